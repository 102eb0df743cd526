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
One exchange `<prefix>/<tag>/<round>`:

    v/<p>    process p's value (text, often empty); deleted by the decider once read
    c        the claim: who decides the outcome, set once (refusing to overwrite)
             by the decider when it has every value, or by a process that gave up
    all      the outcome: "ok:" and the combined value (compressed when long),
             or {"failed": why} or {"gave_up": p, "missing": [...]}; set by
             whoever holds the claim
    to/<p>   with `converge_each`: what the decider tells process p alone (set
             before `all`), so that N different answers cost O(N) bytes, not N^2

A process makes two calls (set its value, blocking get of the outcome; one
more with `converge_each`). Every call occupies the one coordinator, so calls
a process are what an exchange costs at scale: 50 us a call is 0.2 s for one
call of each of 4,096 processes. The decider waits for the values with a few
calls of its own: it reads all values posted so far (one directory get),
waits for the lowest process still missing (one blocking get) and reads them
all again, a few rounds, until waiting for each one still missing costs less
than reading them all again.

No process counts itself out of an exchange (a call each): each posts, with
its next value in any exchange, the exchanges it is done with, and the next
decider deletes those every process is done with (one delete each). So the
store holds at most the last exchange's outcome (a few bytes; with
`converge_each`, the shares too) for a run, besides the exchanges in progress.

The claim `c` decides between "every value is there" and "someone gave up"
in one order seen by all: a process whose deadline passes claims it and
publishes who was missing; one that finds it claimed by the decider waits
for the decider's outcome, so an outcome the decider started (and the index
it may write) stands on every process.
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
from typing import Any, Final

import jax
from absl import logging as log

from jaxckpt import _internals
from jaxckpt.coord import _kv, _relay

_PREFIX: Final = "jaxckpt"
_GRACE_S: Final = 5.0  # how long a process waits for a value it knows is set or being set
DECIDER: Final = 0  # the process that reads every value and decides (see the module docstring)
_CALL_BYTES: Final = 50_000  # a call costs the coordinator about as much as this many bytes
_OK: Final = "ok:"  # prefix of a combined outcome (a failure is a JSON object)
_PACKED: Final = "z:"  # prefix of a compressed one (JSON never starts with "z")
_PACK_FROM: Final = 256  # outcomes from this many characters on are compressed
_AGREED: Final = "_jaxckpt_agreed"  # attribute of an exception that every process raises
_lock = threading.Lock()
_rounds: dict[str, int] = {}  # tag -> next round; every process calls a tag's rounds in order
_retiring: list[str] = []  # exchanges this process is done with, left to a later one to delete
_RETIRING: Final = "r:"  # prefix of a posted value that carries the retiring exchanges

_get = _kv.get  # a bounded blocking get (None once the deadline passes)

Combine = Callable[[dict[int, str]], Any]  # every process's posted text -> the JSON outcome


KeyValueClient = _kv.KeyValueClient


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
    client, me, count, clock = _session()
    key = next_key(tag)
    return exchange(client, me, count, key, text, combine, timeout_s=timeout_s, clock=clock)


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
    share: str | None = None
    retiring = _retiring_list()
    with _lock:
        done_with = list(retiring)
    posted_text = f"{_RETIRING}{json.dumps(done_with)}\n{text}" if done_with else text
    relay = bound_relay()
    try:
        if relay is not None and len(relay.members) > 1 and me != relay.leader:
            outcome, share = _as_member(
                relay, client, me, count, key, posted_text, each, timeout_s, deadline, clock
            )
        else:
            outcome, share = _as_poster(
                relay,
                client,
                me,
                count,
                key,
                posted_text,
                combine,
                each,
                timeout_s,
                deadline,
                clock,
            )
        ok = outcome.startswith(_OK)
    except Exception as e:  # the runtime raises its own error types
        raise mark_agreed(
            ConnectionError(
                f"[process {me}] The exchange '{what}' through the jax.distributed "
                f"coordination service failed: {e}. Is the coordinator (process 0) still "
                "running?"
            )
        ) from e
    finally:
        # IMPORTANT: done with the exchange (its outcome read, or never to be): the first
        # later exchange whose every process says so deletes it (no call of its own).
        with _lock:
            if key not in retiring:
                retiring.append(key)
    # Decoded only now, out of the exchange: a big outcome is held no longer than needed.
    if ok:
        return _decoded(outcome, share, each, retiring)
    decided = _failure(outcome)
    if "failed" in decided:
        raise mark_agreed(
            RuntimeError(
                f"[process {me}] The exchange '{what}' could not combine the processes' "
                f"values: {decided['failed']}"
            )
        )
    missing = [int(p) for p in decided.get("missing") or []]
    raise mark_agreed(_timeout(me, what, timeout_s, count, missing, decided.get("gave_up")))


