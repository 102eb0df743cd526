"""Bad input gets a clear error naming the leaf path, the process and the step."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _options


def handler(memory_root: str, **kw) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, **kw))


@pytest.fixture
def saved(memory_root, ckpt_dir):
    state = sharded_state(mesh_1d())
    mngr = manager(ckpt_dir, handler(memory_root))
    save(mngr, 3, state)
    mngr.wait_until_finished()
    yield mngr, state
    mngr.close()


def test_unsupported_leaf_names_its_path(memory_root, ckpt_dir):
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        with pytest.raises(TypeError, match=r"leaf at \['opt'\]\['fn'\] of type function"):
            save(mngr, 1, {"opt": {"fn": lambda x: x}, "w": np.ones(2)})
            mngr.wait_until_finished()
        assert mngr.all_steps() == []
        save(mngr, 2, {"w": np.ones(2)})  # the manager still works
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2]


def test_shape_mismatch_names_path_expected_and_actual(saved):
    mngr, state = saved
    target = abstract(state)
    target["w"] = jax.ShapeDtypeStruct((16, 7), np.float32, sharding=state["w"].sharding)
    with pytest.raises(
        ValueError,
        match=r"\[process 0\] Leaf \['w'\] at step 3: expected shape \(16, 6\) \(saved\), the target has \(16, 7\)",
    ):
        restore(mngr, 3, target)


def test_dtype_mismatch_names_path(saved):
    mngr, state = saved
    target = abstract(state)
    target["b"] = jax.ShapeDtypeStruct((5,), np.int32, sharding=state["b"].sharding)
    with pytest.raises(ValueError, match=r"Leaf \['b'\] at step 3: expected dtype float32"):
        restore(mngr, 3, target)


def test_structure_mismatch_lists_missing_and_extra(saved):
    mngr, state = saved
    target = abstract(state)
    del target["h"]
    target["extra"] = jax.ShapeDtypeStruct((1,), np.float32)
    with pytest.raises(
        ValueError,
        match=r"at step 3.*target has leaves the checkpoint lacks: \['extra'\].*checkpoint has leaves the target lacks: \['h'\]",
    ):
        restore(mngr, 3, target)


def test_iterator_target_for_an_array_is_rejected(saved):
    from helpers import fresh_iterator

    mngr, state = saved
    target = abstract(state)
    target["w"] = fresh_iterator()
    with pytest.raises(TypeError, match=r"Leaf \['w'\].*iterator"):
        restore(mngr, 3, target)


def test_a_failed_restore_harms_nothing(saved):
    mngr, state = saved
    target = abstract(state)
    target["w"] = jax.ShapeDtypeStruct((2, 2), np.float32, sharding=NamedSharding(mesh_1d(), P()))
    with pytest.raises(ValueError):
        restore(mngr, 3, target)
    assert_tree_equal(restore(mngr, 3, abstract(state)), state)


def test_unknown_step_names_newest_restorable(saved, ckpt_dir):
    mngr, state = saved
    (ckpt_dir / "9" / "train").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError,
        match=r"Step 9 cannot be restored: .* holds no jaxckpt index manifest. The newest "
        r"restorable step is 3: resume with jaxckpt\.latest_restorable_step\(mngr\)",
    ):
        mngr.restore(
            9,
            args=__import__("orbax.checkpoint").checkpoint.args.Composite(
                train=jaxckpt.TieredRestore(abstract(state))
            ),
        )


def test_unwritable_memory_root_is_reported(tmp_path, ckpt_dir):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mngr = manager(ckpt_dir, handler(str(blocker / "sub")))
    with pytest.raises(PermissionError, match=r"\[process 0\] The memory tier .* is not writable"):
        save(mngr, 1, {"w": np.ones(2)})
        mngr.wait_until_finished()
    assert mngr.all_steps() == []
    with contextlib.suppress(PermissionError):  # Orbax reports a failed save once more
        mngr.close()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"replicas": -1}, r"TierOptions.replicas must be an integer >= 0, got -1"),
        ({"persist_every": 0}, r"TierOptions.persist_every must be an integer >= 1, got 0"),
        ({"memory_keep": 0}, r"memory_keep"),
        ({"persist_compression": "lz77"}, r"persist_compression must be one of"),
        ({"timeout_s": 0}, r"timeout_s must be a positive"),
        ({"run_id": "a/b"}, r"run_id may only hold"),
        ({"replicas": True}, r"replicas must be an integer"),
        ({"spare_slabs": "no"}, r"spare_slabs must be a bool, got 'no'"),
        # Values that used to be accepted and failed only in the first save.
        ({"timeout_s": float("inf")}, r"TierOptions.timeout_s must be a positive, finite.* inf"),
        ({"timeout_s": float("nan")}, r"TierOptions.timeout_s .* got nan"),
        ({"timeout_s": 1e12}, r"TierOptions.timeout_s .*at most 604800"),
        ({"timeout_s": True}, r"TierOptions.timeout_s .* got True"),
        ({"timeout_s": "60"}, r"TierOptions.timeout_s .* got '60'"),
        ({"failure_domain": 7}, r"TierOptions.failure_domain must be None .* got 7"),
        ({"failure_domain": " "}, r"TierOptions.failure_domain .* got ' '"),
        ({"peer_host": ""}, r"TierOptions.peer_host must be an IP address or a host name"),
        ({"peer_host": 7}, r"TierOptions.peer_host .* got 7"),
        ({"peer_host": "my host"}, r"TierOptions.peer_host .* got 'my host'"),
        ({"pinned_host_staging": 1}, r"TierOptions.pinned_host_staging .* got 1"),
        ({"hold_cpu_arrays": 0}, r"TierOptions.hold_cpu_arrays must be a bool, got 0"),
        ({"persist_compression": ["zstd"]}, r"persist_compression must be one of"),
        ({"run_id": 7}, r"TierOptions.run_id may only hold .* got 7"),
    ],
)
def test_options_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        jaxckpt.TierOptions("/dev/shm/x", **kw)


@pytest.mark.parametrize("root", ["", None, b"/dev/shm/x", 7, "/dev/shm/\0x"])
def test_options_need_a_memory_root(root):
    with pytest.raises(ValueError, match=r"TierOptions.memory_root must be a non-empty path"):
        jaxckpt.TierOptions(root)


def test_options_accept_what_they_document(tmp_path):
    options = jaxckpt.TierOptions(
        tmp_path,  # os.PathLike
        timeout_s=_options.MAX_TIMEOUT_S,
        failure_domain="rack-7",
        peer_host="node-3.cluster.local",
        persist_compression="zstd",
        pinned_host_staging=False,
    )
    assert options.memory_root == str(tmp_path)
    jaxckpt.TierOptions("/dev/shm/x", timeout_s=1, peer_host="::1")


def test_the_longest_timeout_saves_and_restores(memory_root, ckpt_dir):
    """The largest timeout the options accept is accepted by every wait it bounds."""
    h = handler(memory_root, persist_every=1, timeout_s=_options.MAX_TIMEOUT_S)
    with manager(ckpt_dir, h) as mngr:
        state = {"w": np.arange(8.0)}
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        assert_tree_equal(restore(mngr, 1, abstract(state)), state)


def test_handler_needs_options():
    with pytest.raises(TypeError, match="needs TierOptions"):
        jaxckpt.TieredCheckpointHandler({"memory_root": "/dev/shm"})
