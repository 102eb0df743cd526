"""`jaxckpt bench`: the report's shape and the figure arithmetic (no timing assertions)."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
from object_stores import running

from jaxckpt.bench import _figure as _bench_figure
from jaxckpt.bench import _run as bench
from jaxckpt.bench import _state as _bench_state

FIGURE_IDS = {
    "1a",
    "1b",
    "1c",
    "1d",
    "1e",
    "1f",
    "2a",
    "2b",
    "2c",
    "2d",
    "3a",
    "3b",
    "3c",
    "4a",
    "4b",
    "4c",
    "4d",
    "4e",
    "5a",
    "5b",
    "5c",
    "5d",
    "5e",
    "6a",
    "6b",
    "6c",
    "6d",
    "8a",
    "8b",
    *("9a", "9b", "9c", "9d", "9e", "9f"),  # the accelerator-host proxy
    # one process saving every step; a save's cost; beside a hot spare
    *("10a", "10b", "10c", "10d", "10e", "10f"),
}
SOLO_IDS = {"10a", "10b", "10c", "10d", "10e", "10f"}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_ratio_and_target():
    assert _bench_figure.Figure("x", "n", 2.0, "s", 4.0, "b", "<= 0.6").met is True
    f = _bench_figure.Figure("x", "n", 3.0, "s", 4.0, "b", ">= 0.8")
    assert f.ratio == 0.75 and f.met is False
    missing = _bench_figure.Figure("x", "n", None, "s", 4.0, "b", ">= 0.8")
    assert missing.ratio is None and missing.met is None

    met = _bench_figure.Figure("y", "a name", 0.5, "MB/s", 1.0, "raw op", ">= 0.4")
    plain = _bench_figure.Figure("z", "no target", 0.0123, "s", 0.5, "raw op")
    header, *rows = _bench_figure.table([missing, met, plain]).splitlines()
    # Columns are two or more spaces apart; seconds are in human units.
    cells = [re.split(r"\s{2,}", row) for row in rows]
    assert re.split(r"\s{2,}", header) == [
        "#",
        "figure",
        "value",
        "baseline",
        "baseline is",
        "ratio",
        "target",
        "met",
    ]
    assert cells == [
        ["x", "n", "-", "4.00 s", "b", "-", ">= 0.8", "-"],
        ["y", "a name", "0.5 MB/s", "1 MB/s", "raw op", "0.5", ">= 0.4", "yes"],
        ["z", "no target", "12.3 ms", "500.0 ms", "raw op", "0.0246"],
    ]


def test_state_shape_follows_the_requested_size():
    small = _bench_state.shape_for(1 / 16, devices=4, batch_per_device=16)
    big = _bench_state.shape_for(2.0, devices=4, batch_per_device=16)
    assert small.width % 4 == 0 and big.width == 4096 and big.batch == 64
    for shape, gib in ((small, 1 / 16), (big, 2.0)):
        assert 0.7 < shape.state_bytes / (gib * 2**30) < 1.3


@pytest.mark.parametrize(
    "argv",
    [
        ["--processes", "0"],
        ["--replicas", "2"],
        ["--state-gib", "-1"],
        ["--steps", "2"],
        ["--store-only"],  # without a store
        ["--store-url", "/tmp/not-an-object-store"],
        ["--store-url", "s3://b/run", "--store-emulator", "s3"],
        ["--many-leaves", "-1"],
        ["--many-leaf-kib", "0"],
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert "jaxckpt bench: error" in capsys.readouterr().err


# Smaller than --quick: the test checks that every figure is measured and reported, not
# the figures themselves.
_SMALL = {
    "state-gib": 1 / 32,
    "steps": 5,
    "warmup": 2,
    "repeats": 2,
    "proxy-state-gib": 1 / 64,
    "proxy-batch": 32,
    "many-leaves": 200,
    "prefault-gib": 0.25,
    "solo-state-gib": 1 / 64,
    "solo-rounds": 1,
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_quick_run_reports_every_figure(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--quick", "--json", str(path), "--memory-root", str(tmp_path / "memory")]
    argv += [f"--{flag}={value}" for flag, value in _SMALL.items()]
    assert bench.main([*argv, "--work-dir", str(tmp_path / "work")]) == 0
    printed = capsys.readouterr().out
    report = json.loads(path.read_text())

    assert report["format_version"] == bench.FORMAT_VERSION
    machine = report["machine"]
    assert _number(machine["cpu_count"]) and _number(machine["ram_bytes"])
    assert all(machine["versions"][p] for p in ("jax", "orbax-checkpoint", "tensorstore"))
    assert isinstance(machine["date"], str)
    assert report["config"]["processes"] == 2 and report["config"]["replicas"] == 1

    figures = {f["id"]: f for f in report["figures"]}
    assert set(figures) == FIGURE_IDS
    for f in figures.values():
        assert _number(f["value"]) and f["value"] >= 0, f
        assert _number(f["baseline"]) and f["baseline"] > 0, f
        assert _number(f["ratio"]) and math.isclose(f["ratio"], f["value"] / f["baseline"]), f
        assert isinstance(f["name"], str) and isinstance(f["unit"], str)
        assert f["met"] is None if f["target"] is None else isinstance(f["met"], bool), f
        assert re.search(rf"^{f['id']}  +{re.escape(f['name'])}  ", printed, re.M), f

    # Every restore came from the tier it was meant to, and restored the saved values.
    for process in report["processes"]:
        restores = process["restores"]
        assert {k: r["tier"] for k, r in restores.items()} == {
            "memory": "memory",
            "memory_mesh_change": "memory",
            "peer": "peer",
            "persistent": "persistent",
            "orbax": "persistent",
            "orbax_mesh_change": "persistent",
        }
        assert all(r["verified"] for r in restores.values()), restores
    _check_new_baselines(report, figures)
    _check_many_leaves(report, figures)
    _check_floor_memory_and_proxy(report, figures)
    _check_solo(report, figures)
    assert not (tmp_path / "memory").exists() and not (tmp_path / "work").exists()


def _check_new_baselines(report, figures):
    """4a: the memory tier's write of saves that reused a retired slab, against a memcpy
    into a pre-faulted tmpfs file of the same bytes; 5a's target is 3x faster than Orbax."""
    procs = report["processes"]
    for p in procs:
        copies = p["raw"]["prefaulted_copy"]
        assert len(copies) == report["config"]["repeats"]
        assert all(_number(c) and c > 0 for c in copies)
        for save in p["saves"]:
            assert isinstance(save["slab_reused"], bool)
            # Committed (the part's directory renamed into place) after its manifest
            # was built, and before the save finished.
            assert 0 < save["manifest_s"] <= save["to_memory_s"] + 0.01, save
        assert not p["saves"][0]["slab_reused"]  # the first save has no retired slab
    value = min(
        statistics.median(
            [
                s["memory_write_bytes_per_s"]
                for s in p["saves"]
                if not s["warmup"] and s["slab_reused"]
            ]
        )
        for p in procs
    )
    baseline = min(p["own_bytes"] / statistics.median(p["raw"]["prefaulted_copy"]) for p in procs)
    assert math.isclose(figures["4a"]["value"], value / 1e6)
    # 1c: the no-save step plus a save's raw work: copy and checksum the own bytes, send
    # and receive a replica over loopback and checksum it (r = 1).
    config = report["config"]
    assert config["replicas"] == 1
    warmup = config["warmup"]

    def floor(p):
        loops, med = p["loops"], lambda k: statistics.median(p["raw"][k])
        steps = loops["train"]["step_s"][warmup:] + loops["train_again"]["step_s"][warmup:]
        work = med("prefaulted_copy") + 2 * med("checksum") + med("socket")
        return statistics.median(steps) + work

    assert math.isclose(figures["1c"]["value"], max(floor(p) for p in procs))
    assert figures["1c"]["baseline"] == figures["1a"]["baseline"]
    assert figures["1c"]["value"] > figures["1c"]["baseline"]
    assert math.isclose(figures["4a"]["baseline"], baseline / 1e6)
    assert figures["4a"]["target"] == ">= 0.8"
    assert figures["5a"]["target"] == figures["5b"]["target"] == "<= 0.33"
    # 5e: a peer restore against its floor, a restore from memory plus the raw transfer.
    assert figures["5e"]["value"] == figures["5b"]["value"]
    assert math.isclose(
        figures["5e"]["baseline"],
        figures["5a"]["value"] + max(statistics.median(p["raw"]["socket"]) for p in procs),
    )
    assert figures["5a"]["baseline"] == figures["5b"]["baseline"]


