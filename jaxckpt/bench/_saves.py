"""Isolated saves, each after the previous one finished: jaxckpt's and Orbax's, of any
state, timed the same way for the full state (`_phases`) and the many-leaf tree
(`_many_leaves`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxckpt.bench._managers import Jaxckpt

Sync = Callable[..., Any]


def jaxckpt(
    count: int, state: Callable[[int], Any], ours: Jaxckpt, sync: Sync, tag: str
) -> list[dict[str, Any]]:
    """Saves steps 1..count of `state(step)` with jaxckpt, each after the previous one
    finished; step 1 warms up.

    `to_memory_s`: from the `mngr.save()` call until the part was committed in
    memory (the rename of its directory into place, by the directory's ctime);
    `manifest_s`: until its manifest was built (the manifest's creation time, just
    before it is written and committed). `slab_reused`: whether the part's slab was
    a retired step's (pages already allocated), as in a training run once a step
    has been retired."""
    pi, records = jax.process_index(), []
    for step in range(1, count + 1):
        sync(f"{tag}/{step}")
        memory = ours.handler.inspect().memory
        free = _slab_inodes(memory.run_dir / ".free") if memory else set()
        wall = time.time()
        start = time.perf_counter()
        ours.save(step, state(step))
        stall_wall = time.perf_counter() - start
        ours.mngr.wait_until_finished()
        done = time.perf_counter() - start
        # Outside the timing: the retention of the older step (in the background) is
        # done before the next save, which then finds its slab.
        ours.handler.wait_for_persistence(ours.timeout_s)
        (metrics,) = ours.metrics("save", step)
        memory = ours.handler.inspect().memory
        manifest = memory.read_manifest(step, pi) if memory else None
        slab = _slab_inodes(memory.part_dir(step, pi), "slab") if memory else set()
        written = manifest.created - wall if manifest else None
        to_memory = _committed(memory.part_dir(step, pi), wall) if memory else None
        push_s = (
            metrics["safe_on_peers_s"] - metrics["safe_in_memory_s"]
            if "safe_on_peers_s" in metrics
            else None
        )
        records.append(
            {
                "warmup": step == 1,
                "slab_reused": bool(slab & free),
                "save_wall_s": stall_wall,
                "done_s": done,
                "manifest_s": written,
                "to_memory_s": to_memory if to_memory is not None else written,
                "to_replicated_s": _plus(to_memory, push_s),
                **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            }
        )
    return records


def _committed(part_dir: Path, wall: float) -> float | None:
    """Seconds from `wall` until `part_dir` was renamed into place (its ctime: nothing
    changes the directory itself afterwards until its step is retired)."""
    try:
        return part_dir.stat().st_ctime - wall
    except OSError:
        return None


def _slab_inodes(directory: Path, name: str | None = None) -> set[int]:
    """The inode numbers of the files in `directory` (or of its file `name`)."""
    try:
        paths = [directory / name] if name else list(directory.iterdir())
        return {p.stat().st_ino for p in paths}
    except OSError:
        return set()


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def orbax(
    count: int, state: Callable[[int], Any], mngr: ocp.CheckpointManager, sync: Sync, tag: str
) -> list[dict[str, Any]]:
    """Orbax saves of steps 1..count, each until finished; step 1 warms up."""
    records = []
    for step in range(1, count + 1):
        sync(f"{tag}/{step}")
        start = time.perf_counter()
        mngr.save(step, args=ocp.args.StandardSave(state(step)))
        stall = time.perf_counter() - start
        mngr.wait_until_finished()
        records.append(
            {
                "step": step,
                "warmup": step == 1,
                "save_wall_s": stall,
                "done_s": time.perf_counter() - start,
            }
        )
    return records
