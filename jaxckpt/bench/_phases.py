"""The measuring phases of one benchmark process, run in lockstep by every process.

1. Training loops: no checkpoint, a jaxckpt save every step, an Orbax
   `StandardCheckpointHandler` async save every step (host memory sampled).
2. Raw baselines on this process's own shards: device->host copy, files into
   the memory tier's tmpfs, a copy into a pre-faulted tmpfs file, fsync'd files
   where checkpoints persist, loopback TCP.
3. Isolated saves (the previous one finished first): jaxckpt, then Orbax; then
   the newest part pushed again to its holders alone (as the loopback baseline runs).
4. Restores from every source (see `_restores`).
   Then a tree of thousands of small leaves saved and restored by both (see
   `_many_leaves`).
5. With a store URL: saves persisted to an object store, against plain tensorstore
   writes to the same endpoint (see `_object_store`); `store_only` runs this alone.

Nothing here interprets the timings; `jaxckpt.bench` turns them into figures.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxckpt import _aio
from jaxckpt.bench import (
    _baselines,
    _floor,
    _many_leaves,
    _object_store,
    _proxy,
    _restores,
    _saves,
    _solo,
    _state,
)
from jaxckpt.bench._managers import Jaxckpt, orbax_manager
from jaxckpt.coord import _multihost

Record = dict[str, list[float]]


_START = time.monotonic()


def progress(message: str) -> None:
    """A progress line on process 0 (echoed by `jaxckpt.bench`)."""
    if jax.process_index() == 0:
        print(f"[bench] {time.monotonic() - _START:6.1f} s  {message}", flush=True)


class Sync:
    """A bounded barrier over every process (a no-op in one process)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __call__(self, tag: str, value: Any = 0) -> list[Any]:
        return _multihost.allgather(value, tag=f"bench/{tag}", timeout_s=self.timeout_s)


def run(cfg: dict[str, Any], memory_root: Path) -> dict[str, Any]:
    """Runs every phase; returns this process's raw timings (JSON-serializable)."""
    sync = Sync(cfg["timeout_s"])
    work = Path(cfg["work_dir"])
    shape = _state.shape_for(cfg["state_gib"], jax.device_count(), cfg["batch_per_device"])
    progress(f"building the state: {shape}")
    tr = _state.build(shape)
    own = _state.own_shards(tr.state(0))
    out: dict[str, Any] = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "shape": dataclasses.asdict(shape),
        "state_bytes": shape.state_bytes,
        "own_bytes": sum(s.nbytes for s in own),
        "own_arrays": len(own),
    }
    for _ in range(cfg["warmup"]):
        tr.train_step()
    if cfg.get("solo"):
        out["solo"] = _solo.run(cfg, tr, memory_root, work, _loop, progress)
        return out
    if cfg.get("proxy"):
        progress("accelerator-host proxy: the train step on one CPU, saves on the others")
        out["proxy"] = _proxy.run(cfg, tr, memory_root, work, _loop)
        return out
    if not cfg.get("store_only"):
        _local_phases(cfg, tr, memory_root, work, sync, out)
        if cfg.get("many_leaves"):
            out["many_leaves"] = _many_leaves.run(cfg, memory_root, work, sync, progress)
    if cfg.get("store_url"):
        progress(f"object store: {cfg['store_url']}")
        out["object_store"] = _object_store.run(cfg, tr, memory_root, sync, progress)
    sync("done")
    return out


def _local_phases(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    work: Path,
    sync: Sync,
    out: dict[str, Any],
) -> None:
    """Phases 1-4, into `out`."""
    progress("training loops")
    with _baselines.MemorySampler(memory_root) as sampler:
        out["loops"], out["memory"] = _loops(cfg, tr, sampler, memory_root, work, sync)
    progress("raw baselines")
    out["raw"] = _raw(cfg, tr, memory_root, work, sync)

    ours = Jaxckpt(
        work / "jaxckpt", memory_root, cfg, persist_every=cfg["repeats"] + 1, memory_keep=1
    )
    omngr = orbax_manager(work / "orbax", cfg, max_to_keep=2)
    try:
        progress("isolated saves")
        out["saves"] = _isolated_jaxckpt(cfg, tr, ours, sync)
        ours.handler.wait_for_persistence(cfg["timeout_s"])
        out["persist"] = ours.metrics("persist")
        out["push_alone"] = _push_alone(cfg, ours, sync)
        out["orbax_saves"] = _isolated_orbax(cfg, tr, omngr, sync)
        progress("restores")
        out["restores"] = _restores.run(tr, ours, omngr, cfg["repeats"] + 1, work, sync)
    finally:
        omngr.close()
        ours.close()
    run_dir = ours.memory_dir
    sync("isolated/closed")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)  # the object-store phase has its own


