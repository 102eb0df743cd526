"""The persistent-store seam (`_store.PersistentStore`), one protocol on every store.

The same test body runs on a local directory and, against the local emulators
(tests/support/object_stores.py), on gs:// and s3://: which steps the store lists as
finalized, a part written and made durable by the store alone (no persistence
queue), its bytes restored from it, and a step retired before the manager deletes
it. The filesystem's own members (the kept area, the switch from an old
directory) are tested on a local directory. No test starts a second JAX process.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state
from object_stores import reset_clients, running

import jaxckpt
from jaxckpt.format import _format
from jaxckpt.memory import _memory_tier
from jaxckpt.persistent import (
    _file_store,
    _index,
    _object_store,
    _paths,
    _persist_job,
    _persister,
    _step_dirs,
    _storage,
    _store,
)

ITEM = "train"


@pytest.fixture(
    params=[
        "file",
        pytest.param("gcs", marks=pytest.mark.slow),
        pytest.param("s3", marks=pytest.mark.slow),
    ]
)
def checkpoint_dir(request, tmp_path, monkeypatch) -> Iterator[str]:
    """A checkpoint directory on a filesystem or on an emulated object store."""
    if request.param == "file":
        yield str(tmp_path / "ckpt")
        return
    with running(request.param, tmp_path) as emulator:
        for key, value in emulator.env().items():
            monkeypatch.setenv(key, value)
        reset_clients()
        try:
            yield emulator.url("run")
        finally:
            reset_clients()


def memory_only(url: str, memory_root: str, state, steps=(1, 2)) -> None:
    """Saves `state` as `steps`, none due for persistence, and waits for what persists."""
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=100))
    with manager(url, h, use_async=False) as mngr:
        for step in steps:
            save(mngr, step, state)
        h.wait_for_persistence()


def the_memory_tier(memory_root: str, item_dir: Path) -> _memory_tier.MemoryTier:
    return _memory_tier.MemoryTier(memory_root, _paths.default_run_id(item_dir))


def test_a_path_chooses_its_store_once():
    assert isinstance(_store.at("/tmp/ckpt"), _file_store.FileStore)
    assert _store.at("gs://bucket/run") == _object_store.ObjectStore("gs")
    assert _store.at("s3://bucket/run/5/train") == _object_store.ObjectStore("s3")
    # An item directory carries the store of its place from its parse on.
    assert _paths.ItemDir.parse("gs://bucket/run/5/train").store == _store.at("gs://bucket")
    assert _paths.ItemDir.parse("/tmp/ckpt/5/train").store == _store.at("/tmp/ckpt")


def test_a_store_writes_a_part_that_counts_once_durable_and_restores(checkpoint_dir, memory_root):
    url = checkpoint_dir
    state = sharded_state(mesh_1d())
    memory_only(url, memory_root, state)
    store, root = _store.at(url), _storage.as_path(url)

    # List steps: both finalized steps hold the item; nothing is durable yet.
    assert sorted(store.step_dirs(root)) == [1, 2]
    steps = _paths.finalized_steps(root, ITEM)
    assert sorted(steps) == [1, 2]
    item_dir = steps[2]
    assert not store.is_persisted(item_dir, 0)
    assert not store.is_durable(item_dir)

    # Write a part and commit it: the store does it all from the job.
    memory = the_memory_tier(memory_root, item_dir)
    job = _persister.part_job(memory, item_dir, 2, 0)
    assert job is not None
    try:
        event = store.persist(job, compression=None, timeout_s=60, closing=None)
    finally:
        assert job.pin is not None
        job.pin.release()
    assert event["event"] == "persist" and event["step"] == 2 and event["bytes"] > 0
    assert store.is_persisted(item_dir, 0) and store.is_durable(item_dir)
    assert _index.persisted_parts(item_dir, _index.read_index(item_dir)) == {0}
    assert not store.is_durable(steps[1])  # only the step persisted

    # Read: with every memory tier gone, the step restores from what the store wrote.
    shutil.rmtree(memory_root)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=100))
    with manager(url, h, use_async=False) as mngr:
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "persistent"

    # Delete: a step retired before the manager deletes it no longer looks durable
    # where its chunks could vanish before the rest (an object store); on a
    # filesystem its part goes with its directory, and retiring changes nothing.
    store.retire(root, [ITEM], [2])
    reset_clients()  # gcsfs/s3fs listings cached before the retirement
    assert store.is_durable(item_dir) == isinstance(store, _file_store.FileStore)


def test_a_step_is_listed_once_the_manager_finalized_it(checkpoint_dir, memory_root):
    """A filesystem's manager finalizes a step by renaming it into place: its name is
    what counts. An object store's writes the final names from the start and then a
    commit file: a step directory without one is not finalized."""
    url = checkpoint_dir
    memory_only(url, memory_root, sharded_state(mesh_1d()), steps=(1,))
    store, root = _store.at(url), _storage.as_path(url)
    assert sorted(store.step_dirs(root)) == [1]
    if isinstance(store, _file_store.FileStore):
        (root / "1" / _step_dirs.COMMIT_FILE).unlink(missing_ok=True)
        finalized = [1]
    else:
        _storage.delete_objects(root / "1", [_step_dirs.COMMIT_FILE])
        reset_clients()  # listings cached before the deletion
        finalized = []
    assert sorted(store.step_dirs(root)) == finalized
    assert sorted(_paths.finalized_steps(root, ITEM)) == finalized


def test_a_step_deleted_before_its_persist_ends_is_kept_and_put_back(tmp_path, memory_root):
    """On a filesystem a part whose step the manager deleted meanwhile is persisted into
    the kept area only, which the store reports and puts back as a step directory."""
    ckpt = tmp_path / "ckpt"
    state = sharded_state(mesh_1d())
    memory_only(str(ckpt), memory_root, state, steps=(1,))
    store = _store.at(ckpt)
    final = ckpt / "1" / ITEM
    memory = the_memory_tier(memory_root, final)
    manifest = memory.read_manifest(1, 0)
    assert manifest is not None
    job = _persist_job.PersistJob(
        manifest,
        memory.part_dir(1, 0),
        ckpt / "1.orbax-checkpoint-tmp-0" / ITEM,  # as the manager names it while saving
        final,
    )
    shutil.rmtree(ckpt / "1")  # deleted by the manager before the persist ends
    store.persist(job, compression=None, timeout_s=60, closing=None)
    assert not (ckpt / "1").exists()  # never recreated by the persist
    assert store.kept_step(ckpt, [ITEM]) == 1

    assert store.reinstate(ckpt, [ITEM]) == 1
    assert store.is_durable(final)
    assert store.reinstate(ckpt, [ITEM]) is None  # in place already
    shutil.rmtree(memory_root)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=100))
    with manager(str(ckpt), h, use_async=False) as mngr:
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)


def test_a_filesystem_tells_a_directory_of_old_steps_only(tmp_path, memory_root):
    """What the first save into a directory asks (`Keeper.switching_in`): older steps of
    another kind and no durable jaxckpt step, neither in place nor kept."""
    ckpt = tmp_path / "ckpt"
    store = _store.at(ckpt)
    assert not store.old_steps_only(ckpt, ITEM)  # no directory
    (ckpt / "7" / ITEM).mkdir(parents=True)  # an older loop's step: no jaxckpt index
    (ckpt / "8.orbax-checkpoint-tmp-3" / ITEM).mkdir(parents=True)  # never finalized
    assert sorted(store.step_dirs(ckpt)) == [7]
    assert store.old_steps_only(ckpt, ITEM)

    # The first save into it (not due) is persisted: then a durable jaxckpt step exists.
    memory_only(str(ckpt), memory_root, sharded_state(mesh_1d()), steps=(9,))
    assert store.is_durable(ckpt / "9" / ITEM)
    assert not store.old_steps_only(ckpt, ITEM)
    shutil.rmtree(ckpt / "9")  # even once the manager deleted it: it is kept
    assert store.kept_step(ckpt, [ITEM]) == 9
    assert not store.old_steps_only(ckpt, ITEM)


def test_an_object_store_keeps_no_step_itself():
    """No hard links on an object store: no kept area, nothing to put back, and the
    manager's policy keeps the newest durable step (the handler says so once)."""
    store = _store.at("s3://bucket/run")
    root = _storage.as_path("s3://bucket/run")
    assert not store.keeps_durable_step and _store.at(os.fspath("/tmp")).keeps_durable_step
    assert store.kept_step(root, [ITEM]) is None
    assert store.reinstate(root, [ITEM]) is None


