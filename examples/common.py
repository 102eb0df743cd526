"""Shared pieces of the jaxckpt examples: processes, mesh, sharding, data, training loop.

The examples train a Flax NNX model with optax on a global mesh and checkpoint the
whole training state after every step. That state is ONE pytree::

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
:func:`make_data_iterator` and docs/multihost.md).

Every process prints one JSON object per line on stdout (the launcher and the demo parse
them)::

    {"event": "start", "process": p, "num_processes": n, "devices": d, "mesh": {...}}
    {"event": "restored", "step": s, "seconds": t, "process": p, "tier": "memory"|...|"unknown",
     "bytes_by_tier": {...}}  # bytes_by_tier only when the handler reports it
    {"event": "restore_failed", "step": s, "error": "...", "process": p}
    {"event": "step", "step": s, "loss": l, "data": "<uint32 hex checksum of the global batch>",
     "process": p}
    {"event": "save", "step": s, "seconds": t, "process": p}
    {"event": "done", "step": s, "seconds": t, "process": p}
    {"event": "replicas_lowered", "asked": r, "used": u, "process": p}  # fewer processes

Environment (set by ``python -m jaxckpt.launch``; all optional):

- ``JAXCKPT_COORDINATOR`` (``host:port``), ``JAXCKPT_NUM_PROCESSES``,
  ``JAXCKPT_PROCESS_ID``: start ``jax.distributed`` on CPU devices with gloo collectives.
- ``JAXCKPT_CPU_DEVICES``: CPU devices per process (default 2 when distributed).
- ``JAXCKPT_MEMORY_ROOT``: default of ``--memory-root``.
- ``JAXCKPT_KILL_AT_STEP`` / ``JAXCKPT_KILL_PROCESS``: failure injection; the named
  process SIGKILLs itself right after the save of that step is issued.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ENV_COORDINATOR: Final = "JAXCKPT_COORDINATOR"
ENV_NUM_PROCESSES: Final = "JAXCKPT_NUM_PROCESSES"
ENV_PROCESS_ID: Final = "JAXCKPT_PROCESS_ID"
ENV_CPU_DEVICES: Final = "JAXCKPT_CPU_DEVICES"
ENV_MEMORY_ROOT: Final = "JAXCKPT_MEMORY_ROOT"
ENV_KILL_AT_STEP: Final = "JAXCKPT_KILL_AT_STEP"
ENV_KILL_PROCESS: Final = "JAXCKPT_KILL_PROCESS"

DATA_AXIS: Final = "data"
FSDP_AXIS: Final = "fsdp"

PyTree = Any
Batch = Any
LossFn = Callable[[Any, Batch, jax.Array], jax.Array]  # (model, batch, dropout key)


# ----------------------------------------------------------------------------- processes


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
            heartbeat_timeout_seconds=5,
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


def log_event(event: str, **fields: Any) -> None:
    """Prints one JSON event line on stdout and flushes it."""
    print(json.dumps({"event": event, **fields}), flush=True)


def maybe_kill(step: int) -> None:
    """SIGKILLs this process if the failure-injection env names this step and process."""
    at = os.environ.get(ENV_KILL_AT_STEP)
    who = os.environ.get(ENV_KILL_PROCESS, "0")
    if at is not None and int(at) == step and int(who) == jax.process_index():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- sharding


def make_mesh(data_parallel: int = 1) -> Mesh:
    """Builds a global ``(data, fsdp)`` mesh over all devices of all processes.

    Args:
        data_parallel: Size of the ``data`` axis (pure replicas); the rest is ``fsdp``.

    Returns:
        A mesh with Auto axes (``jax.make_mesh`` would default to Explicit axes, which
        ``jax.jit(tx.init)`` rejects).

    Raises:
        ValueError: If the device count is not divisible by ``data_parallel``.
    """
    devices = np.array(jax.devices())
    if data_parallel < 1 or devices.size % data_parallel:
        raise ValueError(f"--data-parallel={data_parallel} must divide the {devices.size} devices.")
    grid = devices.reshape(data_parallel, devices.size // data_parallel)
    return Mesh(grid, (DATA_AXIS, FSDP_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def fsdp_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Shards the largest dimension divisible by the ``fsdp`` axis; replicates otherwise."""
    size = mesh.shape[FSDP_AXIS]
    candidates = [(dim, -i) for i, dim in enumerate(shape) if dim % size == 0 and dim >= size]
    spec: list[str | None] = [None] * len(shape)
    if size > 1 and candidates:
        spec[-max(candidates)[1]] = FSDP_AXIS
    return NamedSharding(mesh, P(*spec))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Splits the leading (batch) dimension over every device of the mesh."""
    return NamedSharding(mesh, P((DATA_AXIS, FSDP_AXIS)))


def with_fsdp_shardings(abstract: PyTree, mesh: Mesh) -> PyTree:
    """Returns ``abstract`` (ShapeDtypeStructs) with an FSDP sharding on every leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fsdp_sharding(x.shape, mesh)),
        abstract,
    )


