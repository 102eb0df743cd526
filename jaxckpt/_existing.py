"""Resuming from the checkpoints a job wrote before it switched to jaxckpt.

A job that switches mid-run has Orbax steps (`StandardSave`, `PyTreeSave`, or a
`Composite` of them: `<root>/<step>/<item>`) or `flax.training.checkpoints`
steps (`<root>/checkpoint_<N>`: an Orbax PyTree directory, or a legacy msgpack
file) on disk. `restore_existing` finds the newest and restores it into the shape
of a target, so the first run on jaxckpt starts where the old loop stopped.

Everything on disk is read by Orbax and flax themselves: Orbax's step-name
helpers find the finalized steps, `PyTreeCheckpointHandler` (which also writes
`StandardSave` items and flax's Orbax-format steps) reads an item, and
`flax.training.checkpoints.restore_checkpoint` reads a msgpack file.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import _format, _storage

# flax.training.checkpoints' default name prefix (`checkpoint_<N>`).
_FLAX_PREFIX = "checkpoint_"


def _flax_checkpoints() -> Any:
    """`flax.training.checkpoints`, or None: flax is an extra, not a dependency of jaxckpt."""
    try:
        from flax.training import checkpoints
    except ImportError:
        return None
    return checkpoints


@dataclasses.dataclass(frozen=True)
class _Found:
    """The step to restore: an Orbax PyTree item directory or a flax msgpack file."""

    step: int
    path: epath.Path
    msgpack: bool


def restore_existing(
    directory: str | os.PathLike[str],
    target: Any,
    *,
    step: int | None = None,
    item: str | None = None,
) -> tuple[int, Any] | None:
    """The newest Orbax or flax checkpoint in `directory`, restored into `target`'s shape.

    For a job's first run on jaxckpt, when `jaxckpt.latest_restorable_step(mngr)`
    is None but the loop wrote Orbax or flax checkpoints before it switched:

        step = jaxckpt.latest_restorable_step(mngr)
        if step is None:
            found = jaxckpt.restore_existing("ckpt-before", nnx.state(model))
            if found is not None:
                step, state = found
                nnx.update(model, state)

    and the job continues at `step + 1`; its next `mngr.save` writes the first
    jaxckpt step. `directory` may be an Orbax `CheckpointManager`'s directory
    (`<step>/<item>`, any step prefix) or a `flax.training.checkpoints` directory
    (`checkpoint_<N>`, Orbax-format or legacy msgpack). Steps holding a jaxckpt
    item are skipped: those are restored with `mngr.restore`.

    Args:
      directory: the old checkpoints' directory (local, gs:// or s3://).
      target: the tree to restore into, as saved: e.g. `nnx.state(model)` for a
        `StandardSave(nnx.state(model))`, a linen `TrainState` for a flax
        `save_checkpoint(dir, state, step)`. Concrete arrays or
        `jax.ShapeDtypeStruct`s: committed arrays (and structs with a sharding)
        come back with that sharding; uncommitted ones (a fresh `nnx.Rngs` key
        and count) and structs without a sharding come back uncommitted, so a
        jitted step can combine them with sharded parameters. numpy arrays and
        Python scalars come back as such.
      step: the step to restore instead of the newest.
      item: the item of a multi-item (`Composite`) step to restore; needed when
        a step holds several PyTree items.

    Returns:
      `(step, restored)`, `restored` with the tree structure of `target`; or None
      if `directory` does not exist or holds no such checkpoint (and `step` is None).

    Raises:
      FileNotFoundError: if `step` is given and `directory` has no such checkpoint.
      ValueError: if the step holds several items and `item` is None, has no item
        `item`, or its tree does not match `target` (naming the leaf).
    """
    root = _as_epath(directory)
    found = _find(root, step, item)
    if found is None:
        return None
    if found.msgpack:
        return found.step, _restore_msgpack(found, target)
    return found.step, _restore_pytree(found, target)


def _as_epath(directory: str | os.PathLike[str]) -> epath.Path:
    # Orbax's tensorstore specs need an absolute local path.
    if _storage.is_remote(directory):
        return epath.Path(os.fspath(directory))
    return epath.Path(os.path.abspath(os.fspath(directory)))


def _find(root: epath.Path, step: int | None, item: str | None) -> _Found | None:
    """The step to restore in `root` (the newest, or `step`), or None if there is none."""
    if not root.exists():
        if step is None:
            return None
        raise FileNotFoundError(
            f"There is no directory {root} to restore step {step} from: pass the directory "
            "the old CheckpointManager or flax.training.checkpoints wrote."
        )
    if not root.is_dir():
        raise ValueError(
            f"{root} is a file, not a checkpoint directory: pass the directory holding the "
            "step directories (or flax's checkpoint_<N> files)."
        )
    steps = _steps(root)
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(
                f"{root} has no finalized step {step}; it has steps {sorted(steps) or 'none'}. "
                "Pass one of those, or step=None for the newest."
            )
        found = _item_of(root, step, steps[step], item)
        if found is None:
            raise ValueError(
                f"Step {step} in {root} holds a jaxckpt item: restore it with "
                "mngr.restore(step, args=ocp.args.Composite(...)), not restore_existing."
            )
        return found
    for number in sorted(steps, reverse=True):
        found = _item_of(root, number, steps[number], item)
        if found is not None:
            return found
    return None


def _steps(root: epath.Path) -> dict[int, epath.Path]:
    """step -> path of every finalized Orbax step directory and flax checkpoint in `root`."""
    steps = {
        ocp.path.step.step_from_checkpoint_name(p.name): p
        for p in ocp.path.step.checkpoint_steps_paths(root)
    }
    # flax's legacy msgpack checkpoints are files, which Orbax's helper does not list (and
    # which only flax reads: without flax installed there are none to find).
    flax_checkpoints = _flax_checkpoints()
    if flax_checkpoints is None:
        return steps
    for number in flax_checkpoints.available_steps(os.fspath(root), _FLAX_PREFIX):
        path = root / f"{_FLAX_PREFIX}{number}"
        if path.is_file():
            steps.setdefault(int(number), path)
    return steps


def _item_of(root: epath.Path, step: int, path: epath.Path, item: str | None) -> _Found | None:
    """What of step `step` (at `path`) to restore; None for a step holding a jaxckpt item."""
    if path.is_file():
        return _Found(step, path, msgpack=True)
    if ocp.path.format_utils.is_pytree_checkpoint(path):
        return _Found(step, path, msgpack=False)  # flax's checkpoint_<N>: the step is the item
    items = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if any(_is_jaxckpt_item(path / name) for name in items):
        return None
    pytrees = [name for name in items if ocp.path.format_utils.is_pytree_checkpoint(path / name)]
    if item is not None:
        if item not in pytrees:
            raise ValueError(
                f"Step {step} in {root} has no Orbax PyTree item {item!r}; its PyTree items "
                f"are {pytrees} (of {items}). Pass item= one of those."
            )
        return _Found(step, path / item, msgpack=False)
    if len(pytrees) == 1:
        return _Found(step, path / pytrees[0], msgpack=False)
    if not pytrees:
        raise ValueError(
            f"Step {step} in {root} holds no item written by StandardSave or PyTreeSave "
            f"(its items: {items}): restore_existing cannot read it. Pass step= an older step, "
            "or restore it with the handler that wrote it."
        )
    raise ValueError(
        f"Step {step} in {root} holds several items, {pytrees}: pass item= the one to "
        f"restore (e.g. item={pytrees[0]!r}), and restore the others with their own call."
    )


def _is_jaxckpt_item(path: epath.Path) -> bool:
    # Every jaxckpt item directory holds its step index (or, saved earlier, process 0's
    # index manifest).
    return (path / _format.STEP_INDEX_FILE).exists() or (path / _format.index_file(0)).exists()


def _restore_pytree(found: _Found, target: Any) -> Any:
    """An Orbax PyTree item, read by Orbax's PyTreeCheckpointHandler into `target`'s shape."""
    abstract = jax.tree.map(_abstract, target)
    handler = ocp.PyTreeCheckpointHandler()
    _check_tree(found, handler.metadata(found.path), abstract)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    with ocp.Checkpointer(handler) as checkpointer:
        restored = checkpointer.restore(
            found.path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)
        )
    return jax.tree.map(_finish, target, restored)


def _abstract(x: Any) -> Any:
    """A leaf of the tree Orbax restores: arrays as structs with the sharding to read into."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        sharding = x.sharding if _keeps_sharding(x) else None
        if sharding is None:
            # Read onto one device, then made uncommitted again (`_finish`).
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x


