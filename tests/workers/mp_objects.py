"""Scenarios for tests/test_index_objects.py: memory-only saves into an object store.

Run by tests/support/multiproc.py, one JAX process per "host" (see mp_worker.py); the
emulator's environment comes from the test.
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process, jax.distributed on loopback

# isort: split

import os

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from mp_worker import check, mesh, state, target

import jaxckpt


def scenario_memory_only_saves(args: dict) -> dict:
    """Saves args["steps"] into args["url"], none of them due for persistence, marking in
    the store's log where each step's save starts and ends; then restores the last one."""
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(
            os.environ["MP_MEMORY_ROOT"],
            replicas=args["replicas"],
            persist_every=1000,
            timeout_s=60,
        )
    )
    url = args["url"]
    mngr = ocp.CheckpointManager(
        url,
        item_handlers={"train": handler},
        options=jaxckpt.manager_options(url, handler=handler, enable_async_checkpointing=False),
    )
    m = mesh()
    for step in args["steps"]:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m))))
        multihost_utils.sync_global_devices(f"saved-{step}")
    last = args["steps"][-1]
    restored = mngr.restore(
        last, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(m)))
    ).train
    out = {"bad": check(restored, last), "tier": handler.last_restore_metrics["tier"]}
    mngr.close()
    return {**out, "processes": jax.process_count()}


if __name__ == "__main__":
    mp_worker.main(globals())
