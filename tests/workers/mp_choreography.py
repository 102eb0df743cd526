"""Scenario for tests/test_choreography_multiprocess.py: one process fails just before each
exchange of a save, a restore and a listing; every process must raise its error at once.

Run by tests/support/multiproc.py, one JAX process per "host" (see mp_worker.py).
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process, jax.distributed on loopback

# isort: split

import os
from pathlib import Path

import faults
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from mp_worker import attempt, check, manager, mesh, state, target

import jaxckpt


def scenario_choreography(args: dict) -> dict:
    """Each case of args["cases"] ([fault point, failing process]) runs with a new handler
    (so that its peers are met again: the meeting is an exchange once per run) and
    `JAXCKPT_FAULT=fail:<point>@*@<process>`."""
    ckpt, timeout_s = Path(args["ckpt"]), args["timeout_s"]
    m = mesh()
    out: dict = {}

    def save(mngr: ocp.CheckpointManager, step: int) -> None:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m))))
        mngr.wait_until_finished()  # an asynchronous manager raises a failed commit here

    def restore(mngr: ocp.CheckpointManager, step: int) -> list[str]:
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(m)))
        )
        return check(restored.train, step)

    # The step the restores and listings read, saved without a fault.
    mngr, h = manager(str(ckpt / "shared"), timeout_s=timeout_s, replicas=1, persist_every=1000)
    out["save_ok"] = attempt(lambda: save(mngr, 1))
    mngr.close()

    for point, failing in args["cases"]:
        operation = point.split(".")[0]
        key = f"{point}@{failing}"
        directory = ckpt / point if operation == "save" else ckpt / "shared"
        mngr, h = manager(str(directory), timeout_s=timeout_s, replicas=1, persist_every=1000)
        multihost_utils.sync_global_devices(f"before-{point}")
        os.environ[faults.ENV] = f"{faults.FAIL}{point}@*@{failing}"
        try:
            if operation == "save":
                out[key] = attempt(lambda mngr=mngr: save(mngr, 1))
            elif operation == "restore":
                out[key] = attempt(lambda mngr=mngr: restore(mngr, 1))
            elif operation == "release":
                out[key] = attempt(lambda h=h: h.release_memory())
            else:
                out[key] = attempt(lambda h=h: h.restorable_steps(ckpt / "shared" / "0" / "train"))
        finally:
            del os.environ[faults.ENV]
        out[key]["failing"] = failing
        mngr.close()

    # The job goes on: every process's exchanges are still in step.
    mngr, h = manager(str(ckpt / "shared"), timeout_s=timeout_s, replicas=1, persist_every=1000)
    out["after_save"] = attempt(lambda: save(mngr, 2))
    out["after_restore"] = attempt(lambda: restore(mngr, 2))
    out["after_list"] = attempt(lambda: h.restorable_steps(ckpt / "shared" / "0" / "train"))
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
