"""Scenarios run by tests/support/multiproc.py: one JAX process per "host" on loopback.

Each scenario prints one `RESULT <json>` line. The saved state is a pure
function of the step, so any process count can check what it restored.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=os.environ["MP_COORDINATOR"],
    coordinator_bind_address=os.environ["MP_COORDINATOR"],
    num_processes=int(os.environ["MP_NUM_PROCESSES"]),
    process_id=int(os.environ["MP_PROCESS_ID"]),
    heartbeat_timeout_seconds=5,
    initialization_timeout=60,
)

import faults  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt import _faults, _internals  # noqa: E402

faults.install_from_env()  # JAXCKPT_FAULT: a test crashes or fails this process at a point

ROWS = 48  # divisible by 8, 6 and 4 devices


class Position:
    """An iterator whose state is a global position (the same on every process)."""

    def __init__(self, pos: int = 0, local: bool = False):
        self.pos, self.local = pos, local

    def get_state(self):
        return {"pos": self.pos, **({"process": jax.process_index()} if self.local else {})}

    def set_state(self, state):
        self.pos = state["pos"]
        self.state = state


def expected(step: int) -> dict[str, np.ndarray]:
    return {
        "w": (np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8) + 1000 * step),
        "b": np.full((ROWS,), step, dtype=jax.numpy.bfloat16),
        "keys": np.stack(
            [np.arange(ROWS, dtype=np.uint32) + step, np.arange(ROWS, dtype=np.uint32)], axis=1
        ),
    }


def mesh(shape: tuple[int, ...] | None = None) -> Mesh:
    devices = np.array(jax.devices())
    shape = shape or (devices.size,)
    return Mesh(devices.reshape(shape), ("a", "b")[: len(shape)])


def shardings(m: Mesh, transposed: bool = False) -> dict[str, NamedSharding]:
    axes = m.axis_names
    return {
        "w": NamedSharding(m, P(None, axes[-1]) if transposed else P(axes)),
        "b": NamedSharding(m, P()),
        "keys": NamedSharding(m, P(axes[0])),
    }


def state(step: int, m: Mesh, local_iterator: bool = False) -> dict:
    exp, sh = expected(step), shardings(m)

    def make(name):
        return jax.make_array_from_callback(exp[name].shape, sh[name], lambda idx: exp[name][idx])

    keys_sharding = NamedSharding(m, P(m.axis_names[0], None))
    key_data = jax.make_array_from_callback(
        exp["keys"].shape, keys_sharding, lambda idx: exp["keys"][idx]
    )
    return {
        "w": make("w"),
        "b": make("b"),
        "keys": jax.random.wrap_key_data(key_data, impl="threefry2x32"),
        "data": Position(step * 10, local_iterator),
        "step": step,
    }


def target(m: Mesh, transposed: bool = False) -> dict:
    sh = shardings(m, transposed)
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    return {
        "w": jax.ShapeDtypeStruct((ROWS, 8), np.float32, sharding=sh["w"]),
        "b": jax.ShapeDtypeStruct((ROWS,), jax.numpy.bfloat16, sharding=sh["b"]),
        "keys": jax.ShapeDtypeStruct((ROWS,), key_dtype, sharding=sh["keys"]),
        "data": Position(),
        "step": 0,
    }


def check(restored: dict, step: int) -> list[str]:
    """Problems with `restored` (empty: every addressable shard holds the saved values)."""
    exp, bad = expected(step), []
    for name in ("w", "b", "keys"):
        arr = restored[name]
        if name == "keys":
            arr = jax.random.key_data(arr)
        for shard in arr.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), exp[name][shard.index]):
                bad.append(f"{name}{shard.index}")
    if restored["step"] != step or restored["data"].pos != step * 10:
        bad.append(f"step/data: {restored['step']} {restored['data'].pos}")
    return bad


def manager(
    ckpt_dir: str, timeout_s: float = 60, **options
) -> tuple[ocp.CheckpointManager, jaxckpt.TieredCheckpointHandler]:
    if "MP_RELAY_GROUP" in os.environ:  # exchanges through relay groups of this many
        options.setdefault("relay_group", int(os.environ["MP_RELAY_GROUP"]))
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(os.environ["MP_MEMORY_ROOT"], timeout_s=timeout_s, **options)
    )
    mngr = ocp.CheckpointManager(
        ckpt_dir,
        item_handlers={"train": handler},
        options=ocp.CheckpointManagerOptions(create=True),
    )
    return mngr, handler


def scenario_save(args: dict) -> dict:
    """Saves args["steps"]; with args["crash"], exits like a crash (nothing drained)."""
    mngr, h = manager(
        args["ckpt"],
        replicas=args["replicas"],
        persist_every=args["persist_every"],
        memory_keep=args.get("keep", 2),
    )
    m = mesh()
    for step in args["steps"]:
        local = step in args.get("local_iterator_steps", ())
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m, local))))
    mngr.wait_until_finished()
    h.wait_for_persistence()
    out = {
        "steps": mngr.all_steps(),
        "replicate_bytes_per_s": h.last_save_metrics.get("replicate_bytes_per_s"),
    }
    if args.get("crash"):
        # Every process says what it saved before any "crashes": the first os._exit makes the
        # coordinator abort the others (tests/support/multiproc.py accepts that after a RESULT line).
        print("RESULT " + json.dumps(out), flush=True)
        _internals.distributed_client().wait_at_barrier("mp_worker_crash", 120_000)
        os._exit(0)
    mngr.close()
    return out


def scenario_restore(args: dict) -> dict:
    """Restores each of args["restores"] ({step, mesh?, transposed?, iterator_fn?}) in turn,
    then optionally saves args["then_save"] (re-replication after a recovery)."""
    mngr, h = manager(
        args["ckpt"],
        replicas=args["replicas"],
        persist_every=args.get("persist_every", 1000),
        timeout_s=args.get("timeout_s", 60),
    )
    if jax.process_index() in args.get("absent", ()):
        time.sleep(args["absent_s"])  # alive, but never takes part in the restore
        return {"absent": True}
    results, last = [], None
    for req in args["restores"]:
        m = mesh(tuple(req["mesh"]) if req.get("mesh") else None)
        kw = {}
        if req.get("iterator_fn"):
            kw["iterator_state_fn"] = lambda states, p, n: {"pos": min(s["pos"] for s in states)}
        started = time.perf_counter()
        try:
            tgt = target(m, req.get("transposed", False))
            restored = mngr.restore(
                req["step"], args=ocp.args.Composite(train=jaxckpt.TieredRestore(tgt, **kw))
            ).train
        except Exception as e:  # reported to the test
            results.append(
                {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - started}
            )
            continue
        results.append({"bad": check(restored, req["step"]), **h.last_restore_metrics})
        last = (restored, req["step"])
    out: dict = {"restores": results}
    if args.get("then_save") is not None:
        step = args["then_save"]
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, mesh()))))
        mngr.wait_until_finished()
        # The arrays restored last keep their values while the tier saves, retires and
        # reuses slabs: the slabs they were restored on are lent to them, never reused.
        out["bad_after_save"] = check(*last) if last is not None else ["nothing restored"]
    mngr.close()
    return out


def _kill_on_receive(step: int) -> None:
    """Makes this process SIGKILL itself when its peer service receives a replica of `step`,
    after the first bytes of the first file arrived (a holder dying mid-push)."""
    import signal

    from jaxckpt.peer import _push_receiver

    original = _push_receiver.PushReceiver.receive
    marker = f"step_{step:012d}"

    def receive(self, rel, total):
        if marker in rel:

            def die_after_the_first_bytes(name, size, slab, check, chunk):
                self._rfile.read(min(size, 16))
                os.kill(os.getpid(), signal.SIGKILL)

            self.receive_slab = die_after_the_first_bytes
        return original(self, rel, total)

    _push_receiver.PushReceiver.receive = receive


def scenario_save_faulty(args: dict) -> dict:
    """Saves args["steps"] with replicas=1, draining (finalized and persisted) after each step
    in args["drain_after"]; meant to be killed: by JAXCKPT_FAULT, or by MP_KILL_ON_RECEIVE=<step>
    while this process's peer service receives a replica of that step."""
    if os.environ.get("MP_KILL_ON_RECEIVE"):
        _kill_on_receive(int(os.environ["MP_KILL_ON_RECEIVE"]))
    mngr, h = manager(args["ckpt"], replicas=1, persist_every=args["persist_every"])
    m = mesh()
    for step in args["steps"]:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state(step, m))))
        if step in args.get("drain_after", ()):
            mngr.wait_until_finished()
            h.wait_for_persistence()
    mngr.wait_until_finished()
    h.wait_for_persistence()
    mngr.close()
    return {"steps": mngr.all_steps(), "no_fault": True}


