"""The recovery timeline as a picture: a Gantt chart from the failure to the first step.

`python -m jaxckpt.launch --timeline-png FILE.png` draws, for every restart of the run
(one panel each), what `_timeline.restart_timeline` computed: the launcher's own row
(the failure's detection, then the restart) before the new attempt starts at 0 s, and
one row per process with its phases (jax_init, restore, compile, first_step, ...) at
their offsets from that start. Phases that ran at the same time (a restore beside the
compile) share the row in lanes. A dashed line marks the job's first trained step.
Needs matplotlib (the `plot` extra); nothing imports this module unless a picture is
asked for. The PNG is deterministic for a given report (no timestamp in its metadata).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from jaxckpt.launch._timeline import PHASES

# One color per usual phase (the launcher's own two first); others are grey.
_COLORS: Final = {
    "detection": "#b71c1c",
    "stop": "#6a1b9a",
    "restart": "#ef9a9a",
    "startup": "#cfd8dc",
    "jax_init": "#90a4ae",
    "task": "#b0bec5",
    "setup": "#78909c",
    "compile": "#ffb300",
    "warm_up": "#ffe082",
    "standby": "#eceff1",
    "manager": "#8d6e63",
    "restore": "#1e88e5",
    "init": "#43a047",
    "first_step": "#2e7d32",
}
_OTHER: Final = "#bdbdbd"
_METADATA: Final = {"Software": None}  # no matplotlib version in the file


def require_matplotlib() -> None:
    """Raises ImportError with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "Pictures need matplotlib: pip install 'jaxckpt[plot]' (or matplotlib>=3.8)."
        ) from e


