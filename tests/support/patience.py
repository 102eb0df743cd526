"""Waits on subprocesses whose timeouts stretch with the machine's load.

A test's timeout is the time the work takes on a quiet machine, with a margin. On a
machine running other CPU-bound work the same test takes longer, and a fixed timeout
turns that into a failure. Here a timeout is a budget of *quiet-machine seconds*: each
second of waiting uses up 1 / stretch() of it, where stretch() is the load per core (at
least 1, at most MAX_STRETCH). A hung child is still killed, only later on a busy machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

# The most a timeout stretches: a hang is still caught, after at most this many times its budget.
MAX_STRETCH = 6.0
_POLL_S = 0.5


def stretch() -> float:
    """How many times slower than on a quiet machine work runs now (1-minute load per core)."""
    return min(MAX_STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def communicate(
    procs: Sequence[subprocess.Popen], timeout: float
) -> tuple[list[tuple[Any, Any]], bool]:
    """Collects every process's (stdout, stderr), killing them all once `timeout` runs out.

    Returns:
      The outputs in the order of `procs`, and whether the timeout killed them.
    """
    outputs: list[tuple[Any, Any] | None] = [None] * len(procs)
    budget, last = timeout, time.monotonic()
    while True:
        for i, proc in enumerate(procs):
            if outputs[i] is None:
                # Retrying after TimeoutExpired loses no output (subprocess's promise).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    outputs[i] = proc.communicate(timeout=_POLL_S / len(procs))
        if all(o is not None for o in outputs):
            return [o for o in outputs if o is not None], False
        now = time.monotonic()
        budget -= (now - last) / stretch()
        last = now
        if budget <= 0:
            for proc in procs:
                proc.kill()
            rest = [
                o if o is not None else p.communicate() for o, p in zip(outputs, procs, strict=True)
            ]
            return rest, True


def run(args: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, ...)` with a stretching timeout.

    Raises:
      subprocess.TimeoutExpired: the child ran past its (stretched) budget; it was killed.
    """
    kwargs.setdefault("text", True)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    [(out, err)], timed_out = communicate([proc], timeout)
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
