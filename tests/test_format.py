"""Manifests, chunk grids and restore plans: pure logic, no processes."""

from __future__ import annotations

import dataclasses
import json
import zlib

import numpy as np
import pytest

from jaxckpt.coord import _plan
from jaxckpt.format import _array_keys, _chunking, _format


def manifest(owner: int, count: int = 2, step: int = 5) -> _format.PartManifest:
    leaf = _format.LeafRecord(
        "['w']",
        _format.ARRAY,
        keys=(("d", "w"),),
        shape=(8, 2),
        dtype="float32",
        stored_shape=(8, 2),
        stored_dtype="float32",
        chunk_shape=(4, 2),
        sharding={
            "type": "named",
            "axis_names": ["x"],
            "mesh_shape": [2],
            "device_ids": [0, 1],
            "spec": ["x"],
        },
    )
    return _format.PartManifest(
        step=step,
        run_id="run-1",
        save_id=f"s{owner}",
        owner=owner,
        process_count=count,
        failure_domain=f"node{owner}",
        leaves=(leaf, _format.LeafRecord("['it']", _format.ITERATOR)),
        chunks={0: (_format.ChunkRecord((owner, 0), 32, crc32c=123 + owner, offset=0),)},
        iterator_states={1: {"next_index": 3}},
        created=1.5,
        metrics={"stall_s": 0.1},
    )


def test_manifest_round_trips_through_json():
    m = manifest(1)
    assert _format.PartManifest.from_json(m.to_json()) == m


def test_what_is_remembered_per_tree_is_never_another_trees():
    """The records' JSON and a save's chunk dicts are remembered by identity: each
    manifest's text holds its own leaves and chunks, saved one after another with the
    same leaves (a training loop) or with other ones (another tree of equal records)."""
    first = manifest(0)
    texts = []
    for crc in (1, 2, 3, 4, 5, 6):  # more saves than the memo keeps
        chunks = {0: (_format.ChunkRecord((0, 0), 32, crc32c=crc, offset=0),)}
        m = dataclasses.replace(first, chunks=chunks)
        text = m.to_json()
        assert _format.PartManifest.from_json(text) == m
        assert (
            dataclasses.replace(m, metrics={"s": crc}).to_dict()["chunks"]["0"][0]["crc32c"] == crc
        )
        texts.append(text)
    assert len(set(texts)) == 6
    renamed = tuple(dataclasses.replace(r, path=r.path + "x") for r in first.leaves)
    other = dataclasses.replace(first, leaves=renamed)
    assert _format.PartManifest.from_json(other.to_json()).leaves == renamed
    assert _format.PartManifest.from_json(first.to_json()).leaves == first.leaves


def test_remembered_computes_once_per_object_never_per_equal_object():
    memo: dict = {}
    calls = []
    a, b = ("x",), tuple(["x"])  # equal, not the same object
    assert a == b and a is not b
    for of in (a, a, b, a):
        assert _format.remembered(memo, of, lambda of=of: calls.append(of) or id(of)) == id(of)
    assert [c is a for c in calls] == [True, False]


def test_manifest_of_a_newer_format_is_refused():
    d = json.loads(manifest(0).to_json())
    d["version"] = _format.FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=f"version {_format.FORMAT_VERSION + 1} is not supported"):
        _format.PartManifest.from_dict(d)
    with pytest.raises(ValueError, match="Not a jaxckpt manifest"):
        _format.PartManifest.from_dict({"format": "orbax"})


def test_chunk_grid_arithmetic():
    shape, chunk = (10, 4), (4, 4)
    assert _chunking.chunk_region((2, 0), shape, chunk) == (slice(8, 10), slice(0, 4))
    assert _chunking.chunk_shape_at((2, 0), shape, chunk) == (2, 4)  # cut at the edge
    assert _chunking.chunk_shape_at((1, 0), shape, chunk) == (4, 4)
    assert _chunking.is_chunk((slice(8, 10), slice(0, 4)), (2, 0), shape, chunk)
    assert not _chunking.is_chunk((slice(8, 9), slice(0, 4)), (2, 0), shape, chunk)
    assert not _chunking.is_chunk((slice(4, 8), slice(0, 4)), (2, 0), shape, chunk)
    assert list(_chunking.chunks_overlapping((slice(3, 9), slice(None)), shape, chunk)) == [
        (0, 0),
        (1, 0),
        (2, 0),
    ]
    assert list(_chunking.chunks_overlapping((slice(4, 4), slice(None)), shape, chunk)) == []
    assert _chunking.chunk_index_of((slice(4, 8), slice(None)), shape, chunk) == (1, 0)
    with pytest.raises(ValueError, match="not aligned"):
        _chunking.chunk_index_of((slice(3, 7), slice(None)), shape, chunk)
    a = (slice(2, 6), slice(0, 4))
    b = _chunking.chunk_region((1, 0), shape, chunk)
    both = _chunking.intersect(a, b)
    assert both == (slice(4, 6), slice(0, 4))
    assert _chunking.relative(both, b) == (slice(0, 2), slice(0, 4))


