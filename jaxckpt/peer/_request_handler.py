"""Peer service request handler: answers one peer's requests on the run directory.

Authenticates each request by token and run, confines its path to the run
directory, and serves files (with ``Range`` and ``ETag``), listings, deletions,
pushes of memory-tier parts (received by `_push_receiver`), checks of a held
part (``POST /check/...``: a peer read bad bytes from it; it is checked here and
quarantined if damaged), and the service's relay store (``/relay/...``: a relay
group's members reach their leader's `_kv.RelayStore` here). The wire format is
defined in `_wire`. What a handler needs to know about the service it answers
for (run directory, run, token, limits, relay store) comes in a `ServiceConfig`.
"""

import dataclasses
import errno
import hmac
import http.server
import json
import logging
import os
import re
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from jaxckpt.coord import _kv, _multihost
from jaxckpt.memory import _fs, _quarantine
from jaxckpt.peer import _push_receiver, _wire

logger = logging.getLogger(__name__)


def no_free_slab(dest: Path, nbytes: int) -> bool:
    """A `ServiceConfig.take_free_slab` for a service without a memory tier to reuse."""
    return False


class LaterToken:
    """A run's token that a service learns after it started serving (the set-up tells
    it once every process's address is exchanged): a request waits for it."""

    def __init__(self) -> None:
        self._value = b""
        self._known = threading.Event()

    def set(self, token: bytes) -> None:
        self._value = token
        self._known.set()

    def wait(self, timeout: float) -> bytes:
        """The token, or b"" (which no request matches) if it is not known in time."""
        self._known.wait(timeout)
        return self._value


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """What the request handlers of one peer service share.

    Attributes:
      run_dir: Real path of the run directory served and written.
      run_id: The run served; requests naming another run are refused.
      token: The run's shared secret, encoded; every request must carry it.
      later_token: Where the secret arrives instead, once known (`LaterToken`):
        until then requests wait for it (for at most `io_timeout`).
      max_push_bytes: Largest push body accepted; bigger ones get HTTP 413.
      io_timeout: Seconds any one recv/send on a connection may block.
      temp_name: Returns a fresh name (starting with `TEMP_PREFIX`) for a
        temporary entry in the run directory, given its purpose.
      commit_lock: Serialises the renames that commit pushes and deletions.
      take_free_slab: ``(dest, nbytes)``: moves a free (retired, already
        allocated) slab of the memory tier to ``dest`` and returns True, or
        returns False if there is none; a pushed slab of ``nbytes`` is received
        into it.
      retire_part: ``(part_dir)``: disposes of a part a push replaced (moved
        out of its place already): gives its slab to the memory tier's free
        slabs (`MemoryTier.recycle`) when it takes it, then removes the rest.
      relay_store: The store served under ``/relay/`` (the process's own, when it
        leads a relay group).
      closing: Set when the service closes: a relay get that waits gives up.
    """

    run_dir: str
    run_id: str
    token: bytes = dataclasses.field(repr=False)
    max_push_bytes: int
    io_timeout: float
    temp_name: Callable[[str], str]
    commit_lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, compare=False, repr=False
    )
    take_free_slab: Callable[[Path, int], bool] = no_free_slab
    retire_part: Callable[[str], None] = _fs.remove_entry
    later_token: LaterToken | None = dataclasses.field(default=None, compare=False, repr=False)
    relay_store: _kv.RelayStore = dataclasses.field(
        default_factory=_kv.RelayStore, compare=False, repr=False
    )
    closing: threading.Event = dataclasses.field(
        default_factory=threading.Event, compare=False, repr=False
    )


