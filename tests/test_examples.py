"""Tests of the Flax examples and the demo: resume, node loss, data order, bit for bit.

The examples run as subprocesses in quick mode (tiny models, a few steps); the
multi-process ones go through ``jaxckpt.launch`` with 2 processes x 2 CPU devices.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import patience
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import launch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `examples` is a directory of scripts, not an installed package
    sys.path.insert(0, str(REPO))

from examples import data  # noqa: E402

EXAMPLES = ("lm", "classifier")


def run_example(name: str, *flags: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Runs ``examples/<name>.py --quick`` in one process (2 CPU devices); returns its events."""
    env = {**os.environ, "JAXCKPT_CPU_DEVICES": "2"}
    proc = patience.run(
        [sys.executable, str(REPO / "examples" / f"{name}.py"), "--quick", *flags],
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [e for e in map(launch.parse_event, proc.stdout.splitlines()) if e]


def losses(events: list[dict[str, Any]], process: int = 0) -> dict[int, str]:
    """Step -> the exact loss (hex) that ``process`` logged, the later one if logged twice."""
    return {
        e["step"]: float(e["loss"]).hex()
        for e in events
        if e["event"] == "step" and e["process"] == process
    }


# ----------------------------------------------------------------------------- data order


def test_global_stream_is_the_same_for_any_process_count() -> None:
    records = np.arange(100)
    batches = {}
    for count in (1, 2, 3, 4):
        rows = 24 // count
        parts = [
            data.process_stream(records, 7, 24, p * rows, (p + 1) * rows) for p in range(count)
        ]
        batches[count] = [np.concatenate([part[i] for part in parts]) for i in range(10)]
    for count in (2, 3, 4):
        np.testing.assert_array_equal(batches[count], batches[1])
    # 10 batches of 24 = 2.4 epochs: every epoch is a permutation of the records.
    stream = np.concatenate(batches[1])
    assert sorted(stream[:100]) == list(range(100)) and not np.array_equal(stream[:100], records)


def test_iterator_state_is_the_global_position() -> None:
    """States saved by 4 processes are equal, and resume 3 processes at the same batch."""
    records = np.arange(100)

    def iterators(count: int) -> list[Any]:
        rows = 24 // count
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        streams = [
            data.process_stream(records, 0, 24, p * rows, (p + 1) * rows) for p in range(count)
        ]
        return [iter(s.to_iter_dataset(read_options=options)) for s in streams]

    four = iterators(4)
    for it in four:
        for _ in range(5):
            next(it)
    states = [it.get_state() for it in four]
    assert all(s == states[0] for s in states)
    expected = np.concatenate([next(it) for it in four])  # global batch 5
    three = iterators(3)
    for it in three:
        it.set_state(states[0])
    np.testing.assert_array_equal(np.concatenate([next(it) for it in three]), expected)


def test_process_stream_rejects_unaligned_rows() -> None:
    with pytest.raises(ValueError, match="aligned block"):
        data.process_stream(np.arange(10), 0, 24, 4, 10)


def test_fingerprint_does_not_depend_on_sharding() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("b",))
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.standard_normal((16, 5, 3)).astype(np.float32),
        "label": rng.integers(0, 10, 16).astype(np.int32),
    }
    fp = jax.jit(data.fingerprint)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("b")))
    assert int(fp(sharded)) == int(fp(batch))
    swapped = {**batch, "label": batch["label"][::-1].copy()}
    assert int(fp(swapped)) != int(fp(batch))  # the order of the samples counts


# ----------------------------------------------------------------------------- one process


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_resume_reproduces_one_long_run(example: str, tmp_path: Path) -> None:
    """Stop after 3 steps, start again: steps 4..6 are bitwise those of one 6-step run."""
    one_run = run_example(example, "--steps", "6", "--no-checkpoint")
    flags = ("--ckpt-dir", str(tmp_path / "ckpt"), "--memory-root", str(tmp_path / "mem"))
    first = run_example(example, "--steps", "3", *flags, "--persist-every", "2")
    second = run_example(example, "--steps", "6", *flags, "--persist-every", "2")
    (restored,) = [e for e in second if e["event"] == "restored"]
    assert restored["step"] == 3 and restored["tier"] == "memory"
    assert sorted(losses(second)) == [4, 5, 6]
    assert {**losses(first), **losses(second)} == losses(one_run)


@pytest.mark.slow
def test_restart_loads_the_train_step_from_the_cache_while_restoring(tmp_path: Path) -> None:
    """A resumed run compiles nothing: the cache serves the train step, during the restore."""
    flags = ("--ckpt-dir", str(tmp_path / "ckpt"), "--memory-root", str(tmp_path / "mem"))
    first = run_example("classifier", "--steps", "2", *flags)
    second = run_example("classifier", "--steps", "4", *flags)
    (cold,) = [e for e in first if e["event"] == "timeline"]
    (warm,) = [e for e in second if e["event"] == "timeline"]
    # On by default, next to the checkpoints; the first run filled it.
    cache = tmp_path / "ckpt.compilation-cache"
    (start,) = [e for e in second if e["event"] == "start"]
    assert start["compilation_cache"] == str(cache)
    assert any(p.name.startswith("jit_train_step-") for p in cache.iterdir())
    assert cold["compile"]["cache_misses"] == 1 and cold["compile"]["cache_hits"] == 0
    # The restart: the train step's executable comes from the cache, and nothing else of
    # the process compiles either.
    assert warm["compile"]["cache_hits"] == 1 and warm["compile"]["cache_misses"] == 0
    assert warm["compile"]["process_cache_misses"] == 0
    assert warm["compile"]["executable"] == "ahead"
    # The compile did not wait for the restore: it started before the restore ended (a
    # cached compile may finish before the restore even starts, so no more is asserted).
    phases = warm["phases"]
    assert "restore" in phases and "init" not in phases
    (_, restore_end), (compile_start, compile_end) = (
        phases["restore"],
        phases["compile"],
    )
    assert compile_start < restore_end
    assert phases["setup"][0] <= compile_start  # lowered from the abstract state
    assert phases["first_step"][0] >= max(restore_end, compile_end)


