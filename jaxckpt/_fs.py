"""Filesystem helpers: atomic replacement, removal, and cleanup of staging leftovers.

What is atomic here, and what is not:

- `write_atomic` and `replace_dir` make a new file or directory *visible* atomically:
  a reader sees either the old entry or the complete new one, never a partial one,
  because the final step is one `rename(2)` within one filesystem. That holds on
  any POSIX filesystem (tmpfs included) and is what a crash of this process can
  rely on.
- `replace_dir` over an existing directory takes two renames (old away, new in):
  between them the name is briefly absent. Readers that find it absent retry or
  fall back; they never see a mix of old and new files.
- None of these calls fsync: after a power loss (not a process crash) a renamed
  file can be empty on a disk-backed filesystem. The memory tier lives on tmpfs,
  which a power loss empties anyway.
- Removal is not atomic: `remove_entry` of a tree deletes file by file. Callers
  that need a tree to vanish at once rename it into a staging directory first and
  remove it there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Writes `data` to `path` through a temporary sibling and one rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def replace_dir(staging: Path, final: Path, *, make_parents: bool = True) -> None:
    """Moves the complete directory `staging` to `final`, replacing what was there.

    An existing `final` is first renamed away, then removed, so that `final`
    names either the old complete directory or the new one (or, for an instant,
    nothing).

    Raises:
      FileNotFoundError: if `final`'s parent is missing and `make_parents` is False.
    """
    if make_parents:
        final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(staging, final)
    if old is not None:
        remove_entry(old)


def remove_entry(path: str | os.PathLike[str]) -> None:
    """Removes a file, symlink or directory tree; an absent entry is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remove_entries(directory: Path, which: Callable[[Path], bool]) -> list[Path]:
    """Removes the entries of `directory` for which `which(entry)` is true.

    Meant for staging directories: leftovers of writes that a crash interrupted.
    An entry that vanishes or cannot be examined meanwhile is skipped.

    Returns:
      The entries removed (none if `directory` does not exist).
    """
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        try:
            doomed = which(entry)
        except OSError:
            continue
        if doomed:
            remove_entry(entry)
            removed.append(entry)
    return removed
