"""A leaf's target regions filled from its tiles as each is read and checked.

The read engine (`_chunk_reads`) reads the tiles the regions intersect, each once, and
hands each to `Assembly.place` as soon as it is verified (on the read pool, several at
once); `finish` gives the regions' values with at most one copy of any byte.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxckpt.format import _chunking, _tiles
from jaxckpt.memory import _readers

Key = tuple[tuple[int, ...], int]  # a tile of a leaf: (its chunk's index, its index)


class Assembly:
    """The target regions of one leaf, filled from its tiles as each is read and checked.

    A region that is exactly one tile is that tile (no copy); one that is a run of tiles
    one after the other is a view of them where they were read in place (no copy); every
    other one gets a buffer, aligned as a slab is (JAX on CPU keeps it without another
    copy), all of a leaf's carved out of one allocation (`_readers.aligned_buffers`: huge
    pages where the kernel offers them), which each tile is copied into right after it
    is read and checked, while it is in cache.
    `place` may run on several threads at once (distinct tiles).
    """

    def __init__(
        self,
        regions: Sequence[_chunking.Region],
        wanted: Sequence[Sequence[tuple[tuple[int, ...], _tiles.Tile]]],
        dtype: np.dtype,
    ):
        self.needed: dict[Key, _tiles.Tile] = {}  # every tile to read
        self._regions, self._dtype = regions, dtype
        self._into: dict[Key, list[int]] = {}  # tile -> regions it is copied into
        self._is: dict[Key, list[int]] = {}  # tile -> regions it is
        self._runs: dict[int, list[Key]] = {}  # region -> the run of tiles it is
        self._kept: dict[Key, np.ndarray] = {}  # the tiles of runs, as read
        self._out: list[np.ndarray | None] = []
        copied: list[int] = []  # regions assembled by copies, in one allocation
        for r, (region, found) in enumerate(zip(regions, wanted, strict=True)):
            for i, t in found:
                self.needed[i, t.index] = t
            if len(found) == 1 and found[0][1].region == region:
                self._is.setdefault((found[0][0], found[0][1].index), []).append(r)
                self._out.append(None)
            elif len({i for i, _ in found}) == 1 and _tiles.is_run([t for _, t in found], region):
                self._runs[r] = [(i, t.index) for i, t in found]
                self._out.append(None)
            else:
                for i, t in found:
                    self._into.setdefault((i, t.index), []).append(r)
                self._out.append(None)
                copied.append(r)
        buffers = _readers.aligned_buffers([self._nbytes(regions[r]) for r in copied])
        for r, buf in zip(copied, buffers, strict=True):
            self._out[r] = self._shaped(buf, regions[r])
        self._in_runs = {key for keys in self._runs.values() for key in keys}

    def _nbytes(self, region: _chunking.Region) -> int:
        return math.prod(s.stop - s.start for s in region) * self._dtype.itemsize

    def _shaped(self, buf: np.ndarray, region: _chunking.Region) -> np.ndarray:
        return buf.view(self._dtype).reshape([s.stop - s.start for s in region])

    def _buffer(self, region: _chunking.Region) -> np.ndarray:
        return self._shaped(_readers.aligned_empty(self._nbytes(region)), region)

    def place(self, key: Key, data: np.ndarray) -> None:
        """Tile `key`'s verified values into every region that needs them."""
        tile = self.needed[key]
        for r in self._into.get(key, ()):
            region, buf = self._regions[r], self._out[r]
            assert buf is not None
            both = _chunking.intersect(region, tile.region)
            buf[_chunking.relative(both, region)] = data[_chunking.relative(both, tile.region)]
        for r in self._is.get(key, ()):
            self._out[r] = data
        if key in self._in_runs:
            self._kept[key] = data

    def finish(self) -> list[np.ndarray]:
        """Every region's values, once every tile is placed."""
        for r, run in self._runs.items():
            view = _readers.joined([self._kept[key] for key in run])
            if view is None:  # not read in place: copied together
                buf = self._buffer(self._regions[r])
                buf.reshape(-1).view(np.uint8)[:] = np.concatenate(
                    [self._kept[key].reshape(-1).view(np.uint8) for key in run]
                )
                self._out[r] = buf
            else:
                dims = [s.stop - s.start for s in self._regions[r]]
                self._out[r] = view.view(self._dtype).reshape(dims)
        assert all(buf is not None for buf in self._out)
        return [buf for buf in self._out if buf is not None]


def batches(
    keys: Sequence[Key], tiles: Mapping[Key, _tiles.Tile], task_bytes: int
) -> list[Sequence[Key]]:
    """`keys` (tiles) cut into consecutive runs of about `task_bytes`, one task each."""
    out, start, run = [], 0, 0
    for k, key in enumerate(keys):
        run += tiles[key].nbytes
        if run >= task_bytes:
            out.append(keys[start : k + 1])
            start, run = k + 1, 0
    if start < len(keys):
        out.append(keys[start:])
    return out
