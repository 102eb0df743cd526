"""The other processes: their addresses, who holds whose replicas, and what they hold.

The run's peers meet once per run, in one exchange of the choreographies
(`_choreography.meeting`; this module takes part in no exchange itself). Before
it, every process starts its peer data service on `TierOptions.peer_host`
(without the run's token yet: a request waits for it) and publishes its address
in the coordinator's store (`Hello`); in it, each posts its address and failure
domain, process 0 the run's secret token too, which every process gets back and
serves under from then on. No process reads every address: the process that
decides the exchange computes the replica placement (`placement_shares`:
`_placement.place_replicas`, a pure function of the failure domains) once and
tells each process only its holders and their addresses, and its relay group,
so the set-up moves O(N) bytes through the coordinator, a few hundred a process.
Any other address (a holder of another owner's part, read on a restore onto
another mesh) is looked up when first needed (`Addresses`). After it, `Peers`
reads and pushes the copies other processes hold.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from absl import logging as log

from jaxckpt import _faults, _options
from jaxckpt.coord import _holdings, _kv, _multihost, _placement, _published, _relay
from jaxckpt.format import _format
from jaxckpt.peer import _client, _relay_client, _server, _wire
from jaxckpt.tiers import _memory_tier, _slab

Inventory = _holdings.Inventory  # step -> owners whose verified part a process holds


class Service(Protocol):
    """What `Peers` needs of this process's peer data service (a `PeerServer`)."""

    @property
    def address(self) -> _wire.PeerAddress: ...
    @property
    def relay_store(self) -> _kv.RelayStore: ...
    def set_token(self, token: str) -> None: ...
    def close(self) -> None: ...


class Addresses:
    """Process -> its peer address: those told at set-up, any other looked up in the
    coordinator's store once, when first needed (every process published its own)."""

    def __init__(self, run_id: str, known: Mapping[int, _wire.PeerAddress], timeout_s: float):
        self._run_id = run_id
        self._known = dict(known)
        self._timeout_s = timeout_s

        self._domains: dict[int, str] = {}

    def __getitem__(self, process: int) -> _wire.PeerAddress:
        if process not in self._known:
            self._look_up(process)
        return self._known[process]

    def domain(self, process: int) -> str:
        """`process`'s failure domain (published beside its address), looked up once."""
        if process not in self._domains:
            self._look_up(process)
        return self._domains[process]

    def _look_up(self, process: int) -> None:
        raw = json.loads(_published.look_up(address_name(self._run_id, process), self._timeout_s))
        self._domains[process] = str(raw.pop("domain", ""))
        self._known[process] = _wire.PeerAddress.from_dict(raw)


def address_name(run_id: str, process: int) -> str:
    """Where `process` publishes its peer address for the run (`_multihost.publish`)."""
    return f"{run_id}/address/{process}"


