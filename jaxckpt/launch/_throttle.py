"""A cap on the CPU the hot spares take while the job trains.

The idle scheduling class (`_priority`) gives a spare only the CPU the job leaves idle,
but taking it still slows the job: on a 2-CPU VM, a spare busy at the idle class beside
one training process took 0.33-0.37 of a CPU and slowed its steps x1.10-1.13 (blocks of
steps alternating with the spare stopped); held to 5 ms of every 100 it took 0.06 and
slowed them x1.02. Whatever the cause (caches, a shared core under the VM, the wake-ups
of the job's threads), what the spare takes is what the job loses, so the launcher
bounds it: while an attempt runs, every spare process group that no restart woke runs
for ``share`` of each `PERIOD_S` and is stopped (SIGSTOP) for the rest.

A stopped process keeps its state, its sockets and its place in its own spare job (all
of them stop and continue together); it only prepares more slowly. Leaving the cap
(`Throttle.running` ends) continues every group it stopped, so a restart wakes spares
that run. Should the launcher die while one is stopped, its group is orphaned, and the
kernel sends it SIGHUP and SIGCONT: it ends, as a spare whose launcher died does.
Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Final

PERIOD_S: Final = 0.1
DEFAULT_SHARE: Final = 0.05  # of each period; `--standby-cpu`


class Throttle:
    """Runs the process groups `pids()` names for `share` of every `period_s` while
    `running()` lasts (each group led by its process: `_supervise.ProcessSet`)."""

    def __init__(self, share: float, period_s: float = PERIOD_S):
        if not 0 < share <= 1:
            raise ValueError(f"A CPU share must be in (0, 1], got {share}.")
        self.share = share
        self.period_s = period_s

    @contextlib.contextmanager
    def running(self, pids: Callable[[], Iterable[int]]) -> Iterator[None]:
        """Caps the groups while the body runs (a share of 1 caps nothing); every group
        stopped is continued as it leaves, whatever happened."""
        if self.share >= 1:
            yield
            return
        done = threading.Event()
        cycle = threading.Thread(
            target=self._cycle, args=(pids, done), name="jaxckpt-throttle", daemon=True
        )
        cycle.start()
        try:
            yield
        finally:
            done.set()
            cycle.join()  # it continues what it stopped before it returns

    def _cycle(self, pids: Callable[[], Iterable[int]], done: threading.Event) -> None:
        on_s = self.share * self.period_s
        while not done.wait(on_s):
            stopped = set(pids())
            _signal(stopped, signal.SIGSTOP)
            try:
                done.wait(self.period_s - on_s)
            finally:
                _signal(stopped, signal.SIGCONT)


def _signal(groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
