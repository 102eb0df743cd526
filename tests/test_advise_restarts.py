"""`jaxckpt advise --launch-report`: R in Young/Daly is the restart the launcher measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fresh_iterator, manager, mesh_1d, save, sharded_state

import jaxckpt
from jaxckpt import cli
from jaxckpt.tools import _costs, _young_daly


def launch_report(*restarts: tuple[str, float, float]) -> dict:
    """A launcher report (``--json``) with one failure per ``(tier, recovery_s, restore_s)``."""
    return {
        "success": True,
        "failures": [
            {
                "detected_after_s": 0.01,
                "restart": {
                    "outcome": "ok",
                    "restored": {"0": {"step": 3, "tier": tier, "seconds": read}},
                    "first_step_after_s": total - 0.21,
                    "timeline": {"recovery_s": total, "restore_s": read},
                },
            }
            for tier, total, read in restarts
        ],
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Steps 1-3 of one process, step 2 persisted (memory and persistent rows)."""
    base = tmp_path_factory.mktemp("advise")
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(str(base / "memory"), persist_every=2, memory_keep=2)
    )
    state = {**sharded_state(mesh_1d()), "data": fresh_iterator()}
    with manager(base / "ckpt", h) as mngr:
        for step in (1, 2, 3):
            save(mngr, step, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    return base / "ckpt"


def advise(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["advise", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_measured_restarts_set_r(capsys, ckpt, tmp_path) -> None:
    path = tmp_path / "launch.json"
    # Two restarts from memory (median 6 s, 1 s of it the read), one from persistent.
    path.write_text(
        json.dumps(
            launch_report(("memory", 5.0, 1.0), ("memory", 7.0, 1.0), ("persistent", 30.0, 20.0))
        )
    )
    base = ("--mtbf-hours", 2, "--step-seconds", 0.5, "--json")
    code, out, err = advise(capsys, ckpt, *base)
    assert code == 0, err
    before = {t["tier"]: t for t in json.loads(out)["tiers"]}
    code, out, err = advise(capsys, ckpt, *base, "--launch-report", path)
    assert code == 0, err
    tiers = {t["tier"]: t for t in json.loads(out)["tiers"]}
    assert tiers["memory"]["restore_s"] == pytest.approx(6.0)
    assert "measured: median of 2 restart(s) from memory" in tiers["memory"]["restore_from"]
    assert tiers["persistent"]["restore_s"] == pytest.approx(30.0)
    # R enters the time lost: W = C/tau + (tau/2 + R)/M.
    row = tiers["memory"]
    assert row["waste_fraction"] == pytest.approx(
        _young_daly.waste_fraction(row["interval_steps"] * 0.5, row["cost_s"], 6.0, 7200)
    )
    assert row["waste_fraction"] > before["memory"]["waste_fraction"]


def test_unmeasured_tiers_get_the_measured_overhead(ckpt) -> None:
    catalog = jaxckpt.tools._catalog.Catalog(str(ckpt), None, (), None)
    restarts = _costs.restarts_from_launch_report([("r", launch_report(("memory", 5.0, 1.0)))])
    assert (restarts.overhead_s, restarts.read_s, restarts.counts) == (4.0, 1.0, {"memory": 1})
    plain, *_ = _costs.measure(catalog)
    measured, *_ = _costs.measure(catalog, restarts=restarts)
    by_tier = {c.tier: c for c in plain}
    for cost in measured:
        if cost.tier == "memory":
            assert cost.restore_s == 5.0
        else:  # its read estimate, plus everything but the read of the measured restart
            assert cost.restore_s == pytest.approx(by_tier[cost.tier].restore_s + 4.0)
            assert "measured restart outside the read" in cost.restore_from


def test_a_report_without_a_restart_is_refused(capsys, ckpt, tmp_path) -> None:
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"success": True, "failures": []}))
    code, _, err = advise(capsys, ckpt, "--mtbf-hours", 2, "--launch-report", path)
    assert code != 0 and "trained a step after restoring" in err
    with pytest.raises(SystemExit):  # one restart cost or the other
        cli.main(["advise", str(ckpt), "--mtbf-hours", "2", "--restart-seconds", "3",
                  "--launch-report", str(path)])  # fmt: skip
