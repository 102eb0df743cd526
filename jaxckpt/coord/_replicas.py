"""Data-parallel replicas share a save: who snapshots which slice of a replicated shard.

In an HSDP, multi-slice or plain data-parallel layout every shard of a global
array is held by R processes at once. Instead of the `replica_id == 0` process
saving all of it, each of the R processes saves a distinct, deterministic 1/R:

- the leaf's chunk grid is the shard cut into `slices` chunks along one
  dimension (`cut`): the first dimension R divides, else the one whose
  smallest divisor >= R splits most evenly, else (every dimension shorter
  than R) one chunk per index of the longest; shards smaller than
  `MIN_CHUNK_BYTES` a replica are not cut, and zero-size arrays never are;
- the chunks of a shard go, in contiguous runs, to its holders (the distinct
  processes that hold it, in process order), the runs rotated by the leaf and
  shard so that a leftover chunk falls on a different holder each time;
- a shard too small to cut (under `MIN_CHUNK_BYTES` a replica: biases, norms,
  scalars) is saved whole by every one of its holders (`every_holder_saves`):
  each keeps its own copy in its own memory tier, so that a restart reads it
  from there even where more processes hold it than a part has copies (a
  fully replicated scalar on a dp x fsdp mesh); its bytes are negligible, and
  every holder pays them alike.

Everything is computed from the sharding alone, so every process agrees
without an exchange, and a single-replica leaf (R = 1) keeps the grid and the
owners it always had: the shard is one chunk, saved by its only process.
`partners` says which processes hold the same shards in other replicas, for
the replica-aware placement (`_placement.place_replicas(preferred=...)`).

`shares` gives a process the buffers of the chunks it saves.

How a restore's replicas share their read is `_read_layout`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import jax

from jaxckpt.format import _chunking

# A shard is cut only while each of its R slices keeps at least this many bytes: a
# chunk costs a manifest record, a CRC and a slab alignment, which small leaves
# (biases, norms, counters) would pay R times for nothing. Such a shard is saved
# whole by every one of its holders (`every_holder_saves`).
MIN_CHUNK_BYTES: Final = 64 << 10

RegionKey = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Split:
    """How the shards of one leaf are shared among their replicas.

    Attributes:
      chunk_shape: the leaf's chunk grid (the shard shape, `cut` divided by `slices`).
      replicas: R, the fewest distinct processes that hold any one shard.
      cut: the dimension the shards are cut along; None if not cut.
      slices: chunks per shard along `cut` (1: not cut).
      chunks: process -> the chunk indices it saves.
      regions: each shard's region -> the distinct processes that hold it.
    """

    chunk_shape: tuple[int, ...]
    replicas: int
    cut: int | None
    slices: int
    chunks: Mapping[int, tuple[tuple[int, ...], ...]]
    regions: Mapping[RegionKey, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def choose_cut(shard_shape: Sequence[int], replicas: int, itemsize: int) -> tuple[int | None, int]:
    """(dimension, chunks per shard) of a shard held by `replicas` processes (pure)."""
    nbytes = math.prod(shard_shape) * itemsize
    if replicas <= 1 or nbytes == 0 or nbytes < replicas * MIN_CHUNK_BYTES:
        return None, 1
    for d, n in enumerate(shard_shape):
        if n % replicas == 0:
            return d, replicas
    best: tuple[float, int, int] | None = None  # (imbalance, k, dim)
    for d, n in enumerate(shard_shape):
        k = next((k for k in range(replicas, n + 1) if n % k == 0), None)
        if k is None or nbytes // k < MIN_CHUNK_BYTES:
            continue
        imbalance = math.ceil(k / replicas) * replicas / k
        if best is None or imbalance < best[0]:
            best = (imbalance, k, d)
    if best is not None:
        return best[2], best[1]
    # Every dimension shorter than R: one chunk per index of the longest, if not too small.
    longest = max(range(len(shard_shape)), key=lambda d: (shard_shape[d], -d), default=None)
    if longest is None or shard_shape[longest] <= 1:
        return None, 1
    if nbytes // shard_shape[longest] < MIN_CHUNK_BYTES:
        return None, 1
    return longest, shard_shape[longest]


def every_holder_saves(shard_shape: Sequence[int], replicas: int, itemsize: int) -> bool:
    """Whether a shard held by `replicas` processes is saved whole by each of them (pure):
    one too small to cut (`choose_cut`), and not empty.

    Saved once, such a shard would reach the holders that did not save it (and hold
    no copy of the saver's part) over the network on every restore; saved by each,
    it is read from each one's own memory tier. It costs under `replicas` x
    `MIN_CHUNK_BYTES` a holder, the same on every holder.
    """
    nbytes = math.prod(shard_shape) * itemsize
    return replicas > 1 and 0 < nbytes < replicas * MIN_CHUNK_BYTES


def owned_slices(slices: int, holders: int, rotation: int) -> list[range]:
    """For each holder position, the run of chunk positions 0..slices-1 it saves (pure).

    Contiguous runs of floor or ceil(slices / holders) chunks; a run of one chunk
    more starts at holder `rotation`, so the extra chunks rotate with it.
    """
    base, extra = divmod(slices, holders)
    sizes = [base + (1 if (p - rotation) % holders < extra else 0) for p in range(holders)]
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def split_regions(
    shape: Sequence[int],
    shard_shape: Sequence[int],
    regions: Mapping[RegionKey, Sequence[int]],
    itemsize: int,
    leaf: int = 0,
) -> Split:
    """The split of a leaf, from its shard grid and who holds each shard (pure).

    Args:
      shape: the stored global shape.
      shard_shape: the stored shard shape (every shard has it, edge shards cut).
      regions: each shard's region -> the processes that hold it (any order,
        repeats allowed: a process holding a shard on two devices counts once).
      itemsize: bytes per element.
      leaf: the leaf's index in the tree, which rotates who saves leftovers.
    """
    holders = {key: sorted(set(ps)) for key, ps in regions.items()}
    replicas = min((len(h) for h in holders.values()), default=1)
    cut, slices = choose_cut(shard_shape, replicas, itemsize)
    every = every_holder_saves(shard_shape, replicas, itemsize)
    chunk_shape = [max(1, n) for n in shard_shape]  # zarr chunks are never empty
    if cut is not None:
        chunk_shape[cut] = shard_shape[cut] // slices
    chunks: dict[int, list[tuple[int, ...]]] = {}
    for ordinal, key in enumerate(sorted(holders)):
        procs = holders[key]
        base = tuple(start // c for (start, _), c in zip(key, chunk_shape, strict=True))
        if cut is None or shape[cut] == 0:
            for p in procs if every else [procs[(leaf + ordinal) % len(procs)]]:
                chunks.setdefault(p, []).append(base)
            continue
        first = base[cut]
        stop = key[cut][1]
        count = min(slices, -(-(stop - key[cut][0]) // chunk_shape[cut]))  # edge shards
        runs = owned_slices(count, len(procs), leaf + ordinal)
        for p, run in zip(procs, runs, strict=True):
            for j in run:
                chunks.setdefault(p, []).append((*base[:cut], first + j, *base[cut + 1 :]))
    return Split(
        tuple(chunk_shape),
        replicas,
        cut,
        slices,
        {p: tuple(cs) for p, cs in chunks.items()},
        {key: tuple(procs) for key, procs in holders.items()},
    )


def regions_of(
    sharding: jax.sharding.Sharding, shape: Sequence[int], stored_shape: Sequence[int]
) -> dict[RegionKey, list[int]]:
    """Each shard's region of the stored array -> the processes of its devices (trailing
    stored dimensions, a typed key's data, are whole)."""
    tail = [(0, n) for n in stored_shape[len(shape) :]]
    out: dict[RegionKey, list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        region = _chunking.normalize_region(index or (), shape)
        key = _chunking.region_key(region) + tuple(tail)
        out.setdefault(key, []).append(int(device.process_index))  # type: ignore[attr-defined]
    return out


def split_of(
    sharding: jax.sharding.Sharding,
    shape: Sequence[int],
    stored_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    leaf: int,
) -> Split:
    """`split_regions` of a global array leaf with this sharding."""
    return split_regions(
        stored_shape, shard_shape, regions_of(sharding, shape, stored_shape), itemsize, leaf
    )


def partners(held: Sequence[Mapping[int, Any]], process_count: int) -> tuple[tuple[int, ...], ...]:
    """For each process, the others that hold the same replicated shards (pure).

    Args:
      held: one mapping a replicated leaf: process -> a key of the shard it
        holds (its region); processes that hold none are absent.
      process_count: how many processes there are.

    Returns:
      partners[p]: the processes that hold exactly the shards `p` holds (in
      other replicas), in ring order after `p`; empty where none does.
    """
    signature: list[list[Any]] = [[] for _ in range(process_count)]
    for i, leaf in enumerate(held):
        for p, key in leaf.items():
            signature[p].append((i, key))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for p, sig in enumerate(signature):
        if sig:
            groups.setdefault(tuple(sig), []).append(p)
    out: list[tuple[int, ...]] = [() for _ in range(process_count)]
    for members in groups.values():
        for k, p in enumerate(members):
            out[p] = tuple(members[k + 1 :] + members[:k])
    return tuple(out)


def partners_of(splits: Iterable[Split], process_count: int) -> tuple[tuple[int, ...], ...]:
    """`partners` of a tree's replicated leaves (their splits): which shards each process
    holds, leaf by leaf."""
    held = []
    for split in splits:
        by_process: dict[int, list[Any]] = {}
        for key, procs in split.regions.items():
            for p in set(procs):
                by_process.setdefault(p, []).append(key)
        held.append({p: tuple(sorted(keys)) for p, keys in by_process.items()})
    return partners(held, process_count)


def shares(
    data: jax.Array, record: Any, split: Split, process_index: int
) -> list[tuple[jax.Array, tuple[int, ...], _chunking.Region | None]]:
    """(shard buffer, chunk index, the chunk's region within the shard; None: all of it)
    of each chunk of a replicated leaf (`record`: its `_format.LeafRecord`) that
    process `process_index` saves."""
    shape, chunk_shape = record.stored_shape, record.chunk_shape
    assert shape is not None and chunk_shape is not None
    shards: dict[RegionKey, Any] = {}
    for shard in data.addressable_shards:
        key = _chunking.region_key(_chunking.normalize_region(shard.index, shape))
        shards.setdefault(key, shard)
    out = []
    for index in split.chunks.get(process_index, ()):
        where = _chunking.chunk_region(index, shape, chunk_shape)
        for key, shard in shards.items():
            if all(a <= w.start and w.stop <= b for w, (a, b) in zip(where, key, strict=True)):
                outer = tuple(slice(a, b) for a, b in key)
                whole = _chunking.region_key(where) == key
                out.append((shard.data, index, None if whole else _chunking.relative(where, outer)))
                break
        else:  # the split is computed from the same sharding: it names only held shards
            raise AssertionError(f"process {process_index} holds no shard of chunk {index}")
    return out
