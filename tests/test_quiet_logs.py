"""Quiet by default: saves and persists log at DEBUG, the first save and every restore
one INFO line each (step, source, time), `restore_existing` too."""

from __future__ import annotations

import logging
import re
import shutil

import orbax.checkpoint as ocp
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt


def _jaxckpt_lines(caplog, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and r.getMessage().startswith("jaxckpt")
    ]


@pytest.fixture
def all_logs(caplog):
    # absl's logger follows its own verbosity: let DEBUG records through for the test.
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="absl"):
        yield caplog


def test_saves_and_persists_are_debug_the_first_save_and_restores_info(
    memory_root, ckpt_dir, all_logs
):
    state = sharded_state(mesh_1d())
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=1)
    )
    mngr = manager(ckpt_dir, handler, max_to_keep=1)
    for step in (1, 2, 3, 4, 5):
        save(mngr, step, state)
        mngr.wait_until_finished()
    handler.wait_for_persistence()

    info = _jaxckpt_lines(all_logs, logging.INFO)
    debug = _jaxckpt_lines(all_logs, logging.DEBUG)
    (first,) = [line for line in info if "first save" in line]
    assert "first save (step 1" in first and f"memory tier {memory_root}" in first
    assert "when step % 2 == 0 (next: step 2)" in first and "no replicas" in first
    assert not [line for line in info if "'event': 'save'" in line or "'event': 'persist'" in line]
    assert not [line for line in info if "keeping steps" in line]
    assert len([line for line in debug if "'event': 'save'" in line]) == 5
    assert len([line for line in debug if "'event': 'persist'" in line]) == 2  # steps 2, 4
    assert len(info) == 1, info  # nothing else changed state

    all_logs.clear()
    assert_tree_equal(restore(mngr, 5, abstract(state)), state)
    (line,) = _jaxckpt_lines(all_logs, logging.INFO)
    assert re.fullmatch(r"jaxckpt: \[process 0\] restored step 5 from memory in \d+\.\d\d s", line)
    mngr.close()

    shutil.rmtree(memory_root)  # the host is gone: step 4 comes from persistent storage
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    mngr = manager(ckpt_dir, handler)
    all_logs.clear()
    assert_tree_equal(restore(mngr, 4, abstract(state)), state)
    (line,) = [x for x in _jaxckpt_lines(all_logs, logging.INFO) if "restored" in x]
    assert "restored step 4 from persistent in " in line
    mngr.close()


def test_restore_existing_logs_the_step_the_old_format_and_the_time(tmp_path, all_logs):
    state = {"w": sharded_state(mesh_1d())["w"]}
    with ocp.CheckpointManager(tmp_path / "old") as old:
        old.save(7, args=ocp.args.StandardSave(state))
        old.wait_until_finished()
    all_logs.clear()
    step, restored = jaxckpt.restore_existing(tmp_path / "old", abstract(state))
    assert step == 7
    assert_tree_equal(restored, state)
    (line,) = [x for x in _jaxckpt_lines(all_logs, logging.INFO) if "restored" in x]
    assert re.fullmatch(
        r"jaxckpt: \[process 0\] restored step 7 from the old format \(Orbax PyTree "
        r".*/old/7/default\) in \d+\.\d\d s",
        line,
    )
    all_logs.clear()
    assert jaxckpt.restore_existing(tmp_path / "nothing", abstract(state)) is None
    assert any("found no Orbax or flax" in x for x in _jaxckpt_lines(all_logs, logging.INFO))