def pyplot() -> Any:
    """`matplotlib.pyplot`, drawing to files only (no display); the one set-up of the
    launcher's and the benchmark's pictures.

    Raises:
      ImportError: if matplotlib is not installed (says what to install).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _lanes(spans: Sequence[tuple[str, float, float]]) -> list[int]:
    """A lane for each span, so that no two spans of one lane overlap (in order)."""
    ends: list[float] = []
    out = []
    for _, start, end in spans:
        for lane, last in enumerate(ends):
            if start >= last - 1e-9:
                ends[lane] = end
                out.append(lane)
                break
        else:
            ends.append(end)
            out.append(len(ends) - 1)
    return out


def _rows(timeline: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, float, float]]]]:
    """(row label, [(phase, start, end)]) from top to bottom: the launcher, then processes."""
    launcher: list[tuple[str, float, float]] = []
    restart = timeline.get("restart_after_s")
    grow = timeline.get("kind") == "grow"
    lead = timeline.get("stopped_after_s" if grow else "detected_after_s")
    if restart is not None:
        launcher.append(("restart", -float(restart), 0.0))
        if lead is not None:
            name = "stop" if grow else "detection"
            launcher.insert(0, (name, -float(restart) - float(lead), -float(restart)))
    rows = [("launcher", launcher)] if launcher else []
    processes = timeline.get("processes", {})
    for key in sorted(processes, key=int):
        entry = processes[key]
        spans = [
            (name, float(s["start"]), float(s["end"]))
            for name, s in entry.get("phases", {}).items()
            if not (name in ("startup", "standby") and s["end"] <= 0)  # a spare's past
        ]
        label = f"process {key}"
        tier = (entry.get("restored") or {}).get("tier")
        if tier:
            label += f"\n(from {tier})"
        rows.append((label, sorted(spans, key=lambda s: s[1])))
    return rows


def _window(timeline: Mapping[str, Any]) -> tuple[float, float] | None:
    """The x range to show: with hot spares, from just before the failure (their
    preparation, long before it, is cut at the left edge); else None (all of it)."""
    if not timeline.get("standby"):
        return None
    spans = [(start, end) for _, row in _rows(timeline) for _, start, end in row]
    first = float(timeline.get("first_step_after_s") or 0.0)
    end = max([first, *(e for _, e in spans)])
    lead = timeline.get("stopped_after_s") or timeline.get("detected_after_s") or 0
    failure = -float(timeline.get("restart_after_s") or 0) - float(lead)
    pad = 0.08 * (end - failure) or 1.0
    return failure - pad, end + pad


def _draw(ax: Any, timeline: Mapping[str, Any], title: str) -> set[str]:
    rows = _rows(timeline)
    window = _window(timeline)
    width = window[1] - window[0] if window else _width(timeline)
    used: set[str] = set()
    for y, (_, spans) in enumerate(rows):
        lanes = _lanes(spans)
        count = max(lanes, default=0) + 1
        height = 0.76 / count
        for (name, start, end), lane in zip(spans, lanes, strict=True):
            bottom = y - 0.38 + lane * height
            # A hot spare's preparation ended before the attempt started: off the
            # restart's path, drawn faint.
            ax.broken_barh(
                [(start, max(end - start, 1e-3))],
                (bottom, height * 0.92),
                facecolors=_COLORS.get(name, _OTHER),
                edgecolor="white",
                linewidth=0.5,
                alpha=0.35 if end <= 0 and y > 0 else 1.0,
            )
            used.add(name)
            text = f"{name} {end - start:.2g} s"
            shown = (max(start, window[0]), min(end, window[1])) if window else (start, end)
            if shown[1] - shown[0] >= len(text) * width / 140:  # room: ~140 chars across
                ax.text(
                    (shown[0] + shown[1]) / 2,
                    bottom + height * 0.46,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the launcher on top
    ax.axvline(0.0, color="black", linewidth=0.8)
    first = timeline.get("first_step_after_s")
    if first is not None:
        ax.axvline(float(first), color="#2e7d32", linestyle="--", linewidth=1.0)
        ax.annotate(
            f"first step +{float(first):.2f} s",
            (float(first), -0.5),
            xytext=(3, -2),
            textcoords="offset points",
            va="top",
            fontsize=7,
            color="#2e7d32",
        )
    if window:
        ax.set_xlim(*window)
        title += "\n(hot spares: what they did before the failure is cut at the left edge)"
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", color="#e0e0e0")
    ax.set_axisbelow(True)
    return used


def _width(timeline: Mapping[str, Any]) -> float:
    """Seconds the drawn spans cover, from the earliest start to the latest end."""
    spans = [(start, end) for _, row in _rows(timeline) for _, start, end in row]
    first = timeline.get("first_step_after_s") or 0.0
    low = min([0.0, *(s for s, _ in spans)])
    return max([first, *(e for _, e in spans)]) - low or 1.0


def _title(failure: Mapping[str, Any]) -> str:
    restart, timeline = failure["restart"], failure["restart"]["timeline"]
    if failure.get("kind") == "grow":
        return (
            f"attempt {failure.get('attempt')}: grow back from {failure.get('from_processes')}"
            f" to {restart.get('processes')} processes after the save of step"
            f" {failure.get('last_step')}, restored step {restart.get('restored_step')};"
            f" last step to first step {timeline.get('recovery_s')} s"
        )
    lost = "node lost" if failure.get("node_lost") else str(failure.get("kind"))
    recovery = timeline.get("recovery_s")
    spares = ", hot spares" if timeline.get("standby") else ""
    return (
        f"attempt {failure.get('attempt')}: process {failure.get('process')} failed ({lost}) "
        f"at step {failure.get('last_step')}; restart with {restart.get('processes')} "
        f"processes{spares}, restored step {restart.get('restored_step')}; failure to first "
        f"step {recovery if recovery is not None else '?'} s"
    )


def plot(report: Mapping[str, Any], path: str | Path) -> Path:
    """Draws the recovery timeline of every restart in a launcher report as a PNG.

    Args:
      report: what `python -m jaxckpt.launch --json` writes (its `failures` and
        `grows`, in the order they happened).
      path: where the PNG goes.

    Returns:
      The path written.

    Raises:
      ImportError: if matplotlib is not installed (says what to install).
      ValueError: if the report has no restart with a timeline.
    """
    plt = pyplot()
    from matplotlib.patches import Patch

    events = sorted(
        [*report.get("failures", []), *report.get("grows", [])], key=lambda e: e.get("attempt", 0)
    )
    failures = [f for f in events if (f.get("restart") or {}).get("timeline")]
    if not failures:
        raise ValueError("The launcher report has no restart with a recovery timeline.")
    heights = [1 + len(_rows(f["restart"]["timeline"])) * 0.55 for f in failures]
    fig, axes = plt.subplots(
        len(failures),
        1,
        figsize=(11, 0.9 + sum(heights)),
        dpi=100,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    try:
        used: set[str] = set()
        for ax, failure in zip(axes[:, 0], failures, strict=True):
            used |= _draw(ax, failure["restart"]["timeline"], _title(failure))
        axes[-1, 0].set_xlabel(
            "seconds from the start of the new attempt (the failure, or the stop, is left of 0)"
        )
        order = ["detection", "stop", "restart", *PHASES]
        names = [n for n in order if n in used] + sorted(used - set(order))
        fig.legend(
            handles=[Patch(color=_COLORS.get(n, _OTHER), label=n) for n in names],
            loc="lower center",
            ncol=min(len(names), 7),
            fontsize=8,
            frameon=False,
            bbox_to_anchor=(0.5, 0.0),
        )
        fig.suptitle("jaxckpt.launch: recovery timeline", fontsize=10, x=0.01, ha="left")
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        out = Path(path)
        fig.savefig(out, format="png", metadata=_METADATA)
        return out
    finally:
        plt.close(fig)
