"""What a run measured, per tier: the save cost C, the restore time R, and the step time.

The costs come from the step manifests the handler writes (`metrics`). R is
the whole downtime of a failure, not only the read: detection, restarting the
processes, `jax.distributed`, the restore, compiling the train step, the first
step. It comes, in this order, from `--restore-seconds`, from the restarts a
launcher report measured (`python -m jaxckpt.launch --json`, the recovery
timeline of each restart: `restarts_from_launch_report`), or from the part
bytes over a measured bandwidth plus a restart cost (the one the report measured
outside the read, else `--restart-seconds`). Every number says where it came from.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxckpt.format import _format
from jaxckpt.tools import _catalog, _table


@dataclasses.dataclass(frozen=True)
class TierCost:
    """Cost and restore time of one tier, and where each number came from."""

    tier: str
    cost_s: float
    cost_from: str
    restore_s: float
    restore_from: str


def _num(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _median_of_max(per_step: list[list[float]]) -> float | None:
    """The slowest process sets a step's cost; the median over steps resists outliers."""
    values = [max(v) for v in per_step if v]
    return statistics.median(values) if values else None


def _recorded_persist_s(part_dir: Path) -> float | None:
    """The persistence time the persisted copy's manifest records, if any."""
    try:
        metrics = json.loads((part_dir / _format.MANIFEST_FILE).read_text()).get("metrics", {})
        return _num(metrics, "persist_s")
    except (OSError, ValueError, AttributeError):
        return None


def _persist_s_from_files(part_dir: Path) -> float | None:
    """A persisted part's copy time from its files: the persister writes the manifest last."""
    try:
        first = min(p.stat().st_mtime for p in part_dir.rglob("*") if p.is_file())
        return max(0.0, (part_dir / _format.MANIFEST_FILE).stat().st_mtime - first)
    except (OSError, ValueError):
        return None


def _persistent_cost(
    infos: list[_catalog.StepInfo], per_process: float, bytes_per_s: float | None
) -> tuple[float | None, str]:
    """(cost, where it came from) of persisting a step; None when nothing tells."""
    durable = [
        [i.item_dir / _format.part_dir_name(o) for o in i.owners]
        for i in infos
        if i.durable and i.item_dir is not None
    ]
    per_step = [
        [t for p in parts if (t := _recorded_persist_s(p)) is not None] for parts in durable
    ]
    if (cost := _median_of_max(per_step)) is not None:
        used = sum(1 for v in per_step if v)
        return cost, f"median over {used} persisted step(s) of the slowest persist_s"
    if bytes_per_s:
        given = f"given {_size_rate(bytes_per_s)}"
        return (
            per_process / bytes_per_s,
            f"estimate: {_table.size(per_process)} per process / {given}",
        )
    per_step = [
        [t for p in parts if (t := _persist_s_from_files(p)) is not None] for parts in durable
    ]
    if (cost := _median_of_max(per_step)) is not None:
        return cost, f"file times of {len(durable)} persisted step(s) (no persist_s recorded)"
    return None, ""


# ---- measured restarts ---------------------------------------------------------------

TIER_ORDER = ("memory", "peer", "persistent")  # a restart is as slow as its slowest tier


@dataclasses.dataclass(frozen=True)
class MeasuredRestarts:
    """Restarts a launcher measured, from failure to the first trained step.

    Attributes:
      total_s: Tier -> median downtime of the restarts that restored from it (the
        slowest tier any process read from): detection + restart + first step.
      read_s: Median time of the restore itself (the slowest process's).
      overhead_s: Median downtime outside the restore (detection, process start,
        `jax.distributed`, the compilation the restore did not hide, the first step):
        what a restore from another tier costs on top of its read.
      counts: Tier -> number of restarts measured.
      source: Where they came from (file names).
    """

    total_s: dict[str, float]
    read_s: float
    overhead_s: float
    counts: dict[str, int]
    source: str


def _restart_tier(restart: Mapping[str, Any]) -> str | None:
    tiers = {str(e.get("tier")) for e in (restart.get("restored") or {}).values()}
    known = [t for t in TIER_ORDER if t in tiers]
    return known[-1] if known else None


