"""The index of a step's copies: which parts exist where, read once and passed down.

A step's item directory holds its index: one object, `index.json`, with every
part's index manifest (the leaf records once), written by one process at the
end of the save's agreement (`entry` is what each process hands to it,
`write_step_index` what the agreement's decider writes), so that a step costs
the persistent store one object whatever the process count. Steps saved by
earlier versions hold one `index_<p>.json` per part instead, and are still read.
A persisted part adds `part_<p>/manifest.json`, and the memory tiers hold their
own copies. Everything here reads them through checked parsers, never raw JSON:

- `read_index`: the index manifests of one step (either layout);
- `memory_parts`, `persisted_parts`: which of a step's parts a memory tier holds,
  or persistent storage, from the very save the index describes;
- `part_count`, `has_index`: how many parts a step has, whether a directory holds a
  jaxckpt step (whether each part is durable is the store's:
  `_store.PersistentStore.is_persisted`);
- `GlobalView`: what every process holds for every finalized step, each step's
  index read at most once, and the restore plan of a step.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from absl import logging as log

from jaxckpt import _resources
from jaxckpt.coord import _holdings, _plan
from jaxckpt.format import _checksum, _format
from jaxckpt.tiers import _memory_tier, _storage

Index = dict[int, _format.PartManifest]  # owner -> index manifest

STEP_INDEX_FORMAT: Final = "jaxckpt-index"
STEP_INDEX_VERSION: Final = 1
# Leaf record fields that may differ between processes' records of one per-process leaf
# (the rest is compared by the save's agreement): each part records its own.
_OWN_LEAF_FIELDS: Final = ("scalar_type", "uncommitted", "sharding")
# Manifest members that are the same in every part, written once in the step index.
_SHARED_MEMBERS: Final = ("format", "version", "leaves", "jaxckpt_version")


def entry(manifest: _format.PartManifest) -> str:
    """What this process hands to the step index's writer: its index manifest without
    the leaf records (the same in every part, which the agreement checks), but with
    its own values of the fields a per-process leaf's record may hold differently;
    compressed."""
    d = manifest.to_dict()
    for name in _SHARED_MEMBERS:
        d.pop(name, None)
    d["own_leaves"] = _own_leaf_fields(manifest.leaves)
    return base64.b64encode(zlib.compress(json.dumps(d, separators=(",", ":")).encode())).decode()


def _own_leaf_fields(leaves: Sequence[_format.LeafRecord]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, r in enumerate(leaves):
        if r.per_process:
            fields = {
                k: getattr(r, k) for k in _OWN_LEAF_FIELDS if getattr(r, k) not in (None, False)
            }
            if fields:
                out[str(i)] = fields
    return out


def step_index_text(leaves: Sequence[_format.LeafRecord], entries: Mapping[int, str]) -> str:
    """The step index (checksummed JSON) from the writer's leaf records and every
    process's `entry`."""
    head = json.dumps(
        {
            "format": STEP_INDEX_FORMAT,
            "version": STEP_INDEX_VERSION,
            "manifest_version": _format.FORMAT_VERSION,
            "jaxckpt_version": _format.JAXCKPT_VERSION,
            "leaves": [_shared_record(r) for r in leaves],
        },
        separators=(",", ":"),
    )
    # Each entry is spliced in as the JSON text `entry` made (not parsed and dumped again:
    # at thousands of processes that was most of the deciding process's time).
    parts = ",".join(
        f'"{int(p)}":{zlib.decompress(base64.b64decode(e)).decode()}'
        for p, e in sorted(entries.items())
    )
    return _format.with_checksum(f'{head[:-1]},"parts":{{{parts}}}}}')


def _shared_record(record: _format.LeafRecord) -> dict[str, Any]:
    d = record.to_dict()
    if record.per_process:
        for k in _OWN_LEAF_FIELDS:
            d.pop(k, None)
    return d


def write_step_index(
    item_dir: Path, leaves: Sequence[_format.LeafRecord], entries: Mapping[int, str]
) -> None:
    """Writes the step index of `item_dir` (one file, or one object): by one process,
    once every process has handed its `entry` and the save is agreed on."""
    _storage.write_file(item_dir / _format.STEP_INDEX_FILE, step_index_text(leaves, entries))