def _as_poster(
    relay: _relay.Relay | None,
    client: KeyValueClient,
    me: int,
    count: int,
    key: str,
    posted_text: str,
    combine: Combine,
    each: bool,
    timeout_s: float,
    deadline: float,
    clock: Callable[[], float],
) -> tuple[str, str | None]:
    """The part of a process that posts to the coordinator itself (alone, or as its relay
    group's leader, its members' values with its own; the decider decides). Returns
    (outcome, this process's share)."""
    share: str | None = None
    leads = relay if relay is not None and relay.relays_for(me) else None
    posted = posted_text
    if leads is not None:
        # IMPORTANT: half the timeout, so that the decider still has the bundle in
        # time to name any member that did not post (dead, or later than that).
        texts = _relay.collect(leads, me, key, posted_text, clock() + timeout_s / 2, clock)
        posted = _relay.bundle(texts)
    client.key_value_set(f"{key}/v/{me}", posted)
    if me == DECIDER:
        leaders = relay.leaders if relay is not None else ()
        outcome = _decide(client, key, count, combine, each, deadline, clock, leaders)
    else:
        outcome = _get(client, f"{key}/all", deadline, clock) or _give_up(
            client, key, me, count, timeout_s, clock
        )
    if outcome.startswith(_OK) and each:  # set before the outcome: there already
        share = _get(client, f"{key}/to/{me}", clock() + _GRACE_S, clock)
    if leads is not None:
        shares = _relay.unbundle(me, share) if share is not None else None
        share = shares.pop(me, None) if shares is not None else None
        _relay.relay_down(leads, key, outcome, shares)
    return outcome, share


def _as_member(
    relay: _relay.Relay,
    client: KeyValueClient,
    me: int,
    count: int,
    key: str,
    posted_text: str,
    each: bool,
    timeout_s: float,
    deadline: float,
    clock: Callable[[], float],
) -> tuple[str, str | None]:
    """A relay group member's part of an exchange: through its leader (see `_relay`);
    straight through the coordinator if the leader cannot be reached. Returns
    (outcome, this process's share)."""
    try:
        outcome, share = _relay.through_leader(
            relay, me, key, posted_text, each=each, ok_prefix=_OK, deadline=deadline, clock=clock
        )
    except _relay.Unreachable as e:
        log.warning(
            "jaxckpt: [process %d] exchange %s: %s; exchanging through the coordinator instead",
            me,
            key,
            e,
        )
        with contextlib.suppress(Exception):  # already there: the same value
            client.key_value_set(f"{key}/v/{me}", posted_text)
        outcome = _get(client, f"{key}/all", deadline, clock) or _give_up(
            client, key, me, count, timeout_s, clock
        )
    else:
        if outcome is not None:
            return outcome, share
        # The leader relayed nothing in time: the coordinator's outcome, or a give-up.
        outcome = _get(client, f"{key}/all", clock(), clock) or _give_up(
            client, key, me, count, timeout_s, clock
        )
    share = None
    if outcome.startswith(_OK) and each:
        # Set before the outcome: under this process's key if its value came alone, else
        # in its leader's bundle.
        share = _get(client, f"{key}/to/{me}", clock(), clock)
        if share is None:
            bundled = _get(client, f"{key}/to/{relay.leader}", clock() + _GRACE_S, clock)
            share = _relay.unbundle(relay.leader, bundled).get(me) if bundled else None
    return outcome, share


