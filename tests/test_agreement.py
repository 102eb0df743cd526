"""Agreement across processes, with threads playing processes (see tests/test_multihost.py).

Trees that differ across processes are refused at save on every process with
one message naming the leaves and processes; any one process's error is
raised by all. The real multi-process runs are in tests/workers/mp_agreement.py.
"""

from __future__ import annotations

import re

from test_multihost import job  # noqa: F401 -- the fixture

from jaxckpt.coord import _agreement
from jaxckpt.format import _format

SHARDING = {
    "type": "named",
    "axis_names": ["data"],
    "mesh_shape": [6],
    "device_ids": [0, 1, 2, 3, 4, 5],
    "spec": ["data"],
}


def leaf(path: str, shape=(48, 8), dtype="float32", **kw) -> _format.LeafRecord:
    return _format.LeafRecord(
        path,
        _format.ARRAY,
        keys=(("d", path.strip("[']")),),
        shape=shape,
        dtype=dtype,
        stored_shape=shape,
        stored_dtype=dtype,
        chunk_shape=(8, *shape[1:]),
        sharding=kw.pop("sharding", SHARDING),
        **kw,
    )


def tree(process: int, variant: str) -> list[_format.LeafRecord]:
    leaves = [leaf("['b']", shape=(48,)), leaf("['w']")]
    scalar = _format.LeafRecord("['step']", _format.SCALAR, value=process, scalar_type="int")
    if variant == "extra" and process == 1:
        leaves.append(leaf("['extra']"))
    if variant == "shape" and process == 1:
        leaves[1] = leaf("['w']", shape=(24, 8))
    if variant == "sharding" and process == 2:
        leaves[1] = leaf("['w']", sharding={**SHARDING, "spec": [None]})
    if variant == "per_process":  # each process's own local sharding: not a difference
        local = {"type": "single", "device_id": 2 * process}
        leaves.append(leaf("['loc']", shape=(4,), per_process=True, sharding=local))
    return sorted([*leaves, scalar], key=lambda r: r.path)


def save_all(run, variant: str, count: int = 3) -> dict:
    return run(
        count,
        lambda p: _agreement.agree_on_save(
            tree(p, variant), None, tag="save/run/train", step=5, timeout_s=5
        ),
    )


def same_message(results: dict) -> str:
    """The one message every process raised (without its `[process p]` prefix)."""
    messages = set()
    for p, (kind, error, _) in results.items():
        assert kind == "error" and isinstance(error, ValueError), (p, error)
        assert _agreement.is_agreed(error)
        messages.add(re.sub(r"^\[process \d\] ", "", str(error)))
    assert len(messages) == 1, messages
    return messages.pop()


def test_equal_trees_with_different_values_save(job):  # noqa: F811
    _, run = job
    for variant in ("same", "per_process"):
        results = save_all(run, variant)
        assert all(kind == "ok" for kind, _, _ in results.values()), (variant, results)


def test_an_extra_leaf_on_one_process_is_refused_everywhere(job):  # noqa: F811
    _, run = job
    message = same_message(save_all(run, "extra"))
    assert "different trees at step 5" in message
    assert "processes [0, 2] saved one tree and processes [1] another" in message
    assert "leaf ['extra']: processes [0, 2] do not save it; processes [1] save it" in message
    assert run.left() == []  # the last exchange's outcome alone, for the next to delete


def test_a_different_shape_or_sharding_is_named(job):  # noqa: F811
    _, run = job
    message = same_message(save_all(run, "shape"))
    assert "leaf ['w']" in message and "shape=[48, 8]" in message
    assert "shape=[24, 8]" in message and "processes [1]" in message
    message = same_message(save_all(run, "sharding"))
    assert "leaf ['w']" in message and "processes [2]" in message and "sharding=" in message


def test_one_process_error_is_raised_by_all(job):  # noqa: F811
    _, run = job

    def one(p: int) -> None:
        error = (
            FileNotFoundError(f"[process {p}] No verified copy of chunk (0,)") if p == 2 else None
        )
        _agreement.agree(error, tag="restore/run/train", what="The restore of step 5", timeout_s=5)

    results = run(3, one)
    own = results[2][1]
    assert isinstance(own, FileNotFoundError) and str(own).startswith("[process 2] No verified")
    for p in (0, 1):
        kind, error, _ = results[p]
        assert kind == "error" and type(error) is FileNotFoundError, error
        assert str(error).startswith(
            f"[process {p}] The restore of step 5 failed on process 2, so it fails on every "
            "process: FileNotFoundError: [process 2] No verified copy"
        ), error


def test_an_error_of_a_non_builtin_type_comes_back_as_runtime_error(job):  # noqa: F811
    _, run = job

    class Custom(Exception):
        pass

    def one(p: int) -> None:
        error = Custom("boom") if p == 0 else None
        _agreement.agree(error, tag="t", what="The save of step 1", timeout_s=5)

    results = run(2, one)
    assert isinstance(results[0][1], Custom)
    assert type(results[1][1]) is RuntimeError and "Custom: boom" in str(results[1][1])
