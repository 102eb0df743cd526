"""Local multi-process launcher with failure injection and recovery reports.

Runs N copies of a command as one ``jax.distributed`` job on this machine, watches them,
and when one dies or hangs kills the rest, restarts the whole set and reports how the
restart went. Restarting every process is the only recovery JAX allows: a
``jax.distributed`` job cannot take a restarted process back in, and its survivors fail
or hang in their next collective::

    python -m jaxckpt.launch -n 4 --kill 2@7 -- python examples/lm.py --quick --ckpt-dir /tmp/c

Each child gets ``JAXCKPT_COORDINATOR=127.0.0.1:PORT``, ``JAXCKPT_NUM_PROCESSES``,
``JAXCKPT_PROCESS_ID``, ``JAXCKPT_CPU_DEVICES``, ``JAXCKPT_FAILURE_DOMAIN=node<i>`` and
``JAXCKPT_MEMORY_ROOT=<memory-base>/node<i>``, plus ``JAXCKPT_KILL_AT_STEP`` /
``JAXCKPT_KILL_PROCESS`` in the first attempt when a failure is injected. Its output lines
are echoed with a ``[p<i>]`` prefix; its event lines (`_events`: ``step``, ``restored``,
``timeline``) feed the report, which gives every restart's recovery timeline
(`_timeline`). The launcher does not import jax.

Two things shorten a restart:

- JAX's persistent compilation cache, on by default: every child gets
  ``JAX_COMPILATION_CACHE_DIR=<memory-base>/compilation-cache`` (``--compilation-cache``
  to choose, ``off`` to leave the environment alone; a directory already set in the
  environment is kept) and, unless set, ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``.
  JAX reads both at import; a restarted process loads its executables instead of
  compiling them again.
- ``--standby``: hot spares. Once an attempt trains, the launcher starts the job of the
  next one: its processes get ``JAXCKPT_STANDBY=1`` and the job variables above (a
  coordinator port of their own), so they import jax, join their job and prepare what
  does not depend on where they run (the examples build their mesh and compile their
  train step), then wait for one line on stdin. At a restart each gets
  ``{"env": {...}}``, every variable above; only the memory root, failure domain and
  failure injection are new to it. The command must support it (the examples do).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from jaxckpt.launch._children import (
    ENV_CACHE_DIR,
    Job,
    compilation_cache_env,
    start_spares,
)
from jaxckpt.launch._events import RestoredEvent, StepEvent, TimelineEvent, parse_event
from jaxckpt.launch._supervise import PortRetries, free_port, port_in_use
from jaxckpt.launch._timeline import format_timeline, restart_timeline

MAX_PORT_RETRIES: Final = 5
POLL_S: Final = 0.05


@dataclasses.dataclass
class Attempt:
    """One run of the whole process set.

    Attributes:
        index: 0 for the first run, then 1, 2, ... per restart (port retries included).
        num_processes: Processes in this run.
        port: Coordinator port.
        outcome: ``ok``, ``exit`` (non-zero code), ``signal``, ``hang`` or ``port``.
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


def next_nodes(nodes: list[int], lost: int | None, count: int | None) -> list[int]:
    """The nodes of the restarted job.

    The same nodes when the job keeps its size (a lost node comes back empty, like
    a spare); when it shrinks, the surviving nodes in order, the lost one first out;
    when it grows, fresh nodes.
    """
    if count is None or count == len(nodes):
        return list(nodes)
    survivors = [k for k in nodes if k != lost]
    fresh = range(max(nodes) + 1, max(nodes) + 1 + max(0, count - len(survivors)))
    return (survivors + list(fresh))[:count]


