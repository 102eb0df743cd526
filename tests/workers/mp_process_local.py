"""Scenarios for tests/test_process_local.py: leaves whose value differs per process.

A process-local jax.Array, a numpy array and a Python scalar are saved by every
process with its own value; global arrays next to them keep one value.
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process

# isort: split

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.persistent import _paths

PER_PROCESS = ("loc", "pinned", "key", "np", "s")  # the saving process's index as value
EQUAL = 7  # step 2: every per-process leaf holds this on every process


def value_of(step: int, process: int) -> int:
    return process if step == 1 else EQUAL


def state(step: int) -> dict:
    v = value_of(step, jax.process_index())
    m = mp_worker.mesh()
    w = np.arange(mp_worker.ROWS * 2, dtype=np.float32).reshape(mp_worker.ROWS, 2)
    return {
        "loc": jnp.full((4,), float(v)),  # uncommitted, on this process's default device
        "pinned": jax.device_put(jnp.full((2,), float(v)), jax.local_devices()[1]),
        "key": jax.random.wrap_key_data(jnp.full((2,), v, jnp.uint32)),  # a typed key, local
        "np": np.full(3, v),
        "s": v,
        "same": jax.device_put(jnp.arange(4.0), jax.local_devices()[0]),  # local, equal everywhere
        "g": jax.device_put(np.arange(6.0, dtype=np.float32), NamedSharding(m, P())),  # global
        "w": jax.make_array_from_callback(w.shape, NamedSharding(m, P("a")), lambda i: w[i]),
    }


def target() -> dict:
    m = mp_worker.mesh()
    local = jax.local_devices()
    return {
        "loc": jnp.zeros((4,)),
        "pinned": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=SingleDeviceSharding(local[1])),
        "key": jax.random.key(0),  # fresh: uncommitted
        "np": np.zeros(3, dtype=np.int64),
        "s": 0,
        "same": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=SingleDeviceSharding(local[0])),
        "g": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(m, P())),
        "w": jax.ShapeDtypeStruct(
            (mp_worker.ROWS, 2), jnp.float32, sharding=NamedSharding(m, P("a"))
        ),
    }


def summary(restored: dict) -> dict:
    """Each leaf as this process sees it (the addressable data of jax.Arrays)."""
    out = {}
    rows = np.arange(mp_worker.ROWS * 2, dtype=np.float32).reshape(mp_worker.ROWS, 2)
    for name, x in restored.items():
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if name == "w":
            out["w_ok"] = (
                np.array_equal(x, rows)
                if isinstance(x, np.ndarray)
                else all(np.array_equal(s.data, rows[s.index]) for s in x.addressable_shards)
            )
        if isinstance(x, jax.Array):
            out[name] = {
                "values": sorted(
                    {float(v) for s in x.addressable_shards for v in np.ravel(s.data)}
                ),
                "committed": x.committed,
                "fully_addressable": x.is_fully_addressable,
            }
        elif isinstance(x, np.ndarray):
            out[name] = {"values": sorted({float(v) for v in np.ravel(x)}), "numpy": True}
        else:
            out[name] = {"values": [float(x)], "type": type(x).__name__}
    return out


def manager(ckpt: str, **options) -> tuple[ocp.CheckpointManager, jaxckpt.TieredCheckpointHandler]:
    return mp_worker.manager(ckpt, replicas=1, persist_every=1, **options)


def attempt(mngr, h, step: int, tgt, **kw) -> dict:
    try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(tgt, **kw))
        ).train
    except Exception as e:  # reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"leaves": summary(restored), "bytes_by_tier": h.last_restore_metrics["bytes_by_tier"]}


def scenario_save(args: dict) -> dict:
    mngr, h = manager(args["ckpt"], memory_keep=2)  # step 1 stays in memory
    for step in (1, 2):
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step))))
    mngr.wait_until_finished()
    h.wait_for_persistence()
    mngr.close()
    return {"steps": mngr.all_steps()}


def _lose_memory(ckpt: str, who: list[int], phase: str) -> None:
    # IMPORTANT: nobody may still read a memory tier that is about to be deleted.
    multihost_utils.sync_global_devices(f"lose-{phase}")
    if jax.process_index() in who:
        run_id = _paths.default_run_id(Path(ckpt) / "1" / "train")
        shutil.rmtree(Path(os.environ["MP_MEMORY_ROOT"]) / run_id, ignore_errors=True)
    multihost_utils.sync_global_devices(f"lost-{phase}")


def scenario_same_count(args: dict) -> dict:
    """Restores step 1 on the saving process count from memory, after process 1 lost its
    memory (its part from a peer), and after every process did (persistent)."""
    out = {}
    for phase, lose in (("memory", []), ("peer", [1]), ("persistent", [0, 1, 2, 3])):
        _lose_memory(args["ckpt"], lose, phase)
        mngr, h = manager(args["ckpt"])
        out[phase] = attempt(mngr, h, 1, target())
        out[phase + "_none"] = attempt(mngr, h, 1, None)
        mngr.close()
    # Differing values cannot make one global array: refused by name before any read.
    mngr, h = manager(args["ckpt"])
    spread = NamedSharding(mp_worker.mesh(), P())
    tgt = {**target(), "loc": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=spread)}
    out["global_target"] = attempt(mngr, h, 1, tgt)
    mngr.close()
    return out


def scenario_other_count(args: dict) -> dict:
    """Restores on another process count: differing values refused, mapped, equal ones kept."""
    mngr, h = manager(args["ckpt"])
    calls: list[str] = []

    def pick(path, values, process, count):
        calls.append(path)
        return values[2 * process + 1]  # a value no default could produce on this process

    out = {
        "refused": attempt(mngr, h, 1, target()),
        "refused_none": attempt(mngr, h, 1, None),
        "mapped": attempt(mngr, h, 1, target(), per_process_fn=pick),
        "mapped_none": attempt(mngr, h, 1, None, per_process_fn=pick),
        "equal": attempt(mngr, h, 2, target()),
        "equal_none": attempt(mngr, h, 2, None),
    }
    out["calls"] = sorted(calls)
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
