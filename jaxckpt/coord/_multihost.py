"""The one place that talks to other processes; every call degrades to one process.

Small control messages (inventories, peer addresses, the run's token, the
verdicts of saves and restores) go through the jax.distributed key-value store.
An exchange waits for every process at once against one deadline, so any
number of dead processes costs one timeout, and it ends the same way on every
process that takes part: either all get the same outcome, or all raise. Its
keys are deleted once every process is done with them, so a long run does not
grow the coordinator's store. Bulk bytes never go through here (see the peer
data service).

No process reads every other process's value: that would move O(N^2) bytes
through the one coordinator per exchange (~1 GB at 4,096 processes). Instead
the last process to arrive reads the values once, *combines* them into one
outcome (a verdict, a digest comparison, a table) and publishes it; every
process reads only that outcome. One exchange `<prefix>/<tag>/<round>`:

    v/<p>    process p's value (text, often empty)
    n        arrivals; a process that gives up adds `_GAVE_UP` to it
    all      the outcome: "ok:" and the combined value (compressed when long),
             or {"failed": why} or {"gave_up": p}; set by the last arrival or by
             the one who gave up
    to/<p>   with `converge_each`: what the decider tells process p alone (set
             before `all`), so that N different answers cost O(N) bytes, not N^2
    done     processes finished with the exchange; the last one deletes it all
             (or, for an exchange every process follows with another, that
             one's decider: `converge(retire_later=True)`)

A process makes four calls (set, increment, blocking get, increment); the
last arrival two or three more (one directory read, a set, the delete).

The atomic counter `n` decides between "everyone arrived" and "someone gave up"
in one order seen by all: a process whose deadline passes adds `_GAVE_UP` and
learns from the sum whether every other process had arrived just before (then
the last arrival is deciding, and it waits for that outcome a little longer).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

import jax
from absl import logging as log

from jaxckpt import _internals

_PREFIX: Final = "jaxckpt"
_GAVE_UP: Final = 1 << 20  # added to `n` by a process that stops waiting (more than any count)
_GRACE_S: Final = 5.0  # how long past its deadline a process waits for an outcome being decided
_OK: Final = "ok:"  # prefix of a combined outcome (a failure is a JSON object)
_PACKED: Final = "z:"  # prefix of a compressed one (JSON never starts with "z")
_PACK_FROM: Final = 256  # outcomes from this many characters on are compressed
_AGREED: Final = "_jaxckpt_agreed"  # attribute of an exception that every process raises
_lock = threading.Lock()
_rounds: dict[str, int] = {}  # tag -> next round; every process calls a tag's rounds in order
_retiring: list[str] = []  # exchanges this process is done with, left to a later one to delete
_RETIRING: Final = "r:"  # prefix of a posted value that carries the retiring exchanges

Combine = Callable[[dict[int, str]], Any]  # every process's posted text -> the JSON outcome


class KeyValueClient(Protocol):
    """The part of jax's `DistributedRuntimeClient` an exchange uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def key_value_increment(self, key: str, increment: int) -> int: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
    def key_value_delete(self, key: str) -> None: ...


@dataclasses.dataclass
class Member:
    """One process of a job whose store is not jax's own: the scale simulation binds one
    per thread (`bound`), so that the real exchanges run with N processes in one."""

    client: KeyValueClient
    index: int
    count: int
    clock: Callable[[], float] = time.monotonic
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)
    retiring: list[str] = dataclasses.field(default_factory=list)


_member: contextvars.ContextVar[Member | None] = contextvars.ContextVar(
    "jaxckpt_member", default=None
)


@contextlib.contextmanager
def bound(member: Member) -> Iterator[Member]:
    """Makes this thread (context) `member` for every call below (for simulations)."""
    token = _member.set(member)
    try:
        yield member
    finally:
        _member.reset(token)


def is_agreed(error: BaseException) -> bool:
    """Whether every process that took part raises `error` too (no further agreement needed)."""
    return bool(getattr(error, _AGREED, False))


