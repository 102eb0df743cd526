"""One process of `jaxckpt bench --reshard`: saves in one layout, restores onto another,
and measures each restore against its floor and against Orbax's.

A worker has one role (`cfg["role"]`):

- ``single``: one process with every device any mesh uses; for each direction it saves
  (jaxckpt, persisted, and Orbax), restores from its own memory, then from the
  persistent tier after dropping the step from memory, and Orbax restores its copy.
- ``save``: the saving job of a direction that changes the process count: jaxckpt
  (one replica, persisted) and Orbax save; the memory tiers stay for the next job.
- ``restore``: the restoring job, started on other processes after a node loss:
  restores from the memory tiers left (own and peers'), then from the persistent tier
  after every process dropped the step from memory, and Orbax restores its copy.

Every restore's tree is compared, shard by shard, with the saved values
(`_reshard.values`); persistent reads, jaxckpt's, Orbax's and the floor's, start from a
cold page cache.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import jax
import numpy as np
import orbax.checkpoint as ocp

import jaxckpt
from jaxckpt.bench import _baselines, _reshard
from jaxckpt.bench._managers import Jaxckpt, orbax_manager
from jaxckpt.bench._phases import Sync, progress
from jaxckpt.bench._reshard_floor import Floor

STEP: Final = 1


def run(cfg: dict[str, Any], memory_root: Path) -> dict[str, Any]:
    """This process's measurements (the worker's result)."""
    sync = Sync(cfg["timeout_s"])
    rows = _reshard.rows_for(cfg["state_mib"])
    out: dict[str, Any] = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "shape": f"{_reshard.LEAVES} x ({rows}, {_reshard.COLUMNS}) float32",
        "state_bytes": _reshard.LEAVES * rows * _reshard.COLUMNS * 4,
        "results": [],
    }
    work = Path(cfg["work_dir"])
    for name in cfg["directions"]:
        d = _reshard.BY_NAME[name]
        progress(f"{d.what}: {cfg['role']}")
        if cfg["role"] == "save":
            _save(cfg, d, rows, memory_root, work / name, sync)
        else:
            out["results"].append(_measure(cfg, d, rows, memory_root, work / name, sync))
    sync("reshard/done")
    return out


def _state(d: _reshard.Direction, rows: int) -> dict[str, jax.Array]:
    """The saved state in the direction's saving layout."""
    sharding = d.save.sharding(jax.devices())
    shape = (rows, _reshard.COLUMNS)

    def leaf(i: int) -> jax.Array:
        def shard(index: Any) -> np.ndarray:
            return _reshard.values(i, _reshard.region_of(tuple(index), shape)).astype(np.float32)

        return jax.make_array_from_callback(shape, sharding, shard)

    return {f"w{i}": leaf(i) for i in range(_reshard.LEAVES)}


def _managers(cfg: dict[str, Any], memory_root: Path, work: Path) -> tuple[Jaxckpt, Any]:
    # Every save persisted; one copy on a peer where there are peers.
    tiles = {} if cfg.get("tile_bytes") is None else {"tile_bytes": cfg["tile_bytes"] or None}
    ours = Jaxckpt(work / "jaxckpt", memory_root, cfg, persist_every=1, memory_keep=1, **tiles)
    return ours, orbax_manager(work / "orbax", cfg, max_to_keep=1)


def _save(
    cfg: dict[str, Any],
    d: _reshard.Direction,
    rows: int,
    memory_root: Path,
    work: Path,
    sync: Sync,
) -> None:
    """Saves `STEP` with jaxckpt (into memory, a peer and the persistent tier) and Orbax."""
    state = _state(d, rows)
    ours, omngr = _managers(cfg, memory_root, work)
    try:
        ours.save(STEP, state)
        ours.mngr.wait_until_finished()
        ours.handler.wait_for_persistence(cfg["timeout_s"])
        omngr.save(STEP, args=ocp.args.StandardSave(state))
        omngr.wait_until_finished()
    finally:
        omngr.close()
        ours.close()
    sync(f"reshard/{d.name}/saved")


