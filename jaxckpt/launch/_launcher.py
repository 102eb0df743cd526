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
import dataclasses
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from jaxckpt.launch._attempt import Attempt, run_attempt
from jaxckpt.launch._children import (
    ENV_CACHE_DIR,
    Job,
    compilation_cache_env,
    start_spares,
)
from jaxckpt.launch._supervise import PortRetries, free_port
from jaxckpt.launch._timeline import format_timeline, restart_timeline

MAX_PORT_RETRIES: Final = 5


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
    args, command, injection = _parse(argv)
    own_base = args.memory_base is None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    base = args.memory_base or tempfile.mkdtemp(prefix="jaxckpt-launch-", dir=shm)
    os.makedirs(base, exist_ok=True)
    cache_env = compilation_cache_env(args.compilation_cache, base)
    if ENV_CACHE_DIR in cache_env:
        print(f"[launch] compilation cache: {cache_env[ENV_CACHE_DIR]}", flush=True)

    start = time.monotonic()
    launch = _Restarts(args, command, injection, base, cache_env)
    try:
        launch.run()
    finally:
        launch.close()
        if own_base and not args.keep_memory:
            shutil.rmtree(base, ignore_errors=True)

    ok = launch.attempts[-1].outcome == "ok"
    report = {
        "command": list(command),
        "num_processes": args.num_processes,
        "success": ok,
        "seconds": round(time.monotonic() - start, 3),
        "restarts": launch.restarts,
        "attempts": [dataclasses.asdict(a) for a in launch.attempts],
        "failures": launch.failures,
    }
    _write(args, report)
    print(
        f"[launch] {'success' if ok else 'FAILED'} after {launch.restarts} restarts,"
        f" {report['seconds']} s",
        flush=True,
    )
    return 0 if ok else 1


def _parse(
    argv: Sequence[str] | None,
) -> tuple[argparse.Namespace, list[str], tuple[int, int] | None]:
    """The arguments, the command after ``--`` and the failure to inject; refuses bad ones
    (`parser.error`: exit status 2)."""
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
    return args, command, injection


class _Restarts:
    """The attempts of one launch: the first, then a restart after each failure (a port
    retry is no restart) until one attempt succeeds or ``--max-restarts`` are spent.

    Attributes:
        attempts: Every attempt, in order.
        failures: A `failure_report` per failure, with the restart that followed it.
        restarts: Restarts so far.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        command: Sequence[str],
        injection: tuple[int, int] | None,
        base: str,
        cache_env: Mapping[str, str],
    ):
        self.attempts: list[Attempt] = []
        self.failures: list[dict[str, Any]] = []
        self.restarts = 0
        self._args = args
        self._command = command
        self._injection = injection
        self._base = base
        self._cache_env = cache_env
        self._nodes = list(range(args.num_processes))
        self._ports = PortRetries(MAX_PORT_RETRIES)
        self._pending: tuple[Attempt, bool] | None = None  # failed attempt awaiting its restart
        self._spares: Job | None = None  # hot spares for the next attempt (--standby)

    def run(self) -> None:
        """Runs attempts until one succeeds or no restart is left."""
        while True:
            attempt, injected = self._run_next()
            if self._ports.retry(attempt.outcome == "port"):
                print(f"[launch] port {attempt.port} in use, retrying", flush=True)
                continue
            if self._pending is not None:
                self.failures.append(failure_report(self._pending[0], attempt, self._pending[1]))
                print("[launch] " + format_failure(self.failures[-1]), flush=True)
                self._pending = None
            if attempt.outcome == "ok" or not self._restart_after(attempt, injected):
                return

    def close(self) -> None:
        """Kills the spares no attempt woke."""
        if self._spares is not None:
            self._spares.processes.kill()

    def _run_next(self) -> tuple[Attempt, bool]:
        """Runs the next attempt (on the spares, if they still wait); returns it and
        whether it carried the injected failure (only attempts before any ran do)."""
        woken = self._take_spares()
        port = woken.port if woken is not None and woken.port else free_port()
        nodes = self._nodes
        attempt = Attempt(
            index=len(self.attempts), num_processes=len(nodes), port=port, nodes=nodes
        )
        first = all(a.outcome == "port" for a in self.attempts)
        inject = self._injection if first else None
        print(
            f"[launch] attempt {attempt.index}: {len(nodes)} processes on nodes {nodes},"
            f" port {attempt.port}" + (" (hot spares)" if woken else ""),
            flush=True,
        )
        run_attempt(
            attempt,
            self._command,
            self._base,
            self._args.cpu_devices,
            self._args.hang_timeout,
            inject,
            env=self._cache_env,
            spares=woken,
            on_training=self._prepare_spares,
        )
        self.attempts.append(attempt)
        return attempt, inject is not None

    def _take_spares(self) -> Job | None:
        """The spares for the next attempt, if they can be its processes (else killed)."""
        spares, self._spares = self._spares, None
        if spares is None or spares.usable_for(len(self._nodes)):
            return spares
        spares.processes.kill()
        return None

    def _prepare_spares(self) -> None:
        """Starts the next attempt's spares, once this one trains (it has the CPUs now)."""
        args = self._args
        if args.standby and self._spares is None and self.restarts < args.max_restarts:
            count = args.processes_after_failure or len(self._nodes)
            self._spares = start_spares(self._command, count, args.cpu_devices, self._cache_env)

    def _restart_after(self, attempt: Attempt, injected: bool) -> bool:
        """Handles a failed attempt: loses its node's memory for ``--lose-node``, then
        plans the restart; False when no restart is left."""
        args = self._args
        lose = bool(args.lose_node) and injected
        lost_node = None
        if lose and attempt.process is not None:
            lost_node = self._nodes[args.lose_node[0]]
            shutil.rmtree(os.path.join(self._base, f"node{lost_node}"), ignore_errors=True)
        print(
            f"[launch] process {attempt.process} failed: {attempt.outcome}"
            f" ({describe_returncode(attempt.returncode)}) at step {attempt.last_step},"
            f" detected after {attempt.detected_after_s} s; killed the others",
            flush=True,
        )
        if self.restarts >= args.max_restarts:
            self.failures.append(failure_report(attempt, None, lose))
            print(f"[launch] giving up after {self.restarts} restarts", flush=True)
            return False
        self.restarts += 1
        self._pending = (attempt, lose)
        self._nodes = next_nodes(self._nodes, lost_node, args.processes_after_failure)
        return True


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Writes the report as JSON (``--json``) and the recovery timelines (``--timeline-png``)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.timeline_png:
        if any(f.get("restart") for f in report["failures"]):
            from jaxckpt.launch import _timeline_plot

            print(f"[launch] timeline: {_timeline_plot.plot(report, args.timeline_png)}")
        else:
            print("[launch] no restart: no recovery timeline to draw", flush=True)
