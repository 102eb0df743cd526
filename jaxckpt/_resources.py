"""The owner of the process's shared thread pools and caches, and of their lifetime.

The slab copies, the restore's reads and the peer service's checks run on a few
bounded thread pools; a few caches spare repeated work between saves (the leaf
records of a tree, a manifest's parse, the kept slab mappings). They are shared
by every handler of the process, so one object, `SHARED`, owns them:

- a handler `acquire`s it when it is made and `release`s it in `close()`;
- when the last handler releases it, the pools are shut down (their running
  work finishes) and every cache is cleared (its `on_release` runs): one
  handler's `close()` never clears what another handler still uses;
- a pool starts its threads on first use, also again after a release, so the
  code that uses it (and tests that call it directly) needs no handler.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Pool:
    """A bounded thread pool whose threads start on first use (see the module docstring)."""

    def __init__(self, workers: int, prefix: str):
        self._workers, self._prefix = workers, prefix
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
        with self._lock:  # never onto an executor being shut down
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._workers, thread_name_prefix=self._prefix
                )
            return self._executor.submit(fn, *args)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """`fn` of every item, in order (all submitted at once)."""
        futures = [self.submit(fn, item) for item in items]
        return (f.result() for f in futures)

    def queued(self) -> int:
        """How many submitted tasks have not started yet."""
        with self._lock:
            executor = self._executor
        return executor._work_queue.qsize() if executor is not None else 0

    def shutdown(self) -> None:
        """Lets the running and queued tasks finish, then the threads end."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)


class Resources:
    """The pools and caches of the process, kept while some handler uses them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: set[int] = set()
        self._pools: list[Pool] = []
        self._on_release: list[Callable[[], None]] = []
        self._gc_pauses, self._gc_was_on = 0, False

    def pool(self, workers: int, prefix: str) -> Pool:
        """A new pool owned here (made at import time by the module that uses it)."""
        made = Pool(workers, prefix)
        with self._lock:
            self._pools.append(made)
        return made

    def cache(self, cache: T, on_release: Callable[[], None] | None = None) -> T:
        """Registers `cache` (a dict or list), cleared when the last user releases;
        `on_release` instead, if given."""
        clear = on_release or getattr(cache, "clear")  # noqa: B009 -- any container
        with self._lock:
            self._on_release.append(clear)
        return cache

    def acquire(self, user: object) -> None:
        with self._lock:
            self._users.add(id(user))

    def release(self, user: object) -> None:
        """`user` is done; the last one shuts the pools down and clears the caches."""
        with self._lock:
            self._users.discard(id(user))
            if self._users:
                return
            pools, clears = list(self._pools), list(self._on_release)
        for p in pools:
            p.shutdown()
        for clear in clears:
            clear()

    def users(self) -> int:
        with self._lock:
            return len(self._users)

    @contextlib.contextmanager
    def gc_paused(self) -> Iterator[None]:
        """Python's cyclic garbage collector off while the body runs, if it was on.

        A restore of thousands of leaves allocates a few hundred thousand small
        objects (views, records, arrays), a save some 10^5: each 700 allocations
        start a collection, and some of those walk every object of the process
        (jax's, the model's), a fifth of such a restore, half of such a save.
        Nothing they allocate is cyclic garbage; reference counting still frees
        everything else, and cyclic garbage the training makes meanwhile is
        collected once the collector is back. So a body is local work, never a wait
        on other processes. Re-entrant and thread-safe: the collector is on again
        once the last body that turned it off ends.
        """
        with self._lock:
            if self._gc_pauses == 0:
                self._gc_was_on = gc.isenabled()
                gc.disable()
            self._gc_pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._gc_pauses -= 1
                if self._gc_pauses == 0 and self._gc_was_on:
                    gc.enable()


SHARED: Final = Resources()
