"""Scenarios of restores onto other meshes and process counts (tests/test_reshard_multiprocess.py):
each process reports, per restore, the bytes it read from each tier and the bytes its
target shards needed (the restore's metrics), and whether it got the saved values.

Every saved leaf is a pure function of its name, so any layout can check what it
restored. Each scenario prints one `RESULT <json>` line.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import mp_worker
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.persistent import _paths

SHAPE = (256, 256)  # float32, 256 KiB


def value(step: int) -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000 * step


def mesh(layout: str) -> Mesh:
    """Meshes over this job's devices (process p holds devices 2p and 2p + 1):
    `all`: every device in order; `one-each`: each process's first device;
    `interleaved`: every device, the processes taking turns; `grid`: (processes, 2)."""
    devices = np.array(jax.devices())
    if layout == "all":
        return Mesh(devices, ("x",))
    if layout == "one-each":
        return Mesh(devices[::2], ("x",))
    if layout == "interleaved":
        return Mesh(np.concatenate([devices[0::2], devices[1::2]]), ("x",))
    if layout == "grid":
        return Mesh(devices.reshape(-1, 2), ("x", "y"))
    raise ValueError(layout)


def sharding(spec: dict) -> NamedSharding:
    return NamedSharding(mesh(spec["mesh"]), P(*spec["spec"]))


def scenario_save(args: dict) -> dict:
    """Saves step k with "w" laid out as args["saves"][k] ({mesh, spec}), persisted."""
    mngr, h = mp_worker.manager(
        args["ckpt"],
        replicas=1,
        persist_every=1,
        memory_keep=len(args["saves"]),
        tile_bytes=args["tile_bytes"],
    )
    for step, spec in enumerate(args["saves"]):
        v = value(step)
        w = jax.make_array_from_callback(SHAPE, sharding(spec), lambda idx, v=v: v[idx])
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave({"w": w})))
        mngr.wait_until_finished()
    h.wait_for_persistence()
    mngr.close()
    return {}


def _forget(ckpt: str) -> None:
    """Deletes this process's memory of the run (a lost node, or a new one)."""
    run_id = _paths.default_run_id(Path(ckpt) / "0" / "train")
    shutil.rmtree(Path(os.environ["MP_MEMORY_ROOT"]) / run_id, ignore_errors=True)


def scenario_restore(args: dict) -> dict:
    """Restores each of args["restores"] ({step, mesh, spec, forget?: [processes]}) in
    turn: each process in `forget` first deletes its memory of the run."""
    pi = jax.process_index()
    out = []
    for k, req in enumerate(args["restores"]):
        multihost_utils.sync_global_devices(f"restore-{k}")
        if pi in req.get("forget", ()):
            _forget(args["ckpt"])
        multihost_utils.sync_global_devices(f"restore-{k}-ready")
        mngr, h = mp_worker.manager(args["ckpt"], replicas=1, persist_every=1000)
        target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding(req))}
        restored = mngr.restore(
            req["step"], args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))
        ).train
        w = restored["w"]
        expected = value(req["step"])
        equal = all(
            np.array_equal(np.asarray(s.data), expected[s.index]) for s in w.addressable_shards
        )
        metrics = h.last_restore_metrics
        out.append(
            {
                "equal": equal and w.sharding.is_equivalent_to(target["w"].sharding, 2),
                "bytes_by_tier": metrics["bytes_by_tier"],
                "bytes_needed": metrics["bytes_needed"],
            }
        )
        mngr.close()
    return {"restores": out}


if __name__ == "__main__":
    mp_worker.main(globals())
