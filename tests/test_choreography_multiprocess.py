"""A process that fails just before any exchange still takes part in every exchange: 2 JAX
processes on loopback, one failing (`JAXCKPT_FAULT=fail:<operation>.<exchange>`) before
each exchange of a save, a restore, a listing and a release of the memory tier, and
before the run is opened.

Every process must raise the failing process's error, without waiting out the
timeout (a process that skipped an exchange would leave the other waiting in it
until a TimeoutError). See tests/workers/mp_choreography.py for the scenario.
"""

from __future__ import annotations

import pytest
from multiproc import run

from jaxckpt import _faults
from jaxckpt.run import _choreography

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TIMEOUT_S = 30  # TierOptions.timeout_s: a process left waiting would take that long
# (fault point, failing process): every exchange of each operation, and the opening of
# the run before them; each operation fails once on each process.
CASES = [
    ("save.open", 1),
    ("save.meet", 0),
    ("save.agree", 1),
    ("restore.open", 0),
    ("restore.meet", 1),
    ("restore.inventories", 0),
    ("restore.agree", 1),
    ("restore.reshard", 0),  # taken to the verdict just before it
    ("list.open", 0),
    ("list.meet", 1),
    ("list.inventories", 0),
    ("list.agree", 1),
    ("release.agree", 0),
    ("release.agree", 1),
]


def test_the_cases_cover_every_exchange_of_every_operation():
    covered = {point for point, _ in CASES}
    operations = (
        _choreography.SaveChoreography,
        _choreography.RestoreChoreography,
        _choreography.ListChoreography,
        _choreography.ReleaseChoreography,
    )
    for op in operations:
        opens = () if op is _choreography.ReleaseChoreography else ("open",)
        for name in (*opens, *op.EXCHANGES):
            assert f"{op.VERB}.{name}" in covered, (op.VERB, name)
            assert f"{op.VERB}.{name}" in _faults.POINTS
        assert {p for point, p in CASES if point.startswith(op.VERB + ".")} == {0, 1}, op.VERB


def test_a_failure_before_any_exchange_fails_every_process_within_the_bound(tmp_path):
    roots = [str(tmp_path / "hosts" / f"node{i}") for i in range(2)]
    args = {"ckpt": str(tmp_path / "ckpt"), "timeout_s": TIMEOUT_S, "cases": CASES}
    results = [
        r.result
        for r in run(
            "choreography",
            roots,
            ["node0", "node1"],
            args,
            worker="mp_choreography.py",
            timeout=600,
        )
    ]

    for p, r in enumerate(results):
        for ok in ("save_ok", "after_save", "after_restore", "after_list"):
            assert "error" not in r[ok], (p, ok, r[ok])
        assert r["after_restore"]["value"] == [], (p, r["after_restore"])
        # Newest first (step 1 may have left memory already: memory_keep=1).
        assert r["after_list"]["value"][0] == 2, (p, r["after_list"])
        for point, failing in CASES:
            outcome = r[f"{point}@{failing}"]
            injected = f"[process {failing}] injected fault before {point} of step"
            assert "error" in outcome, (p, point, outcome)
            error = outcome["error"]
            # The same error everywhere: the failing process's own, or one naming it.
            assert error.startswith("RuntimeError: "), (p, point, error)
            assert injected in error, (p, point, error)
            if p != failing:
                assert f"failed on process {failing}" in error, (p, point, error)
            # Within the bound: nobody waited for a process that skipped an exchange.
            assert outcome["seconds"] < TIMEOUT_S, (p, point, outcome)
    slowest = {
        f"{point}@{failing}": max(r[f"{point}@{failing}"]["seconds"] for r in results)
        for point, failing in CASES
    }
    print(f"CHOREOGRAPHY slowest process per injected failure (s): {slowest}")
