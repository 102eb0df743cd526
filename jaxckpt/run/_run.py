"""This process's side of a run: its memory tier, its peers, and what it holds.

A run is one checkpoint directory's saves and restores (its run id names its
memory tier, `_paths.ItemDir.run_id`). `Run` holds the run in use and does, for
the operations' choreographies (`_choreography`), this process's own side of
everything that involves the other processes or a crashed run:

- opening the run (`open`, step 1 of every save and restore): its memory tier,
  and once per run the crashed run's leftovers taken over (`_recovery`);
  `memory_for` only looks the open tier up;
- the run's peers, once met (`peers_of`, `adopt`: the meeting is the choreographies');
- what this process holds in memory (`held`), which it offers to the exchange of
  inventories behind every restore plan.

No exchange runs here: which process takes part in which exchange, and when, is
the choreographies' business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from absl import logging as log

from jaxckpt import _resources
from jaxckpt._options import TierOptions
from jaxckpt.coord import _holdings, _multihost
from jaxckpt.format import _format
from jaxckpt.peer import _peers
from jaxckpt.run import _recovery
from jaxckpt.tiers import (
    _fs,
    _index,
    _memory_tier,
    _paths,
    _persister,
    _quarantine,
    _retention,
    _slab,
)


@dataclasses.dataclass(frozen=True)
class Held:
    """What this process holds in memory for every finalized step of an item (`local`),
    the steps (step -> item directory) and the index manifests read on the way."""

    steps: dict[int, Path]
    local: _peers.Inventory
    indexes: dict[int, _index.Index]

    def view(self, inventories: _holdings.Holdings | None = None) -> _index.GlobalView:
        """Every process's holdings (`inventories`, as exchanged; None: this one's alone)
        with the steps and their indexes: what plans a restore."""
        pi = _multihost.process_index()
        held = inventories if inventories is not None else {pi: self.local}
        return _index.GlobalView(self.steps, held, pi, self.indexes)


class Run:
    """The run in use by one handler in this process: memory tier and peers.

    Attributes:
      memory: the memory tier of the run in use (None before the first save or restore).
      peers: the run's peers (None in one process, or before they were met).
    """

    def __init__(
        self, options: TierOptions, persister: _persister.Persister, keeper: _retention.Keeper
    ):
        self._options = options
        self._persister = persister  # takes the newest step's part at the end of a run
        # Takes over what a crashed run left: old staging, steps left unpersisted.
        self._recovery = _recovery.Recovery(persister, options.persist_every, options.timeout_s)
        self._keeper = keeper  # told of every checkpoint directory and item used
        self.memory: _memory_tier.MemoryTier | None = None
        self.peers: _peers.Peers | None = None
        self._items: dict[str, set[tuple[Path, str]]] = {}  # run id -> (root, item) used
        _resources.SHARED.acquire(self)

    @property
    def options(self) -> TierOptions:
        return self._options

    # ---- the run's tiers ----------------------------------------------------

    def memory_for(
        self, item: _paths.ItemDir, recorded: _format.PartManifest | None = None
    ) -> _memory_tier.MemoryTier | None:
        """The open memory tier of the run that `item` belongs to, or None if that run is
        not open here (a lookup: it opens nothing; see `open`).

        The run id is the one `recorded` in the step's index manifest (a restore:
        the copies to read carry it, whatever the directory is called now), else
        `TierOptions.run_id`, else one derived from the checkpoint directory's
        real path (so a symlink to it finds the same tier).
        """
        run_id = item.run_id(self._options.run_id, recorded.run_id if recorded else None)
        return self.memory if self.memory is not None and self.memory.run_id == run_id else None

    def open(
        self,
        item: _paths.ItemDir,
        recorded: _format.PartManifest | None = None,
        indexes: dict[int, _index.Index] | None = None,
    ) -> _memory_tier.MemoryTier:
        """Opens the run that `item` belongs to (step 1 of a save, a restore or a listing):
        its memory tier, prepared (`MemoryTier.prepare`: RUN.json, writable or not), and,
        once per run, the crashed run's leftovers taken over (`_recovery.Recovery`).

        Args:
          item: the item directory of the operation.
          recorded: a manifest of the step's index (its run id wins; see `memory_for`).
          indexes: step -> index manifests the caller read already: the recovery
            does not read them again (and adds those it reads).
        """
        self._keeper.note(item)
        _resources.SHARED.acquire(self)  # again, if used after `close`
        run_id = item.run_id(self._options.run_id, recorded.run_id if recorded else None)
        self._items.setdefault(run_id, set()).add((item.root, item.item))
        memory = self.memory_for(item, recorded)
        if memory is None:
            memory = _memory_tier.MemoryTier(
                self._options.memory_root,
                run_id,
                self._options.spare_slabs,
                self._options.memory_budget,
            )
            memory.prepare(
                str(item.root), _multihost.process_index(), self._options.resolved_failure_domain
            )
            self.memory = memory
            self._recovery.run(
                memory, item, _multihost.process_index(), indexes if indexes is not None else {}
            )
        return memory

    # ---- this process's side of the exchanges (run by `_choreography`) ---------------

    def peers_of(self, run_id: str) -> _peers.Peers | None:
        """The peers of run `run_id`, if this process met them already (once per run)."""
        return self.peers if self.peers is not None and self.peers.run_id == run_id else None

    def adopt(self, peers: _peers.Peers) -> _peers.Peers:
        """Keeps `peers`, just met, as the run's (closing those of the run before)."""
        if self.peers is not None and self.peers is not peers:
            self.peers.close()
        self.peers = peers
        return peers

    def held(
        self,
        item: _paths.ItemDir,
        memory: _memory_tier.MemoryTier | None,
        indexes: dict[int, _index.Index] | None = None,
    ) -> Held:
        """What this process holds in memory, for every finalized step of `item`: its
        side of the exchange `inventories`. Without a memory tier, or if it cannot be
        listed, nothing (the others read from peers or persistent storage).

        `indexes` are index manifests read already (step -> index): not read again.
        """
        pi = _multihost.process_index()
        steps: dict[int, Path] = {}
        local: _peers.Inventory = {}
        known: dict[int, _index.Index] = indexes if indexes is not None else {}
        try:
            steps = item.finalized_steps()
            if item.step is not None and item.path.is_dir():
                steps[item.step] = item.path
            if memory is not None:
                mine = _index.GlobalView(steps, {}, pi, known)
                local = {
                    s: _index.memory_parts(memory, s, mine.index(s))
                    for s in memory.steps()
                    if s in steps
                }
        except OSError as e:
            log.warning("jaxckpt: [process %d] cannot list what it holds: %s", pi, e)
            local = {}
        return Held(steps, local, known)

    def verify_held(self, memory: _memory_tier.MemoryTier, steps: Iterable[int]) -> None:
        """Checks every part this process holds in memory for `steps` against its
        checksums and quarantines a damaged one (`_quarantine`), so that no inventory
        offers it (`latest_restorable_step(verify=True)`)."""
        pi, wanted = _multihost.process_index(), set(steps)
        held = [
            memory.part_dir(s, o) for s in memory.steps() if s in wanted for o in memory.parts(s)
        ]
        damaged, nbytes, seconds = _quarantine.verify_tier(held, pi)
        log.info(
            "jaxckpt: [process %d] verified %d memory-tier parts (%.3f GB) in %.2f s "
            "(%.2f GB/s); %d damaged, quarantined",
            pi,
            len(held),
            nbytes / 1e9,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
            len(damaged),
        )

    def redact(self, text: str) -> str:
        """`text` without the run's secrets (the peers' token)."""
        return self.peers.redact(text) if self.peers is not None else text

    def persist_newest(self) -> list[int]:
        """Queues the persistence of this process's part of the newest finalized step of
        every item of the run in use, where that step is not durable and this memory
        tier holds the part from its save (a step that was not due, at the end of a
        run). Returns the steps queued."""
        memory = self.memory
        if memory is None:
            return []
        queued = []
        for root, item, step in self._keeper.newest_not_durable(
            self._items.get(memory.run_id, set())
        ):
            item_dir = _paths.finalized_steps(root, item).get(step)
            job = None
            if item_dir is not None:
                job = _persister.part_job(memory, item_dir, step, _multihost.process_index())
            if job is not None:
                log.info(
                    "jaxckpt: persisting step %d of %s, the newest, to release memory", step, root
                )
                self._persister.submit(job)
                queued.append(step)
        return queued

    def release_memory(self) -> list[int]:
        """Removes every step of the run's memory tier on this host (its own parts and
        the replicas it holds) and the spare slabs, if the newest step of every item of
        the run is durable; a pinned step (a restore reading it) stays. Otherwise it
        logs which steps it keeps and why, and removes nothing.

        Returns:
          The steps removed.
        """
        memory = self.memory
        if memory is None:
            return []
        in_memory_only = self._keeper.newest_not_durable(self._items.get(memory.run_id, set()))
        if in_memory_only:
            log.warning(
                "jaxckpt: [process %d] not releasing the memory tier %s: the newest step of %s, "
                "which is in memory tiers only (some process's part of it is in no memory "
                "tier of its own, so it could not be persisted); the tier keeps steps %s.",
                _multihost.process_index(),
                memory.run_dir,
                ", ".join(
                    f"{root} (item {item!r}) is {step}" for root, item, step in in_memory_only
                ),
                memory.steps(),
            )
            return []
        steps = memory.steps()
        removed = memory.retain(0, max(steps)) if steps else []
        _fs.remove_entries(memory.run_dir / ".free", which=lambda p: True)
        _slab.forget_unlinked()
        return removed

    def close(self) -> None:
        """Stops the peer service and lets go of the process's shared resources (the
        last user's release shuts their pools and unmaps the kept slabs); the memory
        tier stays as it is."""
        try:
            if self.peers is not None:
                self.peers.close()
                self.peers = None
        finally:
            _resources.SHARED.release(self)
