"""`make demo`: lose a node mid-training, recover from memory and peers, lose nothing.

Three runs of the LM example (examples/lm.py, quick model) through the local launcher,
4 processes x 2 CPU devices, a checkpoint EVERY step (memory tier + 1 peer copy) and a
persisted one every 10 steps:

1. an uninterrupted reference run of 30 steps;
2. the same job, with node 1 lost at step 17 (process killed, its memory deleted); the
   launcher restarts all 4 processes, which restore the newest step and train on. The
   loss of every step must be BITWISE identical to the reference;
3. node 3 lost at step 17 and the job continues on the 3 surviving nodes (a 6-device
   mesh instead of 8): every later step must train on the same global batch as the
   reference (the data order survives the resize).

The restarts wake hot spares (``jaxckpt.launch --standby``: processes that joined their
job, compiled the train step through the persistent compilation cache and ran it once
while the job trained), and each prints its recovery timeline: per phase, the process
that ended it last, from the restart to the first trained step.

Then one JSON summary line (with ``recovery_timeline``); the exit code is 0 iff both
checks pass. About 3 minutes on
2 cores; ``--quick`` (2 processes, 8 steps) is for tests::

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

from jaxckpt import launch

EXAMPLE = Path(__file__).resolve().parent / "lm.py"
TIERS = ("memory", "peer", "persistent")
CHILD_LINE = re.compile(r"^\[p(\d+)\] (.*)$")
ATTEMPT_LINE = re.compile(r"^\[launch\] attempt (\d+): (\d+) processes")


@dataclasses.dataclass(frozen=True)
class Config:
    """What the demo runs."""

    processes: int = 4
    steps: int = 30
    fail_at: int = 17
    persist_every: int = 10
    batch: int = 24  # divisible by 8 and 6 devices, 4 and 3 processes
    seed: int = 0
    run_timeout_s: float = 420.0


QUICK = Config(processes=2, steps=8, fail_at=5, persist_every=4, run_timeout_s=240.0)


@dataclasses.dataclass
class Step:
    """What process 0 logged for one training step."""

    loss: float
    data: str  # checksum of the step's global batch


@dataclasses.dataclass
class Run:
    """One launcher run: what process 0 logged per attempt, and the launcher's report."""

    name: str
    returncode: int
    seconds: float
    report: dict[str, Any]
    steps: list[dict[int, Step]]  # per attempt: step -> what process 0 logged
    processes: list[int]  # per attempt: process count
    unrestorable: list[set[int]]  # per attempt: steps whose restore failed
    save_seconds: list[float]
    log: Path


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
        run.steps[-1][event["step"]] = Step(float(event["loss"]), str(event.get("data")))
        if not verbose:
            print(
                f"  [{run.name}] step {event['step']:>3}/{cfg.steps}  loss {event['loss']:.6f}"
                f"  batch checksum {event.get('data')}  ({plural(run.processes[-1], 'process')})",
                flush=True,
            )
    elif kind == launch.SaveEvent.kind and process == 0:
        run.save_seconds.append(float(event["seconds"]))


def fail(run: Run, why: str) -> None:
    """Prints why a run is unusable and the end of its log, then exits 1."""
    print(f"\nFAILED: {run.name}: {why}. Last lines of {run.log}:")
    lines = run.log.read_text().splitlines()
    noise = ('"event": "step"', '"event": "save"', "[Gloo]")
    print("\n".join(line for line in lines if not any(n in line for n in noise))[-6000:])
    raise SystemExit(1)


# ----------------------------------------------------------------------------- checks


def plural(count: int, noun: str) -> str:
    """``1 process``, ``3 processes``."""
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("s") else "s")


def bits(x: float) -> str:
    """The exact value of a loss (a float32 widened to float64) as a hex float."""
    return x.hex()


def compare_bitwise(reference: dict[int, Step], run: Run) -> tuple[bool, list[str]]:
    """Compares every step of every attempt of ``run`` with the reference, bit for bit.

    Steps computed before the failure and again after the restore are compared both times.

    Returns:
        ``(identical, table rows)``.
    """
    seen: dict[int, list[Step]] = {}
    for steps in run.steps:
        for step, logged in steps.items():
            seen.setdefault(step, []).append(logged)
    identical = sorted(seen) == sorted(reference)
    rows = [f"    {'step':>4}  {'uninterrupted':<20}{'recovered run':<20}float32 bits"]
    for step, want in sorted(reference.items()):
        got = seen.get(step, [])
        same = bool(got) and all(bits(g.loss) == bits(want.loss) for g in got)
        identical &= same
        shown = repr(got[-1].loss) if got else "missing"
        note = "" if len(got) < 2 else f"  (computed {len(got)}x: before the failure and after)"
        rows.append(
            f"    {step:>4}  {want.loss!r:<20}{shown:<20}{bits(want.loss)}"
            f"  {'identical' if same else 'DIFFERENT'}{note}"
        )
    return identical, rows


