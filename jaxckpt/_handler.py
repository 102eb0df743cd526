"""`TieredCheckpointHandler`: the Orbax handler that ties the tiers together."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from absl import logging as log
from etils import epath
from orbax.checkpoint import checkpoint_args

from jaxckpt import (
    _agreement,
    _aio,
    _commit,
    _faults,
    _format,
    _memory_tier,
    _multihost,
    _paths,
    _persister,
    _placement,
    _plan,
    _readers,
    _restore,
    _retention,
    _slab,
    _snapshot,
    _storage,
    _target,
    _tree,
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
    memory tier, the push to peers and the index manifest happen in its commit
    future (`_commit`), the persistent copy (every `persist_every` steps) on a
    background queue.
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
        # Set while closing: the manager has finished, so background waits for a
        # step's finalization end at once (a step not finalized by now never will be).
        self._closing = threading.Event()
        # Commits of saves returned by `async_save` that have not ended yet.
        self._commits_in_flight = 0
        self._commits_done = threading.Condition()
        self._persister = _persister.Persister(
            options.persist_compression,
            options.timeout_s,
            on_persisted=self._publish,
            closing=self._closing,
            on_failed=self._publish,
        )
        self._memory: _memory_tier.MemoryTier | None = None
        self._peers: _peers.Peers | None = None
        self._retainer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxckpt-retain"
        )
        self._retention_errors: list[BaseException] = []  # appended by the retainer thread
        self._keeper = _retention.Keeper(options.persist_every, self._persister.pending_steps)
        self._on_metrics = on_metrics
        self.last_save_metrics: dict[str, Any] = {}
        self.last_restore_metrics: dict[str, Any] = {}
        self.last_persist_metrics: dict[str, Any] = {}
        # Garbage collection keeps the newest durable step whatever the manager's options.
        _retention.guard_garbage_collection()

    @property
    def options(self) -> TierOptions:
        return self._options

    # ---- save -----------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: TieredSave) -> list[Any]:
        """Snapshots this process's shards to host and returns the commit future.

        An unsupported leaf or dtype is refused earlier, when `TieredSave` is
        built. Other bad input (an unwritable memory root, an iterator state
        that is not JSON, ...) is logged at once and raised by the returned
        future, that is by `mngr.save()` in a synchronous manager and by
        `wait_until_finished()` or the next `save()` in an asynchronous one.
        Raising here instead would strand Orbax's directory-creation threads;
        the step is not finalized either way.
        """
        pi = _multihost.process_index()
        started = time.perf_counter()
        # At once, not through the commit: no step, no save (every process sees the same
        # directory, so all refuse alike, before any collective).
        _step_of(directory, args.step)
        tag = self._tag("save", directory)
        step, memory = args.step, None
        refused: Exception | None = None
        staged: _memory_tier.StagedSlab | None = None
        try:
            step = _step_of(directory, args.step)
            memory = self._memory_for(directory)
            memory.require_writable(step)
            # Validates every leaf first.
            snapshot = _snapshot.take(args.state, pi, self._options.pinned_host_staging)
        except Exception as error:
            refused = error
        try:
            # IMPORTANT: a process that refused the save still meets its peers (collective,
            # once per run), so that every process takes part in the same exchanges; the
            # refusal is agreed on in the commit, where every process raises it.
            if memory is None:  # only after an error
                self._decline(directory, refused or RuntimeError("no memory tier"))
            else:
                self._check_placement(self._connect(memory))
                cpu = refused is None and snapshot.staging == "cpu_view"
                if cpu and not self._options.hold_cpu_arrays:
                    assert step is not None  # set when nothing was refused
                    # The copy lets go of the arrays: JAX may donate them to the next
                    # train step (a declined donation costs that step more than the copy).
                    release = [s.release() for s in snapshot.shards]
                    staged = memory.stage_slab(step, pi, release, checksum=False)
        except Exception as error:
            refused = refused or error
        if refused is not None or memory is None:
            refused = refused or RuntimeError("no memory tier")
            log.error("jaxckpt: [process %d] save into %s refused: %s", pi, directory, refused)
            commit = _commit.refused(tag, step, refused, self._services())
        else:
            assert step is not None  # set when nothing was refused
            _faults.maybe_crash("snapshot", step, pi)
            metrics = {"event": "save", "step": step, "process": pi, "bytes": snapshot.nbytes}
            metrics["stall_s"] = time.perf_counter() - started
            metrics["host_staging"] = "slab" if staged else snapshot.staging
            if staged is not None:
                metrics["slab_copy_s"] = staged.seconds
            save = _commit.Save(
                _storage.as_path(directory), step, snapshot, memory, pi, metrics, started, staged
            )
            commit = _commit.commit(tag, save, self._services())
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._counted(commit),
                name="jaxckpt_commit",
                timeout_secs=int(self._options.timeout_s),
            )
        ]

    def _services(self) -> _commit.Services:
        """What the commit of a save started now uses of this handler."""

        def committed(memory: _memory_tier.MemoryTier, directory: Path, step: int) -> None:
            self._retainer.submit(self._retain, memory, directory, step)

        return _commit.Services(
            self._options,
            self._peers,
            self._persister,
            self._publish,
            self._publish_failure,
            committed,
        )

    def _counted(self, commit: Awaitable[None]) -> Awaitable[None]:
        """`commit`, counted as in flight from now until it ends (`wait_for_persistence`
        waits for the commits of the saves made so far: they queue the persistence)."""
        with self._commits_done:
            self._commits_in_flight += 1

        async def run() -> None:
            try:
                await commit
            finally:
                with self._commits_done:
                    self._commits_in_flight -= 1
                    self._commits_done.notify_all()

        return run()

    def save(self, directory: epath.Path, args: TieredSave) -> None:
        """Saves synchronously: `async_save`, then waits for its commit."""

        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        _aio.run_sync(run())  # also from a thread that runs an event loop (Jupyter)

    # ---- restore --------------------------------------------------------------

    def restore(self, directory: epath.Path, args: TieredRestore | None = None) -> Any:
        """Restores the step in `directory` from the fastest verified copy of each part.

        Collective: every process calls it for the same step. The processes
        exchange what their memory tiers hold, and all reach the same verdict on
        whether the step is restorable before any of them reads a byte. Any error
        is agreed on before it returns: if one process fails, every process
        raises (the same built-in type, naming the process), so none is left
        waiting at the CheckpointManager's barrier.

        Raises:
          FileNotFoundError: if the step cannot be restored from any tier; the
            message names the newest step that can.
          ValueError, TypeError: if the target does not match the saved tree.
          TimeoutError: if another process does not take part within the timeout.
        """
        try:
            result = self._restore_locally(directory, args)
        except Exception as error:
            self._publish_failure("restore", _paths.step_of(directory), error)
            if not _agreement.is_agreed(error):
                self._agree("restore", directory, error)
            raise
        self._agree("restore", directory, None)
        return result

    def _restore_locally(self, directory: epath.Path, args: TieredRestore | None) -> Any:
        """`restore` on this process; a failing process still takes part in the exchanges."""
        start = time.perf_counter()
        # Slabs removed since the last save (a lost memory tier, another process's
        # retention) are still mapped here, their pages held: let them go before the
        # restore allocates the target's buffers.
        _slab.forget_unlinked()
        args = args if args is not None else TieredRestore()
        item_dir = _storage.as_path(directory)
        step = _step_of(directory, None)
        pi = _multihost.process_index()
        index = _restore.read_index(item_dir)
        recorded = index.get(pi) or next(iter(index.values()), None)
        with self._taking_part(directory, recorded, None):
            memory = self._memory_for(directory, recorded=recorded)
        count = _multihost.process_count()
        fns = (args.iterator_state_fn, args.per_process_fn)
        if index:  # validate the target before reading; agreed on in `restore`
            leaves = next(iter(index.values())).leaves
            ctx = _target.Context(index, pi, count, step, *fns)
            with self._taking_part(directory, recorded, memory):
                _target.check(leaves, args.abstract_state, ctx)
        view = self._global_view(directory, memory)
        plan = view.plan(step, item_dir)
        if not plan.restorable:
            raise FileNotFoundError(view.not_restorable_message(item_dir, plan))
        # IMPORTANT: the step's slabs are read in place (mapped) and lent to the restored
        # arrays; a pin keeps the step from being retired (by any process sharing the
        # memory root) before they are marked lent, which keeps them from being reused.
        plan, pin = _restore.pin_memory(memory, plan, pi)
        restorer = _restore.Restorer(
            plan,
            self._reader_for(item_dir, memory, step),
            pi,
            self._redact,
            timeout_s=self._options.timeout_s,
        )
        try:
            ctx = _target.Context(plan.manifests, pi, count, step, *fns)
            result = _target.fill(restorer, plan.leaves, args.abstract_state, ctx)
        except _restore.ChunkUnavailableError as e:
            raise FileNotFoundError(
                f"{self._redact(str(e))}. {view.newest_restorable_sentence(exclude=step)}"
            ) from e
        finally:
            if pin is not None:
                pin.release()
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
        steps: dict[int, Path] = {}
        local: _peers.Inventory = {}
        try:
            steps = _paths.sibling_steps(directory)
            current = _storage.as_path(directory)
            step = _paths.step_of(directory)
            if step is not None and current.is_dir():
                steps[step] = current
            local = {
                s: _restore.memory_parts(memory, s, _restore.read_index(steps[s]))
                for s in memory.steps()
                if s in steps
            }
        except OSError as e:
            # IMPORTANT: still take part in the exchange below (the others wait in it),
            # offering nothing: the restore reads from peers or persistent storage instead.
            pi = _multihost.process_index()
            log.warning("jaxckpt: [process %d] cannot list what it holds: %s", pi, e)
        peers = self._connect(memory)
        inventories = (
            peers.exchange_inventories(local) if peers else {_multihost.process_index(): local}
        )
        return _restore.GlobalView(steps, inventories, _multihost.process_index())

    def _reader_for(
        self, item_dir: Path, memory: _memory_tier.MemoryTier, step: int
    ) -> _restore.ReaderFor:
        def reader_for(source: _plan.Source, owner: int) -> _readers.ChunkReader:
            if source.tier == _plan.MEMORY:
                return _readers.SlabReader(memory.slab(step, owner), memory.lend(step, owner))
            if source.tier == _plan.PEER and self._peers is not None and source.holder is not None:
                return _readers.RangeReader(
                    self._peers.slab_range_reader(source.holder, step, owner)
                )
            if source.tier == _plan.PERSISTENT:
                return _readers.ZarrReader(
                    _storage.kvstore(item_dir / _format.part_dir_name(owner))
                )
            raise ValueError(f"No reader for {source.describe()}.")

        return reader_for

    def _retain(self, memory: _memory_tier.MemoryTier, directory: Path, step: int) -> None:
        """Once `step` is finalized, bounds the memory tier to `memory_keep` steps.

        Runs on the retainer thread; a failure is recorded and raised by the next
        `wait_for_persistence()` or `close()` (nobody reads this call's future).
        """
        try:
            _paths.wait_finalized(
                directory,
                _paths.final_item_dir(directory),
                step,
                self._options.timeout_s,
                self._closing,
            )
        except OSError as e:  # not finalized: keep everything
            log.warning("jaxckpt: memory retention skipped after step %d: %s", step, e)
            return
        try:
            memory.retain(
                self._options.memory_keep, upto=step, pinned=self._persister.pending_steps()
            )
        except Exception as e:
            log.exception("jaxckpt: memory retention after step %d failed", step)
            error = OSError(
                f"[process {_multihost.process_index()}] Memory retention after step {step} "
                f"in {memory.run_dir} failed: {e}. Older steps stay in memory until it "
                "succeeds; check that the memory root is writable and has free space."
            )
            error.__cause__ = e
            self._retention_errors.append(error)

    def _check_placement(self, peers: _peers.Peers | None) -> None:
        """Raises ValueError if `replicas` copies cannot live outside each owner's domain."""
        if peers is not None:
            peers.holders  # noqa: B018 -- computing the placement validates it
        else:
            _placement.place_replicas(
                [self._options.resolved_failure_domain], self._options.replicas
            )

    def _publish_failure(self, operation: str, step: int | None, error: BaseException) -> None:
        """Hands a failed save or restore to the user's callback (`<operation>_failed`)."""
        self._publish(
            {
                "event": f"{operation}_failed",
                "process": _multihost.process_index(),
                "step": step,
                "error": self._redact(str(error)),
            }
        )

    def _publish(self, metrics: dict[str, Any]) -> None:
        """Hands a save's, persist's or restore's measurements (or failure) to the log and
        the user's callback."""
        if metrics["event"] == "save":
            self.last_save_metrics = metrics
        elif metrics["event"] == "restore":
            self.last_restore_metrics = metrics
        elif metrics["event"] == "persist":
            self.last_persist_metrics = metrics
        log.info("jaxckpt: %s", metrics)
        if self._on_metrics is not None:
            # The user's callback is no part of checkpointing: its failure must not fail
            # a save or a restore, nor be taken for a failed persist.
            try:
                self._on_metrics(dict(metrics))
            except Exception:
                log.exception(
                    "jaxckpt: the on_metrics callback failed on the %s event of step %s; "
                    "checkpointing is not affected",
                    metrics.get("event"),
                    metrics.get("step"),
                )

    def _redact(self, text: str) -> str:
        return self._peers.redact(text) if self._peers is not None else text

    # ---- metadata and lifecycle --------------------------------------------

    def metadata(self, directory: epath.Path) -> Any:
        """The saved tree: `jax.ShapeDtypeStruct` per array leaf (with the saved
        sharding when its devices exist here, else without; without for an array
        saved uncommitted), scalars as saved, and this process's iterator state
        wrapped in `IteratorState`. Per-process leaves show this process's own
        saved value (another process count: process 0's).

        Every node is nested as dicts and lists; the result is a restore target
        for any saved tree (leaves are matched by key names).
        """
        index = _restore.read_index(_storage.as_path(directory))
        if not index:
            raise FileNotFoundError(f"{directory} holds no jaxckpt index manifest.")
        pi = _multihost.process_index()
        same_count = {m.process_count for m in index.values()} == {_multihost.process_count()}
        # Per-process leaves show this process's own value, which only exists on the same count.
        manifest = index[pi] if same_count and pi in index else index[min(index)]
        entries = []
        for i, record in enumerate(manifest.leaves):
            entries.append((record.keys, _target.leaf_metadata(i, record, manifest)))
        return _tree.nest(entries)

    def finalize(self, directory: epath.Path) -> None:
        """No-op: parts become visible by their own atomic renames."""

    def close(self) -> None:
        """Drains pending persistence (bounded by `TierOptions.timeout_s`).

        Raises:
          OSError: if a step failed to persist, or memory retention failed.
          TimeoutError: if persistence is not done within the timeout (it goes on
            in the background; a later save reuses the same worker).
        """
        # Orbax closes its handlers after its own finalization is done (and a user
        # closing the handler directly has no save in flight).
        self._closing.set()
        try:
            self._retainer.shutdown(wait=True)
            self._retainer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxckpt-retain"
            )
            self._persister.close()
        finally:
            self._closing.clear()
            if self._peers is not None:
                self._peers.close()
                self._peers = None
            _slab.forget_all()  # the slabs stay in the tier, unmapped
        self._raise_background_errors()

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """Blocks until the saves made so far have ended their commits and the
        background work they queued (memory retention, persistence) is done, or
        failed: right after an asynchronous manager's `save()`, it waits for that
        step's persistence too.

        Raises:
          TimeoutError: if it is not done within `timeout_s` (default: the options').
        """
        timeout_s = self._options.timeout_s if timeout_s is None else timeout_s
        # The commits of the saves made so far first: they queue the persistence (an
        # asynchronous manager's save returns before its commit has run).
        with self._commits_done:
            if not self._commits_done.wait_for(
                lambda: self._commits_in_flight == 0, timeout=timeout_s
            ):
                raise TimeoutError(
                    f"[process {_multihost.process_index()}] {self._commits_in_flight} save(s) "
                    f"did not end their commit within {timeout_s:.0f} s; see the manager's "
                    "wait_until_finished() for why."
                )
        self._retainer.submit(lambda: None).result(timeout=timeout_s)
        self._persister.drain(timeout_s)
        self._raise_background_errors()

    def _raise_background_errors(self) -> None:
        """Raises what failed on the background threads since the last call, if anything.

        Raises:
          OSError: naming the failed persists and retention runs, chained to the first.
        """
        persist = self._persister.take_errors()
        retention, self._retention_errors = self._retention_errors, []
        said = []
        if persist:
            said.append(f"{len(persist)} step(s) failed to persist; first: {persist[0]}")
        if retention:
            said.append(f"memory retention failed {len(retention)} time(s); first: {retention[0]}")
        if said:
            raise OSError("jaxckpt: " + "; ".join(said)) from (persist or retention)[0]

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
        error: BaseException | None = None
        steps: list[int] = []
        try:
            with self._taking_part(item_dir, None, None):
                # The newest step's index records the run id its copies carry.
                finalized = _paths.sibling_steps(item_dir)
                index = _restore.read_index(finalized[max(finalized)]) if finalized else {}
                pi = _multihost.process_index()
                recorded = index.get(pi) or next(iter(index.values()), None)
                memory = self._memory_for(item_dir, recorded=recorded)
            steps = self._global_view(item_dir, memory).restorable_steps()
        except Exception as e:  # agreed on below, so that every process raises
            error = e
        _agreement.agree(
            error,
            tag=self._tag("list", item_dir),
            what="Finding the restorable steps",
            timeout_s=self._options.timeout_s,
        )
        return steps

    def pending_persistence(self) -> set[int]:
        """Steps queued or being written to persistent storage."""
        return self._persister.pending_steps()

    def preservation_policy(self, base: Any) -> Any:
        """An Orbax PreservationPolicy that keeps what `base` keeps, the newest
        durable (persisted) step, and every newer step to be persisted.

        Not needed: a manager holding this handler keeps those steps whatever
        its options (the handler wraps the manager's deletion decision once per
        process); this explicit form is kept for code that already uses it, and
        for an Orbax where that wrapper cannot be installed (a warning says so).
        Pass it as `CheckpointManagerOptions(preservation_policy=...)`.
        """
        return self._keeper.policy(base)

    # ---- helpers --------------------------------------------------------------

    def _tag(self, verb: str, directory: epath.Path | Path) -> str:
        """The exchange tag of a save or restore of this item: the same on every process,
        and apart for every checkpoint directory and item (their commits run concurrently)."""
        run = self._options.run_id or _paths.default_run_id(directory)
        return f"{verb}/{run}/{_paths.strip_tmp(_storage.as_path(directory).name)}"

    def _agree(self, verb: str, directory: epath.Path | Path, error: BaseException | None) -> None:
        """Raises on every process if `error` or another process's error is set (collective)."""
        _agreement.agree(
            error,
            tag=self._tag(verb, directory),
            what=f"The {verb} of step {_paths.step_of(directory)}",
            timeout_s=self._options.timeout_s,
        )

    @contextlib.contextmanager
    def _taking_part(
        self,
        directory: epath.Path | Path,
        recorded: _format.PartManifest | None,
        memory: _memory_tier.MemoryTier | None,
    ) -> Iterator[None]:
        """On an error inside, takes part in the restore's exchange of inventories all the
        same (with nothing to offer), then raises it: `restore` agrees on it afterwards."""
        try:
            yield
        except Exception as error:
            # IMPORTANT: the other processes are about to meet in `_global_view`; skipping
            # it would leave them waiting and this process's exchanges out of step.
            if memory is not None:
                self._global_view(directory, memory)
            elif _multihost.process_count() > 1:
                saved = recorded.run_id if recorded is not None else None
                run_id = _paths.run_id(directory, self._options.run_id, saved)
                if self._peers is None or self._peers.run_id != run_id:
                    self._decline(directory, error, run_id)
                else:
                    self._peers.exchange_inventories({})
            raise

    def _decline(
        self, directory: epath.Path | Path, error: BaseException, run_id: str | None = None
    ) -> None:
        """Where the others meet their peers, takes part without a memory tier (collective):
        all raise `error`. Nothing to do if this run's peers were met already."""
        if _multihost.process_count() == 1:
            return
        run_id = run_id or _paths.run_id(directory, self._options.run_id, None)
        if self._peers is None or self._peers.run_id != run_id:
            _peers.Peers.decline(run_id, self._options, error)

    def _connect(self, memory: _memory_tier.MemoryTier) -> _peers.Peers | None:
        """Meets the other processes once per run (collective); None in one process."""
        if _multihost.process_count() == 1:
            return None
        if self._peers is None or self._peers.run_id != memory.run_id:
            if self._peers is not None:
                self._peers.close()
            self._peers = _peers.Peers.connect(memory, self._options)
        return self._peers

    def _memory_for(
        self, directory: epath.Path | Path, recorded: _format.PartManifest | None = None
    ) -> _memory_tier.MemoryTier:
        """This run's memory tier, for the item directory `directory`.

        The run id is the one `recorded` in the step's index manifest (a restore:
        the copies to read carry it, whatever the directory is called now), else
        `TierOptions.run_id`, else one derived from the checkpoint directory's
        real path (so a symlink to it finds the same tier).
        """
        self._keeper.note(directory)
        run_id = _paths.run_id(
            directory, self._options.run_id, recorded.run_id if recorded else None
        )
        if self._memory is None or self._memory.run_id != run_id:
            memory = _memory_tier.MemoryTier(
                self._options.memory_root, run_id, self._options.spare_slabs
            )
            memory.prepare(
                str(_paths.checkpoint_root(directory)),
                _multihost.process_index(),
                self._options.resolved_failure_domain,
            )
            memory.clear_staging(older_than_s=self._options.timeout_s)
            self._memory = memory
            self._resume_persistence(memory, directory)
        return self._memory

    def _resume_persistence(
        self, memory: _memory_tier.MemoryTier, directory: epath.Path | Path
    ) -> None:
        """Queues what a crash left unpersisted (steps due, finalized, still in this
        process's memory): a restarted job persists them as the lost one would have."""
        try:
            jobs = _persister.unpersisted_jobs(
                memory,
                _paths.checkpoint_root(directory),
                _paths.strip_tmp(_storage.as_path(directory).name),
                _multihost.process_index(),
                self._options.persist_every,
            )
        except Exception:  # the look is a convenience: never fail a save or restore over it
            log.exception("jaxckpt: could not look for unpersisted steps in %s", memory.run_dir)
            return
        for job in jobs:
            log.info("jaxckpt: persisting step %d, left unpersisted by a crash", job.manifest.step)
            self._persister.submit(job)


