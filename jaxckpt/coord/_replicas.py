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

On restore, `read_layout` says how the R processes that hold a target region
share its read (each a distinct part, `reshard` carrying the parts to the
others): an even split where a dimension divides, a padded one where none does,
and, reading from persistent storage onto another split, parts of whole saved
chunks, so that no chunk is read by two processes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import jax
import numpy as np

from jaxckpt import _resources
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


def reshard(
    arrays: list[jax.Array],
    shardings: list[jax.sharding.Sharding],
    layouts: Sequence[ReadLayout | None] | None = None,
) -> Sequence[jax.Array]:
    """`arrays` laid out with `shardings`, by one compiled program: a collective over the
    replica axes, each process contributing the 1/R it read (`read_layout`), the
    padding of a padded read layout dropped on the way.
    Collective: every process calls it with the same leaves."""
    key = (tuple(shardings), tuple(layouts or [None] * len(arrays)))
    fn = _RESHARD.get(key)
    if fn is None:
        if len(_RESHARD) >= 8:
            _RESHARD.pop(next(iter(_RESHARD)), None)
        unpads = [(lambda x: x) if lay is None else lay.unpad for lay in key[1]]
        fn = _RESHARD[key] = jax.jit(
            lambda *xs: tuple(f(x) for f, x in zip(unpads, xs, strict=True)),
            out_shardings=key[0],
        )
    return fn(*arrays)


# The reshard of the last few trees (its compiled programs are kept with it).
_RESHARD: dict[Any, Any] = _resources.SHARED.cache({})


@dataclasses.dataclass(frozen=True)
class ReadLayout:
    """How the processes that hold one region of a target sharding (its replicas across
    processes) read it, each a distinct part, before `reshard` carries the parts to
    the others.

    Where a dimension splits evenly (`_even_dims`) the read array is the stored
    array itself. Where none does, it is the stored array padded along `dim`: each
    of the `blocks` target shards along `dim` (`size` long) is cut into slots of
    `slot` (whole saved chunks where the chunks tile the shard), one a replica,
    the last ones short or empty, filled out with zeros that `unpad` drops.

    Attributes:
      sharding: the read array's sharding (the target's mesh).
      shape: the read array's shape.
      dim: the padded dimension; None: not padded.
      blocks: target shards along `dim`.
      slot: each replica's slot along `dim`, padding included.
      size: a target shard's extent along `dim`.
    """

    sharding: jax.sharding.NamedSharding
    shape: tuple[int, ...]
    dim: int | None = None
    blocks: int = 1
    slot: int = 0
    size: int = 0

    def stored_region(self, region: _chunking.Region) -> _chunking.Region:
        """The part of the stored array that `region` of the read array holds (empty
        along `dim` for a slot of padding only)."""
        d = self.dim
        if d is None:
            return region
        width = self.shape[d] // self.blocks
        block, offset = divmod(region[d].start, width)
        start = block * self.size + min(offset, self.size)
        stop = block * self.size + min(offset + region[d].stop - region[d].start, self.size)
        return (*region[:d], slice(start, stop), *region[d + 1 :])

    def pad(self, data: np.ndarray, region: _chunking.Region) -> np.ndarray:
        """`data` (read for `stored_region(region)`) filled out with zeros to `region`."""
        d = self.dim
        want = region[d].stop - region[d].start if d is not None else 0
        if d is None or data.shape[d] == want:
            return data
        out = np.zeros((*data.shape[:d], want, *data.shape[d + 1 :]), dtype=data.dtype)
        out[(slice(None),) * d + (slice(0, data.shape[d]),)] = data
        return out

    def unpad(self, x: jax.Array) -> jax.Array:
        """The stored array from the read array (traced inside `reshard`)."""
        d = self.dim
        if d is None:
            return x
        blocks = x.reshape(
            *x.shape[:d], self.blocks, self.shape[d] // self.blocks, *x.shape[d + 1 :]
        )
        kept = jax.lax.slice_in_dim(blocks, 0, self.size, axis=d + 1)
        return kept.reshape(*x.shape[:d], self.blocks * self.size, *x.shape[d + 1 :])


