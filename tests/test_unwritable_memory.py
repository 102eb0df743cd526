"""A full or read-only memory tier never blocks a restore.

A restore reads what the tier holds without new pages in it (a full tmpfs), and a
tier that cannot be written at all (read-only, or full before the run could record
itself there: a replacement host) is skipped with a warning, the step read from
peers and persistent storage; saving into such a tier is refused by name.

The real filesystems need root (a small tmpfs, a read-only bind mount) and skip
without it, saying why; the same behaviour is also checked with the failures
injected where the tier writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

import pytest
from helpers import (
    abstract,
    assert_tree_equal,
    fill,
    manager,
    mesh_1d,
    read_only,
    restore,
    save,
    sharded_state,
    small_tmpfs,
)

import jaxckpt
from jaxckpt.coord import _liveness
from jaxckpt.memory import _memory_tier


def handler(memory_root, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(memory_root), **kw))


def saved(memory_root, ckpt_dir, *, persist_every: int) -> dict:
    """Saves step 1 (persisted when `persist_every` is 1), as a job that then ends."""
    state = sharded_state(mesh_1d(), seed=1)
    h = handler(memory_root, persist_every=persist_every)
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    return state


def restored(memory_root, ckpt_dir, state) -> tuple[int | None, str]:
    """What a restarted job on `memory_root` gets: the newest restorable step, restored
    exactly (checked); and the tier it read most from."""
    h = handler(memory_root, persist_every=1)
    with manager(ckpt_dir, h) as mngr:
        step = jaxckpt.latest_restorable_step(mngr)
        assert_tree_equal(restore(mngr, step, abstract(state)), state)
        return step, h.last_restore_metrics["tier"]


def refused_save(memory_root, ckpt_dir, step: int) -> BaseException:
    """The error a save into `memory_root` raises."""
    h = handler(memory_root, persist_every=1)
    mngr = manager(ckpt_dir, h, use_async=False)
    with pytest.raises(OSError) as err:
        save(mngr, step, sharded_state(mesh_1d(), seed=step))
    assert step not in mngr.all_steps()
    with contextlib.suppress(OSError):  # Orbax may report a failed save once more
        mngr.close()
    return err.value


# ---- real filesystems (root) -------------------------------------------------------------


def test_a_full_tmpfs_still_restores_what_it_holds(tmp_path, ckpt_dir):
    """Save, fill the tmpfs, restart: the step comes back from memory (pinning it takes
    no page), and the next save says the tier is full."""
    with small_tmpfs(tmp_path / "shm", "8m") as root:
        state = saved(root, ckpt_dir, persist_every=1000)  # in memory only
        fill(root)
        assert restored(root, ckpt_dir, state) == (1, "memory")
        error = refused_save(root, ckpt_dir, 2)
        assert error.errno == errno.ENOSPC, error
        assert "does not fit in the memory tier" in str(error) or "is full" in str(error)


def test_a_replacement_host_on_a_full_tmpfs_restores_from_persistent_storage(
    tmp_path, ckpt_dir, caplog
):
    state = saved(tmp_path / "lost-host", ckpt_dir, persist_every=1)
    with small_tmpfs(tmp_path / "shm", "1m") as root:
        fill(root)
        with caplog.at_level(logging.WARNING):
            assert restored(root, ckpt_dir, state) == (1, "persistent")
        said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
        assert said and str(root) in said[0] and "No space left" in said[0], said
        assert "restores skip it and read from peers and persistent storage" in said[0]
        error = refused_save(root, ckpt_dir, 2)
        assert error.errno == errno.ENOSPC and not isinstance(error, PermissionError), error
        assert "[process 0] The memory tier" in str(error) and "is full, so step 2" in str(error)


def test_a_read_only_memory_root_restores_from_persistent_storage(tmp_path, ckpt_dir, caplog):
    """The memory root remounted read-only, with the step still in it: nothing there can
    be pinned, so the restore reads persistent storage; a save is refused by name."""
    state = saved(tmp_path / "memory", ckpt_dir, persist_every=1)
    with read_only(tmp_path / "memory", tmp_path / "ro") as root:
        with caplog.at_level(logging.WARNING):
            assert restored(root, ckpt_dir, state) == (1, "persistent")
        assert "Read-only file system" in caplog.text and str(root) in caplog.text
        error = refused_save(root, ckpt_dir, 2)
        assert isinstance(error, PermissionError), error
        assert "The memory tier" in str(error) and "is not writable" in str(error)
        assert "so step 2 cannot be saved" in str(error)


# ---- the same failures, injected (no root needed) ----------------------------------------


def test_a_step_that_cannot_be_pinned_is_read_from_the_next_tier(
    memory_root, ckpt_dir, monkeypatch, caplog
):
    state = saved(memory_root, ckpt_dir, persist_every=1)

    def no_pin(self, path):
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))

    monkeypatch.setattr(_liveness.HeldFile, "__init__", no_pin)
    with caplog.at_level(logging.WARNING):
        assert restored(memory_root, ckpt_dir, state) == (1, "persistent")
    said = [r.getMessage() for r in caplog.records if "skips the memory tier" in r.getMessage()]
    assert len(said) == 1, said
    assert "step 1" in said[0] and "Read-only file system (injected)" in said[0], said


def test_a_pin_needs_no_page_of_the_tier(memory_root, ckpt_dir, monkeypatch):
    """A full tier refuses every write of data into it (ENOSPC) but still creates
    files: the restore pins and lends the step and reads it from memory."""
    state = saved(memory_root, ckpt_dir, persist_every=1000)
    real = {"write": os.write, "pwrite": os.pwrite}

    def in_tier(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(memory_root))

    def full(name):
        def write(fd, *args):
            if in_tier(fd):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real[name](fd, *args)

        return write

    for name in real:
        monkeypatch.setattr(os, name, full(name))
    assert restored(memory_root, ckpt_dir, state) == (1, "memory")


def test_an_unwritable_tier_skips_restores_refuses_saves_and_recovers(
    memory_root, ckpt_dir, monkeypatch, caplog
):
    state = saved(memory_root, ckpt_dir, persist_every=1)
    record_run = _memory_tier.MemoryTier._record_run

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(_memory_tier.MemoryTier, "_record_run", full)
    with caplog.at_level(logging.WARNING):
        assert restored(memory_root, ckpt_dir, state) == (1, "persistent")
    assert "cannot be written (" in caplog.text and "(injected)" in caplog.text
    error = refused_save(memory_root, ckpt_dir, 2)
    assert error.errno == errno.ENOSPC and "is full, so step 2 cannot be saved" in str(error)
    assert "TierOptions.memory_keep" in str(error)

    # Room again: the same handler's next save tries the tier again and succeeds.
    h = handler(memory_root, persist_every=1000)
    with manager(ckpt_dir, h, use_async=False) as mngr:
        with pytest.raises(OSError, match="is full"):
            save(mngr, 3, sharded_state(mesh_1d(), seed=3))
        monkeypatch.setattr(_memory_tier.MemoryTier, "_record_run", record_run)
        save(mngr, 4, sharded_state(mesh_1d(), seed=4))
        assert_tree_equal(
            restore(mngr, 4, abstract(sharded_state(mesh_1d(), seed=4))),
            {**sharded_state(mesh_1d(), seed=4)},
        )
        assert h.last_restore_metrics["tier"] == "memory"
