"""What the launcher starts: process sets with their output queue, hot spares, and the
compilation cache's environment (see `_launcher`). Imports neither jax nor the rest of
jaxckpt.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from jaxckpt.launch._events import StandbyEvent, parse_event
from jaxckpt.launch._supervise import ProcessSet, free_port

ENV_STANDBY: Final = "JAXCKPT_STANDBY"
ENV_CACHE_DIR: Final = "JAX_COMPILATION_CACHE_DIR"
ENV_CACHE_MIN_SECS: Final = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def _pump(
    index: int,
    stream: Any,
    lines: queue.Queue[tuple[int, str | None]],
    ready: threading.Event | None,
) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if ready is not None and not ready.is_set():
            event = parse_event(line)
            if event is not None and event["event"] == StandbyEvent.kind:
                ready.set()
        lines.put((index, line))
    lines.put((index, None))


class Job:
    """A started process set and the queue its output lines arrive in, ``(i, line)``.

    ``line`` is None when process ``i``'s output closed. Leaving the context kills the set.
    A standby job (hot spares) also notes which of its processes said they are ready
    (a ``standby`` event: `ready`).
    """

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        standby: bool = False,
        port: int | None = None,
        nice: int = 0,
    ):
        self.standby = standby
        self.port = port
        self.started_at = time.time()
        self.lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.processes = ProcessSet(command, envs, stdin_pipe=standby, nice=nice)
        self._ready = [threading.Event() for _ in envs] if standby else []
        for i, proc in enumerate(self.processes.procs):
            ready = self._ready[i] if standby else None
            threading.Thread(
                target=_pump, args=(i, proc.stdout, self.lines, ready), daemon=True
            ).start()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.processes.kill()

    @property
    def size(self) -> int:
        """Processes of the job."""
        return len(self.processes.procs)

    def ready(self) -> bool:
        """Whether every process said it is ready (standby jobs only)."""
        return self.standby and all(r.is_set() for r in self._ready)

    def alive(self) -> bool:
        """Whether every process still runs."""
        return all(c is None for c in self.processes.codes())

    def last_lines(self, count: int, wait_s: float = 1.0) -> list[str]:
        """The last `count` output lines that arrived and nobody read (``[p<i>] line``),
        waiting up to `wait_s` for the output of the processes that exited to end."""
        lines: list[str] = []
        exited = sum(code is not None for code in self.processes.codes())
        deadline = time.monotonic() + wait_s
        while True:
            left_s = deadline - time.monotonic() if exited > 0 else 0.0
            try:
                i, line = self.lines.get(timeout=left_s) if left_s > 0 else self.lines.get_nowait()
            except queue.Empty:
                return lines[-count:]
            if line is None:
                exited -= 1
            else:
                lines.append(f"[p{i}] {line}")

    def usable_for(self, count: int) -> bool:
        """Whether these spares can become a set of `count` processes: all still wait."""
        return self.standby and self.size == count and self.alive()


def start_spares(
    command: Sequence[str],
    count: int,
    cpu_devices: int,
    env: Mapping[str, str],
    nice: int = 0,
) -> Job:
    """Starts a spare job of `count` processes (``JAXCKPT_STANDBY=1``) on a fresh port.

    Args:
        command: The command every process runs.
        count: Processes of the job.
        cpu_devices: ``JAXCKPT_CPU_DEVICES`` for every process.
        env: More variables for every process (the compilation cache's).
        nice: The spares' nice value until they are woken (`_priority`).
    """
    port = free_port()
    envs = [
        {
            **env,
            "JAXCKPT_COORDINATOR": f"127.0.0.1:{port}",
            "JAXCKPT_NUM_PROCESSES": str(count),
            "JAXCKPT_PROCESS_ID": str(i),
            "JAXCKPT_CPU_DEVICES": str(cpu_devices),
            ENV_STANDBY: "1",
        }
        for i in range(count)
    ]
    return Job(command, envs, standby=True, port=port, nice=nice)


def compilation_cache_env(
    choice: str | None, memory_base: str, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The compilation-cache variables to give every child (see the module docstring).

    Args:
        choice: ``--compilation-cache``: a directory, ``off``, or None for the default.
        memory_base: The launcher's memory base, which outlives every restart.
        environ: The launcher's environment; what it sets already is kept.
    """
    if choice == "off":
        return {}
    env = {}
    if choice:
        env[ENV_CACHE_DIR] = os.path.abspath(choice)
    elif not environ.get(ENV_CACHE_DIR):
        env[ENV_CACHE_DIR] = os.path.join(os.path.abspath(memory_base), "compilation-cache")
    # Every compilation on the restart path costs recovery time, the small ones too.
    if ENV_CACHE_MIN_SECS not in environ:
        env[ENV_CACHE_MIN_SECS] = "0"
    return env
