"""When each phase of this process's start ran, for the ``timeline`` event.

The launcher turns every process's phases into the recovery timeline of its report
(``jaxckpt.launch.TimelineEvent`` names the usual phases).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psutil


class Timeline:
    """Wall-clock phases of this process's start, reported in one ``timeline`` event.

    Wall-clock (``time.time()``) rather than monotonic time: the launcher compares them
    with its own clock (same host here; on a cluster, as good as the hosts' clock sync).
    """

    def __init__(self) -> None:
        self.phases: dict[str, list[float]] = {}

    def add(self, name: str, start: float, end: float) -> None:
        """Records a phase that ran from ``start`` to ``end``."""
        self.phases[name] = [round(start, 4), round(end, 4)]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Records the phase that the ``with`` block runs."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())


def process_started_at() -> float:
    """When this process was created (wall clock), to time the interpreter and imports."""
    return float(psutil.Process().create_time())
