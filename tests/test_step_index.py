"""One combined index per step, written by one process inside the save's agreement,
read in part (a part's entry when asked for); the previous versions' layouts still read.

Threads play processes for the agreement (tests/test_multihost.py's `job`); the
handler tests save and restore in this process. The object count per step on
an object store is in tests/test_index_objects.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    abstract,
    as_per_part_index,
    assert_tree_equal,
    manager,
    mesh_1d,
    restore,
    sharded_state,
)
from helpers import save as save_step
from test_agreement import leaf
from test_multihost import job  # noqa: F401 -- the fixture

import jaxckpt
from jaxckpt.coord import _agreement
from jaxckpt.format import _checked_json, _format
from jaxckpt.persistent import _index


def leaves(scalar_type: str = "int", uncommitted: bool = False) -> tuple[_format.LeafRecord, ...]:
    return (
        leaf("['b']", shape=(48,)),
        _format.LeafRecord(
            "['loc']", _format.ARRAY, shape=(4,), dtype="float32", stored_shape=(4,),
            stored_dtype="float32", chunk_shape=(4,), per_process=True, uncommitted=uncommitted,
        ),
        _format.LeafRecord("['step']", _format.SCALAR, scalar_type=scalar_type, per_process=True),
    )  # fmt: skip


def manifest(owner: int, count: int = 3, **kw) -> _format.PartManifest:
    return _format.PartManifest(
        step=5,
        run_id="run",
        save_id=f"save-{owner}",
        owner=owner,
        process_count=count,
        failure_domain=f"node{owner}",
        leaves=kw.pop("leaves", leaves()),
        chunks={0: (_format.ChunkRecord((owner,), 32, crc32c=owner + 7, offset=0),)},
        iterator_states={},
        scalars={2: owner},
        shardings={1: {"type": "single", "device_id": owner}},
        created=1.0,
        metrics={"stall_s": 0.1 * owner},
        **kw,
    )


def agree_all(run, write, *, failing: int | None = None, count: int = 3) -> dict:
    def one(p: int) -> None:
        m = manifest(p, count)
        error = OSError(f"[process {p}] disk full") if p == failing else None
        _agreement.agree_on_save(
            m.leaves,
            error,
            tag="save/run/train",
            step=5,
            timeout_s=10,
            entry=None if error else _index.entry(m),
            write_index=write,
        )

    return run(count, one)


def test_one_process_writes_the_index_of_every_part_once_all_agreed(job):  # noqa: F811
    _, run = job
    calls = []
    results = agree_all(run, lambda entries: calls.append(dict(entries)))
    assert all(kind == "ok" for kind, _, _ in results.values()), results
    assert len(calls) == 1 and sorted(calls[0]) == [0, 1, 2]
    index = _index.parse_step_index(_index.step_index_text(leaves(), calls[0]).encode())
    assert index == {p: manifest(p) for p in range(3)}


def test_no_index_is_written_when_a_process_failed(job):  # noqa: F811
    _, run = job
    calls = []
    results = agree_all(run, lambda entries: calls.append(entries), failing=1)
    assert calls == []
    assert all(kind == "error" for kind, _, _ in results.values()), results


def test_a_failed_index_write_fails_the_save_on_every_process(job):  # noqa: F811
    _, run = job

    def write(entries):
        raise OSError("[process 9] could not write the index of step 5: the bucket is gone")

    results = agree_all(run, write)
    for p, (kind, error, _) in results.items():
        assert kind == "error" and _agreement.is_agreed(error), (p, error)
        assert "could not write the index of step 5: the bucket is gone" in str(error)


def test_each_part_keeps_its_own_fields_of_a_per_process_leaf():
    """The leaf records are written once; the fields a per-process leaf's record may hold
    differently on each process (a scalar's type, uncommitted) stay each part's own."""
    own = {
        0: manifest(0),
        1: manifest(1, leaves=leaves(scalar_type="float", uncommitted=True)),
        2: manifest(2, persist=True),
    }
    text = _index.step_index_text(own[0].leaves, {p: _index.entry(m) for p, m in own.items()})
    assert text.count('"path":"[\'b\']"') == 1  # the records once, not once per part
    index = _index.parse_step_index(text.encode())
    assert index == own
    assert index[1].leaves[2].scalar_type == "float" and index[1].leaves[1].uncommitted
    assert index[0].leaves is index[2].leaves  # parsed once and shared


def test_a_damaged_step_index_header_is_not_believed(tmp_path):
    text = _index.step_index_text(leaves(), {0: _index.entry(manifest(0, 1))})
    flipped = text.replace("\"['b']\"", "\"['c']\"")  # a leaf record: in the header
    (tmp_path / _format.STEP_INDEX_FILE).write_text(flipped)
    assert _index.read_index(tmp_path) == {}
    with pytest.raises(ValueError, match="damaged"):
        _index.parse_step_index(flipped.encode())


def test_an_index_of_a_newer_version_asks_for_an_upgrade():
    text = _index.step_index_text(leaves(), {0: _index.entry(manifest(0, 1))})
    with pytest.raises(ValueError, match="upgrade jaxckpt"):
        _index.parse_step_index(text.replace("jaxckpt-index 2 ", "jaxckpt-index 3 ", 1).encode())
    v1 = json.loads(v1_step_index_text(leaves(), {0: _index.entry(manifest(0, 1))}))
    v1["version"] = 99
    del v1["crc32c"]
    with pytest.raises(ValueError, match="upgrade jaxckpt"):
        _index.parse_step_index(_checked_json.with_checksum(json.dumps(v1)).encode())


def test_a_version_1_step_index_still_parses(tmp_path):
    """Steps saved by the previous version hold one JSON object with every part."""
    own = {0: manifest(0), 1: manifest(1, leaves=leaves(scalar_type="float")), 2: manifest(2)}
    text = v1_step_index_text(own[0].leaves, {p: _index.entry(m) for p, m in own.items()})
    assert _index.parse_step_index(text.encode()) == own
    (tmp_path / _format.STEP_INDEX_FILE).write_text(text)
    assert _index.read_index(tmp_path) == own
    assert _index.part_count(tmp_path) == 3
    flipped = text.replace('"save-0"', '"save-1"')
    (tmp_path / _format.STEP_INDEX_FILE).write_text(flipped)
    assert _index.read_index(tmp_path) == {}  # damaged: read whole, so believed not at all


def big_index(count: int) -> tuple[dict[int, _format.PartManifest], str]:
    parts = {p: manifest(p, count) for p in range(count)}
    return parts, _index.step_index_text(leaves(), {p: _index.entry(m) for p, m in parts.items()})


def damage(text: str, needle: str) -> str:
    at = text.index(needle)
    return text[:at] + needle.replace("save", "savX") + text[at + len(needle) :]


def test_one_part_is_read_without_the_others(tmp_path):
    """A process asks for its own part: another part's damaged entry does not stop it,
    and its own damaged entry is reported, naming the part and the index."""
    parts, text = big_index(2000)  # larger than what a reader reads first
    text = damage(text, '"save-1500"')
    path = tmp_path / _format.STEP_INDEX_FILE
    path.write_text(text)
    index = _index.read_index(tmp_path)
    assert len(index) == 2000 and 1999 in index and 2000 not in index
    assert _format.saved_process_count(index) == 2000
    assert _index.part_count(tmp_path) == 2000
    assert index[1700] == parts[1700] and index[3] == parts[3]
    many = [p for p in range(0, 2000, 50) if p != 1500]  # past a few: the rest read at once
    assert [index[p] for p in many] == [parts[p] for p in many]
    with pytest.raises(ValueError, match=r"the entry of part 1500 does not match its checksum"):
        index[1500]
    with pytest.raises(ValueError, match=str(path)):
        index.get(1500)
    with pytest.raises(ValueError, match="part 1500"):
        list(index.values())  # every part: the damaged one too


def test_a_steps_nan_count_is_read_without_its_parts(tmp_path):
    """`latest_restorable_step(finite=True)` asks every step for its NaN/Inf count: the
    header records the parts' sum, so no part's entry is read (a damaged one included)."""
    counted = {p: manifest(p, 3, nonfinite={0: p}) for p in range(3)}
    text = _index.step_index_text(leaves(), {p: _index.entry(m) for p, m in counted.items()})
    (tmp_path / _format.STEP_INDEX_FILE).write_text(damage(text, '"save-1"'))
    index = _index.read_index(tmp_path)
    assert _index.nonfinite_total(index) == 3 and index[2] == counted[2]
    uncounted = _index.step_index_text(leaves(), {0: _index.entry(manifest(0, 1))})
    assert _index.nonfinite_total(_index.parse_step_index(uncounted.encode())) == 0


def test_a_restore_plan_reads_its_own_part_alone(tmp_path):
    """The plan of a process whose own part is in its memory tier: restorable, its
    own part's chunks found in its part, though every other part's entry is damaged."""
    from jaxckpt.coord import _plan

    count = 300
    parts, text = big_index(count)
    for p in range(count):
        if p != 7:
            text = damage(text, f'"save-{p}"')
    (tmp_path / _format.STEP_INDEX_FILE).write_text(text)
    index = _index.read_index(tmp_path)
    held = {p: {p} for p in range(count)}
    plan = _plan.plan_step(5, index, 7, held, set())
    assert plan.restorable and plan.sources[7][0].tier == _plan.MEMORY
    assert plan.chunk_owner(7)((0, (7,)), False) == (7,)
    assert plan.manifests[7] == parts[7]


def v1_step_index_text(records: tuple[_format.LeafRecord, ...], entries: dict[int, str]) -> str:
    """The version-1 step index, as the previous version wrote it (one JSON object)."""
    import base64
    import zlib

    def shared(record: _format.LeafRecord) -> dict:
        d = record.to_dict()
        if record.per_process:
            for k in ("scalar_type", "uncommitted", "sharding"):
                d.pop(k, None)
        return d

    head = json.dumps(
        {
            "format": "jaxckpt-index",
            "version": 1,
            "manifest_version": _format.FORMAT_VERSION,
            "jaxckpt_version": _format.JAXCKPT_VERSION,
            "leaves": [shared(r) for r in records],
        },
        separators=(",", ":"),
    )
    parts = ",".join(
        f'"{int(p)}":{zlib.decompress(base64.b64decode(e)).decode()}'
        for p, e in sorted(entries.items())
    )
    return _checked_json.with_checksum(f'{head[:-1]},"parts":{{{parts}}}}}')


def _persisted_steps_1_and_2(memory_root: str, ckpt_dir: Path) -> dict:
    """Saves a state as steps 1 and 2, both persisted (this version's index); the state."""
    state = sharded_state(mesh_1d())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save_step(mngr, 1, state)
        save_step(mngr, 2, state)
        h.wait_for_persistence()
    return state


def test_a_step_saved_with_one_index_per_part_still_restores(memory_root, ckpt_dir):
    """Steps written by earlier versions hold `index_<p>.json` per part: still read."""
    state = _persisted_steps_1_and_2(memory_root, ckpt_dir)
    for step in (1, 2):
        item = ckpt_dir / str(step) / "train"
        files = as_per_part_index(item)
        assert [f.name for f in files] == ["index_00000.json"]
        assert not (item / _format.STEP_INDEX_FILE).exists()
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with manager(ckpt_dir, h, use_async=False) as mngr:
        assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 2
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "memory"
        assert mngr.item_metadata(2).train["w"].shape == state["w"].shape  # read there too


def test_a_step_saved_with_a_version_1_index_still_restores(memory_root, ckpt_dir):
    """Steps written by the previous version hold a version-1 `index.json`: still read,
    by a restore, `latest_restorable_step`, the metadata and `jaxckpt` part counts."""
    state = _persisted_steps_1_and_2(memory_root, ckpt_dir)
    for step in (1, 2):
        item = ckpt_dir / str(step) / "train"
        index = dict(_index.read_index(item))
        entries = {p: _index.entry(m) for p, m in index.items()}
        (item / _format.STEP_INDEX_FILE).write_text(v1_step_index_text(index[0].leaves, entries))
        assert _index.read_index(item) == index and _index.part_count(item) == 1
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=2))
    with manager(ckpt_dir, h, use_async=False) as mngr:
        assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 2
        assert_tree_equal(restore(mngr, 2, abstract(state)), state)
        assert h.last_restore_metrics["tier"] == "memory"
        assert mngr.item_metadata(2).train["w"].shape == state["w"].shape


def test_a_save_whose_index_cannot_be_written_fails_and_keeps_the_previous_step(
    memory_root, ckpt_dir, monkeypatch
):
    state = sharded_state(mesh_1d())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1000))
    with manager(ckpt_dir, h, use_async=False) as mngr:
        save_step(mngr, 1, state)

        def broken(item_dir, leaves, entries):
            raise PermissionError(f"{item_dir} is read-only")

        monkeypatch.setattr(_index, "write_step_index", broken)
        with pytest.raises(OSError, match=r"could not write the index of step 2 .*read-only"):
            save_step(mngr, 2, state)
        monkeypatch.undo()
        assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 1
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)
