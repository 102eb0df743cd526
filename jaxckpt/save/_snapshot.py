"""The part of a save that stalls training: copying this process's shards to host.

Everything here runs on the caller's thread inside `async_save`; it copies one
copy of every byte in the whole job, and reads iterator states, so that all
later work can run in the background. A shard held by one process is saved by
it whole (its `replica_id` 0 copy); a shard held by R > 1 processes
(data-parallel replicas) is shared among them: each copies its own chunks of it,
a deterministic 1/R (`_replicas`).

Values that can differ per process are saved by every process into its own
part: numpy arrays, scalars and, in a multi-process job, jax.Arrays whose
devices all belong to this process (process-local: `is_fully_addressable`).
A global array, even fully replicated, has one value and is saved once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Final

import jax
import numpy as np

from jaxckpt import _resources
from jaxckpt.coord import _multihost, _replicas
from jaxckpt.format import _array_keys, _chunking, _format, _sharding, _tiles, _tree


@dataclasses.dataclass
class HostShard:
    """One chunk of one leaf, in host memory.

    `data` may be a view of memory JAX owns (a CPU buffer, or a `pinned_host`
    copy of a device buffer): `holds` keeps that alive until the memory tier
    has the bytes and `release`s the shard.
    """

    leaf: int
    index: tuple[int, ...]
    data: np.ndarray | None
    holds: Any = None
    nbytes: int = dataclasses.field(init=False)
    shape: tuple[int, ...] = dataclasses.field(init=False)  # kept once `data` is released
    itemsize: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        assert self.data is not None
        self.nbytes = self.data.nbytes
        self.shape = tuple(self.data.shape)
        self.itemsize = self.data.dtype.itemsize

    def copy_out(self) -> None:
        """Replaces the shard's view by a private copy and lets go of what it viewed."""
        assert self.data is not None, "a shard's data is copied before it is released"
        self.data, self.holds = np.array(self.data, copy=True), None

    def release(self) -> np.ndarray:
        """The shard's data, which it lets go of: once the caller drops it as well,
        JAX may reuse (donate) the buffer it viewed."""
        data, self.data, self.holds = self.data, None, None
        assert data is not None, "a shard's data is released once"
        return data


