"""Test-only fault injection: crash this process at a named phase of a save.

The one place where an environment variable changes behaviour. Set
`JAXCKPT_FAULT=<phase>@<step>[@<process>]` and the process kills itself with
SIGKILL when it reaches that phase of that step, so that tests can crash a save
at an exact point instead of relying on timing luck.
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


def maybe_crash(phase: str, step: int, process: int) -> None:
    """Kills this process if `JAXCKPT_FAULT` names this phase, step and process."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_phase, want_step, *rest = spec.split("@")
    if want_phase == phase and int(want_step) == step and (not rest or int(rest[0]) == process):
        os.kill(os.getpid(), signal.SIGKILL)
