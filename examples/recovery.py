"""What the demo checks and prints of its launcher runs: losses bit for bit, the data order
across resizes, where the restores read from, each restart's timeline (a table and a
picture) and how much the waiting hot spares slow training (``demo.py`` runs them).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TIERS = ("memory", "peer", "persistent")


@dataclasses.dataclass
class Step:
    """What process 0 logged for one training step."""

    loss: float
    data: str  # checksum of the step's global batch
    seconds: float | None = None  # since the previous step ended, its save included


@dataclasses.dataclass
class Run:
    """One launcher run: what process 0 logged per attempt, and the launcher's report."""

    name: str
    returncode: int
    seconds: float
    report: dict[str, Any]
    steps: list[dict[int, Step]]  # per attempt: step -> what process 0 logged
    processes: list[int]  # per attempt: process count
    unrestorable: list[set[int]]  # per attempt: steps whose restore failed
    save_seconds: list[float]
    log: Path


def fail(run: Run, why: str) -> None:
    """Prints why a run is unusable and the end of its log, then exits 1."""
    print(f"\nFAILED: {run.name}: {why}. Last lines of {run.log}:")
    lines = run.log.read_text().splitlines()
    noise = ('"event": "step"', '"event": "save"', "[Gloo]")
    print("\n".join(line for line in lines if not any(n in line for n in noise))[-6000:])
    raise SystemExit(1)


def plural(count: int, noun: str) -> str:
    """``1 process``, ``3 processes``."""
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("s") else "s")


def bits(x: float) -> str:
    """The exact value of a loss (a float32 widened to float64) as a hex float."""
    return x.hex()


def compare_bitwise(reference: dict[int, Step], run: Run) -> tuple[bool, list[str]]:
    """Compares every step of every attempt of ``run`` with the reference, bit for bit.

    Steps computed before the failure and again after the restore are compared both times.

    Returns:
        ``(identical, table rows)``.
    """
    seen: dict[int, list[Step]] = {}
    for steps in run.steps:
        for step, logged in steps.items():
            seen.setdefault(step, []).append(logged)
    identical = sorted(seen) == sorted(reference)
    rows = [f"    {'step':>4}  {'uninterrupted':<20}{'recovered run':<20}float32 bits"]
    for step, want in sorted(reference.items()):
        got = seen.get(step, [])
        same = bool(got) and all(bits(g.loss) == bits(want.loss) for g in got)
        identical &= same
        shown = repr(got[-1].loss) if got else "missing"
        note = "" if len(got) < 2 else f"  (computed {len(got)}x: before the failure and after)"
        rows.append(
            f"    {step:>4}  {want.loss!r:<20}{shown:<20}{bits(want.loss)}"
            f"  {'identical' if same else 'DIFFERENT'}{note}"
        )
    return identical, rows


def restart_of(run: Run, kind: str = "failures") -> dict[str, Any]:
    """The launcher's report of the first failure (or grow back) and its restart."""
    entries = run.report.get(kind) or []
    if not entries or not entries[0].get("restart"):
        fail(run, f"the launcher reports no {kind[:-1]} with a restart")
    return entries[0]


def tiers_of(restart: dict[str, Any]) -> list[str]:
    """The tiers the processes restored from, fastest first."""
    found = {e.get("tier") for e in restart["restored"].values()}
    return [t for t in TIERS if t in found] + sorted(str(t) for t in found - set(TIERS))


def print_recovery(failure: dict[str, Any]) -> None:
    """Prints the launcher's recovery report as a table."""
    restart = failure["restart"]
    per_process = "  ".join(
        f"p{i}: {e['tier']} ({e['seconds']} s)" for i, e in restart["restored"].items()
    )
    lost = restart["steps_lost"]
    print(f"  lost node            process {failure['process']} ({failure['status']}) at step"
          f" {failure['last_step']}, memory root deleted: {failure['node_lost']}")  # fmt: skip
    print(f"  detected after       {failure['detected_after_s']} s (the launcher watches its"
          " children; on a cluster JAX's heartbeat or the scheduler notices)")  # fmt: skip
    print(
        f"  restored step        {restart['restored_step']} on {plural(restart['processes'], 'process')}"
    )
    print(f"  tier per process     {per_process or 'nothing restored'}")
    print(f"  restore time         {restart['restore_seconds']} s (slowest process)")
    print(f"  steps of work lost   {lost} (recomputed after the restart)")
    print(f"  first step after     {restart['first_step_after_s']} s from the restart"
          " (jax.distributed, restore overlapped with compile, the step)")  # fmt: skip
    print_timeline(restart["timeline"])


