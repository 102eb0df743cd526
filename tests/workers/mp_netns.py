"""Scenarios for tests/test_netns_multiprocess.py: each process on its own test host.

Every process runs in its own network namespace (tests/support/netns.py) with its own
address: the jax.distributed coordinator binds to host 0's, each peer service
to its host's. The test process cuts and heals links between the phases: a
phase starts when every process has written `<sync>/<phase>.<p>` and the test
has answered with `<sync>/<phase>.go`.
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process, jax.distributed on MP_COORDINATOR

# isort: split

import os
import shutil
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from mp_worker import attempt, check, manager, mesh, state, target

import jaxckpt


def phase(sync: str, name: str, timeout_s: float = 60) -> None:
    """Waits until the test lets phase `name` start (after every process reached it)."""
    print(f"[netns] reached {name}", flush=True)
    Path(sync, f"{name}.{jax.process_index()}").touch()
    go = Path(sync, f"{name}.go")
    deadline = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never started phase {name}")
        time.sleep(0.02)


def drop_own_part(step: int) -> int:
    """Deletes this process's own part of `step` from its memory tier (as after a node
    loss), so that it must read it from a peer or persistent storage."""
    root = Path(os.environ["MP_MEMORY_ROOT"])
    gone = 0
    for part in root.glob(f"run-*/step_{step:012d}/part_{jax.process_index():05d}"):
        shutil.rmtree(part)
        gone += 1
    return gone


def scenario_network(args: dict) -> dict:
    """Saves and restores between hosts while the test shapes or cuts the network."""
    mngr, h = manager(
        args["ckpt"],
        replicas=1,
        persist_every=args["persist_every"],
        timeout_s=args["timeout_s"],
        memory_keep=4,
        peer_host=os.environ["MP_PEER_HOST"],
    )
    m = mesh()
    out: dict = {"peer_host": os.environ["MP_PEER_HOST"]}

    def save(step: int) -> None:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m))))
        mngr.wait_until_finished()
        h.wait_for_persistence()  # a restore below may fall back to it

    def restore(step: int) -> dict:
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(m)))
        )
        return {"bad": check(restored.train, step), "tier": h.last_restore_metrics.get("tier")}

    for name, step in args["phases"]:
        phase(args["sync"], name)
        if name.startswith("save"):
            out[name] = attempt(lambda step=step: save(step))
            out[name]["skipped"] = sorted(
                {holder for s, holder in h.inspect().peers.skipped if s == step}
            )
        else:
            dropped = drop_own_part(step)
            out[name] = attempt(lambda step=step: restore(step))
            out[name]["dropped"] = dropped
    # Its holders' addresses it was told; the others' it looks up.
    out["addresses"] = [h.inspect().peers.addresses[p].host for p in range(jax.process_count())]
    out["holders"] = list(h.inspect().peers.holders)
    phase(args["sync"], "end")
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
