"""The `jaxckpt bench` command line: its flags, and their checks before anything starts.

The flags are those of `_run` (the driver); `--gpu`, `--scale` and `--reshard` hand the
whole command line to `_gpu`, `_scale_cli` and `_reshard_cli`, which have their own.
"""

from __future__ import annotations

import argparse
import os

from jaxckpt.bench import _emulator
from jaxckpt.launch import _timeline_plot
from jaxckpt.persistent import _storage


def build_parser(description: str) -> argparse.ArgumentParser:
    """The parser of `jaxckpt bench` (`description`: the driver's), its flags in groups in
    the order `--help` shows them."""
    p = argparse.ArgumentParser(prog="jaxckpt bench", description=description)
    _add_modes(p)
    _add_outputs(p)
    _add_measuring(p)
    _add_places(p)
    _add_object_store(p)
    _add_proxy(p)
    _add_solo(p)
    return p


def _add_modes(p: argparse.ArgumentParser) -> None:
    """What runs: the preset, another benchmark instead, the layout, and the size."""
    p.add_argument("--quick", action="store_true", help="small state, few steps (a smoke run)")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="instead: the one-process accelerator check (`jaxckpt bench --gpu --help`)",
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="instead: coordination at thousands of processes, simulated "
        "(`jaxckpt bench --scale --help`)",
    )
    p.add_argument(
        "--reshard",
        action="store_true",
        help="instead: restores onto another mesh, process count or axis order, against "
        "their floor and Orbax's (`jaxckpt bench --reshard --help`)",
    )
    p.add_argument(
        "--layout",
        choices=("default", "hsdp"),
        default="default",
        help="hsdp: instead, data-parallel replicas sharing the save (`_hsdp`: a mesh "
        "('dp', 'fsdp') with dp across processes; 4 processes unless --processes)",
    )
    p.add_argument("--dp", type=int, default=2, help="with --layout hsdp: the replicas R")
    p.add_argument("--state-mib", type=float, default=64, help="with --layout hsdp: state MiB")
    p.add_argument("--processes", type=int, default=None, help="JAX processes on loopback")
    p.add_argument("--state-gib", type=float, help="params + adam state, GiB (quick: 1/8, else 1)")


def _add_outputs(p: argparse.ArgumentParser) -> None:
    """Where the figures go besides the table, or a saved report to show instead."""
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw every figure against its baseline and target as a PNG (needs "
        "matplotlib: the plot extra)",
    )
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="run nothing: print (and with --plot draw) the figures of a report --json wrote",
    )


