"""Resuming a job: the newest step some tier can restore, as one collective call."""

from __future__ import annotations

import logging
from typing import Any

from jaxckpt import _internals
from jaxckpt._handler import TieredCheckpointHandler
from jaxckpt.coord import _multihost
from jaxckpt.persistent import _index, _paths, _storage, _store

log = logging.getLogger(__name__)


def latest_restorable_step(
    mngr: Any, *, delete_newer: bool = True, verify: bool = False, finite: bool = False
) -> int | None:
    """The newest step of `mngr` that every jaxckpt item can restore, from any tier.

    After a process crash the newest step is usually still in memory; after a
    node or rack loss `mngr.latest_step()` may name a step whose only copies are
    gone. This finds the newest step that can really be restored (own memory,
    a peer's memory or persistent storage), so a job resumes with:

        step = jaxckpt.latest_restorable_step(mngr)
        if step is not None:
            state = mngr.restore(step, args=...)

    Collective: every process calls it, and all get the same answer.

    A copy whose bytes failed their checksum in a restore is quarantined where it
    lies (on the process that read it, or by its holder, told by that process)
    and never offered again: after a restore that failed for want of a good
    copy, the next call returns the older step instead of the same one, so an
    automatic resume does not loop.

    The newest durable step, if the manager's own options deleted it (plain
    `max_to_keep`, `LatestN`, ...), is first put back as a step directory from the
    handler's kept copy (hard links in `<directory>/.jaxckpt-kept/`, one WARNING
    line), unless a newer step is durable: a loss of every memory tier then
    resumes from it whatever the manager's options.

    Args:
      mngr: an `ocp.CheckpointManager` with at least one item handled by a
        `TieredCheckpointHandler` (through a handler registry or `item_handlers=`).
        Items of other handlers are taken to be restorable from the manager's
        directory, as Orbax would.
      verify: first check every copy each process holds in its memory tier (its
        own parts and the replicas it keeps for peers, of every finalized step)
        against the CRC-32Cs of its manifest, quarantining the damaged ones, so
        the answer is a step whose memory copies are known whole. Costs one read
        of what each process holds in memory, at CRC-32C speed, all processes
        at once: measured 1.0-2.8 GB/s on a loaded 2-core host, so about 0.4-1 s
        per GB held (docs/operations.md). Persisted copies are not read (a
        restore checks each chunk it reads, and falls back to another copy).
      delete_newer: delete (`mngr.delete`) the finalized steps newer than the
        returned one: none of them can be restored, and the manager skips saving
        a step number that already exists, so the resumed job's next saves of
        those steps would otherwise be lost. When no step is restorable nothing
        is deleted: the steps stay (a tier may come back), with a warning saying
        so and what to do.
      finite: skip the steps whose saves counted NaN or Inf values in a floating
        leaf (`TierOptions.count_nonfinite`, on by default): the newest restorable
        step without them. With `delete_newer`, the newer steps holding them are
        deleted too (none is deleted when no step without them is left). A step
        saved without counting (the option off, or a jaxckpt from before it) is
        taken as finite.

    Returns:
      The step, or None if no step can be restored.

    Raises:
      ValueError: if `mngr` has no item handled by a `TieredCheckpointHandler`.
      TimeoutError: if another process does not take part in time.
    """
    handlers = _tiered_handlers_or_raise(mngr)
    root = _storage.as_path(mngr.directory)
    steps = _candidate_steps(mngr, root, handlers)
    restorable = set(steps)
    for item, handler in sorted(handlers.items()):
        # Any item directory will do: the handler looks at the step directories next to it.
        restorable &= set(handler.restorable_steps(root / "0" / item, verify=verify))
    poisoned = _skipped_nonfinite(mngr, root, handlers, restorable) if finite else {}
    newest = max(restorable - set(poisoned), default=None)
    if newest is None and steps:
        _leave_the_unrestorable_steps(mngr, steps, bool(poisoned))
        return None
    if delete_newer and newest is not None:
        _delete_newer_steps(mngr, steps, newest, poisoned)
    return newest


def _tiered_handlers_or_raise(mngr: Any) -> dict[str, TieredCheckpointHandler]:
    """`tiered_handlers(mngr)`; a manager without any is refused."""
    handlers = tiered_handlers(mngr)
    if not handlers:
        raise ValueError(
            f"[process {_multihost.process_index()}] The CheckpointManager at {mngr.directory} "
            "has no item handled by jaxckpt.TieredCheckpointHandler: register one "
            "(handler_registry.add(item, jaxckpt.TieredSave, handler), and the same for "
            "TieredRestore) or use mngr.latest_step()."
        )
    return handlers


