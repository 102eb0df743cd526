"""Elastic training through the launcher: a job shrinks when a node is lost and none
replaces it, and grows back when the node registers again (``--grow-at-save``), with the
data order and the state of an uninterrupted run, restoring from memory and peers only.

The job is tests/workers/elastic_job.py: the examples' loop on a model whose training
is exact on any mesh, so "the same state" means the same bits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import patience
import pytest

import jaxckpt
from jaxckpt import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

JOB = Path(__file__).resolve().parent / "workers" / "elastic_job.py"
STEPS = 32  # persisted: a multiple of --persist-every


def _job(root: Path) -> list[str]:
    return [
        *(sys.executable, str(JOB), "--steps", str(STEPS), "--batch", "24"),
        *("--ckpt-dir", str(root / "ckpt"), "--replicas", "1", "--persist-every", "4"),
    ]


def _events(lines: list[str]) -> list[list[dict[str, Any]]]:
    """Per attempt, the events of process 0 (one attempt for a run without the launcher)."""
    attempts: list[list[dict[str, Any]]] = [[]]
    for line in lines:
        if line.startswith("[launch] attempt "):
            attempts.append([])
        text = line[5:] if line.startswith("[p0] ") else line
        event = launch.parse_event(text)
        if event is not None and event.get("process", 0) == 0:
            attempts[-1].append(event)
    return [a for a in attempts if a]


def _data(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["step"]: e["data"] for e in events if e["event"] == "step"}


def _final_state(ckpt: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """The last step's params and optimizer state, read from the persistent tier onto
    the host here, as raw bytes by leaf path."""
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(tmp_path / "reader")))
    mngr = ocp.CheckpointManager(ckpt, item_handlers={"train": handler})
    state = mngr.restore(STEPS, args=ocp.args.Composite(train=jaxckpt.TieredRestore())).train
    mngr.close()
    leaves = jax.tree_util.tree_leaves_with_path({k: state[k] for k in ("params", "opt_state")})
    return {jax.tree_util.keystr(p): np.atleast_1d(np.asarray(v)).view(np.uint8) for p, v in leaves}


def test_shrink_and_grow_back_keep_the_state_and_data_order(tmp_path: Path, capsys) -> None:
    # The uninterrupted run: one process, no launcher.
    ref = tmp_path / "reference"
    env = {**os.environ, "JAXCKPT_CPU_DEVICES": "2", "JAXCKPT_MEMORY_ROOT": str(ref / "mem")}
    proc = patience.run(_job(ref), timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (reference,) = _events(proc.stdout.splitlines())
    assert sorted(_data(reference)) == list(range(1, STEPS + 1))

    # 2 processes; node 1 lost at step 4 -> 1 process; node 1 back at step 6 -> 2 again.
    run = tmp_path / "elastic"
    code = launch.main(
        [
            *("-n", "2", "--cpu-devices", "2", "--max-restarts", "1"),
            *("--lose-node", "1@4", "--processes-after-failure", "1"),
            *("--return-node", "1@6", "--grow-at-save"),
            *("--memory-base", str(run / "mem"), "--json", str(run / "report.json"), "--"),
            *_job(run),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    report = json.loads((run / "report.json").read_text())
    assert [a["num_processes"] for a in report["attempts"]] == [2, 1, 2], out[-6000:]
    assert [a["outcome"] for a in report["attempts"]] == ["signal", "stopped", "ok"]
    (failure,), (grow,) = report["failures"], report["grows"]
    assert grow["nodes_added"] == [1] and grow["restart"]["nodes"] == [0, 1]
    # The grow restarts from the step the smaller job stopped at: no step lost.
    assert (
        grow["restart"]["restored_step"] == grow["last_step"] and grow["restart"]["steps_lost"] == 0
    )
    # Every restore read memory and peers only, though steps 4, 8, ... are persisted.
    for restart in (failure["restart"], grow["restart"]):
        for entry in restart["restored"].values():
            assert set(entry["bytes_by_tier"]) <= {"memory", "peer"}, restart["restored"]
    assert grow["restart"]["timeline"]["kind"] == "grow"
    assert grow["restart"]["timeline"]["recovery_s"] > 0

    # Every step of every attempt trained on the reference's global batch.
    attempts = _events(out.splitlines())
    assert len(attempts) == 3
    for events in attempts:
        data = _data(events)
        assert data and all(data[s] == _data(reference)[s] for s in data), (data, reference)
    assert max(_data(attempts[-1])) == STEPS
    # And the job ends in the uninterrupted run's state, bit for bit.
    want = _final_state(ref / "ckpt", tmp_path / "a")
    got = _final_state(run / "ckpt", tmp_path / "b")
    assert sorted(got) == sorted(want)
    different = [k for k in want if not np.array_equal(want[k], got[k])]
    assert not different, different
