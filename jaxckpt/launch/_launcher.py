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
- ``--standby``: hot spares (`_standby`). Before the first attempt, the launcher starts
  a spare job of each size a restart may take (the job's, ``--processes-after-failure``,
  and with ``--grow-at-save`` the launched size): its processes get
  ``JAXCKPT_STANDBY=1`` and the job variables above (a coordinator port of their own),
  so they import jax, join their job and prepare what does not depend on where they run
  (the examples build their mesh, compile their train step and prepare their restore),
  print a ``standby`` event and wait for one line on stdin; the job starts once they are
  ready, and they wait at nice 19 in the idle scheduling class (`_priority`), held to
  ``--standby-cpu`` of the CPU while the job trains (`_throttle`). At a
  restart the spares of its size get ``{"env": {...}}``, every variable above (only the
  memory root, failure domain and failure injection are new to them), and nice 0 back;
  the spares that replace them start once the restarted job trains, at nice 19. The
  command must support it (the examples do).

Elastic jobs (`_restarts`): with ``--processes-after-failure M`` a failure restarts the
job on M of its nodes; a node that registers later (``--register-dir``, `_registry`;
``--return-node K@S`` simulates it) grows it back to ``-n`` with ``--grow-at-save``: the
job gets SIGTERM, stops after its next save, and restarts on the larger set of nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from jaxckpt.launch import _priority, _throttle
from jaxckpt.launch._children import ENV_CACHE_DIR, compilation_cache_env
from jaxckpt.launch._report import describe_returncode as describe_returncode
from jaxckpt.launch._restarts import Restarts
from jaxckpt.launch._restarts import next_nodes as next_nodes


def parse_injection(spec: str) -> tuple[int, int]:
    """Parses ``P@S`` (process P, step S)."""
    try:
        process, step = (int(part) for part in spec.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROCESS@STEP, got {spec!r}") from None
    return process, step


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
    p.add_argument(
        "--standby-nice",
        type=int,
        default=_priority.NICEST,
        metavar="N",
        help="the spares' nice value until woken (0..19, default 19, which also puts them in"
        " the idle scheduling class: they take only the CPU the job leaves idle)",
    )
    p.add_argument(
        "--standby-cpu",
        type=float,
        default=_throttle.DEFAULT_SHARE,
        metavar="SHARE",
        help="while the job trains, the spares no restart woke run for SHARE of every"
        f" {_throttle.PERIOD_S * 1e3:.0f} ms and are stopped (SIGSTOP) for the rest: the CPU"
        f" they take is what the job loses (default {_throttle.DEFAULT_SHARE}; 1: no cap)",
    )
    p.add_argument(
        "--standby-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="the first attempt waits up to S seconds for its spares to be ready",
    )
    p.add_argument(
        "--grow-at-save",
        action="store_true",
        help="when a node registers while the job runs below -n processes, stop the job at"
        " its next save (SIGTERM) and restart it on the returned nodes too",
    )
    p.add_argument(
        "--return-node",
        type=parse_injection,
        metavar="K@S",
        help="node K registers once the job reached step S (simulates a host coming back)",
    )
    p.add_argument(
        "--register-dir",
        metavar="DIR",
        help="where hosts register: a file node<k> per host (default <memory-base>/register)",
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
    launch = Restarts(args, command, injection, base, cache_env)
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
        "grows": launch.grows,
    }
    _write(args, report)
    grown = f", {len(launch.grows)} grow back(s)" if launch.grows else ""
    print(
        f"[launch] {'success' if ok else 'FAILED'} after {launch.restarts} restarts{grown},"
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
    if not 0 <= args.standby_nice <= _priority.NICEST:
        parser.error(f"--standby-nice must be in 0..{_priority.NICEST}, got {args.standby_nice}")
    if not 0 < args.standby_cpu <= 1:
        parser.error(f"--standby-cpu must be in (0, 1], got {args.standby_cpu}")
    if args.kill and args.lose_node:
        parser.error("--kill and --lose-node are exclusive")
    if args.timeline_png:
        from jaxckpt.launch import _timeline_plot

        try:
            _timeline_plot.require_matplotlib()
        except ImportError as e:
            parser.error(str(e))
    if args.return_node and args.return_node[0] < 0:
        parser.error(f"--return-node names node {args.return_node[0]}: nodes are >= 0")
    injection = args.lose_node or args.kill
    if injection and not 0 <= injection[0] < args.num_processes:
        parser.error(f"process {injection[0]} is not in 0..{args.num_processes - 1}")
    return args, command, injection


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
