"""Garbage collection on several processes keeps the newest step every process persisted."""

from __future__ import annotations

import shutil

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_max_to_keep_1_keeps_the_newest_durable_step_across_processes(tmp_path):
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    domains = ["node0", "node1"]
    ckpt = tmp_path / "ckpt"
    common = {"ckpt": str(ckpt), "slow_s": 1.5}
    for r in run("save_with_max_to_keep_1", roots, domains, common, worker="mp_durability.py"):
        # Each save finds the previous persist step still persisting on process 1:
        # it is kept (and the durable one before it) until a newer one is durable.
        assert r.result["seen"][-1][-1] == 5, r.result
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert 4 in steps and max(steps) == 5, steps
    for p in range(2):
        assert (ckpt / "4" / "train" / f"part_{p:05d}" / "manifest.json").exists()
    for root in roots:  # every memory tier is lost
        shutil.rmtree(root, ignore_errors=True)
    for r in run("restore", roots, domains, {**common, "step": 4}, worker="mp_durability.py"):
        assert r.result == {"bad": [], "tier": "persistent"}, r.result