# ----------------------------------------------------------------------------- processes


def launch_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, *flags: str
) -> tuple[int, dict[str, Any], list[list[dict[str, Any]]]]:
    """Runs a 6-step classifier job on 2 processes x 2 devices through the launcher.

    Returns:
        ``(exit code, launcher report, per attempt: the events of process 0)``.
    """
    root = tmp_path / name
    code = launch.main(
        [
            *("-n", "2", "--cpu-devices", "2", "--max-restarts", "1", *flags),
            *("--memory-base", str(root / "mem"), "--json", str(root / "report.json"), "--"),
            *(sys.executable, str(REPO / "examples" / "classifier.py"), "--quick"),
            *("--steps", "6", "--replicas", "1", "--persist-every", "3"),
            *("--ckpt-dir", str(root / "ckpt")),
        ]
    )
    attempts: list[list[dict[str, Any]]] = []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("[launch] attempt "):
            attempts.append([])
        elif line.startswith("[p0] ") and attempts:
            event = launch.parse_event(line[5:])
            attempts[-1] += [event] if event else []
    return code, json.loads((root / "report.json").read_text()), attempts


@pytest.mark.multiprocess
@pytest.mark.slow
def test_classifier_killed_process_recovers_bitwise(tmp_path: Path, capsys) -> None:
    code, _, (reference,) = launch_example(tmp_path, capsys, "reference")
    assert code == 0 and sorted(losses(reference)) == [1, 2, 3, 4, 5, 6]
    code, report, attempts = launch_example(tmp_path, capsys, "killed", "--kill", "1@4")
    before, after = attempts[0], attempts[-1]  # (a port retry would add an empty attempt)
    assert code == 0 and report["restarts"] == 1
    (failure,) = report["failures"]
    assert failure["process"] == 1 and failure["status"] == "killed by SIGKILL"
    restart = failure["restart"]
    # Process 1's memory survives a plain kill: both restore the same step from memory.
    assert {e["step"] for e in restart["restored"].values()} == {restart["restored_step"]}
    assert 1 <= restart["restored_step"] <= 4, restart
    assert {e["tier"] for e in restart["restored"].values()} == {"memory"}
    # Every step, including those computed twice, is bitwise the reference.
    assert losses(before) == {s: losses(reference)[s] for s in losses(before)}
    assert losses(after) == {
        s: losses(reference)[s] for s in range(restart["restored_step"] + 1, 7)
    }
    # The recovery timeline: every process's phases, measured from the restart. The
    # launcher's cache (under its memory base) served the train step to BOTH processes:
    # JAX's to process 0, the example's own per-process one to process 1 (on CPU, JAX's
    # key differs per process and only process 0 writes).
    timeline = restart["timeline"]
    assert sorted(timeline["processes"]) == ["0", "1"] and timeline["standby"] is False
    for entry in timeline["processes"].values():
        phases = entry["phases"]
        assert {"startup", "jax_init", "setup", "restore", "compile", "first_step"} <= set(phases)
        assert entry["compile"]["cache_hits"] == 1 and entry["compile"]["cache_misses"] == 0
        # The compile did not wait for the restore (a cached one may end before it starts).
        assert phases["compile"]["start"] < phases["restore"]["end"]
    assert timeline["processes"]["1"]["compile"]["own_cache"] == {"hits": 1, "misses": 0}
    assert isinstance(timeline["restore_compile_overlap_s"], float)
    assert timeline["recovery_s"] >= timeline["first_step_after_s"] > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_quick(tmp_path: Path) -> None:
    """The demo (LM): node loss -> bitwise identical losses; shrink and grow back -> data
    order preserved, from memory and peers."""
    proc = patience.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--quick", "--workdir", str(tmp_path)],
        timeout=280,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out[-6000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["identical_losses"] is True and summary["resize_data_order_preserved"] is True
    assert summary["grow_data_order_preserved"] is True and summary["persistent_bytes_read"] == 0
    assert summary["recovered_from"] and summary["steps_lost"] >= 0
    assert summary["restore_seconds"] is not None and summary["resized_to"] == 1
    assert summary["grown_to"] == 2 and summary["grow_recovery_timeline"]["kind"] == "grow"
    assert summary["shrink_recovery_s"] > 0 and summary["grow_recovery_s"] > 0
    assert summary["standby_slowdown"]["waiting"]["steps"] > 0
    # Woken spares use the memory roots of the nodes they replace: step 4 is persisted
    # too, but memory and peers serve it.
    assert "persistent" not in summary["recovered_from"]
    # The timeline of the node-loss restart: hot spares, which compiled the train step (one
    # lookup of the cache each) before the job even started: nothing left on the restart.
    timeline = summary["recovery_timeline"]
    assert timeline["standby"] is True and timeline["phases"]["compile"]["end"] <= 0
    assert timeline["compile_cache_hits"] + timeline["compile_cache_misses"] == 2
    assert {"restore", "compile", "first_step"} <= set(timeline["phases"])
    assert timeline["recovery_s"] >= timeline["first_step_after_s"] > 0
    assert timeline["first_step_over_max_restore_compile"] > 0
    assert "Recovery timeline" in out
    assert "Recovery report" in out and "IDENTICAL" in out and "PRESERVED" in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
