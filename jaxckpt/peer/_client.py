"""Peer service client: reads, lists, deletes and pushes files on other processes.

Each call opens one connection to a peer's `PeerServer`, speaks the wire format
of `_wire`, and turns transport failures and HTTP errors into built-in
exceptions that name the peer, the path and the run. Plain requests (fetch, byte
ranges, list, delete) go through `http.client`; only the streaming push of a
part speaks HTTP over a raw socket (see `push_part`).
"""

import contextlib
import errno
import http.client
import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Final

from jaxckpt.format import _format
from jaxckpt.memory import _landing, _slab
from jaxckpt.peer import _wire

_STATUS_ERRNO: Final = {400: errno.EINVAL, 409: errno.ESTALE, 413: errno.EFBIG, 507: errno.ENOSPC}


def redact_token(text: str, token: str) -> str:
    """Returns ``text`` with every occurrence of ``token`` replaced by ``<redacted>``.

    No answer of a peer service quotes the token; this keeps it out of error
    messages and logs should any other text (a caller's own) hold it.
    """
    return text.replace(token, "<redacted>") if token else text


@contextlib.contextmanager
def _transport_errors(address: _wire.PeerAddress, action: str, timeout: float) -> Iterator[None]:
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
        # A ConnectionError (errno kept): the peer cannot be reached, as with a refusal.
        raise ConnectionError(e.error.errno, f"{where} could not connect: {e.error}.") from e.error


class _ConnectFailed(Exception):
    """Carries a connect failure that is neither a timeout nor a `ConnectionError`."""

    def __init__(self, error: OSError) -> None:
        self.error = error


def _connect(address: _wire.PeerAddress, timeout: float) -> socket.socket:
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
    """An `http.client` connection that connects through `_connect` within ``timeout``,
    then lets each send or receive block for ``answer_timeout`` (default: the same)."""

    def __init__(
        self, address: _wire.PeerAddress, timeout: float, answer_timeout: float | None = None
    ) -> None:
        super().__init__(address.host, address.port, timeout=timeout)
        self._address, self._connect_timeout = address, timeout
        self._answer_timeout = timeout if answer_timeout is None else answer_timeout

    def connect(self) -> None:
        self.sock = _connect(self._address, self._connect_timeout)
        self.sock.settimeout(self._answer_timeout)


def raise_for_status(address: _wire.PeerAddress, action: str, status: int, body: bytes) -> None:
    """Raises the built-in error for an HTTP error status; returns on 2xx."""
    if 200 <= status < 300:
        return
    reason = refusal_reason(body)
    message = f"{action} on peer {address} failed with HTTP {status}: {reason}"
    if status == 403:
        raise PermissionError(errno.EACCES, message)
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, message)
    raise OSError(_STATUS_ERRNO.get(status, errno.EIO), message)


