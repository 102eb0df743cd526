"""A stand-in hot spare beside the one process's training (figure 10f).

`jaxckpt.launch --standby` keeps spares beside the job, at the launcher's waiting
priority (`launch._priority`: nice 19 and the idle scheduling class). A waiting spare's
work is short (it compiles its prepared restore once, then sleeps), but a spare started
while the job trains imports, compiles and runs its step on the job's CPUs. The
stand-in is that worst case made steady: a process of its own session (as the launcher
starts them) that compiles XLA programs without pause, each of new shapes (nothing
comes from a cache), at the waiting priority from its start. `beside()` runs it
around a loop and returns what CPU it got.

Run as ``python -m jaxckpt.bench._spare``: prints ``ready`` once its first program is
compiled, then compiles until killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Final

import psutil

from jaxckpt.launch import _priority, _supervise

READY: Final = "ready"
START_TIMEOUT_S: Final = 120.0  # its imports and first compilation, on a loaded machine
_LEAVES: Final = 24  # arrays a program carries (a restore's reshard carries every leaf)


@dataclasses.dataclass
class Spare:
    """What the stand-in got while it ran beside the loop."""

    cpu_s: float = 0.0  # CPU seconds, every thread
    seconds: float = 0.0  # wall seconds


@contextlib.contextmanager
def beside(nice: int = _priority.NICEST) -> Iterator[Spare]:
    """Runs the stand-in at `nice` (its scheduling class as `_priority.set_priority`
    gives) while the body runs; fills the `Spare` yielded as it leaves.

    Raises:
        RuntimeError: If the stand-in exits or says nothing for `START_TIMEOUT_S`.
    """
    spare = Spare()
    command = [sys.executable, "-m", "jaxckpt.bench._spare"]
    # Its output goes to a file, read until it is ready: nothing ever blocks its writes.
    # Prepared at normal priority (as the launcher's first spares are), then lowered.
    with (
        tempfile.TemporaryFile() as output,
        _supervise.ProcessSet(command, [{}], outputs=[output]) as procs,
    ):
        proc = procs.procs[0]
        _await_ready(proc, output)
        _priority.set_priority(proc.pid, nice)
        watched = psutil.Process(proc.pid)
        before, start = _cpu(watched), time.perf_counter()
        yield spare
        spare.cpu_s = round(_cpu(watched) - before, 3)
        spare.seconds = round(time.perf_counter() - start, 3)


def _await_ready(proc: subprocess.Popen[bytes], output: IO[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        output.seek(0)
        printed = output.read()
        if READY.encode() in printed.splitlines():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(
        f"The bench's stand-in spare (pid {proc.pid}) did not get ready in"
        f" {START_TIMEOUT_S:.0f} s (exit code {proc.poll()}); it printed:"
        f" {printed.decode(errors='replace')[-2000:]!r}"
    )


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _compile_one(i: int) -> None:
    import jax
    import jax.numpy as jnp

    n = 48 + i % 97  # new shapes every time: no cache hit

    def program(*xs: jax.Array) -> list[jax.Array]:
        return [jnp.cumsum(jnp.tanh(x @ x.T), axis=0)[::2] * k for k, x in enumerate(xs)]

    shapes = [jax.ShapeDtypeStruct((n + j, n), jnp.float32) for j in range(_LEAVES)]
    jax.jit(program).lower(*shapes).compile()


def main() -> None:
    """Compiles until killed; ``ready`` after the first program."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _compile_one(0)
    print(READY, flush=True)
    i = 1
    while True:
        _compile_one(i)
        i += 1


if __name__ == "__main__":
    main()
