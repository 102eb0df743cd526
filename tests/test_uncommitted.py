"""Uncommitted target leaves (fresh keys, metrics made outside any mesh) restore uncommitted.

An uncommitted array may be moved by the next jit next to arrays on other
devices; pinning the restored copy to device 0 would make that jit fail with
incompatible devices (what Orbax does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def _state(mesh):
    return {
        "w": jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("data"))),
        "key": jax.random.PRNGKey(3),
        "typed_key": jax.random.key(4),
        "metrics": jnp.full(3, 2.5),
    }


def _mix(w, key, typed_key, metrics):
    return w.sum() + key.sum().astype(w.dtype) + metrics.sum() + jax.random.uniform(typed_key)


def test_uncommitted_target_leaves_restore_uncommitted(memory_root, ckpt_dir):
    mesh = mesh_1d()
    state = _state(mesh)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        fresh = {
            "w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
            "key": jax.random.PRNGKey(0),
            "typed_key": jax.random.key(0),
            "metrics": jnp.zeros(3),
        }
        assert not fresh["key"].committed and not fresh["metrics"].committed
        restored = restore(mngr, 1, fresh)
        meta_restored = restore(mngr, 1, mngr.item_metadata(1).train)
    for name in ("key", "typed_key", "metrics"):
        assert not restored[name].committed, name
        assert not meta_restored[name].committed, name  # saved uncommitted: metadata says so
    assert restored["w"].committed and restored["w"].sharding == state["w"].sharding
    np.testing.assert_array_equal(restored["key"], state["key"])
    np.testing.assert_array_equal(
        jax.random.key_data(restored["typed_key"]), jax.random.key_data(state["typed_key"])
    )
    np.testing.assert_array_equal(restored["metrics"], state["metrics"])
    # The next jit mixes the 8-device param with the restored single-device leaves.
    out = jax.jit(_mix)(restored["w"], restored["key"], restored["typed_key"], restored["metrics"])
    assert np.isfinite(float(out))
    jax.jit(_mix)(*(meta_restored[k] for k in ("w", "key", "typed_key", "metrics")))


def test_committed_target_leaves_stay_where_asked(memory_root, ckpt_dir):
    mesh = mesh_1d()
    state = _state(mesh)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    device = jax.devices()[3]
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        target = {**state, "metrics": jax.device_put(jnp.zeros(3), device)}
        restored = restore(mngr, 1, target)
    assert restored["metrics"].committed and restored["metrics"].devices() == {device}


def test_fresh_nnx_rngs_and_metrics_restore_next_to_a_sharded_model(memory_root, ckpt_dir):
    mesh = mesh_1d()
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    params = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim == 2 else P())),
        nnx.state(model, nnx.Param),
    )
    rngs = nnx.state(nnx.Rngs(params=1, dropout=2))
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, {"params": params, "rngs": rngs, "loss": jnp.zeros(())})
        mngr.wait_until_finished()
        target = {
            "params": params,
            "rngs": nnx.state(nnx.Rngs(params=5, dropout=6)),
            "loss": jnp.ones(()),
        }
        restored = restore(mngr, 1, target)

    @jax.jit
    def step(params, rngs, loss):
        key = jax.tree_util.tree_leaves(rngs)[0]
        noise = (
            jax.random.uniform(key)
            if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
            else 0.0
        )
        return sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(params)) + loss + noise

    step(restored["params"], restored["rngs"], restored["loss"])
