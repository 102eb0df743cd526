"""The newest durable step, kept where the manager's garbage collection cannot reach it.

An Orbax manager deletes step directories by its own options alone: a plain
`ocp.CheckpointManagerOptions(max_to_keep=1)` deletes the durable step 10 as soon
as step 11 (memory only) is saved, and a handler cannot see, let alone change, a
plain manager's policy. So every persisted part is also hard-linked into

    <ckpt>/.jaxckpt-kept/<step directory name>/<item>/index_<p>.json, part_<p>/...

(the same inodes: no byte is copied, and no space is used while the step directory
lives). When the manager deletes the step directory, the part's files live on
through these links; Orbax lists and deletes only step names, never a dot name. A
part whose step directory the manager deleted before its persist ended (the step
saved one save earlier) is persisted straight into the kept area.

A kept step of an item is *complete* once every process's part is in it. Once a
step is complete, the kept copies of older steps of that item are removed
(`prune`): the kept area holds the newest durable step, and for a moment the one
before it, never more. `reinstate` (called by `latest_restorable_step`) puts the
newest complete kept step back as a step directory, by hard links again, when the
manager deleted it and no newer step is durable; the manager then lists and
restores it like any step.

Filesystems only, and part of the file store (`_file_store`): an object store has no
hard links (there the manager keeps the newest durable step through
`jaxckpt.manager_options(url, handler=handler, ...)`). On a filesystem a part is
persisted once its directory exists (renamed into place complete).
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from pathlib import Path

from absl import logging as log

from jaxckpt.format import _format
from jaxckpt.memory import _fs
from jaxckpt.persistent import _index, _step_dirs

KEPT_DIR = ".jaxckpt-kept"
_UNLINKABLE: set[Path] = set()  # checkpoint directories whose filesystem has no hard links
# What Orbax writes into a step directory itself (linked along with the items, so a
# step put back is the one the manager finalized).
STEP_FILES = ("_CHECKPOINT_METADATA", _step_dirs.COMMIT_FILE)


def kept_dir(root: Path) -> Path:
    """The kept area of the checkpoint directory `root`."""
    return root / KEPT_DIR


def link_tree(src: Path, dst: Path, *, threads: int = 16) -> None:
    """Re-creates the directory tree `src` at `dst` (which must not exist), every
    file hard-linked, none copied. The directories are made level by level and the
    links on `threads` threads (a part holds a directory and two files or more per
    array leaf: one by one, thousands of metadata calls add up)."""
    levels: dict[int, list[Path]] = {}
    links: list[tuple[str, Path]] = []
    for dirpath, _, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = dst if rel == "." else dst / rel
        levels.setdefault(0 if rel == "." else rel.count(os.sep) + 1, []).append(target)
        links += ((os.path.join(dirpath, name), target / name) for name in filenames)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for depth in sorted(levels):
            list(pool.map(os.mkdir, levels[depth]))  # re-raises the first failure
        list(pool.map(lambda pair: os.link(*pair), links))


def _link_step_files(step_dir: Path, dst: Path) -> None:
    """Links the manager's own files of `step_dir` into `dst` (where not there yet)."""
    for name in STEP_FILES:
        try:
            os.link(step_dir / name, dst / name)
        except FileExistsError:
            continue
        except FileNotFoundError:
            continue


class KeptPart:
    """One process's persisted part on its way into the kept area: `stage` links the
    complete part's tree while it is still in the persister's staging directory,
    `commit` adds its index manifest and renames it in."""

    def __init__(self, root: Path, step_name: str, item: str, owner: int):
        self._root = root
        self._item = item
        self._item_dir = kept_dir(root) / step_name / item
        self._part = self._item_dir / _format.part_dir_name(owner)
        self._index = self._item_dir / _format.index_file(owner)
        self._staging = self._item_dir / f".{self._part.name}.{uuid.uuid4().hex[:8]}"

    def stage(self, part: Path) -> bool:
        """Hard-links the complete, fsynced part tree `part` into a staging name.

        Returns:
          False if the filesystem cannot (no hard links: logged once per checkpoint
          directory); the part is then persisted into its step directory only.
        """
        try:
            self._item_dir.mkdir(parents=True, exist_ok=True)
            link_tree(part, self._staging)
        except OSError as e:
            self.discard()
            if self._root not in _UNLINKABLE:
                _UNLINKABLE.add(self._root)
                log.warning(
                    "jaxckpt: cannot hard-link persisted parts into %s (%s): the newest "
                    "durable step is kept there only by a manager built with "
                    "jaxckpt.manager_options(directory, handler=handler, ...).",
                    kept_dir(self._root),
                    e,
                )
            return False
        return True

    def commit(self, index: Path | None, index_text: str, step_dir: Path | None) -> None:
        """Links `index` (the step's index manifest; written from `index_text`, a
        manifest of the same save, where the step is gone) and the manager's files of
        `step_dir` (if it still exists), renames the part into place, and removes the
        kept copies this makes obsolete.

        IMPORTANT: the index manifest is in place before the part's rename, which
        makes the kept part count (as in a step directory).
        """
        try:
            if step_dir is not None:
                _link_step_files(step_dir, self._item_dir.parent)
            linked = False
            if index is not None:
                tmp = self._item_dir / f".{self._index.name}.{uuid.uuid4().hex[:8]}"
                try:
                    os.link(index, tmp)
                    os.replace(tmp, self._index)
                    linked = True
                except FileNotFoundError:
                    pass
            if not linked:
                _fs.write_atomic(self._index, index_text)
                _fs.fsync_path(self._index)
            # The files are on stable storage already (same inodes): only the new names
            # need flushing.
            _fs.fsync_tree(self._staging, files=False)
            _fs.replace_dir(self._staging, self._part, make_parents=False)
            _fs.fsync_dirs(self._item_dir, self._item_dir.parent, kept_dir(self._root))
        finally:
            self.discard()
        prune(self._root, self._item)

    def discard(self) -> None:
        """Removes what `stage` linked, if it was not committed."""
        _fs.remove_entry(self._staging)


