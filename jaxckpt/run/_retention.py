"""What stays: the steps garbage collection must keep, and the memory tier's steps.

Orbax decides which steps to delete from the user's options alone (`max_to_keep`,
`LatestN`, ...). Those know nothing of jaxckpt's tiers: with `LatestN(1)` and
`persist_every=2`, step 2 is deleted as soon as step 3 (memory only) is saved,
and a memory loss then leaves nothing to restore. So a manager set up with
`jaxckpt.manager_options(directory, handler=handler, ...)` (or with
`preservation_policy=handler.preservation_policy(base)`) never deletes:

- the newest step whose parts are all persisted (durable), and
- any newer step that is to be persisted (`step % persist_every == 0`, or its save
  asked for it with `TieredSave(persist=True)`, as its index manifest says): its
  persistence may still be running on some process, and it is the next durable
  step; plus any step this process is still persisting.

Once a newer step is durable, the older one is deleted as the options say. The
rule is an ordinary Orbax `PreservationPolicy` (`KeepDurable`): nothing of
Orbax is rewritten. It reads only the shared checkpoint directory (durability
through the store, `_store.PersistentStore.is_durable`, which reads the step's
index through the checked parser), so every process reaches the same decision
once persistence has settled; only the primary process deletes. The steps it lets
go are retired on the store first (`PersistentStore.retire`: on an object store
their part manifests are deleted before the manager deletes the steps' other
objects). Where the store keeps the newest durable step itself (a filesystem's
kept area, `_kept`) a manager without the policy still leaves it; elsewhere a
handler whose manager has no such policy logs, once, the one-line fix.

The first save into a directory holding another loop's checkpoint and no durable
jaxckpt step is persisted (`Keeper.switching_in`).

`MemoryRetainer` bounds the memory tier: after each finalized step it keeps the
newest `memory_keep` steps and any step still queued for persistence, on a thread
of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any

from absl import logging as log

from jaxckpt.coord import _multihost
from jaxckpt.format import _format
from jaxckpt.memory import _memory_tier
from jaxckpt.persistent import _index, _paths, _storage, _store

_ASKED_STEPS = 64  # own saves remembered per item: more than a manager keeps
# The longest a save waits for the retention that frees its slab (`MemoryRetainer.settle`):
# a run takes about half a millisecond; a new 1 MiB slab costs about as much, 192 MiB 50 ms.
SETTLE_S = 0.02


class DurableSteps:
    """Finds the newest durable step of an item, asking the store it lies on.

    Whether a step is due for persistence is read from its index once: the policy asks
    at every save, about every step the manager keeps, and an index never changes once
    written (a step saved again writes a new file: another inode or mtime, not served).
    """

    _MAX_DUE = 64  # steps remembered: more than a manager keeps

    def __init__(self) -> None:
        self._due: dict[tuple[str, int, int, int], bool] = {}
        self._due_lock = threading.Lock()

    def _index_is_due(self, item_dir: Path, persist_every: int) -> bool:
        """Whether the step in `item_dir` asked for persistence (its first index manifest
        says so), read once per index file."""
        try:
            st = os.stat(item_dir / _format.STEP_INDEX_FILE)
        except OSError:
            st = None  # no combined index (an older step, or none yet): not cached
        key = (str(item_dir), st.st_ino, st.st_mtime_ns, persist_every) if st else None
        if key is not None:
            with self._due_lock:
                known = self._due.get(key)
            if known is not None:
                return known
        first = _index.first_index(item_dir)
        due = first is not None and first.is_due(persist_every)
        if key is not None and first is not None:
            with self._due_lock:
                if len(self._due) >= self._MAX_DUE:
                    self._due.pop(next(iter(self._due)))
                self._due[key] = due
        return due

    def is_durable(self, item_dir: Path) -> bool:
        """Whether every process's part of the step in `item_dir` is persisted."""
        return _store.at(item_dir).is_durable(item_dir)

    def steps_to_keep(
        self,
        root: Path,
        item: str,
        steps: Iterable[int],
        persist_every: int,
        pending: Set[int] = frozenset(),
        asked: Mapping[int, bool] | None = None,
        known: Mapping[int, Path] | None = None,
    ) -> set[int]:
        """Of `steps`, those garbage collection must keep (see the module docstring).

        Args:
          root: the CheckpointManager's directory.
          item: the item's name (its directory in each step directory).
          steps: the manager's steps.
          persist_every: `TierOptions.persist_every`.
          pending: steps this process is still persisting.
          asked: step -> whether this process's own save of it asked for persistence
            (`TieredSave(persist=True)`), known without reading the step's index.
          known: step -> its item directory once finalized, for the steps this process
            saved: when it names every step, the directory is not listed (the policy
            asks at every save).
        """
        steps = sorted(set(steps), reverse=True)
        if known is not None and all(s in known for s in steps):
            item_dirs = dict(known)
        else:
            item_dirs = {s: d / item for s, d in _store.at(root).step_dirs(root).items()}

        def _is_due(step: int) -> bool:
            if step % persist_every == 0:
                return True
            if asked is not None and step in asked:
                return asked[step]
            return step in item_dirs and self._index_is_due(item_dirs[step], persist_every)

        newest = next((s for s in steps if s in item_dirs and self.is_durable(item_dirs[s])), None)
        keep = {s for s in steps if s in pending}
        keep |= {s for s in steps if (newest is None or s > newest) and _is_due(s)}
        if newest is not None:
            keep.add(newest)
        return keep


