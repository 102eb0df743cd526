"""The only place jaxckpt reaches into JAX's or Orbax's private attributes.

Neither library offers a public way to do these four things:

- `distributed_client`: the key-value store client of `jax.distributed`
  (`jax._src.distributed.global_state.client`), through which processes exchange
  small control messages (`_multihost`);
- `manager_handlers`: the handlers a `CheckpointManager` holds
  (`mngr._checkpointer.handler._handler_registry`), so that
  `latest_restorable_step(mngr)` finds the manager's jaxckpt items;
- `manager_finalize_threads`: the threads on which asynchronous CheckpointManagers
  finish their saves and delete old steps (`checkpoint_manager._FinalizeThread`), so
  that `wait_for_persistence` renames a part into a step directory only once no
  manager is deleting (`persistent/_step_gate`);
- `weakly_typed`: an array made weakly typed, dtype, values and sharding unchanged
  (`jax._src.lax.lax._convert_element_type`, what `jax.numpy` itself uses), so that a
  restored array is weakly typed where its target is (`_weak_type`).

Each reach is named in `REACHED` with the versions it is known from;
`tests/test_internals.py` checks each against the installed JAX and Orbax, so a
release that moves one fails that test by name instead of a save or a restore.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from typing import Any, Final

# What is reached, for the test and for error messages: (library, dotted path).
DISTRIBUTED_STATE: Final = ("jax", "jax._src.distributed.global_state.client")
MANAGER_CHECKPOINTER: Final = ("orbax-checkpoint", "CheckpointManager._checkpointer")
COMPOSITE_REGISTRY: Final = (
    "orbax-checkpoint",
    "CompositeCheckpointHandler._handler_registry",
)
FINALIZE_THREAD: Final = (
    "orbax-checkpoint",
    "orbax.checkpoint.checkpoint_manager._FinalizeThread",
)
CONVERT_ELEMENT_TYPE: Final = ("jax", "jax._src.lax.lax._convert_element_type")
REACHED: Final = (
    DISTRIBUTED_STATE,
    MANAGER_CHECKPOINTER,
    COMPOSITE_REGISTRY,
    FINALIZE_THREAD,
    CONVERT_ELEMENT_TYPE,
)


def version(library: str) -> str:
    """The installed version of `library` (a distribution name), or "not installed"."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def moved(reach: tuple[str, str], why: object) -> RuntimeError:
    """The error for an internal that is not where jaxckpt looks for it."""
    library, path = reach
    return RuntimeError(
        f"jaxckpt reaches the private {path} of {library} {version(library)}, and it is not "
        f"there ({why}). A release moved it: update jaxckpt/_internals.py (the only place "
        "that reaches it) and tests/test_internals.py, or install a version jaxckpt supports."
    )


def distributed_state() -> Any:
    """`jax._src.distributed.global_state`: the state `jax.distributed.initialize` sets.

    Raises:
      RuntimeError: if this JAX keeps it elsewhere.
    """
    try:
        module = importlib.import_module("jax._src.distributed")
        return module.global_state
    except (ImportError, AttributeError) as e:
        raise moved(DISTRIBUTED_STATE, e) from e


def distributed_client() -> Any | None:
    """The `jax.distributed` key-value store client, None before `initialize()`.

    Raises:
      RuntimeError: if this JAX keeps it elsewhere.
    """
    state = distributed_state()
    if not hasattr(state, "client"):
        raise moved(DISTRIBUTED_STATE, "global_state has no attribute 'client'")
    return state.client


def manager_handlers(mngr: Any) -> dict[str, Any]:
    """item -> handler, for every item of the CheckpointManager `mngr` whose handler is
    registered (through a handler registry or `item_handlers=`).

    Raises:
      RuntimeError: if this Orbax keeps them elsewhere.
    """
    checkpointer = getattr(mngr, "_checkpointer", None)
    if checkpointer is None:
        raise moved(MANAGER_CHECKPOINTER, f"{type(mngr).__name__} has no _checkpointer")
    registry = getattr(getattr(checkpointer, "handler", None), "_handler_registry", None)
    if registry is None:
        raise moved(COMPOSITE_REGISTRY, "the manager's checkpointer.handler has none")
    entries = registry.get_all_entries()
    return {item: handler for (item, _), handler in entries.items() if item is not None}


def manager_finalize_threads() -> list[threading.Thread]:
    """The live threads on which asynchronous CheckpointManagers of this process finish
    a save: wait for its commit, delete the steps its options let go, and meet the
    other processes (after the primary process's deletions).

    Raises:
      RuntimeError: if this Orbax finishes its saves on threads of another kind.
    """
    try:
        module = importlib.import_module("orbax.checkpoint.checkpoint_manager")
        kind = module._FinalizeThread
    except (ImportError, AttributeError) as e:
        raise moved(FINALIZE_THREAD, e) from e
    return [t for t in threading.enumerate() if isinstance(t, kind) and t.is_alive()]


def weakly_typed(value: Any) -> Any:
    """The jax.Array `value`, weakly typed; its dtype, values, sharding and whether it is
    committed unchanged.

    Raises:
      RuntimeError: if this JAX keeps the conversion elsewhere.
    """
    try:
        lax = importlib.import_module("jax._src.lax.lax")
        convert = lax._convert_element_type
    except (ImportError, AttributeError) as e:
        raise moved(CONVERT_ELEMENT_TYPE, e) from e
    return convert(value, value.dtype, weak_type=True)