def restart_of(run: Run) -> dict[str, Any]:
    """The launcher's report of the first failure and its restart."""
    failures = run.report.get("failures") or []
    if not failures or "restart" not in failures[0]:
        fail(run, "the launcher reports no failure with a restart")
    return failures[0]


def tiers_of(restart: dict[str, Any]) -> list[str]:
    """The tiers the processes restored from, fastest first."""
    found = {e.get("tier") for e in restart["restored"].values()}
    return [t for t in TIERS if t in found] + sorted(str(t) for t in found - set(TIERS))


def print_recovery(failure: dict[str, Any]) -> None:
    """Prints the launcher's recovery report as a table."""
    restart = failure["restart"]
    per_process = "  ".join(
        f"p{i}: {e['tier']} ({e['seconds']} s)" for i, e in restart["restored"].items()
    )
    lost = restart["steps_lost"]
    print(f"  lost node            process {failure['process']} ({failure['status']}) at step"
          f" {failure['last_step']}, memory root deleted: {failure['node_lost']}")  # fmt: skip
    print(f"  detected after       {failure['detected_after_s']} s (the launcher watches its"
          " children; on a cluster JAX's heartbeat or the scheduler notices)")  # fmt: skip
    print(
        f"  restored step        {restart['restored_step']} on {plural(restart['processes'], 'process')}"
    )
    print(f"  tier per process     {per_process or 'nothing restored'}")
    print(f"  restore time         {restart['restore_seconds']} s (slowest process)")
    print(f"  steps of work lost   {lost} (recomputed after the restart)")
    print(f"  first step after     {restart['first_step_after_s']} s from the restart"
          " (jax.distributed, restore overlapped with compile, the step)")  # fmt: skip
    print_timeline(restart["timeline"])


def print_timeline(timeline: dict[str, Any]) -> None:
    """Prints the recovery timeline: per phase, the process that ended it last."""
    spares = "hot spares woken" if timeline["standby"] else "processes started"
    print(f"\n  Recovery timeline (seconds from the restart: {spares}; the slowest process"
          " of each phase):")  # fmt: skip
    print(f"    {'phase':<12}{'process':>8}{'start':>9}{'end':>9}{'seconds':>9}")
    for name, span in timeline["slowest"].items():
        print(
            f"    {name:<12}{'p' + str(span['process']):>8}{span['start']:>9.3f}"
            f"{span['end']:>9.3f}{span['seconds']:>9.3f}"
        )
    print(
        f"    restore and compile overlapped {timeline['restore_compile_overlap_s']} s;"
        f" compilation cache: {timeline['compile_cache_hits']} hit(s),"
        f" {timeline['compile_cache_misses']} miss(es) of the train step over all processes"
    )
    print(
        f"    failure to first trained step: detected {timeline['detected_after_s']} s"
        f" + restart {timeline['restart_after_s']} s + first step"
        f" {timeline['first_step_after_s']} s = {timeline['recovery_s']} s"
    )


def timeline_summary(timeline: dict[str, Any]) -> dict[str, Any]:
    """The recovery timeline of the summary line: totals and each phase's slowest process."""
    restore, compile_ = timeline["restore_s"], timeline["compile_s"]
    bound = max(restore or 0.0, compile_ or 0.0)
    first = timeline["first_step_after_s"]
    return {
        **{
            k: timeline[k]
            for k in (
                "detected_after_s",
                "restart_after_s",
                "first_step_after_s",
                "recovery_s",
                "standby",
                "restore_s",
                "compile_s",
                "restore_compile_overlap_s",
                "compile_cache_hits",
                "compile_cache_misses",
            )
        },
        # How close the restart comes to its floor: reading the state or loading the
        # executable, whichever is longer (they overlap).
        "first_step_over_max_restore_compile": (
            round(first / bound, 2) if first is not None and bound > 0 else None
        ),
        # Stricter, and the one that counts with hot spares (they compiled before the
        # failure): how much the restart adds to reading the state.
        "first_step_over_restore": (
            round(first / restore, 2) if first is not None and restore else None
        ),
        "phases": {
            name: {k: span[k] for k in ("process", "start", "end", "seconds")}
            for name, span in timeline["slowest"].items()
        },
    }


