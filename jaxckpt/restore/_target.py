"""Matching a restore target against the saved tree (`_fill` fills it in).

Everything a target can get wrong (structure, shape, dtype, kind, per-process
values for another process count) is checked before any byte is read, and
before any collective, so every process fails the same way.

Target and saved leaves are matched by path, and failing that by the key
names along it, whatever the node kind: a dict key "a" matches an attribute
`.a`, and an index 0 matches `[0]` or a flattened index 0. So
`item_metadata()`, which nests every node as dicts and lists, is a target for
a namedtuple, a dataclass or an nnx.State alike. The result takes the
target's structure.

Per-process leaves (each process saved its own value: process-local arrays,
numpy arrays, scalars, iterator states) come back per process. On the saving
process count every process gets its own value; on another count a value
every process saved alike (same chunk checksums or JSON, read from the
manifests only) restores everywhere, and differing values are refused by
name unless `per_process_fn` maps them. Never another process's value.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Final, Protocol

import jax
import numpy as np

from jaxckpt.format import _format, _sharding, _tree

# (states saved by every process, in process order; this process; process count) -> state
IteratorStateFn = Callable[[list[Any], int, int], Any]
# (leaf path; values saved by every process, in process order; this process; process count)
# -> this process's value
PerProcessFn = Callable[[str, list[Any], int, int], Any]

# Where an array leaf goes, when not onto a jax.sharding.Sharding:
HOST: Final = "host"  # a numpy array
UNCOMMITTED: Final = "uncommitted"  # a jax.Array on the default device, free to move
Placement = jax.sharding.Sharding | str


class Target(Protocol):
    """What a restore is asked for (`jaxckpt.TieredRestore` is one): the target tree and
    the functions that give per-process leaves."""

    @property
    def abstract_state(self) -> Any: ...
    @property
    def iterator_state_fn(self) -> IteratorStateFn | None: ...
    @property
    def per_process_fn(self) -> PerProcessFn | None: ...


@dataclasses.dataclass(frozen=True)
class Context:
    """Who restores which step, and what every process saved for it.

    Attributes:
      manifests: owner -> index manifest of every part of the step.
      process: this process's index.
      count: how many processes restore.
      step: the step restored.
      iterator_state_fn: maps saved iterator states whenever the process count
        changed (the older, iterator-only hook).
      per_process_fn: maps the saved values of a per-process leaf when the
        process count changed and the values differ.
    """

    manifests: Mapping[int, _format.PartManifest]
    process: int
    count: int
    step: int
    iterator_state_fn: IteratorStateFn | None = None
    per_process_fn: PerProcessFn | None = None
    # leaf -> `source()`'s answer, computed once: comparing saved values costs per process.
    sources: dict[int, int | None] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @functools.cached_property  # asked for every per-process leaf
    def saved_count(self) -> int:
        """How many processes saved the step."""
        return _format.saved_process_count(self.manifests)

    @functools.cached_property
    def complete(self) -> bool:
        """Whether the manifest of every saving process is at hand."""
        return bool(self.manifests) and set(self.manifests) == set(range(self.saved_count))

    def where(self, record: _format.LeafRecord) -> str:
        return f"[process {self.process}] Leaf {record.path or '<root>'} at step {self.step}"


class IteratorState:
    """Metadata leaf for a saved iterator: `state` is what `get_state()` returned."""

    def __init__(self, state: Any):
        self.state = state

    def __repr__(self) -> str:
        return f"IteratorState({self.state!r})"


def metadata(index: Mapping[int, _format.PartManifest], pi: int, count: int) -> Any:
    """What the handler's `metadata()` shows of a step whose index manifests are `index`
    (see there), for process `pi` of `count`."""
    same_count = _format.saved_process_count(index) == count
    # Per-process leaves show this process's own value, which only exists on the same count.
    manifest = index[pi] if same_count and pi in index else index[min(index)]
    entries = [(r.keys, leaf_metadata(i, r, manifest)) for i, r in enumerate(manifest.leaves)]
    return _tree.nest(entries)


def leaf_metadata(i: int, record: _format.LeafRecord, manifest: _format.PartManifest) -> Any:
    """What `metadata()` shows for saved leaf `i`, as `manifest`'s owner saved it."""
    if record.kind == _format.ARRAY:
        assert record.shape is not None and record.dtype is not None
        if record.key_impl:
            dtype = jax.eval_shape(lambda: jax.random.key(0, impl=record.key_impl)).dtype
        else:
            dtype = np.dtype(record.dtype)
        sharding = saved_sharding(i, record, manifest)
        # Weakly typed as saved: a restore through this target keeps `lr * bf16` bfloat16.
        weak = i in manifest.weak_types
        return jax.ShapeDtypeStruct(record.shape, dtype, sharding=sharding, weak_type=weak)
    if record.kind == _format.NUMPY:
        assert record.shape is not None and record.dtype is not None
        return jax.ShapeDtypeStruct(record.shape, np.dtype(record.dtype))
    if record.kind == _format.SCALAR:
        return scalar(i, record, manifest)
    return IteratorState(_tree.decode_iterator_state(manifest.iterator_states.get(i)))


