"""A simulated jax.distributed coordinator, in virtual time, for N processes in one.

`Simulation(count).run(fn)` calls `fn(p)` for every process p in its own
thread, with `_multihost` bound to a `SimulatedClient` of one shared
`Coordinator`, so the real exchange, agreement and planning code runs as it
does in a job of `count` processes. Only one thread runs at a time, handed
the baton by a discrete-event loop, so a run is deterministic in everything
but the CPU time each process's own code takes, which is measured (thread CPU
time) and advances that process's virtual clock.

The coordinator is modelled as one service queue (the coordination service's
key-value store behind one lock): every call occupies it, in arrival order,
for `latency_s` plus its request and response bytes over `bandwidth`. A
blocking get that waits pays its response bytes when the key is set; its
deadline is virtual time. The key-value semantics are jax's
`DistributedRuntimeClient`'s: `set` refuses to overwrite unless asked, an
atomic `increment` returns the new value, `blocking_key_value_get` waits for a
key or fails with DEADLINE_EXCEEDED, `dir_get(k)` returns every key under
`k/`, and `delete(k)` removes `k` and everything under `k/`.

With `relay_domains`, the processes also form relay groups (`_relay`: the
processes of one rack, at most 32 a group, led by the lowest), and each group's
leader keeps a store of its own (`_kv.RelayStore` in a real job): here one
more `Coordinator` a group, with its own queue and data, `relay_latency_s`
a call (a Python HTTP request over the peer network) and the coordinator's
bandwidth; the leader's own calls to it are local (`LOCAL_LATENCY_S`, no
bytes on the wire). Every process's `Member.relay` is its group's, with a
client of that store. Calls and bytes are counted per store: the
coordinator's figures stay the coordinator's.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from jaxckpt.coord import _multihost, _published, _relay

LATENCY_S: Final = 50e-6  # the coordinator's time per call
RELAY_LATENCY_S: Final = (
    1e-3  # a relay store's per call: an HTTP request to a leader (0.8-0.9 ms measured here)
)
LOCAL_LATENCY_S: Final = 5e-6  # a leader's call to its own store (in its memory, one lock)
RELAY: Final = "relay_"  # prefix of a relay store's calls in a process's recorded calls
BANDWIDTH: Final = 1e9  # bytes per second through the coordinator
_INT_BYTES: Final = 8  # an increment's operand and result on the wire
_STACK_BYTES: Final = 512 << 10  # per simulated process thread


@dataclasses.dataclass
class Counts:
    """Calls made and bytes moved (request + response)."""

    calls: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes


class Coordinator:
    """The key-value store and its one service queue (see the module docstring)."""

    def __init__(self, latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH):
        if not latency_s >= 0 or not bandwidth > 0:
            raise ValueError(
                f"latency_s must be >= 0 and bandwidth > 0, got {latency_s} and {bandwidth}."
            )
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.data: dict[str, str] = {}
        self.busy_until = 0.0  # virtual time the queue is next free
        self.total = Counts()
        self.peak_keys = 0

    def serve(
        self, arrival: float, nbytes: int, calls: int = 1, latency_s: float | None = None
    ) -> float:
        """Queues work that arrives at `arrival` (`calls` of `latency_s` each, the store's
        own by default, and `nbytes` over its bandwidth); returns when it is done."""
        start = max(arrival, self.busy_until)
        latency_s = self.latency_s if latency_s is None else latency_s
        self.busy_until = start + calls * latency_s + nbytes / self.bandwidth
        return self.busy_until

    def delete(self, key: str) -> None:
        below = key.rstrip("/") + "/"
        for k in [k for k in self.data if k == key or k.startswith(below)]:
            del self.data[k]

    def dir_get(self, key: str) -> list[tuple[str, str]]:
        below = key.rstrip("/") + "/"
        return sorted((k, v) for k, v in self.data.items() if k.startswith(below))


class _Process:
    def __init__(self, index: int):
        self.index = index
        self.clock = 0.0  # virtual time this process has reached
        self.cpu_mark = 0.0  # its thread CPU time when it last got the baton
        self.cpu_s = 0.0  # thread CPU time used by its own code
        self.counts = Counts()  # its calls to the coordinator
        self.relay_counts = Counts()  # its calls to relay stores (its group's leader's)
        self.relay: _relay.Relay | None = None  # its relay group when it started
        self.wake = threading.Semaphore(0)
        self.reply: tuple[bool, Any] = (True, None)
        self.result: tuple[bool, Any] | None = None
        # (method, ok, result), for replays: a relay store's methods are named "relay_..."
        self.calls: list[tuple[str, bool, Any]] = []
        self.member: _multihost.Member | None = None  # once it runs


class Simulation:
    """N processes of one job against one `Coordinator`, and with `relay_domains` (every
    process's failure domain) one relay store a group (see the module docstring)."""

    def __init__(
        self,
        count: int,
        coordinator: Coordinator | None = None,
        relay_domains: list[str] | None = None,
        relay_latency_s: float = RELAY_LATENCY_S,
        relay_group: int | None = None,
    ):
        """`relay_group`: the most processes a group has (`TierOptions.relay_group`; None:
        `_relay.group_size`)."""
        self.count = count
        self.coordinator = coordinator or Coordinator()
        self.processes = [_Process(p) for p in range(count)]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._baton = threading.Semaphore(0)  # released when the running thread yields
        # (store, key) -> [(proc, id, local)]: blocking gets waiting for a key of that store
        self._waiters: dict[tuple[Coordinator, str], list[tuple[_Process, int, bool]]] = {}
        self._pending: set[int] = set()  # blocking gets still waiting, by id
        self.now = 0.0
        self.relay_stores: dict[int, Coordinator] = {}  # leader -> its group's store
        if relay_domains is not None:
            if len(relay_domains) != count:
                raise ValueError(f"{len(relay_domains)} relay domains for {count} processes.")
            leaders = tuple(_relay.leaders(relay_domains, _relay.group_size(count, relay_group)))
            for leader in sorted(set(leaders)):
                self.relay_stores[leader] = Coordinator(relay_latency_s, self.coordinator.bandwidth)
            for leader in self.relay_stores:
                members = _relay.members(leaders, leader)
                store = self.relay_stores[leader]
                for p in members:
                    proc = self.processes[p]
                    client = SimulatedClient(self, proc, store, local=p == leader)
                    proc.relay = _relay.Relay(
                        leader, members, client, leaders if p == _multihost.DECIDER else ()
                    )

    @property
    def groups(self) -> int:
        """The relay groups (0 without relays)."""
        return len(self.relay_stores)

    def relay_total(self) -> Counts:
        """Calls and bytes of every relay store together."""
        total = Counts()
        for store in self.relay_stores.values():
            total.calls += store.total.calls
            total.bytes += store.total.bytes
        return total

    def counts_of(self, proc: _Process, store: Coordinator) -> Counts:
        """`proc`'s counts of its calls to `store`."""
        return proc.counts if store is self.coordinator else proc.relay_counts

    # ---- the event loop ------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> list[tuple[bool, Any]]:
        """Runs `fn(p)` as every process p; returns (ok, result or exception) per process.

        The garbage collector is off meanwhile: a collection of the whole simulation's
        heap (N processes' objects) would be billed to whichever process set it off.
        """
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(fn)
        finally:
            if enabled:
                gc.enable()

    def _run(self, fn: Callable[[int], Any]) -> list[tuple[bool, Any]]:
        old = threading.stack_size(_STACK_BYTES)
        try:
            threads = [
                threading.Thread(target=self._body, args=(proc, fn), daemon=True)
                for proc in self.processes
            ]
            for t in threads:
                t.start()
        finally:
            threading.stack_size(old)
        for proc in self.processes:
            self._at(0.0, functools.partial(self._resume, proc, True, None))
        while self._events:
            when, _, action = heapq.heappop(self._events)
            self.now = max(self.now, when)
            action()
        for t in threads:
            t.join()
        stuck = [p.index for p in self.processes if p.result is None]
        if stuck:
            raise RuntimeError(f"Simulated processes {stuck[:10]} never finished (a lost wake-up).")
        return [p.result for p in self.processes if p.result is not None]

    def left_over(self) -> list[str]:
        """The keys in the store that no later exchange would delete: every exchange's but
        those every process is done with (the next exchange's decider deletes them; see
        `_multihost`), and the values published for the run."""
        retiring = [set(p.member.retiring) if p.member else set() for p in self.processes]
        done = set.intersection(*retiring) if retiring else set()
        return sorted(
            k
            for k in self.coordinator.data
            if not k.startswith(f"{_published.PUBLISHED}/")
            and not any(k.startswith(f"{d}/") for d in done)
        )

    def relay_left_over(self) -> dict[int, int]:
        """The keys each relay store still holds, by its group's leader. The relay's design
        keeps a leader's last few exchanges' outcomes (and shares) there: a count that
        must stay small at any N, not zero (the bench reports the most as a figure)."""
        return {leader: len(store.data) for leader, store in self.relay_stores.items()}

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def _resume(self, proc: _Process, ok: bool, value: Any) -> None:
        """Hands the baton to `proc` with a call's reply; returns once it yields it back."""
        proc.clock = max(proc.clock, self.now)
        proc.reply = (ok, value)
        proc.wake.release()
        self._baton.acquire()

    def _body(self, proc: _Process, fn: Callable[[int], Any]) -> None:
        proc.wake.acquire()
        proc.cpu_mark = time.thread_time()
        member = _multihost.Member(
            SimulatedClient(self, proc),
            proc.index,
            self.count,
            clock=lambda: self.clock(proc),
            relay=proc.relay,
        )
        proc.member = member
        try:
            with _multihost.bound(member):
                proc.result = (True, fn(proc.index))
        except BaseException as e:  # reported per process
            proc.result = (False, e)
        self._spend(proc)
        self._baton.release()

    def clock(self, proc: _Process) -> float:
        """`proc`'s virtual time now: its last reply plus the CPU its code used since."""
        return proc.clock + (time.thread_time() - proc.cpu_mark)

    def charge(self, proc: _Process, seconds: float) -> None:
        """Advances `proc`'s virtual time by `seconds` of CPU its code did not spend here
        (work measured once elsewhere: see `_scale.Restore`)."""
        proc.clock += seconds
        proc.cpu_s += seconds

    def _spend(self, proc: _Process) -> None:
        used = time.thread_time() - proc.cpu_mark
        proc.cpu_s += used
        proc.clock += used

    # ---- calls ---------------------------------------------------------------------------

    def call(
        self,
        proc: _Process,
        store: Coordinator,
        method: str,
        nbytes: int,
        apply: Callable[[float], None],
    ) -> Any:
        """Runs in `proc`'s thread: the request reaches `store`'s queue at `proc`'s clock,
        where `apply(arrival)` acts on the store and schedules the reply; waits for it."""
        self._spend(proc)
        self.counts_of(proc, store).add(nbytes)
        store.total.add(nbytes)
        self._at(proc.clock, lambda: apply(proc.clock))
        self._baton.release()
        proc.wake.acquire()
        proc.cpu_mark = time.thread_time()
        ok, value = proc.reply
        proc.calls.append((method, ok, value))
        if not ok:
            raise value
        return value

    def reply_at(self, proc: _Process, when: float, ok: bool, value: Any) -> None:
        self._at(when, lambda: self._resume(proc, ok, value))

    def wait_for(
        self,
        proc: _Process,
        store: Coordinator,
        key: str,
        arrival: float,
        timeout_s: float,
        local: bool = False,
    ) -> None:
        """`proc` waits for `key` of `store` from `arrival` on, for at most `timeout_s`;
        `local`: the store is in `proc` (the value is not sent over the wire)."""
        waiter = next(self._seq)
        self._pending.add(waiter)
        self._waiters.setdefault((store, key), []).append((proc, waiter, local))

        def expire() -> None:
            if waiter in self._pending:
                self._pending.discard(waiter)
                waiting = [w for w in self._waiters[store, key] if w[1] != waiter]
                if waiting:
                    self._waiters[store, key] = waiting
                else:
                    del self._waiters[store, key]
                error = RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
                self.reply_at(proc, self.now, False, error)

        self._at(arrival + timeout_s, expire)

    def wake(self, store: Coordinator, key: str, done: float) -> None:
        """A set of `key` in `store` served at `done` answers everyone waiting for it."""
        value = store.data[key]
        for proc, waiter, local in self._waiters.pop((store, key), []):
            self._pending.discard(waiter)
            self.counts_of(proc, store).bytes += len(value)
            store.total.bytes += len(value)
            sent = 0 if local else len(value)
            self.reply_at(proc, store.serve(done, sent, calls=0), True, value)


class SimulatedClient:
    """`_multihost.KeyValueClient` of one simulated process, on the coordinator or (`store`)
    on a relay store; `local`: the store is in this process (a leader's own)."""

    def __init__(
        self, sim: Simulation, proc: _Process, store: Coordinator | None = None, local: bool = False
    ):
        self._sim = sim
        self._proc = proc
        self._store_ = store
        self._local = local
        # Recorded as "relay_<method>" on a relay store (`ReplayClient.for_relay`).
        self._prefix = "" if store is None or store is sim.coordinator else RELAY

    @property
    def _store(self) -> Coordinator:
        return self._sim.coordinator if self._store_ is None else self._store_

    def _serve(self, arrival: float, nbytes: int) -> float:
        if self._local:  # no bytes on the wire
            return self._store.serve(arrival, 0, latency_s=LOCAL_LATENCY_S)
        return self._store.serve(arrival, nbytes)

    def _served(self, arrival: float, nbytes: int, ok: bool, value: Any) -> float:
        done = self._serve(arrival, nbytes)
        self._sim.reply_at(self._proc, done, ok, value)
        self._store.peak_keys = max(self._store.peak_keys, len(self._store.data))
        return done

    def _call(self, method: str, nbytes: int, apply: Callable[[float], None]) -> Any:
        return self._sim.call(self._proc, self._store, self._prefix + method, nbytes, apply)

    def _response(self, nbytes: int) -> None:
        """Counts `nbytes` of a response to this process."""
        self._sim.counts_of(self._proc, self._store).bytes += nbytes
        self._store.total.bytes += nbytes

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        def apply(arrival: float) -> None:
            if key in self._store.data and not allow_overwrite:
                error = RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
                self._served(arrival, len(key) + len(value), False, error)
                return
            self._store.data[key] = value
            done = self._served(arrival, len(key) + len(value), True, None)
            self._sim.wake(self._store, key, done)

        self._call("set", len(key) + len(value), apply)

    def key_value_increment(self, key: str, increment: int) -> int:
        def apply(arrival: float) -> None:
            value = int(self._store.data.get(key, "0")) + increment
            self._store.data[key] = str(value)
            done = self._served(arrival, len(key) + 2 * _INT_BYTES, True, value)
            self._sim.wake(self._store, key, done)

        return int(self._call("increment", len(key) + 2 * _INT_BYTES, apply))

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        def apply(arrival: float) -> None:
            if key in self._store.data:
                value = self._store.data[key]
                self._response(len(value))
                self._served(arrival, len(key) + len(value), True, value)
            else:
                done = self._serve(arrival, len(key))
                self._sim.wait_for(
                    self._proc, self._store, key, done, timeout_in_ms / 1000, local=self._local
                )

        return str(self._call("blocking_get", len(key), apply))

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        def apply(arrival: float) -> None:
            found = self._store.dir_get(key)
            nbytes = sum(len(k) + len(v) for k, v in found)
            self._response(nbytes)
            self._served(arrival, len(key) + nbytes, True, found)

        return list(self._call("dir_get", len(key), apply))

    def key_value_delete(self, key: str) -> None:
        def apply(arrival: float) -> None:
            self._store.delete(key)
            self._served(arrival, len(key), True, None)

        self._call("delete", len(key), apply)


class ReplayClient:
    """Answers one process's calls as its simulation did, so that its code can run again
    alone (to measure its CPU time and memory without the other threads). `for_relay()`
    is its client of its relay store: both answer from the one recorded list, in order."""

    def __init__(self, calls: Iterable[tuple[str, bool, Any]], prefix: str = ""):
        self._calls = iter(calls)  # an iterator stays itself: `for_relay` shares it
        self._prefix = prefix

    def for_relay(self) -> ReplayClient:
        """The same process's client of its relay store (its recorded "relay_" calls)."""
        return ReplayClient(self._calls, RELAY)

    def _next(self, method: str) -> Any:
        method = self._prefix + method
        recorded, ok, value = next(self._calls)
        if recorded != method:
            raise RuntimeError(f"The replay called {method} where the simulation {recorded}.")
        if not ok:
            raise value
        return value

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._next("set")

    def key_value_increment(self, key: str, increment: int) -> int:
        return int(self._next("increment"))

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return str(self._next("blocking_get"))

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        return list(self._next("dir_get"))

    def key_value_delete(self, key: str) -> None:
        self._next("delete")
