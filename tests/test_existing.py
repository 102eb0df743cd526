"""restore_existing: a job's first resume on jaxckpt, from the Orbax or flax checkpoints it
wrote before. Each is written by Orbax or flax itself (the pinned versions), restored onto
a 2-device mesh, compared bit for bit, and followed by a jitted step that combines the
sharded parameters with an uncommitted fresh array."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import config as flax_config
from flax import linen as nn
from flax import nnx
from flax.training import checkpoints
from flax.training import train_state as ts
from helpers import assert_tree_equal, manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def _model(mesh, seed):
    """A model whose parameters are on the mesh (the hidden kernel split over it) and whose
    dropout stream, made outside the mesh, is uncommitted."""
    model = MLP(nnx.Rngs(params=seed, dropout=seed + 1))

    def place(path, x):
        split = "hidden" in jax.tree_util.keystr(path) and x.ndim == 2
        return jax.device_put(x, NamedSharding(mesh, P(None, "data") if split else P()))

    nnx.update(model, jax.tree_util.tree_map_with_path(place, nnx.state(model, nnx.Param)))
    return model


def _host(tree):
    """The tree's values as numpy (typed keys as their key data), to compare later."""

    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    return jax.tree.map(one, tree)


@nnx.jit
def _train_step(model, optimizer, x):
    def loss_fn(model):
        return jnp.mean(model(x) ** 2)  # dropout: draws from the uncommitted stream

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _orbax_save(directory, steps, **items):
    with ocp.CheckpointManager(directory) as mngr:
        for step, args in steps:
            mngr.save(step, args=args)
        mngr.wait_until_finished()


def _uncommitted(tree):
    return [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(x, jax.Array) and not x.committed
    ]


def test_the_newest_standard_save_step_restores_onto_the_mesh(tmp_path):
    mesh = mesh_1d(2)
    model = _model(mesh, seed=0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    saved = {}
    with ocp.CheckpointManager(tmp_path / "old") as old:
        for step in (1, 2, 4):
            _train_step(model, optimizer, jnp.ones((2, 4)))
            saved[step] = _host(nnx.state(model))
            old.save(step, args=ocp.args.StandardSave(nnx.state(model)))
            old.wait_until_finished()  # nnx.state shares the model's variables

    fresh = _model(mesh, seed=7)
    target = nnx.state(fresh)
    assert _uncommitted(target) == [
        "['dropout']['rngs']['count'].value",
        "['dropout']['rngs']['key'].value",
    ]
    step, restored = jaxckpt.restore_existing(tmp_path / "old", target)
    assert step == 4
    assert_tree_equal(_host(restored), saved[4])
    assert int(restored["dropout"]["rngs"]["count"][...]) == 3  # three steps drew from it
    kernel = restored["hidden"]["kernel"][...]
    assert kernel.sharding == target["hidden"]["kernel"][...].sharding
    assert kernel.sharding.spec == P(None, "data")
    assert _uncommitted(restored) == _uncommitted(target)

    nnx.update(fresh, restored)
    _train_step(fresh, nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param), jnp.ones((2, 4)))
    assert int(fresh.dropout.rngs.count[...]) == 4

    step, older = jaxckpt.restore_existing(tmp_path / "old", nnx.state(_model(mesh, 7)), step=2)
    assert step == 2
    assert_tree_equal(_host(older), saved[2])


