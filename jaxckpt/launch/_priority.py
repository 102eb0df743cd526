"""The CPU priority of hot spares: low while they prepare and wait, the job's once woken.

A spare prepares (imports, compiles, runs its train step once) while the job it stands
by for trains, on the same CPUs when the launcher runs everything on one machine. Given a
high nice value as it starts, it takes mostly the CPU the job leaves idle; woken, it gets
the job's priority back (`set_priority` 0).

At the nicest value (`NICEST`, the launcher's default) a spare's threads are also put in
Linux's idle scheduling class (``SCHED_IDLE``): a nice value only weighs CPU time, so a
thread of the job that wakes (the job's processes wake each other at every collective)
may wait for a spare at nice 19 to use up its slice, where it preempts an idle-class
thread at once. Measured beside one process training on 2
CPUs (~140 ms steps), a stand-in spare compiling without pause, 4 interleaved rounds:
steps x1.087 at nice 18 in the normal class (it got ~2 CPU-seconds a 4.3 s loop), x1.036
at nice 19 in the idle class (~1.2 s): the CPU the job leaves idle, and less of its
time (`jaxckpt bench --solo only`, figure 10f, measures it with `_throttle`'s cap too).

Linux schedules by session first where autogroups are on (``/proc/sys/kernel/
sched_autogroup_enabled``): the CPU goes to each session's autogroup in turn, and the
idle class weighs only among the threads of one autogroup. So the launcher's processes
share its session (`_supervise`: a process group of their own, not a session), and the
spares' idle class weighs against the job's threads directly. Measured beside one
process training on 2 CPUs, a busy spare at the idle class took 0.33-0.37 of a CPU
in the trainer's session (steps x1.10-1.13), 0.42-0.44 in a session of its own even
with its autogroup at nice 19 (x1.17-1.18): what it still takes, `_throttle` caps. A
process that leads its own session gets the nice value for its autogroup too
(``/proc/<pid>/autogroup``); one in its starter's session does not (that autogroup is
the job's). Lowering a
priority is allowed to anyone; raising it back needs ``CAP_SYS_NICE`` (root) or a
``RLIMIT_NICE`` that allows it: without either, a woken spare keeps its low priority
(`set_priority` says so). Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import contextlib
import os

NICEST = 19


def set_priority(pid: int, nice: int) -> str | None:
    """Gives every thread of process `pid` (and its autogroup, if it leads a session of
    its own) the nice value `nice`; at `NICEST` its threads also get the idle scheduling
    class, below it the normal one (threads started later take their starter's).

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
        policy = os.SCHED_IDLE if nice == NICEST else os.SCHED_OTHER
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        if _leads_session(pid):
            _write_autogroup(str(pid), nice)
    except PermissionError as e:
        return (
            f"cannot give process {pid} nice {nice} ({e.strerror}): raising a priority"
            " needs CAP_SYS_NICE or a RLIMIT_NICE that allows it"
        )
    return None


def _leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except ProcessLookupError:
        return False


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
