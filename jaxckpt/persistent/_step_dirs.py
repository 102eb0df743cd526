"""Step directories as an Orbax CheckpointManager makes them, on any store.

The manager writes into `<root>/<step>.orbax-checkpoint-tmp[-<n>]/<item>.orbax-checkpoint-tmp[-<n>]`
and renames both to `<root>/<step>/<item>` when the step is finalized; where it
cannot rename (object stores: `ocp.path.atomicity.CommitFileTemporaryPath`) it
writes into the final names from the start and finalizes the step with a commit
file. Step names are Orbax's: `<step>` or `<prefix>_<step>` (`ocp.path.step`).
Beside the steps jaxckpt keeps dot directories of its own, which the manager never
lists (a persister's staging, `_kept`'s kept area).

Which listed step counts as finalized is the store's (`_store.PersistentStore.step_dirs`);
this module holds what is the same everywhere: the names, the listing, and the wait
for the manager to finalize a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from jaxckpt.persistent import _index, _storage

# A persister's staging directory under the checkpoint directory (filesystems).
STAGING_DIR = ".jaxckpt-staging"
# What the manager writes into a step directory to finalize it where it cannot rename.
COMMIT_FILE = "commit_success.txt"
# How many times more often `wait_finalized` looks right after it is told that a
# finalization is under way (the manager renames the step a moment later).
FAST_LOOKS = 20


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


def step_dirs(root: Path, finalized: Callable[[Path], bool] | None = None) -> dict[int, Path]:
    """step -> step directory, for every entry of `root` with a step's final name (no
    dot name, no temporary one) that `finalized` accepts (every one, if None): one
    listing of `root`, nothing if it does not exist."""
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        if is_temporary(p.name) or p.name.startswith("."):
            continue
        step = step_of_name(p.name)
        if step is not None and (finalized is None or finalized(p)):
            out[step] = p
    return out


def with_item(steps: dict[int, Path], item: str) -> dict[int, Path]:
    """step -> `<step directory>/<item>`, for the steps of `steps` holding `item`."""
    return {step: d / item for step, d in steps.items() if (d / item).is_dir()}


def is_finalized(item_dir: Path, final_item_dir: Path) -> bool:
    """Whether the manager has finalized the step of `item_dir`: renamed it to
    `final_item_dir`, or (when it writes into the final name from the start, as on
    object stores) written the step's commit file."""
    if item_dir == final_item_dir:
        return _storage.exists(final_item_dir.parent / COMMIT_FILE)
    return final_item_dir.is_dir()


def _vanished(item_dir: Path, final_item_dir: Path) -> bool:
    """Whether the step of `item_dir`, not finalized yet, is gone (its save failed, or
    garbage collection removed it).

    Written in place (object stores): its index is gone. The decider writes the index
    before the commit ends, and the waits that ask this follow the commit; one bounded
    request per look, where a directory's existence would be a listing through
    gcsfs/s3fs, whose retries on a store that is down last half a minute.
    Renamed at finalization (local directories): neither name exists; the final
    name is looked at again last, closing the race with the manager's rename.
    """
    if item_dir == final_item_dir:
        return not _index.has_index(final_item_dir)
    final_step, tmp_step = final_item_dir.parent, item_dir.parent
    return not final_step.exists() and not tmp_step.exists() and not final_step.exists()


class StepNeverFinalized(OSError):
    """The manager finished without finalizing a step: its save failed."""


class StepDeleted(FileNotFoundError):
    """The manager deleted a step, as its options say, before a part of it was persisted,
    and the store has nowhere else to keep that part: the manager's choice, no failure."""


def wait_finalized(
    item_dir: Path,
    final_item_dir: Path,
    step: int,
    timeout_s: float,
    given_up: threading.Event | None,
    poll_s: float,
    wake: threading.Event | None = None,
) -> None:
    """Waits until the manager has finalized the step `item_dir` (`is_finalized`),
    looking again every `poll_s` (the store's: a look may be a request).

    `given_up` is set when no finalization can come any more (the manager has
    finished and is closing the handler): the wait then ends at once. `wake`, set
    when the manager is finalizing a step (the handler's `finalize`), makes it look
    at once and then `FAST_LOOKS` times as often for `poll_s` (it clears `wake`).

    Raises:
      FileNotFoundError: if the step vanished instead (the save failed, or
        garbage collection removed it).
      StepNeverFinalized: if `given_up` is set before the step is finalized (its
        save failed after the handler's part was written).
      TimeoutError: if it is not finalized within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    fast_until = 0.0  # after a wake, look FAST_LOOKS times as often until then
    while not is_finalized(item_dir, final_item_dir):
        if _vanished(item_dir, final_item_dir):
            raise FileNotFoundError(
                f"Step {step} vanished from {final_item_dir.parent.parent} before it was finalized "
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
        pause = poll_s / FAST_LOOKS if time.monotonic() < fast_until else poll_s
        if wake is None:
            time.sleep(pause)
        elif wake.wait(pause):
            wake.clear()
            fast_until = time.monotonic() + poll_s
