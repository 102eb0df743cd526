"""A handler's life on this process: its options, the metrics it publishes, the
work its saves leave running (`_background`: persistence, retention), the retention
keeper and the run; the calls that wait for that work or end it (close, release); and
the one look at that state from outside (`Inspection`: the benchmark's and the tests')."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxckpt import _metrics
from jaxckpt._options import TierOptions
from jaxckpt.coord import _multihost
from jaxckpt.peer import _peers
from jaxckpt.run import _background, _choreography, _run
from jaxckpt.tiers import _memory_tier, _retention


class Session:
    """What one `TieredCheckpointHandler` holds across its saves and restores; the save
    and the restore operations (`save/_operation`, `restore/_operation`) work in it."""

    def __init__(self, options: TierOptions, on_metrics: Callable[[dict[str, Any]], None] | None):
        self.options = options
        self.publisher = _metrics.Publisher(on_metrics)
        self.background = _background.Background(options, self.publisher)
        persister = self.background.persister
        self.keeper = _retention.Keeper(options.persist_every, persister.pending_steps)
        self.runs = _run.Run(options, persister, self.keeper)

    def close(self) -> None:
        """`TieredCheckpointHandler.close`: drains persistence, closes the run, warns (on
        process 0) when the newest step is not durable."""
        try:
            self.background.close()
        finally:
            self.runs.close()  # the last handler's close unmaps the kept slabs too
        self.background.raise_errors()
        if _multihost.process_index() == 0:
            self.keeper.warn_newest_not_durable()

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """`TieredCheckpointHandler.wait_for_persistence`."""
        self.background.wait(self.options.timeout_s if timeout_s is None else timeout_s)
        self.background.raise_errors()

    def release_memory(self, timeout_s: float | None = None) -> list[int]:
        """`TieredCheckpointHandler.release_memory`: collective, one verdict."""
        timeout_s = self.options.timeout_s if timeout_s is None else timeout_s
        with _choreography.ReleaseChoreography(self.runs) as op:
            # 1. This process's persistence, and its part of a newest step not durable yet
            # (not due, at the end of a run) persisted.
            self.wait_for_persistence(timeout_s)
            if self.runs.persist_newest():
                self.wait_for_persistence(timeout_s)
            # 2. Exchange `agree`: the newest step is durable only once every process's part
            # is; each frees its tier after all have persisted theirs.
            op.agree()
            return self.runs.release_memory()

    def pending_persistence(self) -> set[int]:
        """Steps queued or being written to persistent storage."""
        return self.background.persister.pending_steps()


class Inspection:
    """One handler's state on this process, as jaxckpt's benchmark and tests look at it
    (`TieredCheckpointHandler.inspect()`), instead of reaching into private attributes.

    A live view: each attribute is looked up when read. The objects it returns are
    internal (no compatibility promise); use them to look and to wait, and leave their
    private state alone.
    """

    def __init__(self, session: Session):
        self._session = session

    @property
    def run(self) -> _run.Run:
        """The handler's run on this process (`_run.Run`): its memory tier and peers, the
        lookups and exchanges a choreography runs on it."""
        return self._session.runs

    @property
    def memory(self) -> _memory_tier.MemoryTier | None:
        """The memory tier of the run open on this process (the one the handler's latest
        save, restore or listing opened), or None before the first: which steps and parts
        it holds (`steps()`, `part_dir(step, process)`) and where (`run_dir`)."""
        return self._session.runs.memory

    @property
    def peers(self) -> _peers.Peers | None:
        """That run's peers (addresses, holders, skipped pushes), or None in one process
        or before they were met."""
        return self._session.runs.peers

    def wait_for_retention(self, timeout_s: float | None = None) -> None:
        """Waits for the memory retention the saves so far queued, and for nothing else
        (`wait_for_persistence` waits for persistence too).

        Raises:
          TimeoutError: if it has not ended within `timeout_s` (default: the options').
        """
        options = self._session.options
        self._session.background.retainer.wait(
            options.timeout_s if timeout_s is None else timeout_s
        )
