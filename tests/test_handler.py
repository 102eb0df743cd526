"""The handler through a real ocp.CheckpointManager, in one process."""

from __future__ import annotations

import json
import shutil
import threading
import time

import faults
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import (
    abstract,
    assert_tree_equal,
    flip_slab_byte,
    fresh_iterator,
    index_manifest,
    manager,
    mesh_1d,
    restore,
    run_python,
    save,
    sharded_state,
    train_state,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.memory import _slab
from jaxckpt.persistent import _kept, _paths
from jaxckpt.save import _save


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("registry", [True, False], ids=["registry", "item_handlers"])
def test_round_trip_every_leaf_kind(memory_root, ckpt_dir, use_async, registry):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1000)
    with manager(ckpt_dir, h, use_async=use_async, registry=registry) as mngr:
        save(mngr, 3, state)
        mngr.wait_until_finished()
        restored = restore(mngr, 3, abstract(state))
    assert_tree_equal(restored, state)
    assert restored["w"].sharding == state["w"].sharding
    assert jax.random.key_impl(restored["keys"]) == jax.random.key_impl(state["keys"])
    assert type(restored["scale"]) is np.float32 and type(restored["step"]) is int
    assert h.last_restore_metrics["tier"] == "memory"


def test_composite_with_json_item(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 1, state, metrics=ocp.args.JsonSave({"loss": 0.25}))
        mngr.wait_until_finished()
        out = mngr.restore(
            1,
            args=ocp.args.Composite(
                train=jaxckpt.TieredRestore(abstract(state)), metrics=ocp.args.JsonRestore()
            ),
        )
    assert out.metrics == {"loss": 0.25}
    assert_tree_equal(out.train, state)


def test_full_training_state_continues_identically(memory_root, ckpt_dir):
    mesh = mesh_1d()
    state, _ = train_state(mesh)
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 2, state)
        mngr.wait_until_finished()
        expected_next = next(state["data"])  # what training would read next
        target = {
            **abstract({k: v for k, v in state.items() if k != "data"}),
            "data": fresh_iterator(),
        }
        restored = restore(mngr, 2, target)
    assert restored["data"] is target["data"]  # set in place
    np.testing.assert_array_equal(next(restored["data"]), expected_next)
    assert jax.random.key_impl(restored["rng"]) == "threefry2x32"
    np.testing.assert_array_equal(
        jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"])
    )
    assert_tree_equal(restored["params"], state["params"])
    assert_tree_equal(restored["opt_state"], state["opt_state"])
    assert restored["step"] == 2


def _targets(mesh: Mesh, state: dict) -> dict:
    """Other shardings on `mesh` for every array of `sharded_state`."""
    a = mesh.axis_names
    t = abstract(state)
    t["w"] = jax.ShapeDtypeStruct((16, 6), np.float32, sharding=NamedSharding(mesh, P(a)))
    t["h"] = jax.ShapeDtypeStruct(
        (8, 4), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P(None, a[0]))
    )
    t["b"] = jax.ShapeDtypeStruct((5,), np.float32, sharding=NamedSharding(mesh, P()))
    t["keys"] = jax.ShapeDtypeStruct(
        (8,), state["keys"].dtype, sharding=NamedSharding(mesh, P(a[-1]))
    )
    return t


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1,)], ids=["2x4", "4x2", "one-device"])
def test_reshard_onto_other_meshes(memory_root, ckpt_dir, shape):
    state = sharded_state(mesh_1d())
    n = int(np.prod(shape))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), ("a", "b")[: len(shape)])
    target = _targets(mesh, state)
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 5, state)
        mngr.wait_until_finished()
        restored = restore(mngr, 5, target)
    assert_tree_equal(restored, state)
    for k in ("w", "h", "b", "keys"):
        assert restored[k].sharding.is_equivalent_to(target[k].sharding, len(target[k].shape)), k