def _restore_step(mngr, h, step: int, follow: bool) -> dict:
    """Restores `step`; if it is not restorable and `follow`, the newest step the error names."""
    import re

    started = time.perf_counter()
    try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target(mesh())))
        ).train
    except FileNotFoundError as e:
        named = re.search(r"newest restorable step is (\d+)", str(e))
        if follow and named:
            return _restore_step(mngr, h, int(named.group(1)), follow=False)
        return {"step": step, "error": f"FileNotFoundError: {e}"}
    except Exception as e:  # reported to the test
        return {"step": step, "error": f"{type(e).__name__}: {e}"}
    return {
        **h.last_restore_metrics,
        "step": step,
        "bad": check(restored, step),
        "seconds": time.perf_counter() - started,
    }


def scenario_recover(args: dict) -> dict:
    """A restarted job: for each tier in args["tiers"] and each run in args["runs"]
    ({ckpt, lose}), restores the latest step (or the newest restorable one the error names)
    and step args["previous"]. Before the "peer" tier, process `lose` loses its memory of the
    run; before "persistent", every process does. Reports the peer tokens and bound hosts."""
    import logging
    import shutil
    from pathlib import Path

    from absl import logging as absl_logging
    from jax.experimental import multihost_utils

    from jaxckpt.tiers import _paths

    absl_logging.set_verbosity(absl_logging.INFO)  # the token must not show up even here
    logging.getLogger("jaxckpt").setLevel(logging.DEBUG)
    pi = jax.process_index()
    recovered, tokens, hosts = [], [], set()
    for tier in args["tiers"]:
        for r, run in enumerate(args["runs"]):
            # IMPORTANT: nobody may still read a memory tier that is about to be deleted.
            multihost_utils.sync_global_devices(f"recover-{tier}-{r}")
            if tier == "persistent" or (tier == "peer" and pi == run["lose"]):
                run_id = _paths.default_run_id(Path(run["ckpt"]) / "0" / "train")
                shutil.rmtree(Path(os.environ["MP_MEMORY_ROOT"]) / run_id, ignore_errors=True)
            multihost_utils.sync_global_devices(f"recover-{tier}-{r}-lost")
            mngr, h = manager(run["ckpt"], replicas=1, persist_every=1000)
            entry = {"run": r, "tier": tier, "lose": run["lose"]}
            entry["newest"] = _restore_step(mngr, h, mngr.latest_step(), follow=True)
            entry["previous"] = _restore_step(mngr, h, args["previous"], follow=False)
            peers = h.inspect().peers
            if peers is not None:
                tokens.append(peers.token)
                hosts.add(peers.addresses[pi].host)
            mngr.close()
            recovered.append(entry)
    return {"recovered": recovered, "tokens": tokens, "peer_hosts": sorted(hosts)}


def attempt(fn) -> dict:
    """Runs `fn`; its outcome and how long it took."""
    started = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # reported to the test
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - started}
    return {"value": value, "seconds": time.perf_counter() - started}


def slow_persists_on_the_last_process(slow_s: float) -> None:
    """The last process waits `slow_s` before each persist: a verdict that judged a step
    from one process's own persistence would find the slower process's part missing."""
    if jax.process_index() == jax.process_count() - 1:

        def slow(point, step, process):
            if point == "persist_begin":
                time.sleep(slow_s)

        _faults.install(slow)


def main(scenarios: dict) -> None:
    """Runs `scenario_<argv[1]>` from `scenarios` (a worker's globals()) with argv[2] as JSON.

    Other worker scripts import this module (which starts JAX) and call
    `main(globals())` with their own scenarios.
    """
    scenario, raw = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = scenarios[f"scenario_{scenario}"](raw)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(globals())
