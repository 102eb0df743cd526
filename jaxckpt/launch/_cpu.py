"""The CPU time a job and its hot spares used while the job trained.

How much spares slow training shows in the job's step times, measured against a run
without them; on a shared machine those drift with the load. What the spares took is
steadier: the CPU seconds of their processes while the job trained, beside the job's
own. On CPUs the job would keep busy, that share is the slowdown's bound. Sampled at
most every `SAMPLE_S`, so a process that ends between two samples loses the time since
the last one. Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Final

import psutil

SAMPLE_S: Final = 1.0


def _cpu_s(pid: int) -> float | None:
    """CPU seconds of `pid` and of the children it reaped; None if it is gone."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    return None


class CpuShare:
    """The job's and the spares' CPU seconds from the first `sample` on.

    A process first seen at the first sample counts from there; one that appears later
    (a spare started meanwhile) counts from its start.
    """

    def __init__(self, spare_pids: Callable[[], Iterable[int]]):
        self._spare_pids = spare_pids
        self._base: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._spares: set[int] = set()
        self._started: float | None = None
        self._next = 0.0

    def sample(self, job_pids: Iterable[int], force: bool = False) -> None:
        """Samples every process (at most every `SAMPLE_S`, unless `force`)."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + SAMPLE_S
        first = self._started is None
        if first:
            self._started = now
        spares = set(self._spare_pids())
        self._spares |= spares
        for pid in [*job_pids, *spares]:
            cpu = _cpu_s(pid)
            if cpu is None:
                continue
            self._base.setdefault(pid, cpu if first else 0.0)
            self._last[pid] = cpu

    def result(self) -> dict[str, float] | None:
        """``{"job", "standby", "seconds"}``: CPU seconds of each, over the wall seconds
        sampled; None before the first sample."""
        if self._started is None:
            return None

        def used(pids: Iterable[int]) -> float:
            return round(sum(self._last[p] - self._base[p] for p in pids), 3)

        return {
            "job": used(p for p in self._last if p not in self._spares),
            "standby": used(p for p in self._last if p in self._spares),
            "seconds": round(time.monotonic() - self._started, 3),
        }
