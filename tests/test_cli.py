"""The `jaxckpt` command line, against checkpoints the handler wrote in this process."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import types
from pathlib import Path

import patience
import pytest
from helpers import (
    REPO,
    flip_slab_byte,
    fresh_iterator,
    index_manifest,
    manager,
    mesh_1d,
    save,
    sharded_state,
)

import jaxckpt
from jaxckpt import cli
from jaxckpt.format import _format
from jaxckpt.tools import _inspect, _mtbf, _young_daly

STEPS = (1, 2, 3)  # persist_every=2 persists step 2; memory_keep=2 keeps steps 2 and 3


def jaxckpt_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def as_json(capsys, *argv) -> dict:
    code, out, err = jaxckpt_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint dir, memory root) holding steps 1-3 of one process; read only."""
    base = tmp_path_factory.mktemp("saved")
    ckpt, memory = base / "ckpt", base / "memory"
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(str(memory), persist_every=2, memory_keep=2)
    )
    data = fresh_iterator()
    next(data)
    state = {**sharded_state(mesh_1d()), "data": data}
    with manager(ckpt, h) as mngr:
        for step in STEPS:
            save(mngr, step, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    return ckpt, memory


@pytest.fixture
def copy(saved, tmp_path) -> tuple[Path, Path]:
    """A private copy of `saved` to damage (the run id travels in the manifests)."""
    ckpt, memory = tmp_path / "ckpt", tmp_path / "memory"
    shutil.copytree(saved[0], ckpt)
    shutil.copytree(saved[1], memory)
    return ckpt, memory


def index(ckpt: Path, step: int) -> dict:
    return index_manifest(ckpt / str(step) / "train")


def first_chunk(part_dir: Path, manifest: dict, path: str) -> Path:
    """The zarr3 file of chunk (0, ..., 0) of a leaf in a part directory."""
    leaf = next(leaf for leaf in manifest["leaves"] if leaf["path"] == path)
    return part_dir.joinpath("arrays", leaf["array_key"], "c", *["0"] * len(leaf["stored_shape"]))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


# ---- ls ---------------------------------------------------------------------------


def test_ls_shows_each_step_in_memory_and_persistent(capsys, saved):
    ckpt, memory = saved
    report = as_json(capsys, "ls", ckpt, "--memory-root", memory)
    steps = {s["step"]: s for s in report["steps"]}
    assert sorted(steps) == list(STEPS)
    assert steps[1]["memory"] == {} and not steps[1]["restorable"] and steps[1]["missing"] == [0]
    assert steps[2]["memory"] == {"0": [str(memory)]} and steps[2]["durable"]
    assert steps[2]["restorable_from"] == ["memory", "persistent"]
    assert steps[3]["restorable_from"] == ["memory"] and steps[3]["persisted"] == []
    assert all(s["bytes"] == steps[1]["bytes"] > 0 and s["age_s"] >= 0 for s in steps.values())
    (root,) = report["memory_roots"]
    assert root["domain"] is not None  # one process: its own domain
    assert root["steps"] == {s: {"own": [0], "replica": [], "unknown": []} for s in ("2", "3")}

    code, text, _ = jaxckpt_cli(capsys, "ls", ckpt, "--memory-root", memory)
    assert code == 0
    lines = {line.split()[0]: line for line in text.splitlines() if line[:4].strip().isdigit()}
    assert "yes: memory + persistent" in lines["2"] and "1/1 durable" in lines["2"]
    assert "yes: memory" in lines["3"] and "NO: part 0 has no copy" in lines["1"]
    assert f"{memory}" in text and "OWN PARTS" in text


def test_ls_after_the_memory_root_is_lost(capsys, copy):
    ckpt, memory = copy
    shutil.rmtree(memory)
    report = as_json(capsys, "ls", ckpt, "--memory-root", memory)
    steps = {s["step"]: s for s in report["steps"]}
    assert steps[2]["restorable_from"] == ["persistent"]
    assert not steps[3]["restorable"] and steps[3]["missing"] == [0]
    code, text, _ = jaxckpt_cli(capsys, "ls", ckpt, "--memory-root", memory)
    assert code == 0 and f"memory root {memory} holds nothing of run" in text
    # Without any memory root, the same answer, and a hint.
    code, text, _ = jaxckpt_cli(capsys, "ls", ckpt)
    assert code == 0 and "No --memory-root given" in text


def test_ls_marks_a_step_only_in_memory(capsys, copy):
    ckpt, memory = copy
    shutil.rmtree(ckpt / "3")  # garbage-collected by the manager, still in memory
    (step3,) = [
        s for s in as_json(capsys, "ls", ckpt, "--memory-root", memory)["steps"] if s["step"] == 3
    ]
    assert not step3["finalized"] and not step3["restorable"] and step3["memory"]


def test_ls_shows_a_step_whose_index_entry_is_damaged_as_not_restorable(capsys, copy):
    """A part's damaged entry of the step index is that part missing, not a failed `ls`."""
    ckpt, memory = copy
    path = ckpt / "2" / "train" / _format.STEP_INDEX_FILE
    text = path.read_text()
    at = text.rindex('"save_id":"') + len('"save_id":"')
    path.write_text(text[:at] + chr(ord(text[at]) ^ 0x01) + text[at + 1 :])
    steps = {s["step"]: s for s in as_json(capsys, "ls", ckpt, "--memory-root", memory)["steps"]}
    assert not steps[2]["restorable"] and steps[3]["restorable_from"] == ["memory"]


def test_errors_are_sentences_with_exit_status_2(capsys, tmp_path, saved):
    code, _, err = jaxckpt_cli(capsys, "ls", tmp_path / "nowhere")
    assert code == 2 and "does not exist" in err
    code, _, err = jaxckpt_cli(capsys, "inspect", saved[0], 99)
    assert code == 2 and "Step 99" in err and "steps found: [1, 2, 3]" in err


# ---- inspect ----------------------------------------------------------------------


def test_inspect_shows_tree_shardings_iterators_and_metrics(capsys, saved):
    ckpt, memory = saved
    report = as_json(capsys, "inspect", ckpt, 2, "--memory-root", memory)
    leaves = {leaf["path"]: leaf for leaf in report["leaves"]}
    w = leaves["['w']"]
    assert (w["shape"], w["dtype"], w["bytes"], w["chunks"]) == ([16, 6], "float32", 384, 8)
    assert w["sharding"]["spec"] == ["data"] and w["sharding"]["mesh_shape"] == [8]
    assert leaves["['keys']"]["dtype"] == "key<fry>" and leaves["['h']"]["dtype"] == "bfloat16"
    assert leaves["['step']"]["value"] == 7 and leaves["['name']"]["value"] == "run"
    assert report["iterator_states"]["['data']"]["0"] is not None
    assert (report["format"], report["format_version"], report["process_count"]) == (
        "jaxckpt",
        _format.FORMAT_VERSION,
        1,
    )
    (proc,) = report["processes"]
    assert proc["metrics"]["stall_s"] > 0 and proc["metrics"]["persist_s"] > 0
    assert report["location"]["restorable_from"] == ["memory", "persistent"]

    code, text, _ = jaxckpt_cli(capsys, "inspect", ckpt, 2)
    assert code == 0
    assert (
        f"jaxckpt format v{_format.FORMAT_VERSION}" in text
        and "ITERATOR STATES" in text
        and "SAVE METRICS" in text
    )
    (w_line,) = [line for line in text.splitlines() if line.startswith("w ")]
    assert "(16, 6)" in w_line and "float32" in w_line and "P('data') data=8" in w_line


def test_inspect_tree_joins_single_child_chains():
    paths = [
        ["params", "embed", "embedding", "value"],
        ["params", "pos", "embedding", "value"],
        ["opt", "[0]", "count"],
        ["step"],
    ]
    assert _inspect._collapse(paths) == [
        ["params", "embed.embedding.value"],
        ["params", "pos.embedding.value"],
        ["opt[0].count"],
        ["step"],
    ]


# ---- verify -----------------------------------------------------------------------


def test_verify_passes_then_fails_on_a_flipped_byte_in_each_copy(capsys, copy):
    ckpt, memory = copy
    code, text, err = jaxckpt_cli(capsys, "verify", ckpt, 2, "--memory-root", memory)
    assert code == 0, text
    assert "verify step 2" in err and re.search(r"(\d+)/\1 chunks", err)  # progress on stderr
    assert "2 good copies, 0 bad." in text

    manifest = index(ckpt, 2)
    run_dir = memory / manifest["run_id"] / "step_000000000002" / "part_00000"
    flip_slab_byte(run_dir, "['w']", (0, 0), at=5, bit=0x10)
    code, text, _ = jaxckpt_cli(capsys, "verify", ckpt, 2, "--memory-root", memory, "--no-progress")
    assert code == 1
    assert "['w'] chunk (0, 0): checksum mismatch" in text and "1 good copy, 1 bad." in text

    flip_byte(first_chunk(ckpt / "2" / "train" / "part_00000", manifest, "['b']"))
    report = json.loads(
        jaxckpt_cli(capsys, "verify", ckpt, 2, "--memory-root", memory, "--json", "--no-progress")[
            1
        ]
    )
    bad = {c["tier"]: c["problems"] for c in report["copies"]}
    assert bad == {
        "memory": ["['w'] chunk (0, 0): checksum mismatch"],
        "persistent": ["['b'] chunk (0,): checksum mismatch"],
    }
    assert report["parts_without_good_copy"] == [0] and not report["ok"]


def test_a_memory_copy_with_a_broken_manifest_is_bad_and_unused(capsys, copy):
    ckpt, memory = copy
    part = memory / index(ckpt, 3)["run_id"] / "step_000000000003" / "part_00000"
    (part / "manifest.json").write_text("{not json")
    code, text, _ = jaxckpt_cli(capsys, "ls", ckpt, "--memory-root", memory)
    assert "copy of part 0 in" in text and "is not used (unreadable manifest)" in text
    code, text, _ = jaxckpt_cli(capsys, "verify", ckpt, 3, "--memory-root", memory, "--no-progress")
    assert code == 1 and "unreadable manifest" in text


def test_verify_without_a_copy_in_reach_exits_3(capsys, saved):
    code, text, _ = jaxckpt_cli(capsys, "verify", saved[0], 3, "--no-progress")
    assert code == 3 and "No good copy in reach of part(s) 0" in text


# ---- advise -----------------------------------------------------------------------


def test_young_and_daly_match_hand_computed_values():
    # C = 1 min, M = 1 day: sqrt(2*60*86400) = 3219.94 s; Daly: x = C/2M = 3.4722e-4,
    # 3219.94 * (1 + 0.018634/3 + 3.4722e-4/9) - 60 = 3180.06 s.
    assert _young_daly.young_interval(60, 86400) == pytest.approx(3219.938, abs=1e-3)
    assert _young_daly.daly_interval(60, 86400) == pytest.approx(3180.062, abs=1e-3)
    # C = 10 min, M = 1 h: Young 2078.46 s, Daly 2078.46 * 1.105484 - 600 = 1697.71 s.
    assert _young_daly.young_interval(600, 3600) == pytest.approx(2078.461, abs=1e-3)
    assert _young_daly.daly_interval(600, 3600) == pytest.approx(1697.706, abs=1e-3)
    # C >= 2M: checkpoint once per MTBF.
    assert _young_daly.daly_interval(7200, 3600) == 3600
    # W = C/tau + (tau/2 + R)/M = 60/3600 + (1800 + 120)/86400.
    assert _young_daly.waste_fraction(3600, 60, 120, 86400) == pytest.approx(0.0388889, abs=1e-7)
    # Daly's interval is (near) the minimum of the first-order waste.
    tau = _young_daly.daly_interval(60, 86400)
    best = _young_daly.waste_fraction(tau, 60, 0, 86400)
    assert best < _young_daly.waste_fraction(0.8 * tau, 60, 0, 86400)
    assert best < _young_daly.waste_fraction(1.2 * tau, 60, 0, 86400)
    with pytest.raises(ValueError, match="MTBF must be a positive"):
        _young_daly.young_interval(60, 0)


def test_failure_log_gives_span_over_intervals():
    log = [
        "# failures",
        "2026-01-01T00:00:00Z",
        "",
        "1767232800",
        "2026-01-01 04:00:00",
        "2026-01-01T06:00:00+00:00",
    ]
    mtbf, failures, span = _mtbf.mtbf_from_log(log)
    assert (failures, span, mtbf) == (4, 6 * 3600, 2 * 3600)
    with pytest.raises(ValueError, match="line 2: 'yesterday'"):
        _mtbf.mtbf_from_log(["1", "yesterday"])
    with pytest.raises(ValueError, match="at least two"):
        _mtbf.mtbf_from_log(["1"])


def test_advise_uses_the_measured_costs_of_a_real_checkpoint(capsys, saved, tmp_path):
    ckpt, _ = saved
    report = as_json(capsys, "advise", ckpt, "--mtbf-hours", 2, "--step-seconds", 0.5)
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert sorted(tiers) == ["memory", "persistent"]  # no replicas: no peer row
    stall = statistics.median(index(ckpt, s)["metrics"]["stall_s"] for s in STEPS)
    persisted = json.loads((ckpt / "2/train/part_00000/manifest.json").read_text())
    for tier, cost in (("memory", stall), ("persistent", persisted["metrics"]["persist_s"])):
        row = tiers[tier]
        assert row["cost_s"] == pytest.approx(cost)
        assert row["young_s"] == pytest.approx(math.sqrt(2 * cost * 7200))
        assert row["daly_s"] == pytest.approx(_young_daly.daly_interval(cost, 7200))
        assert row["interval_steps"] == max(1, round(row["daly_s"] / 0.5))
        assert row["waste_fraction"] == pytest.approx(
            _young_daly.waste_fraction(row["interval_steps"] * 0.5, cost, row["restore_s"], 7200)
        )
    rec = report["recommended"]
    assert rec["save_interval_steps"] == tiers["memory"]["interval_steps"]
    assert rec["persist_every"] % rec["save_interval_steps"] == 0
    assert rec["persist_every"] >= tiers["persistent"]["interval_steps"]

    log = tmp_path / "failures.txt"
    log.write_text("0\n3600\n7200\n")
    code, text, _ = jaxckpt_cli(capsys, "advise", ckpt, "--failure-log", log)
    assert code == 0
    assert "MTBF 1h00m (3 failures over 2h00m" in text
    assert "step 0.5" not in text and "median over 2 pairs of consecutive saves" in text
    assert "recommended: CheckpointManagerOptions(save_interval_steps=" in text


# ---- bench and the console script -------------------------------------------------


def test_bench_is_delegated_with_its_arguments(capsys, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(main=lambda argv: calls.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "jaxckpt.bench", fake)
    assert cli.main(["bench", "--quick", "--json"]) == 0
    assert calls == [["--quick", "--json"]]


def test_console_script_runs_in_a_fresh_interpreter(saved):
    proc = patience.run(
        [sys.executable, "-m", "jaxckpt.cli", "ls", str(saved[0]), "--json"],
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in json.loads(proc.stdout)["steps"]] == list(STEPS)


# ---- several processes ------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ls_and_verify_of_a_four_process_checkpoint_with_replicas(capsys, tmp_path):
    from multiproc import run

    ckpt, base = tmp_path / "ckpt", tmp_path / "hosts"
    roots = [base / f"node{i}" for i in range(4)]
    run(
        "save",
        [str(r) for r in roots],
        [f"node{i}" for i in range(4)],
        {"ckpt": str(ckpt), "replicas": 1, "steps": [1, 2, 3], "persist_every": 2, "crash": True},
    )
    flags = [x for r in roots for x in ("--memory-root", r)]
    report = as_json(capsys, "ls", ckpt, *flags)
    replicas = {}
    for i, root in enumerate(report["memory_roots"]):
        assert root["domain"] == f"node{i}"
        held = root["steps"]["3"]
        assert held["own"] == [i] and len(held["replica"]) == 1 and not held["unknown"]
        replicas[held["replica"][0]] = roots[i]
    assert sorted(replicas) == [0, 1, 2, 3]  # every part has one replica elsewhere
    steps = {s["step"]: s for s in report["steps"]}
    assert steps[3]["memory_copies"] == 8 and steps[3]["restorable_from"] == ["memory"]
    assert steps[2]["durable"] and steps[2]["process_count"] == 4

    code, text, _ = jaxckpt_cli(capsys, "verify", ckpt, 2, *flags, "--no-progress")
    assert code == 0 and "12 good copies, 0 bad." in text

    # Node 1 lost: its part of step 3 is still on its peer. Then the peer too: step 3 is
    # gone, step 2 remains restorable from persistent storage.
    shutil.rmtree(roots[1])
    steps = {s["step"]: s for s in as_json(capsys, "ls", ckpt, *flags)["steps"]}
    assert steps[3]["restorable"] and steps[3]["memory"]["1"] == [str(replicas[1])]
    shutil.rmtree(replicas[1])
    steps = {s["step"]: s for s in as_json(capsys, "ls", ckpt, *flags)["steps"]}
    assert not steps[3]["restorable"] and steps[3]["missing"] == [1]
    assert steps[2]["restorable"] and "1" not in steps[2]["memory"] and 1 in steps[2]["persisted"]
