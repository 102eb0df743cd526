"""`TieredCheckpointHandler`: the Orbax handler that ties the tiers together."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from absl import logging as log
from etils import epath
from orbax.checkpoint import checkpoint_args

from jaxckpt import (
    _faults,
    _format,
    _fs,
    _memory_tier,
    _multihost,
    _paths,
    _persister,
    _placement,
    _plan,
    _restore,
    _snapshot,
    _target,
    _tree,
    _zarr,
)
from jaxckpt._options import TierOptions
from jaxckpt.peer import _peers


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

    def __init__(
        self,
        options: TierOptions,
        *,
        on_metrics: Callable[[dict[str, Any]], None] | None = None,
    ):
        if not isinstance(options, TierOptions):
            raise TypeError(
                f"TieredCheckpointHandler needs TierOptions, got {type(options).__name__}."
            )
        self._options = options
        self._persister = _persister.Persister(
            options.persist_compression, options.timeout_s, on_persisted=self._publish
        )
        self._memory: _memory_tier.MemoryTier | None = None
        self._peers: _peers.Peers | None = None
        self._retainer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxckpt-retain"
        )
        self._on_metrics = on_metrics
        self.last_save_metrics: dict[str, Any] = {}
        self.last_restore_metrics: dict[str, Any] = {}
        self.last_persist_metrics: dict[str, Any] = {}

    @property
    def options(self) -> TierOptions:
        return self._options

    # ---- save -----------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: TieredSave) -> list[Any]:
        """Snapshots this process's shards to host and returns the commit future.

        Bad input (an unsupported leaf, an unwritable memory root, ...) is logged
        at once and raised by the returned future, that is by `mngr.save()` in a
        synchronous manager and by `wait_until_finished()` or the next `save()`
        in an asynchronous one. Raising here instead would strand Orbax's
        directory-creation threads; the step is not finalized either way.
        """
        pi = _multihost.process_index()
        started = time.perf_counter()
        try:
            step = _step_of(directory, args.step)
            memory = self._memory_for(directory)
            snapshot = _snapshot.take(args.state, pi)  # validates every leaf first
            peers = self._connect(memory)  # collective, once per run: after local validation
            self._check_placement(peers)
            _faults.maybe_crash("snapshot", step, pi)
        except Exception as error:
            log.error("jaxckpt: [process %d] save into %s refused: %s", pi, directory, error)
            commit = _raise(error)
        else:
            metrics = {"event": "save", "step": step, "process": pi, "bytes": snapshot.nbytes}
            metrics["stall_s"] = time.perf_counter() - started
            commit = self._commit(
                Path(os.fspath(directory)), step, snapshot, memory, pi, metrics, started
            )
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
        metrics: dict[str, Any],
        started: float,
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
            metrics["memory_write_s"] = memory_s = time.perf_counter() - start
            metrics["memory_write_bytes_per_s"] = snapshot.nbytes / max(memory_s, 1e-9)
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
                metrics=dict(metrics),
            )
            (staging / _format.MANIFEST_FILE).write_text(manifest.to_json())
            _faults.maybe_crash("memory_write", step, pi)
            committed = memory.commit(staging, step, pi)
            _faults.maybe_crash("memory_commit", step, pi)
        except BaseException:
            _fs.remove_entry(staging)
            raise
        metrics["safe_in_memory_s"] = time.perf_counter() - started
        if self._peers is not None and self._options.replicas:
            push_start = time.perf_counter()
            sent = await self._peers.push_replicas(committed, step, pi)
            metrics["replicate_s"] = push_s = time.perf_counter() - push_start
            metrics["replicate_bytes"] = sent
            metrics["replicate_bytes_per_s"] = sent / max(push_s, 1e-9)
            metrics["safe_on_peers_s"] = time.perf_counter() - started
            _faults.maybe_crash("replicated", step, pi)
        # IMPORTANT: the index manifest is written only after the memory part is committed
        # (and replicated), so an index never points at copies that do not exist yet.
        manifest = dataclasses.replace(manifest, metrics=dict(metrics))
        _fs.write_atomic(directory / _format.index_file(pi), manifest.to_json())
        _faults.maybe_crash("index", step, pi)
        self._publish(metrics)
        if step % self._options.persist_every == 0:
            self._persister.submit(
                _persister.PersistJob(
                    manifest,
                    committed,
                    directory,
                    _paths.final_item_dir(directory),
                    pin=memory.pin(step),
                )
            )
        # IMPORTANT: older steps leave memory only once this one is finalized, so that
        # a crash at any moment leaves a finalized step in memory.
        self._retainer.submit(self._retain, memory, directory, step)

    # ---- restore --------------------------------------------------------------

    def restore(self, directory: epath.Path, args: TieredRestore | None = None) -> Any:
        """Restores the step in `directory` from the fastest verified copy of each part.

        Collective: every process calls it for the same step. The processes
        exchange what their memory tiers hold, and all reach the same verdict on
        whether the step is restorable before any of them reads a byte.

        Raises:
          FileNotFoundError: if the step cannot be restored from any tier; the
            message names the newest step that can.
          ValueError, TypeError: if the target does not match the saved tree.
          TimeoutError: if another process does not take part within the timeout.
        """
        start = time.perf_counter()
        args = args if args is not None else TieredRestore()
        item_dir = Path(os.fspath(directory))
        step = _step_of(directory, None)
        memory = self._memory_for(directory)
        pi = _multihost.process_index()
        index = _restore.read_index(item_dir)
        count = _multihost.process_count()
        fn = args.iterator_state_fn
        if index:  # validate the target before any collective, so all fail alike
            leaves = next(iter(index.values())).leaves
            ctx = _target.Context(index, pi, count, step, fn)
            _target.check(leaves, args.abstract_state, ctx)
        view = self._global_view(directory, memory)
        plan = view.plan(step, item_dir)
        if not plan.restorable:
            raise FileNotFoundError(view.not_restorable_message(item_dir, plan))
        restorer = _restore.Restorer(
            plan,
            self._kvstore_for(item_dir, memory, step),
            pi,
            self._redact,
            timeout_s=self._options.timeout_s,
        )
        try:
            ctx = _target.Context(plan.manifests, pi, count, step, fn)
            result = _target.fill(restorer, plan.leaves, args.abstract_state, ctx)
        except _restore.ChunkUnavailableError as e:
            raise FileNotFoundError(
                f"{self._redact(str(e))}. {view.newest_restorable_sentence(exclude=step)}"
            ) from e
        by_tier = restorer.bytes_by_tier
        self._publish(
            {
                "event": "restore",
                "process": pi,
                "step": step,
                "seconds": time.perf_counter() - start,
                "bytes_by_tier": dict(by_tier),
                "tier": max(by_tier, key=by_tier.__getitem__) if by_tier else "none",
                "fallbacks": len(restorer.failures),
            }
        )
        return result

    def _global_view(
        self, directory: epath.Path | Path, memory: _memory_tier.MemoryTier
    ) -> _restore.GlobalView:
        """What every process holds in memory, for every finalized step (collective)."""
        steps = _paths.sibling_steps(directory)
        current = Path(os.fspath(directory))
        step = _paths.step_of(directory)
        if step is not None and current.is_dir():
            steps[step] = current
        local = {
            s: _restore.memory_parts(memory, s, _restore.read_index(steps[s]))
            for s in memory.steps()
            if s in steps
        }
        peers = self._connect(memory)
        inventories = (
            peers.exchange_inventories(local) if peers else {_multihost.process_index(): local}
        )
        return _restore.GlobalView(steps, inventories, _multihost.process_index())

    def _kvstore_for(
        self, item_dir: Path, memory: _memory_tier.MemoryTier, step: int
    ) -> _restore.KvstoreFor:
        def kvstore_for(source: _plan.Source, owner: int) -> dict[str, Any]:
            if source.tier == _plan.MEMORY:
                return _zarr.file_kvstore(str(memory.part_dir(step, owner)))
            if source.tier == _plan.PEER and self._peers is not None and source.holder is not None:
                return self._peers.part_kvstore(source.holder, step, owner)
            if source.tier == _plan.PERSISTENT:
                return _zarr.file_kvstore(str(item_dir / _format.part_dir_name(owner)))
            raise ValueError(f"No reader for {source.describe()}.")

        return kvstore_for

    def _retain(self, memory: _memory_tier.MemoryTier, directory: Path, step: int) -> None:
        """Once `step` is finalized, bounds the memory tier to `memory_keep` steps."""
        try:
            _paths.wait_finalized(
                directory, _paths.final_item_dir(directory), step, self._options.timeout_s
            )
        except OSError as e:  # not finalized: keep everything
            log.warning("jaxckpt: memory retention skipped after step %d: %s", step, e)
            return
        memory.retain(self._options.memory_keep, upto=step, pinned=self._persister.pending_steps())

    def _check_placement(self, peers: _peers.Peers | None) -> None:
        """Raises ValueError if `replicas` copies cannot live outside each owner's domain."""
        if peers is not None:
            peers.holders  # noqa: B018 -- computing the placement validates it
        else:
            _placement.place_replicas(
                [self._options.resolved_failure_domain], self._options.replicas
            )

    def _publish(self, metrics: dict[str, Any]) -> None:
        """Hands a save's or restore's measurements to the log and the user's callback."""
        if metrics["event"] == "save":
            self.last_save_metrics = metrics
        elif metrics["event"] == "restore":
            self.last_restore_metrics = metrics
        else:
            self.last_persist_metrics = metrics
        log.info("jaxckpt: %s", metrics)
        if self._on_metrics is not None:
            self._on_metrics(dict(metrics))

    def _redact(self, text: str) -> str:
        return self._peers.redact(text) if self._peers is not None else text

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
            entries.append(
                (record.keys, _target.leaf_metadata(record, manifest.iterator_states.get(i)))
            )
        return _tree.nest(entries)

    def finalize(self, directory: epath.Path) -> None:
        """No-op: parts become visible by their own atomic renames."""

    def close(self) -> None:
        """Drains pending persistence (bounded by `TierOptions.timeout_s`).

        Raises:
          OSError: if a step failed to persist.
        """
        try:
            self._retainer.shutdown(wait=True)
            self._retainer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxckpt-retain"
            )
            self._persister.close()
        finally:
            if self._peers is not None:
                self._peers.close()
                self._peers = None
        errors = self._persister.take_errors()
        if errors:
            raise OSError(
                f"jaxckpt: {len(errors)} step(s) failed to persist; first: {errors[0]}"
            ) from errors[0]

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """Blocks until the background work queued so far (memory retention,
        persistence) is done, or failed.

        Raises:
          TimeoutError: if it is not done within `timeout_s` (default: the options').
        """
        timeout_s = self._options.timeout_s if timeout_s is None else timeout_s
        self._retainer.submit(lambda: None).result(timeout=timeout_s)
        self._persister.drain(timeout_s)
        errors = self._persister.take_errors()
        if errors:
            raise OSError(
                f"jaxckpt: {len(errors)} step(s) failed to persist; first: {errors[0]}"
            ) from errors[0]

    def restorable_steps(self, item_dir: epath.Path | Path) -> list[int]:
        """Every finalized step next to `item_dir` that can be restored from some tier.

        Collective: every process calls it; the processes exchange what their
        memory tiers hold (bounded by `TierOptions.timeout_s`) and all get the
        same answer.

        Args:
          item_dir: any `<checkpoint dir>/<step>/<item>` directory of this item
            (the step need not exist).

        Returns:
          The restorable steps, newest first.
        """
        return self._global_view(item_dir, self._memory_for(item_dir)).restorable_steps()

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

    def _connect(self, memory: _memory_tier.MemoryTier) -> _peers.Peers | None:
        """Meets the other processes once per run (collective); None in one process."""
        if _multihost.process_count() == 1:
            return None
        if self._peers is None or self._peers.run_id != memory.run_id:
            if self._peers is not None:
                self._peers.close()
            self._peers = _peers.Peers.connect(memory, self._options)
        return self._peers

    def _memory_for(self, directory: epath.Path | Path) -> _memory_tier.MemoryTier:
        run_id = self._options.run_id or _paths.default_run_id(directory)
        if self._memory is None or self._memory.run_id != run_id:
            memory = _memory_tier.MemoryTier(self._options.memory_root, run_id)
            memory.prepare(
                str(_paths.checkpoint_root(directory)),
                _multihost.process_index(),
                self._options.resolved_failure_domain,
            )
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


async def _raise(error: BaseException) -> None:
    raise error


def _step_of(directory: epath.Path | Path, explicit: int | None) -> int:
    step = explicit if explicit is not None else _paths.step_of(directory)
    if step is None:
        raise ValueError(
            f"Cannot tell the step of {directory}: save through ocp.CheckpointManager "
            "(step directories are named by step) or pass TieredSave(state, step=...)."
        )
    return step


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
      iterator_state_fn: only needed to restore iterators onto another process
        count when each process saved a different state: called as
        `fn(saved_states, process_index, process_count)`, it returns this
        process's state. Not needed when the saved states are identical.
    """

    abstract_state: Any = None
    iterator_state_fn: _target.IteratorStateFn | None = None
