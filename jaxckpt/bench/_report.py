"""Turns the processes' raw timings into figures (value, baseline, ratio) and prints them.

Every ratio is value / baseline, both measured in the same run. Across
processes, a time is the slowest process's and a bandwidth the slowest
process's: a job goes at the pace of its slowest host. Targets are those of
the benchmark's issue; `met` is None where the run could not measure a figure.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Final

import psutil

from jaxckpt.tools import _table

_MB: Final = 1e6
_PACKAGES: Final = ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy", "jaxckpt")


@dataclasses.dataclass(frozen=True)
class Figure:
    """One row of the table: `ratio` = `value` / `baseline`."""

    id: str
    name: str
    value: float | None
    unit: str
    baseline: float | None
    baseline_name: str
    target: str | None = None  # "<= 1.15" or ">= 0.6", on the ratio
    ratio: float | None = dataclasses.field(init=False)
    met: bool | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        ok = self.value is not None and self.baseline is not None and self.baseline > 0
        ratio = self.value / self.baseline if ok else None  # type: ignore[operator]
        object.__setattr__(self, "ratio", ratio)
        met = None
        if self.target is not None and ratio is not None:
            op, bound = self.target.split()
            met = ratio <= float(bound) if op == "<=" else ratio >= float(bound)
        object.__setattr__(self, "met", met)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Figure:
        """The figure a report's `figures` entry describes (ratio and met recomputed)."""
        return cls(
            str(d["id"]),
            str(d["name"]),
            d.get("value"),
            str(d["unit"]),
            d.get("baseline"),
            str(d["baseline_name"]),
            d.get("target"),
        )


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _worst(
    procs: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], float | None], *, low: bool
) -> float | None:
    """The slowest process's value: the lowest bandwidth (`low`) or the longest time."""
    vals = [v for p in procs if (v := get(p)) is not None]
    if not vals:
        return None
    return min(vals) if low else max(vals)


def _sum(*xs: float | None) -> float | None:
    return None if any(x is None for x in xs) else sum(x for x in xs if x is not None)


def figures(procs: Sequence[dict[str, Any]], warmup: int, replicas: int) -> list[Figure]:
    """Every figure of the benchmark from the processes' raw results (those of the
    phases that ran: the object-store figures only with a store)."""
    out = _local_figures(procs, warmup, replicas) if "loops" in procs[0] else []
    if "object_store" in procs[0]:
        out += _store_figures(procs)
    if "many_leaves" in procs[0]:
        out += _many_leaf_figures(procs)
    return out


def _store_figures(procs: Sequence[dict[str, Any]]) -> list[Figure]:
    """Persisting to an object store against tensorstore writing the same bytes there."""

    def median(key: str, kind: str = "saves") -> Callable[[dict[str, Any]], float | None]:
        """A process's median of `key` over its measured (not warm-up) repeats."""
        return lambda p: _median([r[key] for r in p["object_store"][kind] if not r["warmup"]])

    def store_bw(key: str, kind: str = "saves") -> float | None:
        return _scale(_worst(procs, median(key, kind), low=True), _MB)

    def store_t(key: str) -> float | None:
        return _worst(procs, median(key), low=False)

    baseline = store_bw("bytes_per_s", "baseline")
    name = "tensorstore zarr3 write, same chunks, same store"
    return [
        Figure(
            "7a",
            "object store: save until persisted",
            store_bw("bytes_per_s"),
            "MB/s",
            baseline,
            name,
            ">= 0.7",
        ),
        Figure(
            "7b",
            "object store: upload (handler persist_s)",
            store_bw("persist_bytes_per_s"),
            "MB/s",
            baseline,
            name,
        ),
        Figure(
            "7c",
            "object store: time outside the upload",
            store_t("outside_upload_s"),
            "s",
            store_t("seconds"),
            "the whole save until persisted",
        ),
    ]


