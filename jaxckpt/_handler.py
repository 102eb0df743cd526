"""`TieredCheckpointHandler`: the Orbax handler, an adapter from Orbax's calls to the
save (`save/_operation`), the restore (`restore/_operation`) and the handler's session
(`run/_session`: background work, retention, the run, close and release)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args

from jaxckpt._args import TieredRestore, TieredSave
from jaxckpt._options import TierOptions
from jaxckpt.restore import _operation as _restore_operation
from jaxckpt.restore import _prepare
from jaxckpt.run import _session
from jaxckpt.save import _operation as _save_operation


class TieredCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves the whole training state to memory tiers every step, persists some steps.

    Use it with `ocp.CheckpointManager`, through a handler registry or
    `item_handlers=`, alone or inside `ocp.args.Composite`:

        handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions("/dev/shm/ckpt"))
        mngr = ocp.CheckpointManager(path, item_handlers={"train": handler})
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))
        state = mngr.restore(step, args=ocp.args.Composite(
            train=jaxckpt.TieredRestore(abstract_state))).train

    An adapter: each call goes to its operation (`SaveOperation`, `RestoreOperation`),
    which runs under that operation's choreography (the run opened, the exchanges in
    order), or to the handler's `Session` (waits, close, release).
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
        self._session = _session.Session(options, on_metrics)
        self._saves = _save_operation.SaveOperation(self._session)
        self._restores = _restore_operation.RestoreOperation(self._session)

    @property
    def options(self) -> TierOptions:
        return self._options

    # The latest measurements of each kind (empty before the first).
    last_save_metrics = property(lambda self: self._session.publisher.last["save"])
    last_restore_metrics = property(lambda self: self._session.publisher.last["restore"])
    last_persist_metrics = property(lambda self: self._session.publisher.last["persist"])

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
        return await self._saves.start(directory, args.state, args.step, args.persist)

    def save(self, directory: epath.Path, args: TieredSave) -> None:
        """Saves synchronously: `async_save`, then waits for its commit."""
        self._saves.run(directory, args.state, args.step, args.persist)

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
        return self._restores.restore(directory, args if args is not None else TieredRestore())

    @staticmethod
    def prepare_restore(directory: epath.Path | Path | str, args: TieredRestore) -> int:
        """Compiles ahead what a restore of `directory` into `args` compiles, so that the
        restore only reads and places: on a hot spare, while it waits for a restart.

        A restore onto another process count (a job shrunk or grown back) reshards the
        leaves replicated across processes with one compiled collective; this compiles
        it now. Local and cheap: it reads the step's index only (no chunk, no memory
        tier, no other process), and needs no handler. Any step saved in the layout the
        restore will read does (the newest one, say).

            step = mngr.latest_step()
            jaxckpt.TieredCheckpointHandler.prepare_restore(
                mngr.directory / str(step) / "train", jaxckpt.TieredRestore(abstract_state))

        Returns:
          How many leaves the prepared reshard carries (0: the restore compiles nothing).

        Raises:
          FileNotFoundError: if `directory` holds no jaxckpt index.
          ValueError, TypeError: if the target does not match the saved tree.
        """
        return _prepare.prepare(directory, args)

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
        return self._restores.metadata(directory)

    def finalize(self, directory: epath.Path) -> None:
        """Parts become visible by their own atomic renames; the manager renames the
        step next, which the memory tier's retention for it looks for from now on."""
        self._session.background.retainer.nudge()

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
        self._session.close()

    def wait_for_persistence(self, timeout_s: float | None = None) -> None:
        """Blocks until the saves made so far have ended their commits and the
        background work they queued (memory retention, persistence) is done, or
        failed: right after an asynchronous manager's `save()`, it waits for that
        step's persistence too.

        Raises:
          TimeoutError: if it is not done within `timeout_s` (default: the options').
        """
        self._session.wait_for_persistence(timeout_s)

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
        return self._restores.restorable_steps(item_dir, verify)

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
        return self._session.release_memory(timeout_s)

    def pending_persistence(self) -> set[int]:
        """Steps queued or being written to persistent storage."""
        return self._session.pending_persistence()

    def inspect(self) -> _session.Inspection:
        """A look at this handler's state on this process, for jaxckpt's benchmark and
        tests: the open run's memory tier (which steps and parts it holds, where), its
        peers, and a wait for memory retention alone.

        The objects it returns are internal types, with no compatibility promise; they
        are documented in the `run/` package (`_session.Inspection`).
        """
        return _session.Inspection(self._session)

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
        return self._session.keeper.policy(base, directory)


checkpoint_args.register_with_handler(TieredCheckpointHandler, for_save=True)(TieredSave)
checkpoint_args.register_with_handler(TieredCheckpointHandler, for_restore=True)(TieredRestore)
