"""This process in its job: joining ``jax.distributed``, events, failures, hot spares.

Joining (:func:`setup_jax`), the event lines (:func:`emit`), failure injection
(:func:`maybe_kill`), a hot spare's wait for its go line (:func:`await_go`) and a stop
the job is asked for (:func:`stop_requested`).

Every process prints one JSON event per line on stdout; the launcher and the demo parse
them. The events and their fields are defined in ``jaxckpt.launch``
(``StepEvent``, ``RestoredEvent``, ...; the module ``jaxckpt/launch/_events.py``).

Environment (set by ``python -m jaxckpt.launch``; all optional):

- ``JAXCKPT_COORDINATOR`` (``host:port``), ``JAXCKPT_NUM_PROCESSES``,
  ``JAXCKPT_PROCESS_ID``: start ``jax.distributed`` on CPU devices with gloo collectives.
- ``JAXCKPT_CPU_DEVICES``: CPU devices per process (default 2 when distributed).
- ``JAXCKPT_MEMORY_ROOT``: default of ``--memory-root``.
- ``JAXCKPT_KILL_AT_STEP`` / ``JAXCKPT_KILL_PROCESS``: failure injection; the named
  process SIGKILLs itself right after the save of that step is issued.
- ``JAXCKPT_STANDBY=1`` (``jaxckpt.launch --standby``): start as a hot spare of the job
  that the variables above name (coordinator, process id and count, devices): join it,
  build the mesh, data and abstract state, compile the train step and run it once on a
  fresh state (``training.warm_up``), print the ``standby`` event, then wait for one JSON
  line on stdin, ``{"env": {...}}``: the variables of where it runs (memory root, failure
  domain, ...), set before the checkpoint manager is built (:func:`await_go`). End of
  input means the spare is not needed: exit 0.

SIGTERM is JAX's preemption notice once ``jax.distributed`` runs: the launcher sends it to
grow the job back (``--grow-at-save``), and the loop stops at the step its processes agree
on, after that step's save (:func:`stop_requested`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Final

import jax
from jax.experimental import multihost_utils

from examples.timeline import Timeline
from jaxckpt import launch

ENV_COORDINATOR: Final = "JAXCKPT_COORDINATOR"
ENV_NUM_PROCESSES: Final = "JAXCKPT_NUM_PROCESSES"
ENV_PROCESS_ID: Final = "JAXCKPT_PROCESS_ID"
ENV_CPU_DEVICES: Final = "JAXCKPT_CPU_DEVICES"
ENV_MEMORY_ROOT: Final = "JAXCKPT_MEMORY_ROOT"
ENV_KILL_AT_STEP: Final = "JAXCKPT_KILL_AT_STEP"
ENV_KILL_PROCESS: Final = "JAXCKPT_KILL_PROCESS"
ENV_STANDBY: Final = "JAXCKPT_STANDBY"
HEARTBEAT_S: Final = 5  # a dead process fails the others' next collective soon
# A hot spare waits at the idle class, stopped but for 1 ms in 100 while the job trains
# (`jaxckpt.launch --standby-cpu`): its job's heartbeats may starve for seconds (with the
# job's 5 s, pauses of 250 ms-1 s killed spare jobs ("stopped sending heartbeats"), and
# one spare job in ~10 demo runs at 1 ms in 100 could not take over, why not unrecorded).
# It keeps this timeout once woken; the launcher notices a dead process at once anyway.
STANDBY_HEARTBEAT_S: Final = 120


def setup_jax(cluster: bool = False) -> None:
    """Configures jax and joins the distributed job, if there is one.

    Must run before any other jax call. With ``JAXCKPT_COORDINATOR`` set, every process
    runs on CPU devices with gloo collectives and meets the others on loopback; with
    ``cluster`` it lets ``jax.distributed.initialize()`` detect a real cluster.

    Args:
        cluster: Call ``jax.distributed.initialize()`` without arguments (SLURM, TPU, ...).
    """
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator or ENV_CPU_DEVICES in os.environ:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(os.environ.get(ENV_CPU_DEVICES, "2")))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            coordinator_bind_address=coordinator,
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
            heartbeat_timeout_seconds=(
                STANDBY_HEARTBEAT_S if os.environ.get(ENV_STANDBY) == "1" else HEARTBEAT_S
            ),
            initialization_timeout=60,
            shutdown_timeout_seconds=60,
        )
    elif cluster:
        jax.distributed.initialize()
    # IMPORTANT: create the backend now, in every process. Creating it exchanges the
    # device topology through the coordination service: a process blocks there until
    # every other process has created its own backend, so one that puts it off (or never
    # touches a device) stalls the others, then fails them on a timeout of minutes.
    jax.devices()


def emit(event: launch.Event) -> None:
    """Prints one event line on stdout and flushes it."""
    print(launch.format_event(event), flush=True)


def maybe_kill(step: int) -> None:
    """SIGKILLs this process if the failure-injection env names this step and process."""
    at = os.environ.get(ENV_KILL_AT_STEP)
    who = os.environ.get(ENV_KILL_PROCESS, "0")
    if at is not None and int(at) == step and int(who) == jax.process_index():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def stop_requested(step: int) -> bool:
    """Whether the job stops after ``step``, its save included: True on every process at
    the same step once any of them got a preemption notice (SIGTERM).

    JAX's preemption sync point: each process must call it once at every step, from the
    same first step on (Orbax's ``CheckpointManager.save`` also asks it, for the same
    step). False without ``jax.distributed`` (no preemption service).
    """
    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # no preemption service: one process without jax.distributed
        return False


def await_go(timeline: Timeline) -> None:
    """As a hot spare (``JAXCKPT_STANDBY=1``): waits for the launcher's go line.

    The spare has joined its (spare) job, built its mesh and data, and compiled its
    train step; the go line carries the variables that say where it runs (memory root,
    failure domain, ...). Exits 0 at the end of input: the launcher did not need it.

    Raises:
        ValueError: If the go line is not ``{"env": {...}}``, or names another
            coordinator than the one this spare joined.
    """
    # jaxckpt and Orbax were imported at the start (`from jaxckpt import launch`), not at
    # the restart: they are part of what the spare is for.
    start = time.time()
    emit(launch.StandbyEvent(process=jax.process_index()))
    line = sys.stdin.readline()
    if not line.strip():
        raise SystemExit(0)
    go = json.loads(line)
    if not isinstance(go, dict) or not isinstance(go.get("env"), dict):
        raise ValueError(f'The go line must be {{"env": {{...}}}}, got {line.strip()!r}.')
    env = {str(k): str(v) for k, v in go["env"].items()}
    joined = os.environ.get(ENV_COORDINATOR)
    if env.get(ENV_COORDINATOR, joined) != joined:
        raise ValueError(
            f"[process {jax.process_index()}] this spare joined the job of coordinator "
            f"{joined}, but its go line names {env[ENV_COORDINATOR]}: the launcher must "
            "wake spares with the job they were started for."
        )
    os.environ.update(env)
    del os.environ[ENV_STANDBY]
    timeline.add("standby", start, time.time())
