"""`jaxckpt ls`: every step of a checkpoint, where its copies are, what each memory root holds.

`listing` builds the JSON-able report (what `--json` prints) and `render_listing`
renders the terminal text from that same report, so the two never disagree. The
cells that say where one step's copies are (`step_summary` and the `*_cell`
functions) are `inspect`'s header too. The checkpoint directory may be local or
on an object store (`gs://`, `s3://`): see `_catalog`.
"""

from __future__ import annotations

import time
from typing import Any

from jaxckpt.persistent import _kept
from jaxckpt.tools import _catalog, _table, _trust


def step_summary(info: _catalog.StepInfo, now: float) -> dict[str, Any]:
    """Where one step lives, as JSON."""
    created = info.created
    sources = []
    if info.in_memory():
        sources.append("memory")
    if info.persisted:
        sources.append("persistent")
    return {
        "step": info.step,
        "finalized": info.finalized,
        "item_dir": str(info.item_dir) if info.item_dir else None,
        "created": created,
        "age_s": None if created is None else max(0.0, now - created),
        "bytes": info.nbytes,
        "process_count": info.process_count,
        "parts": list(info.owners),
        "memory": {str(o): [str(r) for r in roots] for o, roots in sorted(info.memory.items())},
        "memory_copies": sum(len(r) for r in info.memory.values()),
        "persisted": sorted(info.persisted),
        "durable": info.durable,
        "restorable": info.restorable,
        "restorable_from": sources if info.restorable else [],
        "missing": list(info.missing),
        "stale": [{"root": str(r), "part": o, "why": why} for r, o, why in info.stale],
        "incomplete": list(info.incomplete),
        # Memory copies found damaged and marked: no copy (not in "memory").
        "quarantined": [q.to_dict() for q in info.quarantined],
        # NaN/Inf values the saves counted (None: not counted).
        "nonfinite": None if info.nonfinite is None else sum(info.nonfinite.values()),
        # Data-parallel replicas: R, and how many slices (chunks of shards held by R
        # processes, each saved by one of them) each part holds.
        "replicas": max((m.replicas for m in info.index.values()), default=1),
        "slices": {str(o): m.slices for o, m in sorted(info.index.items()) if m.slices},
    }


def listing(catalog: _catalog.Catalog) -> dict[str, Any]:
    """`jaxckpt ls` as JSON: every step, and what each memory root holds."""
    now = time.time()
    infos = [catalog.step(s) for s in catalog.steps()]
    roots = []
    for root in catalog.roots:
        held: dict[str, dict[str, list[int]]] = {}
        for info in infos:
            owners = [o for o, paths in info.memory.items() if root.path in paths]
            if owners:
                held[str(info.step)] = root.classify(owners, info.domains)
        roots.append(
            {
                "path": str(root.path),
                "run_dir_exists": root.tier.run_dir.is_dir(),
                "domain": root.domain,
                "steps": held,
                "quarantined": [q.to_dict() for q in catalog.quarantined if q.root == root.path],
            }
        )
    kept = catalog.kept({i.step for i in infos if i.durable})
    return {
        "directory": str(catalog.directory),
        "remote": catalog.remote,
        "item": catalog.item,
        "run_id": catalog.run_id,
        "time": now,
        "memory_roots": roots,
        "steps": [step_summary(i, now) for i in infos],
        "unfinalized": catalog.unfinalized,
        "quarantined": [q.to_dict() for q in catalog.quarantined],
        "kept_area": None if catalog.remote else str(_kept.kept_dir(catalog.directory)),
        "kept": [k.to_dict() for k in kept],
    }


def in_memory_cell(s: dict[str, Any]) -> str:
    """How many of a step's parts the memory roots hold, in how many copies."""
    bad = f"{len(s['quarantined'])} quarantined" if s.get("quarantined") else ""
    if not s["memory"]:
        return bad or "-"
    copies = s["memory_copies"]
    cell = (
        f"{len(s['memory'])}/{len(s['parts'])} parts, {copies} cop{'y' if copies == 1 else 'ies'}"
    )
    return f"{cell}, {bad}" if bad else cell


def persistent_cell(s: dict[str, Any]) -> str:
    """How many of a step's parts are persisted, and whether the step is durable."""
    if not s["persisted"]:
        return "-"
    done = f"{len(s['persisted'])}/{len(s['parts'])}"
    return f"{done} durable" if s["durable"] else f"{done} partial"


def finite_cell(s: dict[str, Any]) -> str:
    """Whether the save counted NaN/Inf values in the step (- not counted)."""
    n = s.get("nonfinite")
    return "-" if n is None else "yes" if not n else f"NO: {n} NaN/Inf"


