"""The snapshot derives a tree's paths, kinds and leaf records once per tree structure:
a tree that differs in any way that matters is never served another tree's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.format import _format
from jaxckpt.save import _snapshot


def _take(tree):
    snap = _snapshot.take(tree, 0)
    for s in snap.shards:
        s.release()
    return snap


def test_the_same_tree_is_described_once_and_again_alike():
    tree = {"a": jnp.ones((4, 8)), "b": np.arange(3), "step": 1}
    first = _take(tree)
    assert first.leaves == _take({"a": jnp.zeros((4, 8)), "b": np.arange(3, 6), "step": 2}).leaves
    assert [r.path for r in first.leaves] == ["['a']", "['b']", "['step']"]


@pytest.mark.parametrize(
    "changed",
    [
        {"a": jnp.ones((4, 9)), "b": np.arange(3), "step": 1},  # a shape
        {"a": jnp.ones((4, 8), jnp.bfloat16), "b": np.arange(3), "step": 1},  # a dtype
        {"a": jnp.ones((4, 8)), "b": np.arange(3.0), "step": 1},  # a numpy dtype
        {"a": jnp.ones((4, 8)), "c": np.arange(3), "step": 1},  # a key
        {"a": jnp.ones((4, 8)), "b": np.arange(3), "step": 1.5},  # a scalar's type
        {"a": jnp.ones((4, 8)), "b": np.arange(3), "step": np.ones(2)},  # a kind
    ],
)
def test_a_changed_tree_is_not_served_the_cached_description(changed):
    _take({"a": jnp.ones((4, 8)), "b": np.arange(3), "step": 1})
    fresh = _take(changed)
    leaves = jax.tree_util.tree_flatten_with_path(changed)[0]
    for record, (path, value) in zip(fresh.leaves, leaves, strict=True):
        assert record.path == jax.tree_util.keystr(path)
        if isinstance(value, (jax.Array, np.ndarray)):
            assert record.shape == value.shape
            assert np.dtype(record.dtype) == np.dtype(value.dtype)
        else:
            assert record.kind == _format.SCALAR
    assert set(fresh.scalars) == {
        i for i, (_, v) in enumerate(leaves) if not isinstance(v, (jax.Array, np.ndarray))
    }


def test_a_changed_sharding_is_not_served_the_cached_records():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    cols = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    x = jnp.arange(32.0).reshape(4, 8)
    by_rows = _take({"w": jax.device_put(x, rows)})
    by_cols = _take({"w": jax.device_put(x, cols)})
    assert by_rows.leaves[0].chunk_shape == (2, 8)
    assert by_cols.leaves[0].chunk_shape == (4, 4)
    assert sorted(s.index for s in by_cols.shards) == [(0, 0), (0, 1)]


def test_an_unsupported_leaf_is_refused_after_a_cached_tree_naming_its_path():
    _take({"a": jnp.ones(2), "n": 1})
    with pytest.raises(TypeError, match=r"\['n'\]"):
        _take({"a": jnp.ones(2), "n": object()})