def restarts_from_launch_report(
    reports: Iterable[tuple[str, Mapping[str, Any]]],
) -> MeasuredRestarts:
    """The restart downtimes measured in launcher reports (``--json``).

    Args:
      reports: ``(name, report)`` pairs; the name is only quoted.

    Raises:
      ValueError: if no report holds a restart that trained a step after its restore.
    """
    totals: dict[str, list[float]] = {}
    reads: list[float] = []
    overheads: list[float] = []
    names = []
    for name, report in reports:
        names.append(name)
        failures = report.get("failures") if isinstance(report, Mapping) else None
        for failure in failures if isinstance(failures, list) else []:
            restart = failure.get("restart") if isinstance(failure, Mapping) else None
            if not isinstance(restart, Mapping) or restart.get("outcome") != "ok":
                continue
            timeline = restart.get("timeline") or {}
            total = _num(timeline, "recovery_s")
            if total is None:  # a report from before the timeline: no restart_after_s
                first, detected = (
                    _num(restart, "first_step_after_s"),
                    _num(failure, "detected_after_s"),
                )
                total = first + (detected or 0.0) if first is not None else None
            tier = _restart_tier(restart)
            if total is None or tier is None:
                continue
            read = _num(timeline, "restore_s") or _num(restart, "restore_seconds") or 0.0
            totals.setdefault(tier, []).append(total)
            reads.append(read)
            overheads.append(max(0.0, total - read))
    if not reads:
        raise ValueError(
            f"No restart in {', '.join(names) or 'the launch reports'} trained a step after "
            "restoring a checkpoint, so none gives a restart time; inject one with "
            "`python -m jaxckpt.launch --kill P@S --json FILE ...` or pass --restart-seconds."
        )
    return MeasuredRestarts(
        total_s={t: statistics.median(v) for t, v in totals.items()},
        read_s=statistics.median(reads),
        overhead_s=statistics.median(overheads),
        counts={t: len(v) for t, v in totals.items()},
        source=", ".join(names),
    )


# ---- per-tier costs -------------------------------------------------------------------


def measure(
    catalog: _catalog.Catalog,
    *,
    last: int = 50,
    persist_bytes_per_s: float | None = None,
    restart_s: float = 0.0,
    restore_s: Mapping[str, float] | None = None,
    restarts: MeasuredRestarts | None = None,
) -> tuple[list[TierCost], float | None, str, list[str]]:
    """Per-tier costs from the newest `last` finalized steps' manifests.

    R per tier: `restore_s` if given; else the measured `restarts` of that tier; else
    the read estimated from a bandwidth plus the restart overhead (`restarts`' measured
    one, else `restart_s`).

    Returns:
      (tier costs, step seconds or None, where the step time came from, notes).
    """
    infos = [catalog.step(s) for s in sorted(catalog.step_dirs)[-last:]]
    infos = [i for i in infos if i.index]
    saves = _SaveMetrics.of(infos)
    per_process = saves.per_process
    restore = _RestoreEstimate.of(per_process, restart_s, restore_s, restarts)
    notes: list[str] = []
    costs: list[TierCost] = []

    def add(tier: str, cost: float, cost_from: str, bw: float | None, bw_name: str) -> None:
        costs.append(TierCost(tier, cost, cost_from, *restore.seconds(tier, bw, bw_name)))

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    n = f"median over {len(infos)} step(s) of the slowest process's"
    mem = _median_of_max(saves.stall)
    if mem is None:
        notes.append("No stall_s in the manifests: the memory and peer tiers cannot be costed.")
    else:
        add(
            "memory",
            mem,
            f"{n} stall_s",
            median(saves.bandwidth["memory"]),
            "memory write bandwidth",
        )
    if (cost := _median_of_max(saves.peer)) is not None:
        bw = median(saves.bandwidth["peer"])
        add("peer", cost, f"{n} stall_s + replicate_s", bw, "replication bandwidth")
    elif mem is not None:
        notes.append("No replicate_s in the manifests (replicas=0?): no peer tier row.")
    persist, persist_from = _persistent_cost(infos, per_process, persist_bytes_per_s)
    if persist is None:
        notes.append("No persisted step and no --persist-mbps: no persistent tier row.")
    else:
        bw = per_process / persist if persist > 0 else None
        add("persistent", persist, persist_from, bw, "persist bandwidth (reads assumed as fast)")
    step_s, step_from = _step_seconds(infos)
    return costs, step_s, step_from, notes