def read_layout(
    sharding: jax.sharding.Sharding,
    stored_shape: Sequence[int],
    chunk_shape: Sequence[int] | None = None,
    whole_chunks: bool = False,
    processes: np.ndarray | None = None,
) -> ReadLayout | None:
    """How a restore onto `sharding` reads each region once across its replicas (pure);
    None where they cannot share the read (no replication across processes, not a
    NamedSharding, a zero-size or 0-d array, a target uneven already, a target shard
    that is one saved chunk where no dimension divides).

    Where a dimension divides with the unused mesh axes along which processes differ
    added to its own (minor), the target's sharding so extended (`_even_dims`): each
    replica holds a distinct 1/R of every region; else padded (`ReadLayout`) along the
    dimension with the most saved chunks (`chunk_shape`) in a target shard, each
    replica reading a contiguous run of whole chunks: every byte is read once, not
    once a replica.

    `whole_chunks` (the restore reads from persistent storage): an even split whose
    parts cut a saved chunk between processes (restored onto another dp/fsdp split)
    has each of them read that chunk whole (a chunk is read and checked whole).
    There the first even dimension that cuts no chunk between processes
    (`_shares_chunks`) is taken, else the target's mesh with the replica axes cut
    into factors, each on a dimension it leaves in whole chunks (`_refined`: no
    padding, the reshard a plain collective), else the padded layout where its
    slots are whole chunks, else the layout as without it. On the split the chunks
    were saved from, the first even dimension is the one the save cut, its parts
    the saved chunks: the layout is the same either way.

    `processes`: the process of each device of the mesh, shaped as it (None: the
    devices' own), to ask about a job other than this one.
    """
    found = _spread(sharding, stored_shape, processes)
    if found is None:
        return None
    mesh, spec, across = found
    evens = _even_dims(mesh, spec, across, stored_shape)
    if whole_chunks and chunk_shape is not None:
        procs = _processes(mesh) if processes is None else processes
        for d in evens:
            if not _shares_chunks(mesh, procs, spec, across, d, stored_shape[d], chunk_shape[d]):
                return ReadLayout(_named(sharding, spec, d, across), tuple(stored_shape))
        refined = _refined(sharding, found, stored_shape, chunk_shape)
        if refined is not None:
            return ReadLayout(refined, tuple(stored_shape))
        padded = _padded(sharding, found, stored_shape, chunk_shape)
        if padded is not None and padded.size % chunk_shape[padded.dim or 0] == 0:
            return padded  # its slots are runs of whole chunks
    if evens:
        return ReadLayout(_named(sharding, spec, evens[0], across), tuple(stored_shape))
    return _padded(sharding, found, stored_shape, chunk_shape)


