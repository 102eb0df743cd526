"""Relay groups: an exchange's values gathered per rack, off the coordinator.

Through one coordinator every call of every process queues (about 50 us a
call): an exchange costs two calls a process, so 16,384 processes spend
1.6 s in the queue per exchange whatever else is done. Once the peers have met,
the processes of one rack form a *group* (at most `MAX_MEMBERS`, in process
order) whose lowest process, the *leader*, relays for the others: each member
posts its value to the leader's own store (`_kv.RelayStore`, reached over
the peer data service) and reads the outcome there; the leader posts the
group's values to the coordinator as one *bundle* and reads the outcome once
for all. The coordinator then sees two calls a group, not two a process.

A process's rack is its failure domain without its last level
(`"zone-a/rack-3"` of `"zone-a/rack-3/host-17"`), or the whole domain when
it has one level: the processes of one host then form a group. A job of one
process a domain has groups of one and exchanges as before.

Failures keep the exchange's promise (every process gets the same outcome,
or all raise): a member whose leader cannot be reached posts its value to the
coordinator itself and reads the outcome there; a leader posts its bundle
when every member has posted or half the timeout has passed, so a member
that is later than that is named missing, as a dead one is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Callable, Sequence
from typing import Final

from jaxckpt.coord import _kv

MAX_MEMBERS: Final = 32  # a group's processes, its leader included (`group_size`)
# The coordinator's time a call over a leader's (~50 us against ~1 ms an HTTP request):
# groups of sqrt(N / 20) balance the coordinator's 2N/G calls against a leader's 2G.
_CALLS_PER_LEADER_CALL: Final = 20
BUNDLE: Final = "b:"  # prefix of a leader's posted value: its group's values


@dataclasses.dataclass(frozen=True)
class Relay:
    """This process's place in its relay group.

    Attributes:
      leader: the group's leader (its lowest process); a process whose leader is
        another posts through it (`posts_through_leader`).
      members: the processes the leader relays for, itself included, in process
        order (on a member, what it needs: itself and its leader).
      store: the leader's store: its own `RelayStore` on the leader, a client of
        it over the peer data service on a member.
      leaders: on the decider, every process's leader (it waits for a missing
        process's bundle under its leader's key); empty elsewhere.
    """

    leader: int
    members: tuple[int, ...]
    store: _kv.KeyValueClient
    leaders: tuple[int, ...] = ()
    # The leader's exchanges, oldest first: their outcomes stay in its store for `KEPT`.
    relayed: list[str] = dataclasses.field(default_factory=list, compare=False, repr=False)
    lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, compare=False, repr=False
    )

    def relays_for(self, me: int) -> bool:
        """Whether `me` leads a group with other processes in it."""
        return me == self.leader and len(self.members) > 1

    def posts_through_leader(self, me: int) -> bool:
        """Whether `me` is a member that posts to its leader's store."""
        return me != self.leader


def rack(domain: str) -> str:
    """The rack of failure domain `domain`: all but its last level, or itself."""
    head, sep, _ = domain.rpartition("/")
    return head if sep and head else domain


