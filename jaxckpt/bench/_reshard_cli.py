"""`jaxckpt bench --reshard`: restores onto another layout, against the floor and Orbax.

    jaxckpt bench --reshard                          # every direction, 64 MiB, 3 repeats
    jaxckpt bench --reshard --quick                  # 4 MiB, 1 repeat (a smoke run)
    jaxckpt bench --reshard --directions finer_2_8,procs_2_4 --state-mib 256 --json r.json

One process with 64 CPU devices saves and restores each one-process direction (a
finer or coarser mesh, another axis order, replicated <-> sharded: `_reshard.DIRECTIONS`)
from its own memory and from the persistent tier. A direction that changes the process
count is two jobs: N processes save (one replica each, persisted), a node is lost, and
M processes restore from the memory tiers left (own and peers'), then from the
persistent tier once every memory tier dropped the step. Every restore is measured
against its floor (the needed bytes read from the same tier, checksummed and put on
the target devices) and against Orbax restoring its own copy onto the same target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from jaxckpt.bench import _figure, _machine, _reshard

# How the driver runs one job: (config, memory base, log dir, deadline) -> each process's
# result (`_run._run_processes`, passed in by `_run.main`).
Launch = Callable[[dict[str, Any], Path, Path, float], list[dict[str, Any]]]

FORMAT_VERSION: Final = 1  # of the JSON report; bump on incompatible changes
_DEFAULTS: Final = {"state_mib": 64.0, "repeats": 3, "deadline_s": 1800.0}
_QUICK: Final = {"state_mib": 4.0, "repeats": 1, "deadline_s": 900.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxckpt bench --reshard", description=__doc__.splitlines()[0])
    p.add_argument("--reshard", action="store_true", required=True, help="this benchmark")
    p.add_argument("--quick", action="store_true", help="4 MiB, one repeat (a smoke run)")
    p.add_argument("--state-mib", type=float, help="the saved state, MiB (default 64; quick: 4)")
    p.add_argument("--repeats", type=int, help="restores per tier (default 3; quick: 1)")
    p.add_argument(
        "--tile-kib",
        type=int,
        help="TierOptions.tile_bytes in KiB (default: its default, 1024; 0: chunks saved whole)",
    )
    p.add_argument(
        "--directions",
        default=",".join(d.name for d in _reshard.DIRECTIONS),
        help="comma-separated directions (default: all): "
        + ", ".join(d.name for d in _reshard.DIRECTIONS),
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--memory-root", help="parent of the memory tiers (default: a dir in /dev/shm)")
    p.add_argument("--work-dir", help="persistent checkpoints (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds any one wait may take")
    p.add_argument("--deadline", type=float, help="seconds the whole run may take")
    p.add_argument("--keep", action="store_true", help="keep the memory tiers and checkpoints")
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The directions asked for; refuses bad flags (exit status 2) before anything starts."""
    names = [n for n in args.directions.split(",") if n]
    unknown = [n for n in names if n not in _reshard.BY_NAME]
    if unknown or not names:
        parser.error(
            f"--directions must name some of {', '.join(_reshard.BY_NAME)}; got {args.directions!r}"
        )
    if args.state_mib is not None and not args.state_mib > 0:
        parser.error(f"--state-mib must be positive, got {args.state_mib}")
    if args.tile_kib is not None and args.tile_kib < 0:
        parser.error(f"--tile-kib must be 0 (whole chunks) or positive, got {args.tile_kib}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    return names


def main(argv: Sequence[str] | None, launch: Launch) -> int:
    """Runs the jobs through `launch`; prints the figures and every process's restores;
    returns 0 on success, 1 if a job failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    names = _check(parser, args)
    preset = _QUICK if args.quick else _DEFAULTS
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    memory_base = Path(args.memory_root or tempfile.mkdtemp(prefix="jaxckpt-reshard-", dir=shm))
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxckpt-reshard-"))
    cfg = {
        "layout": "reshard",
        "quick": args.quick,
        "state_mib": args.state_mib or preset["state_mib"],
        "repeats": args.repeats or preset["repeats"],
        # None: TierOptions' default; 0: whole chunks.
        "tile_bytes": None if args.tile_kib is None else args.tile_kib << 10,
        "timeout_s": args.timeout,
        "platform": "cpu",
        "work_dir": str(work_dir),
    }
    start = time.monotonic()
    deadline = start + (args.deadline or preset["deadline_s"])
    machine = _machine.machine(str(memory_base), str(work_dir))
    try:
        procs = _jobs(launch, cfg, names, memory_base, deadline)
    except (RuntimeError, TimeoutError) as e:
        print(f"[bench] {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(memory_base, ignore_errors=True)
            shutil.rmtree(work_dir, ignore_errors=True)
    results = [r for p in procs for r in p["results"]]
    figs = _reshard.figures(results)
    print(_figure.table(figs))
    print()
    print(_reshard.per_process_table(results))
    print(f"\nstate {procs[0]['shape']}, {time.monotonic() - start:.1f} s")
    if args.json:
        report = {
            "format_version": FORMAT_VERSION,
            "command": ["jaxckpt", "bench", *argv],
            "machine": machine,
            "config": cfg,
            "state": {k: procs[0][k] for k in ("shape", "state_bytes")},
            "seconds": round(time.monotonic() - start, 1),
            "figures": [dataclasses.asdict(f) for f in figs],
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _jobs(
    launch: Launch, cfg: dict[str, Any], names: list[str], memory_base: Path, deadline: float
) -> list[dict[str, Any]]:
    """Runs one job for the one-process directions, two for each other; every job's
    processes' results."""
    directions = [_reshard.BY_NAME[n] for n in names]
    single = [d.name for d in directions if not d.multiprocess]
    procs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxckpt-reshard-logs-") as tmp:
        logs = Path(tmp)
        if single:
            _say(f"one process, {_reshard.ONE_PROCESS_DEVICES} devices: {', '.join(single)}")
            job = {
                **cfg,
                "role": "single",
                "directions": single,
                "processes": 1,
                "devices_per_process": _reshard.ONE_PROCESS_DEVICES,
                "replicas": 0,
            }
            procs += _job(launch, job, memory_base / "single", logs / "single", deadline)
        for d in directions:
            if d.multiprocess:
                procs += _resized(launch, cfg, d, memory_base / d.name, logs / d.name, deadline)
    return procs


def _resized(
    launch: Launch,
    cfg: dict[str, Any],
    d: _reshard.Direction,
    base: Path,
    logs: Path,
    deadline: float,
) -> list[dict[str, Any]]:
    """A direction that changes the process count: the saving job, a node loss, the
    restoring job (the results are the restoring job's)."""
    job = {**cfg, "directions": [d.name], "replicas": 1}
    _say(f"{d.what}: {d.save_processes} processes save")
    _job(
        launch,
        {
            **job,
            "role": "save",
            "processes": d.save_processes,
            "devices_per_process": d.devices_per_process(saving=True),
        },
        base,
        logs / "save",
        deadline,
    )
    for node in d.lost:
        shutil.rmtree(base / node, ignore_errors=True)
    lost = f"{', '.join(d.lost)} lost, " if d.lost else ""
    _say(f"{d.what}: {lost}{d.restore_processes} processes restore")
    return _job(
        launch,
        {
            **job,
            "role": "restore",
            "processes": d.restore_processes,
            "devices_per_process": d.devices_per_process(saving=False),
            "nodes": list(d.restart_nodes),
        },
        base,
        logs / "restore",
        deadline,
    )


def _job(
    launch: Launch, cfg: dict[str, Any], base: Path, logs: Path, deadline: float
) -> list[dict[str, Any]]:
    """One job's processes run to the end (memory roots under `base`); their results."""
    base.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    return launch(cfg, base, logs, deadline)


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
