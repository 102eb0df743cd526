"""`jaxckpt.latest_restorable_step` on 4 processes: node loss and rack loss."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from multiproc import run

from jaxckpt.format import _format
from jaxckpt.memory import _memory_tier, _quarantine
from jaxckpt.persistent import _paths

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


def test_a_damaged_peer_replica_is_quarantined_and_the_older_step_resumed(tmp_path):
    """2 processes, replicas=1, persist_every=2, steps 1..3: process 0's node is lost and
    the replica of its step-3 part that process 1 holds is damaged. The restore of step 3
    fails on both; process 1 (told by process 0) quarantines its replica, so the next
    latest_restorable_step returns 2 on both, which restores: no restart loop."""
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    domains = ["node0", "node1"]
    common = {"ckpt": str(tmp_path / "ckpt"), "replicas": 1, "persist_every": 2}
    run("save", roots, domains, {**common, "steps": [1, 2, 3], "crash": True})

    shutil.rmtree(roots[0])  # node loss
    run_id = _paths.default_run_id(Path(common["ckpt"]) / "0" / "train")
    replica = _memory_tier.MemoryTier(roots[1], run_id).part_dir(3, 0)
    manifest = _format.PartManifest.from_json((replica / _format.MANIFEST_FILE).read_text())
    # A chunk of "w", which only part 0 holds ("b", small and replicated over both
    # processes, is in each one's part: a damaged copy of it is read from the other).
    w = next(i for i, r in enumerate(manifest.leaves) if r.path == "['w']")
    chunk = manifest.chunks[w][0]
    assert chunk.offset is not None and chunk.nbytes >= 8
    with open(replica / "slab", "r+b") as f:
        f.seek(chunk.offset)
        f.write(bytes(b ^ 0xFF for b in f.read(8)))

    results = run("resume_damaged", roots, domains, common, worker="mp_resume.py")
    for r in results:
        assert r.result is not None
        assert r.result["first"] == 3, r.result
        assert r.result["failed"] and r.result["failed"].startswith("FileNotFoundError"), r.result
        assert r.result["step"] == 2 and r.result["after_delete"] == [1, 2], r.result
        assert r.result["bad"] == [], r.result
    assert "checksum mismatch" in results[0].result["failed"], results[0].result
    assert _quarantine.is_quarantined(replica)
