"""One figure of the benchmark, a value against a baseline measured in the same run, and
the plain-text table that prints the figures.

`ratio` is value / baseline; targets are those of the benchmark's issue, on the ratio;
`met` is None where the run could not measure a figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxckpt.tools import _table


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
