"""NaN/Inf counting in the save's slab pass: the counters, the manifest, the metrics,
the warning and `latest_restorable_step(..., finite=True)`."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt
from jaxckpt.format import _finite, _format
from jaxckpt.memory import _slab
from jaxckpt.persistent import _index

BLOCK = 1 << 20


def _poisoned(dtype, n: int, where: dict[int, float]) -> np.ndarray:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n).astype(np.float64)
    values[:3] = [5e4, -5e4, 0.0]  # large finite values (every dtype here holds them)
    for i, v in where.items():
        values[i] = v
    return values.astype(dtype)


@pytest.mark.parametrize(
    "dtype",
    [
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        ml_dtypes.float8_e5m2,
    ],
    ids=lambda d: np.dtype(d).name,
)
def test_counter_counts_every_nan_and_inf_block_by_block(dtype):
    n = 3 * BLOCK // np.dtype(dtype).itemsize + 17  # several blocks and a short last one
    where = {5: np.nan, 100: np.inf, n - 1: -np.inf, n // 2: np.nan}
    data = _poisoned(dtype, n, where)
    count = _finite.counter(np.dtype(dtype).name)
    assert count is not None
    raw = data.reshape(-1).view(np.uint8)
    blocks = [raw[s : s + BLOCK] for s in range(0, raw.nbytes, BLOCK)]
    assert sum(count(b) for b in blocks) == len(where)
    clean = _poisoned(dtype, n, {})
    assert sum(count(b) for b in [clean.view(np.uint8)]) == 0


@pytest.mark.parametrize("n", [64, 1 << 16], ids=["small block", "large block"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_counter_is_exact_for_huge_finite_values(dtype, n):
    """Values whose squares overflow (a large block's quick test, its sum of squares, is
    Inf) are still finite: counted exactly, they count zero, and a NaN among them one
    (a small block is counted at once)."""
    huge = np.finfo(dtype).max
    data = np.full(n, huge / 2, dtype=dtype)
    count = _finite.counter(np.dtype(dtype).name)
    assert count is not None
    assert count(data.view(np.uint8)) == 0
    data[7] = np.nan
    assert count(data.view(np.uint8)) == 1


@pytest.mark.parametrize("dtype", ["int32", "uint32", "bool", "uint8", None])
def test_no_counter_for_dtypes_without_nan(dtype):
    assert _finite.counter(dtype) is None


def test_slab_passes_count_per_chunk_then_per_leaf(tmp_path):
    chunks = [
        _poisoned(np.float32, 1000, {1: np.nan, 2: np.inf}),
        np.arange(10, dtype=np.int32),
        _poisoned(ml_dtypes.bfloat16, 700_000, {699_999: -np.inf}),
        _poisoned(np.float32, 50, {}),
    ]
    dtypes = [c.dtype for c in chunks]
    offsets, size = _slab.layout([c.nbytes for c in chunks])
    written = _finite.Tally(dtypes)
    crcs = _slab.write(tmp_path / "a", chunks, offsets, size, tally=written)
    assert written.counts == [2, 0, 1, 0]
    assert written.by_leaf([0, 1, 0, 3]) == {0: 3}
    # The CPU path: filled without checksums, checksummed and counted in place later.
    later = _finite.Tally(dtypes)
    _slab.write(tmp_path / "b", chunks, offsets, size, checksum=False)
    sizes = [c.nbytes for c in chunks]
    assert _slab.checksums(tmp_path / "b", offsets, sizes, later) == crcs
    assert later.counts == [2, 0, 1, 0]


def test_manifest_field_round_trips_and_older_manifests_read_as_not_counted():
    leaf = _format.LeafRecord("['w']", _format.ARRAY, dtype="float32", stored_dtype="float32")
    base = _format.PartManifest(
        step=1,
        run_id="r",
        save_id="s",
        owner=0,
        process_count=1,
        failure_domain="h",
        leaves=(leaf,),
        chunks={},
        iterator_states={},
        created=0.0,
    )
    assert _format.PartManifest.from_json(base.to_json()).nonfinite is None
    assert "nonfinite" not in base.to_dict()  # an older reader sees the manifest it knew
    counted = _format.PartManifest(**{**base.__dict__, "nonfinite": {0: 4}})
    assert _format.PartManifest.from_json(counted.to_json()).nonfinite == {0: 4}


def _state(step: int, poison: float | None = None) -> dict:
    state = sharded_state(mesh_1d(), seed=step)
    if poison is not None:
        w = np.asarray(state["w"]).copy()
        w[3, 2] = poison
        w[12, 0] = poison
        state["w"] = jax.device_put(w, state["w"].sharding)
        h = np.asarray(state["h"]).copy()
        h[0, 0] = poison
        state["h"] = jax.device_put(h, state["h"].sharding)
    return state


@pytest.mark.parametrize("hold", [False, True], ids=["copy_then_checksum", "fill_and_checksum"])
def test_save_counts_warns_once_and_finite_resume_skips_poisoned_steps(
    memory_root, ckpt_dir, hold, caplog
):
    options = jaxckpt.TierOptions(memory_root, persist_every=1, memory_keep=4, hold_cpu_arrays=hold)
    handler = jaxckpt.TieredCheckpointHandler(options)
    mngr = manager(ckpt_dir, handler, max_to_keep=10)
    states = {1: _state(1), 2: _state(2, np.nan), 3: _state(3), 4: _state(4, -np.inf)}
    metrics = {}
    with caplog.at_level("WARNING"):
        for step, state in states.items():
            save(mngr, step, state)
            mngr.wait_until_finished()
            metrics[step] = dict(handler.last_save_metrics)
    handler.wait_for_persistence()
    assert {s: m["nonfinite"] for s, m in metrics.items()} == {1: 0, 2: 3, 3: 0, 4: 3}
    warned = [r.getMessage() for r in caplog.records if "NaN/Inf" in r.getMessage()]
    assert len(warned) == 2, warned  # once per poisoned step, never per leaf or chunk
    assert "step 2 holds 3 NaN/Inf values" in warned[0] and "['w'] (2)" in warned[0]
    assert "['h'] (1)" in warned[0] and "step 4" in warned[1]
    poisoned = {"['h']": 1, "['w']": 2}
    for step, expected in {1: {}, 2: poisoned, 3: {}, 4: poisoned}.items():
        index = _index.read_index(ckpt_dir / str(step) / "train")
        recorded = index[0].nonfinite
        assert recorded is not None
        assert {index[0].leaves[i].path: n for i, n in recorded.items()} == expected

    assert jaxckpt.latest_restorable_step(mngr, delete_newer=False) == 4
    assert jaxckpt.latest_restorable_step(mngr, delete_newer=False, finite=True) == 3
    assert mngr.all_steps() == [1, 2, 3, 4]
    assert jaxckpt.latest_restorable_step(mngr, finite=True) == 3
    assert mngr.all_steps() == [1, 2, 3]  # the poisoned newer step is gone: 4 can be saved again
    assert_tree_equal(restore(mngr, 3, abstract(states[3])), states[3])
    save(mngr, 4, _state(4))
    mngr.wait_until_finished()
    assert jaxckpt.latest_restorable_step(mngr, finite=True) == 4
    mngr.close()


def test_counting_off_records_nothing_and_counts_as_finite(memory_root, ckpt_dir):
    options = jaxckpt.TierOptions(memory_root, persist_every=1, count_nonfinite=False)
    handler = jaxckpt.TieredCheckpointHandler(options)
    mngr = manager(ckpt_dir, handler)
    save(mngr, 1, _state(1, np.nan))
    mngr.wait_until_finished()
    assert "nonfinite" not in handler.last_save_metrics
    assert _index.read_index(ckpt_dir / "1" / "train")[0].nonfinite is None
    assert jaxckpt.latest_restorable_step(mngr, delete_newer=False, finite=True) == 1
    mngr.close()


def test_count_nonfinite_option_is_validated(memory_root):
    with pytest.raises(ValueError, match="count_nonfinite must be a bool"):
        jaxckpt.TierOptions(memory_root, count_nonfinite="yes")  # type: ignore[arg-type]


def test_ls_and_inspect_show_the_counts(memory_root, ckpt_dir, capsys):
    import json

    from jaxckpt import cli

    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    mngr = manager(ckpt_dir, handler)
    save(mngr, 1, _state(1))
    save(mngr, 2, _state(2, np.inf))
    mngr.wait_until_finished()
    handler.wait_for_persistence()
    mngr.close()

    assert cli.main(["ls", str(ckpt_dir), "--json"]) == 0
    steps = {s["step"]: s for s in json.loads(capsys.readouterr().out)["steps"]}
    assert (steps[1]["nonfinite"], steps[2]["nonfinite"]) == (0, 3)
    assert cli.main(["ls", str(ckpt_dir)]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines() if line[:4].strip().isdigit()}
    assert "FINITE" in text and lines["1"].rstrip().endswith("yes")
    assert lines["2"].rstrip().endswith("NO: 3 NaN/Inf")

    assert cli.main(["inspect", str(ckpt_dir), "2", "--json"]) == 0
    leaves = {x["path"]: x["nonfinite"] for x in json.loads(capsys.readouterr().out)["leaves"]}
    assert leaves["['w']"] == 2 and leaves["['h']"] == 1 and leaves["['b']"] == 0
    assert cli.main(["inspect", str(ckpt_dir), "2"]) == 0
    text = capsys.readouterr().out
    assert "finite: NO: 3 NaN/Inf" in text
    (w_line,) = [line for line in text.splitlines() if line.startswith("w ")]
    assert w_line.rstrip().endswith("2 NaN/Inf")
