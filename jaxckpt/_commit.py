"""The background half of a save: what a save's commit future does once `async_save`
has returned.

In order: the part's slab in the memory tier (copied from the held shards, or only
checksummed where `async_save` copied it already), its manifest, the atomic commit;
the push to the replica holders; the persist job of a step that is due; the
agreement of every process; the index manifest in the step directory. Any failure
before the index is agreed on, so every process raises and the manager finalizes
the step on all of them or on none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jaxckpt import (
    _agreement,
    _faults,
    _format,
    _fs,
    _memory_tier,
    _multihost,
    _paths,
    _persister,
    _slab,
    _snapshot,
    _storage,
)
from jaxckpt._options import TierOptions
from jaxckpt.peer import _peers

Agree = Callable[[BaseException | None], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Save:
    """One save of this process, from its snapshot to its index manifest."""

    directory: Path
    step: int
    snapshot: _snapshot.Snapshot
    memory: _memory_tier.MemoryTier
    process: int
    metrics: dict[str, Any]
    started: float
    # The shards' bytes, copied into the part's slab before `save()` returned (on CPU,
    # unless `TierOptions.hold_cpu_arrays`); else the commit copies them.
    staged: _memory_tier.StagedSlab | None = None


@dataclasses.dataclass(frozen=True)
class Services:
    """What a commit uses of the handler that runs it."""

    options: TierOptions
    peers: _peers.Peers | None  # None in one process
    persister: _persister.Persister
    publish: Callable[[dict[str, Any]], None]  # a save's metrics
    publish_failure: Callable[[str, int | None, BaseException], None]
    # Called once the commit succeeded (memory, directory, step): memory retention.
    committed: Callable[[_memory_tier.MemoryTier, Path, int], None]


async def refused(tag: str, step: int | None, error: BaseException, services: Services) -> None:
    """The commit of a save this process refused: every process raises with it."""
    services.publish_failure("save", step, error)
    if not _agreement.is_agreed(error):
        await asyncio.to_thread(
            _agreement.agree_on_save,
            None,
            error,
            tag=tag,
            step=step,
            timeout_s=services.options.timeout_s,
        )
    raise error


async def commit(tag: str, save: Save, services: Services) -> None:
    """The commit of `save`, agreed on: every process fails it if one fails before its
    index manifest or saved another tree (see `_agreement`)."""
    agreed = False

    async def agree(error: BaseException | None) -> None:
        nonlocal agreed
        agreed = True
        start = time.perf_counter()
        await asyncio.to_thread(
            _agreement.agree_on_save,
            save.snapshot.leaves,
            error,
            tag=tag,
            step=save.step,
            timeout_s=services.options.timeout_s,
        )
        save.metrics["agree_s"] = time.perf_counter() - start

    try:
        await _commit(save, agree, services)
    except Exception as error:
        services.publish_failure("save", save.step, error)
        if not agreed:
            await agree(error)
        raise


async def _commit(save: Save, agree: Agree, services: Services) -> None:
    manifest, part = await _commit_in_memory(save, services.options)
    save.metrics["safe_in_memory_s"] = time.perf_counter() - save.started
    # Set once the commit has ended: a persist job (queued after the push) makes
    # nothing durable before it is True and the manager has finalized the step.
    committed: concurrent.futures.Future[bool] = concurrent.futures.Future()
    try:
        await _replicate_agree_index(save, manifest, part, agree, committed, services)
    except BaseException:
        committed.set_result(False)
        raise
    committed.set_result(True)
    # IMPORTANT: older steps leave memory only once this one is finalized, so that
    # a crash at any moment leaves a finalized step in memory.
    services.committed(save.memory, save.directory, save.step)


async def _commit_in_memory(save: Save, options: TierOptions) -> tuple[_format.PartManifest, Path]:
    """The part's slab (with its CRC-32Cs) and manifest, committed into the memory tier."""
    step, snapshot, memory, pi, metrics = (
        save.step,
        save.snapshot,
        save.memory,
        save.process,
        save.metrics,
    )
    start = time.perf_counter()
    staged = save.staged
    if staged is None:
        chunks_data = [s.release() for s in snapshot.shards]
        staged = await asyncio.to_thread(memory.stage_slab, step, pi, chunks_data)
    staging = staged.staging
    try:
        crcs = staged.crcs
        if crcs is None:  # copied by `async_save`: checksummed here, in place
            sizes = [s.nbytes for s in snapshot.shards]
            slab = staging / _slab.SLAB_FILE
            crcs = await asyncio.to_thread(_slab.checksums, slab, staged.offsets, sizes)
        chunks: dict[int, list[_format.ChunkRecord]] = {}
        for s, crc, offset in zip(snapshot.shards, crcs, staged.offsets, strict=True):
            chunks.setdefault(s.leaf, []).append(
                _format.ChunkRecord(s.index, s.nbytes, crc32c=crc, offset=offset)
            )
        memory_s = time.perf_counter() - start + (save.staged.seconds if save.staged else 0.0)
        metrics["memory_write_s"] = memory_s
        metrics["memory_write_bytes_per_s"] = snapshot.nbytes / max(memory_s, 1e-9)
        manifest = _format.PartManifest(
            step=step,
            run_id=memory.run_id,
            save_id=uuid.uuid4().hex,
            owner=pi,
            process_count=_multihost.process_count(),
            failure_domain=options.resolved_failure_domain,
            leaves=snapshot.leaves,
            chunks={leaf: tuple(cs) for leaf, cs in chunks.items()},
            iterator_states=snapshot.iterator_states,
            scalars=snapshot.scalars,
            shardings=snapshot.shardings,
            created=time.time(),
            metrics=dict(metrics),
        )
        (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
        _faults.maybe_crash("memory_write", step, pi)
        part = memory.commit(staging, step, pi)
        _faults.maybe_crash("memory_commit", step, pi)
    except BaseException as e:
        _fs.remove_entry(staging)
        if _fs.is_out_of_space(e):
            raise memory.full_error(e, step, pi) from e
        raise
    return manifest, part


async def _replicate_agree_index(
    save: Save,
    manifest: _format.PartManifest,
    part: Path,
    agree: Agree,
    committed: concurrent.futures.Future[bool],
    services: Services,
) -> None:
    """The rest of a commit once the part is in memory: push it to its holders,
    queue its persistence if the step is due, agree with the other processes,
    write the index manifest."""
    directory, step, pi, metrics, started = (
        save.directory,
        save.step,
        save.process,
        save.metrics,
        save.started,
    )
    options = services.options
    if services.peers is not None and options.replicas:
        push_start = time.perf_counter()
        sent = await services.peers.push_replicas(part, step, pi)
        metrics["replicate_s"] = push_s = time.perf_counter() - push_start
        metrics["replicate_bytes"] = sent
        metrics["replicate_bytes_per_s"] = sent / max(push_s, 1e-9)
        metrics["safe_on_peers_s"] = time.perf_counter() - started
        _faults.maybe_crash("replicated", step, pi)
    # Persistence starts once the part is on its peers, beside the agreement and the
    # index: the fast tiers first (a node is lost more often than a rack), and a
    # persist beside the push would share the cores and the network with it
    # (measured on 2 cores: the push 5x slower, and the persist no faster).
    if step % options.persist_every == 0:
        services.persister.submit(
            _persister.PersistJob(
                manifest,
                part,
                directory,
                _paths.final_item_dir(directory),
                pin=save.memory.pin(step),
                committed=committed,
            )
        )
    # IMPORTANT: every process agrees that all committed the same tree before any writes
    # its index manifest: a step is indexed by every process or by none.
    await agree(None)
    # IMPORTANT: the index manifest is written only after the memory part is committed
    # (and replicated), so an index never points at copies that do not exist yet.
    manifest = dataclasses.replace(manifest, metrics=dict(metrics))
    _storage.write_file(directory / _format.index_file(pi), manifest.to_json())
    _faults.maybe_crash("index", step, pi)
    services.publish(metrics)
