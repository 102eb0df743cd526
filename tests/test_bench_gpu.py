"""`python -m jaxckpt.bench --gpu`: the accelerator check runs end to end (here on CPU,
where its figures mean nothing: this keeps the code working between GPU runs)."""

from __future__ import annotations

import json
import sys

import patience
from helpers import REPO


def test_the_gpu_check_runs_on_cpu_and_reports_every_figure(tmp_path):
    out = tmp_path / "gpu.json"
    proc = patience.run(
        [
            *(sys.executable, "-m", "jaxckpt.bench", "--gpu", "--platform", "cpu"),
            *("--state-gib", "0.01", "--loop-steps", "20", "--saves", "3", "--json", str(out)),
        ],
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    figures = {f["id"]: f for f in report["figures"]}
    assert sorted(figures) == ["g1", "g2", "g3", "g4", "g5", "g6"]
    for f in figures.values():
        assert f["value"] > 0 and f["baseline"] > 0 and f["ratio"] > 0, f
    raw = report["raw"]
    assert raw["bitwise_equal"] is True
    assert raw["restore_tier"] == "memory"
    assert raw["jaxckpt_host_staging"] == "slab"  # on CPU: copied into the slab in save()
    assert report["state_bytes"] > 0
    assert "g1  jaxckpt mngr.save() blocks" in proc.stdout