class PeerRequestHandler(http.server.BaseHTTPRequestHandler):
    """Answers the requests of one connection to a peer service.

    A server makes one per connection, binding the service's `ServiceConfig`
    first: ``functools.partial(PeerRequestHandler, config=config)``.
    """

    protocol_version = "HTTP/1.1"
    server_version = "jaxckpt-peer/1"
    disable_nagle_algorithm = True

    def __init__(
        self,
        request: Any,
        client_address: Any,
        server: socketserver.BaseServer,
        *,
        config: ServiceConfig,
    ) -> None:
        """Answers the requests of one connection (the base class does so here).

        Args:
          request: The connection's socket.
          client_address: The peer's address.
          server: The server that accepted the connection.
          config: The service this connection talks to.
        """
        self.config = config  # Before the base class starts answering.
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        # A stalled client cannot pin this thread: every recv/send times out.
        self.connection.settimeout(self.config.io_timeout)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("peer service %s: %s", self.address_string(), format % args)

    def handle_expect_100(self) -> bool:
        try:
            rel = self._route("POST", "push")
            receiver = self._receiver()
            receiver.length(self.headers.get("Content-Length"))
            receiver.destination(rel)
        except _wire.Refusal as e:
            self._reply_error(e)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            kind = [*urllib.parse.urlsplit(self.path).path.split("/", 2), ""][1]
            if kind == "relay":
                self._relay(self._relay_key())
                return
            rel = self._route(self.command, kind)
            if kind == "files" and self.command in ("GET", "HEAD"):
                self._send_file(rel)
            elif kind == "list" and self.command == "GET":
                names = sorted(
                    n for n in os.listdir(self._resolve(rel)) if not n.startswith(_wire.TEMP_PREFIX)
                )
                self._reply(200, json.dumps({"names": names}).encode(), "application/json")
            elif kind == "files" and self.command == "DELETE":
                self._delete(rel)
            elif kind == "push" and self.command == "POST":
                self._push(rel)
            elif kind == "check" and self.command == "POST":
                self._check(rel)
            else:
                raise _wire.Refusal(405, f"{self.command} is not supported on {kind!r} paths.")
        except _wire.Refusal as e:
            self._reply_error(e)
        except (FileNotFoundError, NotADirectoryError) as e:
            self._reply_error(_wire.Refusal(404, f"{e.strerror}: {self._relpath_for_log()!r}."))
        except OSError as e:
            if isinstance(e, (ConnectionError, TimeoutError)):
                raise  # The client is gone; there is no one to answer.
            status = 507 if e.errno == errno.ENOSPC else 500
            self._reply_error(
                _wire.Refusal(status, f"{e.strerror or e}: {self._relpath_for_log()!r}.")
            )

    def _check(self, rel: str) -> None:
        """Checks the part at ``rel`` against its manifest's checksums, quarantining it
        if damaged (a peer read bad bytes from it); answers what is wrong, or null."""
        if not _push_receiver.PART_PLACE.fullmatch(rel):
            raise _wire.Refusal(400, f"Check of {rel!r}: not a part's place (step_<n>/part_<n>).")
        part_dir = Path(self._resolve(rel))
        if not part_dir.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such part", rel)
        damage = _quarantine.check_and_quarantine(part_dir, _multihost.process_index())
        self._reply(200, json.dumps({"damage": damage}).encode(), "application/json")

    def _receiver(self) -> _push_receiver.PushReceiver:
        return _push_receiver.PushReceiver(self.config, self.rfile, self._resolve, self._temp_path)

    def _push(self, rel: str) -> None:
        receiver = self._receiver()
        payload, replaced = receiver.receive(
            rel, receiver.length(self.headers.get("Content-Length"))
        )
        self._reply(200, json.dumps({"bytes": payload}).encode(), "application/json")
        if replaced is not None:
            self.config.retire_part(replaced)  # After answering: this need not delay the pusher.

    def _relpath_for_log(self) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)

    def _route(self, method: str, kind: str) -> str:
        """Authenticates the request and returns its cleaned relative path."""
        try:
            return _wire.clean_relpath(self._authenticated_rest(kind), allow_empty=True)
        except ValueError as e:
            raise _wire.Refusal(400, str(e)) from e

    def _relay_key(self) -> str:
        """Authenticates a relay request and returns its key (`_wire.check_relay_key`)."""
        key = self._authenticated_rest("relay")
        try:
            _wire.check_relay_key(key)
        except ValueError as e:
            raise _wire.Refusal(400, str(e)) from e
        return key

    def _authenticated_rest(self, kind: str) -> str:
        """Authenticates the request (token, then run) and returns its decoded path
        after ``/<kind>/<run_id>/``."""
        sent = (self.headers.get(_wire.TOKEN_HEADER) or "").encode("utf-8", "surrogateescape")
        token = self.config.token
        if self.config.later_token is not None:
            token = self.config.later_token.wait(self.config.io_timeout)
        if not token or not hmac.compare_digest(sent, token):
            raise _wire.Refusal(403, f"Missing or wrong {_wire.TOKEN_HEADER} header.")
        try:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path, errors="strict")
        except UnicodeDecodeError as e:
            raise _wire.Refusal(400, "The request path is not valid percent-encoded UTF-8.") from e
        parts = path.split("/", 3)  # ["", kind, run_id, relpath]
        if len(parts) < 3 or parts[1] != kind:
            raise _wire.Refusal(404, f"Unknown path {path!r}; expected /{kind}/<run_id>/<path>.")
        if parts[2] != self.config.run_id:
            raise _wire.Refusal(
                409, f"This peer serves run {self.config.run_id!r}, not run {parts[2]!r}."
            )
        return parts[3] if len(parts) > 3 else ""

    def _relay(self, key: str) -> None:
        """Answers a request on the relay store (see `_wire`)."""
        store = self.config.relay_store
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if self.command == "POST":
            value = self._relay_value()
            try:
                store.key_value_set(key, value, allow_overwrite=query.get("overwrite") == ["1"])
            except RuntimeError as e:
                raise _wire.Refusal(409, str(e)) from e
            self._reply(204, b"", "application/json")
        elif self.command == "GET" and query.get("dir") == ["1"]:
            items = [list(item) for item in store.key_value_dir_get(key)]
            self._reply(200, json.dumps({"items": items}).encode(), "application/json")
        elif self.command == "GET":
            value = self._relay_wait(key, _query_int(query, "wait_ms"))
            self._reply(200, value.encode(), "text/plain; charset=utf-8")
        elif self.command == "DELETE":
            store.key_value_delete(key)
            self._reply(204, b"", "application/json")
        else:
            raise _wire.Refusal(405, f"{self.command} is not supported on 'relay' paths.")

    def _relay_value(self) -> str:
        """Reads a relay set's body: at most `RELAY_MAX_VALUE_BYTES` of UTF-8."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError as e:
            raise _wire.Refusal(411, "A relay set needs a Content-Length.") from e
        if not 0 <= length <= _wire.RELAY_MAX_VALUE_BYTES:
            raise _wire.Refusal(
                413,
                f"A relay value must be 0 to {_wire.RELAY_MAX_VALUE_BYTES} bytes, got {length}.",
            )
        try:
            return _wire.read_exact(self.rfile, length).decode()
        except UnicodeDecodeError as e:
            raise _wire.Refusal(400, "A relay value must be UTF-8.") from e

    def _relay_wait(self, key: str, wait_ms: int) -> str:
        """The relay store's value of ``key`` once there, waiting ``wait_ms`` (at most
        the I/O timeout) in slices, so that the service closing ends the wait."""
        store = self.config.relay_store
        deadline = time.monotonic() + min(wait_ms / 1000, self.config.io_timeout)
        while True:
            left = deadline - time.monotonic()
            try:
                return store.blocking_key_value_get(key, int(max(0.0, min(left, _SLICE_S)) * 1000))
            except RuntimeError as e:
                if self.config.closing.is_set():
                    raise _wire.Refusal(503, "This peer service is closing.") from e
                if left <= _SLICE_S:
                    raise _wire.Refusal(504, str(e)) from e

    def _resolve(self, rel: str) -> str:
        """Joins ``rel`` to the run directory; 400 if symlinks lead outside it."""
        run_dir = self.config.run_dir
        path = os.path.join(run_dir, rel) if rel else run_dir
        real = os.path.realpath(path)
        if real != run_dir and not real.startswith(run_dir + os.sep):
            raise _wire.Refusal(400, f"Path {rel!r} resolves outside the run directory.")
        return path

    def _temp_path(self, purpose: str) -> str:
        """Returns a fresh temporary path in the run directory (hidden from listings)."""
        return os.path.join(self.config.run_dir, self.config.temp_name(purpose))

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _reply_error(self, error: _wire.Refusal) -> None:
        logger.debug("peer service: %s %s -> %d %s", self.command, self.path, error.status, error)
        # An unread request body would be parsed as the next request.
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True
        body = json.dumps({"error": error.message}).encode()
        self._reply(error.status, body, "application/json")

    def _send_file(self, rel: str) -> None:
        with open(self._resolve(rel), "rb") as f:
            st = os.fstat(f.fileno())
            etag = f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
            if_match = self.headers.get("If-Match")
            if if_match is not None and if_match.strip() not in ("*", etag):
                raise _wire.Refusal(412, f"{rel!r} changed (ETag is {etag}).")
            if self.headers.get("If-None-Match", "").strip() in ("*", etag):
                self.send_response(304)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, length = 0, st.st_size
            span = _parse_range(self.headers.get("Range"), st.st_size)
            self.send_response(206 if span else 200)
            if span:
                start, length = span
                end = start + length - 1
                self.send_header("Content-Range", f"bytes {start}-{end}/{st.st_size}")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if self.command == "GET" and length:
                # Zero-copy from the tmpfs page cache to the socket.
                self.connection.sendfile(f, start, length)

    def _delete(self, rel: str) -> None:
        if not rel:
            raise _wire.Refusal(400, "Refusing to delete the whole run directory.")
        path = self._resolve(rel)
        trash = self._temp_path("delete")
        with self.config.commit_lock:
            os.rename(path, trash)  # FileNotFoundError -> 404
        _fs.remove_entry(trash)
        self._reply(204, b"", "application/json")


_SLICE_S: Final = 0.25  # a relay get's wait between looks at whether the service closes


def _query_int(query: dict[str, list[str]], name: str) -> int:
    """The non-negative int of query parameter ``name`` (0 if absent); 400 if malformed."""
    values = query.get(name, ["0"])
    if len(values) != 1 or not (values[0].isascii() and values[0].isdigit()) or len(values[0]) > 12:
        raise _wire.Refusal(400, f"Query parameter {name} must be one non-negative int.")
    return int(values[0])


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """Parses a single ``bytes=`` range into (start, length); None means whole file."""
    unsatisfiable = _wire.Refusal(416, f"Range {value!r} lies outside the {size}-byte file.")
    match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", value or "")
    if not match or match.groups() == ("", ""):
        return None  # Absent, multi-range or malformed: RFC 9110 allows ignoring it.
    first, last = match.groups()
    if first:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
        if last and int(last) < start:
            return None
    else:
        start, end = max(size - int(last), 0), size - 1
        if int(last) == 0:
            raise unsatisfiable
    if start >= size:
        raise unsatisfiable
    return start, end - start + 1