def test_reads_only_chunks_a_target_shard_needs(memory_root, ckpt_dir):
    from jaxckpt.persistent import _paths
    from jaxckpt.restore import _chunk_reads

    state = {
        "w": jax.device_put(
            np.arange(64, dtype=np.float32).reshape(16, 4), NamedSharding(mesh_1d(), P("data"))
        )
    }
    chunk_bytes = state["w"].nbytes // 8  # 8 chunks of 2 rows
    h = handler(memory_root)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        # Fully replicated on 8 devices: every chunk is read once, not once per device.
        one = Mesh(np.array(jax.devices()), ("x",))
        restored = restore(
            mngr,
            1,
            {"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(one, P()))},
        )
        assert h.last_restore_metrics["bytes_by_tier"] == {"memory": 8 * chunk_bytes}
        np.testing.assert_array_equal(restored["w"], state["w"])
        # A region of rows 3..6 touches saved chunks 1, 2 and 3 (rows 2..7) only.
        run = h.inspect().run
        item = _paths.ItemDir.parse(ckpt_dir / "1" / "train")
        plan = run.held(item, run.memory).view().plan(1)
        readers = _chunk_reads.reader_factory(item.path, run.memory, run.peers, 1)
        chunks = _chunk_reads.ChunkReads(plan, readers, 0)
        (rows,) = chunks.read_regions(0, [(slice(3, 7), slice(0, 4))])
        assert chunks.bytes_by_tier == {"memory": 3 * chunk_bytes}
        np.testing.assert_array_equal(rows, np.asarray(state["w"])[3:7])


def test_restore_from_memory_in_a_new_process(memory_root, ckpt_dir):
    code = f"""
        import numpy as np, jax, orbax.checkpoint as ocp, jaxckpt
        from helpers import manager, save, restore, sharded_state, mesh_1d, abstract, assert_tree_equal
        h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions({memory_root!r}, persist_every=1000))
        mngr = manager({str(ckpt_dir)!r}, h)
        state = sharded_state(mesh_1d(), seed=11)
        if os.environ["MODE"] == "save":
            save(mngr, 4, state)
            mngr.wait_until_finished()
            os._exit(0)  # a crash: no close(), nothing drained
        out = restore(mngr, 4, abstract(state))
        assert_tree_equal(out, state)
        print("RESULT", h.last_restore_metrics["tier"], sorted(os.listdir({str(ckpt_dir)!r} + "/4/train")))
    """
    run_python(code, env={"MODE": "save"})
    out = run_python(code, env={"MODE": "restore"})
    # Restored from memory: the step was never persisted (no part_* in the item directory).
    assert "RESULT memory ['commit_success.txt', 'index.json']" in out, out


def test_restore_from_persistent_after_memory_is_lost(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    with manager(ckpt_dir, h) as mngr:
        for step in range(5):
            save(mngr, step, state)
            # Each step retired before the next save: that save refills its slab through
            # a kept mapping (a save that finds no retired slab writes a fresh one).
            mngr.wait_until_finished()
            h.wait_for_persistence()
        shutil.rmtree(memory_root)
        restored = restore(mngr, 4, abstract(state))
        assert h.last_restore_metrics["tier"] == "persistent"
        assert_tree_equal(restored, state)
        with pytest.raises(
            FileNotFoundError, match=r"Step 3 cannot be restored.*newest restorable step is 4"
        ):
            restore(mngr, 3, abstract(state))


def test_persisted_copy_is_compressed_and_complete(memory_root, ckpt_dir):
    state = {
        "z": jax.device_put(np.zeros((64, 64), np.float32), NamedSharding(mesh_1d(), P("data")))
    }
    h = handler(memory_root, persist_every=1, persist_compression="zstd")
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        meta = json.loads((ckpt_dir / "1/train/part_00000/arrays/z/zarr.json").read_text())
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
        shutil.rmtree(memory_root)
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)


@pytest.fixture
def slow_persistence():
    """Holds every persistence job until the test releases it."""
    with faults.held("persist_begin") as gate:
        yield gate


def test_persistence_does_not_block_the_next_save(memory_root, ckpt_dir, slow_persistence):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 2, state)
        save(mngr, 3, state)  # waits for step 2's commit futures, not for its persistence
        mngr.wait_until_finished()
        assert h.pending_persistence() == {2}
        assert mngr.all_steps() == [2, 3]
        assert not (ckpt_dir / "2/train/part_00000").exists()  # not durable yet
        # A pending step is kept in memory whatever the retention says.
        save(mngr, 4, state), save(mngr, 5, state), mngr.wait_until_finished()
        h.inspect().wait_for_retention(30)  # retention after step 5 has run
        assert h.inspect().memory.steps() == [2, 4, 5]  # 3 went; 4 waits to be persisted too
        slow_persistence.set()
    # close() drained the queue.
    assert (ckpt_dir / "2/train/part_00000/manifest.json").exists()
    assert (ckpt_dir / "4/train/part_00000/manifest.json").exists()


def test_close_drains_pending_persistence(memory_root, ckpt_dir, slow_persistence):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1)
    mngr = manager(ckpt_dir, h)
    save(mngr, 1, state)
    mngr.wait_until_finished()
    threading.Timer(0.5, slow_persistence.set).start()
    mngr.close()
    assert h.pending_persistence() == set()
    assert (ckpt_dir / "1/train/part_00000/manifest.json").exists()


