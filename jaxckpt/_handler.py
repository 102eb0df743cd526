"""`TieredCheckpointHandler`: the Orbax handler that ties the tiers together."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args

from jaxckpt import (
    _format,
    _memory_tier,
    _multihost,
    _paths,
    _persister,
    _plan,
    _restore,
    _sharding,
    _snapshot,
    _tree,
    _zarr,
)
from jaxckpt._options import TierOptions

log = logging.getLogger("jaxckpt")


class TieredCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves the whole training state to memory tiers every step, persists some steps.

    Use it with `ocp.CheckpointManager`, through a handler registry or
    `item_handlers=`, alone or inside `ocp.args.Composite`:

        handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions("/dev/shm/ckpt"))
        mngr = ocp.CheckpointManager(path, item_handlers={"train": handler})
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
        state = mngr.restore(step, args=ocp.args.Composite(
            train=jaxckpt.TieredRestore(abstract_state))).train

    `async_save` copies this process's shards to host and returns; writing the
    memory tier, the index manifest and (every `persist_every` steps, on a
    background queue) the persistent copy happen after it returns.
    """

    def __init__(self, options: TierOptions):
        if not isinstance(options, TierOptions):
            raise TypeError(
                f"TieredCheckpointHandler needs TierOptions, got {type(options).__name__}."
            )
        self._options = options
        self._persister = _persister.Persister(options.persist_compression, options.timeout_s)
        self._memory: _memory_tier.MemoryTier | None = None
        self.last_save_metrics: dict[str, float] = {}
        self.last_restore_metrics: dict[str, Any] = {}

    @property
    def options(self) -> TierOptions:
        return self._options

    # ---- save -----------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: TieredSave) -> list[Any]:
        """Snapshots this process's shards to host and returns the commit future."""
        step = _step_of(directory, args.step)
        memory = self._memory_for(directory)
        pi = _multihost.process_index()
        snapshot = _snapshot.take(args.state, pi)
        self.last_save_metrics = {
            "step": step,
            "stall_s": snapshot.stall_s,
            "bytes": snapshot.nbytes,
        }
        log.info(
            "jaxckpt: [process %d] step %d: %d bytes to host in %.3f s",
            pi,
            step,
            snapshot.nbytes,
            snapshot.stall_s,
        )
        commit = self._commit(Path(os.fspath(directory)), step, snapshot, memory, pi)
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                commit, name="jaxckpt_commit", timeout_secs=int(self._options.timeout_s)
            )
        ]

    def save(self, directory: epath.Path, args: TieredSave) -> None:
        """Saves synchronously: `async_save`, then waits for its commit."""

        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        asyncio.run(run())

    async def _commit(
        self,
        directory: Path,
        step: int,
        snapshot: _snapshot.Snapshot,
        memory: _memory_tier.MemoryTier,
        pi: int,
    ) -> None:
        start = time.perf_counter()
        by_leaf: dict[int, list[_snapshot.HostShard]] = {}
        for shard in snapshot.shards:
            by_leaf.setdefault(shard.leaf, []).append(shard)
        staging = memory.new_staging_dir(step, pi)
        try:
            part = _zarr.file_kvstore(str(staging))
            crcs = asyncio.gather(
                *(asyncio.to_thread(_zarr.checksum, s.data) for s in snapshot.shards)
            )
            await asyncio.gather(
                *(
                    _zarr.write_chunks(
                        _zarr.array_kvstore(part, leaf),
                        snapshot.leaves[leaf],
                        [(s.index, s.data) for s in shards],
                    )
                    for leaf, shards in by_leaf.items()
                )
            )
            chunks: dict[int, list[_format.ChunkRecord]] = {}
            for s, crc in zip(snapshot.shards, await crcs, strict=True):
                chunks.setdefault(s.leaf, []).append(
                    _format.ChunkRecord(s.index, crc, s.data.nbytes)
                )
            memory_s = time.perf_counter() - start
            manifest = _format.PartManifest(
                step=step,
                run_id=memory.run_id,
                save_id=uuid.uuid4().hex,
                owner=pi,
                process_count=_multihost.process_count(),
                failure_domain=self._options.resolved_failure_domain,
                leaves=snapshot.leaves,
                chunks={leaf: tuple(cs) for leaf, cs in chunks.items()},
                iterator_states=snapshot.iterator_states,
                created=time.time(),
                metrics={
                    "stall_s": snapshot.stall_s,
                    "memory_write_s": memory_s,
                    "bytes": snapshot.nbytes,
                },
            )
            (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
            committed = memory.commit(staging, step, pi)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # IMPORTANT: the index manifest is written only after the memory part is committed,
        # so an index never points at a memory copy that does not exist yet.
        _write_atomic(directory / _format.index_file(pi), manifest.to_json())
        self.last_save_metrics.update(
            memory_write_s=memory_s, memory_write_bytes_per_s=snapshot.nbytes / max(memory_s, 1e-9)
        )
        if step % self._options.persist_every == 0:
            self._persister.submit(
                _persister.PersistJob(
                    manifest, committed, directory, _paths.final_item_dir(directory)
                )
            )
        memory.retain(self._options.memory_keep, pinned=self._persister.pending_steps())
        for error in self._persister.take_errors():
            log.error("jaxckpt: [process %d] an earlier persistence failed: %s", pi, error)

    # ---- restore --------------------------------------------------------------

    def restore(self, directory: epath.Path, args: TieredRestore | None = None) -> Any:
        """Restores the step in `directory` from the fastest verified copy of each part.

        Raises:
          FileNotFoundError: if the step cannot be restored from any tier; the
            message names the newest step that can.
          ValueError, TypeError: if the target does not match the saved tree.
        """
        start = time.perf_counter()
        item_dir = Path(os.fspath(directory))
        step = _step_of(directory, None)
        memory = self._memory_for(directory)
        pi = _multihost.process_index()
        plan = self._plan_for(item_dir, step, memory, pi)
        if not plan.restorable:
            raise FileNotFoundError(self._not_restorable_message(item_dir, step, plan, memory, pi))
        target = args.abstract_state if args is not None else None
        restorer = _restore.Restorer(plan, self._kvstore_for(item_dir, memory, step), pi)
        try:
            result = _restore_tree(restorer, plan, target, pi, step)
        except _restore.ChunkUnavailableError as e:
            raise FileNotFoundError(
                f"{e}. {self._newest_restorable_sentence(item_dir, memory, pi, exclude=step)}"
            ) from e
        self.last_restore_metrics = {
            "step": step,
            "seconds": time.perf_counter() - start,
            "bytes_by_tier": dict(restorer.bytes_by_tier),
            "tier": max(
                restorer.bytes_by_tier, key=lambda t: _plan.TIER_ORDER.index(t), default="none"
            ),
            "fallbacks": len(restorer.failures),
        }
        log.info("jaxckpt: [process %d] restored step %d: %s", pi, step, self.last_restore_metrics)
        return result

    def _plan_for(
        self, item_dir: Path, step: int, memory: _memory_tier.MemoryTier, pi: int
    ) -> _plan.StepPlan:
        index = _restore.read_index(item_dir)
        held = {pi: _restore.memory_parts(memory, step, index)}
        return _plan.plan_step(step, index, pi, held, _restore.persisted_parts(item_dir, index))

    def _kvstore_for(
        self, item_dir: Path, memory: _memory_tier.MemoryTier, step: int
    ) -> _restore.KvstoreFor:
        def kvstore_for(source: _plan.Source, owner: int) -> dict[str, Any]:
            if source.tier == _plan.MEMORY:
                return _zarr.file_kvstore(str(memory.part_dir(step, owner)))
            if source.tier == _plan.PERSISTENT:
                return _zarr.file_kvstore(str(item_dir / _format.part_dir_name(owner)))
            raise ValueError(f"No reader for {source.describe()}.")

        return kvstore_for

    def restorable_steps(self, directory: epath.Path) -> list[int]:
        """Steps next to `directory` that this process could restore, newest first."""
        memory = self._memory_for(directory)
        pi = _multihost.process_index()
        steps = _paths.sibling_steps(directory)
        return [
            s
            for s in sorted(steps, reverse=True)
            if self._plan_for(steps[s], s, memory, pi).restorable
        ]

    def _newest_restorable_sentence(
        self, item_dir: Path, memory: _memory_tier.MemoryTier, pi: int, exclude: int
    ) -> str:
        newest = [s for s in self.restorable_steps(item_dir) if s != exclude]
        if newest:
            return f"The newest restorable step is {newest[0]}: restore that step instead."
        return "No other step is restorable from any tier."

    def _not_restorable_message(
        self,
        item_dir: Path,
        step: int,
        plan: _plan.StepPlan,
        memory: _memory_tier.MemoryTier,
        pi: int,
    ) -> str:
        if not plan.owners:
            why = f"{item_dir} holds no jaxckpt index manifest"
        else:
            why = (
                f"no verified copy of the part(s) of process(es) {plan.missing} exists in memory, "
                "in a peer's memory or in persistent storage"
            )
        return (
            f"[process {pi}] Step {step} cannot be restored: {why}. "
            + self._newest_restorable_sentence(item_dir, memory, pi, exclude=step)
        )

    # ---- metadata and lifecycle --------------------------------------------

    def metadata(self, directory: epath.Path) -> Any:
        """The saved tree: `jax.ShapeDtypeStruct` per array leaf (with the saved
        sharding when its devices exist here, else without), scalars as saved,
        and this process's iterator state wrapped in `IteratorState`.
        """
        index = _restore.read_index(Path(os.fspath(directory)))
        if not index:
            raise FileNotFoundError(f"{directory} holds no jaxckpt index manifest.")
        pi = _multihost.process_index()
        manifest = index.get(pi, next(iter(index.values())))
        entries = []
        for i, record in enumerate(manifest.leaves):
            entries.append((record.keys, _leaf_metadata(record, manifest.iterator_states.get(i))))
        return _tree.nest(entries)

    def finalize(self, directory: epath.Path) -> None:
        """No-op: parts become visible by their own atomic renames."""

    def close(self) -> None:
        """Drains pending persistence (bounded by `TierOptions.timeout_s`).

        Raises:
          OSError: if a step failed to persist.
        """
        self._persister.close()
        errors = self._persister.take_errors()
        if errors:
            raise OSError(
                f"jaxckpt: {len(errors)} step(s) failed to persist; first: {errors[0]}"
            ) from errors[0]

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """Blocks until every queued step is persisted (or failed)."""
        self._persister.drain(timeout_s)

    def pending_persistence(self) -> set[int]:
        """Steps queued or being written to persistent storage."""
        return self._persister.pending_steps()

    def preservation_policy(self, base: Any) -> Any:
        """An Orbax PreservationPolicy that keeps what `base` keeps plus every step
        still being persisted, so garbage collection never deletes one mid-write.

        Pass it as `CheckpointManagerOptions(preservation_policy=...)`.
        """
        return _KeepPersisting(base, self._persister)

    # ---- helpers --------------------------------------------------------------

    def _memory_for(self, directory: epath.Path | Path) -> _memory_tier.MemoryTier:
        run_id = self._options.run_id or _paths.default_run_id(directory)
        if self._memory is None or self._memory.run_id != run_id:
            memory = _memory_tier.MemoryTier(self._options.memory_root, run_id)
            memory.prepare(str(_paths.checkpoint_root(directory)), _multihost.process_index())
            memory.clear_staging(older_than_s=self._options.timeout_s)
            self._memory = memory
        return self._memory


@dataclasses.dataclass
class _KeepPersisting:
    base: Any
    persister: _persister.Persister

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        keep = self.base.should_preserve(checkpoints, context=context)
        pending = self.persister.pending_steps()
        return [k or c.step in pending for k, c in zip(keep, checkpoints, strict=True)]


class IteratorState:
    """Metadata leaf for a saved iterator: `state` is what `get_state()` returned."""

    def __init__(self, state: Any):
        self.state = state

    def __repr__(self) -> str:
        return f"IteratorState({self.state!r})"


def _leaf_metadata(record: _format.LeafRecord, iterator_state: Any) -> Any:
    if record.kind == _format.ARRAY:
        assert record.shape is not None and record.dtype is not None
        if record.key_impl:
            dtype = jax.eval_shape(lambda: jax.random.key(0, impl=record.key_impl)).dtype
        else:
            dtype = np.dtype(record.dtype)
        return jax.ShapeDtypeStruct(
            record.shape, dtype, sharding=_sharding.rebuild(record.sharding)
        )
    if record.kind == _format.NUMPY:
        assert record.shape is not None and record.dtype is not None
        return jax.ShapeDtypeStruct(record.shape, np.dtype(record.dtype))
    if record.kind == _format.SCALAR:
        return _tree.scalar_value(record)
    return IteratorState(_tree.decode_iterator_state(iterator_state))


def _restore_tree(
    restorer: _restore.Restorer, plan: _plan.StepPlan, target: Any, pi: int, step: int
) -> Any:
    records = plan.leaves
    if target is None:
        values = []
        for i, r in enumerate(records):
            if r.kind in (_format.ARRAY, _format.NUMPY):
                values.append(
                    (
                        r.keys,
                        restorer.host_array(i)
                        if not r.key_impl
                        else jax.random.wrap_key_data(
                            jax.numpy.asarray(restorer.host_array(i)), impl=r.key_impl
                        ),
                    )
                )
            elif r.kind == _format.SCALAR:
                values.append((r.keys, _tree.scalar_value(r)))
            else:
                values.append((r.keys, _tree.decode_iterator_state(restorer.iterator_state(i, pi))))
        return _tree.nest(values)

    pairs, treedef = _tree.flatten(target)
    by_path = {r.path: i for i, r in enumerate(records)}
    missing = [p for p, _ in pairs if p not in by_path]
    extra = sorted(set(by_path) - {p for p, _ in pairs})
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"the target has leaves the checkpoint lacks: {_tree.describe_paths(missing)}"
            )
        if extra:
            parts.append(
                f"the checkpoint has leaves the target lacks: {_tree.describe_paths(extra)}"
            )
        raise ValueError(
            f"[process {pi}] The restore target does not match the tree saved at step {step}: "
            + "; ".join(parts)
            + ". Build the target from the same state structure (mngr.item_metadata(step) shows it)."
        )
    # Validate every leaf before reading any bytes.
    for path, leaf in pairs:
        _check_leaf(records[by_path[path]], leaf, pi, step, plan)
    out = [
        _restore_leaf(restorer, by_path[path], records[by_path[path]], leaf, pi, plan)
        for path, leaf in pairs
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_leaf(
    record: _format.LeafRecord, leaf: Any, pi: int, step: int, plan: _plan.StepPlan
) -> None:
    where = f"[process {pi}] Leaf {record.path or '<root>'} at step {step}"
    if record.kind == _format.ITERATOR:
        if _tree.is_iterator(leaf) and pi not in plan.manifests:
            raise ValueError(
                f"{where}: the checkpoint holds iterator states of {len(plan.owners)} processes and "
                f"none for process {pi}; restore with the same process count."
            )
        return
    if record.kind == _format.SCALAR:
        return
    if _tree.is_iterator(leaf):
        raise TypeError(f"{where}: the target is an iterator but the checkpoint holds an array.")
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{where}: the target {type(leaf).__name__} is not array-like; the checkpoint holds an "
            f"array of shape {record.shape} and dtype {record.dtype}. Use a jax.ShapeDtypeStruct."
        )
    if tuple(shape) != record.shape:
        raise ValueError(
            f"{where}: expected shape {record.shape} (saved), the target has {tuple(shape)}."
        )
    if str(dtype) != record.dtype:
        raise ValueError(f"{where}: expected dtype {record.dtype} (saved), the target has {dtype}.")