def proxy_figures(proxy: dict[str, Any], warmup: int) -> list[Figure]:
    """The accelerator-host proxy: one process, its train step confined to one CPU and
    its saves to the others (`_proxy`); every loop against the same loop without saving.

    9a holds the saved arrays (`hold_cpu_arrays`), the CPU's counterpart of what a save
    on an accelerator does (its stall is the transfer to pinned host memory, the slab
    filled in the background); 9f is the CPU default, which copies into the slab
    inside `save()`, on the host's CPUs, while the device waits."""
    loops = proxy["loops"]

    def median(name: str, key: str = "step_s") -> float | None:
        return _median(loops.get(name, {}).get(key, [])[warmup:])

    train = _median(loops["train"]["step_s"][warmup:] + loops["train_again"]["step_s"][warmup:])
    dispatch = _median(
        loops["train"]["dispatch_s"][warmup:] + loops["train_again"]["dispatch_s"][warmup:]
    )
    base = "step time without saving (step on one CPU)"
    return [
        Figure(
            "9a",
            "proxy: step time, jaxckpt save every step (holding the arrays)",
            median("jaxckpt_hold"),
            "s",
            train,
            base,
            "<= 1.03",
        ),
        Figure("9b", "proxy: step time, the overlapped floor", median("floor"), "s", train, base),
        Figure(
            "9c", "proxy: step time, Orbax async save every step", median("orbax"), "s", train, base
        ),
        Figure(
            "9d",
            "proxy: mngr.save() blocks, jaxckpt (holding the arrays)",
            median("jaxckpt_hold", "save_s"),
            "s",
            train,
            "the same step time (the share of it)",
        ),
        Figure(
            "9e",
            "proxy: the step's dispatch while jaxckpt saves (holding)",
            median("jaxckpt_hold", "dispatch_s"),
            "s",
            dispatch,
            "the step's dispatch without saving (GIL waits)",
        ),
        Figure(
            "9f",
            "proxy: step time, jaxckpt save every step (copying in save())",
            median("jaxckpt"),
            "s",
            train,
            base,
        ),
    ]


def _many_leaf_figures(procs: Sequence[dict[str, Any]]) -> list[Figure]:
    """The many-leaf tree: jaxckpt's save until safe in memory and restore from memory,
    against Orbax saving it until finished and restoring it from its directory."""

    def saves(key: str, kind: str) -> float | None:
        return _worst(
            procs,
            lambda p: _median([s.get(key) for s in p["many_leaves"][kind] if not s["warmup"]]),
            low=False,
        )

    def restore(source: str) -> float | None:
        return _worst(
            procs,
            lambda p: _median([r["seconds"] for r in p["many_leaves"]["restores"][source]]),
            low=False,
        )

    n = procs[0]["many_leaves"]["leaves"]
    kib = procs[0]["many_leaves"]["leaf_bytes"] / 1024
    return [
        Figure(
            "8a",
            f"{n}-leaf tree ({kib:g} KiB each): save until safe in memory",
            saves("to_memory_s", "saves"),
            "s",
            saves("done_s", "orbax_saves"),
            "Orbax save of the same tree until finished",
            "<= 0.25",
        ),
        Figure(
            "8b",
            f"{n}-leaf tree ({kib:g} KiB each): restore from own memory",
            restore("memory"),
            "s",
            restore("orbax"),
            "Orbax restore of the same tree (cold)",
            "<= 0.2",
        ),
    ]