def _decoded(outcome: str, share: str | None, each: bool, retiring: list[str]) -> Any:
    """An "ok" outcome's value (with `each`, and this process's `share`), the exchanges
    its decider deleted taken off this process's `retiring` list."""
    body = outcome[len(_OK) :]
    if body.startswith(_RETIRING):  # exchanges deleted by this one's decider
        line, body = body[len(_RETIRING) :].split("\n", 1)
        gone = set(json.loads(line))
        with _lock:
            retiring[:] = [k for k in retiring if k not in gone]
    if each:
        return _unpack(body), _unpack(share) if share else None
    return _unpack(body)


def _decide(
    client: KeyValueClient,
    key: str,
    count: int,
    combine: Combine,
    each: bool,
    deadline: float,
    clock: Callable[[], float],
    leaders: tuple[int, ...] = (),
) -> str:
    """The decider's part: waits for every value (until `deadline`), claims the outcome,
    combines the values and publishes it; with `each`, every process's own share first
    (see `converge_each`: a relay leader's bundle gets its group's shares as one bundle).
    Returns the outcome, or the one a process that gave up first published."""
    posted = _gather(client, key, count, deadline, clock, leaders)
    texts = posted.texts
    # IMPORTANT: claimed before `combine` runs (it may write the step's index): once the
    # decider holds the claim, no process can give up, so its outcome is every process's.
    if not _claim(client, key, DECIDER, clock):
        return _outcome_of_claim(client, key, clock() + _GRACE_S, clock)
    if len(texts) < count:
        missing = sorted(set(range(count)) - _posted(client, key))
        outcome = json.dumps({"gave_up": DECIDER, "missing": missing})
        client.key_value_set(f"{key}/all", outcome)
        return outcome
    retired = _retired(texts)
    for old in retired:
        _delete(client, old)
    prefix = f"{_RETIRING}{json.dumps(retired)}\n" if retired else ""
    try:
        combined = combine(texts)
        if each:
            _hand_out(client, key, combined["each"], posted)
            combined = combined["all"]
        outcome = _OK + prefix + _pack(json.dumps(combined, separators=(",", ":")))
    except Exception as e:  # every process raises it (see `exchange`)
        outcome = json.dumps({"failed": f"{type(e).__name__}: {e}"})
    client.key_value_set(f"{key}/all", outcome)
    # Every value was read, by the decider alone: gone now (the outcome stays until a later
    # exchange retires it: a few bytes, not N values).
    _delete(client, f"{key}/v")
    return outcome


def _hand_out(client: KeyValueClient, key: str, shares: dict[Any, Any], posted: _Posted) -> None:
    """Sets each process's share where it reads it: under the key its value came under,
    one bundle for a relay leader's group."""
    by_source: dict[int, dict[int, str]] = {}
    for p, share in shares.items():
        p = int(p)
        by_source.setdefault(posted.via.get(p, p), {})[p] = _pack(
            json.dumps(share, separators=(",", ":"))
        )
    for source, group in by_source.items():
        value = _relay.bundle(group) if source in posted.bundles else group[source]
        client.key_value_set(f"{key}/to/{source}", value)


def _retired(texts: dict[int, str]) -> list[str]:
    """The exchanges every process is done with (each posted so before its value), to be
    deleted now; takes those lists off `texts`. Most processes post the same list: each
    distinct one is parsed once (the decider's CPU is on every exchange's critical path)."""
    lines: set[str] = set()
    unlisted = False
    for p, t in texts.items():
        if t.startswith(_RETIRING):
            line, texts[p] = t[len(_RETIRING) :].split("\n", 1)
            lines.add(line)
        else:
            unlisted = True
    if unlisted or not lines:
        return []
    return sorted(set.intersection(*(set(json.loads(line)) for line in lines)))


def _delete(client: KeyValueClient, key: str) -> None:
    """Deletes `key` and everything under it (cleanup: a failure is only logged, and the
    exchange's outcome stands)."""
    try:
        client.key_value_delete(key)
    except Exception as e:  # the runtime raises its own error types
        log.warning("jaxckpt: could not clean up %s in the coordinator's store: %s", key, e)


