"""The other processes: their addresses, who holds whose replicas, and what they hold.

`Peers.connect` is collective (every process calls it once per run): process 0
makes the run's secret token, every process starts its peer data service on
`TierOptions.peer_host`, and addresses and failure domains are exchanged
through jax.distributed. Replica placement is then a pure function of the
failure domains, so every process agrees on it without another message.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from absl import logging as log

from jaxckpt import (
    _agreement,
    _faults,
    _format,
    _memory_tier,
    _multihost,
    _options,
    _placement,
    _slab,
)
from jaxckpt.peer import _client, _server, _wire

Inventory = dict[int, set[int]]  # step -> owners whose verified part a process holds


class Service(Protocol):
    """What `Peers` needs of this process's peer data service (a `PeerServer`)."""

    @property
    def address(self) -> _wire.PeerAddress: ...
    def close(self) -> None: ...


class Peers:
    """This process's connection to every other process's memory tier."""

    def __init__(
        self,
        server: Service,
        token: str,
        run_id: str,
        addresses: list[_wire.PeerAddress],
        domains: list[str],
        replicas: int,
        timeout_s: float,
    ):
        self._server = server
        self._token = token
        self.run_id = run_id
        self.addresses = addresses
        self.domains = domains
        self.replicas = replicas
        self._holders: tuple[tuple[int, ...], ...] | None = None
        self._partnered: tuple[Any, tuple[tuple[int, ...], ...]] | None = None
        self.skipped: list[tuple[int, int]] = []  # (step, holder) of pushes that failed
        self._timeout_s = timeout_s
        # IMPORTANT: a peer that stalls for half the timeout is given up (its copy skipped,
        # or the next source read), so that a process that met one still reaches the
        # agreement after its push or restore in time: the others wait there for at most
        # the whole timeout from their own arrival.
        self._peer_timeout_s = timeout_s / 2

    @classmethod
    def connect(cls, memory: _memory_tier.MemoryTier, options: _options.TierOptions) -> Peers:
        """Starts this process's peer service and meets the others (collective).

        Raises:
          ValueError: if `options.replicas` cannot be placed in other failure domains.
          TimeoutError: if another process does not show up within the timeout.
          Any error another process met starting its peer service (the same
            built-in type, naming it), on every process.
        """

        def serve(token: str) -> _server.PeerServer:
            server = _server.PeerServer(
                memory.run_dir.parent,
                run_id=memory.run_id,
                token=token,
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

        return cls.meet(memory.run_id, serve, options)

    @classmethod
    def decline(cls, run_id: str, options: _options.TierOptions, error: BaseException) -> None:
        """Takes part in meeting the others without a memory tier to serve (collective).

        A process whose memory tier failed calls this where the others call
        `connect`, so that they all learn of `error` at once instead of waiting
        for it, and every process's exchanges stay in step.

        Raises:
          `error` (marked as agreed), always.
        """
        cls.meet(run_id, None, options, error)
        raise _agreement.mark_agreed(error)  # meet raised it already; for the type checker

    @classmethod
    def meet(
        cls,
        run_id: str,
        serve: Callable[[str], Service] | None,
        options: _options.TierOptions,
        error: BaseException | None = None,
    ) -> Peers:
        """The exchanges of `connect` (collective): the token, then every process's address
        and failure domain. `serve(token)` starts this process's service; None (or
        `error`) takes part without one, and every process raises the error."""
        tag = f"peers/{run_id}"
        token = _multihost.broadcast(
            secrets.token_hex(32) if _multihost.process_index() == 0 else None,
            tag=f"{tag}/token",
            timeout_s=options.timeout_s,
        )
        server = None
        if error is None and serve is not None:
            try:
                server = serve(token)
            except Exception as e:  # agreed on below, so every process raises it
                server, error = None, e
        me = (
            {"address": server.address.to_dict(), "domain": options.resolved_failure_domain}
            if server is not None
            else None
        )
        try:
            # IMPORTANT: a process that cannot serve still takes part, with its error, so
            # the others raise it at once instead of timing out.
            everyone = _agreement.agree(
                error,
                tag=f"{tag}/hello",
                what=f"Starting the peer data service of run {run_id}",
                timeout_s=options.timeout_s,
                payload=me,
            )
        except BaseException:
            if server is not None:
                server.close()
            raise
        assert server is not None  # no process failed, this one included
        addresses = [_wire.PeerAddress.from_dict(p["address"]) for p in everyone]
        domains = [str(p["domain"]) for p in everyone]
        return cls(server, token, run_id, addresses, domains, options.replicas, options.timeout_s)

    @property
    def holders(self) -> tuple[tuple[int, ...], ...]:
        """holders[owner]: the processes that keep copies of `owner`'s parts.

        Raises:
          ValueError: if `replicas` cannot be placed outside each owner's failure
            domain (only saving needs placement; restoring never does).
        """
        if self._holders is None:
            self._holders = _placement.place_replicas(self.domains, self.replicas)
        return self._holders

    def holders_with(self, partners: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """`holders`, each owner's partners (the processes holding the same shards in
        other data-parallel replicas: `_replicas.partners`) taken first where the
        failure domains allow; the last answer is kept (a loop saves one tree)."""
        if not any(partners):
            return self.holders
        if self._partnered is None or self._partnered[0] != partners:
            placed = _placement.place_replicas(self.domains, self.replicas, partners)
            self._partnered = (partners, placed)
        return self._partnered[1]

    def close(self) -> None:
        self._server.close()

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
        """Copies a committed part to every holder of `owner`'s replicas at once (`holders`,
        else `self.holders[owner]`); bytes sent.

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
            _faults.maybe_crash("replicate", step, owner)
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

        targets = self.holders[owner] if holders is None else holders
        sent = await asyncio.gather(*(asyncio.to_thread(push, h) for h in targets))
        return sum(sent)

    def exchange_inventories(self, local: Inventory) -> dict[int, Inventory]:
        """process -> its inventory, for every process (collective).

        Every process reads every inventory, so the table goes through the
        coordinator compressed: owners are sent as offsets from their holder,
        which makes the usual layout (each process holds its own part and its
        ring neighbours') the same few bytes on every process.
        """
        me = _multihost.process_index()
        wire = {str(step): sorted(o - me for o in owners) for step, owners in local.items()}
        # IMPORTANT: every process follows this exchange with another (the restore's or
        # the listing's verdict), whose decider deletes it: one call fewer before planning.
        everyone = _multihost.allgather(
            wire, tag=f"inventory/{self.run_id}", timeout_s=self._timeout_s, retire_later=True
        )
        return {
            p: {int(s): {p + o for o in offsets} for s, offsets in inv.items()}
            for p, inv in enumerate(everyone)
        }