def mark_agreed(error: BaseException) -> BaseException:
    """Marks `error` as one every process that took part raises as well."""
    setattr(error, _AGREED, True)
    return error


def process_index() -> int:
    member = _member.get()
    return member.index if member is not None else jax.process_index()


def process_count() -> int:
    member = _member.get()
    return member.count if member is not None else jax.process_count()


def _client() -> KeyValueClient:
    client = _internals.distributed_client()
    if client is None:
        raise RuntimeError(
            "jaxckpt needs jax.distributed.initialize() before it can exchange data between "
            f"{process_count()} processes."
        )
    return client


def _session() -> tuple[KeyValueClient, int, int, Callable[[], float]]:
    """(client, this process, process count, clock) of the job this thread belongs to."""
    member = _member.get()
    if member is not None:
        return member.client, member.index, member.count, member.clock
    return _client(), process_index(), process_count(), time.monotonic


def session() -> tuple[KeyValueClient, int, int, Callable[[], float]]:
    """(client, this process, process count, clock) of the job this thread belongs to."""
    return _session()


def wait_for(
    client: KeyValueClient, key: str, deadline: float, clock: Callable[[], float]
) -> str | None:
    """The value of `key` once it is set, or None if `deadline` (on `clock`) passes first."""
    return _get(client, key, deadline, clock)


def converge(
    text: str, combine: Combine, *, tag: str, timeout_s: float, retire_later: bool = False
) -> Any:
    """Every process posts `text`; one of them combines all texts; all get the result.

    `combine(texts)` gets every process's text by process index and returns a
    JSON-serializable outcome. It runs on one process only (the last to arrive),
    so it must depend on nothing but its argument and what every process
    shares; if it raises, every process raises a RuntimeError saying so.

    All processes must call this in the same order for the same `tag`; calls
    with different tags may interleave differently on each process.

    With `retire_later`, a process that got the outcome does not count itself
    out (one call fewer, on the critical path of what follows): the exchange
    is deleted by the first later exchange that every process enters after
    this one (each posts the exchanges it is done with). For an exchange that
    every process always follows with another, such as a restore's inventory
    with its verdict.

    Raises:
      TimeoutError: on every process that takes part, if some process did not
        contribute within `timeout_s` (one deadline for all of them), naming
        the processes that were missing.
      ConnectionError: if the coordination service itself failed.
    """
    if process_count() == 1:
        return json.loads(json.dumps(combine({0: text})))  # the same types as through the store
    client, me, count, clock = _session()
    key = next_key(tag)
    return exchange(
        client,
        me,
        count,
        key,
        text,
        combine,
        timeout_s=timeout_s,
        clock=clock,
        retire_later=retire_later,
    )


def converge_each(text: str, combine: Combine, *, tag: str, timeout_s: float) -> tuple[Any, Any]:
    """`converge` where the outcome differs per process: `combine(texts)` returns
    `{"all": what every process gets, "each": {process: what it alone gets}}`; the
    decider stores each process's share under its own key, and every process reads
    only the common outcome and its share (one call more than `converge`).

    Returns:
      (the common outcome, this process's share or None).

    Raises:
      As `converge`.
    """
    if process_count() == 1:
        decided = json.loads(json.dumps(combine({0: text})))
        return decided["all"], decided["each"].get("0")
    client, me, count, clock = _session()
    key = next_key(tag)
    return exchange(
        client, me, count, key, text, combine, timeout_s=timeout_s, clock=clock, each=True
    )


def allgather(value: Any, *, tag: str, timeout_s: float, retire_later: bool = False) -> list[Any]:
    """Every process's JSON-serializable `value`, in process order.

    Moves O(N^2) bytes through the coordinator (every process reads every
    value): for small N, or values that compress well. See `converge`.

    Raises:
      TimeoutError, ConnectionError: as `converge`.
    """
    count = process_count()
    if count == 1:
        return [value]
    text = json.dumps(value)  # a value that cannot be sent fails here, before taking part
    return converge(
        text,
        lambda texts: [json.loads(texts[p]) for p in range(count)],
        tag=tag,
        timeout_s=timeout_s,
        retire_later=retire_later,
    )