@dataclasses.dataclass
class _Posted:
    """The values posted to one exchange so far, a relay leader's bundle taken apart."""

    texts: dict[int, str] = dataclasses.field(default_factory=dict)  # process -> its value
    via: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> key it came under
    keys: set[int] = dataclasses.field(default_factory=set)  # the keys read (v/<p>)
    bundles: set[int] = dataclasses.field(default_factory=set)  # those that held bundles
    nbytes: int = 0

    def add(self, source: int, value: str) -> None:
        self.keys.add(source)
        self.nbytes += len(value)
        if value.startswith(_relay.BUNDLE):
            self.bundles.add(source)
        for p, text in _relay.unbundle(source, value).items():
            if p not in self.texts:
                self.texts[p] = text
                self.via[p] = source


def _gather(
    client: KeyValueClient,
    key: str,
    count: int,
    deadline: float,
    clock: Callable[[], float],
    leaders: tuple[int, ...] = (),
) -> _Posted:
    """Every value posted under `key` once all `count` are there, or those posted by the
    deadline. Reads all values posted so far (one call, every value's bytes); while a call
    for each key still missing would cost more than reading them all again
    (`_CALL_BYTES`), waits for the lowest one missing and reads them all again (each read
    finds every value posted meanwhile: a few rounds); then waits for each missing key.
    A missing process's key is its relay leader's (`leaders`), until that leader's
    bundle came without it: then its own (a member that exchanged alone)."""
    posted = _posted_values(client, key)
    while len(posted.texts) < count:
        waits = sorted(
            {
                leaders[p] if p < len(leaders) and leaders[p] not in posted.keys else p
                for p in range(count)
                if p not in posted.texts
            }
        )
        if len(waits) * _CALL_BYTES > posted.nbytes:
            if _get(client, f"{key}/v/{waits[0]}", deadline, clock) is None:
                return posted
            posted = _posted_values(client, key)
            continue
        for w in waits:
            value = _get(client, f"{key}/v/{w}", deadline, clock)
            if value is None:
                return posted
            posted.add(w, value)
    return posted


def _posted_values(client: KeyValueClient, key: str) -> _Posted:
    posted = _Posted()
    for k, v in client.key_value_dir_get(f"{key}/v"):
        posted.add(int(k.rsplit("/", 1)[1]), v)
    return posted


def _claim(client: KeyValueClient, key: str, me: int, clock: Callable[[], float]) -> bool:
    """Whether this process decides the outcome: the first to set `c` (the decider once it
    has every value, or a process that gave up), in one order seen by all."""
    try:
        client.key_value_set(f"{key}/c", str(me))
        return True
    except Exception:
        holder = _get(client, f"{key}/c", clock() + _GRACE_S, clock)
        if holder is None:  # not a refusal to overwrite: the service failed
            raise
        return holder == str(me)


def _outcome_of_claim(
    client: KeyValueClient, key: str, deadline: float, clock: Callable[[], float]
) -> str:
    """The outcome published by whoever holds the claim (bounded by `deadline`)."""
    return _get(client, f"{key}/all", deadline, clock) or json.dumps({"gave_up": None})


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


def _give_up(
    client: KeyValueClient,
    key: str,
    me: int,
    count: int,
    timeout_s: float,
    clock: Callable[[], float],
) -> str:
    """Stops waiting: tells every process who gave up and who never posted, unless the
    decider claimed the outcome first (it has every value): then its outcome, waited for
    at most another `timeout_s` (its `combine` may write the step's index)."""
    if not _claim(client, key, me, clock):
        return _outcome_of_claim(client, key, clock() + timeout_s, clock)
    missing = sorted(set(range(count)) - _posted(client, key))
    verdict = json.dumps({"gave_up": me, "missing": missing})
    client.key_value_set(f"{key}/all", verdict)  # wakes the processes still waiting
    return verdict


def _posted(client: KeyValueClient, key: str) -> set[int]:
    return set(_posted_values(client, key).texts)


def _timeout(
    me: int, what: str, timeout_s: float, count: int, missing: list[int], by: int | None
) -> TimeoutError:
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
