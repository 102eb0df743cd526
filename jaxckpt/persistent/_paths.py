"""What an Orbax item directory tells us: the step, the final path, the run, the store.

`ItemDir.parse` reads it once, where a save or a restore enters the handler; the
value is passed down, so nothing below derives these facts from the path again.
It carries the persistent store the directory lies on (`_store.at`, asked once):
which steps are finalized and how often a wait looks again are the store's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import threading
from pathlib import Path

from jaxckpt.coord import _multihost
from jaxckpt.persistent import _step_dirs, _storage, _store

# A run id names a directory in the memory root and a URL segment of the peer
# service: no '/', and not '.' or '..' (the first character is a letter or digit).
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


@dataclasses.dataclass(frozen=True)
class ItemDir:
    """One item directory `<root>/<step>/<item>` of a CheckpointManager, parsed once.

    Attributes:
      path: the directory as the manager named it (temporary while it saves).
      final: its name once the manager has finalized the step.
      root: the manager's directory (the parent of the step directories).
      item: the item's name, without Orbax's temporary suffix.
      step: the step its parent directory names, or None.
      store: the persistent store it lies on (chosen once, here).
    """

    path: Path
    final: Path
    root: Path
    item: str
    step: int | None
    store: _store.PersistentStore

    @classmethod
    def parse(cls, directory: os.PathLike[str] | str) -> ItemDir:
        path = _storage.as_path(directory)
        final = (
            path.parent.parent
            / _step_dirs.strip_tmp(path.parent.name)
            / _step_dirs.strip_tmp(path.name)
        )
        return cls(
            path=path,
            final=final,
            root=path.parent.parent,
            item=final.name,
            step=_step_dirs.step_of_name(path.parent.name),
            store=_store.at(path),
        )

    @functools.cached_property
    def default_run_id(self) -> str:
        """`default_run_id` of this item's checkpoint directory (computed once)."""
        return default_run_id(self.path)

    def run_id(self, configured: str | None, recorded: str | None = None) -> str:
        """The run id whose memory tier holds this item's copies (see `run_id`)."""
        if recorded and is_valid_run_id(recorded):
            return recorded
        return configured or self.default_run_id

    def require_step(self, explicit: int | None = None) -> int:
        """`explicit` if given, else the step the directory names.

        Raises:
          ValueError: if there is neither, saying how to save through a manager.
        """
        step = explicit if explicit is not None else self.step
        if step is None:
            raise ValueError(
                f"[process {_multihost.process_index()}] Cannot tell the step of {self.path}: "
                "jaxckpt saves through ocp.CheckpointManager, whose step directories are named "
                "by step (flax.training.checkpoints.save_checkpoint(_multiprocess)(..., "
                "orbax_checkpointer=...) is not supported). Use mngr = ocp.CheckpointManager("
                'ckpt_dir, item_handlers={"train": handler}); mngr.save(step, args='
                "ocp.args.Composite(train=jaxckpt.TieredSave(state))), or pass "
                "TieredSave(state, step=...) to a bare Checkpointer."
            )
        return step

    def tag(self, verb: str, configured_run_id: str | None) -> str:
        """The exchange tag of a save or restore of this item: the same on every process,
        and apart for every checkpoint directory and item (their commits run concurrently)."""
        return f"{verb}/{configured_run_id or self.default_run_id}/{self.item}"

    def finalized_steps(self) -> dict[int, Path]:
        """step -> final item directory, for every finalized step of this item."""
        return _step_dirs.with_item(self.store.step_dirs(self.root), self.item)

    def wait_finalized(
        self,
        step: int,
        timeout_s: float,
        given_up: threading.Event | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        """`_step_dirs.wait_finalized` for this item directory, on its store."""
        _step_dirs.wait_finalized(
            self.path, self.final, step, timeout_s, given_up, self.store.poll_s, wake
        )


def is_valid_run_id(run_id: object) -> bool:
    """Whether `run_id` can name a run directory (and the peer service's URL segment)."""
    return isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id) is not None


def final_item_dir(directory: os.PathLike | str) -> Path:
    """The item directory as it will be named once the manager finalizes the step."""
    directory = _storage.as_path(directory)
    return (
        directory.parent.parent
        / _step_dirs.strip_tmp(directory.parent.name)
        / _step_dirs.strip_tmp(directory.name)
    )


def step_of(directory: os.PathLike | str) -> int | None:
    """The step number of an item directory `<root>/<step>/<item>`, if it has one."""
    return _step_dirs.step_of_name(_storage.as_path(directory).parent.name)


def checkpoint_root(directory: os.PathLike | str) -> Path:
    """The CheckpointManager's directory (the parent of the step directories)."""
    return _storage.as_path(directory).parent.parent


def default_run_id(directory: os.PathLike | str) -> str:
    """A run id derived from the checkpoint root: stable across restarts of a job.

    The root's real path (or URL, on an object store) is hashed, so every
    spelling of a local root (a symlink, a relative path, `..`) gives the same run id.
    An absolute root is resolved once per process (every save asks).
    """
    root = checkpoint_root(directory)
    if not root.is_absolute() and not _storage.is_remote(root):
        return _run_id_of(_storage.identity(root))
    return _run_id_of_root(str(root))


@functools.lru_cache(maxsize=64)
def _run_id_of_root(root: str) -> str:
    return _run_id_of(_storage.identity(root))


def _run_id_of(identity: str) -> str:
    return "run-" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def run_id(directory: os.PathLike | str, configured: str | None, recorded: str | None) -> str:
    """The run id whose memory tier holds the copies of the step in `directory`.

    `recorded` (from the step's index manifest, when restoring) wins: the copies
    carry it, whatever the directory is called now and however the run id was
    chosen then. Else `configured` (`TierOptions.run_id`), else `default_run_id`.
    An invalid recorded id (a damaged manifest) is ignored.
    """
    if recorded and is_valid_run_id(recorded):
        return recorded
    return configured or default_run_id(directory)


def finalized_steps(root: Path, item: str) -> dict[int, Path]:
    """step -> item directory `<root>/<step>/<item>` for every finalized step holding
    `item` (which steps are finalized is the store's: `_store.PersistentStore.step_dirs`)."""
    return _step_dirs.with_item(_store.at(root).step_dirs(root), item)