def _loop(
    tr: _state.Training,
    steps: int,
    save: Callable[[int], None] | None = None,
    after_save: Callable[[Record], None] | None = None,
) -> Record:
    """Step times (train step + save) and save times for `steps` steps."""
    rec: Record = {"step_s": [], "save_s": [], "dispatch_s": []}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        tr.train_step()
        trained = time.perf_counter()
        if save is not None:
            save(step)
        end = time.perf_counter()
        rec["step_s"].append(end - start)
        rec["save_s"].append(end - trained)
        rec["dispatch_s"].append(tr.dispatch_s)
        if after_save is not None:
            after_save(rec)
    return rec


def _loops(
    cfg: dict[str, Any],
    tr: _state.Training,
    sampler: _baselines.MemorySampler,
    memory_root: Path,
    work: Path,
    sync: Sync,
) -> tuple[dict[str, Record], dict[str, float]]:
    steps = cfg["steps"]
    loops: dict[str, Record] = {}
    memory: dict[str, float] = {}
    sync("loop/train")
    with sampler.phase("train") as peaks:
        loops["train"] = _loop(tr, steps)
    memory["train_rss_peak"] = floor = int(peaks["rss"])

    memory["memory_keep"] = 1
    # The default (the copy into the slab inside `save()`), then holding the saved arrays
    # while a background thread copies them (`hold_cpu_arrays`): the trade of step
    # time for host memory (figures 1a/6b against 1e/6d).
    # Then the default without NaN/Inf counting (`count_nonfinite=False`): its cost, 1f.
    for name, hold, count in (
        ("jaxckpt", False, True),
        ("jaxckpt_hold", True, True),
        ("jaxckpt_uncounted", False, False),
    ):
        loops[name], used = _jaxckpt_loop(
            cfg, tr, sampler, floor, memory_root, work, sync, name, hold, count
        )
        if name != "jaxckpt_uncounted":
            memory.update({k if name == "jaxckpt" else f"hold_{k}": v for k, v in used.items()})
    omngr = orbax_manager(work / "loop-orbax", cfg, max_to_keep=2)
    sync("loop/orbax")
    with sampler.phase("orbax", rss_floor=floor) as peaks:
        loops["orbax"] = _loop(
            tr, steps, lambda s: omngr.save(s, args=ocp.args.StandardSave(tr.state(s)))
        )
        omngr.wait_until_finished()
    memory["orbax_rss_peak"] = int(peaks["rss"])
    omngr.close()
    sync("loop/floor")
    loops["floor"] = _floor_loop(cfg, tr, memory_root, sync)
    # The no-save loop again, last: the baseline then brackets the loops it is compared with.
    sync("loop/train/again")
    loops["train_again"] = _loop(tr, steps)
    if jax.process_index() == 0:
        shutil.rmtree(work / "loop-orbax", ignore_errors=True)
    return loops, memory


def _jaxckpt_loop(
    cfg: dict[str, Any],
    tr: _state.Training,
    sampler: _baselines.MemorySampler,
    rss_floor: int,
    memory_root: Path,
    work: Path,
    sync: Sync,
    name: str,
    hold: bool,
    count_nonfinite: bool = True,
) -> tuple[Record, dict[str, int]]:
    """The training loop with a jaxckpt save every step (`memory_keep=1`, nothing
    persisted); its record and the host memory it used, counted above `rss_floor`
    (the no-save loop's peak RSS)."""
    ours = Jaxckpt.every_step(work / f"loop-{name}", memory_root, cfg, hold, count_nonfinite)
    sync(f"loop/{name}")
    with sampler.phase(name, rss_floor=rss_floor) as peaks:
        record = _loop(tr, cfg["steps"], lambda s: ours.save(s, tr.state(s)))
        ours.mngr.wait_until_finished()
        # Retention of older steps runs in the background: the steady state is after it.
        ours.handler.wait_for_persistence(cfg["timeout_s"])
        sync(f"loop/{name}/retained")
    saves = sorted(ours.metrics("save"), key=lambda m: m["step"])
    record["stall_s"] = [m["stall_s"] for m in saves]
    record["safe_in_memory_s"] = [m["safe_in_memory_s"] for m in saves]
    used = {
        "jaxckpt_rss_peak": int(peaks["rss"]),
        "jaxckpt_tmpfs_peak": int(peaks["tmpfs"]),
        "jaxckpt_combined_peak": int(peaks["combined"]),
        "tmpfs_steady": _baselines.tree_bytes(memory_root),
        # The spare slabs among them (`TierOptions.spare_slabs=False` frees these).
        "tmpfs_spare": sum(_baselines.tree_bytes(free) for free in memory_root.glob("*/.free")),
        "rss_after": _baselines.rss_bytes(),
    }
    run_dir = ours.memory_dir
    ours.close()
    sync(f"loop/{name}/closed")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    if jax.process_index() == 0:
        shutil.rmtree(work / f"loop-{name}", ignore_errors=True)
    return record, used


