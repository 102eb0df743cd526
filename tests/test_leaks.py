"""A write that fails for lack of space leaves nothing behind, in either tier."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import time
from pathlib import Path

import faults
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import manager, mesh_1d, save, small_tmpfs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.tiers import _persist_job, _slab, _zarr


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


def leftovers(staging: Path) -> list[str]:
    """Everything under a staging directory (files and directories)."""
    return (
        sorted(str(p.relative_to(staging)) for p in staging.rglob("*")) if staging.exists() else []
    )


def state_of(mib: float, leaves: int = 4) -> dict[str, jax.Array]:
    n = int(mib * 2**20 / 4 / leaves) // 8 * 8
    sharding = NamedSharding(mesh_1d(), P("data"))
    return {f"x{i}": jax.device_put(np.full(n, i, np.float32), sharding) for i in range(leaves)}


def failing_after_others(monkeypatch, name: str) -> None:
    """`_zarr.<name>` fails with ENOSPC for leaf 0 at once; the other leaves write late.

    The late writes run on threads, as tensorstore's writes run in C++: like
    them, they go on when the coroutine awaiting them is cancelled.
    """
    original = getattr(_zarr, name)
    pool = concurrent.futures.ThreadPoolExecutor(8)

    def late(*args, **kwargs):
        time.sleep(0.3)
        return asyncio.run(original(*args, **kwargs))

    async def flaky(*args, **kwargs):
        if str(args[0]["path"]).rstrip("/").endswith("arrays/x0"):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return await asyncio.wrap_future(pool.submit(late, *args, **kwargs))

    monkeypatch.setattr(_zarr, name, flaky)


@pytest.mark.parametrize("hold", [False, True], ids=["copy", "hold"])
def test_failed_memory_write_leaves_no_staging_chunks(hold, memory_root, ckpt_dir, monkeypatch):
    """The first chunk's write fails at once; the others land late, after the failure
    (in `save()` itself, or in the commit of held arrays)."""
    original = _slab._pwrite_all

    def flaky(fd, data, offset):
        if offset == 0:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        time.sleep(0.3)
        original(fd, data, offset)

    monkeypatch.setattr(_slab, "_pwrite_all", flaky)
    h = handler(memory_root, persist_every=1000, hold_cpu_arrays=hold)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        with pytest.raises(OSError, match="Step 1 does not fit in the memory tier"):
            save(mngr, 1, state_of(0.1))
        time.sleep(0.6)  # a write still in flight would land by now
        assert leftovers(Path(memory_root) / h.inspect().memory.run_id / ".staging") == []


def test_failed_persistence_leaves_no_staging_dirs(memory_root, ckpt_dir, monkeypatch):
    failing_after_others(monkeypatch, "write_chunks")
    h = handler(memory_root, persist_every=1)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, state_of(0.1))
        with pytest.raises(OSError, match=r"step 1 .*No space left"):
            h.wait_for_persistence()
        time.sleep(0.6)
        assert leftovers(ckpt_dir / ".jaxckpt-staging") == []
        assert not (ckpt_dir / "1" / "train" / "part_00000").exists()


def test_full_tmpfs_memory_tier_leaves_nothing(tmp_path, ckpt_dir):
    with small_tmpfs(tmp_path / "shm", "1m") as root:
        h = handler(str(root), persist_every=1000)
        with manager(ckpt_dir, h, use_async=False) as mngr:
            with pytest.raises(OSError, match=r"Step 1 does not fit in the memory tier.*size="):
                save(mngr, 1, state_of(4, leaves=8))
            time.sleep(0.3)
            assert leftovers(root / h.inspect().memory.run_id / ".staging") == []


def test_full_persistent_storage_leaves_nothing(memory_root, tmp_path):
    # The persist waits for the save to return: the disk fills up with its part,
    # not (by a race) before the manager has written the step's own files.
    with small_tmpfs(tmp_path / "disk", "2m") as ckpt:
        h = handler(memory_root, persist_every=1)
        with manager(ckpt, h, use_async=False) as mngr, faults.held("persist_begin") as saved:
            save(mngr, 1, state_of(4, leaves=8))
            saved.set()
            with pytest.raises(OSError, match="step 1"):
                h.wait_for_persistence()
            time.sleep(0.3)
            assert leftovers(ckpt / ".jaxckpt-staging") == []


def test_a_save_that_fails_after_the_part_does_not_hold_up_close(
    memory_root, ckpt_dir, monkeypatch, caplog
):
    """Orbax fails the save after the handler wrote its part: the step is never
    finalized, and close gives up waiting for it at once instead of after timeout_s."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.Checkpointer, "_save_step_metadata", full)
    h = handler(memory_root, persist_every=1, timeout_s=3600)
    with (
        manager(ckpt_dir, h, use_async=False) as mngr,
        pytest.raises(OSError, match="No space left"),
    ):
        save(mngr, 1, state_of(0.1))
    assert "step 1 is not persisted: Step 1 was never finalized" in caplog.text
    assert "memory retention skipped after step 1: Step 1 was never finalized" in caplog.text
    assert h.last_persist_metrics == {}
    assert not any(p.name.startswith("1") and "tmp" not in p.name for p in ckpt_dir.iterdir())


def test_persistence_starts_early_but_a_failed_commit_persists_nothing(
    memory_root, ckpt_dir, monkeypatch, caplog
):
    """The persist job is queued once the part is in memory; when the rest of the commit
    (push, agreement, index) fails, the job makes nothing durable, reports no second
    error, and the next step persists."""
    from jaxckpt.coord import _agreement

    agree = _agreement.agree_on_save
    writing: list[int] = []
    write = _persist_job.write_chunks

    async def spy(manifest, *args, **kwargs):
        writing.append(manifest.step)
        return await write(manifest, *args, **kwargs)

    def failing(leaves, error, *, tag, step, timeout_s, **index):
        if step == 2 and leaves is not None:
            error = error or ValueError("the other processes saved another tree (injected)")
        if step == 3:  # the agreement waits until step 3's persistence is under way
            deadline = time.monotonic() + 30
            while 3 not in writing:
                assert time.monotonic() < deadline, "persistence did not start before the index"
                time.sleep(0.01)
        return agree(leaves, error, tag=tag, step=step, timeout_s=timeout_s, **index)

    monkeypatch.setattr(_persist_job, "write_chunks", spy)
    monkeypatch.setattr(_agreement, "agree_on_save", failing)
    h = handler(memory_root, persist_every=1)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save(mngr, 1, state_of(0.1))
        with pytest.raises(ValueError, match="another tree"):
            save(mngr, 2, state_of(0.1))
        save(mngr, 3, state_of(0.1))
        h.wait_for_persistence()  # no error: the failed save already raised
    assert (ckpt_dir / "1" / "train" / "part_00000").is_dir()
    assert (ckpt_dir / "3" / "train" / "part_00000").is_dir()
    assert not list(ckpt_dir.glob("2*/train/part_00000"))
    assert "step 2 is not persisted: The save of step 2 failed after its part" in caplog.text
    assert leftovers(ckpt_dir / ".jaxckpt-staging") == []
