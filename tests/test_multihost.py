"""`_multihost` exchanges, with N threads playing N processes over an in-memory store.

The store behaves like jax's coordination service key-value store (set refuses
to overwrite, blocking get with a deadline, directory get and recursive
delete: `_kv.RelayStore`); the real one is exercised by tests/workers/mp_agreement.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from jaxckpt.coord import _exchange, _kv, _multihost


class FakeStore(_kv.RelayStore):
    """The coordination service's key-value store, as jaxckpt's in-memory one models it
    (`_kv.RelayStore`), that can be made to fail every call like a dead coordinator."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_with: str | None = None  # every call raises this

    @property
    def data(self) -> dict[str, str]:
        return self._data

    def _check(self) -> None:
        if self.fail_with:
            raise RuntimeError(self.fail_with)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._check()
        super().key_value_set(key, value, allow_overwrite)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        self._check()
        return super().blocking_key_value_get(key, timeout_in_ms)

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        self._check()
        return super().key_value_dir_get(key)

    def key_value_delete(self, key: str) -> None:
        self._check()
        super().key_value_delete(key)


class Job:
    """`job(count, fn)` calls `fn(process)` in `count` threads, each one a process of a
    jax.distributed job whose key-value store is `store`; returns process -> (kind,
    result or error, seconds)."""

    def __init__(self, store: FakeStore, monkeypatch: pytest.MonkeyPatch):
        self.store = store
        self._monkeypatch = monkeypatch
        self.members: dict[int, _multihost.Member] = {}  # a process keeps its rounds

    def __call__(
        self, count: int, fn: Callable[[int], Any], processes: list[int] | None = None
    ) -> dict:
        self._monkeypatch.setattr(_multihost, "process_count", lambda: count)
        results: dict[int, Any] = {}
        for p in range(count):
            self.members.setdefault(p, _multihost.Member(self.store, p, count)).count = count

        def one(p: int) -> None:
            started = time.monotonic()
            try:
                with _multihost.bound(self.members[p]):
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

    def left(self) -> list[str]:
        """The keys in the store that no later exchange would delete."""
        return left_over(self.store.data, list(self.members.values()))


@pytest.fixture
def job(monkeypatch):
    """(store, run): `run` is a `Job` over `store`."""
    store = FakeStore()
    return store, Job(store, monkeypatch)


def left_over(data: dict[str, Any], members: list[_multihost.Member]) -> list[str]:
    """The keys in `data` that no later exchange would delete: those of an exchange that
    not every process is done with yet (each posts those it is done with next time)."""
    done = set.intersection(*(set(m.retiring) for m in members)) if members else set()
    return sorted(k for k in data if not any(k.startswith(f"{d}/") for d in done))


def test_allgather_returns_every_value_in_process_order_and_leaves_no_keys(job):
    store, run = job
    results = run(4, lambda p: [_multihost.allgather({"p": p}, tag="t", timeout_s=5)])
    for kind, value, _ in results.values():
        assert kind == "ok" and value == [[{"p": 0}, {"p": 1}, {"p": 2}, {"p": 3}]]
    # Its outcome alone stays, for the next exchange to delete: no value, no share.
    assert run.left() == [] and all(k.startswith("jaxckpt/t/0/") for k in store.data)
    assert not any("/v/" in k for k in store.data), sorted(store.data)


def test_many_rounds_keep_the_store_empty(job):
    """Every finished exchange is deleted by the next one: a long run does not grow the
    store beyond the last exchange's outcome."""
    store, run = job

    def many(p: int) -> list[int]:
        return [_multihost.allgather(i, tag=f"tag{i % 3}", timeout_s=5)[2] for i in range(60)]

    results = run(3, many)
    assert all(kind == "ok" and value == list(range(60)) for kind, value, _ in results.values())
    assert {k.rsplit("/", 1)[0] for k in store.data} == {"jaxckpt/tag2/19"}, sorted(store.data)
    assert run.left() == []


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


def test_giving_up_after_the_decider_claimed_the_outcome_waits_for_it():
    """The decider claims the outcome once it has every value, before it combines them
    (its combine may write the step's index): a process whose deadline passes then gets
    that outcome, not a timeout of its own; before the claim, giving up wins."""
    store = FakeStore()
    store.key_value_set("k/c", "0")  # the decider has every value and is combining them
    store.key_value_set("k/all", "ok:[1,2,3]")
    assert _exchange._give_up(store, "k", 1, 3, 1.0, time.monotonic) == "ok:[1,2,3]"
    store2 = FakeStore()
    store2.key_value_set("k/v/0", "")
    store2.key_value_set("k/v/1", "")  # process 2 never came: giving up wins
    verdict = _exchange._give_up(store2, "k", 1, 3, 1.0, time.monotonic)
    assert json.loads(verdict) == {"gave_up": 1, "missing": [2]}
    assert store2.data["k/all"] == verdict and store2.data["k/c"] == "1"


