"""Resuming from the checkpoints a job wrote before it switched to jaxckpt.

A job that switches mid-run has Orbax steps (`StandardSave`, `PyTreeSave`, or a
`Composite` of them: `<root>/<step>/<item>`) or `flax.training.checkpoints`
steps (`<root>/checkpoint_<N>`: an Orbax PyTree directory, or a legacy msgpack
file) on disk. `restore_existing` finds the newest and restores it into the shape
of a target, so the first run on jaxckpt starts where the old loop stopped.

Everything on disk is read by Orbax and flax themselves: Orbax's step-name
helpers find the finalized steps, `PyTreeCheckpointHandler` (which also writes
`StandardSave` items and flax's Orbax-format steps) reads an item, and
`flax.serialization` reads a msgpack file (`_existing_msgpack`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.format import _format
from jaxckpt.persistent import _storage
from jaxckpt.restore import _existing_msgpack

log = logging.getLogger(__name__)


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
    (`<step>/<item>`, any step prefix), a `flax.training.checkpoints` directory
    (`checkpoint_<N>`, Orbax-format or legacy msgpack), or one checkpoint written
    without steps (`ocp.PyTreeCheckpointer().save(directory, tree)`), returned as
    step 0. Steps holding a jaxckpt item are skipped (those are restored with
    `mngr.restore`), and so are step directories a save never finalized (an
    Orbax temporary directory; a step whose item directories are empty) and
    names that are not steps (`checkpoint_best`, `checkpoint_7.bak`). A damaged
    newest msgpack file (truncated) is named in a warning and the next older
    step is restored instead.

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
        `item`, or its tree does not match `target` (naming the leaf: a leaf the
        target has and the step lacks, or one the step holds and the target
        lacks); if `step` was not finalized; if the file of `step`, or of every
        step, is damaged (naming the file).
    """
    start = time.perf_counter()
    root = _storage.absolute(directory)  # Orbax's tensorstore specs need an absolute path
    damaged: _existing_msgpack.DamagedCheckpointError | None = None
    for found in _candidates(root, step, item):
        try:
            restored = _restore_found(found, target)
        except _existing_msgpack.DamagedCheckpointError as e:
            if step is not None:
                raise
            log.warning("jaxckpt: %s Trying the next older step.", e)
            damaged = damaged or e
            continue
        _say_restored(found, time.perf_counter() - start)
        return found.step, restored
    if damaged is not None:  # every step there was is damaged: never a silent fresh start
        raise ValueError(
            f"Every checkpoint restore_existing finds in {root} is damaged; the newest: {damaged}"
        ) from damaged
    log.info("jaxckpt: restore_existing found no Orbax or flax checkpoint in %s", root)
    return None


def _say_restored(found: _Found, seconds: float) -> None:
    """The one INFO line of a `restore_existing` that found a checkpoint."""
    log.info(
        "jaxckpt: [process %d] restored step %d from the old format (%s %s) in %.2f s",
        jax.process_index(),
        found.step,
        "flax msgpack" if found.msgpack else "Orbax PyTree",
        found.path,
        seconds,
    )


def _restore_found(found: _Found, target: Any) -> Any:
    """One found checkpoint restored into `target`'s shape.

    Raises:
      _existing_msgpack.DamagedCheckpointError: if its msgpack file is damaged.
    """
    if found.msgpack:
        return _restore_msgpack(found, _existing_msgpack.read(found.step, found.path), target)
    return _restore_pytree(found, target)


def _candidates(root: epath.Path, step: int | None, item: str | None) -> Iterator[_Found]:
    """What to restore in `root`: `step`, or every step newest first (the caller takes
    the first it can read); nothing if there is none."""
    if not root.exists():
        if step is None:
            return
        raise FileNotFoundError(
            f"There is no directory {root} to restore step {step} from: pass the directory "
            "the old CheckpointManager or flax.training.checkpoints wrote."
        )
    if not root.is_dir():
        raise ValueError(
            f"{root} is a file, not a checkpoint directory: pass the directory holding the "
            "step directories (or flax's checkpoint_<N> files)."
        )
    if ocp.path.format_utils.is_pytree_checkpoint(root):
        # One checkpoint written without steps (`PyTreeCheckpointer().save(root)`); its
        # own subdirectories (`d`, `ocdbt.process_0`) are not steps.
        if step not in (None, 0):
            raise FileNotFoundError(
                f"{root} is one checkpoint without steps (as PyTreeCheckpointer().save "
                f"writes it), restored as step 0, not step {step}: pass step=None."
            )
        yield _Found(0, root, msgpack=False)
        return
    steps = _steps(root)
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(
                f"{root} has no finalized step {step}; it has steps {sorted(steps) or 'none'}. "
                "Pass one of those, or step=None for the newest."
            )
        found = _item_of(root, step, steps[step], item)
        if isinstance(found, str):
            raise ValueError(
                f"Step {step} in {root} {found}: restore_existing does not read it. Pass "
                "another step, or step=None for the newest it reads."
            )
        yield found
        return
    for number in sorted(steps, reverse=True):
        found = _item_of(root, number, steps[number], item)
        if isinstance(found, _Found):
            yield found
        elif found != _JAXCKPT:
            log.warning("jaxckpt: step %d in %s %s; skipped.", number, root, found)


def _steps(root: epath.Path) -> dict[int, epath.Path]:
    """step -> path of every finalized Orbax step directory and flax checkpoint in `root`
    (Orbax's helper leaves out its temporary directories, and names that are no step)."""
    steps = {
        ocp.path.step.step_from_checkpoint_name(p.name): p
        for p in ocp.path.step.checkpoint_steps_paths(root)
    }
    # flax's legacy msgpack checkpoints are files, which Orbax's helper does not list.
    for number, path in _existing_msgpack.steps(root).items():
        steps.setdefault(number, path)
    return steps


# Why a step is not restored: it holds a jaxckpt item (`mngr.restore` reads it).
_JAXCKPT = "holds a jaxckpt item: restore it with mngr.restore(step, args=...)"


def _item_of(root: epath.Path, step: int, path: epath.Path, item: str | None) -> _Found | str:
    """What of step `step` (at `path`) to restore, or why nothing of it is."""
    if path.is_file():
        return _Found(step, path, msgpack=True)
    if ocp.path.format_utils.is_pytree_checkpoint(path):
        return _Found(step, path, msgpack=False)  # flax's checkpoint_<N>: the step is the item
    dirs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    items = sorted(p.name for p in dirs)
    if any(_is_jaxckpt_item(path / name) for name in items):
        return _JAXCKPT
    if not any(any(True for _ in p.iterdir()) for p in dirs):
        # A save that died before its items were written (its step metadata and empty
        # item directories are made first, and kept by commit-file finalization).
        return f"was never finalized (its item directories, {items}, are empty)"
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
    _existing_msgpack.require_same_leaves(
        where,
        saved,
        wanted,
        "Pass a target with the tree the old loop saved (e.g. nnx.state(model) for "
        "StandardSave(nnx.state(model)))",
        "the optimizer state",
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


def _restore_msgpack(found: _Found, saved: Any, target: Any) -> Any:
    """A legacy flax msgpack checkpoint (its state dict `saved`), placed as `target` asks."""
    restored = _existing_msgpack.restore(found.step, found.path, saved, target)
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
