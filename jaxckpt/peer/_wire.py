"""Peer service wire format, version 1: what `_server` and `_client` agree on.

This format is a compatibility promise between the processes of a run:

* A process's service is reached at a `PeerAddress` (host and TCP port).

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

import dataclasses
import json
import re
from typing import Any, Final

TOKEN_HEADER: Final = "X-Jaxckpt-Token"
# Names under root/run_id that start with this are in-flight pushes or
# deletions; they are never listed and are removed when their process is gone.
TEMP_PREFIX: Final = ".jaxckpt-peer-tmp-"
PUSH_VERSION: Final = 1
_RUN_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


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


def encode_push_header(files: list[tuple[str, int]]) -> bytes:
    """Returns the JSON push header listing ``(path, size)`` pairs, without its length."""
    entries = [{"path": name, "size": size} for name, size in files]
    return json.dumps({"version": PUSH_VERSION, "files": entries}).encode()


def decode_push_header(data: bytes) -> list[tuple[str, int]]:
    """Parses and validates a push header into ``(cleaned path, size)`` pairs.

    Raises:
      ValueError: If the header is malformed, of another version, lists a
        path that could escape or a file twice, or holds a bad size.
    """
    try:
        header = json.loads(data)
        version = header["version"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Malformed push header: {e}") from e
    if version != PUSH_VERSION:
        raise ValueError(f"Push format version {version!r} unsupported.")
    try:
        files = [(clean_relpath(f["path"], allow_empty=False), f["size"]) for f in header["files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Malformed push header: {e}") from e
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for _, s in files):
        raise ValueError("Push header sizes must be non-negative ints.")
    if len({name for name, _ in files}) != len(files):
        raise ValueError("Push header lists a file twice.")
    return files


def push_body_length(header_length: int, files: list[tuple[str, int]]) -> int:
    """Returns the Content-Length of a push whose JSON header has ``header_length`` bytes."""
    return 4 + header_length + sum(size + 4 for _, size in files)


def pack_u32(value: int) -> bytes:
    """Encodes a header length or CRC-32 as 4 big-endian bytes."""
    return value.to_bytes(4, "big")


def read_u32(stream: Any) -> int:
    """Reads a header length or CRC-32 written by `pack_u32`."""
    return int.from_bytes(read_exact(stream, 4), "big")


def read_exact(stream: Any, size: int) -> bytes:
    """Reads exactly ``size`` bytes; ConnectionResetError if the stream ends first."""
    data = stream.read(size)
    if len(data) != size:
        raise ConnectionResetError(f"Connection closed after {len(data)} of {size} bytes.")
    return bytes(data)
