"""`jaxckpt bench --scale`: what coordination costs at N processes, by simulation.

    jaxckpt bench --scale                        # N = 8, 64, 512, 4096, 16384; ~3-5 minutes
    jaxckpt bench --scale --processes-list 8,64 --json scale.json

For each N it runs the real exchange, agreement, inventory and planning code
of N processes against one simulated coordinator (`_coordinator`: one service
queue, a per-call latency, a bandwidth; no JAX devices) for three operations.
Failure domains are `rack<r>/host<h>`: `PROCESSES_PER_HOST` processes a host,
`HOSTS_PER_RACK` hosts a rack. The set-up runs straight against the
coordinator (it forms the relay groups); a save and a restore run through the
relay groups (`_relay`: a rack's processes, at most `_relay.group_size` a
group (about sqrt(N / 20), at most 32) or `--relay-group`, the lowest the
leader, whose own store its members call, `--relay-latency-us` a call), or
with `--no-relay` straight against the coordinator, as before the relay:

- setup: the peer set-up (`_choreography.meeting`: the run's token, every process's
  address published, its address and failure domain posted, the replica
  placement computed once by the decider, each process told its holders);
- save: one save's agreement (`_agreement.agree_on_save`: verdict, tree digest
  and each part's index entry; the decider builds the step's one index, not
  written anywhere here);
- restore: one restore after a node loss: each process's read of the step's
  index (`index_read`: the step index the save's decider builds, held in
  memory, read as `_index.read_index` reads it from storage: its first bytes,
  the process's own part's row and entry; the bytes and CPU of that are the
  row's `index_bytes` and `index_cpu_s`, charged to every process and included
  in its CPU figures), the inventories (`_choreography.exchange_inventories`; the lost
  process holds nothing, its part lives on its peer), every process's plan
  (`_plan.plan_step` over that lazily read index, and the chunk owners), which
  must find every part, and the verdict (`_agreement.agree`).

It prints one JSON object a line per N and operation, then a table and the
fitted growth of every figure in N (1, N, N log N or N^2). The coordinator's
figures (`rpcs`, `coordinator_bytes`, the `process_*` ones, the `queue_*` ones)
count the coordinator's calls alone; `relay_rpcs` and `relay_bytes` count every
relay store's (a leader's calls to its own store among them), `groups` the relay
groups (0 without relays) and `relay_max_keys` the most keys a relay store holds
at the end.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, Final

from jaxckpt import _resources
from jaxckpt._options import TierOptions
from jaxckpt.bench import _coordinator
from jaxckpt.coord import _agreement, _holdings, _kv, _multihost, _placement, _plan, _relay
from jaxckpt.format import _format
from jaxckpt.peer._peers import Hello
from jaxckpt.peer._wire import PeerAddress
from jaxckpt.run import _choreography
from jaxckpt.tiers import _index, _step_index

OPS: Final = ("setup", "save", "restore")
DEFAULT_PROCESSES: Final = (8, 64, 512, 4096, 16384)
PROCESSES_PER_HOST: Final = 4  # the failure domain of a process is its host
HOSTS_PER_RACK: Final = 8  # a host's domain is rack<r>/host<h>: 32 processes a rack
LEAVES: Final = 24  # array leaves in the saved tree (a transformer's few dozen)
DEVICES_PER_PROCESS: Final = 8
STEP: Final = 1000
RUN_ID: Final = "run-0123456789abcdef"
TIMEOUT_S: Final = 120.0  # TierOptions' default: every wait is bounded by it
EVERY_PROCESS_PLANS: Final = 16384  # up to this N every simulated process plans a restore
SAMPLED_PLANNERS: Final = 512  # beyond, about this many do (see `Restore`)
FIGURES: Final = ("rpcs", "coordinator_bytes", "modeled_s", "plan_cpu_s", "peak_rss_bytes")
INDEX_READERS: Final = 3  # processes whose index read is measured (the median is charged)


class StubService:
    """A peer data service that is only an address (nothing connects to it): the simulated
    processes' (`Peers.meet`), here and in the coordination tests."""

    def __init__(self, p: int):
        self.address = PeerAddress(f"10.{p >> 16}.{(p >> 8) & 255}.{p & 255}", 40000 + p % 20000)
        self.relay_store = _kv.RelayStore()  # a leader's (the set-up forms the groups)

    def set_token(self, token: str) -> None:
        pass

    def close(self) -> None:
        pass


