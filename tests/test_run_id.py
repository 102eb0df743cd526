"""Path spellings and run ids: a symlinked checkpoint directory finds the same
memory tier, restore reads the run id recorded in the index, and no run id can
name the memory root or its parent."""

from __future__ import annotations

import os

import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt
from jaxckpt.tiers import _paths


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


def test_every_spelling_of_the_checkpoint_dir_has_one_run_id(tmp_path):
    real = tmp_path / "real" / "ckpt"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    spellings = [
        real,
        link,
        tmp_path / "real" / "." / "ckpt",
        tmp_path / "real" / "x" / ".." / "ckpt",
    ]
    (tmp_path / "real" / "x").mkdir()
    ids = {_paths.default_run_id(p / "1" / "train") for p in spellings}
    assert len(ids) == 1


def test_manager_opened_through_a_symlink_finds_the_memory_tier(memory_root, tmp_path):
    """Step 1 lives only in memory; a manager opened through a symlink restores it."""
    real = tmp_path / "ckpt"
    link = tmp_path / "ckpt-link"
    link.symlink_to(real, target_is_directory=True)
    state = sharded_state(mesh_1d())
    with manager(real, handler(memory_root, persist_every=1000)) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
    h = handler(memory_root, persist_every=1000)
    with manager(link, h) as mngr:
        save(mngr, 2, state)  # the same tier: retention (memory_keep=1) drops step 1
        mngr.wait_until_finished()
        h.wait_for_persistence()
        assert len(os.listdir(memory_root)) == 1
        assert h.inspect().memory.steps() == [2]
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "memory"


def test_restore_uses_the_run_id_recorded_in_the_index(memory_root, ckpt_dir):
    """Whatever run id the restoring handler would choose, the saved copies are found."""
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, handler(memory_root, persist_every=1000, run_id="first")) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
    h = handler(memory_root, persist_every=1000, run_id="renamed")
    with manager(ckpt_dir, h) as mngr:
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "memory"


@pytest.mark.parametrize("bad", [".", "..", ".hidden", "-x", "a/b", "", "é"])
def test_run_ids_that_could_escape_the_memory_root_are_refused(memory_root, bad):
    with pytest.raises(ValueError, match="run_id"):
        jaxckpt.TierOptions(memory_root, run_id=bad)


def test_a_plain_run_id_is_accepted(memory_root):
    assert jaxckpt.TierOptions(memory_root, run_id="job-7.v2_a").run_id == "job-7.v2_a"
    assert not os.path.exists(os.path.join(memory_root, "job-7.v2_a"))  # nothing written yet
