"""Peer service wire format, version 2: what `_server` and `_client` agree on.

This format is a compatibility promise between the processes of a run:

* A process's service is reached at a `PeerAddress` (host and TCP port).

* Every request carries the run's secret in the ``X-Jaxckpt-Token`` header and
  names the run in its path: ``/files/<run>/<relpath>`` (GET, HEAD, DELETE),
  ``/list/<run>/<relpath>`` (GET: ``{"names": [...]}``), ``/push/<run>/<dest>``.
* A push copies one memory-tier part (``manifest.json`` and its ``slab``, see
  `jaxckpt.memory._slab`) to ``<dest>``, which must be the part's own place
  (``step_<step:012d>/part_<owner:05d>``). It is one ``POST`` with
  ``Expect: 100-continue`` and a Content-Length, so the server can refuse it
  before any byte of the body moves. The body is a 4-byte big-endian header
  length, a JSON header ``{"version": 2, "manifest_bytes": M, "slab_bytes": S}``,
  then the M bytes of ``manifest.json`` and the S bytes of the slab, raw. The
  sender computes no checksum: the receiver checks every chunk of the slab
  against the CRC-32C its manifest records (and every chunk's place against the
  slab's size) before the part becomes visible.
* ``/relay/<run>/<key>`` serves the process's relay store (`jaxckpt.coord._kv`:
  a relay group's leader keeps it, its members reach it here). ``<key>`` is
  one opaque percent-encoded string (``/`` in it is part of the key, at most
  `RELAY_MAX_KEY_BYTES` of UTF-8, no ``..`` component). ``POST`` sets the key
  to the body (UTF-8, at most `RELAY_MAX_VALUE_BYTES`), 204; with
  ``?overwrite=1`` it may replace a value, else 409 whose error says
  ``ALREADY_EXISTS``. ``GET ?wait_ms=N`` answers the value (200) once the key
  exists, waiting up to N ms (at most the service's I/O timeout), else 504
  whose error says ``DEADLINE_EXCEEDED``. ``GET ?dir=1`` answers
  ``{"items": [[key, value], ...]}`` for every key under ``<key>/``.
  ``DELETE`` removes the key and every key under ``<key>/`` (204).
* Errors are JSON ``{"error": "<sentence>"}`` with the HTTP status.

Version 1 pushed any directory, each file followed by its zlib CRC-32.
"""

import dataclasses
import json
import re
from typing import Any, Final

TOKEN_HEADER: Final = "X-Jaxckpt-Token"
# Names under root/run_id that start with this are in-flight pushes or
# deletions; they are never listed and are removed when their process is gone.
TEMP_PREFIX: Final = ".jaxckpt-peer-tmp-"
PUSH_VERSION: Final = 2
_RUN_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
RELAY_MAX_KEY_BYTES: Final = 1024  # a relay key's UTF-8
RELAY_MAX_VALUE_BYTES: Final = 64 << 20  # a relay value's UTF-8


class Refusal(Exception):
    """A request the service refuses: answered with ``status`` and a JSON
    ``{"error": message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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


def check_run_id(run_id: str) -> None:
    """Raises ValueError unless ``run_id`` can name a run directory and URL segment."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run_id must be 1-255 characters from [A-Za-z0-9._-] starting with a letter or "
            f"digit, got {run_id!r}."
        )


def check_token(token: str) -> None:
    """Raises ValueError unless ``token`` can travel as a header value."""
    # A header value may not hold CR/LF; never echo the token in the message.
    if not isinstance(token, str) or not token.isascii() or not token.isprintable():
        raise ValueError("token must be a non-empty string of printable ASCII characters.")
    if not token or token != token.strip():
        raise ValueError("token must be non-empty, without leading or trailing spaces.")


def clean_relpath(relpath: str, *, allow_empty: bool) -> str:
    """Returns ``relpath`` normalised to ``a/b/c``; ValueError if it could escape."""
    if not isinstance(relpath, str) or "\x00" in relpath or relpath.startswith("/"):
        raise ValueError(f"Path {relpath!r} must be a relative str without NUL characters.")
    parts = relpath.removesuffix("/").split("/") if relpath else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"Path {relpath!r} must not contain empty, '.' or '..' components.")
    if not parts and not allow_empty:
        raise ValueError("Path must not be empty here.")
    return "/".join(parts)


def check_relay_key(key: str) -> None:
    """Raises ValueError unless ``key`` can name a value of a relay store: a non-empty
    str of at most `RELAY_MAX_KEY_BYTES` of UTF-8, without NUL or a ``..`` component."""
    if not isinstance(key, str) or not key or "\x00" in key:
        raise ValueError(f"Relay key {key!r} must be a non-empty str without NUL characters.")
    try:
        size = len(key.encode())
    except UnicodeEncodeError as e:
        raise ValueError(f"Relay key {key!r} is not valid UTF-8.") from e
    if size > RELAY_MAX_KEY_BYTES:
        raise ValueError(
            f"Relay key of {size} bytes is over {RELAY_MAX_KEY_BYTES}: {key[:80]!r}..."
        )
    if ".." in key.split("/"):
        raise ValueError(f"Relay key {key!r} must not contain a '..' component.")


@dataclasses.dataclass(frozen=True)
class PushHeader:
    """What a push's JSON header announces: the sizes of the part's two files.

    Attributes:
      manifest_bytes: Size of the part's ``manifest.json``, sent first.
      slab_bytes: Size of the part's slab, sent next.
    """

    manifest_bytes: int
    slab_bytes: int

    @property
    def payload_bytes(self) -> int:
        return self.manifest_bytes + self.slab_bytes


def encode_push_header(header: PushHeader) -> bytes:
    """Returns the JSON push header, without its length."""
    return json.dumps(
        {
            "version": PUSH_VERSION,
            "manifest_bytes": header.manifest_bytes,
            "slab_bytes": header.slab_bytes,
        }
    ).encode()


def decode_push_header(data: bytes) -> PushHeader:
    """Parses and validates a push header.

    Raises:
      ValueError: If the header is malformed, of another version, or holds a bad size.
    """
    try:
        header = json.loads(data)
        version = header["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Malformed push header: {e!r}") from e
    if version != PUSH_VERSION:
        raise ValueError(
            f"Push format version {version!r} unsupported (this peer speaks version "
            f"{PUSH_VERSION}): every process of a run must run the same jaxckpt."
        )
    try:
        sizes = header["manifest_bytes"], header["slab_bytes"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"Malformed push header: {e!r}") from e
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError("Push header sizes must be non-negative ints.")
    return PushHeader(*sizes)


def push_body_length(header_length: int, header: PushHeader) -> int:
    """Returns the Content-Length of a push whose JSON header has ``header_length`` bytes."""
    return 4 + header_length + header.payload_bytes


def pack_u32(value: int) -> bytes:
    """Encodes a push header length as 4 big-endian bytes."""
    return value.to_bytes(4, "big")


def read_u32(stream: Any) -> int:
    """Reads a push header length written by `pack_u32`."""
    return int.from_bytes(read_exact(stream, 4), "big")


def read_exact(stream: Any, size: int) -> bytes:
    """Reads exactly ``size`` bytes; ConnectionResetError if the stream ends first."""
    data = stream.read(size)
    if len(data) != size:
        raise ConnectionResetError(f"Connection closed after {len(data)} of {size} bytes.")
    return bytes(data)