def refusal_reason(body: bytes) -> str:
    """The sentence of an error answer (``{"error": ...}``), or its first bytes."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


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
    return status, _wire.read_exact(reader, length) if status >= 200 else b""


def _request(
    address: _wire.PeerAddress,
    token: str,
    run_id: str,
    method: str,
    kind: str,
    relpath: str,
    timeout: float,
    headers: dict[str, str] | None = None,
    into: memoryview | None = None,
    progress: Callable[[int], None] | None = None,
) -> bytes:
    """Sends one body-less request to a peer; returns the body of its 2xx answer, or
    receives that body straight into ``into`` (returning b"") if given, which it
    must fill exactly (else OSError), calling ``progress(received)`` as it goes."""
    _wire.check_run_id(run_id)
    _wire.check_token(token)
    rel = _wire.clean_relpath(relpath, allow_empty=kind == "list")
    action = f"{method} {relpath!r} of run {run_id!r}"
    url = f"/{kind}/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    status, body = exchange(
        address, token, method, url, action, timeout, headers, into=into, progress=progress
    )
    raise_for_status(address, action, status, body)
    return body


def exchange(
    address: _wire.PeerAddress,
    token: str,
    method: str,
    url: str,
    action: str,
    timeout: float,
    headers: dict[str, str] | None = None,
    *,
    send: bytes | None = None,
    answer_timeout: float | None = None,
    into: memoryview | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, bytes]:
    """Sends one request (``url``: its path and query, the run in it; ``send``, its
    body, if any) to a peer; returns the status and body of its answer, whatever the status
    (`_request` and the relay client judge it). Connects within ``timeout``; each
    send or receive then blocks at most ``answer_timeout`` (default ``timeout``).
    ``into`` and ``progress`` are `_request`'s; transport failures raise as
    `_transport_errors` says, naming ``action`` and the peer."""
    wait = timeout if answer_timeout is None else answer_timeout
    with _transport_errors(address, action, max(timeout, wait)):
        conn = _Connection(address, timeout, wait)
        with contextlib.closing(conn):
            conn.request(
                method,
                url,
                body=send,
                headers={_wire.TOKEN_HEADER: token, "Connection": "close", **(headers or {})},
            )
            try:
                response = conn.getresponse()
                status = response.status
                if into is not None and 200 <= status < 300:
                    body, size = b"", response.length
                    if size != len(into):
                        raise OSError(
                            errno.EIO,
                            f"{action} on peer {address}: the peer answers with {size} "
                            f"bytes, not the {len(into)} asked for.",
                        )
                    _read_into(response, into, progress)
                else:
                    body = response.read()
            except http.client.RemoteDisconnected as e:
                raise ConnectionResetError(_NO_ANSWER) from e
            except http.client.IncompleteRead as e:
                got, size = len(e.partial), len(e.partial) + (e.expected or 0)
                raise ConnectionResetError(f"Connection closed after {got} of {size} bytes.") from e
    return status, body


# With a `progress` callback, a body is received at most this much at a time, so that
# the caller sees each piece while it is in cache (and a landing slab makes the pages
# of the next piece exist first: the same size).
PROGRESS_BYTES: Final = _landing.PIECE


def _read_into(
    response: http.client.HTTPResponse,
    out: memoryview,
    progress: Callable[[int], None] | None = None,
) -> None:
    done = 0
    piece = PROGRESS_BYTES if progress is not None else len(out)
    while done < len(out):
        got = response.readinto(out[done : done + piece])
        if not got:
            raise ConnectionResetError(f"Connection closed after {done} of {len(out)} bytes.")
        done += got
        if progress is not None:
            progress(done)


def fetch_file(
    address: _wire.PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
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
    address: _wire.PeerAddress,
    *,
    token: str,
    run_id: str,
    relpath: str,
    offset: int,
    into: memoryview,
    timeout: float,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Receives bytes [offset, offset + len(into)) of ``root/run_id/relpath`` on a
    peer straight into ``into`` (the server sends them from its page cache with
    sendfile; this side copies them once, from the socket). With ``progress``, the
    bytes arrive at most `PROGRESS_BYTES` at a time, each time followed by
    ``progress(bytes received so far)``.

    Arguments and errors are those of `fetch_file`; a range that is not wholly in
    the file raises OSError (EIO), one cut short ConnectionResetError.
    """
    if offset < 0:
        raise ValueError(f"Bad byte range: offset={offset}, nbytes={len(into)}.")
    if not len(into):
        return
    span = {"Range": f"bytes={offset}-{offset + len(into) - 1}"}
    _request(
        address, token, run_id, "GET", "files", relpath, timeout, span, into=into, progress=progress
    )


