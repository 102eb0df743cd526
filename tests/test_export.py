"""`jaxckpt export` / `jaxckpt.export`: a durable step out as plain Orbax or safetensors,
read back without jaxckpt (in an interpreter where it cannot be imported), bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import fresh_iterator, manager, mesh_1d, run_python, save, sharded_state

import jaxckpt
from jaxckpt import cli

STEP = 4

# Reads an export with plain Orbax or safetensors; jaxckpt cannot even be imported.
READER = """
import sys, json, hashlib
sys.modules["jaxckpt"] = None
import numpy as np, jax

def digest(x):
    x = np.asarray(x)
    return [x.dtype.name, list(x.shape), hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()]

def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in flat(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: digest(tree)}

fmt, out, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
if fmt == "orbax":
    import orbax.checkpoint as ocp
    tree = ocp.StandardCheckpointer().restore(f"{out}/{step}/default")
    with ocp.CheckpointManager(out) as mngr:
        again = mngr.restore(step, args=ocp.args.StandardRestore())
    assert flat(again) == flat(tree)
    result = flat(tree)
else:
    import glob, os
    from safetensors.numpy import load_file
    result = {}
    for path in sorted(glob.glob(f"{out}/*.safetensors")):
        result.update({k: digest(v) for k, v in load_file(path).items()})
