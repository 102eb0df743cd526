"""Durable means durable: fsync before the durability rename, and garbage
collection that never deletes the newest persisted step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import faults
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
    expected = {part, item, item.parent, ckpt_dir, item / "index.json"}
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


def test_steps_still_being_persisted_are_kept_with_the_newest_durable_one(memory_root, ckpt_dir):
    """While step 4 is being persisted, step 2 (durable) and 4 both survive LatestN(1)."""
    state = {"x": jax.device_put(np.arange(16.0), NamedSharding(mesh_1d(), P("data")))}
    h = handler(memory_root, persist_every=2)
    with (
        manager(ckpt_dir, h, use_async=False, max_to_keep=1) as mngr,
        faults.held("persist_begin", steps={4}) as gate,
    ):
        for step in range(1, 7):
            save(mngr, step, state)
            if step == 2:
                h.wait_for_persistence()
        assert mngr.all_steps() == [2, 4, 6]  # 6 is queued behind 4
        gate.set()
        h.wait_for_persistence()
        save(mngr, 7, state)
        assert mngr.all_steps() == [6, 7]


def test_a_save_that_asks_for_persistence_is_persisted_whatever_persist_every_says(
    memory_root, ckpt_dir, caplog
):
    """The last step of a run (`TieredSave(state, persist=True)`) ends up on disk: it
    survives the memory tier's loss and garbage collection keeps it; a clean close says
    nothing of it. Without the flag, close warns that the newest step is in memory only."""
    state = sharded_state(mesh_1d())
    last = 7
    h = handler(memory_root, persist_every=100)
    with manager(ckpt_dir, h, max_to_keep=1) as mngr:
        for step in range(1, last + 1):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    train=jaxckpt.TieredSave(state, persist=step == last or step == 3)
                ),
            )
        mngr.wait_until_finished()
        h.wait_for_persistence()
        assert (ckpt_dir / f"{last}/train/part_00000").is_dir()
        assert not (ckpt_dir / f"{last - 1}").exists()  # max_to_keep=1: gone, not durable
        with caplog.at_level("WARNING"):
            mngr.close()
    assert not [r for r in caplog.records if "memory tiers only" in r.getMessage()]
    shutil.rmtree(memory_root)
    h = handler(memory_root, persist_every=100)
    with manager(ckpt_dir, h) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == last
        assert_tree_equal(restore(mngr, last, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "persistent"
        save(mngr, last + 1, state)  # not due, not asked for
        mngr.wait_until_finished()
        with caplog.at_level("WARNING"):
            mngr.close()
    warned = [r.getMessage() for r in caplog.records if "memory tiers only" in r.getMessage()]
    assert len(warned) == 1 and f"step {last + 1} " in warned[0]
    assert "TieredSave(state, persist=True)" in warned[0]


def test_a_step_asked_to_persist_is_kept_until_durable_and_persisted_after_a_crash(
    memory_root, ckpt_dir, monkeypatch
):
    """Step 3 asked for persistence, but the job died before its persist ran: garbage
    collection keeps it (it is the next durable step), and the restarted job persists it
    from memory, as it does for a step due by persist_every."""
    from jaxckpt.tiers import _persister

    submit = _persister.Persister.submit
    monkeypatch.setattr(
        _persister.Persister,
        "submit",
        lambda self, job: None if job.manifest.step == 3 else submit(self, job),
    )
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2, memory_keep=3)
    with manager(ckpt_dir, h, use_async=False, max_to_keep=1) as mngr:
        for step in (2, 3, 5):
            mngr.save(
                step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state, persist=step == 3))
            )
        h.wait_for_persistence()
        assert mngr.all_steps() == [2, 3, 5]  # 2 durable; 3 to be persisted; 5 newest
    assert not (ckpt_dir / "3/train/part_00000").exists()
    monkeypatch.setattr(_persister.Persister, "submit", submit)

    h = handler(memory_root, persist_every=2, memory_keep=3)
    with manager(ckpt_dir, h) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == 5
        h.wait_for_persistence()
        assert h.last_persist_metrics["step"] == 3
    assert (ckpt_dir / "3/train/part_00000").is_dir()


def test_persist_must_be_a_bool():
    with pytest.raises(TypeError, match=r"persist=\.\.\.\) must be a bool"):
        jaxckpt.TieredSave({"x": np.zeros(2)}, persist="yes")


def _slabs(memory_root: str) -> list[Path]:
    """Every slab file in a memory root: the steps' parts and the spare slabs. Memory
    retention may be deleting an older step meanwhile (it runs in the background):
    `os.walk` passes over a directory that is gone, where `rglob` raises."""
    return [
        Path(top, name)
        for top, _, files in os.walk(memory_root)
        for name in files
        if "slab" in name
    ]


def test_release_memory_frees_the_tier_once_the_newest_step_is_durable(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=100)
    with manager(ckpt_dir, h) as mngr:
        for step in range(1, 4):
            mngr.save(
                step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state, persist=step == 3))
            )
        mngr.wait_until_finished()
        assert _slabs(memory_root)  # step 3 (and any spare slabs the tier keeps)
        assert h.release_memory() == [3]
        assert _slabs(memory_root) == []
        assert_tree_equal(restore(mngr, 3, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "persistent"
        save(mngr, 4, state)  # a later save fills the tier again
        mngr.wait_until_finished()
        assert_tree_equal(restore(mngr, 4, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "memory"


def test_release_memory_persists_a_newest_step_that_was_not_due_then_frees_the_tier(
    memory_root, ckpt_dir
):
    """A run that ends on step 3 (not due, not asked for) ends with it durable."""
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    with manager(ckpt_dir, h) as mngr:
        for step in range(1, 4):
            save(mngr, step, state)
        mngr.wait_until_finished()
        assert 3 in h.release_memory()
        assert _slabs(memory_root) == []
        assert (ckpt_dir / "3" / "train" / "part_00000").is_dir()
        assert_tree_equal(restore(mngr, 3, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "persistent"


def test_release_memory_says_what_it_keeps_when_the_newest_step_cannot_be_persisted(
    memory_root, ckpt_dir, caplog
):
    """This process's part of the newest step is in no memory tier of its own (as after a
    restore from a peer): nothing can persist it, so the tier stays, said plainly."""
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2, memory_keep=2)
    with manager(ckpt_dir, h) as mngr:
        for step in range(1, 4):
            save(mngr, step, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        (step_3,) = Path(memory_root).glob("*/step_000000000003")
        shutil.rmtree(step_3)
        caplog.set_level("WARNING")
        assert h.release_memory() == []
        assert "not releasing the memory tier" in caplog.text and "is 3" in caplog.text
        assert list(Path(memory_root).glob("*/step_000000000002"))  # nothing removed
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)


def test_the_steps_kept_against_the_policy_are_logged_once_per_change(
    memory_root, ckpt_dir, caplog
):
    """Saving every step with max_to_keep=1 and persist_every=4: step 4 is kept against
    the policy from step 5 to 8, then step 8: two DEBUG lines, not one per save."""
    state = {"x": jax.device_put(np.arange(16.0), NamedSharding(mesh_1d(), P("data")))}
    h = handler(memory_root, persist_every=4)
    with (
        caplog.at_level("DEBUG"),
        caplog.at_level("DEBUG", logger="absl"),
        manager(ckpt_dir, h, use_async=False, max_to_keep=1) as mngr,
    ):
        for step in range(1, 12):
            save(mngr, step, state)
            h.wait_for_persistence()
    said = [r.getMessage() for r in caplog.records if "jaxckpt: keeping steps" in r.getMessage()]
    assert [m.split("[")[1].split("]")[0] for m in said] == ["4", "8"]
