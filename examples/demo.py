"""`make demo`: lose a node mid-training, recover from memory and peers, lose nothing;
shrink when no node replaces it, and grow back when it returns.

Three runs of the LM example (examples/lm.py, quick model) through the local launcher,
4 processes x 2 CPU devices, a checkpoint EVERY step (memory tier + 1 peer copy) and a
persisted one every 10 steps:

1. an uninterrupted reference run of 30 steps;
2. the same job, with node 1 lost at step 17 (process killed, its memory deleted); the
   launcher restarts all 4 processes, which restore the newest step and train on. The
   loss of every step must be BITWISE identical to the reference;
3. elastic: node 3 lost at step 12 and the job continues on the 3 surviving nodes (a
   6-device mesh instead of 8); node 3 registers again at step 18 and the launcher grows
   the job back to 4 processes at its next save (``--grow-at-save``). Every step after
   each resize must train on the same global batch as the reference (the data order
   survives both), and no restore may read the persistent tier.

The restarts wake hot spares (``jaxckpt.launch --standby``: processes that joined their
job, compiled the train step of their size through the persistent compilation cache and
ran it once before the job started, then waited at nice 19 in the idle class, held to
``--standby-cpu`` of the CPU while the job trains), and each
prints its recovery timeline: per phase, the process that ended it last, from the restart
to the first trained step, as a table and a picture. The runs with spares are compared step by
step with the reference: how much the waiting spares slow training.

Then one JSON summary line (``recovery_timeline``, ``shrink_recovery_s``,
``grow_recovery_s``, ``standby_slowdown``); the exit code is 0 iff every check passes.
About 2-4 minutes on 2 cores; ``--quick`` (2 processes, 20 steps) is for tests::

    python examples/demo.py [--quick] [--verbose] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds `examples`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.recovery import (
    Run,
    Step,
    check_resize,
    compare_bitwise,
    cpu_share,
    fail,
    plural,
    print_recovery,
    print_timeline,
    restart_of,
    slowdown,
    tiers_of,
    timeline_summary,
)
from jaxckpt import launch

EXAMPLE = Path(__file__).resolve().parent / "lm.py"
CHILD_LINE = re.compile(r"^\[p(\d+)\] (.*)$")
ATTEMPT_LINE = re.compile(r"^\[launch\] attempt (\d+): (\d+) processes")


@dataclasses.dataclass(frozen=True)
class Config:
    """What the demo runs."""

    processes: int = 4
    steps: int = 30
    fail_at: int = 17
    shrink_at: int = 12  # scenario 3: the last node is lost at this step
    return_at: int = 18  # ... and registers again once the job reached this one
    persist_every: int = 10
    batch: int = 24  # divisible by 8 and 6 devices, 4 and 3 processes
    seed: int = 0
    run_timeout_s: float = 480.0
    pictures: str | None = None  # --pictures: a directory for the timelines' PNGs


# Quick steps are short: the grow back (the registration, the stop at a step every process
# agrees on) needs a dozen of them after the return, on a loaded machine too.
QUICK = Config(
    processes=2, steps=20, fail_at=5, shrink_at=4, return_at=6, persist_every=4,
    run_timeout_s=300.0,
)  # fmt: skip


# ----------------------------------------------------------------------------- running


def run_job(name: str, cfg: Config, work: Path, flags: Sequence[str], verbose: bool) -> Run:
    """Runs the LM example through ``jaxckpt.launch`` and collects what it logged.

    Args:
        name: Label of the run (progress lines, sub-directory of ``work``).
        cfg: Sizes and steps.
        work: Scratch directory (on tmpfs): checkpoints, memory roots, logs.
        flags: Extra launcher flags (failure injection).
        verbose: Echo every line of every process.

    Returns:
        The collected run; ``returncode`` is the launcher's.
    """
    root = work / name
    root.mkdir(parents=True)
    report_path, log_path = root / "report.json", root / "launch.log"
    command = [
        *(sys.executable, "-m", "jaxckpt.launch", "-n", str(cfg.processes), "--cpu-devices", "2"),
        *("--memory-base", str(root / "memory"), "--json", str(report_path)),
        *("--max-restarts", "1" if flags else "0", *flags),
        # Hot spares: the restart wakes processes that have already imported jax.
        *(["--standby"] if flags else []),
        # The timeline pictures (--pictures; matplotlib: the plot extra).
        *(["--timeline-png", f"{cfg.pictures}/{name}.png"] if flags and cfg.pictures else []),
        *("--", sys.executable, str(EXAMPLE), "--quick", "--steps", str(cfg.steps)),
        *("--batch", str(cfg.batch), "--seed", str(cfg.seed), "--ckpt-dir", str(root / "ckpt")),
        *("--replicas", "1", "--persist-every", str(cfg.persist_every)),
    ]
    run = Run(name, -1, 0.0, {}, [], [], [], [], log_path)
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                _show(run, line.rstrip("\n"), cfg, verbose)
                if time.monotonic() - start > cfg.run_timeout_s:
                    print(f"  [{name}] no result after {cfg.run_timeout_s:.0f} s, stopping it")
                    break
        finally:
            # SIGINT: the launcher then SIGKILLs the process groups of its children.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    run.returncode = proc.returncode
    run.seconds = time.monotonic() - start
    if report_path.exists():
        run.report = json.loads(report_path.read_text())
    return run


def _show(run: Run, line: str, cfg: Config, verbose: bool) -> None:
    """Records one launcher output line and prints the progress it carries."""
    if verbose:
        print(f"    {line}", flush=True)
    if m := ATTEMPT_LINE.match(line):
        run.steps.append({})
        run.unrestorable.append(set())
        run.processes.append(int(m[2]))
        print(f"  [{run.name}] attempt {m[1]}: {plural(int(m[2]), 'process')} start", flush=True)
        return
    if line.startswith("[launch]") or line.startswith("  restart"):
        if not verbose:
            print(f"  [{run.name}] {line.removeprefix('[launch] ').strip()}", flush=True)
        return
    m = CHILD_LINE.match(line)
    event = launch.parse_event(m[2]) if m else None
    if event is None or not run.steps:
        return
    process, kind = int(m[1]) if m else -1, event["event"]
    if kind == launch.RestoredEvent.kind and not verbose:
        print(
            f"  [{run.name}] p{process} restored step {event['step']} from"
            f" {event.get('tier')} in {event.get('seconds')} s",
            flush=True,
        )
    elif kind == launch.ReplicasLoweredEvent.kind and process == 0 and not verbose:
        print(f"  [{run.name}] peer copies lowered to {event['used']}: too few processes left")
    elif kind == launch.RestoreFailedEvent.kind and event["step"] not in run.unrestorable[-1]:
        # Every process says so for the same step; one line is enough.
        run.unrestorable[-1].add(event["step"])
        if not verbose:
            error = str(event.get("error", "")).split(". ")[0][:200]
            print(f"  [{run.name}] the restore of step {event['step']} failed, the attempt"
                  f" fails (p{process}: {error})")  # fmt: skip
    elif kind == launch.StepEvent.kind and process == 0:
        run.steps[-1][event["step"]] = Step(
            float(event["loss"]), str(event.get("data")), event.get("seconds")
        )
        if not verbose:
            print(
                f"  [{run.name}] step {event['step']:>3}/{cfg.steps}  loss {event['loss']:.6f}"
                f"  batch checksum {event.get('data')}  ({plural(run.processes[-1], 'process')})",
                flush=True,
            )
    elif kind == launch.SaveEvent.kind and process == 0:
        run.save_seconds.append(float(event["seconds"]))


# ----------------------------------------------------------------------------- scenarios

PRESERVED_MEANS = """\
Data order after the resize. Global batch s is a function of (seed, s) only; each process
reads the rows of it that land on its devices, so the saved iterator state is the GLOBAL
position {"next_index": s}: the same on every process, and valid for any process count.
"Preserved" means: the job resumes at the global batch after the restored step, and every
later step trains on exactly the global batch (same samples, same order) that the
uninterrupted run used, checked with each step's global-batch checksum. The losses are
close but not bitwise equal: the same sums now run over fewer devices, in another order."""


def reference_run(cfg: Config, work: Path, verbose: bool) -> dict[int, Step]:
    """Scenario 1: the uninterrupted run; returns what each step logged."""
    print(f"1/3  Reference: {cfg.steps} steps, no failure.", flush=True)
    ref = run_job("reference", cfg, work, [], verbose)
    if ref.returncode or len(ref.steps) != 1 or sorted(ref.steps[0]) != [*range(1, cfg.steps + 1)]:
        fail(ref, f"the launcher exited {ref.returncode} or steps are missing")
    mean_save = sum(ref.save_seconds) / max(len(ref.save_seconds), 1)
    print(
        f"     done in {ref.seconds:.0f} s; each per-step checkpoint held training up for"
        f" {mean_save * 1e3:.0f} ms on average (the copy to host; the rest is asynchronous).\n"
    )
    return ref.steps[0]


def node_loss_run(
    reference: dict[int, Step], cfg: Config, work: Path, verbose: bool
) -> tuple[Run, dict[str, Any], bool]:
    """Scenario 2: lose a node, restart on as many processes, compare bit for bit.

    Returns:
        ``(the run, the launcher's failure report, whether every loss is identical)``.
    """
    victim = 1 % cfg.processes
    print(
        f"2/3  Node loss: process {victim} is killed right after it starts saving step"
        f" {cfg.fail_at}, and its node's memory is deleted; the launcher restarts the job.",
        flush=True,
    )
    lost = run_job("node-loss", cfg, work, ["--lose-node", f"{victim}@{cfg.fail_at}"], verbose)
    if lost.returncode or len(lost.steps) < 2:
        fail(lost, f"the launcher exited {lost.returncode} without a recovered run")
    failure = restart_of(lost)
    print(f"     done in {lost.seconds:.0f} s.\n\nRecovery report (from the launcher):")
    print_recovery(failure)
    identical, rows = compare_bitwise(reference, lost)
    print("\nLoss per step, uninterrupted vs. recovered (float32, compared bit for bit):")
    print("\n".join(rows))
    print(
        "  => IDENTICAL: params, optimizer state, PRNG key and data position were restored"
        " exactly.\n"
        if identical
        else "  => NOT IDENTICAL: the recovered run diverged from the uninterrupted one.\n"
    )
    return lost, failure, identical


def elastic_run(
    reference: dict[int, Step], cfg: Config, work: Path, verbose: bool
) -> tuple[Run, dict[str, Any], dict[str, Any]]:
    """Scenario 3: lose the last node and continue on the others; grow back when it
    returns. Checks the data order after each resize.

    Returns:
        ``(the run, the shrink's findings, the grow back's)``.
    """
    n, last = cfg.processes, cfg.processes - 1
    print(
        f"3/3  Elastic: node {last} is lost at step {cfg.shrink_at} and the job continues on"
        f" the {plural(n - 1, 'surviving node')} ({2 * (n - 1)} devices instead of {2 * n});"
        f" node {last} registers again at step {cfg.return_at} and the job grows back to"
        f" {plural(n, 'process')} at its next save.",
        flush=True,
    )
    flags = [
        *("--lose-node", f"{last}@{cfg.shrink_at}", "--processes-after-failure", str(n - 1)),
        *("--return-node", f"{last}@{cfg.return_at}", "--grow-at-save"),
    ]
    run = run_job("elastic", cfg, work, flags, verbose)
    if run.returncode or len(run.steps) < 3:
        fail(run, f"the launcher exited {run.returncode} without a shrunk and a grown run")
    shrink_restart = restart_of(run, "failures")["restart"]
    grow = restart_of(run, "grows")
    shrunk_steps, grown_steps = run.steps[-2], run.steps[-1]
    stopped_at = int(grow["last_step"])
    shrink = check_resize(reference, shrink_restart, shrunk_steps, stopped_at)
    grown = check_resize(reference, grow["restart"], grown_steps, cfg.steps)
    if grow["restart"]["steps_lost"]:
        grown["preserved"] = False
        grown["problems"].append(f"the grow back lost {grow['restart']['steps_lost']} step(s)")
    print(f"     done in {run.seconds:.0f} s.\n\n{PRESERVED_MEANS}")
    for what, found in (("shrink", shrink), ("grow back", grown)):
        diff = found["max_rel_loss_diff"]
        print(
            f"\n  {what}: restored step {found['restored_step']} from"
            f" {'+'.join(found['tiers']) or '-'} ({found['persistent_bytes']} bytes from the"
            f" persistent tier) on {plural(found['processes'], 'process')};"
            f" {found['steps_checked']} later steps trained on the reference's global"
            f" batches; largest relative loss difference {'-' if diff is None else f'{diff:.1e}'}"
        )
        print_timeline(found["timeline"])
        for problem in found["problems"]:
            print(f"  PROBLEM: {problem}")
        print(f"  => data order {'PRESERVED' if found['preserved'] else 'NOT PRESERVED'}")
    print()
    return run, shrink, grown


def standby_slowdown(
    reference: dict[int, Step], cfg: Config, lost: Run, elastic: Run
) -> dict[str, Any]:
    """How much the hot spares slow training, step by step against the reference.

    ``waiting``: the first attempts of runs 2 and 3 (their spares, prepared before the
    job started, wait at nice 19) over their steps before the failure; ``preparing``: the
    grown job of run 3, while the spares that replace the ones it woke prepare at nice 19;
    ``none (restarted)``, its control: the restarted job of run 2, beside no spare.
    Step times drift with the machine's load between runs; ``cpu_share`` (the CPU the
    spares used while the jobs trained, over the jobs') does not, and bounds the slowdown.
    """
    waiting = [
        (lost.steps[0], range(2, cfg.fail_at)),
        (elastic.steps[0], range(2, cfg.shrink_at)),
    ]
    grown, restarted = elastic.steps[-1], lost.steps[-1]
    preparing = [(grown, range(min(grown, default=0) + 1, cfg.steps + 1))]
    # The control for `preparing`: a job just restarted, with no spare left to prepare.
    alone = [(restarted, range(min(restarted, default=0) + 1, cfg.steps + 1))]
    found = {
        "waiting": slowdown(reference, waiting),
        "preparing": slowdown(reference, preparing),
        "none (restarted)": slowdown(reference, alone),
    }
    firsts = [lost.report["attempts"][0], elastic.report["attempts"][0]]
    cpu = {
        "waiting": cpu_share(firsts),
        "preparing": cpu_share(elastic.report["attempts"][-1:]),
        "none (restarted)": cpu_share(lost.report["attempts"][-1:]),
    }
    print("Training with the spares beside it, against the reference (median step time), and")
    print("the CPU the spares took while the job trained, over the job's own:")
    for name, figure in found.items():
        share = cpu[name]
        print(
            f"  spares {name:<17}"
            + (
                f" {figure['with_s'] * 1e3:.0f} ms vs {figure['without_s'] * 1e3:.0f} ms"
                f" without: x{figure['ratio']} over {figure['steps']} steps;"
                if figure
                else ""
            )
            + (
                f" CPU {share['standby_cpu_s']:.2f} s vs the job's {share['job_cpu_s']:.1f} s:"
                f" {share['share']:.2%}"
                if share
                else ""
            )
        )
    print()
    return {**found, "cpu_share": cpu}


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 processes, 20 steps (tests)")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--workdir", help="parent of the scratch directory (default /dev/shm)")
    parser.add_argument(
        "--pictures", metavar="DIR", help="also draw each run's timelines as PNGs in DIR"
    )
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(QUICK if args.quick else Config(), pictures=args.pictures)
    if args.pictures:
        os.makedirs(args.pictures, exist_ok=True)
    parent = args.workdir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    work = Path(tempfile.mkdtemp(prefix="jaxckpt-demo-", dir=parent))
    begin = time.monotonic()
    print(
        f"jaxckpt demo: a byte-level transformer LM on {plural(cfg.processes, 'process')}"
        f" x 2 CPU devices, {cfg.steps} steps, a checkpoint every step (memory + 1 peer copy),"
        f" persisted every {cfg.persist_every}.\nScratch directory: {work}\n",
        flush=True,
    )
    try:
        reference = reference_run(cfg, work, args.verbose)
        lost, failure, identical = node_loss_run(reference, cfg, work, args.verbose)
        elastic, shrink, grown = elastic_run(reference, cfg, work, args.verbose)
        slowed = standby_slowdown(reference, cfg, lost, elastic)
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    restart = failure["restart"]
    summary = {
        "recovery_timeline": timeline_summary(restart["timeline"]),
        "recovered_from": tiers_of(restart),
        "restore_seconds": restart["restore_seconds"],
        "steps_lost": restart["steps_lost"],
        "identical_losses": identical,
        "restored_step": restart["restored_step"],
        "detected_after_s": failure["detected_after_s"],
        "shrink_recovery_s": shrink["timeline"]["recovery_s"],
        "grow_recovery_s": grown["timeline"]["recovery_s"],
        "shrink_recovery_timeline": timeline_summary(shrink["timeline"]),
        "grow_recovery_timeline": timeline_summary(grown["timeline"]),
        "resized_to": shrink["processes"],
        "grown_to": grown["processes"],
        "resize_recovered_from": shrink["tiers"],
        "grow_recovered_from": grown["tiers"],
        "persistent_bytes_read": shrink["persistent_bytes"] + grown["persistent_bytes"],
        "resize_data_order_preserved": shrink["preserved"],
        "grow_data_order_preserved": grown["preserved"],
        "standby_slowdown": slowed,
        "demo_seconds": round(time.monotonic() - begin, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if identical and shrink["preserved"] and grown["preserved"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
