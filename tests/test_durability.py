"""Durable means durable: fsync before the durability rename, and garbage
collection that never deletes the newest persisted step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_every_file_and_directory_of_a_persisted_part_is_fsynced(
    memory_root, ckpt_dir, monkeypatch
):
    """A power loss after the durability rename cannot leave an empty or missing file."""
    synced: set[tuple[int, int]] = set()
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, state)
        h.wait_for_persistence()
    item = ckpt_dir / "1" / "train"
    part = item / "part_00000"
    expected = {part, item, item.parent, ckpt_dir, item / "index_00000.json"}
    expected |= {Path(d) / n for d, dirs, files in os.walk(part) for n in dirs + files}
    missing = sorted(str(p) for p in expected if _identity(p) not in synced)
    assert not missing, f"{len(missing)} not fsynced, such as {missing[:3]}"


@pytest.mark.parametrize(
    "gc",
    [
        {"max_to_keep": 1},
        {"preservation_policy": ocp.checkpoint_managers.LatestN(n=1)},
        {"preservation_policy": "wrapped"},
    ],
    ids=["max_to_keep", "LatestN", "wrapped_LatestN"],
)
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_newest_persisted_step_survives_garbage_collection(memory_root, ckpt_dir, gc, use_async):
    """With LatestN(1), steps 1..5 and persist_every=2, a memory loss leaves step 4."""
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    if gc.get("preservation_policy") == "wrapped":
        gc = {"preservation_policy": h.preservation_policy(ocp.checkpoint_managers.LatestN(n=1))}
    with manager(ckpt_dir, h, use_async=use_async, **gc) as mngr:
        for step in range(1, 6):
            save(mngr, step, state)
            mngr.wait_until_finished()
            h.wait_for_persistence()
        assert mngr.all_steps() == [4, 5]  # 2 went once 4 was durable; 5 is the newest
        assert sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == [4, 5]
        shutil.rmtree(memory_root)
        restored = restore(mngr, 4, abstract(state))
        assert h.last_restore_metrics["tier"] == "persistent"
        assert_tree_equal(restored, state)


def test_steps_still_being_persisted_are_kept_with_the_newest_durable_one(
    memory_root, ckpt_dir, monkeypatch
):
    """While step 4 is being persisted, step 2 (durable) and 4 both survive LatestN(1)."""
    import threading

    from jaxckpt import _persister

    gate = threading.Event()
    original = _persister.Persister._persist

    def held(self, job):
        if job.manifest.step == 4:
            assert gate.wait(60)
        return original(self, job)

    monkeypatch.setattr(_persister.Persister, "_persist", held)
    state = {"x": jax.device_put(np.arange(16.0), NamedSharding(mesh_1d(), P("data")))}
    h = handler(memory_root, persist_every=2)
    with manager(ckpt_dir, h, use_async=False, max_to_keep=1) as mngr:
        for step in range(1, 7):
            save(mngr, step, state)
            if step == 2:
                h.wait_for_persistence()
        assert mngr.all_steps() == [2, 4, 6]  # 6 is queued behind 4
        gate.set()
        h.wait_for_persistence()
        save(mngr, 7, state)
        assert mngr.all_steps() == [6, 7]