def _local_figures(procs: Sequence[dict[str, Any]], warmup: int, replicas: int) -> list[Figure]:
    """The figures of phases 1-4 (every run but `--store-only`)."""

    mb = _MB

    def t(get: Callable[[dict[str, Any]], float | None]) -> float | None:
        return _worst(procs, get, low=False)

    def bw(get: Callable[[dict[str, Any]], float | None]) -> float | None:
        return _worst(procs, get, low=True)

    def loop(p: dict[str, Any], name: str, key: str = "step_s") -> float | None:
        return _median(p["loops"].get(name, {}).get(key, [])[warmup:])

    def saves(p: dict[str, Any], key: str, kind: str = "saves") -> float | None:
        return _median([s.get(key) for s in p[kind] if not s["warmup"]])

    def raw(p: dict[str, Any], key: str) -> float | None:
        return _median(p["raw"][key])

    def per_s(p: dict[str, Any], key: str) -> float | None:
        seconds = raw(p, key)
        return p["own_bytes"] / seconds if seconds else None

    def persist_bw(p: dict[str, Any]) -> float | None:
        done = p.get("persist") or []
        return _median([d.get("persist_bytes_per_s") for d in done])

    def bandwidth(
        id_: str,
        name: str,
        get: Callable[[dict[str, Any]], float | None],
        raw_key: str,
        baseline_name: str,
        target: str | None = None,
    ) -> Figure:
        """Bytes/s from `get` against the raw operation `raw_key` on the own bytes, in MB/s."""
        baseline = bw(lambda p: per_s(p, raw_key))
        return Figure(
            id_, name, _scale(bw(get), mb), "MB/s", _scale(baseline, mb), baseline_name, target
        )

    def restore(name: str) -> float | None:
        return t(lambda p: p["restores"].get(name, {}).get("seconds"))

    def train_of(p: dict[str, Any]) -> float | None:
        return _median(
            p["loops"]["train"]["step_s"][warmup:] + p["loops"]["train_again"]["step_s"][warmup:]
        )

    def save_work(p: dict[str, Any]) -> float | None:
        """The raw work of a save every step here, done alone: copy the own bytes into
        pre-faulted tmpfs and checksum them; with replicas, also send and receive
        them over loopback and checksum what was received (old runs: no checksum)."""
        crc = _median(p["raw"].get("checksum", [])) or 0.0
        work = _sum(raw(p, "prefaulted_copy"), crc)
        if replicas:
            work = _sum(work, raw(p, "socket"), crc * replicas)
        return work

    d2h = t(lambda p: raw(p, "d2h"))
    tmpfs = t(lambda p: raw(p, "tmpfs_write"))
    sock = t(lambda p: raw(p, "socket"))
    # The no-save loop ran first and last; its steps from both runs make the baseline.
    train = t(train_of)
    orbax_restore = restore("orbax")
    state = procs[0]["state_bytes"]
    rss_delta = sum(
        max(0, p["memory"]["jaxckpt_rss_peak"] - p["memory"]["train_rss_peak"]) for p in procs
    )
    tmpfs_steady = sum(p["memory"]["tmpfs_steady"] for p in procs)
    tmpfs_spare = sum(p["memory"].get("tmpfs_spare", 0) for p in procs)
    combined = sum(p["memory"]["jaxckpt_combined_peak"] for p in procs)
    held = [p["memory"].get("hold_jaxckpt_combined_peak") for p in procs]  # older runs: none
    combined_holding = sum(held) if all(h is not None for h in held) else None
    # The save loop's memory_keep: at a save's peak the tier holds one step more.
    keep = procs[0]["memory"].get("memory_keep", 1)
    floor = Figure(
        "1d",
        "step time, a save's raw work overlapped (the floor)",
        t(lambda p: loop(p, "floor")),
        "s",
        train,
        "step time without saving",
    )
    # 1a's target: within 0.05 of the floor measured in the same run (old runs: 1.15).
    bound = f"<= {floor.ratio + 0.05:.3f}" if floor.ratio is not None else "<= 1.15"
    return [
        Figure(
            "1a",
            "step time, jaxckpt save every step",
            t(lambda p: loop(p, "jaxckpt")),
            "s",
            train,
            "step time without saving",
            bound,
        ),
        Figure(
            "1b",
            "step time, Orbax async save every step",
            t(lambda p: loop(p, "orbax")),
            "s",
            train,
            "step time without saving",
        ),
        Figure(
            "1c",
            "no-save step + a save's raw work, not overlapped",
            t(lambda p: _sum(train_of(p), save_work(p))),
            "s",
            train,
            "step time without saving",
        ),
        floor,
        Figure(
            "1e",
            "step time, jaxckpt save every step, holding the arrays",
            t(lambda p: loop(p, "jaxckpt_hold")),
            "s",
            train,
            "step time without saving",
            bound,
        ),
        Figure(
            "1f",
            "step time, jaxckpt save every step, NaN/Inf counted (the default)",
            t(lambda p: loop(p, "jaxckpt")),
            "s",
            t(lambda p: loop(p, "jaxckpt_uncounted")),
            "the same, count_nonfinite=False",
            "<= 1.03",
        ),
        Figure(
            "2a",
            "stall: jaxckpt mngr.save() blocks (isolated)",
            t(lambda p: saves(p, "save_wall_s")),
            "s",
            d2h,
            "raw device->host copy of own shards",
        ),
        Figure(
            "2b",
            "stall: jaxckpt snapshot (handler stall_s)",
            t(lambda p: saves(p, "stall_s")),
            "s",
            d2h,
            "raw device->host copy of own shards",
        ),
        Figure(
            "2c",
            "stall: jaxckpt mngr.save() in the loop",
            t(lambda p: loop(p, "jaxckpt", "save_s")),
            "s",
            d2h,
            "raw device->host copy of own shards",
        ),
        Figure(
            "2d",
            "stall: Orbax mngr.save() blocks (isolated)",
            t(lambda p: saves(p, "save_wall_s", "orbax_saves")),
            "s",
            d2h,
            "raw device->host copy of own shards",
        ),
        Figure(
            "3a",
            "time to safe: committed in memory",
            t(lambda p: saves(p, "to_memory_s")),
            "s",
            _sum(d2h, tmpfs),
            "raw device->host copy + raw tmpfs write",
        ),
        Figure(
            "3b",
            "time to safe: replicated to a peer",
            t(lambda p: saves(p, "to_replicated_s")),
            "s",
            _sum(d2h, tmpfs, sock),
            "raw copy + tmpfs write + loopback send",
        ),
        Figure(
            "3c",
            "time to safe in memory vs Orbax durable",
            t(lambda p: saves(p, "to_memory_s")),
            "s",
            t(lambda p: saves(p, "done_s", "orbax_saves")),
            "Orbax save until committed on disk",
        ),
        bandwidth(
            "4a",
            "memory-tier write bandwidth (slab reused)",
            lambda p: _median(
                [
                    s.get("memory_write_bytes_per_s")
                    for s in p["saves"]
                    if not s["warmup"] and s.get("slab_reused")
                ]
            ),
            "prefaulted_copy",
            "memcpy into a pre-faulted tmpfs file",
            ">= 0.8",
        ),
        bandwidth(
            "4b",
            "persistence bandwidth",
            persist_bw,
            "fsync_write",
            "raw fsync'd file writes, same disk",
            ">= 0.7",
        ),
        bandwidth(
            "4c",
            "peer (replica push) bandwidth within a save",
            lambda p: saves(p, "replicate_bytes_per_s"),
            "socket",
            "raw loopback TCP, same pattern",
        ),
        Figure(
            "4d",
            "persistence: time in fsync (files, dirs)",
            t(lambda p: _median([d.get("fsync_s") for d in p.get("persist") or []])),
            "s",
            t(lambda p: _median([d.get("persist_s") for d in p.get("persist") or []])),
            "the whole persist of the part",
        ),
        bandwidth(
            "4e",
            "peer push alone (every process at once)",
            lambda p: _median([d["bytes"] / d["seconds"] for d in p.get("push_alone") or []]),
            "socket",
            "raw loopback TCP, same pattern",
            ">= 0.5",
        ),
        Figure(
            "5a",
            "restore from own memory",
            restore("memory"),
            "s",
            orbax_restore,
            "Orbax restore (persistent, cold)",
            "<= 0.33",
        ),
        Figure(
            "5b",
            "restore from peer memory",
            restore("peer"),
            "s",
            orbax_restore,
            "Orbax restore (persistent, cold)",
            "<= 0.33",
        ),
        Figure(
            "5e",
            "restore from peer memory vs its floor",
            restore("peer"),
            "s",
            _sum(restore("memory"), sock),
            "restore from own memory + raw loopback TCP of the own bytes",
        ),
        Figure(
            "5c",
            "restore from persistent (cold)",
            restore("persistent"),
            "s",
            orbax_restore,
            "Orbax restore (persistent, cold)",
        ),
        Figure(
            "5d",
            "restore from memory onto another mesh",
            restore("memory_mesh_change"),
            "s",
            restore("orbax_mesh_change"),
            "Orbax restore onto the same mesh change",
        ),
        Figure(
            "6a",
            f"host memory (peak RSS delta + tmpfs), r={replicas}",
            (rss_delta + tmpfs_steady) / state,
            "x state",
            1.0 + replicas,
            "1 + r copies of the state",
            "<= 1.1",
        ),
        Figure(
            "6b",
            f"host memory, peak during saves (memory_keep={keep}), r={replicas}",
            combined / state,
            "x state",
            (keep + 1.0) * (1.0 + replicas),
            "(memory_keep + 1)(1 + r) copies of the state",
            "<= 1.05",
        ),
        Figure(
            "6c",
            f"host memory as 6a, less the spare slabs (spare_slabs=False), r={replicas}",
            (rss_delta + tmpfs_steady - tmpfs_spare) / state,
            "x state",
            1.0 + replicas,
            "1 + r copies of the state",
        ),
        Figure(
            "6d",
            f"host memory as 6b, holding the arrays (1e's loop), r={replicas}",
            None if combined_holding is None else combined_holding / state,
            "x state",
            (keep + 1.0) * (1.0 + replicas),
            "(memory_keep + 1)(1 + r) copies of the state",
        ),
    ]