def _restore_leaf(
    restorer: _restore.Restorer,
    i: int,
    record: _format.LeafRecord,
    leaf: Any,
    pi: int,
    plan: _plan.StepPlan,
) -> Any:
    if record.kind == _format.SCALAR:
        return _tree.scalar_value(record)
    if record.kind == _format.ITERATOR:
        state = restorer.iterator_state(i, pi)
        if _tree.is_iterator(leaf):
            leaf.set_state(state)
            return leaf
        return state
    sharding = None if isinstance(leaf, np.ndarray) else getattr(leaf, "sharding", None)
    if sharding is None and record.kind == _format.ARRAY and not isinstance(leaf, np.ndarray):
        # A jax.Array saved, no sharding asked for: lay it out as it was saved.
        sharding = _sharding.rebuild(record.sharding)
        if sharding is None:
            raise ValueError(
                f"[process {pi}] Leaf {record.path} at step {plan.step}: the saved sharding "
                f"{record.sharding} uses devices this runtime does not have; give the target "
                "a sharding (jax.ShapeDtypeStruct(shape, dtype, sharding=...))."
            )
    if sharding is None:
        data = restorer.host_array(i)
        return (
            jax.random.wrap_key_data(jax.numpy.asarray(data), impl=record.key_impl)
            if record.key_impl
            else data
        )
    return restorer.array(i, sharding)


