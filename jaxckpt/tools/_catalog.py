"""What a checkpoint directory and a set of memory roots hold, step by step.

Read only, and offline: it never talks to the processes of a job. It reads the
`index_<p>.json` manifests of every step in the CheckpointManager's directory,
the persisted parts next to them, and the memory tiers under the memory roots
it is given, and decides restorability with the same rules a restore uses
(`_index.matches`, `_plan.plan_step`): a step is restorable from what is in
reach when every part it needs has a copy of this very save somewhere.

The checkpoint directory may be local or on an object store (`gs://`, `s3://`):
its store (`_store.at`) says which steps are finalized (there: once their commit
file exists) and whether a part is persisted (there: once its `manifest.json`
exists, written after every chunk; a part without one is an upload not finished,
abandoned, or being retired by garbage collection, never a copy). Memory roots
are always local paths: a host's memory tier next to a remote directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Final

from jaxckpt.coord import _placement, _plan
from jaxckpt.format import _format
from jaxckpt.memory import _memory_tier
from jaxckpt.persistent import _index, _paths, _step_dirs, _storage, _store
from jaxckpt.tools import _trust

UNREADABLE: Final = "unreadable manifest"
OTHER_SAVE: Final = "another save of the step"


@dataclasses.dataclass(frozen=True)
class MemoryRoot:
    """One memory root (one host, or one process of a host) given on the command line.

    Attributes:
      path: the memory root as given.
      tier: the run's memory tier under it.
      domain: the failure domain of the processes that use this root, when it
        can be told (then a part of another domain held here is a replica).
    """

    path: Path
    tier: _memory_tier.MemoryTier
    domain: str | None = None

    def classify(self, held: Sequence[int], domains: Mapping[int, str]) -> dict[str, list[int]]:
        """Splits held owners into "own" and "replica" (or "unknown" without a domain)."""
        out: dict[str, list[int]] = {"own": [], "replica": [], "unknown": []}
        for o in sorted(held):
            kind = "unknown" if self.domain is None or o not in domains else None
            out[kind or ("own" if domains[o] == self.domain else "replica")].append(o)
        return out


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """Where the parts of one step are, and whether the step can be restored.

    Attributes:
      step: the training step.
      item_dir: `<dir>/<step>/<item>`, or None for a step found only in memory
        (not finalized, or already deleted by the manager's garbage collection).
      index: owner -> index manifest (for a memory-only step: the memory copies).
      owners: every part the step needs.
      memory: owner -> memory roots that hold a copy of this very save.
      stale: (root, owner, why) memory copies a restore never reads (another
        save of the step, or an unreadable manifest).
      persisted: owners whose part is durable in the checkpoint directory.
      missing: owners with no copy in reach.
      incomplete: owners with a part directory in `item_dir` that is not a durable
        copy of this save (no manifest of it): on a filesystem a damaged part (a
        persisted part appears whole, by a rename), on an object store an upload
        not finished, abandoned, or being retired (or a manifest of another save).
      quarantined: memory copies found damaged and marked (`_quarantine`): never
        offered to a restore, so not in `memory`.
    """

    step: int
    item_dir: Path | None
    index: Mapping[int, _format.PartManifest]
    owners: tuple[int, ...]
    memory: Mapping[int, tuple[Path, ...]]
    stale: tuple[tuple[Path, int, str], ...]
    persisted: frozenset[int]
    missing: tuple[int, ...]
    incomplete: tuple[int, ...] = ()
    quarantined: tuple[_trust.Quarantined, ...] = ()

    @property
    def finalized(self) -> bool:
        return self.item_dir is not None

    @property
    def restorable(self) -> bool:
        return self.finalized and bool(self.owners) and not self.missing

    @property
    def durable(self) -> bool:
        """Every part is persisted: the step survives the loss of every memory tier."""
        return self.finalized and bool(self.owners) and set(self.owners) <= self.persisted

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.index.values())

    @property
    def created(self) -> float | None:
        return max((m.created for m in self.index.values()), default=None)

    @property
    def process_count(self) -> int:
        return max((m.process_count for m in self.index.values()), default=0)

    @property
    def nonfinite(self) -> dict[int, int] | None:
        """Leaf index -> NaN/Inf values its parts counted, for the leaves that hold any;
        None if a part did not count (`TierOptions.count_nonfinite` off, older jaxckpt)."""
        out: dict[int, int] = {}
        for m in self.index.values():
            if m.nonfinite is None:
                return None
            for leaf, n in m.nonfinite.items():
                out[leaf] = out.get(leaf, 0) + n
        return out if self.index else None

    @property
    def domains(self) -> dict[int, str]:
        return {o: m.failure_domain for o, m in self.index.items()}

    def in_memory(self) -> set[int]:
        return {o for o, roots in self.memory.items() if roots}


class Catalog:
    """The steps of one item of a checkpoint directory, and the memory roots given.

    `directory` is a local path or an object-store URL (`gs://bucket/path`,
    `s3://bucket/path`); memory roots are local paths.

    Raises (on construction):
      FileNotFoundError: if `directory` does not exist.
      ValueError: if `item` is None and the directory holds several jaxckpt items.
      OSError: if the object store cannot be read.
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        item: str | None = None,
        memory_roots: Sequence[os.PathLike | str] = (),
        run_id: str | None = None,
    ):
        # Never Path(os.fspath(url)): that turns gs://b/x into the local path gs:/b/x.
        self.directory = _storage.as_path(directory)
        self.store = _store.at(self.directory)
        self.remote = self.store.remote  # what the reports say
        if not self.directory.is_dir():
            raise FileNotFoundError(f"Checkpoint directory {self.directory} does not exist.")
        self.item = item or _single_item(self.directory)
        self.step_dirs = _paths.finalized_steps(self.directory, self.item)
        self.unfinalized = self._unfinalized()
        self._index = {s: _index.readable(_index.read_index(d)) for s, d in self.step_dirs.items()}
        self.run_id = run_id or self._run_id()
        memory_roots = list(dict.fromkeys(os.fspath(r) for r in memory_roots))  # each once
        tiers = [_memory_tier.MemoryTier(os.fspath(r), self.run_id) for r in memory_roots]
        self._held = [self._holdings(t) for t in tiers]
        self.roots = [
            MemoryRoot(Path(os.fspath(r)), t, self._domain_of(t, i))
            for i, (r, t) in enumerate(zip(memory_roots, tiers, strict=True))
        ]
        self.quarantined = [q for r in self.roots for q in _trust.quarantined(r.path, r.tier)]

    def steps(self) -> list[int]:
        """Every step in the directory or in a memory root, oldest first."""
        return sorted(set(self.step_dirs).union(*(h.keys() for h in self._held)))

    def step(self, step: int) -> StepInfo:
        """Where the parts of `step` are.

        Raises:
          FileNotFoundError: if neither the directory nor a memory root has the step.
        """
        if step not in self.steps():
            raise FileNotFoundError(
                f"Step {step} is neither in {self.directory} (item {self.item!r}) nor in the "
                f"memory roots given; steps found: {self.steps() or 'none'}."
            )
        item_dir = self.step_dirs.get(step)
        index = self._index.get(step, {})
        memory: dict[int, list[Path]] = {}
        stale = []
        for root, held in zip(self.roots, self._held, strict=True):
            for owner, copy in held.get(step, {}).items():
                if copy is None:
                    stale.append((root.path, owner, UNREADABLE))
                elif item_dir is None or _index.matches(copy, index.get(owner, copy)):
                    memory.setdefault(owner, []).append(root.path)
                else:
                    stale.append((root.path, owner, OTHER_SAVE))
        if item_dir is None:  # memory only: describe the step from its memory copies
            index = {o: c for h in self._held for o, c in h.get(step, {}).items() if c is not None}
        persisted = _index.persisted_parts(item_dir, dict(index)) if item_dir else set()
        incomplete = _incomplete_parts(item_dir, index, persisted) if item_dir else ()
        held_by_root = {
            i: {o for o, roots in memory.items() if r.path in roots}
            for i, r in enumerate(self.roots)
        }
        plan = _plan.plan_step(step, index, -1, held_by_root, persisted)
        return StepInfo(
            step=step,
            item_dir=item_dir,
            index=index,
            owners=plan.owners,
            memory={o: tuple(r) for o, r in memory.items()},
            stale=tuple(stale),
            persisted=frozenset(persisted),
            missing=tuple(plan.missing) if item_dir else plan.owners,
            incomplete=incomplete,
            quarantined=tuple(q for q in self.quarantined if q.step == step),
        )

    def kept(self, durable: Collection[int]) -> list[_trust.KeptStep]:
        """The item's steps in the kept area (`_kept`; none on an object store, which has
        no kept area); `durable` are the steps durable in the directory."""
        if self.remote:
            return []
        return _trust.kept_steps(self.directory, self.item, durable)

    # ---- discovery ----------------------------------------------------------

    def _unfinalized(self) -> list[str]:
        """Step directories the manager has not finalized: a save in progress or
        abandoned. They have temporary names, or (where the manager writes into the
        final name and finalizes with a commit file, as on object stores) a step's
        name that the store does not count as finalized."""
        final = {d.name for d in self.store.step_dirs(self.directory).values()}
        out = []
        for p in self.directory.iterdir():
            if _step_dirs.is_temporary(p.name) or (
                p.name not in final
                and not p.name.startswith(".")
                and _step_dirs.step_of_name(p.name) is not None
            ):
                out.append(p.name)
        return sorted(out)

    def _run_id(self) -> str:
        for step in sorted(self._index, reverse=True):
            for m in self._index[step].values():
                return m.run_id
        return _paths.default_run_id(self.directory / "0" / self.item)

    def _holdings(
        self, tier: _memory_tier.MemoryTier
    ) -> dict[int, dict[int, _format.PartManifest | None]]:
        """step -> owner -> the manifest of the copy held (None if unreadable)."""
        return {
            s: {o: tier.read_manifest(s, o) for o in owners}
            for s, owners in tier.inventory().items()
        }

    def _domain_of(self, tier: _memory_tier.MemoryTier, i: int) -> str | None:
        """The failure domain of the processes whose memory tier `tier` is.

        A replica is never placed in its owner's domain, so parts of this
        domain are the root's own. The domain is read from RUN.json when the
        handler records it there; otherwise it is the one domain whose
        processes, with the replica placement every process computes, would
        hold exactly the parts found here.
        """
        try:
            run = json.loads((tier.run_dir / "RUN.json").read_text())
            if isinstance(run.get("failure_domain"), str):
                return str(run["failure_domain"])
        except (OSError, ValueError):
            pass
        votes: dict[str, int] = {}
        for step, copies in self._held[i].items():
            index = self._index.get(step) or {o: c for o, c in copies.items() if c is not None}
            domains = {o: m.failure_domain for o, m in index.items()}
            held = {o for o in copies if o in domains}
            for domain in _consistent_domains(held, domains, self._copies(step)):
                votes[domain] = votes.get(domain, 0) + 1
        best = sorted(votes.items(), key=lambda kv: -kv[1])
        if not best or (len(best) > 1 and best[0][1] == best[1][1]):
            return None
        return best[0][0]

    def _copies(self, step: int) -> dict[int, int]:
        """owner -> how many of the given roots hold a copy of it at `step`."""
        out: dict[int, int] = {}
        for held in self._held:
            for o in held.get(step, {}):
                out[o] = out.get(o, 0) + 1
        return out


