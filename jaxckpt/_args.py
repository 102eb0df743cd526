"""The arguments of a save and a restore with `TieredCheckpointHandler`.

Orbax's args dataclasses; `_handler` registers them with the handler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp

from jaxckpt.coord import _multihost
from jaxckpt.format import _tree
from jaxckpt.restore import _target


@dataclasses.dataclass
class TieredSave(ocp.args.CheckpointArgs):
    """Save the whole training state (a pytree) with `TieredCheckpointHandler`.

    Attributes:
      state: params, optimizer state, typed PRNG keys, iterators, scalars.
      step: only needed outside a CheckpointManager, whose directories name the step.
      persist: persist this step whatever `TierOptions.persist_every` says, e.g. the
        last step of a run (`persist=step == last_step`), so that the trained state
        ends up in the manager's directory. Pass the same value on every process.

    Raises:
      TypeError: on construction, for a leaf jaxckpt cannot save and restore
        exactly (an unsupported type or dtype), naming its path: the error comes
        from the `mngr.save()` line of that very step, asynchronous manager
        included, before Orbax starts anything.
    """

    state: Any
    step: int | None = None
    persist: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.persist, bool):
            raise TypeError(
                f"[process {_multihost.process_index()}] TieredSave(persist=...) must be a "
                f"bool, not {self.persist!r}."
            )
        try:
            _tree.validate(self.state)
        except TypeError as e:
            raise TypeError(f"[process {_multihost.process_index()}] {e}") from None


@dataclasses.dataclass
class TieredRestore(ocp.args.CheckpointArgs):
    """Restore with `TieredCheckpointHandler` into the layout of `abstract_state`.

    Attributes:
      abstract_state: the target tree: `jax.ShapeDtypeStruct` (or arrays) with
        the shardings to restore onto (any mesh), fresh iterator objects whose
        state is set in place, and placeholders for scalars. A `np.ndarray`
        leaf (or a leaf without a sharding where a numpy array was saved) is
        restored as numpy; an uncommitted jax.Array leaf (made outside any
        mesh, e.g. a fresh `jax.random.key(0)`) is restored uncommitted, free
        to join a later jit on other devices; a saved jax.Array with no target
        sharding gets its saved sharding (uncommitted if it was saved so).
        Leaves are matched by path, else by key names whatever the node kind,
        so `mngr.item_metadata(step).train` (nested dicts and lists) is a
        target for any saved tree; the result has the target's structure.
        None restores everything to host (numpy).
      iterator_state_fn: the older, iterator-only form of `per_process_fn`:
        called as `fn(saved_states, process_index, process_count)` for every
        iterator whenever the process count changed, it returns this
        process's state.
      per_process_fn: only needed to restore leaves saved per process
        (process-local jax.Arrays, numpy arrays, scalars, iterator states) onto
        another process count when the processes saved different values:
        called as `fn(path, saved_values, process_index, process_count)` for
        each such leaf (`path` as `jax.tree_util.keystr` prints it;
        `saved_values` in the saving processes' order, numpy arrays for
        arrays), it returns this process's value. Values every process saved
        alike restore everywhere without it; on the saving process count each
        process gets its own. For a target sharding that spans processes, it
        must return the same value on every process.
    """

    abstract_state: Any = None
    iterator_state_fn: _target.IteratorStateFn | None = None
    per_process_fn: _target.PerProcessFn | None = None
