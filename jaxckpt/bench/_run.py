"""`jaxckpt bench`: what a checkpoint every step costs, each figure against a raw baseline.

    python -m jaxckpt.bench --quick                 # ~2 minutes on 2 cores, small state
    python -m jaxckpt.bench --state-gib 4 --json bench.json
    python -m jaxckpt.bench --store-only --store-emulator s3   # object-store persistence only
    PYTHONPATH=. python -m jaxckpt.bench --gpu     # one process on this machine's accelerator
    python -m jaxckpt.bench --scale                # coordination at N = 8 ... 4096, simulated

Runs N JAX processes on this machine (loopback, one memory root and failure
domain each, like `jaxckpt.launch`) that train an MLP with optax adam, save
with jaxckpt and with Orbax's `StandardCheckpointHandler`, restore from every
tier, and measure the raw operations each figure is bounded by (device->host
copy, tmpfs write, copy into a pre-faulted tmpfs file, fsync'd write, loopback
TCP; Orbax on a tree of 4000 small leaves; with an object store, tensorstore
writing the same chunks there) in the same run. Prints one
table (value, baseline, ratio, target) and optionally writes it as JSON with
the machine it ran on. Every wait on another process has a timeout; the whole
run has a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import psutil

from jaxckpt.bench import _emulator, _figure, _flags, _hsdp, _machine, _plot, _results
from jaxckpt.bench._worker import (
    ENV_COORDINATOR,
    ENV_MEMORY_ROOT,
    ENV_PROCESS_ID,
    PROXY_XLA_FLAGS,
    RESULT_PREFIX,
)

FORMAT_VERSION: Final = 1  # of the JSON report; bump on incompatible changes
_PORT_RETRIES: Final = 2
# The proxy's state and batch: the 192 MiB of a one-process save every step whose step
# took 0.23 s on two CPUs, and a batch that makes it ~0.45 s on one (`docs/benchmarks.md`).
_QUICK: Final = {
    "state_gib": 1 / 8,
    "steps": 8,
    "repeats": 3,
    "deadline_s": 900.0,
    "proxy_state_gib": 1 / 16,
    "proxy_batch": 64,
    "solo_state_gib": 1 / 16,
}
_FULL: Final = {
    "state_gib": 1.0,
    "steps": 16,
    "repeats": 3,
    "deadline_s": 3600.0,
    "proxy_state_gib": 0.1875,
    "proxy_batch": 768,
    "solo_state_gib": 0.1875,
}


def _envs(
    cfg: dict[str, Any], memory_base: Path, port: int, store_env: dict[str, str]
) -> list[dict[str, str]]:
    package_parent = str(Path(__file__).resolve().parent.parent.parent)
    envs = []
    # Process i runs on node i, unless `nodes` names them (a job restarted on other nodes).
    nodes = cfg.get("nodes") or [f"node{i}" for i in range(cfg["processes"])]
    for i, node in enumerate(nodes):
        env = {
            **store_env,
            ENV_PROCESS_ID: str(i),
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_MEMORY_ROOT: str(memory_base / node),
            "JAXCKPT_FAILURE_DOMAIN": node,
            "PYTHONPATH": os.pathsep.join(
                [package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if cfg["platform"] == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
        if cfg.get("proxy"):
            env["XLA_FLAGS"] = " ".join(
                filter(None, [os.environ.get("XLA_FLAGS"), PROXY_XLA_FLAGS])
            )
        envs.append(env)
    return envs


def _run_once(
    cfg: dict[str, Any],
    memory_base: Path,
    logs: list[Path],
    deadline: float,
    store_env: dict[str, str],
) -> str | None:
    """Runs the worker processes once, their output into `logs`; returns why they failed."""
    shown = 0

    def echo() -> None:
        """Echoes process 0's progress lines."""
        nonlocal shown
        lines = logs[0].read_bytes().decode(errors="replace").splitlines()
        for line in lines[shown:]:
            if line.startswith("[bench] "):
                print(line, file=sys.stderr, flush=True)
        shown = len(lines)

    from jaxckpt.launch._supervise import ProcessSet, free_port

    command = [sys.executable, "-m", "jaxckpt.bench._worker", json.dumps(cfg)]
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(open(path, "wb")) for path in logs]
        envs = _envs(cfg, memory_base, free_port(), store_env)
        with ProcessSet(command, envs, outputs) as processes:
            return processes.wait(deadline, tick=echo)


