"""Test-only fault injection: crash this process at a named phase of a save, or fail
it just before an exchange of a collective operation.

The one place where an environment variable changes behaviour. Set
`JAXCKPT_FAULT=<phase>@<step>[@<process>]` and the process kills itself with
SIGKILL when it reaches that phase of that step, so that tests can crash a save
at an exact point instead of relying on timing luck. Set
`JAXCKPT_FAULT=fail:<point>@<step>[@<process>]` (`<step>` may be `*`) and the
process fails there with a `RuntimeError`, as if its own work had failed just
before that exchange (`_choreography`): every process must then raise it.
"""

from __future__ import annotations

import os
import signal
from typing import Final

ENV: Final = "JAXCKPT_FAULT"
PHASES: Final = (
    "snapshot",  # after the device->host copy, before async_save returns
    "memory_write",  # chunks written to the memory staging directory, not committed
    "memory_commit",  # memory part committed, replicas not pushed
    "replicate",  # replicas being pushed
    "replicated",  # replicas pushed, index manifest not written
    "index",  # index manifest written, commit future not finished
    "persist_write",  # persisted chunks staged, not renamed into place
    "persist_commit",  # part durable in the checkpoint directory
)
FAIL: Final = "fail:"  # the prefix of a point where the process fails instead
# `<operation>.open` is the opening of the run (before the first exchange); the others
# are the operations' exchanges, in order (`_choreography`).
POINTS: Final = (
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


def _wanted(name: str, step: int | None, process: int) -> bool:
    spec = os.environ.get(ENV)
    if not spec:
        return False
    want, want_step, *rest = spec.split("@")
    return (
        want == name
        and (want_step == "*" or (step is not None and int(want_step) == step))
        and (not rest or int(rest[0]) == process)
    )


def maybe_crash(phase: str, step: int, process: int) -> None:
    """Kills this process if `JAXCKPT_FAULT` names this phase, step and process."""
    if _wanted(phase, step, process):
        os.kill(os.getpid(), signal.SIGKILL)


def injected(point: str, step: int | None, process: int) -> RuntimeError | None:
    """The failure `JAXCKPT_FAULT=fail:<point>@...` asks for here, or None."""
    if point not in POINTS:
        raise ValueError(f"Unknown fault point {point!r}: one of {', '.join(POINTS)}.")
    if not _wanted(FAIL + point, step, process):
        return None
    return RuntimeError(f"[process {process}] injected fault before {point} of step {step} ({ENV})")


def maybe_fail(point: str, step: int | None, process: int) -> None:
    """Raises the failure `JAXCKPT_FAULT=fail:<point>@...` asks for here, if any."""
    error = injected(point, step, process)
    if error is not None:
        raise error