class Peers:
    """This process's connection to every other process's memory tier."""

    def __init__(
        self,
        server: Service,
        token: str,
        run_id: str,
        addresses: Addresses,
        holders: tuple[int, ...] | ValueError,
        replicas: int,
        timeout_s: float,
        domain: str = "",
        relay: _relay.Relay | None = None,
    ):
        """Args: `holders` are the processes that keep copies of this process's parts,
        or why `replicas` cannot be placed (raised by `holders` when a save needs them);
        `relay` is this process's relay group (None: it calls the coordinator itself)."""
        self._server = server
        self._token = token
        self.run_id = run_id
        self.addresses = addresses
        self.replicas = replicas
        self._holders = holders
        self._domain = domain  # this process's failure domain
        self._partnered: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.skipped: list[tuple[int, int]] = []  # (step, holder) of pushes that failed
        # A peer that stalls for half the timeout is given up (its copy skipped, or the
        # next source read): the operation's next exchange, which the others wait in for
        # the whole timeout, is still reached in time (`_choreography`).
        self._peer_timeout_s = timeout_s / 2
        self.relay = relay

    @property
    def token(self) -> str:
        """The run's secret: every request to a peer service carries it; never logged."""
        return self._token

    @property
    def holders(self) -> tuple[int, ...]:
        """The processes that keep copies of this process's parts.

        Raises:
          ValueError: if `replicas` cannot be placed outside each owner's failure
            domain (only saving needs placement; restoring never does).
        """
        if isinstance(self._holders, ValueError):
            raise ValueError(str(self._holders))
        return self._holders

    def holders_with(self, partners: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """`holders`, with this process's partners (the processes holding the same shards
        in other data-parallel replicas: `_replicas.partners`, alike on every process)
        taken first, each copy in a failure domain of its own outside this process's;
        the set-up's holders fill the rest (`_placement.partner_holders`). The last
        answer is kept (a loop saves one tree)."""
        me = _multihost.process_index()
        mine = tuple(partners[me]) if me < len(partners) else ()
        if not mine:
            return self.holders
        if self._partnered is None or self._partnered[0] != mine:

            def domain_of(p: int) -> str:
                return self._domain if p == me else self.addresses.domain(p)

            chosen = _placement.partner_holders(
                me, mine, domain_of, self.holders, self.replicas, len(partners)
            )
            self._partnered = (mine, chosen)
        return self._partnered[1]

    def close(self) -> None:
        _multihost.use_relay(None, replacing=self.relay)
        self._server.close()
        _published.unpublish(address_name(self.run_id, _multihost.process_index()))

    def redact(self, text: str) -> str:
        """`text` without the run's token (kept out of every error and log)."""
        return _client.redact_token(text, self._token)

    def slab_range_reader(self, holder: int, step: int, owner: int) -> Callable[..., None]:
        """(offset, into, timeout_s, progress=None): receives len(into) bytes of
        `owner`'s slab of `step` from `offset` into `into`, as `holder`'s memory tier
        holds it (a range request to its peer service; `fetch_range`'s `progress`)."""
        step_dir = _memory_tier.MemoryTier.step_name(step)
        relpath = f"{step_dir}/{_format.part_dir_name(owner)}/{_slab.SLAB_FILE}"
        address = self.addresses[holder]

        def read(
            offset: int,
            into: memoryview,
            timeout_s: float,
            progress: Callable[[int], None] | None = None,
        ) -> None:
            _client.fetch_range(
                address,
                token=self._token,
                run_id=self.run_id,
                relpath=relpath,
                offset=offset,
                into=into,
                timeout=min(timeout_s, self._peer_timeout_s),
                progress=progress,
            )

        return read

    def report_damaged(self, holder: int, step: int, owner: int, why: str) -> None:
        """Tells `holder` that the bytes read from its copy of `owner`'s part of `step`
        failed their checksum (`why`): it checks its copy and quarantines it if it is
        damaged (bytes damaged on the way are not its copy's fault), so that no
        inventory offers it again. Bounded by half the timeout; a holder that does
        not answer is logged, not raised (its copy is not read again by this restore).
        """
        relpath = f"{_memory_tier.MemoryTier.step_name(step)}/{_format.part_dir_name(owner)}"
        me = _multihost.process_index()
        try:
            damage = _client.check_part(
                self.addresses[holder],
                token=self._token,
                run_id=self.run_id,
                relpath=relpath,
                timeout=self._peer_timeout_s,
            )
        except OSError as e:
            log.warning(
                "jaxckpt: [process %d] the copy of part %d of step %d held by process %d "
                "failed its checksum (%s), and that process could not check it: %s",
                me,
                owner,
                step,
                holder,
                why,
                self.redact(str(e)),
            )
            return
        log.warning(
            "jaxckpt: [process %d] the copy of part %d of step %d held by process %d "
            "failed its checksum (%s); %s",
            me,
            owner,
            step,
            holder,
            why,
            f"that process found it damaged ({damage}): it is quarantined"
            if damage is not None
            else "that process found its copy whole (damaged on the way): it stays",
        )

    async def push_replicas(
        self, part_dir: Path, step: int, owner: int, holders: Sequence[int] | None = None
    ) -> int:
        """Copies a committed part to every holder of this process's replicas at once
        (`holders`, else `self.holders`); bytes sent.

        This process only sends (`push_part`: sendfile, no checksum); each holder
        verifies every chunk against the part's manifest before keeping it. A
        holder that cannot be reached or does not answer within half the timeout (a
        partition, a dead or stalled host) is skipped, with a warning: the save goes
        on with the copies that arrived (the owner's own stays in its memory tier),
        and a restore plans from the copies the processes actually hold. `skipped`
        lists (step, holder). A holder that answers with a refusal (its memory tier
        full, a bad request) fails the save, naming it: that does not pass by itself.
        """
        dest = f"{_memory_tier.MemoryTier.step_name(step)}/{_format.part_dir_name(owner)}"

        def push(holder: int) -> int:
            _faults.at("replicate", step, owner)
            try:
                return _client.push_part(
                    self.addresses[holder],
                    token=self._token,
                    run_id=self.run_id,
                    part_dir=part_dir,
                    dest_relpath=dest,
                    timeout=self._peer_timeout_s,
                )
            except (TimeoutError, ConnectionError) as e:
                log.warning(
                    "jaxckpt: [process %d] pushing the replica of step %d to process %d (%s) "
                    "got no answer, so that copy is skipped: %s",
                    owner,
                    step,
                    holder,
                    self.addresses[holder],
                    self.redact(str(e)),
                )
                self.skipped.append((step, holder))
                return 0
            except OSError as e:
                raise OSError(
                    f"[process {owner}] Pushing the replica of step {step} to process {holder} "
                    f"({self.addresses[holder]}) was refused: {self.redact(str(e))}"
                ) from e

        targets = self.holders if holders is None else holders
        sent = await asyncio.gather(*(asyncio.to_thread(push, h) for h in targets))
        return sum(sent)


class Hello:
    """This process's side of the run's meeting of the peers, around its one exchange.

    The exchange itself (`_agreement.agree_each`) is the choreography's
    (`_choreography.meeting`); here are this process's own steps: before it, its
    peer service started without the run's token (a request waits for it) and its
    address published (`start`, `publish`), or no service and why (`declined`), the
    error taken to the exchange so that every process raises it; after it, the
    `Peers` made of what the exchange told this process (`met`), or the service
    closed and its address taken back where the exchange failed (`abandon`).
    """

    def __init__(
        self,
        run_id: str,
        options: _options.TierOptions,
        server: Service | None,
        error: BaseException | None,
    ):
        self.run_id = run_id
        self.options = options
        self.error = error  # why this process cannot serve (None: it serves)
        self._server = server
        self._me = _multihost.process_index()
        self._payload: dict[str, Any] | None = None

    @classmethod
    def start(
        cls, run_id: str, serve: Callable[[], Service], options: _options.TierOptions
    ) -> Hello:
        """Starts this process's peer service (`serve()`); an error is kept (`error`)."""
        try:
            return cls(run_id, options, serve(), None)
        except Exception as e:  # taken to the exchange: every process raises it
            return cls(run_id, options, None, e)

    @classmethod
    def serving(cls, memory: _memory_tier.MemoryTier, options: _options.TierOptions) -> Hello:
        """`start` with a `PeerServer` over the run's memory tier."""

        def serve() -> _server.PeerServer:
            server = _server.PeerServer(
                memory.run_dir.parent,
                run_id=memory.run_id,
                token=None,  # the run's, told by the meeting (requests wait for it)
                host=options.peer_host,
                io_timeout=options.timeout_s,
                reuse_free_slabs=options.spare_slabs,
                memory_budget=options.memory_budget,
            )
            try:
                server.start()
            except BaseException:
                server.close()
                raise
            return server

        return cls.start(memory.run_id, serve, options)

    @classmethod
    def declined(cls, run_id: str, options: _options.TierOptions, error: BaseException) -> Hello:
        """Takes part without a peer service (this process's memory tier failed: `error`),
        so that the others learn of it at once instead of waiting for it."""
        return cls(run_id, options, None, error)

    def publish(self) -> None:
        """Publishes this process's address and failure domain in the coordinator's store,
        for any process to look up when it needs them (`Addresses`); an error is kept."""
        if self._server is None:
            return
        published = {
            **self._server.address.to_dict(),
            "domain": self.options.resolved_failure_domain,
        }
        try:
            _published.publish(address_name(self.run_id, self._me), json.dumps(published))
        except Exception as e:  # taken to the exchange: every process raises it
            self.abandon()
            self.error = e

    @property
    def tag(self) -> str:
        """The name the meeting's exchange meets under."""
        return f"peers/{self.run_id}/hello"

    @property
    def what(self) -> str:
        """What fails, in the messages of a failed meeting."""
        return f"Starting the peer data service of run {self.run_id}"

    def payload(self) -> dict[str, Any] | None:
        """What this process posts: its address and failure domain; process 0 the run's
        secret token too (made once). None where it cannot serve."""
        if self._server is None or self.error is not None:
            return None
        if self._payload is None:
            self._payload = {
                "address": self._server.address.to_dict(),
                "domain": self.options.resolved_failure_domain,
            }
            if self._me == 0:
                self._payload["token"] = secrets.token_hex(32)
        return self._payload

    def share(self, everyone: list[Any]) -> dict[str, Any]:
        """What the exchange's decider tells every process and each (`placement_shares`)."""
        return placement_shares(everyone, self.options.replicas, self.options.relay_group)

    def met(self, common: dict[str, Any], told: dict[str, Any]) -> Peers:
        """This process's `Peers`, from what the exchange told every process (`common`: the
        run's token) and this one alone (`told`: its holders and their addresses, or why
        none can be placed; its relay group), which its service serves under from now."""
        server, options = self._server, self.options
        assert server is not None and self.error is None  # no process failed, this one included
        token = str(common["token"])
        server.set_token(token)
        known = {self._me: server.address}
        holders: tuple[int, ...] | ValueError
        if "placement_error" in told:
            holders = ValueError(told["placement_error"])
        else:
            holders = tuple(int(h) for h, _ in told["holders"])
            known.update({int(h): _wire.PeerAddress.from_dict(a) for h, a in told["holders"]})
        relay = _relay_of(told.get("relay"), server, token, self.run_id, options.timeout_s / 2)
        return Peers(
            server,
            token,
            self.run_id,
            Addresses(self.run_id, known, options.timeout_s),
            holders,
            options.replicas,
            options.timeout_s,
            options.resolved_failure_domain,
            relay,
        )

    def abandon(self) -> None:
        """Closes this process's service and takes its address back (the meeting failed)."""
        if self._server is not None:
            self._server.close()
            _published.unpublish(address_name(self.run_id, self._me))
            self._server = None


def _relay_of(
    told: dict[str, Any] | None, server: Service, token: str, run_id: str, timeout_s: float
) -> _relay.Relay | None:
    """This process's relay group, as the meeting's decider told it (None: alone)."""
    if not told:
        return None
    me = _multihost.process_index()
    leader = int(told.get("leader", me))  # the decider alone in its group: no leader
    store: _kv.KeyValueClient
    if leader == me:
        store = server.relay_store
    else:
        address = _wire.PeerAddress.from_dict(told["address"])
        store = _relay_client.RelayClient(address, token=token, run_id=run_id, timeout=timeout_s)
    return _relay.Relay(
        leader,
        tuple(sorted({int(p) for p in told.get("members", (leader, me))})),
        store,
        tuple(int(p) for p in told.get("leaders", ())),
    )


def placement_shares(
    everyone: list[Any], replicas: int, relay_group: int | None = None
) -> dict[str, Any]:
    """What the set-up's decider tells every process (the run's token, from process 0)
    and each process alone: its holders, with their addresses (`replicas` placed once
    over every process's failure domain), or why they cannot be placed; and its relay
    group (`relay_shares`: groups of at most `relay_group`, else `_relay.group_size`)."""
    common = {"token": everyone[0]["token"]}
    domains = [str(p["domain"]) for p in everyone]
    try:
        placed = _placement.place_replicas(domains, replicas)
    except ValueError as e:
        return {
            "all": common,
            "each": {p: {"placement_error": str(e)} for p in range(len(everyone))},
        }
    each: dict[int, dict[str, Any]] = {
        p: {"holders": [[h, everyone[h]["address"]] for h in holders]}
        for p, holders in enumerate(placed)
    }
    size = _relay.group_size(len(everyone), relay_group)
    for p, relay in relay_shares(domains, [e["address"] for e in everyone], size).items():
        each[p]["relay"] = relay
    return {"all": common, "each": each}


def relay_shares(domains: list[str], addresses: list[Any], size: int) -> dict[int, dict[str, Any]]:
    """What each process of a relay group of more than one is told of it (`_relay`, at
    most `size` a group): its leader and the leader's address; a leader its members; the
    decider every process's leader."""
    leader_of = _relay.leaders(domains, size)
    groups: dict[int, list[int]] = {}
    for p, leader in enumerate(leader_of):
        groups.setdefault(leader, []).append(p)
    told: dict[int, dict[str, Any]] = {}
    for leader, group in groups.items():
        if len(group) < 2:
            continue
        for p in group:
            told[p] = {"leader": leader, "address": addresses[leader]}
        told[leader]["members"] = group
    if told:
        told.setdefault(_multihost.DECIDER, {})["leaders"] = leader_of
    return told