def test_a_pytree_save_restores_into_an_abstract_target(tmp_path):
    mesh = mesh_1d(2)
    state = {
        "w": jax.device_put(jnp.arange(12.0).reshape(6, 2), NamedSharding(mesh, P("data"))),
        "key": jax.random.key(5),
        "table": np.arange(6, dtype=np.int64).reshape(2, 3),
        "step": 11,
    }
    _orbax_save(tmp_path / "old", [(11, ocp.args.PyTreeSave(state))])
    target = {
        "w": jax.ShapeDtypeStruct((6, 2), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
        "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype),  # no sharding: uncommitted
        "table": np.zeros((2, 3), np.int64),
        "step": 0,
    }
    step, restored = jaxckpt.restore_existing(tmp_path / "old", target)
    assert step == 11
    assert_tree_equal(restored, state)
    assert restored["w"].committed and restored["w"].sharding == target["w"].sharding
    assert not restored["key"].committed
    assert isinstance(restored["table"], np.ndarray) and restored["step"] == 11
    out = jax.jit(lambda w, k: w * jax.random.uniform(k))(restored["w"], restored["key"])
    assert out.sharding.is_equivalent_to(target["w"].sharding, 2)


def test_a_composite_step_restores_the_item_asked_for(tmp_path):
    mesh = mesh_1d(2)
    replicated = NamedSharding(mesh, P())
    params = {"w": jax.device_put(jnp.arange(4.0), replicated)}
    opt = {"mu": jax.device_put(jnp.full(4, 0.5), replicated), "count": jnp.int32(3)}
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), opt=ocp.args.PyTreeSave(opt))
    _orbax_save(tmp_path / "old", [(6, args)])

    with pytest.raises(ValueError, match=r"several items, \['opt', 'params'\]: pass item="):
        jaxckpt.restore_existing(tmp_path / "old", params)
    with pytest.raises(ValueError, match=r"no Orbax PyTree item 'train'"):
        jaxckpt.restore_existing(tmp_path / "old", params, item="train")
    step, got_params = jaxckpt.restore_existing(tmp_path / "old", params, item="params")
    _, got_opt = jaxckpt.restore_existing(
        tmp_path / "old", {"mu": params["w"], "count": jnp.int32(0)}, item="opt"
    )
    assert step == 6
    assert_tree_equal(got_params, params)
    assert_tree_equal(got_opt, opt)
    assert got_opt["mu"].sharding == replicated and not got_opt["count"].committed
    jax.jit(lambda a, b, c: a + b * c)(got_params["w"], got_opt["mu"], got_opt["count"])


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


def _linen_state(mesh, seed):
    dense = Dense()
    params = dense.init(jax.random.key(seed), jnp.ones((1, 4)))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return ts.TrainState.create(apply_fn=dense.apply, params=params, tx=optax.adam(0.1))