# ----------------------------------------------------------------------------- data


def process_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """Returns the rows ``[lo, hi)`` of every global batch that this process feeds.

    They are the rows :func:`batch_sharding` places on this process's devices, so the
    global batch the model sees is exactly the global stream's batch, in order, whatever
    the process count.

    Raises:
        ValueError: If the batch does not split evenly over the devices, or this process's
            rows are not one contiguous block of the batch.
    """
    if global_batch % mesh.size:
        raise ValueError(
            f"The global batch {global_batch} must be divisible by the {mesh.size} devices "
            f"of the mesh; pass --batch with a multiple of {mesh.size}."
        )
    indices = batch_sharding(mesh).addressable_devices_indices_map((global_batch,))
    rows = sorted({r for index in indices.values() for r in range(*index[0].indices(global_batch))})
    lo, hi = rows[0], rows[-1] + 1
    if rows != list(range(lo, hi)) or lo % (hi - lo):
        raise ValueError(
            f"[process {jax.process_index()}] its devices hold rows {rows} of the global "
            "batch, not one aligned block; order jax.devices() by process."
        )
    return lo, hi


def make_data_iterator(
    records: Sequence[Any] | np.ndarray, seed: int, global_batch: int, mesh: Mesh
) -> Any:
    """Builds this process's grain iterator over its slice of every global batch.

    The global stream is the shuffled, endlessly repeated record sequence cut into
    ``global_batch``-sized batches: global batch ``i`` is a function of ``(seed, i)`` only.
    Each process reads the rows of batch ``i`` that land on its devices
    (:func:`process_rows`). The iterator's state is therefore ``{"next_index": i}``, the
    GLOBAL position, identical on every process and meaningful for any process count:
    a checkpoint saved by 4 processes resumes on 3 with the same global batches.

    Args:
        records: The whole data set (every process holds it; the examples are small).
        seed: Shuffle seed; each epoch is reshuffled.
        global_batch: Global batch size; must be divisible by the device count.
        mesh: The training mesh (see :func:`make_mesh`).

    Returns:
        A ``grain`` ``DatasetIterator`` (has ``get_state()``/``set_state()``).
    """
    ds = process_stream(records, seed, global_batch, *process_rows(mesh, global_batch))
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(ds.to_iter_dataset(read_options=options))


def process_stream(
    records: Sequence[Any] | np.ndarray, seed: int, global_batch: int, lo: int, hi: int
) -> grain.MapDataset:
    """Rows ``[lo, hi)`` of every global batch of the stream, as a grain ``MapDataset``.

    Element ``i`` is rows ``lo:hi`` of global batch ``i``, whatever the other processes
    read: the position ``i`` means the same thing for any split of the batch.
    """
    local = hi - lo
    if not 0 <= lo < hi <= global_batch or global_batch % local or lo % local:
        raise ValueError(f"rows [{lo}, {hi}) are not an aligned block of a {global_batch} batch.")
    # Micro-batches of `local` rows: global batch i is micro-batches i*k .. i*k + k-1, and
    # this process takes the (lo // local)-th of each group.
    k = global_batch // local
    ds = grain.MapDataset.source(records).shuffle(seed=seed).repeat()
    return ds.batch(local, drop_remainder=True)[lo // local :: k]


def to_global_batch(local: Batch, mesh: Mesh) -> Batch:
    """Assembles the global batch from every process's local numpy batch."""
    sharding = batch_sharding(mesh)

    def assemble(x: np.ndarray) -> jax.Array:
        shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(assemble, local)


def fingerprint(batch: Batch) -> jax.Array:
    """A uint32 checksum of the global batch's bytes and their positions (jit-able).

    Integer sums are exact and associative, so the value depends on the batch only, not
    on how it is sharded: runs on different process counts can compare their data order.
    """
    total = jnp.uint32(0)
    for x in jax.tree.leaves(batch):
        if x.dtype.itemsize == 4:
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        bits = x.astype(jnp.uint32).reshape(-1)
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
        total = total * jnp.uint32(31) + jnp.sum(bits * weights, dtype=jnp.uint32)
    return total


# ----------------------------------------------------------------------------- jaxckpt
# The only place the examples touch jaxckpt / Orbax.


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
    import orbax.checkpoint as ocp

    import jaxckpt

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
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=1, max_to_keep=3, keep_period=persist_every
    )
    return ocp.CheckpointManager(ckpt_dir, handler_registry=registry, options=options), handler


