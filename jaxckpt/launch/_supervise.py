"""A set of local processes started together and stopped together, as one JAX job.

Shared by the launcher (`jaxckpt.launch`) and the benchmark (`jaxckpt.bench`). Every
process leads a process group of its own, which holds it and every child it starts, in
the starter's session (one scheduling autogroup for the job and its spares:
`_priority`). The set is stopped with SIGKILL to each group: after `jax.distributed.initialize`,
JAX's preemption notifier catches SIGTERM, so a SIGTERM'd process may linger.

A coordinator port is picked free just before the start, but another program can take it
before the coordinator binds it; the coordinator then fails with "Failed to add port"
(`PORT_IN_USE`) and the whole set has to run again on a fresh port (`PortRetries`).

Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Final

import portpicker

from jaxckpt.launch import _priority

PORT_IN_USE: Final = "Failed to add port"


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    return int(portpicker.pick_unused_port())


def port_in_use(output: str) -> bool:
    """Whether a process's output says its coordinator could not bind its port."""
    return PORT_IN_USE in output


class PortRetries:
    """The budget of reruns of one job on a fresh port, when its coordinator's was taken."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def retry(self, port_was_taken: bool) -> bool:
        """Whether to run the set again on a fresh port (and counts the rerun if so)."""
        if not port_was_taken or self.used >= self.limit:
            return False
        self.used += 1
        return True


class ProcessSet:
    """One copy of a command per environment, each in its own process group; `kill()`
    stops all.

    Each process gets this process's environment, ``PYTHONUNBUFFERED=1`` and its own
    entries of `envs`; stdin is closed (a pipe with ``stdin_pipe``: `send`) and stderr
    goes with stdout, into ``outputs[i]`` (a file) or else a pipe (``procs[i].stdout``).
    With ``nice`` > 0 every process gets that priority as it starts (`_priority.set_priority`:
    the nice value, and at 19 the idle class; before the interpreter it runs starts any
    thread of its own).
    Use as a context manager: leaving it kills the set, whatever happened.
    """

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        outputs: Sequence[IO[bytes]] | None = None,
        stdin_pipe: bool = False,
        nice: int = 0,
    ):
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, extra in enumerate(envs):
                self.procs.append(
                    subprocess.Popen(
                        list(command),
                        env={**os.environ, "PYTHONUNBUFFERED": "1", **extra},
                        stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                        stdout=subprocess.PIPE if outputs is None else outputs[i],
                        stderr=subprocess.STDOUT,
                        process_group=0,  # its own: SIGKILL reaches its children
                    )
                )
                if nice:  # lowering a priority is always allowed
                    _priority.set_priority(self.procs[-1].pid, nice)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def send(self, index: int, line: str) -> None:
        """Writes one line to process `index`'s stdin and closes it (``stdin_pipe`` only).

        Raises:
            BrokenPipeError: If the process has exited.
        """
        stdin = self.procs[index].stdin
        if stdin is None:
            raise ValueError(f"Process {index} was started without a stdin pipe.")
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def set_priority(self, nice: int) -> list[str]:
        """Gives every process (each thread) the nice value `nice` (`_priority.set_priority`);
        returns why it could not, per process that refused."""
        return [why for p in self.procs if (why := _priority.set_priority(p.pid, nice)) is not None]

    def terminate(self) -> None:
        """Sends SIGTERM to every process still running (not to its children): to a JAX
        process, a preemption notice (it lives on; the job decides when to stop)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    def codes(self) -> list[int | None]:
        """Every process's return code, None while it runs (negative: killed by that signal)."""
        return [proc.poll() for proc in self.procs]

    def kill(self) -> None:
        """SIGKILLs every process group and reaps every process."""
        # Every group, even of an exited leader: its own children may still run.
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()

    def wait(
        self, deadline: float, poll_s: float = 0.2, tick: Callable[[], None] | None = None
    ) -> str | None:
        """Waits, up to the `time.monotonic()` deadline, for every process to exit 0.

        Calls `tick` at every poll. Returns None if all exited 0, else why not: the first
        process that exited otherwise, or the deadline. Leaves the set running (`kill()`).
        """
        while True:
            if tick is not None:
                tick()
            codes = self.codes()
            bad = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if bad:
                return f"process {bad[0]} exited with {codes[bad[0]]}"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                return "the run passed its deadline"
            time.sleep(poll_s)