@jax.jit
def _linen_step(state, rng, x):
    noise = jax.random.normal(rng, x.shape)
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x + noise) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
@pytest.mark.parametrize("orbax_format", [True, False], ids=["orbax", "msgpack"])
def test_flax_save_checkpoint_restores_a_train_state(tmp_path, orbax_format):
    mesh = mesh_1d(2)
    state = _linen_state(mesh, seed=0)
    previous = flax_config.flax_use_orbax_checkpointing
    flax_config.update("flax_use_orbax_checkpointing", orbax_format)
    try:
        for _ in range(3):
            state = _linen_step(state, jax.random.key(9), jnp.ones((2, 4)))
            checkpoints.save_checkpoint(os.fspath(tmp_path / "old"), state, int(state.step), keep=5)
    finally:
        flax_config.update("flax_use_orbax_checkpointing", previous)
    written = next((tmp_path / "old").glob("checkpoint_3"))
    assert written.is_dir() == orbax_format

    target = _linen_state(mesh, seed=1)
    step, restored = jaxckpt.restore_existing(tmp_path / "old", target)
    assert step == 3 and restored.step == 3
    assert isinstance(restored, ts.TrainState) and restored.apply_fn == target.apply_fn
    assert_tree_equal(restored.params, state.params)
    assert_tree_equal(restored.opt_state, state.opt_state)  # adam's moments and count
    kernel = restored.params["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P())
    assert not restored.opt_state[0].count.committed  # optax made it uncommitted
    fresh_rng = jax.random.key(1)  # made outside the mesh: uncommitted
    assert int(_linen_step(restored, fresh_rng, jnp.ones((2, 4))).step) == 4


def test_nothing_to_restore_is_none(tmp_path):
    target = {"w": jnp.zeros(2)}
    assert jaxckpt.restore_existing(tmp_path / "missing", target) is None
    (tmp_path / "empty").mkdir()
    assert jaxckpt.restore_existing(tmp_path / "empty", target) is None
    with pytest.raises(FileNotFoundError, match=r"no finalized step 3; it has steps none"):
        jaxckpt.restore_existing(tmp_path / "empty", target, step=3)


def test_a_tree_mismatch_names_the_leaf_and_the_step(tmp_path):
    _orbax_save(
        tmp_path / "old", [(2, ocp.args.StandardSave({"w": jnp.zeros(4), "b": jnp.ones(2)}))]
    )
    old = os.fspath(tmp_path / "old")
    with pytest.raises(ValueError, match=rf"Step 2 at {old}/2/default has no leaf 'v'"):
        jaxckpt.restore_existing(old, {"w": jnp.zeros(4), "b": jnp.ones(2), "v": jnp.ones(1)})
    with pytest.raises(ValueError, match=r"holds leaf 'b' that the target lacks"):
        jaxckpt.restore_existing(old, {"w": jnp.zeros(4)})
    with pytest.raises(
        ValueError, match=r"leaf 'w' was saved with shape \(4,\), the target's is \(5,\)"
    ):
        jaxckpt.restore_existing(old, {"w": jnp.zeros(5), "b": jnp.ones(2)})
    with pytest.raises(FileNotFoundError, match=r"no finalized step 7; it has steps \[2\]"):
        jaxckpt.restore_existing(old, {"w": jnp.zeros(4), "b": jnp.ones(2)}, step=7)


def test_steps_holding_a_jaxckpt_item_are_skipped(tmp_path, memory_root):
    directory = tmp_path / "ckpt"
    old = {"w": jnp.arange(3.0)}
    _orbax_save(directory, [(2, ocp.args.StandardSave(old))])
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(directory, handler) as mngr:
        save(mngr, 5, {"w": jnp.zeros(3)})
        mngr.wait_until_finished()
    assert sorted(n for n in os.listdir(directory) if not n.startswith(".")) == ["2", "5"]
    step, restored = jaxckpt.restore_existing(directory, {"w": jnp.zeros(3)})
    assert step == 2
    assert_tree_equal(restored, old)
    with pytest.raises(ValueError, match=r"Step 5 in .* holds a jaxckpt item: restore it with"):
        jaxckpt.restore_existing(directory, {"w": jnp.zeros(3)}, step=5)


@pytest.mark.parametrize("directory", ["new", "old"], ids=["own_directory", "shared_directory"])
def test_an_old_orbax_checkpoint_becomes_the_first_jaxckpt_step(tmp_path, memory_root, directory):
    mesh = mesh_1d(2)
    model = _model(mesh, seed=0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(3):
        _train_step(model, optimizer, jnp.ones((2, 4)))
    old = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    _orbax_save(tmp_path / "old", [(3, ocp.args.StandardSave(old))])
    expected = _host(old)

    # The new job: fresh objects, a jaxckpt manager on a new directory or the old loop's.
    model = _model(mesh, seed=5)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(tmp_path / directory, handler) as mngr:
        step = jaxckpt.latest_restorable_step(mngr)
        assert step is None
        assert (tmp_path / "old" / "3").is_dir()  # the old loop's step is left alone
        found = jaxckpt.restore_existing(
            tmp_path / "old", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        )
        assert found is not None
        step, state = found
        nnx.update(model, state["model"])
        nnx.update(optimizer, state["optimizer"])
        assert step == 3 and int(optimizer.step[...]) == 3
        full_state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        assert_tree_equal(_host(full_state), expected)
        save(mngr, step + 1, full_state)
        mngr.wait_until_finished()
        assert jaxckpt.latest_restorable_step(mngr) == 4
        assert (tmp_path / "old" / "3").is_dir()
        back = restore(mngr, 4, full_state)
    assert_tree_equal(back, full_state)
    _train_step(model, optimizer, jnp.ones((2, 4)))  # the job goes on, on the mesh
    assert int(optimizer.step[...]) == 4


# ---- what a directory holds besides whole steps ------------------------------------------


def _msgpack_save(directory, tree, step):
    previous = flax_config.flax_use_orbax_checkpointing
    flax_config.update("flax_use_orbax_checkpointing", False)
    try:
        checkpoints.save_checkpoint(os.fspath(directory), tree, step, keep=10)
    finally:
        flax_config.update("flax_use_orbax_checkpointing", previous)


def _msgpack_tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(2), jnp.float32),
        },
        "count": jnp.asarray(seed, jnp.int32),
    }


@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
def test_a_msgpack_step_refuses_a_target_that_drops_saved_leaves(tmp_path):
    saved = _msgpack_tree(5)
    _msgpack_save(tmp_path / "old", saved, 5)
    partial = {"params": {"w": jnp.zeros((3, 2))}, "count": jnp.asarray(0, jnp.int32)}
    with pytest.raises(
        ValueError, match=r"checkpoint_5 .*holds leaf 'params\.b' that the target lacks"
    ) as raised:
        jaxckpt.restore_existing(tmp_path / "old", partial)
    assert "Pass a target with the tree the old loop saved" in str(raised.value)
    extra = {**jax.tree.map(jnp.zeros_like, saved), "more": jnp.ones(1)}
    with pytest.raises(ValueError, match=r"has no leaf 'more', which the target has"):
        jaxckpt.restore_existing(tmp_path / "old", extra)
    step, restored = jaxckpt.restore_existing(tmp_path / "old", jax.tree.map(jnp.zeros_like, saved))
    assert step == 5
    assert_tree_equal(restored, saved)


