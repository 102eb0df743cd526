"""What the CheckpointManager's garbage collection must keep: the newest durable step.

Orbax decides which steps to delete in `CheckpointManager._get_old_steps_to_remove`
from the user's options alone (`max_to_keep`, `LatestN`, ...). Those know nothing
of jaxckpt's tiers: with `LatestN(1)` and `persist_every=2`, step 2 is deleted as
soon as step 3 (memory only) is saved, and a memory loss then leaves nothing to
restore. So, whatever the options, a manager whose items are handled by a
`TieredCheckpointHandler` never deletes:

- the newest step whose parts are all persisted (durable), and
- any newer step that is to be persisted (`step % persist_every == 0`): its
  persistence may still be running on some process, and it is the next durable
  step; plus any step this process is still persisting.

Once a newer step is durable, the older one is deleted as the options say.
`guard_garbage_collection` installs this as a wrapper around that one Orbax
method, once per process (the handler's constructor calls it); managers without
such a handler are untouched. Each handler has a `Keeper` that applies the rule;
`Keeper.policy(base)` is the same rule as an explicit PreservationPolicy wrapper
(`handler.preservation_policy(base)`), for an Orbax whose manager lacks the method. The rule reads only the shared checkpoint
directory, so every process reaches the same decision once persistence has
settled; only the primary process deletes, and it never deletes a step unless
it saw a newer one durable. On an object store the wrapper also deletes the
part manifests of the steps to delete first (`retire_manifests`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence, Set
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from absl import logging as log

from jaxckpt import _format, _paths, _storage

# The handler attribute holding its `Keeper`.
KEEPER_ATTR = "_keeper"


class DurableSteps:
    """Finds the newest durable step of an item; remembers what it found durable."""

    def __init__(self) -> None:
        # (item dir, inode and ctime of its first part): durable for as long as that
        # part exists; a step deleted and saved again has a new part.
        self._durable: set[tuple[Path, int, int]] = set()

    def is_durable(self, item_dir: Path) -> bool:
        """Whether every process's part of the step in `item_dir` is persisted."""
        if _storage.is_remote(item_dir):
            return self._is_durable_remote(item_dir)
        try:
            first = os.stat(item_dir / _format.part_dir_name(0))  # cheap: most steps have none
        except OSError:
            return False
        key = (item_dir, first.st_ino, first.st_ctime_ns)
        if key in self._durable:
            return True
        try:
            count = int(json.loads((item_dir / _format.index_file(0)).read_text())["process_count"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if all((item_dir / _format.part_dir_name(p)).is_dir() for p in range(count)):
            self._durable.add(key)
            return True
        return False

    def _is_durable_remote(self, item_dir: Path) -> bool:
        """On an object store a part is durable once its manifest object exists (no rename;
        objects have no inode to remember them by, so nothing is cached)."""
        try:
            count = int(json.loads((item_dir / _format.index_file(0)).read_text())["process_count"])
            return all(
                (item_dir / _format.part_dir_name(p) / _format.MANIFEST_FILE).exists()
                for p in range(count)
            )
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def steps_to_keep(
        self,
        root: Path,
        item: str,
        steps: Iterable[int],
        persist_every: int,
        pending: Set[int] = frozenset(),
    ) -> set[int]:
        """Of `steps`, those garbage collection must keep (see the module docstring).

        Args:
          root: the CheckpointManager's directory.
          item: the item's name (its directory in each step directory).
          steps: the manager's steps.
          persist_every: `TierOptions.persist_every`.
          pending: steps this process is still persisting.
        """
        steps = sorted(set(steps), reverse=True)
        item_dirs = _item_dirs(root, item)
        newest = next((s for s in steps if s in item_dirs and self.is_durable(item_dirs[s])), None)
        keep = {s for s in steps if s in pending}
        keep |= {s for s in steps if (newest is None or s > newest) and s % persist_every == 0}
        if newest is not None:
            keep.add(newest)
        return keep


class Keeper:
    """One handler's view of what garbage collection must keep, in every manager it serves."""

    def __init__(self, persist_every: int, pending: Callable[[], Set[int]]):
        self._persist_every = persist_every
        self._pending = pending  # steps this process is still persisting
        self._durable = DurableSteps()
        self._items: set[tuple[Path, str]] = set()  # (checkpoint dir, item) seen

    def note(self, item_dir: os.PathLike[str] | str) -> None:
        """Remembers the checkpoint directory and item of a save or restore (for `policy`)."""
        final = _paths.final_item_dir(item_dir)
        self._items.add((final.parent.parent, final.name))

    def steps_to_keep(self, root: Path, item: str, steps: Sequence[int]) -> set[int]:
        return self._durable.steps_to_keep(root, item, steps, self._persist_every, self._pending())

    def policy(self, base: Any) -> KeepDurable:
        """`base`, plus the steps to keep in every checkpoint directory seen so far."""

        def keep(steps: Sequence[int]) -> set[int]:
            out = set(self._pending())
            for root, item in list(self._items):
                out |= self.steps_to_keep(root, item, steps)
            return out

        return KeepDurable(base, keep)


def _item_dirs(root: Path, item: str) -> dict[int, Path]:
    """step -> `<root>/<step name>/<item>` for every finalized step name (one listdir)."""
    if _storage.is_remote(root):
        return _paths.finalized_steps(root, item)
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith(".") or _paths.is_temporary(name):
            continue
        step = _paths.step_of_name(name)
        if step is not None:
            out[step] = root / name / item
    return out


def keepers(mngr: Any) -> dict[str, Keeper]:
    """item -> the `Keeper` of its handler, for the items of `mngr` jaxckpt handles.

    Orbax exposes no public accessor for a manager's handlers; this reads its
    composite handler's registry, and finds nothing if a future Orbax moves it.
    """
    composite = getattr(getattr(mngr, "_checkpointer", None), "handler", None)
    registry = getattr(composite, "_handler_registry", None)
    entries = registry.get_all_entries() if registry is not None else {}
    found = {item: getattr(h, KEEPER_ATTR, None) for (item, _), h in entries.items()}
    return {item: k for item, k in found.items() if item is not None and isinstance(k, Keeper)}


def kept_by_handlers(mngr: Any, steps: Sequence[int]) -> set[int]:
    """The steps of `mngr` that its jaxckpt handlers keep."""
    root = _storage.as_path(mngr.directory)
    keep: set[int] = set()
    for item, keeper in keepers(mngr).items():
        keep |= keeper.steps_to_keep(root, item, steps)
    return keep


def retire_manifests(mngr: Any, steps: Sequence[int]) -> None:
    """On an object store, deletes the part manifests of `steps` before the manager
    deletes the steps' other objects.

    IMPORTANT: a part's manifest is its durability marker there, and deleting a
    prefix is one request per object in no given order: without its manifest first,
    a reader could meet a part that still looks durable while its chunks vanish.
    """
    root = _storage.as_path(mngr.directory)
    if not _storage.is_remote(root) or not steps:
        return
    for item in keepers(mngr):
        item_dirs = _item_dirs(root, item)
        for step in steps:
            if step not in item_dirs:
                continue
            try:
                text = (item_dirs[step] / _format.index_file(0)).read_text()
                count = int(json.loads(text)["process_count"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no index: nothing of this step was ever persisted
            manifests = [
                f"{_format.part_dir_name(p)}/{_format.MANIFEST_FILE}" for p in range(count)
            ]
            _storage.delete_objects(item_dirs[step], manifests)


def guard_garbage_collection() -> bool:
    """Wraps `CheckpointManager._get_old_steps_to_remove`, once per process.

    The wrapper removes from Orbax's deletion list the steps that the manager's
    jaxckpt handlers keep; it changes nothing for other managers. Should it
    fail, it keeps every step this time (and logs why) rather than delete one.

    Returns:
      Whether the guard is installed (False if this Orbax has no such method;
      then only `handler.preservation_policy(base)` protects durable steps).
    """
    cls = ocp.CheckpointManager
    original: Callable[[Any], list[int]] | None = getattr(cls, "_get_old_steps_to_remove", None)
    if original is None:
        log.warning(
            "jaxckpt: this Orbax's CheckpointManager has no _get_old_steps_to_remove; wrap "
            "your preservation policy in handler.preservation_policy(base) so that garbage "
            "collection keeps the newest persisted step."
        )
        return False
    if getattr(original, "_jaxckpt_guard", False):
        return True

    @functools.wraps(original)
    def _get_old_steps_to_remove(self: Any) -> list[int]:
        doomed = original(self)
        if not doomed:
            return doomed
        try:
            keep = kept_by_handlers(self, self.all_steps())
        except Exception:
            log.exception("jaxckpt: deciding which steps to keep failed; deleting none")
            return []
        if keep & set(doomed):
            log.info(
                "jaxckpt: keeping steps %s (newest durable, or to be persisted) that the "
                "preservation policy would delete",
                sorted(keep & set(doomed)),
            )
        doomed = [s for s in doomed if s not in keep]
        try:
            retire_manifests(self, doomed)
        except Exception:
            log.exception(
                "jaxckpt: retiring the manifests of steps %s failed; deleting none", doomed
            )
            return []
        return doomed

    _get_old_steps_to_remove._jaxckpt_guard = True  # type: ignore[attr-defined]
    cls._get_old_steps_to_remove = _get_old_steps_to_remove  # type: ignore[method-assign]
    return True


@dataclasses.dataclass
class KeepDurable:
    """An Orbax PreservationPolicy: what `base` keeps, plus what `keep(steps)` names."""

    base: Any
    keep: Callable[[Sequence[int]], set[int]]

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        preserved = self.base.should_preserve(checkpoints, context=context)
        keep = self.keep([c.step for c in checkpoints])
        return [p or c.step in keep for p, c in zip(preserved, checkpoints, strict=True)]
