"""The memory tier's layout, commit, retention and pins (no jax needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from jaxckpt.coord import _liveness
from jaxckpt.memory._memory_tier import MemoryTier


def commit_step(tier: MemoryTier, step: int, owner: int = 0, size: int = 64) -> None:
    staging = tier.new_staging_dir(step, owner)
    (staging / "manifest.json").write_text("{}")
    slab = staging / "slab"
    tier.take_free_slab(slab)
    with open(slab, "ab") as f:
        f.truncate(size)
    tier.commit(staging, step, owner)


def test_commit_is_atomic_and_replaces(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    commit_step(tier, 5)
    staging = tier.new_staging_dir(5, 0)
    (staging / "new").write_text("x")
    (staging / "slab").write_bytes(b"")
    tier.commit(staging, 5, 0)
    assert sorted(p.name for p in tier.part_dir(5, 0).iterdir()) == ["new", "slab"]
    assert tier.inventory() == {5: [0]}


def test_a_part_without_a_slab_is_not_held(tmp_path):
    """A part of a format before slabs (left by an older jaxckpt) is not counted."""
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    staging = tier.new_staging_dir(5, 0)
    (staging / "manifest.json").write_text("{}")
    (staging / "arrays").mkdir()
    tier.commit(staging, 5, 0)
    assert tier.inventory() == {}


def test_retired_slabs_are_reused_and_bounded(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in range(1, 4):
        commit_step(tier, step, owner=0, size=4096)
        commit_step(tier, step, owner=1, size=4096)
    slab = tier.slab(1, 0)
    inode = slab.stat().st_ino
    assert tier.retain(1, upto=3) == [1, 2]
    # Two parts per step here: at most two retired slabs wait for reuse.
    free = sorted((tier.run_dir / ".free").iterdir())
    assert len(free) == 2
    assert inode in {p.stat().st_ino for p in free}
    target = tier.run_dir / "taken"
    assert tier.take_free_slab(target) and target.stat().st_size == 4096
    assert tier.take_free_slab(tmp_path / "t2")
    assert not tier.take_free_slab(tmp_path / "t3")


def test_without_spare_slabs_retired_slabs_are_freed(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a", spare_slabs=False)
    tier.prepare("ckpt", 0)
    for step in (1, 2, 3):
        commit_step(tier, step, owner=0, size=4096)
    assert tier.retain(1, upto=3) == [1, 2]
    assert list((tier.run_dir / ".free").glob("*")) == []
    assert sorted(p.name for p in tier.run_dir.rglob("slab")) == ["slab"]  # step 3's


def test_a_lent_slab_is_never_recycled(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in (1, 2):
        commit_step(tier, step, owner=0, size=4096)
        commit_step(tier, step, owner=1, size=4096)
    lent = tier.slab(1, 0).stat().st_ino
    assert tier.lend(1, 0)
    assert tier.retain(1, upto=2) == [1]
    # Part 1's slab waits for reuse; the lent one is only unlinked.
    free = list((tier.run_dir / ".free").iterdir())
    assert len(free) == 1 and free[0].stat().st_ino != lent
    assert not tier.lend(1, 0)  # retired: nothing left to lend


def test_retention_keeps_newest_and_pinned_steps(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in range(1, 6):
        commit_step(tier, step)
    pin = tier.pin(2)
    assert tier.retain(2, upto=5, pinned={3}) == [1]
    assert tier.steps() == [2, 3, 4, 5]
    pin.release()
    assert tier.retain(2, upto=4) == [2]
    assert tier.steps() == [3, 4, 5]  # 5 is after `upto`: still being saved


class _Racing(MemoryTier):
    """A tier whose listing of steps is followed at once by another process's
    retention of the same memory root (two processes on one host)."""

    other: MemoryTier

    def steps(self) -> list[int]:
        found = super().steps()
        if getattr(self, "other", None) is not None:
            other, self.other = self.other, None
            other.retain(1, upto=max(found))
        return found


def test_retention_tolerates_steps_deleted_by_another_process_meanwhile(tmp_path, monkeypatch):
    tier = _Racing(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in range(1, 6):
        commit_step(tier, step)
    tier.other = MemoryTier(str(tmp_path), "run-a")
    # The other process deletes 1-4 after this one listed them, and after any check
    # that their directories exist (a step may vanish between any two calls).
    real_is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda p: p.name.startswith("step_") or real_is_dir(p))
    assert tier.retain(2, upto=5) == [1, 2, 3]  # nothing left to delete: no error
    assert tier.steps() == [5]
    assert not tier.is_pinned(1) and tier.parts(1) == []


def test_pins_of_dead_processes_are_ignored(tmp_path):
    """Processes sharing one memory root see each other's pins; a dead one's pin is void."""
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in (1, 2, 3):
        commit_step(tier, step)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from jaxckpt.memory._memory_tier import MemoryTier; MemoryTier({str(tmp_path)!r}, 'run-a').pin(1)",
        ],
        check=True,
    )
    assert other.returncode == 0
    assert not tier.is_pinned(1)  # that process has exited
    live = tier.pin(1)
    assert tier.is_pinned(1)
    assert tier.retain(1, upto=3) == [2] and tier.steps() == [1, 3]
    live.release()


def test_runs_are_kept_apart(tmp_path):
    a, b = MemoryTier(str(tmp_path), "run-a"), MemoryTier(str(tmp_path), "run-b")
    a.prepare("ckpt-a", 0)
    b.prepare("ckpt-b", 0)
    commit_step(a, 1)
    assert b.steps() == [] and a.steps() == [1]


def test_the_smallest_free_slab_that_fits_is_taken(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    free = tier.run_dir / ".free"
    free.mkdir()
    for name, size in [("a", 100), ("b", 4000), ("c", 9000)]:
        (free / name).write_bytes(b"x" * size)
    assert tier.take_free_slab(tmp_path / "x", 3000) and (tmp_path / "x").stat().st_size == 4000
    assert tier.take_free_slab(tmp_path / "y", 99999) and (tmp_path / "y").stat().st_size == 9000
    assert tier.take_free_slab(tmp_path / "z", 1) and (tmp_path / "z").stat().st_size == 100


def test_a_slab_retired_here_is_taken_first_unless_another_process_took_it(tmp_path):
    """A process's next save takes the slab it retired last; where another process
    sharing the memory root took that one meanwhile, it takes what `.free/` holds."""
    tier, other = MemoryTier(str(tmp_path), "run-a"), MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in (1, 2):
        commit_step(tier, step, owner=0, size=4096)
        commit_step(tier, step, owner=1, size=8192)
    mine = {tier.slab(1, 0).stat().st_ino, tier.slab(1, 1).stat().st_ino}
    assert tier.retain(1, upto=2) == [1]
    assert tier.take_free_slab(tmp_path / "x", 4096)
    assert (tmp_path / "x").stat().st_ino in mine
    assert other.take_free_slab(tmp_path / "y", 1)  # the other one, listed
    commit_step(tier, 3, owner=0, size=4096)
    commit_step(tier, 3, owner=1, size=4096)
    assert tier.retain(1, upto=3) == [2]
    free = {p.stat().st_ino for p in (tier.run_dir / ".free").iterdir()}
    assert other.take_free_slab(tmp_path / "z", 1)  # one of them, before `tier` asks
    assert tier.take_free_slab(tmp_path / "w", 1)  # the other: its hint, or the listing
    assert {(tmp_path / n).stat().st_ino for n in ("z", "w")} == free
    assert not tier.take_free_slab(tmp_path / "v", 1)


def _made_by_a_dead_process(tier: MemoryTier) -> list[str]:
    """A staging part and a trash directory made by a process that then died (SIGKILL)."""
    script = (
        "import os, signal; from jaxckpt.coord import _liveness; "
        "from jaxckpt.memory._memory_tier import MemoryTier; "
        f"tier = MemoryTier({str(tier.run_dir.parent)!r}, {tier.run_id!r}); "
        "part = tier.new_staging_dir(3, 0); (part / 'slab').write_bytes(b'x' * 4096); "
        "trash = tier.run_dir / '.staging' / _liveness.owned_name('trash.2'); "
        "(trash / 'part_00000').mkdir(parents=True); "
        "print(part.name, trash.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    return done.stdout.split()


def test_staging_leftovers_go_when_their_maker_is_gone_however_young(tmp_path):
    """Decided by who made an entry (pid, start time, pid namespace, boot), not by its age."""
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    staging = tier.run_dir / ".staging"
    dead = _made_by_a_dead_process(tier)
    assert any(n.endswith(tuple("0123456789abcdef")) and "-step_3.part_0-" in n for n in dead)
    assert any("-trash.2-" in n for n in dead)
    mine = tier.new_staging_dir(4, 0)  # a save of this (live) process in flight
    # Made in another pid namespace (another container sharing the tmpfs): not ours to
    # judge, so only age removes it, as it does a name from an older jaxckpt.
    _, start, _, boot = _liveness.record().split(".")
    foreign = staging / f"1.{start}.4026530000.{boot}-step_4.part_1-abc"
    legacy_young = staging / "step_4.part_2.0123abcd"
    legacy_old = staging / "step_1.part_2.4567cdef"
    for entry in (foreign, legacy_young, legacy_old):
        entry.mkdir()
    os.utime(legacy_old, (time.time() - 3600, time.time() - 3600))

    tier.clear_staging(older_than_s=120)
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        [mine.name, foreign.name, legacy_young.name]
    )
    os.utime(foreign, (time.time() - 3600, time.time() - 3600))
    tier.clear_staging(older_than_s=120)
    assert sorted(p.name for p in staging.iterdir()) == sorted([mine.name, legacy_young.name])


def test_retention_removes_the_leftovers_of_processes_that_died_meanwhile(tmp_path):
    """A process sharing the memory root dies after this one started: its staging slab
    goes with this process's next retention, not with the next restart."""
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    tier.clear_staging()
    mine = tier.new_staging_dir(3, 1)
    for step in (1, 2):
        commit_step(tier, step)
    dead = _made_by_a_dead_process(tier)
    assert tier.retain(1, upto=2) == [1]
    assert [p.name for p in (tier.run_dir / ".staging").iterdir()] == [mine.name]
    assert not set(dead) & {p.name for p in (tier.run_dir / ".staging").iterdir()}
