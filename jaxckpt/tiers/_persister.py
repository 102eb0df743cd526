"""Lazy persistence: copies committed memory parts to the checkpoint directory.

Runs on its own thread and queue so that a slow persistent store never holds up
the next `mngr.save()` (the manager waits for the previous save's commit
futures, and persistence is not one of them). How a part becomes durable
depends on where the checkpoint directory lives (`_storage`):

- A filesystem: a persisted part becomes visible only by renaming a complete
  staging directory to `<item_dir>/part_<owner>`; its existence is the
  durability marker, so every file and directory of the part (and the owner's
  index manifest) is fsynced before that rename, and the directories above it
  after.
- An object store (no rename): the chunks are uploaded straight into
  `<item_dir>/part_<owner>/` (concurrently, with tensorstore), and the part's
  manifest object, written last, is the durability marker; readers ignore a part
  without one. A failed upload is retried with backoff within `timeout_s`.

One worker thread at a time: `close` stops it once the queue is empty; if it
is still busy when `close` gives up waiting, it finishes its jobs and a later
`submit` hands it more rather than starting a second worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging as log

from jaxckpt import _faults
from jaxckpt.format import _checksum, _format
from jaxckpt.tiers import _fs, _index, _kept, _memory_tier, _paths, _readers, _slab, _storage, _zarr

# Attempts at uploading a part to an object store (each request is also retried by
# tensorstore), and the first wait between them (doubled after each failure).
UPLOAD_ATTEMPTS = int(os.environ.get("JAXCKPT_UPLOAD_ATTEMPTS", "3"))
UPLOAD_BACKOFF_S = 0.5


@dataclasses.dataclass(frozen=True)
class PersistJob:
    """Persist one committed memory part into a (soon to be final) item directory."""

    manifest: _format.PartManifest
    source_part: Path
    item_dir: Path  # where the manager is writing the step now
    final_item_dir: Path  # where it will be once the manager finalizes the step
    pin: _memory_tier.Pin | None = None  # memory-tier pin on the source step, released when done
    # Made for a step finalized before the job (`part_job`: resumed after a restart by
    # `_recovery.Recovery`, or the newest step at `release_memory`): its deletion since
    # (nobody restores it any more) is no failure.
    resumed: bool = False
    # Set by the save once its commit ended (True: it succeeded); the job is queued as
    # soon as the part is in memory, and makes nothing durable before it is True.
    committed: concurrent.futures.Future[bool] | None = None


def part_job(
    memory: _memory_tier.MemoryTier,
    item_dir: Path,
    step: int,
    owner: int,
    persist_every: int | None = None,
    index: _index.Index | None = None,
) -> PersistJob | None:
    """A job that persists `owner`'s part of the finalized step in `item_dir` from
    `memory`, if `memory` holds it from that very save, it is not durable and (with
    `persist_every`) the step is due; else None. `index` is the step's index when read
    already (not read again)."""
    index = _index.read_index(item_dir) if index is None else index
    recorded = {o: m for o, m in index.items() if o == owner}
    if persist_every is not None and not any(m.is_due(persist_every) for m in recorded.values()):
        return None
    if not _index.memory_parts(memory, step, recorded) - _index.persisted_parts(item_dir, recorded):
        return None
    manifest = memory.read_manifest(step, owner)
    assert manifest is not None  # memory_parts read it
    return PersistJob(
        manifest,
        memory.part_dir(step, owner),
        item_dir,
        item_dir,
        pin=memory.pin(step),
        resumed=True,
    )


class Persister:
    """A single background worker that persists parts in submission order."""

    def __init__(
        self,
        compression: str | None,
        timeout_s: float,
        on_persisted: Callable[[dict[str, Any]], None] | None = None,
        closing: threading.Event | None = None,
        on_failed: Callable[[dict[str, Any]], None] | None = None,
        on_settled: Callable[[], None] | None = None,
    ):
        self._compression = compression
        # Called once a step leaves the queue (persisted or not), before `drain` can
        # return: memory retention may retire it now (`MemoryRetainer.again`).
        self._on_settled = on_settled
        # Set by the handler's close, once the manager has finished: a step not
        # finalized by then never will be, and its job ends instead of waiting.
        self._closing = closing
        self._on_persisted = on_persisted
        self._on_failed = on_failed  # gets a `persist_failed` event per failed job
        self._timeout_s = timeout_s
        self._queue: queue.Queue[PersistJob | None] = queue.Queue()
        self._pending: dict[int, int] = {}  # step -> jobs queued or running
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._cleaned: set[Path] = set()

    def submit(self, job: PersistJob) -> None:
        with self._lock:
            self._pending[job.manifest.step] = self._pending.get(job.manifest.step, 0) + 1
            # IMPORTANT: queued under the lock that the worker holds when it decides to
            # stop, so a job is never left behind by a worker that has just stopped.
            self._queue.put(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="jaxckpt-persist", daemon=True
                )
                self._thread.start()

    def pending_steps(self) -> set[int]:
        """Steps queued or being persisted; memory retention keeps them."""
        with self._lock:
            return set(self._pending)

    def take_errors(self) -> list[BaseException]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def drain(self, timeout_s: float | None = None) -> None:
        """Waits until every submitted job has finished.

        Raises:
          TimeoutError: if jobs are still pending after the timeout.
        """
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        with self._idle:
            if not self._idle.wait_for(lambda: not self._pending, timeout=timeout_s):
                raise TimeoutError(
                    f"Persisting steps {sorted(self._pending)} did not finish within {timeout_s:.0f} s; "
                    "raise TierOptions.timeout_s or check the checkpoint directory's storage."
                )

    def close(self) -> None:
        """Drains the queue and stops the worker.

        Raises:
          TimeoutError: if jobs are still pending after `timeout_s`; the worker
            then keeps running until they are done (and a later `submit` reuses
            it): it is never abandoned with work in hand.
        """
        try:
            self.drain()
        except TimeoutError:
            self._stop_worker(join=False)  # busy: it stops once its queue is done
            raise
        self._stop_worker(join=True)

    def _stop_worker(self, *, join: bool) -> None:
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._queue.put(None)  # stop once the jobs queued before it are done
        if join:
            thread.join(timeout=self._timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                with self._lock:
                    # A job submitted after close() keeps this worker going.
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            metrics = self._run_one(job)
            if metrics is not None and self._on_persisted is not None:
                # The user's metrics callback is no part of persisting: its failure
                # must not turn a durable step into a reported persistence failure.
                try:
                    self._on_persisted(metrics)
                except Exception:
                    log.exception(
                        "jaxckpt: the metrics callback failed on step %d's persist event "
                        "(the step is persisted)",
                        job.manifest.step,
                    )

    def _run_one(self, job: PersistJob) -> dict[str, Any] | None:
        """Persists one job; records its failure. Returns its metrics if it succeeded."""
        try:
            return self._persist(job)
        except _paths.StepNeverFinalized as e:
            # Not a persistence failure: the step's save failed, and said so.
            log.warning("jaxckpt: step %d is not persisted: %s", job.manifest.step, e)
            return None
        except BaseException as e:
            if job.resumed and isinstance(e, FileNotFoundError):
                # Deleted since the restart: nobody restores that step any more.
                log.warning("jaxckpt: resumed persist of step %d dropped: %s", job.manifest.step, e)
                return None
            log.error("jaxckpt: persisting step %d failed: %s", job.manifest.step, e)
            error = OSError(
                f"Persisting step {job.manifest.step} of process {job.manifest.owner} "
                f"into {job.final_item_dir} failed: {e}"
            )
            error.__cause__ = e
            with self._lock:
                self._errors.append(error)
            if self._on_failed is not None:
                failed = {
                    "event": "persist_failed",
                    "process": job.manifest.owner,
                    "step": job.manifest.step,
                    "error": str(e),
                }
                try:
                    self._on_failed(failed)
                except Exception:
                    log.exception("jaxckpt: the callback failed on a persist_failed event")
            return None
        finally:
            if job.pin is not None:
                job.pin.release()
            with self._idle:
                step = job.manifest.step
                self._pending[step] -= 1
                if not self._pending[step]:
                    del self._pending[step]
                    if self._on_settled is not None:
                        self._on_settled()  # only queues work: never waits on this lock
                self._idle.notify_all()

    def _await_commit(self, job: PersistJob) -> None:
        """Waits until the save that queued `job` has ended its commit.

        Raises:
          StepNeverFinalized: if that commit failed (the save said so; not a
            persistence failure).
          TimeoutError: if it does not end within `timeout_s`.
        """
        if job.committed is None:
            return
        step = job.manifest.step
        try:
            ok = job.committed.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"The save of step {step} did not end its commit within {self._timeout_s:.0f} s."
            ) from None
        if not ok:
            raise _paths.StepNeverFinalized(
                f"The save of step {step} failed after its part was in memory (the save "
                "raised why); it is not persisted."
            )

    def _persist(self, job: PersistJob) -> dict[str, Any]:
        if _storage.is_remote(job.final_item_dir):
            return self._persist_to_object_store(job)
        return self._persist_to_filesystem(job)

    def _persist_to_filesystem(self, job: PersistJob) -> dict[str, Any]:
        start = time.perf_counter()
        manifest = job.manifest
        root = job.final_item_dir.parent.parent
        staging = (
            root
            / _paths.STAGING_DIR
            / (
                f"{job.final_item_dir.parent.name}.{job.final_item_dir.name}.p{manifest.owner}.{uuid.uuid4().hex[:8]}"
            )
        )
        if root not in self._cleaned:  # leftovers of this process index's killed predecessor
            suffix = f".p{manifest.owner}."
            _fs.remove_entries(root / _paths.STAGING_DIR, which=lambda p: suffix in p.name)
            self._cleaned.add(root)
        staging.mkdir(parents=True)
        try:
            asyncio.run(
                self._write_arrays(manifest, job.source_part, _zarr.file_kvstore(str(staging)))
            )
            copy_s = time.perf_counter() - start
            manifest = dataclasses.replace(
                manifest, metrics={**manifest.metrics, "persist_s": copy_s}
            )
            (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
            sync_start = time.perf_counter()
            _fs.fsync_tree(staging)
            fsync_s = time.perf_counter() - sync_start
            _faults.maybe_crash("persist_write", manifest.step, manifest.owner)
            self._await_commit(job)
            # A step the manager deleted (its garbage collection, one save later) before
            # this persist ended is persisted into the kept area only (`_kept`).
            gone = False
            if not job.resumed:  # a resumed job's step was finalized before the restart
                try:
                    _paths.wait_finalized(
                        job.item_dir,
                        job.final_item_dir,
                        manifest.step,
                        self._timeout_s,
                        self._closing,
                    )
                except FileNotFoundError:
                    gone = True
            final = job.final_item_dir
            kept = _kept.KeptPart(root, final.parent.name, final.name, manifest.owner)
            try:
                keeping = kept.stage(staging)
                # IMPORTANT: the rename is the durability marker; it comes after every byte
                # of the part and its index manifest is on stable storage, and never
                # recreates a step directory that garbage collection removed.
                if not gone:
                    try:
                        _fs.fsync_path(_index.index_path(final, manifest.owner))
                        part = final / _format.part_dir_name(manifest.owner)
                        _fs.replace_dir(staging, part, make_parents=False)
                        # The new name, and the finalized step's own names, survive a
                        # power loss.
                        _fs.fsync_dirs(final, final.parent, root)
                    except FileNotFoundError:
                        if job.resumed:  # nobody restores that step any more
                            raise FileNotFoundError(
                                f"Step {manifest.step} was deleted before it was persisted."
                            ) from None
                        gone = True
                if gone and not keeping:
                    raise FileNotFoundError(
                        f"Step {manifest.step} was deleted before it was persisted (and "
                        f"{_kept.kept_dir(root)} cannot hold it: no hard links there)."
                    )
                if gone:
                    log.info(
                        "jaxckpt: step %d was deleted by the manager before its persist "
                        "ended; its part is kept in %s",
                        manifest.step,
                        _kept.kept_dir(root),
                    )
                    kept.commit(None, manifest.to_json(), None)
                elif keeping:
                    try:
                        # A step's combined index names every part: the kept part gets its
                        # own index manifest instead (what a per-part index holds).
                        index = _index.index_path(final, manifest.owner)
                        kept.commit(
                            None if index.name == _format.STEP_INDEX_FILE else index,
                            manifest.to_json(),
                            final.parent,
                        )
                    except OSError:  # the step is durable in its directory all the same
                        log.exception(
                            "jaxckpt: keeping a link to step %d's part in %s failed",
                            manifest.step,
                            _kept.kept_dir(root),
                        )
            finally:
                kept.discard()
            _faults.maybe_crash("persist_commit", manifest.step, manifest.owner)
            # fsync_s: flushing the part to stable storage.
            return _persist_metrics(manifest, copy_s, fsync_s=fsync_s)
        finally:
            _fs.remove_entry(staging)

    def _persist_to_object_store(self, job: PersistJob) -> dict[str, Any]:
        start = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        manifest, final = job.manifest, job.final_item_dir
        part = final / _format.part_dir_name(manifest.owner)
        backoff = UPLOAD_BACKOFF_S
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            try:
                self._upload(manifest, job.source_part, part, deadline)
                break
            except Exception as e:
                out_of_time = time.monotonic() + backoff > deadline
                if attempt == UPLOAD_ATTEMPTS or out_of_time:
                    why = "out of time" if out_of_time else "no attempts left"
                    raise OSError(
                        f"Uploading the part of process {manifest.owner} of step {manifest.step} "
                        f"to {part} failed {attempt} time(s) ({why}; TierOptions.timeout_s = "
                        f"{self._timeout_s:.0f} s); the last error: {e}. The step is not "
                        "durable there; check the store's endpoint and credentials."
                    ) from e
                log.warning(
                    "jaxckpt: uploading step %d (attempt %d of %d) failed, retrying in %.1f s: %s",
                    manifest.step,
                    attempt,
                    UPLOAD_ATTEMPTS,
                    backoff,
                    e,
                )
                time.sleep(backoff)
                backoff *= 2
        copy_s = time.perf_counter() - start
        manifest = dataclasses.replace(manifest, metrics={**manifest.metrics, "persist_s": copy_s})
        _faults.maybe_crash("persist_write", manifest.step, manifest.owner)
        self._await_commit(job)
        if not job.resumed:
            _paths.wait_finalized(
                job.item_dir,
                final,
                manifest.step,
                max(deadline - time.monotonic(), 1.0),
                self._closing,
            )
        if not _index.has_index(final):
            raise FileNotFoundError(
                f"Step {manifest.step} was deleted (garbage-collected) before it was persisted."
            )
        # IMPORTANT: the manifest object is the durability marker: written last, after
        # every chunk is stored and the manager has finalized the step.
        _storage.write_object(part / _format.MANIFEST_FILE, manifest.to_json())
        _faults.maybe_crash("persist_commit", manifest.step, manifest.owner)
        return _persist_metrics(manifest, copy_s)

    def _upload(
        self, manifest: _format.PartManifest, source: Path, part: Path, deadline: float
    ) -> None:
        """Uploads every chunk of a part (not its manifest), all concurrently, by `deadline`.

        The upload runs on a thread of its own: a store that stops answering holds
        tensorstore's requests open with no timeout of their own, and waiting for
        them to be cancelled could take as long. At the deadline this gives up on
        it; its writes may still land later, but without a manifest the part is
        never read, and a later attempt removes the manifest before rewriting.

        Raises:
          TimeoutError: if the upload is not done by `deadline`.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"No time was left to upload step {manifest.step}.")
        outcome: list[BaseException | None] = []

        def upload() -> None:
            try:
                # IMPORTANT: a manifest left by an earlier attempt (or save) of this part is
                # removed before anything else of it: it must never vouch for chunks being
                # rewritten.
                _storage.delete_objects(part, [_format.MANIFEST_FILE])
                # The arrays are created anew (`empty`): the chunks the manifest lists are
                # rewritten, and no other chunk is ever read.
                _storage.delete_objects(
                    part,
                    [
                        f"{_format.ARRAYS_DIR}/{manifest.leaves[leaf].array_key}/zarr.json"
                        for leaf in manifest.chunks
                    ],
                )
                asyncio.run(
                    self._write_arrays(manifest, source, _storage.kvstore(part), empty=True)
                )
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=upload, name="jaxckpt-upload", daemon=True)
        thread.start()
        thread.join(timeout=remaining)
        if thread.is_alive():
            raise TimeoutError(
                f"The upload did not finish within {remaining:.1f} s (TierOptions.timeout_s)."
            )
        if outcome[0] is not None:
            raise outcome[0]

    async def _write_arrays(
        self,
        manifest: _format.PartManifest,
        source: Path,
        dst: dict[str, Any],
        *,
        empty: bool = False,
    ) -> None:
        """Writes every chunk of a memory part's slab into the part's zarr3 arrays at `dst`,
        from views of the slab (no copy on the way), each verified first.

        Raises:
          ValueError: if a chunk does not match its checksum (nothing of it is written).
        """
        slab = _slab.Reader(source / _slab.SLAB_FILE)
        views: dict[int, list[tuple[tuple[int, ...], np.ndarray]]] = {}
        for leaf, chunks in manifest.chunks.items():
            record = manifest.leaves[leaf]
            for chunk in chunks:
                view = _readers.chunk_view(slab, record, chunk)
                if not _checksum.matches(chunk.crc32c, chunk.crc32, view):
                    raise ValueError(
                        f"Chunk {chunk.index} of leaf {record.path} in {source} does not match "
                        "its checksum; the part was not persisted."
                    )
                views.setdefault(leaf, []).append((chunk.index, view))
        await _zarr.settle(
            [
                _zarr.write_chunks(
                    _zarr.array_kvstore(dst, manifest.leaves[leaf]),
                    manifest.leaves[leaf],
                    data,
                    self._compression,
                    empty=empty,
                    crc32c=True,
                    attributes=_format.array_attributes(
                        manifest.leaves[leaf],
                        manifest.step,
                        manifest.owner,
                        manifest.shardings.get(leaf),
                    ),
                )
                for leaf, data in views.items()
            ]
        )


def _persist_metrics(
    manifest: _format.PartManifest, copy_s: float, **extra: float
) -> dict[str, Any]:
    """The `persist` event of one part; `copy_s` is the time spent copying (or
    uploading) and verifying its chunks, as recorded in the part's manifest."""
    return {
        "event": "persist",
        "step": manifest.step,
        "process": manifest.owner,
        "bytes": manifest.nbytes,
        "persist_s": copy_s,
        "persist_bytes_per_s": manifest.nbytes / max(copy_s, 1e-9),
        **extra,
    }
