"""The many-leaf phase: a tree of thousands of small arrays, where fixed costs per leaf
dominate, saved and restored by jaxckpt and by Orbax.

Every process builds the same tree: `leaves` float32 vectors of `leaf_bytes` each,
sharded over every device of every process where the length divides (else
replicated), with distinct values. Then, in lockstep:

- jaxckpt saves steps 1..repeats+1 (nothing persisted), each after the previous
  one finished, timed from `mngr.save()` until the part is committed in memory
  (as figure 3a); Orbax's `StandardSave` of the same steps, until finished;
- the last step is restored `repeats` times from jaxckpt's own memory and from
  Orbax's directory (its page cache dropped first, as figure 5a), each restored
  tree compared with the saved values.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.bench import _baselines, _saves, _state
from jaxckpt.bench._managers import Jaxckpt, orbax_manager


def build(leaves: int, leaf_bytes: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The tree (global arrays) and the values of its leaves on the host."""
    m = _state.mesh()
    n = max(1, leaf_bytes // 4)
    spec = P(_state.AXIS) if n % jax.device_count() == 0 else P()
    sharding = NamedSharding(m, spec)
    values = {
        f"leaf{i:05d}": np.arange(i, i + n, dtype=np.float32) / (i + 1) for i in range(leaves)
    }

    def make(v: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])

    tree = {k: make(v) for k, v in values.items()}
    return tree, values


def _abstract(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in tree.items()}


def _equal(restored: dict[str, Any], values: dict[str, np.ndarray]) -> bool:
    """Whether every addressable shard of every restored leaf holds the saved values."""
    if restored.keys() != values.keys():
        return False
    return all(
        np.array_equal(np.asarray(s.data), values[k][s.index])
        for k, a in restored.items()
        for s in a.addressable_shards
    )


def run(
    cfg: dict[str, Any],
    memory_root: Path,
    work: Path,
    sync: Callable[..., Any],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Runs the phase; returns its raw timings."""
    leaves, leaf_bytes, repeats = cfg["many_leaves"], cfg["many_leaf_bytes"], cfg["repeats"]
    tree, values = build(leaves, leaf_bytes)
    abstract = _abstract(tree)
    out: dict[str, Any] = {
        "leaves": leaves,
        "leaf_bytes": leaf_bytes,
        "bytes": sum(v.nbytes for v in values.values()),
        "own_bytes": sum(s.nbytes for s in _state.own_shards(tree)),
    }
    ours = Jaxckpt(
        work / "many-jaxckpt", memory_root, cfg, persist_every=10**9, memory_keep=1, max_to_keep=2
    )
    omngr = orbax_manager(work / "many-orbax", cfg, max_to_keep=2)
    last = repeats + 1
    try:
        progress(f"{leaves}-leaf tree: saves")
        out["saves"] = _saves.jaxckpt(last, lambda s: tree, ours, sync, "many/save")
        out["orbax_saves"] = _saves.orbax(last, lambda s: tree, omngr, sync, "many/orbax")
        progress(f"{leaves}-leaf tree: restores")
        restores: dict[str, list[dict[str, Any]]] = {"memory": [], "orbax": []}
        out["restores"] = restores
        for i in range(repeats):
            sync(f"many/restore/{i}")
            start = time.perf_counter()
            restored = ours.mngr.restore(
                last, args=ocp.args.Composite(train=jaxckpt.TieredRestore(abstract))
            ).train
            jax.block_until_ready(restored)
            seconds = time.perf_counter() - start
            tier = ours.metrics("restore", last)[-1].get("tier")
            restores["memory"].append(
                {"seconds": seconds, "tier": tier, "verified": _equal(restored, values)}
            )
            del restored
            _baselines.evict_page_cache(work / "many-orbax")
            sync(f"many/orbax_restore/{i}")
            start = time.perf_counter()
            restored = omngr.restore(last, args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(restored)
            seconds = time.perf_counter() - start
            restores["orbax"].append(
                {"seconds": seconds, "tier": "persistent", "verified": _equal(restored, values)}
            )
            del restored
            sync(f"many/restored/{i}")
    finally:
        omngr.close()
        ours.close()
    run_dir = ours.memory_dir
    sync("many/closed")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    if jax.process_index() == 0:
        shutil.rmtree(work / "many-orbax", ignore_errors=True)
        shutil.rmtree(work / "many-jaxckpt", ignore_errors=True)
    return out
