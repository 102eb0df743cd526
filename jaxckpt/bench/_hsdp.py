"""`jaxckpt bench --layout hsdp`: data-parallel replicas sharing the save, measured.

    jaxckpt bench --layout hsdp                          # 4 processes x 2 devices, dp=2
    jaxckpt bench --layout hsdp --dp 4 --state-mib 64 --json hsdp.json --plot hsdp.png

N processes on loopback hold a state of float32 leaves sharded `P('fsdp')` over a
mesh ('dp', 'fsdp') whose dp axis spans processes (HSDP: every shard is held by
R = dp processes). Each process, in lockstep:

- runs a donating train step K times with no saves and with a jaxckpt save every
  step, on the HSDP mesh and on the unreplicated mesh (dp = 1) of the same bytes
  per host, the two layouts alternating for `--repeats` rounds; then with an Orbax
  save every step (same manager options) on the HSDP mesh;
- records each save's bytes snapshotted, stall and bytes pushed (medians);
- persists one step, forgets every memory tier and restores it from persistent
  storage, against Orbax restoring its own checkpoint of the same state (5c).

Figures (`figures`): per-process bytes, stall and push as max over mean, and the
stall's spread against the unreplicated layout's (whose work is even: the noise); the loop
with saves against no saves and against Orbax; the time a save every step adds on HSDP
against the unreplicated layout of the same bytes a host; the persistent restore against Orbax's and the
bytes it read against the state's.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from jaxckpt.bench._figure import Figure

LEAVES: Final = 4  # float32 leaves of (rows, 1024)
# A save's phases (seconds from its start; `SaveMetrics`), recorded per layout.
_PHASES: Final = ("memory_write_s", "safe_in_memory_s", "replicate_s", "safe_on_peers_s", "agree_s")
COLUMNS: Final = 1024


def run(cfg: dict[str, Any], memory_root: Path) -> dict[str, Any]:
    """One process's measurements (the worker's result)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxckpt.bench import _managers

    devices = np.array(jax.devices())
    fsdp_all = devices.size
    rows = max(fsdp_all, int(cfg["state_mib"] * 2**20 / 4 / COLUMNS / LEAVES))
    rows -= rows % fsdp_all
    work = Path(cfg["work_dir"])
    out: dict[str, Any] = {
        "process": jax.process_index(),
        "shape": f"{LEAVES} x ({rows}, {COLUMNS}) float32",
        "state_bytes": LEAVES * rows * COLUMNS * 4,
        "devices": int(devices.size),
        "platform": devices.flat[0].platform,
    }

    def state_on(mesh: Mesh) -> dict[str, jax.Array]:
        sharding = NamedSharding(mesh, P("fsdp"))

        def leaf(i: int) -> jax.Array:
            def shard(idx: Any) -> np.ndarray:
                return np.full((idx[0].stop - idx[0].start, COLUMNS), i + 1.0, np.float32)

            return jax.make_array_from_callback((rows, COLUMNS), sharding, shard)

        return {f"w{i}": leaf(i) for i in range(LEAVES)}

    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001, s), donate_argnums=0)

    def loop(mesh: Mesh, save: Any, tag: str) -> list[float]:
        state = state_on(mesh)
        times = []
        for k in range(cfg["steps"]):
            multihost_utils.sync_global_devices(f"{tag}-{k}")
            start = time.perf_counter()
            state = step_fn(state)
            if save is not None:
                save(k, state)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - start)
        return times[cfg["warmup"] :]

    layouts = {"hsdp": cfg["dp"], "fsdp": 1}
    meshes = {
        n: Mesh(devices.reshape(dp, fsdp_all // dp), ("dp", "fsdp")) for n, dp in layouts.items()
    }
    times, saves = _alternating(cfg, meshes, loop, work, memory_root)
    for name, mesh in meshes.items():
        res: dict[str, Any] = {"dp": layouts[name], **times[name]}
        # Medians a save; the phases (where its background time goes) are in the JSON only.
        for key in ("bytes", "stall_s", "replicate_bytes", *_PHASES):
            res[key] = statistics.median(float(m.get(key) or 0) for m in saves[name])
        if name == "hsdp":
            orbax = _managers.orbax_manager(work / f"{name}-orbax", cfg, max_to_keep=2)

            def orbax_save(k: int, s: Any, orbax: Any = orbax) -> None:
                orbax.save(k, args=ocp.args.StandardSave(s))

            res["orbax_s"] = statistics.median(loop(mesh, orbax_save, "orbax"))
            orbax.wait_until_finished()
            orbax.close()
            res.update(_restores(cfg, mesh, state_on(mesh), work, memory_root))
        out[name] = res
    return out


def _alternating(
    cfg: dict[str, Any],
    meshes: dict[str, Any],
    loop: Callable[[Any, Any, str], list[float]],
    work: Path,
    memory_root: Path,
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """Each layout's loop without saves and with a jaxckpt save every step (median step
    times), and its saves' metrics. The layouts alternate for `repeats` rounds: a load
    that drifts during the run weighs on both alike (h4 compares them)."""
    from jax.experimental import multihost_utils

    from jaxckpt.bench import _managers

    times: dict[str, dict[str, list[float]]] = {
        n: {"no_save_s": [], "jaxckpt_s": []} for n in meshes
    }
    saves: dict[str, list[dict[str, Any]]] = {n: [] for n in meshes}
    for r in range(max(1, int(cfg.get("repeats") or 1))):
        for name, mesh in meshes.items():
            tag = f"{name}-{r}"
            times[name]["no_save_s"] += loop(mesh, None, f"{tag}-none")
            j = _managers.Jaxckpt.every_step(work / f"{tag}-jaxckpt", memory_root, cfg)
            times[name]["jaxckpt_s"] += loop(mesh, j.save, f"{tag}-jaxckpt")
            j.mngr.wait_until_finished()
            saves[name] += j.metrics("save")[cfg["warmup"] :]
            j.close()
            multihost_utils.sync_global_devices(f"{tag}-closed")
            if j.memory_dir is not None:
                shutil.rmtree(j.memory_dir, ignore_errors=True)
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    return medians, saves


def _restores(
    cfg: dict[str, Any], mesh: Any, state: Any, work: Path, memory_root: Path
) -> dict[str, Any]:
    """The persistent restore (every memory tier forgotten) against Orbax's (5c)."""
    import jax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    import jaxckpt
    from jaxckpt.bench import _managers

    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    j = _managers.Jaxckpt(work / "restore-jaxckpt", memory_root, cfg, persist_every=1)
    j.save(0, state)
    j.mngr.wait_until_finished()
    j.handler.wait_for_persistence()
    memory_dir = j.memory_dir
    j.close()
    multihost_utils.sync_global_devices("hsdp-persisted")
    if memory_dir is not None:
        shutil.rmtree(memory_dir, ignore_errors=True)
    multihost_utils.sync_global_devices("hsdp-forgotten")
    j = _managers.Jaxckpt(work / "restore-jaxckpt", memory_root, cfg, persist_every=1)
    start = time.perf_counter()
    restored = j.mngr.restore(0, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))).train
    jax.block_until_ready(restored)
    out: dict[str, Any] = {"restore_s": time.perf_counter() - start}
    metrics = j.handler.last_restore_metrics
    out["restore_bytes"] = sum(metrics.get("bytes_by_tier", {}).values())
    out["restore_tier"] = metrics.get("tier")
    j.close()
    o = _managers.orbax_manager(work / "restore-orbax", cfg, max_to_keep=1)
    o.save(0, args=ocp.args.StandardSave(state))
    o.wait_until_finished()
    multihost_utils.sync_global_devices("orbax-saved")
    start = time.perf_counter()
    restored = o.restore(0, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(restored)
    out["orbax_restore_s"] = time.perf_counter() - start
    o.close()
    return out


def figures(procs: list[dict[str, Any]]) -> list[Figure]:
    """The HSDP figures from every process's result."""
    h = [p["hsdp"] for p in procs]
    f = [p["fsdp"] for p in procs]
    dp = h[0]["dp"]
    figs = []
    for key, what, unit in (
        ("bytes", "bytes snapshotted a save", "B"),
        ("replicate_bytes", "bytes pushed a save", "B"),
        ("stall_s", "save stall", "s"),
    ):
        values = [float(x[key]) for x in h]
        figs.append(
            Figure(
                id=f"h1.{key}",
                name=f"HSDP (R={dp}) {what}, busiest process",
                value=max(values),
                unit=unit,
                baseline=statistics.mean(values),
                baseline_name="mean over processes",
                target="<= 1.05",
            )
        )
    # The stall's spread over processes on the unreplicated layout, where every process
    # copies the same bytes by construction: the machine's own noise (the busiest of N
    # noisy processes is above their mean even when the work is even).
    spreads = [
        max(v) / statistics.mean(v) for v in ([float(x["stall_s"]) for x in g] for g in (h, f))
    ]
    figs.append(
        Figure(
            id="h1.stall_spread",
            name=f"HSDP (R={dp}) save stall spread (busiest over mean)",
            value=spreads[0],
            unit="x",
            baseline=spreads[1],
            baseline_name="the same spread unreplicated (dp=1: even work, the noise)",
            target="<= 1.05",
        )
    )
    save, none, orbax = (max(x[k] for x in h) for k in ("jaxckpt_s", "no_save_s", "orbax_s"))
    flat_save, flat_none = (max(x[k] for x in f) for k in ("jaxckpt_s", "no_save_s"))
    figs += [
        Figure("h2", "HSDP loop step, a jaxckpt save every step", save, "s", none, "no saves"),
        Figure("h3", "HSDP loop step, a jaxckpt save every step", save, "s", orbax, "Orbax"),
        Figure(
            "h4",
            "HSDP loop, time a save every step adds to a step",
            save - none,
            "s",
            flat_save - flat_none,
            "the same unreplicated (dp=1), same bytes a host",
            "<= 1.05",
        ),
        Figure(
            "h5",
            "HSDP restore from persistent storage (5c)",
            max(x["restore_s"] for x in h),
            "s",
            max(x["orbax_restore_s"] for x in h),
            "Orbax restore",
            "<= 1.0",
        ),
        Figure(
            "h6",
            "HSDP persistent restore: bytes read across the job",
            float(sum(x["restore_bytes"] for x in h)),
            "B",
            float(procs[0]["state_bytes"]),
            "the state's bytes (each read once)",
            "<= 1.0",
        ),
    ]
    return figs
