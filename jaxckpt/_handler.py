"""`TieredCheckpointHandler`: the Orbax handler, an adapter from Orbax's calls to the
operations' choreographies (`_choreography`), the save (`_save`) and the restore
(`_index`, `_restore`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from absl import logging as log
from etils import epath
from orbax.checkpoint import checkpoint_args

from jaxckpt import _aio, _metrics, _resources
from jaxckpt._args import TieredRestore, TieredSave
from jaxckpt._options import TierOptions
from jaxckpt.coord import _multihost
from jaxckpt.restore import _fill, _restore, _target
from jaxckpt.run import _choreography, _run
from jaxckpt.save import _background, _save, _snapshot
from jaxckpt.tiers import _index, _paths, _retention, _slab, _storage


class TieredCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves the whole training state to memory tiers every step, persists some steps.

    Use it with `ocp.CheckpointManager`, through a handler registry or
    `item_handlers=`, alone or inside `ocp.args.Composite`:

        handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions("/dev/shm/ckpt"))
        mngr = ocp.CheckpointManager(path, item_handlers={"train": handler})
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
        state = mngr.restore(step, args=ocp.args.Composite(
            train=jaxckpt.TieredRestore(abstract_state))).train

    An adapter: each call parses its item directory once (`_paths.ItemDir`) and
    runs its operation under that operation's choreography (`_choreography`: the
    run opened, the exchanges in order), handing the work to the save
    (`_save.Save`) or the restore's index and reads (`_index`, `_restore`).
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
        self._publisher = _metrics.Publisher(on_metrics)
        self._background = _background.Background(options, self._publisher)
        persister, retainer = self._background.persister, self._background.retainer
        self._keeper = _retention.Keeper(options.persist_every, persister.pending_steps)
        self._runs = _run.Run(options, persister, self._keeper)
        self._services = _save.Services(options, persister, retainer, self._publisher)

    @property
    def options(self) -> TierOptions:
        return self._options

    # The latest measurements of each kind (empty before the first).
    last_save_metrics = property(lambda self: self._publisher.last["save"])
    last_restore_metrics = property(lambda self: self._publisher.last["restore"])
    last_persist_metrics = property(lambda self: self._publisher.last["persist"])

    # ---- save -----------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: TieredSave) -> list[Any]:
        """Snapshots this process's shards to host and returns the commit future.

        An unsupported leaf or dtype is refused when `TieredSave` is built. Other bad
        input (an unwritable memory root, an iterator state that is not JSON, ...) is
        logged at once and raised by the returned future: by `mngr.save()` in a
        synchronous manager, by `wait_until_finished()` or the next `save()` in an
        asynchronous one (raising here would strand Orbax's directory-creation
        threads); the step is not finalized either way.
        """
        started = time.perf_counter()
        item = _paths.ItemDir.parse(directory)
        # At once, not through the commit: no step, no save (every process sees the same
        # directory, so all refuse alike, before any exchange).
        step = item.require_step(args.step)
        op = _choreography.SaveChoreography(self._runs, item, step, self._publisher)
        snapshot, save = None, None
        persist = args.persist
        # 1. Open the run; refuse what the tier cannot take; the snapshot (validates every
        # leaf first). An error is this process's refusal, raised by the commit future.
        with op.local():
            # Before the run's memory tier is opened (which may queue a crashed run's
            # persists): the first save into an old Orbax or flax directory is persisted.
            if not persist and self._keeper.switching_in(item):
                log.info(
                    "jaxckpt: persisting step %d, the first save into %s, which holds older "
                    "steps that are not jaxckpt's and no durable jaxckpt step of item %r",
                    step,
                    item.root,
                    item.item,
                )
                persist = True
            memory = op.open()
            memory.require_writable(step)
            snapshot = _snapshot.take(
                args.state, _multihost.process_index(), self._options.pinned_host_staging
            )
        # 2. Exchange `meet`: the peers (collective, once per run), a refusing process too.
        op.meet()
        # 3. The save takes over; on CPU its slab is filled now (the end of the stall).
        if op.ok and snapshot is not None and op.memory is not None:
            with op.local():
                save = _save.Save(
                    item, step, snapshot, op.memory, op, self._services, started, persist
                )
                save.stage()
        # 4. The commit future, with the exchange `agree` (or this process's refusal).
        commit = op.commit(save.commit if save is not None else None)
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._background.in_flight.track(commit),
                name="jaxckpt_commit",
                timeout_secs=int(self._options.timeout_s),
            )
        ]

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
        item = _paths.ItemDir.parse(directory)
        # Its exchanges in order, a failing process's too; the verdict when the block ends
        # (after the collector resumes). A tree of thousands of leaves allocates some 10^5
        # small objects: Python's cyclic collector would walk every object of the process
        # hundreds of times.
        with (
            _choreography.RestoreChoreography(self._runs, item, self._publisher) as op,
            _resources.SHARED.gc_paused(),
        ):
            return self._restore_locally(op, item, args if args is not None else TieredRestore())

    def _restore_locally(
        self, op: _choreography.RestoreChoreography, item: _paths.ItemDir, args: TieredRestore
    ) -> Any:
        """`restore` on this process, in order; `op` runs its exchanges."""
        start = time.perf_counter()
        # 1. Slabs removed since the last save (a lost memory tier, another process's
        # retention) are still mapped here, their pages held: let them go before the
        # restore allocates the target's buffers.
        _slab.forget_unlinked()
        step = item.require_step()
        pi, count = _multihost.process_index(), _multihost.process_count()
        # 2. The step's index, read once: its parts, and the run its copies carry.
        index = _index.read_index(item.path)
        recorded = index.get(pi) or next(iter(index.values()), None)
        indexes = {step: index}  # read once: the recovery and the inventories reuse it
        # 3. Open the run: its memory tier, under the run id the index records.
        memory = op.open(recorded, indexes)
        # 4. The target, validated before anything is read (agreed on at the end).
        fns = (args.iterator_state_fn, args.per_process_fn)
        if index:
            ctx = _target.Context(index, pi, count, step, *fns)
            _target.check(next(iter(index.values())).leaves, args.abstract_state, ctx)
        # 5. Exchanges `meet` (once per run) and `inventories`; the plan: a source per part.
        op.meet()
        view = op.inventories(indexes)
        plan = view.plan(step, item.path)
        if not plan.restorable:
            raise FileNotFoundError(view.not_restorable_message(item.path, plan))
        # IMPORTANT: the step's slabs are read in place (mapped) and lent to the restored
        # arrays; a pin keeps the step from being retired (by any process sharing the
        # memory root) before they are marked lent, which keeps them from being reused.
        plan, pin = _restore.pin_memory(memory, plan, pi)
        # 6. The reads, fastest source first, into the target's shardings.
        readers = _restore.reader_factory(
            item.path, memory, op.peers, step, plan.manifests, pi, self._options.timeout_s
        )

        def unavailable(e: _restore.ChunkUnavailableError) -> FileNotFoundError:
            return FileNotFoundError(
                f"{self._runs.redact(str(e))}. {view.newest_restorable_sentence(exclude=step)}"
            )

        def agree_on_reads(error: BaseException | None) -> None:
            # 7, held early: before a collective reshard (data-parallel replicas), so that
            # no process enters it alone; a read that failed is agreed on as it is raised.
            if isinstance(error, _restore.ChunkUnavailableError):
                error = unavailable(error)
            op.agree(error)

        restorer = _restore.Restorer(
            plan,
            readers,
            pi,
            self._runs.redact,
            timeout_s=self._options.timeout_s,
            on_damaged=_restore.quarantiner(memory, self._runs.peers, step, pi),
            agree=agree_on_reads if count > 1 else None,
        )
        try:
            ctx = _target.Context(plan.manifests, pi, count, step, *fns)
            result = _fill.fill(restorer, plan.leaves, args.abstract_state, ctx)
        except _restore.ChunkUnavailableError as e:
            raise unavailable(e) from e
        finally:
            restorer.finish()
            if pin is not None:
                pin.release()
        seconds = time.perf_counter() - start
        self._publisher.publish(_metrics.restore_metrics(step, seconds, restorer))
        # 7. Exchange `agree` (the verdict): when the choreography's block ends, unless
        # held before the reshard of data-parallel replicas (`agree_on_reads`).
        return result

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
        index = _index.read_index(_storage.as_path(directory))
        if not index:
            raise FileNotFoundError(f"{directory} holds no jaxckpt index manifest.")
        return _target.metadata(index, _multihost.process_index(), _multihost.process_count())

    def finalize(self, directory: epath.Path) -> None:
        """No-op: parts become visible by their own atomic renames."""

    def close(self) -> None:
        """Drains pending persistence (bounded by `TierOptions.timeout_s`), and persists
        nothing else: a newest step not due stays in memory only, with a warning (end
        the run with `release_memory()`, or save the last step with
        `TieredSave(state, persist=True)`, to end with it on disk). A step the manager
        deleted before its persist ended is persisted into the kept area (`_kept`):
        no failure.

        Raises:
          OSError: if a step failed to persist, or memory retention failed.
          TimeoutError: if persistence is not done within the timeout (it goes on
            in the background; a later save reuses the same worker).
        """
        try:
            self._background.close()
        finally:
            self._runs.close()  # the last handler's close unmaps the kept slabs too
        self._background.raise_errors()
        if _multihost.process_index() == 0:
            self._keeper.warn_newest_not_durable()

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """Blocks until the saves made so far have ended their commits and the
        background work they queued (memory retention, persistence) is done, or
        failed: right after an asynchronous manager's `save()`, it waits for that
        step's persistence too.

        Raises:
          TimeoutError: if it is not done within `timeout_s` (default: the options').
        """
        self._background.wait(self._options.timeout_s if timeout_s is None else timeout_s)
        self._background.raise_errors()

    def restorable_steps(self, item_dir: epath.Path | Path, verify: bool = False) -> list[int]:
        """Every finalized step next to `item_dir` that can be restored from some tier.

        Collective: every process calls it; the processes exchange what their
        memory tiers hold (bounded by `TierOptions.timeout_s`) and all get the
        same answer. A memory-tier copy that failed its checksums (in a restore,
        or here with `verify`) is quarantined and not counted.

        Args:
          item_dir: any `<checkpoint dir>/<step>/<item>` directory of this item
            (the step need not exist).
          verify: first check every copy this process holds in memory against its
            checksums (see `jaxckpt.latest_restorable_step`).

        Returns:
          The restorable steps, newest first.
        """
        item = _paths.ItemDir.parse(item_dir)
        with _choreography.ListChoreography(self._runs, item) as op:
            # The newest step's index records the run id its copies carry.
            finalized = item.finalized_steps()
            newest = max(finalized, default=None)
            index = _index.read_index(finalized[newest]) if newest is not None else {}
            indexes = {newest: index} if newest is not None else {}
            pi = _multihost.process_index()
            memory = op.open(index.get(pi) or next(iter(index.values()), None), indexes)
            if verify:
                self._runs.verify_held(memory, finalized)
            op.meet()
            return op.inventories(indexes).restorable_steps()

    def release_memory(self, timeout_s: float | None = None) -> list[int]:
        """Ends a run: makes the newest step durable and frees this host's memory tier.

        Collective: every process calls it, and all reach one verdict. Each process
        waits for its queued persistence, persists its own part of the newest step
        if that step is not durable yet (one that was not due: whatever step the run
        ends on), waits for that too (each wait bounded by `timeout_s`), and then the
        processes agree (bounded by `TierOptions.timeout_s`). Once every process's
        part is durable, each removes the run's steps from its tier (own parts and
        the replicas held for peers) and the spare slabs; later saves fill it again.
        If some process's part of the newest step is in no memory tier of its own (it
        was restored from a peer, say), nothing can persist it: every process logs
        which steps it keeps, removes nothing and returns an empty list.

        Returns:
          The steps removed.

        Raises:
          OSError: on every process, if a process's persistence failed (naming it).
          TimeoutError: on every process, if one did not finish in time or did not
            take part.
        """
        timeout_s = self._options.timeout_s if timeout_s is None else timeout_s
        with _choreography.ReleaseChoreography(self._runs) as op:
            # 1. This process's persistence, and its part of a newest step not durable yet
            # (not due, at the end of a run) persisted.
            self.wait_for_persistence(timeout_s)
            if self._runs.persist_newest():
                self.wait_for_persistence(timeout_s)
            # 2. Exchange `agree`: the newest step is durable only once every process's part
            # is; each frees its tier after all have persisted theirs.
            op.agree()
            return self._runs.release_memory()

    def pending_persistence(self) -> set[int]:
        """Steps queued or being written to persistent storage."""
        return self._background.persister.pending_steps()

    def preservation_policy(self, base: Any, directory: Any = None) -> Any:
        """An Orbax PreservationPolicy that keeps what `base` keeps, the newest
        durable (persisted) step, and every newer step to be persisted.

        Pass it as `CheckpointManagerOptions(preservation_policy=...)`, or let
        `jaxckpt.manager_options(directory, handler=handler, ...)` build it.

        Args:
          base: the policy whose steps are kept as well (e.g. `LatestN(3)`).
          directory: the manager's checkpoint directory; without it the policy
            keeps the steps of every checkpoint directory this handler has used.
        """
        return self._keeper.policy(base, directory)


checkpoint_args.register_with_handler(TieredCheckpointHandler, for_save=True)(TieredSave)
checkpoint_args.register_with_handler(TieredCheckpointHandler, for_restore=True)(TieredRestore)
