"""The pictures: `jaxckpt bench --plot` and `jaxckpt.launch --timeline-png` (matplotlib)."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
from test_launch import run  # noqa: F401  (the launcher on fake children)

from jaxckpt.bench import _figure, _plot
from jaxckpt.bench import _run as bench
from jaxckpt.launch import _timeline_plot

pytest.importorskip("matplotlib")

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk."""
    assert data[:8] == _PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _check_png(path, min_px=(600, 150)):
    data = path.read_bytes()
    width, height = _png_size(data)
    assert width >= min_px[0] and height >= min_px[1]
    assert 10_000 < len(data) < 300_000
    return data


def _bench_report() -> dict:
    figs = [
        _figure.Figure(
            "1a", "step time, jaxckpt save every step", 2.0, "s", 1.4, "no save", "<= 1.15"
        ),
        _figure.Figure("1d", "floor", 1.5, "s", 1.4, "no save"),
        _figure.Figure("4a", "memory-tier write", 3500.0, "MB/s", 6500.0, "memcpy", ">= 0.8"),
        _figure.Figure("5a", "restore from own memory", 0.09, "s", 1.3, "Orbax", "<= 0.33"),
        _figure.Figure("5b", "restore from peer memory", None, "s", 1.3, "Orbax", "<= 0.33"),
    ]
    return {
        "figures": [dataclasses.asdict(f) for f in figs],
        "config": {"processes": 2, "replicas": 1},
        "state": {"state_bytes": 2**30},
        "machine": {"cpu_count": 2, "date": "2026-12-02T06:00:00+00:00"},
    }


def test_bench_plot_draws_a_saved_report(tmp_path, capsys):
    report = tmp_path / "bench.json"
    report.write_text(json.dumps(_bench_report()))
    png = tmp_path / "bench.png"
    assert bench.main(["--from-json", str(report), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    # The table is printed as a run prints it, the figure without a value included.
    assert "1a  " in printed and "5b  " in printed and "plot: " in printed
    data = _check_png(png)
    # Deterministic: the same report gives the same file.
    again = tmp_path / "again.png"
    assert bench.main(["--from-json", str(report), "--plot", str(again)]) == 0
    assert again.read_bytes() == data


def test_bench_plot_refuses_what_it_cannot_draw(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench.main(["--from-json", str(bad)]) == 2
    assert "not a report of --json" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"figures": []}))
    with pytest.raises(ValueError, match="no figure with a ratio"):
        _plot.plot(json.loads(empty.read_text()), tmp_path / "x.png")


def test_launcher_draws_the_recovery_timeline(run, tmp_path, capsys):  # noqa: F811
    png = tmp_path / "timeline.png"
    code, report = run("-n", "3", "--kill", "1@3", "--timeline-png", str(png))
    assert code == 0 and report["failures"][0]["restart"]["timeline"]
    assert f"[launch] timeline: {png}" in capsys.readouterr().out
    _check_png(png)


def test_timeline_rows_put_overlapping_phases_in_lanes():
    spans = [("restore", 0.0, 2.0), ("compile", 0.5, 1.5), ("first_step", 2.0, 2.5)]
    assert _timeline_plot._lanes(spans) == [0, 1, 0]
    timeline = {
        "detected_after_s": 1.0,
        "restart_after_s": 0.5,
        "first_step_after_s": 3.0,
        "processes": {
            "1": {"phases": {"restore": {"start": 0.1, "end": 1.0}}, "restored": {"tier": "peer"}},
            "0": {"phases": {"standby": {"start": -9.0, "end": -1.0}}},
        },
    }
    rows = _timeline_plot._rows(timeline)
    assert rows[0] == ("launcher", [("detection", -1.5, -0.5), ("restart", -0.5, 0.0)])
    # Processes in order; a hot spare's wait before the failure is not drawn.
    assert rows[1] == ("process 0", [])
    assert rows[2] == ("process 1\n(from peer)", [("restore", 0.1, 1.0)])
    # Without hot spares everything is shown; with them, from just before the failure.
    assert _timeline_plot._window(timeline) is None
    left, right = _timeline_plot._window({**timeline, "standby": True})
    assert -1.5 - 0.5 < left < -1.5 and right > 3.0
    with pytest.raises(ValueError, match="no restart"):
        _timeline_plot.plot({"failures": [{"restart": None}]}, "unused.png")