class Keeper:
    """One handler's view of what garbage collection must keep, in every manager it serves."""

    def __init__(self, persist_every: int, pending: Callable[[], Set[int]]):
        self._persist_every = persist_every
        self._pending = pending  # steps this process is still persisting
        self._durable = DurableSteps()
        self._lock = threading.Lock()
        self._items: set[tuple[Path, str]] = set()  # (checkpoint dir, item) seen
        self._guarded: set[str] = set()  # checkpoint dirs whose manager has our policy
        self._guarded_anywhere = False  # a policy made without its directory exists
        self._warned: set[tuple[Path, str, int]] = set()  # newest steps said to be in memory
        self._saved: set[tuple[Path, str]] = set()  # (checkpoint dir, item) saved into
        # (checkpoint dir, item) -> step -> whether this handler's save of it asked for
        # persistence, and its item directory once finalized: the policy asks at every
        # save, and need not read those indexes nor list the directory.
        self._own_saves: dict[tuple[Path, str], dict[int, tuple[bool, Path]]] = {}
        self._identities: dict[Path, str] = {}  # checkpoint dir -> `_storage.identity`

    def _identity(self, root: Path) -> str:
        """`_storage.identity(root)`, resolved once per directory (the policy compares
        directories at every save)."""
        known = self._identities.get(root)
        if known is None:
            known = self._identities[root] = _storage.identity(root)
        return known

    def saved(self, item: _paths.ItemDir, step: int, persist: bool) -> None:
        """Notes this handler's save of `step` into `item` and whether it asked for its
        persistence (`TieredSave(persist=True)`, or the first save into an old directory)."""
        with self._lock:
            own = self._own_saves.setdefault((item.root, item.item), {})
            if len(own) >= _ASKED_STEPS:
                own.pop(min(own))
            own[step] = (persist, item.final)

    def note(self, item: _paths.ItemDir) -> None:
        """Remembers the checkpoint directory and item of a save or restore; says once
        per object-store directory how to keep its durable steps if no policy of ours
        guards it."""
        with self._lock:
            first = (item.root, item.item) not in self._items
            self._items.add((item.root, item.item))
            guarded = self._guarded_anywhere or self._identity(item.root) in self._guarded
        # Where the store keeps the newest durable step itself (a filesystem's kept area,
        # `_kept`) it holds whatever the manager deletes; an object store does not.
        if first and not guarded and not item.store.keeps_durable_step:
            log.warning(
                "jaxckpt: garbage collection in %s does not know which step is durable: "
                "if the manager's options delete steps (max_to_keep, a preservation "
                "policy), build them with options=jaxckpt.manager_options(directory, "
                "handler=handler, **options) so that it keeps the newest persisted step.",
                item.root,
            )

    def switching_in(self, item: _paths.ItemDir) -> bool:
        """Whether this is the handler's first save into `item`'s checkpoint directory
        and item while no jaxckpt step of it is durable but the directory holds older
        steps of another kind (an Orbax or flax checkpoint of the loop before jaxckpt).
        That save is persisted: the manager's options (`LatestN(1)`) delete the old step
        as soon as it is finalized, and the first step due by `persist_every` may be
        far away. The store judges the directory (`PersistentStore.old_steps_only`:
        on a filesystem; an object store does not judge it)."""
        with self._lock:
            if (item.root, item.item) in self._saved:
                return False
            self._saved.add((item.root, item.item))
        return item.store.old_steps_only(item.root, item.item)

    def steps_to_keep(self, root: Path, item: str, steps: Sequence[int]) -> set[int]:
        with self._lock:
            saved = dict(self._own_saves.get((root, item), {}))
        asked = {s: persist for s, (persist, _) in saved.items()}
        known = {s: final for s, (_, final) in saved.items()}
        return self._durable.steps_to_keep(
            root, item, steps, self._persist_every, self._pending(), asked, known
        )

    def newest_not_durable(
        self, items: Iterable[tuple[Path, str]] | None = None
    ) -> list[tuple[Path, str, int]]:
        """(checkpoint directory, item, step) for every item seen (of `items`, if given)
        whose newest finalized step is not durable: it lives in memory tiers only."""
        with self._lock:
            seen = sorted(self._items if items is None else set(items) & self._items)
        out = []
        for root, item in seen:
            finalized = _paths.finalized_steps(root, item)
            if finalized and not self._durable.is_durable(finalized[max(finalized)]):
                out.append((root, item, max(finalized)))
        return out

    def warn_newest_not_durable(self) -> None:
        """Logs a warning (once a step) for every item seen whose newest finalized step
        lives in memory tiers only: a handler's close says so."""
        for root, item, step in self.newest_not_durable():
            if (root, item, step) in self._warned:
                continue
            self._warned.add((root, item, step))
            log.warning(
                "jaxckpt: closing with step %d of %s (item %r) in memory tiers only: it was "
                "not due for persistence (persist_every=%d). To end a run with the trained "
                "state on disk, call handler.release_memory() on every process before "
                "closing, or save the last step with TieredSave(state, persist=True).",
                step,
                root,
                item,
                self._persist_every,
            )

    def policy(self, base: Any, root: os.PathLike[str] | str | None = None) -> KeepDurable:
        """`base`, plus the steps to keep of the items seen so far in the checkpoint
        directory `root` (every directory seen, if None)."""
        where = _storage.identity(root) if root is not None else None
        with self._lock:
            if where is None:
                self._guarded_anywhere = True
            else:
                self._guarded.add(where)

        def items() -> list[tuple[Path, str]]:
            with self._lock:
                seen = list(self._items)
            return [(r, i) for r, i in seen if where is None or self._identity(r) == where]

        def keep(steps: Sequence[int]) -> set[int]:
            out = set(self._pending())
            for r, i in items():
                out |= self.steps_to_keep(r, i, steps)
            return out

        def retire(steps: Sequence[int]) -> None:
            roots = {r for r, _ in items()}
            if len(roots) != 1:  # which manager's steps these are is unknown: leave them
                return
            (r,) = roots
            _store.at(r).retire(r, sorted({i for _, i in items()}), list(steps))

        return KeepDurable(base, keep, retire)


