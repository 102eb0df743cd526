"""The accelerator-host proxy (figures 9a-e): what a GPU host looks like to a save.

On a GPU host the train step runs on the device, and a save's host work (copies,
checksums, the manager's Python) only costs the step what it takes from the step's
own host side. Here one process trains on one CPU device with XLA single-threaded
(`XLA_FLAGS`, set by the driver before jax starts) and every thread that exists
once the step has run (XLA's and jax's: "the device") confined to one CPU; the
training loop's thread, and every thread a save starts from it afterwards, to the
other CPUs ("the host"). Then, against the same loop without saving: a jaxckpt save
every step (as it copies by default, and holding the arrays: `hold_cpu_arrays`), the
overlapped raw floor (`_floor`), an Orbax async save every step, and
the time the loop's thread takes to dispatch each step (its Python, which waits for
the GIL when a save's Python threads hold it).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxckpt.bench import _floor, _state
from jaxckpt.bench._managers import Jaxckpt, orbax_manager


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def confine() -> dict[str, Any]:
    """Confines every thread of this process but the calling one to the first usable
    CPU, and the calling thread (and so every thread it starts later) to the others.

    Raises:
      RuntimeError: with fewer than 2 usable CPUs.
    """
    cpus = usable_cpus()
    if len(cpus) < 2:
        raise RuntimeError(
            f"The accelerator-host proxy needs 2 usable CPUs, this process has {cpus}."
        )
    device, host = cpus[0], cpus[1:]
    me = threading.get_native_id()
    others = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
    for tid in others:
        try:
            os.sched_setaffinity(tid, {device})
        except OSError:  # ended meanwhile
            continue
    os.sched_setaffinity(me, set(host))
    return {"device_cpu": device, "host_cpus": host, "device_threads": len(others)}


def run(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    work: Path,
    loop: Callable[..., dict[str, list[float]]],
) -> dict[str, Any]:
    """The proxy's loops, in one process; returns their step and dispatch times."""
    out: dict[str, Any] = {"confined": confine()}
    steps = cfg["steps"]
    loops: dict[str, Any] = {}
    for _ in range(cfg["warmup"]):  # the confined step, warm
        tr.train_step()
    loops["train"] = loop(tr, steps)
    for name, hold in (("jaxckpt", False), ("jaxckpt_hold", True)):
        loops[name] = _jaxckpt_loop(cfg, tr, memory_root, work / f"proxy-{name}", loop, hold)
    own = sum(s.nbytes for s in _state.own_shards(tr.state(0)))
    floor = _floor.Floor(memory_root, own, None, cfg["timeout_s"])
    try:
        loops["floor"] = loop(tr, steps, lambda s: floor.save(_state.own_shards(tr.state(s))))
    finally:
        floor.close()
    omngr = orbax_manager(work / "proxy-orbax", cfg, max_to_keep=2)
    try:
        loops["orbax"] = loop(
            tr, steps, lambda s: omngr.save(s, args=ocp.args.StandardSave(tr.state(s)))
        )
        omngr.wait_until_finished()
    finally:
        omngr.close()
    loops["train_again"] = loop(tr, steps)
    shutil.rmtree(work / "proxy-orbax", ignore_errors=True)
    out["loops"] = loops
    return out


def _jaxckpt_loop(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    directory: Path,
    loop: Callable[..., dict[str, list[float]]],
    hold: bool,
) -> dict[str, list[float]]:
    """A loop saving every step with jaxckpt (`hold`: `TierOptions.hold_cpu_arrays`)."""
    ours = Jaxckpt.every_step(directory, memory_root, cfg, hold)
    try:
        record = loop(tr, cfg["steps"], lambda s: ours.save(s, tr.state(s)))
        ours.mngr.wait_until_finished()
        ours.handler.wait_for_persistence(cfg["timeout_s"])
        return record
    finally:
        run_dir = ours.memory_dir
        ours.close()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
