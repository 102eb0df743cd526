"""Filesystem helpers: atomic replacement, flushing to stable storage, removal,
cleanup of staging leftovers, and what a full filesystem looks like.

What is atomic here, and what is not:

- `write_atomic` and `replace_dir` make a new file or directory *visible* atomically:
  a reader sees either the old entry or the complete new one, never a partial one,
  because the final step is one `rename(2)` within one filesystem. That holds on
  any POSIX filesystem (tmpfs included) and is what a crash of this process can
  rely on.
- `replace_dir` over an existing directory takes two renames (old away, new in):
  between them the name is briefly absent. Readers that find it absent retry or
  fall back; they never see a mix of old and new files.
- Visible is not durable: after a power loss (not a process crash) a renamed
  file can be empty, or a rename undone, on a disk-backed filesystem, unless the
  data and the directories holding the names were fsynced. `write_atomic` and
  `replace_dir` do not fsync (the memory tier lives on tmpfs, which a power loss
  empties anyway); the persister calls `fsync_tree` on a part and `fsync_path`
  on its index manifest before its durability rename, and `fsync_dirs` on the
  directories above it afterwards.
  (Tensorstore's file kvstore already fsyncs each chunk file and its directory
  by default, `file_io_sync`; `fsync_tree` covers everything else too: the
  manifest and every directory created on the way.)
- Removal is not atomic: `remove_entry` of a tree deletes file by file. Callers
  that need a tree to vanish at once rename it into a staging directory first and
  remove it there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
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


def replace_dir(
    staging: Path | str,
    final: Path | str,
    *,
    make_parents: bool = True,
    keep_old_at: Path | str | None = None,
) -> bool:
    """Moves the complete directory `staging` to `final`, replacing what was there.

    An existing `final` is first renamed away, then removed (or left at
    `keep_old_at` for the caller to dispose of), so that `final` names either the
    old complete directory or the new one (or, for an instant, nothing).

    Args:
      staging: the complete new directory.
      final: where it goes.
      make_parents: create `final`'s parent when it is missing.
      keep_old_at: where a replaced `final` is moved instead of being removed
        (a name on the same filesystem that does not exist yet).

    Returns:
      Whether `final` existed and was replaced.

    Raises:
      FileNotFoundError: if `final`'s parent is missing and `make_parents` is False.
    """
    staging, final = Path(staging), Path(final)
    if make_parents:
        final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if os.path.lexists(final):
        old = (
            Path(keep_old_at)
            if keep_old_at is not None
            else final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        )
        os.rename(final, old)
    os.rename(staging, final)
    if old is not None and keep_old_at is None:
        remove_entry(old)
    return old is not None


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flushes one file or directory (its data, or its names) to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, *, threads: int = 32, files: bool = True) -> None:
    """Flushes every file and directory under `root`, and `root`, to stable storage
    (without `files`, the directories only: names of files flushed already).

    Once this returns, a power loss keeps every name under `root` and every
    byte behind it. Everything under `root` must be written already: then the
    order of the flushes does not matter, and they run on `threads` threads
    (a journaling filesystem commits concurrent flushes together, which is
    several times faster than one by one for parts of many chunks). Symlinks
    are not followed.

    Raises:
      OSError: if an entry cannot be opened or flushed (the tree is then not durable).
    """
    paths: list[str] = []
    flush_files = files
    for directory, _, names in os.walk(root):
        paths.append(directory)
        if flush_files:
            paths += (os.path.join(directory, f) for f in names)
    paths = [p for p in paths if not os.path.islink(p)]
    if len(paths) <= 1 or threads <= 1:
        for path in paths:
            fsync_path(path)
        return
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(paths))) as pool:
        for done in pool.map(fsync_path, paths):  # re-raises the first failure
            del done


def fsync_dirs(*directories: Path) -> None:
    """Flushes the names held by each directory (e.g. after a rename into it)."""
    for directory in directories:
        fsync_path(directory)


def is_out_of_space(error: BaseException) -> bool:
    """Whether `error` reports a full filesystem: ENOSPC from Python, or from
    tensorstore (a ValueError "RESOURCE_EXHAUSTED: ... No space left on device")."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(error)


def out_of_space(error: BaseException, what: str, remedy: str) -> OSError:
    """An OSError(ENOSPC) saying `what` did not fit, why (`error`) and `remedy`."""
    return OSError(errno.ENOSPC, f"{what}: no space left on the device ({error}). {remedy}")


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
    An entry that vanishes, cannot be examined or cannot be removed (a read-only
    filesystem) is skipped.

    Returns:
      The entries removed (none if `directory` does not exist or cannot be listed).
    """
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:  # absent, or not a directory
        return removed
    for entry in entries:
        try:
            doomed = which(entry)
        except OSError:
            continue
        if doomed:
            try:
                remove_entry(entry)
            except OSError:
                continue
            removed.append(entry)
    return removed
