"""Peer service client: reads, lists, deletes and pushes files on other processes.

Each call opens one connection to a peer's `PeerServer`, speaks the wire format
of `_wire`, and turns transport failures and HTTP errors into built-in
exceptions that name the peer, the path and the run. Plain requests (fetch, list,
delete) go through `http.client`; only the streaming push speaks HTTP over a raw
socket (see `push_directory`). Tensorstore reads peers directly through
`http_kvstore_spec`.
"""

import concurrent.futures
import contextlib
import errno
import http.client
import json
import os
import socket
import stat
import urllib.parse
import zlib
from collections.abc import Iterator
from typing import Any, Final

from jaxckpt.peer._wire import (
    TOKEN_HEADER,
    PeerAddress,
    check_run_id,
    check_token,
    clean_relpath,
    encode_push_header,
    pack_u32,
    push_body_length,
    read_exact,
)

_BUFFER_BYTES: Final = 8 << 20
_STATUS_ERRNO: Final = {400: errno.EINVAL, 409: errno.ESTALE, 413: errno.EFBIG, 507: errno.ENOSPC}


def http_kvstore_spec(address: PeerAddress, token: str, run_id: str) -> dict[str, Any]:
    """Returns a tensorstore ``http`` kvstore spec rooted at a peer's run directory.

    Add ``"path": "<relative/path/>"`` to address a zarr3 array below it.

    The spec holds the token, and tensorstore quotes the whole spec in its
    error messages: pass those through `redact_token` before raising or
    logging them.
    """
    check_run_id(run_id)
    check_token(token)
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
    """Carries a connect failure that is neither a timeout nor a `ConnectionError`."""

    def __init__(self, error: OSError) -> None:
        self.error = error


def _connect(address: PeerAddress, timeout: float) -> socket.socket:
    """Opens a TCP connection with Nagle off.

    Raises:
      TimeoutError, ConnectionError: As `socket.create_connection` raises them.
      _ConnectFailed: Wrapping any other OSError (unreachable network, unknown host).
    """
    try:
        sock = socket.create_connection((address.host, address.port), timeout=timeout)
    except (TimeoutError, ConnectionError):
        raise
    except OSError as e:
        raise _ConnectFailed(e) from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Connection(http.client.HTTPConnection):
    """An `http.client` connection that connects through `_connect`."""

    def __init__(self, address: PeerAddress, timeout: float) -> None:
        super().__init__(address.host, address.port, timeout=timeout)
        self._address, self._connect_timeout = address, timeout

    def connect(self) -> None:
        self.sock = _connect(self._address, self._connect_timeout)


def _raise_for_status(address: PeerAddress, action: str, status: int, body: bytes) -> None:
    """Raises the built-in error for an HTTP error status; returns on 2xx."""
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


_NO_ANSWER: Final = "the peer closed the connection without answering"


def _read_response(reader: Any) -> tuple[int, bytes]:
    """Reads one response (status line, headers, body) from a raw socket's reader."""
    line = reader.readline(65537)
    if not line:
        raise ConnectionResetError(_NO_ANSWER)
    try:
        status = int(line.split(None, 2)[1])
    except (IndexError, ValueError) as e:
        raise http.client.BadStatusLine(repr(line)) from e
    headers = http.client.parse_headers(reader)
    length = int(headers.get("Content-Length", "0"))
    return status, read_exact(reader, length) if status >= 200 else b""


def _request(
    address: PeerAddress,
    token: str,
    run_id: str,
    method: str,
    kind: str,
    relpath: str,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> bytes:
    """Sends one body-less request to a peer; returns the body of its 2xx answer."""
    check_run_id(run_id)
    check_token(token)
    rel = clean_relpath(relpath, allow_empty=kind == "list")
    action = f"{method} {relpath!r} of run {run_id!r}"
    url = f"/{kind}/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    with _transport_errors(address, action, timeout):
        conn = _Connection(address, timeout)
        with contextlib.closing(conn):
            conn.request(
                method,
                url,
                headers={TOKEN_HEADER: token, "Connection": "close", **(headers or {})},
            )
            try:
                response = conn.getresponse()
                status, body = response.status, response.read()
            except http.client.RemoteDisconnected as e:
                raise ConnectionResetError(_NO_ANSWER) from e
            except http.client.IncompleteRead as e:
                got, size = len(e.partial), len(e.partial) + (e.expected or 0)
                raise ConnectionResetError(f"Connection closed after {got} of {size} bytes.") from e
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


def fetch_range(
    address: PeerAddress,
    *,
    token: str,
    run_id: str,
    relpath: str,
    offset: int,
    nbytes: int,
    timeout: float,
) -> bytes:
    """Returns bytes [offset, offset + nbytes) of ``root/run_id/relpath`` on a peer
    (the server sends them from its page cache with sendfile).

    Arguments and errors are those of `fetch_file`; a range beyond the file's end
    gives fewer bytes (the caller checks the length).
    """
    if offset < 0 or nbytes < 0:
        raise ValueError(f"Bad byte range: offset={offset}, nbytes={nbytes}.")
    if nbytes == 0:
        return b""
    span = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
    return _request(address, token, run_id, "GET", "files", relpath, timeout, span)


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
    check_run_id(run_id)
    check_token(token)
    rel = clean_relpath(dest_relpath, allow_empty=False)
    src = os.fspath(src_dir)
    if not os.path.isdir(src):
        raise NotADirectoryError(errno.ENOTDIR, f"Push source {src!r} is not a directory.")
    files = _regular_files(src)
    header = encode_push_header(files)
    payload = sum(s for _, s in files)
    total = push_body_length(len(header), files)
    action = f"push of {src!r} to {dest_relpath!r} of run {run_id!r}"
    url = f"/push/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    # A raw socket, because http.client cannot speak this exchange: it sends a
    # request's body right after its headers and skips interim answers, so it
    # cannot wait for "100 Continue" before streaming (the server's chance to
    # refuse a push before any body byte moves) nor read the refusal that comes
    # instead. The raw socket also lets `_send_files` use zero-copy sendfile.
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
                    sock.sendall(pack_u32(len(header)) + header)
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
            sock.sendall(pack_u32(crc.result()))


def _file_crc(path: str, size: int) -> int:
    crc, buf = 0, memoryview(bytearray(min(_BUFFER_BYTES, max(size, 1))))
    with open(path, "rb", buffering=0) as f:
        while size:
            got = f.readinto(buf[: min(size, len(buf))])
            if not got:
                raise OSError(errno.EIO, f"{path!r} shrank while being pushed.")
            crc, size = zlib.crc32(buf[:got], crc), size - got
    return crc