def save(manager: Any, step: int, state: PyTree) -> None:
    """Starts the save of ``state`` as ``step`` (returns after the device-to-host copy)."""
    import orbax.checkpoint as ocp

    import jaxckpt

    manager.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state)))


def restore_latest(manager: Any, handler: Any, abstract_state: PyTree) -> PyTree | None:
    """Restores the newest restorable step, trying older ones on error.

    Args:
        manager: From :func:`make_manager`.
        handler: From :func:`make_manager`; may report the tier it read from.
        abstract_state: The state with ShapeDtypeStruct array leaves (with shardings), a
            fresh grain iterator (its state is set in place) and a placeholder step.

    Returns:
        The restored state, or None when there is nothing to restore.
    """
    import orbax.checkpoint as ocp

    import jaxckpt

    for step in sorted(manager.all_steps(), reverse=True):
        start = time.perf_counter()
        try:
            args = ocp.args.Composite(train=jaxckpt.TieredRestore(abstract_state))
            restored = manager.restore(step, args=args).train
        except Exception as e:  # any failure: fall back to the next older step
            log_event("restore_failed", step=step, error=repr(e), process=jax.process_index())
            continue
        # The handler reports where the bytes came from, when it can.
        metrics = getattr(handler, "last_restore_metrics", None) or {}
        extra = {"bytes_by_tier": metrics["bytes_by_tier"]} if "bytes_by_tier" in metrics else {}
        log_event(
            "restored",
            step=step,
            seconds=round(time.perf_counter() - start, 4),
            process=jax.process_index(),
            tier=metrics.get("tier", "unknown"),
            **extra,
        )
        # Newer steps that could not be restored would make the manager skip saving
        # those step numbers again: remove them.
        for newer in [s for s in manager.all_steps() if s > step]:
            manager.delete(newer)
        return restored
    return None


# ----------------------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class Task:
    """What an example trains: a model, a data set and a loss.

    Attributes:
        make_model: Builds the model from ``nnx.Rngs``; must hold only ``nnx.Param`` state.
        records: The data set; items are numpy arrays or dicts of them.
        loss_fn: ``loss_fn(model, global_batch, dropout_key) -> scalar loss``.
        global_batch: Global batch size (divisible by the device count).
        learning_rate: Peak learning rate of adamw.
    """

    make_model: Callable[[nnx.Rngs], nnx.Module]
    records: Sequence[Any] | np.ndarray
    loss_fn: LossFn
    global_batch: int
    learning_rate: float


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Adds the flags shared by every example."""
    parser.add_argument("--steps", type=int, default=20, help="total training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model and data, seconds")
    parser.add_argument("--ckpt-dir", help="persistent checkpoint directory")
    parser.add_argument(
        "--memory-root",
        default=os.environ.get(ENV_MEMORY_ROOT, "/dev/shm/jaxckpt"),
        help="tmpfs directory of this process's memory tier (env JAXCKPT_MEMORY_ROOT)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="peer copies per shard")
    parser.add_argument("--persist-every", type=int, default=10, help="persist every n-th step")
    parser.add_argument("--no-checkpoint", action="store_true", help="train without saving")
    parser.add_argument("--data-parallel", type=int, default=1, help="size of the data axis")
    parser.add_argument("--cluster", action="store_true", help="jax.distributed on a cluster")
    parser.add_argument(
        "--peer-host",
        default="127.0.0.1",
        help="this host's address for the peer data service (on a cluster: its reachable IP)",
    )
    parser.add_argument("--batch", type=int, default=None, help="global batch size")


def main(
    doc: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    make_task: Callable[[argparse.Namespace], Task],
    argv: Sequence[str] | None = None,
) -> int:
    """The ``main`` of an example: parses its flags, joins the job and trains its task.

    Args:
        doc: The example's module docstring; its first line describes the command.
        add_args: Adds the example's own flags after the shared ones
            (:func:`add_common_args`).
        make_task: Builds the model, data and loss from the parsed flags; runs after
            :func:`setup_jax`.
        argv: The command-line arguments; ``sys.argv[1:]`` when None.

    Returns:
        The process exit code (see :func:`train`).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_common_args(parser)
    add_args(parser)
    args = parser.parse_args(argv)
    setup_jax(args.cluster)
    return train(args, make_task(args))


