"""The CPU priority of hot spares: low while they prepare and wait, the job's once woken.

A spare prepares (imports, compiles, runs its train step once) while the job it stands
by for trains, on the same CPUs when the launcher runs everything on one machine. Given a
high nice value as it starts, it takes mostly the CPU the job leaves idle; woken, it gets
the job's priority back (`set_nice` 0).

Linux schedules by session first where autogroups are on (``/proc/sys/kernel/
sched_autogroup_enabled``): every process the launcher starts has a session of its own,
and a nice value weighs only against the other threads of the same session. So the
session's autogroup gets the same nice value (``/proc/<pid>/autogroup``). Lowering a
priority is allowed to anyone; raising it back needs ``CAP_SYS_NICE`` (root) or a
``RLIMIT_NICE`` that allows it: without either, a woken spare keeps its low priority
(`set_nice` says so). Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import os

NICEST = 19


def set_nice(pid: int, nice: int) -> str | None:
    """Gives every thread of process `pid`, and its autogroup, the nice value `nice`.

    Returns:
        None when done (or the process is gone), else why not (no permission to raise
        a priority).
    """
    if not 0 <= nice <= NICEST:
        raise ValueError(f"A nice value must be in 0..{NICEST}, got {nice}.")
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return None  # exited: nothing to restore
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        _write_autogroup(str(pid), nice)
    except PermissionError as e:
        return (
            f"cannot give process {pid} nice {nice} ({e.strerror}): raising a priority"
            " needs CAP_SYS_NICE or a RLIMIT_NICE that allows it"
        )
    return None


def _write_autogroup(pid: str, nice: int) -> None:
    """Sets the nice value of `pid`'s autogroup, where the kernel has autogroups.

    Raises:
        PermissionError: If this process may not set it.
    """
    try:
        fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
    except FileNotFoundError:
        return  # no autogroups (or no /proc): the thread's nice value is all there is
    try:
        os.write(fd, str(nice).encode())
    except PermissionError:
        raise
    except OSError:
        pass  # autogroups switched off: the write is refused, and means nothing then
    finally:
        os.close(fd)
