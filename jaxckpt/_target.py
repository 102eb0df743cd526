"""Matching a restore target against the saved tree, and filling it in.

Everything a target can get wrong (structure, shape, dtype, kind, iterator
states for another process count) is checked before any byte is read, and
before any collective, so every process fails the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt import _format, _sharding, _tree
from jaxckpt._restore import Restorer

# (states saved by every process, in process order; this process; process count) -> state
IteratorStateFn = Callable[[list[Any], int, int], Any]


@dataclasses.dataclass(frozen=True)
class Context:
    """Who restores which step, and what every process saved for it.

    Attributes:
      manifests: owner -> index manifest of every part of the step.
      process: this process's index.
      count: how many processes restore.
      step: the step restored.
      iterator_state_fn: maps saved iterator states when the process count changed.
    """

    manifests: Mapping[int, _format.PartManifest]
    process: int
    count: int
    step: int
    iterator_state_fn: IteratorStateFn | None = None


class IteratorState:
    """Metadata leaf for a saved iterator: `state` is what `get_state()` returned."""

    def __init__(self, state: Any):
        self.state = state

    def __repr__(self) -> str:
        return f"IteratorState({self.state!r})"


def leaf_metadata(record: _format.LeafRecord, iterator_state: Any) -> Any:
    """What `metadata()` shows for one saved leaf."""
    if record.kind == _format.ARRAY:
        assert record.shape is not None and record.dtype is not None
        if record.key_impl:
            dtype = jax.eval_shape(lambda: jax.random.key(0, impl=record.key_impl)).dtype
        else:
            dtype = np.dtype(record.dtype)
        return jax.ShapeDtypeStruct(
            record.shape, dtype, sharding=_sharding.rebuild(record.sharding)
        )
    if record.kind == _format.NUMPY:
        assert record.shape is not None and record.dtype is not None
        return jax.ShapeDtypeStruct(record.shape, np.dtype(record.dtype))
    if record.kind == _format.SCALAR:
        return _tree.scalar_value(record)
    return IteratorState(_tree.decode_iterator_state(iterator_state))


def iterator_state(leaf: int, record: _format.LeafRecord, ctx: Context) -> Any:
    """The state process `pi` of `count` gets for a saved iterator.

    Same process count: its own saved state. Otherwise, if every saved state is
    identical (a global position), that state; else `fn` decides.

    Raises:
      ValueError: if the process count changed, the states differ and no `fn` was given.
    """
    manifests, pi, count, fn, step = (
        ctx.manifests,
        ctx.process,
        ctx.count,
        ctx.iterator_state_fn,
        ctx.step,
    )
    saved = len(manifests)
    states = [
        _tree.decode_iterator_state(manifests[o].iterator_states.get(leaf))
        for o in sorted(manifests)
    ]
    if fn is not None and saved != count:
        return fn(states, pi, count)
    if saved == count and pi in manifests:
        return states[sorted(manifests).index(pi)]
    if all(s == states[0] for s in states):
        return states[0]
    raise ValueError(
        f"[process {pi}] Leaf {record.path} at step {step}: the checkpoint holds different "
        f"iterator states for each of its {saved} processes and {count} processes restore it. "
        "Make the iterator state a global position (identical on every process), or pass "
        "TieredRestore(..., iterator_state_fn=fn) to map the saved states to each process."
    )


def check(records: Sequence[_format.LeafRecord], target: Any, ctx: Context) -> None:
    """Raises ValueError/TypeError naming the leaf if `target` does not fit the saved tree."""
    if target is None:
        return
    pi, step = ctx.process, ctx.step
    pairs, _ = _tree.flatten(target)
    by_path = {r.path: i for i, r in enumerate(records)}
    missing = [p for p, _ in pairs if p not in by_path]
    extra = sorted(set(by_path) - {p for p, _ in pairs})
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
            f"[process {pi}] The restore target does not match the tree saved at step {step}: "
            + "; ".join(parts)
            + ". Build the target from the same state structure (mngr.item_metadata(step) shows it)."
        )
    for path, leaf in pairs:
        i = by_path[path]
        _check_leaf(records[i], leaf, pi, step)
        if records[i].kind == _format.ITERATOR and _tree.is_iterator(leaf):
            iterator_state(i, records[i], ctx)


def _check_leaf(record: _format.LeafRecord, leaf: Any, pi: int, step: int) -> None:
    where = f"[process {pi}] Leaf {record.path or '<root>'} at step {step}"
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


def fill(
    restorer: Restorer, records: Sequence[_format.LeafRecord], target: Any, ctx: Context
) -> Any:
    """The restored tree, in the structure and layout of `target` (None: everything on host)."""
    if target is None:
        entries = [(r.keys, _host_value(restorer, i, r, ctx)) for i, r in enumerate(records)]
        return _tree.nest(entries)
    pairs, treedef = _tree.flatten(target)
    by_path = {r.path: i for i, r in enumerate(records)}
    out = []
    for path, leaf in pairs:
        i = by_path[path]
        record = records[i]
        if record.kind == _format.ITERATOR:
            state = iterator_state(i, record, ctx)
            if _tree.is_iterator(leaf):
                leaf.set_state(state)
                out.append(leaf)
            else:
                out.append(state)
        elif record.kind == _format.SCALAR:
            out.append(_tree.scalar_value(record))
        else:
            out.append(_array(restorer, i, record, leaf, ctx.process, ctx.step))
    return jax.tree_util.tree_unflatten(treedef, out)


def _host_value(restorer: Restorer, i: int, record: _format.LeafRecord, ctx: Context) -> Any:
    if record.kind == _format.SCALAR:
        return _tree.scalar_value(record)
    if record.kind == _format.ITERATOR:
        return iterator_state(i, record, ctx)
    return _with_key_impl(restorer.host_array(i), record)


def _array(
    restorer: Restorer, i: int, record: _format.LeafRecord, leaf: Any, pi: int, step: int
) -> Any:
    if isinstance(leaf, np.ndarray):
        return _with_key_impl(restorer.host_array(i), record)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None and record.kind == _format.ARRAY:
        # A jax.Array was saved and no sharding asked for: lay it out as it was saved.
        sharding = _sharding.rebuild(record.sharding)
        if sharding is None:
            raise ValueError(
                f"[process {pi}] Leaf {record.path} at step {step}: the saved sharding "
                f"{record.sharding} uses devices this runtime does not have; give the target "
                "a sharding (jax.ShapeDtypeStruct(shape, dtype, sharding=...))."
            )
    if sharding is None:
        return _with_key_impl(restorer.host_array(i), record)
    return restorer.array(i, sharding)


def _with_key_impl(data: np.ndarray, record: _format.LeafRecord) -> Any:
    if record.key_impl:
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=record.key_impl)
    return data
