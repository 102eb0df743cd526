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
    {"event": "standby", "process": p}  # a hot spare, ready, waiting for its go line
    {"event": "timeline", "process": p, "phases": {name: [start, end], ...},
     "compile": {"cache_hits": h, "cache_misses": m, "executable": "ahead"|"jit"}}

The ``timeline`` event follows the first trained step of the run: wall-clock
(``time.time()``) start and end of each phase of this process's start -- ``startup``
(process creation to ``main``: interpreter and imports), ``jax_init``
(``jax.distributed`` and the backend), ``task``, ``setup`` (mesh, abstract state,
data), ``warm_up`` and ``standby`` (a hot spare's one step on a fresh state, and its
wait), ``manager``, ``restore`` or ``init``,
``compile`` (the train step, lowered from the abstract state in a thread WHILE the
restore runs) and ``first_step``. The launcher turns them into the recovery timeline
of its report. ``compile`` counts the compilation caches' hits and misses of the train
step and of the whole process.

Compilation cache: on by default (``--compilation-cache``); the directory is the one
in ``JAX_COMPILATION_CACHE_DIR`` if set (the launcher sets it), else
``<ckpt-dir>.compilation-cache`` next to the checkpoints, so that a restarted job loads
its executables instead of compiling them again.

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
  fresh state (:func:`warm_up`), print the ``standby`` event, then wait for one JSON line on stdin, ``{"env": {...}}``: the
  variables of where it runs (memory root, failure domain, ...), set before the
  checkpoint manager is built. End of input means the spare is not needed: exit 0.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
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
ENV_STANDBY: Final = "JAXCKPT_STANDBY"
ENV_CACHE_DIR: Final = "JAX_COMPILATION_CACHE_DIR"  # read by jax itself at import
ENV_CACHE_MIN_SECS: Final = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
COMPILE_THREAD: Final = "compile-train-step"

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


# ----------------------------------------------------------------------------- recovery time


class Timeline:
    """Wall-clock phases of this process's start, reported in one ``timeline`` event.

    Wall-clock (``time.time()``) rather than monotonic time: the launcher compares them
    with its own clock (same host here; on a cluster, as good as the hosts' clock sync).
    """

    def __init__(self) -> None:
        self.phases: dict[str, list[float]] = {}

    def add(self, name: str, start: float, end: float) -> None:
        """Records a phase that ran from ``start`` to ``end``."""
        self.phases[name] = [round(start, 4), round(end, 4)]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Records the phase that the ``with`` block runs."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())


def process_started_at() -> float:
    """When this process was created (wall clock), to time the interpreter and imports."""
    return float(psutil.Process().create_time())


def await_go(timeline: Timeline) -> None:
    """As a hot spare (``JAXCKPT_STANDBY=1``): waits for the launcher's go line.

    The spare has joined its (spare) job, built its mesh and data, and compiled its
    train step; the go line carries the variables that say where it runs (memory root,
    failure domain, ...). Exits 0 at the end of input: the launcher did not need it.

    Raises:
        ValueError: If the go line is not ``{"env": {...}}``, or names another
            coordinator than the one this spare joined.
    """
    # Imported now, not at the restart: they are part of what the spare is for.
    import orbax.checkpoint  # noqa: F401

    import jaxckpt  # noqa: F401

    start = time.time()
    log_event("standby", process=jax.process_index())
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


