"""One exchange through a key-value store: the protocol, free of any job state.

`_multihost` binds it to a job (its store, process, round and relay group).
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

A relay group's members post to their leader's store instead, and the
leader posts their values as one bundle under its own key (`_relay`); the
decider waits for a missing process under its leader's key and sets one share
bundle a group.

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
import dataclasses
import json
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, Final

from absl import logging as log

from jaxckpt.coord import _kv, _relay

PREFIX: Final = "jaxckpt"  # every exchange's keys are under it
_GRACE_S: Final = 5.0  # how long a process waits for a value it knows is set or being set
DECIDER: Final = 0  # the process that reads every value and decides (see the module docstring)
_CALL_BYTES: Final = 50_000  # a call costs the coordinator about as much as this many bytes
_OK: Final = "ok:"  # prefix of a combined outcome (a failure is a JSON object)
_PACKED: Final = "z:"  # prefix of a compressed one (JSON never starts with "z")
_PACK_FROM: Final = 256  # outcomes from this many characters on are compressed
_AGREED: Final = "_jaxckpt_agreed"  # attribute of an exception that every process raises
_RETIRING: Final = "r:"  # prefix of a posted value that carries the retiring exchanges
_lock = threading.Lock()  # guards every process's list of retiring exchanges

KeyValueClient = _kv.KeyValueClient
Combine = Callable[[dict[int, str]], Any]  # every process's posted text -> the JSON outcome
_get = _kv.get  # a bounded blocking get (None once the deadline passes)


def is_agreed(error: BaseException) -> bool:
    """Whether every process that took part raises `error` too (no further agreement needed)."""
    return bool(getattr(error, _AGREED, False))


def mark_agreed(error: BaseException) -> BaseException:
    """Marks `error` as one every process that took part raises as well."""
    setattr(error, _AGREED, True)
    return error


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
    relay: _relay.Relay | None = None,
    retiring: list[str],
) -> Any:
    """One round of `converge` (`converge_each` with `each`) through `client` under `key`
    (see the module docstring), through `relay` if this process is in a relay group;
    `retiring` is this process's list of exchanges it is done with.

    Raises:
      TimeoutError: if some process did not contribute before the deadline.
      ConnectionError: if the coordination service failed.
      RuntimeError: if `combine` failed on the process that ran it.
    """
    deadline = clock() + timeout_s
    what = key.removeprefix(f"{PREFIX}/")
    share: str | None = None
    with _lock:
        done_with = list(retiring)
    posted_text = f"{_RETIRING}{json.dumps(done_with)}\n{text}" if done_with else text
    try:
        if relay is not None and relay.posts_through_leader(me):
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
            relay,
            me,
            key,
            posted_text,
            each=each,
            ok_prefix=_OK,
            grace_s=_GRACE_S,
            deadline=deadline,
            clock=clock,
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
