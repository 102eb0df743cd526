"""`jaxckpt.latest_restorable_step` on 4 processes: node loss and rack loss."""

from __future__ import annotations

import shutil

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_latest_restorable_step_after_node_and_rack_loss(tmp_path):
    roots = [str(tmp_path / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]
    common = {"ckpt": str(tmp_path / "ckpt"), "replicas": 1, "persist_every": 2}
    run("save", roots, domains, {**common, "steps": [1, 2, 3], "crash": True})

    # Node loss: node 2's memory is gone, its peer still holds step 3: nothing is lost.
    shutil.rmtree(roots[2])
    node = run("resume", roots, domains, {**common, "then_save": []}, worker="mp_resume.py")
    for r in node:
        assert r.result == {
            "latest": 3,
            "step": 3,
            "after_delete": [1, 2, 3],
            "bad": [],
            "saved": [1, 2, 3],
        }, r.result

    # Rack loss: every memory tier is gone: step 2 (persisted) is the newest restorable;
    # step 3 is deleted on every process, and saving it again works.
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
    rack = run("resume", roots, domains, {**common, "then_save": [3, 4]}, worker="mp_resume.py")
    for r in rack:
        assert r.result == {
            "latest": 3,
            "step": 2,
            "after_delete": [1, 2],
            "bad": [],
            "saved": [1, 2, 3, 4],
        }, r.result