def _run_processes(
    cfg: dict[str, Any],
    memory_base: Path,
    logs: Path,
    deadline: float,
    store_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    # Imported here: `--gpu` runs without the launcher's dependencies (portpicker).
    from jaxckpt.launch._supervise import PortRetries, port_in_use

    ports = PortRetries(_PORT_RETRIES)
    for attempt in itertools.count():
        paths = [logs / f"process{i}.attempt{attempt}.log" for i in range(cfg["processes"])]
        why = _run_once(cfg, memory_base, paths, deadline, store_env or {})
        texts = [path.read_bytes().decode(errors="replace") for path in paths]
        if why is None:
            results = []
            for i, text in enumerate(texts):
                found = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
                if not found:
                    raise RuntimeError(f"Benchmark process {i} printed no result:\n{text[-4000:]}")
                results.append(json.loads(found[-1][len(RESULT_PREFIX) :]))
            return results
        if ports.retry(any(port_in_use(t) for t in texts)):
            shutil.rmtree(memory_base, ignore_errors=True)
            continue
        dump = "\n".join(f"--- process {i}\n{t[-6000:]}" for i, t in enumerate(texts))
        raise RuntimeError(f"The benchmark failed: {why}.\n{dump}")
    raise AssertionError("unreachable")


def _config(args: argparse.Namespace, work_dir: str) -> dict[str, Any]:
    preset = _QUICK if args.quick else _FULL
    return {
        "quick": args.quick,
        "processes": args.processes,
        "devices_per_process": args.devices_per_process,
        "state_gib": args.state_gib if args.state_gib is not None else preset["state_gib"],
        "replicas": args.replicas if args.replicas is not None else int(args.processes > 1),
        "steps": args.steps or preset["steps"],
        "repeats": args.repeats or preset["repeats"],
        "warmup": args.warmup,
        "batch_per_device": args.batch_per_device,
        "many_leaves": args.many_leaves,
        "many_leaf_bytes": int(args.many_leaf_kib * 1024),
        "timeout_s": args.timeout,
        "platform": args.platform,
        "work_dir": work_dir,
        "keep": args.keep,
        "store_only": args.store_only,
        # Set by `main`: a fresh prefix under --store-url or in the emulator's bucket.
        "store_url": None,
        "store_emulator": args.store_emulator,
    }


def _proxy_runs(args: argparse.Namespace) -> bool:
    """Whether `--proxy auto` runs the proxy: not beside an object-store-only run, and
    only where two CPUs can be told apart."""
    return not args.store_only and len(os.sched_getaffinity(0)) >= 2


def _proxy_config(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The proxy's one process on one CPU device (state and batch: `--proxy-*`)."""
    preset = _QUICK if args.quick else _FULL
    return {
        **cfg,
        "proxy": True,
        "processes": 1,
        "devices_per_process": 1,
        "replicas": 0,
        "state_gib": args.proxy_state_gib or preset["proxy_state_gib"],
        "batch_per_device": args.proxy_batch or preset["proxy_batch"],
        "many_leaves": 0,
        "store_url": None,
    }


def _solo_config(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Figures 10a-f's one process: its CPU devices, no replicas (`_solo`)."""
    preset = _QUICK if args.quick else _FULL
    return {
        **cfg,
        "solo": True,
        "processes": 1,
        "replicas": 0,
        "state_gib": args.solo_state_gib or preset["solo_state_gib"],
        "solo_rounds": args.solo_rounds,
        "many_leaves": 0,
        "store_url": None,
    }


def prefault(gib: float) -> dict[str, float]:
    """Touches `gib` GiB of fresh host memory once, then frees it; returns how fast it went.

    A first-touch rate far below the retouch rate means the machine backs memory
    lazily (a VM); the figures are then measured on memory that is already backed.
    """
    import numpy as np

    def touch(nbytes: int) -> float:
        start = time.perf_counter()
        blocks = [np.ones(min(1 << 30, nbytes - i), np.uint8) for i in range(0, nbytes, 1 << 30)]
        seconds = time.perf_counter() - start
        del blocks
        return seconds

    nbytes = int(gib * 2**30)
    if nbytes <= 0:
        return {"gib": 0.0}
    first = touch(nbytes)
    again = touch(nbytes)
    return {
        "gib": gib,
        "first_touch_bytes_per_s": nbytes / first,
        "retouch_bytes_per_s": nbytes / again,
    }


def _store(
    args: argparse.Namespace, cfg: dict[str, Any], logs: Path, stack: contextlib.ExitStack
) -> dict[str, str]:
    """Sets `cfg["store_url"]` to a fresh prefix on the object store, if one is asked for,
    starting the emulator first (stopped when `stack` closes); returns the environment
    the processes need to reach it (the emulator's; a real store's is inherited)."""
    run = f"jaxckpt-bench-{uuid.uuid4().hex[:12]}"
    if args.store_url:
        cfg["store_url"] = f"{args.store_url.rstrip('/')}/{run}"
        return {}
    if not args.store_emulator:
        return {}
    emulator = _emulator.Emulator(args.store_emulator, logs / "emulator.log")
    print(f"[bench] starting the {emulator.kind} emulator", file=sys.stderr, flush=True)
    emulator.start()
    stack.callback(emulator.stop)
    cfg["store_url"] = f"{emulator.url}/{run}"
    return emulator.env()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; prints the table; returns 0 on success, 1 if the run failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--gpu" in argv:
        from jaxckpt.bench import _gpu  # imports JAX: only this mode runs it in the driver

        return _gpu.main(argv)
    if "--scale" in argv:
        from jaxckpt.bench import _scale_cli  # no JAX devices, no processes: a simulation

        return _scale_cli.main(argv)
    if "--reshard" in argv:
        from jaxckpt.bench import _reshard_cli  # its own jobs, one after another

        return _reshard_cli.main(argv, _run_processes)
    parser = _flags.build_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.processes is None:
        args.processes = 4 if args.layout == "hsdp" else 2
    _flags.check(parser, args)
    if args.from_json:
        return _show(args.from_json, args.plot)
    if importlib.util.find_spec("optax") is None:
        parser.error("the benchmark trains with optax: pip install 'jaxckpt[bench]'")
    memory_base, work_dir, cfg = _plan(args)
    start = time.monotonic()
    machine = _prefaulted_machine(args, cfg["state_gib"], memory_base, work_dir)
    deadline = start + (args.deadline or (_QUICK if args.quick else _FULL)["deadline_s"])
    try:
        procs, proxy, solo = _run_phases(args, cfg, memory_base, work_dir, deadline)
    except (RuntimeError, TimeoutError) as e:
        print(f"[bench] {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(memory_base, ignore_errors=True)
            shutil.rmtree(work_dir, ignore_errors=True)
    figs = _figures(args, cfg, procs, proxy, solo)
    first = procs[0] if procs else proxy or solo
    assert first is not None
    report = {
        "format_version": FORMAT_VERSION,
        "command": ["jaxckpt", "bench", *argv],
        "machine": machine,
        "config": cfg,
        "state": {k: first[k] for k in ("shape", "state_bytes", "devices", "platform")},
        "seconds": round(time.monotonic() - start, 1),
        "figures": [dataclasses.asdict(f) for f in figs],
        "processes": procs,
        "proxy": proxy,
        "solo": solo,
    }
    _emit(args, report, figs)
    return 0


def _plan(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """The run's memory base, persistent directory and configuration (said on stderr)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    memory_base = Path(args.memory_root or tempfile.mkdtemp(prefix="jaxckpt-bench-", dir=shm))
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxckpt-bench-"))
    cfg = _config(args, str(work_dir))
    if args.layout == "hsdp":
        cfg.update(layout="hsdp", dp=args.dp, state_mib=args.state_mib, replicas=1)
        cfg["state_gib"] = args.state_mib / 1024
    print(
        f"[bench] {cfg['processes']} processes x {cfg['devices_per_process']} devices, "
        f"state {cfg['state_gib']:g} GiB, replicas {cfg['replicas']}, "
        f"memory {memory_base}, persistent {work_dir}",
        file=sys.stderr,
        flush=True,
    )
    return memory_base, work_dir, cfg


def _prefaulted_machine(
    args: argparse.Namespace, state_gib: float, memory_base: Path, work_dir: Path
) -> dict[str, Any]:
    """What the run measures on, after touching host memory once (`--prefault-gib`)."""
    machine = _machine.machine(str(memory_base), str(work_dir))
    gib = args.prefault_gib
    if gib is None:
        gib = min(12 * state_gib + 1, 0.6 * psutil.virtual_memory().available / 2**30)
    print(f"[bench] touching {gib:.1f} GiB of host memory first", file=sys.stderr, flush=True)
    machine["prefault"] = prefault(gib)
    return machine


def _run_phases(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    memory_base: Path,
    work_dir: Path,
    deadline: float,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """Runs the processes, then the one-process loops (`_solo`) and the proxy where they
    run; returns their results (the last two: None where they did not run)."""
    memory_base.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxckpt-bench-logs-")))
        store_env = _store(args, cfg, logs, stack)
        procs: list[dict[str, Any]] = []
        if args.layout == "hsdp":
            procs = _run_processes(cfg, memory_base, logs, deadline)
        elif args.proxy != "only" and args.solo != "only":
            procs = _run_processes(cfg, memory_base, logs, deadline, store_env)
        solo = None
        if (
            args.layout != "hsdp"
            and args.proxy != "only"
            and (args.solo == "only" or (args.solo == "auto" and not args.store_only))
        ):
            print("[bench] one process, a save every step", file=sys.stderr, flush=True)
            solo_logs = logs / "solo"
            solo_logs.mkdir()
            solo_cfg = _solo_config(cfg, args)
            solo = _run_processes(solo_cfg, memory_base, solo_logs, deadline)[0]
        proxy = None
        if args.layout != "hsdp" and (
            args.proxy == "only"
            or (args.proxy == "auto" and _proxy_runs(args) and args.solo != "only")
        ):
            print("[bench] the accelerator-host proxy", file=sys.stderr, flush=True)
            proxy_logs = logs / "proxy"
            proxy_logs.mkdir()
            proxy = _run_processes(_proxy_config(cfg, args), memory_base, proxy_logs, deadline)[0]
    return procs, proxy, solo


def _figures(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    procs: list[dict[str, Any]],
    proxy: dict[str, Any] | None,
    solo: dict[str, Any] | None,
) -> list[_figure.Figure]:
    """The figures of the layout that ran, the one process's (`_solo`) and the proxy's."""
    if args.layout == "hsdp":
        figs = _hsdp.figures(procs)
    else:
        figs = _results.figures(procs, cfg["warmup"], cfg["replicas"]) if procs else []
    if solo is not None:
        figs += _results.solo_figures(solo["solo"], cfg["warmup"])
    if proxy is not None:
        figs += _results.proxy_figures(proxy["proxy"], cfg["warmup"])
    return figs


def _emit(args: argparse.Namespace, report: dict[str, Any], figs: list[_figure.Figure]) -> None:
    """Prints the table and a summary line; writes the JSON and the plot if asked for."""
    print(_figure.table(figs))
    state, processes = report["state"], report["config"]["processes"]
    print(
        f"\nstate {state['state_bytes'] / 2**30:.3g} GiB ({state['shape']}), "
        f"{processes if report['processes'] else 1} processes, {report['seconds']} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        print(f"plot: {_plot.plot(report, args.plot)}")


def _show(path: str, png: str | None) -> int:
    """Prints the figures of a saved report, and draws them if `png` is given."""
    try:
        report = json.loads(Path(path).read_text())
        figs = [_figure.Figure.from_dict(f) for f in report["figures"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"jaxckpt bench: error: {path} is not a report of --json ({e}).", file=sys.stderr)
        return 2
    print(_figure.table(figs))
    if png:
        print(f"plot: {_plot.plot(report, png)}")
    return 0
