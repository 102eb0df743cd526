"""Chunk checksums: CRC-32C, computed once at save and verified on every read.

CRC-32C (Castagnoli) runs on the CPU's crc32 instructions through the `crc32c`
package (measured ~14 GB/s per core here, against ~2.5 GB/s for zlib's CRC-32),
releases the GIL, and is the checksum of zarr3's standard `crc32c` codec.
Manifests of format versions 1-2 recorded zlib's CRC-32 instead; `matches`
verifies either.
"""

from __future__ import annotations

import zlib
from typing import Any

import crc32c as _crc32c
import numpy as np


def _bytes_of(data: Any) -> Any:
    """A C-contiguous byte view of an array or buffer (a copy only if not contiguous)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return data


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of an array's bytes in C order, or of a buffer; `value`: the CRC-32C of
    the bytes before them (to checksum a buffer block by block)."""
    return int(_crc32c.crc32c(_bytes_of(data), value))


def crc32(data: Any) -> int:
    """zlib's CRC-32 (what format versions 1-2 recorded)."""
    return zlib.crc32(_bytes_of(data))


def matches(crc32c_value: int | None, crc32_value: int | None, data: Any) -> bool:
    """Whether `data` has the recorded checksum (CRC-32C, or a legacy CRC-32)."""
    if crc32c_value is not None:
        return crc32c(data) == crc32c_value
    if crc32_value is not None:
        return crc32(data) == crc32_value
    return False
