"""The one place that talks to other processes; every call degrades to one process.

Small control messages (inventories, peer addresses, the run's token, the
verdicts of saves and restores) go through the jax.distributed key-value store.
An exchange waits for every process at once against one deadline, so any
number of dead processes costs one timeout, and it ends the same way on every
process that takes part: either all get every value, or all raise. Its keys
are deleted once every process is done with them, so a long run does not grow
the coordinator's store. Bulk bytes never go through here (see the peer data
service).

One exchange `<prefix>/<tag>/<round>` in the store:

    v/<p>    process p's value (JSON)
    n        arrivals; a process that gives up adds `_GAVE_UP` to it
    all      "complete", or who gave up: set by the last arrival or the one who gave up
    done     processes finished with the exchange; the last one deletes it all

The atomic counter `n` decides between "everyone arrived" and "someone gave up"
in one order seen by all: a process whose deadline passes adds `_GAVE_UP` and
learns from the sum whether every other process had arrived just before.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Protocol

import jax
from absl import logging as log

from jaxckpt import _internals

_PREFIX = "jaxckpt"
_GAVE_UP = 1 << 20  # added to `n` by a process that stops waiting (more than any process count)
_COMPLETE = "complete"
_AGREED = "_jaxckpt_agreed"  # attribute of an exception that every process raises
_lock = threading.Lock()
_rounds: dict[str, int] = {}  # tag -> next round; every process calls a tag's rounds in order


class KeyValueClient(Protocol):
    """The part of jax's `DistributedRuntimeClient` an exchange uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def key_value_increment(self, key: str, increment: int) -> int: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
    def key_value_delete(self, key: str) -> None: ...


def is_agreed(error: BaseException) -> bool:
    """Whether every process that took part raises `error` too (no further agreement needed)."""
    return bool(getattr(error, _AGREED, False))


def mark_agreed(error: BaseException) -> BaseException:
    """Marks `error` as one every process that took part raises as well."""
    setattr(error, _AGREED, True)
    return error


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def _client() -> KeyValueClient:
    client = _internals.distributed_client()
    if client is None:
        raise RuntimeError(
            "jaxckpt needs jax.distributed.initialize() before it can exchange data between "
            f"{process_count()} processes."
        )
    return client


def allgather(value: Any, *, tag: str, timeout_s: float) -> list[Any]:
    """Every process's JSON-serializable `value`, in process order.

    All processes must call this in the same order for the same `tag`; calls
    with different tags may interleave differently on each process.

    Raises:
      TimeoutError: on every process that takes part, if some process did not
        contribute within `timeout_s` (one deadline for all of them), naming
        the processes that were missing.
      ConnectionError: if the coordination service itself failed.
    """
    count = process_count()
    if count == 1:
        return [value]
    return exchange(_client(), process_index(), count, next_key(tag), value, timeout_s=timeout_s)


def broadcast(value: Any, *, tag: str, timeout_s: float) -> Any:
    """Process 0's `value`, on every process (every process waits for all, like `allgather`)."""
    if process_count() == 1:
        return value
    mine = value if process_index() == 0 else None
    return allgather(mine, tag=tag, timeout_s=timeout_s)[0]


def next_key(tag: str) -> str:
    """The store key of this process's next round of `tag`."""
    with _lock:
        round_ = _rounds.get(tag, 0)
        _rounds[tag] = round_ + 1
    return f"{_PREFIX}/{tag}/{round_}"


def stored_keys(client: KeyValueClient | None = None) -> list[str]:
    """The keys jaxckpt holds in the coordinator's store right now (for tests and debugging)."""
    if client is None:
        if process_count() == 1 and _internals.distributed_client() is None:
            return []
        client = _client()
    return [k for k, _ in client.key_value_dir_get(_PREFIX)]


def exchange(
    client: KeyValueClient, me: int, count: int, key: str, value: Any, *, timeout_s: float
) -> list[Any]:
    """One round of an all-gather through `client` under `key` (see the module docstring).

    Raises:
      TimeoutError: if some process did not contribute before the deadline.
      ConnectionError: if the coordination service failed.
    """
    deadline = time.monotonic() + timeout_s
    what = key.removeprefix(f"{_PREFIX}/")
    text = json.dumps(value)  # a value that cannot be sent fails here, before taking part
    try:
        client.key_value_set(f"{key}/v/{me}", text)
        arrived = client.key_value_increment(f"{key}/n", 1)
        if arrived == count:  # the last to arrive tells the others
            client.key_value_set(f"{key}/all", _COMPLETE)
            outcome = _COMPLETE
        elif arrived > count:  # somebody gave up before this process arrived
            outcome = _get(client, f"{key}/all", max(deadline, time.monotonic() + 5)) or ""
        else:
            outcome = _get(client, f"{key}/all", deadline) or _give_up(client, key, me, count)
        if outcome == _COMPLETE:
            return _values(client, key, count)
        posted = _posted(client, key)
        raise mark_agreed(_timeout(me, what, timeout_s, count, posted, outcome))
    except TimeoutError:
        raise
    except Exception as e:  # the runtime raises its own error types
        raise mark_agreed(
            ConnectionError(
                f"[process {me}] The exchange '{what}' through the jax.distributed coordination "
                f"service failed: {e}. Is the coordinator (process 0) still running?"
            )
        ) from e
    finally:
        _finish(client, key, count, me)


def _get(client: KeyValueClient, key: str, deadline: float) -> str | None:
    """The value of `key` once it is set, or None if the deadline passes first."""
    ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
        return client.blocking_key_value_get(key, ms)
    except Exception as e:
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
            return None
        raise


def _give_up(client: KeyValueClient, key: str, me: int, count: int) -> str:
    """Stops waiting: `_COMPLETE` if every process arrived just in time, else who gave up."""
    total = client.key_value_increment(f"{key}/n", _GAVE_UP)
    if total == _GAVE_UP + count:
        return _COMPLETE
    verdict = json.dumps({"gave_up": me})
    # Wakes the processes still waiting; fails if another one gave up first and told them.
    with contextlib.suppress(Exception):
        client.key_value_set(f"{key}/all", verdict)
    return verdict


def _posted(client: KeyValueClient, key: str) -> set[int]:
    return {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{key}/v")}


def _values(client: KeyValueClient, key: str, count: int) -> list[Any]:
    values = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{key}/v")}
    return [json.loads(values[p]) for p in range(count)]


def _timeout(
    me: int, what: str, timeout_s: float, count: int, posted: set[int], outcome: str
) -> TimeoutError:
    missing = sorted(set(range(count)) - posted)
    try:
        by = json.loads(outcome)["gave_up"]
    except (ValueError, KeyError, TypeError):
        by = None
    who = "this process" if by == me else f"process {by}" if by is not None else "a process"
    if missing:
        why = (
            f"processes {missing} did not answer within {timeout_s:g} s (dead, stuck, or slower "
            f"than the timeout), so {who} stopped waiting"
        )
    else:
        why = f"{who} stopped waiting after {timeout_s:g} s, just before the last process answered"
    return TimeoutError(
        f"[process {me}] The exchange '{what}' between {count} processes failed: {why}. Every "
        "process that took part raises this; raise TierOptions.timeout_s if they are just slow."
    )


def _finish(client: KeyValueClient, key: str, count: int, me: int) -> None:
    """Counts this process out of the exchange; the last one out deletes its keys."""
    try:
        if client.key_value_increment(f"{key}/done", 1) == count:
            client.key_value_delete(key)
    except Exception as e:  # cleanup only: the exchange's outcome stands
        log.warning("jaxckpt: [process %d] could not clean up exchange %s: %s", me, key, e)