@dataclasses.dataclass
class KeepDurable:
    """An Orbax PreservationPolicy: what `base` keeps, plus what `keep(steps)` names.

    The manager deletes the steps it does not preserve; on an object store their
    part manifests go first (`retire`). Should deciding or retiring fail, it keeps
    every step this time (and logs why) rather than delete one. Which steps it keeps
    against `base` is logged when that changes, not at every save.
    """

    base: Any
    keep: Callable[[Sequence[int]], set[int]]
    retire: Callable[[Sequence[int]], None] = lambda steps: None
    _said: list[int] = dataclasses.field(default_factory=list, init=False, repr=False)

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        preserved = list(self.base.should_preserve(checkpoints, context=context))
        if all(preserved):
            return preserved
        steps = [c.step for c in checkpoints]
        try:
            keep = self.keep(steps)
        except Exception:
            log.exception("jaxckpt: deciding which steps to keep failed; deleting none")
            return [True] * len(checkpoints)
        saved = sorted(s for s, p in zip(steps, preserved, strict=True) if not p and s in keep)
        if saved and saved != self._said:
            log.debug(
                "jaxckpt: keeping steps %s (newest durable, or to be persisted) that the "
                "preservation policy would delete",
                saved,
            )
        self._said = saved
        out = [p or s in keep for p, s in zip(preserved, steps, strict=True)]
        doomed = [s for s, p in zip(steps, out, strict=True) if not p]
        try:
            self.retire(doomed)
        except Exception:
            log.exception(
                "jaxckpt: retiring the manifests of steps %s failed; deleting none", doomed
            )
            return [True] * len(checkpoints)
        return out