@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", ["flax_msgpack", "orbax_manager"])
def test_names_that_are_not_steps_are_ignored(tmp_path, kind):
    old = tmp_path / "old"
    if kind == "flax_msgpack":
        for step in (3, 7):
            _msgpack_save(old, _msgpack_tree(step), step)
    else:
        _orbax_save(old, [(s, ocp.args.StandardSave(_msgpack_tree(s))) for s in (3, 7)])
    (old / "checkpoint_best").write_bytes(b"a copy the old loop kept")
    (old / "checkpoint_7.bak").write_bytes(b"an operator's backup")
    (old / "checkpoint_9.bak").mkdir()
    (old / "checkpoint_best_dir").mkdir()
    step, restored = jaxckpt.restore_existing(old, jax.tree.map(jnp.zeros_like, _msgpack_tree(0)))
    assert step == 7
    assert_tree_equal(restored, _msgpack_tree(7))


def test_a_checkpoint_written_without_steps_is_step_0(tmp_path):
    tree = _msgpack_tree(4)
    ocp.PyTreeCheckpointer().save(tmp_path / "plain", tree)
    step, restored = jaxckpt.restore_existing(
        tmp_path / "plain", jax.tree.map(jnp.zeros_like, tree)
    )
    assert step == 0
    assert_tree_equal(restored, tree)
    with pytest.raises(FileNotFoundError, match=r"one checkpoint without steps .* not step 3"):
        jaxckpt.restore_existing(tmp_path / "plain", tree, step=3)


@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
def test_a_damaged_newest_msgpack_file_is_named_and_the_older_step_restored(tmp_path, caplog):
    old = tmp_path / "old"
    for step in (3, 7):
        _msgpack_save(old, _msgpack_tree(step), step)
    newest = old / "checkpoint_7"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    target = jax.tree.map(jnp.zeros_like, _msgpack_tree(0))
    with caplog.at_level("WARNING", logger="jaxckpt"):
        step, restored = jaxckpt.restore_existing(old, target)
    assert step == 3
    assert_tree_equal(restored, _msgpack_tree(3))
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and os.fspath(newest) in warned[0], warned
    assert "next older step" in warned[0]
    # Asked for by number, or the only step there is: the file is blamed, never the target.
    with pytest.raises(ValueError, match=rf"{newest} is damaged \(truncated"):
        jaxckpt.restore_existing(old, target, step=7)
    (old / "checkpoint_3").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match=r"checkpoint_7 is damaged"):
        jaxckpt.restore_existing(old, target)


def test_unfinalized_step_directories_are_skipped(tmp_path, caplog):
    """What a save killed in flight leaves: the step directory with its metadata and an
    empty item directory (commit-file finalization keeps it where it is), or Orbax's
    temporary directory; the newest finalized step before it restores."""
    old = tmp_path / "old"
    _orbax_save(old, [(11, ocp.args.StandardSave(_msgpack_tree(11)))])
    (old / "13" / "train").mkdir(parents=True)
    (old / "13" / "_CHECKPOINT_METADATA").write_text(
        (old / "11" / "_CHECKPOINT_METADATA").read_text()
    )
    (old / "14").mkdir()
    (old / "14" / "_CHECKPOINT_METADATA").write_text("{}")
    (old / "15.orbax-checkpoint-tmp-1733200000").mkdir()
    (old / "15.orbax-checkpoint-tmp-1733200000" / "default").mkdir()
    target = jax.tree.map(jnp.zeros_like, _msgpack_tree(0))
    with caplog.at_level("WARNING", logger="jaxckpt"):
        step, restored = jaxckpt.restore_existing(old, target)
    assert step == 11
    assert_tree_equal(restored, _msgpack_tree(11))
    skipped = [r.getMessage() for r in caplog.records if "never finalized" in r.getMessage()]
    assert len(skipped) == 2 and "step 14" in skipped[0] and "step 13" in skipped[1], skipped
    with pytest.raises(ValueError, match=r"Step 13 in .* was never finalized"):
        jaxckpt.restore_existing(old, target, step=13)
