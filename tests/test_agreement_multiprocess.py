"""Processes that disagree fail together, at once: 3 JAX processes on loopback.

Without the agreement, a tree that differs on one process saved fine and then
hung the job at restore (the others waited in Orbax's barrier), and a restore
error on one process (a wrong target, a chunk damaged in every copy it reads)
left the others waiting there. See tests/workers/mp_agreement.py for the scenario.
"""

from __future__ import annotations

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TIMEOUT_S = 20  # TierOptions.timeout_s: nothing below may take that long


def test_disagreeing_processes_all_raise_without_waiting(tmp_path):
    roots = [str(tmp_path / "hosts" / f"node{i}") for i in range(3)]
    # One rack, one relay group (`relay_group=3`): after the peers' set-up every exchange
    # goes through it (process 0 leads; 1 and 2 post to it over the peer data service).
    domains = [f"rack0/host{i}" for i in range(3)]
    relayed = {i: {"MP_RELAY_GROUP": "3"} for i in range(3)}
    args = {
        "ckpt": str(tmp_path / "ckpt"),
        "roots": roots,
        "timeout_s": TIMEOUT_S,
        "more_saves": 8,
    }
    results = [
        r.result
        for r in run("agreement", roots, domains, args, worker="mp_agreement.py", env=relayed)
    ]

    for p, r in enumerate(results):
        for ok in ("save_1", "save_4", "restore_4", "restore_last"):
            assert "error" not in r[ok], (p, ok, r[ok])
        assert r["restore_4"]["value"] == [] and r["restore_last"]["value"] == [], (p, r)

        extra = r["save_2_extra_leaf"]["error"]
        assert extra.startswith("ValueError") and "different trees at step 2" in extra, extra
        assert "leaf ['extra']" in extra and "processes [1] save it" in extra, extra
        other = r["save_3_other_sharding"]["error"]
        assert "different trees at step 3" in other and "leaf ['w']" in other, other
        assert "processes [2] save it with" in other and "sharding=" in other, other

        wrong = r["restore_wrong_target_on_1"]["error"]
        assert wrong.startswith("ValueError") and "['w']" in wrong, wrong
        if p != 1:
            assert "failed on process 1, so it fails on every process" in wrong, wrong

        corrupt = r["restore_corrupt_for_1"]["error"]
        assert corrupt.startswith("FileNotFoundError") and "No verified copy" in corrupt, corrupt
        if p != 1:
            assert "failed on process 1" in corrupt, corrupt

        for failed in ("save_2_extra_leaf", "save_3_other_sharding"):
            assert r[failed]["seconds"] < TIMEOUT_S / 2, (p, failed, r[failed])
        for failed in ("restore_wrong_target_on_1", "restore_corrupt_for_1"):
            assert r[failed]["seconds"] < TIMEOUT_S / 2, (p, failed, r[failed])

        # Finished exchanges leave no keys in the coordinator's store, however many saves,
        # but the last one's outcome and claim (the next exchange deletes them).
        assert r["keys_after_save_4"] <= 2 and r["keys_after_more"] <= 2, r
    assert results[1]["corrupted_files"] > 0
    timings = {
        k: max(r[k]["seconds"] for r in results)
        for k in ("save_2_extra_leaf", "restore_wrong_target_on_1", "restore_corrupt_for_1")
    }
    agree = max(r["agree_s"] for r in results)
    print(
        f"AGREEMENT slowest process per failure (s): {timings}; saves: {results[0]['saves']}; "
        f"agreement in the last commit: {agree * 1000:.1f} ms; one exchange (median): "
        f"{max(r['exchange_s'] for r in results) * 1000:.1f} ms"
    )
