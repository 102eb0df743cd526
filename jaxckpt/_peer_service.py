"""Peer data service: serves a process's memory tier to other processes over HTTP.

Each process runs one `PeerServer` (a daemon thread in the training process)
that serves ``root/run_id/`` to peers. Peers read files with plain HTTP GET
(with ``Range``), so tensorstore's ``http`` kvstore driver can open the zarr3
arrays there directly (`http_kvstore_spec`), and push whole directories in one
request that the server commits atomically (`push_directory`).

Wire format, version 1 (a compatibility promise between processes of a run):

* Every request carries the run's secret in the ``X-Jaxckpt-Token`` header and
  names the run in its path: ``/files/<run>/<relpath>`` (GET, HEAD, DELETE),
  ``/list/<run>/<relpath>`` (GET: ``{"names": [...]}``), ``/push/<run>/<dest>``.
* A push is one ``POST`` with ``Expect: 100-continue`` and a Content-Length,
  so the server can refuse it before any byte of the body moves. The body is a
  4-byte big-endian header length, a JSON header
  ``{"version": 1, "files": [{"path": "a/b", "size": 123}, ...]}``, then for
  each file in order its raw bytes followed by their 4-byte big-endian CRC-32.
* Errors are JSON ``{"error": "<sentence>"}`` with the HTTP status.
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import hmac
import http.client
import http.server
import json
import logging
import os
import re
import shutil
import socket
import socketserver
import stat
import threading
import urllib.parse
import uuid
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO, Final

logger = logging.getLogger(__name__)

TOKEN_HEADER: Final = "X-Jaxckpt-Token"
# Names under root/run_id that start with this are in-flight pushes or
# deletions; they are never listed and are removed when their process is gone.
TEMP_PREFIX: Final = ".jaxckpt-peer-tmp-"
_PUSH_VERSION: Final = 1
_MAX_PUSH_HEADER_BYTES: Final = 64 << 20
_BUFFER_BYTES: Final = 8 << 20
_RUN_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_STATUS_ERRNO: Final = {400: errno.EINVAL, 409: errno.ESTALE, 413: errno.EFBIG, 507: errno.ENOSPC}


@dataclasses.dataclass(frozen=True)
class PeerAddress:
    """Where a process's peer service listens.

    Attributes:
      host: Host name or IP address that other processes can connect to.
      port: TCP port.
    """

    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"PeerAddress.host must be a non-empty str, got {self.host!r}.")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ValueError(f"PeerAddress.port must be an int, got {self.port!r}.")
        if not 0 < self.port < 65536:
            raise ValueError(f"PeerAddress.port must be in [1, 65535], got {self.port}.")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-compatible dict (see `from_dict`)."""
        return {"host": self.host, "port": self.port}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PeerAddress":
        """Builds an address from the output of `to_dict`."""
        return cls(host=data["host"], port=data["port"])


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run_id must be 1-255 characters from [A-Za-z0-9._-] starting with a letter or "
            f"digit, got {run_id!r}."
        )


def _check_token(token: str) -> None:
    # A header value may not hold CR/LF; never echo the token in the message.
    if not isinstance(token, str) or not token.isascii() or not token.isprintable():
        raise ValueError("token must be a non-empty string of printable ASCII characters.")
    if not token or token != token.strip():
        raise ValueError("token must be non-empty, without leading or trailing spaces.")


