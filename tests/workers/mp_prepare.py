"""Scenarios of a restore prepared ahead (tests/test_prepare_restore.py): a restore onto a
target replicated across processes compiles its reshard, unless
`TieredCheckpointHandler.prepare_restore` compiled it before. Each process counts the
backend compilations during each call, and checks the values it restored.
"""

from __future__ import annotations

import collections

import jax
import mp_worker
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

SHAPES = {"w": (64, 48), "b": (48,)}
# The event JAX records for each backend compilation (jax._src.dispatch names it; the
# cache's hits record none).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILES: collections.Counter[str] = collections.Counter()
PHASE = ["none"]


def _count(event: str, duration: float, **_: object) -> None:
    if event == BACKEND_COMPILE:
        COMPILES[PHASE[0]] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def value(name: str) -> np.ndarray:
    return np.arange(np.prod(SHAPES[name]), dtype=np.float32).reshape(SHAPES[name]) + len(name)


def scenario_save(args: dict) -> dict:
    """Saves step 1: every leaf sharded over every device of the job."""
    mngr, _ = mp_worker.manager(args["ckpt"], replicas=1, persist_every=1000)
    m = Mesh(np.array(jax.devices()), ("x",))
    state = {
        n: jax.make_array_from_callback(s, NamedSharding(m, P("x")), lambda i, n=n: value(n)[i])
        for n, s in SHAPES.items()
    }
    mngr.save(1, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
    mngr.wait_until_finished()
    mngr.close()
    return {}


def _target(spec: P) -> dict:
    """Every leaf on a (processes, 2) mesh; the "x" axis (processes) unused by `spec`: the
    leaves are replicated across processes, as on a job resized to fewer processes."""
    m = Mesh(np.array(jax.devices()).reshape(-1, 2), ("x", "y"))
    return {
        n: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(m, spec))
        for n, s in SHAPES.items()
    }


def _restore(args: dict, target: dict) -> bool:
    PHASE[0] = "restore"
    mngr, _ = mp_worker.manager(args["ckpt"], replicas=1, persist_every=1000)
    restored = mngr.restore(1, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))).train
    mngr.close()
    PHASE[0] = "none"
    return all(
        np.array_equal(np.asarray(s.data), value(n)[s.index])
        for n, a in restored.items()
        for s in a.addressable_shards
    )


def scenario_restore(args: dict) -> dict:
    """A restore onto one target, unprepared; then prepare_restore and the restore onto
    another target (another program)."""
    plain = _restore(args, _target(P()))
    plain_compiles = COMPILES.pop("restore", 0)
    target = _target(P("y"))
    PHASE[0] = "prepare"
    leaves = jaxckpt.TieredCheckpointHandler.prepare_restore(
        f"{args['ckpt']}/1/train", jaxckpt.TieredRestore(target)
    )
    PHASE[0] = "none"
    prepared = _restore(args, target)
    return {
        "equal": plain and prepared,
        "plain_compiles": plain_compiles,
        "prepare_compiles": COMPILES["prepare"],
        "prepared_compiles": COMPILES["restore"],
        "leaves": leaves,
    }


if __name__ == "__main__":
    mp_worker.main(globals())