class MemoryRetainer:
    """Bounds the memory tier after each finalized step, on a thread of its own.

    Of the steps up to the one just finalized it keeps the newest `memory_keep` and
    any step still queued for persistence. A failure is recorded and raised by
    the handler's next `wait_for_persistence()` or `close()` (`take_errors`).

    A save every step needs the slab its retention frees (`MemoryTier.take_free_slab`:
    a new one is a new file, its pages faulted in) just after the step before is
    finalized: the handler's `finalize` says a finalization is under way (`nudge`),
    so the run waiting for it looks at once, and the next save waits briefly for
    that run before it takes a slab (`settle`).
    """

    def __init__(
        self,
        memory_keep: int,
        timeout_s: float,
        pending: Callable[[], Set[int]],
        closing: threading.Event,
    ):
        self._memory_keep = memory_keep
        self._timeout_s = timeout_s
        self._pending = pending  # steps queued for persistence: never retired
        self._closing = closing  # the manager has finished: finalization waits end
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        self._last: tuple[_memory_tier.MemoryTier, _paths.ItemDir, int] | None = None
        self._queued: concurrent.futures.Future[None] | None = None  # the newest run
        self._finalizing = False  # the manager finalizes the newest run's step
        self._wake = threading.Event()  # `_step_dirs.wait_finalized`: look now
        self._errors: list[BaseException] = []

    @staticmethod
    def _new_pool() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-retain")

    def after(self, memory: _memory_tier.MemoryTier, item: _paths.ItemDir, step: int) -> None:
        """Queues the retention that follows the finalization of `step` in `item`."""
        with self._lock:
            self._last = (memory, item, step)
            self._finalizing = False
            self._queued = self._pool.submit(self._retain, memory, item, step)

    def again(self) -> None:
        """Queues the newest retention again: a step it kept while it was queued for
        persistence is retired once durable, not only at the next save's retention."""
        with self._lock:
            if self._last is not None:
                self._queued = self._pool.submit(self._retain, *self._last)

    def nudge(self) -> None:
        """The manager is finalizing the newest step queued (it renames it next): the
        run waiting for that looks at once, and `settle` may wait for it."""
        with self._lock:
            self._finalizing = self._last is not None
        self._wake.set()

    def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Waits, at most `timeout_s`, for the runs queued so far if the newest one's
        step is being finalized (`nudge`): a save about to take a slab gets the one
        that run frees. Returns at once otherwise, and silently on a timeout."""
        with self._lock:
            queued = self._queued if self._finalizing else None
        if queued is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                queued.result(timeout=timeout_s)

    def wait(self, timeout_s: float) -> None:
        """Waits for the retention runs queued so far.

        Raises:
          TimeoutError: if they have not ended within `timeout_s`.
        """
        try:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"[process {_multihost.process_index()}] Memory retention did not end within "
                f"{timeout_s:.0f} s (each run waits up to TierOptions.timeout_s for its step "
                "to be finalized); check that the checkpoint directory's storage answers."
            ) from None

    def take_errors(self) -> list[BaseException]:
        errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        """Waits for the queued runs; a later `after` starts a new thread."""
        with self._lock:
            pool, self._pool = self._pool, self._new_pool()
        pool.shutdown(wait=True)

    def _retain(self, memory: _memory_tier.MemoryTier, item: _paths.ItemDir, step: int) -> None:
        try:
            item.wait_finalized(step, self._timeout_s, self._closing, self._wake)
        except FileNotFoundError as e:
            # Garbage collection deletes finalized steps only, once newer ones are: a
            # newer finalized step (kept in memory: it is past `upto`) means the step
            # was finalized; else its save failed, and everything stays.
            if not any(s > step for s in item.finalized_steps()):
                log.warning("jaxckpt: memory retention skipped after step %d: %s", step, e)
                return
        except OSError as e:  # not finalized: keep everything
            log.warning("jaxckpt: memory retention skipped after step %d: %s", step, e)
            return
        try:
            memory.retain(self._memory_keep, upto=step, pinned=self._pending())
        except Exception as e:
            log.exception("jaxckpt: memory retention after step %d failed", step)
            error = OSError(
                f"[process {_multihost.process_index()}] Memory retention after step {step} "
                f"in {memory.run_dir} failed: {e}. Older steps stay in memory until it "
                "succeeds; check that the memory root is writable and has free space."
            )
            error.__cause__ = e
            self._errors.append(error)
