"""JSON text that carries its own checksum: how a manifest or a step index is checked.

IMPORTANT: part of the on-disk format (see `_format`), a compatibility promise. A
version 3 object ends with `,"crc32c":<CRC-32C of the text before it, closed>}`:
written in one pass and checked without a second serialization. Versions 1-2 carry
`"crc32"`, zlib's CRC-32 of the object's members sorted by key, and are still read.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Final

from jaxckpt.format import _checksum

_CRC_MEMBER: Final = ',"crc32c":'


def with_checksum(body: str) -> str:
    """A JSON object's text with its CRC-32C (of the text before it) as the last member."""
    return f"{body[:-1]}{_CRC_MEMBER}{_checksum.crc32c(body.encode())}}}"


def checked(raw: bytes) -> dict[str, Any]:
    """The JSON object `with_checksum` wrote (or a version 1-2 one), its checksum checked.

    Raises:
      ValueError: if the text does not match its checksum (the file is damaged).
    """
    damaged = ValueError("The manifest does not match its checksum: the file is damaged.")
    cut = raw.rfind(_CRC_MEMBER.encode())
    if cut >= 0 and raw.endswith(b"}"):
        try:
            recorded = int(raw[cut + len(_CRC_MEMBER) : -1])
        except ValueError:
            raise damaged from None
        if _checksum.crc32c(raw[:cut] + b"}") != recorded:
            raise damaged
        d = json.loads(raw)
        d.pop("crc32c", None)
        return d
    d = json.loads(raw)  # versions 1-2: zlib CRC-32 of the sorted members
    if d.pop("crc32", None) != zlib.crc32(
        json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    ):
        raise damaged
    return d