def _measure(
    cfg: dict[str, Any],
    d: _reshard.Direction,
    rows: int,
    memory_root: Path,
    work: Path,
    sync: Sync,
) -> dict[str, Any]:
    """Restores onto the direction's target from each tier, its floors, and Orbax."""
    if cfg["role"] == "single":
        _save(cfg, d, rows, memory_root, work, sync)
    shape = (rows, _reshard.COLUMNS)
    sharding = d.target.sharding(jax.devices())
    target = {
        f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
        for i in range(_reshard.LEAVES)
    }
    leaves = [(shape, sharding)] * _reshard.LEAVES
    result: dict[str, Any] = {
        "direction": d.name,
        "process": jax.process_index(),
        "save": d.save.describe(),
        "target": d.target.describe(),
        "needed_bytes": _reshard.LEAVES * _reshard.needed_bytes(shape, sharding),
        "tiers": {},
    }
    ours, omngr = _managers(cfg, memory_root, work)
    floors = {
        "memory": Floor(memory_root, leaves, mapped=True),
        "persistent": Floor(work / f"floor-{jax.process_index()}", leaves, mapped=False),
    }
    try:
        memory_tier = d.tiers[0]
        result["tiers"][memory_tier] = _restores(
            cfg, d, ours, target, floors["memory"], sync, memory_tier
        )
        # Every memory tier is lost: each process drops the step from its own (the run
        # is open now: the restore opened it).
        memory = ours.handler.inspect().memory
        assert memory is not None
        shutil.rmtree(memory.step_dir(STEP), ignore_errors=True)
        sync(f"reshard/{d.name}/forgotten")
        result["tiers"]["persistent"] = _restores(
            cfg, d, ours, target, floors["persistent"], sync, "persistent", work / "jaxckpt"
        )
        result["orbax"] = _orbax_restores(cfg, d, omngr, target, work / "orbax", sync)
    finally:
        for floor in floors.values():
            floor.remove()
        omngr.close()
        ours.close()
    sync(f"reshard/{d.name}/closed")
    if ours.memory_dir is not None:
        shutil.rmtree(ours.memory_dir, ignore_errors=True)
    return result


def _timed(
    name: str, sync: Sync, restore: Callable[[], Any], cold: Path | None
) -> tuple[float, Any]:
    """Seconds one restore took (after every process is ready; cold: its files evicted)."""
    if cold is not None:
        _baselines.evict_page_cache(cold)
    sync(name)
    start = time.perf_counter()
    restored = jax.block_until_ready(restore())
    seconds = time.perf_counter() - start
    # Every process restored before any drops a copy (the next tier) another may read.
    sync(f"{name}/done")
    return seconds, restored


def _restores(
    cfg: dict[str, Any],
    d: _reshard.Direction,
    ours: Jaxckpt,
    target: dict[str, Any],
    floor: Floor,
    sync: Sync,
    tier: str,
    cold: Path | None = None,
) -> dict[str, Any]:
    """`repeats` jaxckpt restores from `tier`, each followed by its floor."""
    out: dict[str, Any] = {"seconds": [], "floor_s": [], "bytes_by_tier": [], "verified": True}
    peer_arrays = floor.arrays() if tier == "peer" else None
    for k in range(cfg["repeats"]):
        tag = f"reshard/{d.name}/{tier}/{k}"
        seconds, restored = _timed(
            tag,
            sync,
            lambda: (
                ours.mngr.restore(
                    STEP, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))
                ).train
            ),
            cold,
        )
        metrics = ours.metrics("restore", STEP)[-1]
        out["seconds"].append(seconds)
        out["bytes_by_tier"].append({k: int(v) for k, v in metrics["bytes_by_tier"].items()})
        out["verified"] = out["verified"] and verify(restored)
        del restored
        sync(f"{tag}/floor")
        floor_s = floor.read()
        if peer_arrays is not None:
            floor_s += _loopback(cfg, peer_arrays, sync, f"{tag}/loopback")
        out["floor_s"].append(floor_s)
    return out


def _orbax_restores(
    cfg: dict[str, Any],
    d: _reshard.Direction,
    omngr: Any,
    target: dict[str, Any],
    directory: Path,
    sync: Sync,
) -> dict[str, Any]:
    """`repeats` Orbax restores of its copy onto the same target, each cold."""
    out: dict[str, Any] = {"seconds": [], "verified": True}
    for k in range(cfg["repeats"]):
        seconds, restored = _timed(
            f"reshard/{d.name}/orbax/{k}",
            sync,
            lambda: omngr.restore(STEP, args=ocp.args.StandardRestore(target)),
            directory,
        )
        out["seconds"].append(seconds)
        out["verified"] = out["verified"] and verify(restored)
        del restored
    return out


def _loopback(cfg: dict[str, Any], arrays: list[np.ndarray], sync: Sync, tag: str) -> float:
    """Seconds for every process to send its needed bytes to the next over loopback TCP."""
    server = _baselines.listen()
    with server:
        ports = sync(f"{tag}/ports", server.getsockname()[1])
        nxt = ports[(jax.process_index() + 1) % len(ports)]

        def barrier() -> None:
            sync(f"{tag}/start")

        return _baselines.ring_transfer(server, nxt, arrays, barrier, cfg["timeout_s"])


def verify(restored: dict[str, jax.Array]) -> bool:
    """Whether every shard this process holds equals the saved values of its region."""
    for i in range(_reshard.LEAVES):
        leaf = restored[f"w{i}"]
        for shard in leaf.addressable_shards:
            region = _reshard.region_of(tuple(shard.index), leaf.shape)
            expected = _reshard.values(i, region).astype(np.float32)
            if not np.array_equal(np.asarray(shard.data), expected):
                return False
    return True
