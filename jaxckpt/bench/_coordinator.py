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
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from jaxckpt.coord import _multihost, _published

LATENCY_S: Final = 50e-6  # the coordinator's time per call
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

    def serve(self, arrival: float, nbytes: int, calls: int = 1) -> float:
        """Queues work that arrives at `arrival`; returns when it is done."""
        start = max(arrival, self.busy_until)
        self.busy_until = start + calls * self.latency_s + nbytes / self.bandwidth
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
        self.counts = Counts()
        self.wake = threading.Semaphore(0)
        self.reply: tuple[bool, Any] = (True, None)
        self.result: tuple[bool, Any] | None = None
        self.calls: list[tuple[str, bool, Any]] = []  # (method, ok, result): for replays
        self.member: _multihost.Member | None = None  # once it runs


class Simulation:
    """N processes of one job against one `Coordinator` (see the module docstring)."""

    def __init__(self, count: int, coordinator: Coordinator | None = None):
        self.count = count
        self.coordinator = coordinator or Coordinator()
        self.processes = [_Process(p) for p in range(count)]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._baton = threading.Semaphore(0)  # released when the running thread yields
        self._waiters: dict[str, list[tuple[_Process, int, int]]] = {}  # key -> (proc, bytes, id)
        self._pending: set[int] = set()  # blocking gets still waiting, by id
        self.now = 0.0

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
            SimulatedClient(self, proc), proc.index, self.count, clock=lambda: self.clock(proc)
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

    def call(self, proc: _Process, method: str, nbytes: int, apply: Callable[[float], None]) -> Any:
        """Runs in `proc`'s thread: the request reaches the queue at `proc`'s clock, where
        `apply(arrival)` acts on the store and schedules the reply; waits for it."""
        self._spend(proc)
        proc.counts.add(nbytes)
        self.coordinator.total.add(nbytes)
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

    def wait_for(self, proc: _Process, key: str, arrival: float, timeout_s: float) -> None:
        waiter = next(self._seq)
        self._pending.add(waiter)
        self._waiters.setdefault(key, []).append((proc, len(key), waiter))

        def expire() -> None:
            if waiter in self._pending:
                self._pending.discard(waiter)
                self._waiters[key] = [w for w in self._waiters[key] if w[2] != waiter]
                error = RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
                self.reply_at(proc, self.now, False, error)

        self._at(arrival + timeout_s, expire)

    def wake(self, key: str, done: float) -> None:
        """A set of `key` served at `done` answers everyone waiting for it."""
        value = self.coordinator.data[key]
        for proc, _, waiter in self._waiters.pop(key, []):
            self._pending.discard(waiter)
            proc.counts.bytes += len(value)
            self.coordinator.total.bytes += len(value)
            self.reply_at(proc, self.coordinator.serve(done, len(value), calls=0), True, value)


class SimulatedClient:
    """`_multihost.KeyValueClient` of one simulated process."""

    def __init__(self, sim: Simulation, proc: _Process):
        self._sim = sim
        self._proc = proc

    @property
    def _store(self) -> Coordinator:
        return self._sim.coordinator

    def _served(self, arrival: float, nbytes: int, ok: bool, value: Any) -> float:
        done = self._store.serve(arrival, nbytes)
        self._sim.reply_at(self._proc, done, ok, value)
        self._store.peak_keys = max(self._store.peak_keys, len(self._store.data))
        return done

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        def apply(arrival: float) -> None:
            if key in self._store.data and not allow_overwrite:
                error = RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
                self._served(arrival, len(key) + len(value), False, error)
                return
            self._store.data[key] = value
            done = self._served(arrival, len(key) + len(value), True, None)
            self._sim.wake(key, done)

        self._sim.call(self._proc, "set", len(key) + len(value), apply)

    def key_value_increment(self, key: str, increment: int) -> int:
        def apply(arrival: float) -> None:
            value = int(self._store.data.get(key, "0")) + increment
            self._store.data[key] = str(value)
            done = self._served(arrival, len(key) + 2 * _INT_BYTES, True, value)
            self._sim.wake(key, done)

        return int(self._sim.call(self._proc, "increment", len(key) + 2 * _INT_BYTES, apply))

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        def apply(arrival: float) -> None:
            if key in self._store.data:
                value = self._store.data[key]
                self._proc.counts.bytes += len(value)
                self._store.total.bytes += len(value)
                self._served(arrival, len(key) + len(value), True, value)
            else:
                done = self._store.serve(arrival, len(key))
                self._sim.wait_for(self._proc, key, done, timeout_in_ms / 1000)

        return str(self._sim.call(self._proc, "blocking_get", len(key), apply))

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        def apply(arrival: float) -> None:
            found = self._store.dir_get(key)
            nbytes = sum(len(k) + len(v) for k, v in found)
            self._proc.counts.bytes += nbytes
            self._store.total.bytes += nbytes
            self._served(arrival, len(key) + nbytes, True, found)

        return list(self._sim.call(self._proc, "dir_get", len(key), apply))

    def key_value_delete(self, key: str) -> None:
        def apply(arrival: float) -> None:
            self._store.delete(key)
            self._served(arrival, len(key), True, None)

        self._sim.call(self._proc, "delete", len(key), apply)


class ReplayClient:
    """Answers one process's calls as its simulation did, so that its code can run again
    alone (to measure its CPU time and memory without the other threads)."""

    def __init__(self, calls: list[tuple[str, bool, Any]]):
        self._calls = iter(calls)

    def _next(self, method: str) -> Any:
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