def _step_of(directory: epath.Path | Path, explicit: int | None) -> int:
    step = explicit if explicit is not None else _paths.step_of(directory)
    if step is None:
        raise ValueError(
            f"[process {_multihost.process_index()}] Cannot tell the step of {directory}: "
            "jaxckpt saves through ocp.CheckpointManager, whose step directories are named "
            "by step (flax.training.checkpoints.save_checkpoint(_multiprocess)(..., "
            "orbax_checkpointer=...) is not supported). Use mngr = ocp.CheckpointManager("
            'ckpt_dir, item_handlers={"train": handler}); mngr.save(step, args='
            "ocp.args.Composite(train=jaxckpt.TieredSave(state))), or pass "
            "TieredSave(state, step=...) to a bare Checkpointer."
        )
    return step


@checkpoint_args.register_with_handler(TieredCheckpointHandler, for_save=True)
@dataclasses.dataclass
class TieredSave(ocp.args.CheckpointArgs):
    """Save the whole training state (a pytree) with `TieredCheckpointHandler`.

    Attributes:
      state: params, optimizer state, typed PRNG keys, iterators, scalars.
      step: only needed outside a CheckpointManager, whose directories name the step.

    Raises:
      TypeError: on construction, for a leaf jaxckpt cannot save and restore
        exactly (an unsupported type or dtype), naming its path: the error comes
        from the `mngr.save()` line of that very step, asynchronous manager
        included, before Orbax starts anything.
    """

    state: Any
    step: int | None = None

    def __post_init__(self) -> None:
        try:
            _tree.validate(self.state)
        except TypeError as e:
            raise TypeError(f"[process {_multihost.process_index()}] {e}") from None


