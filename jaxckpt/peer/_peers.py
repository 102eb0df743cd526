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
from collections.abc import Callable
from pathlib import Path

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


class Peers:
    """This process's connection to every other process's memory tier."""

    def __init__(
        self,
        server: _server.PeerServer,
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
        self._timeout_s = timeout_s

    @classmethod
    def connect(cls, memory: _memory_tier.MemoryTier, options: _options.TierOptions) -> Peers:
        """Starts this process's peer service and meets the others (collective).

        Raises:
          ValueError: if `options.replicas` cannot be placed in other failure domains.
          TimeoutError: if another process does not show up within the timeout.
          Any error another process met starting its peer service (the same
            built-in type, naming it), on every process.
        """
        return cls._meet(memory.run_id, memory, options, None)

    @classmethod
    def decline(cls, run_id: str, options: _options.TierOptions, error: BaseException) -> None:
        """Takes part in meeting the others without a memory tier to serve (collective).

        A process whose memory tier failed calls this where the others call
        `connect`, so that they all learn of `error` at once instead of waiting
        for it, and every process's exchanges stay in step.

        Raises:
          `error` (marked as agreed), always.
        """
        cls._meet(run_id, None, options, error)
        raise _agreement.mark_agreed(error)  # _meet raised it already; for the type checker

    @classmethod
    def _meet(
        cls,
        run_id: str,
        memory: _memory_tier.MemoryTier | None,
        options: _options.TierOptions,
        error: BaseException | None,
    ) -> Peers:
        tag = f"peers/{run_id}"
        token = _multihost.broadcast(
            secrets.token_hex(32) if _multihost.process_index() == 0 else None,
            tag=f"{tag}/token",
            timeout_s=options.timeout_s,
        )
        server = None
        if error is None and memory is not None:
            try:
                server = _server.PeerServer(
                    memory.run_dir.parent,
                    run_id=run_id,
                    token=token,
                    host=options.peer_host,
                    io_timeout=options.timeout_s,
                    reuse_free_slabs=options.spare_slabs,
                    memory_budget=options.memory_budget,
                )
                server.start()
            except Exception as e:  # agreed on below, so every process raises it
                if server is not None:
                    server.close()
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
                timeout=min(timeout_s, self._timeout_s),
                progress=progress,
            )

        return read

    async def push_replicas(self, part_dir: Path, step: int, owner: int) -> int:
        """Copies a committed part to every holder of `owner`'s replicas at once; bytes sent.

        This process only sends (`push_part`: sendfile, no checksum); each holder
        verifies every chunk against the part's manifest before keeping it.
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
                    timeout=self._timeout_s,
                )
            except OSError as e:
                raise OSError(
                    f"[process {owner}] Pushing the replica of step {step} to process {holder} "
                    f"({self.addresses[holder]}) failed: {self.redact(str(e))}"
                ) from e

        sent = await asyncio.gather(*(asyncio.to_thread(push, h) for h in self.holders[owner]))
        return sum(sent)

    def exchange_inventories(self, local: Inventory) -> dict[int, Inventory]:
        """process -> its inventory, for every process (collective)."""
        wire = {str(step): sorted(owners) for step, owners in local.items()}
        everyone = _multihost.allgather(
            wire, tag=f"inventory/{self.run_id}", timeout_s=self._timeout_s
        )
        return {p: {int(s): set(o) for s, o in inv.items()} for p, inv in enumerate(everyone)}
