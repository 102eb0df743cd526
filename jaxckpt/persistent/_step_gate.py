"""When a persisted part may enter its step directory on a filesystem.

An Orbax manager deletes a step directory (`rmtree`) only in the save of a newer
step, once that save's handler calls and its commit have ended: in the same `save()` (a
synchronous manager) or on the save's finalize thread (an asynchronous one), which
the manager's next `save()` and `close()` wait for. A part renamed into a step
directory while `rmtree` empties it makes the deletion fail ("Directory not empty"),
and with it the user's save. So a part enters its step directory at once only while
no save of a newer step has begun on this process (`enter`); otherwise it waits,
complete and fsynced in the persister's staging directory, for the next moment the
manager deletes nothing (`settle`): the commit of this process's next save
(which ends before that save's deletions; on the commit's thread, off the training
stall), `wait_for_persistence` once no manager of the process is finishing a save
on its own thread (a synchronous manager deletes on the caller's thread, inside
`save()`), or the handler's close. Its step may be gone by then; the kept area
(`_kept`) holds the newest durable step meanwhile, as it does once the step is gone,
and memory retention keeps the step (`waiting_steps`).

Across processes the same order holds: every process begins a save (`begin`) and
settles before the commit's collective agreement, which the primary process's commit,
and so its deletions, wait for; those deletions end before the manager's barrier that
every process's next save waits for. A manager that deletes on a thread of its own at any time
(`enable_background_delete=True`) gives no such moment and is not supported.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

from absl import logging as log

from jaxckpt import _resources

# A deferred placement: puts one part into its step directory (or finds the step gone)
# and removes its staging; it logs its own failures.
Placement = Callable[[], None]


@dataclasses.dataclass
class _Root:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    newest_begun: int | None = None  # the newest step whose save began on this process
    waiting: list[tuple[int, Placement]] = dataclasses.field(default_factory=list)


_ROOTS: dict[Path, _Root] = _resources.SHARED.cache({})
_ROOTS_LOCK = threading.Lock()


def _root(root: Path) -> _Root:
    with _ROOTS_LOCK:
        return _ROOTS.setdefault(root, _Root())


def enter(root: Path, step: int, place: Placement) -> bool:
    """Runs `place` now if no save of a step newer than `step` has begun in `root` on
    this process; else keeps it for the next `settle`.

    Returns:
      Whether it ran now.
    """
    gate = _root(root)
    with gate.lock:
        if gate.newest_begun is None or step >= gate.newest_begun:
            place()
            return True
        gate.waiting.append((step, place))
        return False


def begin(root: Path, step: int) -> None:
    """A save of `step` begins in `root` (the manager may delete older steps once the
    save's commit has ended): from now on a part of an older step waits."""
    gate = _root(root)
    with gate.lock:
        gate.newest_begun = step if gate.newest_begun is None else max(gate.newest_begun, step)


def settle(root: Path) -> bool:
    """Runs the waiting placements of `root` (the manager deletes nothing now).

    Returns:
      Whether any ran.
    """
    gate = _root(root)
    with gate.lock:
        return _run(gate)


def waiting_steps() -> set[int]:
    """The steps with a part waiting to enter its step directory, in any directory."""
    with _ROOTS_LOCK:
        gates = list(_ROOTS.values())
    steps: set[int] = set()
    for gate in gates:
        with gate.lock:
            steps.update(step for step, _ in gate.waiting)
    return steps


def _run(gate: _Root) -> bool:
    waiting, gate.waiting = gate.waiting, []
    for _, place in waiting:
        try:
            place()
        except Exception:  # a placement logs what it knows; never fails a save
            log.exception("jaxckpt: placing a persisted part into its step directory failed")
    return bool(waiting)