def saved_sharding(
    i: int, record: _format.LeafRecord, manifest: _format.PartManifest | None
) -> jax.sharding.Sharding | None:
    """The sharding `manifest`'s owner saved an array with, if it exists here (a
    per-process one only on this process's devices); None for an uncommitted array."""
    if own_record(i, record, manifest).uncommitted:
        return None
    if not record.per_process:
        return _sharding.rebuild(record.sharding)
    sharding = _sharding.rebuild(manifest.shardings.get(i) if manifest else None)
    return sharding if sharding is not None and sharding.is_fully_addressable else None


def scalar(i: int, record: _format.LeafRecord, manifest: _format.PartManifest) -> Any:
    """The scalar `manifest`'s owner saved (version 1: the one value in the record)."""
    if record.per_process:
        own = own_record(i, record, manifest)
        record = dataclasses.replace(own, value=manifest.scalars.get(i))
    return _tree.scalar_value(record)


def own_record(
    i: int, record: _format.LeafRecord, manifest: _format.PartManifest | None
) -> _format.LeafRecord:
    """`manifest`'s own record of a per-process leaf: its owner's scalar type and
    commitment, which may differ from other processes'."""
    if record.per_process and manifest is not None and i < len(manifest.leaves):
        return manifest.leaves[i]
    return record


# ---- per-process leaves -------------------------------------------------------


def is_per_process(record: _format.LeafRecord) -> bool:
    """Whether every process saved its own value of the leaf."""
    return record.per_process or record.kind == _format.ITERATOR


def _saved_key(i: int, record: _format.LeafRecord, manifest: _format.PartManifest) -> Hashable:
    """Identifies the value `manifest`'s owner saved for a per-process leaf, from the
    manifest alone: chunk checksums for arrays, the value and type of scalars, the
    JSON of iterator states."""
    if record.kind == _format.ITERATOR:
        return json.dumps(manifest.iterator_states.get(i), sort_keys=True)
    if record.kind == _format.SCALAR:
        value = manifest.scalars.get(i)
        if isinstance(value, float) or not isinstance(value, (int, str, type(None))):
            value = json.dumps(value, sort_keys=True)  # NaN equals itself as text
        # The type too: 1 and True and 1.0 are not the same saved value.
        return (own_record(i, record, manifest).scalar_type, type(value).__name__, value)
    return tuple(sorted((c.index, c.checksum, c.nbytes) for c in manifest.chunks.get(i, ())))


def _saved_alike(i: int, record: _format.LeafRecord, ctx: Context) -> bool:
    return len({_saved_key(i, record, m) for m in ctx.manifests.values()}) <= 1


def per_process_mapper(
    record: _format.LeafRecord, ctx: Context
) -> Callable[[list[Any]], Any] | None:
    """The user's function for this leaf's saved values, bound to this process."""
    iterator_fn, fn = ctx.iterator_state_fn, ctx.per_process_fn
    if record.kind == _format.ITERATOR and iterator_fn is not None:
        return lambda values: iterator_fn(values, ctx.process, ctx.count)
    if fn is not None:
        return lambda values: fn(record.path, values, ctx.process, ctx.count)
    return None