def test_a_combine_that_takes_longer_than_the_timeout_still_decides_everywhere(job):
    """The decider's combine (an index written to a slow bucket) outlasts the others'
    deadlines: they wait for its outcome (at most another timeout) instead of giving up."""
    _, run = job

    def slow(texts: dict[int, str]) -> list[str]:
        time.sleep(1.5)
        return sorted(texts.values())

    results = run(3, lambda p: _multihost.converge(str(p), slow, tag="t", timeout_s=1.0))
    for kind, value, _ in results.values():
        assert kind == "ok" and value == ["0", "1", "2"], value


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
    assert store.data == {}  # nothing posted


def test_no_process_reads_the_others_values(job):
    """Only the decider (process 0) reads the posted values; the others read one outcome,
    with two calls each: their value posted, the outcome read."""
    store, run = job
    calls: list[tuple[int, str, str]] = []

    def counting(name: str) -> Callable[..., Any]:
        method = getattr(store, name)

        def call(key: str, *args: Any) -> Any:
            calls.append((_multihost.process_index(), name, key))
            return method(key, *args)

        return call

    for name in ("key_value_set", "key_value_dir_get", "blocking_key_value_get"):
        setattr(store, name, counting(name))
    results = run(6, lambda p: _multihost.allgather(p, tag="t", timeout_s=5))
    assert all(value == list(range(6)) for _, value, _ in results.values())
    reads = [(p, key) for p, name, key in calls if name == "key_value_dir_get"]
    assert reads and all(p == 0 and key.endswith("/v") for p, key in reads), reads
    for p in range(1, 6):
        assert [(n, k) for q, n, k in calls if q == p] == [
            ("key_value_set", f"jaxckpt/t/0/v/{p}"),
            ("blocking_key_value_get", "jaxckpt/t/0/all"),
        ]


def test_the_decider_waits_for_a_late_process_without_reading_big_values_again(job):
    """Values of 60 KB: once one process is missing, waiting for it alone costs less than
    reading every value again, so the decider reads them once and waits for the last."""
    store, run = job
    reads: list[str] = []
    dir_get = store.key_value_dir_get

    def counting(key: str) -> list[tuple[str, str]]:
        reads.append(key)
        return dir_get(key)

    store.key_value_dir_get = counting  # type: ignore[method-assign]

    def wait_until(ready: Callable[[], bool]) -> None:
        while not ready():
            time.sleep(0.01)

    def late(p: int) -> list[int]:
        if p == 0:  # the decider reads once processes 1 and 2 posted
            wait_until(lambda: {"jaxckpt/big/0/v/1", "jaxckpt/big/0/v/2"} <= set(store.data))
        if p == 3:  # and process 3 posts after that read
            wait_until(lambda: bool(reads))
        return [len(v) for v in _multihost.allgather("x" * 60_000, tag="big", timeout_s=10)]

    results = run(4, late)
    assert all(kind == "ok" and value == [60_000] * 4 for kind, value, _ in results.values())
    assert len(reads) == 1, reads


def test_a_failing_combine_raises_on_every_process(job):
    _, run = job

    def combine(texts: dict[int, str]) -> None:
        raise KeyError("no such process")

    results = run(3, lambda p: _multihost.converge("x", combine, tag="t", timeout_s=5))
    for kind, error, _ in results.values():
        assert kind == "error" and isinstance(error, RuntimeError), error
        assert "could not combine" in str(error) and "no such process" in str(error)
        assert _multihost.is_agreed(error)


def test_an_exchange_is_deleted_by_the_next_one_without_a_call_of_its_own(job):
    """No process counts itself out of an exchange: the next exchange's decider deletes
    the inventory's keys (every process posted that it is done with them)."""
    store, run = job
    deleted: list[str] = []
    delete = store.key_value_delete

    def recording(key: str) -> None:
        deleted.append(key)
        delete(key)

    store.key_value_delete = recording  # type: ignore[method-assign]

    def restore(p: int) -> list[Any]:
        held = _multihost.allgather({"held": [p]}, tag="inv", timeout_s=5)
        _multihost.allgather(None, tag="verdict", timeout_s=5)
        return held

    results = run(4, restore)
    for kind, held, _ in results.values():
        assert kind == "ok" and held == [{"held": [p]} for p in range(4)]
    assert "jaxckpt/inv/0" in deleted, deleted
    assert not any(k.startswith("jaxckpt/inv/") for k in store.data), sorted(store.data)
    assert run.left() == []
