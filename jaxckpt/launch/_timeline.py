"""The recovery timeline: from a failure, or the stop before a grow back, to the restarted
job's first trained step.

Each process of a launched job may print one ``timeline`` event after its first trained
step (`_events.TimelineEvent`; the examples do), with the wall-clock (``time.time()``)
start and end of each phase of its start: the usual phases (`_events.PHASES`) in their
order, then any other name. This module turns them into offsets from the start of the
attempt (when the launcher started, or woke, its processes) and names the slowest process
of each phase: a JAX job moves at the pace of its slowest process. Imports neither jax nor
the rest of jaxckpt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxckpt.launch._events import PHASES


def _ordered(names: set[str]) -> list[str]:
    return [p for p in PHASES if p in names] + sorted(names - set(PHASES))


def process_phases(event: Mapping[str, Any], started_at: float) -> dict[str, dict[str, float]]:
    """A process's phases as offsets (seconds) from ``started_at``, in order.

    Malformed phases (not a ``[start, end]`` pair of numbers) are left out.
    """
    raw = event.get("phases")
    if not isinstance(raw, Mapping):
        return {}
    phases = {}
    for name in _ordered({str(k) for k in raw}):
        span = raw[name]
        if (
            isinstance(span, (list, tuple))
            and len(span) == 2
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in span)
        ):
            start, end = float(span[0]), float(span[1])
            phases[name] = {
                "start": round(start - started_at, 3),
                "end": round(end - started_at, 3),
                "seconds": round(end - start, 3),
            }
    return phases


def overlap_s(a: Mapping[str, float] | None, b: Mapping[str, float] | None) -> float:
    """Seconds during which two phases (offsets) both ran; 0 if either is missing."""
    if not a or not b:
        return 0.0
    return round(max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"])), 3)


def restart_timeline(
    *,
    detected_after_s: float | None,
    stopped_after_s: float | None = None,
    restart_after_s: float | None,
    first_step_after_s: float | None,
    started_at: float,
    timelines: Mapping[int, Mapping[str, Any]],
    restored: Mapping[int, Mapping[str, Any]],
    standby: bool,
) -> dict[str, Any]:
    """The timeline of one restart, per process and its slowest process per phase.

    Args:
        detected_after_s: From the failed process's last sign of life to its detection
            (a restart after a failure).
        stopped_after_s: Instead, for a grow back: from the last trained step of the job
            asked to stop to the exit of its last process (its last save committed).
        restart_after_s: From the detection (or the exit) to the start of the new attempt
            (stopping the old processes, collecting their output, deleting a lost
            node's memory).
        first_step_after_s: From the start of the new attempt to its first ``step`` event.
        started_at: Wall-clock start of the new attempt.
        timelines: Process -> its ``timeline`` event.
        restored: Process -> its ``restored`` event (tier and bytes per tier).
        standby: Whether the new attempt woke hot spares instead of starting processes.

    Returns:
        JSON-able: ``kind`` (``failure`` or ``grow``), ``recovery_s`` (failure, or the
        last trained step before a grow, to the first trained step, as far as measured),
        ``processes`` (per process: phases as ``{start, end, seconds}`` offsets, the
        compile's cache counts, the restore's tier and bytes), ``slowest`` (per phase: the
        process that ended it last, and the longest duration), and ``restore_s``,
        ``compile_s`` and ``restore_compile_overlap_s`` of the slowest processes.
    """
    processes = _processes(timelines, restored, started_at)
    slowest: dict[str, dict[str, Any]] = {}
    names = {name for p in processes.values() for name in p["phases"]}
    for name in _ordered(names):
        spans = {i: p["phases"][name] for i, p in processes.items() if name in p["phases"]}
        last = max(spans, key=lambda i: spans[i]["end"])
        slowest[name] = {
            **spans[last],
            "process": int(last),
            "max_seconds": max(s["seconds"] for s in spans.values()),
        }
    grow = stopped_after_s is not None
    parts = (stopped_after_s if grow else detected_after_s, restart_after_s, first_step_after_s)
    restore, compile_ = slowest.get("restore"), slowest.get("compile")
    return {
        "kind": "grow" if grow else "failure",
        "detected_after_s": detected_after_s,
        **({"stopped_after_s": stopped_after_s} if grow else {}),
        "restart_after_s": restart_after_s,
        "first_step_after_s": first_step_after_s,
        "recovery_s": round(sum(parts), 3) if None not in parts else None,  # type: ignore[arg-type]
        "standby": standby,
        "restore_s": restore["max_seconds"] if restore else None,
        "compile_s": compile_["max_seconds"] if compile_ else None,
        "restore_compile_overlap_s": min(
            (
                overlap_s(p["phases"].get("restore"), p["phases"].get("compile"))
                for p in processes.values()
            ),
            default=0.0,
        ),
        "compile_cache_hits": _sum(processes, "cache_hits"),
        "compile_cache_misses": _sum(processes, "cache_misses"),
        "slowest": slowest,
        "processes": processes,
    }


def _processes(
    timelines: Mapping[int, Mapping[str, Any]],
    restored: Mapping[int, Mapping[str, Any]],
    started_at: float,
) -> dict[str, dict[str, Any]]:
    """Per process: its phases from `started_at`, its compile's cache counts and the
    handler's own restore time, and what it restored."""
    processes: dict[str, dict[str, Any]] = {}
    for i in sorted(set(timelines) | set(restored)):
        event = timelines.get(i, {})
        entry: dict[str, Any] = {"phases": process_phases(event, started_at)}
        for key in ("compile", "restore"):
            if isinstance(event.get(key), Mapping):
                entry[key] = dict(event[key])
        if i in restored:
            entry["restored"] = {
                k: restored[i].get(k) for k in ("step", "tier", "seconds", "bytes_by_tier")
            }
        processes[str(i)] = entry
    return processes


def _sum(processes: Mapping[str, Mapping[str, Any]], key: str) -> int | None:
    values = [p["compile"].get(key) for p in processes.values() if "compile" in p]
    counted = [v for v in values if isinstance(v, int)]
    return sum(counted) if counted else None


def format_timeline(timeline: Mapping[str, Any]) -> str:
    """One line: the slowest process's end of each phase, from the restart's start."""
    parts = [
        f"{name} {span['seconds']} s (p{span['process']}, ends +{span['end']} s)"
        for name, span in timeline["slowest"].items()
        if name not in ("startup", "standby") or span["end"] > 0
    ]
    cache = ""
    if timeline.get("compile_cache_hits") is not None:
        cache = f"; compilation cache {timeline['compile_cache_hits']} hit(s)"
        if timeline.get("compile_cache_misses") is not None:
            cache += f", {timeline['compile_cache_misses']} miss(es)"
    grow = timeline.get("kind") == "grow"
    lead = (
        f"stopped {timeline.get('stopped_after_s')} s after its last step"
        if grow
        else f"detected {timeline['detected_after_s']} s"
    )
    return (
        f"timeline{' (hot spares)' if timeline['standby'] else ''}: {lead},"
        f" restarted +{timeline['restart_after_s']} s, "
        + (", ".join(parts) or "no timeline events")
        + f"; first step +{timeline['first_step_after_s']} s{cache};"
        f" {'last step to first step' if grow else 'failure to first step'}"
        f" {timeline['recovery_s']} s"
    )
