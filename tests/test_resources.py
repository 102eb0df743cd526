"""Resource faults: a full memory tier, an unwritable persistent directory, a slow peer.

Each fault must be reported through the manager (or, for the lazy persistent
copy, through the handler), leave the training state and every earlier step
intact, and stop mattering once it clears: the next save works.

The full-tmpfs tests mount a real tiny tmpfs and are skipped where mounting is
not allowed (not root, no CAP_SYS_ADMIN); the injected ENOSPC test always runs.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import abstract, assert_tree_equal, attach_peers, manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_bad_peers import RUN, TOKEN, FakePeers, Proxy, own_server, small_state

import jaxckpt
from jaxckpt._options import TierOptions
from jaxckpt.peer._server import PeerServer
from jaxckpt.tiers import _memory_tier, _slab


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(TierOptions(memory_root, run_id=RUN, **kw))


def host_copy(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x) if isinstance(x, jax.Array) else x, tree)


def assert_unchanged(state, before) -> None:
    """The training state in device memory still holds what it held before the failed save."""
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(state[name]), before[name])


def error_chain(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


# ---- memory tier full ---------------------------------------------------------


def test_memory_tier_full_injected_enospc(memory_root, ckpt_dir, monkeypatch):
    full = False
    original = _slab.write

    def write(*args, **kwargs):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(_slab, "write", write)
    h = handler(memory_root, persist_every=1000)
    mngr = manager(ckpt_dir, h)
    save(mngr, 1, small_state(1))
    mngr.wait_until_finished()

    full = True
    state = small_state(2)
    before = host_copy(state)
    with pytest.raises(Exception) as err:
        save(mngr, 2, state)
        mngr.wait_until_finished()
    assert "No space left" in error_chain(err.value), error_chain(err.value)
    assert_unchanged(state, before)
    assert 2 not in mngr.all_steps()
    h.wait_for_persistence()
    assert h.inspect().memory.steps() == [1]  # nothing half-written is visible
    assert not [
        p for p in (h.inspect().memory.run_dir / ".staging").iterdir() if "step_2" in p.name
    ]
    assert_tree_equal(restore(mngr, 1, abstract(small_state(1))), small_state(1))

    full = False  # space is back: the next save works
    save(mngr, 3, small_state(3))
    mngr.wait_until_finished()
    assert_tree_equal(restore(mngr, 3, abstract(small_state(3))), small_state(3))
    assert mngr.all_steps() == [1, 3]
    mngr.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """Mounts a tmpfs; yields (path, resize(size)). Skips where mounting is not allowed."""
    mounts = []

    def mount(name: str, size: str) -> tuple[Path, Callable[[str], None]]:
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)

        def resize(new: str) -> None:
            subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True)

        return path, resize

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


def big_state(step: int) -> dict:
    """256 KiB of float32 in 8 chunks, unique per step."""
    rng = np.random.default_rng(step)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh_1d(), P("data"))), "step": step}


def test_memory_tier_full_real_tmpfs(tiny_tmpfs, ckpt_dir):
    root, resize = tiny_tmpfs("tiny", "400k")  # one step fits, a second does not
    h = handler(str(root / "memory"), persist_every=1000)
    mngr = manager(ckpt_dir, h)
    save(mngr, 1, big_state(1))
    mngr.wait_until_finished()
    state = big_state(2)
    before = np.array(state["w"])
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        save(mngr, 2, state)
        mngr.wait_until_finished()
    chain = error_chain(err.value)
    assert "space" in chain.lower() or "ENOSPC" in chain or "RESOURCE_EXHAUSTED" in chain, chain
    assert time.monotonic() - start < 30
    np.testing.assert_array_equal(np.asarray(state["w"]), before)
    assert_tree_equal(restore(mngr, 1, abstract(big_state(1))), big_state(1))
    resize("4m")  # the fault clears
    save(mngr, 3, big_state(3))
    mngr.wait_until_finished()
    assert_tree_equal(restore(mngr, 3, abstract(big_state(3))), big_state(3))
    mngr.close()


def test_holder_memory_full_fails_the_save_clearly(tiny_tmpfs, tmp_path, monkeypatch):
    """The replica holder's tmpfs is full: the owner's save reports it; no partial replica."""
    holder_root, resize = tiny_tmpfs("holder", "200k")
    ckpt = tmp_path / "ckpt"
    h = handler(str(tmp_path / "memory"), persist_every=1000, replicas=1, timeout_s=10)
    with PeerServer(holder_root, run_id=RUN, token=TOKEN) as holder:
        attach_peers(
            h, FakePeers(own_server(tmp_path / "own"), holder.address, push=True), monkeypatch
        )
        mngr = manager(ckpt, h)
        with pytest.raises(Exception) as err:
            save(mngr, 1, big_state(1))
            mngr.wait_until_finished()
        chain = error_chain(err.value)
        assert "507" in chain and "process 1" in chain, chain
        holder_memory = _memory_tier.MemoryTier(str(holder_root), RUN)
        assert holder_memory.steps() == []  # no partial replica
        resize("4m")
        save(mngr, 2, big_state(2))
        mngr.wait_until_finished()
        assert holder_memory.parts(2) == [0]
        assert_tree_equal(restore(mngr, 2, abstract(big_state(2))), big_state(2))
        mngr.close()


# ---- persistent directory unwritable ---------------------------------------------


def test_unwritable_persistent_directory_is_reported_and_recovers(memory_root, ckpt_dir):
    ckpt_dir.mkdir()
    blocker = ckpt_dir / ".jaxckpt-staging"  # persistence cannot create its staging area
    blocker.write_text("not a directory")
    h = handler(memory_root, persist_every=1)
    mngr = manager(ckpt_dir, h)
    state = small_state(1)
    before = host_copy(state)
    save(mngr, 1, state)
    mngr.wait_until_finished()  # the memory tier took the step: the save itself succeeded
    with pytest.raises(OSError, match=r"step 1|Step 1"):
        h.wait_for_persistence()  # ...but its persistence failed, and the handler says so
    assert_unchanged(state, before)
    assert not (ckpt_dir / "1" / "train" / "part_00000").exists()
    assert_tree_equal(restore(mngr, 1, abstract(state)), state)  # still in memory

    blocker.unlink()  # the fault clears
    save(mngr, 2, small_state(2))
    mngr.wait_until_finished()
    h.wait_for_persistence()
    assert (ckpt_dir / "2" / "train" / "part_00000" / "manifest.json").exists()
    with contextlib.suppress(OSError):  # an earlier failure may be raised once more
        mngr.close()
    shutil.rmtree(memory_root)  # only the persistent tier is left
    h2 = handler(memory_root)
    with manager(ckpt_dir, h2) as mngr2:
        assert_tree_equal(restore(mngr2, 2, abstract(small_state(2))), small_state(2))
        assert h2.last_restore_metrics["tier"] == "persistent"


# ---- slow peer ---------------------------------------------------------------------


def test_slow_peer_within_the_timeout_gets_its_replica(tmp_path, monkeypatch):
    holder_root = tmp_path / "holder"
    h = handler(str(tmp_path / "memory"), persist_every=1000, replicas=1, timeout_s=10)
    with PeerServer(holder_root, run_id=RUN, token=TOKEN) as holder:
        proxy = Proxy(holder.address, delay=0.01, chunk=1024)
        try:
            attach_peers(
                h, FakePeers(own_server(tmp_path / "own"), proxy.address, push=True), monkeypatch
            )
            with manager(tmp_path / "ckpt", h) as mngr:
                save(mngr, 1, small_state(1))
                mngr.wait_until_finished()
                assert mngr.all_steps() == [1]
            assert _memory_tier.MemoryTier(str(holder_root), RUN).parts(1) == [0]
            assert h.last_save_metrics["replicate_s"] > 0.01
        finally:
            proxy.close()


def test_stalled_peer_is_skipped_in_bounded_time_and_recovers(tmp_path, monkeypatch, caplog):
    """A holder that stops reading (a partition, a stalled host): its copy is skipped
    within the save's bound and the save succeeds; once it reads again, it gets copies."""
    timeout_s = 1.5
    holder_root = tmp_path / "holder"
    h = handler(str(tmp_path / "memory"), persist_every=1000, replicas=1, timeout_s=timeout_s)
    with PeerServer(holder_root, run_id=RUN, token=TOKEN) as holder:
        proxy = Proxy(holder.address)
        try:
            attach_peers(
                h, FakePeers(own_server(tmp_path / "own"), proxy.address, push=True), monkeypatch
            )
            mngr = manager(tmp_path / "ckpt", h)
            save(mngr, 1, small_state(1))
            mngr.wait_until_finished()

            proxy.stall.set()  # the holder stops reading: the push of step 2 never completes
            state = small_state(2)
            before = host_copy(state)
            start = time.monotonic()
            with caplog.at_level("WARNING"):
                save(mngr, 2, state)
                mngr.wait_until_finished()
            took = time.monotonic() - start
            assert took < 4 * timeout_s + 5, f"the save took {took:.1f} s"
            skipped = [
                r.getMessage() for r in caplog.records if "copy is skipped" in r.getMessage()
            ]
            assert skipped and "step 2" in skipped[0] and "no answer" in skipped[0], skipped
            assert_unchanged(state, before)
            assert 2 in mngr.all_steps()
            holder_memory = _memory_tier.MemoryTier(str(holder_root), RUN)
            assert 2 not in holder_memory.steps()  # the stalled holder got no copy
            assert_tree_equal(restore(mngr, 2, abstract(small_state(2))), small_state(2))

            proxy.stall.clear()  # the peer recovers: the next save's copy arrives
            save(mngr, 3, small_state(3))
            mngr.wait_until_finished()
            assert 3 in mngr.all_steps()
            assert holder_memory.parts(3) == [0]
            mngr.close()
        finally:
            proxy.close()
