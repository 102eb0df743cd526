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
one process, the *decider* (process 0, which hosts the coordinator),
reads the values once, *combines* them into one outcome (a verdict, a digest
comparison, a table) and publishes it; every process reads only that outcome.
The protocol of one exchange (its keys, calls, claim and relay groups) is
`_exchange`'s; this module binds it to the job: which store, which process,
which round of a tag, which relay group.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import jax

from jaxckpt import _internals
from jaxckpt.coord import _exchange, _kv, _relay

_PREFIX: Final = _exchange.PREFIX
DECIDER: Final = _exchange.DECIDER
_lock = threading.Lock()
_rounds: dict[str, int] = {}  # tag -> next round; every process calls a tag's rounds in order
_retiring: list[str] = []  # exchanges this process is done with, left to a later one to delete

Combine = _exchange.Combine
KeyValueClient = _kv.KeyValueClient
is_agreed = _exchange.is_agreed
mark_agreed = _exchange.mark_agreed


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
    relay: _relay.Relay | None = None  # its relay group, once the peers have met


_relay_bound: _relay.Relay | None = None  # this process's relay group (`use_relay`)
_direct: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxckpt_direct", default=False)
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


def use_relay(relay: _relay.Relay | None, *, replacing: _relay.Relay | None = None) -> None:
    """Routes this process's later exchanges through `relay` (None: straight to the
    coordinator). Every process of the job binds its group at the same point (the end
    of the peers' set-up), so that a leader never waits for a member that posts
    elsewhere. With `replacing`, changes nothing unless that relay is the one bound."""
    global _relay_bound
    member = _member.get()
    if member is not None:
        if replacing is None or member.relay is replacing:
            member.relay = relay
        return
    with _lock:
        if replacing is None or _relay_bound is replacing:
            _relay_bound = relay


def bound_relay() -> _relay.Relay | None:
    """This process's relay group, if its exchanges go through one."""
    if _direct.get():
        return None
    member = _member.get()
    return member.relay if member is not None else _relay_bound


@contextlib.contextmanager
def direct() -> Iterator[None]:
    """Exchanges below go straight to the coordinator, whatever relay is bound (the
    peers' set-up, which forms the groups: a relay left bound by an earlier run is not
    this run's)."""
    token = _direct.set(True)
    try:
        yield
    finally:
        _direct.reset(token)


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
    return _kv.get(client, key, deadline, clock)


def converge(text: str, combine: Combine, *, tag: str, timeout_s: float) -> Any:
    """Every process posts `text`; one of them combines all texts; all get the result.

    `combine(texts)` gets every process's text by process index and returns a
    JSON-serializable outcome. It runs on one process only (the decider),
    so it must depend on nothing but its argument and what every process
    shares; if it raises, every process raises a RuntimeError saying so.

    All processes must call this in the same order for the same `tag`; calls
    with different tags may interleave differently on each process.

    Two calls a process (see the module docstring); the exchange's keys are
    deleted by a later exchange's decider, once every process is done with it.

    Raises:
      TimeoutError: on every process that takes part, if some process did not
        contribute within `timeout_s` (one deadline for all of them), naming
        the processes that were missing.
      ConnectionError: if the coordination service itself failed.
    """
    if process_count() == 1:
        return json.loads(json.dumps(combine({0: text})))  # the same types as through the store
    return _exchange_here(text, combine, tag, timeout_s, each=False)


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
    return _exchange_here(text, combine, tag, timeout_s, each=True)


def _exchange_here(text: str, combine: Combine, tag: str, timeout_s: float, each: bool) -> Any:
    """The next round of `tag`, exchanged as this process of its job (its store, its
    relay group, its list of exchanges it is done with)."""
    client, me, count, clock = _session()
    return _exchange.exchange(
        client,
        me,
        count,
        next_key(tag),
        text,
        combine,
        timeout_s=timeout_s,
        clock=clock,
        each=each,
        relay=bound_relay(),
        retiring=_retiring_list(),
    )


def allgather(value: Any, *, tag: str, timeout_s: float) -> list[Any]:
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

    def table(texts: dict[int, str]) -> list[Any]:
        parsed: dict[str, Any] = {}  # many processes post the same text: parsed once
        return [
            parsed[t] if t in parsed else parsed.setdefault(t, json.loads(t))
            for t in (texts[p] for p in range(count))
        ]

    return converge(text, table, tag=tag, timeout_s=timeout_s)


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
