"""Relay groups (`_relay`): an exchange's values gathered per rack by a leader, so that
the coordinator sees a few calls a group instead of two a process.

N threads play N processes (`test_multihost.Job`); each group's leader keeps an
in-memory `_kv.RelayStore`, which the real job serves over the peer data service
(tests/test_peer_relay.py) and tests/test_correlated_multiprocess.py runs for real.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
from test_multihost import FakeStore, Job

from jaxckpt.coord import _kv, _multihost, _relay


class Counted(FakeStore):
    """The coordinator's store, counting each process's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[int] = collections.Counter()

    def _check(self) -> None:
        super()._check()
        member = _multihost._member.get()
        self.calls[member.index if member is not None else -1] += 1


class Gone:
    """A leader's store that cannot be reached (its process is dead, its service closed)."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("Connection refused")

        return fail


def racks(*sizes: int) -> list[str]:
    return [f"rack{r}/host{i}" for r, size in enumerate(sizes) for i in range(size)]


def relayed_job(
    monkeypatch: pytest.MonkeyPatch, domains: list[str], gone: set[int] = frozenset()
) -> tuple[Counted, Job, dict[int, _kv.RelayStore]]:
    """A job whose processes exchange through relay groups of `domains`; the leaders in
    `gone` cannot be reached by their members."""
    store = Counted()
    job = Job(store, monkeypatch)
    leader_of = _relay.leaders(domains)
    stores = {leader: _kv.RelayStore() for leader in set(leader_of)}
    for p in range(len(domains)):
        member = job.members.setdefault(p, _multihost.Member(store, p, len(domains)))
        leader = leader_of[p]
        member.relay = _relay.Relay(
            leader,
            _relay.members(leader_of, leader),
            Gone() if leader in gone and p != leader else stores[leader],  # type: ignore[arg-type]
            tuple(leader_of) if p == _multihost.DECIDER else (),
        )
    return store, job, stores


def test_leaders_are_the_lowest_process_of_each_rack_in_groups_of_at_most_max():
    assert _relay.rack("zone-a/rack-3/host-17") == "zone-a/rack-3"
    assert _relay.rack("host-17") == "host-17"
    domains = ["r0/h0", "r1/h0", "r0/h1", "r1/h1", "r0/h2", "solo"]
    assert _relay.leaders(domains) == [0, 1, 0, 1, 0, 5]
    # r0 holds 0, 2 and 4: in groups of at most 2, [0] and [2, 4].
    assert _relay.leaders(domains, max_members=2) == [0, 1, 2, 1, 2, 5]
    assert _relay.members([0, 1, 2, 1, 2, 5], 2) == (2, 4)
    # A rack cut as evenly as it comes: 7 processes in groups of at most 3 -> 2, 2, 3.
    assert _relay.leaders(["r/h"] * 7, max_members=3) == [0, 0, 2, 2, 4, 4, 4]
    # One process a one-level domain: every process its own group (no relay).
    assert _relay.leaders([f"node{i}" for i in range(4)]) == [0, 1, 2, 3]
    # Processes of one host (a one-level domain) form one group.
    assert _relay.leaders(["hostA", "hostA", "hostB", "hostB"]) == [0, 0, 2, 2]
    with pytest.raises(ValueError, match="max_members"):
        _relay.leaders(domains, max_members=0)


def test_groups_balance_the_coordinators_calls_against_a_leaders():
    # About sqrt(N / 20): none below 80 processes, 32 at most; a wanted size wins.
    assert [_relay.group_size(n) for n in (2, 64, 79, 80, 512, 4096, 16384, 10**6)] == [
        1,
        1,
        1,
        2,
        5,
        14,
        28,
        32,
    ]
    assert _relay.group_size(6, wanted=3) == 3 and _relay.group_size(10**6, wanted=1) == 1


def test_members_exchange_through_their_leader_and_never_call_the_coordinator(monkeypatch):
    domains = racks(4, 4, 3)
    store, run, stores = relayed_job(monkeypatch, domains)
    results = run(11, lambda p: _multihost.allgather({"p": p}, tag="t", timeout_s=10))
    expected = [{"p": p} for p in range(11)]
    assert all(kind == "ok" and value == expected for kind, value, _ in results.values())
    leaders = set(_relay.leaders(domains))
    assert set(store.calls) == leaders, store.calls  # the members made no call
    assert all(store.calls[q] == 2 for q in leaders - {0}), store.calls  # post, read
    assert run.left() == []
    # Every value went up in its leader's bundle: three posted keys, not eleven.
    assert not any("/v/" in k for k in store.data)
    assert all(len(s) > 0 for s in stores.values())  # the outcome, for the members


def test_each_process_gets_its_own_share_through_its_leader(monkeypatch):
    store, run, _ = relayed_job(monkeypatch, racks(3, 3))

    def combine(texts: dict[int, str]) -> dict[str, Any]:
        return {"all": {"n": len(texts)}, "each": {p: f"for {t}" for p, t in texts.items()}}

    results = run(6, lambda p: _multihost.converge_each(f"p{p}", combine, tag="e", timeout_s=10))
    for p, (kind, value, _) in results.items():
        assert kind == "ok" and value == ({"n": 6}, f"for p{p}"), (p, value)
    assert set(store.calls) == {0, 3}
    # The decider set one share a group, not one a process.
    assert sorted(k.rsplit("/", 2)[-1] for k in store.data if "/to/" in k) == ["0", "3"]


def test_a_member_whose_leader_cannot_be_reached_exchanges_through_the_coordinator(
    monkeypatch,
):
    # Process 3 leads 3, 4, 5, but they cannot reach it: it waits half the timeout for
    # them, then posts alone; they post themselves.
    domains = racks(3, 3)
    store, run, _ = relayed_job(monkeypatch, domains, gone={3})

    def combine(texts: dict[int, str]) -> dict[str, Any]:
        return {"all": sorted(texts.values()), "each": {p: p * 10 for p in texts}}

    results = run(6, lambda p: _multihost.converge_each(str(p), combine, tag="g", timeout_s=2))
    for p, (kind, value, _) in results.items():
        assert kind == "ok" and value == ([str(q) for q in range(6)], p * 10), (p, value)
    assert {4, 5} <= set(store.calls)  # they posted themselves


def test_a_dead_member_is_named_on_every_process_within_one_timeout(monkeypatch):
    _, run, _ = relayed_job(monkeypatch, racks(3, 3))
    timeout = 1.0
    results = run(
        6,
        lambda p: _multihost.allgather(p, tag="t", timeout_s=timeout),
        processes=[0, 1, 2, 3, 5],
    )
    for p, (kind, error, seconds) in results.items():
        assert kind == "error" and isinstance(error, TimeoutError), (p, error)
        assert "processes [4] did not answer" in str(error), error
        assert seconds < 1.6 * timeout, f"process {p} waited {seconds:.2f} s"


def test_a_dead_leader_is_named_alone_its_members_exchanging_without_it(monkeypatch):
    _, run, _ = relayed_job(monkeypatch, racks(3, 3), gone={3})
    timeout = 1.0
    results = run(
        6, lambda p: _multihost.allgather(p, tag="t", timeout_s=timeout), processes=[0, 1, 2, 4, 5]
    )
    for p, (kind, error, seconds) in results.items():
        assert kind == "error" and isinstance(error, TimeoutError), (p, error)
        assert "processes [3] did not answer" in str(error), error
        assert seconds < 1.6 * timeout, f"process {p} waited {seconds:.2f} s"


def test_a_member_later_than_half_the_timeout_is_named_and_every_process_agrees(monkeypatch):
    _, run, _ = relayed_job(monkeypatch, racks(2, 2))
    timeout = 2.0
    arrived = threading.Event()

    def late(p: int) -> Any:
        if p == 1:
            arrived.wait(0.7 * timeout)  # past the leader's half of the timeout
        return _multihost.allgather(p, tag="t", timeout_s=timeout)

    results = run(4, late)
    kinds = {kind for kind, _, _ in results.values()}
    assert kinds == {"error"}, results
    for p, (_, error, _) in results.items():
        assert isinstance(error, TimeoutError) and "processes [1]" in str(error), (p, error)


def test_many_rounds_keep_the_coordinator_and_every_leaders_store_bounded(monkeypatch):
    _, run, stores = relayed_job(monkeypatch, racks(3, 3))

    def many(p: int) -> list[int]:
        return [
            _multihost.allgather(i, tag=f"tag{i % 3}", timeout_s=10)[4]
            for i in range(_relay.KEPT + 30)
        ]

    results = run(6, many)
    assert all(
        kind == "ok" and value == list(range(_relay.KEPT + 30))
        for kind, value, _ in results.values()
    )
    assert run.left() == []
    for leader, kept in stores.items():
        exchanges = {k.rsplit("/", 2)[0] for k, _ in kept.key_value_dir_get("jaxckpt")}
        assert len(exchanges) <= _relay.KEPT, (leader, len(exchanges))
        assert not any("/v/" in k for k, _ in kept.key_value_dir_get("jaxckpt")), leader