def setup_compilation_cache(cache_dir: str | None, ckpt_dir: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a restart loads its executables.

    Must run before the first compilation. Only process 0 writes entries (JAX's rule);
    every process reads them, so on several hosts the directory must be shared.

    Args:
        cache_dir: ``--compilation-cache``: a directory, ``off``, or None for the default:
            ``JAX_COMPILATION_CACHE_DIR`` if set (the launcher sets it), else
            ``<ckpt_dir>.compilation-cache``, else no cache.
        ckpt_dir: ``--ckpt-dir``, if checkpointing.

    Returns:
        The cache directory in use, or None.
    """
    if cache_dir == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = cache_dir or os.environ.get(ENV_CACHE_DIR)
    if not path and ckpt_dir:
        path = os.path.abspath(ckpt_dir).rstrip(os.sep) + ".compilation-cache"
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Every compilation on the restart path costs recovery time, the small ones too;
    # JAX's default caches only those that took a second or more.
    if ENV_CACHE_MIN_SECS not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# Persistent-cache events per (thread name, kind): JAX's "compile_requests_use_cache" (a
# lookup) and "cache_hits", and the "own_hits" / "own_misses" of `compile_cached`. JAX's
# own "cache_misses" counts only the writes, which process 0 alone does, so a miss is
# a lookup without a hit.
CACHE_EVENTS: collections.Counter[tuple[str, str]] = collections.Counter()
_CACHE_EVENT_PREFIX: Final = "/jax/compilation_cache/"


def _count_cache_event(event: str, **_: Any) -> None:
    if event.startswith(_CACHE_EVENT_PREFIX):
        kind = event.removeprefix(_CACHE_EVENT_PREFIX)
        if kind in ("compile_requests_use_cache", "cache_hits"):
            CACHE_EVENTS[(threading.current_thread().name, kind)] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def compile_counts(executable: str) -> dict[str, Any]:
    """The persistent-cache lookups of the train step's compilation and of the process."""

    def total(kind: str, thread: str | None = None) -> int:
        return sum(n for (t, k), n in CACHE_EVENTS.items() if k == kind and thread in (None, t))

    # Each compilation looks up JAX's cache once (a miss of the process's own cache,
    # `compile_cached`, compiles, so it shows there too); a hit of its own does not.
    lookups = "compile_requests_use_cache"

    def hits(thread: str | None = None) -> int:
        return total("cache_hits", thread) + total("own_hits", thread)

    return {
        "cache_hits": hits(COMPILE_THREAD),
        "cache_misses": total(lookups, COMPILE_THREAD) - total("cache_hits", COMPILE_THREAD),
        "process_cache_hits": hits(),
        "process_cache_misses": total(lookups) - total("cache_hits"),
        "own_cache": {"hits": total("own_hits"), "misses": total("own_misses")},
        "executable": executable,
    }


def abstract_batch(records: Sequence[Any] | np.ndarray, global_batch: int, mesh: Mesh) -> Batch:
    """The global batch as ShapeDtypeStructs, from one record (no data is read)."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (global_batch, *np.shape(x)), np.asarray(x).dtype, sharding=sharding
        ),
        records[0],
    )


# Executables that processes other than 0 of a multi-process CPU job keep themselves.
PER_PROCESS_CACHE: Final = "per-process-executables"


def compile_cached(lowered: Any, cache_dir: str | None) -> Any:
    """Compiles ``lowered`` through JAX's persistent cache, or this process's own one.

    JAX writes cache entries from process 0 only, under a key that, on CPU, hashes
    the topology as THIS process sees it: on a multi-process CPU job, every other
    process misses on every restart and compiles again (GPU and TPU keys agree across
    processes). Those processes keep their own executable, serialized with
    ``jax.experimental.serialize_executable`` under a key of the lowered program, the
    versions and the process's place in the job.

    Returns:
        The ``jax.stages.Compiled``.
    """
    if (
        cache_dir is None
        or jax.process_count() == 1
        or jax.process_index() == 0
        or jax.default_backend() != "cpu"
    ):
        return lowered.compile()
    import jaxlib
    from jax.experimental import serialize_executable

    key = hashlib.sha256()
    for part in (
        lowered.as_text(),
        jax.__version__,
        jaxlib.__version__,
        jax.devices()[0].client.platform_version,
        f"{jax.process_index()}/{jax.process_count()}",
        repr([(d.id, d.process_index) for d in jax.devices()]),
        os.environ.get("XLA_FLAGS", ""),
    ):
        key.update(part.encode() + b"\0")
    path = os.path.join(cache_dir, PER_PROCESS_CACHE, f"p{jax.process_index()}-{key.hexdigest()}")
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                payload = f.read()
            compiled = serialize_executable.deserialize_and_load(
                payload, lowered.in_tree, lowered.out_tree
            )
        except Exception as e:  # a stale or torn entry: compile instead
            log_event("executable_unusable", path=path, error=repr(e), process=jax.process_index())
        else:
            CACHE_EVENTS[(threading.current_thread().name, "own_hits")] += 1
            return compiled
    CACHE_EVENTS[(threading.current_thread().name, "own_misses")] += 1
    compiled = lowered.compile()
    payload, _, _ = serialize_executable.serialize(compiled)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)  # atomic: a process killed mid-write leaves no torn entry
    return compiled


def warm_up(
    step_fn: Any, init: Callable[[], Any], shardings: Any, batch: Batch, cache_dir: str | None
) -> None:
    """Runs the compiled train step once, on a fresh state and a zero batch, and drops it.

    For a hot spare, while it waits: a first run pays costs a later run does not (on
    CPU, connecting the collectives between the processes), and the restart's first
    step should not. Every process of the job must call it (the step is collective).
    """
    state = compile_cached(jax.jit(init, out_shardings=shardings).lower(), cache_dir)()
    zeros = jax.tree.map(
        lambda a: jax.make_array_from_callback(
            a.shape, a.sharding, lambda index: np.zeros(a.shape, a.dtype)[index]
        ),
        batch,
    )
    jax.block_until_ready(step_fn(*state, zeros))


def compile_ahead(
    fn: Any, timeline: Timeline, cache_dir: str | None, *abstract_args: Any
) -> concurrent.futures.Future[Any]:
    """Lowers and compiles ``fn`` for ``abstract_args`` in a thread; returns its future.

    Shapes and shardings are known before any byte of the checkpoint is read, so the
    compilation (or its load from the cache, :func:`compile_cached`) overlaps the
    restore. The thread records the ``compile`` phase.
    """

    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            with timeline.phase("compile"):
                compiled = compile_cached(fn.lower(*abstract_args), cache_dir)
        except BaseException as e:  # handed to the waiting thread
            future.set_exception(e)
        else:
            future.set_result(compiled)

    # A daemon: a failed restore must not wait for the compilation to end the process.
    threading.Thread(target=work, name=COMPILE_THREAD, daemon=True).start()
    return future


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
    # With the handler, garbage collection also keeps the newest persisted step.
    options = jaxckpt.manager_options(
        ckpt_dir, handler=handler, save_interval_steps=1, max_to_keep=3, keep_period=persist_every
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
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="JAX persistent compilation cache, or 'off' (default: $JAX_COMPILATION_CACHE_DIR,"
        " else <ckpt-dir>.compilation-cache)",
    )


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
    timeline = Timeline()
    timeline.add("startup", process_started_at(), time.time())

    def parse() -> argparse.Namespace:
        # A new parser each time: some defaults (--memory-root) are read from the
        # environment when the parser is built.
        parser = argparse.ArgumentParser(description=doc.splitlines()[0])
        add_common_args(parser)
        add_args(parser)
        return parser.parse_args(argv)

    args = parse()
    ckpt_dir = None if args.no_checkpoint else args.ckpt_dir
    cache = args.compilation_cache = setup_compilation_cache(args.compilation_cache, ckpt_dir)
    with timeline.phase("jax_init"):
        setup_jax(args.cluster)

    def go() -> argparse.Namespace:
        await_go(timeline)
        again = parse()  # with the go line's environment
        again.compilation_cache = cache
        return again

    with timeline.phase("task"):
        task = make_task(args)
    return train(args, task, timeline, go if os.environ.get(ENV_STANDBY) == "1" else None)


def train(
    args: argparse.Namespace,
    task: Task,
    timeline: Timeline | None = None,
    go: Callable[[], argparse.Namespace] | None = None,
) -> int:
    """Runs the training loop of an example, resuming from the newest checkpoint.

    The train step is compiled from the abstract state in a thread while the state is
    restored (:func:`compile_ahead`); after the first step, the ``timeline`` event
    reports when each phase ran.

    Args:
        args: Parsed flags (see :func:`add_common_args`); ``setup_jax`` has run.
        task: The model, data and loss.
        timeline: The phases so far (``startup``, ``jax_init``, ...); the rest are added.
        go: A hot spare's wait for its go line (:func:`await_go`), called once the mesh,
            the data and the compilation are ready, before anything that depends on
            the job it joins (memory root, failure domain); returns the flags again.

    Returns:
        0 (the process exit code).
    """
    timeline = timeline if timeline is not None else Timeline()
    setup_start = time.time()
    begin = time.perf_counter()
    process = jax.process_index()
    mesh = make_mesh(args.data_parallel)
    log_event(
        "start",
        process=process,
        num_processes=jax.process_count(),
        devices=jax.device_count(),
        mesh=dict(mesh.shape),
        compilation_cache=getattr(args, "compilation_cache", None),
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

    # IMPORTANT: started before the restore, which it overlaps; waited for after it.
    batch_abstract = abstract_batch(task.records, task.global_batch, mesh)
    cache_dir = getattr(args, "compilation_cache", None)
    ahead = compile_ahead(train_step, timeline, cache_dir, *abstract, batch_abstract)
    data = make_data_iterator(task.records, args.seed, task.global_batch, mesh)
    timeline.add("setup", setup_start, time.time())
    if go is not None:
        with timeline.phase("warm_up"):
            warm_up(ahead.result(), init, shardings, batch_abstract, cache_dir)
        args = go()
    manager_start = time.time()
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
        timeline.add("manager", manager_start, time.time())
        with timeline.phase("restore"):
            restored = restore_latest(manager, handler, abstract_state)
    if restored is None:
        with timeline.phase("init"):
            init_fn = compile_cached(jax.jit(init, out_shardings=shardings).lower(), cache_dir)
            params, opt_state, rng = init_fn()
        step = 0
    else:
        params, opt_state, rng = restored["params"], restored["opt_state"], restored["rng"]
        data, step = restored["data"], int(restored["step"])

    step_fn, executable = ahead.result(), "ahead"
    first_step = True
    while step < args.steps:
        step_start = time.time()
        batch = to_global_batch(next(data), mesh)
        try:
            params, opt_state, rng, loss, data_sum = step_fn(params, opt_state, rng, batch)
        except (TypeError, ValueError) as e:
            # The executable compiled ahead checks its inputs' types and shardings
            # before it runs: a mismatch means the abstract state was not the real one.
            if not first_step:
                raise
            log_event("compiled_ahead_unusable", error=repr(e), process=process)
            step_fn, executable = train_step, "jit"
            params, opt_state, rng, loss, data_sum = step_fn(params, opt_state, rng, batch)
        step += 1
        # `data`: checksum of the global batch of this step (compare runs' data order).
        log_event("step", step=step, loss=float(loss), data=f"{int(data_sum):08x}", process=process)
        if first_step:
            first_step = False
            timeline.add("first_step", step_start, time.time())
            # The handler's own restore time; the rest of `restore` is Orbax's and
            # the loop's (listing steps, barriers).
            metrics = getattr(handler, "last_restore_metrics", None) or {}
            log_event(
                "timeline",
                process=process,
                phases=timeline.phases,
                compile=compile_counts(executable),
                restore={k: metrics[k] for k in ("seconds", "tier", "fallbacks") if k in metrics},
            )
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