def source(i: int, record: _format.LeafRecord, ctx: Context) -> int | None:
    """The owner whose saved value of per-process leaf `i` this process restores;
    None when the user's function maps the saved values instead.

    Same process count: its own. Otherwise a value every process saved alike;
    else the function decides.

    Raises:
      ValueError: if the process count changed, the saved values differ and no
        function maps them.
    """
    if ctx.saved_count == ctx.count and ctx.process in ctx.manifests:
        return ctx.process
    if i in ctx.sources:
        return ctx.sources[i]
    owners = sorted(ctx.manifests)
    if record.kind == _format.ITERATOR and ctx.iterator_state_fn is not None:
        owner = None  # the iterator-only hook maps whenever the count changed, as it always did
    elif _saved_alike(i, record, ctx):
        owner = owners[ctx.process % len(owners)]  # all copies are alike: spread the reads
    elif per_process_mapper(record, ctx) is not None:
        owner = None
    else:
        raise _differing_error([record], ctx)
    ctx.sources[i] = owner
    return owner


def _differing_error(records: Sequence[_format.LeafRecord], ctx: Context) -> ValueError:
    paths = _tree.describe_paths([r.path for r in records], limit=8)
    return ValueError(
        f"[process {ctx.process}] {'Leaf' if len(records) == 1 else 'Leaves'} {paths} at step "
        f"{ctx.step}: the {ctx.saved_count} processes that saved the step saved different values "
        "(process-local arrays, numpy arrays, scalars and iterator states are saved per "
        f"process), and {ctx.count} processes restore it, so a process has no saved value of its "
        "own and jaxckpt never hands it another process's. Save a value that is the same on "
        "every process, or pass TieredRestore(..., per_process_fn=fn) where fn(path, "
        "saved_values, process_index, process_count) returns this process's value (for "
        "iterator states alone, iterator_state_fn=fn(saved_states, process_index, "
        "process_count) does the same)."
    )


def iterator_state(i: int, record: _format.LeafRecord, ctx: Context) -> Any:
    owner = source(i, record, ctx)
    if owner is not None:
        return _tree.decode_iterator_state(ctx.manifests[owner].iterator_states.get(i))
    states = [
        _tree.decode_iterator_state(ctx.manifests[o].iterator_states.get(i))
        for o in sorted(ctx.manifests)
    ]
    mapper = per_process_mapper(record, ctx)
    assert mapper is not None
    return mapper(states)


def match(
    records: Sequence[_format.LeafRecord], target: Any, ctx: Context
) -> tuple[list[tuple[int, Any]], Any]:
    """(saved leaf index, target leaf) for every target leaf in the target's order, and the
    target's treedef.

    A target leaf matches the saved leaf of the same path, else the one with the
    same key names whatever the node kinds (see the module docstring).

    Raises:
      ValueError: naming the leaves on either side that match nothing.
    """
    triples, treedef = _tree.flatten_with_keys(target)
    by_path = {r.path: i for i, r in enumerate(records)}
    matched: list[int | None] = [by_path.get(path) for path, _, _ in triples]
    used = {i for i in matched if i is not None}
    by_names: dict[tuple[Any, ...], int | None] = {}
    for i, r in enumerate(records):
        if i not in used:
            names = _names(r.keys)
            by_names[names] = None if names in by_names else i  # None: ambiguous
    for n, (_, keys, _) in enumerate(triples):
        found = by_names.get(_names(keys)) if matched[n] is None else None
        if found is not None and found not in used:
            matched[n] = found
            used.add(found)
    missing = [path for (path, _, _), m in zip(triples, matched, strict=True) if m is None]
    extra = [r.path for i, r in enumerate(records) if i not in used]
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"the target has leaves the checkpoint lacks: {_tree.describe_paths(missing)}"
            )
        if extra:
            parts.append(
                f"the checkpoint has leaves the target lacks: {_tree.describe_paths(extra)}"
            )
        raise ValueError(
            f"[process {ctx.process}] The restore target does not match the tree saved at step "
            f"{ctx.step}: "
            + "; ".join(parts)
            + ". Build the target from the same state structure (mngr.item_metadata(step) shows "
            "it; leaves are matched by path or key names, whatever the node kind)."
        )
    pairs = [(i, leaf) for i, (_, _, leaf) in zip(matched, triples, strict=True) if i is not None]
    return pairs, treedef


