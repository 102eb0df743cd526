"""Correlated failures: a whole failure domain (a rack) lost at once, and two.

N processes (threads against the simulated coordinator, tests/test_scale.py) in
racks of four exchange what their memory tiers still hold, plan the restore and
agree on its verdict, with `replicas` 1 and 2 and some parts persisted: the plan
finds a surviving copy of every part that has one, reads persistent storage
for the parts that have only that, or every process refuses naming the same
parts. The real multi-process runs are in tests/test_correlated_multiprocess.py.
"""

from __future__ import annotations

import pytest

from jaxckpt.bench import _coordinator, _scale
from jaxckpt.coord import _agreement, _placement, _plan
from jaxckpt.peer import _peers

COUNT = 24
RACK = 4  # processes a failure domain
STEP = 7
RUN = "run-correlated"


def rack(p: int) -> str:
    return f"rack{p // RACK}"


def restore_after_losing(racks: set[str], replicas: int, persisted: set[int]) -> list:
    """Every process's (sources of its own part, plan's missing parts) or its error."""
    domains = [rack(p) for p in range(COUNT)]
    holders = _placement.place_replicas(domains, replicas)
    lost = {p for p in range(COUNT) if rack(p) in racks}
    held = {p: ({p} if p not in lost else set()) for p in range(COUNT)}
    for owner, hs in enumerate(holders):
        for h in hs:
            if h not in lost:
                held[h].add(owner)
    manifests = _scale.manifests(COUNT, _scale.leaves(COUNT))

    def one(p: int):
        addresses = _peers.Addresses(RUN, {}, 30.0)
        peers = _peers.Peers(_scale._Service(p), "t" * 64, RUN, addresses, holders[p], replicas, 30)
        inventories = peers.exchange_inventories({STEP: held[p]})
        plan = _plan.plan_step(
            STEP, manifests, p, {q: inv.get(STEP, set()) for q, inv in inventories.items()},
            persisted,
        )  # fmt: skip
        error = None
        if not plan.restorable:
            error = FileNotFoundError(f"Step {STEP}: no copy of the parts of {plan.missing}")
        _agreement.agree(error, tag=f"restore/{RUN}/{STEP}", what="The restore", timeout_s=30)
        return [s.tier for s in plan.sources[p]], plan.missing

    sim = _coordinator.Simulation(COUNT)
    results = sim.run(one)
    assert sim.coordinator.data == {}
    return results


def expected_missing(racks: set[str], replicas: int, persisted: set[int]) -> list[int]:
    holders = _placement.place_replicas([rack(p) for p in range(COUNT)], replicas)
    return [
        o
        for o in range(COUNT)
        if o not in persisted and all(rack(h) in racks for h in (o, *holders[o]))
    ]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_lost_rack_leaves_a_copy_of_every_part_on_the_others(replicas):
    results = restore_after_losing({"rack2"}, replicas, persisted=set())
    assert expected_missing({"rack2"}, replicas, set()) == []
    for p, (ok, value) in enumerate(results):
        assert ok, (p, value)
        tiers, missing = value
        assert missing == []
        # The lost rack's processes read their own parts from peers in other racks.
        assert tiers[0] == (_plan.PEER if rack(p) == "rack2" else _plan.MEMORY), (p, tiers)


@pytest.mark.parametrize("replicas", [1, 2])
def test_two_lost_racks_read_what_survives_and_refuse_naming_the_rest(replicas):
    racks = {"rack1", "rack2"}  # with one replica, rack1's parts had it in rack2
    missing = expected_missing(racks, replicas, set())
    # With one replica some parts had every copy in the two racks; with two, placed
    # in distinct racks where balance allows, fewer (here none).
    assert bool(missing) == (replicas == 1), missing
    results = restore_after_losing(racks, replicas, persisted=set())
    if not missing:
        assert all(ok and value[1] == [] for ok, value in results), results
        return
    for p, (ok, error) in enumerate(results):  # every process: the same verdict
        assert not ok and type(error) is FileNotFoundError, (p, error)
        assert f"no copy of the parts of {missing}" in str(error), (p, error)

    # The same parts persisted: read from persistent storage, the rest from memory.
    results = restore_after_losing(racks, replicas, persisted=set(missing))
    for p, (ok, value) in enumerate(results):
        assert ok and value[1] == [], (p, value)
        if p in missing:
            assert value[0] == [_plan.PERSISTENT], (p, value)
