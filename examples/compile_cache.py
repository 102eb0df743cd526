"""JAX's persistent compilation cache, so that a restarted job loads its executables.

On by default (``--compilation-cache``): the directory is the one in
``JAX_COMPILATION_CACHE_DIR`` if set (the launcher sets it), else
``<ckpt-dir>.compilation-cache`` next to the checkpoints (:func:`setup_compilation_cache`).
The train step is compiled from the abstract state in a thread while the state is restored
(:func:`compile_ahead`), through JAX's cache or, where JAX's misses (the processes other
than 0 of a multi-process CPU job), this process's own one (:func:`compile_cached`).
:func:`compile_counts` gives the caches' hits and misses for the ``timeline`` event.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
from typing import Any, Final

import jax

from examples.job import emit
from examples.timeline import Timeline
from jaxckpt import launch

ENV_CACHE_DIR: Final = "JAX_COMPILATION_CACHE_DIR"  # read by jax itself at import
ENV_CACHE_MIN_SECS: Final = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
COMPILE_THREAD: Final = "compile-train-step"


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
            emit(
                launch.ExecutableUnusableEvent(
                    path=path, error=repr(e), process=jax.process_index()
                )
            )
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
