"""Correlated failures: a whole failure domain (a rack) lost at once, and two.

N processes (threads against the simulated coordinator, tests/test_scale.py) in
racks of four exchange what their memory tiers still hold, plan the restore and
agree on its verdict, with `replicas` 1 and 2 and some parts persisted: the plan
finds a surviving copy of every part that has one, reads persistent storage
for the parts that have only that, or every process refuses naming the same
parts. The real multi-process runs are in tests/test_correlated_multiprocess.py.

With failure domains of levels ("zone0/rack1/host5") a whole rack or zone is
lost by its path prefix; placement puts a copy outside the owner's zone, so
with one replica a lost zone still leaves a copy of every part.
"""

from __future__ import annotations

import pytest

from jaxckpt import TierOptions
from jaxckpt.bench import _coordinator, _scale
from jaxckpt.coord import _agreement, _placement, _plan
from jaxckpt.peer import _peers
from jaxckpt.run import _choreography

COUNT = 24
RACK = 4  # processes a failure domain
STEP = 7
RUN = "run-correlated"


def rack(p: int) -> str:
    return f"rack{p // RACK}"


RACKS = [rack(p) for p in range(COUNT)]
# 2 zones of 3 racks of 4 hosts, one process a host.
LEVELS = [f"zone{p // 12}/rack{p // RACK}/host{p}" for p in range(COUNT)]


def inside(domain: str, subtrees: set[str]) -> bool:
    """Whether `domain` is one of `subtrees` or below one ("zone0/rack1" holds
    "zone0/rack1/host5")."""
    return any(domain == s or domain.startswith(s + "/") for s in subtrees)


def restore_after_losing(
    racks: set[str], replicas: int, persisted: set[int], domains: list[str] = RACKS
) -> list:
    """Every process's (sources of its own part, plan's missing parts) or its error,
    after losing every process in `racks` (failure domains or path prefixes)."""
    holders = _placement.place_replicas(domains, replicas)
    lost = {p for p in range(COUNT) if inside(domains[p], racks)}
    held = {p: ({p} if p not in lost else set()) for p in range(COUNT)}
    for owner, hs in enumerate(holders):
        for h in hs:
            if h not in lost:
                held[h].add(owner)
    manifests = _scale.manifests(COUNT, _scale.leaves(COUNT))

    def one(p: int):
        inventories = _choreography.exchange_inventories(RUN, {STEP: held[p]}, 30)
        plan = _plan.plan_step(STEP, manifests, p, inventories.for_step(STEP), persisted)
        error = None
        if not plan.restorable:
            error = FileNotFoundError(f"Step {STEP}: no copy of the parts of {plan.missing}")
        _agreement.agree(error, tag=f"restore/{RUN}/{STEP}", what="The restore", timeout_s=30)
        return [s.tier for s in plan.sources[p]], plan.missing

    sim = _coordinator.Simulation(COUNT)
    results = sim.run(one)
    assert sim.left_over() == []
    return results


def expected_missing(
    racks: set[str], replicas: int, persisted: set[int], domains: list[str] = RACKS
) -> list[int]:
    holders = _placement.place_replicas(domains, replicas)
    return [
        o
        for o in range(COUNT)
        if o not in persisted and all(inside(domains[h], racks) for h in (o, *holders[o]))
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


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("subtree", ["zone0/rack1", "zone1/rack5", "zone0", "zone1"])
def test_levels_a_lost_rack_or_zone_leaves_a_copy_of_every_part(replicas, subtree):
    lost = [p for p in range(COUNT) if inside(LEVELS[p], {subtree})]
    assert len(lost) == (RACK if "rack" in subtree else 12)
    assert expected_missing({subtree}, replicas, set(), LEVELS) == []
    results = restore_after_losing({subtree}, replicas, persisted=set(), domains=LEVELS)
    for p, (ok, value) in enumerate(results):  # every process: the same verdict
        assert ok, (p, value)
        tiers, missing = value
        assert missing == []
        assert tiers[0] == (_plan.PEER if p in lost else _plan.MEMORY), (p, tiers)


def test_levels_place_copies_where_host_names_alone_would_lose_parts():
    # The same 24 processes named by host alone: a copy may share its owner's rack,
    # so losing a rack loses parts; named zone/rack/host, none (above).
    hosts = [f"host{p}" for p in range(COUNT)]
    named = [f"{rack(p)}/{hosts[p]}" for p in range(COUNT)]  # rack/host
    lost_by_rack = {r: expected_missing({r}, 1, set(), named) for r in sorted(set(RACKS))}
    assert all(missing == [] for missing in lost_by_rack.values()), lost_by_rack
    flat = _placement.place_replicas(hosts, 1)
    lost = [o for o, (h,) in enumerate(flat) if rack(o) == rack(h) == "rack2"]
    assert len(lost) == RACK - 1, flat  # each copy on the next host: mostly its rack's


def test_levels_a_lost_zone_and_a_rack_of_the_other_refuse_alike_or_read_persisted():
    lost = {"zone0", "zone1/rack4"}
    # One replica: the parts of zone0 copied into rack4 and rack4's own (copied into
    # zone0). Two: each part also has a copy in another rack of its own zone, which
    # saves rack4's parts but not zone0's.
    one, two = (expected_missing(lost, r, set(), LEVELS) for r in (1, 2))
    assert two and set(two) < set(one), (one, two)
    assert all(LEVELS[o].startswith("zone0/") for o in two), two
    for replicas, missing in ((1, one), (2, two)):
        results = restore_after_losing(lost, replicas, persisted=set(), domains=LEVELS)
        for p, (ok, error) in enumerate(results):  # every process: the same verdict
            assert not ok and type(error) is FileNotFoundError, (p, error)
            assert f"no copy of the parts of {missing}" in str(error), (p, error)
        results = restore_after_losing(lost, replicas, persisted=set(missing), domains=LEVELS)
        for p, (ok, value) in enumerate(results):
            assert ok and value[1] == [], (p, value)
            if p in missing:
                assert value[0] == [_plan.PERSISTENT], (p, value)


def test_levels_reach_the_placement_through_the_run_set_up():
    """The run's meeting (`_choreography.meeting`) places over the zone/rack/host domains the
    processes post, and `holders_with` (a replicated leaf: every process a partner)
    looks the partners' domains up: each copy in the other zone, one copy a holder."""
    partners = [tuple(q for q in range(COUNT) if q != p) for p in range(COUNT)]

    def meet(p: int) -> tuple:
        opts = TierOptions("/nonexistent", replicas=1, failure_domain=LEVELS[p])
        hello = _peers.Hello.start("run-levels", lambda: _scale.StubService(p), opts)
        peers = _choreography.meeting(hello)
        return peers.holders, peers.holders_with(partners)

    results = _coordinator.Simulation(COUNT).run(meet)
    assert all(ok for ok, _ in results), results[:2]
    placed = _placement.place_replicas(LEVELS, 1)
    for layout in (0, 1):  # the set-up's holders, then the partner-first ones
        holders = [value[layout] for _, value in results]
        if layout == 0:
            assert holders == list(placed)
        zone = [d.split("/")[0] for d in LEVELS]
        assert all(zone[h] != zone[o] for o, (h,) in enumerate(holders)), holders
        assert sorted(h for (h,) in holders) == list(range(COUNT))  # max/mean held: 1.0
