"""Scenarios for the failure suite (tests/test_faults.py): one process of four is killed
during a save with replicas, and the job restarts with three processes.

Run by tests/support/multiproc.py, one JAX process per "host" (see mp_worker.py).
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process, jax.distributed on loopback

# isort: split

import re
import time

import jax
import orbax.checkpoint as ocp
from mp_worker import check, mesh, state, target

import jaxckpt

RUN_ID = "killed"  # fixed: the restarted job reads copies of the crash in other directories


def manager(
    ckpt: str, timeout_s: float
) -> tuple[ocp.CheckpointManager, jaxckpt.TieredCheckpointHandler]:
    return mp_worker.manager(
        ckpt, timeout_s=timeout_s, replicas=1, persist_every=1000, run_id=RUN_ID
    )


def scenario_save_until_killed(args: dict) -> dict:
    """Saves args["steps"] with one replica each, draining after all but the last; one
    process is meant to die during the last one (JAXCKPT_FAULT)."""
    mngr, _ = manager(args["ckpt"], args["timeout_s"])
    m = mesh()
    for step in args["steps"]:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m))))
        if step != args["steps"][-1]:
            mngr.wait_until_finished()
    mngr.wait_until_finished()
    mngr.close()
    return {"steps": mngr.all_steps(), "no_fault": True}


def _restore(mngr: ocp.CheckpointManager, step: int) -> dict:
    """One restore of `step`: ok (every shard checked bitwise), wrong or an error."""
    started = time.perf_counter()
    try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(mesh())))
        ).train
    except Exception as e:  # classified by the test
        return {"step": step, "error": f"{type(e).__name__}: {e}", "seconds": _since(started)}
    bad = check(restored, step)
    return {"step": step, "bad": bad, "seconds": _since(started)}


def _since(started: float) -> float:
    return time.perf_counter() - started


def scenario_restart(args: dict) -> dict:
    """The restarted job (fewer processes): restores the latest step, or the newest one the
    error names; tries the step that was being saved; then saves and restores the next one."""
    mngr, h = manager(args["ckpt"], args["timeout_s"])
    tries = []
    latest = mngr.latest_step()
    first = _restore(mngr, latest) if latest is not None else {"error": "no step", "step": None}
    tries.append(first)
    named = re.search(r"newest restorable step is (\d+)", first.get("error", ""))
    if named:
        tries.append(_restore(mngr, int(named.group(1))))
    restored = next((t["step"] for t in tries if t.get("bad") == []), None)
    tiers = dict(h.last_restore_metrics.get("bytes_by_tier", {})) if restored else {}
    crashed = _restore(mngr, args["crashed_step"])  # never finalized: must not come back
    tries.append(crashed)
    # The job goes on with three processes: the crashed step is saved anew and restored.
    nxt = args["crashed_step"]
    for stale in [s for s in mngr.all_steps() if s >= nxt]:
        mngr.delete(stale)
    mngr.save(nxt, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(nxt, mesh()))))
    mngr.wait_until_finished()
    tries.append(_restore(mngr, nxt))
    mngr.close()
    return {
        "process": jax.process_index(),
        "latest": latest,
        "restored": restored,
        "tiers": tiers,
        "crashed": crashed,
        "tries": tries,
    }


if __name__ == "__main__":
    mp_worker.main(globals())
