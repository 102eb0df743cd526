"""The `jaxckpt` command: see what can be restored, check it, and choose intervals.

    jaxckpt ls DIR [--memory-root PATH ...]         every step and where it lives
    jaxckpt inspect DIR STEP                        the saved tree, versions, save metrics
    jaxckpt verify DIR STEP [--memory-root PATH ...]  CRC-32 of every copy in reach
    jaxckpt advise DIR --mtbf-hours H               intervals from Young/Daly
    jaxckpt export DIR STEP OUT --format orbax|safetensors  a durable step, without jaxckpt
    jaxckpt bench ...                               the benchmark suite

DIR is a local directory or an object-store URL (gs://bucket/path,
s3://bucket/path), read with the credentials and endpoint the standard variables
give (application default credentials, STORAGE_EMULATOR_HOST and
TENSORSTORE_GCS_HTTP_URL; AWS_* and AWS_ENDPOINT_URL). Memory roots are local
paths, so on an object store without --memory-root only the persisted copies
are listed and checked, and the output says so.

Every command takes `--json`. Exit status: 0 fine, 1 `verify` found a bad copy,
2 bad input (or an error reading the checkpoint), 3 `verify` found no bad copy
but some part has no copy in reach.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import rich.console
from rich import progress

from jaxckpt.restore import _export
from jaxckpt.tools import _advise, _catalog, _costs, _inspect, _listing, _mtbf, _table, _verify

OK, BAD_COPY, ERROR, NOT_IN_REACH = 0, 1, 2, 3


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `jaxckpt` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `jaxckpt inspect ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except (OSError, ValueError) as e:
        print(f"jaxckpt {args.command}: error: {e}", file=sys.stderr)
        return ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _roots(
        _command(
            sub, "ls", _ls, "every step in DIR, where it lives, and whether it can be restored"
        )
    )
    _roots(
        _command(
            sub,
            "inspect",
            _inspect_cmd,
            "the saved tree, versions and save metrics of a step",
            True,
        )
    )
    _add_verify(sub)
    _add_export(sub)
    _add_advise(sub)
    bench = sub.add_parser(
        "bench", help="the benchmark suite (jaxckpt bench --help)", add_help=False
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


_Commands = argparse._SubParsersAction  # the `add_subparsers` object


def _command(
    sub: _Commands, name: str, run: Any, help: str, step: bool = False
) -> argparse.ArgumentParser:
    """A command's parser with what every command takes: DIR (and STEP), --item, --json."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(run=run)
    p.add_argument(
        "directory",
        metavar="DIR",
        help="the CheckpointManager's directory: a path, gs://bucket/path or s3://bucket/path",
    )
    if step:
        p.add_argument("step", metavar="STEP", type=int)
    p.add_argument("--item", help="the jaxckpt item (default: the only one in DIR)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _roots(p: argparse.ArgumentParser) -> None:
    """The memory roots (and run id) a command looks in besides DIR."""
    p.add_argument(
        "--memory-root",
        action="append",
        default=[],
        metavar="PATH",
        help="a TierOptions.memory_root to look in; repeat for every host (or process)",
    )
    p.add_argument("--run-id", help="TierOptions.run_id, if the job set one")


def _add_verify(sub: _Commands) -> None:
    p = _command(
        sub, "verify", _verify_cmd, "read every chunk of every copy in reach, check CRC-32s", True
    )
    _roots(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_export(sub: _Commands) -> None:
    p = _command(
        sub,
        "export",
        _export_cmd,
        "write a durable step as a plain Orbax checkpoint or safetensors files",
        True,
    )
    p.add_argument("out", metavar="OUT", help="the output directory (new or empty)")
    p.add_argument("--format", choices=_export.FORMATS, default="orbax")
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=_export.DEFAULT_MAX_SHARD_BYTES,
        help="safetensors: the size cap of one shard file (default 5e9, as large models ship)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_advise(sub: _Commands) -> None:
    p = _command(
        sub, "advise", _advise_cmd, "checkpoint intervals from measured costs (Young/Daly)"
    )
    mtbf = p.add_mutually_exclusive_group(required=True)
    mtbf.add_argument("--mtbf-hours", type=float, help="mean time between failures")
    mtbf.add_argument(
        "--failure-log", metavar="FILE", help="one failure time per line (ISO 8601 or epoch s)"
    )
    p.add_argument(
        "--step-seconds", type=float, help="seconds per training step (default: measured)"
    )
    p.add_argument(
        "--persistent-mtbf-hours",
        type=float,
        help="MTBF of failures only persistent storage survives (default: --mtbf-hours)",
    )
    p.add_argument(
        "--persist-mbps", type=float, help="persistent write MB/s, when no persist time is recorded"
    )
    restart = p.add_mutually_exclusive_group()
    restart.add_argument(
        "--restart-seconds", type=float, default=0.0, help="added to every restore (job restart)"
    )
    restart.add_argument(
        "--launch-report",
        action="append",
        default=[],
        metavar="FILE",
        help="measured restarts: a `python -m jaxckpt.launch --json` report (repeatable)",
    )
    p.add_argument(
        "--restore-seconds",
        action="append",
        default=[],
        metavar="TIER=S",
        help="a measured restore time, e.g. persistent=95 (repeatable)",
    )
    p.add_argument("--last", type=int, default=50, help="use the newest N steps (default 50)")


def _catalog_of(args: argparse.Namespace) -> _catalog.Catalog:
    return _catalog.Catalog(
        args.directory,
        args.item,
        getattr(args, "memory_root", ()),
        getattr(args, "run_id", None),
    )


def _emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else text)


def _ls(args: argparse.Namespace) -> int:
    report = _listing.listing(_catalog_of(args))
    _emit(args, report, _listing.render_listing(report))
    return OK


def _inspect_cmd(args: argparse.Namespace) -> int:
    report = _inspect.describe_step(_catalog_of(args), args.step)
    _emit(args, report, _inspect.render_step(report))
    return OK


def _verify_cmd(args: argparse.Namespace) -> int:
    catalog = _catalog_of(args)
    if args.no_progress:
        report = _verify.verify(catalog, args.step)
    else:
        with _progress(sys.stderr, f"verify step {args.step}") as update:
            report = _verify.verify(catalog, args.step, update)
    _emit(args, report, _verify.render(report))
    if report["bad_copies"]:
        return BAD_COPY
    return NOT_IN_REACH if report["parts_without_good_copy"] else OK


def _export_cmd(args: argparse.Namespace) -> int:
    def run(update: Any = None) -> Any:
        return _export.export(
            args.directory,
            args.step,
            args.out,
            format=args.format,
            item=args.item,
            max_shard_bytes=args.max_shard_bytes,
            on_progress=update,
        )

    if args.no_progress:
        done = run()
    else:
        with _progress(sys.stderr, f"export step {args.step}", "leaves") as update:
            done = run(update)
    report = {
        "out": str(done.out),
        "format": done.format,
        "step": done.step,
        "bytes": done.bytes,
        "files": [str(f) for f in done.files],
        "leaves": dict(done.leaves),
        "skipped": dict(done.skipped),
        "key_impls": dict(done.key_impls),
    }
    lines = [
        f"exported step {done.step} as {done.format} to {done.out}: {len(done.leaves)} leaves, "
        f"{_table.size(done.bytes)}, {len(done.files)} file(s)"
    ]
    lines += [f"  key data (wrap_key_data impl={v!r}): {k}" for k, v in done.key_impls.items()]
    lines += [f"  skipped {path}: {why}" for path, why in done.skipped.items()]
    _emit(args, report, "\n".join(lines))
    return OK


def _advise_cmd(args: argparse.Namespace) -> int:
    for name in ("mtbf_hours", "persistent_mtbf_hours", "step_seconds", "persist_mbps"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}.")
    if args.last < 1:
        raise ValueError(f"--last must be at least 1, got {args.last}.")
    if args.failure_log:
        with open(args.failure_log) as f:
            mtbf_s, failures, span = _mtbf.mtbf_from_log(f)
        mtbf_from = f"{failures} failures over {_table.duration(span)} in {args.failure_log}"
    else:
        mtbf_s, mtbf_from = args.mtbf_hours * 3600, "given"
    restore = {}
    for item in args.restore_seconds:
        tier, _, seconds = item.partition("=")
        if tier not in _advise.COVERS or not seconds:
            raise ValueError(
                f"--restore-seconds takes TIER=SECONDS with TIER one of "
                f"{', '.join(_advise.COVERS)}, got {item!r}."
            )
        restore[tier] = float(seconds)
    restarts = None
    if args.launch_report:
        reports = []
        for path in args.launch_report:
            with open(path) as f:
                reports.append((path, json.load(f)))
        restarts = _costs.restarts_from_launch_report(reports)
    costs, step_s, step_from, notes = _costs.measure(
        _catalog_of(args),
        last=args.last,
        persist_bytes_per_s=args.persist_mbps * 1e6 if args.persist_mbps else None,
        restart_s=args.restart_seconds,
        restore_s=restore,
        restarts=restarts,
    )
    if args.step_seconds:
        step_s, step_from = args.step_seconds, "given"
    persistent = args.persistent_mtbf_hours * 3600 if args.persistent_mtbf_hours else None
    report = _advise.advise(
        costs,
        mtbf_s,
        step_s,
        persistent,
        mtbf_from=mtbf_from,
        step_from=step_from,
        notes=notes,
    )
    _emit(args, report, _advise.render(report))
    return OK


def _bench(argv: list[str]) -> int:
    # Imported only here: the benchmark pulls in more than the other commands need.
    try:
        bench = importlib.import_module("jaxckpt.bench")
    except ImportError as e:
        print(f"jaxckpt bench: error: the benchmark is not available ({e}).", file=sys.stderr)
        return ERROR
    return int(bench.main(argv) or 0)


@contextlib.contextmanager
def _progress(stream: TextIO, description: str, unit: str = "chunks") -> Iterator[_verify.Progress]:
    """A rich progress bar on `stream` (redrawn on a terminal, printed once when done
    otherwise); yields the callback `_verify.verify` reports to."""
    columns = (
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.TextColumn("{task.fields[chunks]} " + unit),
        progress.DownloadColumn(binary_units=True),
        progress.TransferSpeedColumn(),
        progress.TimeRemainingColumn(),
    )
    console = rich.console.Console(file=stream)
    with progress.Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=None, chunks="0/?")

        def update(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            bar.update(task, completed=done_bytes, total=total_bytes, chunks=f"{done}/{total}")

        yield update


if __name__ == "__main__":
    sys.exit(main())
