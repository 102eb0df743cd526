"""Chunk readers: one per (source, part), whatever the tier.

A tier is just a way to get a chunk's bytes: a view of a slab in this host's
memory tier, a byte range of a peer's slab, or a read of a persisted zarr3
array through tensorstore. Readers never block longer than their timeout.

A reader reads one tile of a chunk at a time (`_tiles`: a chunk saved whole is one
tile), so that a restore onto another mesh reads only the tiles it needs: a tile
is a slab view, one byte range of a peer's slab, or one inner chunk of a
persisted zarr3 array.

A slab reader returns a view of the mapped slab (no copy). The restore pins
the step in the memory tier while it reads, so the slab cannot be retired
meanwhile, and lends the slab first (`MemoryTier.lend`): a lent slab is never
written in place again, so the restored arrays may keep its pages, mapped
copy-on-write (on CPU they do: restoring from memory copies nothing). A slab
that could not be lent gives private copies, as every other reader does.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from jaxckpt import _resources
from jaxckpt.format import _chunking, _format, _tiles
from jaxckpt.memory import _slab


class ChecksumMismatchError(ValueError):
    """A chunk's bytes do not match the checksum its manifest records (raised by a
    reader that checks as it receives: `verifies_checksums`)."""


class ChunkReader(Protocol):
    def read(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        """The values of `tile` of `chunk`, in the tile's own shape."""
        ...


def from_bytes(data: Any, record: _format.LeafRecord, tile: _tiles.Tile) -> np.ndarray:
    """`tile`'s values from its bytes (`data`, at least `tile.nbytes` long)."""
    assert record.stored_dtype is not None
    dtype = np.dtype(record.stored_dtype)
    if dtype.itemsize * math.prod(tile.shape) != tile.nbytes:
        raise ValueError(
            f"A piece of {record.path} at {tile.region} records {tile.nbytes} bytes, but its "
            f"shape {tile.shape} of {dtype} needs {dtype.itemsize * math.prod(tile.shape)}."
        )
    return np.frombuffer(data, np.uint8, count=tile.nbytes).view(dtype).reshape(tile.shape)


def slab_offset(record: _format.LeafRecord, chunk: _format.ChunkRecord) -> int:
    if chunk.offset is None:
        raise ValueError(f"Chunk {chunk.index} of {record.path} has no slab offset.")
    return chunk.offset


def tile_view(
    slab: _slab.Reader, record: _format.LeafRecord, chunk: _format.ChunkRecord, tile: _tiles.Tile
) -> np.ndarray:
    """A tile as a view of a mapped slab (no copy: for a slab that cannot change
    meanwhile, such as a pinned step's)."""
    return from_bytes(
        slab.view(slab_offset(record, chunk) + tile.offset, tile.nbytes), record, tile
    )


def read_chunk(
    reader: ChunkReader,
    leaf: int,
    record: _format.LeafRecord,
    chunk: _format.ChunkRecord,
    timeout_s: float,
) -> np.ndarray:
    """A whole chunk in its own shape (C order), every tile checked against its checksum.

    Raises:
      ChecksumMismatchError: naming the first tile whose bytes do not match.
    """
    pieces = _tiles.tiles(record, chunk)
    out: np.ndarray | None = None
    origin: _chunking.Region = ()
    for tile in pieces:
        data = reader.read(leaf, record, chunk, tile, timeout_s)
        if not getattr(reader, "verifies_checksums", False) and not tile.matches(data):
            raise ChecksumMismatchError(
                f"checksum mismatch of {_tiles.describe(chunk, tile)} of {record.path}"
            )
        if len(pieces) == 1:
            return data
        if out is None:
            assert record.stored_shape is not None and record.chunk_shape is not None
            origin = _chunking.chunk_region(chunk.index, record.stored_shape, record.chunk_shape)
            out = np.empty([s.stop - s.start for s in origin], data.dtype)
        out[_chunking.relative(tile.region, origin)] = data
    assert out is not None
    return out


