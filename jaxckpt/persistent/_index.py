"""The index of a step's copies: which parts exist where, read once and passed down.

A step's item directory holds its index: one object, `index.json`, with every
part's index manifest (the leaf records once), written by one process at the
end of the save's agreement (`entry` is what each process hands to it,
`write_step_index` what the agreement's decider writes), so that a step costs
the persistent store one object whatever the process count. It is laid out to
be read in part (`_step_index`): a process reads the shared header and the
entries of the parts it asks for, not every part's. Steps saved by earlier
versions hold a version-1 index (read whole) or one `index_<p>.json` per part,
and are still read.
A persisted part adds `part_<p>/manifest.json`, and the memory tiers hold their
own copies. Everything here reads them through checked parsers, never raw JSON:

- `read_index`: the index manifests of one step (any layout), a lazy mapping;
  `recorded`: one process's manifest of it (else the first part's), `readable`:
  every part whose entry can be read (the tools'); `nonfinite_total`: the step's
  NaN/Inf count;
- `memory_parts`, `persisted_parts`: which of a step's parts a memory tier holds,
  or persistent storage, from the very save the index describes;
- `part_count`, `has_index`: how many parts a step has, whether a directory holds a
  jaxckpt step (whether each part is durable is the store's:
  `_store.PersistentStore.is_persisted`);
- `GlobalView`: what every process holds for every finalized step, each step's
  index read at most once, and the restore plan of a step.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from pathlib import Path

from absl import logging as log

from jaxckpt.coord import _holdings, _plan
from jaxckpt.format import _finite, _format, _step_index
from jaxckpt.memory import _memory_tier
from jaxckpt.persistent import _storage

Index = _step_index.Index  # owner -> index manifest
# What the save's agreement and its tests use: the step index's text (`_step_index`).
entry = _step_index.entry
step_index_text = _step_index.step_index_text
parse_step_index = _step_index.parse_step_index


def write_step_index(
    item_dir: Path, leaves: Sequence[_format.LeafRecord], entries: Mapping[int, str]
) -> None:
    """Writes the step index of `item_dir` (one file, or one object): by one process,
    once every process has handed its `entry` and the save is agreed on."""
    _storage.write_file(item_dir / _format.STEP_INDEX_FILE, step_index_text(leaves, entries))


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
    index (a version-2 one read in part: each part's entry when asked for,
    `_step_index.StepIndex`), or in a step saved before it, every `index_<p>.json`.
    A missing or damaged index (or header): empty."""
    combined = _step_index_of(item_dir)
    if combined is not None:
        return combined
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


def _step_index_of(item_dir: Path) -> Index | None:
    """The step index of `item_dir` (empty if unreadable), or None if it has none."""
    path = item_dir / _format.STEP_INDEX_FILE
    try:
        head = _storage.read_range(path, 0, _step_index.HEAD_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("jaxckpt: cannot read the step index in %s: %s", item_dir, e)
        return {}
    try:
        return _step_index.read_step_index(
            lambda start, stop: _storage.read_range(path, start, stop), str(path), head
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("jaxckpt: ignoring unreadable step index %s: %s", item_dir, e)
        return {}


def readable(index: Index) -> dict[int, _format.PartManifest]:
    """Every part of `index` whose entry can be read (a damaged one warned about and
    left out, as an unreadable index manifest always was): for a look at every part,
    the tools' (a step index read in part reads the rest of itself at once)."""
    out = {}
    for owner in index:
        manifest = _entry_or_none(index, owner)
        if manifest is not None:
            out[owner] = manifest
    return out


def nonfinite_total(index: Index) -> int:
    """How many NaN/Inf values the parts of a step counted (0 where none did): what a
    version-2 index's header records (no part's entry read), else every part's sum."""
    if isinstance(index, _step_index.StepIndex):
        return index.nonfinite or 0
    return sum(_finite.total(m.nonfinite) or 0 for m in readable(index).values())


def recorded(index: Index, me: int) -> _format.PartManifest | None:
    """`me`'s index manifest, else the first part's (what every part records alike:
    the run id, the leaf records), or None for an empty index; one part's entry read.

    Raises:
      ValueError: if that part's entry of the step index is damaged.
    """
    if me in index:
        return index[me]
    first = next(iter(index), None)
    return None if first is None else index[first]


def first_index(item_dir: Path) -> _format.PartManifest | None:
    """Process 0's index manifest of the step in `item_dir` (what every part of a step
    records alike: whether the step is to be persisted), or None if it is missing or
    damaged."""
    try:
        combined = _step_index_of(item_dir)
        if combined is not None:
            return combined.get(0)
        return _format.PartManifest.from_json((item_dir / _format.index_file(0)).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def part_count(item_dir: Path) -> int | None:
    """How many processes saved the step in `item_dir` (a version-2 index records it
    in its header: no part's entry read), or None if its index is missing or damaged."""
    combined = _step_index_of(item_dir)
    if combined is not None:
        return _format.saved_process_count(combined) if combined else None
    first = first_index(item_dir)
    return None if first is None else first.process_count


def matches(copy: _format.PartManifest | None, index: _format.PartManifest | None) -> bool:
    """Whether a stored copy of a part is the one the index describes (same save)."""
    return (
        copy is not None
        and index is not None
        and copy.save_id == index.save_id
        and copy.run_id == index.run_id
        and copy.step == index.step
        and copy.owner == index.owner
    )


def memory_parts(memory: _memory_tier.MemoryTier, step: int, index: Index) -> set[int]:
    """Owners whose part of `step` this memory tier holds, from this very save; none
    from a tier `prepare` could not write (its steps cannot be pinned while read), nor
    a part whose entry of the step index is damaged (no copy can be checked against it)."""
    if memory.unwritable is not None:
        return set()
    return {
        o
        for o in memory.parts(step)
        if o in index and matches(memory.read_manifest(step, o), _entry_or_none(index, o))
    }


def _entry_or_none(index: Index, owner: int) -> _format.PartManifest | None:
    try:
        return index[owner]
    except ValueError as e:
        log.warning("jaxckpt: %s", e)
        return None


def persisted_parts(item_dir: Path, index: Index) -> set[int]:
    """Owners whose part of the step is durable in the item directory."""
    return {owner for owner in index if _is_persisted(item_dir, index, owner)}


def _is_persisted(item_dir: Path, index: Index, owner: int) -> bool:
    """Whether `owner`'s part is durable in the item directory: not where its entry of
    the index is damaged (every process reads the same entry, so all agree)."""
    try:
        m = index[owner]
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
            self._known[owner] = _is_persisted(self._item_dir, self._index, owner)
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