def print_timeline(timeline: dict[str, Any]) -> None:
    """Prints the recovery timeline: per phase, the process that ended it last, as a table
    and as a picture."""
    spares = "hot spares woken" if timeline["standby"] else "processes started"
    print(f"\n  Recovery timeline (seconds from the restart: {spares}; the slowest process"
          " of each phase):")  # fmt: skip
    print(f"    {'phase':<12}{'process':>8}{'start':>9}{'end':>9}{'seconds':>9}")
    for name, span in timeline["slowest"].items():
        print(
            f"    {name:<12}{'p' + str(span['process']):>8}{span['start']:>9.3f}"
            f"{span['end']:>9.3f}{span['seconds']:>9.3f}"
        )
    print(
        f"    restore and compile overlapped {timeline['restore_compile_overlap_s']} s;"
        f" compilation cache: {timeline['compile_cache_hits']} hit(s),"
        f" {timeline['compile_cache_misses']} miss(es) of the train step over all processes"
    )
    print("\n".join(f"    {row}" for row in timeline_picture(timeline)))
    if timeline.get("kind") == "grow":
        print(
            f"    last step before the grow to first trained step after it: stopped"
            f" {timeline['stopped_after_s']} s (its last save committed, every process"
            f" exited) + restart {timeline['restart_after_s']} s + first step"
            f" {timeline['first_step_after_s']} s = {timeline['recovery_s']} s"
        )
    else:
        print(
            f"    failure to first trained step: detected {timeline['detected_after_s']} s"
            f" + restart {timeline['restart_after_s']} s + first step"
            f" {timeline['first_step_after_s']} s = {timeline['recovery_s']} s"
        )


def timeline_picture(timeline: dict[str, Any], width: int = 56) -> list[str]:
    """The timeline as text: a row per phase (its slowest process) on one time axis, from
    the failure (or the last step before a grow) to the first trained step.

    What ran before the failure (a hot spare's preparation) starts at the left edge, ``<``.
    """
    restart = float(timeline.get("restart_after_s") or 0.0)
    lead = timeline.get("stopped_after_s") or timeline.get("detected_after_s") or 0.0
    begin = -restart - float(lead)
    first = float(timeline.get("first_step_after_s") or 0.0)
    spans = [(name, s["start"], s["end"]) for name, s in timeline["slowest"].items()]
    end = max([first, *(e for _, _, e in spans)])
    scale = width / max(end - begin, 1e-6)

    def bar(start: float, stop: float) -> str:
        lo = max(0, min(width - 1, int((start - begin) * scale)))
        hi = max(lo + 1, min(width, round((stop - begin) * scale)))
        cells = [" "] * width
        for k in range(lo, hi):
            cells[k] = "#"
        if start < begin:
            cells[0] = "<"
        return "".join(cells)

    first_label = "stop" if timeline.get("kind") == "grow" else "detection"
    rows = [(first_label, begin, -restart), ("restart", -restart, 0.0)]
    rows += [(n, a, b) for n, a, b in spans if b > begin]
    zero = int(-begin * scale)
    axis = [" "] * width
    axis[min(zero, width - 1)] = "0"
    axis[width - 1] = "|"
    out = [f"{'':<12}|{''.join(axis)}  {begin:.2f} .. {end:.2f} s (0: the restart)"]
    out += [f"{name:<12}|{bar(a, b)}| {max(0.0, b - max(a, begin)):.2f} s" for name, a, b in rows]
    return out