def _scale(x: float | None, by: float) -> float | None:
    return None if x is None else x / by


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or 0.01 <= abs(x) < 10_000:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return f"{x:.2e}"


def quantity(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return _table.duration(x) if unit == "s" else f"{_fmt(x)} {unit}"


def table(figs: Sequence[Figure]) -> str:
    """The figures as a plain-text table, like the `jaxckpt` command line's."""
    rows = [
        (
            f.id,
            f.name,
            quantity(f.value, f.unit),
            quantity(f.baseline, f.unit),
            f.baseline_name,
            _fmt(f.ratio),
            f.target,
            None if f.target is None else "-" if f.met is None else "yes" if f.met else "no",
        )
        for f in figs
    ]
    headers = ("#", "figure", "value", "baseline", "baseline is", "ratio", "target", "met")
    return _table.table(headers, rows, right=(2, 3, 5))


def _fs_type(path: str) -> str | None:
    """The type of the filesystem holding `path`, if known."""
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        # The longest mount point holding the path; of several at one point, the last.
        if inside and (best is None or len(mount) >= len(best[0])):
            best = (mount, part.fstype)
    return best[1] if best else None


def _cpu_model() -> str | None:
    # Neither psutil nor platform (`uname -p`, often empty on Linux) names the CPU model.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine(memory_root: str, work_dir: str) -> dict[str, Any]:
    """What the figures were measured on."""
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        usable: int | None = len(psutil.Process().cpu_affinity())
    except AttributeError:  # no CPU affinity on macOS
        usable = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": psutil.cpu_count(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "ram_bytes": psutil.virtual_memory().total,
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "versions": versions,
        "memory_root": memory_root,
        "memory_root_fs": _fs_type(memory_root),
        "persistent_dir": work_dir,
        "persistent_fs": _fs_type(work_dir),
    }