class SlabReader:
    """Chunks of a part in this host's memory tier, from its mapped slab (the caller
    pins the step while reading): views of a lent slab, mapped copy-on-write, which
    the restored arrays may keep; private copies from any other."""

    def __init__(self, slab: Path, lent: bool):
        self._slab = _slab.Reader(slab, private=lent)
        self._lent = lent

    def read(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        view = tile_view(self._slab, record, chunk, tile)
        return view if self._lent else view.copy()

    def prefetch(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tiles: Sequence[_tiles.Tile],
        timeout_s: float = 120.0,
    ) -> None:
        """Maps the pages of `tiles` of `chunk` before they are read: each run of them
        one after the other in the slab in one call (`_slab.Reader.populate`)."""
        if chunk.offset is None:
            return  # `read` says why
        for run in _tiles.runs(tiles):
            self._slab.populate(chunk.offset + run[0].offset, sum(t.nbytes for t in run))

    def finish(self) -> None:
        """The restore is done with the slab: unmapped off its path (`_slab.Reader.release`)."""
        self._slab.release()


class RangeReader:
    """Chunks of a part held by a peer: byte ranges of its slab, received over the
    network straight into a new buffer, aligned as the slab is (so that JAX on CPU
    may keep it without a copy)."""

    def __init__(self, fetch: Callable[[int, memoryview, float], None]):
        self._fetch = fetch  # (offset, into, timeout_s): fills `into`
        self._lock = threading.Lock()
        # Tiles received ahead (`prefetch`): (slab offset, nbytes) -> (the run's future
        # buffer, where the tile starts in it).
        self._started: dict[tuple[int, int], tuple[concurrent.futures.Future[np.ndarray], int]]
        self._started = {}

    def prefetch(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tiles: Sequence[_tiles.Tile],
        timeout_s: float = 120.0,
    ) -> None:
        """Starts receiving `tiles` of `chunk`: each run of them one after the other in
        the slab with one request (a tile a request costs a round trip each); `read`
        takes each, checked, and a failure here is raised by that `read`."""
        base = slab_offset(record, chunk)
        for run in _tiles.runs(tiles):
            if len(run) < 2:
                continue  # read when asked for: one request either way
            start, nbytes = base + run[0].offset, sum(t.nbytes for t in run)
            future = _AHEAD.submit(self._receive, start, nbytes, timeout_s)
            with self._lock:
                for t in run:
                    self._started[base + t.offset, t.nbytes] = (future, t.offset - run[0].offset)

    def _receive(self, offset: int, nbytes: int, timeout_s: float) -> np.ndarray:
        buf = aligned_empty(nbytes)
        self._fetch(offset, buf.data, timeout_s)
        return buf

    def read(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        offset = slab_offset(record, chunk) + tile.offset
        with self._lock:
            started = self._started.pop((offset, tile.nbytes), None)
        if started is not None:
            future, at = started
            return from_bytes(future.result(timeout=timeout_s)[at:], record, tile)
        return from_bytes(self._receive(offset, tile.nbytes, timeout_s), record, tile)


# Runs of a peer's tiles received ahead (`RangeReader.prefetch`): requests that wait on
# the network, a few at once.
_AHEAD: Final = _resources.SHARED.pool(4, "jaxckpt-range-ahead")


def joined(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """One uint8 view of `parts` where they are adjacent views of one buffer, in order
    (tiles read in place from one mapped slab); None where they are not."""
    owners: list[Any] = []
    for p in parts:
        while isinstance(p.base, np.ndarray):
            p = p.base
        owners.append(p if p.base is None else p.base)  # an array, or a buffer (a mapping)
    if any(o is not owners[0] for o in owners):
        return None
    if any(a.ctypes.data + a.nbytes != b.ctypes.data for a, b in itertools.pairwise(parts)):
        return None
    owner = owners[0]
    if isinstance(owner, np.ndarray):
        if not owner.flags.c_contiguous:
            return None
        whole = owner.reshape(-1).view(np.uint8)
    else:
        whole = np.frombuffer(owner, np.uint8)
    start = parts[0].ctypes.data - whole.ctypes.data
    return whole[start : start + sum(p.nbytes for p in parts)]


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer of `nbytes` that starts at a multiple of `_slab.ALIGN`."""
    raw = np.empty(nbytes + _slab.ALIGN, np.uint8)
    start = -raw.ctypes.data % _slab.ALIGN
    return raw[start : start + nbytes]


def aligned_buffers(sizes: Sequence[int]) -> list[np.ndarray]:
    """New uint8 buffers of `sizes` bytes, each at a multiple of `_slab.ALIGN`, carved
    out of one allocation: numpy asks the kernel for transparent huge pages from 4 MiB
    on, so a restore's regions are faulted in 2 MiB at a time where the kernel offers
    them (64 MiB of 2 MiB buffers took ~10 ms to fault in by 4 KiB pages here, ~3 ms
    as 16 MiB ones)."""
    offsets, total = _slab.layout(sizes)
    whole = aligned_empty(total)
    return [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