def _clean_relpath(relpath: str, *, allow_empty: bool) -> str:
    """Returns ``relpath`` normalised to ``a/b/c``; ValueError if it could escape."""
    if not isinstance(relpath, str) or "\x00" in relpath or relpath.startswith("/"):
        raise ValueError(f"Path {relpath!r} must be a relative str without NUL characters.")
    parts = relpath.removesuffix("/").split("/") if relpath else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"Path {relpath!r} must not contain empty, '.' or '..' components.")
    if not parts and not allow_empty:
        raise ValueError("Path must not be empty here.")
    return "/".join(parts)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "jaxckpt-peer/1"
    disable_nagle_algorithm = True
    server: "_HTTPServer"

    def setup(self) -> None:
        super().setup()
        # A stalled client cannot pin this thread: every recv/send times out.
        self.connection.settimeout(self.server.io_timeout)

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
        if not hmac.compare_digest(sent, self.server.token):
            raise _HTTPError(403, f"Missing or wrong {TOKEN_HEADER} header.")
        try:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path, errors="strict")
        except UnicodeDecodeError as e:
            raise _HTTPError(400, "The request path is not valid percent-encoded UTF-8.") from e
        parts = path.split("/", 3)  # ["", kind, run_id, relpath]
        if len(parts) < 3 or parts[1] != kind:
            raise _HTTPError(404, f"Unknown path {path!r}; expected /{kind}/<run_id>/<path>.")
        if parts[2] != self.server.run_id:
            raise _HTTPError(
                409, f"This peer serves run {self.server.run_id!r}, not run {parts[2]!r}."
            )
        try:
            return _clean_relpath(parts[3] if len(parts) > 3 else "", allow_empty=True)
        except ValueError as e:
            raise _HTTPError(400, str(e)) from e

    def _resolve(self, rel: str) -> str:
        """Joins ``rel`` to the run directory; 400 if symlinks lead outside it."""
        run_dir = self.server.run_dir
        path = os.path.join(run_dir, rel) if rel else run_dir
        real = os.path.realpath(path)
        if real != run_dir and not real.startswith(run_dir + os.sep):
            raise _HTTPError(400, f"Path {rel!r} resolves outside the run directory.")
        return path

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
        trash = os.path.join(self.server.run_dir, self.server.temp_name("delete"))
        with self.server.commit_lock:
            os.rename(path, trash)  # FileNotFoundError -> 404
        _remove(trash)
        self._reply(204, b"", "application/json")

    def _push_length(self) -> int:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _HTTPError(411, "A push needs a Content-Length header.")
        if int(length) > self.server.max_push_bytes:
            raise _HTTPError(
                413,
                f"Push of {length} bytes exceeds this peer's limit of "
                f"{self.server.max_push_bytes} bytes (PeerServer max_push_bytes).",
            )
        return int(length)

    def _push(self, rel: str) -> None:
        if not rel or rel.startswith(TEMP_PREFIX):
            raise _HTTPError(400, f"Push destination {rel!r} must name a non-temporary path.")
        dest = self._resolve(rel)
        total = self._push_length()
        files = self._read_push_header(total)
        tmp = os.path.join(self.server.run_dir, self.server.temp_name("push"))
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
                    if int.from_bytes(_read_exact(self.rfile, 4), "big") != crc:
                        raise _HTTPError(
                            400, f"CRC-32 mismatch for {name!r}: corrupted in transit."
                        )
            old = os.path.join(self.server.run_dir, self.server.temp_name("old"))
            # IMPORTANT: rename only after every byte arrived and matched, and
            # move an existing destination away before renaming over it, so
            # readers see the old directory or the new one, never a mix.
            with self.server.commit_lock:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                had_old = os.path.lexists(dest)
                if had_old:
                    os.rename(dest, old)
                os.rename(tmp, dest)
                committed = True
        finally:
            if not committed:
                _remove(tmp)
        body = json.dumps({"bytes": sum(s for _, s in files)}).encode()
        self._reply(200, body, "application/json")
        if had_old:
            _remove(old)  # After answering: freeing pages need not delay the pusher.

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
        size = int.from_bytes(_read_exact(self.rfile, 4), "big") if total >= 4 else -1
        if not 0 <= size <= min(_MAX_PUSH_HEADER_BYTES, total - 4):
            raise _HTTPError(400, f"Bad push header length {size} for a {total}-byte body.")
        try:
            header = json.loads(_read_exact(self.rfile, size))
            if header["version"] != _PUSH_VERSION:
                raise _HTTPError(400, f"Push format version {header['version']!r} unsupported.")
            files = [
                (_clean_relpath(f["path"], allow_empty=False), f["size"]) for f in header["files"]
            ]
        except (ValueError, KeyError, TypeError) as e:
            raise _HTTPError(400, f"Malformed push header: {e}") from e
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for _, s in files):
            raise _HTTPError(400, "Push header sizes must be non-negative ints.")
        if len({name for name, _ in files}) != len(files):
            raise _HTTPError(400, "Push header lists a file twice.")
        if 4 + size + sum(s + 4 for _, s in files) != total:
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


