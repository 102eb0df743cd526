"""Peer service request handler: answers one peer's requests on the run directory.

Authenticates each request by token and run, confines its path to the run
directory, and serves files (with ``Range`` and ``ETag``), listings, deletions
and pushes of memory-tier parts. A push is received into a temporary directory
(its slab into a free slab of the memory tier when there is one), its chunks are
checked against the pushed manifest while later ones still arrive, and it is
committed with a rename. The wire format is defined in `_wire`. What a handler
needs to know about the service it answers for (run directory, run, token,
limits) comes in a `ServiceConfig`.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from jaxckpt import _checksum, _format, _fs, _memory_tier, _resources, _slab
from jaxckpt.peer import _wire

logger = logging.getLogger(__name__)

_MAX_PUSH_HEADER_BYTES: Final = 1 << 16
_MAX_MANIFEST_BYTES: Final = 1 << 30  # read into memory whole
_RECV_STEP: Final = 8 << 20  # bytes received between hand-offs of complete chunks to checks
_DRAIN_BYTES: Final = 1 << 20
_PART_PLACE: Final = re.compile(r"step_[0-9]+/part_[0-9]+")
# Checks chunks of received slabs (CRC-32C releases the GIL): shared by all pushes.
_verify_pool: Final = _resources.SHARED.pool(min(4, os.cpu_count() or 1), "jaxckpt-peer-verify")


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
            rel = self._route("POST", "push")
            self._push_length()
            self._push_dest(rel)
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
                    n for n in os.listdir(self._resolve(rel)) if not n.startswith(_wire.TEMP_PREFIX)
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
        sent = (self.headers.get(_wire.TOKEN_HEADER) or "").encode("utf-8", "surrogateescape")
        token = self.config.token
        if self.config.later_token is not None:
            token = self.config.later_token.wait(self.config.io_timeout)
        if not token or not hmac.compare_digest(sent, token):
            raise _HTTPError(403, f"Missing or wrong {_wire.TOKEN_HEADER} header.")
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
            return _wire.clean_relpath(parts[3] if len(parts) > 3 else "", allow_empty=True)
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
        _fs.remove_entry(trash)
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

    def _push_dest(self, rel: str) -> str:
        """The path a push to ``rel`` writes; 400 unless ``rel`` is a part's place."""
        if not _PART_PLACE.fullmatch(rel):
            raise _HTTPError(
                400, f"Push destination {rel!r} is not a part's place (step_<n>/part_<n>)."
            )
        return self._resolve(rel)

    def _push(self, rel: str) -> None:
        total = self._push_length()
        sizes = self._read_push_header(total)
        dest = self._push_dest(rel)
        tmp = self._temp_path("push")
        committed = had_old = False
        try:
            os.mkdir(tmp)
            try:
                manifest = self._receive_manifest(rel, sizes, tmp)
                slab = _slab.Incoming(
                    os.path.join(tmp, _slab.SLAB_FILE), sizes.slab_bytes, self.config.take_free_slab
                )
            except (_HTTPError, OSError) as e:
                if isinstance(e, (ConnectionError, TimeoutError)):
                    raise
                # The pusher sends the whole body before it reads an answer: read
                # the slab's bytes away, so that it gets this refusal, not a reset.
                self._drain(sizes.slab_bytes)
                raise
            with slab:
                check = _SlabCheck(manifest, slab.view, sizes.slab_bytes)
                try:
                    self._receive_file(_slab.SLAB_FILE, sizes.slab_bytes, slab, check, _RECV_STEP)
                finally:
                    # IMPORTANT: no check may still read the mapping when it is closed.
                    check.wait()
            damaged = check.damaged()
            if damaged:
                raise _HTTPError(400, damaged)
            old = self._temp_path("old")
            # IMPORTANT: rename only after every byte arrived and every chunk matched
            # its manifest, and move an existing destination away before renaming over
            # it, so readers see the old part or the new one, never a mix.
            with self.config.commit_lock:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                had_old = os.path.lexists(dest)
                if had_old:
                    os.rename(dest, old)
                os.rename(tmp, dest)
                committed = True
        finally:
            if not committed:
                _fs.remove_entry(tmp)
        body = json.dumps({"bytes": sizes.payload_bytes}).encode()
        self._reply(200, body, "application/json")
        if had_old:
            self.config.retire_part(old)  # After answering: this need not delay the pusher.

    def _receive_manifest(
        self, rel: str, sizes: _wire.PushHeader, tmp: str
    ) -> _format.PartManifest:
        """Receives the pushed part's manifest into ``tmp`` and checks it.

        Raises:
          _HTTPError: 400 unless the manifest is a part manifest of this run whose
            place is ``rel`` and whose chunks all lie inside the announced slab.
        """
        data = _wire.read_exact(self.rfile, sizes.manifest_bytes)
        try:
            manifest = _format.PartManifest.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _HTTPError(
                400, f"The pushed {_format.MANIFEST_FILE} is not a valid part manifest: {e}"
            ) from e
        step_dir = _memory_tier.MemoryTier.step_name(manifest.step)
        place = f"{step_dir}/{_format.part_dir_name(manifest.owner)}"
        if manifest.run_id != self.config.run_id or place != rel:
            raise _HTTPError(
                400,
                f"The pushed part (run {manifest.run_id!r}, step {manifest.step}, owner "
                f"{manifest.owner}) belongs at {place!r} of run {manifest.run_id!r}, not at "
                f"{rel!r} of run {self.config.run_id!r}.",
            )
        for leaf, chunk in _chunks(manifest):
            if chunk.offset is None or chunk.offset < 0 or chunk.nbytes < 0:
                raise _HTTPError(400, f"{_describe(manifest, leaf, chunk)} has no place in a slab.")
            if _end(chunk) > sizes.slab_bytes:
                raise _HTTPError(
                    400,
                    f"{_describe(manifest, leaf, chunk)} lies outside the pushed "
                    f"{sizes.slab_bytes}-byte slab.",
                )
        with open(os.path.join(tmp, _format.MANIFEST_FILE), "xb") as out:
            out.write(data)
        return manifest

    def _receive_file(
        self, name: str, size: int, slab: _slab.Incoming, check: "_SlabCheck", step: int
    ) -> None:
        """Receives the next ``size`` body bytes into ``slab``.

        Each ``step`` bytes, the chunks completed so far go to ``check``, so chunks
        are verified while later ones still arrive.

        Note: tests/mp_worker.py wraps this method (a holder dying mid-receive);
        keep its positional signature.
        """
        done = 0
        while done < size:
            want = min(step, size - done)
            got = slab.receive(self.rfile, done, want)
            if got != want:
                raise ConnectionResetError(
                    f"Client disconnected after {done + got} of {size} bytes of {name!r}."
                )
            done += got
            check.received(done)
        check.received(size)

    def _drain(self, size: int) -> None:
        """Reads and drops the next ``size`` body bytes."""
        buf = memoryview(bytearray(max(1, min(size, _DRAIN_BYTES))))
        while size:
            got = self.rfile.readinto(buf[: min(size, len(buf))]) or 0
            if not got:
                raise ConnectionResetError("Client disconnected during a refused push.")
            size -= got

    def _read_push_header(self, total: int) -> _wire.PushHeader:
        size = _wire.read_u32(self.rfile) if total >= 4 else -1
        if not 0 <= size <= min(_MAX_PUSH_HEADER_BYTES, total - 4):
            raise _HTTPError(400, f"Bad push header length {size} for a {total}-byte body.")
        try:
            header = _wire.decode_push_header(_wire.read_exact(self.rfile, size))
        except ValueError as e:
            raise _HTTPError(400, str(e)) from e
        if _wire.push_body_length(size, header) != total:
            raise _HTTPError(400, "Content-Length does not match the sizes in the push header.")
        if header.manifest_bytes > _MAX_MANIFEST_BYTES:
            raise _HTTPError(
                400, f"A pushed manifest of {header.manifest_bytes} bytes is implausibly large."
            )
        return header