def _check_floor_memory_and_proxy(report, figures):
    """1d, the overlapped floor, sets 1a's target; 6b is the peak against (memory_keep + 1)
    (1 + r) copies; the proxy confines the step to one CPU and its saves to the others."""
    warmup = report["config"]["warmup"]
    assert figures["1a"]["target"] == f"<= {figures['1d']['ratio'] + 0.05:.3f}"
    assert figures["1d"]["baseline"] == figures["1a"]["baseline"]
    assert figures["1e"]["target"] == figures["1a"]["target"]
    assert figures["1f"]["value"] == figures["1a"]["value"]
    assert figures["1f"]["target"] == "<= 1.03"
    for p in report["processes"]:
        assert len(p["loops"]["floor"]["step_s"]) == report["config"]["steps"]
        assert len(p["loops"]["jaxckpt_hold"]["step_s"]) == report["config"]["steps"]
        assert len(p["loops"]["jaxckpt_uncounted"]["step_s"]) == report["config"]["steps"]
        assert p["memory"]["memory_keep"] == 1
        assert p["memory"]["hold_jaxckpt_combined_peak"] > 0
    assert figures["6b"]["baseline"] == 2 * 2 and figures["6b"]["target"] == "<= 1.05"
    assert figures["6d"]["baseline"] == figures["6b"]["baseline"]
    proxy = report["proxy"]["proxy"]
    confined = proxy["confined"]
    assert confined["device_cpu"] not in confined["host_cpus"] and confined["device_threads"] > 0
    loops = proxy["loops"]
    assert set(loops) == {"train", "jaxckpt", "jaxckpt_hold", "floor", "orbax", "train_again"}
    steps = loops["train"]["step_s"][warmup:] + loops["train_again"]["step_s"][warmup:]
    assert math.isclose(figures["9a"]["baseline"], statistics.median(steps))
    assert math.isclose(
        figures["9a"]["value"], statistics.median(loops["jaxckpt_hold"]["step_s"][warmup:])
    )
    assert figures["9a"]["target"] == "<= 1.03"
    assert report["proxy"]["shape"]["batch"] == _SMALL["proxy-batch"]
    assert report["proxy"]["devices"] == 1


