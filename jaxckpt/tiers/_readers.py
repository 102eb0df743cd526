"""Chunk readers: one per (source, part), whatever the tier.

A tier is just a way to get a chunk's bytes: a view of a slab in this host's
memory tier, a byte range of a peer's slab, or a read of a persisted zarr3
array through tensorstore. Readers never block longer than their timeout.

A slab reader returns a view of the mapped slab (no copy). The restore pins
the step in the memory tier while it reads, so the slab cannot be retired
meanwhile, and lends the slab first (`MemoryTier.lend`): a lent slab is never
written in place again, so the restored arrays may keep its pages, mapped
copy-on-write (on CPU they do: restoring from memory copies nothing). A slab
that could not be lent gives private copies, as every other reader does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxckpt.format import _chunking, _format
from jaxckpt.tiers import _slab, _zarr


class ChecksumMismatchError(ValueError):
    """A chunk's bytes do not match the checksum its manifest records (raised by a
    reader that checks as it receives: `verifies_checksums`)."""


class ChunkReader(Protocol):
    def read(
        self, leaf: int, record: _format.LeafRecord, chunk: _format.ChunkRecord, timeout_s: float
    ) -> np.ndarray:
        """The chunk's values (a private copy), in the chunk's own shape."""
        ...


def from_bytes(data: Any, record: _format.LeafRecord, chunk: _format.ChunkRecord) -> np.ndarray:
    assert (
        record.stored_dtype is not None
        and record.stored_shape is not None
        and record.chunk_shape is not None
    )
    shape = _chunking.chunk_shape_at(chunk.index, record.stored_shape, record.chunk_shape)
    dtype = np.dtype(record.stored_dtype)
    if dtype.itemsize * math.prod(shape) != chunk.nbytes:
        raise ValueError(
            f"Chunk {chunk.index} of {record.path} records {chunk.nbytes} bytes, but its "
            f"shape {shape} of {dtype} needs {dtype.itemsize * math.prod(shape)}."
        )
    return np.frombuffer(data, np.uint8, count=chunk.nbytes).view(dtype).reshape(shape)


def slab_offset(record: _format.LeafRecord, chunk: _format.ChunkRecord) -> int:
    if chunk.offset is None:
        raise ValueError(f"Chunk {chunk.index} of {record.path} has no slab offset.")
    return chunk.offset


def chunk_view(
    slab: _slab.Reader, record: _format.LeafRecord, chunk: _format.ChunkRecord
) -> np.ndarray:
    """A chunk as a view of a mapped slab (no copy: for a slab that cannot change
    meanwhile, such as a pinned step's)."""
    return from_bytes(slab.view(slab_offset(record, chunk), chunk.nbytes), record, chunk)


class SlabReader:
    """Chunks of a part in this host's memory tier, from its mapped slab (the caller
    pins the step while reading): views of a lent slab, mapped copy-on-write, which
    the restored arrays may keep; private copies from any other."""

    def __init__(self, slab: Path, lent: bool):
        self._slab = _slab.Reader(slab, private=lent)
        self._lent = lent

    def read(
        self, leaf: int, record: _format.LeafRecord, chunk: _format.ChunkRecord, timeout_s: float
    ) -> np.ndarray:
        view = chunk_view(self._slab, record, chunk)
        return view if self._lent else view.copy()


class RangeReader:
    """Chunks of a part held by a peer: byte ranges of its slab, received over the
    network straight into a new buffer, aligned as the slab is (so that JAX on CPU
    may keep it without a copy)."""

    def __init__(self, fetch: Callable[[int, memoryview, float], None]):
        self._fetch = fetch  # (offset, into, timeout_s): fills `into`

    def read(
        self, leaf: int, record: _format.LeafRecord, chunk: _format.ChunkRecord, timeout_s: float
    ) -> np.ndarray:
        buf = aligned_empty(chunk.nbytes)
        self._fetch(slab_offset(record, chunk), buf.data, timeout_s)
        return from_bytes(buf, record, chunk)


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer of `nbytes` that starts at a multiple of `_slab.ALIGN`."""
    raw = np.empty(nbytes + _slab.ALIGN, np.uint8)
    start = -raw.ctypes.data % _slab.ALIGN
    return raw[start : start + nbytes]


class ZarrReader:
    """Chunks of a persisted part: its zarr3 arrays read through tensorstore."""

    def __init__(self, part_kvstore: dict[str, Any]):
        self._part = part_kvstore
        self._arrays: dict[int, Any] = {}

    def read(
        self, leaf: int, record: _format.LeafRecord, chunk: _format.ChunkRecord, timeout_s: float
    ) -> np.ndarray:
        assert record.stored_shape is not None and record.chunk_shape is not None
        if leaf not in self._arrays:
            kvstore = _zarr.array_kvstore(self._part, record)
            self._arrays[leaf] = _zarr.open_array(kvstore, record).result(timeout=timeout_s)
        region = _chunking.chunk_region(chunk.index, record.stored_shape, record.chunk_shape)
        return np.asarray(self._arrays[leaf][region].read().result(timeout=timeout_s))
