"""A rack lost at once, and two, in a real job: 6 JAX processes in 3 failure domains.

The simulation of the same cases at 24 processes is tests/test_correlated_failures.py.
"""

from __future__ import annotations

import shutil

import pytest
from multiproc import run
from test_multiprocess import restores

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RACKS = {"rackA": [0, 1], "rackB": [2, 3], "rackC": [4, 5]}
DOMAINS = [rack for rack, members in RACKS.items() for _ in members]
# A relay group a rack: a lost rack takes its whole group, leader and member, with it.
RELAYED = {p: {"MP_RELAY_GROUP": "2"} for p in range(len(DOMAINS))}


def in_racks(scenario: str, roots: list[str], args: dict) -> list:
    return run(scenario, roots, DOMAINS, args, env=RELAYED)


def lose(roots: list[str], *racks: str) -> None:
    for rack in racks:
        for p in RACKS[rack]:
            shutil.rmtree(roots[p], ignore_errors=True)


def saved(tmp_path, replicas: int) -> tuple[list[str], dict]:
    """Steps 1-3 saved by every process (step 2 persisted), the job ended; the roots."""
    roots = [str(tmp_path / "hosts" / f"p{i}") for i in range(len(DOMAINS))]
    common = {"ckpt": str(tmp_path / "ckpt"), "replicas": replicas}
    args = {**common, "steps": [1, 2, 3], "persist_every": 2}
    assert all(r.result["steps"] == [1, 2, 3] for r in in_racks("save", roots, args))
    return roots, common


def test_one_replica_a_lost_rack_then_two(tmp_path):
    # Placement (one replica, never in the owner's rack): 0->2, 1->3, 2->4, 3->5, 4->1, 5->0.
    roots, common = saved(tmp_path, replicas=1)

    # Rack B lost: its processes' parts come from their holders in rack C.
    lose(roots, "rackB")
    (one,) = restores(in_racks("restore", roots, {**common, "restores": [{"step": 3}]}))
    assert all(r["bad"] == [] and "persistent" not in r["bytes_by_tier"] for r in one), one
    assert [one[p]["tier"] for p in RACKS["rackB"]] == ["peer", "peer"], one

    # Racks A and B lost: parts 0 and 1 had every copy there. Every process refuses step 3
    # naming them and the newest restorable step; step 2 comes from persistent storage.
    lose(roots, "rackA")
    step3, step2 = restores(
        in_racks("restore", roots, {**common, "restores": [{"step": 3}, {"step": 2}]})
    )
    for r in step3:
        assert "Step 3 cannot be restored" in r["error"], r
        assert "process(es) [0, 1]" in r["error"] and "newest restorable step is 2" in r["error"]
    assert all(r["bad"] == [] for r in step2), step2
    assert all("persistent" in step2[p]["bytes_by_tier"] for p in RACKS["rackA"]), step2


def test_two_replicas_survive_two_lost_racks(tmp_path):
    # Placement (two replicas in two other racks): every part has a copy in every rack.
    roots, common = saved(tmp_path, replicas=2)
    lose(roots, "rackA", "rackB")
    (three,) = restores(in_racks("restore", roots, {**common, "restores": [{"step": 3}]}))
    assert all(r["bad"] == [] and "persistent" not in r["bytes_by_tier"] for r in three), three
    assert all(three[p]["tier"] == "peer" for p in RACKS["rackA"] + RACKS["rackB"]), three