def parse_step_index(raw: bytes) -> Index:
    """owner -> index manifest, from a step index's text (parsed once per text).

    Raises:
      ValueError: if the text is damaged or is no readable step index.
    """
    key = (len(raw), _checksum.crc32c(raw))
    cached = _PARSED.get(key)
    if cached is not None and cached[0] == raw:
        return dict(cached[1])
    d = _format.checked(raw)
    if d.get("format") != STEP_INDEX_FORMAT or d.get("version") != STEP_INDEX_VERSION:
        raise ValueError(
            f"Not a jaxckpt step index of a readable version (format={d.get('format')!r}, "
            f"version={d.get('version')!r}); upgrade jaxckpt."
        )
    shared = d["leaves"]
    records = tuple(_format.LeafRecord.from_dict(x) for x in shared)
    header = {"format": _format.FORMAT_NAME, "version": d["manifest_version"], "leaves": []}
    out: Index = {}
    variants: dict[str, tuple[_format.LeafRecord, ...]] = {}  # parts' own fields -> records
    for owner, part in d["parts"].items():
        own = part.pop("own_leaves", {})
        manifest = _format.PartManifest.from_dict({**part, **header})
        variant = json.dumps(own, sort_keys=True)
        leaves = variants.get(variant)
        if leaves is None:  # built once per variant: parts alike share one tuple
            leaves = variants[variant] = tuple(
                _with_own(r, own.get(str(i), {})) if r.per_process else r
                for i, r in enumerate(records)
            )
        if manifest.owner != int(owner):
            raise ValueError(f"The step index's part {owner} records owner {manifest.owner}.")
        out[manifest.owner] = dataclasses.replace(manifest, leaves=leaves)
    if len(_PARSED) >= 4:
        _PARSED.pop(next(iter(_PARSED), (-1, -1)), None)
    _PARSED[key] = (raw, out)
    return dict(out)


def _with_own(record: _format.LeafRecord, own: Mapping[str, Any]) -> _format.LeafRecord:
    return dataclasses.replace(
        record, **{k: own.get(k, False if k == "uncommitted" else None) for k in _OWN_LEAF_FIELDS}
    )


# Parsed step indexes by text: a restore and retention read the same one several times.
_PARSED: dict[tuple[int, int], tuple[bytes, Index]] = _resources.SHARED.cache({})


def has_index(item_dir: Path) -> bool:
    """Whether `item_dir` holds a jaxckpt step's index (either layout)."""
    return _storage.exists(item_dir / _format.STEP_INDEX_FILE) or _storage.exists(
        item_dir / _format.index_file(0)
    )


def index_path(item_dir: Path, owner: int) -> Path:
    """The file that indexes `owner`'s part of the step in `item_dir`: the step index, or
    in a step saved before it, the part's own index manifest."""
    combined = item_dir / _format.STEP_INDEX_FILE
    return combined if _storage.exists(combined) else item_dir / _format.index_file(owner)


