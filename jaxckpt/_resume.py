"""Resuming a job: the newest step some tier can restore, as one collective call."""

from __future__ import annotations

import logging
from typing import Any

from jaxckpt import _internals, _kept, _multihost, _paths, _storage
from jaxckpt._handler import TieredCheckpointHandler

log = logging.getLogger(__name__)


def latest_restorable_step(mngr: Any, *, delete_newer: bool = True) -> int | None:
    """The newest step of `mngr` that every jaxckpt item can restore, from any tier.

    After a process crash the newest step is usually still in memory; after a
    node or rack loss `mngr.latest_step()` may name a step whose only copies are
    gone. This finds the newest step that can really be restored (own memory,
    a peer's memory or persistent storage), so a job resumes with:

        step = jaxckpt.latest_restorable_step(mngr)
        if step is not None:
            state = mngr.restore(step, args=...)

    Collective: every process calls it, and all get the same answer.

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
      delete_newer: delete (`mngr.delete`) the finalized steps newer than the
        returned one: none of them can be restored, and the manager skips saving
        a step number that already exists, so the resumed job's next saves of
        those steps would otherwise be lost.

    Returns:
      The step, or None if no step can be restored (then, with `delete_newer`,
      every step is deleted).

    Raises:
      ValueError: if `mngr` has no item handled by a `TieredCheckpointHandler`.
      TimeoutError: if another process does not take part in time.
    """
    handlers = tiered_handlers(mngr)
    if not handlers:
        raise ValueError(
            f"[process {_multihost.process_index()}] The CheckpointManager at {mngr.directory} "
            "has no item handled by jaxckpt.TieredCheckpointHandler: register one "
            "(handler_registry.add(item, jaxckpt.TieredSave, handler), and the same for "
            "TieredRestore) or use mngr.latest_step()."
        )
    root = _storage.as_path(mngr.directory)
    # The newest durable step, if the manager's garbage collection deleted it, is put
    # back from the handler's kept copy (`_kept`): it is a candidate like any step.
    _kept.reinstate(root, sorted(handlers))
    mngr.reload()
    # Steps holding no jaxckpt item (an old loop's Orbax steps in the same directory,
    # which jaxckpt.restore_existing reads) are neither candidates nor deleted.
    ours = set().union(*(_paths.finalized_steps(root, item) for item in handlers))
    steps = sorted(s for s in mngr.all_steps() if s in ours)
    restorable = set(steps)
    for item, handler in sorted(handlers.items()):
        # Any item directory will do: the handler looks at the step directories next to it.
        restorable &= set(handler.restorable_steps(root / "0" / item))
    newest = max(restorable, default=None)
    if delete_newer:
        for step in steps:
            if newest is None or step > newest:
                log.warning(
                    "jaxckpt: [process %d] deleting step %d of %s: no tier holds a complete "
                    "verified copy of it (own memory, peers' memory, persistent storage), and "
                    "the next saves must be able to write that step number again; %s",
                    _multihost.process_index(),
                    step,
                    mngr.directory,
                    "nothing is restorable"
                    if newest is None
                    else f"the newest restorable step is {newest}",
                )
                mngr.delete(step)
    return newest


def tiered_handlers(mngr: Any) -> dict[str, TieredCheckpointHandler]:
    """item -> the `TieredCheckpointHandler` that handles it in `mngr`.

    Orbax exposes no public accessor for a manager's handlers (`_internals`).
    """
    return {
        item: handler
        for item, handler in _internals.manager_handlers(mngr).items()
        if isinstance(handler, TieredCheckpointHandler)
    }