def is_complete(item_dir: Path) -> bool:
    """Whether every process's part of the step in (kept) `item_dir` is there: its
    directory, renamed into place complete."""
    count = _index.part_count(item_dir)
    return count is not None and all(
        (item_dir / _format.part_dir_name(p)).is_dir() for p in range(count)
    )


def kept_steps(root: Path) -> dict[int, str]:
    """step -> step directory name, for every step in the kept area."""
    try:
        names = os.listdir(kept_dir(root))
    except OSError:
        return {}
    out = {}
    for name in names:
        step = _step_dirs.step_of_name(name)
        if step is not None and not name.startswith("."):
            out[step] = name
    return out


def newest_complete(root: Path, items: list[str]) -> tuple[int, str] | None:
    """(step, step directory name) of the newest kept step complete for every item."""
    for step, name in sorted(kept_steps(root).items(), reverse=True):
        if all(is_complete(kept_dir(root) / name / item) for item in items):
            return step, name
    return None


def prune(root: Path, item: str) -> list[int]:
    """Removes `item`'s kept copies older than its newest complete kept step (a step
    directory left with no item goes too). Concurrent prunes of other processes are
    fine: removal tolerates what vanished. Returns the steps whose copy went."""
    newest = newest_complete(root, [item])
    if newest is None:
        return []
    removed = []
    for step, name in kept_steps(root).items():
        if step >= newest[0]:
            continue
        step_dir = kept_dir(root) / name
        if (step_dir / item).exists():
            _fs.remove_entry(step_dir / item)
            removed.append(step)
        try:
            left = [e for e in os.listdir(step_dir) if e not in STEP_FILES]
        except OSError:
            continue
        if not left:
            _fs.remove_entry(step_dir)
    return removed


def to_reinstate(root: Path, items: list[str]) -> tuple[int, str] | None:
    """(step, step directory name) that `reinstate` would put back now: the newest
    complete kept step of `items`, if the manager deleted it and no newer step is
    durable for every item; else None. Reads only (`jaxckpt ls` shows it)."""
    if not items:
        return None
    newest = newest_complete(root, items)
    if newest is None:
        return None
    step, name = newest
    if (root / name).exists():
        return None
    steps = _step_dirs.step_dirs(root)
    finalized = [_step_dirs.with_item(steps, item) for item in items]
    newer = set.intersection(*(set(f) for f in finalized))
    if any(s > step and all(is_complete(f[s]) for f in finalized) for s in newer):
        return None
    return newest


def reinstate(root: Path, items: list[str]) -> int | None:
    """Puts the newest complete kept step of `items` back as a step directory of
    `root` if the manager deleted it and no newer step is durable for every item.

    Every process may call it at once: each builds the step directory under a
    staging name, and the first rename wins (the others' find the name taken).
    A filesystem's only (`_file_store.FileStore.reinstate`).

    Returns:
      The step put back, or None if none was needed.
    """
    chosen = to_reinstate(root, items)
    if chosen is None:
        return None
    step, name = chosen
    staging = root / _step_dirs.STAGING_DIR / f"reinstate.{name}.{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        _link_step_files(kept_dir(root) / name, staging)
        for item in items:
            link_tree(kept_dir(root) / name / item, staging / item)
        if not (staging / _step_dirs.COMMIT_FILE).exists():
            # A step the manager deleted before its files were linked: finalized for
            # a manager that finalizes by commit file too (a rename needs nothing).
            (staging / _step_dirs.COMMIT_FILE).write_text(f"put back by jaxckpt: step {step}\n")
        _fs.fsync_tree(staging, files=False)
        if (staging / _step_dirs.COMMIT_FILE).stat().st_nlink == 1:
            _fs.fsync_path(staging / _step_dirs.COMMIT_FILE)
        try:
            os.rename(staging, root / name)
        except OSError:
            if not (root / name).exists():
                raise
            return step  # another process put it back first
        _fs.fsync_dirs(root)
    finally:
        _fs.remove_entry(staging)
    log.warning(
        "jaxckpt: step %d of %s (items %s) was deleted by the manager's garbage collection "
        "while it was the newest durable step; put back from its kept copy in %s",
        step,
        root,
        items,
        kept_dir(root),
    )
    return step