@dataclasses.dataclass(frozen=True)
class _SaveMetrics:
    """What the steps' manifests say of their saves: per step, each process's stall and
    stall + replication seconds; the largest process's bytes (median over the steps); the
    bandwidths the saves measured."""

    stall: list[list[float]]
    peer: list[list[float]]
    per_process: float
    bandwidth: dict[str, list[float]]

    @classmethod
    def of(cls, infos: list[_catalog.StepInfo]) -> _SaveMetrics:
        stall, peer, sizes = [], [], []
        bandwidth: dict[str, list[float]] = {"memory": [], "peer": []}
        for info in infos:
            ms = [m.metrics for m in info.index.values()]
            stall.append([v for m in ms if (v := _num(m, "stall_s")) is not None])
            peer.append(
                [
                    (_num(m, "stall_s") or 0.0) + r
                    for m in ms
                    if (r := _num(m, "replicate_s")) is not None
                ]
            )
            sizes.append([float(m.nbytes) for m in info.index.values()])
            bandwidth["memory"] += [v for m in ms if (v := _num(m, "memory_write_bytes_per_s"))]
            bandwidth["peer"] += [v for m in ms if (v := _num(m, "replicate_bytes_per_s"))]
        return cls(stall, peer, _median_of_max(sizes) or 0.0, bandwidth)


@dataclasses.dataclass(frozen=True)
class _RestoreEstimate:
    """Where a tier's restore time R comes from, in `measure`'s order: given, measured
    restarts, or the bytes over a bandwidth plus the restart overhead."""

    per_process: float
    restart_s: float
    given: dict[str, float]
    restarts: MeasuredRestarts | None
    extra: str  # what the estimate adds to the read, said after it

    @classmethod
    def of(
        cls,
        per_process: float,
        restart_s: float,
        restore_s: Mapping[str, float] | None,
        restarts: MeasuredRestarts | None,
    ) -> _RestoreEstimate:
        if restarts is not None:
            restart_s = restarts.overhead_s
            extra = (
                f" + {_table.duration(restart_s)} measured restart outside the read"
                f" (median, {restarts.source})"
            )
        else:
            extra = f" + {_table.duration(restart_s)} restart" if restart_s else ""
        return cls(per_process, restart_s, dict(restore_s or {}), restarts, extra)

    def seconds(self, tier: str, bw: float | None, bw_name: str) -> tuple[float, str]:
        """R of `tier` (`bw`: its read bandwidth, if measured) and where it came from."""
        restarts = self.restarts
        if tier in self.given:
            return self.given[tier], "given (--restore-seconds)"
        if restarts is not None and tier in restarts.total_s:
            return restarts.total_s[tier], (
                f"measured: median of {restarts.counts[tier]} restart(s) from {tier} in"
                f" {restarts.source}, failure to first trained step"
            )
        if bw:
            per_process = self.per_process
            return per_process / bw + self.restart_s, (
                f"estimate: {_table.size(per_process)} per process / {_size_rate(bw)}"
                f" {bw_name}{self.extra}"
            )
        return self.restart_s, "unknown (no bandwidth measured); pass --restore-seconds"


def _size_rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{_table.size(bytes_per_s)}/s"


def _step_seconds(infos: list[_catalog.StepInfo]) -> tuple[float | None, str]:
    """Seconds per training step from the save times of consecutive saved steps."""
    rates = []
    for a, b in itertools.pairwise(infos):
        if a.created is not None and b.created is not None and b.created > a.created:
            rates.append((b.created - a.created) / (b.step - a.step))
    if not rates:
        return None, "unknown (fewer than two saved steps); pass --step-seconds"
    return statistics.median(rates), f"median over {len(rates)} pairs of consecutive saves"
