"""How a restore's replicas share their read: each process that holds a region reads a part.

The R processes that hold a region of a target sharding each read a distinct
part of it, so that every byte is read once across the job, not once a replica.

A target leaf replicated across processes (a NamedSharding whose unused mesh
axes span processes) is read under a `ReadLayout` (`read_layout`) and carried
onto its target by `reshard`, one compiled collective over the replica axes:

- an even split where a dimension divides with those axes added to its own;
- a padded one where none does: each target shard cut into R slots (of whole
  saved chunks where they tile it), filled out with zeros that `reshard` drops;
- reading from persistent storage onto another split (`whole_chunks`), parts
  of whole saved chunks (the first even dimension that cuts no chunk between
  processes, else the mesh with the replica axes cut into prime factors, else
  the padded layout), so that no chunk is read by two processes.

Everything is computed from the target sharding, the stored shape, the saved
chunk shape (the grid `_replicas` chose) and whether the restore reads from
persistent storage (agreed), so every process agrees without an exchange.

On CPU a reshard of at most `QUICK_COMPILE_BYTES` is compiled without the backend's
optimizations: it only moves data, and its compilation is what costs. Measured on 2 CPUs
(4 devices, 40 leaves, one sharding onto another): 4.2 CPU-seconds to compile by
default, 1.0 without; running it on 88 MB took 1.3-1.4x as long (43 -> 56 ms onto a 2x2
mesh, 88 -> 126 ms onto replicas), which for 64 MiB stays well under the ~1 s saved.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Final

import jax
import numpy as np

from jaxckpt import _resources
from jaxckpt.format import _chunking


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


@dataclasses.dataclass(frozen=True)
class Resharding:
    """Leaves read 1/R a process, each in its `ReadLayout` (`layouts`; None: the stored
    array itself), to carry onto their `targets` by `reshard`; none: nothing to do."""

    arrays: tuple[jax.Array, ...] = ()
    targets: tuple[jax.sharding.Sharding, ...] = ()
    layouts: tuple[ReadLayout | None, ...] = ()


def reshard(
    arrays: list[jax.Array],
    shardings: list[jax.sharding.Sharding],
    layouts: Sequence[ReadLayout | None] | None = None,
) -> Sequence[jax.Array]:
    """`arrays` laid out with `shardings`, by one compiled program: a collective over the
    replica axes, each process contributing the 1/R it read (`read_layout`), the
    padding of a padded read layout dropped on the way.
    Collective: every process calls it with the same leaves."""
    nbytes = sum(a.nbytes for a in arrays)
    return _program(shardings, layouts or [None] * len(arrays), nbytes)(*arrays)


def compile_reshard(
    abstract: Sequence[jax.ShapeDtypeStruct],
    shardings: list[jax.sharding.Sharding],
    layouts: Sequence[ReadLayout | None],
) -> None:
    """Compiles the program `reshard` runs for arrays like `abstract` (shape, dtype and
    read sharding) without running it: a later `reshard` of such arrays onto `shardings`
    finds it compiled (a hot spare prepares a restore). Local, not a collective."""
    nbytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in abstract)
    _program(shardings, layouts, nbytes).lower(*abstract).compile()


# A reshard of at most this many bytes (its arrays' global sizes), on CPU, compiles
# without the backend's optimizations (`QUICK_COMPILE`): see the module docstring.
QUICK_COMPILE_BYTES: Final = 64 << 20
QUICK_COMPILE: Final = {"xla_backend_optimization_level": 0}


def compiles_quickly(shardings: Sequence[jax.sharding.Sharding], nbytes: int) -> bool:
    """Whether a reshard onto `shardings` of arrays of `nbytes` in all compiles without
    the backend's optimizations (`QUICK_COMPILE`): at most `QUICK_COMPILE_BYTES`, on CPU."""
    devices: list[jax.Device] = [d for s in shardings for d in s.device_set]
    return nbytes <= QUICK_COMPILE_BYTES and all(d.platform == "cpu" for d in devices)


def _program(
    shardings: Sequence[jax.sharding.Sharding],
    layouts: Sequence[ReadLayout | None],
    nbytes: int,
) -> Any:
    """The jitted reshard onto `shardings` of arrays of `nbytes` in all (kept for the last
    few trees): compiled quickly where `compiles_quickly`."""
    quick = compiles_quickly(shardings, nbytes)
    key = (tuple(shardings), tuple(layouts), quick)
    fn = _RESHARD.get(key)
    if fn is None:
        if len(_RESHARD) >= 8:
            _RESHARD.pop(next(iter(_RESHARD)), None)
        unpads = [(lambda x: x) if lay is None else lay.unpad for lay in key[1]]
        fn = _RESHARD[key] = jax.jit(
            lambda *xs: tuple(f(x) for f, x in zip(unpads, xs, strict=True)),
            out_shardings=key[0],
            compiler_options=QUICK_COMPILE if quick else None,
        )
    return fn


# The reshard of the last few trees (its compiled programs are kept with it).
_RESHARD: dict[Any, Any] = _resources.SHARED.cache({})


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