def leaves(count: int) -> tuple[_format.LeafRecord, ...]:
    """The saved tree: `LEAVES` arrays sharded over every device, and a step counter."""
    devices = count * DEVICES_PER_PROCESS
    sharding = {
        "type": "named",
        "axis_names": ["data"],
        "mesh_shape": [devices],
        "device_ids": list(range(devices)),
        "spec": ["data"],
    }
    out = []
    for i in range(LEAVES):
        shape = (count * 64, 1024)
        out.append(
            _format.LeafRecord(
                f"['params']['layer{i}']",
                _format.ARRAY,
                keys=(("d", "params"), ("d", f"layer{i}")),
                shape=shape,
                dtype="bfloat16",
                stored_shape=shape,
                stored_dtype="bfloat16",
                chunk_shape=(64, 1024),
                sharding=sharding,
            )
        )
    out.append(_format.LeafRecord("['step']", _format.SCALAR, value=STEP, scalar_type="int"))
    return tuple(out)


def manifests(count: int, tree: tuple[_format.LeafRecord, ...]) -> dict[int, _format.PartManifest]:
    """Every owner's index manifest: one chunk of every array leaf (its rows)."""
    out = {}
    for owner in range(count):
        chunk = (_format.ChunkRecord((owner, 0), 64 * 1024 * 2, 0, 0),)
        chunks = dict.fromkeys(range(LEAVES), chunk)
        out[owner] = _format.PartManifest(
            STEP, RUN_ID, "save", owner, count, _domain(owner, count), tree, chunks, {}, 0.0
        )
    return out


def _domain(p: int, count: int) -> str:
    """`rack<r>/host<h>`: `PROCESSES_PER_HOST` processes a host (one a host below two
    hosts' worth), `HOSTS_PER_RACK` hosts a rack (hosts numbered across racks)."""
    per_host = PROCESSES_PER_HOST if count >= 2 * PROCESSES_PER_HOST else 1
    host = p // per_host
    return f"rack{host // HOSTS_PER_RACK}/host{host}"


def domains(count: int) -> list[str]:
    """Every process's failure domain."""
    return [_domain(p, count) for p in range(count)]


