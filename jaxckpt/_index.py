"""The index of a step's copies: which parts exist where, read once and passed down.

A step's item directory holds one index manifest per part (`index_<p>.json`,
written by every save); a persisted part adds `part_<p>/manifest.json`, and the
memory tiers hold their own copies. Everything here reads them through the
checked manifest parser (`_format.PartManifest.from_json`), never raw JSON:

- `read_index`: the index manifests of one step;
- `memory_parts`, `persisted_parts`: which of a step's parts a memory tier holds,
  or persistent storage, from the very save the index describes;
- `part_count`, `is_persisted`: the durability reads garbage collection makes;
- `GlobalView`: what every process holds for every finalized step, each step's
  index read at most once, and the restore plan of a step.
"""

from __future__ import annotations

from pathlib import Path

from absl import logging as log

from jaxckpt import _format, _memory_tier, _plan, _storage

Index = dict[int, _format.PartManifest]  # owner -> index manifest


def read_index(item_dir: Path) -> Index:
    """owner -> index manifest, for every part recorded in an item directory."""
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
        return _format.PartManifest.from_json((item_dir / _format.index_file(0)).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def part_count(item_dir: Path) -> int | None:
    """How many processes saved the step in `item_dir`, or None if its index is
    missing or damaged."""
    first = first_index(item_dir)
    return None if first is None else first.process_count


def is_persisted(item_dir: Path, owner: int) -> bool:
    """Whether `owner`'s part of the step is durable: its directory (renamed into place
    when complete) on a filesystem, its manifest (written last) on an object store."""
    part = item_dir / _format.part_dir_name(owner)
    if _storage.is_remote(item_dir):
        return (part / _format.MANIFEST_FILE).exists()
    return part.is_dir()


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
    out = set()
    for owner, m in index.items():
        try:
            path = item_dir / _format.part_dir_name(owner) / _format.MANIFEST_FILE
            if matches(_format.PartManifest.from_json(_storage.read_bytes(path)), m):
                out.add(owner)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


class GlobalView:
    """What every process holds in memory for every finalized step, plus persistence.

    Each step's index is read at most once (`index`), into `indexes` (shared with
    the caller: a restore hands in the one it read already).
    """

    def __init__(
        self,
        steps: dict[int, Path],
        inventories: dict[int, dict[int, set[int]]],
        me: int,
        indexes: dict[int, Index] | None = None,
    ):
        self.steps = steps  # step -> item directory
        self.inventories = inventories  # process -> step -> owners held
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
        held = {p: inv.get(step, set()) for p, inv in self.inventories.items()}
        return _plan.plan_step(step, index, self.me, held, persisted_parts(item_dir, index))

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
