"""Coordination at many processes, against the simulated coordinator (jaxckpt/bench/_coordinator.py).

The real exchange, agreement, inventory and planning code runs as N processes
(threads) in virtual time: what goes through the coordinator is counted
exactly, every wait is bounded in virtual time, and every process must end
with the same verdict. The big-N figures are `jaxckpt bench --scale`'s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_agreement import tree

from jaxckpt._options import TierOptions
from jaxckpt.bench import _coordinator, _scale, _scale_cli
from jaxckpt.coord import _agreement, _multihost, _placement, _published
from jaxckpt.peer import _peers
from jaxckpt.run import _choreography

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30.0  # virtual seconds


def simulate(count: int, fn, **coordinator) -> tuple[_coordinator.Simulation, list]:
    sim = _coordinator.Simulation(count, _coordinator.Coordinator(**coordinator))
    return sim, sim.run(fn)


def test_a_save_moves_about_a_kilobyte_a_process_through_the_coordinator():
    """Its verdict, tree digest and index entry (the part's 24 chunk records, compressed):
    as many bytes a process at any N. The decider (process 0) reads every posted value,
    again when it read before the last of them arrived (a few rounds at most, depending on
    when each process's post lands: CPU timing), so its bytes are bounded, not fixed."""
    rows = {n: _scale.measure(n, "save") for n in (16, 128)}
    # What every process but the decider moves, a process.
    per = {
        n: (row["coordinator_bytes"] - row["max_process_bytes"]) / (n - 1)
        for n, row in rows.items()
    }
    for n, row in rows.items():
        assert per[n] < 1000, row
        # At most three reads of all the values the others posted.
        assert row["max_process_bytes"] < 3 * per[n] * (n - 1), row
        assert row["rpcs"] <= 4 * n + 4, row
    # Flat in N: a process's bytes at 128 as at 16 (key names grow a digit).
    assert per[128] < 1.1 * per[16], rows


def test_restore_after_a_node_loss_and_setup_plan_everywhere():
    for op in ("setup", "restore"):
        row = _scale.measure(32, op)  # raises if any process failed or keys were left
        assert set(_scale.FIGURES) <= set(row) and row["op"] == op, row
    restore = _scale.Restore(32)
    sim, results = simulate(32, restore)
    assert all(ok and value is True for ok, value in results), results[:3]
    assert sim.left_over() == []


def test_a_restore_after_a_node_loss_costs_four_calls_a_process_without_relays():
    """The inventories and the verdict: each process posts and reads once in each; only
    the decider (process 0) makes more calls (its reads of the values, claims, deletes)."""
    row = _scale.measure(64, "restore", relay=False)
    assert row["process_rpcs"] == 4, row
    assert row["rpcs"] <= 4 * 64 + 16, row


def test_a_restoring_process_reads_as_much_of_the_step_index_at_any_n():
    """Each process reads the index's first bytes, its row and its own entry of the real
    step index (not the whole of it, O(N)): about the same bytes at 64 and 2,048 processes
    (an entry's numbers grow a digit or two)."""
    small, large = _scale.Restore(64), _scale.Restore(2048)
    assert large.index_bytes < 1.01 * small.index_bytes, (small.index_bytes, large.index_bytes)
    assert large.index_bytes < 80_000, large.index_bytes
    row = _scale.measure(64, "restore")
    assert row["index_bytes"] == small.index_bytes and row["index_cpu_s"] > 0, row


def test_a_restore_at_many_processes_plans_on_a_sample_and_charges_the_rest(monkeypatch):
    """Beyond `EVERY_PROCESS_PLANS` only a sample plans for real (the lost process and its
    holder among them); the others are charged one plan's CPU and still take part."""
    monkeypatch.setattr(_scale, "EVERY_PROCESS_PLANS", 16)
    monkeypatch.setattr(_scale, "SAMPLED_PLANNERS", 8)
    restore = _scale.Restore(64)
    assert {0, 63, restore.lost, *restore.holders[restore.lost]} <= restore.planners
    assert len(restore.planners) < 64 and restore.plan_cpu_s > 0
    row = _scale.measure(64, "restore")  # raises if a planner failed or keys were left
    assert row["planned_s"] >= restore.plan_cpu_s, row


def test_the_decider_waits_for_processes_arriving_over_time():
    """Processes arrive spread over 50 ms (virtual): the decider reads what is there,
    waits for the lowest one missing, and again; the others still make two calls each."""

    def late(p: int) -> list:
        _multihost_sleep(((p * 37) % 50) / 1000)
        return _multihost.allgather(p, tag="t", timeout_s=TIMEOUT_S)

    sim, results = simulate(40, late)
    assert all(ok and value == list(range(40)) for ok, value in results), results[:2]
    for proc in sim.processes[1:]:
        calls = [method for method, ok, _ in proc.calls if ok]  # not the sleep
        assert calls == ["set", "blocking_get"], (proc.index, calls)
    decider = [method for method, _, _ in sim.processes[0].calls]
    assert decider.count("dir_get") > 1, decider  # it waited in rounds
    assert sim.left_over() == []


def test_one_failing_process_makes_every_process_raise_its_error():
    def one(p: int) -> None:
        error = FileNotFoundError(f"[process {p}] no copy of part 3") if p == 11 else None
        _agreement.agree(error, tag="restore/r/5", what="The restore of step 5", timeout_s=30)

    sim, results = simulate(48, one)
    for p, (ok, error) in enumerate(results):
        assert not ok and type(error) is FileNotFoundError, (p, error)
        assert "no copy of part 3" in str(error) and (p == 11 or "on process 11" in str(error))
    assert sim.left_over() == []


def test_a_dead_process_costs_every_other_process_one_bounded_wait():
    """Process 9 never takes part: the others raise within the timeout (virtual time),
    naming it, and none waits a timeout of its own after the first gave up."""
    leaves = tree(0, "same")

    def save(p: int) -> None:
        if p == 9:
            return
        _agreement.agree_on_save(leaves, None, tag="save/r/7", step=7, timeout_s=TIMEOUT_S)

    sim, results = simulate(40, save)
    for p, (ok, error) in enumerate(results):
        if p == 9:
            continue
        assert not ok and isinstance(error, TimeoutError), (p, error)
        assert "processes [9] did not answer" in str(error), error
        assert _multihost.is_agreed(error)
    finished = [proc.clock for proc in sim.processes if proc.index != 9]
    assert max(finished) < TIMEOUT_S + 1, max(finished)


def test_a_late_process_raises_at_once_as_the_others_did():
    leaves = tree(0, "same")

    def save(p: int) -> None:
        if p == 3:  # arrives after the others gave up
            _multihost_sleep(TIMEOUT_S + 2)
        _agreement.agree_on_save(leaves, None, tag="save/r/8", step=8, timeout_s=TIMEOUT_S)

    sim, results = simulate(12, save)
    assert all(not ok and isinstance(e, TimeoutError) for ok, e in results), results
    late = sim.processes[3]
    assert late.clock < TIMEOUT_S + 2 + 1, late.clock  # no timeout of its own


def _multihost_sleep(seconds: float) -> None:
    """Spends virtual time: a blocking get of a key nobody sets."""
    client = _multihost.session()[0]
    try:
        client.blocking_key_value_get("sleep", int(seconds * 1000))
    except RuntimeError as e:
        assert "DEADLINE_EXCEEDED" in str(e)


def test_a_different_tree_on_one_of_many_processes_is_named_everywhere():
    def save(p: int) -> None:
        leaves = tree(1 if p == 21 else 0, "extra")
        _agreement.agree_on_save(leaves, None, tag="save/r/2", step=2, timeout_s=TIMEOUT_S)

    sim, results = simulate(64, save)
    messages = set()
    for p, (ok, error) in enumerate(results):
        assert not ok and isinstance(error, ValueError), (p, error)
        messages.add(re.sub(r"^\[process \d+\] ", "", str(error)))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "processes [21] another" in message and "leaf ['extra']" in message, message
    assert sim.left_over() == []


def test_growth_fits():
    counts = [8, 64, 512, 4096]
    assert _scale_cli.growth(counts, [3 * n for n in counts]) == "N"
    assert _scale_cli.growth(counts, [n * n for n in counts]) == "N^2"
    assert _scale_cli.growth(counts, [5.0 for _ in counts]) == "1"
    assert _scale_cli.growth([8, 64], [1, 2]) == "-"


def test_bench_scale_prints_one_json_object_a_line_and_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "jaxckpt.bench", "--scale", "--processes-list", "4,8,16"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        check=True,
        timeout=300,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["processes"], r["op"]) for r in rows] == [
        (n, op) for n in (4, 8, 16) for op in ("setup", "save", "restore")
    ]
    for r in rows:
        assert {"processes", "op", *_scale.FIGURES} <= set(r), r
    assert "growth in N" in out and "coord. bytes" in out