class _SlabCheck:
    """Verifies a pushed slab's chunks against their manifest while the slab arrives.

    Each chunk is checked (its CRC-32C, or a legacy CRC-32) as soon as all of its
    bytes are in, on a shared pool, while later chunks still arrive.
    """

    def __init__(self, manifest: _format.PartManifest, data: memoryview, size: int) -> None:
        self._manifest, self._data, self._size = manifest, data, size
        self._chunks = sorted(_chunks(manifest), key=lambda lc: _end(lc[1]))
        self._next = 0
        self._jobs: list[concurrent.futures.Future[list[tuple[int, _format.ChunkRecord]]]] = []

    def received(self, upto: int) -> None:
        """Queues the checks of the chunks that lie wholly before byte ``upto``."""
        first = self._next
        while self._next < len(self._chunks) and _end(self._chunks[self._next][1]) <= upto:
            self._next += 1
        if self._next > first:
            self._jobs.append(_verify_pool.submit(self._verify, first, self._next))

    def _verify(self, first: int, stop: int) -> list[tuple[int, _format.ChunkRecord]]:
        return [
            (leaf, c)
            for leaf, c in self._chunks[first:stop]
            if not _checksum.matches(c.crc32c, c.crc32, self._data[_end(c) - c.nbytes : _end(c)])
        ]

    def wait(self) -> None:
        """Returns once no queued check runs any more."""
        concurrent.futures.wait(self._jobs)

    def damaged(self) -> str:
        """After `wait`: why the received slab is refused, or "" if every chunk matched."""
        bad = [b for job in self._jobs for b in job.result()]
        if not bad:
            return ""
        first = _describe(self._manifest, *bad[0])
        more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
        return (
            f"{first}{more} does not match the checksum in the pushed manifest: the "
            f"{self._size}-byte slab was damaged in transit or changed while it was sent. "
            "Nothing was kept."
        )


def _chunks(manifest: _format.PartManifest) -> list[tuple[int, _format.ChunkRecord]]:
    """(leaf index, chunk) for every chunk of a part."""
    return [(leaf, c) for leaf, cs in sorted(manifest.chunks.items()) for c in cs]


def _end(chunk: _format.ChunkRecord) -> int:
    """Where a chunk ends in its slab (checked to have an offset before any use)."""
    return (chunk.offset or 0) + chunk.nbytes


def _describe(manifest: _format.PartManifest, leaf: int, chunk: _format.ChunkRecord) -> str:
    path = manifest.leaves[leaf].path if 0 <= leaf < len(manifest.leaves) else f"#{leaf}"
    where = (
        f", bytes [{chunk.offset}, {_end(chunk)}) of the slab" if chunk.offset is not None else ""
    )
    return f"Chunk {list(chunk.index)} of leaf {path!r} (step {manifest.step}{where})"


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
