"""Durable under every manager set-up docs/durability.md calls supported: plain options with any
`max_to_keep`, a preservation policy, `item_handlers=`, a handler registry, a synchronous
manager and `jaxckpt.manager_options`. After losing every memory tier, the newest due
persisted step (or a newer one) restores exactly, and nothing raises at close."""

from __future__ import annotations

import os
import shutil
import threading

import faults
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import abstract, assert_tree_equal, mesh_1d, restore, sharded_state

import jaxckpt
from jaxckpt.persistent import _kept

SETUPS = {
    "max_to_keep_1": {"max_to_keep": 1},
    "max_to_keep_2": {"max_to_keep": 2},
    "max_to_keep_3": {"max_to_keep": 3},
    "LatestN_1": {"preservation_policy": ocp.checkpoint_managers.LatestN(n=1)},
    "item_handlers": {"max_to_keep": 1, "form": "item_handlers"},
    "sync": {"max_to_keep": 1, "enable_async_checkpointing": False},
    "manager_options": {"max_to_keep": 1, "form": "manager_options"},
    # manager_options creates a local step's directories in save(); given async_options
    # (directories created on Orbax's threads, awaited through its signals) stay as they are.
    "manager_options_async_directories": {
        "max_to_keep": 1,
        "async_options": ocp.AsyncOptions(create_directories_asynchronously=True),
        "form": "manager_options",
    },
}


def _manager(ckpt_dir, handler, setup: dict) -> ocp.CheckpointManager:
    options = {k: v for k, v in setup.items() if k != "form"}
    form = setup.get("form", "registry")
    if form == "manager_options":
        opts = jaxckpt.manager_options(ckpt_dir, handler=handler, **options)
    else:
        opts = ocp.CheckpointManagerOptions(**options)
    if form == "item_handlers":
        return ocp.CheckpointManager(ckpt_dir, item_handlers={"train": handler}, options=opts)
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("train", jaxckpt.TieredSave, handler)
    reg.add("train", jaxckpt.TieredRestore, handler)
    return ocp.CheckpointManager(ckpt_dir, handler_registry=reg, options=opts)


def _handler(memory_root: str) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=5))


@pytest.mark.parametrize("setup", list(SETUPS.values()), ids=list(SETUPS))
def test_losing_every_memory_tier_leaves_the_newest_due_step_under_any_manager_set_up(
    memory_root, ckpt_dir, setup
):
    mesh = mesh_1d()
    states = {step: sharded_state(mesh, seed=step) for step in range(13)}
    h = _handler(memory_root)
    mngr = _manager(ckpt_dir, h, setup)
    for step in range(13):
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(states[step])))
    mngr.wait_until_finished()
    mngr.close()  # raises nothing: a step the manager deleted on purpose is no error
    shutil.rmtree(memory_root)  # every memory tier is lost

    h2 = _handler(memory_root)
    with _manager(ckpt_dir, h2, setup) as mngr2:
        step = jaxckpt.latest_restorable_step(mngr2)
        assert step is not None and step >= 10, (step, mngr2.all_steps())
        assert_tree_equal(restore(mngr2, step, abstract(states[step])), states[step])
        assert h2.last_restore_metrics["tier"] == "persistent"
        # The resumed job saves on from there, and the manager's deletions go on as set.
        mngr2.save(step + 1, args=ocp.args.Composite(train=jaxckpt.TieredSave(states[step])))
        mngr2.wait_until_finished()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_late_persist_never_enters_a_step_the_manager_is_deleting(
    memory_root, ckpt_dir, monkeypatch, use_async
):
    """Step 5's persist ends while the manager deletes step 5 (max_to_keep=1, in the
    save of step 6): its part does not enter the step directory being deleted, the
    deletion and every save succeed, and after every memory tier is lost step 5
    restores from the kept area."""
    release, persisted = threading.Event(), threading.Event()
    rmtree = shutil.rmtree
    entered: list[bool] = []

    def held(step, process):
        if step == 5:
            assert release.wait(60), "the manager never deleted step 5"

    def deleting(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "5" and not release.is_set():
            release.set()  # step 5's persist ends now, while its step is being deleted
            assert persisted.wait(60), "step 5 was never persisted"
            entered.append(os.path.exists(os.path.join(path, "train", "part_00000")))
        return rmtree(path, *args, **kwargs)

    def on_metrics(event):
        if event["event"] == "persist" and event["step"] == 5:
            persisted.set()

    monkeypatch.setattr(shutil, "rmtree", deleting)
    mesh = mesh_1d()
    states = {step: sharded_state(mesh, seed=step) for step in range(8)}
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=5), on_metrics=on_metrics
    )
    setup = {"max_to_keep": 1, "enable_async_checkpointing": use_async}
    with faults.at("persist_begin", held), _manager(ckpt_dir, h, setup) as mngr:
        for step in range(8):
            mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(states[step])))
        h.wait_for_persistence()  # an asynchronous manager may still be deleting
        mngr.wait_until_finished()
        assert mngr.all_steps() == [7]
    assert entered == [False]
    shutil.rmtree(memory_root)  # every memory tier is lost

    h2 = _handler(memory_root)
    with _manager(ckpt_dir, h2, setup) as mngr2:
        assert jaxckpt.latest_restorable_step(mngr2) == 5
        assert_tree_equal(restore(mngr2, 5, abstract(states[5])), states[5])