@checkpoint_args.register_with_handler(TieredCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class TieredRestore(ocp.args.CheckpointArgs):
    """Restore with `TieredCheckpointHandler` into the layout of `abstract_state`.

    Attributes:
      abstract_state: the target tree: `jax.ShapeDtypeStruct` (or arrays) with
        the shardings to restore onto (any mesh), fresh iterator objects whose
        state is set in place, and placeholders for scalars. A `np.ndarray`
        leaf (or a leaf without a sharding where a numpy array was saved) is
        restored as numpy; an uncommitted jax.Array leaf (made outside any
        mesh, e.g. a fresh `jax.random.key(0)`) is restored uncommitted, free
        to join a later jit on other devices; a saved jax.Array with no target
        sharding gets its saved sharding (uncommitted if it was saved so).
        Leaves are matched by path, else by key names whatever the node kind,
        so `mngr.item_metadata(step).train` (nested dicts and lists) is a
        target for any saved tree; the result has the target's structure.
        None restores everything to host (numpy).
      iterator_state_fn: the older, iterator-only form of `per_process_fn`:
        called as `fn(saved_states, process_index, process_count)` for every
        iterator whenever the process count changed, it returns this
        process's state.
      per_process_fn: only needed to restore leaves saved per process
        (process-local jax.Arrays, numpy arrays, scalars, iterator states) onto
        another process count when the processes saved different values:
        called as `fn(path, saved_values, process_index, process_count)` for
        each such leaf (`path` as `jax.tree_util.keystr` prints it;
        `saved_values` in the saving processes' order, numpy arrays for
        arrays), it returns this process's value. Values every process saved
        alike restore everywhere without it; on the saving process count each
        process gets its own. For a target sharding that spans processes, it
        must return the same value on every process.
    """

    abstract_state: Any = None
    iterator_state_fn: _target.IteratorStateFn | None = None
    per_process_fn: _target.PerProcessFn | None = None
