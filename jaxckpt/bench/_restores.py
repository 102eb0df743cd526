"""Restore phase of one benchmark process: every source, and a mesh change, vs Orbax.

Runs in this order, because each source is forced by deleting faster ones:
own memory; own memory onto column-sharded weights (a mesh change: every
device needs a slice of every saved chunk, so peers' parts are read too); peer
memory (each process deletes its own part, as after a node loss); persistent
(every process deletes the step from its memory tier). Persistent reads, ours
and Orbax's, start from a cold page cache. Each restored tree is checked
against the saved state on device.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import jaxckpt
from jaxckpt.bench import _baselines, _state
from jaxckpt.bench._managers import Jaxckpt

_equal = jax.jit(
    lambda a, b: jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in zip(a, b, strict=True)]))
)


def _verify(restored: Any, saved: Any) -> bool:
    """Whether every array leaf of `restored` equals `saved` (a global check)."""
    a = [x for x in jax.tree_util.tree_leaves(restored) if isinstance(x, jax.Array)]
    b = [x for x in jax.tree_util.tree_leaves(saved) if isinstance(x, jax.Array)]
    return len(a) == len(b) and bool(_equal(a, b))


def run(
    tr: _state.Training,
    ours: Jaxckpt,
    omngr: ocp.CheckpointManager,
    step: int,
    work: Path,
    sync: Callable[..., Any],
) -> dict[str, dict[str, Any]]:
    """Restores `step` from each source; returns seconds and tiers per source."""
    pi, out = jax.process_index(), {}
    saved = tr.state(step)
    mngr, handler = ours.mngr, ours.handler
    memory = handler.inspect().memory
    assert memory is not None

    def jaxckpt_restore(name: str, transposed: bool = False) -> None:
        sync(f"restore/{name}")
        start = time.perf_counter()
        restored = mngr.restore(
            step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(tr.abstract(transposed)))
        ).train
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - start
        # Every process restored before any deletes a copy (next source) another may read.
        sync(f"restored/{name}")
        m = ours.metrics("restore", step)[-1]
        out[name] = {
            "seconds": seconds,
            "tier": m.get("tier"),
            "bytes_by_tier": {k: int(v) for k, v in m.get("bytes_by_tier", {}).items()},
            "verified": _verify(restored, saved),
        }

    def orbax_restore(name: str, transposed: bool = False) -> None:
        _baselines.evict_page_cache(work / "orbax")
        sync(f"restore/{name}")
        start = time.perf_counter()
        restored = omngr.restore(step, args=ocp.args.StandardRestore(tr.abstract(transposed)))
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - start
        sync(f"restored/{name}")
        out[name] = {"seconds": seconds, "tier": "persistent", "verified": _verify(restored, saved)}

    jaxckpt_restore("memory")
    jaxckpt_restore("memory_mesh_change", transposed=True)
    if jax.process_count() > 1 and handler.options.replicas:
        shutil.rmtree(memory.part_dir(step, pi))
        jaxckpt_restore("peer")
    shutil.rmtree(memory.step_dir(step), ignore_errors=True)
    _baselines.evict_page_cache(work / "jaxckpt")
    jaxckpt_restore("persistent")
    orbax_restore("orbax")
    orbax_restore("orbax_mesh_change", transposed=True)
    return out
