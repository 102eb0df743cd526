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