def _check_many_leaves(report, figures):
    """8a/8b: the many-leaf tree, jaxckpt against Orbax, from the same raw timings."""
    config, procs = report["config"], report["processes"]
    count = _SMALL["many-leaves"]
    assert config["many_leaves"] == count and config["many_leaf_bytes"] == 16 * 1024
    for p in procs:
        many = p["many_leaves"]
        assert many["leaves"] == count and many["bytes"] == count * 16 * 1024
        # Each process owns its shards of every leaf: half the bytes with 2 processes.
        assert many["own_bytes"] * len(procs) == many["bytes"]
        for kind in ("saves", "orbax_saves"):
            assert [s["warmup"] for s in many[kind]] == [True] + [False] * config["repeats"]
            assert all(_number(s["done_s"]) and s["done_s"] > 0 for s in many[kind])
        for save in many["saves"]:
            assert 0 < save["to_memory_s"] < save["done_s"] + 0.01, save
        restores = many["restores"]
        assert {k: {r["tier"] for r in rs} for k, rs in restores.items()} == {
            "memory": {"memory"},
            "orbax": {"persistent"},
        }
        assert all(r["verified"] for rs in restores.values() for r in rs), restores
        assert all(len(rs) == config["repeats"] for rs in restores.values())

    def worst(get):
        return max(get(p["many_leaves"]) for p in procs)

    def measured(records, key):
        return statistics.median([r[key] for r in records if not r["warmup"]])

    assert math.isclose(
        figures["8a"]["value"], worst(lambda m: measured(m["saves"], "to_memory_s"))
    )
    assert math.isclose(
        figures["8a"]["baseline"], worst(lambda m: measured(m["orbax_saves"], "done_s"))
    )
    for source, key in (("memory", "value"), ("orbax", "baseline")):
        assert math.isclose(
            figures["8b"][key],
            worst(lambda m, s=source: statistics.median([r["seconds"] for r in m["restores"][s]])),
        )
    assert figures["8a"]["target"] == "<= 0.25" and figures["8b"]["target"] == "<= 0.2"
    assert figures["8a"]["name"].startswith(f"{count}-leaf tree")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["s3 --store-url", "gcs --store-emulator"])
