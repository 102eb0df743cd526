"""Who holds which parts in memory, for every process of a job, in a few hundred bytes.

A process's inventory is what its memory tier holds: step -> the owners whose
verified part it holds. In the exchange `inventories` each process posts its
own as offsets from itself (owner - process), so that the usual layout (each
process holds its own part and its placement's few) is the same text on nearly
every process. The decider (`combine`) groups the processes by the text they
posted, each group's processes as ranges, and adds for every step the ranges
of owners that some process holds (`covered`). Every process reads only that
outcome (`decode`): its size grows with the distinct inventories, not with N,
and no process decodes N inventories. The holders of one part are looked up
when it is planned (`StepHoldings.holders`: O(groups x offsets)), so a process
plans only the parts it reads, and the parts no process holds (`uncovered`) are
the decider's to name, the same on every process.

Pure: no I/O, no JAX.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from typing import Any, Final

Inventory = dict[int, set[int]]  # step -> owners whose part a process holds
_INVERT_FROM: Final = 32  # from this many groups on, a step's holders are inverted once


class Ranges:
    """A set of integers as sorted, disjoint, half-open ranges: `[start, stop, ...]`."""

    def __init__(self, bounds: Sequence[int] = ()):
        self.bounds = list(bounds)

    @classmethod
    def of(cls, values: Iterable[int]) -> Ranges:
        bounds: list[int] = []
        for v in sorted(set(values)):
            if bounds and bounds[-1] == v:
                bounds[-1] = v + 1
            else:
                bounds += [v, v + 1]
        return cls(bounds)

    @classmethod
    def union(cls, many: Iterable[Ranges]) -> Ranges:
        spans = sorted(
            (r.bounds[i], r.bounds[i + 1]) for r in many for i in range(0, len(r.bounds), 2)
        )
        bounds: list[int] = []
        for start, stop in spans:
            if bounds and start <= bounds[-1]:
                bounds[-1] = max(bounds[-1], stop)
            else:
                bounds += [start, stop]
        return cls(bounds)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        return bisect.bisect_right(self.bounds, value) % 2 == 1

    def __iter__(self) -> Iterator[int]:
        for i in range(0, len(self.bounds), 2):
            yield from range(self.bounds[i], self.bounds[i + 1])

    def shifted(self, by: int) -> Ranges:
        return Ranges([b + by for b in self.bounds])

    def outside(self, values: Sequence[int]) -> list[int]:
        """The members of sorted `values` not in these ranges (bisected per gap, not per
        value)."""
        out: list[int] = []
        edges = [-(1 << 62), *self.bounds, 1 << 62]
        for i in range(0, len(edges), 2):  # the gaps: [edges[i], edges[i + 1])
            lo = bisect.bisect_left(values, edges[i])
            hi = bisect.bisect_left(values, edges[i + 1])
            out.extend(values[lo:hi])
        return out


def wire(me: int, local: Mapping[int, Set[int]]) -> str:
    """What process `me` posts of its inventory: owners as offsets from itself."""
    offsets = {str(s): sorted(o - me for o in owners) for s, owners in sorted(local.items())}
    return json.dumps(offsets, separators=(",", ":"))


def combine(texts: Mapping[int, str]) -> dict[str, Any]:
    """The decider's outcome of the exchange `inventories`, from every process's `wire`
    text: the processes grouped by the text they posted, and each step's covered owners.

    Raises:
      ValueError: if a posted text is not an inventory.
    """
    members: dict[str, list[int]] = {}
    for p, text in texts.items():
        members.setdefault(text, []).append(p)
    groups = []
    for text, processes in members.items():
        inventory = json.loads(text or "{}")
        if not isinstance(inventory, dict):
            raise ValueError(f"processes {processes[:8]} posted no inventory: {text[:80]!r}")
        groups.append([inventory, Ranges.of(processes).bounds])
    return {"groups": groups, "covered": _covered(groups)}


def _covered(groups: list[list[Any]]) -> dict[str, list[int]]:
    """step -> ranges of owners some process holds: each group's ranges shifted by each
    of its offsets (O(groups x offsets x ranges), nothing per process)."""
    shifted: dict[str, list[Ranges]] = {}
    for inventory, bounds in groups:
        processes = Ranges(bounds)
        for step, offsets in inventory.items():
            shifted.setdefault(step, []).extend(processes.shifted(int(o)) for o in offsets)
    return {step: Ranges.union(many).bounds for step, many in shifted.items()}


class StepHoldings:
    """Who holds which part of one step in memory (see the module docstring)."""

    def __init__(
        self, count: int, groups: Sequence[tuple[tuple[int, ...], Ranges]], covered: Ranges
    ):
        self.count = count  # processes, for the order in which readers spread over holders
        self._groups = [(offsets, processes) for offsets, processes in groups if offsets]
        self.covered = covered  # owners that some process holds
        self._inverted: dict[int, list[int]] | None = None

    @classmethod
    def of(cls, held: Mapping[int, Set[int]]) -> StepHoldings:
        """From every process's owners held (process -> owners), as a full table."""
        groups = [
            (tuple(sorted(o - p for o in owners)), Ranges([p, p + 1])) for p, owners in held.items()
        ]
        covered = Ranges.of(o for owners in held.values() for o in owners)
        return cls(max(1, len(held)), groups, covered)

    def holders(self, owner: int) -> list[int]:
        """The processes that hold `owner`'s part, in process order."""
        if len(self._groups) >= _INVERT_FROM:
            if self._inverted is None:
                inverted: dict[int, list[int]] = {}
                for offsets, processes in self._groups:
                    for p in processes:
                        for o in offsets:
                            inverted.setdefault(p + o, []).append(p)
                self._inverted = inverted
            return sorted(self._inverted.get(owner, ()))
        return sorted(
            owner - o
            for offsets, processes in self._groups
            for o in offsets
            if owner - o in processes
        )

    def held_by(self, p: int) -> set[int]:
        """The owners whose part process `p` holds."""
        return {p + o for offsets, processes in self._groups if p in processes for o in offsets}

    def uncovered(self, owners: Sequence[int]) -> list[int]:
        """The members of sorted `owners` whose part no process holds."""
        return self.covered.outside(owners)


