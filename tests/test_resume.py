"""`jaxckpt.latest_restorable_step`: the one call a resuming job makes."""

from __future__ import annotations

import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import (
    abstract,
    assert_tree_equal,
    manager,
    mesh_1d,
    restore,
    save,
    sharded_state,
    slab_chunk,
)

import jaxckpt
from jaxckpt import _resume
from jaxckpt.tiers import _memory_tier, _quarantine


def _state(step: int) -> dict:
    state = sharded_state(mesh_1d(), seed=step)
    state["step"] = step
    return state


def _saved(memory_root, ckpt_dir, steps, **manager_options):
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=2)
    )
    mngr = manager(ckpt_dir, handler, **manager_options)
    for step in steps:
        save(mngr, step, _state(step))
    mngr.wait_until_finished()
    handler.wait_for_persistence()
    return mngr, handler


def test_memory_intact_returns_the_newest_step_and_deletes_nothing(memory_root, ckpt_dir):
    mngr, _ = _saved(memory_root, ckpt_dir, [1, 2, 3])
    mngr.close()
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    mngr = manager(ckpt_dir, handler)
    assert jaxckpt.latest_restorable_step(mngr) == 3
    assert mngr.all_steps() == [1, 2, 3]
    assert_tree_equal(restore(mngr, 3, abstract(_state(3))), _state(3))
    mngr.close()


@pytest.mark.parametrize("registry", [True, False], ids=["handler_registry", "item_handlers"])
def test_memory_loss_returns_the_newest_persisted_step_and_frees_newer(
    memory_root, ckpt_dir, registry, caplog
):
    mngr, _ = _saved(memory_root, ckpt_dir, [1, 2, 3, 4, 5], registry=registry)
    mngr.close()
    shutil.rmtree(memory_root)  # the host is gone: only persisted steps (2, 4) survive

    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    mngr = manager(ckpt_dir, handler, registry=registry)
    assert mngr.latest_step() == 5  # what Orbax alone would try, and fail to restore
    assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 4
    assert mngr.all_steps() == [1, 2, 3, 4, 5]
    with caplog.at_level("WARNING", logger="jaxckpt"):
        assert jaxckpt.latest_restorable_step(mngr) == 4
    assert mngr.all_steps() == [1, 2, 3, 4]
    deleted = [r.getMessage() for r in caplog.records if "deleting step" in r.getMessage()]
    assert len(deleted) == 1 and "deleting step 5" in deleted[0]
    assert "no tier holds" in deleted[0] and "newest restorable step is 4" in deleted[0]
    assert_tree_equal(restore(mngr, 4, abstract(_state(4))), _state(4))

    # The resumed job saves step 5 again, and it is really saved.
    save(mngr, 5, _state(5))
    mngr.wait_until_finished()
    assert mngr.all_steps()[-1] == 5
    assert_tree_equal(restore(mngr, 5, abstract(_state(5))), _state(5))
    mngr.close()


def test_nothing_restorable_returns_none_and_deletes_nothing(memory_root, ckpt_dir, caplog):
    """The last steps there are stay when none is restorable (a tier may come back),
    and the warning says so, naming them and what to do."""
    mngr, _ = _saved(memory_root, ckpt_dir, [1, 3])  # persist_every=2: both in memory only
    mngr.close()
    shutil.rmtree(memory_root)
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    mngr = manager(ckpt_dir, handler)
    with caplog.at_level("WARNING", logger="jaxckpt"):
        assert jaxckpt.latest_restorable_step(mngr) is None
    assert mngr.all_steps() == [1, 3]
    warned = [r.getMessage() for r in caplog.records if "is restorable" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "steps [1, 3]" in warned[0] and "left in place" in warned[0]
    assert "mngr.delete(step)" in warned[0]
    assert not any("deleting step" in r.getMessage() for r in caplog.records)
    mngr.close()


def test_a_manager_without_a_tiered_item_is_refused(ckpt_dir):
    mngr = ocp.CheckpointManager(ckpt_dir, item_handlers={"x": ocp.StandardCheckpointHandler()})
    mngr.save(1, args=ocp.args.Composite(x=ocp.args.StandardSave({"a": np.zeros(2)})))
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match=r"no item handled by jaxckpt\.TieredCheckpointHandler"):
        jaxckpt.latest_restorable_step(mngr)
    mngr.close()


def test_a_step_a_crash_left_unpersisted_is_persisted_on_restart(
    memory_root, ckpt_dir, monkeypatch
):
    """Step 4 was due for persistence (persist_every=2) but the job died before its
    persist ran: the restarted job persists it from memory, and it survives the
    memory tier's loss."""
    from jaxckpt.tiers import _persister

    submit = _persister.Persister.submit
    monkeypatch.setattr(
        _persister.Persister,
        "submit",
        lambda self, job: None if job.manifest.step == 4 else submit(self, job),
    )
    mngr, _ = _saved(memory_root, ckpt_dir, [2, 3, 4])
    mngr.close()
    assert not (ckpt_dir / "4/train/part_00000").exists()
    assert (ckpt_dir / "2/train/part_00000").exists()
    monkeypatch.setattr(_persister.Persister, "submit", submit)

    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=2)
    )
    with manager(ckpt_dir, handler) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == 4
        handler.wait_for_persistence()
        assert handler.last_persist_metrics["step"] == 4
    shutil.rmtree(memory_root)
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with manager(ckpt_dir, handler) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == 4
        assert_tree_equal(restore(mngr, 4, abstract(_state(4))), _state(4))
        assert handler.last_restore_metrics["tier"] == "persistent"