def group_size(count: int, wanted: int | None = None) -> int:
    """The most processes a relay group of a job of `count` has: `wanted`, else about
    sqrt(count / 20), at most `MAX_MEMBERS` (1: no relay, below 80 processes)."""
    if wanted is not None:
        return wanted
    return max(1, min(MAX_MEMBERS, math.isqrt(count // _CALLS_PER_LEADER_CALL)))


def leaders(domains: Sequence[str], max_members: int = MAX_MEMBERS) -> list[int]:
    """Every process's leader: its rack's processes in process order, cut into the
    fewest groups of at most `max_members`, as even as they come (a rack of 32 in
    groups of at most 28: two of 16), each led by its lowest process (pure)."""
    if max_members < 1:
        raise ValueError(f"max_members must be >= 1, got {max_members}.")
    by_rack: dict[str, list[int]] = {}
    for p, domain in enumerate(domains):
        by_rack.setdefault(rack(domain), []).append(p)
    out = list(range(len(domains)))
    for processes in by_rack.values():
        count = -(-len(processes) // max_members)  # groups in this rack
        for g in range(count):
            group = processes[g * len(processes) // count : (g + 1) * len(processes) // count]
            for p in group:
                out[p] = group[0]
    return out


def members(leader_of: Sequence[int], leader: int) -> tuple[int, ...]:
    """The processes `leader` leads (itself included), in process order."""
    return tuple(p for p, q in enumerate(leader_of) if q == leader)


def bundle(texts: dict[int, str]) -> str:
    """A leader's posted value: its group's posted values by process."""
    return BUNDLE + json.dumps({str(p): t for p, t in sorted(texts.items())}, separators=(",", ":"))


def unbundle(key_process: int, value: str) -> dict[int, str]:
    """The posted values in `value`, posted under process `key_process`'s key: a
    bundle's, or that process's own."""
    if not value.startswith(BUNDLE):
        return {key_process: value}
    return {int(p): t for p, t in json.loads(value[len(BUNDLE) :]).items()}


class Unreachable(ConnectionError):
    """The group's leader could not be reached: the member exchanges by itself."""


KEPT: Final = 64  # exchanges whose outcome a leader's store keeps for its members


def through_leader(
    relay: Relay,
    me: int,
    key: str,
    text: str,
    *,
    each: bool,
    ok_prefix: str,
    grace_s: float,
    deadline: float,
    clock: Callable[[], float],
) -> tuple[str | None, str | None]:
    """A member's part: posts `text` to its leader's store and waits there for the
    outcome until `deadline` (and, with `each` and an outcome that starts with
    `ok_prefix`, for its share, at most `grace_s` more). Returns (outcome, share),
    (None, None) if the leader relayed nothing in time.

    Raises:
      Unreachable: if the leader's store failed (dead, closed, reset).
    """
    try:
        relay.store.key_value_set(f"{key}/v/{me}", text)
        outcome = _kv.get(relay.store, f"{key}/all", deadline, clock)
        share = None
        if outcome is not None and outcome.startswith(ok_prefix) and each:
            # Set before the outcome: there already, unless this process's value came late.
            share = _kv.get(relay.store, f"{key}/to/{me}", clock() + grace_s, clock)
    except Exception as e:  # the peer client and the store raise their own types
        raise Unreachable(f"process {relay.leader}, the relay of this process's group: {e}") from e
    return outcome, share


def collect(
    relay: Relay, me: int, key: str, text: str, deadline: float, clock: Callable[[], float]
) -> dict[int, str]:
    """A leader's part before it posts: its members' values in its store, waited for in
    process order until every member posted or `deadline` passes (then those there)."""
    store = relay.store
    texts = {me: text}
    for p in relay.members:
        if p == me:
            continue
        value = _kv.get(store, f"{key}/v/{p}", deadline, clock)
        if value is None:  # late or dead: those posted meanwhile still count
            prefix = f"{key}/v/"
            texts.update({int(k[len(prefix) :]): v for k, v in store.key_value_dir_get(f"{key}/v")})
            break
        texts[p] = value
    store.key_value_delete(f"{key}/v")
    return texts


def relay_down(relay: Relay, key: str, outcome: str, shares: dict[int, str] | None) -> None:
    """A leader's part after the outcome: hands its members their shares, then the
    outcome, in its store; forgets the oldest exchanges beyond the `KEPT` last ones
    (a member reads an outcome as soon as it is set, and takes part in no later
    exchange of the group before it has)."""
    store = relay.store
    for p, share in (shares or {}).items():
        store.key_value_set(f"{key}/to/{p}", share, allow_overwrite=True)
    store.key_value_set(f"{key}/all", outcome, allow_overwrite=True)
    with relay.lock:
        relay.relayed.append(key)
        forgotten = relay.relayed[:-KEPT]
        del relay.relayed[:-KEPT]
    for old in forgotten:
        store.key_value_delete(old)
