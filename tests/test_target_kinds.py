"""Restore targets of another node kind than the saved tree: matched by key names.

`mngr.item_metadata(step).train` nests every saved node as dicts and lists, so
it is a restore target for a namedtuple, a flax.struct dataclass, a registered
dataclass, a custom pytree node and an nnx.State alike; the result takes the
target's structure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


class Pair(NamedTuple):
    a: Any
    b: Any


@flax.struct.dataclass
class FlaxPair:
    a: Any
    b: Any


@dataclasses.dataclass
class RegisteredPair:
    a: Any
    b: Any


jax.tree_util.register_dataclass(RegisteredPair, data_fields=["a", "b"], meta_fields=[])


class CustomPair:
    """A node registered without keys: its children have FlattenedIndexKey paths."""

    def __init__(self, a: Any, b: Any):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(
    CustomPair, lambda p: ((p.a, p.b), None), lambda _, children: CustomPair(*children)
)


def _leaves(mesh: Any) -> tuple[jax.Array, np.ndarray]:
    a = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data")))
    return a, np.arange(3, dtype=np.int32)


def _nnx_state() -> Any:
    return nnx.state(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.Param)


KINDS = {
    "namedtuple": lambda a, b: Pair(a, b),
    "flax_struct": lambda a, b: FlaxPair(a, b),
    "registered_dataclass": lambda a, b: RegisteredPair(a, b),
    "custom_node": lambda a, b: CustomPair(a, b),
    "sequence": lambda a, b: (a, [b]),
}


def _flat(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _restored_from_metadata(memory_root, ckpt_dir, state, *targets):
    """Saves `state` as step 1; returns its item metadata, the restore into that
    metadata, then the restore into each of `targets`."""
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        meta = mngr.item_metadata(1).train
        return (meta, restore(mngr, 1, meta), *(restore(mngr, 1, t) for t in targets))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_item_metadata_is_a_restore_target(memory_root, ckpt_dir, kind):
    mesh = mesh_1d()
    state = {"node": KINDS[kind](*_leaves(mesh)), "step": 3}
    meta, restored = _restored_from_metadata(memory_root, ckpt_dir, state)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(meta)
    for got, want in zip(_flat(restored), _flat(state), strict=True):
        np.testing.assert_array_equal(got, want)
    first = jax.tree_util.tree_leaves(restored)[0]
    assert isinstance(first, jax.Array) and first.sharding.is_equivalent_to(
        NamedSharding(mesh, P("data")), 2
    )


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_saved_dicts_restore_into_any_node_kind(memory_root, ckpt_dir, kind):
    mesh = mesh_1d()
    a, b = _leaves(mesh)
    saved = {"node": {"a": a, "b": b} if kind != "sequence" else [a, [b]]}
    if kind == "custom_node":
        saved = {"node": {0: a, 1: b}}
    target = {"node": KINDS[kind](*_leaves(mesh))}
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, saved)
        mngr.wait_until_finished()
        restored = restore(mngr, 1, target)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)
    for got, want in zip(_flat(restored), [np.asarray(a), b], strict=True):
        np.testing.assert_array_equal(got, want)


def test_nnx_state_metadata_is_a_restore_target(memory_root, ckpt_dir):
    state = {"params": _nnx_state(), "step": 1}
    target = {"params": _nnx_state(), "step": 0}
    _, restored, again = _restored_from_metadata(memory_root, ckpt_dir, state, target)
    for got, want in zip(_flat(restored), _flat(state), strict=True):
        np.testing.assert_array_equal(got, want)
    assert isinstance(again["params"], nnx.State)
    for got, want in zip(_flat(again), _flat(state), strict=True):
        np.testing.assert_array_equal(got, want)


def test_ambiguous_or_missing_names_are_still_refused(memory_root, ckpt_dir):
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, {"node": Pair(np.zeros(2), np.ones(2))})
        mngr.wait_until_finished()
        with pytest.raises(
            ValueError, match=r"target has leaves the checkpoint lacks: \['node'\]\['c'\]"
        ):
            restore(mngr, 1, {"node": {"a": np.zeros(2), "c": np.ones(2)}})
