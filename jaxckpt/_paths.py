"""What an Orbax item directory tells us: the step, the final path, the run."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

# CheckpointManager writes into `<root>/<step>.orbax-checkpoint-tmp[-<n>]/<item>.orbax-checkpoint-tmp[-<n>]`
# and renames both to `<root>/<step>/<item>` when the step is finalized.
_TMP_RE = re.compile(r"\.orbax-checkpoint-tmp(-\d+)?$")
_STEP_RE = re.compile(r"(\d+)$")
STAGING_DIR = ".jaxckpt-staging"


def strip_tmp(name: str) -> str:
    return _TMP_RE.sub("", name)


def final_item_dir(directory: os.PathLike | str) -> Path:
    """The item directory as it will be named once the manager finalizes the step."""
    directory = Path(os.fspath(directory))
    return directory.parent.parent / strip_tmp(directory.parent.name) / strip_tmp(directory.name)


def step_of(directory: os.PathLike | str) -> int | None:
    """The step number of an item directory `<root>/<step>/<item>`, if it has one."""
    match = _STEP_RE.search(strip_tmp(Path(os.fspath(directory)).parent.name))
    return int(match.group(1)) if match else None


def checkpoint_root(directory: os.PathLike | str) -> Path:
    """The CheckpointManager's directory (the parent of the step directories)."""
    return Path(os.fspath(directory)).parent.parent


def default_run_id(directory: os.PathLike | str) -> str:
    """A run id derived from the checkpoint root: stable across restarts of a job."""
    root = os.path.abspath(os.fspath(checkpoint_root(directory)))
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]


def sibling_steps(directory: os.PathLike | str) -> dict[int, Path]:
    """step -> final item directory for every finalized step next to `directory`."""
    directory = Path(os.fspath(directory))
    root, item = checkpoint_root(directory), strip_tmp(directory.name)
    out = {}
    if root.is_dir():
        for p in root.iterdir():
            if _TMP_RE.search(p.name) or p.name.startswith("."):
                continue
            match = _STEP_RE.search(p.name)
            if match and (p / item).is_dir():
                out[int(match.group(1))] = p / item
    return out


def wait_finalized(item_dir: Path, final_item_dir: Path, step: int, timeout_s: float) -> None:
    """Waits until the manager has renamed the step `item_dir` to `final_item_dir`.

    Raises:
      FileNotFoundError: if the step vanished instead (the save failed, or
        garbage collection removed it).
      TimeoutError: if it is not finalized within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    final_step, tmp_step = final_item_dir.parent, item_dir.parent
    while not final_item_dir.is_dir():
        # Checking the final name again closes the race with the manager's rename.
        if not final_step.exists() and not tmp_step.exists() and not final_step.exists():
            raise FileNotFoundError(
                f"Step {step} vanished from {final_step.parent} before it was finalized "
                "(the save failed or the step was garbage-collected)."
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Step {step} was not finalized at {final_item_dir} within {timeout_s:.0f} s."
            )
        time.sleep(0.02)