@pytest.mark.parametrize("latency_s", [0.0, 1e-3])
def test_modeled_time_follows_the_per_call_latency(latency_s):
    sim, _ = simulate(
        8, lambda p: _multihost.allgather(p, tag="t", timeout_s=5), latency_s=latency_s
    )
    calls = sim.coordinator.total.calls
    modeled = max(proc.clock for proc in sim.processes)
    assert modeled >= calls * latency_s  # one queue: calls never overlap


def test_setup_moves_under_a_kilobyte_a_process_and_tells_each_its_holders():
    # Both with relay groups (each process is told its leader too: from 80 processes on).
    rows = {n: _scale.measure(n, "setup") for n in (96, 768)}
    for n, row in rows.items():
        assert row["coordinator_bytes"] / n < 1000, row
        assert row["rpcs"] <= 8 * n + 8, row
    # O(N): eight times the processes, about eight times the bytes (key names grow a digit).
    assert rows[768]["coordinator_bytes"] < 8 * 1.2 * rows[96]["coordinator_bytes"], rows

    count = 12
    domains = [f"rack{p % 3}" for p in range(count)]  # 3 failure domains of 4

    def meet(p: int, replicas: int) -> tuple:
        opts = TierOptions("/nonexistent", replicas=replicas, failure_domain=domains[p])
        peers = _choreography.meeting(
            _peers.Hello.start("run-x", lambda: _scale.StubService(p), opts)
        )
        try:
            holders = peers.holders
        except ValueError as e:
            holders = str(e)
        # Any other process's address is looked up when first needed.
        seen = [peers.addresses[q] for q in range(count)]
        return holders, seen, peers.token

    sim, results = simulate(count, lambda p: meet(p, 2))
    assert all(ok for ok, _ in results), results[:2]
    placed = _placement.place_replicas(domains, 2)
    for p, (_, (holders, seen, token)) in enumerate(results):
        assert holders == placed[p], (p, holders)
        assert seen == [_scale.StubService(q).address for q in range(count)]
        assert token == results[0][1][2] and len(token) == 64  # one token for the run
    # The addresses stay published for the run; no exchange is left in the store (but the
    # set-up's outcome and shares, which the next exchange deletes).
    assert sim.left_over() == []
    assert any(k.startswith(_published.PUBLISHED) for k in sim.coordinator.data)
    # Replicas that cannot be placed: every process is told why, and only a save raises it.
    sim, results = simulate(count, lambda p: meet(p, 9))
    assert all(ok and "replicas=9 needs at least 9 processes" in r[0] for ok, r in results)


