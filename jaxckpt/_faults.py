"""The fault points: the one seam through which a test changes what the library does at a
named point of a save, a persist or a collective operation.

Production code only marks its points (`at`, or `failure` where the caller carries the
error into an exchange instead of raising it); nothing is installed in a normal run, so
a point costs one lookup and does nothing. Tests install hooks (`install`, `hooked`),
which run at every point with its name, step and process, and may block there, sleep,
raise (a failure of this process's own work) or kill the process. The faults the tests
use, including the `JAXCKPT_FAULT` environment variable their child processes read, are
the tests' own (`tests/support/faults.py`), installed through this seam.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Final

# Every point, in the order a save, a persist and the collective operations reach them.
POINTS: Final = (
    "snapshot",  # after the device->host copy, before async_save returns
    "memory_write",  # chunks written to the memory staging directory, not committed
    "memory_commit",  # memory part committed, replicas not pushed
    "replicate",  # replicas being pushed
    "replicated",  # replicas pushed, index manifest not written
    "index",  # index manifest written, commit future not finished
    "persist_begin",  # a persist job begins on the persister's thread, nothing written
    "persist_write",  # persisted chunks staged, not renamed into place
    "persist_commit",  # part durable in the checkpoint directory
    # `<operation>.open` is the opening of the run (before the first exchange); the others
    # are the operations' exchanges, in order (`run/_choreography`).
    "save.open",
    "save.meet",
    "save.agree",
    "restore.open",
    "restore.meet",
    "restore.inventories",
    "restore.agree",
    "restore.reshard",  # taken to the verdict just before it (`RestoreChoreography`)
    "list.open",
    "list.meet",
    "list.inventories",
    "list.agree",
    "release.agree",
)
_KNOWN: Final = frozenset(POINTS)

# A hook: called as hook(point, step, process) at every point while it is installed.
Hook = Callable[[str, int | None, int], None]

_LOCK: Final = threading.Lock()
_HOOKS: Final[list[Hook]] = []  # installed by tests only; empty in a normal run


def at(point: str, step: int | None, process: int) -> None:
    """Marks the point `point` of `step` on `process`: runs the installed hooks, which may
    block, raise or end the process; does nothing when none is installed.

    Raises:
      ValueError: if `point` is not one of `POINTS`.
    """
    _known(point)
    for hook in tuple(_HOOKS):
        hook(point, step, process)


def failure(point: str, step: int | None, process: int) -> Exception | None:
    """`at`, for a caller that carries a local error into an exchange instead of raising
    it (`run/_choreography`): the error a hook raised at `point`, or None.

    Raises:
      ValueError: if `point` is not one of `POINTS`.
    """
    _known(point)
    try:
        for hook in tuple(_HOOKS):
            hook(point, step, process)
    except Exception as e:
        return e
    return None


def _known(point: str) -> None:
    if point not in _KNOWN:
        raise ValueError(f"Unknown fault point {point!r}: one of {', '.join(POINTS)}.")


def install(hook: Hook) -> Callable[[], None]:
    """Runs `hook` at every point from now on (a test, or a test's child process for its
    whole life); returns the call that removes it."""
    with _LOCK:
        _HOOKS.append(hook)

    def remove() -> None:
        with _LOCK:
            if hook in _HOOKS:
                _HOOKS.remove(hook)

    return remove


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Runs `hook` at every point while the block runs."""
    remove = install(hook)
    try:
        yield
    finally:
        remove()