def _floor_loop(cfg: dict[str, Any], tr: _state.Training, memory_root: Path, sync: Sync) -> Record:
    """The training loop with the overlapped raw floor of a save every step (`_floor`)."""
    own = sum(s.nbytes for s in _state.own_shards(tr.state(0)))
    ring, server = None, None
    if cfg["replicas"] and jax.process_count() > 1:
        server = _baselines.listen()
        ports = sync("floor/ports", server.getsockname()[1])
        sizes = sync("floor/bytes", own)
        pi, n = jax.process_index(), jax.process_count()
        ring = (server, ports[(pi + 1) % n], sizes[(pi - 1) % n])
    try:
        floor = _floor.Floor(memory_root, own, ring, cfg["timeout_s"])
        try:
            return _loop(tr, cfg["steps"], lambda s: floor.save(_state.own_shards(tr.state(s))))
        finally:
            floor.close()
    finally:
        if server is not None:
            server.close()


def _raw(
    cfg: dict[str, Any], tr: _state.Training, memory_root: Path, work: Path, sync: Sync
) -> dict[str, list[float]]:
    """The baselines, every process at once (as a save runs on every process at once)."""
    shards = _state.own_shards(tr.state(0))
    out: dict[str, list[float]] = {
        "d2h": [],
        "tmpfs_write": [],
        "prefaulted_copy": [],
        "checksum": [],
        "fsync_write": [],
        "socket": [],
    }
    host: list[Any] = []
    for i in range(cfg["repeats"]):
        del host[:]
        sync(f"raw/d2h/{i}")
        start = time.perf_counter()
        host = _state.raw_device_to_host(shards)
        out["d2h"].append(time.perf_counter() - start)
    persist_dir = work / f"raw-{jax.process_index()}"
    for i in range(cfg["repeats"]):
        sync(f"raw/tmpfs/{i}")
        out["tmpfs_write"].append(_baselines.write_files(host, memory_root, fsync=False))
        sync(f"raw/prefaulted/{i}")
        out["prefaulted_copy"].append(_baselines.prefaulted_copy(host, memory_root))
        sync(f"raw/checksum/{i}")
        out["checksum"].append(_baselines.checksum(host))
        sync(f"raw/fsync/{i}")
        out["fsync_write"].append(_baselines.write_files(host, persist_dir, fsync=True))
    shutil.rmtree(persist_dir, ignore_errors=True)
    if jax.process_count() > 1:
        server = _baselines.listen()
        with server:
            ports = sync("raw/ports", server.getsockname()[1])
            nxt = ports[(jax.process_index() + 1) % len(ports)]
            for i in range(cfg["repeats"]):
                out["socket"].append(
                    _baselines.ring_transfer(
                        server, nxt, host, _barrier(sync, f"raw/socket/{i}"), cfg["timeout_s"]
                    )
                )
    return out


def _barrier(sync: Sync, tag: str) -> Callable[[], None]:
    def wait() -> None:
        sync(tag)

    return wait


def _isolated_jaxckpt(
    cfg: dict[str, Any], tr: _state.Training, ours: Jaxckpt, sync: Sync
) -> list[dict[str, Any]]:
    """Saves steps 1..repeats+1, each after the previous one finished; step 1 warms up.

    Time to safe counts from the `mngr.save()` call: to the commit in memory
    (see `_saves.jaxckpt`), then to the end of the replica push.
    """
    return _saves.jaxckpt(cfg["repeats"] + 1, tr.state, ours, sync, "save")


def _push_alone(cfg: dict[str, Any], ours: Jaxckpt, sync: Sync) -> list[dict[str, float]]:
    """Every process pushes its part of the newest step to its holders again, all at
    once and with nothing else running, as the loopback baseline sends (the product's
    push: sendfile out; the holder receives into a free slab, checks every chunk,
    renames, and recycles the copy it replaced). Seconds and bytes sent, per push."""
    look = ours.handler.inspect()
    peers, memory = look.peers, look.memory
    if peers is None or memory is None or not cfg["replicas"]:
        return []
    me = jax.process_index()
    step = max(memory.steps())
    out = []
    for i in range(cfg["repeats"]):
        sync(f"push_alone/{i}")
        start = time.perf_counter()
        sent = _aio.run_sync(peers.push_replicas(memory.part_dir(step, me), step, me))
        out.append({"seconds": time.perf_counter() - start, "bytes": sent})
    sync("push_alone/done")
    return out


def _isolated_orbax(
    cfg: dict[str, Any], tr: _state.Training, mngr: ocp.CheckpointManager, sync: Sync
) -> list[dict[str, Any]]:
    return _saves.orbax(cfg["repeats"] + 1, tr.state, mngr, sync, "orbax")