def _add_measuring(p: argparse.ArgumentParser) -> None:
    """What each process measures: devices, replicas, steps, repeats, the many-leaf tree."""
    p.add_argument("--devices-per-process", type=int, default=2, help="CPU devices per process")
    p.add_argument("--replicas", type=int, help="peer copies (default 1 with >1 process, else 0)")
    p.add_argument("--steps", type=int, help="steps per training loop (quick: 8, else 16)")
    p.add_argument("--repeats", type=int, help="isolated saves / raw baselines (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="loop steps left out of medians")
    p.add_argument("--batch-per-device", type=int, default=16)
    p.add_argument(
        "--many-leaves",
        type=int,
        default=4000,
        help="leaves of the many-leaf tree saved and restored by both (0: skip that phase)",
    )
    p.add_argument(
        "--many-leaf-kib", type=float, default=16.0, help="KiB per leaf of the many-leaf tree"
    )


def _add_places(p: argparse.ArgumentParser) -> None:
    """Where the run keeps its checkpoints, on which platform, and how long it may take."""
    p.add_argument("--memory-root", help="parent of the memory tiers (default: a dir in /dev/shm)")
    p.add_argument("--work-dir", help="persistent checkpoints (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds any one wait may take")
    p.add_argument("--deadline", type=float, help="seconds the whole run may take")
    p.add_argument("--platform", choices=("cpu", "default"), default="cpu")
    p.add_argument("--keep", action="store_true", help="keep the memory tiers and checkpoints")


def _add_object_store(p: argparse.ArgumentParser) -> None:
    """The object-store phase: a real store or a local emulator, beside the rest or alone."""
    store = p.add_mutually_exclusive_group()
    store.add_argument(
        "--store-url",
        metavar="URL",
        help="also persist to this object store (gs://bucket/prefix or s3://bucket/prefix; "
        "endpoint and credentials from the standard environment: TENSORSTORE_GCS_HTTP_URL "
        "and STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL and AWS_*) against tensorstore "
        "writing the same bytes there",
    )
    store.add_argument(
        "--store-emulator",
        choices=_emulator.KINDS,
        help="the same against a local emulator started on loopback (needs the dev extra: "
        "gcp-storage-emulator, moto_server)",
    )
    p.add_argument("--store-only", action="store_true", help="run the object-store phase alone")


def _add_proxy(p: argparse.ArgumentParser) -> None:
    """The accelerator-host proxy, and the host memory touched before anything is measured."""
    p.add_argument(
        "--proxy",
        choices=("auto", "only", "off"),
        default="auto",
        help="the accelerator-host proxy (figures 9a-e: one process, the train step confined "
        "to one CPU, saves on the others): after the other phases where 2 CPUs are usable "
        "(auto), alone (only), or not at all",
    )
    p.add_argument(
        "--proxy-state-gib", type=float, help="the proxy's state (quick: 1/16, else 0.1875)"
    )
    p.add_argument(
        "--proxy-batch", type=int, help="the proxy's rows per step (quick: 64, else 768)"
    )
    p.add_argument(
        "--prefault-gib",
        type=float,
        help="host memory to touch once before measuring (default: 12x the state, at most "
        "60%% of available RAM; 0 turns it off). Some VMs back guest memory lazily, which "
        "makes the first touch of each page ~10x slower than later ones and would bill it "
        "to whichever phase happens to run first.",
    )


def _add_solo(p: argparse.ArgumentParser) -> None:
    """One process saving every step (figures 10a-f) and the fixed cost of a save."""
    p.add_argument(
        "--solo",
        choices=("auto", "only", "off"),
        default="auto",
        help="one process, a small state saved every step (figures 10a-f: none, the "
        "floor, jaxckpt, Orbax async; and the fixed cost of a 1 MiB save against Orbax's "
        "manager saving a trivial item): after the two-process phases (auto, not with "
        "--store-only), alone (only), or not at all",
    )
    p.add_argument(
        "--solo-state-gib", type=float, help="its state (quick: 1/16, else 0.1875: 192 MiB)"
    )
    p.add_argument(
        "--solo-rounds", type=int, default=3, help="its rounds of loops (medians over all)"
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad flags (`parser.error`: exit status 2) before anything starts."""
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    if args.state_gib is not None and not args.state_gib > 0:
        parser.error(f"--state-gib must be positive, got {args.state_gib}")
    if args.replicas is not None and not 0 <= args.replicas < args.processes:
        parser.error(f"--replicas must be in 0..{args.processes - 1}, got {args.replicas}")
    if args.layout == "hsdp" and (
        args.dp < 2 or args.processes % args.dp or not args.state_mib > 0
    ):
        parser.error(
            f"--layout hsdp needs --dp >= 2 dividing --processes ({args.processes}) and a "
            f"positive --state-mib; got --dp {args.dp}, --state-mib {args.state_mib:g}"
        )
    if args.many_leaves < 0 or not args.many_leaf_kib > 0:
        parser.error("--many-leaves must be at least 0 and --many-leaf-kib positive")
    for name in ("steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.steps is not None and args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.store_url is not None and _storage.scheme(args.store_url) is None:
        parser.error(f"--store-url must be a gs:// or s3:// URL, got {args.store_url!r}")
    if args.proxy_state_gib is not None and not args.proxy_state_gib > 0:
        parser.error(f"--proxy-state-gib must be positive, got {args.proxy_state_gib}")
    if args.proxy_batch is not None and args.proxy_batch < 1:
        parser.error(f"--proxy-batch must be at least 1, got {args.proxy_batch}")
    if args.proxy == "only" and len(os.sched_getaffinity(0)) < 2:
        parser.error("--proxy only needs 2 usable CPUs (one trains, the others save)")
    if args.solo_state_gib is not None and not args.solo_state_gib > 0:
        parser.error(f"--solo-state-gib must be positive, got {args.solo_state_gib}")
    if args.solo_rounds < 1:
        parser.error(f"--solo-rounds must be at least 1, got {args.solo_rounds}")
    if args.solo == "only" and (args.store_only or args.proxy == "only"):
        parser.error("--solo only excludes --store-only and --proxy only")
    if args.store_only and args.proxy == "only":
        parser.error("--store-only and --proxy only are exclusive")
    if args.store_only and not (args.store_url or args.store_emulator):
        parser.error("--store-only needs --store-url or --store-emulator")
    if args.plot is not None:
        try:
            _timeline_plot.require_matplotlib()
        except ImportError as e:
            parser.error(str(e))
    if args.store_emulator and not _emulator.available(args.store_emulator):
        parser.error(
            f"--store-emulator {args.store_emulator} needs the dev extra's emulators "
            "(gcp-storage-emulator, moto_server): pip install 'jaxckpt[dev]'"
        )