def read_index(item_dir: Path) -> Index:
    """owner -> index manifest, for every part recorded in an item directory: its step
    index, or in a step saved before it, every `index_<p>.json`."""
    try:
        raw = _storage.read_bytes(item_dir / _format.STEP_INDEX_FILE)
    except FileNotFoundError:
        raw = None
    except OSError as e:
        log.warning("jaxckpt: cannot read the step index in %s: %s", item_dir, e)
        return {}
    if raw is not None:
        try:
            return parse_step_index(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("jaxckpt: ignoring unreadable step index %s: %s", item_dir, e)
            return {}
    out = {}
    if item_dir.is_dir():
        for p in sorted(item_dir.glob("index_*.json")):
            try:
                m = _format.PartManifest.from_json(p.read_text())
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("jaxckpt: ignoring unreadable index manifest %s: %s", p, e)
                continue
            out[m.owner] = m
    return out


def first_index(item_dir: Path) -> _format.PartManifest | None:
    """Process 0's index manifest of the step in `item_dir` (what every part of a step
    records alike: the process count, whether the step is to be persisted), or None if
    it is missing or damaged."""
    try:
        raw = _storage.read_bytes(item_dir / _format.STEP_INDEX_FILE)
    except OSError:
        raw = None
    try:
        if raw is not None:
            return parse_step_index(raw).get(0)
        return _format.PartManifest.from_json((item_dir / _format.index_file(0)).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def part_count(item_dir: Path) -> int | None:
    """How many processes saved the step in `item_dir`, or None if its index is
    missing or damaged."""
    first = first_index(item_dir)
    return None if first is None else first.process_count


def matches(copy: _format.PartManifest | None, index: _format.PartManifest) -> bool:
    """Whether a stored copy of a part is the one the index describes (same save)."""
    return (
        copy is not None
        and copy.save_id == index.save_id
        and copy.run_id == index.run_id
        and copy.step == index.step
        and copy.owner == index.owner
    )


def memory_parts(memory: _memory_tier.MemoryTier, step: int, index: Index) -> set[int]:
    """Owners whose part of `step` this memory tier holds, from this very save; none
    from a tier `prepare` could not write (its steps cannot be pinned while read)."""
    if memory.unwritable is not None:
        return set()
    return {
        o
        for o in memory.parts(step)
        if o in index and matches(memory.read_manifest(step, o), index[o])
    }


def persisted_parts(item_dir: Path, index: Index) -> set[int]:
    """Owners whose part of the step is durable in the item directory."""
    return {owner for owner, m in index.items() if _is_persisted(item_dir, m)}


def _is_persisted(item_dir: Path, m: _format.PartManifest) -> bool:
    try:
        path = item_dir / _format.part_dir_name(m.owner) / _format.MANIFEST_FILE
        return matches(_format.PartManifest.from_json(_storage.read_bytes(path)), m)
    except (OSError, ValueError, KeyError, TypeError):
        return False


class PersistedParts(Container[int]):
    """`persisted_parts`, each part's manifest read when it is first asked about: a
    restore plan asks about the parts it reads and those no process holds, not all."""

    def __init__(self, item_dir: Path, index: Index):
        self._item_dir = item_dir
        self._index = index
        self._known: dict[int, bool] = {}

    def __contains__(self, owner: object) -> bool:
        if not isinstance(owner, int) or owner not in self._index:
            return False
        if owner not in self._known:
            self._known[owner] = _is_persisted(self._item_dir, self._index[owner])
        return self._known[owner]


class GlobalView:
    """What every process holds in memory for every finalized step, plus persistence.

    Each step's index is read at most once (`index`), into `indexes` (shared with
    the caller: a restore hands in the one it read already).
    """

    def __init__(
        self,
        steps: dict[int, Path],
        inventories: Mapping[int, dict[int, set[int]]] | _holdings.Holdings,
        me: int,
        indexes: dict[int, Index] | None = None,
    ):
        self.steps = steps  # step -> item directory
        if not isinstance(inventories, _holdings.Holdings):
            inventories = _holdings.Holdings.of(inventories)
        self.inventories = inventories  # who holds which part of which step
        self.me = me
        self._indexes = indexes if indexes is not None else {}

    def index(self, step: int) -> Index:
        """The index manifests of `step` (read on first use)."""
        if step not in self._indexes:
            self._indexes[step] = read_index(self.steps[step]) if step in self.steps else {}
        return self._indexes[step]

    def plan(self, step: int, item_dir: Path | None = None) -> _plan.StepPlan:
        item_dir = item_dir or self.steps[step]
        if step not in self._indexes:
            self._indexes[step] = read_index(item_dir)
        index = self._indexes[step]
        held = self.inventories.for_step(step)
        return _plan.plan_step(step, index, self.me, held, PersistedParts(item_dir, index))

    def restorable_steps(self, exclude: int | None = None) -> list[int]:
        """Restorable steps, newest first."""
        return [
            s for s in sorted(self.steps, reverse=True) if s != exclude and self.plan(s).restorable
        ]

    def newest_restorable_sentence(self, exclude: int) -> str:
        steps = self.restorable_steps(exclude)
        if steps:
            return (
                f"The newest restorable step is {steps[0]}: resume with "
                "jaxckpt.latest_restorable_step(mngr), which returns it and deletes the newer "
                "steps (the CheckpointManager skips saving a step that exists), then restore it."
            )
        return "No other step is restorable from any tier."

    def not_restorable_message(self, item_dir: Path, plan: _plan.StepPlan) -> str:
        if not plan.owners:
            why = f"{item_dir} holds no jaxckpt index manifest"
        else:
            why = (
                f"no verified copy of the part(s) of process(es) {plan.missing} exists in any "
                "process's memory or in persistent storage"
            )
        return (
            f"[process {self.me}] Step {plan.step} cannot be restored: {why}. "
            + self.newest_restorable_sentence(exclude=plan.step)
        )
