"""The persistent-store seam: one protocol, a filesystem and an object-store implementation.

The checkpoint directory a CheckpointManager hands the handler is a local path or
a URL (`gs://bucket/...`, `s3://bucket/...`). `at(path)` chooses, from the path
alone, the `PersistentStore` of the place where it lies: `_file_store.FileStore`
or `_object_store.ObjectStore`. Everything that differs between the two is a
member of the protocol, named for what it does: how a part is written and made
durable, whether a part or a step is persisted, which steps the manager has
finalized, how steps are kept from and put back after the manager's garbage
collection, how a step is retired, how often a wait looks again and how long a
read may go unanswered. Nothing outside the storage modules asks which kind of
store a path is on.

What is the same on both stays below the seam: bytes read, written whole and
looked for through `_storage` (a file or one object request), the step index
(`_index`), the zarr3 arrays (`_zarr`), the names of step directories and the wait
for the manager's finalization (`_step_dirs`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Protocol

from jaxckpt.persistent import _file_store, _object_store, _persist_job, _storage


class PersistentStore(Protocol):
    """Where the persistent tier lives, and what is done there the way that place needs.

    Every method takes the paths it acts on: a checkpoint directory `root`, an item
    directory `<root>/<step>/<item>`, or a persistence job.
    """

    @property
    def remote(self) -> bool:
        """Whether the store is reached over the network (an object store): what
        reports say, never a reason to branch."""
        ...

    @property
    def keeps_durable_step(self) -> bool:
        """Whether the store keeps the newest durable step out of the manager's reach
        itself (a filesystem's kept area, by hard links); elsewhere the manager's
        policy must (`jaxckpt.manager_options(url, handler=...)`)."""
        ...

    @property
    def poll_s(self) -> float:
        """How long a wait on the store (the manager's finalization) sleeps between looks."""
        ...

    @property
    def read_timeout_s(self) -> float | None:
        """How long one read may go unanswered before it counts as failed; None where
        every read answers (a local filesystem)."""
        ...

    def persist(
        self,
        job: _persist_job.PersistJob,
        *,
        compression: str | None,
        timeout_s: float,
        closing: threading.Event | None,
    ) -> dict[str, Any]:
        """Writes `job`'s part and makes it durable once the save's commit has succeeded
        and the manager has finalized the step; returns its `persist` event.

        `closing` is set when the manager has finished (no finalization can come).

        Raises:
          StepNeverFinalized: if the save failed after its part was in memory.
          StepDeleted: if the manager deleted the step before it could be persisted
            and the store cannot keep the part elsewhere (the manager's choice: the
            persister logs it, no failure; an object store removes what it uploaded).
          FileNotFoundError: if a resumed job's step was deleted.
          OSError, TimeoutError, ValueError: if writing failed (a chunk that does not
            match its checksum, a store that does not answer within `timeout_s`).
        """
        ...

    def begin_save(self, root: Path, step: int) -> None:
        """A save of `step` into `root` begins on this process: from now on a part of an
        older step waits to enter its step directory until `settle` (`_step_gate`,
        filesystems); the manager may delete older steps once the save's commit ends."""
        ...

    def settle(self, root: Path) -> bool:
        """The manager of `root` deletes nothing now: the parts that waited to enter
        their step directories enter now. Returns whether any did."""
        ...

    def is_persisted(self, item_dir: Path, owner: int) -> bool:
        """Whether `owner`'s part of the step in `item_dir` is durable."""
        ...

    def is_durable(self, item_dir: Path) -> bool:
        """Whether every process's part of the step in `item_dir` is persisted."""
        ...

    def step_dirs(self, root: Path) -> dict[int, Path]:
        """step -> step directory, for every step of `root` the manager has finalized
        (one listing; a step directory need not hold a given item)."""
        ...

    def kept_step(self, root: Path, items: list[str]) -> int | None:
        """The newest step kept out of the manager's reach that is complete for every
        item of `items`, or None."""
        ...

    def reinstate(self, root: Path, items: list[str]) -> int | None:
        """Puts the newest kept step of `items` back as a step directory of `root` if the
        manager deleted it and no newer step is durable; the step, or None."""
        ...

    def retire(self, root: Path, items: list[str], steps: list[int]) -> None:
        """Prepares `steps` of `items` for the manager's deletion, so that no reader
        meets a part that looks durable while it is being deleted."""
        ...

    def old_steps_only(self, root: Path, item: str) -> bool:
        """Whether `root` holds finalized steps of another kind (an Orbax or flax
        checkpoint of the loop before jaxckpt) and no durable step of `item`, kept or in
        place (`Keeper.switching_in`; judged on a filesystem, False on an object store)."""
        ...


def at(path: str | os.PathLike[str]) -> PersistentStore:
    """The store of the place where `path` (a checkpoint, step or item directory) lies."""
    scheme = _storage.scheme(path)
    if scheme is None:
        return _file_store.FileStore()
    return _object_store.ObjectStore(scheme)
