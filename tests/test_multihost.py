"""`_multihost` exchanges, with N threads playing N processes over an in-memory store.

The store behaves like jax's coordination service key-value store (set refuses
to overwrite, atomic increment, blocking get with a deadline, directory get
and recursive delete); the real one is exercised by tests/mp_agreement.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from jaxckpt.coord import _multihost


class FakeStore:
    """An in-memory stand-in for the coordination service's key-value store."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cond = threading.Condition()
        self.fail_with: str | None = None  # every call raises this, like a dead coordinator

    def _check(self) -> None:
        if self.fail_with:
            raise RuntimeError(self.fail_with)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._check()
        with self.cond:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.data[key] = value
            self.cond.notify_all()

    def key_value_increment(self, key: str, increment: int) -> int:
        self._check()
        with self.cond:
            value = int(self.data.get(key, "0")) + increment
            self.data[key] = str(value)
            self.cond.notify_all()
            return value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        self._check()
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        self._check()
        with self.cond:
            prefix = key.rstrip("/") + "/"
            return sorted((k, v) for k, v in self.data.items() if k.startswith(prefix))

    def key_value_delete(self, key: str) -> None:
        self._check()
        with self.cond:
            for k in [k for k in self.data if k == key or k.startswith(key.rstrip("/") + "/")]:
                del self.data[k]


class PerThreadRounds:
    """`_multihost._rounds` for threads playing processes: each keeps its own counters."""

    def __init__(self) -> None:
        self.local = threading.local()

    def _rounds(self) -> dict[str, int]:
        if not hasattr(self.local, "rounds"):
            self.local.rounds = {}
        return self.local.rounds

    def get(self, tag: str, default: int) -> int:
        return self._rounds().get(tag, default)

    def __setitem__(self, tag: str, value: int) -> None:
        self._rounds()[tag] = value


