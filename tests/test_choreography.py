"""The operations' choreographies and the opening of a run, in one process.

The exchanges of an operation run in their order only; a failure injected before
each of them (or before the run is opened) is raised, and the handler goes on;
opening the run is explicit (`memory_for` only looks it up) and a first restore
reads the restored step's index once (the recovery of a crashed run's leftovers
is handed it). The multi-process half is tests/test_choreography_multiprocess.py.
"""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt
from jaxckpt import _faults, _metrics
from jaxckpt.run import _choreography
from jaxckpt.tiers import _index, _paths


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


def test_a_first_restore_reads_the_restored_steps_index_once(memory_root, ckpt_dir, monkeypatch):
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, handler(memory_root, persist_every=1)) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
    reads: list[Path] = []
    read_index = _index.read_index

    def counted(item_dir: Path) -> _index.Index:
        reads.append(Path(item_dir))
        return read_index(item_dir)

    monkeypatch.setattr(_index, "read_index", counted)
    h = handler(memory_root, persist_every=1)  # a new run here: opened by this restore
    try:
        restored = h.restore(Path(ckpt_dir) / "1" / "train", jaxckpt.TieredRestore(abstract(state)))
    finally:
        h.close()
    assert_tree_equal(restored, state)
    assert h.last_restore_metrics["tier"] == "memory"
    assert reads == [Path(ckpt_dir) / "1" / "train"], reads


def test_memory_for_only_looks_the_run_up(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1000)
    item = _paths.ItemDir.parse(Path(ckpt_dir) / "1" / "train")
    run = h.inspect().run
    assert run.memory_for(item) is None
    assert not Path(memory_root).exists() or not list(Path(memory_root).iterdir())
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)  # opens the run
        mngr.wait_until_finished()
        memory = run.memory_for(item)
        assert memory is not None and memory.steps() == [1]
        assert run.memory_for(_paths.ItemDir.parse(Path(ckpt_dir) / "2" / "train")) is memory


def test_exchanges_run_only_in_their_order(memory_root, ckpt_dir):
    h = handler(memory_root)
    try:
        item = _paths.ItemDir.parse(Path(ckpt_dir) / "1" / "train")
        run = h.inspect().run
        op = _choreography.RestoreChoreography(run, item, _metrics.Publisher())
        with pytest.raises(RuntimeError, match="exchange 'inventories' out of order"):
            op.inventories()
        listing = _choreography.ListChoreography(run, item)
        with pytest.raises(RuntimeError, match="ended without its exchange 'meet'"), listing:
            pass
    finally:
        h.close()


@pytest.mark.parametrize(
    "point", [p for p in _faults.POINTS if p.split(".")[0] in ("save", "restore", "list")]
)
def test_a_failure_before_each_exchange_is_raised_and_the_handler_goes_on(
    memory_root, ckpt_dir, monkeypatch, point
):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1000)
    operation = point.split(".")[0]
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        injected = rf"\[process 0\] injected fault before {point} of step"
        with faults.failing(point), pytest.raises(RuntimeError, match=injected):
            if operation == "save":
                save(mngr, 2, state)
                mngr.wait_until_finished()
            elif operation == "restore":
                restore(mngr, 1, abstract(state))
            else:
                h.restorable_steps(Path(ckpt_dir) / "0" / "train")
        save(mngr, 3, state)
        mngr.wait_until_finished()
        assert_tree_equal(restore(mngr, 3, abstract(state)), state)
        assert h.restorable_steps(Path(ckpt_dir) / "0" / "train")[0] == 3


def test_an_unknown_fault_point_is_refused():
    with pytest.raises(ValueError, match=r"Unknown fault point 'restore\.plan'"):
        _faults.failure("restore.plan", 1, 0)
    with pytest.raises(ValueError, match=r"Unknown fault point 'persist_start'"):
        _faults.at("persist_start", 1, 0)


def test_a_hook_runs_at_every_point_only_while_installed():
    seen: list[tuple[str, int | None, int]] = []
    with _faults.hooked(lambda point, step, process: seen.append((point, step, process))):
        _faults.at("persist_begin", 4, 0)
        assert _faults.failure("save.meet", 4, 1) is None  # the hook raised nothing
    _faults.at("persist_begin", 5, 0)
    assert seen == [("persist_begin", 4, 0), ("save.meet", 4, 1)]