def test_object_store_phase_reports_real_throughputs(mode, tmp_path, monkeypatch, capsys):
    """The object-store phase alone, against each emulator: once as a user's bucket
    (--store-url, the emulator started here and reached through the environment),
    once with the emulator the benchmark starts itself."""
    kind, option = mode.split()
    path = tmp_path / "bench.json"
    argv = ["--store-only", "--processes", "1", "--state-gib", "0.02", "--repeats", "2"]
    argv += ["--prefault-gib", "0", "--json", str(path), "--memory-root", str(tmp_path / "m")]
    argv += ["--work-dir", str(tmp_path / "work")]
    if option == "--store-emulator":
        assert bench.main([*argv, "--store-emulator", kind]) == 0
    else:
        with running(kind, tmp_path) as emulator:
            for key, value in emulator.env().items():
                monkeypatch.setenv(key, value)
            assert bench.main([*argv, "--store-url", emulator.url("runs")]) == 0
            left = _objects(emulator)
        # Every object the run wrote under its own prefix is deleted again.
        assert not [k for k in left if k.startswith("runs/jaxckpt-bench-")], left
    printed = capsys.readouterr().out
    report = json.loads(path.read_text())

    figures = {f["id"]: f for f in report["figures"]}
    assert set(figures) == {"7a", "7b", "7c"}  # --store-only: no other phase ran
    for f in figures.values():
        assert _number(f["value"]) and f["value"] > 0, f
        assert _number(f["baseline"]) and f["baseline"] > 0, f
        assert math.isclose(f["ratio"], f["value"] / f["baseline"]), f
        assert re.search(rf"^{f['id']}  +{re.escape(f['name'])}  ", printed, re.M), f
    assert figures["7a"]["baseline"] == figures["7b"]["baseline"]
    assert isinstance(figures["7a"]["met"], bool) and figures["7b"]["met"] is None
    assert 0 < figures["7c"]["ratio"] < 1  # a share of the time from save() until persisted

    (process,) = report["processes"]
    store = process["object_store"]
    assert store["url"].startswith(f"{'gs' if kind == 'gcs' else 's3'}://")
    # Both sides wrote this process's own shards, i.e. the whole state (one process):
    # params and adam's moments, plus adam's int32 step count.
    assert store["bytes"] == process["own_bytes"] == report["state"]["state_bytes"] + 4
    assert store["chunks"] >= store["arrays"] > 0
    for kind_ in ("saves", "baseline"):
        records = store[kind_]
        assert [r["warmup"] for r in records] == [True, False, False]
        for r in records:
            assert r["bytes"] == store["bytes"]
            assert _number(r["seconds"]) and r["seconds"] > 0
            assert math.isclose(r["bytes_per_s"], r["bytes"] / r["seconds"])
    for save in store["saves"]:
        # The upload is part of the time from save() until persisted, and follows the
        # commit in memory.
        assert 0 < save["safe_in_memory_s"] < save["seconds"]
        assert 0 < save["persist_s"] < save["seconds"]
        assert math.isclose(save["outside_upload_s"], save["seconds"] - save["persist_s"])
        assert math.isclose(save["persist_bytes_per_s"], save["bytes"] / save["persist_s"])
    # Figures are the medians of the measured (not warm-up) repeats.
    measured = [r["bytes_per_s"] for r in store["saves"] if not r["warmup"]]
    assert math.isclose(figures["7a"]["value"] * 1e6, sum(measured) / 2)


