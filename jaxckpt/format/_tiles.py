"""Tiles: a saved chunk cut along every dimension, each piece with its own checksum.

A chunk is a saved shard. A restore onto another mesh needs parts of chunks (a
finer split of an axis, the other axis sharded); verified whole, a chunk would be
read whole. So a chunk of a large leaf is cut into tiles on a regular grid (its
`LeafRecord.tile_shape`; tiles at a chunk's end are cut short), laid out one after
the other in the grid's C order, each tile in C order, and each has its own
CRC-32C (`ChunkRecord.tiles`). A tile is one contiguous byte range wherever the
chunk is: in a slab (memory and peer tiers: one view, one ranged request) and in
the persistent tier's zarr3 array (an inner chunk of zarr3's `sharding_indexed`
codec: one ranged read). A chunk without tiles (small leaves, steps saved before
tiles) is one tile: the whole chunk with its own checksum.

The tile shape splits each dimension into a power of two of at most
`MAX_SPLITS` pieces, largest tile extent first, keeping tiles of at least
`tile_bytes` bytes and every split even: the common re-shardings (a finer split
of either axis by up to `MAX_SPLITS`, the other axis sharded) fall on tile
boundaries. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from jaxckpt.format import _checksum, _chunking, _format

MAX_SPLITS: Final = 8  # per dimension: a mesh 8x finer along any axis reads no more
# No tile of a tiled chunk is smaller than this. `jaxckpt bench --reshard --directions
# same_2,finer_2_8 --tile-kib K` (64 MiB restored 2 -> 8 shards from memory): 256 KiB
# tiles 23.9 ms (a strided copy of short rows, 4x the tiles), 1 MiB 18.8 ms, 4 MiB
# 17.4 ms, whole chunks 16.9 ms; smaller tiles read less onto much finer meshes of small
# chunks.
DEFAULT_TILE_BYTES: Final = 1 << 20


def tile_shape_for(
    chunk_shape: Sequence[int], itemsize: int, tile_bytes: int, splittable: int | None = None
) -> tuple[int, ...] | None:
    """The tile shape of chunks of `chunk_shape`, or None where the chunk stays whole.

    Args:
      chunk_shape: the saved chunk's shape (stored: a typed key's data dims last).
      itemsize: bytes per element.
      tile_bytes: the smallest tile: no dimension is split further once halving a
        tile would make it smaller.
      splittable: how many leading dimensions may be split (None: all); a typed
        key's trailing key-data dimensions never are.
    """
    n = len(chunk_shape) if splittable is None else splittable
    splits = [1] * len(chunk_shape)
    tile = list(chunk_shape)
    nbytes = itemsize * math.prod(chunk_shape)
    while nbytes // 2 >= tile_bytes:
        candidates = [d for d in range(n) if tile[d] % 2 == 0 and splits[d] < MAX_SPLITS]
        if not candidates:
            break
        d = max(candidates, key=lambda d: (tile[d], -d))  # the largest extent, earliest
        splits[d] *= 2
        tile[d] //= 2
        nbytes //= 2
    return None if splits == [1] * len(chunk_shape) else tuple(tile)


def with_tile_shapes(
    leaves: tuple[_format.LeafRecord, ...], tile_bytes: int
) -> tuple[_format.LeafRecord, ...]:
    """`leaves` with the tile shape of each array leaf set (`tile_shape_for`)."""
    out = []
    for r in leaves:
        if r.kind in (_format.ARRAY, _format.NUMPY) and r.chunk_shape and r.stored_dtype:
            key_dims = len(r.stored_shape or ()) - len(r.shape or ())
            shape = tile_shape_for(
                r.chunk_shape,
                np.dtype(r.stored_dtype).itemsize,
                tile_bytes,
                len(r.chunk_shape) - key_dims,
            )
            if shape is not None:
                r = dataclasses.replace(r, tile_shape=shape)
        out.append(r)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One tile of one chunk: where it is in the array and in the chunk's bytes.

    Attributes:
      index: its place in the chunk's tile grid (C order gives the byte order).
      region: what it covers, in the stored array's coordinates.
      shape: its shape (cut short at the chunk's end).
      offset: where its bytes start, from the chunk's first byte.
      nbytes: its size.
      crc32c: CRC-32C of its bytes (the chunk's own, for a chunk without tiles).
      crc32: zlib CRC-32 of a whole chunk saved by format versions 1-2.
    """

    index: int
    region: _chunking.Region
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int | None
    crc32: int | None = None

    def matches(self, data: object) -> bool:
        """Whether `data` (this tile's bytes) matches its checksum."""
        return _checksum.matches(self.crc32c, self.crc32, data)


@functools.lru_cache(maxsize=4096)
def _grid(
    chunk_shape: tuple[int, ...], tile_shape: tuple[int, ...], itemsize: int
) -> tuple[tuple[_chunking.Region, tuple[int, ...], int, int], ...]:
    """(region within the chunk, shape, byte offset, nbytes) of each tile, C order."""
    out, offset = [], 0
    grid = [range(0, n, t) for n, t in zip(chunk_shape, tile_shape, strict=True)]
    for starts in np.ndindex(*(len(g) for g in grid)):
        region = tuple(
            slice(g[i], min(g[i] + t, n))
            for g, i, t, n in zip(grid, starts, tile_shape, chunk_shape, strict=True)
        )
        shape = tuple(s.stop - s.start for s in region)
        nbytes = itemsize * math.prod(shape)
        out.append((region, shape, offset, nbytes))
        offset += nbytes
    return tuple(out)