def timeline_summary(timeline: dict[str, Any]) -> dict[str, Any]:
    """The recovery timeline of the summary line: totals and each phase's slowest process."""
    restore, compile_ = timeline["restore_s"], timeline["compile_s"]
    bound = max(restore or 0.0, compile_ or 0.0)
    first = timeline["first_step_after_s"]
    keys = (
        "kind",
        "detected_after_s",
        "stopped_after_s",
        "restart_after_s",
        "first_step_after_s",
        "recovery_s",
        "standby",
        "restore_s",
        "compile_s",
        "restore_compile_overlap_s",
        "compile_cache_hits",
        "compile_cache_misses",
    )
    return {
        **{k: timeline[k] for k in keys if k in timeline},
        # How close the restart comes to its floor: reading the state or loading the
        # executable, whichever is longer (they overlap).
        "first_step_over_max_restore_compile": (
            round(first / bound, 2) if first is not None and bound > 0 else None
        ),
        # Stricter, and the one that counts with hot spares (they compiled before the
        # failure): how much the restart adds to reading the state.
        "first_step_over_restore": (
            round(first / restore, 2) if first is not None and restore else None
        ),
        "phases": {
            name: {k: span[k] for k in ("process", "start", "end", "seconds")}
            for name, span in timeline["slowest"].items()
        },
    }


def check_resize(
    reference: dict[int, Step], restart: dict[str, Any], after: dict[int, Step], end: int
) -> dict[str, Any]:
    """Checks that a job restarted on another process count continued the same global data
    stream, restored from memory and peers only.

    Args:
        reference: The uninterrupted run's steps.
        restart: The launcher's report of the restart.
        after: What process 0 logged for the steps the restarted job trained.
        end: The last step it should have trained.

    Returns:
        The findings; ``preserved`` is the verdict.
    """
    restored = int(restart["restored_step"])
    problems = []
    if restored <= 0 or any(int(e["step"]) != restored for e in restart["restored"].values()):
        problems.append(
            f"the {restart['processes']} processes did not all restore step {restored} > 0"
            " (a restart from scratch replays the data from the beginning)"
        )
    if sorted(after) != list(range(restored + 1, end + 1)):
        problems.append(
            f"after the resize it trained steps {sorted(after)}, expected {restored + 1}..{end}"
        )
    mismatched = [s for s, got in after.items() if got.data != reference[s].data]
    if mismatched:
        problems.append(f"steps {mismatched} trained on other global batches than the reference")
    bucket = {
        p: e["bytes_by_tier"]["persistent"]
        for p, e in restart["restored"].items()
        if (e.get("bytes_by_tier") or {}).get("persistent")
    }
    if bucket:
        problems.append(f"the restore read the persistent tier (bytes per process: {bucket})")
    rel = [
        abs(got.loss - reference[s].loss) / abs(reference[s].loss)
        for s, got in after.items()
        if s in reference
    ]
    return {
        "preserved": not problems,
        "problems": problems,
        "restored_step": restored,
        "tiers": tiers_of(restart),
        "persistent_bytes": sum(bucket.values()),
        "processes": restart["processes"],
        "steps_checked": len(after) - len(mismatched),
        "max_rel_loss_diff": max(rel, default=None),
        "timeline": restart["timeline"],
    }


def step_seconds(steps: dict[int, Step], wanted: Iterable[int]) -> list[float]:
    """The logged times of the `wanted` steps (the first step of a run is no step time)."""
    return [steps[s].seconds for s in wanted if s in steps and steps[s].seconds is not None]


def slowdown(reference: dict[int, Step], windows: list[tuple[dict[int, Step], range]]) -> Any:
    """The median step time of runs with spares over the same steps of the reference.

    Args:
        reference: The uninterrupted run (no spares).
        windows: Steps of runs with spares, and which of their steps to compare.

    Returns:
        ``{"ratio", "with_s", "without_s", "steps"}``, or None without steps to compare.
    """
    with_spares = [t for steps, span in windows for t in step_seconds(steps, span)]
    without = [t for _, span in windows for t in step_seconds(reference, span)]
    if not with_spares or not without:
        return None
    a, b = statistics.median(with_spares), statistics.median(without)
    return {
        "ratio": round(a / b, 3),
        "with_s": round(a, 4),
        "without_s": round(b, 4),
        "steps": len(with_spares),
    }


def cpu_share(attempts: list[dict[str, Any]]) -> dict[str, float] | None:
    """The CPU seconds the spares used while these attempts trained, over the job's
    (the launcher's ``cpu_s`` of each attempt): the bound of their slowdown on CPUs the
    job keeps busy."""
    used = [a["cpu_s"] for a in attempts if a.get("cpu_s")]
    job, spares = sum(c["job"] for c in used), sum(c["standby"] for c in used)
    if not used or job <= 0:
        return None
    return {"share": round(spares / job, 4), "standby_cpu_s": spares, "job_cpu_s": job}
