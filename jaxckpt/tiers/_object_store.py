"""The persistent tier on an object store, gs:// or s3:// (`_store.PersistentStore`).

An object store has no rename and no hard links. A part's chunks are uploaded
straight into `<item_dir>/part_<owner>/` (concurrently, with tensorstore), and the
part's manifest object, written last once the manager has finalized the step (its
commit file exists), is the durability marker: readers ignore a part without one.
A failed upload is retried with backoff within `timeout_s`. The manager finalizes a
step with a commit file, so a step directory without one is not finalized. Before
the manager deletes a step, the policy that guards it deletes the step's part
manifests first (`retire`). No kept area: the manager itself keeps the newest
durable step, built with `jaxckpt.manager_options(url, handler=handler, ...)`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

from absl import logging as log

from jaxckpt import _faults
from jaxckpt.format import _format
from jaxckpt.tiers import _index, _persist_job, _step_dirs, _storage

# Attempts at uploading a part (each request is also retried by tensorstore), and the
# first wait between them (doubled after each failure).
UPLOAD_ATTEMPTS = int(os.environ.get("JAXCKPT_UPLOAD_ATTEMPTS", "3"))
UPLOAD_BACKOFF_S = 0.5


@dataclasses.dataclass(frozen=True)
class ObjectStore:
    """A checkpoint directory on an object store (`scheme`: 'gs' or 's3')."""

    scheme: str
    remote = True
    keeps_durable_step = False  # no hard links: the manager's policy keeps it
    poll_s = 0.1  # a look is a request
    # A chunk read (or array open) that gets no answer within this is reported
    # unreadable, and the rest of that copy is not read (tensorstore's requests have
    # no timeout of their own); as long as a restore waits by default.
    read_timeout_s = 120.0

    def persist(
        self,
        job: _persist_job.PersistJob,
        *,
        compression: str | None,
        timeout_s: float,
        closing: threading.Event | None,
    ) -> dict[str, Any]:
        """Persists `job`'s part: every chunk uploaded, then its manifest (see the module)."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        manifest, final = job.manifest, job.final_item_dir
        part = final / _format.part_dir_name(manifest.owner)
        self._upload_with_retries(manifest, job.source_part, part, deadline, compression, timeout_s)
        copy_s = time.perf_counter() - start
        manifest = _persist_job.with_persist_time(manifest, copy_s)
        _faults.at("persist_write", manifest.step, manifest.owner)
        job.await_commit(timeout_s)
        try:
            if not job.resumed:
                _step_dirs.wait_finalized(
                    job.item_dir,
                    final,
                    manifest.step,
                    max(deadline - time.monotonic(), 1.0),
                    closing,
                    self.poll_s,
                )
            if not _index.has_index(final):
                raise FileNotFoundError(final)
        except FileNotFoundError:
            # The manager deleted the step meanwhile: what was uploaded under it goes too.
            removed = _storage.delete_tree(part)
            raise _step_dirs.StepDeleted(
                f"Step {manifest.step} was deleted by the manager before it was persisted "
                f"({removed} objects uploaded for it removed): its options let it go. To "
                "keep the newest durable step, build the manager with "
                "jaxckpt.manager_options(url, handler=handler, ...)."
            ) from None
        # IMPORTANT: the manifest object is the durability marker: written last, after
        # every chunk is stored and the manager has finalized the step.
        _storage.write_object(part / _format.MANIFEST_FILE, manifest.to_json())
        _faults.at("persist_commit", manifest.step, manifest.owner)
        return _persist_job.persist_metrics(manifest, copy_s)

    def _upload_with_retries(
        self,
        manifest: _format.PartManifest,
        source: Path,
        part: Path,
        deadline: float,
        compression: str | None,
        timeout_s: float,
    ) -> None:
        """`_upload`, tried again with backoff after a failure while attempts and time
        are left.

        Raises:
          OSError: naming the attempts and the last error, once none is left.
        """
        backoff = UPLOAD_BACKOFF_S
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            try:
                self._upload(manifest, source, part, deadline, compression)
                return
            except Exception as e:
                out_of_time = time.monotonic() + backoff > deadline
                if attempt == UPLOAD_ATTEMPTS or out_of_time:
                    why = "out of time" if out_of_time else "no attempts left"
                    raise OSError(
                        f"Uploading the part of process {manifest.owner} of step {manifest.step} "
                        f"to {part} failed {attempt} time(s) ({why}; TierOptions.timeout_s = "
                        f"{timeout_s:.0f} s); the last error: {e}. The step is not "
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

    def _upload(
        self,
        manifest: _format.PartManifest,
        source: Path,
        part: Path,
        deadline: float,
        compression: str | None,
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
                    _persist_job.write_chunks(
                        manifest, source, _storage.kvstore(part), compression, empty=True
                    )
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

    def begin_save(self, root: Path, step: int) -> None:
        """Nothing: a part is uploaded object by object, and deleting a step's objects
        never fails on an upload made meanwhile (it may leave that upload behind)."""

    def settle(self, root: Path) -> bool:
        """Nothing: no part waits (`begin_save`)."""
        return False

    def is_persisted(self, item_dir: Path, owner: int) -> bool:
        """Whether `owner`'s part of the step is durable: its manifest (written last) exists."""
        return (item_dir / _format.part_dir_name(owner) / _format.MANIFEST_FILE).exists()

    def is_durable(self, item_dir: Path) -> bool:
        """Whether every process's part of the step in `item_dir` is persisted (objects
        have no inode to remember a durable step by, so nothing is cached)."""
        count = _index.part_count(item_dir)
        try:
            return count is not None and all(self.is_persisted(item_dir, p) for p in range(count))
        except OSError:
            return False

    def step_dirs(self, root: Path) -> dict[int, Path]:
        """step -> step directory, every step the manager finalized (its commit file exists)."""
        return _step_dirs.step_dirs(root, lambda p: (p / _step_dirs.COMMIT_FILE).exists())

    def kept_step(self, root: Path, items: list[str]) -> int | None:
        """None: an object store has no kept area."""
        return None

    def reinstate(self, root: Path, items: list[str]) -> int | None:
        """None: an object store has no kept area (the manager's policy kept the step)."""
        return None

    def retire(self, root: Path, items: list[str], steps: list[int]) -> None:
        """Deletes the part manifests of `steps` of `items` under the checkpoint
        directory `root`, before the manager deletes the steps' other objects.

        IMPORTANT: a part's manifest is its durability marker here, and deleting a
        prefix is one request per object in no given order: without its manifest
        first, a reader could meet a part that still looks durable while its chunks
        vanish.
        """
        if not steps:
            return
        for item in items:
            item_dirs = _step_dirs.with_item(self.step_dirs(root), item)
            for step in steps:
                if step not in item_dirs:
                    continue
                count = _index.part_count(item_dirs[step])
                if count is None:
                    continue  # no index: nothing of this step was ever persisted
                manifests = [
                    f"{_format.part_dir_name(p)}/{_format.MANIFEST_FILE}" for p in range(count)
                ]
                _storage.delete_objects(item_dirs[step], manifests)

    def old_steps_only(self, root: Path, item: str) -> bool:
        """False: the switch from an old directory is judged on filesystems only (as
        before this seam); a first save on an object store is persisted when due."""
        return False
