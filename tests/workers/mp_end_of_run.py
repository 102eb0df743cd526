"""Multi-process scenarios for plain manager options and the end of a run
(tests/test_end_of_run_multiprocess.py)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import mp_worker
import orbax.checkpoint as ocp

import jaxckpt


def _manager(ckpt: str, **options) -> tuple[ocp.CheckpointManager, jaxckpt.TieredCheckpointHandler]:
    """A manager with plain `ocp.CheckpointManagerOptions` (no jaxckpt policy)."""
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(os.environ["MP_MEMORY_ROOT"], persist_every=5, replicas=1, timeout_s=90)
    )
    opts = ocp.CheckpointManagerOptions(create=True, **options)
    return ocp.CheckpointManager(ckpt, item_handlers={"train": h}, options=opts), h


def _save(mngr: ocp.CheckpointManager, step: int, m, persist: bool = False) -> None:
    state = mp_worker.state(step, m)
    mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state, persist=persist)))


def _slabs() -> list[str]:
    root = Path(os.environ["MP_MEMORY_ROOT"])
    return [str(p) for p in root.rglob("*") if p.is_file() and "slab" in p.name]


def scenario_plain_save(args: dict) -> dict:
    """Steps 0..12 under plain max_to_keep=1, then a clean close (which must not raise)."""
    mngr, _ = _manager(args["ckpt"], max_to_keep=1)
    m = mp_worker.mesh()
    for step in range(13):
        _save(mngr, step, m)
    mngr.wait_until_finished()
    mngr.close()
    return {"closed": True}


def scenario_plain_resume(args: dict) -> dict:
    """After every memory tier is lost: the newest restorable step, restored."""
    mngr, h = _manager(args["ckpt"], max_to_keep=1)
    step = jaxckpt.latest_restorable_step(mngr)
    out: dict = {"step": step}
    if step is not None:
        restored = mngr.restore(
            step,
            args=ocp.args.Composite(
                train=jaxckpt.TieredRestore(mp_worker.target(mp_worker.mesh()))
            ),
        ).train
        out.update(bad=mp_worker.check(restored, step), tier=h.last_restore_metrics["tier"])
    mngr.close()
    return out


def _restore(mngr, h, step: int) -> dict:
    target = mp_worker.target(mp_worker.mesh())
    restored = mngr.restore(
        step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))
    ).train
    return {"bad": mp_worker.check(restored, step), "tier": h.last_restore_metrics["tier"]}


def scenario_end_of_run(args: dict) -> dict:
    """README's end-of-run sequence, `trials` times (each in its own directory), then a
    run that ends on a step that was not due and is not asked to persist (the upstream
    gemma set-up: LatestN(1), commit-file finalization), and its restart with nothing
    left to train."""
    mp_worker.slow_persists_on_the_last_process(args["slow_s"])
    m = mp_worker.mesh()
    trials = []
    for trial in range(args["trials"]):
        ckpt = f"{args['ckpt']}/readme{trial}"
        mngr, h = _manager(ckpt, max_to_keep=2)
        last = 7
        for step in range(1, last + 1):
            _save(mngr, step, m, persist=step == last)
        mngr.wait_until_finished()
        released = h.release_memory()
        slabs = _slabs()
        restored = _restore(mngr, h, last)  # the tier is empty: from persistent storage
        mngr.close()
        trials.append({"released": released, "slabs": slabs, **restored})

    gemma = {
        "preservation_policy": ocp.checkpoint_managers.LatestN(n=1),
        "temporary_path_class": ocp.path.atomicity.CommitFileTemporaryPath,
    }
    ckpt = f"{args['ckpt']}/gemma"
    mngr, h = _manager(ckpt, **gemma)
    for step in range(11, 14):
        _save(mngr, step, m)  # 13 is not due, and nothing asks for it
    mngr.wait_until_finished()
    released = h.release_memory()
    ended = {"released": released, "slabs": _slabs()}
    mngr.close()
    # The restart finds step 13 and has nothing left to train: it restores and ends.
    mngr, h = _manager(ckpt, **gemma)
    step = jaxckpt.latest_restorable_step(mngr)
    restarted = {"step": step, **_restore(mngr, h, step)}
    restarted["released"] = h.release_memory()
    mngr.close()
    return {"trials": trials, "gemma": ended, "restarted": restarted, "pi": jax.process_index()}


if __name__ == "__main__":
    mp_worker.main(globals())
