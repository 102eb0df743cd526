"""The examples' checkpointing: the only lines that use jaxckpt's handler and Orbax.

The examples checkpoint the whole training state after every step. That state is ONE
pytree::

    {
        "params": nnx.State,          # model parameters, FSDP-sharded jax.Arrays
        "opt_state": optax state,     # optax.adamw state (tuple of namedtuples of nnx.State)
        "rng": jax.Array,             # typed PRNG key (jax.random.key), replicated, split per step
        "data": grain DatasetIterator,  # input iterator; its state is the GLOBAL position
                                        # {"next_index": i}, equal on every process
        "step": int,                  # number of completed training steps
    }

Step ``s`` is saved right after the ``s``-th update, so a restore of step ``s`` resumes
with the ``s+1``-th batch and reproduces the uninterrupted run bit for bit. Global batch
``i`` depends only on ``(seed, i)`` and each process reads its rows of it, so a restore
onto another process count continues the same global data stream (see
``data.make_data_iterator`` and docs/multihost.md).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

import jaxckpt
from examples.job import emit
from jaxckpt import launch

PyTree = Any


def make_manager(
    ckpt_dir: str,
    memory_root: str,
    replicas: int,
    persist_every: int,
    peer_host: str = "127.0.0.1",
) -> tuple[Any, Any]:
    """Builds the CheckpointManager that saves the train state every step.

    Args:
        ckpt_dir: Persistent directory; on several hosts, one that every host sees (a
            shared filesystem such as NFS, Lustre or a GCS FUSE mount).
        memory_root: This process's tmpfs directory for the memory tier.
        replicas: Peer copies of each process's shards, in other failure domains.
        persist_every: Persist every n-th step to ``ckpt_dir``.
        peer_host: Address of this host that the other processes can reach; the peer
            data service binds to it.

    Returns:
        ``(manager, handler)``.
    """
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(
            memory_root=memory_root,
            replicas=replicas,
            persist_every=persist_every,
            peer_host=peer_host,
        )
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("train", jaxckpt.TieredSave, handler)
    registry.add("train", jaxckpt.TieredRestore, handler)
    # With the handler, garbage collection also keeps the newest persisted step.
    options = jaxckpt.manager_options(
        ckpt_dir, handler=handler, save_interval_steps=1, max_to_keep=3, keep_period=persist_every
    )
    return ocp.CheckpointManager(ckpt_dir, handler_registry=registry, options=options), handler


def open_manager(args: argparse.Namespace, process: int) -> tuple[Any, Any]:
    """The checkpoint manager and handler of ``--ckpt-dir`` (:func:`make_manager`).

    A job shrunk to fewer processes than copies asked for keeps what it can: with one
    process left there is no peer to hold a copy (a ``replicas_lowered`` event says so).
    """
    if not args.ckpt_dir:
        raise ValueError("--ckpt-dir is required unless --no-checkpoint is given.")
    replicas = min(args.replicas, jax.process_count() - 1)
    if replicas < args.replicas:
        emit(launch.ReplicasLoweredEvent(asked=args.replicas, used=replicas, process=process))
    return make_manager(
        os.path.abspath(args.ckpt_dir),
        args.memory_root,
        replicas,
        args.persist_every,
        args.peer_host,
    )


def save(manager: Any, step: int, state: PyTree) -> None:
    """Starts the save of ``state`` as ``step`` (returns after the device-to-host copy)."""
    manager.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))


def restore_latest(manager: Any, handler: Any, abstract_state: PyTree) -> PyTree | None:
    """Restores the newest step that some tier can restore.

    Collective: every process calls it. `jaxckpt.latest_restorable_step` finds the step
    (own memory, a peer's memory or persistent storage) and deletes the newer steps that
    no tier can restore, so that the manager saves those step numbers again; when no
    step is restorable, this job starts over and deletes every step itself.

    Args:
        manager: From :func:`make_manager`.
        handler: From :func:`make_manager`; may report the tier it read from.
        abstract_state: The state with ShapeDtypeStruct array leaves (with shardings), a
            fresh grain iterator (its state is set in place) and a placeholder step.

    Returns:
        The restored state, or None when there is nothing to restore.

    Raises:
        Exception: What the restore of that step raised, after a ``restore_failed``
            event; the launcher restarts the job.
    """
    start = time.perf_counter()
    step = jaxckpt.latest_restorable_step(manager)
    if step is None:
        # Nothing is restorable, and latest_restorable_step leaves the steps there are (a
        # tier may come back). This job starts over instead, so it deletes them: the
        # manager saves no step number up to the newest that exists.
        for stale in manager.all_steps():
            manager.delete(stale)
        return None
    try:
        args = ocp.args.Composite(train=jaxckpt.TieredRestore(abstract_state))
        restored = manager.restore(step, args=args).train
    except Exception as e:
        emit(launch.RestoreFailedEvent(step=step, error=repr(e), process=jax.process_index()))
        raise
    # The handler reports where the bytes came from, when it can.
    metrics = getattr(handler, "last_restore_metrics", None) or {}
    emit(
        launch.RestoredEvent(
            step=step,
            seconds=round(time.perf_counter() - start, 4),
            process=jax.process_index(),
            tier=metrics.get("tier", "unknown"),
            bytes_by_tier=metrics.get("bytes_by_tier"),
        )
    )
    return restored


class RestorePreparer:
    """For a hot spare while it waits: compiles ahead what restoring the newest step onto
    its target compiles, so that the restart only reads and places.

    A thread looks at ``ckpt_dir`` and, once a step is there, calls
    `jaxckpt.TieredCheckpointHandler.prepare_restore` for it (jaxckpt's reshard of the
    leaves replicated across processes: a restore onto another process count needs it);
    then again for the newest step every ``every_s``, in case a restart changed the
    layout the job saves in (a prepared program is not compiled twice). The spare waits
    at a low priority, and so does this thread: it takes CPU the job leaves idle. A step
    deleted meanwhile is skipped.
    """

    def __init__(self, ckpt_dir: str, abstract_state: PyTree, every_s: float = 30.0):
        self._dir = Path(ckpt_dir)
        self._target = jaxckpt.TieredRestore(abstract_state)
        self._every_s = every_s
        self._done = threading.Event()
        self.prepared: tuple[int, int, float, float] | None = None  # step, leaves, start, end
        self._thread = threading.Thread(target=self._run, name="prepare-restore", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> tuple[int, int, float, float] | None:
        """Stops looking; returns the last preparation: ``(step, leaves resharded, start,
        end)``. Waits for one under way only if none ended before (the restore needs it)."""
        self._done.set()
        if self.prepared is None:
            self._thread.join(timeout_s)
        return self.prepared

    def _newest(self) -> int | None:
        steps = [int(p.name) for p in self._dir.glob("*") if p.name.isdigit()]
        return max(steps, default=None)

    def _run(self) -> None:
        last = None
        while not self._done.is_set():
            step = self._newest() if self._dir.is_dir() else None
            if step is not None and step != last:
                start = time.time()
                try:
                    leaves = jaxckpt.TieredCheckpointHandler.prepare_restore(
                        self._dir / str(step) / "train", self._target
                    )
                except (FileNotFoundError, NotADirectoryError):
                    pass  # not finalized yet, or deleted by the manager: the next one
                else:
                    self.prepared, last = (step, leaves, start, time.time()), step
            # Until the first step is prepared, look often; then now and then.
            self._done.wait(1.0 if last is None else self._every_s)
