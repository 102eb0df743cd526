"""Multi-process scenarios for garbage collection and durability (tests/test_durability_multiprocess.py)."""

from __future__ import annotations

import os

import mp_worker
import orbax.checkpoint as ocp

import jaxckpt


def manager(args: dict) -> tuple[ocp.CheckpointManager, jaxckpt.TieredCheckpointHandler]:
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(os.environ["MP_MEMORY_ROOT"], persist_every=2, replicas=1, timeout_s=60)
    )
    mngr = ocp.CheckpointManager(
        args["ckpt"],
        item_handlers={"train": h},
        options=jaxckpt.manager_options(args["ckpt"], handler=h, create=True, max_to_keep=1),
    )
    return mngr, h


def scenario_save_with_max_to_keep_1(args: dict) -> dict:
    """Saves 1..5 with max_to_keep=1; the last process persists slowly."""
    mp_worker.slow_persists_on_the_last_process(args["slow_s"])
    mngr, h = manager(args)
    m = mp_worker.mesh()
    seen = []
    for step in range(1, 6):
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(mp_worker.state(step, m))))
        mngr.wait_until_finished()
        seen.append(list(mngr.all_steps()))
    h.wait_for_persistence()
    mngr.close()
    return {"seen": seen}


def scenario_restore(args: dict) -> dict:
    mngr, h = manager(args)
    m = mp_worker.mesh()
    restored = mngr.restore(
        args["step"], args=ocp.args.Composite(train=jaxckpt.TieredRestore(mp_worker.target(m)))
    ).train
    out = {"bad": mp_worker.check(restored, args["step"]), "tier": h.last_restore_metrics["tier"]}
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