def train(args: argparse.Namespace, task: Task) -> int:
    """Runs the training loop of an example, resuming from the newest checkpoint.

    Args:
        args: Parsed flags (see :func:`add_common_args`); ``setup_jax`` has run.
        task: The model, data and loss.

    Returns:
        0 (the process exit code).
    """
    begin = time.perf_counter()
    process = jax.process_index()
    mesh = make_mesh(args.data_parallel)
    log_event(
        "start",
        process=process,
        num_processes=jax.process_count(),
        devices=jax.device_count(),
        mesh=dict(mesh.shape),
    )
    tx = optax.adamw(task.learning_rate)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0))))

    def init() -> tuple[PyTree, PyTree, jax.Array]:
        _, params = nnx.split(task.make_model(nnx.Rngs(params=args.seed)))
        return params, tx.init(params), jax.random.key(args.seed)

    abstract = with_fsdp_shardings(jax.eval_shape(init), mesh)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    params_sh, opt_sh, rng_sh = shardings

    @jax.jit
    def train_step(
        params: PyTree, opt_state: PyTree, rng: jax.Array, batch: Batch
    ) -> tuple[PyTree, PyTree, jax.Array, jax.Array, jax.Array]:
        rng, dropout_key = jax.random.split(rng)

        def loss_of(p: PyTree) -> jax.Array:
            return task.loss_fn(nnx.merge(graphdef, p), batch, dropout_key)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = jax.lax.with_sharding_constraint(params, params_sh)
        opt_state = jax.lax.with_sharding_constraint(opt_state, opt_sh)
        rng = jax.lax.with_sharding_constraint(rng, rng_sh)
        return params, opt_state, rng, loss, fingerprint(batch)

    data = make_data_iterator(task.records, args.seed, task.global_batch, mesh)
    manager = handler = None
    restored = None
    if not args.no_checkpoint:
        if not args.ckpt_dir:
            raise ValueError("--ckpt-dir is required unless --no-checkpoint is given.")
        ckpt_dir = os.path.abspath(args.ckpt_dir)
        # A job shrunk to fewer processes than copies asked for keeps what it can: with
        # one process left there is no peer to hold a copy.
        replicas = min(args.replicas, jax.process_count() - 1)
        if replicas < args.replicas:
            log_event("replicas_lowered", asked=args.replicas, used=replicas, process=process)
        manager, handler = make_manager(
            ckpt_dir, args.memory_root, replicas, args.persist_every, args.peer_host
        )
        abstract_state = {
            "params": abstract[0],
            "opt_state": abstract[1],
            "rng": abstract[2],
            "data": data,
            "step": 0,
        }
        restored = restore_latest(manager, handler, abstract_state)
    if restored is None:
        params, opt_state, rng = jax.jit(init, out_shardings=shardings)()
        step = 0
    else:
        params, opt_state, rng = restored["params"], restored["opt_state"], restored["rng"]
        data, step = restored["data"], int(restored["step"])

    while step < args.steps:
        batch = to_global_batch(next(data), mesh)
        params, opt_state, rng, loss, data_sum = train_step(params, opt_state, rng, batch)
        step += 1
        # `data`: checksum of the global batch of this step (compare runs' data order).
        log_event("step", step=step, loss=float(loss), data=f"{int(data_sum):08x}", process=process)
        if manager is not None:
            start = time.perf_counter()
            state = {
                "params": params,
                "opt_state": opt_state,
                "rng": rng,
                "data": data,
                "step": step,
            }
            save(manager, step, state)
            log_event(
                "save", step=step, seconds=round(time.perf_counter() - start, 4), process=process
            )
        maybe_kill(step)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    log_event("done", step=step, seconds=round(time.perf_counter() - begin, 3), process=process)
    return 0
