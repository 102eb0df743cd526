"""How device shards reach host memory at a save: pinned_host staging, CPU views."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt
from jaxckpt.save import _save, _snapshot


@pytest.mark.parametrize(
    ("pinned", "hold", "large", "expected"),
    [
        (None, False, True, "slab"),  # copied into the slab before save() returns
        (None, False, False, "copy"),  # a small part: into private memory first
        (None, True, False, "cpu_view"),
        (True, False, False, "pinned_host"),
    ],
)
def test_a_save_stages_shards_as_configured_and_restores_exactly(
    pinned, hold, large, expected, memory_root, ckpt_dir
):
    mesh = mesh_1d()
    state = sharded_state(mesh)
    if large:  # more than a small part
        big = np.arange(_save.PRIVATE_COPY_BYTES // 4 + 4096, dtype=np.float32)
        state["big"] = jax.device_put(big, jax.NamedSharding(mesh, jax.P()))
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(
            memory_root, persist_every=1000, pinned_host_staging=pinned, hold_cpu_arrays=hold
        )
    )
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        assert h.last_save_metrics["host_staging"] == expected
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)


def test_hold_cpu_arrays_is_validated():
    with pytest.raises(ValueError, match="hold_cpu_arrays must be a bool"):
        jaxckpt.TierOptions("/tmp/m", hold_cpu_arrays="yes")


def test_pinned_staging_copies_every_shard_in_one_batch_and_holds_it():
    mesh = mesh_1d()
    x = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(16, 4), jax.NamedSharding(mesh, jax.P("data"))
    )
    snap = _snapshot.take({"x": x, "k": jax.random.key(1)}, 0, pinned_host=True)
    assert snap.staging == "pinned_host"
    assert len(snap.shards) == 8 + 1
    for shard in snap.shards:
        assert shard.holds.sharding.memory_kind == "pinned_host"  # kept alive with the view
    leaf = [r.path for r in snap.leaves].index("['x']")
    of_x = sorted((s for s in snap.shards if s.leaf == leaf), key=lambda s: s.index)
    rows = np.concatenate([s.data for s in of_x])
    np.testing.assert_array_equal(rows, np.asarray(x))


def test_pinned_host_staging_is_validated():
    with pytest.raises(ValueError, match="pinned_host_staging must be None"):
        jaxckpt.TierOptions("/tmp/m", pinned_host_staging="yes")