def broadcast(value: Any, *, tag: str, timeout_s: float) -> Any:
    """Process 0's `value`, on every process (every process waits for all, like `converge`)."""
    if process_count() == 1:
        return value
    text = json.dumps(value) if process_index() == 0 else ""
    return converge(text, lambda texts: json.loads(texts[0]), tag=tag, timeout_s=timeout_s)


def _retiring_list() -> list[str]:
    member = _member.get()
    return member.retiring if member is not None else _retiring


def next_key(tag: str) -> str:
    """The store key of this process's next round of `tag`."""
    member = _member.get()
    with _lock:
        rounds = member.rounds if member is not None else _rounds
        round_ = rounds.get(tag, 0)
        rounds[tag] = round_ + 1
    return f"{_PREFIX}/{tag}/{round_}"


def stored_keys(client: KeyValueClient | None = None) -> list[str]:
    """The keys jaxckpt holds in the coordinator's store right now (for tests and debugging)."""
    if client is None:
        if process_count() == 1 and _internals.distributed_client() is None:
            return []
        client = _session()[0]
    return [k for k, _ in client.key_value_dir_get(_PREFIX)]


def exchange(
    client: KeyValueClient,
    me: int,
    count: int,
    key: str,
    text: str,
    combine: Combine,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    retire_later: bool = False,
    each: bool = False,
) -> Any:
    """One round of `converge` (`converge_each` with `each`) through `client` under `key`
    (see the module docstring).

    Raises:
      TimeoutError: if some process did not contribute before the deadline.
      ConnectionError: if the coordination service failed.
      RuntimeError: if `combine` failed on the process that ran it.
    """
    deadline = clock() + timeout_s
    what = key.removeprefix(f"{_PREFIX}/")
    finished = False
    outcome: str | None = None
    share: str | None = None
    retiring = _retiring_list()
    with _lock:
        done_with = list(retiring)
    posted_text = f"{_RETIRING}{json.dumps(done_with)}\n{text}" if done_with else text
    try:
        try:
            client.key_value_set(f"{key}/v/{me}", posted_text)
            arrived = client.key_value_increment(f"{key}/n", 1)
            if arrived == count:  # the last to arrive decides, and tells the others
                outcome = _decide(client, key, combine, each)
            elif arrived > count:  # somebody gave up before this process arrived
                outcome = _get(client, f"{key}/all", max(deadline, clock() + _GRACE_S), clock)
            else:
                outcome = _get(client, f"{key}/all", deadline, clock) or _give_up(
                    client, key, me, count, clock
                )
            ok = outcome is not None and outcome.startswith(_OK)
            if ok and each:  # set before the outcome: there already
                share = _get(client, f"{key}/to/{me}", max(deadline, clock() + _GRACE_S), clock)
            decided = {} if ok else _failure(outcome)
            posted = _posted(client, key) if not ok and "failed" not in decided else set()
            finished = True
            if ok and retire_later:
                with _lock:
                    retiring.append(key)
            else:
                _finish(client, key, count, me)
        except Exception as e:  # the runtime raises its own error types
            raise mark_agreed(
                ConnectionError(
                    f"[process {me}] The exchange '{what}' through the jax.distributed "
                    f"coordination service failed: {e}. Is the coordinator (process 0) still "
                    "running?"
                )
            ) from e
    finally:
        if not finished:
            _finish(client, key, count, me)
    # Decoded only now, out of the exchange: a big outcome is held no longer than needed.
    if ok and outcome is not None:
        body = outcome[len(_OK) :]
        if body.startswith(_RETIRING):  # exchanges deleted by this one's decider
            line, body = body[len(_RETIRING) :].split("\n", 1)
            gone = set(json.loads(line))
            with _lock:
                retiring[:] = [k for k in retiring if k not in gone]
        if each:
            return _unpack(body), _unpack(share) if share else None
        return _unpack(body)
    if "failed" in decided:
        raise mark_agreed(
            RuntimeError(
                f"[process {me}] The exchange '{what}' could not combine the processes' "
                f"values: {decided['failed']}"
            )
        )
    raise mark_agreed(_timeout(me, what, timeout_s, count, posted, decided.get("gave_up")))