@pytest.mark.parametrize("in_place", [True, False])
def test_a_step_that_vanishes_before_its_finalization_ends_the_wait(tmp_path, in_place):
    """A step written in place (as on object stores) has vanished when its index is gone;
    a step renamed at finalization, when neither of its names exists. Either ends the
    wait for its finalization at once, where a step still there waits for it."""
    final = tmp_path / "ckpt" / "7" / "train"
    item = final if in_place else tmp_path / "ckpt" / "7.orbax-checkpoint-tmp" / "train"
    item.mkdir(parents=True)
    (item / _format.STEP_INDEX_FILE).write_text("{}")
    with pytest.raises(TimeoutError, match="Step 7 was not finalized"):
        _step_dirs.wait_finalized(item, final, 7, 0.2, None, 0.02)
    if in_place:
        (item / _format.STEP_INDEX_FILE).unlink()  # the step's objects deleted
    else:
        shutil.rmtree(item.parent)
    with pytest.raises(FileNotFoundError, match="Step 7 vanished"):
        _step_dirs.wait_finalized(item, final, 7, 30, None, 0.02)
    if in_place:
        (final.parent / _step_dirs.COMMIT_FILE).write_text("")
    else:
        final.mkdir(parents=True)
    _step_dirs.wait_finalized(item, final, 7, 0.2, None, 0.02)  # finalized: returns


def test_a_finalization_under_way_is_seen_at_once(tmp_path):
    """Told that the manager is finalizing (`wake`), the wait looks at once and then
    often, not only every `poll_s`: here the rename lands 0.1 s after the wake, and a
    wait polling every 60 s still ends (well inside its poll)."""
    item = tmp_path / "7.orbax-checkpoint-tmp-1" / "train.orbax-checkpoint-tmp-2"
    final = tmp_path / "7" / "train"
    item.mkdir(parents=True)
    wake, done = threading.Event(), threading.Event()

    def wait() -> None:
        _step_dirs.wait_finalized(item, final, 7, 300, None, 60, wake)
        done.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    wake.set()
    time.sleep(0.1)
    item.parent.rename(final.parent)
    (final.parent / item.name).rename(final)
    assert done.wait(30)
