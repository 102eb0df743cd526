"""`jaxckpt bench --reshard`: the bytes a process needs of a target (pure, on this
process's 8 CPU devices), the figures from raw results, the arguments, and the quick run's
report: every direction's rows, with ratios, every restore verified (never a timing)."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from jaxckpt.bench import _reshard
from jaxckpt.bench import _run as bench

SHAPE = (64, _reshard.COLUMNS)
ARRAY_BYTES = SHAPE[0] * SHAPE[1] * 4


def test_one_process_needs_every_byte_of_a_sharded_or_replicated_target():
    for layout in (
        _reshard.Layout(2, (2,), ("x",), ("x", None)),
        _reshard.Layout(8, (8,), ("x",), ("x", None)),
        _reshard.Layout(8, (2, 4), ("x", "y"), ("y", "x")),
        _reshard.Layout(8, (8,), ("x",), ()),
    ):
        sharding = layout.sharding(jax.devices())
        # Replicated: 8 devices hold one region, needed once.
        assert _reshard.needed_bytes(SHAPE, sharding) == ARRAY_BYTES, layout


def test_needed_regions_are_the_distinct_device_regions():
    sharding = _reshard.Layout(8, (2, 4), ("x", "y"), ("y", "x")).sharding(jax.devices())
    regions = _reshard.needed_regions(SHAPE, sharding)
    # P('y', 'x') on a 2 x 4 mesh: rows in 4 blocks (y), columns in 2 (x).
    assert len(regions) == 8
    assert regions[0] == ((0, 16), (0, 512)) and regions[-1] == ((48, 64), (512, 1024))
    assert {_reshard.region_bytes(r) for r in regions} == {ARRAY_BYTES // 8}
    replicated = _reshard.Layout(8, (8,), ("x",), ()).sharding(jax.devices())
    assert _reshard.needed_regions(SHAPE, replicated) == [((0, 64), (0, 1024))]


def test_values_are_a_function_of_the_global_index():
    whole = _reshard.values(1, ((0, 64), (0, 1024)))
    part = _reshard.values(1, ((16, 32), (512, 1024)))
    np.testing.assert_array_equal(whole[16:32, 512:], part)
    assert not np.array_equal(whole, _reshard.values(2, ((0, 64), (0, 1024))))
    assert whole.max() < 2**24  # exact in float32
    assert len(np.unique(whole.astype(np.float32))) == whole.size


def test_layouts_and_directions_are_consistent():
    with pytest.raises(ValueError, match="does not hold 8 devices"):
        _reshard.Layout(8, (2, 2), ("x", "y"), ("x",))
    for d in _reshard.DIRECTIONS:
        assert _reshard.rows_for(1) % d.save.devices == 0
        if d.multiprocess:
            assert d.devices_per_process(saving=True) * d.save_processes == d.save.devices
            assert d.devices_per_process(saving=False) * d.restore_processes == d.target.devices
            assert len(d.restart_nodes) == d.restore_processes
        else:
            assert max(d.save.devices, d.target.devices) <= _reshard.ONE_PROCESS_DEVICES


def _result(direction: str, process: int, read: dict, needed: int, seconds: float) -> dict:
    d = _reshard.BY_NAME[direction]
    tier = {"seconds": [seconds], "floor_s": [seconds / 2], "bytes_by_tier": [read]}
    return {
        "direction": direction,
        "process": process,
        "needed_bytes": needed,
        "tiers": {t: {**tier, "verified": True} for t in d.tiers},
        "orbax": {"seconds": [seconds * 4], "verified": True},
    }


def test_figures_take_the_busiest_process_and_count_every_tier_read():
    results = [
        _result("rows_to_columns", 0, {"memory": 100, "peer": 100}, 100, 0.2),
        _result("rows_to_columns", 1, {"memory": 100}, 100, 0.3),
        _result("finer_2_8", 0, {"memory": 400}, 400, 0.1),
    ]
    figs = {f.id: f for f in _reshard.figures(results)}
    assert set(figs) == {
        f"r.{d}.{t}.{k}"
        for d in ("rows_to_columns", "finer_2_8")
        for t in ("memory", "persistent")
        for k in ("bytes", "floor", "orbax")
    }
    assert figs["r.rows_to_columns.memory.bytes"].ratio == 2.0
    assert figs["r.rows_to_columns.memory.bytes"].met is False
    assert figs["r.rows_to_columns.memory.floor"].value == 0.3
    assert math.isclose(figs["r.rows_to_columns.memory.floor"].baseline, 0.15)
    assert figs["r.finer_2_8.memory.floor"].target == "<= 2"
    assert figs["r.finer_2_8.persistent.orbax"].target == "<= 0.5"
    assert figs["r.finer_2_8.persistent.orbax"].ratio == 0.25
    table = _reshard.per_process_table(results)
    assert "memory+peer" in table and "2.00" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["--directions", "sideways"],
        ["--directions", ""],
        ["--state-mib", "0"],
        ["--repeats", "0"],
        ["--tile-kib", "-1"],
        ["--timeout", "-1"],
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--reshard", *argv])
    assert e.value.code == 2
    assert "jaxckpt bench --reshard: error" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_quick_run_reports_every_direction_with_verified_restores(tmp_path, capsys):
    path = tmp_path / "reshard.json"
    argv = ["--reshard", "--quick", "--state-mib", "1", "--json", str(path)]
    argv += ["--memory-root", str(tmp_path / "memory"), "--work-dir", str(tmp_path / "work")]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(path.read_text())

    figures = {f["id"]: f for f in report["figures"]}
    for d in _reshard.DIRECTIONS:
        for tier in d.tiers:
            for kind in ("bytes", "floor", "orbax"):
                f = figures[f"r.{d.name}.{tier}.{kind}"]
                assert f["value"] > 0 and f["baseline"] > 0, f
                assert math.isclose(f["ratio"], f["value"] / f["baseline"]), f
                assert f["id"] in printed
    results = report["results"]
    for d in _reshard.DIRECTIONS:
        procs = [r for r in results if r["direction"] == d.name]
        assert sorted(r["process"] for r in procs) == list(range(d.restore_processes)), d
        for r in procs:
            assert r["orbax"]["verified"] is True, r
            for tier in d.tiers:
                t = r["tiers"][tier]
                assert t["verified"] is True, (d.name, tier, r)
                assert len(t["seconds"]) == len(t["floor_s"]) == len(t["bytes_by_tier"]) == 1
                # Each restore came from the tier it was meant to.
                (sources,) = [set(b) for b in t["bytes_by_tier"]]
                if tier == "persistent":
                    assert sources == {"persistent"}, (d.name, r)
                else:
                    assert sources and "persistent" not in sources, (d.name, tier, r)
    # A process that lost its node reads its part from a peer.
    lost = next(r for r in results if r["direction"] == "procs_2_4" and r["process"] == 0)
    assert set(lost["tiers"]["peer"]["bytes_by_tier"][0]) == {"peer"}
    assert not (tmp_path / "memory").exists() and not (tmp_path / "work").exists()
