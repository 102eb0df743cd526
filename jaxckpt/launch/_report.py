"""What the launcher reports of each restart: after a failure, or to grow the job back.

One JSON-able record per failure (`failure_report`) and per grow back (`grow_report`),
each with the restart that followed and its recovery timeline (`_timeline`), and one
human-readable paragraph of each (`format_failure`, `format_grow`). Imports neither jax
nor the rest of jaxckpt.
"""

from __future__ import annotations

import signal
from typing import Any

from jaxckpt.launch._attempt import Attempt
from jaxckpt.launch._timeline import format_timeline, restart_timeline


def describe_returncode(code: int | None) -> str:
    """Describes a return code as ``exit N`` or the signal name."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
    return f"killed by {name}"


def failure_report(failed: Attempt, after: Attempt | None, node_lost: bool) -> dict[str, Any]:
    """Summarizes one failure and the restart that followed it."""
    report: dict[str, Any] = {
        "attempt": failed.index,
        "process": failed.process,
        "kind": failed.outcome,
        "status": describe_returncode(failed.returncode),
        "detected_after_s": failed.detected_after_s,
        "last_step": failed.last_step,
        "node_lost": node_lost,
    }
    if after is not None:
        restart_after = (
            round(after.started_at - failed.detected_at, 3)
            if failed.detected_at is not None
            else None
        )
        report["restart"] = _restart(failed, after, failed.detected_after_s, None, restart_after)
    return report


def grow_report(stopped: Attempt, after: Attempt, added: list[int]) -> dict[str, Any]:
    """Summarizes one grow back: the job stopped at a save, restarted on more nodes."""
    stop_s = (
        round(stopped.ended_at - stopped.last_step_at, 3)
        if stopped.last_step_at is not None
        else None
    )
    return {
        "attempt": stopped.index,
        "kind": "grow",
        "from_processes": stopped.num_processes,
        "to_processes": after.num_processes,
        "nodes_added": added,
        "last_step": stopped.last_step,
        "stop_requested_after_s": (
            round(stopped.stop_requested_at - stopped.started_at, 3)
            if stopped.stop_requested_at is not None
            else None
        ),
        "stopped_after_s": stop_s,
        "restart": _restart(
            stopped, after, None, stop_s, round(after.started_at - stopped.ended_at, 3)
        ),
    }


def _restart(
    before: Attempt,
    after: Attempt,
    detected_after_s: float | None,
    stopped_after_s: float | None,
    restart_after_s: float | None,
) -> dict[str, Any]:
    """The restart that followed `before`: what it restored and its timeline."""
    steps = [int(after.restored.get(i, {}).get("step", 0)) for i in range(after.num_processes)]
    restored_step = min(steps, default=0)
    return {
        "attempt": after.index,
        "processes": after.num_processes,
        "nodes": list(after.nodes),
        "restored": {
            str(i): {k: e.get(k) for k in ("step", "tier", "seconds", "bytes_by_tier")}
            for i, e in sorted(after.restored.items())
        },
        "restored_step": restored_step,
        "restore_seconds": max(
            (e.get("seconds") or 0.0 for e in after.restored.values()), default=None
        ),
        "steps_lost": before.last_step - restored_step,
        "first_step_after_s": after.first_step_s,
        "outcome": after.outcome,
        "timeline": restart_timeline(
            detected_after_s=detected_after_s,
            stopped_after_s=stopped_after_s,
            restart_after_s=restart_after_s,
            first_step_after_s=after.first_step_s,
            started_at=after.started_at,
            timelines=after.timelines,
            restored=after.restored,
            standby=after.standby,
        ),
    }


def format_failure(report: dict[str, Any]) -> str:
    """Renders a failure report as a few human-readable lines."""
    text = (
        f"failure in attempt {report['attempt']}: process {report['process']} {report['kind']}"
        f" ({report['status']}), last step {report['last_step']},"
        f" detected after {report['detected_after_s']} s"
        + (", node memory deleted" if report["node_lost"] else "")
    )
    return text + _format_restart(report.get("restart"))


def format_grow(report: dict[str, Any]) -> str:
    """Renders a grow report as a few human-readable lines."""
    nodes = ", ".join(f"node{k}" for k in report["nodes_added"])
    text = (
        f"grow back in attempt {report['attempt']}: {nodes} registered; the job of"
        f" {report['from_processes']} processes stopped after its save of step"
        f" {report['last_step']}, {report['stopped_after_s']} s after its last step"
    )
    return text + _format_restart(report["restart"])


def _format_restart(restart: dict[str, Any] | None) -> str:
    if restart is None:
        return "\n  no restart"
    tiers = ", ".join(
        f"p{i}: step {e['step']} from {e['tier']}" for i, e in restart["restored"].items()
    )
    return (
        f"\n  restart (attempt {restart['attempt']}, {restart['processes']} processes):"
        f" restored step {restart['restored_step']} [{tiers or 'nothing restored'}],"
        f" restore {restart['restore_seconds']} s, steps lost {restart['steps_lost']},"
        f" first step {restart['first_step_after_s']} s after start, {restart['outcome']}"
        f"\n  {format_timeline(restart['timeline'])}"
    )
