"""Multi-process scenarios for `jaxckpt.latest_restorable_step` (run by tests/test_resume_multiprocess.py)."""

from __future__ import annotations

import mp_worker
import orbax.checkpoint as ocp

import jaxckpt


def scenario_resume(args: dict) -> dict:
    """Finds the newest restorable step, restores it, then saves the next steps again."""
    mngr, _ = mp_worker.manager(
        args["ckpt"], replicas=args["replicas"], persist_every=args["persist_every"]
    )
    m = mp_worker.mesh()
    latest = mngr.latest_step()
    step = jaxckpt.latest_restorable_step(mngr)
    after_delete = mngr.all_steps()
    restored = mngr.restore(
        step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(mp_worker.target(m)))
    ).train
    bad = mp_worker.check(restored, step)
    for again in args["then_save"]:
        mngr.save(
            again, args=ocp.args.Composite(train=jaxckpt.TieredSave(mp_worker.state(again, m)))
        )
    mngr.wait_until_finished()
    saved = mngr.all_steps()
    mngr.close()
    return {
        "latest": latest,
        "step": step,
        "after_delete": after_delete,
        "bad": bad,
        "saved": saved,
    }


def scenario_resume_damaged(args: dict) -> dict:
    """The newest step's only copy of a part is damaged: its restore fails on every
    process, and the next latest_restorable_step returns the older step everywhere."""
    mngr, _ = mp_worker.manager(
        args["ckpt"], replicas=args["replicas"], persist_every=args["persist_every"]
    )
    m = mp_worker.mesh()
    first = jaxckpt.latest_restorable_step(mngr, delete_newer=False)
    failed = None
    try:
        mngr.restore(
            first, args=ocp.args.Composite(train=jaxckpt.TieredRestore(mp_worker.target(m)))
        )
    except Exception as e:  # every process raises, agreed
        failed = f"{type(e).__name__}: {e}"
    step = jaxckpt.latest_restorable_step(mngr)
    restored = mngr.restore(
        step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(mp_worker.target(m)))
    ).train
    out = {
        "first": first,
        "failed": failed,
        "step": step,
        "after_delete": mngr.all_steps(),
        "bad": mp_worker.check(restored, step),
    }
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
