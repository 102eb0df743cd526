"""This process's side of a run: its memory tier, its peers, and how it meets the others.

A run is one checkpoint directory's saves and restores (its run id names its
memory tier, `_paths.ItemDir.run_id`). `Run` holds the run in use and does, for
the handler, everything that involves the other processes or a crashed run:

- the memory tier of the run (opened on first use, when the run changes), with
  the clean-up of a crashed run's leftovers: staging older than the timeout, and
  the persistence of the steps it left due but unpersisted;
- the peers (met once per run, a collective) and the placement check;
- the choreography that keeps every process's exchanges in step: a process that
  fails before an exchange still takes part in it (`taking_part`, `decline`),
  and the verdict of a restore or a listing is agreed on (`agree`);
- the exchange of inventories behind every restore plan (`global_view`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from absl import logging as log

from jaxckpt import (
    _agreement,
    _format,
    _fs,
    _index,
    _memory_tier,
    _multihost,
    _paths,
    _persister,
    _placement,
    _resources,
    _retention,
    _slab,
)
from jaxckpt._options import TierOptions
from jaxckpt.peer import _peers


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
        self._persister = persister  # takes what a crashed run left unpersisted
        self._keeper = keeper  # told of every checkpoint directory and item used
        self.memory: _memory_tier.MemoryTier | None = None
        self.peers: _peers.Peers | None = None
        self._items: dict[str, set[tuple[Path, str]]] = {}  # run id -> (root, item) used
        _resources.SHARED.acquire(self)

    # ---- the run's tiers ----------------------------------------------------

    def memory_for(
        self, item: _paths.ItemDir, recorded: _format.PartManifest | None = None
    ) -> _memory_tier.MemoryTier:
        """The memory tier of the run that `item` belongs to.

        The run id is the one `recorded` in the step's index manifest (a restore:
        the copies to read carry it, whatever the directory is called now), else
        `TierOptions.run_id`, else one derived from the checkpoint directory's
        real path (so a symlink to it finds the same tier).
        """
        self._keeper.note(item)
        _resources.SHARED.acquire(self)  # again, if used after `close`
        run_id = item.run_id(self._options.run_id, recorded.run_id if recorded else None)
        self._items.setdefault(run_id, set()).add((item.root, item.item))
        if self.memory is None or self.memory.run_id != run_id:
            memory = _memory_tier.MemoryTier(
                self._options.memory_root,
                run_id,
                self._options.spare_slabs,
                self._options.memory_budget,
            )
            memory.prepare(
                str(item.root), _multihost.process_index(), self._options.resolved_failure_domain
            )
            memory.clear_staging(older_than_s=self._options.timeout_s)
            self.memory = memory
            self._resume_persistence(memory, item)
        return self.memory

    def _resume_persistence(self, memory: _memory_tier.MemoryTier, item: _paths.ItemDir) -> None:
        """Queues what a crash left unpersisted (steps due, finalized, still in this
        process's memory): a restarted job persists them as the lost one would have."""
        try:
            jobs = _persister.unpersisted_jobs(
                memory,
                item.root,
                item.item,
                _multihost.process_index(),
                self._options.persist_every,
            )
        except Exception:  # the look is a convenience: never fail a save or restore over it
            log.exception("jaxckpt: could not look for unpersisted steps in %s", memory.run_dir)
            return
        for job in jobs:
            log.info("jaxckpt: persisting step %d, left unpersisted by a crash", job.manifest.step)
            self._persister.submit(job)

    # ---- meeting the other processes -------------------------------------------

    def meet(
        self,
        item: _paths.ItemDir,
        memory: _memory_tier.MemoryTier | None,
        error: BaseException | None,
    ) -> _peers.Peers | None:
        """A save's meeting with its peers (collective, once per run): with a memory tier,
        connects and checks that the replicas can be placed; without one (`error` says
        why), takes part all the same so that every process raises."""
        if memory is None:
            self.decline(item, error or RuntimeError("no memory tier"))
            return None
        peers = self.connect(memory)
        if peers is not None:
            peers.holders  # noqa: B018 -- computing the placement validates it
        else:
            _placement.place_replicas(
                [self._options.resolved_failure_domain], self._options.replicas
            )
        return peers

    def connect(self, memory: _memory_tier.MemoryTier) -> _peers.Peers | None:
        """Meets the other processes once per run (collective); None in one process."""
        if _multihost.process_count() == 1:
            return None
        if self.peers is None or self.peers.run_id != memory.run_id:
            if self.peers is not None:
                self.peers.close()
            self.peers = _peers.Peers.connect(memory, self._options)
        return self.peers

    def decline(
        self, item: _paths.ItemDir, error: BaseException, run_id: str | None = None
    ) -> None:
        """Where the others meet their peers, takes part without a memory tier (collective):
        all raise `error`. Nothing to do if this run's peers were met already."""
        if _multihost.process_count() == 1:
            return
        run_id = run_id or item.run_id(self._options.run_id)
        if self.peers is None or self.peers.run_id != run_id:
            _peers.Peers.decline(run_id, self._options, error)

    @contextlib.contextmanager
    def taking_part(
        self,
        item: _paths.ItemDir,
        recorded: _format.PartManifest | None,
        memory: _memory_tier.MemoryTier | None,
    ) -> Iterator[None]:
        """On an error inside, takes part in the restore's exchange of inventories all the
        same (with nothing to offer), then raises it: the restore agrees on it afterwards."""
        try:
            yield
        except Exception as error:
            # IMPORTANT: the other processes are about to meet in `global_view`; skipping
            # it would leave them waiting and this process's exchanges out of step.
            if memory is not None:
                self.global_view(item, memory)
            elif _multihost.process_count() > 1:
                run_id = item.run_id(self._options.run_id, recorded.run_id if recorded else None)
                if self.peers is None or self.peers.run_id != run_id:
                    self.decline(item, error, run_id)
                else:
                    self.peers.exchange_inventories({})
            raise

    def global_view(
        self,
        item: _paths.ItemDir,
        memory: _memory_tier.MemoryTier,
        indexes: dict[int, _index.Index] | None = None,
    ) -> _index.GlobalView:
        """What every process holds in memory, for every finalized step (collective).

        `indexes` are index manifests read already (step -> index): not read again.
        """
        pi = _multihost.process_index()
        steps: dict[int, Path] = {}
        local: _peers.Inventory = {}
        known: dict[int, _index.Index] = dict(indexes or {})  # shared with the views below
        try:
            steps = item.finalized_steps()
            if item.step is not None and item.path.is_dir():
                steps[item.step] = item.path
            mine = _index.GlobalView(steps, {}, pi, known)
            local = {
                s: _index.memory_parts(memory, s, mine.index(s))
                for s in memory.steps()
                if s in steps
            }
        except OSError as e:
            # IMPORTANT: still take part in the exchange below (the others wait in it),
            # offering nothing: the restore reads from peers or persistent storage instead.
            log.warning("jaxckpt: [process %d] cannot list what it holds: %s", pi, e)
            local = {}
        peers = self.connect(memory)
        inventories = peers.exchange_inventories(local) if peers else {pi: local}
        return _index.GlobalView(steps, inventories, pi, known)

    def restorable_steps(self, item: _paths.ItemDir) -> list[int]:
        """Every finalized step of `item` that some tier can restore, newest first
        (collective: every process takes part in the exchange of inventories)."""
        with self.taking_part(item, None, None):
            # The newest step's index records the run id its copies carry.
            finalized = item.finalized_steps()
            index = _index.read_index(finalized[max(finalized)]) if finalized else {}
            pi = _multihost.process_index()
            recorded = index.get(pi) or next(iter(index.values()), None)
            memory = self.memory_for(item, recorded)
        return self.global_view(item, memory).restorable_steps()

    def agree(
        self, verb: str, item: _paths.ItemDir, error: BaseException | None, what: str = ""
    ) -> None:
        """Raises on every process if `error` or another process's error is set (collective)."""
        _agreement.agree(
            error,
            tag=item.tag(verb, self._options.run_id),
            what=what or f"The {verb} of step {item.step}",
            timeout_s=self._options.timeout_s,
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

    def agree_on_release(self, error: BaseException | None) -> None:
        """One verdict for `release_memory` on every process (collective): raises on
        every process if this process's `error`, or another's, is set. The tag names
        no run: a process that never used the run's tier (no memory) meets the others
        all the same."""
        _agreement.agree(
            error,
            tag="release_memory",
            what="Persisting the newest step to release the memory tier",
            timeout_s=self._options.timeout_s,
        )

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