def test_a_step_not_due_or_already_durable_is_not_persisted_again(memory_root, ckpt_dir):
    mngr, _ = _saved(memory_root, ckpt_dir, [2, 3])
    mngr.close()
    persisted = (ckpt_dir / "2/train/part_00000").stat().st_mtime_ns
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=2)
    )
    with manager(ckpt_dir, handler) as mngr:
        assert jaxckpt.latest_restorable_step(mngr) == 3
        handler.wait_for_persistence()
        assert handler.last_persist_metrics == {}
    assert not (ckpt_dir / "3/train/part_00000").exists()
    assert (ckpt_dir / "2/train/part_00000").stat().st_mtime_ns == persisted


# ---- a damaged newest copy ------------------------------------------------------------


def _damage_newest(memory_root, ckpt_dir):
    """Steps 1..3 with persist_every=2 (step 2 durable, step 3 in memory only), then
    8 bytes of step 3's slab overwritten; the job restarts (a new handler and manager)."""
    mngr, handler = _saved(memory_root, ckpt_dir, [1, 2, 3])
    run_id = handler.inspect().memory.run_id
    mngr.close()
    part = _memory_tier.MemoryTier(memory_root, run_id).part_dir(3, 0)
    slab, offset, _ = slab_chunk(part, "['w']", (2, 0))
    with open(slab, "r+b") as f:
        f.seek(offset + 4)
        f.write(b"\xa5" * 8)
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    return manager(ckpt_dir, handler), part


def handler_run(mngr) -> str:
    """The run id of the memory tier `mngr`'s jaxckpt handler uses."""
    (handler,) = _resume.tiered_handlers(mngr).values()
    return handler.inspect().memory.run_id


def test_a_damaged_newest_copy_is_not_offered_again(memory_root, ckpt_dir):
    """The restore of the damaged step fails (no other copy of it), and quarantines the
    copy: the next resume gets step 2, restores it, and does not loop on step 3."""
    mngr, part = _damage_newest(memory_root, ckpt_dir)
    assert jaxckpt.latest_restorable_step(mngr) == 3  # unverified: the copy looks whole
    with pytest.raises(FileNotFoundError, match=r"chunk \(2, 0\) of \['w'\].*checksum mismatch"):
        restore(mngr, 3, abstract(_state(3)))
    assert _quarantine.is_quarantined(part)
    mngr.close()

    # The next restart: the damaged step is no longer offered, the older one restores.
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    mngr = manager(ckpt_dir, handler)
    assert jaxckpt.latest_restorable_step(mngr) == 2
    assert mngr.all_steps() == [1, 2]  # step 3 deleted: the job saves it again
    assert_tree_equal(restore(mngr, 2, abstract(_state(2))), _state(2))
    save(mngr, 3, _state(3))
    mngr.wait_until_finished()
    assert jaxckpt.latest_restorable_step(mngr) == 3
    assert_tree_equal(restore(mngr, 3, abstract(_state(3))), _state(3))
    mngr.close()


def test_verify_finds_a_damaged_copy_before_answering(memory_root, ckpt_dir):
    mngr, part = _damage_newest(memory_root, ckpt_dir)
    assert jaxckpt.latest_restorable_step(mngr, verify=True, delete_newer=False) == 2
    assert _quarantine.is_quarantined(part)
    assert_tree_equal(restore(mngr, 2, abstract(_state(2))), _state(2))
    # Whole copies pass verification and stay offered.
    tier = _memory_tier.MemoryTier(memory_root, handler_run(mngr))
    assert 2 in tier.inventory() and not _quarantine.is_quarantined(tier.part_dir(2, 0))
    mngr.close()


def test_a_damaged_copy_with_another_copy_falls_back_and_is_quarantined(memory_root, ckpt_dir):
    """Step 2 is durable too: its damaged memory copy falls back to the persisted one,
    and is quarantined, so later restores read the persisted copy directly."""
    mngr, handler = _saved(memory_root, ckpt_dir, [1, 2])
    part = handler.inspect().memory.part_dir(2, 0)
    slab, offset, _ = slab_chunk(part, "['w']", (0, 0))
    with open(slab, "r+b") as f:
        f.seek(offset)
        f.write(b"\x5a" * 8)
    assert_tree_equal(restore(mngr, 2, abstract(_state(2))), _state(2))
    assert handler.last_restore_metrics["fallbacks"] == 1
    assert _quarantine.is_quarantined(part)
    assert_tree_equal(restore(mngr, 2, abstract(_state(2))), _state(2))
    assert handler.last_restore_metrics["fallbacks"] == 0
    assert "memory" not in handler.last_restore_metrics["bytes_by_tier"]
    mngr.close()