@pytest.fixture
def job(monkeypatch):
    """(store, run): `run(count, fn)` calls `fn(process)` in `count` threads, each one a
    process of a jax.distributed job whose key-value store is `store`."""
    store = FakeStore()
    me = threading.local()
    monkeypatch.setattr(_multihost, "_rounds", PerThreadRounds())
    monkeypatch.setattr(_multihost, "_client", lambda: store)
    monkeypatch.setattr(_multihost, "process_index", lambda: me.index)

    def run(count: int, fn: Callable[[int], Any], processes: list[int] | None = None) -> dict:
        monkeypatch.setattr(_multihost, "process_count", lambda: count)
        results: dict[int, Any] = {}

        def one(p: int) -> None:
            me.index = p
            started = time.monotonic()
            try:
                results[p] = ("ok", fn(p), time.monotonic() - started)
            except Exception as e:
                results[p] = ("error", e, time.monotonic() - started)

        threads = [threading.Thread(target=one, args=(p,)) for p in processes or range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "an exchange hung"
        return results

    return store, run


def test_allgather_returns_every_value_in_process_order_and_leaves_no_keys(job):
    store, run = job
    results = run(4, lambda p: [_multihost.allgather({"p": p}, tag="t", timeout_s=5)])
    for kind, value, _ in results.values():
        assert kind == "ok" and value == [[{"p": 0}, {"p": 1}, {"p": 2}, {"p": 3}]]
    assert store.data == {}


def test_many_rounds_keep_the_store_empty(job):
    """Every finished exchange deletes its keys: a long run does not grow the store."""
    store, run = job

    def many(p: int) -> list[int]:
        return [_multihost.allgather(i, tag=f"tag{i % 3}", timeout_s=5)[2] for i in range(60)]

    results = run(3, many)
    assert all(kind == "ok" and value == list(range(60)) for kind, value, _ in results.values())
    assert store.data == {}, sorted(store.data)[:10]


def test_broadcast_gives_process_0s_value(job):
    _, run = job
    results = run(3, lambda p: _multihost.broadcast(f"from {p}", tag="b", timeout_s=5))
    assert {value for _, value, _ in results.values()} == {"from 0"}


def test_dead_processes_cost_one_timeout_and_are_named(job):
    """Processes 3 and 4 never come: the others wait one timeout in all, not one each."""
    _, run = job
    timeout = 1.0
    results = run(
        5, lambda p: _multihost.allgather(p, tag="t", timeout_s=timeout), processes=[0, 1, 2]
    )
    for p, (kind, error, seconds) in results.items():
        assert kind == "error" and isinstance(error, TimeoutError), (p, error)
        assert "processes [3, 4] did not answer" in str(error), error
        assert seconds < 1.6 * timeout, f"process {p} waited {seconds:.2f} s"


def test_a_late_process_fails_too_instead_of_going_on_alone(job):
    """Process 2 arrives after the others gave up: it raises as they did, at once."""
    _, run = job

    def late(p: int) -> list[Any]:
        if p == 2:
            time.sleep(1.0)
        return _multihost.allgather(p, tag="t", timeout_s=0.3)

    results = run(3, late)
    for p, (kind, error, _) in results.items():
        assert kind == "error" and isinstance(error, TimeoutError), (p, error)
        assert "stopped waiting" in str(error), error
    assert results[2][2] < 1.6, results[2]  # it did not wait a timeout of its own
    assert "processes [2] did not answer" in str(results[0][1])


def test_giving_up_just_after_the_last_arrival_waits_for_its_outcome():
    store = FakeStore()
    store.key_value_increment("k/n", 3)  # all three arrived; the last one is deciding
    store.key_value_set("k/all", "ok:[1,2,3]")
    assert _multihost._give_up(store, "k", 0, 3, time.monotonic) == "ok:[1,2,3]"
    store2 = FakeStore()
    store2.key_value_increment("k/n", 2)  # one missing: giving up wins
    assert "gave_up" in _multihost._give_up(store2, "k", 0, 3, time.monotonic)
    assert store2.data["k/all"] == '{"gave_up": 0}'


def test_a_failed_coordinator_is_not_reported_as_a_missing_process(job):
    store, run = job
    store.fail_with = "UNAVAILABLE: failed to connect to all addresses"
    results = run(2, lambda p: _multihost.allgather(p, tag="t", timeout_s=5))
    for kind, error, _ in results.values():
        assert kind == "error" and isinstance(error, ConnectionError), error
        assert "UNAVAILABLE" in str(error) and "did not answer" not in str(error)


def test_a_value_that_cannot_be_sent_fails_before_taking_part(job):
    store, run = job
    results = run(2, lambda p: _multihost.allgather(object(), tag="t", timeout_s=1), [0])
    kind, error, _ = results[0]
    assert kind == "error" and isinstance(error, TypeError)
    assert store.data == {}


def test_no_process_reads_the_others_values(job):
    """Only the last arrival reads the posted values (once); the others read one outcome."""
    store, run = job
    reads: list[str] = []
    dir_get = store.key_value_dir_get

    def counting(key: str) -> list[tuple[str, str]]:
        reads.append(key)
        return dir_get(key)

    store.key_value_dir_get = counting  # type: ignore[method-assign]
    results = run(6, lambda p: _multihost.allgather(p, tag="t", timeout_s=5))
    assert all(value == list(range(6)) for _, value, _ in results.values())
    assert len(reads) == 1 and reads[0].endswith("/v"), reads


def test_a_failing_combine_raises_on_every_process(job):
    _, run = job

    def combine(texts: dict[int, str]) -> None:
        raise KeyError("no such process")

    results = run(3, lambda p: _multihost.converge("x", combine, tag="t", timeout_s=5))
    for kind, error, _ in results.values():
        assert kind == "error" and isinstance(error, RuntimeError), error
        assert "could not combine" in str(error) and "no such process" in str(error)
        assert _multihost.is_agreed(error)


def test_an_exchange_retired_later_is_deleted_by_the_next_one(job):
    """A restore's inventory skips counting itself out; its verdict's decider deletes it."""
    store, run = job
    counted: list[str] = []
    increment = store.key_value_increment

    def recording(key: str, by: int) -> int:
        counted.append(key)
        return increment(key, by)

    store.key_value_increment = recording  # type: ignore[method-assign]

    def restore(p: int) -> list[Any]:
        held = _multihost.allgather({"held": [p]}, tag="inv", timeout_s=5, retire_later=True)
        _multihost.allgather(None, tag="verdict", timeout_s=5)
        return held

    results = run(4, restore)
    for kind, held, _ in results.values():
        assert kind == "ok" and held == [{"held": [p]} for p in range(4)]
    assert "jaxckpt/inv/0/done" not in counted, counted
    assert "jaxckpt/verdict/0/done" in counted
    assert store.data == {}, sorted(store.data)
