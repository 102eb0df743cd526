"""Every corruption in every tier: detected every time, then a fallback or a clear error.

Corruptions of a part: in a slab (memory and peer tiers) a flipped byte, a
zeroed chunk, a truncated or deleted slab; in a persisted part's zarr3 arrays a
flipped byte, a truncated or deleted chunk, a zarr.json that lies about the
dtype or is garbage; and in any part a manifest that is garbage, missing, or
valid JSON with one flipped bit. Tiers: this process's memory, a peer's memory (a real
`PeerServer`; see `FakePeers`), the persisted copy, and the step's index
manifest (the one copy every other copy is checked against).

A restore must give exactly the saved values (from another verified copy) or
raise an error that names the step; it must never return wrong values.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import faults
import pytest
from helpers import (
    abstract,
    attach_peers,
    flip_slab_byte,
    manager,
    mesh_1d,
    restore,
    save,
    sharded_state,
    slab_chunk,
)
from test_bad_peers import RUN, TOKEN, FakePeers, Outcome, bounded, own_server, tally

import jaxckpt
from jaxckpt._options import TierOptions
from jaxckpt.format import _format
from jaxckpt.peer._server import PeerServer
from jaxckpt.tiers import _memory_tier, _slab

STEP = 1
LEAF = "['w']"  # sharded over 8 devices: 8 chunks in process 0's part

# Chunk corruptions: the damaged chunk is read, rejected and replaced (a fallback).
SLAB_CHUNK_CORRUPTIONS = ["flip_byte", "zero_chunk", "truncate"]
ZARR_CHUNK_CORRUPTIONS = ["flip_byte", "truncate", "delete_chunk", "zarr_dtype", "zarr_garbage"]
CHUNK_CORRUPTIONS = set(SLAB_CHUNK_CORRUPTIONS + ZARR_CHUNK_CORRUPTIONS)
MANIFEST_CORRUPTIONS = ["manifest_garbage", "manifest_missing", "manifest_flip"]
# A part without its slab or manifest is not offered at all.
SLAB_CORRUPTIONS = [*SLAB_CHUNK_CORRUPTIONS, "delete_slab", *MANIFEST_CORRUPTIONS]
ZARR_CORRUPTIONS = ZARR_CHUNK_CORRUPTIONS + MANIFEST_CORRUPTIONS


def state():
    return {**sharded_state(mesh_1d(), seed=STEP), "step": STEP}


def corrupt(part: Path, how: str) -> None:
    """Damages one part directory (memory, peer or persisted copy) in one way."""
    manifest_file = part / _format.MANIFEST_FILE
    if how.startswith("manifest_"):
        corrupt_manifest(manifest_file, how)
    elif (part / _slab.SLAB_FILE).exists():
        corrupt_slab(part, how)
    else:
        corrupt_zarr(part, how)


def corrupt_slab(part: Path, how: str) -> None:
    slab, offset, nbytes = slab_chunk(part, LEAF, (0, 0))
    if how == "flip_byte":
        flip_slab_byte(part, LEAF, (0, 0), at=nbytes // 2, bit=0x04)
    elif how == "zero_chunk":
        with open(slab, "r+b") as f:
            f.seek(offset)
            f.write(bytes(nbytes))
    elif how == "truncate":  # cuts into the first chunk: every chunk after it is gone too
        os.truncate(slab, offset + 7)
    elif how == "delete_slab":
        slab.unlink()
    else:
        raise ValueError(how)


def corrupt_zarr(part: Path, how: str) -> None:
    manifest = _format.PartManifest.from_json((part / _format.MANIFEST_FILE).read_text())
    key = next(r.array_key for r in manifest.leaves if r.path == LEAF)
    assert key is not None
    array = part / _format.ARRAYS_DIR / key
    chunk = array / "c" / "0" / "0"
    if how == "flip_byte":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x04
        chunk.write_bytes(bytes(data))
    elif how == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:7])
    elif how == "delete_chunk":
        chunk.unlink()
    elif how == "zarr_dtype":  # same item size: every byte is where it was, read as int32
        meta = json.loads((array / "zarr.json").read_text())
        assert meta["data_type"] == "float32"
        meta["data_type"] = "int32"
        (array / "zarr.json").write_text(json.dumps(meta))
    elif how == "zarr_garbage":
        (array / "zarr.json").write_bytes(b"\x00garbage{")
    else:
        raise ValueError(how)


def corrupt_manifest(manifest_file: Path, how: str) -> None:
    if how == "manifest_garbage":
        manifest_file.write_text(manifest_file.read_text()[:-40])
    elif how == "manifest_missing":
        manifest_file.unlink()
    elif how == "manifest_flip":  # still valid JSON, but another save's id
        text = manifest_file.read_text()
        i = text.index('"save_id":"') + len('"save_id":"')
        manifest_file.write_text(text[:i] + chr(ord(text[i]) ^ 0x01) + text[i + 1 :])
    else:
        raise ValueError(how)


def save_step(memory_root: str, ckpt: Path, *, persist: bool) -> None:
    h = jaxckpt.TieredCheckpointHandler(
        TierOptions(memory_root, run_id=RUN, persist_every=1 if persist else 1000)
    )
    with manager(ckpt, h) as mngr:
        save(mngr, STEP, state())
        mngr.wait_until_finished()
        h.wait_for_persistence()


def restore_step(memory_root: str, ckpt: Path, peers=None, monkeypatch=None) -> Outcome:
    h = jaxckpt.TieredCheckpointHandler(TierOptions(memory_root, run_id=RUN, timeout_s=5))
    if peers is not None:
        attach_peers(h, peers, monkeypatch)
    mngr = manager(ckpt, h)
    expected = state()
    outcome = bounded(lambda: restore(mngr, STEP, abstract(expected)), expected, h)
    if outcome.kind != "hang":
        mngr.close()
    return outcome


def memory_part(memory_root: str) -> Path:
    return _memory_tier.MemoryTier(memory_root, RUN).part_dir(STEP, 0)


def persisted_part(ckpt: Path) -> Path:
    return ckpt / str(STEP) / "train" / _format.part_dir_name(0)


def check(outcome: Outcome, how: str, fallback: bool) -> None:
    """The verdict every scenario must reach."""
    assert outcome.kind != "wrong", f"{how}: WRONG VALUES restored: {outcome.error}"
    assert outcome.kind != "hang", f"{how}: restore hung"
    if fallback:
        assert outcome.kind == "ok", f"{how}: {outcome.error!r}"
        assert "persistent" in outcome.metrics["bytes_by_tier"], outcome.metrics
        if how in CHUNK_CORRUPTIONS:  # the damaged chunk was read, rejected, replaced
            assert outcome.metrics["fallbacks"] >= 1, outcome.metrics
    else:
        assert outcome.kind == "error", how
        assert isinstance(outcome.error, FileNotFoundError), repr(outcome.error)
        assert f"step {STEP}" in str(outcome.error).lower(), outcome.error


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "only-copy"])
@pytest.mark.parametrize("how", SLAB_CORRUPTIONS)
def test_corrupt_memory_copy(how, fallback, memory_root, ckpt_dir):
    save_step(memory_root, ckpt_dir, persist=fallback)
    corrupt(memory_part(memory_root), how)
    outcome = restore_step(memory_root, ckpt_dir)
    tally(f"corrupt_{how}_{'fallback' if fallback else 'only'}", "memory", outcome)
    check(outcome, how, fallback)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "only-copy"])
@pytest.mark.parametrize("how", SLAB_CORRUPTIONS)
def test_corrupt_peer_copy(how, fallback, memory_root, ckpt_dir, tmp_path, monkeypatch):
    save_step(memory_root, ckpt_dir, persist=fallback)
    holder_root = tmp_path / "holder"
    shutil.copytree(
        memory_part(memory_root), _memory_tier.MemoryTier(str(holder_root), RUN).part_dir(STEP, 0)
    )
    shutil.rmtree(memory_part(memory_root))  # the owner's node is lost
    corrupt(_memory_tier.MemoryTier(str(holder_root), RUN).part_dir(STEP, 0), how)
    with PeerServer(holder_root, run_id=RUN, token=TOKEN) as holder:
        peers = FakePeers(
            own_server(tmp_path / "own"),
            holder.address,
            holder_memory=_memory_tier.MemoryTier(str(holder_root), RUN),
            ckpt_dir=ckpt_dir,
        )
        outcome = restore_step(memory_root, ckpt_dir, peers, monkeypatch)
    tally(f"corrupt_{how}_{'fallback' if fallback else 'only'}", "peer", outcome)
    check(outcome, how, fallback)


@pytest.mark.parametrize("how", ZARR_CORRUPTIONS)
def test_corrupt_persisted_copy(how, memory_root, ckpt_dir):
    save_step(memory_root, ckpt_dir, persist=True)
    shutil.rmtree(memory_root)  # memory lost: the persisted copy is the only one
    corrupt(persisted_part(ckpt_dir), how)
    outcome = restore_step(memory_root, ckpt_dir)
    tally(f"corrupt_{how}_only", "persistent", outcome)
    check(outcome, how, fallback=False)


INDEX_CORRUPTIONS = ["index_garbage", "index_missing", "index_scalar_flip", "index_crc_flip"]


def corrupt_index(item_dir: Path, how: str) -> None:
    index = item_dir / _format.STEP_INDEX_FILE
    text = index.read_text()
    if how == "index_garbage":
        index.write_text(text[: len(text) // 2])
    elif how == "index_missing":
        index.unlink()
    elif how == "index_scalar_flip":  # {"step": 1} saved; one bit turns it into 0
        header = json.loads(text.split("\n", 2)[1])  # after the step index's prefix line
        leaf = [x["path"] for x in header["leaves"]].index("['step']")
        entry = f'"{leaf}":1'  # the value is in the part's "scalars", by leaf index
        i = text.index(entry, text.index('"scalars":')) + len(entry) - 1
        index.write_text(text[:i] + chr(ord(text[i]) ^ 0x01) + text[i + 1 :])
    elif how == "index_crc_flip":  # the first chunk record's checksum, one bit off
        i = text.index('"crc32c":') + len('"crc32c":')
        index.write_text(text[:i] + chr(ord(text[i]) ^ 0x01) + text[i + 1 :])
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", INDEX_CORRUPTIONS)
def test_corrupt_index_manifest_is_never_believed(how, memory_root, ckpt_dir):
    """Every other copy is checked against the index; a damaged index must not pass."""
    save_step(memory_root, ckpt_dir, persist=True)
    corrupt_index(ckpt_dir / str(STEP) / "train", how)
    outcome = restore_step(memory_root, ckpt_dir)
    tally(f"corrupt_{how}", "index", outcome)
    assert outcome.kind != "wrong", f"{how}: WRONG VALUES restored: {outcome.error}"
    assert outcome.kind in ("ok", "error"), outcome
    if outcome.kind == "error":
        assert f"step {STEP}" in str(outcome.error).lower(), outcome.error


@pytest.mark.parametrize("how", ["flip_byte", "zero_chunk", "truncate"])
def test_memory_corrupted_before_persistence_is_not_persisted(how, memory_root, ckpt_dir):
    """The persister verifies what it copies: damage in memory never becomes durable."""
    h = jaxckpt.TieredCheckpointHandler(TierOptions(memory_root, run_id=RUN, persist_every=1))
    mngr = manager(ckpt_dir, h)
    with faults.held("persist_begin") as gate:
        save(mngr, STEP, state())
        mngr.wait_until_finished()
        corrupt(memory_part(memory_root), how)
        gate.set()
        # The failure is raised by the wait, or else kept for close().
        with pytest.raises(OSError, match=rf"Persisting step {STEP} .*failed"):
            try:
                h.wait_for_persistence()
            finally:
                mngr.close()
    assert not persisted_part(ckpt_dir).exists()
    outcome = restore_step(memory_root, ckpt_dir)
    tally(f"corrupt_{how}_before_persist", "memory+persistent", outcome)
    check(outcome, how, fallback=False)
