"""`jaxckpt ls`, `inspect` and `verify` on a checkpoint directory on an object store.

The steps are saved and persisted by a CheckpointManager on a local emulator
(tests/support/object_stores.py) of GCS or S3, then read back by the command line, as
an operator would from a machine that has only the bucket.
"""

from __future__ import annotations

import json
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
import test_object_stores
from helpers import mesh_1d, save, sharded_state
from object_stores import reset_clients, running

import jaxckpt
from jaxckpt import cli
from jaxckpt.format import _chunking, _format
from jaxckpt.persistent import _index, _object_store, _step_dirs, _storage, _zarr, _zarr_reader

pytestmark = pytest.mark.slow

store_env = test_object_stores.store_env  # the fixture: an emulator's environment, per test

STEPS = (1, 2, 3)  # persist_every=2 persists step 2; memory_keep=2 keeps steps 2 and 3


def jaxckpt_cli(capsys, *argv) -> tuple[int, str, str]:
    # A `jaxckpt` command is a fresh process: no listing cached by the saves above.
    reset_clients()
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def as_json(capsys, *argv) -> dict:
    code, out, err = jaxckpt_cli(capsys, *argv, "--json")
    assert code in (0, 1, 3), err
    return json.loads(out)


def save_steps(url: str, memory_root: str) -> None:
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2, memory_keep=2)
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("train", jaxckpt.TieredSave, h)
    registry.add("train", jaxckpt.TieredRestore, h)
    opts = jaxckpt.manager_options(url, enable_async_checkpointing=False)
    with ocp.CheckpointManager(url, handler_registry=registry, options=opts) as mngr:
        for step in STEPS:
            save(mngr, step, sharded_state(mesh_1d()))
        mngr.wait_until_finished()
        h.wait_for_persistence()


def persisted_array(url: str, step: int, path: str) -> tuple[dict, _format.LeafRecord]:
    """The kvstore spec of a leaf's persisted zarr3 array on the store, and its record."""
    item_dir = _storage.as_path(f"{url}/{step}/train")
    record = next(r for r in _index.read_index(item_dir)[0].leaves if r.path == path)
    part = _storage.kvstore(item_dir / _format.part_dir_name(0))
    return _zarr.array_kvstore(part, record), record


def rewrite_first_chunk(url: str, step: int, path: str) -> None:
    """Other values in chunk (0, ...) of a leaf, written through zarr: every check of the
    store and of the codecs passes, only the CRC-32 in the index manifest can tell."""
    spec, record = persisted_array(url, step, path)
    assert record.stored_shape is not None and record.chunk_shape is not None
    array = _zarr.open_array(spec).result()
    ndim = len(record.stored_shape)
    region = _chunking.chunk_region((0,) * ndim, record.stored_shape, record.chunk_shape)
    array[region].write(np.asarray(array[region].read().result()) + 1).result()


