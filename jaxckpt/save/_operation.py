"""The save as Orbax calls it (`TieredCheckpointHandler.async_save`), in order: the item
directory parsed, the run opened, the snapshot (the stall), the exchange `meet`, the
slab staged (`_save.Save`), and the commit future with the exchange `agree`."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

import orbax.checkpoint as ocp
from absl import logging as log
from etils import epath

from jaxckpt import _aio, _resources
from jaxckpt.coord import _multihost
from jaxckpt.persistent import _paths
from jaxckpt.run import _choreography, _session
from jaxckpt.save import _save, _snapshot


class SaveOperation:
    """Every save of one handler (`session`), each under its own `SaveChoreography`."""

    def __init__(self, session: _session.Session):
        self._session = session
        background = session.background
        self._services = _save.Services(
            session.options, background.persister, background.retainer, session.publisher
        )

    async def start(
        self, directory: epath.Path, state: Any, step: int | None, persist: bool
    ) -> list[Any]:
        """`TieredCheckpointHandler.async_save` of `TieredSave(state, step, persist)`:
        snapshots this process's shards to host and returns the commit future (which
        raises this process's refusal)."""
        started = time.perf_counter()
        session, options = self._session, self._session.options
        item = _paths.ItemDir.parse(directory)
        # At once, not through the commit: no step, no save (every process sees the same
        # directory, so all refuse alike, before any exchange).
        step = item.require_step(step)
        # From now on, persisted parts of older steps wait to enter their step
        # directories: the manager may delete those steps once this commit has ended.
        item.store.begin_save(item.root, step)
        session.background.saved_into(item.root)
        op = _choreography.SaveChoreography(session.runs, item, step, session.publisher)
        snapshot, save = None, None
        # 1. Open the run; refuse what the tier cannot take; the snapshot (validates every
        # leaf first). An error is this process's refusal, raised by the commit future.
        with op.local():
            # Before the run's memory tier is opened (which may queue a crashed run's
            # persists): the first save into an old Orbax or flax directory is persisted.
            if not persist and session.keeper.switching_in(item):
                log.info(
                    "jaxckpt: persisting step %d, the first save into %s, which holds older "
                    "steps that are not jaxckpt's and no durable jaxckpt step of item %r",
                    step,
                    item.root,
                    item.item,
                )
                persist = True
            session.keeper.saved(item, step, persist)
            memory = op.open()
            memory.require_writable(step)
            # The collector paused for the snapshot, as for the slab's fill and manifest
            # (`_save`): a tree of thousands of leaves allocates some 10^5 objects a save,
            # and the full collections they set off walked every object of the process:
            # 4000 sharded leaves, 117 ms a save on this thread, 49 on the commit's.
            with _resources.SHARED.gc_paused():
                snapshot = _snapshot.take(
                    state,
                    _multihost.process_index(),
                    options.pinned_host_staging,
                    options.tile_bytes,
                )
        # 2. Exchange `meet`: the peers (collective, once per run), a refusing process too.
        op.meet()
        # 3. The save takes over; on CPU its slab is filled now (the end of the stall).
        if op.ok and snapshot is not None and op.memory is not None:
            with op.local():
                save = _save.Save(
                    item, step, snapshot, op.memory, op, self._services, started, persist
                )
                with _resources.SHARED.gc_paused():
                    save.stage()
        # 4. The commit future, with the exchange `agree` (or this process's refusal).
        commit = _placed_first(item, op.commit(save.commit if save is not None else None))
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                session.background.in_flight.track(commit),
                name="jaxckpt_commit",
                timeout_secs=int(options.timeout_s),
            )
        ]

    def run(self, directory: epath.Path, state: Any, step: int | None, persist: bool) -> None:
        """`TieredCheckpointHandler.save`: `start`, then waits for its commit."""

        async def run() -> None:
            for f in await self.start(directory, state, step, persist):
                f.result()

        _aio.run_sync(run())  # also from a thread that runs an event loop (Jupyter)


async def _placed_first(item: _paths.ItemDir, commit: Awaitable[None]) -> None:
    """`commit`, after the persisted parts of older steps that waited enter their step
    directories (`PersistentStore.settle`): the manager deletes nothing before this
    commit has ended, and on the commit's thread the renames and flushes stay off the
    training stall.

    The commit future runs this on a thread and event loop of its own (Orbax's), so
    blocking work runs here directly: a hop to `asyncio.to_thread` would start a new
    executor thread on that fresh loop at every save."""
    try:
        item.store.settle(item.root)
    finally:
        await commit
