"""`jaxckpt advise`: checkpoint intervals per tier from the measured costs and the failure rate.

`advise` turns each tier's measured cost C and restore time R (`_costs`) and the
MTBF M (given, or from a failure log: `_mtbf`) into Young's and Daly's intervals
and the time each loses (`_young_daly`), rounded to whole training steps, and
the options to set; `render` prints that report as `jaxckpt advise` shows it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from jaxckpt.tools import _costs, _table, _young_daly

COVERS = {
    "memory": "a process crash (the host and its tmpfs survive)",
    "peer": "the loss of hosts in up to `replicas` failure domains",
    "persistent": "anything, including every memory tier",
}


def advise(
    costs: list[_costs.TierCost],
    mtbf_s: float,
    step_s: float | None,
    persistent_mtbf_s: float | None = None,
    *,
    mtbf_from: str = "given",
    step_from: str = "given",
    notes: Iterable[str] = (),
) -> dict[str, Any]:
    """Intervals and time lost per tier, and the options to set (JSON-able).

    Each tier row assumes every failure is recovered from that tier. The
    persistent row uses `persistent_mtbf_s` (failures the memory and peer
    copies do not survive) when given.
    """
    rows = []
    for c in costs:
        m = persistent_mtbf_s if c.tier == "persistent" and persistent_mtbf_s else mtbf_s
        young, daly = (
            _young_daly.young_interval(c.cost_s, m),
            _young_daly.daly_interval(c.cost_s, m),
        )
        steps = max(1, round(daly / step_s)) if step_s else None
        interval = steps * step_s if steps and step_s else daly
        rows.append(
            {
                **dataclasses.asdict(c),
                "mtbf_s": m,
                "covers": COVERS[c.tier],
                "young_s": young,
                "daly_s": daly,
                "interval_steps": steps,
                "interval_s": interval,
                "waste_fraction": _young_daly.waste_fraction(interval, c.cost_s, c.restore_s, m),
            }
        )
    by_tier = {r["tier"]: r for r in rows}
    save_row = by_tier.get("peer") or by_tier.get("memory")
    recommended: dict[str, Any] = {}
    if save_row and save_row["interval_steps"]:
        every = save_row["interval_steps"]
        recommended["save_interval_steps"] = every
        if "persistent" in by_tier and by_tier["persistent"]["interval_steps"]:
            wanted = by_tier["persistent"]["interval_steps"]
            # Only saved steps can be persisted: a multiple of the save interval.
            recommended["persist_every"] = max(1, math.ceil(wanted / every)) * every
    return {
        "mtbf_s": mtbf_s,
        "mtbf_from": mtbf_from,
        "persistent_mtbf_s": persistent_mtbf_s,
        "step_s": step_s,
        "step_from": step_from if step_s else "unknown; pass --step-seconds",
        "tiers": rows,
        "recommended": recommended,
        "notes": list(notes),
    }


def render(report: dict[str, Any]) -> str:
    out = [
        f"MTBF {_table.duration(report['mtbf_s'])} ({report['mtbf_from']}); "
        f"step {_table.duration(report['step_s'])} ({report['step_from']})",
        "",
    ]
    rows = [
        [
            r["tier"],
            _table.duration(r["cost_s"]),
            _table.duration(r["restore_s"]),
            _table.duration(r["young_s"]),
            _table.duration(r["daly_s"]),
            f"{r['interval_steps']} step(s)"
            if r["interval_steps"]
            else _table.duration(r["interval_s"]),
            _table.percent(r["waste_fraction"]),
        ]
        for r in report["tiers"]
    ]
    headers = ["TIER", "COST C", "RESTORE R", "YOUNG", "DALY", "EVERY", "TIME LOST"]
    out.append(
        _table.table(headers, rows, right=(1, 2, 3, 4, 5, 6)) if rows else "no tier could be costed"
    )
    out.append("")
    out += [
        f"  {r['tier']}: C = {r['cost_from']}; R = {r['restore_from']}" for r in report["tiers"]
    ]
    out += [f"  {r['tier']} survives {r['covers']}" for r in report["tiers"]]
    out += [f"  note: {n}" for n in report["notes"]]
    rec = report["recommended"]
    out.append("")
    if rec:
        opts = [f"CheckpointManagerOptions(save_interval_steps={rec['save_interval_steps']})"]
        if "persist_every" in rec:
            opts.append(f"TierOptions(persist_every={rec['persist_every']})")
        out.append("recommended: " + ", ".join(opts))
    else:
        out.append("recommended: pass --step-seconds to turn the intervals into steps")
    out.append("TIME LOST assumes every failure is recovered from that tier (first-order model).")
    return "\n".join(out)
