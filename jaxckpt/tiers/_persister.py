"""Lazy persistence: the queue that copies committed memory parts to the checkpoint directory.

Runs on its own thread and queue so that a slow persistent store never holds up
the next `mngr.save()` (the manager waits for the previous save's commit
futures, and persistence is not one of them). Each job (`_persist_job.PersistJob`)
is handed to the store its checkpoint directory lies on (`_store.at`), which
writes the part and makes it durable the way that store needs (`_file_store`:
fsync and one rename; `_object_store`: concurrent uploads with the part's
manifest written last). This module keeps only the queue: submission order, what
is pending, failures and the events they report.

One worker thread at a time: `close` stops it once the queue is empty; if it
is still busy when `close` gives up waiting, it finishes its jobs and a later
`submit` hands it more rather than starting a second worker.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from absl import logging as log

from jaxckpt import _faults
from jaxckpt.tiers import _index, _memory_tier, _step_dirs, _step_gate, _store
from jaxckpt.tiers._persist_job import PersistJob


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
    recorded = {owner: index[owner]} if owner in index else {}
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
    """A single background worker that persists parts in submission order, each on the
    store its checkpoint directory lies on (`store_at`: `_store.at`, or a unit test's)."""

    def __init__(
        self,
        compression: str | None,
        timeout_s: float,
        on_persisted: Callable[[dict[str, Any]], None] | None = None,
        closing: threading.Event | None = None,
        on_failed: Callable[[dict[str, Any]], None] | None = None,
        on_settled: Callable[[], None] | None = None,
        store_at: Callable[[Path], _store.PersistentStore] = _store.at,
    ):
        self._compression = compression
        self._store_at = store_at  # the store a job's checkpoint directory lies on
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
        """Steps queued or being persisted, or with a persisted part waiting to enter its
        step directory (`_step_gate`); memory retention keeps them."""
        with self._lock:
            pending = set(self._pending)
        return pending | _step_gate.waiting_steps()

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
        except (_step_dirs.StepNeverFinalized, _step_dirs.StepDeleted) as e:
            # Not a persistence failure: the step's save failed, and said so, or the
            # manager's options let the step go.
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

    def _persist(self, job: PersistJob) -> dict[str, Any]:
        """Persists one job on its store; its `persist` event."""
        _faults.at("persist_begin", job.manifest.step, job.manifest.owner)
        return self._store_at(job.final_item_dir).persist(
            job, compression=self._compression, timeout_s=self._timeout_s, closing=self._closing
        )