def test_a_part_whose_persist_ends_after_a_newer_save_began_enters_its_step_later(
    memory_root, ckpt_dir
):
    """max_to_keep=3 keeps step 5: its part, persisted once step 6's save has begun,
    is in its step directory after wait_for_persistence, durable there."""
    mesh = mesh_1d()
    states = {step: sharded_state(mesh, seed=step) for step in range(8)}
    h = _handler(memory_root)
    with (
        _manager(ckpt_dir, h, {"max_to_keep": 3}) as mngr,
        faults.held("persist_begin", steps={5}) as release,
    ):
        for step in range(8):
            mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(states[step])))
        mngr.wait_until_finished()
        release.set()
        h.wait_for_persistence()
        assert (ckpt_dir / "5" / "train" / "part_00000").is_dir()
    shutil.rmtree(memory_root)
    shutil.rmtree(_kept.kept_dir(ckpt_dir))  # durable in its step directory alone
    h2 = _handler(memory_root)
    with _manager(ckpt_dir, h2, {"max_to_keep": 3}) as mngr2:
        assert jaxckpt.latest_restorable_step(mngr2) == 5
        assert_tree_equal(restore(mngr2, 5, abstract(states[5])), states[5])


def test_manager_options_refuse_a_manager_that_deletes_at_any_moment(ckpt_dir):
    with pytest.raises(ValueError, match=r"enable_background_delete=True is not supported"):
        jaxckpt.manager_options(ckpt_dir, max_to_keep=2, enable_background_delete=True)


def test_the_kept_area_holds_hard_links_of_the_newest_durable_step_only(memory_root, ckpt_dir):
    """No byte is copied: the kept part's files are the step directory's inodes, and
    the kept copy of an older durable step goes once a newer one is complete."""
    state = sharded_state(mesh_1d())
    h = _handler(memory_root)
    with _manager(ckpt_dir, h, {"max_to_keep": 10}) as mngr:
        for step in range(11):
            mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
            mngr.wait_until_finished()
            h.wait_for_persistence()
        kept = _kept.kept_dir(ckpt_dir)
        assert sorted(os.listdir(kept)) == ["10"]
        part = ckpt_dir / "10" / "train" / "part_00000"
        files = [p for p in part.rglob("*") if p.is_file()]
        assert files
        for f in files:
            twin = kept / "10" / "train" / "part_00000" / f.relative_to(part)
            assert os.stat(twin).st_ino == os.stat(f).st_ino
            assert os.stat(f).st_nlink == 2


GEMMA = {  # upstream google/flax examples/gemma's manager options
    "preservation_policy": ocp.checkpoint_managers.LatestN(n=1),
    "temporary_path_class": ocp.path.atomicity.CommitFileTemporaryPath,
}


def test_switching_into_an_old_orbax_directory_leaves_a_durable_step_from_the_first_save(
    memory_root, ckpt_dir
):
    """Old Orbax step 11; jaxckpt saves 12 and 13 (persist_every=5, so none is due), the
    job is killed and every memory tier lost: step 12, the first save, restores."""
    mesh = mesh_1d()
    with ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(**GEMMA)) as old:
        old.save(11, args=ocp.args.Composite(train=ocp.args.StandardSave({"w": np.ones(4)})))
    states = {step: sharded_state(mesh, seed=step) for step in (12, 13)}
    h = _handler(memory_root)
    mngr = _manager(ckpt_dir, h, GEMMA)
    for step in (12, 13):
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(states[step])))
    mngr.wait_until_finished()
    h.wait_for_persistence()
    assert mngr.all_steps() == [13]  # the manager deleted 11, then 12
    shutil.rmtree(memory_root)  # killed here (no close), every memory tier lost

    h2 = _handler(memory_root)
    with _manager(ckpt_dir, h2, GEMMA) as mngr2:
        assert jaxckpt.latest_restorable_step(mngr2) == 12
        assert_tree_equal(restore(mngr2, 12, abstract(states[12])), states[12])
        assert h2.last_restore_metrics["tier"] == "persistent"


def test_only_the_first_save_into_an_old_directory_is_persisted_beyond_the_steps_due(
    memory_root, ckpt_dir, tmp_path
):
    state = sharded_state(mesh_1d())
    with ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(**GEMMA)) as old:
        old.save(11, args=ocp.args.Composite(train=ocp.args.StandardSave({"w": np.ones(4)})))
    new = tmp_path / "new"
    for directory, first in ((ckpt_dir, 12), (new, 12)):
        h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=100))
        with _manager(directory, h, {}) as mngr:
            for step in (first, first + 1):
                mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
            mngr.wait_until_finished()
            h.wait_for_persistence()
    persisted = sorted(int(p.parent.parent.name) for p in ckpt_dir.glob("*/train/part_00000"))
    assert persisted == [12]  # switching in: the first save
    assert list(new.glob("*/train/part_00000")) == []  # a new job: the steps due only


def test_a_filesystem_without_hard_links_persists_into_the_step_directories_as_before(
    memory_root, ckpt_dir, monkeypatch, caplog
):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(_kept.os, "link", no_links)
    _kept._UNLINKABLE.discard(ckpt_dir)
    state = sharded_state(mesh_1d())
    h = _handler(memory_root)
    caplog.set_level("WARNING")
    with _manager(ckpt_dir, h, {"max_to_keep": 3}) as mngr:
        for step in range(6):
            mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
            mngr.wait_until_finished()
            h.wait_for_persistence()
    assert (ckpt_dir / "5" / "train" / "part_00000").is_dir()
    assert caplog.text.count("cannot hard-link persisted parts") == 1
    assert not list(_kept.kept_dir(ckpt_dir).glob("*/train/part_*"))
