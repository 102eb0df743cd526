"""One attempt of the launcher: the whole process set run once, watched until every
process exits 0 or one fails or hangs (see `_launcher`, which restarts it).

Each process gets its place in the job (coordinator, process id and count, CPU devices)
and its node (failure domain, memory root) as variables; hot spares get the same on
stdin. The job's output lines are echoed with a ``[p<i>]`` prefix and their event lines
(`_events`) recorded in the attempt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from jaxckpt.launch._children import Job
from jaxckpt.launch._cpu import CpuShare
from jaxckpt.launch._events import (
    RestoredEvent,
    StepEvent,
    StoppedEvent,
    TimelineEvent,
    parse_event,
)
from jaxckpt.launch._supervise import port_in_use

POLL_S: Final = 0.05


@dataclasses.dataclass
class Attempt:
    """One run of the whole process set.

    Attributes:
        index: 0 for the first run, then 1, 2, ... per restart (port retries included).
        num_processes: Processes in this run.
        port: Coordinator port.
        outcome: ``ok``, ``stopped`` (every process exited 0 after a ``stopped`` event:
            the job stopped when asked, `run_attempt`'s ``should_stop``), ``exit``
            (non-zero code), ``signal``, ``hang`` or ``port``.
        process: The process that failed first, if any.
        returncode: Its return code (negative: killed by that signal).
        detected_after_s: Time from its last sign of life (an output line, or the close of
            its output when it died) to the detection.
        last_step: Highest ``step`` event seen in this run (0 if none).
        restored: Process -> its ``restored`` event.
        seconds: Duration of the run.
        first_step_s: Time from the start of the run to its first ``step`` event.
        nodes: The simulated node (memory root ``node<k>``, failure domain ``node<k>``)
            each process runs on.
        started_at: Wall-clock start of the run (processes started, or spares woken).
        detected_at: Wall-clock time of the failure's detection.
        standby: Whether the run woke hot spares.
        timelines: Process -> its ``timeline`` event.
        last_step_at: Wall-clock time of the last ``step`` event.
        stop_requested_at: Wall-clock time the launcher asked the job to stop, if it did.
        ended_at: Wall-clock end of the run (every process exited, or killed).
        cpu_s: CPU seconds the job and the hot spares used from its first ``step`` event
            to its end (`_cpu.CpuShare`), or None if it never trained.
    """

    index: int
    num_processes: int
    port: int
    nodes: list[int] = dataclasses.field(default_factory=list)
    outcome: str = "ok"
    process: int | None = None
    returncode: int | None = None
    detected_after_s: float | None = None
    last_step: int = 0
    restored: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    first_step_s: float | None = None
    started_at: float = 0.0
    detected_at: float | None = None
    standby: bool = False
    timelines: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    last_step_at: float | None = None
    stop_requested_at: float | None = None
    ended_at: float = 0.0
    stopped: bool = False  # a process printed a ``stopped`` event
    cpu_s: dict[str, float] | None = None


def run_attempt(
    attempt: Attempt,
    command: Sequence[str],
    memory_base: str,
    cpu_devices: int,
    hang_timeout: float,
    injection: tuple[int, int] | None,
    env: Mapping[str, str] | None = None,
    spares: Job | None = None,
    on_training: Callable[[], None] | None = None,
    should_stop: Callable[[Attempt], bool] | None = None,
    spare_pids: Callable[[], list[int]] = list,
) -> Attempt:
    """Runs the process set once, until all exit 0 or one fails or hangs.

    Args:
        attempt: The run to perform; its result fields are filled in and it is returned.
        command: The command every process runs.
        memory_base: Parent of the per-process ``node<i>`` memory roots.
        cpu_devices: ``JAXCKPT_CPU_DEVICES`` for every process.
        hang_timeout: Seconds without output after which a running process counts as hung.
        injection: ``(process, step)`` to SIGKILL, or None.
        env: More variables for every process (the compilation cache's).
        spares: Hot spares to wake (`start_spares`, as many as processes) instead of
            starting processes; they get their variables on stdin. Killed at the end.
        on_training: Called once, at the run's first ``step`` event.
        should_stop: Asked at every poll while the job runs; once it says True, every
            process gets SIGTERM (once): a JAX job's preemption notice, on which the
            examples stop at the next step the processes agree on, after its save
            (``stopped`` event, exit 0).
        spare_pids: The processes of the hot spares beside the job, whose CPU time is
            counted with the job's while it trains (``cpu_s``).

    Returns:
        ``attempt``, filled in.
    """
    envs = _child_envs(attempt, memory_base, cpu_devices, injection, env or {})
    start = time.monotonic()
    attempt.started_at = time.time()
    job = _wake(spares, envs, attempt) if spares is not None else Job(command, envs)
    output = _Output(attempt, job.lines, start, on_training)
    usage = CpuShare(spare_pids)
    with job:
        _watch(job, output, attempt, hang_timeout, injection, should_stop, usage)
        if attempt.first_step_s is not None:
            usage.sample([p.pid for p in job.processes.procs], force=True)
    attempt.cpu_s = usage.result()
    # Collect what the dead processes wrote before they died.
    deadline = time.monotonic() + 2.0
    while output.open_streams and time.monotonic() < deadline:
        output.read(POLL_S)
    if attempt.outcome != "ok" and output.port_taken:
        attempt.outcome = "port"
    if attempt.outcome == "ok" and attempt.stopped:
        attempt.outcome = "stopped"
    attempt.ended_at = time.time()
    attempt.seconds = round(time.monotonic() - start, 3)
    return attempt


def _child_envs(
    attempt: Attempt,
    memory_base: str,
    cpu_devices: int,
    injection: tuple[int, int] | None,
    env: Mapping[str, str],
) -> list[dict[str, str]]:
    """Every process's variables: its place in the job, its node, `env`, the injection."""
    kill = (
        {"JAXCKPT_KILL_PROCESS": str(injection[0]), "JAXCKPT_KILL_AT_STEP": str(injection[1])}
        if injection is not None
        else {}
    )
    return [
        {
            "JAXCKPT_COORDINATOR": f"127.0.0.1:{attempt.port}",
            "JAXCKPT_NUM_PROCESSES": str(attempt.num_processes),
            "JAXCKPT_PROCESS_ID": str(i),
            "JAXCKPT_CPU_DEVICES": str(cpu_devices),
            "JAXCKPT_FAILURE_DOMAIN": f"node{attempt.nodes[i]}",
            "JAXCKPT_MEMORY_ROOT": os.path.join(memory_base, f"node{attempt.nodes[i]}"),
            **env,
            **kill,
        }
        for i in range(attempt.num_processes)
    ]


def _wake(spares: Job, envs: Sequence[Mapping[str, str]], attempt: Attempt) -> Job:
    """Gives the waiting spares the job's priority back, then each its variables on stdin;
    the spares become the attempt's job."""
    attempt.standby = True
    refused = spares.processes.set_priority(0)
    if refused:
        print(f"[launch] {refused[0]}; the woken spares keep their low priority", flush=True)
    for i, child_env in enumerate(envs):
        # A spare that died meanwhile shows up in `_watch`, as a failed process.
        with contextlib.suppress(OSError):
            spares.processes.send(i, json.dumps({"env": child_env}))
    return spares


class _Output:
    """The job's output as it comes: each line echoed with its process, the events it
    carries recorded in the attempt, and each process's last sign of life."""

    def __init__(
        self,
        attempt: Attempt,
        lines: queue.Queue[tuple[int, str | None]],
        start: float,
        on_training: Callable[[], None] | None,
    ):
        self.attempt = attempt
        self.last_output = [start] * attempt.num_processes
        self.open_streams = attempt.num_processes
        self.port_taken = False
        self._lines = lines
        self._start = start
        self._on_training = on_training

    def read(self, timeout: float) -> bool:
        """Handles one queued line (or end of stream); False if none came in time."""
        try:
            i, line = self._lines.get(timeout=timeout) if timeout else self._lines.get_nowait()
        except queue.Empty:
            return False
        # A closed stream (the process died) counts as its last sign of life.
        self.last_output[i] = time.monotonic()
        if line is None:
            self.open_streams -= 1
            return True
        print(f"[p{i}] {line}", flush=True)
        self.port_taken = self.port_taken or port_in_use(line)
        self._record(i, parse_event(line) or {"event": None})
        return True

    def read_waiting(self) -> None:
        """Handles the lines that come within a poll, and those queued behind them;
        bounded, so that a chatty child cannot starve the checks between polls."""
        if self.read(POLL_S):
            for _ in range(10_000):
                if not self.read(0):
                    break

    def _record(self, i: int, event: dict[str, Any]) -> None:
        attempt = self.attempt
        if event["event"] == StepEvent.kind and isinstance(event.get("step"), int):
            attempt.last_step = max(attempt.last_step, event["step"])
            attempt.last_step_at = time.time()
            if attempt.first_step_s is None:
                attempt.first_step_s = round(time.monotonic() - self._start, 3)
                if self._on_training is not None:
                    self._on_training()
        elif event["event"] == RestoredEvent.kind:
            attempt.restored[i] = event
        elif event["event"] == TimelineEvent.kind:
            attempt.timelines[i] = event
        elif event["event"] == StoppedEvent.kind:
            attempt.stopped = True


def _watch(
    job: Job,
    output: _Output,
    attempt: Attempt,
    hang_timeout: float,
    injection: tuple[int, int] | None,
    should_stop: Callable[[Attempt], bool] | None,
    usage: CpuShare,
) -> None:
    """Reads the job's output until every process exited 0 with its output closed, or one
    failed or hung: that one goes into `attempt`. Asks the job to stop (SIGTERM to every
    process) once `should_stop` says so."""
    while True:
        output.read_waiting()
        if attempt.first_step_s is not None:
            usage.sample([p.pid for p in job.processes.procs])
        if attempt.stop_requested_at is None and should_stop is not None and should_stop(attempt):
            attempt.stop_requested_at = time.time()
            job.processes.terminate()
        now = time.monotonic()
        codes = job.processes.codes()
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        hung = [
            i
            for i, code in enumerate(codes)
            if code is None and now - output.last_output[i] > hang_timeout
        ]
        if failed or hung:
            # Prefer the injected victim when several died in the same poll.
            victim = injection[0] if injection and injection[0] in failed else None
            attempt.process = victim if victim is not None else (failed or hung)[0]
            attempt.returncode = code = codes[attempt.process]
            attempt.outcome = "hang" if code is None else "signal" if code < 0 else "exit"
            attempt.detected_after_s = round(now - output.last_output[attempt.process], 3)
            attempt.detected_at = time.time()
            return
        if all(code == 0 for code in codes) and output.open_streams == 0:
            return