def _consistent_domains(
    held: set[int], domains: Mapping[int, str], copies: Mapping[int, int]
) -> list[str]:
    """Domains D such that the processes of D found in `held`, plus the owners
    they hold replicas of under the standard placement, are exactly `held`."""
    candidates = sorted({domains[o] for o in held})
    if len(candidates) == 1:
        return candidates
    n = max(domains, default=-1) + 1
    if sorted(domains) != list(range(n)):
        return []
    layout = [domains[p] for p in range(n)]
    # With several roots given, copies per part = 1 + replicas; else try the usual counts.
    seen = max(copies.values(), default=1) - 1
    tries = [seen] if seen > 0 else [1, 2, 3]
    found = []
    for domain in candidates:
        procs = {o for o in held if domains[o] == domain}
        for replicas in tries:
            holders = _placement_of(tuple(layout), replicas)
            if holders is None:
                continue
            if procs | {o for o in range(n) if procs & set(holders[o])} == held:
                found.append(domain)
                break
    return found


@functools.lru_cache(maxsize=64)
def _placement_of(layout: tuple[str, ...], replicas: int) -> tuple[tuple[int, ...], ...] | None:
    try:
        return _placement.place_replicas(layout, replicas)
    except ValueError:
        return None


def _incomplete_parts(
    item_dir: Path, index: Mapping[int, _format.PartManifest], persisted: set[int]
) -> tuple[int, ...]:
    """Owners in `index` with a part directory in `item_dir` that is not durable
    (`StepInfo.incomplete`): one listing of the item directory."""
    try:
        present = {p.name for p in item_dir.iterdir()}
    except OSError:  # the step is being deleted
        return ()
    return tuple(
        o for o in sorted(index) if o not in persisted and _format.part_dir_name(o) in present
    )


def _single_item(directory: Path) -> str:
    """The one jaxckpt item of a checkpoint directory ("train" when it has none yet)."""
    items: set[str] = set()
    for step_dir in directory.iterdir():
        if (
            step_dir.is_dir()
            and not _step_dirs.is_temporary(step_dir.name)
            and _step_dirs.step_of_name(step_dir.name) is not None
        ):
            items.update(p.parent.name for p in step_dir.glob("*/index_*.json"))
            items.update(p.parent.name for p in step_dir.glob(f"*/{_format.STEP_INDEX_FILE}"))
    if len(items) > 1:
        raise ValueError(
            f"{directory} holds several jaxckpt items ({', '.join(sorted(items))}); "
            "pick one with --item."
        )
    return items.pop() if items else "train"