# ---- relay groups ------------------------------------------------------------------------

# A save's agreement; a restore's inventories and verdict (its reshard is a jax collective,
# not the coordinator's; its meeting, once per run, is the set-up's).
EXCHANGES = {"save": 1, "restore": 2}
DECIDER_CALLS = 8  # the decider's own calls an exchange: its reads, claim, outcome, deletes


@pytest.mark.parametrize("count", [64, 256])
@pytest.mark.parametrize("op", ["save", "restore"])
def test_through_relay_groups_the_coordinator_sees_two_calls_a_group(op, count):
    """Every process gets its result (`measure` raises otherwise) and each group's leader
    alone talks to the coordinator: two calls a group an exchange (its bundle, the
    outcome), and the decider's share (its own calls, and at worst a wait for each
    group's bundle), far fewer than every process's two calls without relays."""
    flat = _scale.measure(count, op, relay=False)
    row = _scale.measure(count, op, relay_group=32)  # a rack a group (automatic: smaller)
    groups = row["groups"]
    assert groups == count // (_scale.PROCESSES_PER_HOST * _scale.HOSTS_PER_RACK), row
    assert flat["groups"] == 0 and flat["relay_rpcs"] == 0, flat
    exchanges = EXCHANGES[op]
    bound = exchanges * (2 * groups + DECIDER_CALLS + groups)
    assert row["rpcs"] <= bound, (
        f"{row['rpcs']} coordinator calls through {groups} relay groups, over {bound} "
        f"({flat['rpcs']} without relays): do the exchanges go through Member.relay?"
    )
    assert row["rpcs"] * 4 < flat["rpcs"], (row, flat)
    assert row["process_rpcs"] == 0, row  # a member calls its leader's store only
    assert row["relay_rpcs"] >= exchanges * 2 * (count - groups), row  # each member's two


