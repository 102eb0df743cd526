"""`jaxckpt inspect`: what one step holds: its tree, versions, iterator states and save metrics.

`describe_step` builds the JSON-able report (what `--json` prints) and
`render_step` renders the terminal text from that same report, so the two never
disagree. Where the step's copies are is told as `ls` tells it (`_listing`). The
checkpoint directory may be local or on an object store (`gs://`, `s3://`): see
`_catalog`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jaxckpt.format import _format, _step_index
from jaxckpt.persistent import _index, _store
from jaxckpt.tools import _catalog, _listing, _table

# Save metrics shown as columns by `inspect`, in this order (others only in --json).
METRIC_COLUMNS = (
    ("stall_s", "STALL"),
    ("memory_write_s", "MEMORY WRITE"),
    ("replicate_s", "REPLICATE"),
    ("persist_s", "PERSIST"),
    ("safe_in_memory_s", "SAFE IN MEMORY"),
    ("safe_on_peers_s", "SAFE ON PEERS"),
)


def sharding_text(desc: dict[str, Any] | None) -> str:
    """{'type': 'named', 'spec': ['data', None], ...} -> "P('data', None) data=8,model=2"."""
    if not desc:
        return "-"
    if desc.get("type") == "named":
        spec = ", ".join(
            repr(tuple(p)) if isinstance(p, list) else repr(p) for p in desc.get("spec", [])
        )
        mesh = ",".join(
            f"{n}={s}" for n, s in zip(desc["axis_names"], desc["mesh_shape"], strict=True)
        )
        return f"P({spec}) {mesh}"
    if desc.get("type") == "single":
        return f"device {desc['device_id']}"
    return str(desc.get("repr", desc))[:40]


def _collapse(paths: list[list[str]]) -> list[list[str]]:
    """Joins a node with its only child onto one line: params / embed.embedding.value."""
    children: dict[tuple[str, ...], set[str]] = {}
    for labels in paths:
        for depth, label in enumerate(labels):
            children.setdefault(tuple(labels[:depth]), set()).add(label)
    out = []
    for labels in paths:
        segments = [labels[0]]
        for depth in range(1, len(labels)):
            if len(children[tuple(labels[:depth])]) == 1:
                sep = "" if labels[depth].startswith("[") else "."
                segments[-1] += sep + labels[depth]
            else:
                segments.append(labels[depth])
        out.append(segments)
    return out


def _label(key: tuple[str, Any]) -> str:
    kind, value = key
    return f"[{value}]" if kind == "s" else str(value)


def describe_step(catalog: _catalog.Catalog, step: int) -> dict[str, Any]:
    """`jaxckpt inspect` as JSON.

    Raises:
      FileNotFoundError: if the step is nowhere, or has no manifest in reach.
    """
    info = catalog.step(step)
    if not info.index:
        raise FileNotFoundError(
            f"Step {step} in {info.item_dir} has no readable jaxckpt index manifest."
        )
    owners = sorted(info.index)
    first = info.index[owners[0]]
    raw = _raw_index(info, owners[0])
    iterators = {
        rec.path: {str(o): info.index[o].iterator_states.get(i) for o in owners}
        for i, rec in enumerate(first.leaves)
        if rec.kind == _format.ITERATOR
    }
    return {
        "directory": str(catalog.directory),
        "item": catalog.item,
        "step": step,
        "format": raw.get("format", _format.FORMAT_NAME),
        "format_version": raw.get("version", _format.FORMAT_VERSION),
        "jaxckpt_version": raw.get("jaxckpt_version"),
        "run_id": first.run_id,
        "process_count": info.process_count,
        "memory_roots": [str(r.path) for r in catalog.roots],
        "location": _listing.step_summary(info, time.time()),
        "leaves": [_leaf(info, owners, i, rec) for i, rec in enumerate(first.leaves)],
        "iterator_states": iterators,
        "processes": [_process(info, o) for o in owners],
    }


def _raw_index(info: _catalog.StepInfo, owner: int) -> dict[str, Any]:
    """`owner`'s index manifest as JSON, its format and version as a part manifest's
    (the step index names its parts'); empty where it cannot be read."""
    if info.item_dir is None:
        return {}
    index = _index.read_index(info.item_dir)
    if isinstance(index, _step_index.StepIndex):  # its header records them
        return {
            "format": _format.FORMAT_NAME,
            "version": index.manifest_version,
            "jaxckpt_version": index.jaxckpt_version,
        }
    try:
        raw = json.loads(_index.index_path(info.item_dir, owner).read_text())
        if raw.get("format") == _step_index.STEP_INDEX_FORMAT:  # a version-1 step index
            raw = {**raw, "format": _format.FORMAT_NAME, "version": raw["manifest_version"]}
    except (OSError, ValueError):
        return {}
    return raw


def _leaf(
    info: _catalog.StepInfo, owners: list[int], i: int, rec: _format.LeafRecord
) -> dict[str, Any]:
    """Leaf `i` (`rec`, its record in the first process's manifest) across the processes."""
    first = info.index[owners[0]]
    nonfinite = info.nonfinite
    chunks = [c for m in info.index.values() for c in m.chunks.get(i, ())]
    return {
        "path": rec.path,
        "keys": [list(k) for k in rec.keys],
        "kind": rec.kind,
        "shape": list(rec.shape) if rec.shape is not None else None,
        "dtype": rec.dtype,
        "chunk_shape": list(rec.chunk_shape) if rec.chunk_shape is not None else None,
        "sharding": rec.sharding,
        "bytes": sum(c.nbytes for c in chunks),
        "chunks": len(chunks),
        "key_impl": rec.key_impl,
        # A per-process scalar's value is in each part: the first process's here.
        "value": first.scalars.get(i) if rec.per_process else rec.value,
        "scalar_type": rec.scalar_type,
        "per_process": rec.per_process,
        "nonfinite": None if nonfinite is None else nonfinite.get(i, 0),
        # Shared by data-parallel replicas: who holds which slice (chunk indices).
        "replicas": rec.replicas,
        "slices_per_shard": rec.slices,
        "cut": rec.cut,
        "slices": (
            {
                str(o): [list(c.index) for c in info.index[o].chunks.get(i, ())]
                for o in owners
                if info.index[o].chunks.get(i)
            }
            if rec.replicas
            else None
        ),
    }


def _process(info: _catalog.StepInfo, owner: int) -> dict[str, Any]:
    """One process's part: its domain, bytes, chunks, slices and save metrics (with the
    persistence time where its part was persisted)."""
    m = info.index[owner]
    metrics = dict(m.metrics)
    if owner in info.persisted and info.item_dir is not None:
        metrics.update(_persisted_metrics(info.item_dir / _format.part_dir_name(owner)))
    return {
        "process": owner,
        "failure_domain": m.failure_domain,
        "bytes": m.nbytes,
        "chunks": sum(len(cs) for cs in m.chunks.values()),
        "slices": m.slices,
        "metrics": metrics,
    }


def _persisted_metrics(part_dir: Path) -> dict[str, Any]:
    """Metrics only the persisted copy's manifest has (the persistence time)."""
    try:
        d = json.loads((part_dir / _format.MANIFEST_FILE).read_text())
        return {k: v for k, v in d.get("metrics", {}).items() if k.startswith("persist")}
    except (OSError, ValueError, AttributeError):
        return {}


def render_step(report: dict[str, Any]) -> str:
    out = _step_header(report)
    out.append(
        _table.table(
            ["TREE", "KIND", "SHAPE", "DTYPE", "SAVED SHARDING", "BYTES", ""],
            _tree_rows(report["leaves"]),
            right=(5,),
        )
    )
    if report["iterator_states"]:
        out += ["", "ITERATOR STATES", *_iterator_lines(report["iterator_states"])]
    out += ["", "SAVE METRICS", _metrics_table(report["processes"])]
    shared = [leaf for leaf in report["leaves"] if leaf.get("slices")]
    if shared:
        out += ["", "SLICES (shards held by R processes, each saving a share)"]
        for leaf in shared:
            held = ", ".join(
                f"process {o}: {len(idx)}"
                for o, idx in sorted(leaf["slices"].items(), key=lambda x: int(x[0]))
            )
            out.append(f"  {leaf['path']}  R={leaf['replicas']}{_cut_text(leaf)}; {held}")
    return "\n".join(out)


def _step_header(report: dict[str, Any]) -> list[str]:
    """The lines above the tree: the step, its format, where its copies are, finiteness."""
    loc = report["location"]
    version = f"jaxckpt format v{report['format_version']}"
    if report["jaxckpt_version"]:
        version += f", written by jaxckpt {report['jaxckpt_version']}"
    in_memory = _listing.in_memory_cell(loc) if report["memory_roots"] else "not looked for"
    out = [
        f"step {report['step']} of {report['directory']}  item {report['item']!r}",
        f"{version}; {report['process_count']} process(es); run {report['run_id']}; "
        f"{_table.size(loc['bytes'])}; saved {_table.duration(loc['age_s'])} ago",
        f"in memory: {in_memory}; persistent: {_listing.persistent_cell(loc)}; "
        f"restorable: {_listing.restorable_cell(loc)}",
    ]
    if not report["memory_roots"]:
        out.append("(no --memory-root given: only the copies in the checkpoint directory count)")
    finite = _listing.finite_cell(loc)
    out.append(f"finite: {finite} (NaN/Inf values counted at save; - not counted)")
    if loc["incomplete"]:
        remote = _store.at(report["directory"]).remote
        out.append(_listing.incomplete_note({"remote": remote}, loc["incomplete"]))
    out.append("")
    return out


def _tree_rows(leaves: list[dict[str, Any]]) -> list[list[Any]]:
    """The tree's table: a row per inner node (indented, first time it appears) and per leaf."""
    rows: list[list[Any]] = []
    previous: list[str] = []
    paths = [[_label((k[0], k[1])) for k in leaf["keys"]] or ["<root>"] for leaf in leaves]
    for leaf, labels in zip(leaves, _collapse(paths), strict=True):
        common = 0
        while common < min(len(previous), len(labels) - 1) and previous[common] == labels[common]:
            common += 1
        for depth in range(common, len(labels) - 1):
            rows.append(["  " * depth + labels[depth]] + [""] * 6)
        previous = labels
        rows.append(_leaf_row("  " * (len(labels) - 1) + labels[-1], leaf))
    return rows


def _leaf_row(name: str, leaf: dict[str, Any]) -> list[Any]:
    if leaf["kind"] == _format.SCALAR:
        return [name, "scalar", "", leaf["scalar_type"], "", "", repr(leaf["value"])]
    if leaf["kind"] == _format.ITERATOR:
        return [name, "iterator", "", "", "", "", "state per process, below"]
    return [
        name,
        leaf["kind"],
        str(tuple(leaf["shape"] or ())),
        leaf["dtype"],
        sharding_text(leaf["sharding"]),
        _table.size(leaf["bytes"]),
        f"{leaf['chunks']} chunk(s)"
        + (f", {leaf['nonfinite']} NaN/Inf" if leaf.get("nonfinite") else "")
        + _shared_text(leaf),
    ]


def _iterator_lines(iterator_states: dict[str, dict[str, Any]]) -> list[str]:
    """Each iterator's state: once where every process saved the same, else per process."""
    out = []
    for path, states in iterator_states.items():
        texts = {p: json.dumps(s, sort_keys=True) for p, s in states.items()}
        if len(set(texts.values())) == 1:
            out.append(
                f"  {path}  all {len(texts)} process(es): {_clip(next(iter(texts.values())))}"
            )
        else:
            out += [f"  {path}  process {p}: {_clip(t)}" for p, t in texts.items()]
    return out


def _metrics_table(processes: list[dict[str, Any]]) -> str:
    rows = []
    for p in processes:
        m = p["metrics"]
        rows.append(
            [p["process"], p["failure_domain"], _table.size(p["bytes"]), p["chunks"]]
            + [_table.duration(_number(m.get(key))) for key, _ in METRIC_COLUMNS]
        )
    headers = ["PROCESS", "DOMAIN", "BYTES", "CHUNKS"] + [h for _, h in METRIC_COLUMNS]
    return _table.table(headers, rows, right=tuple(range(2, len(headers))))


def _shared_text(leaf: dict[str, Any]) -> str:
    return f", R={leaf['replicas']}{_cut_text(leaf)}" if leaf.get("replicas") else ""


def _cut_text(leaf: dict[str, Any]) -> str:
    if leaf.get("cut") is None:
        return ", shards whole"
    return f", {leaf['slices_per_shard']} slices a shard (dim {leaf['cut']})"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
