"""The background half of a handler's saves, with one owner: the commits still in
flight, the persistence queue and memory retention; their waits, close and errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable
from pathlib import Path

from jaxckpt import _internals, _metrics
from jaxckpt._options import TierOptions
from jaxckpt.coord import _multihost
from jaxckpt.persistent import _persister, _store
from jaxckpt.run import _retention


class Background:
    """What a handler's saves leave running after `save()` returns (see the module
    docstring); the handler waits for it, closes it and reports its failures."""

    def __init__(self, options: TierOptions, publisher: _metrics.Publisher):
        # Set while closing: the manager has finished, so background waits for a
        # step's finalization end at once (a step not finalized by now never will be).
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._roots: set[Path] = set()  # the checkpoint directories saved into
        self.in_flight = InFlight()
        self.persister = _persister.Persister(
            options.persist_compression,
            options.timeout_s,
            on_persisted=publisher.publish,
            closing=self._closing,
            on_failed=publisher.publish,
            on_settled=lambda: self.retainer.again(),
        )
        self.retainer = _retention.MemoryRetainer(
            options.memory_keep, options.timeout_s, self.persister.pending_steps, self._closing
        )

    def saved_into(self, root: Path) -> None:
        """A save into the checkpoint directory `root` began (its persisted parts may
        wait to enter their step directories: `_step_gate`)."""
        with self._lock:
            self._roots.add(root)

    def wait(self, timeout_s: float) -> None:
        """Waits for the commits of the saves made so far (they queue the persistence: an
        asynchronous manager's save returns before its commit has run), then for the
        retention and persistence they queued, the persisted parts' entry into their
        step directories, and the retention that retires the steps this made durable.

        Raises:
          TimeoutError: if it is not done within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        self.in_flight.wait(timeout_s)
        self.retainer.wait(timeout_s)
        self.persister.drain(timeout_s)
        # A manager finishing a save on its own thread may be deleting steps: a part
        # enters its step directory once it is done.
        for thread in _internals.manager_finalize_threads():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(
                    f"[process {_multihost.process_index()}] the CheckpointManager did not "
                    f"finish its save within {timeout_s:.0f} s; see its wait_until_finished()."
                )
        if self._settle():
            self.retainer.again()  # the steps this made durable
        self.retainer.wait(timeout_s)  # the runs that steps made durable meanwhile queued

    def _settle(self) -> bool:
        """The persisted parts that waited enter their step directories (no manager is
        deleting now); whether any did."""
        with self._lock:
            roots = list(self._roots)
        return any([_store.at(root).settle(root) for root in roots])

    def close(self) -> None:
        """Drains retention and persistence (each bounded by the options' timeout)."""
        # Orbax closes its handlers after its own finalization is done (and a user
        # closing the handler directly has no save in flight).
        self._closing.set()
        try:
            self.retainer.close()
            try:
                self.persister.close()
            finally:
                if self._settle():  # the manager has finished
                    self.retainer.again()
                self.retainer.close()  # the runs the last persists queued (`again`)
        finally:
            self._closing.clear()

    def raise_errors(self) -> None:
        """Raises what failed on the background threads since the last call, if anything.

        Raises:
          OSError: naming the failed persists and retention runs, chained to the first.
        """
        persist = self.persister.take_errors()
        retention = self.retainer.take_errors()
        said = []
        if persist:
            said.append(f"{len(persist)} step(s) failed to persist; first: {persist[0]}")
        if retention:
            said.append(f"memory retention failed {len(retention)} time(s); first: {retention[0]}")
        if said:
            raise OSError("jaxckpt: " + "; ".join(said)) from (persist or retention)[0]


class InFlight:
    """Counts the commits of saves that have not ended yet (`wait_for_persistence` waits
    for them: they queue the persistence)."""

    def __init__(self) -> None:
        self._count = 0
        self._done = threading.Condition()

    def track(self, commit: Awaitable[None]) -> Awaitable[None]:
        """`commit`, counted as in flight from now until it ends."""
        with self._done:
            self._count += 1

        async def run() -> None:
            try:
                await commit
            finally:
                with self._done:
                    self._count -= 1
                    self._done.notify_all()

        return run()

    def wait(self, timeout_s: float) -> None:
        """Waits until every commit counted so far has ended.

        Raises:
          TimeoutError: if they have not within `timeout_s`.
        """
        with self._done:
            if not self._done.wait_for(lambda: self._count == 0, timeout=timeout_s):
                raise TimeoutError(
                    f"[process {_multihost.process_index()}] {self._count} save(s) did not "
                    f"end their commit within {timeout_s:.0f} s; see the manager's "
                    "wait_until_finished() for why."
                )
