"""A cap on the CPU the hot spares take while the job trains.

The idle scheduling class (`_priority`) gives a spare only the CPU the job leaves idle,
but taking it still slows the job: on a 2-CPU VM, a spare busy at the idle class beside
one training process took 0.33-0.37 of a CPU and slowed its steps x1.10-1.13 (blocks of
steps alternating with the spare stopped); a spare compiling in windows of 2 ms every
100 ms, 2.5-3.5% of a CPU, slowed them x1.02-1.03. Whatever the cause (a VM's CPU
budget, caches, the wake-ups of the job's threads), what the spares take is what the
job loses, so the launcher bounds it: while an attempt runs, the spares no restart woke
run for ``share`` of every `PERIOD_S` and are stopped (SIGSTOP to each process group)
for the rest. A spare compiles on several threads, so it may use up to that many times
``share`` of a CPU.

The pauses stay short: a spare job's processes keep their own `jax.distributed` job
alive, and its heartbeats must get through. With windows every 100 ms the examples'
spare jobs (heartbeat timeout 5 s) lived; stopped for 250 ms to 1 s at a time, they
failed as they were woken (a task had "stopped sending heartbeats").

A stopped process keeps its state, its sockets and its place in its own spare job (all
of them stop and continue together); it only prepares more slowly. Leaving the cap
(`Throttle.running` ends) continues every group it stopped, so a restart wakes spares
that run. Should the launcher die while one is stopped, its group is orphaned, and the
kernel sends it SIGHUP and SIGCONT: it ends, as a spare whose launcher died does. (Not
one that had been sent SIGSTOP and not stopped yet in the instant the launcher died: it
stays stopped, and its group needs a SIGKILL.)
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
DEFAULT_SHARE: Final = 0.01  # of each period; `--standby-cpu`


class Throttle:
    """Runs the process groups `pids()` names (each led by its process:
    `_supervise.ProcessSet`) for `share` of every `period_s` while `running()` lasts."""

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
        window_s = self.share * self.period_s
        while not done.wait(window_s):
            stopped = set(pids())
            _signal(stopped, signal.SIGSTOP)
            try:
                done.wait(self.period_s - window_s)
            finally:
                _signal(stopped, signal.SIGCONT)


def _signal(groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