def parse_injection(spec: str) -> tuple[int, int]:
    """Parses ``P@S`` (process P, step S)."""
    try:
        process, step = (int(part) for part in spec.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROCESS@STEP, got {spec!r}") from None
    return process, step


def describe_returncode(code: int | None) -> str:
    """Describes a return code as ``exit N`` or the signal name."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
    return f"killed by {name}"


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

    Returns:
        ``attempt``, filled in.
    """
    n = attempt.num_processes
    kill = (
        {"JAXCKPT_KILL_PROCESS": str(injection[0]), "JAXCKPT_KILL_AT_STEP": str(injection[1])}
        if injection is not None
        else {}
    )
    envs = [
        {
            "JAXCKPT_COORDINATOR": f"127.0.0.1:{attempt.port}",
            "JAXCKPT_NUM_PROCESSES": str(n),
            "JAXCKPT_PROCESS_ID": str(i),
            "JAXCKPT_CPU_DEVICES": str(cpu_devices),
            "JAXCKPT_FAILURE_DOMAIN": f"node{attempt.nodes[i]}",
            "JAXCKPT_MEMORY_ROOT": os.path.join(memory_base, f"node{attempt.nodes[i]}"),
            **(env or {}),
            **kill,
        }
        for i in range(n)
    ]
    start = time.monotonic()
    attempt.started_at = time.time()
    if spares is not None:
        job, attempt.standby = spares, True
        for i, child_env in enumerate(envs):
            # A spare that died meanwhile shows up below, as a failed process.
            with contextlib.suppress(OSError):
                job.processes.send(i, json.dumps({"env": child_env}))
    else:
        job = Job(command, envs)
    lines = job.lines
    last_output = [start] * n
    open_streams = n
    port_taken = False

    def read(timeout: float) -> bool:
        """Handles one queued line (or end of stream); False if none came in time."""
        nonlocal open_streams, port_taken
        try:
            i, line = lines.get(timeout=timeout) if timeout else lines.get_nowait()
        except queue.Empty:
            return False
        # A closed stream (the process died) counts as its last sign of life.
        last_output[i] = time.monotonic()
        if line is None:
            open_streams -= 1
            return True
        print(f"[p{i}] {line}", flush=True)
        port_taken = port_taken or port_in_use(line)
        event = parse_event(line) or {"event": None}
        if event["event"] == StepEvent.kind and isinstance(event.get("step"), int):
            attempt.last_step = max(attempt.last_step, event["step"])
            if attempt.first_step_s is None:
                attempt.first_step_s = round(time.monotonic() - start, 3)
                if on_training is not None:
                    on_training()
        elif event["event"] == RestoredEvent.kind:
            attempt.restored[i] = event
        elif event["event"] == TimelineEvent.kind:
            attempt.timelines[i] = event
        return True

    with job:
        processes = job.processes
        while True:
            # Bounded, so that a chatty child cannot starve the checks below.
            if read(POLL_S):
                for _ in range(10_000):
                    if not read(0):
                        break
            now = time.monotonic()
            codes = processes.codes()
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            hung = [
                i
                for i, code in enumerate(codes)
                if code is None and now - last_output[i] > hang_timeout
            ]
            if failed or hung:
                # Prefer the injected victim when several died in the same poll.
                victim = injection[0] if injection and injection[0] in failed else None
                attempt.process = victim if victim is not None else (failed or hung)[0]
                attempt.returncode = code = codes[attempt.process]
                attempt.outcome = "hang" if code is None else "signal" if code < 0 else "exit"
                attempt.detected_after_s = round(now - last_output[attempt.process], 3)
                attempt.detected_at = time.time()
                break
            if all(code == 0 for code in codes) and open_streams == 0:
                break
    # Collect what the dead processes wrote before they died.
    deadline = time.monotonic() + 2.0
    while open_streams and time.monotonic() < deadline:
        read(POLL_S)
    if attempt.outcome != "ok" and port_taken:
        attempt.outcome = "port"
    attempt.seconds = round(time.monotonic() - start, 3)
    return attempt


def failure_report(failed: Attempt, after: Attempt | None, node_lost: bool) -> dict[str, Any]:
    """Summarizes one failure and the restart that followed it."""
    report: dict[str, Any] = {
        "attempt": failed.index,
        "process": failed.process,
        "kind": failed.outcome,
        "status": describe_returncode(failed.returncode),
        "detected_after_s": failed.detected_after_s,
        "last_step": failed.last_step,
        "node_lost": node_lost,
    }
    if after is not None:
        steps = [int(after.restored.get(i, {}).get("step", 0)) for i in range(after.num_processes)]
        restored_step = min(steps, default=0)
        report["restart"] = {
            "attempt": after.index,
            "processes": after.num_processes,
            "restored": {
                str(i): {k: e.get(k) for k in ("step", "tier", "seconds")}
                for i, e in sorted(after.restored.items())
            },
            "restored_step": restored_step,
            "restore_seconds": max(
                (e.get("seconds") or 0.0 for e in after.restored.values()), default=None
            ),
            "steps_lost": failed.last_step - restored_step,
            "first_step_after_s": after.first_step_s,
            "outcome": after.outcome,
            "timeline": restart_timeline(
                detected_after_s=failed.detected_after_s,
                restart_after_s=(
                    round(after.started_at - failed.detected_at, 3)
                    if failed.detected_at is not None
                    else None
                ),
                first_step_after_s=after.first_step_s,
                started_at=after.started_at,
                timelines=after.timelines,
                restored=after.restored,
                standby=after.standby,
            ),
        }
    return report


def format_failure(report: dict[str, Any]) -> str:
    """Renders a failure report as a few human-readable lines."""
    text = (
        f"failure in attempt {report['attempt']}: process {report['process']} {report['kind']}"
        f" ({report['status']}), last step {report['last_step']},"
        f" detected after {report['detected_after_s']} s"
        + (", node memory deleted" if report["node_lost"] else "")
    )
    restart = report.get("restart")
    if restart is None:
        return text + "\n  no restart"
    tiers = ", ".join(
        f"p{i}: step {e['step']} from {e['tier']}" for i, e in restart["restored"].items()
    )
    return (
        f"{text}\n  restart (attempt {restart['attempt']}, {restart['processes']} processes):"
        f" restored step {restart['restored_step']} [{tiers or 'nothing restored'}],"
        f" restore {restart['restore_seconds']} s, steps lost {restart['steps_lost']},"
        f" first step {restart['first_step_after_s']} s after start, {restart['outcome']}"
        f"\n  {format_timeline(restart['timeline'])}"
    )


def build_parser() -> argparse.ArgumentParser:
    """Returns the launcher's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m jaxckpt.launch", description=__doc__.splitlines()[0]
    )
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("--cpu-devices", type=int, default=2, help="CPU devices per process")
    p.add_argument("--memory-base", help="parent of node<i> memory roots (default: /dev/shm)")
    p.add_argument("--keep-memory", action="store_true", help="keep the default memory base")
    p.add_argument("--hang-timeout", type=float, default=120.0, help="seconds without output")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--kill", type=parse_injection, metavar="P@S", help="SIGKILL P at step S")
    p.add_argument("--lose-node", type=parse_injection, metavar="P@S", help="--kill + lose memory")
    p.add_argument("--processes-after-failure", type=int, metavar="M", help="restart with M")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument(
        "--timeline-png",
        metavar="PATH",
        help="draw every restart's recovery timeline as a PNG (needs matplotlib: the plot extra)",
    )
    p.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="JAX persistent compilation cache for the children, or 'off'"
        " (default: $JAX_COMPILATION_CACHE_DIR, else <memory-base>/compilation-cache)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="keep hot spares (JAXCKPT_STANDBY=1) ready for the next restart",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns 0 iff the last attempt ended with every process exiting 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.num_processes < 1 or (args.processes_after_failure or 1) < 1:
        parser.error("process counts must be at least 1")
    if args.kill and args.lose_node:
        parser.error("--kill and --lose-node are exclusive")
    if args.timeline_png:
        from jaxckpt.launch import _timeline_plot

        try:
            _timeline_plot.require_matplotlib()
        except ImportError as e:
            parser.error(str(e))
    injection = args.lose_node or args.kill
    if injection and not 0 <= injection[0] < args.num_processes:
        parser.error(f"process {injection[0]} is not in 0..{args.num_processes - 1}")
    own_base = args.memory_base is None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    base = args.memory_base or tempfile.mkdtemp(prefix="jaxckpt-launch-", dir=shm)
    os.makedirs(base, exist_ok=True)
    cache_env = compilation_cache_env(args.compilation_cache, base)
    if ENV_CACHE_DIR in cache_env:
        print(f"[launch] compilation cache: {cache_env[ENV_CACHE_DIR]}", flush=True)

    start = time.monotonic()
    attempts: list[Attempt] = []
    failures: list[dict[str, Any]] = []
    pending: tuple[Attempt, bool] | None = None  # failed attempt awaiting its restart
    restarts = 0
    ports = PortRetries(MAX_PORT_RETRIES)
    nodes = list(range(args.num_processes))
    spares: Job | None = None  # hot spares for the next attempt (--standby)

    def prepare_spares() -> None:
        """Starts the next attempt's spares, once this one trains (it has the CPUs now)."""
        nonlocal spares
        if args.standby and spares is None and restarts < args.max_restarts:
            count = args.processes_after_failure or len(nodes)
            spares = start_spares(command, count, args.cpu_devices, cache_env)

    try:
        while True:
            woken = None
            if spares is not None:
                woken = spares if spares.usable_for(len(nodes)) else None
                if woken is None:
                    spares.processes.kill()
                spares = None
            port = woken.port if woken is not None and woken.port else free_port()
            attempt = Attempt(index=len(attempts), num_processes=len(nodes), port=port, nodes=nodes)
            first = all(a.outcome == "port" for a in attempts)
            inject = injection if first else None
            print(
                f"[launch] attempt {attempt.index}: {len(nodes)} processes on nodes {nodes},"
                f" port {attempt.port}" + (" (hot spares)" if woken else ""),
                flush=True,
            )
            run_attempt(
                attempt,
                command,
                base,
                args.cpu_devices,
                args.hang_timeout,
                inject,
                env=cache_env,
                spares=woken,
                on_training=prepare_spares,
            )
            attempts.append(attempt)
            if ports.retry(attempt.outcome == "port"):
                print(f"[launch] port {attempt.port} in use, retrying", flush=True)
                continue
            if pending is not None:
                failures.append(failure_report(pending[0], attempt, pending[1]))
                print("[launch] " + format_failure(failures[-1]), flush=True)
                pending = None
            if attempt.outcome == "ok":
                break
            lose = bool(args.lose_node) and inject is not None
            lost_node = None
            if lose and attempt.process is not None:
                lost_node = nodes[args.lose_node[0]]
                shutil.rmtree(os.path.join(base, f"node{lost_node}"), ignore_errors=True)
            print(
                f"[launch] process {attempt.process} failed: {attempt.outcome}"
                f" ({describe_returncode(attempt.returncode)}) at step {attempt.last_step},"
                f" detected after {attempt.detected_after_s} s; killed the others",
                flush=True,
            )
            if restarts >= args.max_restarts:
                failures.append(failure_report(attempt, None, lose))
                print(f"[launch] giving up after {restarts} restarts", flush=True)
                break
            restarts += 1
            pending = (attempt, lose)
            nodes = next_nodes(nodes, lost_node, args.processes_after_failure)
    finally:
        if spares is not None:
            spares.processes.kill()
        if own_base and not args.keep_memory:
            shutil.rmtree(base, ignore_errors=True)

    ok = attempts[-1].outcome == "ok"
    report = {
        "command": list(command),
        "num_processes": args.num_processes,
        "success": ok,
        "seconds": round(time.monotonic() - start, 3),
        "restarts": restarts,
        "attempts": [dataclasses.asdict(a) for a in attempts],
        "failures": failures,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.timeline_png:
        if any(f.get("restart") for f in failures):
            from jaxckpt.launch import _timeline_plot

            print(f"[launch] timeline: {_timeline_plot.plot(report, args.timeline_png)}")
        else:
            print("[launch] no restart: no recovery timeline to draw", flush=True)
    print(
        f"[launch] {'success' if ok else 'FAILED'} after {restarts} restarts, {report['seconds']} s",
        flush=True,
    )
    return 0 if ok else 1
