"""A save or restore of many leaves runs without Python's cyclic collector where it
allocates, and gives it back.

Such a restore allocates a few hundred thousand small objects, a save some 10^5; each
700 allocations start a collection, some of which walk every object of the process.
The restore turns the collector off while it reads and places the leaves; a save while
it takes its snapshot and while its commit writes the part (never through an
exchange's wait); each turns it on again after, whether it succeeded or failed, and
never turns on a collector the caller had off.
"""

from __future__ import annotations

import gc
import threading

import jax
import numpy as np
import pytest
from helpers import abstract, manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _faults, _resources


def _many_leaves(n: int = 1500) -> dict[str, jax.Array]:
    sharding = NamedSharding(mesh_1d(), P("data"))
    return {f"leaf{i:05d}": jax.device_put(np.full(64, i, np.float32), sharding) for i in range(n)}


@pytest.fixture
def collections():
    """The collections Python starts meanwhile (their generation), on any thread."""
    started: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield started
    finally:
        gc.callbacks.remove(note)


def test_a_many_leaf_restore_starts_no_collection_and_turns_it_back_on(
    memory_root, ckpt_dir, collections
):
    state = _many_leaves()
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, handler) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        target = abstract(state)
        assert gc.isenabled()
        collections.clear()
        restored = restore(mngr, 1, target)
        during = list(collections)
        assert gc.isenabled()
    for k in ("leaf00000", "leaf01499"):
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(state[k]))
    # 1500 leaves x 8 shards allocate some 10^5 objects: with the collector on, over a
    # hundred collections start during the restore. A few may start in the manager's
    # own steps around the handler's reads.
    assert len(during) <= 5, f"{len(during)} collections started during the restore"


def test_a_many_leaf_save_starts_few_collections_and_turns_it_back_on(
    memory_root, ckpt_dir, collections
):
    state = _many_leaves()
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, handler) as mngr:
        save(mngr, 1, state)  # the first save of a tree derives its records: not counted
        mngr.wait_until_finished()
        counts = []
        for step in (2, 3):
            collections.clear()
            save(mngr, step, state)
            mngr.wait_until_finished()
            counts.append(len(collections))
            assert gc.isenabled()
        np.testing.assert_array_equal(
            np.asarray(restore(mngr, 3, abstract(state))["leaf01499"]), state["leaf01499"]
        )
    # 1500 leaves x 8 shards: with the collector on, ~180 collections started during
    # a save (4 now); what is left runs in the manager's own steps and the commit's exchanges.
    assert max(counts) <= 20, counts


@pytest.mark.parametrize("point", ["snapshot", "memory_write"])
def test_a_save_that_fails_where_the_collector_is_paused_turns_it_back_on(
    memory_root, ckpt_dir, point
):
    """A save fails at a point of its local work (the training thread's staging, the
    commit's part written): the collector was paused there, and is on again after."""
    paused_at: list[bool] = []

    def fail(at: str, step: int | None, process: int) -> None:
        if at == point:
            paused_at.append(not gc.isenabled())
            raise OSError(f"injected at {point}")

    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with (
        manager(ckpt_dir, handler) as mngr,
        _faults.hooked(fail),
        pytest.raises(Exception, match=f"injected at {point}"),
    ):
        save(mngr, 1, _many_leaves(20))
        mngr.wait_until_finished()
    assert paused_at == [True]
    assert gc.isenabled()


def test_a_failed_restore_turns_the_collector_back_on(memory_root, ckpt_dir):
    state = _many_leaves(20)
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, handler) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        wrong = {k: jax.ShapeDtypeStruct((65,), np.float32) for k in state}
        with pytest.raises(ValueError):
            restore(mngr, 1, wrong)
    assert gc.isenabled()


def test_the_pause_nests_across_threads_and_keeps_a_collector_that_was_off():
    shared = _resources.SHARED
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with shared.gc_paused():
            inside.set()
            leave.wait(10)

    with shared.gc_paused():
        assert not gc.isenabled()
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    thread.join(10)
    assert gc.isenabled()

    gc.disable()
    try:
        with shared.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()
