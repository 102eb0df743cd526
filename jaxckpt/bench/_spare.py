"""A stand-in hot spare beside the one process's training (figure 10f).

`jaxckpt.launch --standby` keeps spares beside the job, at the launcher's waiting
priority (`launch._priority`: nice 19 and the idle scheduling class) and held to its
CPU cap while the job trains (`launch._throttle`, ``--standby-cpu``). A waiting spare's
work is short (it compiles its prepared restore once, then sleeps), but a spare started
while the job trains imports, compiles and runs its step on the job's CPUs. The
stand-in is that worst case made steady: a process group of its own (as the launcher
starts them) that compiles XLA programs without pause, each of new shapes (nothing
comes from a cache), at the waiting priority from its start. `beside()` starts it
and its cap, a process of its own as the launcher is; `Spare.alternate` runs the loop
in blocks of steps, the stand-in held to the cap in one block and stopped in the next,
and counts the CPU it got.

Run as ``python -m jaxckpt.bench._spare``: prints ``ready`` once its first program is
compiled, then compiles until killed; ``python -m jaxckpt.bench._spare cap PID SHARE``
is its cap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, Final

import psutil

from jaxckpt.launch import _priority, _supervise, _throttle

READY: Final = "ready"
START_TIMEOUT_S: Final = 120.0  # its imports and first compilation, on a loaded machine
ANSWER_TIMEOUT_S: Final = 60.0  # the cap's answer to an order (its start imports jaxckpt)
_LEAVES: Final = 24  # arrays a program carries (a restore's reshard carries every leaf)
BLOCK_STEPS: Final = 4  # steps per block, the stand-in capped then stopped
# The cap's process: its command-line word, its orders and its answers.
_CAP: Final = "cap"
_CAPPED: Final = "capped"
_STOP: Final = "stop"
_STOPPED: Final = "stopped"


@dataclasses.dataclass
class Spare:
    """The stand-in, its cap's process, and what the stand-in got while it ran beside the
    loop (capped blocks only)."""

    pid: int
    cap: subprocess.Popen[str]
    cpu_s: float = 0.0  # CPU seconds, every thread
    seconds: float = 0.0  # wall seconds

    def alternate(
        self, run: Callable[[int], dict[str, list[Any]]], steps: int
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Runs `run(n)` (n steps, a record of lists per step) in blocks of `BLOCK_STEPS`,
        the stand-in stopped (SIGSTOP) in one and held to the cap in the next, until each
        side has `steps` steps; returns the records (capped, stopped)."""
        capped: dict[str, list[Any]] = {}
        stopped: dict[str, list[Any]] = {}
        watched = psutil.Process(self.pid)
        while len(capped.get("step_s", [])) < steps:
            n = min(BLOCK_STEPS, steps - len(capped.get("step_s", [])))
            _extend(stopped, run(n))
            self._tell(_CAP, _CAPPED)
            before, start = _cpu(watched), time.perf_counter()
            _extend(capped, run(n))
            self._tell(_STOP, _STOPPED)
            self.cpu_s = round(self.cpu_s + _cpu(watched) - before, 3)
            self.seconds = round(self.seconds + time.perf_counter() - start, 3)
        return capped, stopped

    def _tell(self, order: str, ack: str) -> None:
        """Sends the cap's process `order`; returns once it answers `ack`."""
        assert self.cap.stdin is not None
        self.cap.stdin.write(order + "\n")
        self.cap.stdin.flush()
        _await_answer(self.cap, ack, f"to {order!r}")


def _await_answer(cap: subprocess.Popen[str], ack: str, what: str) -> None:
    """Waits up to `ANSWER_TIMEOUT_S` for the cap's next line, which must be `ack`.

    Raises:
        RuntimeError: If it says something else, nothing in time, or died.
    """
    assert cap.stdout is not None
    # One line answers each order, so nothing waits in the reader's buffer unseen.
    readable, _, _ = select.select([cap.stdout], [], [], ANSWER_TIMEOUT_S)
    answer = cap.stdout.readline().strip() if readable else None  # "" if it died
    if answer != ack:
        raise RuntimeError(
            f"The stand-in spare's cap (pid {cap.pid}) answered {answer!r} {what}, not"
            f" {ack!r}, within {ANSWER_TIMEOUT_S:.0f} s (exit code {cap.poll()})."
        )


def _extend(into: dict[str, list[Any]], record: dict[str, list[Any]]) -> None:
    for key, values in record.items():
        into.setdefault(key, []).extend(values)


@contextlib.contextmanager
def beside(share: float = _throttle.DEFAULT_SHARE, nice: int = _priority.NICEST) -> Iterator[Spare]:
    """Starts the stand-in, gives it `nice` (its scheduling class as
    `_priority.set_priority` gives), then its cap: a process of its own, as the launcher
    is, that holds it to `share` (`_throttle`) or stops it, as `Spare.alternate` says.
    Kills both as the body leaves.

    Raises:
        RuntimeError: If the stand-in exits or says nothing for `START_TIMEOUT_S`.
    """
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
        cap = subprocess.Popen(
            [*command, _CAP, str(proc.pid), str(share)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        try:
            _await_answer(cap, _STOPPED, "as it started")
            yield Spare(proc.pid, cap)
        finally:
            cap.kill()
            cap.wait()


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


def _cap_main(pid: int, share: float) -> None:
    """Stops process group `pid` and says so; then on each ``cap`` line continues it,
    holds it to `share` (`_throttle`) and says so, until a ``stop`` line stops it again."""
    os.killpg(pid, signal.SIGSTOP)
    print(_STOPPED, flush=True)
    throttle = _throttle.Throttle(share)
    for line in sys.stdin:
        if line.strip() != _CAP:
            return
        os.killpg(pid, signal.SIGCONT)
        with throttle.running(lambda: [pid]):
            print(_CAPPED, flush=True)
            order = sys.stdin.readline().strip()
        os.killpg(pid, signal.SIGSTOP)
        if order != _STOP:
            return
        print(_STOPPED, flush=True)


def main() -> None:
    """Compiles until killed; ``ready`` after the first program. With ``cap PID SHARE``:
    the stand-in's cap instead (`_cap_main`)."""
    if sys.argv[1:2] == [_CAP]:
        _cap_main(int(sys.argv[2]), float(sys.argv[3]))
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _compile_one(0)
    print(READY, flush=True)
    i = 1
    while True:
        _compile_one(i)
        i += 1


if __name__ == "__main__":
    main()