def _one_rack(count: int) -> list[str]:
    return [f"rack0/host{p}" for p in range(count)]


def test_relay_stores_queue_apart_from_the_coordinator():
    """A relay call occupies its group's store (`relay_latency_s` a call), never the
    coordinator's queue, and a blocking get waits on, and is woken by, its own store."""
    count, latency, relay_latency = 8, 1e-3, 5e-3
    sim = _coordinator.Simulation(
        count,
        _coordinator.Coordinator(latency_s=latency),
        relay_domains=_one_rack(count),
        relay_latency_s=relay_latency,
        relay_group=count,
    )

    def member(p: int) -> str:
        relay = _multihost.bound_relay()
        assert relay is not None and relay.leader == 0 and relay.members == tuple(range(count))
        assert relay.leaders == ((0,) * count if p == 0 else ())
        if p == 0:  # the leader: the same key in the coordinator first, then in its store
            _multihost_sleep(0.1)
            client = _multihost.session()[0]
            client.key_value_set("k", "coordinator's")
            _multihost_sleep(0.1)
            relay.store.key_value_set("k", "relay's")
            return "leader"
        relay.store.key_value_set(f"v/{p}", str(p))
        return relay.store.blocking_key_value_get("k", 10_000)

    results = sim.run(member)
    assert [r for _, r in results] == ["leader"] + ["relay's"] * (count - 1), results
    store = sim.relay_stores[0]
    assert sim.groups == 1 and store.latency_s == relay_latency
    # The coordinator: the leader's two sleeps (blocking gets) and one set, nothing else.
    assert sim.coordinator.total.calls == 3 and sim.relay_total().calls == 2 * (count - 1) + 1
    assert sim.processes[1].counts.calls == 0 and sim.processes[1].relay_counts.calls == 2
    # Members' sets queue one after another on the relay store at time 0 (the leader's own
    # call is local), not behind the coordinator's latency.
    member_done = max(proc.clock for proc in sim.processes[1:])
    assert member_done >= 0.2, member_done  # woken by the relay's set, not the coordinator's
    assert store.busy_until >= 2 * (count - 1) * relay_latency
    assert sim.coordinator.busy_until < 3 * latency + 0.2 + 0.01
    assert sim.relay_left_over() == {0: count}  # v/1..7 and k
    assert sim.left_over() == ["k"]
    # A replay answers the relay's calls from the relay's recorded replies.
    calls = sim.processes[3].calls
    assert [m for m, _, _ in calls] == ["relay_set", "relay_blocking_get"], calls
    replay = _coordinator.ReplayClient(calls)
    relay = replay.for_relay()
    relay.key_value_set("v/3", "3")
    assert relay.blocking_key_value_get("k", 1) == "relay's"
    with pytest.raises(RuntimeError, match="replay called set where the simulation"):
        _coordinator.ReplayClient(calls).key_value_set("v/3", "3")


def test_relay_groups_are_a_rack_of_at_most_32():
    count = 80  # 20 hosts of 4: racks of 32, 32 and 16
    sim = _coordinator.Simulation(count, relay_domains=_scale.domains(count), relay_group=32)
    relays = [proc.relay for proc in sim.processes]
    assert all(r is not None for r in relays)
    assert sorted(sim.relay_stores) == [0, 32, 64]
    assert [r.leader for r in relays if r] == [p // 32 * 32 for p in range(count)]
    assert relays[0] and relays[0].leaders == tuple(p // 32 * 32 for p in range(count))
    assert all(r and r.leaders == () for r in relays[1:])
    # One process a host below two hosts' worth, in one rack: one group.
    assert _scale.domains(4) == [f"rack0/host{h}" for h in range(4)]
    # Automatic: about sqrt(N / 20) a group (2 at 80), never across racks.
    auto = _coordinator.Simulation(count, relay_domains=_scale.domains(count))
    assert sorted(auto.relay_stores) == list(range(0, count, 2))
    # Groups of one still get their relay.
    alone = _coordinator.Simulation(3, relay_domains=["a", "b", "c"])
    assert [(p.relay.leader, p.relay.members) for p in alone.processes if p.relay] == [
        (0, (0,)),
        (1, (1,)),
        (2, (2,)),
    ]