class Holdings:
    """Every process's inventory, for every step, as the decider grouped them."""

    def __init__(
        self,
        count: int,
        groups: Sequence[tuple[Mapping[int, tuple[int, ...]], Ranges]],
        covered: Mapping[int, Ranges],
    ):
        self.count = count
        self._groups = list(groups)
        self._covered = dict(covered)

    @classmethod
    def of(cls, inventories: Mapping[int, Inventory]) -> Holdings:
        """From a full table (process -> inventory): one process, tests, tools."""
        outcome = combine({p: wire(p, inv) for p, inv in inventories.items()})
        return decode(outcome, max(1, len(inventories)))

    def steps(self) -> set[int]:
        return set(self._covered)

    def for_step(self, step: int) -> StepHoldings:
        groups = [(inventory.get(step, ()), processes) for inventory, processes in self._groups]
        return StepHoldings(self.count, groups, self._covered.get(step, Ranges()))

    def inventory(self, p: int) -> Inventory:
        """Process `p`'s inventory."""
        for inventory, processes in self._groups:
            if p in processes:
                return {s: {p + o for o in offsets} for s, offsets in inventory.items()}
        return {}


def decode(outcome: Mapping[str, Any], count: int) -> Holdings:
    """The `Holdings` of a job of `count` processes from `combine`'s outcome.

    Raises:
      ValueError: if the outcome is not one `combine` made.
    """
    try:
        groups = [
            (
                {int(s): tuple(int(o) for o in offsets) for s, offsets in inventory.items()},
                Ranges([int(b) for b in bounds]),
            )
            for inventory, bounds in outcome["groups"]
        ]
        covered = {
            int(s): Ranges([int(b) for b in bounds]) for s, bounds in outcome["covered"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"Not an outcome of the exchange of inventories: {e}") from e
    return Holdings(count, groups, covered)