def regions_in_chunk(
    chunk_shape: Sequence[int], tile_shape: Sequence[int] | None
) -> list[_chunking.Region]:
    """The tiles of a chunk of `chunk_shape` as regions of the chunk, in byte order."""
    if tile_shape is None:
        return [tuple(slice(0, n) for n in chunk_shape)]
    return [g[0] for g in _grid(tuple(chunk_shape), tuple(tile_shape), 1)]


def byte_sizes(
    chunk_shape: Sequence[int], tile_shape: Sequence[int] | None, itemsize: int
) -> list[int] | None:
    """The byte sizes of a chunk's tiles, in byte order (None for a chunk saved whole)."""
    if tile_shape is None:
        return None
    return [g[3] for g in _grid(tuple(chunk_shape), tuple(tile_shape), itemsize)]


def chunk_record(
    record: _format.LeafRecord,
    index: tuple[int, ...],
    nbytes: int,
    offset: int,
    crcs: Sequence[int],
) -> _format.ChunkRecord:
    """The record of a chunk of `record`'s leaf at `offset` in its slab whose tiles have
    `crcs` (one: a chunk saved whole)."""
    if record.tile_shape is None:
        (crc,) = crcs
        return _format.ChunkRecord(index, nbytes, crc32c=crc, offset=offset)
    return _format.ChunkRecord(index, nbytes, offset=offset, tiles=tuple(crcs))


def tiles(record: _format.LeafRecord, chunk: _format.ChunkRecord) -> list[Tile]:
    """The tiles of `chunk` of the leaf of `record`, in byte order; a chunk saved
    without tiles is one."""
    where: _chunking.Region = ()
    if record.stored_shape is not None and record.chunk_shape is not None:
        where = _chunking.chunk_region(chunk.index, record.stored_shape, record.chunk_shape)
    shape = tuple(s.stop - s.start for s in where)
    if record.tile_shape is None or chunk.tiles is None:
        # (A record without a shape, such as a bare one in a pushed manifest, still
        # says where its one tile's bytes are.)
        return [Tile(0, where, shape, 0, chunk.nbytes, chunk.crc32c, chunk.crc32)]
    if not where:
        raise ValueError(f"Chunk {chunk.index} of {record.path} has tiles but no chunk grid.")
    itemsize = np.dtype(record.stored_dtype).itemsize
    grid = _grid(shape, record.tile_shape, itemsize)
    if len(grid) != len(chunk.tiles):
        raise ValueError(
            f"Chunk {chunk.index} of {record.path} records {len(chunk.tiles)} tile checksums, "
            f"but its shape {shape} cut into tiles of {record.tile_shape} makes {len(grid)}."
        )
    origin = [s.start for s in where]
    return [
        Tile(
            k,
            tuple(slice(o + s.start, o + s.stop) for o, s in zip(origin, region, strict=True)),
            tshape,
            offset,
            nbytes,
            crc,
        )
        for k, ((region, tshape, offset, nbytes), crc) in enumerate(
            zip(grid, chunk.tiles, strict=True)
        )
    ]


def overlapping(tiles_of_chunk: Sequence[Tile], region: _chunking.Region) -> list[Tile]:
    """The tiles among `tiles_of_chunk` that intersect explicit `region`."""
    return [
        t
        for t in tiles_of_chunk
        if all(
            max(a.start, b.start) < min(a.stop, b.stop)
            for a, b in zip(t.region, region, strict=True)
        )
    ]


def runs(tiles: Sequence[Tile]) -> list[list[Tile]]:
    """`tiles` (of one chunk, in byte order) cut into runs whose bytes follow each other."""
    out: list[list[Tile]] = []
    for t in tiles:
        if out and out[-1][-1].offset + out[-1][-1].nbytes == t.offset:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def is_run(found: Sequence[Tile], region: _chunking.Region) -> bool:
    """Whether `found` (tiles of one chunk, in byte order) are exactly `region`, one after
    the other in C order: tiles that split the first dimension only, consecutive along
    it. Their bytes are then `region`'s, contiguous in any copy of the chunk."""
    if len(found) < 2 or any(t.region[1:] != region[1:] for t in found):
        return False
    rows = [t.region[0] for t in found] if found[0].region else []
    return (
        bool(rows)
        and rows[0].start == region[0].start
        and rows[-1].stop == region[0].stop
        and all(a.stop == b.start for a, b in itertools.pairwise(rows))
        and all(a.offset + a.nbytes == b.offset for a, b in itertools.pairwise(found))
    )


def damaged(record: _format.LeafRecord, chunk: _format.ChunkRecord, data: Any) -> int | None:
    """The first tile of `chunk` whose bytes in `data` (the chunk's bytes as laid out in
    a slab: an array or a buffer) fail their checksum; None where every tile matches."""
    flat = (
        data.reshape(-1).view(np.uint8)
        if isinstance(data, np.ndarray)
        else np.frombuffer(data, np.uint8)
    )
    for t in tiles(record, chunk):
        if not t.matches(flat[t.offset : t.offset + t.nbytes]):
            return t.index
    return None


def describe(chunk: _format.ChunkRecord, tile: Tile) -> str:
    """`chunk (i, j)`, or `tile k of chunk (i, j)` for a chunk saved in tiles."""
    return (
        f"chunk {chunk.index}"
        if chunk.tiles is None
        else f"tile {tile.index} of chunk {chunk.index}"
    )