def test_plan_prefers_own_memory_then_peers_then_persistent():
    index = {0: manifest(0), 1: manifest(1)}
    plan = _plan.plan_step(5, index, me=0, held={0: {0}, 1: {1}, 2: {0, 1}}, persisted={0, 1})
    assert plan.restorable
    assert plan.sources[0] == (
        _plan.Source("memory", 0),
        _plan.Source("peer", 2),
        _plan.Source("persistent"),
    )
    assert plan.sources[1] == (
        _plan.Source("peer", 1),
        _plan.Source("peer", 2),
        _plan.Source("persistent"),
    )
    assert plan.chunk_owners() == {(0, (0, 0)): (0,), (0, (1, 0)): (1,)}
    # Looked up in a process's own part first; any other chunk through the whole table.
    for first in (0, 1, None):
        owners_of = plan.chunk_owner(first)
        assert [owners_of((0, (i, 0)), False) for i in (0, 1, 2)] == [(0,), (1,), ()]
        assert owners_of((0, (0, 0)), True) == (0,)
    # Sources are planned per part asked for; the plan without a tier drops it.
    assert plan.without("memory").sources[0][0] == _plan.Source("peer", 2)
    assert not _plan.plan_step(5, index, 0, {0: {0}}, set()).without("memory").restorable


def test_plan_is_the_same_on_every_process_up_to_its_own_view():
    index = {0: manifest(0), 1: manifest(1)}
    held = {0: {0}, 1: {1}}
    a = _plan.plan_step(5, index, me=0, held=held, persisted=set())
    b = _plan.plan_step(5, index, me=1, held=held, persisted=set())
    assert a.restorable and b.restorable and a.owners == b.owners


def test_plan_reports_missing_parts():
    index = {0: manifest(0), 1: manifest(1)}
    plan = _plan.plan_step(5, index, me=0, held={0: {0}}, persisted=set())
    assert not plan.restorable and plan.missing == [1]
    # An index manifest lost for a process the step had: also missing.
    plan = _plan.plan_step(5, {0: manifest(0, count=3)}, me=0, held={0: {0}}, persisted={0})
    assert plan.missing == [1, 2]
    assert not _plan.plan_step(5, {}, me=0, held={}, persisted=set()).restorable


def leaf(*keys: tuple[str, object], kind: str = _format.ARRAY) -> _format.LeafRecord:
    return _format.LeafRecord(jax_path(keys), kind, keys=tuple(keys))


def jax_path(keys) -> str:
    return "".join(f"[{k!r}]" for _, k in keys)


def test_array_keys_are_escaped_tree_paths():
    records = _array_keys.with_array_keys(
        (
            leaf(("d", "params"), ("d", "Dense_0"), ("d", "kernel")),
            leaf(("d", "opt_state"), ("s", 0), ("a", "mu")),
            leaf(("d", "a.b/c%"), ("d", "ü")),
            leaf(("d", "it"), kind=_format.ITERATOR),
            leaf(kind=_format.NUMPY),
        )
    )
    assert [r.array_key for r in records] == [
        "params.Dense_0.kernel",
        "opt_state.0.mu",
        "a%2Eb%2Fc%25.%C3%BC",
        None,
        "_",
    ]


def test_array_keys_stay_unique_and_short():
    long = "x" * 300
    records = _array_keys.with_array_keys(
        (leaf(("d", 0)), leaf(("d", "0")), leaf(("d", long)), leaf(("d", "0~1")))
    )
    keys = [r.array_key for r in records]
    assert keys == ["0", "0~1", "x" * 200 + "~2", "0%7E1"]
    assert len(set(keys)) == len(keys)


def test_older_manifests_name_arrays_by_leaf_index():
    d = json.loads(manifest(0).to_json())
    d.pop("crc32c")
    d["version"] = 2
    old = _format.PartManifest.from_dict(d)
    assert [r.array_key for r in old.leaves] == ["0", None]


