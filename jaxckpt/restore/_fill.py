"""Filling a matched restore target in: each saved leaf read into its place.

`_target` matched the target against the saved tree and checked it before any
byte was read; here every leaf is materialised where the target says: onto the
target's sharding (through `Restorer.array`, placed together by
`Restorer.place`), as numpy on the host, or uncommitted; per-process values as
`_target.source` or the user's `per_process_fn` choose; typed PRNG keys with
their impl, and weak types kept where the target has them. Leaves read 1/R a
process wait for the reshard onto their targets, a collective the restore's
choreography runs (`Filled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.coord import _read_layout
from jaxckpt.format import _format, _sharding, _tree, _weak_type
from jaxckpt.restore._restore import Restorer
from jaxckpt.restore._target import (
    HOST,
    UNCOMMITTED,
    Context,
    Placement,
    iterator_state,
    leaf_placement,
    match,
    per_process_mapper,
    scalar,
    source,
)


@dataclasses.dataclass(frozen=True)
class Filled:
    """A restored tree on this process, but for its leaves read 1/R a process: those wait
    in `resharding` for the collective that carries them onto their targets (the restore
    choreography's exchange `reshard`); `tree` takes its result and makes the tree."""

    resharding: _read_layout.Resharding
    _finish: Callable[[Sequence[jax.Array]], Any]

    def tree(self, resharded: Sequence[jax.Array]) -> Any:
        """The restored tree, the arrays of `resharding` replaced by `resharded`."""
        return self._finish(resharded)


def fill(
    restorer: Restorer, records: Sequence[_format.LeafRecord], target: Any, ctx: Context
) -> Filled:
    """The restored tree, in the structure and layout of `target` (None: everything on
    host), once the leaves read 1/R a process are resharded (`Filled`)."""
    if target is None:
        nested = _tree.nest(
            [(r.keys, _leaf(restorer, i, r, None, ctx)) for i, r in enumerate(records)]
        )
        return Filled(_read_layout.Resharding(), lambda resharded: nested)
    pairs, treedef = match(records, target, ctx)
    out = [_leaf(restorer, i, records[i], leaf, ctx) for i, leaf in pairs]
    placed = restorer.place(out)

    def finish(resharded: Sequence[jax.Array]) -> Any:
        values = placed.resharded(resharded)
        kept = [_weak_type.as_target(v, leaf) for v, (_, leaf) in zip(values, pairs, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, kept)

    return Filled(placed.resharding, finish)


def resharded_leaves(
    records: Sequence[_format.LeafRecord], target: Any, ctx: Context
) -> list[tuple[_format.LeafRecord, jax.sharding.Sharding]]:
    """The leaves `fill` reads with `Restorer.array` onto a target sharding, for all the
    processes alike (not per process), in its order, with their shardings: those a
    restore may carry by a reshard (`_restore.compile_reshard` compiles it ahead)."""
    if target is None:
        return []
    pairs, _ = match(records, target, ctx)
    out = []
    for i, leaf in pairs:
        record = records[i]
        if record.kind in (_format.ITERATOR, _format.SCALAR) or record.per_process:
            continue  # as in `_leaf`: no array, or read from one owner
        placement = leaf_placement(i, record, leaf, ctx, None)
        if isinstance(placement, jax.sharding.Sharding):
            out.append((record, placement))
    return out


def _leaf(restorer: Restorer, i: int, record: _format.LeafRecord, leaf: Any, ctx: Context) -> Any:
    """Saved leaf `i` restored into target leaf `leaf` (None: no target, to host); an
    array for a target sharding comes back `Deferred` (`Restorer.place` puts it)."""
    if record.kind == _format.ITERATOR:
        state = iterator_state(i, record, ctx)
        if _tree.is_iterator(leaf):
            leaf.set_state(state)
            return leaf
        return state
    owner = source(i, record, ctx) if record.per_process else None
    mapper = per_process_mapper(record, ctx) if record.per_process and owner is None else None
    if record.kind == _format.SCALAR:
        if mapper is not None:
            return mapper([scalar(i, record, ctx.manifests[o]) for o in sorted(ctx.manifests)])
        first = owner if owner is not None else next(iter(ctx.manifests))
        return scalar(i, record, ctx.manifests[first])
    placement = leaf_placement(i, record, leaf, ctx, owner)
    if mapper is not None:
        saved = [_with_key_impl(restorer.host_array(i, o), record) for o in sorted(ctx.manifests)]
        return _place(_mapped_data(mapper(saved), record, ctx), record, placement)
    if placement == HOST:
        return _with_key_impl(restorer.host_array(i, owner), record)
    if placement == UNCOMMITTED:
        return _place(restorer.host_array(i, owner), record, UNCOMMITTED)
    assert isinstance(placement, jax.sharding.Sharding)
    return restorer.array(i, placement, owner)


def _mapped_data(value: Any, record: _format.LeafRecord, ctx: Context) -> np.ndarray:
    """The stored form of what the user's function returned for an array leaf, checked."""
    data = np.asarray(jax.random.key_data(value) if record.key_impl else value)
    if data.shape != record.stored_shape or data.dtype.name != record.stored_dtype:
        raise ValueError(
            f"{ctx.where(record)}: per_process_fn returned shape {data.shape} and dtype "
            f"{data.dtype}; the leaf was saved with shape {record.stored_shape} and dtype "
            f"{record.stored_dtype}. Return one of the saved values or one like them."
        )
    return data


def _place(data: np.ndarray, record: _format.LeafRecord, placement: Placement) -> Any:
    """Host data of a whole leaf, laid out as `placement` says."""
    if placement == HOST:
        return _with_key_impl(data, record)
    if placement == UNCOMMITTED:
        out = jax.device_put(data)  # no device: uncommitted, jit may move it
    else:
        assert isinstance(placement, jax.sharding.Sharding) and record.shape is not None
        sharding = (
            _sharding.with_trailing_dims(placement, data.ndim - len(record.shape))
            if record.key_impl
            else placement
        )
        out = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    return jax.random.wrap_key_data(out, impl=record.key_impl) if record.key_impl else out


def _with_key_impl(data: np.ndarray, record: _format.LeafRecord) -> Any:
    if record.key_impl:
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=record.key_impl)
    return data
