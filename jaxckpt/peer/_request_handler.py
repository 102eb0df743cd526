"""Peer service request handler: answers one peer's requests on the run directory.

Authenticates each request by token and run, confines its path to the run
directory, and serves files (with ``Range`` and ``ETag``), listings, deletions
and pushes, which it receives into a temporary directory and commits with a
rename. The wire format is defined in `_wire`. What a handler needs to know about
the service it answers for (run directory, run, token, limits) comes in a
`ServiceConfig`.
"""

import concurrent.futures
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
import urllib.parse
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO, Final

from jaxckpt._fs import remove_entry
from jaxckpt.peer._wire import (
    TEMP_PREFIX,
    TOKEN_HEADER,
    clean_relpath,
    decode_push_header,
    push_body_length,
    read_exact,
    read_u32,
)

logger = logging.getLogger(__name__)

_MAX_PUSH_HEADER_BYTES: Final = 64 << 20
_BUFFER_BYTES: Final = 8 << 20


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """What the request handlers of one peer service share.

    Attributes:
      run_dir: Real path of the run directory served and written.
      run_id: The run served; requests naming another run are refused.
      token: The run's shared secret, encoded; every request must carry it.
      max_push_bytes: Largest push body accepted; bigger ones get HTTP 413.
      io_timeout: Seconds any one recv/send on a connection may block.
      temp_name: Returns a fresh name (starting with `TEMP_PREFIX`) for a
        temporary entry in the run directory, given its purpose.
      commit_lock: Serialises the renames that commit pushes and deletions.
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


class _HTTPError(Exception):
    """A refusal to answer with ``status`` and a JSON ``{"error": message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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
            self._route("POST", "push")
            self._push_length()
        except _HTTPError as e:
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
            rel = self._route(self.command, kind)
            if kind == "files" and self.command in ("GET", "HEAD"):
                self._send_file(rel)
            elif kind == "list" and self.command == "GET":
                names = sorted(
                    n for n in os.listdir(self._resolve(rel)) if not n.startswith(TEMP_PREFIX)
                )
                self._reply(200, json.dumps({"names": names}).encode(), "application/json")
            elif kind == "files" and self.command == "DELETE":
                self._delete(rel)
            elif kind == "push" and self.command == "POST":
                self._push(rel)
            else:
                raise _HTTPError(405, f"{self.command} is not supported on {kind!r} paths.")
        except _HTTPError as e:
            self._reply_error(e)
        except (FileNotFoundError, NotADirectoryError) as e:
            self._reply_error(_HTTPError(404, f"{e.strerror}: {self._relpath_for_log()!r}."))
        except OSError as e:
            if isinstance(e, (ConnectionError, TimeoutError)):
                raise  # The client is gone; there is no one to answer.
            status = 507 if e.errno == errno.ENOSPC else 500
            self._reply_error(
                _HTTPError(status, f"{e.strerror or e}: {self._relpath_for_log()!r}.")
            )

    def _relpath_for_log(self) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)

    def _route(self, method: str, kind: str) -> str:
        """Authenticates the request and returns its cleaned relative path."""
        sent = (self.headers.get(TOKEN_HEADER) or "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, self.config.token):
            raise _HTTPError(403, f"Missing or wrong {TOKEN_HEADER} header.")
        try:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path, errors="strict")
        except UnicodeDecodeError as e:
            raise _HTTPError(400, "The request path is not valid percent-encoded UTF-8.") from e
        parts = path.split("/", 3)  # ["", kind, run_id, relpath]
        if len(parts) < 3 or parts[1] != kind:
            raise _HTTPError(404, f"Unknown path {path!r}; expected /{kind}/<run_id>/<path>.")
        if parts[2] != self.config.run_id:
            raise _HTTPError(
                409, f"This peer serves run {self.config.run_id!r}, not run {parts[2]!r}."
            )
        try:
            return clean_relpath(parts[3] if len(parts) > 3 else "", allow_empty=True)
        except ValueError as e:
            raise _HTTPError(400, str(e)) from e

    def _resolve(self, rel: str) -> str:
        """Joins ``rel`` to the run directory; 400 if symlinks lead outside it."""
        run_dir = self.config.run_dir
        path = os.path.join(run_dir, rel) if rel else run_dir
        real = os.path.realpath(path)
        if real != run_dir and not real.startswith(run_dir + os.sep):
            raise _HTTPError(400, f"Path {rel!r} resolves outside the run directory.")
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

    def _reply_error(self, error: _HTTPError) -> None:
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
                raise _HTTPError(412, f"{rel!r} changed (ETag is {etag}).")
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
            raise _HTTPError(400, "Refusing to delete the whole run directory.")
        path = self._resolve(rel)
        trash = self._temp_path("delete")
        with self.config.commit_lock:
            os.rename(path, trash)  # FileNotFoundError -> 404
        remove_entry(trash)
        self._reply(204, b"", "application/json")

    def _push_length(self) -> int:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _HTTPError(411, "A push needs a Content-Length header.")
        if int(length) > self.config.max_push_bytes:
            raise _HTTPError(
                413,
                f"Push of {length} bytes exceeds this peer's limit of "
                f"{self.config.max_push_bytes} bytes (PeerServer max_push_bytes).",
            )
        return int(length)

    def _push(self, rel: str) -> None:
        if not rel or rel.startswith(TEMP_PREFIX):
            raise _HTTPError(400, f"Push destination {rel!r} must name a non-temporary path.")
        dest = self._resolve(rel)
        total = self._push_length()
        files = self._read_push_header(total)
        tmp = self._temp_path("push")
        committed = False
        try:
            os.mkdir(tmp)
            largest = max([1] + [size for _, size in files])
            bufs = [memoryview(bytearray(min(_BUFFER_BYTES, largest))) for _ in range(2)]
            with concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-peer-write") as writer:
                for name, size in files:
                    target = os.path.join(tmp, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "xb") as out:
                        crc = self._receive_file(name, size, out, bufs, writer)
                    if read_u32(self.rfile) != crc:
                        raise _HTTPError(
                            400, f"CRC-32 mismatch for {name!r}: corrupted in transit."
                        )
            old = self._temp_path("old")
            # IMPORTANT: rename only after every byte arrived and matched, and
            # move an existing destination away before renaming over it, so
            # readers see the old directory or the new one, never a mix.
            with self.config.commit_lock:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                had_old = os.path.lexists(dest)
                if had_old:
                    os.rename(dest, old)
                os.rename(tmp, dest)
                committed = True
        finally:
            if not committed:
                remove_entry(tmp)
        body = json.dumps({"bytes": sum(s for _, s in files)}).encode()
        self._reply(200, body, "application/json")
        if had_old:
            remove_entry(old)  # After answering: freeing pages need not delay the pusher.

    def _receive_file(
        self,
        name: str,
        size: int,
        out: BinaryIO,
        bufs: list[memoryview],
        writer: concurrent.futures.Executor,
    ) -> int:
        """Copies ``size`` body bytes into ``out``; returns their CRC-32.

        Double-buffered: while the socket fills one buffer, the writer thread
        checksums and writes the other (both release the GIL), so receiving
        overlaps with checksumming and writing.
        """
        crc, pending, turn = 0, None, 0
        try:
            while size:
                chunk = bufs[turn][: min(size, len(bufs[turn]))]
                got = self.rfile.readinto(chunk)
                if not got:
                    raise ConnectionResetError(f"Client disconnected during {name!r}.")
                if pending is not None:
                    crc = pending.result()
                pending = writer.submit(_checksum_and_write, out, chunk[:got], crc)
                size, turn = size - got, 1 - turn
        finally:
            # IMPORTANT: never return (or close `out`) while a write is in flight.
            if pending is not None:
                crc = pending.result()
        return crc

    def _read_push_header(self, total: int) -> list[tuple[str, int]]:
        size = read_u32(self.rfile) if total >= 4 else -1
        if not 0 <= size <= min(_MAX_PUSH_HEADER_BYTES, total - 4):
            raise _HTTPError(400, f"Bad push header length {size} for a {total}-byte body.")
        try:
            files = decode_push_header(read_exact(self.rfile, size))
        except ValueError as e:
            raise _HTTPError(400, str(e)) from e
        if push_body_length(size, files) != total:
            raise _HTTPError(400, "Content-Length does not match the sizes in the push header.")
        return files


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """Parses a single ``bytes=`` range into (start, length); None means whole file."""
    unsatisfiable = _HTTPError(416, f"Range {value!r} lies outside the {size}-byte file.")
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


def _checksum_and_write(out: BinaryIO, data: memoryview, crc: int) -> int:
    out.write(data)
    return zlib.crc32(data, crc)