def test_a_version_2_manifest_is_read_and_checked_with_its_crc32():
    d = json.loads(manifest(0).to_json())
    d.pop("crc32c")
    d["version"] = 2
    for c in d["chunks"]["0"]:  # v2 chunk records: zlib CRC-32, no offset
        c["crc32"] = c.pop("crc32c")
        c.pop("offset", None)
    d["crc32"] = zlib.crc32(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())
    text = json.dumps(d)
    old = _format.PartManifest.from_json(text)
    assert old.chunks[0][0].checksum == ("crc32", 123)
    with pytest.raises(ValueError, match="damaged"):
        _format.PartManifest.from_json(text.replace('"run-1"', '"run-2"'))


def test_a_manifest_checks_its_crc32c_and_is_parsed_once():
    text = manifest(1).to_json()
    assert text.endswith("}") and ',"crc32c":' in text
    first = _format.PartManifest.from_json(text)
    assert _format.PartManifest.from_json(text.encode()) is first  # cached by content
    for damaged in (text.replace('"s1"', '"s2"'), text[:-3] + "9}", text[:-1]):
        with pytest.raises(ValueError):
            _format.PartManifest.from_json(damaged)


def test_replicated_leaf_fields_round_trip_and_are_absent_without_replicas():
    plain = manifest(0)
    assert "replicas" not in plain.to_json() and plain.slices == 0 and plain.replicas == 1
    leaf = dataclasses.replace(plain.leaves[0], chunk_shape=(2, 2), replicas=2, cut=0, slices=2)
    shared = dataclasses.replace(plain, leaves=(leaf, plain.leaves[1]))
    back = _format.PartManifest.from_json(shared.to_json())
    assert (
        back == shared
        and back.leaves[0].replicas == 2
        and (back.slices, back.replicas)
        == (
            1,
            2,
        )
    )


def test_unknown_leaf_fields_are_ignored():
    d = json.loads(manifest(0).to_json())
    d.pop("crc32c")
    d["leaves"][0]["from_a_later_version"] = [1, 2]
    assert _format.PartManifest.from_dict(d).leaves == manifest(0).leaves


def test_a_chunk_in_several_parts_is_read_from_this_process_memory_first():
    # A small replicated shard is saved by each of its holders (`_replicas`): the same
    # chunk in every part. Process 1 holds its own part: it reads its own copy, and the
    # others in a rotating order after it.
    shared = (_format.ChunkRecord((0, 0), 32, crc32c=7, offset=0),)
    index = {o: dataclasses.replace(manifest(o, count=3), chunks={0: shared}) for o in range(3)}
    plan = _plan.plan_step(5, index, me=1, held={0: {0}, 1: {1}, 2: {2}}, persisted={0, 1, 2})
    assert plan.chunk_owners(1) == {(0, (0, 0)): (1, 2, 0)}
    plan = _plan.plan_step(5, index, me=2, held={0: {0}, 1: {1}}, persisted={0, 1, 2})
    assert plan.chunk_owners(2) == {(0, (0, 0)): (0, 1, 2)}  # peers first, then persistent


def test_a_damaged_own_copy_of_a_chunk_in_several_parts_falls_back_to_another_part():
    from jaxckpt.format import _checksum
    from jaxckpt.restore import _chunk_reads

    good = np.arange(8, dtype=np.float32).reshape(4, 2)
    leaf = dataclasses.replace(manifest(0).leaves[0], shape=(4, 2), stored_shape=(4, 2))
    shared = (_format.ChunkRecord((0, 0), good.nbytes, crc32c=_checksum.crc32c(good), offset=0),)
    index = {
        o: dataclasses.replace(manifest(o), leaves=(leaf,), chunks={0: shared}) for o in range(2)
    }
    plan = _plan.plan_step(5, index, me=0, held={0: {0}, 1: {1}}, persisted=set())

    class Reader:
        def __init__(self, data):
            self.data = data

        def read(self, leaf, record, expected, tile, timeout_s):
            return self.data

    readers = {("memory", 0): Reader(good + 1), ("peer", 1): Reader(good)}
    damaged = []
    chunks = _chunk_reads.ChunkReads(
        plan,
        lambda source, owner: readers[(source.tier, owner)],
        0,
        on_damaged=lambda source, owner, why: damaged.append((source.tier, owner)),
    )
    (got,) = chunks.read_regions(0, [(slice(0, 4), slice(0, 2))])
    np.testing.assert_array_equal(got, good)
    assert chunks.bytes_by_tier == {"peer": good.nbytes}  # the other part's copy
    assert damaged == [("memory", 0)] and chunks.failures
