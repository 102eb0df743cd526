"""Every private JAX or Orbax attribute jaxckpt reaches (`jaxckpt/_internals.py`) is
still there in the installed versions.

A release that moves one fails here, by name, with the versions installed and
what to update, rather than in the middle of a save or a restore.
"""

from __future__ import annotations

import orbax.checkpoint as ocp
import pytest

import jaxckpt
from jaxckpt import _internals


def _where(reach: tuple[str, str]) -> str:
    library, path = reach
    return (
        f"jaxckpt reaches the private {path} of {library} {_internals.version(library)} "
        f"(jax {_internals.version('jax')}, orbax-checkpoint "
        f"{_internals.version('orbax-checkpoint')}); if a release moved it, update "
        "jaxckpt/_internals.py and this test"
    )


def test_every_reach_is_listed_with_its_library() -> None:
    assert _internals.REACHED
    for library, path in _internals.REACHED:
        assert _internals.version(library) != "not installed", f"{library} for {path}"


def test_the_jax_distributed_client_is_reachable() -> None:
    where = _where(_internals.DISTRIBUTED_STATE)
    try:
        state = _internals.distributed_state()
    except RuntimeError as e:
        pytest.fail(f"{where}: {e}")
    assert hasattr(state, "client"), f"{where}: global_state has no 'client'"
    # In one process without jax.distributed.initialize() there is no client yet.
    assert _internals.distributed_client() is None, where


def test_a_managers_handlers_are_reachable(tmp_path) -> None:
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(tmp_path / "memory")))
    other = ocp.StandardCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("train", jaxckpt.TieredSave, handler)
    registry.add("train", jaxckpt.TieredRestore, handler)
    registry.add("extra", ocp.args.StandardSave, other)
    with ocp.CheckpointManager(tmp_path / "ckpt", handler_registry=registry) as mngr:
        checkpointer = getattr(mngr, "_checkpointer", None)
        assert checkpointer is not None, _where(_internals.MANAGER_CHECKPOINTER)
        composite = getattr(checkpointer, "handler", None)
        assert hasattr(composite, "_handler_registry"), _where(_internals.COMPOSITE_REGISTRY)
        try:
            found = _internals.manager_handlers(mngr)
        except RuntimeError as e:
            pytest.fail(f"{_where(_internals.COMPOSITE_REGISTRY)}: {e}")
        assert found.get("train") is handler, _where(_internals.COMPOSITE_REGISTRY)
        assert found.get("extra") is other, _where(_internals.COMPOSITE_REGISTRY)


def test_item_handlers_are_reachable_too(tmp_path) -> None:
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(tmp_path / "memory")))
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers={"train": handler}) as mngr:
        found = _internals.manager_handlers(mngr)
    assert found.get("train") is handler, _where(_internals.COMPOSITE_REGISTRY)


def test_an_asynchronous_managers_finalize_thread_is_found(tmp_path, monkeypatch) -> None:
    """While an asynchronous manager deletes an old step on its finalize thread, that
    thread is found; once the save is finished, none is."""
    import shutil
    import threading

    deleting, release = threading.Event(), threading.Event()
    rmtree = shutil.rmtree

    def held(path, *args, **kwargs):
        deleting.set()
        assert release.wait(60)
        return rmtree(path, *args, **kwargs)

    where = _where(_internals.FINALIZE_THREAD)
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
        mngr.save(0, args=ocp.args.Composite(x=ocp.args.StandardSave({"w": 1})))
        mngr.wait_until_finished()
        monkeypatch.setattr(shutil, "rmtree", held)
        mngr.save(1, args=ocp.args.Composite(x=ocp.args.StandardSave({"w": 2})))
        assert deleting.wait(60), "the manager did not delete step 0"
        try:
            threads = _internals.manager_finalize_threads()
        except RuntimeError as e:
            pytest.fail(f"{where}: {e}")
        finally:
            release.set()
        assert len(threads) == 1, where
        threads[0].join(60)
        mngr.wait_until_finished()
        assert _internals.manager_finalize_threads() == []


def test_an_array_can_be_made_weakly_typed() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    where = _where(_internals.CONVERT_ELEMENT_TYPE)
    strong = jax.device_put(np.arange(4, dtype=np.float32))
    try:
        weak = _internals.weakly_typed(strong)
    except RuntimeError as e:
        pytest.fail(f"{where}: {e}")
    assert weak.weak_type and not strong.weak_type, where
    assert weak.dtype == strong.dtype and np.array_equal(weak, strong), where
    assert (weak * jnp.ones(4, jnp.bfloat16)).dtype == jnp.bfloat16, where


def test_a_moved_internal_is_named_with_the_versions() -> None:
    error = _internals.moved(_internals.DISTRIBUTED_STATE, "gone")
    text = str(error)
    assert "jax._src.distributed.global_state.client" in text
    assert _internals.version("jax") in text
    assert "jaxckpt/_internals.py" in text


def test_no_other_module_reaches_a_private_jax_or_orbax_attribute() -> None:
    """`jax._src`, `_checkpointer` and `_handler_registry` appear in `_internals` only."""
    from pathlib import Path

    package = Path(jaxckpt.__file__).parent
    words = ("jax._src", "._checkpointer", '"_checkpointer"', "_handler_registry")
    found = [
        f"{p.relative_to(package)}: {w}"
        for p in sorted(package.rglob("*.py"))
        if p.name != "_internals.py"
        for w in words
        if w in p.read_text()
    ]
    assert not found, f"private JAX/Orbax reaches outside _internals.py: {found}"