def test_garbage_collection_keeps_steps_being_persisted(memory_root, ckpt_dir, slow_persistence):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    policy = h.preservation_policy(ocp.checkpoint_managers.LatestN(n=1))
    with manager(ckpt_dir, h, preservation_policy=policy) as mngr:
        for step in (2, 3, 5):
            save(mngr, step, state)
        mngr.wait_until_finished()
        assert 2 in mngr.all_steps()  # LatestN(1) alone would have deleted it
        slow_persistence.set()
        h.wait_for_persistence()
        save(mngr, 7, state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 7]  # 2 is the newest durable step: kept
    assert not list((ckpt_dir / ".jaxckpt-staging").iterdir())


def test_garbage_collected_step_leaves_no_half_written_data(
    memory_root, ckpt_dir, slow_persistence
):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=2)
    with manager(ckpt_dir, h, max_to_keep=1) as mngr:
        save(mngr, 2, state)
        save(mngr, 3, state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]  # garbage collection keeps a step to be persisted
        mngr.delete(2)  # but an explicit deletion goes ahead
        slow_persistence.set()
        h.wait_for_persistence()  # a step deleted on purpose is no persistence failure
        assert not (ckpt_dir / "2").exists()  # never recreated
        assert not list((ckpt_dir / ".jaxckpt-staging").iterdir())
        # Its part went into the kept area whole (the newest durable step: `_kept`).
        assert _kept.is_complete(_kept.kept_dir(ckpt_dir) / "2" / "train")


def test_flipped_byte_in_memory_falls_back_to_persistent(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        flip_slab_byte(h.inspect().memory.part_dir(1, 0), "['w']", (0, 0), at=3)
        restored = restore(mngr, 1, abstract(state))
        assert_tree_equal(restored, state)
        assert h.last_restore_metrics["fallbacks"] == 1
        assert h.last_restore_metrics["bytes_by_tier"]["persistent"] > 0


def test_flipped_byte_without_other_copy_raises(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, persist_every=1000)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        flip_slab_byte(h.inspect().memory.part_dir(1, 0), "['w']", (3, 0), at=-1, bit=0x01)
        with pytest.raises(
            FileNotFoundError, match=r"chunk \(3, 0\) of \['w'\].*checksum mismatch"
        ):
            restore(mngr, 1, abstract(state))


def test_large_leaves_read_in_the_background_fail_and_fall_back_alike(memory_root, ckpt_dir):
    """Leaves of 1 MiB and more are read on threads while the next ones are asked for:
    a damaged chunk of one still falls back to another tier, or fails the restore
    with its name, and no read outlives the failed restore."""
    from jaxckpt.restore import _restore

    row = NamedSharding(mesh_1d(), P("data"))
    rng = np.random.default_rng(0)
    state = {
        f"big{i}": jax.device_put(rng.standard_normal((512, 1024)).astype(np.float32), row)
        for i in range(4)
    }
    assert state["big0"].nbytes >= _restore._BACKGROUND_LEAF_BYTES
    h = handler(memory_root, persist_every=2, memory_keep=2)
    with manager(ckpt_dir, h) as mngr:
        for step in (1, 2):
            save(mngr, step, state)
            mngr.wait_until_finished()
        h.wait_for_persistence()
        flip_slab_byte(h.inspect().memory.part_dir(2, 0), "['big2']", (5, 0), at=7)
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)
        assert h.last_restore_metrics["fallbacks"] == 1
        flip_slab_byte(h.inspect().memory.part_dir(1, 0), "['big1']", (3, 0), at=-1, bit=0x01)
        with pytest.raises(FileNotFoundError, match=r"chunk \(3, 0\) of \['big1'\]"):
            restore(mngr, 1, abstract(state))
        assert _restore.LEAF_POOL.queued() == 0


def test_memory_of_another_run_is_never_used(memory_root, tmp_path):
    state = sharded_state(mesh_1d())
    first = tmp_path / "first"
    with manager(first, handler(memory_root, persist_every=1000)) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
    # The same checkpoint directory wiped and reused by a new run that saved step 1
    # again: the old memory copy's save id no longer matches the new index.
    shutil.rmtree(first)
    other = sharded_state(mesh_1d(), seed=5)
    h = handler(memory_root, persist_every=1)
    with manager(first, h) as mngr:
        save(mngr, 1, other)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    stale_part = h.inspect().memory.part_dir(1, 0)
    (stale_part / "manifest.json").write_text(
        (stale_part / "manifest.json").read_text().replace('"save_id":"', '"save_id":"x')
    )
    h2 = handler(memory_root)
    with manager(first, h2) as mngr:
        assert_tree_equal(restore(mngr, 1, abstract(other)), other)
        assert h2.last_restore_metrics["tier"] == "persistent"