def _candidate_steps(
    mngr: Any, root: Any, handlers: dict[str, TieredCheckpointHandler]
) -> list[int]:
    """The manager's finalized steps that hold a jaxckpt item, oldest first, after the
    newest durable step is put back if the manager deleted it."""
    # The newest durable step, if the manager's garbage collection deleted it, is put
    # back from the store's kept copy (a filesystem's: `_kept`): a candidate like any step.
    _store.at(root).reinstate(root, sorted(handlers))
    mngr.reload()
    # Steps holding no jaxckpt item (an old loop's Orbax steps in the same directory,
    # which jaxckpt.restore_existing reads) are neither candidates nor deleted.
    ours = set().union(*(_paths.finalized_steps(root, item) for item in handlers))
    return sorted(s for s in mngr.all_steps() if s in ours)


def _leave_the_unrestorable_steps(mngr: Any, steps: list[int], poisoned: bool) -> None:
    """Says that none of `steps` is restorable, and leaves them."""
    # IMPORTANT: never delete the last steps there are. Nothing restorable now may
    # be a tier that comes back (a host rebooting, a peer partitioned away), and a
    # deleted step is gone for good; the job decides, told what is left.
    log.warning(
        "jaxckpt: [process %d] no step of %s is restorable%s: no tier holds a complete "
        "verified copy of steps %s (own memory, peers' memory, persistent storage). "
        "They are left in place; the manager saves no step number up to %d while they "
        "exist. To start over, delete them (mngr.delete(step)) or use a new checkpoint "
        "directory; to resume from the checkpoints an older loop wrote, see "
        "jaxckpt.restore_existing.",
        _multihost.process_index(),
        mngr.directory,
        " without NaN/Inf values" if poisoned else "",
        steps,
        steps[-1],
    )


def _delete_newer_steps(mngr: Any, steps: list[int], newest: int, poisoned: dict[int, int]) -> None:
    """Deletes the `steps` newer than `newest` (unrestorable, or holding NaN/Inf values),
    so that the resumed job's saves can write those step numbers again."""
    for step in steps:
        if step in poisoned and step > newest:
            log.warning(
                "jaxckpt: [process %d] deleting step %d of %s: it holds NaN/Inf values, "
                "and the next saves must be able to write that step number again",
                _multihost.process_index(),
                step,
                mngr.directory,
            )
            mngr.delete(step)
        elif step > newest:
            log.warning(
                "jaxckpt: [process %d] deleting step %d of %s: no tier holds a complete "
                "verified copy of it (own memory, peers' memory, persistent storage), and "
                "the next saves must be able to write that step number again; the newest "
                "restorable step is %d",
                _multihost.process_index(),
                step,
                mngr.directory,
                newest,
            )
            mngr.delete(step)


def _skipped_nonfinite(
    mngr: Any, root: Any, handlers: dict[str, TieredCheckpointHandler], restorable: set[int]
) -> dict[int, int]:
    """`_nonfinite_steps` of the restorable steps, each said to be skipped (finite=True)."""
    poisoned = _nonfinite_steps(root, handlers, restorable)
    for step, count in sorted(poisoned.items()):
        log.warning(
            "jaxckpt: [process %d] step %d of %s is restorable but holds %d NaN/Inf values: "
            "skipped (finite=True)",
            _multihost.process_index(),
            step,
            mngr.directory,
            count,
        )
    return poisoned


def _nonfinite_steps(
    root: Any, handlers: dict[str, TieredCheckpointHandler], steps: set[int]
) -> dict[int, int]:
    """Step -> its NaN/Inf count, for the `steps` whose index manifests (of any jaxckpt
    item) record any. Every process reads the same files, so all agree."""
    out: dict[int, int] = {}
    for item in handlers:
        for step, item_dir in _paths.finalized_steps(root, item).items():
            if step not in steps:
                continue
            count = _index.nonfinite_total(_index.read_index(item_dir))
            if count:
                out[step] = out.get(step, 0) + count
    return out


def tiered_handlers(mngr: Any) -> dict[str, TieredCheckpointHandler]:
    """item -> the `TieredCheckpointHandler` that handles it in `mngr`.

    Orbax exposes no public accessor for a manager's handlers (`_internals`).
    """
    return {
        item: handler
        for item, handler in _internals.manager_handlers(mngr).items()
        if isinstance(handler, TieredCheckpointHandler)
    }
