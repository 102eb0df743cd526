"""A restore prepared ahead: what a restore of a step onto a target would compile,
compiled before it, so that the restore only reads and places.

A restore onto another process count (a job shrunk after a node loss, or grown back)
carries the leaves replicated across processes to their targets by one compiled
collective (`_restore.Restorer.place`, `coord._read_layout.reshard`); compiling it is
most of such a restore from memory on a small state (measured: 1.2-1.4 s of 1.8-2.5 s
on 3 processes of 2 CPU devices, before a small reshard on CPU was compiled without the
backend's optimizations: about 4x less CPU since, `_read_layout`). A hot spare knows its
target before any failure: it calls `prepare` while it waits, and the restore finds the
program compiled.

Reads only the step's index (no chunk, no memory tier, no exchange, nothing collective),
so each process may call it alone, before it knows where it will run. The programs are
those of a restore from memory and peers; one from persistent storage may read large
chunks in another layout, and compiles that.
"""

from __future__ import annotations

import os
from typing import Any

from jaxckpt.coord import _multihost
from jaxckpt.persistent import _index, _paths
from jaxckpt.restore import _fill, _restore, _target


def prepare(directory: os.PathLike[str] | str, target: Any) -> int:
    """Compiles ahead what a restore of the step in `directory` onto `target` compiles.

    Args:
        directory: The item directory of a finalized step (`<root>/<step>/<item>`), saved
            in the layout the restore will read (any step of the same job will do).
        target: A `TieredRestore` (its abstract state, with the target's shardings).

    Returns:
        How many leaves the prepared reshard carries (0: the restore compiles nothing).

    Raises:
        FileNotFoundError: If `directory` holds no jaxckpt index.
        ValueError, TypeError: If the target does not match the saved tree.
    """
    item = _paths.ItemDir.parse(directory)
    step = item.require_step()
    index = _index.read_index(item.path)
    pi, count = _multihost.process_index(), _multihost.process_count()
    recorded = _index.recorded(index, pi)
    if recorded is None:
        raise FileNotFoundError(
            f"[process {pi}] {item.path} holds no jaxckpt index: nothing to prepare a restore"
            " of. Pass the item directory of a finalized step (<root>/<step>/<item>)."
        )
    ctx = _target.Context(index, pi, count, step, target.iterator_state_fn, target.per_process_fn)
    _target.check(recorded.leaves, target.abstract_state, ctx)
    leaves = _fill.resharded_leaves(recorded.leaves, target.abstract_state, ctx)
    return _restore.compile_reshard(leaves)