def test_retention_bounds_memory(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = handler(memory_root, memory_keep=2, persist_every=1000)
    with manager(ckpt_dir, h) as mngr:
        for step in range(6):
            save(mngr, step, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        assert h.inspect().memory.steps() == [4, 5]
        with pytest.raises(FileNotFoundError, match="newest restorable step is 5"):
            restore(mngr, 2, abstract(state))


def test_retention_after_a_step_the_manager_deleted_first(memory_root, ckpt_dir, monkeypatch):
    """Saves back to back with `max_to_keep=1`: garbage collection may delete a step
    before its retention has seen it finalized. A newer finalized step shows that it
    was, and the retention still retires the older steps (here: after step 2, which
    the manager deleted when step 3 was finalized, step 1 leaves memory; the retention
    after step 3 is held until then)."""
    wait_finalized = _paths.ItemDir.wait_finalized
    release = threading.Event()

    def late(self, step, *args, **kwargs):
        if step == 2:  # looks only once the manager has finalized 3 and deleted 2
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (
                (ckpt_dir / "2").exists() or not (ckpt_dir / "3").exists()
            ):
                time.sleep(0.01)
        if step == 3:
            assert release.wait(60)
        return wait_finalized(self, step, *args, **kwargs)

    monkeypatch.setattr(_paths.ItemDir, "wait_finalized", late)
    state = sharded_state(mesh_1d())
    h = handler(memory_root, memory_keep=1, persist_every=1000)
    try:
        with manager(ckpt_dir, h, max_to_keep=1) as mngr:
            for step in (1, 2, 3):
                save(mngr, step, state)
            mngr.wait_until_finished()
            assert not (ckpt_dir / "2").exists()
            memory = h.inspect().memory
            deadline = time.monotonic() + 60
            while memory.steps() != [2, 3] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert memory.steps() == [2, 3]
            release.set()
            h.inspect().wait_for_retention(30)
            assert memory.steps() == [3]
            assert_tree_equal(restore(mngr, 3, abstract(state)), state)
    finally:
        release.set()


def test_without_spare_slabs_the_tier_holds_only_the_kept_steps(memory_root, ckpt_dir):
    """Step 0 is still being persisted when the later saves' retention runs, so they
    keep it; once it is durable it leaves the tier without waiting for another save,
    and only the kept step's slab is left (no spares)."""
    state = sharded_state(mesh_1d())
    h = handler(memory_root, memory_keep=1, persist_every=1000, spare_slabs=False)
    with manager(ckpt_dir, h) as mngr, faults.held("persist_begin", steps={0}) as release:
        for step in range(4):
            save(mngr, step, state)
            mngr.wait_until_finished()
        h.inspect().wait_for_retention(30)
        assert h.inspect().memory.steps() == [0, 3]  # 0 is kept: not durable yet
        release.set()
        h.wait_for_persistence()
        assert h.inspect().memory.steps() == [3]
        assert [p.parent.name for p in h.inspect().memory.run_dir.rglob("slab")] == ["part_00000"]
        assert_tree_equal(restore(mngr, 3, abstract(state)), state)
        assert_tree_equal(restore(mngr, 0, abstract(state)), state)


def test_metadata_builds_a_restore_target(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    state["data"] = fresh_iterator()
    next(state["data"])
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        meta = mngr.item_metadata(1).train
        assert meta["w"].shape == (16, 6) and meta["w"].dtype == np.float32
        assert meta["w"].sharding == state["w"].sharding
        assert meta["keys"].dtype == state["keys"].dtype
        assert meta["step"] == 7
        assert meta["data"].state == state["data"].get_state()
        target = {**meta, "data": fresh_iterator()}
        restored = restore(mngr, 1, target)
    assert_tree_equal(
        {k: v for k, v in restored.items() if k != "data"},
        {k: v for k, v in state.items() if k != "data"},
    )
    assert restored["data"].get_state() == state["data"].get_state()


def test_no_target_restores_to_host(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        out = restore(mngr, 1, None)
    assert isinstance(out["w"], np.ndarray)
    np.testing.assert_array_equal(out["w"], state["w"])
    assert out["step"] == 7


def test_metrics_reach_the_callback_the_log_and_the_manifest(memory_root, ckpt_dir):
    events = []
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=1), on_metrics=events.append
    )
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        restore(mngr, 1, abstract(state))
    kinds = [e["event"] for e in events]
    assert sorted(kinds) == ["persist", "restore", "save"]
    saved = next(e for e in events if e["event"] == "save")
    assert saved["bytes"] > 0 and saved["stall_s"] > 0 and saved["memory_write_s"] > 0
    assert saved["safe_in_memory_s"] >= saved["stall_s"]
    persisted = next(e for e in events if e["event"] == "persist")
    assert persisted["step"] == 1 and persisted["persist_s"] > 0
    index = index_manifest(ckpt_dir / "1/train")
    assert index["metrics"]["stall_s"] == saved["stall_s"]
    durable = json.loads((ckpt_dir / "1/train/part_00000/manifest.json").read_text())
    assert durable["metrics"]["persist_s"] == persisted["persist_s"]


@pytest.mark.parametrize(
    ("hold", "n"),
    [(False, 64), (False, _save.PRIVATE_COPY_BYTES // 4 + 1024), (True, 64)],
    ids=["small", "large", "hold"],
)
def test_snapshot_survives_a_donating_train_step(hold, n, memory_root, ckpt_dir, monkeypatch):
    """The step saved keeps its values when the next train step donates the saved
    arrays while the commit is still pending. On CPU the save copied them (into the
    slab, or a small part into private memory) before it returned and let go of them,
    so the step may reuse their buffers; `hold_cpu_arrays` holds views of them instead
    until the slab has them (JAX <= 0.11 declines the donation; 0.12 donates the array
    but leaves the viewed memory alone)."""

    gate = threading.Event()  # the commit's work on the slab waits for the train step
    write, checksums = _slab.write, _slab.checksums

    def gated_write(*args, checksum=True, **kwargs):
        if checksum:  # else the copy before save() returns
            assert gate.wait(60)
        return write(*args, checksum=checksum, **kwargs)

    def gated_checksums(*args, **kwargs):
        assert gate.wait(60)
        return checksums(*args, **kwargs)

    monkeypatch.setattr(_slab, "write", gated_write)
    monkeypatch.setattr(_slab, "checksums", gated_checksums)
    sharding = NamedSharding(mesh_1d(), P("data"))
    w = jax.device_put(np.arange(n, dtype=np.float32), sharding)
    expected = np.asarray(w).copy()
    update = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
    with manager(ckpt_dir, handler(memory_root, hold_cpu_arrays=hold)) as mngr:
        save(mngr, 1, {"w": w})
        saved, w = w, update(w)  # while the commit is still pending
        w.block_until_ready()
        donated = saved.is_deleted()
        gate.set()
        mngr.wait_until_finished()
        target = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding)}
        np.testing.assert_array_equal(restore(mngr, 1, target)["w"], expected)
    np.testing.assert_array_equal(np.asarray(w), expected * 2 + 1)
    if not hold:
        assert donated  # the save let go of the arrays before it returned


def test_restored_arrays_outlive_their_slab(memory_root, ckpt_dir):
    """Arrays restored from memory may keep the slab's pages (on CPU they do): they
    keep their values after the step is retired and its slabs' successors are
    written, and a train step that donates them changes no saved byte."""
    sharding = NamedSharding(mesh_1d(), P("data"))

    def weights(step: int) -> jax.Array:
        return jax.device_put(np.arange(4096, dtype=np.float32) * step, sharding)

    target = {"w": jax.ShapeDtypeStruct((4096,), np.float32, sharding=sharding)}
    h = handler(memory_root, memory_keep=1, persist_every=1000)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, {"w": weights(1)})
        mngr.wait_until_finished()
        restored = restore(mngr, 1, target)["w"]
        assert h.last_restore_metrics["tier"] == "memory"
        for step in range(2, 6):  # retires step 1; later saves refill retired slabs
            save(mngr, step, {"w": weights(step)})
            mngr.wait_until_finished()
        h.wait_for_persistence()
        assert h.inspect().memory.steps() == [5]
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(weights(1)))

        update = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
        again = update(restore(mngr, 5, target)["w"])
        np.testing.assert_array_equal(np.asarray(again), np.asarray(weights(5)) * 2 + 1)
        np.testing.assert_array_equal(np.asarray(restore(mngr, 5, target)["w"]), weights(5))
        assert h.last_restore_metrics["tier"] == "memory"