def list_dir(
    address: _wire.PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> list[str]:
    """Returns the sorted entry names of directory ``root/run_id/relpath`` on a peer.

    Temporary entries of in-flight pushes are left out. Arguments and errors
    are those of `fetch_file`; ``relpath`` may be empty for the run directory.
    """
    names = json.loads(_request(address, token, run_id, "GET", "list", relpath, timeout))["names"]
    return [str(n) for n in names]


def delete_path(
    address: _wire.PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> None:
    """Removes file or directory ``root/run_id/relpath`` on a peer.

    The entry is first renamed away, so it vanishes atomically. Arguments and
    errors are those of `fetch_file` (FileNotFoundError if it is absent).
    """
    _request(address, token, run_id, "DELETE", "files", relpath, timeout)


def check_part(
    address: _wire.PeerAddress, *, token: str, run_id: str, relpath: str, timeout: float
) -> str | None:
    """Asks a peer to check its copy of a part (``root/run_id/relpath``: a part's
    place) against its manifest's checksums, quarantining it if it is damaged (the
    peer's `_quarantine.check_and_quarantine`). Returns what is wrong with it, or None.
    Arguments and errors are those of `fetch_file`."""
    body = _request(address, token, run_id, "POST", "check", relpath, timeout)
    damage = json.loads(body or b"{}").get("damage")
    return None if damage is None else str(damage)


def push_part(
    address: _wire.PeerAddress,
    *,
    token: str,
    run_id: str,
    part_dir: str | os.PathLike[str],
    dest_relpath: str,
    timeout: float,
) -> int:
    """Copies a memory-tier part (``manifest.json`` and ``slab``) to a peer.

    The files go out with zero-copy sendfile and nothing else: this side
    computes no checksum and copies no byte through user space. The peer receives into a temporary directory, checks
    every chunk of the received slab against the CRC-32C that the received
    manifest records (and that every chunk lies inside the slab), and only then
    renames the directory to ``root/run_id/dest_relpath`` (replacing what was
    there), so the destination never holds a partial or damaged copy.

    Args:
      address: The peer's `PeerServer.address`.
      token: The run's shared secret.
      run_id: The run whose directory receives the copy.
      part_dir: Local part directory (``manifest.json`` and ``slab``).
      dest_relpath: The part's place below the peer's run directory
        (``step_<step:012d>/part_<owner:05d>``, as the manifest says; the peer
        refuses any other).
      timeout: Seconds any one connect, send or receive may block.

    Returns:
      The number of file bytes sent.

    Raises:
      ValueError: If an argument is malformed (before any I/O).
      FileNotFoundError: If ``part_dir`` lacks one of the files (before any I/O).
      PermissionError: If the peer rejected the token.
      OSError: If the push was refused: ``errno.EINVAL`` when the manifest is
        not a valid part manifest of this run and place or a chunk of the slab
        arrived damaged (the message names it), ``errno.EFBIG`` when too big for
        the peer, ``errno.ENOSPC`` when its memory tier is full.
      TimeoutError, ConnectionError: If the peer is unreachable or stalls.
    """
    _wire.check_run_id(run_id)
    _wire.check_token(token)
    rel = _wire.clean_relpath(dest_relpath, allow_empty=False)
    src = os.fspath(part_dir)
    action = f"push of part {src!r} to {dest_relpath!r} of run {run_id!r}"
    url = f"/push/{urllib.parse.quote(run_id)}/{urllib.parse.quote(rel)}"
    with contextlib.ExitStack() as files:
        manifest, slab = (
            files.enter_context(open(os.path.join(src, name), "rb"))
            for name in (_format.MANIFEST_FILE, _slab.SLAB_FILE)
        )
        sizes = _wire.PushHeader(
            os.fstat(manifest.fileno()).st_size, os.fstat(slab.fileno()).st_size
        )
        header = _wire.encode_push_header(sizes)
        total = _wire.push_body_length(len(header), sizes)
        # A raw socket, because http.client cannot speak this exchange: it sends a
        # request's body right after its headers and skips interim answers, so it
        # cannot wait for "100 Continue" before streaming (the server's chance to
        # refuse a push before any body byte moves) nor read the refusal that comes
        # instead. The raw socket also lets `_send_file` use zero-copy sendfile.
        request = (
            f"POST {url} HTTP/1.1\r\nHost: {address}\r\n{_wire.TOKEN_HEADER}: {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {total}\r\n"
            "Expect: 100-continue\r\nConnection: close\r\n\r\n"
        ).encode()
        with _transport_errors(address, action, timeout):
            status, body = _exchange_push(address, timeout, request, header, manifest, slab, sizes)
    raise_for_status(address, action, status, body)
    return sizes.payload_bytes


def _exchange_push(
    address: _wire.PeerAddress,
    timeout: float,
    request: bytes,
    header: bytes,
    manifest: BinaryIO,
    slab: BinaryIO,
    sizes: _wire.PushHeader,
) -> tuple[int, bytes]:
    """The push's exchange: the request, "100 Continue" (or the refusal instead), the
    body sent with sendfile, the answer. The final status and body."""
    sock = _connect(address, timeout)
    with sock, sock.makefile("rb") as reader:
        sock.sendall(request)
        status, body = _read_response(reader)
        if status == 100:
            try:
                sock.sendall(_wire.pack_u32(len(header)) + header)
                _send_file(sock, manifest, sizes.manifest_bytes)
                _send_file(sock, slab, sizes.slab_bytes)
            except (BrokenPipeError, ConnectionResetError):
                pass  # The peer gave up early; its answer (if any) says why.
            status, body = _read_response(reader)
    return status, body


def _send_file(sock: socket.socket, f: BinaryIO, size: int) -> None:
    """Sends the first ``size`` bytes of ``f`` with zero-copy sendfile."""
    sent = sock.sendfile(f, 0, size) if size else 0
    if sent != size:
        # The peer then waits for the rest and times out, or sees the next bytes
        # out of place and refuses them: either way nothing is committed there.
        raise OSError(errno.EIO, f"{f.name!r} shrank while being pushed.")
