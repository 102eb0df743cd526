"""The launcher's hot spares: a spare job ready for each process count a restart may take.

``--standby`` keeps, beside the running job, one spare job (`_children.start_spares`) of
every size the launcher may restart at: the size after a failure (the job's own, or
``--processes-after-failure``) and, with ``--grow-at-save``, the launched size that a grow
back returns to. A restart wakes the spare job of its size; the next one of that size is
started once the restarted job trains.

The first spares are prepared before the job starts (`Standby.wait_ready`), at normal
priority: they import, join their job and compile the train step of their size (into the
persistent compilation cache) while nothing else of the launch needs the CPUs, and wait
at a low priority from then on (`_priority`). Those started while a job trains start at
the low priority: they take the CPU the job leaves idle, up to the launcher's cap while
the job runs (`_throttle`), and finish preparing at full speed if a restart wakes them
first. Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from jaxckpt.launch._children import Job, start_spares

POLL_S = 0.1
_LAST_LINES = 12  # of a spare job that cannot take over, printed


class Standby:
    """Spare jobs by size, started on demand, each woken at most once."""

    def __init__(
        self,
        command: Sequence[str],
        cpu_devices: int,
        env: Mapping[str, str],
        nice: int,
    ):
        """`nice`: the spares' priority while they wait (`_priority`)."""
        self._command = command
        self._cpu_devices = cpu_devices
        self._env = env
        self.nice = nice
        self._jobs: dict[int, Job] = {}

    @property
    def sizes(self) -> list[int]:
        """The sizes of the spare jobs held."""
        return sorted(self._jobs)

    def fill(self, sizes: Iterable[int], nice: int | None = None) -> list[int]:
        """Starts a spare job of each size in `sizes` not held yet (a held one that lost a
        process is replaced); returns the sizes started.

        Args:
            sizes: Process counts.
            nice: Their priority from the start (default: `self.nice`).
        """
        started = []
        for size in sorted(set(sizes)):
            held = self._jobs.get(size)
            if held is not None and held.alive():
                continue
            if held is not None:
                held.processes.kill()
            self._jobs[size] = start_spares(
                self._command,
                size,
                self._cpu_devices,
                self._env,
                self.nice if nice is None else nice,
            )
            started.append(size)
        return started

    def wait_ready(self, timeout_s: float) -> str | None:
        """Waits until every spare job held is ready (each process printed its ``standby``
        event), then gives them their waiting priority.

        Returns:
            None if all are ready, else why not: a spare process exited (its job is
            dropped) or `timeout_s` passed (they go on preparing, at the low priority).
        """
        deadline = time.monotonic() + timeout_s
        why = None
        while True:
            dead = [size for size, job in self._jobs.items() if not job.alive()]
            for size in dead:
                job = self._jobs.pop(size)
                codes = job.processes.codes()
                job.processes.kill()
                why = f"a spare of the {size}-process job exited ({codes}) while preparing"
            if all(job.ready() for job in self._jobs.values()):
                break
            if time.monotonic() > deadline:
                why = f"the spares were not ready after {timeout_s:.0f} s"
                break
            time.sleep(POLL_S)
        for job in self._jobs.values():
            job.processes.set_priority(self.nice)  # lowering a priority is always allowed
        return why

    def pids(self) -> list[int]:
        """The processes of every spare job held (also asked by `_throttle`'s thread)."""
        jobs = list(self._jobs.values())  # one step under the GIL: safe beside `fill`
        return [p.pid for job in jobs for p in job.processes.procs]

    def preparing(self, size: int) -> bool:
        """Whether the spare job of `size` processes still prepares (held, every process
        alive, not all ready yet)."""
        job = self._jobs.get(size)
        return job is not None and job.alive() and not job.ready()

    def take(self, size: int) -> Job | None:
        """The spare job of `size` processes for a restart, if one waits (it leaves the
        pool); None otherwise."""
        job = self._jobs.pop(size, None)
        if job is None or job.usable_for(size):
            return job
        codes = job.processes.codes()
        job.processes.kill()
        said = "\n".join(job.last_lines(_LAST_LINES)) or "(nothing)"
        print(
            f"[launch] standby: the spare job of {size} processes cannot take over (exit"
            f" codes {codes}); the last lines it printed:\n{said}",
            flush=True,
        )
        return None

    def close(self) -> None:
        """Kills every spare job no restart woke."""
        for job in self._jobs.values():
            job.processes.kill()
        self._jobs.clear()
