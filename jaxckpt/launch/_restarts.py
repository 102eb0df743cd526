"""The attempts of one launch: the first, a restart after each failure, and a grow back
when a lost failure domain (or a new host) returns.

A failure restarts the whole job (the only recovery JAX allows) on the same nodes or,
with ``--processes-after-failure M``, on M of them: the job shrinks when no node takes
the lost one's place. A node that registers later (`_registry`; ``--return-node P@S``
simulates it) grows the job back to its launched size with ``--grow-at-save``: once the
job trains (and, with ``--standby``, once the spares of that size are ready, so that the
grow costs a restore and a step), every process gets SIGTERM, a JAX preemption notice; a
job that supports it (the examples do) stops at the next step its processes agree on,
after that step's save is committed, and exits 0 (``stopped`` event). The launcher then
restarts it on its nodes and the returned ones, which restore that step from the memory
tiers and peers. Imports neither jax nor the rest of jaxckpt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from jaxckpt.launch._attempt import Attempt, run_attempt
from jaxckpt.launch._registry import Registry, register
from jaxckpt.launch._report import (
    describe_returncode,
    failure_report,
    format_failure,
    format_grow,
    grow_report,
)
from jaxckpt.launch._standby import Standby
from jaxckpt.launch._supervise import PortRetries, free_port
from jaxckpt.launch._throttle import Throttle

MAX_PORT_RETRIES: Final = 5


def next_nodes(nodes: list[int], lost: int | None, count: int | None) -> list[int]:
    """The nodes of the job restarted after a failure.

    The same nodes when the job keeps its size (a lost node comes back empty, like
    a spare); when it shrinks, the surviving nodes in order, the lost one first out;
    when it grows, fresh nodes.
    """
    if count is None or count == len(nodes):
        return list(nodes)
    survivors = [k for k in nodes if k != lost]
    fresh = range(max(nodes) + 1, max(nodes) + 1 + max(0, count - len(survivors)))
    return (survivors + list(fresh))[:count]


class Restarts:
    """The attempts of one launch, until one ends with every process exiting 0 (a grow
    back's stop does not count) or ``--max-restarts`` restarts after failures are spent
    (a port retry or a grow back is no such restart).

    Attributes:
        attempts: Every attempt, in order.
        failures: A `failure_report` per failure, with the restart that followed it.
        grows: A `grow_report` per grow back, with its restart.
        restarts: Restarts after failures so far.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        command: Sequence[str],
        injection: tuple[int, int] | None,
        base: str,
        cache_env: Mapping[str, str],
    ):
        self.attempts: list[Attempt] = []
        self.failures: list[dict[str, Any]] = []
        self.grows: list[dict[str, Any]] = []
        self.restarts = 0
        self._args = args
        self._command = command
        self._injection = injection
        self._base = base
        self._cache_env = cache_env
        self._nodes = list(range(args.num_processes))
        self._ports = PortRetries(MAX_PORT_RETRIES)
        # The attempt that ended and awaits its restart: ("failure", attempt, node lost)
        # or ("grow", attempt, nodes added).
        self._pending: tuple[str, Attempt, Any] | None = None
        self._standby = (
            Standby(command, args.cpu_devices, cache_env, args.standby_nice)
            if args.standby
            else None
        )
        self._throttle = Throttle(args.standby_cpu)
        self._registry = Registry(args.register_dir or os.path.join(base, "register"))
        self._returned: list[int] = []  # registered nodes not in the job yet
        self._return_done = False  # --return-node registered its node

    def run(self) -> None:
        """Runs attempts until one succeeds or no restart is left."""
        self._first_spares()
        while True:
            attempt, injected = self._run_next()
            if self._ports.retry(attempt.outcome == "port"):
                print(f"[launch] port {attempt.port} in use, retrying", flush=True)
                continue
            self._report(attempt)
            if attempt.outcome == "stopped":
                self._grow(attempt)
                continue
            if attempt.outcome == "ok" or not self._restart_after(attempt, injected):
                return

    def close(self) -> None:
        """Kills the spares no attempt woke."""
        if self._standby is not None:
            self._standby.close()

    # ---- hot spares ---------------------------------------------------------

    def _spare_sizes(self) -> set[int]:
        """The sizes the next restart may take: after a failure, and of a grow back."""
        args, sizes = self._args, set()
        if self.restarts < args.max_restarts:
            sizes.add(args.processes_after_failure or len(self._nodes))
        if args.grow_at_save:
            sizes.add(args.num_processes)
        return sizes

    def _first_spares(self) -> None:
        """Prepares the first spares before the job starts (`_standby`)."""
        if self._standby is None or not self._spare_sizes():
            return
        start = time.monotonic()
        sizes = self._standby.fill(self._spare_sizes(), nice=0)
        print(f"[launch] standby: preparing spare jobs of {sizes} processes", flush=True)
        why = self._standby.wait_ready(self._args.standby_timeout)
        print(
            f"[launch] standby: {why or 'ready'} after {time.monotonic() - start:.1f} s;"
            f" the spares wait at nice {self._standby.nice}",
            flush=True,
        )

    def _prepare_spares(self) -> None:
        """Replaces the spares woken, once the attempt trains (at the low priority)."""
        if self._standby is not None:
            self._standby.fill(self._spare_sizes())

    # ---- attempts -----------------------------------------------------------

    def _run_next(self) -> tuple[Attempt, bool]:
        """Runs the next attempt (on the spares of its size, if they wait); returns it and
        whether it carried the injected failure (only attempts before any ran do)."""
        nodes = self._nodes
        first = all(a.outcome == "port" for a in self.attempts)
        # The spares stand by for restarts: the first attempt starts its own processes.
        restart = self._standby is not None and not first
        woken = self._standby.take(len(nodes)) if restart and self._standby else None
        port = woken.port if woken is not None and woken.port else free_port()
        attempt = Attempt(
            index=len(self.attempts), num_processes=len(nodes), port=port, nodes=list(nodes)
        )
        inject = self._injection if first else None
        print(
            f"[launch] attempt {attempt.index}: {len(nodes)} processes on nodes {nodes},"
            f" port {attempt.port}" + (" (hot spares)" if woken else ""),
            flush=True,
        )
        spare_pids = self._standby.pids if self._standby is not None else list
        # The spares no restart woke take little CPU while the job runs (`_throttle`);
        # between attempts they prepare at full speed.
        with self._throttle.running(spare_pids):
            run_attempt(
                attempt,
                self._command,
                self._base,
                self._args.cpu_devices,
                self._args.hang_timeout,
                inject,
                env=self._cache_env,
                spares=woken,
                on_training=self._prepare_spares,
                should_stop=self._should_stop,
                spare_pids=spare_pids,
            )
        self.attempts.append(attempt)
        return attempt, inject is not None

    def _report(self, attempt: Attempt) -> None:
        """Reports the failure or grow back that `attempt` restarted from, if any."""
        if self._pending is None:
            return
        kind, before, detail = self._pending
        self._pending = None
        if kind == "grow":
            self.grows.append(grow_report(before, attempt, detail))
            print("[launch] " + format_grow(self.grows[-1]), flush=True)
        else:
            self.failures.append(failure_report(before, attempt, detail))
            print("[launch] " + format_failure(self.failures[-1]), flush=True)

    def _restart_after(self, attempt: Attempt, injected: bool) -> bool:
        """Handles a failed attempt: loses its node's memory for ``--lose-node``, then
        plans the restart; False when no restart is left."""
        args = self._args
        lose = bool(args.lose_node) and injected
        lost_node = None
        if lose and attempt.process is not None:
            lost_node = self._nodes[args.lose_node[0]]
            shutil.rmtree(os.path.join(self._base, f"node{lost_node}"), ignore_errors=True)
        print(
            f"[launch] process {attempt.process} failed: {attempt.outcome}"
            f" ({describe_returncode(attempt.returncode)}) at step {attempt.last_step},"
            f" detected after {attempt.detected_after_s} s; killed the others",
            flush=True,
        )
        if self.restarts >= args.max_restarts:
            self.failures.append(failure_report(attempt, None, lose))
            print(f"[launch] giving up after {self.restarts} restarts", flush=True)
            return False
        self.restarts += 1
        self._pending = ("failure", attempt, lose)
        self._nodes = next_nodes(self._nodes, lost_node, args.processes_after_failure)
        return True

    # ---- grow back ----------------------------------------------------------

    def _should_stop(self, attempt: Attempt) -> bool:
        """Asked at every poll of a running attempt: takes registrations (and registers
        ``--return-node``'s node when due); True once the job should stop to grow back."""
        args = self._args
        if args.return_node and not self._return_done:
            node, step = args.return_node
            if node not in self._nodes and attempt.last_step >= step:
                register(self._registry.directory, node)
                self._return_done = True
        for node in self._registry.take():
            if node in self._nodes or node in self._returned:
                print(f"[launch] node{node} registered, but it is in the job already", flush=True)
                continue
            self._returned.append(node)
            print(f"[launch] node{node} registered", flush=True)
        if not (args.grow_at_save and self._returned and len(self._nodes) < args.num_processes):
            return False
        if attempt.first_step_s is None:
            return False  # not training yet: let it restore and train first
        if self._standby is not None and self._standby.preparing(args.num_processes):
            return False  # grow once its spares are ready: then it costs a restore
        print(
            f"[launch] growing back to {args.num_processes} processes: asking the job to stop"
            f" at its next save (SIGTERM, a preemption notice), at step {attempt.last_step}",
            flush=True,
        )
        return True

    def _grow(self, stopped: Attempt) -> None:
        """Plans the restart of a job that stopped to grow back: its nodes, then the
        registered ones, up to the launched size."""
        added = self._returned[: self._args.num_processes - len(self._nodes)]
        self._returned = self._returned[len(added) :]
        self._nodes = self._nodes + added
        self._pending = ("grow", stopped, added)
        print(
            f"[launch] the job stopped after step {stopped.last_step}; restarting it on"
            f" nodes {self._nodes}",
            flush=True,
        )