class Setup:
    """The peer set-up of every process, and the placement computed from it."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, p: int) -> None:
        opts = TierOptions(
            memory_root="/nonexistent",
            replicas=1,
            timeout_s=TIMEOUT_S,
            failure_domain=_domain(p, self.count),
        )
        peers = _choreography.meeting(Hello.start(RUN_ID, lambda: StubService(p), opts))
        if len(peers.holders) != 1:  # the decider placed them once
            raise RuntimeError(f"process {p} was told holders {peers.holders}")


def index_read(raw: bytes, p: int) -> tuple[int, float]:
    """(bytes read, CPU seconds) of process `p`'s read of the step index `raw`, as a
    restore reads it (`_index.read_index`): its first bytes, then its own part's row
    and entry, checked and parsed."""
    read_bytes = 0

    def read(start: int, stop: int | None) -> bytes:
        nonlocal read_bytes
        data = raw[start:stop]
        read_bytes += len(data)
        return data

    with _resources.SHARED.gc_paused():
        start = time.thread_time()
        index = _step_index.read_step_index(read, "the step index", read(0, _step_index.HEAD_BYTES))
        if index[p].owner != p:
            raise RuntimeError(f"process {p} read the index of part {index[p].owner}")
        return read_bytes, time.thread_time() - start


class Restore:
    """One restore after the loss of process `lost`: its memory tier is empty.

    Every process plans (`_plan.plan_step`: the verdict from the parts no process holds,
    and the sources of its own part, the one it reads) up to `EVERY_PROCESS_PLANS`
    processes. Beyond, a sample plans for real (the lost process, its holders, process
    0, the last, and evenly spaced others: `SAMPLED_PLANNERS` in all) and every other
    process is charged, in virtual time, the CPU one plan took before the simulation;
    every process still takes part in every exchange and decodes the inventories.
    """

    def __init__(self, count: int):
        self.count = count
        self.lost = count // 2
        tree = leaves(count)
        parts = manifests(count, tree)
        # The step index as the save's decider writes it; every process reads its part.
        raw = _index.step_index_text(tree, {p: _index.entry(m) for p, m in parts.items()}).encode()
        del parts
        readers = sorted({0, self.lost, count - 1})[:INDEX_READERS]
        reads = sorted(index_read(raw, p) for p in readers)
        self.index_bytes = max(b for b, _ in reads)
        self.index_cpu_s = sorted(c for _, c in reads)[len(reads) // 2]
        # The planners plan over the index read lazily (one object for the simulation:
        # a part's entry parsed by the first planner that asks for it).
        self.manifests = _step_index.read_step_index(
            lambda start, stop: raw[start:stop], "the step index", raw[: _step_index.HEAD_BYTES]
        )
        self.holders = _placement.place_replicas([_domain(p, count) for p in range(count)], 1)
        self.inventory: dict[int, set[int]] = {p: {p} for p in range(count)}
        for owner, hs in enumerate(self.holders):
            for h in hs:
                self.inventory[h].add(owner)
        self.inventory[self.lost] = set()
        stride = 1 if count <= EVERY_PROCESS_PLANS else max(1, count // SAMPLED_PLANNERS)
        self.planners = {p for p in range(count) if p % stride == 0}
        self.planners |= {0, count - 1, self.lost, *self.holders[self.lost]}
        self.plan_cpu_s = 0.0 if stride == 1 else self._one_plan_s()

        self.clock: Callable[[int], float] = lambda p: 0.0  # a process's (virtual) time
        self.charge: Callable[[int, float], None] = lambda p, s: None  # CPU not spent here
        self.planned: dict[int, float] = {}  # process -> when it had its plan

    def _one_plan_s(self) -> float:
        """The CPU of one process's plan (process 1's), measured once."""
        held = _holdings.Holdings.of({q: {STEP: owners} for q, owners in self.inventory.items()})
        with _resources.SHARED.gc_paused():
            start = time.thread_time()
            plan = _plan.plan_step(STEP, self.manifests, 1, held.for_step(STEP), set())
            _ = plan.restorable, plan.sources[1], plan.chunk_owner(1)((0, (1, 0)), False)
            return time.thread_time() - start

    def __call__(self, p: int) -> bool:
        # As `TieredCheckpointHandler.restore` does: the cyclic collector paused (else a
        # replay bills the walk of the simulation's whole heap to the planning process).
        with _resources.SHARED.gc_paused():
            return self._restore(p)

    def _restore(self, p: int) -> bool:
        self.charge(p, self.index_cpu_s)  # its read of the step's index, measured before
        held = _choreography.exchange_inventories(RUN_ID, {STEP: self.inventory[p]}, TIMEOUT_S)
        ok, error = True, None
        if p in self.planners:
            plan = _plan.plan_step(STEP, self.manifests, p, held.for_step(STEP), set())
            own = plan.sources[p]
            owner_of = plan.chunk_owner(p)  # as the restorer finds the part of each chunk
            ok = all(owner_of((leaf, (p, 0)), False) == (p,) for leaf in range(LEAVES))
            ok = ok and plan.restorable and bool(own)
            ok = ok and (p != self.lost or own[0].tier == _plan.PEER)
            if not plan.restorable:
                error = FileNotFoundError(f"step {STEP}: {plan.missing}")
            del plan, owner_of  # a closure over the plan, and its copy of the manifests
        else:
            self.charge(p, self.plan_cpu_s)
        self.planned[p] = self.clock(p)
        # Let go of the table before the verdict: the simulation holds N processes at once.
        del held
        _agreement.agree(error, tag=f"restore/{RUN_ID}/{STEP}", what="restore", timeout_s=TIMEOUT_S)
        return ok


def save_fn(count: int) -> Callable[[int], None]:
    tree = leaves(count)
    _agreement.tree_digest(tree)  # computed once per tree and remembered, as in a training run
    parts = manifests(count, tree)

    def build_index(entries: dict[int, str]) -> None:
        _index.step_index_text(tree, entries)  # what the decider writes (no I/O here)

    def save(p: int) -> None:
        _agreement.agree_on_save(
            tree,
            None,
            tag=f"save/{RUN_ID}/{STEP}",
            step=STEP,
            timeout_s=TIMEOUT_S,
            entry=_index.entry(parts[p]),
            write_index=build_index,
        )

    return save


def measure(
    count: int,
    op: str,
    latency_s: float = _coordinator.LATENCY_S,
    bandwidth: float = _coordinator.BANDWIDTH,
    relay: bool = True,
    relay_latency_s: float = _coordinator.RELAY_LATENCY_S,
    relay_group: int | None = None,
) -> dict[str, Any]:
    """Simulates `op` with `count` processes; its figures (see the module docstring).
    A save or a restore runs through relay groups unless `relay` is False; the set-up
    never does (it forms them).

    Raises:
      RuntimeError: if a simulated process failed (the operation itself is broken).
    """
    fn: Callable[[int], Any] = (
        Setup(count) if op == "setup" else save_fn(count) if op == "save" else Restore(count)
    )
    sim = _coordinator.Simulation(
        count,
        _coordinator.Coordinator(latency_s, bandwidth),
        relay_domains=domains(count) if relay and op != "setup" else None,
        relay_latency_s=relay_latency_s,
        relay_group=relay_group,
    )
    if isinstance(fn, Restore):
        fn.clock = lambda p: sim.clock(sim.processes[p])
        fn.charge = lambda p, seconds: sim.charge(sim.processes[p], seconds)
    results = sim.run(fn)
    planned = dict(fn.planned) if isinstance(fn, Restore) else {}
    index_cpu_s = fn.index_cpu_s if isinstance(fn, Restore) else 0.0
    index_figures = (
        {"index_bytes": fn.index_bytes, "index_cpu_s": round(fn.index_cpu_s, 6)}
        if isinstance(fn, Restore)
        else {}
    )
    if isinstance(fn, Restore):
        fn.clock, fn.charge = (lambda p: 0.0), (lambda p, seconds: None)
    failed = [(p, r) for p, (ok, r) in enumerate(results) if not ok or r is False]
    if failed:
        p, r = failed[0]
        raise RuntimeError(f"{op} with {count} processes failed on {len(failed)}, first {p}: {r}")
    # What the set-up publishes (every process's address) stays for the run, by design;
    # the last exchange's outcome stays until the next exchange deletes it.
    left = sim.left_over()
    if left:
        raise RuntimeError(f"{op} left {len(left)} keys in the coordinator, such as {left[0]}.")
    # Per-process CPU and memory: the busiest process (the one that combined the values)
    # and an ordinary one, each run again alone against its recorded replies.
    busiest = max(sim.processes, key=lambda proc: proc.counts.bytes).index
    cpu, peak, ordinary = 0.0, 0, 0.0
    for p in sorted({busiest, 0, count - 1}):
        c, m = _replay(fn, p, count, sim.processes[p].calls, sim.processes[p].relay)
        cpu, peak = max(cpu, c), max(peak, m)
        if p == count - 1:
            ordinary = c  # a process that decides nothing
    return {
        "processes": count,
        "op": op,
        "rpcs": sim.coordinator.total.calls,
        "coordinator_bytes": sim.coordinator.total.bytes,
        "modeled_s": round(max(proc.clock for proc in sim.processes), 6),
        "plan_cpu_s": round(cpu + index_cpu_s, 6),
        "process_cpu_s": round(ordinary + index_cpu_s, 6),
        "peak_rss_bytes": peak,
        "max_process_bytes": max(proc.counts.bytes for proc in sim.processes),
        "max_process_rpcs": max(proc.counts.calls for proc in sim.processes),
        "process_rpcs": sorted(proc.counts.calls for proc in sim.processes)[count // 2],
        "queue_calls_s": round(sim.coordinator.total.calls * latency_s, 6),
        "queue_bytes_s": round(sim.coordinator.total.bytes / bandwidth, 6),
        **({"planned_s": round(max(planned.values()), 6)} if planned else {}),
        **index_figures,
        "relay_rpcs": sim.relay_total().calls,
        "relay_bytes": sim.relay_total().bytes,
        "groups": sim.groups,
        "relay_max_keys": max(sim.relay_left_over().values(), default=0),
    }


def _replay(
    fn: Callable[[int], Any],
    p: int,
    count: int,
    calls: list[tuple[str, bool, Any]],
    relay: _relay.Relay | None = None,
) -> tuple[float, int]:
    """(CPU seconds, peak bytes allocated) of process `p`'s part, run alone (in its relay
    group `relay`, if it ran in one: its relay store's replies are among `calls`)."""

    def member() -> _multihost.Member:
        client = _coordinator.ReplayClient(calls)
        relayed = dataclasses.replace(relay, store=client.for_relay()) if relay else None
        return _multihost.Member(client, p, count, relay=relayed)

    gc.collect()
    with _multihost.bound(member()):
        start = time.thread_time()
        fn(p)
        cpu = time.thread_time() - start
    tracemalloc.start()
    try:
        with _multihost.bound(member()):
            fn(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return cpu, peak