def restorable_cell(s: dict[str, Any]) -> str:
    """Whether the step can be restored, from which tiers, or why not."""
    if not s["finalized"]:
        return "NO: not in the directory (unfinalized or deleted)"
    if s["restorable"]:
        return "yes: " + " + ".join(s["restorable_from"])
    if not s["parts"]:
        return "NO: no index manifest"
    missing = s["missing"]
    which = (
        f"part {missing[0]} has" if len(missing) == 1 else f"parts {_table.owners(missing)} have"
    )
    return f"NO: {which} no copy in reach"


def incomplete_note(report: dict[str, Any], owners: list[int]) -> str:
    """The note on parts in the directory that are not used (no manifest of this save)."""
    which = f"part {owners[0]}" if len(owners) == 1 else f"parts {_table.owners(owners)}"
    if report.get("remote"):
        # The manifest is written last (`_object_store`): without it the upload is unfinished.
        return (
            f"{which} in the object store not durable (upload not finished, abandoned, or "
            "being deleted: no manifest of this save); not used"
        )
    return (
        f"{which} in the directory without a manifest of this save (damaged, or from "
        "another save); not used"
    )


def _slices_cell(s: dict[str, Any]) -> str:
    """How a step's replicated shards were shared: R, and the slices each part holds."""
    if not s.get("slices"):
        return "-"
    counts = sorted(set(s["slices"].values()))
    each = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"R={s['replicas']}: {each} a part"


def _listing_notes(report: dict[str, Any]) -> list[str]:
    """The lines below `ls`'s tables: copies not used, quarantined copies, the kept
    area, saves in progress, memory roots that hold nothing of the run."""
    steps, roots = report["steps"], report["memory_roots"]
    notes = [
        f"step {s['step']}: copy of part {x['part']} in {x['root']} is not used ({x['why']})"
        for s in steps
        for x in s["stale"]
    ]
    notes += [
        f"step {s['step']}: {incomplete_note(report, s['incomplete'])}"
        for s in steps
        if s.get("incomplete")
    ]
    notes += _trust.quarantine_notes(report.get("quarantined", ()))
    notes += _trust.kept_notes(report.get("kept", ()), _kept.KEPT_DIR)
    notes += [f"save in progress or abandoned: {name}" for name in report["unfinalized"]]
    notes += [
        f"memory root {r['path']} holds nothing of run {report['run_id']} (lost, or another run)"
        for r in roots
        if not r["run_dir_exists"]
    ]
    return notes


def render_listing(report: dict[str, Any]) -> str:
    steps, roots = report["steps"], report["memory_roots"]
    head = (
        f"{report['directory']}  item {report['item']!r}  run {report['run_id']}  "
        f"{len(steps)} step(s), {len(roots)} memory root(s)"
    )
    rows = [
        [
            s["step"],
            _table.duration(s["age_s"]),
            _table.size(s["bytes"]),
            s["process_count"] or "-",
            in_memory_cell(s),
            persistent_cell(s),
            restorable_cell(s),
            finite_cell(s),
        ]
        for s in reversed(steps)
    ]
    out = [head, ""]
    if rows:
        headers = ["STEP", "AGE", "SIZE", "PROCS", "IN MEMORY", "PERSISTENT", "RESTORABLE"]
        headers.append("FINITE")
        if any(s.get("slices") for s in steps):  # data-parallel replicas shared the save
            headers.append("SLICES")
            for row, s in zip(rows, reversed(steps), strict=True):
                row.append(_slices_cell(s))
        out.append(_table.table(headers, rows, right=(0, 1, 2, 3)))
    else:
        out.append("no steps")
    if roots:
        root_rows = []
        for r in roots:
            kinds: dict[str, set[int]] = {"own": set(), "replica": set(), "unknown": set()}
            for held in r["steps"].values():
                for kind, owners in held.items():
                    kinds[kind].update(owners)
            steps_held = [int(s) for s in r["steps"]]
            own = _table.owners(kinds["own"] | kinds["unknown"])
            root_rows.append(
                [
                    r["path"],
                    r["domain"] or "?",
                    _table.owners(steps_held),
                    own + (" (own or replica)" if kinds["unknown"] else ""),
                    _table.owners(kinds["replica"]),
                ]
            )
        out += [
            "",
            _table.table(["MEMORY ROOT", "DOMAIN", "STEPS", "OWN PARTS", "REPLICAS OF"], root_rows),
        ]
    elif report.get("remote"):
        out += [
            "",
            "No --memory-root given: only the persisted copies in the object store were looked "
            "for (memory tiers are on the hosts' local filesystems: give --memory-root on a host "
            "to include its own).",
        ]
    else:
        out += ["", "No --memory-root given: only persistent copies were looked for."]
    notes = _listing_notes(report)
    if notes:
        out += ["", *notes]
    return "\n".join(out)