def _step_of(directory: epath.Path | Path, explicit: int | None) -> int:
    step = explicit if explicit is not None else _paths.step_of(directory)
    if step is None:
        raise ValueError(
            f"Cannot tell the step of {directory}: save through ocp.CheckpointManager "
            "(step directories are named by step) or pass TieredSave(state, step=...)."
        )
    return step


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


@checkpoint_args.register_with_handler(TieredCheckpointHandler, for_save=True)
@dataclasses.dataclass
class TieredSave(ocp.args.CheckpointArgs):
    """Save the whole training state (a pytree) with `TieredCheckpointHandler`.

    Attributes:
      state: params, optimizer state, typed PRNG keys, iterators, scalars.
      step: only needed outside a CheckpointManager, whose directories name the step.
    """

    state: Any
    step: int | None = None


@checkpoint_args.register_with_handler(TieredCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class TieredRestore(ocp.args.CheckpointArgs):
    """Restore with `TieredCheckpointHandler` into the layout of `abstract_state`.

    Attributes:
      abstract_state: the target tree: `jax.ShapeDtypeStruct` (or arrays) with
        the shardings to restore onto (any mesh), fresh iterator objects whose
        state is set in place, and placeholders for scalars. A `np.ndarray`
        leaf (or a leaf without a sharding where a numpy array was saved) is
        restored as numpy; a saved jax.Array with no target sharding gets its
        saved sharding. None restores everything to host (numpy).
    """

    abstract_state: Any = None