def _names(keys: Sequence[tuple[str, Any]]) -> tuple[Any, ...]:
    """A path's key names without their node kinds (dict key, attribute, index)."""
    return tuple(name for _, name in keys)


def check(records: Sequence[_format.LeafRecord], target: Any, ctx: Context) -> None:
    """Raises ValueError/TypeError naming the leaf if `target` does not fit the saved tree,
    or a per-process value has no source on this process count (target None too)."""
    if ctx.complete:  # else the plan reports the missing parts
        refused = []
        for i, r in enumerate(records):
            if is_per_process(r):
                try:
                    source(i, r, ctx)
                except ValueError:
                    refused.append(r)
        if refused:
            raise _differing_error(refused, ctx)
    if target is None:
        return
    pairs, _ = match(records, target, ctx)
    for i, leaf in pairs:
        record = records[i]
        _check_leaf(record, leaf, ctx)
        if record.kind in (_format.ARRAY, _format.NUMPY):
            owner = source(i, record, ctx) if ctx.complete and record.per_process else None
            placement = leaf_placement(i, record, leaf, ctx, owner)
            if (
                record.per_process
                and isinstance(placement, jax.sharding.Sharding)
                and not placement.is_fully_addressable
                and owner == ctx.process
                and not _saved_alike(i, record, ctx)
            ):
                raise ValueError(
                    f"{ctx.where(record)}: every process saved its own, different value, and the "
                    f"target lays the leaf out over devices of several processes ({placement}); "
                    "one global array cannot hold a different value per process. Restore it "
                    "onto this process's devices (e.g. jax.ShapeDtypeStruct(shape, dtype, "
                    "sharding=SingleDeviceSharding(jax.local_devices()[0]))) or into numpy."
                )


def _check_leaf(record: _format.LeafRecord, leaf: Any, ctx: Context) -> None:
    where = ctx.where(record)
    if record.kind in (_format.ITERATOR, _format.SCALAR):
        return
    if _tree.is_iterator(leaf):
        raise TypeError(f"{where}: the target is an iterator but the checkpoint holds an array.")
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{where}: the target {type(leaf).__name__} is not array-like; the checkpoint holds an "
            f"array of shape {record.shape} and dtype {record.dtype}. Use a jax.ShapeDtypeStruct."
        )
    if tuple(shape) != record.shape:
        raise ValueError(
            f"{where}: expected shape {record.shape} (saved), the target has {tuple(shape)}."
        )
    if str(dtype) != record.dtype:
        raise ValueError(f"{where}: expected dtype {record.dtype} (saved), the target has {dtype}.")


def leaf_placement(
    i: int, record: _format.LeafRecord, leaf: Any, ctx: Context, owner: int | None
) -> Placement:
    """Where an array leaf goes: the target's sharding, numpy, or uncommitted for an
    uncommitted target array; without a target sharding, as saved.

    Raises:
      ValueError: if no sharding was asked for and the saved one does not exist here.
    """
    if leaf is None or isinstance(leaf, np.ndarray):
        return HOST
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return UNCOMMITTED  # fresh state made outside any mesh: leave it free to move
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        return sharding
    if record.kind != _format.ARRAY:
        return HOST  # a numpy array was saved and no sharding asked for
    if owner is None:
        owner = ctx.process if ctx.process in ctx.manifests else min(ctx.manifests, default=0)
    if own_record(i, record, ctx.manifests.get(owner)).uncommitted:
        return UNCOMMITTED
    saved = saved_sharding(i, record, ctx.manifests.get(owner))
    if saved is None:
        whose = f"process {owner} saved it with" if record.per_process else "saved sharding"
        desc = ctx.manifests[owner].shardings.get(i) if record.per_process else record.sharding
        raise ValueError(
            f"{ctx.where(record)}: the {whose} ({desc}) uses devices this "
            f"{'process' if record.per_process else 'runtime'} does not have; give the target a "
            "sharding (jax.ShapeDtypeStruct(shape, dtype, sharding=...))."
        )
    return saved
