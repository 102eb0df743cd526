"""The persistent tier on a filesystem (`_store.PersistentStore`'s local implementation).

A persisted part becomes visible only by renaming a complete staging directory
(`<ckpt>/.jaxckpt-staging/...`) to `<item_dir>/part_<owner>`: its existence is
the durability marker, so every file and directory of the part (and the owner's
index manifest) is fsynced before that rename, and the directories above it
after. Before the rename the part is hard-linked into the kept area (`_kept`),
which keeps the newest durable step out of the manager's reach; a step the
manager deleted before its persist ended is persisted there only. The rename waits
for a moment the manager deletes nothing (`_step_gate`) when a newer save has begun.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from absl import logging as log

from jaxckpt import _faults, _resources
from jaxckpt.format import _format
from jaxckpt.tiers import _fs, _index, _kept, _persist_job, _step_dirs, _step_gate, _zarr

# Checkpoint directories whose staging leftovers of this process index's killed
# predecessor were removed (once, at this process's first persist there).
_CLEANED: set[Path] = _resources.SHARED.cache(set())
# (item dir, inode and ctime of its first part) found durable: durable for as long as
# that part exists (a step deleted and saved again has a new part).
_DURABLE: set[tuple[Path, int, int]] = _resources.SHARED.cache(set())


@dataclasses.dataclass(frozen=True)
class FileStore:
    """A checkpoint directory on a (POSIX) filesystem."""

    remote = False
    keeps_durable_step = True  # the kept area (`_kept`), by hard links
    poll_s = 0.02
    read_timeout_s = None

    def persist(
        self,
        job: _persist_job.PersistJob,
        *,
        compression: str | None,
        timeout_s: float,
        closing: threading.Event | None,
    ) -> dict[str, Any]:
        """Persists `job`'s part: staged, fsynced, renamed into place (see the module)."""
        start = time.perf_counter()
        manifest = job.manifest
        final = job.final_item_dir
        root = final.parent.parent
        staging = (
            root
            / _step_dirs.STAGING_DIR
            / f"{final.parent.name}.{final.name}.p{manifest.owner}.{uuid.uuid4().hex[:8]}"
        )
        if root not in _CLEANED:  # leftovers of this process index's killed predecessor
            suffix = f".p{manifest.owner}."
            _fs.remove_entries(root / _step_dirs.STAGING_DIR, which=lambda p: suffix in p.name)
            _CLEANED.add(root)
        staging.mkdir(parents=True)
        placing = False  # True once the staging directory belongs to its placement
        try:
            asyncio.run(
                _persist_job.write_chunks(
                    manifest, job.source_part, _zarr.file_kvstore(str(staging)), compression
                )
            )
            copy_s = time.perf_counter() - start
            manifest = _persist_job.with_persist_time(manifest, copy_s)
            (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
            sync_start = time.perf_counter()
            _fs.fsync_tree(staging)
            fsync_s = time.perf_counter() - sync_start
            _faults.at("persist_write", manifest.step, manifest.owner)
            job.await_commit(timeout_s)
            # A step the manager deleted (its garbage collection, one save later) before
            # this persist ended is persisted into the kept area only (`_kept`).
            gone = False
            if not job.resumed:  # a resumed job's step was finalized before the restart
                try:
                    _step_dirs.wait_finalized(
                        job.item_dir, final, manifest.step, timeout_s, closing, self.poll_s
                    )
                except FileNotFoundError:
                    gone = True
            placing = self._commit(job, manifest, staging, gone)
            _faults.at("persist_commit", manifest.step, manifest.owner)
            # fsync_s: flushing the part to stable storage.
            return _persist_job.persist_metrics(manifest, copy_s, fsync_s=fsync_s)
        finally:
            if not placing:
                _fs.remove_entry(staging)

    def _commit(
        self,
        job: _persist_job.PersistJob,
        manifest: _format.PartManifest,
        staging: Path,
        gone: bool,
    ) -> bool:
        """Renames the complete, fsynced part `staging` into the kept area and (unless
        its step is `gone`) into place, now or, when a newer save has begun, at the
        next moment the manager deletes nothing (`_step_gate`).

        Returns:
          Whether the placement waits: it then owns `staging` and removes it.
        """
        final = job.final_item_dir
        root = final.parent.parent
        kept = _kept.KeptPart(root, final.parent.name, final.name, manifest.owner)
        try:
            keeping = kept.stage(staging)
            waits = False
            if not gone:
                waits = not _step_gate.enter(
                    root, manifest.step, lambda: self._place(job, manifest, staging)
                )
                # Placed now, or found its step gone.
                gone = not waits and not self.is_persisted(final, manifest.owner)
            if gone and job.resumed:  # nobody restores that step any more
                raise FileNotFoundError(
                    f"Step {manifest.step} was deleted before it was persisted."
                )
            if gone and not keeping:
                raise _step_dirs.StepDeleted(
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
            return waits
        finally:
            kept.discard()

    def _place(
        self, job: _persist_job.PersistJob, manifest: _format.PartManifest, staging: Path
    ) -> None:
        """Renames the part `staging` into its step directory, if the step still
        exists, and removes what is left of `staging`."""
        final = job.final_item_dir
        # IMPORTANT: the rename is the durability marker; it comes after every byte
        # of the part and its index manifest is on stable storage, and never
        # recreates a step directory that garbage collection removed.
        try:
            _fs.fsync_path(_index.index_path(final, manifest.owner))
            part = final / _format.part_dir_name(manifest.owner)
            _fs.replace_dir(staging, part, make_parents=False)
            # The new name, and the finalized step's own names, survive a power loss.
            _fs.fsync_dirs(final, final.parent, final.parent.parent)
        except FileNotFoundError:
            log.info(
                "jaxckpt: step %d was deleted by the manager before its part entered "
                "its step directory",
                manifest.step,
            )
        finally:
            _fs.remove_entry(staging)

    def begin_save(self, root: Path, step: int) -> None:
        """From now on parts of older steps of `root` wait (`_step_gate.begin`)."""
        _step_gate.begin(root, step)

    def settle(self, root: Path) -> bool:
        """The waiting parts of `root` enter their step directories (`_step_gate.settle`)."""
        return _step_gate.settle(root)

    def is_persisted(self, item_dir: Path, owner: int) -> bool:
        """Whether `owner`'s part of the step is durable: its directory exists (renamed
        into place when complete)."""
        return (item_dir / _format.part_dir_name(owner)).is_dir()

    def is_durable(self, item_dir: Path) -> bool:
        """Whether every process's part of the step in `item_dir` is persisted."""
        try:
            first = os.stat(item_dir / _format.part_dir_name(0))  # cheap: most steps have none
        except OSError:
            return False
        key = (item_dir, first.st_ino, first.st_ctime_ns)
        if key in _DURABLE:
            return True
        count = _index.part_count(item_dir)
        if count is None:
            return False
        if all(self.is_persisted(item_dir, p) for p in range(count)):
            _DURABLE.add(key)
            return True
        return False

    def step_dirs(self, root: Path) -> dict[int, Path]:
        """step -> step directory, every step the manager finalized (renamed)."""
        return _step_dirs.step_dirs(root)

    def kept_step(self, root: Path, items: list[str]) -> int | None:
        """The newest step in the kept area that is complete for every item of `items`."""
        newest = _kept.newest_complete(root, items)
        return None if newest is None else newest[0]

    def reinstate(self, root: Path, items: list[str]) -> int | None:
        """Puts the newest complete kept step back as a step directory (`_kept.reinstate`)."""
        return _kept.reinstate(root, items)

    def retire(self, root: Path, items: list[str], steps: list[int]) -> None:
        """Nothing: a part's directory is its durability marker and goes with its step."""

    def old_steps_only(self, root: Path, item: str) -> bool:
        """Whether `root` holds finalized steps of another kind (an Orbax or flax
        checkpoint of the loop before jaxckpt) and no durable step of `item`, neither
        kept nor in place."""
        if not root.is_dir() or self.kept_step(root, [item]) is not None:
            return False
        ours = _step_dirs.with_item(self.step_dirs(root), item)
        if any(self.is_durable(ours[s]) for s in sorted(ours, reverse=True)):
            return False
        return any(
            not name.startswith(".")
            and not _step_dirs.is_temporary(name)
            and _step_dirs.step_of_name(name) is not None
            and not _index.has_index(root / name / item)
            for name in os.listdir(root)
        )
