"""`jaxckpt bench --layout hsdp`: its figures from the processes' results (pure), and its
arguments checked (the run itself is `jaxckpt bench --layout hsdp`, minutes on 2 cores)."""

from __future__ import annotations

import pytest

from jaxckpt.bench import _hsdp, _run


def _result(p: int, bytes_: float, stall: float) -> dict:
    common = {"jaxckpt_s": 0.2, "no_save_s": 0.1, "bytes": bytes_, "stall_s": stall}
    return {
        "process": p,
        "state_bytes": 4000,
        "hsdp": {
            "dp": 2,
            **common,
            "replicate_bytes": bytes_,
            "orbax_s": 0.4,
            "restore_s": 0.3,
            "orbax_restore_s": 0.6,
            "restore_bytes": 1000,
        },
        "fsdp": {"dp": 1, **common, "jaxckpt_s": 0.3, "replicate_bytes": bytes_},
    }


def test_figures_compare_the_busiest_process_with_the_mean() -> None:
    procs = [_result(0, 1000, 0.01), _result(1, 1000, 0.01), _result(2, 1100, 0.03)]
    figs = {f.id: f for f in _hsdp.figures(procs)}
    assert figs["h1.bytes"].value == 1100 and figs["h1.bytes"].ratio == pytest.approx(
        1100 / 1033.33, rel=1e-3
    )
    assert figs["h1.bytes"].met is False  # 6% over the mean: the target is 5%
    assert figs["h1.stall_s"].ratio == pytest.approx(0.03 / (0.05 / 3))
    # The unreplicated runs stalled as unevenly (the same figures): the spread is noise.
    assert figs["h1.stall_spread"].ratio == pytest.approx(1.0) and figs["h1.stall_spread"].met
    for p in procs:
        p["fsdp"]["stall_s"] = 0.02  # even unreplicated: HSDP's spread is all imbalance
    figs = {f.id: f for f in _hsdp.figures(procs)}
    assert figs["h1.stall_spread"].ratio == pytest.approx(0.03 / (0.05 / 3))
    assert not figs["h1.stall_spread"].met
    assert figs["h2"].ratio == pytest.approx(2.0) and figs["h3"].ratio == pytest.approx(0.5)
    # A save every step adds 0.1 s on HSDP against 0.2 s unreplicated: met.
    assert figs["h4"].ratio == pytest.approx(0.5) and figs["h4"].met
    assert figs["h5"].ratio == pytest.approx(0.5) and figs["h5"].met
    assert figs["h6"].ratio == pytest.approx(0.75) and figs["h6"].met  # 3 x 1000 of 4000


def test_the_stall_spread_is_measured_against_the_unreplicated_layouts() -> None:
    """HSDP's spread no wider than the unreplicated layout's: met, though the busiest
    process stalls 1.33 x the mean."""
    procs = [_result(0, 1000, 0.01), _result(1, 1000, 0.02)]
    for p, stall in zip(procs, (0.03, 0.05), strict=True):
        p["fsdp"]["stall_s"] = stall  # spread 1.25
    figs = {f.id: f for f in _hsdp.figures(procs)}
    assert figs["h1.stall_s"].ratio == pytest.approx(0.02 / 0.015)
    assert figs["h1.stall_spread"].ratio == pytest.approx((0.02 / 0.015) / 1.25)
    assert not figs["h1.stall_spread"].met  # 1.067
    procs[0]["fsdp"]["stall_s"] = 0.025  # spread 1.33
    figs = {f.id: f for f in _hsdp.figures(procs)}
    assert figs["h1.stall_spread"].ratio == pytest.approx(1.0) and figs["h1.stall_spread"].met


def test_layout_arguments_are_checked(capsys) -> None:
    with pytest.raises(SystemExit):
        _run.main(["--layout", "hsdp", "--processes", "3", "--dp", "2"])
    assert "--dp >= 2 dividing --processes (3)" in capsys.readouterr().err