def check_resize(reference: dict[int, Step], run: Run, cfg: Config) -> dict[str, Any]:
    """Checks that the run resized after the failure continued the same global data stream.

    Returns:
        The findings; ``preserved`` is the verdict.
    """
    restart = restart_of(run)["restart"]
    restored = int(restart["restored_step"])
    after = run.steps[-1] if len(run.steps) > 1 else {}
    problems = []
    if restored <= 0 or any(int(e["step"]) != restored for e in restart["restored"].values()):
        problems.append(
            f"the {restart['processes']} processes did not all restore step {restored} > 0"
            " (a restart from scratch replays the data from the beginning)"
        )
    if sorted(after) != list(range(restored + 1, cfg.steps + 1)):
        problems.append(
            f"after the resize it trained steps {sorted(after)}, expected"
            f" {restored + 1}..{cfg.steps}"
        )
    mismatched = [s for s, got in after.items() if got.data != reference[s].data]
    if mismatched:
        problems.append(f"steps {mismatched} trained on other global batches than the reference")
    rel = [
        abs(got.loss - reference[s].loss) / abs(reference[s].loss)
        for s, got in after.items()
        if s in reference
    ]
    return {
        "preserved": not problems,
        "problems": problems,
        "restored_step": restored,
        "tiers": tiers_of(restart),
        "processes": restart["processes"],
        "steps_checked": len(after) - len(mismatched),
        "max_rel_loss_diff": max(rel, default=None),
        "timeline": restart["timeline"],
    }


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
) -> tuple[dict[str, Any], bool]:
    """Scenario 2: lose a node, restart on as many processes, compare bit for bit.

    Returns:
        ``(the launcher's failure report, whether every loss is identical)``.
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
    return failure, identical


def shrink_run(
    reference: dict[int, Step], cfg: Config, work: Path, verbose: bool
) -> dict[str, Any]:
    """Scenario 3: lose the last node and continue on the others; check the data order."""
    n, last = cfg.processes, cfg.processes - 1
    print(
        f"3/3  Shrink: node {last} is lost at step {cfg.fail_at} and the job continues on"
        f" the {plural(n - 1, 'surviving node')} ({2 * (n - 1)} devices instead of {2 * n}).",
        flush=True,
    )
    flags = ["--lose-node", f"{last}@{cfg.fail_at}", "--processes-after-failure", str(n - 1)]
    shrunk = run_job("shrink", cfg, work, flags, verbose)
    if shrunk.returncode or len(shrunk.steps) < 2:
        fail(shrunk, f"the launcher exited {shrunk.returncode} without a resized run")
    resize = check_resize(reference, shrunk, cfg)
    diff = resize["max_rel_loss_diff"]
    print(f"     done in {shrunk.seconds:.0f} s.\n\n{PRESERVED_MEANS}")
    print(
        f"  restored step {resize['restored_step']} from {'+'.join(resize['tiers']) or '-'}"
        f" on {plural(resize['processes'], 'process')}; {resize['steps_checked']} later steps"
        " trained on the reference's global batches; largest relative loss difference"
        f" {'-' if diff is None else f'{diff:.1e}'}"
    )
    print_timeline(resize["timeline"])
    for problem in resize["problems"]:
        print(f"  PROBLEM: {problem}")
    print(f"  => data order {'PRESERVED' if resize['preserved'] else 'NOT PRESERVED'}\n")
    return resize


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 processes, 8 steps (tests)")
    parser.add_argument("--verbose", action="store_true", help="echo every process's output")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--workdir", help="parent of the scratch directory (default /dev/shm)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
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
        failure, identical = node_loss_run(reference, cfg, work, args.verbose)
        resize = shrink_run(reference, cfg, work, args.verbose)
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    restart = failure["restart"]
    summary = {
        "recovery_timeline": timeline_summary(restart["timeline"]),
        "resize_recovery_timeline": timeline_summary(resize["timeline"]),
        "recovered_from": tiers_of(restart),
        "restore_seconds": restart["restore_seconds"],
        "steps_lost": restart["steps_lost"],
        "identical_losses": identical,
        "restored_step": restart["restored_step"],
        "detected_after_s": failure["detected_after_s"],
        "resized_to": resize["processes"],
        "resize_recovered_from": resize["tiers"],
        "resize_data_order_preserved": resize["preserved"],
        "demo_seconds": round(time.monotonic() - begin, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if identical and resize["preserved"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