def _refined(
    sharding: jax.sharding.Sharding,
    found: tuple[Any, list[Any], tuple[str, ...]],
    stored_shape: Sequence[int],
    chunk_shape: Sequence[int],
) -> jax.sharding.NamedSharding | None:
    """The target's sharding on its mesh with each axis of `across` cut into prime
    factors (major first: the same devices, in the same order), each factor added to
    the first dimension whose whole saved chunks in a target shard it still divides;
    None where a factor divides none.

    Every device then reads whole saved chunks, none read by two, and the array
    read is the stored array: the reshard onto the target is a plain collective
    (an all-gather), where a padded layout's would also move its padding and
    permute its slots.
    """
    mesh, spec, across = found
    room = []  # whole chunks in a target shard, per dimension, still to share
    for d, entry in enumerate(spec):
        size, rest = divmod(stored_shape[d], math.prod(mesh.shape[a] for a in _axes(entry)))
        room.append(size // chunk_shape[d] if not rest and size % chunk_shape[d] == 0 else 1)
    names: list[str] = []
    sizes: list[int] = []
    types: list[Any] = []  # each factor of an axis keeps its type
    added: list[list[str]] = [[] for _ in spec]
    for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if a not in across:
            names.append(a)
            sizes.append(mesh.shape[a])
            types.append(kind)
            continue
        for k, p in enumerate(_prime_factors(mesh.shape[a])):
            dim = next((d for d, n in enumerate(room) if n % p == 0), None)
            if dim is None:
                return None
            room[dim] //= p
            names.append(f"{a}#{k}")
            sizes.append(p)
            types.append(kind)
            added[dim].append(names[-1])
    if len(set(names)) < len(names):
        return None  # a factor's name is taken by an axis of the mesh
    fine = jax.sharding.Mesh(mesh.devices.reshape(sizes), tuple(names), axis_types=tuple(types))
    entries = [(*_axes(e), *more) or None for e, more in zip(spec, added, strict=True)]
    return jax.sharding.NamedSharding(
        fine, jax.sharding.PartitionSpec(*entries), memory_kind=sharding.memory_kind
    )


def _prime_factors(n: int) -> list[int]:
    """`n`'s prime factors, smallest first, repeated (a mesh axis's size: small)."""
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _shares_chunks(
    mesh: Any,
    processes: np.ndarray,
    spec: list[Any],
    across: tuple[str, ...],
    d: int,
    size: int,
    chunk: int,
) -> bool:
    """Whether the even split of dimension `d` (`size` long, saved in chunks of `chunk`
    along it) over its own axes and `across` cuts a saved chunk between two processes.

    The split's parts along `d` follow its axes in row-major order; a boundary
    between two parts inside a chunk is a chunk read by both their processes
    (wherever they differ, at any coordinate of the other axes).
    """
    axes = [*_axes(spec[d]), *across]
    rest = [a for a in mesh.axis_names if a not in axes]
    order = [mesh.axis_names.index(a) for a in (*axes, *rest)]
    procs = processes.transpose(order).reshape(math.prod(mesh.shape[a] for a in axes), -1)
    part = size // procs.shape[0]
    inside = np.arange(1, procs.shape[0]) * part % chunk != 0
    return bool((inside[:, None] & (procs[1:] != procs[:-1])).any())


def _processes(mesh: Any) -> np.ndarray:
    """The process of each device of `mesh`, shaped as the mesh (read-only), kept for
    the last few meshes: a restore asks once a leaf, and asking every device costs
    ~10 us a device."""
    found = _PROCESSES.get(mesh)
    if found is None:
        if len(_PROCESSES) >= 8:
            _PROCESSES.pop(next(iter(_PROCESSES)), None)
        found = np.vectorize(lambda dev: dev.process_index, otypes=[int])(mesh.devices)
        found.flags.writeable = False
        _PROCESSES[mesh] = found
    return found


_PROCESSES: dict[Any, np.ndarray] = _resources.SHARED.cache({})


def _padded(
    sharding: jax.sharding.Sharding,
    found: tuple[Any, list[Any], tuple[str, ...]],
    stored_shape: Sequence[int],
    chunk_shape: Sequence[int] | None,
) -> ReadLayout | None:
    """The padded `ReadLayout` along the dimension with the most saved chunks in a target
    shard, among those whose chunks tile the target shards first (elements stand for
    chunks in the others: restored onto another mesh); None where a target shard is
    one chunk (a small shard, saved whole by each of its holders: nothing to share)."""
    mesh, spec, across = found
    replicas = math.prod(mesh.shape[a] for a in across)
    best: tuple[tuple[bool, int, int], int, int, int, int] | None = None
    for d, entry in enumerate(spec):  # (rank, dimension, target shards, their size, chunk)
        blocks = math.prod(mesh.shape[a] for a in _axes(entry))
        if stored_shape[d] % blocks:
            continue
        size = stored_shape[d] // blocks
        tiled = chunk_shape is not None and size % chunk_shape[d] == 0
        chunk = chunk_shape[d] if chunk_shape is not None and tiled else 1
        rank = (tiled, size // chunk, -d)
        if best is None or rank > best[0]:
            best = (rank, d, blocks, size, chunk)
    if best is None or best[0][1] < 2:
        return None
    _, d, blocks, size, chunk = best
    slot = -(-(size // chunk) // replicas) * chunk
    shape = (*stored_shape[:d], blocks * replicas * slot, *stored_shape[d + 1 :])
    return ReadLayout(_named(sharding, spec, d, across), shape, d, blocks, slot, size)


def _even_dims(
    mesh: Any, spec: list[Any], across: tuple[str, ...], stored_shape: Sequence[int]
) -> list[int]:
    """The dimensions that `across`, added to their own axes, divides, in order."""
    return [
        d
        for d, entry in enumerate(spec)
        if stored_shape[d] % math.prod(mesh.shape[a] for a in _axes(entry) + across) == 0
    ]


def _named(
    sharding: Any, spec: list[Any], d: int, across: tuple[str, ...]
) -> jax.sharding.NamedSharding:
    """`sharding` with `across` added, minor, to dimension `d`'s axes."""
    spec = list(spec)
    spec[d] = _axes(spec[d]) + across
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind
    )


def _spread(
    sharding: jax.sharding.Sharding,
    stored_shape: Sequence[int],
    processes: np.ndarray | None = None,
) -> tuple[Any, list[Any], tuple[str, ...]] | None:
    """(mesh, the spec padded to the stored rank, the unused mesh axes along which
    processes differ) of a NamedSharding that replicates across processes."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not math.prod(stored_shape):
        return None
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(stored_shape) - len(sharding.spec))
    used = {a for entry in spec if entry is not None for a in _axes(entry)}
    procs = _processes(mesh) if processes is None else processes
    across = tuple(
        a
        for k, a in enumerate(mesh.axis_names)
        if a not in used
        and mesh.shape[a] > 1
        and bool((procs != np.take(procs, [0], axis=k)).any())
    )
    if not across:
        return None
    return mesh, spec, across


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)
