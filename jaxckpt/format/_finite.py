"""Counting NaN and Inf in a save's chunks, block by block, during the slab pass.

A save already passes over every byte it keeps once off the training thread: the
slab fill or checksum pass (`_slab`), which takes each 1 MiB block while it is in
cache. `Tally` counts the non-finite numbers of each floating chunk in that same
pass, from the same blocks, so a poisoned step (NaN/Inf after a loss spike or a
silent corruption) is known from its manifest without reading it again.

The test of a block is one cheap reduction that is exact when it says "finite":
for float32/float64 (and complex) the block's dot product with itself (a sum of
squares: NaN propagates, ±Inf squares to +Inf, nothing cancels; a sum that
overflows only sends the block to the exact count); for the 16-bit floats the
largest magnitude bits. Only a block that fails it is counted element by element
(and a float32/64 block under 64 KiB, where the count is the cheaper test).
Measured here on a 1 MiB float32 block in cache: 18 µs for the dot product, 31 µs
for a max and a min, ~50 µs for the block's CRC-32C. Other
floating dtypes (the float8/float4 families of `ml_dtypes`) are counted with
`np.isfinite` on every block (slower: they are rare in a training state).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import ml_dtypes
import numpy as np

# 16-bit floats: dtype name -> its exponent bits (all set: Inf or NaN).
_HALF: Final = {"float16": 0x7C00, "bfloat16": 0x7F80}
# Wider floats: dtype name -> the float type of its numbers (complex: of each part).
_WIDE: Final[dict[str, type[np.floating]]] = {
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.float32,
    "complex128": np.float64,
}
_SCRATCH_ITEMS: Final = 1 << 20  # uint16 items: two MiB, more than a block's worth
# A smaller float32/64 block is counted exactly at once: below it, the dot product and
# its `np.errstate` cost more than the count (0.6 against 2.0 µs for 256 bytes; a tree of
# thousands of small leaves has as many blocks).
_COUNT_BELOW: Final = 64 << 10
_local = threading.local()

Counter = Callable[[np.ndarray], int]


def _scratch(n: int) -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(max(n, _SCRATCH_ITEMS), np.uint16)
    return buf[:n]


def _wide(kind: type[np.floating]) -> Counter:
    def count(block: np.ndarray) -> int:
        values = block.view(kind)
        if values.nbytes < _COUNT_BELOW:
            return int(values.size - np.count_nonzero(np.isfinite(values)))
        with np.errstate(over="ignore", invalid="ignore"):  # the sum may overflow: fine
            if np.isfinite(np.dot(values, values)):
                return 0
        return int(values.size - np.count_nonzero(np.isfinite(values)))

    return count


def _half(exponent: int) -> Counter:
    def count(block: np.ndarray) -> int:
        bits = block.view(np.uint16)
        if not bits.size:
            return 0
        magnitude = np.bitwise_and(bits, 0x7FFF, out=_scratch(bits.size))
        if int(magnitude.max()) < exponent:
            return 0
        return int(np.count_nonzero(magnitude >= exponent))

    return count


def _exact(dtype: np.dtype) -> Counter:
    def count(block: np.ndarray) -> int:
        values = block.view(dtype)
        return int(values.size - np.count_nonzero(np.isfinite(values)))

    return count


def _is_floating(dtype: np.dtype) -> bool:
    if dtype.kind in "fc":
        return True
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def counter(dtype: str | np.dtype | None) -> Counter | None:
    """The non-finite counter of `dtype`'s bytes (a C-contiguous uint8 block holding
    whole elements), or None for a dtype that holds no NaN/Inf (integers, bools,
    typed PRNG keys' data)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    if dt.name in _HALF:
        return _half(_HALF[dt.name])
    if dt.name in _WIDE:
        return _wide(_WIDE[dt.name])
    return _exact(dt) if _is_floating(dt) else None


class Tally:
    """NaN/Inf counts of one save's chunks, added block by block by the slab pass.

    A chunk is passed over by one thread (`_slab` hands out whole chunks), so its
    count needs no lock.
    """

    def __init__(self, dtypes: Sequence[str | np.dtype | None]):
        """`dtypes[i]`: the stored dtype of chunk `i` (None: not counted)."""
        self._counters = [counter(d) for d in dtypes]
        self.counts = [0] * len(dtypes)

    def add(self, chunk: int, block: np.ndarray) -> None:
        """Counts the non-finite numbers of `block`, the next bytes of chunk `chunk`."""
        count = self._counters[chunk]
        if count is not None:
            self.counts[chunk] += count(block)

    def by_leaf(self, leaves: Sequence[int]) -> dict[int, int]:
        """Leaf index -> its non-finite count, for the leaves that have any
        (`leaves[i]`: the leaf chunk `i` belongs to)."""
        out: dict[int, int] = {}
        for leaf, n in zip(leaves, self.counts, strict=True):
            if n:
                out[leaf] = out.get(leaf, 0) + n
        return out


def total(nonfinite: Mapping[int, int] | None) -> int | None:
    """The number of non-finite values a part recorded; None if it did not count."""
    return None if nonfinite is None else sum(nonfinite.values())
