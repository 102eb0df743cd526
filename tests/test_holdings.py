"""The exchange of inventories in a few hundred bytes (jaxckpt/coord/_holdings.py): the
grouped outcome answers every question the full table did."""

from __future__ import annotations

import json
import random

import pytest

from jaxckpt.bench import _scale
from jaxckpt.coord import _holdings, _placement, _plan


def table(count: int, replicas: int, lost: set[int], seed: int) -> dict[int, dict[int, set[int]]]:
    """process -> {step: owners held}: each its own part and its placed copies, a few
    processes lost (nothing held), a few more holding an older step too."""
    rng = random.Random(seed + 1000)  # not the caller's choice of lost processes
    domains = [f"host{p // 4}" for p in range(count)]
    holders = _placement.place_replicas(domains, replicas)
    held: dict[int, dict[int, set[int]]] = {p: {5: {p}} for p in range(count)}
    for owner, hs in enumerate(holders):
        for h in hs:
            held[h][5].add(owner)
    for p in rng.sample(sorted(set(range(count)) - lost), 3):
        held[p][4] = {p, (p + 1) % count}
    for p in lost:
        held[p] = {}
    return held


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_grouped_outcome_gives_every_processes_holders_and_inventory(seed, replicas):
    count = 48
    rng = random.Random(seed)
    lost = set(rng.sample(range(count), 5))
    full = table(count, replicas, lost, seed)
    outcome = json.loads(
        json.dumps(_holdings.combine({p: _holdings.wire(p, inv) for p, inv in full.items()}))
    )
    holdings = _holdings.decode(outcome, count)
    assert holdings.steps() == {4, 5}
    for step in (4, 5):
        mine = holdings.for_step(step)
        owners = list(range(count))
        expected_uncovered = [
            o for o in owners if not any(o in inv.get(step, ()) for inv in full.values())
        ]
        assert mine.uncovered(owners) == expected_uncovered
        for o in owners:
            assert mine.holders(o) == sorted(p for p, inv in full.items() if o in inv.get(step, ()))
    for p in range(count):
        assert holdings.inventory(p) == {s: o for s, o in full[p].items()}


@pytest.mark.parametrize("lost", [set(), {7}, {0, 1, 2, 3}])
def test_a_plan_from_the_groups_is_the_plan_from_the_full_table(lost):
    count = 32
    full = table(count, 1, lost, 0)
    manifests = _scale.manifests(count, _scale.leaves(count))
    grouped = _holdings.Holdings.of(full).for_step(5)
    persisted = {1, 2}
    for me in (0, 5, count - 1, *lost):
        a = _plan.plan_step(5, manifests, me, grouped, persisted)
        b = _plan.plan_step(
            5, manifests, me, {p: inv.get(5, set()) for p, inv in full.items()}, persisted
        )
        assert a.missing == b.missing and a.restorable == b.restorable
        assert dict(a.sources) == dict(b.sources)
    # Missing: exactly the parts no process holds (none is persisted here).
    plan = _plan.plan_step(5, manifests, 0, grouped, set())
    assert plan.missing == [o for o in range(count) if not grouped.holders(o)]


def test_the_outcome_stays_small_as_the_job_grows():
    """Processes of the same layout post the same text: the outcome grows with the
    distinct inventories, not with N."""
    sizes = {}
    for count in (64, 1024):
        full = table(count, 1, {count // 2}, 1)
        outcome = _holdings.combine({p: _holdings.wire(p, inv) for p, inv in full.items()})
        sizes[count] = len(json.dumps(outcome))
    assert sizes[1024] < 2 * sizes[64] < 4000, sizes


def test_a_plan_asks_persistent_storage_only_about_the_parts_it_needs():
    count = 64
    full = table(count, 1, {9}, 2)
    manifests = _scale.manifests(count, _scale.leaves(count))
    asked: list[int] = []

    class Persisted:
        def __contains__(self, owner: object) -> bool:
            asked.append(int(owner))  # type: ignore[call-overload]
            return False

    plan = _plan.plan_step(5, manifests, 9, _holdings.Holdings.of(full).for_step(5), Persisted())
    assert plan.restorable and plan.sources[9][0].tier == _plan.PEER
    assert asked == [9]


def test_ranges():
    r = _holdings.Ranges.of([1, 2, 3, 7, 9, 10])
    assert r.bounds == [1, 4, 7, 8, 9, 11]
    assert [x for x in range(12) if x in r] == [1, 2, 3, 7, 9, 10] == list(r)
    assert r.outside([0, 1, 4, 5, 8, 10, 11]) == [0, 4, 5, 8, 11]
    assert _holdings.Ranges.union([r, r.shifted(1)]).bounds == [1, 5, 7, 12]
    with pytest.raises(ValueError, match="Not an outcome"):
        _holdings.decode({"groups": 3}, 4)
