"""One save of this process, from its held shards to its index manifest.

`Save` owns the whole background half of a save; the handler's `async_save`
only takes the snapshot, meets the peers and hands over. In order:

1. `stage` (before `async_save` returns, on CPU unless `hold_cpu_arrays`): the
   held views are copied into the part's slab and let go, so that the next train
   step may donate those buffers (a small part, up to `PRIVATE_COPY_BYTES`, into
   private memory instead: the commit writes its slab);
2. `commit` (the commit future): the slab (filled now, with each block's
   CRC-32C, or only checksummed where `stage` filled it), its manifest and the
   atomic commit into the memory tier; the push to the replica holders; the
   persist job of a step that is due; the agreement of every process (the
   exchange `agree` of `_choreography.SaveChoreography`); the index manifest in
   the step directory; then memory retention.

Any failure before the index is agreed on (by the choreography), so every
process raises and the manager finalizes the step on all of them or on none. `SaveMetrics` records
each phase.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from pathlib import Path
from typing import Final

import numpy as np
from absl import logging as log

from jaxckpt import _faults, _metrics, _resources
from jaxckpt._options import TierOptions
from jaxckpt.coord import _multihost
from jaxckpt.format import _chunking, _finite, _format, _tiles
from jaxckpt.memory import _fs, _memory_tier, _slab
from jaxckpt.persistent import _index, _paths, _persist_job, _persister, _storage
from jaxckpt.run import _choreography, _retention
from jaxckpt.save import _snapshot

# A part this small is copied into private memory in `save()`, not into its slab: the
# slab's file work (its staging directory, a retired slab taken over, a mapping) costs
# the training thread ~0.4 ms, as much as copying 4 MiB; the commit writes the slab.
PRIVATE_COPY_BYTES: Final = 4 << 20


@dataclasses.dataclass(frozen=True)
class Services:
    """The handler-lifetime objects a save hands its work to (objects, not callbacks)."""

    options: TierOptions
    persister: _persister.Persister
    retainer: _retention.MemoryRetainer
    publisher: _metrics.Publisher


class Save:
    """The background half of one save of this process (see the module docstring)."""

    def __init__(
        self,
        item: _paths.ItemDir,
        step: int,
        snapshot: _snapshot.Snapshot,
        memory: _memory_tier.MemoryTier,
        choreography: _choreography.SaveChoreography,
        services: Services,
        started: float,
        persist: bool = False,
    ):
        """Args (beside the collaborators): `choreography` runs the save's exchanges (its
        peers met already); `persist` asks for the step's persistence whatever
        `TierOptions.persist_every` says (`TieredSave(persist=True)`)."""
        self._item, self._step, self._snapshot = item, step, snapshot
        self._memory, self._services = memory, services
        self._choreography, self._peers = choreography, choreography.peers
        self._options = services.options
        self._asked_to_persist = persist
        self._persist = persist or step % services.options.persist_every == 0
        self._started = started
        self._process = _multihost.process_index()
        self._staged: _memory_tier.StagedSlab | None = None
        self._checksummed = False  # whether the staged slab's CRC-32Cs are computed
        # NaN/Inf counted in the slab's checksum pass (`_finite`), if asked.
        self._tally = (
            _finite.Tally([snapshot.leaves[s.leaf].stored_dtype for s in snapshot.shards])
            if self._options.count_nonfinite
            else None
        )
        self.metrics = _metrics.SaveMetrics(
            step=step,
            process=self._process,
            bytes=snapshot.nbytes,
            stall_s=0.0,
            host_staging=snapshot.staging,
        )

    def stage(self) -> None:
        """On CPU (unless `hold_cpu_arrays`), copies the held views now and lets go of
        them (`_copy_views`): JAX may then donate the arrays to the next train step (a
        declined donation costs that step more than the copy). Ends the stall."""
        if self._snapshot.staging == "cpu_view" and not self._options.hold_cpu_arrays:
            self._copy_views()
        _faults.at("snapshot", self._step, self._process)
        self.metrics.stall_s = time.perf_counter() - self._started

    def _copy_views(self) -> None:
        """The held views copied into the part's slab, or into private memory if the
        part is small (`PRIVATE_COPY_BYTES`: the commit writes its slab)."""
        shards = self._snapshot.shards
        if self._snapshot.nbytes <= PRIVATE_COPY_BYTES:
            for s in shards:
                s.copy_out()
            self.metrics.host_staging = "copy"
            return
        self._staged = self._stage_slab([s.release() for s in shards], checksum=False)
        self.metrics.host_staging = "slab"
        self.metrics.slab_copy_s = self._staged.seconds

    def _stage_slab(
        self,
        chunks: list[np.ndarray],
        checksum: bool = True,
        tally: _finite.Tally | None = None,
    ) -> _memory_tier.StagedSlab:
        """`MemoryTier.stage_slab` of the part's `chunks`, once the retention that frees the
        previous step's slab has run (`MemoryRetainer.settle`): saved back to back, the
        part refills that slab instead of a new file."""
        self._services.retainer.settle()
        return self._memory.stage_slab(
            self._step, self._process, chunks, checksum, tally, self._tile_regions()
        )

    async def commit(self) -> None:
        """The commit of this save; its agreement is the choreography's exchange `agree`
        (a failure before it is agreed on by `_choreography.SaveChoreography.commit`)."""
        # Local work only, so the collector is paused (see `_operation`) for as long as it
        # takes, never through an exchange's wait.
        with _resources.SHARED.gc_paused():
            manifest, part = self._commit_in_memory()
        self.metrics.safe_in_memory_s = time.perf_counter() - self._started
        # Set once the commit has ended: a persist job (queued after the push) makes
        # nothing durable before it is True and the manager has finalized the step.
        committed: concurrent.futures.Future[bool] = concurrent.futures.Future()
        try:
            await self._replicate_agree_index(manifest, part, committed)
        except BaseException:
            committed.set_result(False)
            raise
        committed.set_result(True)
        # IMPORTANT: older steps leave memory only once this one is finalized, so that
        # a crash at any moment leaves a finalized step in memory.
        self._services.retainer.after(self._memory, self._item, self._step)

    def _commit_in_memory(self) -> tuple[_format.PartManifest, Path]:
        """The part's slab (with its CRC-32Cs) and manifest, committed into the memory tier."""
        step, pi, snapshot, memory = self._step, self._process, self._snapshot, self._memory
        start = time.perf_counter()
        staged = self._staged
        if staged is None:
            # On the commit future's own thread (see `_operation._placed_first`).
            staged = self._stage_slab([s.release() for s in snapshot.shards], tally=self._tally)
        staging = staged.staging
        try:
            crcs = staged.crcs
            if crcs is None:  # filled by `stage`: checksummed here, in place
                sizes = [s.nbytes for s in snapshot.shards]
                slab = staging / _slab.SLAB_FILE
                crcs = _slab.checksums(slab, staged.offsets, sizes, self._tally, self._tile_sizes())
            chunks: dict[int, list[_format.ChunkRecord]] = {}
            for s, crc, offset in zip(snapshot.shards, crcs, staged.offsets, strict=True):
                record = snapshot.leaves[s.leaf]
                chunks.setdefault(s.leaf, []).append(
                    _tiles.chunk_record(record, s.index, s.nbytes, offset, crc)
                )
            nonfinite = self._nonfinite()
            memory_s = time.perf_counter() - start + (self.metrics.slab_copy_s or 0.0)
            self.metrics.memory_write_s = memory_s
            self.metrics.memory_write_bytes_per_s = snapshot.nbytes / max(memory_s, 1e-9)
            manifest = _format.PartManifest(
                step=step,
                run_id=memory.run_id,
                save_id=uuid.uuid4().hex,
                owner=pi,
                process_count=_multihost.process_count(),
                failure_domain=self._options.resolved_failure_domain,
                leaves=snapshot.leaves,
                chunks={leaf: tuple(cs) for leaf, cs in chunks.items()},
                iterator_states=snapshot.iterator_states,
                scalars=snapshot.scalars,
                shardings=snapshot.shardings,
                created=time.time(),
                metrics=self.metrics.to_dict(),
                persist=self._asked_to_persist,
                weak_types=snapshot.weak_types,
                nonfinite=nonfinite,
            )
            (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
            _faults.at("memory_write", step, pi)
            part = memory.commit(staging, step, pi)
            _faults.at("memory_commit", step, pi)
        except BaseException as e:
            _fs.remove_entry(staging)
            if _fs.is_out_of_space(e):
                raise memory.full_error(e, step, pi) from e
            raise
        return manifest, part

    def _tile_regions(self) -> list[list[_chunking.Region] | None]:
        """Each shard's tiles, as regions of the shard in byte order (None: saved whole)."""
        leaves = self._snapshot.leaves
        return [
            None
            if (shape := leaves[s.leaf].tile_shape) is None
            else _tiles.regions_in_chunk(s.shape, shape)
            for s in self._snapshot.shards
        ]

    def _tile_sizes(self) -> list[list[int] | None]:
        """Each shard's tiles' byte sizes, in byte order (None: saved whole)."""
        leaves = self._snapshot.leaves
        return [
            _tiles.byte_sizes(s.shape, leaves[s.leaf].tile_shape, s.itemsize)
            for s in self._snapshot.shards
        ]

    def _nonfinite(self) -> dict[int, int] | None:
        """Leaf index -> NaN/Inf count of this part's floating leaves that hold any
        (None if not counted); warns once for a step that has any."""
        if self._tally is None:
            return None
        found = self._tally.by_leaf([s.leaf for s in self._snapshot.shards])
        self.metrics.nonfinite = sum(found.values())
        if found:
            leaves = self._snapshot.leaves
            named = ", ".join(
                f"{leaves[i].path} ({n})" for i, n in sorted(found.items(), key=lambda x: -x[1])[:5]
            )
            more = f" and {len(found) - 5} more leaves" if len(found) > 5 else ""
            log.warning(
                "jaxckpt: [process %d] step %d holds %d NaN/Inf values in %s%s. The step is "
                "saved as it is; latest_restorable_step(..., finite=True) skips such steps.",
                self._process,
                self._step,
                self.metrics.nonfinite,
                named,
                more,
            )
        return found

    async def _replicate_agree_index(
        self,
        manifest: _format.PartManifest,
        part: Path,
        committed: concurrent.futures.Future[bool],
    ) -> None:
        """The rest of a commit once the part is in memory: push it to its holders,
        queue its persistence if the step is due, agree with the other processes,
        write the index manifest."""
        step, pi, metrics, options = self._step, self._process, self.metrics, self._options
        if self._peers is not None and options.replicas:
            push_start = time.perf_counter()
            # Data-parallel replicas: the copy goes to a partner holding the rest of the shard.
            holders = self._peers.holders_with(self._snapshot.partners)
            sent = await self._peers.push_replicas(part, step, pi, holders)
            metrics.replicate_s = push_s = time.perf_counter() - push_start
            metrics.replicate_bytes = sent
            metrics.replicate_bytes_per_s = sent / max(push_s, 1e-9)
            metrics.safe_on_peers_s = time.perf_counter() - self._started
            _faults.at("replicated", step, pi)
        # Persistence starts once the part is on its peers, beside the agreement and the
        # index: the fast tiers first (a node is lost more often than a rack), and a
        # persist beside the push would share the cores and the network with it
        # (measured on 2 cores: the push 5x slower, and the persist no faster).
        if self._persist:
            self._services.persister.submit(
                _persist_job.PersistJob(
                    manifest,
                    part,
                    self._item.path,
                    self._item.final,
                    pin=self._memory.pin(step),
                    committed=committed,
                )
            )
        # The choreography's exchange `agree`, now that the part is committed and pushed:
        # the step's index is written within it (`SaveChoreography.agree`).
        manifest = dataclasses.replace(manifest, metrics=metrics.to_dict())
        agree_start = time.perf_counter()
        await self._choreography.agree(
            self._snapshot.leaves, _index.entry(manifest), self._write_index
        )
        self.metrics.agree_s = time.perf_counter() - agree_start
        # One process wrote the step's objects: the others' cached listings do not show them.
        _storage.forget_listings(self._item.path)
        _faults.at("index", step, pi)
        self._services.publisher.announce(self._set_up())
        self._services.publisher.publish(metrics.to_dict())

    def _set_up(self) -> str:
        """The first save's one INFO line: the tiers, the replicas, the persist cadence."""
        o, every = self._options, self._options.persist_every
        due = (self._step // every + 1) * every
        replicas = (
            f"{o.replicas} replica(s) in other failure domains"
            if self._peers is not None and o.replicas
            else "no replicas"
        )
        return (
            f"[process {self._process}] first save (step {self._step}, "
            f"{self.metrics.bytes / 2**20:.1f} MiB): memory tier {self._memory.run_dir} keeps "
            f"{o.memory_keep} step(s); {replicas}; persisted to {self._item.root} when "
            f"step % {every} == 0 (next: step {due}) or asked"
            + ("; NaN/Inf counted" if o.count_nonfinite else "")
            + ". Each save and persist is logged at DEBUG."
        )

    def _write_index(self, entries: dict[int, str]) -> None:
        """Writes the step's index from every process's entry (on the deciding process)."""
        path = self._item.path / _format.STEP_INDEX_FILE
        try:
            _index.write_step_index(self._item.path, self._snapshot.leaves, entries)
        except Exception as e:
            raise OSError(
                f"[process {self._process}] could not write the index of step {self._step} "
                f"({path}): {e}. The step is not saved on any process; the earlier steps "
                "are untouched. Check that the checkpoint directory is writable and save again."
            ) from e
