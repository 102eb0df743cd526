"""What an Orbax item directory tells us: the step, the final path, the run.

`ItemDir.parse` reads it once, where a save or a restore enters the handler; the
value is passed down, so nothing below derives these facts from the path again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import threading
import time
from pathlib import Path

import orbax.checkpoint as ocp

from jaxckpt.coord import _multihost
from jaxckpt.tiers import _storage

# CheckpointManager writes into `<root>/<step>.orbax-checkpoint-tmp[-<n>]/<item>.orbax-checkpoint-tmp[-<n>]`
# and renames both to `<root>/<step>/<item>` when the step is finalized (on object stores it
# writes a commit file instead: the item directory has its final name from the start). Step names are Orbax's: `<step>` or `<prefix>_<step>`.
STAGING_DIR = ".jaxckpt-staging"
# What the manager writes into a step directory to finalize it where it cannot rename
# (object stores: `ocp.path.atomicity.CommitFileTemporaryPath`).
COMMIT_FILE = "commit_success.txt"

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
      remote: whether it lies on an object store.
    """

    path: Path
    final: Path
    root: Path
    item: str
    step: int | None
    remote: bool

    @classmethod
    def parse(cls, directory: os.PathLike[str] | str) -> ItemDir:
        path = _storage.as_path(directory)
        final = path.parent.parent / strip_tmp(path.parent.name) / strip_tmp(path.name)
        return cls(
            path=path,
            final=final,
            root=path.parent.parent,
            item=final.name,
            step=step_of_name(path.parent.name),
            remote=_storage.is_remote(path),
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
        return finalized_steps(self.root, self.item)

    def wait_finalized(
        self, step: int, timeout_s: float, given_up: threading.Event | None = None
    ) -> None:
        """`wait_finalized` for this item directory."""
        wait_finalized(self.path, self.final, step, timeout_s, given_up)


def is_valid_run_id(run_id: object) -> bool:
    """Whether `run_id` can name a run directory (and the peer service's URL segment)."""
    return isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id) is not None


def is_temporary(name: str) -> bool:
    """Whether `name` is a step or item directory the manager has not finalized yet."""
    return ocp.path.step.TMP_DIR_SUFFIX in name


def strip_tmp(name: str) -> str:
    """`5.orbax-checkpoint-tmp-123` -> `5`; a finalized name is returned unchanged."""
    index = name.find(ocp.path.step.TMP_DIR_SUFFIX)
    return name if index == -1 else name[:index]


def step_of_name(name: str) -> int | None:
    """The step of a step directory's name (finalized or temporary), if it names one."""
    try:
        return ocp.path.step.step_from_checkpoint_name(name)
    except ValueError:
        return None


def final_item_dir(directory: os.PathLike | str) -> Path:
    """The item directory as it will be named once the manager finalizes the step."""
    directory = _storage.as_path(directory)
    return directory.parent.parent / strip_tmp(directory.parent.name) / strip_tmp(directory.name)


def step_of(directory: os.PathLike | str) -> int | None:
    """The step number of an item directory `<root>/<step>/<item>`, if it has one."""
    return step_of_name(_storage.as_path(directory).parent.name)


def checkpoint_root(directory: os.PathLike | str) -> Path:
    """The CheckpointManager's directory (the parent of the step directories)."""
    return _storage.as_path(directory).parent.parent


def default_run_id(directory: os.PathLike | str) -> str:
    """A run id derived from the checkpoint root: stable across restarts of a job.

    The root's real path (or URL, on an object store) is hashed, so every
    spelling of a local root (a symlink, a relative path, `..`) gives the same run id.
    """
    root = _storage.identity(checkpoint_root(directory))
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]


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


def sibling_steps(directory: os.PathLike | str) -> dict[int, Path]:
    """step -> final item directory for every finalized step next to `directory`."""
    directory = _storage.as_path(directory)
    return finalized_steps(checkpoint_root(directory), strip_tmp(directory.name))


def finalized_steps(root: Path, item: str) -> dict[int, Path]:
    """step -> item directory `<root>/<step>/<item>` for every finalized step holding `item`.

    On an object store a step is finalized once its commit file exists.
    """
    out = {}
    remote = _storage.is_remote(root)
    if root.is_dir():
        for p in root.iterdir():
            if is_temporary(p.name) or p.name.startswith("."):
                continue
            step = step_of_name(p.name)
            if step is None or (remote and not (p / COMMIT_FILE).exists()):
                continue
            if (p / item).is_dir():
                out[step] = p / item
    return out


def is_finalized(item_dir: Path, final_item_dir: Path) -> bool:
    """Whether the manager has finalized the step of `item_dir`: renamed it to
    `final_item_dir`, or (when it writes into the final name from the start, as on
    object stores) written the step's commit file."""
    if item_dir == final_item_dir:
        return _storage.exists(final_item_dir.parent / COMMIT_FILE)
    return final_item_dir.is_dir()


class StepNeverFinalized(OSError):
    """The manager finished without finalizing a step: its save failed."""


def wait_finalized(
    item_dir: Path,
    final_item_dir: Path,
    step: int,
    timeout_s: float,
    given_up: threading.Event | None = None,
) -> None:
    """Waits until the manager has finalized the step `item_dir` (`is_finalized`).

    `given_up` is set when no finalization can come any more (the manager has
    finished and is closing the handler): the wait then ends at once.

    Raises:
      FileNotFoundError: if the step vanished instead (the save failed, or
        garbage collection removed it).
      StepNeverFinalized: if `given_up` is set before the step is finalized (its
        save failed after the handler's part was written).
      TimeoutError: if it is not finalized within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    final_step, tmp_step = final_item_dir.parent, item_dir.parent
    poll_s = 0.1 if _storage.is_remote(item_dir) else 0.02  # a remote check is a request
    while not is_finalized(item_dir, final_item_dir):
        # Checking the final name again closes the race with the manager's rename.
        if not final_step.exists() and not tmp_step.exists() and not final_step.exists():
            raise FileNotFoundError(
                f"Step {step} vanished from {final_step.parent} before it was finalized "
                "(the save failed or the step was garbage-collected)."
            )
        if (
            given_up is not None
            and given_up.is_set()
            and not is_finalized(item_dir, final_item_dir)
        ):
            raise StepNeverFinalized(
                f"Step {step} was never finalized at {final_item_dir}: the manager finished "
                f"without renaming {item_dir.parent.name} (its save failed; the error was "
                "raised by the save or by wait_until_finished)."
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Step {step} was not finalized at {final_item_dir} within {timeout_s:.0f} s."
            )
        time.sleep(poll_s)