print("RESULT " + json.dumps(result))
"""


def read_without_jaxckpt(fmt: str, out: Path, step: int) -> dict:
    code = f"import sys\nsys.argv = ['reader', {fmt!r}, {str(out)!r}, '{step}']\n" + READER
    text = run_python(code)
    (line,) = [x for x in text.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def digest(x) -> list:
    x = np.asarray(x)
    return [
        x.dtype.name,
        list(x.shape),
        hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest(),
    ]


def expected_digests(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        if name in ("name", "data"):
            continue  # a str scalar and an iterator: not exported
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[name] = digest(value)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(str(base / "memory"), persist_every=2)
    )
    state = {**sharded_state(mesh_1d(), seed=3), "data": fresh_iterator()}
    with manager(base / "ckpt", handler) as mngr:
        for step in (STEP, STEP + 1):  # step 5 lives in memory only
            save(mngr, step, state)
        mngr.wait_until_finished()
        handler.wait_for_persistence()
    return base / "ckpt", state


def test_orbax_export_reads_back_bit_for_bit_without_jaxckpt(saved, tmp_path):
    ckpt, state = saved
    calls = []
    done = jaxckpt.export(ckpt, STEP, tmp_path / "out", on_progress=lambda *a: calls.append(a))
    assert set(done.skipped) == {"['data']", "['name']"}
    assert "iterator" in done.skipped["['data']"] and "str" in done.skipped["['name']"]
    assert done.key_impls == {"keys": "threefry2x32"}
    assert done.files == (tmp_path / "out" / str(STEP) / "default",)
    # Progress after every leaf, ending at every leaf and every byte.
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1))
    assert calls[-1][0] == calls[-1][1] and calls[-1][2] == calls[-1][3] == done.bytes > 0

    got = read_without_jaxckpt("orbax", tmp_path / "out", STEP)
    assert got == expected_digests(state)


def test_safetensors_export_shards_by_size_with_an_index(saved, tmp_path):
    ckpt, state = saved
    out = tmp_path / "st"
    done = jaxckpt.export(ckpt, STEP, out, format="safetensors", max_shard_bytes=100)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(done.leaves)
    assert index["metadata"]["total_size"] == done.bytes + sum(
        np.asarray(state[k]).nbytes for k in ("step", "scale")
    )
    # No shard over the cap but one holding a single larger leaf.
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    from safetensors import safe_open

    for shard, names in by_shard.items():
        with safe_open(out / shard, "np") as f:
            assert sorted(f.keys()) == sorted(names)
            size = sum(f.get_tensor(n).nbytes for n in names)
            assert size <= 100 or len(names) == 1
            assert json.loads(f.metadata()["jaxckpt_key_impls"]).get("keys", "threefry2x32") == (
                "threefry2x32"
            )

    got = read_without_jaxckpt("safetensors", out, STEP)
    want = expected_digests(state)
    want["step"] = digest(np.asarray(state["step"]))  # 0-d int64
    want["scale"] = digest(state["scale"])  # 0-d float32, its saved dtype
    assert got == want


def test_one_safetensors_file_when_it_fits(saved, tmp_path):
    done = jaxckpt.export(saved[0], STEP, tmp_path / "one", format="safetensors")
    assert [p.name for p in done.files] == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()


def test_refuses_a_step_that_is_not_durable_and_a_used_output(saved, tmp_path):
    ckpt, _ = saved
    with pytest.raises(FileNotFoundError, match=r"step 5 is not durable.*process\(es\) \[0\]"):
        jaxckpt.export(ckpt, STEP + 1, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"step 9 of item 'train' is not in"):
        jaxckpt.export(ckpt, 9, tmp_path / "x", item="train")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        jaxckpt.export(ckpt, STEP, tmp_path / "used")
    with pytest.raises(ValueError, match="format must be one of"):
        jaxckpt.export(ckpt, STEP, tmp_path / "y", format="npz")


def test_a_damaged_chunk_fails_the_export_naming_it(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    part = ckpt / str(STEP) / "train" / "part_00000" / "arrays" / "w" / "c"
    chunk = sorted(p for p in part.rglob("*") if p.is_file())[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    # tensorstore's own crc32c codec finds it first; the error says which chunk it is.
    with pytest.raises(
        ValueError, match=r"chunk \(0, 0\) of \['w'\] in process 0's part of step 4"
    ):
        jaxckpt.export(ckpt, STEP, tmp_path / "out")


def test_cli_export_with_progress_and_json(saved, tmp_path, capsys):
    ckpt, _ = saved
    out = tmp_path / "cli"
    code = cli.main(["export", str(ckpt), str(STEP), str(out), "--format", "safetensors", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["format"] == "safetensors" and report["files"] == [str(out / "model.safetensors")]
    assert "['data']" in report["skipped"] and "leaves" in captured.err  # the progress bar
    code = cli.main(["export", str(ckpt), str(STEP), str(tmp_path / "o"), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0 and f"exported step {STEP} as orbax" in text
    assert "skipped ['data']" in text and "impl='threefry2x32'" in text
    code = cli.main(["export", str(ckpt), str(STEP + 1), str(tmp_path / "z"), "--no-progress"])
    assert code == 2 and "not durable" in capsys.readouterr().err


# ---- a sharded multi-process state ----------------------------------------------------

ROWS = 48  # tests/workers/mp_worker.py's state, a pure function of the step


def mp_expected(step: int) -> dict:
    return {
        "w": np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8) + 1000 * step,
        "b": np.full((ROWS,), step, dtype=jax.numpy.bfloat16),
        "keys": np.stack(
            [np.arange(ROWS, dtype=np.uint32) + step, np.arange(ROWS, dtype=np.uint32)], axis=1
        ),
    }


@pytest.mark.multiprocess
@pytest.mark.slow
def test_export_of_a_sharded_two_process_step(tmp_path):
    from multiproc import run

    from jaxckpt.persistent._index import read_index

    ckpt = tmp_path / "ckpt"
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    run(
        "save",
        roots,
        ["node0", "node1"],
        {"ckpt": str(ckpt), "replicas": 0, "steps": [2], "persist_every": 2},
    )
    index = read_index(ckpt / "2" / "train")[1]
    assert index.process_count == 2 and index.chunks  # process 1 owns part of the state
    want = {k: digest(v) for k, v in mp_expected(2).items()}

    orbax = jaxckpt.export(ckpt, 2, tmp_path / "orbax")
    assert set(orbax.skipped) == {"['data']"}
    got = read_without_jaxckpt("orbax", tmp_path / "orbax", 2)
    assert got.pop("step")[1] == []
    assert got == want

    jaxckpt.export(ckpt, 2, tmp_path / "st", format="safetensors", max_shard_bytes=1024)
    got = read_without_jaxckpt("safetensors", tmp_path / "st", 2)
    assert got.pop("step") == digest(np.asarray(2))
    assert got == want


# ---- from an object store -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_export_from_an_object_store(kind, tmp_path, memory_root, monkeypatch):
    from object_stores import reset_clients, running
    from test_tools_object_stores import save_steps

    with running(kind, tmp_path) as emulator:
        for key, value in emulator.env().items():
            monkeypatch.setenv(key, value)
        reset_clients()
        url = emulator.url("run")
        save_steps(url, memory_root)  # steps 1-3 of sharded_state(mesh_1d()); step 2 durable
        reset_clients()
        jaxckpt.export(url, 2, tmp_path / "orbax")
        jaxckpt.export(url, 2, tmp_path / "st", format="safetensors")
    reset_clients()
    want = expected_digests(sharded_state(mesh_1d()))
    assert read_without_jaxckpt("orbax", tmp_path / "orbax", 2) == want
    want["step"] = digest(np.asarray(7))
    want["scale"] = digest(np.float32(0.5))
    assert read_without_jaxckpt("safetensors", tmp_path / "st", 2) == want