def _keeps_sharding(x: jax.Array | jax.ShapeDtypeStruct) -> bool:
    if isinstance(x, jax.Array):
        return x.committed
    return x.sharding is not None


def _finish(target: Any, value: Any) -> Any:
    """A restored leaf as `target` asks: uncommitted if `target` is."""
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct) and not _keeps_sharding(target):
        return _uncommitted(value)
    return value


def _uncommitted(value: Any) -> jax.Array:
    """`value` on the default device, uncommitted (JAX may move it to any device)."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = jnp.asarray(np.asarray(jax.random.key_data(value)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    return jnp.asarray(np.asarray(value))


def _check_tree(found: _Found, metadata: Any, abstract: Any) -> None:
    """Raises ValueError naming the first leaves where the saved tree and `abstract` differ."""
    saved = ocp.tree.to_flat_dict(getattr(metadata, "tree", metadata))
    wanted = ocp.tree.to_flat_dict(abstract)
    where = f"Step {found.step} at {found.path}"
    missing = [".".join(k) for k in wanted if k not in saved]
    if missing:
        raise ValueError(
            f"{where} has no leaf {missing[0]!r}"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f", which the target has; it holds {_names(saved)}. Pass a target with the "
            "tree the old loop saved (e.g. nnx.state(model) for StandardSave(nnx.state(model)))."
        )
    extra = [".".join(k) for k in saved if k not in wanted]
    if extra:
        raise ValueError(
            f"{where} holds leaf {extra[0]!r}"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + " that the target lacks. Pass a target with the tree the old loop saved "
            "(the optimizer state too, if it saved one)."
        )
    for key, leaf in wanted.items():
        shape = _saved_shape(leaf)
        saved_shape = getattr(saved[key], "shape", None)
        if shape is not None and saved_shape is not None and tuple(saved_shape) != shape:
            raise ValueError(
                f"{where}: leaf {'.'.join(key)!r} was saved with shape {tuple(saved_shape)}, "
                f"the target's is {shape}. Build the target as the old loop did (the same "
                "model configuration)."
            )


def _saved_shape(leaf: Any) -> tuple[int, ...] | None:
    """The shape a target leaf has on disk (a typed PRNG key is saved as its key data)."""
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        return None
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(leaf.shape)


def _names(flat: dict[tuple[str, ...], Any]) -> str:
    names = [".".join(k) for k in flat]
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _restore_msgpack(found: _Found, target: Any) -> Any:
    """A legacy flax msgpack checkpoint, read by flax, placed as `target` asks."""
    try:
        restored = _flax_checkpoints().restore_checkpoint(os.fspath(found.path), target=target)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"Step {found.step} at {found.path} (a flax msgpack checkpoint) does not match "
            f"the target: {e}. Pass a target with the tree the old loop saved."
        ) from e
    return jax.tree_util.tree_map_with_path(
        lambda path, t, v: _place(found, path, t, v), target, restored
    )


def _place(found: _Found, path: Any, target: Any, value: Any) -> Any:
    """A host value read from msgpack, put where `target` says."""
    if not isinstance(target, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        return value
    value = np.asarray(value)
    if value.shape != _saved_shape(target):
        raise ValueError(
            f"Step {found.step} at {found.path}: leaf {jax.tree_util.keystr(path)!r} was saved "
            f"with shape {value.shape}, the target's is {_saved_shape(target)}. Build the "
            "target as the old loop did (the same model configuration)."
        )
    if isinstance(target, np.ndarray):
        return value.astype(target.dtype, copy=False)
    if jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(target) if isinstance(target, jax.Array) else None
        array = jax.random.wrap_key_data(jnp.asarray(value), impl=impl)
    else:
        array = jnp.asarray(value, dtype=target.dtype)
    return jax.device_put(array, target.sharding) if _keeps_sharding(target) else array