def _decide(client: KeyValueClient, key: str, combine: Combine, each: bool = False) -> str:
    """Reads every value once, combines them and publishes the outcome (the last arrival);
    with `each`, every process's own share first (see `converge_each`)."""
    texts = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{key}/v")}
    # Exchanges every process is done with (it posted so), deleted now.
    done_with: list[set[str]] = []
    for p, t in texts.items():
        if t.startswith(_RETIRING):
            line, texts[p] = t[len(_RETIRING) :].split("\n", 1)
            done_with.append(set(json.loads(line)))
        else:
            done_with.append(set())
    retired = sorted(set.intersection(*done_with)) if done_with else []
    for old in retired:
        client.key_value_delete(old)
    prefix = f"{_RETIRING}{json.dumps(retired)}\n" if retired else ""
    try:
        combined = combine(texts)
        if each:
            for p, share in combined["each"].items():
                client.key_value_set(
                    f"{key}/to/{p}", _pack(json.dumps(share, separators=(",", ":")))
                )
            combined = combined["all"]
        outcome = _OK + prefix + _pack(json.dumps(combined, separators=(",", ":")))
    except Exception as e:  # every process raises it (see `exchange`)
        outcome = json.dumps({"failed": f"{type(e).__name__}: {e}"})
    client.key_value_set(f"{key}/all", outcome)
    return outcome


def _pack(text: str) -> str:
    if len(text) < _PACK_FROM:
        return text
    return _PACKED + base64.b64encode(zlib.compress(text.encode(), 6)).decode()


def _unpack(text: str) -> Any:
    if text.startswith(_PACKED):
        text = zlib.decompress(base64.b64decode(text[len(_PACKED) :])).decode()
    return json.loads(text)


def _failure(outcome: str | None) -> dict[str, Any]:
    """{"failed": why} or {"gave_up": process or None}, from an outcome that is not ok."""
    try:
        decided = json.loads(outcome or "null")
    except ValueError:
        decided = None
    return decided if isinstance(decided, dict) else {"gave_up": None}


def _get(
    client: KeyValueClient, key: str, deadline: float, clock: Callable[[], float]
) -> str | None:
    """The value of `key` once it is set, or None if the deadline passes first."""
    ms = max(1, int((deadline - clock()) * 1000))
    try:
        return client.blocking_key_value_get(key, ms)
    except Exception as e:
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
            return None
        raise


def _give_up(
    client: KeyValueClient, key: str, me: int, count: int, clock: Callable[[], float]
) -> str | None:
    """Stops waiting: the outcome if every process arrived just in time (the last one is
    deciding it), else tells the others who gave up."""
    total = client.key_value_increment(f"{key}/n", _GAVE_UP)
    if total == _GAVE_UP + count:
        return _get(client, f"{key}/all", clock() + _GRACE_S, clock)
    verdict = json.dumps({"gave_up": me})
    # Wakes the processes still waiting; fails if another one gave up first and told them.
    with contextlib.suppress(Exception):
        client.key_value_set(f"{key}/all", verdict)
    return verdict


def _posted(client: KeyValueClient, key: str) -> set[int]:
    return {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{key}/v")}


def _timeout(
    me: int, what: str, timeout_s: float, count: int, posted: set[int], by: int | None
) -> TimeoutError:
    missing = sorted(set(range(count)) - posted)
    who = "this process" if by == me else f"process {by}" if by is not None else "a process"
    if missing:
        shown = missing if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"
        why = (
            f"processes {shown} did not answer within {timeout_s:g} s (dead, stuck, or slower "
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
