"""Chunk-grid arithmetic: pure functions over shapes and index tuples."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

Region = tuple[slice, ...]


def normalize_region(region: Sequence[slice], shape: Sequence[int]) -> Region:
    """Turns slices that may hold None into explicit [start, stop) slices."""
    out = []
    for s, n in zip(region, shape, strict=True):
        start, stop = s.start, s.stop
        if s.step is None and start is not None and stop is not None and 0 <= start <= stop <= n:
            out.append(s)  # explicit already (the common case: fast)
            continue
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"Strided regions are not supported (got {s}).")
        out.append(slice(start, stop))
    return tuple(out)


def region_key(region: Region) -> tuple[tuple[int, int], ...]:
    """A hashable form of an explicit region (slices are unhashable before 3.12)."""
    return tuple((s.start, s.stop) for s in region)


def chunk_index_of(
    region: Sequence[slice], shape: Sequence[int], chunk_shape: Sequence[int]
) -> tuple[int, ...]:
    """The grid index of the chunk that is exactly `region`.

    Raises:
      ValueError: if `region` does not start on the chunk grid.
    """
    idx = []
    for s, c in zip(normalize_region(region, shape), chunk_shape, strict=True):
        if s.start % c:
            raise ValueError(
                f"Shard starting at {s.start} is not aligned to the chunk size {c}; "
                "jaxckpt needs every shard of an array to have the same shape."
            )
        idx.append(s.start // c)
    return tuple(idx)


def chunk_region(index: Sequence[int], shape: Sequence[int], chunk_shape: Sequence[int]) -> Region:
    """The region of the array covered by the chunk at grid `index`."""
    return tuple(
        slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk_shape, shape, strict=True)
    )


def chunk_shape_at(
    index: Sequence[int], shape: Sequence[int], chunk_shape: Sequence[int]
) -> tuple[int, ...]:
    """The shape of the chunk at grid `index` (edge chunks are cut at the array's end)."""
    return tuple(min(c, n - i * c) for i, c, n in zip(index, chunk_shape, shape, strict=True))


def is_chunk(
    region: Sequence[slice], index: Sequence[int], shape: Sequence[int], chunk_shape: Sequence[int]
) -> bool:
    """Whether explicit `region` is exactly the chunk at grid `index`."""
    return all(
        s.start == i * c and s.stop == min((i + 1) * c, n)
        for s, i, c, n in zip(region, index, chunk_shape, shape, strict=True)
    )


def chunks_overlapping(
    region: Sequence[slice], shape: Sequence[int], chunk_shape: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """Grid indices of every chunk that intersects `region` (empty regions: none)."""
    region = normalize_region(region, shape)
    ranges = []
    for s, c in zip(region, chunk_shape, strict=True):
        if s.stop <= s.start:
            return
        ranges.append(range(s.start // c, (s.stop - 1) // c + 1))
    yield from itertools.product(*ranges)


def intersect(a: Region, b: Region) -> Region:
    """The intersection of two explicit regions (may be empty)."""
    return tuple(
        slice(max(x.start, y.start), max(max(x.start, y.start), min(x.stop, y.stop)))
        for x, y in zip(a, b, strict=True)
    )


def relative(inner: Region, outer: Region) -> Region:
    """`inner` expressed in the coordinates of `outer` (which contains it)."""
    return tuple(
        slice(i.start - o.start, i.stop - o.start) for i, o in zip(inner, outer, strict=True)
    )
