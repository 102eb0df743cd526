"""The persistent tier on object stores (gs://, s3://), against real local emulators.

Each test starts its emulator (tests/support/object_stores.py) on a free loopback port
and stops it by pid at the end.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import time
from pathlib import Path

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import abstract, assert_tree_equal, mesh_1d, restore, save, sharded_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from object_stores import Emulator, reset_clients, running

import jaxckpt
from jaxckpt.persistent import _object_store, _persister, _storage, _store, _zarr

pytestmark = pytest.mark.slow


@pytest.fixture
def store_env(monkeypatch):
    """Sets an emulator's environment for one test (and gives fresh fsspec clients)."""

    def use(emulator: Emulator) -> None:
        for key, value in emulator.env().items():
            monkeypatch.setenv(key, value)
        reset_clients()

    yield use
    reset_clients()


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


def manager(url: str, h: jaxckpt.TieredCheckpointHandler, **options) -> ocp.CheckpointManager:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("train", jaxckpt.TieredSave, h)
    registry.add("train", jaxckpt.TieredRestore, h)
    opts = jaxckpt.manager_options(url, enable_async_checkpointing=False, **options)
    return ocp.CheckpointManager(url, handler_registry=registry, options=opts)


def saved(url: str, memory_root: str, state, steps=range(3)) -> jaxckpt.TieredCheckpointHandler:
    """Saves `state` as `steps` (every other one persisted) and drains; the handler."""
    h = handler(memory_root, persist_every=2)
    with manager(url, h) as mngr:
        for step in steps:
            save(mngr, step, state)
        h.wait_for_persistence()
    return h


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_save_persist_wipe_memory_restore(kind, tmp_path, memory_root, store_env):
    state = sharded_state(mesh_1d())
    with running(kind, tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        assert saved(url, memory_root, state).last_persist_metrics["step"] == 2
        shutil.rmtree(memory_root)  # the host is gone: only the bucket is left

        h = handler(memory_root, persist_every=2)
        with manager(url, h) as mngr:
            assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 2
            assert_tree_equal(restore(mngr, 2, abstract(state)), state)
            assert h.last_restore_metrics["tier"] == "persistent"
            with pytest.raises(FileNotFoundError, match="Step 1 cannot be restored"):
                restore(mngr, 1, abstract(state))  # in no tier any more


def test_a_step_a_crash_left_unpersisted_is_persisted_on_restart(
    tmp_path, memory_root, store_env, monkeypatch
):
    state = sharded_state(mesh_1d())
    submit = _persister.Persister.submit
    monkeypatch.setattr(  # the job "dies" before step 2's persist runs
        _persister.Persister,
        "submit",
        lambda self, job: None if job.manifest.step == 2 else submit(self, job),
    )
    with running("s3", tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        saved(url, memory_root, state)
        part = _storage.as_path(url + "/2/train/part_00000")
        assert not _storage.exists(part / "manifest.json")
        # Lookups through gcsfs/s3fs before the resumed upload (they may cache listings
        # that the upload, through tensorstore, does not update).
        assert not (part / "manifest.json").exists() and not list(part.parent.glob("part_*/*"))
        monkeypatch.setattr(_persister.Persister, "submit", submit)

        h = handler(memory_root, persist_every=2)
        with manager(url, h) as mngr:
            assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 2
            h.wait_for_persistence()
            assert h.last_persist_metrics["step"] == 2
        shutil.rmtree(memory_root)
        h = handler(memory_root, persist_every=2)
        with manager(url, h) as mngr:
            assert_tree_equal(restore(mngr, 2, abstract(state)), state)
            assert h.last_restore_metrics["tier"] == "persistent"


def test_garbage_collection_deletes_manifests_first(tmp_path, memory_root, store_env, monkeypatch):
    state = sharded_state(mesh_1d())
    with running("s3", tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        delete = _storage.delete_objects
        seen: list[tuple[str, list[str], bool]] = []

        def recorded(directory, keys):
            # What is left of the step when its manifests go: everything (the index too).
            index = _storage.exists(directory / "index.json")
            seen.append((str(directory), list(keys), index))
            delete(directory, keys)

        monkeypatch.setattr(_storage, "delete_objects", recorded)
        h = handler(memory_root, persist_every=1)
        with manager(url, h) as mngr:  # no collection by the manager itself in this test
            save(mngr, 0, state)
            h.wait_for_persistence()
            save(mngr, 1, state)
            h.wait_for_persistence()
            mngr.wait_until_finished()
            # What the garbage-collection guard runs before Orbax deletes a step (called
            # directly: when the manager's own collection runs depends on its threads).
            _store.at(url).retire(_storage.as_path(url), ["train"], [0])
            retired = [
                (d, keys, index) for d, keys, index in seen if keys == ["part_00000/manifest.json"]
            ]
            assert (url + "/0/train", ["part_00000/manifest.json"], True) in retired, seen
            assert not _storage.exists(_storage.as_path(url + "/0/train/part_00000/manifest.json"))
            # Without its manifest the part is no longer durable (and memory holds step 1
            # only): step 0 cannot be restored any more, step 1 can.
            assert h.restorable_steps(_storage.as_path(url + "/0/train")) == [1]


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_a_step_the_manager_deletes_before_its_upload_leaves_no_objects_and_no_error(
    kind, tmp_path, memory_root, store_env, monkeypatch, caplog
):
    """Without the handler's policy, max_to_keep=1 deletes step 2 (due) in the save of
    step 3, before step 2's part is uploaded: the objects its upload put under the
    deleted step are removed, a WARNING names the step, and nothing raises (the
    options chose it)."""
    release = threading.Event()
    upload = _object_store.ObjectStore._upload_with_retries

    def held(self, manifest, *args):
        if manifest.step == 2:
            assert release.wait(60)
        return upload(self, manifest, *args)

    def objects(url: str) -> list[str]:
        _storage.forget_listings(_storage.as_path(url))
        fs = fsspec.filesystem(kind)
        return fs.find(fsspec.core.strip_protocol(url) + "/")

    monkeypatch.setattr(_object_store.ObjectStore, "_upload_with_retries", held)
    state = sharded_state(mesh_1d())
    with running(kind, tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        h = handler(memory_root, persist_every=2)
        opts = jaxckpt.manager_options(url, max_to_keep=1, enable_async_checkpointing=False)
        with ocp.CheckpointManager(url, item_handlers={"train": h}, options=opts) as mngr:
            try:
                for step in range(4):
                    save(mngr, step, state)
                assert mngr.all_steps() == [3]  # step 2 deleted in the save of step 3
            finally:
                release.set()  # step 2's part is uploaded now, under the deleted step
            h.wait_for_persistence()  # no error
        assert objects(url + "/2") == []
        assert objects(url + "/3")  # the manager's step is untouched
        assert "Step 2 was deleted by the manager before it was persisted" in caplog.text


def test_manager_options_for_urls():
    s3 = jaxckpt.manager_options("s3://b/run", max_to_keep=2)
    assert s3.temporary_path_class is ocp.path.atomicity.CommitFileTemporaryPath
    assert s3.max_to_keep == 2
    assert jaxckpt.manager_options("gs://b/run").temporary_path_class is None  # Orbax's own
    assert jaxckpt.manager_options("/tmp/run").temporary_path_class is None
    # A local directory's step directories are made in save(); on a store, in the
    # background (a directory there is a request); given async_options stay as they are.
    local = jaxckpt.manager_options("/tmp/run").async_options
    assert local.create_directories_asynchronously is False
    assert jaxckpt.manager_options("gs://b/run").async_options is None
    given = ocp.AsyncOptions(timeout_secs=60)
    assert jaxckpt.manager_options("/tmp/run", async_options=given).async_options is given
    with pytest.raises(ValueError, match="cannot be renamed"):
        jaxckpt.manager_options(
            "s3://b/run", temporary_path_class=ocp.path.atomicity.AtomicRenameTemporaryPath
        )


def test_store_killed_mid_persist(tmp_path, memory_root, store_env, monkeypatch):
    """The store dies while a step uploads: the error surfaces from wait_for_persistence,
    bounded in time, and the step persisted before stays durable and restorable."""
    monkeypatch.setattr(_object_store, "UPLOAD_BACKOFF_S", 0.1)
    state = sharded_state(mesh_1d())
    data = tmp_path / "objects"
    data.mkdir()
    with running("gcs", tmp_path, data_dir=data) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        # A budget the three attempts (each a few seconds against a dead store) fit in
        # on a loaded machine; the failure still surfaces within it.
        timeout_s = 40
        h = handler(memory_root, persist_every=2, timeout_s=timeout_s)
        write, upload = _zarr.write_chunks, _object_store.ObjectStore._upload
        attempts: list[int] = []

        step_2_saved = threading.Event()

        async def dying_write(dst, *args, **kwargs):
            if "run/2/train/" in dst["path"] and emulator.proc.poll() is None:
                # Once the manager's save of step 2 has returned (it was finalized, and
                # the manager is done with the store), the store dies before any array
                # of step 2 is written (the writes run concurrently: each waits here):
                # mid-upload. Waiting for save() to return, not only for the commit
                # file, keeps the manager's own last requests off the dead store.
                deadline = time.monotonic() + 30
                while not step_2_saved.is_set():
                    assert time.monotonic() < deadline, "save() of step 2 did not return"
                    await asyncio.sleep(0.02)
                if emulator.proc.poll() is None:
                    emulator.kill()
            await write(dst, *args, **kwargs)

        def counted_upload(self, manifest, *args):
            attempts.append(manifest.step)
            return upload(self, manifest, *args)

        monkeypatch.setattr(_zarr, "write_chunks", dying_write)
        monkeypatch.setattr(_object_store.ObjectStore, "_upload", counted_upload)
        with manager(url, h) as mngr:
            save(mngr, 0, state)
            h.wait_for_persistence()  # step 0 is durable
            save(mngr, 1, state)
            save(mngr, 2, state)
            step_2_saved.set()
            start = time.monotonic()
            with pytest.raises(OSError, match=r"step 2.*failed \d time\(s\)") as error:
                h.wait_for_persistence()
            took = time.monotonic() - start
            assert took < timeout_s, f"the failure took {took:.1f} s to surface"
            # Every attempt the error counts was made, on step 2 only; all of them unless
            # the step's time ran out first (a loaded machine).
            said = re.search(
                r"failed (\d) time\(s\) \((no attempts left|out of time)", str(error.value)
            )
            assert said, str(error.value)
            assert attempts == [0] + [2] * int(said[1]), str(error.value)
            assert said[2] == "out of time" or int(said[1]) == _object_store.UPLOAD_ATTEMPTS
            assert int(said[1]) > 1, "the upload was not retried"
            emulator.restart()
            reset_clients()
        shutil.rmtree(memory_root)
        h = handler(memory_root, persist_every=2)
        with manager(url, h) as mngr:
            assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 0
            assert_tree_equal(restore(mngr, 0, abstract(state)), state)


def test_stalled_endpoint_is_bounded(tmp_path, memory_root, store_env, monkeypatch):
    """A store that stops answering mid-upload (the test proxy stalls): the upload gives
    up within TierOptions.timeout_s, a clear error surfaces, nothing hangs."""
    from test_bad_peers import Proxy

    from jaxckpt.peer._wire import PeerAddress

    state = sharded_state(mesh_1d())
    with running("s3", tmp_path) as emulator:
        proxy = Proxy(PeerAddress("127.0.0.1", emulator.port))
        try:
            store_env(emulator)
            kvstore = _storage.kvstore

            def through_proxy(path):
                spec = kvstore(path)
                if "/part_" in str(path):  # the part's uploads only, not the manager's files
                    spec["endpoint"] = f"http://127.0.0.1:{proxy.address.port}"
                return spec

            monkeypatch.setattr(_storage, "kvstore", through_proxy)
            upload = _object_store.ObjectStore._upload

            def stalled_upload(self, *args):
                proxy.stall.set()
                return upload(self, *args)

            monkeypatch.setattr(_object_store.ObjectStore, "_upload", stalled_upload)
            url = emulator.url("run")
            h = handler(memory_root, persist_every=1, timeout_s=3)
            with manager(url, h) as mngr:
                save(mngr, 0, state)
                start = time.monotonic()
                with pytest.raises(OSError, match=r"step 0 .*failed 1 time\(s\) \(out of time"):
                    h.wait_for_persistence(timeout_s=30)
                took = time.monotonic() - start
                assert took < 10, f"the failure took {took:.1f} s to surface (timeout_s=3)"
        finally:
            proxy.close()


def test_remote_paths_never_become_local(tmp_path):
    """`gs://b/x` must not turn into the local path `gs:/b/x` anywhere."""
    from jaxckpt.persistent import _paths, _storage

    item = "gs://bucket/run/5/train"
    assert str(_paths.final_item_dir(item)) == item
    assert str(_paths.checkpoint_root(item)) == "gs://bucket/run"
    assert _paths.step_of(item) == 5
    assert _paths.default_run_id(item) != _paths.default_run_id(
        os.path.join("gs:", "bucket", "run", "5", "train")
    )
    assert _storage.kvstore("gs://bucket/run/5/train/part_00000") == {
        "driver": "gcs",
        "bucket": "bucket",
        "path": "run/5/train/part_00000/",
    }
    assert not Path("gs:").exists()


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_a_step_index_on_an_object_store_is_read_in_ranges(kind, tmp_path, store_env):
    """A process reads its own part of a large step index (ranged reads): another
    part's damaged entry does not stop it; the damaged one is reported by name."""
    from test_step_index import big_index, damage

    from jaxckpt.format import _format
    from jaxckpt.persistent import _index

    parts, text = big_index(2000)  # larger than a reader's first read
    text = damage(text, '"save-1500"')
    with running(kind, tmp_path) as emulator:
        store_env(emulator)
        item_dir = _storage.as_path(emulator.url("run/5/train"))
        _storage.write_object(item_dir / _format.STEP_INDEX_FILE, text)
        index = _index.read_index(item_dir)
        assert len(index) == 2000 and _index.part_count(item_dir) == 2000
        assert index[1700] == parts[1700] and index[1999] == parts[1999]
        with pytest.raises(ValueError, match="the entry of part 1500 does not match"):
            index[1500]
        small = _index.step_index_text(parts[0].leaves, {0: _index.entry(parts[0])})
        _storage.write_object(item_dir / _format.STEP_INDEX_FILE, small)  # under a first read
        assert _index.read_index(item_dir)[0].save_id == "save-0"


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_tiled_chunks_persist_and_restore_onto_another_mesh(kind, tmp_path, memory_root, store_env):
    """A leaf saved in tiles (zarr3 shards whose inner chunks are the tiles) is uploaded,
    and read back tile by tile onto another mesh."""
    values = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    two = Mesh(np.array(jax.devices()[:2]), ("x",))
    state = {"w": jax.device_put(values, NamedSharding(two, P("x")))}
    with running(kind, tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        h = handler(memory_root, persist_every=1, tile_bytes=4096)
        with manager(url, h) as mngr:
            save(mngr, 1, state)
            h.wait_for_persistence()
        shutil.rmtree(memory_root)
        h = handler(memory_root, persist_every=1, tile_bytes=4096)
        columns = NamedSharding(mesh_1d(), P(None, "data"))
        with manager(url, h) as mngr:
            restored = restore(
                mngr, 1, {"w": jax.ShapeDtypeStruct((256, 256), np.float32, sharding=columns)}
            )
            assert h.last_restore_metrics["tier"] == "persistent"
    np.testing.assert_array_equal(restored["w"], values)
    assert restored["w"].sharding == columns
