"""The restore as Orbax calls it (`TieredCheckpointHandler.restore`), in order: the
item directory parsed, the step's index read once, the run opened, the target
checked, the exchanges `meet` and `inventories` (the plan: a source per part), the
reads on this process (`_restore.Restorer` into `_fill`), and the exchanges `agree`
and `reshard`. Also the two other reads of an item: its metadata and its
restorable steps (a collective list). The one module of `restore` that runs a
choreography (`run`); the read engine below it takes part in no exchange."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from etils import epath

from jaxckpt import _metrics, _resources
from jaxckpt.coord import _multihost
from jaxckpt.format import _format
from jaxckpt.restore import _chunk_reads, _fill, _restore, _target
from jaxckpt.run import _choreography, _session
from jaxckpt.tiers import _index, _paths, _slab, _storage


class RestoreOperation:
    """Every restore, metadata and list call of one handler (`session`)."""

    def __init__(self, session: _session.Session):
        self._session = session

    def restore(self, directory: epath.Path, target: _target.Target) -> Any:
        """`TieredCheckpointHandler.restore` into `target` (a `TieredRestore`): collective,
        one verdict."""
        item = _paths.ItemDir.parse(directory)
        # Its exchanges in order, a failing process's too; the verdict when the block ends
        # (after the collector resumes). A tree of thousands of leaves allocates some 10^5
        # small objects: Python's cyclic collector would walk every object of the process
        # hundreds of times.
        session = self._session
        with (
            _choreography.RestoreChoreography(session.runs, item, session.publisher) as op,
            _resources.SHARED.gc_paused(),
        ):
            return self._restore_locally(op, item, target)

    def _restore_locally(
        self, op: _choreography.RestoreChoreography, item: _paths.ItemDir, args: _target.Target
    ) -> Any:
        """`restore` on this process, in order; `op` runs its exchanges."""
        start = time.perf_counter()
        runs, timeout_s = self._session.runs, self._session.options.timeout_s
        # 1. Slabs removed since the last save (a lost memory tier, another process's
        # retention) are still mapped here, their pages held: let them go before the
        # restore allocates the target's buffers.
        _slab.forget_unlinked()
        step = item.require_step()
        pi, count = _multihost.process_index(), _multihost.process_count()
        # 2. The step's index, read once: its parts, and the run its copies carry.
        index, recorded = self._index(item, step, pi)
        indexes = {step: index}  # read once: the recovery and the inventories reuse it
        # 3. Open the run: its memory tier, under the run id the index records.
        memory = op.open(recorded, indexes)
        # 4. The target, validated before anything is read (a failure: agreed on in `agree`).
        fns = (args.iterator_state_fn, args.per_process_fn)
        if index:
            ctx = _target.Context(index, pi, count, step, *fns)
            assert recorded is not None  # the index has parts
            _target.check(recorded.leaves, args.abstract_state, ctx)
        # 5. Exchanges `meet` (once per run) and `inventories`; the plan: a source per part.
        op.meet()
        view = op.inventories(indexes)
        plan = view.plan(step, item.path)
        if not plan.restorable:
            raise FileNotFoundError(view.not_restorable_message(item.path, plan))
        # Agreed before the pin (which may drop this process's memory from its plan alone).
        from_persistent = bool(plan.suspects)
        # Its slabs are read in place and lent to the restored arrays: pinned meanwhile.
        plan, pin = _chunk_reads.pin_memory(memory, plan, pi)
        # 6. The reads, fastest source first, into the target's shardings, on this
        # process's devices (a leaf replicated across processes: 1/R here).
        readers = _chunk_reads.reader_factory(
            item.path, memory, op.peers, step, plan.manifests, pi, timeout_s
        )
        restorer = _restore.Restorer(
            plan,
            readers,
            pi,
            runs.redact,
            timeout_s=timeout_s,
            on_damaged=_chunk_reads.quarantiner(memory, op.peers, step, pi),
            spread=count > 1,
            from_persistent=from_persistent,
        )
        try:
            ctx = _target.Context(plan.manifests, pi, count, step, *fns)
            filled = _fill.fill(restorer, plan.leaves, args.abstract_state, ctx)
            # 7. Exchanges `agree` (every process read its leaves) and, at once, `reshard`
            # (the leaves read 1/R a process, onto their targets).
            result = filled.tree(op.agree_and_reshard(filled.resharding))
        except _chunk_reads.ChunkUnavailableError as e:
            raise FileNotFoundError(
                f"{runs.redact(str(e))}. {view.newest_restorable_sentence(exclude=step)}"
            ) from e
        finally:
            restorer.finish()
            if pin is not None:
                pin.release()
        seconds = time.perf_counter() - start
        chunks = restorer.chunks
        self._session.publisher.publish(
            _metrics.restore_metrics(
                step, seconds, chunks.bytes_by_tier, chunks.bytes_needed, len(chunks.failures)
            )
        )
        return result

    def _index(
        self, item: _paths.ItemDir, step: int, pi: int
    ) -> tuple[_index.Index, _format.PartManifest | None]:
        """The step's index (read in part) and this process's manifest in it (else the
        first part's, which records the run and the leaves alike; None: no part).

        Raises:
          FileNotFoundError: if this process's entry of the index is damaged.
        """
        index = _index.read_index(item.path)
        try:
            return index, _index.recorded(index, pi)
        except ValueError as e:
            raise FileNotFoundError(
                f"[process {pi}] Step {step} cannot be restored: "
                f"{self._session.runs.redact(str(e))}"
            ) from e

    def metadata(self, directory: epath.Path) -> Any:
        """`TieredCheckpointHandler.metadata`: the saved tree, from the step's index."""
        index = _index.read_index(_storage.as_path(directory))
        if not index:
            raise FileNotFoundError(f"{directory} holds no jaxckpt index manifest.")
        return _target.metadata(index, _multihost.process_index(), _multihost.process_count())

    def restorable_steps(self, item_dir: epath.Path | Path, verify: bool) -> list[int]:
        """`TieredCheckpointHandler.restorable_steps`: collective, the same answer everywhere."""
        runs = self._session.runs
        item = _paths.ItemDir.parse(item_dir)
        with _choreography.ListChoreography(runs, item) as op:
            # The newest step's index records the run id its copies carry.
            finalized = item.finalized_steps()
            newest = max(finalized, default=None)
            index = _index.read_index(finalized[newest]) if newest is not None else {}
            indexes = {newest: index} if newest is not None else {}
            pi = _multihost.process_index()
            memory = op.open(_index.recorded(index, pi), indexes)
            if verify:
                runs.verify_held(memory, finalized)
            op.meet()
            return op.inventories(indexes).restorable_steps()