def _read_exact(stream: Any, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ConnectionResetError(f"Connection closed after {len(data)} of {size} bytes.")
    return bytes(data)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        *,
        run_dir: str,
        run_id: str,
        token: str,
        max_push_bytes: int,
        io_timeout: float,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.run_dir, self.run_id, self.token = run_dir, run_id, token.encode()
        self.max_push_bytes, self.io_timeout = max_push_bytes, io_timeout
        self.commit_lock = threading.Lock()
        self._live_lock = threading.Lock()
        self._live: dict[threading.Thread, socket.socket] = {}
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls getfqdn(), which can block on DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def temp_name(self, purpose: str) -> str:
        return f"{TEMP_PREFIX}{os.getpid()}-{purpose}-{uuid.uuid4().hex}"

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_one,
            args=(request, client_address),
            daemon=True,
            name=f"jaxckpt-peer-{client_address}",
        )
        with self._live_lock:
            self._live[thread] = request
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("peer service: request from %s failed", client_address, exc_info=True)

    def abort_requests(self, timeout: float) -> None:
        """Shuts every open connection and joins the handler threads."""
        with self._live_lock:
            live = list(self._live.items())
        for _, sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread, _ in live:
            thread.join(timeout)


class PeerServer:
    """Serves ``root/run_id/`` to the other processes of a run.

    The server binds on construction (so `address` is known at once) and
    serves from a daemon thread after `start`; each connection gets its own
    daemon thread whose socket operations time out after ``io_timeout``.
    Usable as a context manager (start on enter, close on exit).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        run_id: str,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_push_bytes: int = 1 << 40,
        io_timeout: float = 60.0,
    ) -> None:
        """Binds the listening socket.

        Args:
          root: Memory-tier root; the server serves and writes ``root/run_id/``.
          run_id: Identifies the run; requests naming another run are refused.
          token: Shared secret every request must carry.
          host: Interface to listen on; a wildcard (``0.0.0.0``, ``::``) is
            advertised under this machine's hostname.
          port: TCP port; 0 picks a free one.
          max_push_bytes: Largest push body accepted; bigger ones get HTTP 413.
          io_timeout: Seconds any one recv/send on a connection may block.

        Raises:
          ValueError: If an argument is invalid.
          OSError: If the socket cannot be bound.
        """
        _check_run_id(run_id)
        _check_token(token)
        if isinstance(max_push_bytes, bool) or not isinstance(max_push_bytes, int):
            raise ValueError(f"max_push_bytes must be an int, got {max_push_bytes!r}.")
        if max_push_bytes <= 0 or not io_timeout > 0:
            raise ValueError(
                f"max_push_bytes and io_timeout must be positive, got {max_push_bytes!r} "
                f"and {io_timeout!r}."
            )
        run_dir = os.path.realpath(os.path.join(os.fspath(root), run_id))
        os.makedirs(run_dir, exist_ok=True)
        self._httpd = _HTTPServer(
            (host, port),
            run_dir=run_dir,
            run_id=run_id,
            token=token,
            max_push_bytes=max_push_bytes,
            io_timeout=io_timeout,
        )
        advertised = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self._address = PeerAddress(advertised, self._httpd.server_address[1])
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> PeerAddress:
        """Where peers reach this server."""
        return self._address

    def start(self) -> None:
        """Starts serving; idempotent.

        First removes temporary entries (`TEMP_PREFIX`) left in the run
        directory by processes of this host that no longer run (judged by the
        pid in their name), such as a push cut short by a crash.

        Raises:
          RuntimeError: If the server was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"PeerServer at {self._address} is closed; make a new one.")
            if self._thread is not None:
                return
            _remove_stale_temps(self._httpd.run_dir)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.1},
                daemon=True,
                name=f"jaxckpt-peer-server-{self._address.port}",
            )
            self._thread.start()

    def close(self) -> None:
        """Stops serving, aborts open connections, joins threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._httpd.shutdown()
            thread.join()
        self._httpd.server_close()
        self._httpd.abort_requests(timeout=self._httpd.io_timeout)

    def __enter__(self) -> "PeerServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _remove_stale_temps(run_dir: str) -> None:
    for name in os.listdir(run_dir):
        if not name.startswith(TEMP_PREFIX):
            continue
        pid = name.removeprefix(TEMP_PREFIX).split("-", 1)[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove(os.path.join(run_dir, name))
        except (ValueError, PermissionError):
            pass  # Not ours to judge, or the process is alive under another user.


def http_kvstore_spec(address: PeerAddress, token: str, run_id: str) -> dict[str, Any]:
    """Returns a tensorstore ``http`` kvstore spec rooted at a peer's run directory.

    Add ``"path": "<relative/path/>"`` to address a zarr3 array below it.

    The spec holds the token, and tensorstore quotes the whole spec in its
    error messages: pass those through `redact_token` before raising or
    logging them.
    """
    _check_run_id(run_id)
    _check_token(token)
    return {
        "driver": "http",
        "base_url": f"http://{address}/files/{urllib.parse.quote(run_id)}/",
        "headers": [f"{TOKEN_HEADER}: {token}"],
    }


def redact_token(text: str, token: str) -> str:
    """Returns ``text`` with every occurrence of ``token`` replaced by ``<redacted>``."""
    return text.replace(token, "<redacted>") if token else text


@contextlib.contextmanager
def _transport_errors(address: PeerAddress, action: str, timeout: float) -> Iterator[None]:
    """Re-raises network failures as built-in errors naming the peer and path."""
    where = f"{action} on peer {address}"
    try:
        yield
    except TimeoutError as e:
        raise TimeoutError(f"{where} got no answer within {timeout} s.") from e
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as e:
        base = next(t for t in type(e).__mro__ if t.__module__ == "builtins")
        raise base(f"{where} failed: {e}.") from e
    except (ConnectionError, http.client.HTTPException) as e:
        raise ConnectionError(f"{where} failed: {e!r}.") from e
    except _ConnectFailed as e:
        raise OSError(e.error.errno, f"{where} could not connect: {e.error}.") from e.error


class _ConnectFailed(Exception):
    def __init__(self, error: OSError) -> None:
        self.error = error


def _connect(address: PeerAddress, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((address.host, address.port), timeout=timeout)
    except (TimeoutError, ConnectionError):
        raise
    except OSError as e:  # Unreachable network, unknown host, ...
        raise _ConnectFailed(e) from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _raise_for_status(address: PeerAddress, action: str, status: int, body: bytes) -> None:
    if 200 <= status < 300:
        return
    try:
        reason = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        reason = body[:200].decode("utf-8", "replace")
    message = f"{action} on peer {address} failed with HTTP {status}: {reason}"
    if status == 403:
        raise PermissionError(errno.EACCES, message)
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, message)
    raise OSError(_STATUS_ERRNO.get(status, errno.EIO), message)


def _read_response(reader: Any) -> tuple[int, bytes]:
    line = reader.readline(65537)
    if not line:
        raise ConnectionResetError("the peer closed the connection without answering")
    try:
        status = int(line.split(None, 2)[1])
    except (IndexError, ValueError) as e:
        raise http.client.BadStatusLine(repr(line)) from e
    headers = http.client.parse_headers(reader)
    length = int(headers.get("Content-Length", "0"))
    return status, _read_exact(reader, length) if status >= 200 else b""


def _request(
    address: PeerAddress,
    token: str,
    run_id: str,
    method: str,
    kind: str,
    relpath: str,
    timeout: float,
) -> bytes:
    _check_run_id(run_id)
    _check_token(token)
    rel = _clean_relpath(relpath, allow_empty=kind == "list")
    action = f"{method} {relpath!r} of run {run_id!r}"
    url = f"/{kind}/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    with _transport_errors(address, action, timeout):
        sock = _connect(address, timeout)
        with sock, sock.makefile("rb") as reader:
            head = f"{method} {url} HTTP/1.1\r\nHost: {address}\r\n{TOKEN_HEADER}: {token}\r\n"
            sock.sendall(f"{head}Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
            status, body = _read_response(reader)
    _raise_for_status(address, action, status, body)
    return body


def fetch_file(
    address: PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> bytes:
    """Returns the bytes of ``root/run_id/relpath`` on a peer.

    Args:
      address: The peer's `PeerServer.address`.
      token: The run's shared secret.
      run_id: The run whose directory holds the file.
      relpath: Path of the file below the run directory.
      timeout: Seconds any one connect, send or receive may block.

    Raises:
      ValueError: If an argument is malformed (before any I/O).
      FileNotFoundError: If the peer has no such file.
      PermissionError: If the peer rejected the token.
      TimeoutError, ConnectionError, OSError: If the peer is unreachable,
        stalls, or refuses for another reason (message names the peer).
    """
    return _request(address, token, run_id, "GET", "files", relpath, timeout)


def list_dir(
    address: PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> list[str]:
    """Returns the sorted entry names of directory ``root/run_id/relpath`` on a peer.

    Temporary entries of in-flight pushes are left out. Arguments and errors
    are those of `fetch_file`; ``relpath`` may be empty for the run directory.
    """
    names = json.loads(_request(address, token, run_id, "GET", "list", relpath, timeout))["names"]
    return [str(n) for n in names]


def delete_path(
    address: PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> None:
    """Removes file or directory ``root/run_id/relpath`` on a peer.

    The entry is first renamed away, so it vanishes atomically. Arguments and
    errors are those of `fetch_file` (FileNotFoundError if it is absent).
    """
    _request(address, token, run_id, "DELETE", "files", relpath, timeout)


def push_directory(
    address: PeerAddress,
    *,
    token: str,
    run_id: str,
    src_dir: str | os.PathLike[str],
    dest_relpath: str,
    timeout: float,
) -> int:
    """Copies every regular file under ``src_dir`` to ``root/run_id/dest_relpath`` on a peer.

    The peer writes into a temporary directory and renames it to
    ``dest_relpath`` (replacing what was there) only after every file arrived
    with the right size and CRC-32, so the destination never holds a partial
    copy. Symlinks and special files under ``src_dir`` are skipped.

    Args:
      address: The peer's `PeerServer.address`.
      token: The run's shared secret.
      run_id: The run whose directory receives the copy.
      src_dir: Local directory to copy.
      dest_relpath: Destination below the peer's run directory.
      timeout: Seconds any one connect, send or receive may block.

    Returns:
      The number of file bytes sent.

    Raises:
      ValueError: If an argument is malformed (before any I/O).
      PermissionError: If the peer rejected the token.
      OSError: If the push was refused (``errno.EFBIG`` when too big for the
        peer, ``errno.ENOSPC`` when its memory tier is full) or a local file
        could not be read.
      TimeoutError, ConnectionError: If the peer is unreachable or stalls.
    """
    _check_run_id(run_id)
    _check_token(token)
    rel = _clean_relpath(dest_relpath, allow_empty=False)
    src = os.fspath(src_dir)
    if not os.path.isdir(src):
        raise NotADirectoryError(errno.ENOTDIR, f"Push source {src!r} is not a directory.")
    files = _regular_files(src)
    header = json.dumps(
        {"version": _PUSH_VERSION, "files": [{"path": n, "size": s} for n, s in files]}
    ).encode()
    payload = sum(s for _, s in files)
    total = 4 + len(header) + payload + 4 * len(files)
    action = f"push of {src!r} to {dest_relpath!r} of run {run_id!r}"
    url = f"/push/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    request = (
        f"POST {url} HTTP/1.1\r\nHost: {address}\r\n{TOKEN_HEADER}: {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {total}\r\n"
        "Expect: 100-continue\r\nConnection: close\r\n\r\n"
    ).encode()
    with _transport_errors(address, action, timeout):
        sock = _connect(address, timeout)
        with sock, sock.makefile("rb") as reader:
            sock.sendall(request)
            status, body = _read_response(reader)
            if status == 100:
                try:
                    sock.sendall(len(header).to_bytes(4, "big") + header)
                    _send_files(sock, src, files)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # The peer gave up early; its answer (if any) says why.
                status, body = _read_response(reader)
    _raise_for_status(address, action, status, body)
    return payload


def _regular_files(src: str) -> list[tuple[str, int]]:
    """Lists (posix relative path, size) of regular files under ``src``, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                found.append((os.path.relpath(path, src).replace(os.sep, "/"), st.st_size))
    return sorted(found)


def _send_files(sock: socket.socket, src: str, files: list[tuple[str, int]]) -> None:
    """Sends each file with zero-copy sendfile while another thread checksums it."""
    with concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-peer-crc") as pool:
        for name, size in files:
            path = os.path.join(src, name)
            crc = pool.submit(_file_crc, path, size)
            with open(path, "rb") as f:
                sent = sock.sendfile(f, 0, size) if size else 0
            if sent != size:
                raise OSError(errno.EIO, f"{path!r} shrank while being pushed.")
            # A file that changed meanwhile fails the server's CRC check.
            sock.sendall(crc.result().to_bytes(4, "big"))


def _file_crc(path: str, size: int) -> int:
    crc, buf = 0, memoryview(bytearray(min(_BUFFER_BYTES, max(size, 1))))
    with open(path, "rb", buffering=0) as f:
        while size:
            got = f.readinto(buf[: min(size, len(buf))])
            if not got:
                raise OSError(errno.EIO, f"{path!r} shrank while being pushed.")
            crc, size = zlib.crc32(buf[:got], crc), size - got
    return crc
