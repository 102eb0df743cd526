"""`jaxckpt bench --plot FILE.png`: every figure's ratio to its baseline, and its target.

One horizontal bar per figure, on a logarithmic axis (ratios run from 0.01 to a few):
the bar ends at the figure's ratio, the line at 1 is the baseline it was measured
against, and a figure with a target carries a mark there, the bar green where the
target is met and red where it is not. Figures without a ratio are left out. Needs
matplotlib (the `plot` extra); imported only when a plot is asked for. The PNG is
deterministic for a given report (no timestamp in its metadata).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from jaxckpt.bench import _figure
from jaxckpt.launch import _timeline_plot

_MET: Final = "#2e7d32"
_MISSED: Final = "#c62828"
_NO_TARGET: Final = "#90a4ae"
# A PNG's metadata names the matplotlib version by default: the same report would
# then give different files on different installs.
_METADATA: Final = {"Software": None}


def _subtitle(report: Mapping[str, Any]) -> str:
    cfg, state, machine = report.get("config", {}), report.get("state", {}), report.get("machine")
    parts = []
    if state.get("state_bytes"):
        parts.append(f"state {state['state_bytes'] / 2**30:.3g} GiB")
    if cfg:
        parts.append(f"{cfg.get('processes')} processes, r = {cfg.get('replicas')}")
    if machine:
        cpus = machine.get("cpus_usable") or machine.get("cpu_count")
        parts.append(f"{cpus} CPUs")
        parts.append(str(machine.get("date", ""))[:16].replace("T", " "))
    return ", ".join(p for p in parts if p)


def plot(report: Mapping[str, Any], path: str | Path) -> Path:
    """Writes the figures of a benchmark report (as `--json` writes it) as a PNG.

    Args:
      report: the report; only its `figures` (and, for the subtitle, `config`,
        `state` and `machine`) are read.
      path: where the PNG goes.

    Returns:
      The path written.

    Raises:
      ImportError: if matplotlib is not installed (says what to install).
      ValueError: if the report has no figure with a ratio.
    """
    plt = _timeline_plot.pyplot()

    figs = [f for f in report.get("figures", []) if _finite(f.get("ratio"))]
    if not figs:
        raise ValueError("The benchmark report has no figure with a ratio to plot.")
    figs = list(reversed(figs))  # the first figure on top
    ratios = [float(f["ratio"]) for f in figs]
    bounds = [_bound(f.get("target")) for f in figs]
    low = min([*ratios, *(b for b in bounds if b), 1.0])
    high = max([*ratios, *(b for b in bounds if b), 1.0])
    left, right = low / 2, 10 ** math.ceil(math.log10(high) + 0.1)

    height = 1.2 + 0.34 * len(figs)
    fig, ax = plt.subplots(figsize=(11, height), dpi=100)
    try:
        ys = range(len(figs))
        ax.barh(ys, ratios, left=left, height=0.62, color=[_color(f) for f in figs], zorder=2)
        ax.axvline(1.0, color="black", linewidth=1.0, zorder=3)
        for y, f, ratio, bound in zip(ys, figs, ratios, bounds, strict=True):
            _annotate(ax, y, f, ratio, bound)
        ax.set_yticks(list(ys), [_label(f) for f in figs], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(left, right * 8)
        ax.set_ylim(-0.7, len(figs) - 0.3)
        _describe(ax, report, len(figs))
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, format="png", metadata=_METADATA, bbox_inches="tight")
        return out
    finally:
        plt.close(fig)


def _annotate(ax: Any, y: int, f: Mapping[str, Any], ratio: float, bound: float | None) -> None:
    """One figure's row: its target's mark, its ratio by the bar, value / baseline right."""
    if bound is not None:
        ax.plot([bound, bound], [y - 0.42, y + 0.42], color="black", linewidth=2.2, zorder=4)
        ax.annotate(
            f["target"].replace("<=", "\u2264").replace(">=", "\u2265"),
            (bound, y + 0.42),
            xytext=(2, -1),
            textcoords="offset points",
            fontsize=7,
            va="bottom",
        )
    # Right of the target's mark when the bar ends just short of it.
    near = bound is not None and ratio < bound < 1.8 * ratio
    ax.annotate(
        _fmt(ratio),
        (bound if near else ratio, y),
        xytext=(4, 0),
        textcoords="offset points",
        va="center",
        fontsize=8,
        fontweight="bold",
    )
    ax.annotate(
        f"{_figure.quantity(f['value'], f['unit'])} / {_figure.quantity(f['baseline'], f['unit'])}",
        (1.0, y),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 0),
        textcoords="offset points",
        ha="right",
        va="center",
        fontsize=7,
        color="#555555",
    )


def _describe(ax: Any, report: Mapping[str, Any], rows: int) -> None:
    """The grid, the axis label, the title with the run's subtitle, and the colours' legend."""
    from matplotlib.patches import Patch

    ax.grid(axis="x", which="major", color="#dddddd", zorder=0)
    ax.set_xlabel(
        "ratio = value / baseline measured in the same run (log scale; 1 = baseline); "
        "right: value / baseline"
    )
    ax.set_title(
        "jaxckpt bench: each figure against its baseline\n" + _subtitle(report),
        fontsize=10,
        loc="left",
    )
    ax.legend(
        handles=[
            Patch(color=_MET, label="target met"),
            Patch(color=_MISSED, label="target not met"),
            Patch(color=_NO_TARGET, label="no target"),
        ],
        loc="upper right",
        bbox_to_anchor=(1.0, -0.04 * 30 / (rows + 4)),
        ncol=3,
        frameon=False,
        fontsize=8,
    )


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _bound(target: str | None) -> float | None:
    return float(target.split()[1]) if target else None


def _color(f: Mapping[str, Any]) -> str:
    met = f.get("met")
    return _NO_TARGET if met is None else _MET if met else _MISSED


def _label(f: Mapping[str, Any]) -> str:
    name = f["name"]
    name = name if len(name) <= 58 else name[:57] + "\u2026"
    return f"{f['id']}  {name}"


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.0f}"
