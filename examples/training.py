"""The examples' training loop: flags, the job's start, resume or init, train and save.

An example (``lm.py``, ``classifier.py``) is a :class:`Task` (model, data, loss) and its
own flags; :func:`main` joins the job (``job``), builds the mesh and the data
(``sharding``, ``data``), compiles the train step while the state is restored
(``compile_cache``, ``checkpointing``), trains, and saves after every step. Each process
reports the phases of its start in one ``timeline`` event (``timeline``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from examples import checkpointing, compile_cache, data, job
from examples.sharding import make_mesh, with_fsdp_shardings
from examples.timeline import Timeline, process_started_at
from jaxckpt import launch

PyTree = Any
Batch = Any
LossFn = Callable[[Any, Batch, jax.Array], jax.Array]  # (model, batch, dropout key)


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
        default=os.environ.get(job.ENV_MEMORY_ROOT, "/dev/shm/jaxckpt"),
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
            ``job.setup_jax``.
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
    cache = compile_cache.setup_compilation_cache(args.compilation_cache, ckpt_dir)
    args.compilation_cache = cache
    with timeline.phase("jax_init"):
        job.setup_jax(args.cluster)

    def go() -> argparse.Namespace:
        job.await_go(timeline)
        again = parse()  # with the go line's environment
        again.compilation_cache = cache
        return again

    with timeline.phase("task"):
        task = make_task(args)
    return train(args, task, timeline, go if os.environ.get(job.ENV_STANDBY) == "1" else None)


def train(
    args: argparse.Namespace,
    task: Task,
    timeline: Timeline | None = None,
    go: Callable[[], argparse.Namespace] | None = None,
) -> int:
    """Runs the training loop of an example, resuming from the newest checkpoint.

    The train step is compiled from the abstract state in a thread while the state is
    restored (``compile_cache.compile_ahead``); after the first step, the ``timeline``
    event reports when each phase ran.

    Args:
        args: Parsed flags (see :func:`add_common_args`); ``job.setup_jax`` has run.
        task: The model, data and loss.
        timeline: The phases so far (``startup``, ``jax_init``, ...); the rest are added.
        go: A hot spare's wait for its go line (``job.await_go``), called once the mesh,
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
    cache_dir = getattr(args, "compilation_cache", None)
    job.emit(
        launch.StartEvent(
            process=process,
            num_processes=jax.process_count(),
            devices=jax.device_count(),
            mesh=dict(mesh.shape),
            compilation_cache=cache_dir,
        )
    )
    tx = optax.adamw(task.learning_rate)

    def init() -> tuple[PyTree, PyTree, jax.Array]:
        _, params = nnx.split(task.make_model(nnx.Rngs(params=args.seed)))
        return params, tx.init(params), jax.random.key(args.seed)

    abstract = with_fsdp_shardings(jax.eval_shape(init), mesh)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    train_step = make_train_step(task, tx, shardings)
    # IMPORTANT: started before the restore, which it overlaps; waited for after it.
    batch_abstract = data.abstract_batch(task.records, task.global_batch, mesh)
    ahead = compile_cache.compile_ahead(train_step, timeline, cache_dir, *abstract, batch_abstract)
    iterator = data.make_data_iterator(task.records, args.seed, task.global_batch, mesh)
    abstract_state = {
        "params": abstract[0],
        "opt_state": abstract[1],
        "rng": abstract[2],
        "data": iterator,
        "step": 0,
    }
    timeline.add("setup", setup_start, time.time())
    if go is not None:
        with timeline.phase("warm_up"):
            warm_up(ahead.result(), init, shardings, batch_abstract, cache_dir)
        args = standby(args, go, abstract_state, timeline)
    manager = handler = restored = None
    if not args.no_checkpoint:
        with timeline.phase("manager"):
            manager, handler = checkpointing.open_manager(args, process)
        with timeline.phase("restore"):
            restored = checkpointing.restore_latest(manager, handler, abstract_state)
    if restored is None:
        with timeline.phase("init"):
            init_jit = jax.jit(init, out_shardings=shardings)
            params, opt_state, rng = compile_cache.compile_cached(init_jit.lower(), cache_dir)()
        step = 0
    else:
        params, opt_state, rng = restored["params"], restored["opt_state"], restored["rng"]
        iterator, step = restored["data"], int(restored["step"])

    step_fn, executable = ahead.result(), "ahead"
    first_step, stopped = True, False
    last_event = time.perf_counter()
    while step < args.steps:
        step_start = time.time()
        batch = data.to_global_batch(next(iterator), mesh)
        try:
            params, opt_state, rng, loss, data_sum = step_fn(params, opt_state, rng, batch)
        except (TypeError, ValueError) as e:
            # The executable compiled ahead checks its inputs' types and shardings
            # before it runs: a mismatch means the abstract state was not the real one.
            if not first_step:
                raise
            job.emit(launch.CompiledAheadUnusableEvent(error=repr(e), process=process))
            step_fn, executable = train_step, "jit"
            params, opt_state, rng, loss, data_sum = step_fn(params, opt_state, rng, batch)
        step += 1
        # `data`: checksum of the global batch of this step (compare runs' data order).
        now = time.perf_counter()
        job.emit(
            launch.StepEvent(
                step=step,
                loss=float(loss),
                data=f"{int(data_sum):08x}",
                process=process,
                seconds=round(now - last_event, 4),
            )
        )
        last_event = now
        if first_step:
            first_step = False
            timeline.add("first_step", step_start, time.time())
            # The handler's own restore time; the rest of `restore` is Orbax's and
            # the loop's (listing steps, barriers).
            metrics = getattr(handler, "last_restore_metrics", None) or {}
            job.emit(
                launch.TimelineEvent(
                    process=process,
                    phases=timeline.phases,
                    compile=compile_cache.compile_counts(executable),
                    restore={
                        k: metrics[k] for k in ("seconds", "tier", "fallbacks") if k in metrics
                    },
                )
            )
        if manager is not None:
            start = time.perf_counter()
            state = {
                "params": params,
                "opt_state": opt_state,
                "rng": rng,
                "data": iterator,
                "step": step,
            }
            checkpointing.save(manager, step, state)
            seconds = round(time.perf_counter() - start, 4)
            job.emit(launch.SaveEvent(step=step, seconds=seconds, process=process))
        job.maybe_kill(step)
        if job.stop_requested(step):
            stopped = True  # every process agreed on this step; its save is made
            break
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if stopped:
        job.emit(launch.StoppedEvent(step=step, process=process))
    seconds = round(time.perf_counter() - begin, 3)
    job.emit(launch.DoneEvent(step=step, seconds=seconds, process=process))
    return 0