def flip_byte_of_first_chunk(url: str, step: int, path: str) -> None:
    """One byte of the object of chunk (0, ...) of a leaf flipped (rot on the store)."""
    spec, record = persisted_array(url, step, path)
    assert record.stored_shape is not None
    store = ts.KvStore.open(spec).result()
    key = "c/" + "/".join(["0"] * len(record.stored_shape))
    data = bytearray(store.read(key).result().value)
    data[len(data) // 2] ^= 0x10
    store.write(key, bytes(data)).result()


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_ls_inspect_verify_on_an_object_store(kind, tmp_path, memory_root, store_env, capsys):
    with running(kind, tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        save_steps(url, memory_root)

        # ---- ls: every step, where it lives; nothing local is needed
        report = as_json(capsys, "ls", url)
        assert report["directory"] == url and report["remote"] and report["item"] == "train"
        steps = {s["step"]: s for s in report["steps"]}
        assert sorted(steps) == list(STEPS)
        assert steps[2]["durable"] and steps[2]["restorable_from"] == ["persistent"]
        assert steps[2]["item_dir"] == f"{url}/2/train"
        for step in (1, 3):  # finalized, not persisted, and no memory root given
            assert steps[step]["persisted"] == [] and steps[step]["missing"] == [0]
        assert all(s["bytes"] > 0 and s["process_count"] == 1 for s in steps.values())
        assert report["unfinalized"] == []
        code, text, _ = jaxckpt_cli(capsys, "ls", url)
        assert code == 0
        lines = {line.split()[0]: line for line in text.splitlines() if line[:4].strip().isdigit()}
        assert "1/1 durable" in lines["2"] and "yes: persistent" in lines["2"]
        assert "NO: part 0 has no copy in reach" in lines["3"]
        assert "only the persisted copies in the object store were looked for" in text

        # The host's memory root next to the bucket: steps 2 and 3 are in memory too.
        steps = {
            s["step"]: s for s in as_json(capsys, "ls", url, "--memory-root", memory_root)["steps"]
        }
        assert steps[2]["restorable_from"] == ["memory", "persistent"]
        assert steps[3]["restorable_from"] == ["memory"] and not steps[1]["restorable"]

        # ---- inspect: the saved tree, read from the store
        report = as_json(capsys, "inspect", url, 2)
        leaves = {leaf["path"]: leaf for leaf in report["leaves"]}
        w = leaves["['w']"]
        assert (w["shape"], w["dtype"], w["bytes"], w["chunks"]) == ([16, 6], "float32", 384, 8)
        assert w["sharding"]["spec"] == ["data"]
        assert leaves["['h']"]["dtype"] == "bfloat16" and leaves["['h']"]["shape"] == [8, 4]
        assert leaves["['keys']"]["dtype"] == "key<fry>"
        assert leaves["['step']"]["value"] == 7 and leaves["['name']"]["value"] == "run"
        assert report["format_version"] == _format.FORMAT_VERSION
        (proc,) = report["processes"]
        assert proc["metrics"]["persist_s"] > 0  # from the persisted part's manifest
        assert report["location"]["durable"] and report["memory_roots"] == []
        code, text, _ = jaxckpt_cli(capsys, "inspect", url, 2)
        assert code == 0 and f"step 2 of {url}" in text and "persistent: 1/1 durable" in text
        assert "in memory: not looked for" in text
        (w_line,) = [line for line in text.splitlines() if line.startswith("w ")]
        assert "(16, 6)" in w_line and "float32" in w_line and "P('data') data=8" in w_line

        # ---- verify: every chunk of the persisted copy read back from the store
        code, text, err = jaxckpt_cli(capsys, "verify", url, 2)
        assert code == 0, text
        assert "verify step 2" in err and "27/27 chunks" in err  # progress on stderr
        assert "1 good copy, 0 bad." in text
        assert "Not checked: the memory tiers (no --memory-root given: they are on " in text
        report = as_json(capsys, "verify", url, 2, "--no-progress")
        (copy,) = report["copies"]
        assert (copy["tier"], copy["location"], copy["chunks"], copy["ok"]) == (
            "persistent",
            url,
            27,
            True,
        )
        assert report["ok"] and report["parts_without_good_copy"] == []
        code, text, _ = jaxckpt_cli(capsys, "verify", url, 3, "--no-progress")
        assert code == 3 and "No good copy in reach of part(s) 0" in text  # never persisted
        code, text, _ = jaxckpt_cli(capsys, "verify", url, 2, "--memory-root", memory_root)
        assert code == 0 and "2 good copies, 0 bad." in text and "Not checked" not in text

        # ---- one chunk on the store damaged: verify names the step, the leaf, the chunk
        rewrite_first_chunk(url, 2, "['w']")
        code, text, _ = jaxckpt_cli(capsys, "verify", url, 2, "--no-progress")
        assert code == 1, text
        assert f"step 2 of {url}" in text
        assert f"part 0 (persistent, {url}): ['w'] chunk (0, 0): checksum mismatch" in text, text
        assert "0 good copies, 1 bad." in text
        report = as_json(capsys, "verify", url, 2, "--memory-root", memory_root, "--no-progress")
        bad = {c["tier"]: c["problems"] for c in report["copies"]}
        assert bad == {"memory": [], "persistent": ["['w'] chunk (0, 0): checksum mismatch"]}
        assert not report["ok"] and report["bad_copies"] == 1
        assert report["parts_without_good_copy"] == []  # the memory copy is good
        # A flipped byte in an object (caught by the arrays' crc32c codec): the same verdict.
        flip_byte_of_first_chunk(url, 2, "['b']")
        (copy,) = as_json(capsys, "verify", url, 2, "--no-progress")["copies"]
        assert copy["problems"] == [
            "['b'] chunk (0,): checksum mismatch",
            "['w'] chunk (0, 0): checksum mismatch",
        ]

        # ---- the part's manifest gone (an upload not finished): no copy, and said so
        part = _storage.as_path(f"{url}/2/train") / _format.part_dir_name(0)
        _storage.delete_objects(part, [_format.MANIFEST_FILE])
        code, text, _ = jaxckpt_cli(capsys, "ls", url)
        assert code == 0
        assert "step 2: part 0 in the object store not durable (upload not finished" in text
        code, text, _ = jaxckpt_cli(capsys, "verify", url, 2, "--no-progress")
        assert code == 3, text
        assert "No good copy in reach of part(s) 0" in text
        assert f"Not checked: part 0 in {url}/2/train (its upload has not finished" in text

        # ---- a step without its commit file is not finalized: not a step to restore
        _storage.delete_objects(_storage.as_path(f"{url}/3"), [_step_dirs.COMMIT_FILE])
        report = as_json(capsys, "ls", url)
        assert [s["step"] for s in report["steps"]] == [1, 2] and report["unfinalized"] == ["3"]
        code, text, _ = jaxckpt_cli(capsys, "ls", url)
        assert "save in progress or abandoned: 3" in text
        code, _, err = jaxckpt_cli(capsys, "inspect", url, 3)
        assert code == 2 and "Step 3" in err and "steps found: [1, 2]" in err


def test_errors_on_an_object_store(tmp_path, store_env, capsys):
    with running("s3", tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("nothing/here")
        code, _, err = jaxckpt_cli(capsys, "ls", url)
        assert code == 2 and f"Checkpoint directory {url} does not exist" in err  # the URL


def test_verify_of_a_store_that_stops_answering_is_bounded(
    tmp_path,
    memory_root,
    store_env,
    capsys,
    monkeypatch,
):
    """The store stalls mid-verify: the chunks are reported unread within the timeout."""
    from test_bad_peers import Proxy

    from jaxckpt.peer._wire import PeerAddress

    with running("s3", tmp_path) as emulator:
        store_env(emulator)
        url = emulator.url("run")
        save_steps(url, memory_root)
        proxy = Proxy(PeerAddress("127.0.0.1", emulator.port))
        try:
            init = _zarr_reader.ZarrReader.__init__

            def through_proxy(self, part_kvstore):  # the chunk reads only
                init(self, {**part_kvstore, "endpoint": f"http://127.0.0.1:{proxy.address.port}"})

            monkeypatch.setattr(_zarr_reader.ZarrReader, "__init__", through_proxy)
            monkeypatch.setattr(_object_store.ObjectStore, "read_timeout_s", 1.0)
            proxy.stall.set()
            start = time.monotonic()
            code, text, _ = jaxckpt_cli(capsys, "verify", url, 2, "--no-progress")
            took = time.monotonic() - start
            assert code == 1, text
            assert "not read (no answer within 1.00 s)" in text and "27 problem(s)" in text
            assert took < 15, f"verify took {took:.1f} s with a 1 s timeout"
        finally:
            proxy.close()
