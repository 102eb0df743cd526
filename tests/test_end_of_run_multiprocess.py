"""Two processes: plain manager options keep a durable step through a memory loss, and
`release_memory()` at the end of a run is collective (one verdict, every trial)."""

from __future__ import annotations

import shutil

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = "mp_end_of_run.py"


def test_plain_max_to_keep_1_leaves_a_durable_step_after_every_memory_tier_is_lost(tmp_path):
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    domains = ["node0", "node1"]
    common = {"ckpt": str(tmp_path / "ckpt")}
    for r in run("plain_save", roots, domains, common, worker=WORKER):
        assert r.result == {"closed": True}
    for root in roots:  # every memory tier is lost
        shutil.rmtree(root, ignore_errors=True)
    for r in run("plain_resume", roots, domains, common, worker=WORKER):
        assert r.result["step"] is not None and r.result["step"] >= 10, r.result
        assert r.result["bad"] == [] and r.result["tier"] == "persistent", r.result


def test_release_memory_at_the_end_of_a_run_is_collective_and_ends_whatever_the_step(tmp_path):
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    args = {"ckpt": str(tmp_path / "ckpt"), "trials": 4, "slow_s": 1.0}
    for r in run("end_of_run", roots, ["node0", "node1"], args, worker=WORKER, timeout=480):
        for trial in r.result["trials"]:  # every trial: the last step durable, the tier freed
            assert trial["released"] and max(trial["released"]) == 7, r.result
            assert trial["slabs"] == [], trial
            assert trial["bad"] == [] and trial["tier"] == "persistent", trial
        # A run that ends on step 13 (not due, not asked for): persisted, and the tier freed.
        assert 13 in r.result["gemma"]["released"] and r.result["gemma"]["slabs"] == [], r.result
        assert r.result["restarted"]["step"] == 13 and r.result["restarted"]["bad"] == []
