"""Restore planning: for a step, where every part can be read from. Pure logic.

Every process computes the same verdict from the same inputs (the step's index
manifests, the parts the exchange of inventories says no process holds, and
persistent storage), so all agree on whether a step is restorable before any of
them starts reading. Sources are planned per part when a reader asks for them
(`StepPlan.sources` is lazy): a process plans only the parts it reads, O(own
parts), not every part of the step.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable, Container, Iterator, Mapping, Sequence, Set

from jaxckpt.coord import _holdings
from jaxckpt.format import _format

MEMORY = "memory"  # this process's own memory tier
PEER = "peer"  # another process's memory tier, over the peer data service
PERSISTENT = "persistent"  # the CheckpointManager's directory
TIER_ORDER = (MEMORY, PEER, PERSISTENT)


@dataclasses.dataclass(frozen=True)
class Source:
    """A verified copy of a part: which tier, and which process serves it."""

    tier: str
    holder: int | None = None  # the serving process (MEMORY, PEER); None for PERSISTENT

    def describe(self) -> str:
        return self.tier if self.holder is None else f"{self.tier} of process {self.holder}"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """For one step: the parts that make it up and an ordered list of sources for each."""

    step: int
    owners: tuple[int, ...]  # every process that saved a part of the step
    manifests: Mapping[int, _format.PartManifest]  # owner -> index manifest
    sources: Mapping[int, tuple[Source, ...]]  # owner -> fastest first
    # The owners that may have no source: those no process holds (None: any owner).
    suspects: Sequence[int] | None = None
    # The planning process: its own part's leaf records are the plan's (`leaves`).
    reader: int | None = None

    @property
    def missing(self) -> list[int]:
        """Owners whose part has no verified copy (or no index manifest) anywhere."""
        unindexed = set()
        if len(self.manifests) < len(self.owners):  # the manifests' owners are among them
            unindexed = set(self.owners).difference(self.manifests)
        suspects = self.owners if self.suspects is None else self.suspects
        return sorted(unindexed | {o for o in suspects if not self.sources.get(o)})

    @property
    def restorable(self) -> bool:
        return bool(self.owners) and not self.missing

    @property
    def leaves(self) -> tuple[_format.LeafRecord, ...]:
        """The leaf records of the reader's own part, else of the first part: one part's
        manifest (a step index parses no other part's entry for them)."""
        if self.reader is not None and self.reader in self.manifests:
            return self.manifests[self.reader].leaves
        return self.manifests[next(iter(self.manifests))].leaves

    def without(self, tier: str) -> StepPlan:
        """This plan with no source of `tier` (a tier the reader cannot use after all)."""
        found = self.sources

        def plan(owner: int) -> tuple[Source, ...]:
            return tuple(s for s in found.get(owner, ()) if s.tier != tier)

        return dataclasses.replace(self, sources=LazySources(self.owners, plan), suspects=None)

    def chunk_owners(self, me: int = 0) -> dict[tuple[int, tuple[int, ...]], tuple[int, ...]]:
        """(leaf, chunk index) -> the owners whose parts hold the chunk, the one to read
        first first.

        A chunk is in one part, or (a small shard held by data-parallel replicas,
        `_replicas.every_holder_saves`) in the part of each of its holders: those
        come in the order of their fastest source (a copy in `me`'s own memory tier
        first), then in a rotating order after `me`, so that readers spread over
        them. Only leaves saved once are listed: a per-process leaf has its own
        value in every part, and its reader names the owner it reads.
        """
        per_process = self._per_process()
        found: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for owner in self.manifests:
            try:
                m = self.manifests[owner]
            except ValueError:  # a damaged entry of the step index: no copy to read there
                continue
            for key in _chunks(m, per_process):
                found.setdefault(key, []).append(owner)
        count = max(1, len(self.manifests))

        def rank(owner: int) -> tuple[int, int, int]:
            sources = self.sources.get(owner, ())
            tier = TIER_ORDER.index(sources[0].tier) if sources else len(TIER_ORDER)
            return (tier, (owner - me) % count, owner)

        return {
            key: tuple(owners) if len(owners) == 1 else tuple(sorted(owners, key=rank))
            for key, owners in found.items()
        }

    def chunk_owner(
        self, first: int | None
    ) -> Callable[[tuple[int, tuple[int, ...]], bool], tuple[int, ...]]:
        """`chunk_owners(first).get(key, ())`, looking in `first`'s part before any
        other: a process restoring onto the mesh it saved from reads only its own part
        (while a verified source of it is faster than persistent storage), and never
        builds the table of every part's chunks (O(chunks of the step)). The returned
        function's second argument, `every`, asks for every part that holds the chunk
        (the table, built on first use): where the own copy failed."""
        mine = self.manifests.get(first) if first is not None else None
        own: set[tuple[int, tuple[int, ...]]] = set()
        if mine is not None and first is not None:
            fastest = self.sources.get(first, ())
            if fastest and fastest[0].tier != PERSISTENT:
                own = set(_chunks(mine, self._per_process()))
        table: list[dict[tuple[int, tuple[int, ...]], tuple[int, ...]]] = []
        lock = threading.Lock()

        def owners(key: tuple[int, tuple[int, ...]], every: bool = False) -> tuple[int, ...]:
            if key in own and not every and first is not None:
                return (first,)
            with lock:  # leaves are read on several threads
                if not table:
                    table.append(self.chunk_owners(first or 0))
            return table[0].get(key, ())

        return owners

    def _per_process(self) -> set[int]:
        if not self.manifests:
            return set()
        return {i for i, r in enumerate(self.leaves) if r.per_process}


def _chunks(
    m: _format.PartManifest, per_process: Set[int]
) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(leaf, chunk index) of every chunk of the leaves saved once in part `m`."""
    for leaf, chunks in m.chunks.items():
        if leaf not in per_process:
            for c in chunks:
                yield leaf, c.index


class LazySources(Mapping[int, tuple[Source, ...]]):
    """owner -> its sources, each planned on first use (a reader asks only for the
    parts it reads)."""

    def __init__(self, owners: Sequence[int], plan: Callable[[int], tuple[Source, ...]]):
        self._owners = owners  # sorted
        self._plan = plan
        self._planned: dict[int, tuple[Source, ...]] = {}

    def __getitem__(self, owner: int) -> tuple[Source, ...]:
        found = self._planned.get(owner)
        if found is None:
            i = _index_of(self._owners, owner)
            if i is None:
                raise KeyError(owner)
            found = self._planned[owner] = self._plan(owner)
        return found

    def __iter__(self) -> Iterator[int]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)


def _index_of(values: Sequence[int], value: int) -> int | None:
    i = bisect.bisect_left(values, value)
    return i if i < len(values) and values[i] == value else None


def expected_owners(manifests: Mapping[int, _format.PartManifest]) -> set[int]:
    return set(range(_part_count(manifests)))


def _part_count(manifests: Mapping[int, _format.PartManifest]) -> int:
    return _format.saved_process_count(manifests)


def _owners(manifests: Mapping[int, _format.PartManifest]) -> list[int]:
    """Every owner the step has (its process count's, and any other indexed): sorted."""
    count = _part_count(manifests)
    if manifests and min(manifests) >= 0 and max(manifests) < count:  # as a step usually is
        return list(range(count))
    return sorted(set(range(count)).union(manifests))


def plan_step(
    step: int,
    manifests: Mapping[int, _format.PartManifest],
    me: int,
    held: Mapping[int, Set[int]] | _holdings.StepHoldings,
    persisted: Container[int],
) -> StepPlan:
    """Decides where each part of `step` is read from by process `me`.

    The verdict (`restorable`, `missing`) looks only at the parts no process holds
    (and persistent storage for those); the sources of a part are planned when
    asked for (`StepPlan.sources`).

    Args:
      step: the step to restore.
      manifests: owner -> index manifest of every part saved for the step.
      me: the planning process.
      held: who holds which verified part of `step` in memory: the exchange's
        `StepHoldings`, or process -> owners held.
      persisted: owners whose part is durable in persistent storage (asked only
        about the parts planned and those no process holds).

    Returns:
      The plan; `plan.missing` lists parts with no copy (including parts whose
      index manifest is missing although the step had that many processes).
    """
    owners = _owners(manifests)
    holdings = held if isinstance(held, _holdings.StepHoldings) else _holdings.StepHoldings.of(held)
    mine = holdings.held_by(me)
    count = holdings.count

    def plan(owner: int) -> tuple[Source, ...]:
        found: list[Source] = []
        if owner in mine:
            found.append(Source(MEMORY, me))
        # Prefer the owner itself, then the others in a rotating order so that
        # readers of the same part spread over its holders.
        peers = [p for p in holdings.holders(owner) if p != me]
        peers.sort(key=lambda p: (p != owner, (p - me) % count, p))
        found += [Source(PEER, p) for p in peers]
        if owner in persisted:
            found.append(Source(PERSISTENT))
        return tuple(found)

    sources = LazySources(owners, plan)
    # The manifests as handed in (a step index parses each part's entry when asked for:
    # a copy would parse them all).
    return StepPlan(step, tuple(owners), manifests, sources, holdings.uncovered(owners), me)
