"""Per-process leaves in the manifest (format version 2) and the rule that restores them.

The multi-process behaviour is in tests/test_process_local.py; here, in one
process: what the manifest records, that version-1 manifests still restore,
and the per-leaf decision (own value, a value saved alike, the mapping
function, or an error naming the leaf) on made-up manifests.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    as_per_part_index,
    assert_tree_equal,
    index_manifest,
    manager,
    mesh_1d,
    restore,
    save,
    sharded_state,
)

import jaxckpt
from jaxckpt.format import _format
from jaxckpt.memory import _readers
from jaxckpt.restore import _target

# ---- what a save records ------------------------------------------------------


def test_numpy_and_scalars_are_per_process_and_arrays_global_in_one_process(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    with manager(ckpt_dir, jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))) as m:
        save(m, 1, state)
        m.wait_until_finished()
    raw = index_manifest(ckpt_dir / "1" / "train")
    assert raw["version"] == _format.FORMAT_VERSION == 4
    leaves = {leaf["path"]: leaf for leaf in raw["leaves"]}
    by_index = {leaf["path"]: i for i, leaf in enumerate(raw["leaves"])}
    for name in ("['table']", "['step']", "['scale']", "['name']"):
        assert leaves[name]["per_process"] is True, leaves[name]
    # Scalar values live in the part, not in the (identical everywhere) leaf records.
    assert "value" not in leaves["['step']"] and raw["scalars"][str(by_index["['step']"])] == 7
    # One process: every jax.Array is global (one value, its sharding in the record).
    assert "per_process" not in leaves["['w']"] and leaves["['w']"]["sharding"]["type"] == "named"
    assert leaves["['legacy_key']"]["uncommitted"] is True  # jax.random.PRNGKey(0): uncommitted
    assert "uncommitted" not in leaves["['w']"]


def test_manifest_round_trips_the_per_process_fields():
    record = _format.LeafRecord(
        "['s']", _format.SCALAR, keys=(("d", "s"),), scalar_type="int", per_process=True
    )
    array = _format.LeafRecord(
        "['a']",
        _format.ARRAY,
        keys=(("d", "a"),),
        shape=(2,),
        dtype="float32",
        stored_shape=(2,),
        stored_dtype="float32",
        chunk_shape=(2,),
        per_process=True,
        uncommitted=True,
    )
    m = _manifest(0, 2, (record, array), scalars={0: 5}, chunks={1: ((0,), 11)})
    m = _format.PartManifest(**{**m.__dict__, "shardings": {1: {"type": "single", "device_id": 0}}})
    assert _format.PartManifest.from_json(m.to_json()) == m


# ---- version 1 manifests still restore -----------------------------------------


def _as_version_1(path: Path, crc32s: dict[tuple[str, tuple[int, ...]], int]) -> None:
    """Rewrites a manifest the way jaxckpt 1 wrote it: scalar values inside the leaf
    records, no per-process fields (numpy arrays were process 0's, as here), chunks
    with their zlib CRC-32 (`crc32s`) and no slab offsets, arrays named by index."""
    d = json.loads(path.read_text())
    d.pop("crc32c")
    d["version"] = 1
    scalars = d.pop("scalars")
    d.pop("shardings")
    for i, leaf in enumerate(d["leaves"]):
        leaf.pop("per_process", None)
        leaf.pop("uncommitted", None)
        leaf.pop("array_key", None)
        if leaf["kind"] == _format.SCALAR:
            leaf["value"] = scalars[str(i)]
    for i, chunks in d["chunks"].items():
        for c in chunks:
            c.pop("crc32c")
            c.pop("offset")
            c["crc32"] = crc32s[(d["leaves"][int(i)]["path"], tuple(c["index"]))]
    d["crc32"] = zlib.crc32(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(d))


def _zlib_crc32s(part: Path) -> dict[tuple[str, tuple[int, ...]], int]:
    """(leaf path, chunk index) -> zlib CRC-32 of that chunk, read from a memory slab."""
    manifest = _format.PartManifest.from_json((part / _format.MANIFEST_FILE).read_text())
    reader = _readers.SlabReader(part / "slab", lent=False)
    return {
        (manifest.leaves[leaf].path, c.index): zlib.crc32(
            _readers.read_chunk(reader, leaf, manifest.leaves[leaf], c, 10).tobytes()
        )
        for leaf, chunks in manifest.chunks.items()
        for c in chunks
    }


def test_a_version_1_checkpoint_still_restores(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    as_per_part_index(ckpt_dir / "1" / "train")  # version 1 had one index file per part
    # (`.jaxckpt-kept/` holds hard links of the same persisted files: not other copies.)
    manifests = [
        *Path(memory_root).rglob(_format.MANIFEST_FILE),
        *(p for p in ckpt_dir.rglob(_format.MANIFEST_FILE) if ".jaxckpt-kept" not in p.parts),
        *(p for p in ckpt_dir.rglob("index_*.json") if ".jaxckpt-kept" not in p.parts),
    ]
    assert len(manifests) == 3, manifests
    memory_part = manifests[0].parent
    crc32s = _zlib_crc32s(memory_part)
    persisted = ckpt_dir / "1" / "train" / _format.part_dir_name(0)
    index = _format.PartManifest.from_json(manifests[-1].read_text())
    for i, record in enumerate(index.leaves):  # version 1 named arrays by leaf index
        if record.array_key is not None:
            (persisted / "arrays" / record.array_key).rename(persisted / "arrays" / str(i))
    for path in manifests:
        _as_version_1(path, crc32s)
    # Before slabs the memory tier held zarr arrays: such a memory part is not used.
    (memory_part / "slab").unlink()
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, h) as mngr:
        target = {**state, "legacy_key": jax.ShapeDtypeStruct((2,), jnp.uint32)}
        restored = restore(mngr, 1, target)
        assert h.last_restore_metrics["tier"] == "persistent"
        host = restore(mngr, 1, None)
        meta = mngr.item_metadata(1).train
    assert_tree_equal(restored, state)
    assert host["step"] == 7 and host["name"] == "run" and type(host["scale"]) is np.float32
    np.testing.assert_array_equal(host["table"], state["table"])
    assert meta["step"] == 7 and meta["table"].shape == (3, 3)


# ---- the rule, on made-up manifests ---------------------------------------------


RECORDS = (
    _format.LeafRecord(
        "['s']", _format.SCALAR, keys=(("d", "s"),), scalar_type="int", per_process=True
    ),
    _format.LeafRecord(
        "['np']",
        _format.NUMPY,
        keys=(("d", "np"),),
        shape=(3,),
        dtype="int64",
        stored_shape=(3,),
        stored_dtype="int64",
        chunk_shape=(3,),
        per_process=True,
    ),
    _format.LeafRecord("['it']", _format.ITERATOR, keys=(("d", "it"),)),
)


def _manifest(owner, count, leaves=RECORDS, scalars=None, chunks=None, states=None):
    return _format.PartManifest(
        step=5,
        run_id="run",
        save_id=f"s{owner}",
        owner=owner,
        process_count=count,
        failure_domain=f"node{owner}",
        leaves=leaves,
        chunks={
            i: (_format.ChunkRecord(idx, 24, crc32c=crc, offset=0),)
            for i, (idx, crc) in (chunks or {}).items()
        },
        iterator_states=states or {},
        created=0.0,
        scalars=scalars or {},
    )


def _saved(values: list[int]) -> dict[int, _format.PartManifest]:
    """Manifests of len(values) processes, each saving `values[p]` for every leaf."""
    n = len(values)
    return {
        p: _manifest(p, n, scalars={0: v}, chunks={1: ((0,), 1000 + v)}, states={2: {"pos": v}})
        for p, v in enumerate(values)
    }


def _ctx(manifests, process, count, **fns):
    return _target.Context(manifests, process, count, 5, **fns)


def test_same_process_count_gets_its_own_value():
    manifests = _saved([10, 11, 12, 13])
    for p in range(4):
        ctx = _ctx(manifests, p, 4)
        assert [_target.source(i, r, ctx) for i, r in enumerate(RECORDS)] == [p, p, p]
        assert (
            _target.scalar(0, RECORDS[0], manifests[_target.source(0, RECORDS[0], ctx)]) == 10 + p
        )
        _target.check(RECORDS, None, ctx)


def test_another_count_restores_values_saved_alike_and_refuses_differing_ones_by_name():
    alike = _saved([7, 7, 7, 7])
    for p in range(2):
        ctx = _ctx(alike, p, 2)
        _target.check(RECORDS, None, ctx)
        assert all(_target.source(i, r, ctx) in range(4) for i, r in enumerate(RECORDS))
    differing = _saved([7, 7, 8, 7])
    ctx = _ctx(differing, 1, 2)
    with pytest.raises(ValueError, match=r"Leaves \['s'\], \['np'\], \['it'\] at step 5") as e:
        _target.check(RECORDS, None, ctx)
    assert "per_process_fn" in str(e.value) and "[process 1]" in str(e.value)
    # Same values, another type on one process: differing too (never silently retyped).
    retyped = dict(alike)
    float_leaf = (
        _format.LeafRecord(
            "['s']", _format.SCALAR, keys=(("d", "s"),), scalar_type="float", per_process=True
        ),
        *RECORDS[1:],
    )
    retyped[3] = _manifest(
        3, 4, float_leaf, scalars={0: 7}, chunks={1: ((0,), 1007)}, states={2: {"pos": 7}}
    )
    with pytest.raises(ValueError, match=r"Leaf \['s'\] at step 5"):
        _target.check(RECORDS, None, _ctx(retyped, 0, 2))


def test_the_mapping_function_decides_differing_values_and_the_old_name_maps_iterators():
    differing = _saved([0, 1, 2, 3])
    calls = []

    def fn(path, values, process, count):
        calls.append((path, values, process, count))
        return values[-1]

    ctx = _ctx(differing, 1, 2, per_process_fn=fn)
    _target.check(RECORDS, None, ctx)
    assert [_target.source(i, r, ctx) for i, r in enumerate(RECORDS)] == [None, None, None]
    assert _target.iterator_state(2, RECORDS[2], ctx) == {"pos": 3}
    assert calls == [("['it']", [{"pos": v} for v in range(4)], 1, 2)]
    # iterator_state_fn: iterators only, called whenever the count changed (as before).
    old = _ctx(_saved([7, 7, 7, 7]), 0, 2, iterator_state_fn=lambda states, p, n: {"pos": -1})
    assert _target.iterator_state(2, RECORDS[2], old) == {"pos": -1}
    with pytest.raises(ValueError, match=r"Leaves \['s'\], \['np'\] at step 5"):
        _target.check(RECORDS, None, _ctx(differing, 0, 2, iterator_state_fn=lambda *a: 0))
