"""Tests for replica placement (pure logic, no processes)."""

import collections
import json
import os
import random
import subprocess
import sys

import pytest

from jaxckpt.coord import _placement
from jaxckpt.coord._placement import partner_holders, place_replicas


def _random_layouts(seed: int, count: int) -> list[tuple[list[str], int]]:
    """Random (domains, replicas) pairs that admit a placement."""
    rng = random.Random(seed)
    layouts = []
    while len(layouts) < count:
        n = rng.randint(1, 24)
        style = rng.choice(["random", "blocks", "interleaved", "shuffled"])
        if style == "random":
            num_domains = rng.randint(1, min(n, 6))
            domains = [f"node{rng.randrange(num_domains)}" for _ in range(n)]
        else:
            per_domain = rng.randint(1, 4)
            num_domains = max(1, n // per_domain)
            n = per_domain * num_domains
            if style == "blocks":
                domains = [f"node{i // per_domain}" for i in range(n)]
            else:
                domains = [f"node{i % num_domains}" for i in range(n)]
                if style == "shuffled":
                    rng.shuffle(domains)
        sizes = collections.Counter(domains)
        most = min(n - s for s in sizes.values())
        layouts.append((domains, rng.randint(0, min(most, 4))))
    return layouts


def _loads(holders: tuple[tuple[int, ...], ...]) -> list[int]:
    load = [0] * len(holders)
    for hs in holders:
        for h in hs:
            load[h] += 1
    return load


def _best_max_load(domains: list[str], replicas: int) -> int:
    """Smallest feasible maximum holder load, by max-flow (reference solution)."""
    n = len(domains)

    def feasible(cap: int) -> bool:
        source, sink = 2 * n, 2 * n + 1
        graph: list[dict[int, int]] = [{} for _ in range(2 * n + 2)]

        def edge(u: int, v: int, c: int) -> None:
            graph[u][v] = graph[u].get(v, 0) + c
            graph[v].setdefault(u, 0)

        for o in range(n):
            edge(source, o, replicas)
            edge(n + o, sink, cap)
            for h in range(n):
                if domains[h] != domains[o]:
                    edge(o, n + h, 1)
        flow = 0
        while True:
            prev: dict[int, int | None] = {source: None}
            queue = [source]
            for u in queue:
                for v, c in graph[u].items():
                    if c > 0 and v not in prev:
                        prev[v] = u
                        queue.append(v)
            if sink not in prev:
                return flow == n * replicas
            v = sink
            while (u := prev[v]) is not None:
                graph[u][v] -= 1
                graph[v][u] += 1
                v = u
            flow += 1

    cap = replicas
    while not feasible(cap):
        cap += 1
    return cap


@pytest.mark.parametrize("seed", range(4))
def test_properties_over_random_layouts(seed: int) -> None:
    for domains, replicas in _random_layouts(seed, 150):
        holders = place_replicas(domains, replicas)
        assert len(holders) == len(domains)
        for owner, hs in enumerate(holders):
            assert len(hs) == replicas
            assert len(set(hs)) == replicas, (domains, replicas, owner, hs)
            assert owner not in hs
            assert all(domains[h] != domains[owner] for h in hs), (domains, owner, hs)
        assert place_replicas(domains, replicas) == holders
        assert place_replicas(tuple(domains), replicas) == holders


def test_busiest_holder_is_as_light_as_possible() -> None:
    for domains, replicas in _random_layouts(10, 120):
        if replicas == 0 or len(domains) > 12:
            continue
        load = _loads(place_replicas(domains, replicas))
        assert max(load) == _best_max_load(domains, replicas), (domains, replicas, load)


@pytest.mark.parametrize("per_domain", [1, 2, 3, 8])
@pytest.mark.parametrize("num_domains", [2, 3, 5, 16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_equal_domains_are_perfectly_balanced_and_spread(
    per_domain: int, num_domains: int, interleaved: bool
) -> None:
    n = per_domain * num_domains
    if interleaved:
        domains = [f"host{i % num_domains}" for i in range(n)]
    else:
        domains = [f"host{i // per_domain}" for i in range(n)]
    for replicas in range(1, min(n - per_domain, 4) + 1):
        holders = place_replicas(domains, replicas)
        assert _loads(holders) == [replicas] * n
        if replicas < num_domains:
            for hs in holders:
                assert len({domains[h] for h in hs}) == replicas, (domains, replicas, holders)


def test_skewed_layout_stays_fast_and_balanced() -> None:
    domains = ["big"] * 600 + [f"small{i}" for i in range(400)]
    load = _loads(place_replicas(domains, 2))
    # 1200 replicas of "big" must land on the 400 small processes.
    assert max(load) == 3
    assert min(load) >= 1


def test_same_answer_under_another_hash_seed() -> None:
    domains = [f"rack{i % 3}/host{i % 7}" for i in range(40)]
    # Load the module file alone (stdlib only, no site packages) so the
    # subprocess starts fast whatever the package imports.
    code = (
        "import importlib.util, json, sys; "
        "spec = importlib.util.spec_from_file_location('placement', sys.argv[2]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(json.dumps(module.place_replicas(json.loads(sys.argv[1]), 2)))"
    )
    answers = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-S", "-c", code, json.dumps(domains), _placement.__file__],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        answers.add(out)
    assert len(answers) == 1
    assert json.loads(answers.pop()) == [list(h) for h in place_replicas(domains, 2)]


def test_zero_replicas_and_single_process() -> None:
    assert place_replicas(["a", "b", "a"], 0) == ((), (), ())
    assert place_replicas(["solo"], 0) == ((),)
    assert place_replicas([], 3) == ()
    with pytest.raises(ValueError, match=r"replicas=1 needs at least 1 processes outside"):
        place_replicas(["solo"], 1)


def test_too_few_processes_outside_a_domain() -> None:
    with pytest.raises(ValueError) as err:
        place_replicas(["node0", "node1", "node0", "node2"], 3)
    message = str(err.value)
    assert "replicas=3" in message
    assert "'node0'" in message
    assert "process 0" in message
    assert "only 2 exist" in message
    assert "TierOptions.replicas" in message


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_rejects_bad_replicas(bad: object) -> None:
    with pytest.raises(ValueError, match="replicas must be a non-negative int"):
        place_replicas(["a", "b"], bad)  # type: ignore[arg-type]


def test_rejects_bad_domain() -> None:
    with pytest.raises(ValueError, match="process 1"):
        place_replicas(["a", ""], 1)


# ---- partner_holders: one owner's holders in a data-parallel layout ---------------------


def test_partners_in_other_domains_come_first_and_each_copy_gets_a_domain_of_its_own():
    domains = ["a", "a", "b", "b", "c", "c"]
    # Process 0's partners are 1 (same domain), 2 and 3 (both in b), 4 (in c).
    got = partner_holders(0, [1, 2, 3, 4], domains.__getitem__, [5, 3], 2, 6)
    assert got == (2, 4)  # never a second copy in b, never the owner's domain
    # One replica: the first partner after the owner in another domain.
    assert partner_holders(0, [1, 2, 3, 4], domains.__getitem__, [5], 1, 6) == (2,)


def test_without_partners_in_other_domains_the_set_up_holders_fill_unused_domains_first():
    domains = ["a", "a", "b", "c"]
    got = partner_holders(0, [1], domains.__getitem__, [2, 3], 2, 4)
    assert got == (2, 3)
    # A partner in b takes one copy; the set-up's holder in b is then second to c.
    assert partner_holders(0, [2], domains.__getitem__, [2, 3], 2, 4) == (2, 3)
    assert partner_holders(1, [2], {0: "a", 1: "a", 2: "b", 3: "b"}.__getitem__, [3, 2], 1, 4) == (
        2,
    )


def test_a_leaf_every_process_holds_spreads_its_copies_around_the_ring():
    n = 8
    domains = [f"host{p}" for p in range(n)]
    holders = [
        partner_holders(p, [q for q in range(n) if q != p], domains.__getitem__, [], 1, n)
        for p in range(n)
    ]
    assert [h for (h,) in holders] == [(p + 1) % n for p in range(n)]
    assert sorted(h for (h,) in holders) == list(range(n))  # each holds exactly one copy


# ---- failure domains with levels ("zone/rack/host") -------------------------------------


def _tree(zones: int, racks: int, hosts: int, per_host: int = 1) -> list[str]:
    """Process -> "z<i>/r<j>/h<k>": `zones` x `racks` x `hosts` hosts of `per_host`."""
    return [
        f"z{z}/r{r}/h{h}"
        for z in range(zones)
        for r in range(racks)
        for h in range(hosts)
        for _ in range(per_host)
    ]


def _subtrees(domains: list[str], procs: tuple[int, ...], levels: int) -> int:
    """How many distinct subtrees of `levels` levels (1: zones, 2: racks) `procs` are in."""
    return len({tuple(domains[p].split("/")[:levels]) for p in procs})


def _max_over_mean(holders: tuple[tuple[int, ...], ...]) -> float:
    load = _loads(holders)
    return max(load) / (sum(load) / len(load))


def _random_trees(seed: int, count: int) -> list[list[str]]:
    """Uneven zone/rack/host layouts, processes in a shuffled order."""
    rng = random.Random(seed)
    layouts = []
    for _ in range(count):
        domains = [
            f"z{z}/r{r}/h{h}"
            for z in range(rng.randint(1, 4))
            for r in range(rng.randint(1, 3))
            for h in range(rng.randint(1, 3))
            for _ in range(rng.randint(1, 2))
        ]
        rng.shuffle(domains)
        layouts.append(domains)
    return layouts


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (2, 3, 4, 2), (3, 2, 2, 1), (4, 3, 2, 2)])
@pytest.mark.parametrize("shuffled", [False, True])
def test_levels_spread_copies_over_zones_then_racks_and_stay_balanced(shape, shuffled) -> None:
    zones, racks = shape[:2]
    domains = _tree(*shape)
    if shuffled:
        random.Random(len(domains)).shuffle(domains)
    for replicas in range(1, 5):
        holders = place_replicas(domains, replicas)
        assert _loads(holders) == [replicas] * len(domains)  # max/mean = 1.0
        assert _max_over_mean(holders) == 1.0
        for owner, hs in enumerate(holders):
            copies = (owner, *hs)
            assert all(domains[h] != domains[owner] for h in hs)  # never the owner's host
            # The owner and its copies: in as many zones, then racks, then hosts as exist.
            assert _subtrees(domains, copies, 1) == min(replicas + 1, zones), (owner, hs)
            assert _subtrees(domains, copies, 2) == min(replicas + 1, zones * racks)
            assert _subtrees(domains, copies, 3) == replicas + 1
        assert place_replicas(domains, replicas) == holders


def test_two_zones_one_copy_in_the_other_zone_two_in_both() -> None:
    domains = _tree(2, 2, 2)  # processes 0-3 in z0, 4-7 in z1
    one = place_replicas(domains, 1)
    assert all((owner < 4) != (h < 4) for owner, (h,) in enumerate(one)), one
    two = place_replicas(domains, 2)
    for owner, hs in enumerate(two):
        # One copy in the other zone, the other in the owner's zone in another rack.
        assert sorted((h < 4) == (owner < 4) for h in hs) == [False, True], (owner, hs)
        assert _subtrees(domains, (owner, *hs), 2) == 3, (owner, hs)


def test_one_rack_or_zone_falls_back_to_other_hosts() -> None:
    domains = [f"zone-a/rack-1/host-{p // 2}" for p in range(6)]
    holders = place_replicas(domains, 2)
    assert all(domains[h] != domains[o] for o, hs in enumerate(holders) for h in hs)
    assert _loads(holders) == [2] * 6
    with pytest.raises(ValueError, match=r"replicas=5 needs at least 5 processes outside"):
        place_replicas(domains, 5)  # only 4 processes outside each host
    # A zone with more processes than the others can take copies of keeps some of
    # them, in its other racks, and never loads a holder above the best bound.
    domains = [f"big/r{p % 3}/h{p}" for p in range(6)] + ["small/r0/h0", "small/r1/h1"]
    holders = place_replicas(domains, 1)
    assert max(_loads(holders)) == 1
    outside = [o for o, (h,) in enumerate(holders) if domains[h][:3] != domains[o][:3]]
    assert len(outside) == 4  # the two small-zone processes hold two, take two
    assert all(_subtrees(domains, (o, *hs), 2) == 2 for o, hs in enumerate(holders))


@pytest.mark.parametrize("seed", range(2))
def test_levels_over_uneven_layouts_balance_best_and_spread_where_balance_lets(seed) -> None:
    for domains in _random_trees(seed, 60):
        n = len(domains)
        most = min(n - c for c in collections.Counter(domains).values())
        for replicas in range(1, min(most, 3) + 1):
            holders = place_replicas(domains, replicas)
            for owner, hs in enumerate(holders):
                assert len(set(hs)) == replicas and owner not in hs
                assert all(domains[h] != domains[owner] for h in hs), (domains, owner, hs)
            load = _loads(holders)
            if n <= 14:
                assert max(load) == _best_max_load(domains, replicas), (domains, replicas)
            if replicas > 2:
                continue
            # As many owners have a copy outside their zone (rack) as any placement
            # with the same busiest holder could give one.
            for levels in (1, 2):
                far = [o for o in range(n) if _subtrees(domains, (o, *holders[o]), levels) > 1]
                assert len(far) == _most_owners_with_a_far_copy(domains, max(load), levels)


def _most_owners_with_a_far_copy(domains: list[str], cap: int, levels: int) -> int:
    """How many owners at most can have a copy outside their subtree of `levels` levels,
    no holder taking more than `cap` (max flow: owner -> far holder -> sink)."""
    n = len(domains)
    prefix = [tuple(d.split("/")[:levels]) for d in domains]
    held = [0] * n
    match: dict[int, list[int]] = {h: [] for h in range(n)}

    def augment(owner: int, seen: set[int]) -> bool:
        for h in range(n):
            if prefix[h] == prefix[owner] or h in seen:
                continue
            seen.add(h)
            if held[h] < cap:
                held[h] += 1
                match[h].append(owner)
                return True
            for other in match[h]:
                if augment(other, seen):
                    match[h].remove(other)
                    match[h].append(owner)
                    return True
        return False

    return sum(augment(o, set()) for o in range(n))


def test_levels_of_different_depths_and_flat_names_mix() -> None:
    domains = ["solo", "z0/r0/h0", "z0/r0/h0", "z0/r1", "z1/r0/h0", "z1/r0/h1", "z0"]
    for replicas in (1, 2, 3):
        holders = place_replicas(domains, replicas)
        for owner, hs in enumerate(holders):
            assert len(set(hs)) == replicas
            assert all(domains[h] != domains[owner] for h in hs)
        assert max(_loads(holders)) == _best_max_load(domains, replicas)


def test_levels_partner_holders_of_a_replicated_leaf_are_balanced_and_spread() -> None:
    domains = _tree(2, 2, 2, per_host=2)  # numbered zone by zone: 0-7 in z0
    n = len(domains)
    for replicas in (1, 2, 3):
        placed = place_replicas(domains, replicas)
        holders = tuple(
            partner_holders(p, [q for q in range(n) if q != p], domains.__getitem__, placed[p],
                            replicas, n)
            for p in range(n)
        )  # fmt: skip
        assert _max_over_mean(holders) == 1.0, holders
        for owner, hs in enumerate(holders):
            assert len(set(hs)) == replicas
            assert _subtrees(domains, (owner, *hs), 1) == 2
            assert _subtrees(domains, (owner, *hs), 2) == min(replicas + 1, 4)
            assert _subtrees(domains, (owner, *hs), 3) == replicas + 1


def test_levels_a_partner_in_the_owners_rack_never_displaces_a_copy_in_another_zone() -> None:
    domains = ["z0/r0/h0", "z0/r0/h1", "z0/r1/h0", "z1/r0/h0", "z0/r1/h1"]
    # Process 0's partner 1 shares its rack; the set-up put its copy in the other zone.
    assert partner_holders(0, [1], domains.__getitem__, [3], 1, 5) == (3,)
    # A second copy goes to another rack: the set-up's holder 2, or a partner there first.
    assert partner_holders(0, [1], domains.__getitem__, [3, 2], 2, 5) == (3, 2)
    assert partner_holders(0, [1, 4], domains.__getitem__, [3, 2], 2, 5) == (3, 4)
    # A partner in another zone is taken first, as with flat domains.
    assert partner_holders(0, [3], domains.__getitem__, [2], 1, 5) == (3,)


def test_the_catalog_finds_each_hosts_domain_with_levels() -> None:
    from jaxckpt.tools._catalog import _consistent_domains

    domains = _tree(2, 2, 2, per_host=2)
    n = len(domains)
    holders = place_replicas(domains, 1)
    by_owner = dict(enumerate(domains))
    for host in sorted(set(domains)):
        procs = {p for p in range(n) if domains[p] == host}
        held = procs | {o for o in range(n) if procs & set(holders[o])}
        assert _consistent_domains(held, by_owner, dict.fromkeys(range(n), 2)) == [host]


@pytest.mark.parametrize("domain", ["zone-a//host-1", "/rack-1", "rack-1/", "a/ /b"])
def test_a_domain_path_with_an_empty_level_is_refused(domain) -> None:
    from jaxckpt import TierOptions

    if domain == "a/ /b":  # a blank level is a name like any other
        assert TierOptions("/dev/shm/x", failure_domain=domain).failure_domain == domain
        return
    with pytest.raises(ValueError, match=r"TierOptions.failure_domain .* no level may be empty"):
        TierOptions("/dev/shm/x", failure_domain=domain)
    assert TierOptions("/dev/shm/x", failure_domain="zone-a/rack-3/host-17")
