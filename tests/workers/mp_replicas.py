"""Scenarios of data-parallel layouts (tests/test_replicas_multiprocess.py): dp x fsdp meshes
whose dp axis spans processes, so every shard is held by R processes.

The saved state is a pure function of the step and of nothing else, so any layout
can check what it restored. Each scenario prints one `RESULT <json>` line.
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
from jaxckpt.format import _format
from jaxckpt.persistent import _paths

# name -> (shape, dtype, spec over ('dp', 'fsdp')): a mixed tree.
LEAVES = {
    "w": ((64, 4096), np.float32, P("fsdp")),  # 1 MiB, sharded over fsdp, replicated over dp
    "odd": ((12, 24003), np.float32, P("fsdp")),  # shards of 3 rows: cut in 3 over R = 2
    "full": ((256, 1024), np.float32, P()),  # fully replicated: cut over every process
    "bias": ((16,), np.float32, P("fsdp")),  # small shards: saved whole by both replicas
    "ln": ((512,), np.float32, P()),  # small, fully replicated: saved whole by every process
    "scale": ((), np.float32, P()),  # a fully replicated scalar array: likewise
    "empty": ((0, 8), np.float32, P(None, "fsdp")),  # zero-size
    "cols": ((24, 8192), np.float32, P(None, "fsdp")),  # sharded along the second dim
}


def dp_mesh(dp: int) -> Mesh:
    """('dp', 'fsdp') over every device, dp across processes (HSDP): the devices in process
    order, so each dp row is a run of processes."""
    devices = np.array(jax.devices())
    return Mesh(devices.reshape(dp, devices.size // dp), ("dp", "fsdp"))


def value(name: str, step: int) -> np.ndarray:
    shape, dtype, _ = LEAVES[name]
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64) % 9973 + step * 7).astype(dtype).reshape(shape)


def state(step: int, m: Mesh) -> dict:
    out: dict = {}
    for name, (shape, _, spec) in LEAVES.items():
        v = value(name, step)
        out[name] = jax.make_array_from_callback(
            shape, NamedSharding(m, spec), lambda idx, v=v: v[idx]
        )
    key_data = np.stack([np.arange(16, dtype=np.uint32) + step, np.arange(16, dtype=np.uint32)], 1)
    kd = jax.make_array_from_callback(
        key_data.shape, NamedSharding(m, P("fsdp", None)), lambda idx: key_data[idx]
    )
    out["keys"] = jax.random.wrap_key_data(kd, impl="threefry2x32")
    out["step"] = step
    out["data"] = mp_worker.Position(step * 10)
    return out


def target(m: Mesh) -> dict:
    out: dict = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m, spec))
        for name, (shape, dtype, spec) in LEAVES.items()
    }
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    out["keys"] = jax.ShapeDtypeStruct((16,), key_dtype, sharding=NamedSharding(m, P("fsdp")))
    out["step"] = 0
    out["data"] = mp_worker.Position()
    return out


def check(restored: dict, step: int) -> list[str]:
    bad = []
    for name in LEAVES:
        v = value(name, step)
        for shard in restored[name].addressable_shards:
            if not np.array_equal(np.asarray(shard.data), v[shard.index]):
                bad.append(f"{name}{shard.index}")
    keys = np.asarray(
        jax.experimental.multihost_utils.process_allgather(
            jax.random.key_data(restored["keys"]), tiled=True
        )
    )
    if keys[:, 0].tolist() != [i + step for i in range(16)]:
        bad.append("keys")
    if restored["step"] != step or restored["data"].pos != step * 10:
        bad.append("step/data")
    return bad


def scenario_save(args: dict) -> dict:
    """Saves each of args["saves"] ({step, dp}); reports each save's metrics."""
    mngr, h = mp_worker.manager(
        args["ckpt"], replicas=1, persist_every=args["persist_every"], memory_keep=3
    )
    out = []
    for save in args["saves"]:
        m = dp_mesh(save["dp"])
        mngr.save(
            save["step"],
            args=ocp.args.Composite(train=jaxckpt.TieredSave(state(save["step"], m))),
        )
        mngr.wait_until_finished()
        out.append(dict(h.last_save_metrics))
    h.wait_for_persistence()
    mngr.close()
    return {"saves": out}


def _corrupt(owner: int, step: int, ckpt: str) -> None:
    """Flips a byte in the middle of the first chunk of "w" in this process's memory copy
    of `owner`'s part of `step`."""
    run_id = _paths.default_run_id(Path(ckpt) / str(step) / "train")
    part = (
        Path(os.environ["MP_MEMORY_ROOT"])
        / run_id
        / f"step_{step:012d}"
        / _format.part_dir_name(owner)
    )
    manifest = _format.PartManifest.from_json((part / _format.MANIFEST_FILE).read_bytes())
    w = next(i for i, r in enumerate(manifest.leaves) if r.path == "['w']")
    chunk = manifest.chunks[w][0]
    assert chunk.offset is not None
    with open(part / "slab", "r+b") as f:
        f.seek(chunk.offset + chunk.nbytes // 2)
        byte = f.read(1)
        f.seek(chunk.offset + chunk.nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def scenario_restore(args: dict) -> dict:
    """Restores each of args["restores"] ({step, dp, corrupt?: [[process, owner], ...],
    forget?: true}) in turn. `corrupt`: each such process first damages its copy of that
    owner's part; `forget`: every process first deletes its memory of the run."""
    pi = jax.process_index()
    results = []
    for k, req in enumerate(args["restores"]):
        multihost_utils.sync_global_devices(f"restore-{k}")
        for process, owner in req.get("corrupt", ()):
            if process == pi:
                _corrupt(owner, req["step"], args["ckpt"])
        if req.get("forget"):
            run_id = _paths.default_run_id(Path(args["ckpt"]) / "0" / "train")
            shutil.rmtree(Path(os.environ["MP_MEMORY_ROOT"]) / run_id, ignore_errors=True)
        multihost_utils.sync_global_devices(f"restore-{k}-ready")
        mngr, h = mp_worker.manager(args["ckpt"], replicas=1, persist_every=1000)
        try:
            restored = mngr.restore(
                req["step"],
                args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(dp_mesh(req["dp"])))),
            ).train
            results.append({"bad": check(restored, req["step"]), **h.last_restore_metrics})
        except Exception as e:  # reported to the test
            results.append({"error": f"{type(e).__name__}: {e}"})
        mngr.close()
    return {"restores": results}


if __name__ == "__main__":
    mp_worker.main(globals())