def _objects(emulator) -> list[str]:
    """Every object name in the emulator's bucket (one listing, over plain HTTP)."""
    import urllib.request
    import xml.etree.ElementTree as ET

    if emulator.kind == "gcs":
        url = f"{emulator.endpoint}/storage/v1/b/{emulator.bucket}/o"
        with urllib.request.urlopen(url, timeout=10) as r:
            return [item["name"] for item in json.loads(r.read()).get("items", [])]
    with urllib.request.urlopen(
        f"{emulator.endpoint}/{emulator.bucket}?list-type=2", timeout=10
    ) as r:
        root = ET.fromstring(r.read())
    return [e.text or "" for e in root.iter() if e.tag.endswith("}Key")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_process_figures_are_produced(tmp_path, capsys):
    """`--solo only`: one process, a small state saved every step (10a-c, each loop against
    the same loop without saving, 10a's target the floor's ratio + 0.05) and the fixed cost
    of a 1 MiB save against Orbax's manager saving a trivial item (10d: that + 2 ms)."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--solo", "only", "--json", str(path), "--steps", "4", "--warmup", "1"]
    argv += ["--solo-state-gib", str(1 / 64), "--solo-rounds", "2", "--prefault-gib", "0"]
    argv += ["--memory-root", str(tmp_path / "memory"), "--work-dir", str(tmp_path / "work")]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(path.read_text())
    figures = {f["id"]: f for f in report["figures"]}
    assert set(figures) == SOLO_IDS
    assert report["processes"] == [] and report["proxy"] is None
    for f in figures.values():
        assert _number(f["value"]) and _number(f["baseline"]) and f["baseline"] > 0, f
        assert re.search(rf"^{f['id']}  +{re.escape(f['name'])}  ", printed, re.M), f
    _check_solo(report, figures)
    assert len(report["solo"]["solo"]["rounds"]) == 2
    assert not (tmp_path / "memory").exists() and not (tmp_path / "work").exists()


SPARE_LOOPS = {"beside_spare", "spare_stopped"}  # 10f's blocks, twice a loop's steps a side


def _check_solo(report, figures):
    """10a-f from the one process's raw timings: medians over every round's measured steps
    (or saves), targets derived from the baselines measured in the same run; the stand-in
    spare of 10f ran beside its loop."""
    solo, warmup = report["solo"], report["config"]["warmup"]
    assert solo["devices"] >= 1 and solo["processes"] == 1
    raw = solo["solo"]
    rounds = raw["rounds"]
    assert raw["tiny_bytes"] == 1 << 20
    for r in rounds:
        assert set(r["loops"]) == {
            "train",
            "beside_spare",
            "spare_stopped",
            "floor",
            "jaxckpt",
            "jaxckpt_hold",
            "orbax",
            "train_again",
        }
        per_loop = report["config"]["steps"]
        assert all(
            len(loop["step_s"]) == (2 * per_loop if name in SPARE_LOOPS else per_loop)
            for name, loop in r["loops"].items()
        )
        # The stand-in ran, capped, through every block of the loop beside it (what CPU an
        # idle-class process gets depends on the machine's load: none at all beside a busy
        # neighbour), and no more than about the launcher's cap of it. Its seconds are
        # rounded to the millisecond: at most half of one below.
        beside = sum(r["loops"]["beside_spare"]["step_s"])
        assert _number(r["spare"]["cpu_s"]), r["spare"]
        assert r["spare"]["seconds"] >= beside - 0.0005, (r["spare"], beside)
        assert r["spare"]["cpu_s"] <= 0.25 * r["spare"]["seconds"] + 0.05, r["spare"]
        assert set(r["fixed_s"]) == {"jaxckpt", "orbax_trivial"}
        assert all(len(ts) > raw["warmup_saves"] for ts in r["fixed_s"].values())

    def steps(*names):
        return statistics.median(
            [s for r in rounds for n in names for s in r["loops"][n]["step_s"][warmup:]]
        )

    def fixed(name):
        return statistics.median(
            [t for r in rounds for t in r["fixed_s"][name][raw["warmup_saves"] :]]
        )

    train = steps("train", "train_again")
    for fid, loop in (
        ("10a", "jaxckpt"),
        ("10b", "floor"),
        ("10c", "orbax"),
        ("10e", "jaxckpt_hold"),
    ):
        assert math.isclose(figures[fid]["value"], steps(loop))
        assert math.isclose(figures[fid]["baseline"], train)
    assert math.isclose(figures["10f"]["value"], steps("beside_spare"))
    assert math.isclose(figures["10f"]["baseline"], steps("spare_stopped"))
    assert figures["10a"]["target"] == f"<= {figures['10b']['ratio'] + 0.05:.3f}"
    assert figures["10e"]["target"] == figures["10a"]["target"]
    assert figures["10f"]["target"] == "<= 1.02"
    assert math.isclose(figures["10d"]["value"], fixed("jaxckpt"))
    trivial = fixed("orbax_trivial")
    assert math.isclose(figures["10d"]["baseline"], trivial)
    assert figures["10d"]["target"] == f"<= {(trivial + 0.002) / trivial:.3f}"
