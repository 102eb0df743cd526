"""What a crashed run left behind, dealt with once per run when the run is opened.

A job that crashed leaves two things in its memory tier that a restarted job
must take over (`Recovery.run`, called by `_run.Run.open` when it opens the
run's tier):

- staging leftovers (a part's staging slab, a retired step being removed) whose
  maker has certainly ended, or that are older than the timeout
  (`MemoryTier.clear_staging`);
- steps that were due for persistence, that the manager finalized, that this
  process's memory still holds from that very save, and that are not durable:
  their persistence is queued again, so a crash between a save and its persist
  loses no durable step.

The look reads the index manifests of the steps in memory; the indexes the
caller read already (a restore's step) are handed in and not read again.
"""

from __future__ import annotations

from pathlib import Path

from absl import logging as log

from jaxckpt.memory import _memory_tier
from jaxckpt.persistent import _index, _paths, _persist_job, _persister


class Recovery:
    """Takes over a crashed run's leftovers in this process's memory tier."""

    def __init__(self, persister: _persister.Persister, persist_every: int, timeout_s: float):
        self._persister = persister  # takes what a crashed run left unpersisted
        self._persist_every = persist_every
        self._timeout_s = timeout_s

    def run(
        self,
        memory: _memory_tier.MemoryTier,
        item: _paths.ItemDir,
        owner: int,
        indexes: dict[int, _index.Index],
    ) -> None:
        """Clears old staging and queues the persistence of what a crash left unpersisted.

        Args:
          memory: the run's memory tier, just opened.
          item: the item whose steps are looked at.
          owner: this process.
          indexes: step -> index manifests read already; those read here are added.
        """
        memory.clear_staging(older_than_s=self._timeout_s)
        try:
            jobs = self.unpersisted_jobs(memory, item.root, item.item, owner, indexes)
        except Exception:  # the look is a convenience: never fail a save or restore over it
            log.exception("jaxckpt: could not look for unpersisted steps in %s", memory.run_dir)
            return
        for job in jobs:
            log.info("jaxckpt: persisting step %d, left unpersisted by a crash", job.manifest.step)
            self._persister.submit(job)

    def unpersisted_jobs(
        self,
        memory: _memory_tier.MemoryTier,
        root: Path,
        item: str,
        owner: int,
        indexes: dict[int, _index.Index],
    ) -> list[_persist_job.PersistJob]:
        """Jobs that persist `owner`'s part of every step due for persistence (by
        `persist_every`, or asked for by its save) that the manager finalized, that
        `memory` still holds from that very save, and that is not durable."""
        jobs = []
        finalized = _paths.finalized_steps(root, item)
        for step in memory.steps():
            if step not in finalized:
                continue
            item_dir = finalized[step]
            if step not in indexes:
                indexes[step] = _index.read_index(item_dir)
            job = _persister.part_job(
                memory, item_dir, step, owner, self._persist_every, indexes[step]
            )
            if job is not None:
                jobs.append(job)
        return jobs