def standby(
    args: argparse.Namespace,
    go: Callable[[], argparse.Namespace],
    abstract_state: PyTree,
    timeline: Timeline,
) -> argparse.Namespace:
    """A hot spare's wait for its go line, preparing the restore meanwhile: its reshard
    compiled for the newest step the job saved (`checkpointing.RestorePreparer`).

    Returns:
        The flags again, with the go line's environment (``go``).
    """
    preparer = (
        checkpointing.RestorePreparer(args.ckpt_dir, abstract_state)
        if args.ckpt_dir and not args.no_checkpoint
        else None
    )
    args = go()
    prepared = preparer.stop() if preparer is not None else None
    if prepared is not None:
        step, leaves, start, end = prepared
        timeline.add("prepare_restore", start, end)
        job.emit(launch.RestorePreparedEvent(step=step, leaves=leaves, process=jax.process_index()))
    return args


def make_train_step(task: Task, tx: optax.GradientTransformation, shardings: PyTree) -> Any:
    """The jitted train step, its state's outputs kept on ``shardings``.

    ``train_step(params, opt_state, rng, batch)`` returns ``(params, opt_state, rng, loss,
    fingerprint of the global batch)``.
    """
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0))))
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
        return params, opt_state, rng, loss, data.fingerprint(batch)

    return train_step


def warm_up(
    step_fn: Any, init: Callable[[], Any], shardings: Any, batch: Batch, cache_dir: str | None
) -> None:
    """Runs the compiled train step once, on a fresh state and a zero batch, and drops it.

    For a hot spare, while it waits: a first run pays costs a later run does not (on
    CPU, connecting the collectives between the processes), and the restart's first
    step should not. Every process of the job must call it (the step is collective).
    """
    init_jit = jax.jit(init, out_shardings=shardings)
    state = compile_cache.compile_cached(init_jit.lower(), cache_dir)()
    zeros = jax.tree.map(
        lambda a: jax.make_array_from_callback(
            a.shape, a.sharding, lambda index: np.zeros(a.shape, a.dtype)[index]
        ),
        batch,
    )
    jax.block_until_ready(step_fn(*state, zeros))