@dataclasses.dataclass
class Snapshot:
    """Everything one process saves for one step, held in host memory."""

    leaves: tuple[_format.LeafRecord, ...]
    shards: list[HostShard]
    iterator_states: dict[int, Any]
    stall_s: float
    scalars: dict[int, Any] = dataclasses.field(default_factory=dict)  # per-process values
    shardings: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    staging: str = "none"  # how device shards reached host: see `_stage`
    weak_types: tuple[int, ...] = ()  # array leaves that are weakly typed (`PartManifest`)
    # partners[p]: the processes holding the same shards as p in other replicas
    # (`_replicas.partners`); empty without replicated shards.
    partners: tuple[tuple[int, ...], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def take(
    state: Any,
    process_index: int,
    pinned_host: bool | None = None,
    tile_bytes: int | None = _tiles.DEFAULT_TILE_BYTES,
) -> Snapshot:
    """Validates `state` and copies this process's share of it to host.

    Args:
      state: the pytree to save.
      process_index: the saving process. Every process saves its own per-process
        values (numpy arrays, scalars, process-local arrays), process 0 included.
      pinned_host: stage device shards through `pinned_host` memory
        (`TierOptions.pinned_host_staging`; None: where the devices have it and
        are not CPUs).
      tile_bytes: the smallest tile a chunk is cut into (`TierOptions.tile_bytes`;
        None: chunks stay whole).

    Raises:
      TypeError: for an unsupported leaf, naming its path.
    """
    start = time.perf_counter()
    multi_process = _multihost.process_count() > 1
    values, treedef = jax.tree_util.tree_flatten(state, is_leaf=_tree.is_iterator)
    # What each leaf's path, kind and record derive from (not its values): the same for
    # every save of a training loop, so the per-leaf work below is done once per tree.
    structure = (treedef, tuple(_signature(leaf, multi_process) for leaf in values))
    described = _DESCRIBED.get(structure)
    if described is None:
        described = _describe(state)  # validates every leaf before any copy
        if len(_DESCRIBED) >= _CACHED_TREES:
            _DESCRIBED.pop(next(iter(_DESCRIBED), None), None)
        _DESCRIBED[structure] = described
    paths, keys, kinds = described
    for path, leaf, kind in zip(paths, values, kinds, strict=True):
        if kind == _format.SCALAR:
            _tree.encode_scalar(path, leaf)  # a value, checked at every save
    pairs = list(zip(paths, values, strict=True))
    records_key = (structure, tile_bytes)  # the leaf records depend on the tile size too
    taking = _Taking(_RECORDS.get(records_key), multi_process, process_index)
    # (A typed key array has no weak type to keep.)
    taking.snap.weak_types = tuple(
        i
        for i, ((_, leaf), kind) in enumerate(zip(pairs, kinds, strict=True))
        if kind == _format.ARRAY and getattr(leaf, "weak_type", False) is True
    )
    for i, ((path, leaf), kind) in enumerate(zip(pairs, kinds, strict=True)):
        taking.leaf(i, path, leaf, kind)
    taking.copy_to_host(pinned_host)
    snap = taking.finish(records_key, list(keys), tile_bytes)
    snap.stall_s = time.perf_counter() - start
    return snap


class _Taking:
    """One `take`: each leaf's record and shards to copy (`leaf`), the copies
    (`copy_to_host`), the records kept for the next save of the same tree (`finish`)."""

    def __init__(self, cached: Any, multi_process: bool, process_index: int):
        self.cached = cached  # the same tree as an earlier save: same records
        self.known = cached[0] if cached else None
        self.splits: dict[int, _replicas.Split] = dict(cached[1]) if cached else {}
        self.multi_process, self.process_index = multi_process, process_index
        self.records: list[_format.LeafRecord] = []
        self.pending: list[tuple[int, jax.Array, tuple[int, ...], _chunking.Region | None]] = []
        self.local: list[tuple[int, jax.Array]] = []  # process-local arrays, one chunk each
        self.snap = Snapshot((), [], {}, 0.0)

    def leaf(self, i: int, path: str, leaf: Any, kind: str) -> None:
        """Leaf `i`'s record, and its value held or its shards queued for the copy."""
        known, snap = self.known, self.snap
        if kind == _format.ARRAY:
            self._array(i, path, leaf)
        elif kind == _format.NUMPY:
            self.records.append(known[i] if known else _numpy_record(path, leaf))
            snap.shards.append(HostShard(i, (0,) * leaf.ndim, np.array(leaf, copy=True)))
        elif kind == _format.SCALAR:
            record = _tree.scalar_record(path, leaf)
            # The value lives in this process's part: the records stay the same everywhere.
            snap.scalars[i] = record.value
            self.records.append(
                known[i] if known else dataclasses.replace(record, value=None, per_process=True)
            )
        else:
            self.records.append(known[i] if known else _format.LeafRecord(path, kind))
            snap.iterator_states[i] = _tree.encode_iterator_state(path, leaf.get_state())

    def _array(self, i: int, path: str, leaf: Any) -> None:
        known, splits = self.known, self.splits
        data = jax.random.key_data(leaf) if _tree.is_typed_key(leaf) else leaf
        if self.multi_process and leaf.is_fully_addressable:
            self.records.append(known[i] if known else _array_record(path, leaf, per_process=True))
            self.snap.shardings[i] = _sharding.describe(leaf.sharding)
            self.local.append((i, data))
            return
        if known:
            self.records.append(known[i])
        else:
            record = _array_record(path, leaf)
            if self.multi_process:
                split = _split(record, data, i)
                if split.replicas > 1:
                    splits[i] = split
                    record = dataclasses.replace(
                        record,
                        chunk_shape=split.chunk_shape,
                        replicas=split.replicas,
                        cut=split.cut,
                        slices=split.slices if split.cut is not None else None,
                    )
            self.records.append(record)
        chunk_shape = self.records[-1].chunk_shape
        assert chunk_shape is not None
        if i in splits:  # shared with other replicas: this process's chunks only
            self.pending.extend(
                (i, buf, index, cut)
                for buf, index, cut in _replicas.shares(
                    data, self.records[-1], splits[i], self.process_index
                )
            )
            return
        for shard in data.addressable_shards:
            if shard.replica_id == 0:
                index = _chunking.chunk_index_of(shard.index, data.shape, chunk_shape)
                self.pending.append((i, shard.data, index, None))

    def copy_to_host(self, pinned_host: bool | None) -> None:
        """The device->host copies of every queued shard."""
        pending, local, snap = self.pending, self.local, self.snap
        # IMPORTANT: every device->host transfer starts before any is waited for.
        local_bufs = [
            [s.data for s in data.addressable_shards if s.replica_id == 0] for _, data in local
        ]
        bufs = [buf for _, buf, _, _ in pending] + [b for group in local_bufs for b in group]
        cuts = [cut for _, _, _, cut in pending] + [None] * (len(bufs) - len(pending))
        hosts, holds, snap.staging = _stage(bufs, pinned_host, cuts)
        for (i, _, index, _), host, held in zip(pending, hosts, holds, strict=False):
            snap.shards.append(HostShard(i, index, host, held))
        done = len(pending)
        for (i, data), group in zip(local, local_bufs, strict=True):
            parts = list(zip(group, hosts[done : done + len(group)], strict=True))
            done += len(group)
            snap.shards.append(
                HostShard(i, (0,) * data.ndim, _whole_on_host(data, parts), holds[done - 1])
            )

    def finish(self, structure: Any, keys: list[Any], tile_bytes: int | None) -> Snapshot:
        """The snapshot with its leaf records (and partners), cached for the same tree."""
        snap = self.snap
        if self.cached:
            snap.leaves, _, snap.partners = self.cached
            return snap
        leaves = tuple(
            dataclasses.replace(r, keys=k) for r, k in zip(self.records, keys, strict=True)
        )
        if tile_bytes is not None:
            leaves = _tiles.with_tile_shapes(leaves, tile_bytes)
        snap.leaves = _array_keys.with_array_keys(leaves)
        snap.partners = _replicas.partners_of(self.splits.values(), _multihost.process_count())
        if len(_RECORDS) >= _CACHED_TREES:
            _RECORDS.pop(next(iter(_RECORDS), None), None)
        _RECORDS[structure] = (snap.leaves, tuple(self.splits.items()), snap.partners)
        return snap


_CACHED_TREES: Final = 4

# Per tree structure (the treedef and every leaf's `_signature`), its leaves' paths,
# encoded keys and kinds (`_describe`); and its leaf records, with the splits of its
# replicated leaves and the partners. A training loop saves the same tree every step:
# what is proportional to its leaf count is derived once (the records' JSON too, see
# `_format`). A tree that differs in any leaf's type, shape, dtype or sharding, or in its
# structure, is another key: never served another tree's entry.
_DESCRIBED: dict[Any, tuple[tuple[str, ...], tuple[Any, ...], tuple[str, ...]]] = (
    _resources.SHARED.cache({})
)
_RECORDS: dict[
    Any,
    tuple[
        tuple[_format.LeafRecord, ...],
        tuple[tuple[int, _replicas.Split], ...],
        tuple[tuple[int, ...], ...],
    ],
] = _resources.SHARED.cache({})


def _split(record: _format.LeafRecord, data: jax.Array, leaf: int) -> _replicas.Split:
    """How the shards of a global array leaf are shared among the processes holding them."""
    assert record.stored_shape is not None and record.chunk_shape is not None
    shard_shape = tuple(data.sharding.shard_shape(data.shape))
    return _replicas.split_of(
        data.sharding,
        data.shape,
        record.stored_shape,
        shard_shape,
        np.dtype(data.dtype).itemsize,
        leaf,
    )


def _describe(state: Any) -> tuple[tuple[str, ...], tuple[Any, ...], tuple[str, ...]]:
    """Every leaf's tree path, encoded keys and kind, each leaf validated.

    Raises:
      TypeError: for an unsupported leaf, naming its path.
    """
    triples, _ = _tree.flatten_with_keys(state)
    kinds = tuple(_tree.kind_of(path, leaf) for path, _, leaf in triples)
    return tuple(p for p, _, _ in triples), tuple(k for _, k, _ in triples), kinds


def _signature(leaf: Any, multi_process: bool) -> Any:
    """What a leaf's path, kind and record are derived from, hashable (not its values):
    its type, and an array's shape, dtype, sharding, commitment and (in a multi-process
    job) whether it is process-local."""
    if isinstance(leaf, jax.Array):
        local = multi_process and leaf.is_fully_addressable
        return (type(leaf), leaf.shape, leaf.dtype, leaf.sharding, leaf.committed, local)
    if isinstance(leaf, np.ndarray):
        return (type(leaf), leaf.shape, leaf.dtype)
    return (type(leaf), getattr(leaf, "dtype", None))


def _numpy_record(path: str, leaf: np.ndarray) -> _format.LeafRecord:
    return _format.LeafRecord(
        path,
        _format.NUMPY,
        shape=leaf.shape,
        dtype=leaf.dtype.name,
        stored_shape=leaf.shape,
        stored_dtype=leaf.dtype.name,
        chunk_shape=tuple(max(1, n) for n in leaf.shape),
        per_process=True,
    )


@functools.cache
def _key_data_layout(impl: str) -> tuple[tuple[int, ...], str]:
    """Trailing dims and dtype of the key data of one key of `impl` (cached: eval_shape
    traces a new function every call, and JAX keeps each trace)."""
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return tuple(data.shape), np.dtype(data.dtype).name


def _device_of(buf: jax.Array) -> Any:
    return next(iter(buf.devices()))


def _has_pinned_host(device: Any) -> bool:
    return any(m.kind == "pinned_host" for m in device.addressable_memories())


def _stage(
    bufs: list[jax.Array],
    pinned_host: bool | None,
    cuts: list[_chunking.Region | None] | None = None,
) -> tuple[list[np.ndarray], list[Any], str]:
    """Host views of single-device buffers, what keeps them alive, and how they got there.

    `cuts[k]`, where given, is the only region of `bufs[k]` wanted (a replica's share
    of a shard): on CPU a view of it, elsewhere sliced on the device before the copy,
    so that only that share crosses to host.

    - "pinned_host": one batched `device_put` of every buffer to its device's
      `pinned_host` memory (transfers run concurrently; JAX reuses the pinned
      pool across saves, so no host allocation per save once warm), then
      zero-copy numpy views of the results.
    - "cpu_view": on CPU a jax buffer already is host memory and immutable: a
      numpy view holds it, and while the view lives a donating train step cannot
      overwrite it (JAX <= 0.11 declines the donation; 0.12 donates the array but
      gives the step fresh memory). The handler copies the views into the
      step's slab before `save()` returns and drops them (unless
      `TierOptions.hold_cpu_arrays`): a donation that cannot reuse the buffers
      costs the next step more than the copy (fresh, page-faulted output buffers).
    - "pageable": every transfer started (`copy_to_host_async`), then copied
      into fresh host memory.
    """
    if not bufs:
        return [], [], "none"
    cuts = cuts or [None] * len(bufs)
    on_cpu = all(b.platform() == "cpu" for b in bufs)
    if on_cpu:
        views = [
            np.asarray(b) if c is None else np.asarray(b)[c]
            for b, c in zip(bufs, cuts, strict=True)
        ]
        if pinned_host is not True:
            return views, list(bufs), "cpu_view"
    if any(c is not None for c in cuts):  # the share only, sliced on its device
        bufs = [b if c is None else b[c] for b, c in zip(bufs, cuts, strict=True)]
    if pinned_host is None:
        pinned_host = not on_cpu and all(_has_pinned_host(_device_of(b)) for b in bufs)
    if pinned_host:
        targets = [
            jax.sharding.SingleDeviceSharding(_device_of(b), memory_kind="pinned_host")
            for b in bufs
        ]
        staged = jax.device_put(bufs, targets)
        return [np.asarray(s) for s in staged], list(staged), "pinned_host"
    for b in bufs:
        b.copy_to_host_async()
    return [np.array(b, copy=True) for b in bufs], [None] * len(bufs), "pageable"


def _whole_on_host(data: jax.Array, shards: list[tuple[jax.Array, np.ndarray]]) -> np.ndarray:
    """A process-local array's whole value on host (one chunk of its own part), from its
    replica-0 shards' host copies (in `data.addressable_shards` order)."""
    if len(shards) == 1 and shards[0][1].shape == data.shape:
        return shards[0][1]  # one device holds it all: no assembly
    out = np.empty(data.shape, dtype=data.dtype)
    for s, (_, host) in zip(
        [s for s in data.addressable_shards if s.replica_id == 0], shards, strict=True
    ):
        out[s.index] = host
    return out


def _array_record(path: str, leaf: jax.Array, per_process: bool = False) -> _format.LeafRecord:
    """The record of a jax.Array leaf.

    A per-process (process-local) array is saved whole, as one chunk, and its
    sharding goes into the owner's part: each process's may name other devices.
    """
    is_key = _tree.is_typed_key(leaf)
    key_impl = str(jax.random.key_impl(leaf)) if is_key else None
    if key_impl is not None:
        tail, stored_dtype = _key_data_layout(key_impl)
    else:
        tail, stored_dtype = (), np.dtype(leaf.dtype).name
    stored_shape = tuple(leaf.shape) + tail
    if per_process:
        shard_shape = stored_shape
    else:
        shard_shape = tuple(leaf.sharding.shard_shape(leaf.shape)) + tail
    chunk = tuple(max(1, n) for n in shard_shape)  # zarr chunks are never empty
    return _format.LeafRecord(
        path,
        _format.ARRAY,
        shape=tuple(leaf.shape),
        dtype=str(leaf.dtype),
        stored_shape=stored_shape,
        stored_dtype=stored_dtype,
        chunk_shape=chunk,
        sharding=None if per_process else _sharding.describe(leaf.sharding),
        key_impl=key_impl,
        per_process=per_process,
        uncommitted=not leaf.committed,
    )
