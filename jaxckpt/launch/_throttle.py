"""A cap on the CPU the hot spares take while the job trains.

The idle scheduling class (`_priority`) gives a spare only the CPU the job leaves idle,
but taking it still slows the job: on a 2-CPU VM, a spare busy at the idle class beside
one training process took 0.33-0.37 of a CPU and slowed its steps x1.10-1.13 (blocks of
steps alternating with the spare stopped), and a spare compiling in windows of 2-5 ms
every 100 ms, 2.5-7% of a CPU, slowed them x1.02-1.05: about what the spare took.
Whatever the cause (a VM's CPU budget, caches, the wake-ups of the job's threads), what
the spares take is what the job loses, so the launcher bounds it: while an attempt
runs, the spares no restart woke get at most ``share`` CPU-seconds a second, all
together. They run in windows of ``share`` of `PERIOD_S` and are stopped (SIGSTOP to
each process group) in between, for longer when a window used more than its share (a
spare compiles on several threads): what they used past the budget is repaid first.

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
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from jaxckpt.launch._cpu import cpu_seconds

PERIOD_S: Final = 0.25
DEFAULT_SHARE: Final = 0.01  # CPU-seconds a second, all spares together; `--standby-cpu`


class Throttle:
    """Holds the process groups `pids()` names (each led by its process:
    `_supervise.ProcessSet`) to `share` CPU-seconds a second, all together, while
    `running()` lasts."""

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
        used = _CpuUsed()
        used.since_last(pids())  # what they used before the cap is not its to repay
        debt_s = 0.0  # CPU-seconds used past the budget
        while not done.wait(window_s):
            stopped = set(pids())
            _signal(stopped, signal.SIGSTOP)
            try:
                start = time.monotonic()
                debt_s = max(0.0, debt_s + used.since_last(stopped) - window_s * self.share)
                pause_s = max(self.period_s - window_s, debt_s / self.share)
                # The budget accrues while they are stopped, as in the window.
                if not done.wait(pause_s):
                    debt_s = max(0.0, debt_s - (time.monotonic() - start) * self.share)
            finally:
                _signal(stopped, signal.SIGCONT)


class _CpuUsed:
    """The CPU seconds processes used between two calls (a process first seen: none)."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}

    def since_last(self, pids: Iterable[int]) -> float:
        total = 0.0
        now: dict[int, float] = {}
        for pid in pids:
            cpu = cpu_seconds(pid)
            if cpu is not None:
                now[pid] = cpu
                total += cpu - self._last.get(pid, cpu)
        self._last = now
        return total


def _signal(groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
