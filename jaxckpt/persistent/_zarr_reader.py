"""The persistent tier's chunk reader: a persisted part's zarr3 arrays, a tile at a time.

The memory and peer tiers' readers are `memory/_readers` (a slab view, a peer's byte
range); this one reads what `_zarr` wrote, and gives the restore the same tiles.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from jaxckpt import _resources
from jaxckpt.format import _format, _tiles
from jaxckpt.memory import _readers
from jaxckpt.persistent import _zarr


class ZarrReader:
    """Chunks of a persisted part: its zarr3 arrays, a tile at a time (a tiled leaf's
    array keeps each tile as an inner chunk of zarr3's `sharding_indexed` codec).

    Where an array stores its tiles as their bytes (`_zarr.RawLayout`: no compression),
    a tile is one ranged read into a buffer of its own, which the restore checks
    against the manifest's CRC-32C and uses as it is: no decoding, no copy and no
    second checksum (the CRC-32C stored after it must be the manifest's too). Else
    tensorstore reads and decodes it (its `crc32c` codec checks it as well).
    """

    def __init__(self, part_kvstore: dict[str, Any]):
        self._part = part_kvstore
        self._arrays: dict[int, Any] = {}
        self._layouts: dict[int, _zarr.RawLayout | None] = {}
        self._raw: dict[int, _zarr.RawReads] = {}
        self._lock = threading.Lock()
        # Reads started ahead (`prefetch`), taken by `read`: (leaf, chunk, tile) -> future.
        self._started: dict[tuple[int, tuple[int, ...], int], Any] = {}
        # Each shard's index, read once: (leaf, chunk) -> its (offset, nbytes) rows, or
        # None where the shard is not stored.
        self._indexes: dict[
            tuple[int, tuple[int, ...]], concurrent.futures.Future[np.ndarray | None]
        ] = {}

    def _array(self, leaf: int, record: _format.LeafRecord, timeout_s: float) -> Any:
        array = self._arrays.get(leaf)
        if array is None:
            kvstore = _zarr.array_kvstore(self._part, record)
            array = _zarr.open_array(kvstore, record).result(timeout=timeout_s)
            self._layouts[leaf] = _zarr.raw_layout(array, record)
            self._raw[leaf] = _zarr.RawReads(kvstore)
            self._arrays[leaf] = array  # (set last: the others are there when it is)
        return array

    def _as_bytes(self, leaf: int, tile: _tiles.Tile) -> bool:
        """Whether `tile` is read as bytes: its array stores pieces of its shape so."""
        layout = self._layouts.get(leaf)
        return layout is not None and tile.shape == layout.inner

    def prefetch(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tiles: Sequence[_tiles.Tile],
        timeout_s: float = 120.0,
    ) -> None:
        """Starts reading `tiles` of `chunk`, all at once (ranged reads on a pool, or
        tensorstore's concurrent reads); `read` takes each. A failure here is raised by
        that `read`."""
        try:
            array = self._array(leaf, record, timeout_s)
        except Exception:
            return  # `read` opens it again and raises
        with self._lock:
            for tile in tiles:
                self._started[leaf, chunk.index, tile.index] = (
                    _RAW_READS.submit(self._read_bytes, leaf, record, chunk, tile, timeout_s)
                    if self._as_bytes(leaf, tile)
                    else array[tile.region].read()
                )

    def read(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        with self._lock:
            started = self._started.pop((leaf, chunk.index, tile.index), None)
        if started is None:
            array = self._array(leaf, record, timeout_s)
            if self._as_bytes(leaf, tile):
                return self._read_bytes(leaf, record, chunk, tile, timeout_s)
            started = array[tile.region].read()
        return np.asarray(started.result(timeout=timeout_s))

    def _read_bytes(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        """`tile` read as the bytes its array stores (`_as_bytes`), into a new aligned
        buffer; the fill value where its array does not store it."""
        layout, reads = self._layouts[leaf], self._raw[leaf]
        assert layout is not None and record.stored_dtype is not None
        key = _zarr.chunk_key(chunk.index)
        where = f"{_tiles.describe(chunk, tile)} of {record.path} ({key})"
        start, nbytes = 0, tile.nbytes + layout.trailer
        if layout.per_shard:
            index = self._shard_index(leaf, chunk, key, layout, where, timeout_s)
            if index is not None:
                origin = [s.start for s in tile.region]
                chunk_start = [
                    i * c for i, c in zip(chunk.index, record.chunk_shape or (), strict=True)
                ]
                start, stored = (int(x) for x in index[layout.position(chunk_start, origin)])
                if stored != nbytes and (start, stored) != (_zarr.MISSING, _zarr.MISSING):
                    raise ValueError(f"{where}: stored in {stored} bytes, not {nbytes}.")
            if index is None or start == _zarr.MISSING:
                return np.full(tile.shape, layout.fill, np.dtype(record.stored_dtype))
        buf = _readers.aligned_empty(nbytes)
        try:
            got = reads.read_into(key, start, buf, timeout_s)
        except FileNotFoundError:
            if layout.per_shard:
                raise
            return np.full(tile.shape, layout.fill, np.dtype(record.stored_dtype))
        if got != nbytes:
            raise ValueError(f"{where}: its file ends after {got} of its {nbytes} bytes.")
        stored_crc = int.from_bytes(buf[tile.nbytes :].tobytes(), "little")
        if layout.trailer and tile.crc32c is not None and stored_crc != tile.crc32c:
            raise _readers.ChecksumMismatchError(
                f"{where}: the CRC-32C stored after it is not the one its manifest records."
            )
        return _readers.from_bytes(buf, record, tile)

    def _shard_index(
        self,
        leaf: int,
        chunk: _format.ChunkRecord,
        key: str,
        layout: _zarr.RawLayout,
        where: str,
        timeout_s: float,
    ) -> np.ndarray | None:
        """The index of `chunk`'s shard, read once (None: the shard is not stored)."""
        with self._lock:
            future = self._indexes.get((leaf, chunk.index))
            mine = future is None
            if future is None:
                future = self._indexes[leaf, chunk.index] = concurrent.futures.Future()
        if not mine:
            return future.result(timeout=timeout_s)
        try:
            data = np.empty(layout.index_nbytes, np.uint8)
            try:
                got = self._raw[leaf].read_into(key, 0, data, timeout_s)
            except FileNotFoundError:
                index = None
            else:
                index = _zarr.shard_index(data[:got], layout, where)
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(index)
        return index


# Tiles of persisted arrays read ahead as bytes (`ZarrReader.prefetch`): reads that wait
# on a disk or an object store, several at once.
_RAW_READS: Final = _resources.SHARED.pool(8, "jaxckpt-zarr-bytes")
