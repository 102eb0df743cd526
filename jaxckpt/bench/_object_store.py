"""The object-store phase of one benchmark process: persisting to gs:// or s3://.

jaxckpt saves each step into a CheckpointManager on the store URL with every step
persisted (`persist_every=1`); a save is timed from the `mngr.save()` call until
`handler.wait_for_persistence()` returns, i.e. until this process's part is durable on
the store (its chunks uploaded, the step finalized by the manager, the part manifest
written). The baseline writes the same bytes with plain tensorstore to a fresh prefix
on the same endpoint, in the same layout: one zarr3 array per leaf (the global shape,
the shard shape as its chunk grid, no compression), each own shard one chunk, every
array and chunk write in flight at once, with jaxckpt's object-store context (request
concurrency and retries, `_storage.CONTEXT_SPEC`). Saves and baseline writes alternate,
every process at once (as a save runs on every process at once); the first of each is
a warm-up. What each repeat wrote is deleted after it, outside the timing, so the
store holds at most about two copies of the state.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jaxckpt.bench import _state
from jaxckpt.bench._managers import Jaxckpt
from jaxckpt.persistent import _storage


def own_chunks(tree: Any) -> list[dict[str, Any]]:
    """This process's replica-0 shards of each array leaf that has some, on the host:
    the leaf's index, global shape, dtype, chunk (shard) shape, and (region, data) pairs."""
    leaves = []
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        if not isinstance(leaf, jax.Array):
            continue
        shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
        if shards:
            leaves.append(
                {
                    "leaf": i,
                    "shape": tuple(leaf.shape),
                    "dtype": np.dtype(leaf.dtype).name,
                    "chunk": tuple(shards[0].data.shape),
                    "shards": [(s.index, np.asarray(s.data)) for s in shards],
                }
            )
    return leaves


def _context() -> ts.Context:
    # jaxckpt's object-store settings, and a fresh cache pool (as `_zarr` opens with).
    return ts.Context(
        {"data_copy_concurrency": {"limit": 8}, "cache_pool": {}, **_storage.CONTEXT_SPEC}
    )


def _chunk_key(region: tuple[slice, ...], chunk: tuple[int, ...]) -> str:
    """The zarr3 default-encoded key of the chunk that `region` is."""
    return "/".join(["c", *(str((r.start or 0) // c) for r, c in zip(region, chunk, strict=True))])


async def _write_leaf(kvstore: dict[str, Any], leaf: dict[str, Any], context: ts.Context) -> None:
    metadata = {
        "shape": list(leaf["shape"]),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf["chunk"])}},
        "chunk_key_encoding": {"name": "default"},
        "data_type": leaf["dtype"],
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": 0,
    }
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata}
    array = await ts.open(spec, create=True, context=context)
    await asyncio.gather(*[array[region].write(data) for region, data in leaf["shards"]])


def tensorstore_write(url: str, leaves: list[dict[str, Any]]) -> float:
    """Seconds to write `leaves` with tensorstore under the fresh prefix `url`."""
    context = _context()
    part = _storage.kvstore(url)

    async def write() -> None:
        await asyncio.gather(
            *[_write_leaf(_leaf_kvstore(part, leaf), leaf, context) for leaf in leaves]
        )

    start = time.perf_counter()
    asyncio.run(write())
    return time.perf_counter() - start


def _leaf_kvstore(part: dict[str, Any], leaf: dict[str, Any]) -> dict[str, Any]:
    return {**part, "path": f"{part['path']}{leaf['leaf']}/"}


def delete_written(url: str, leaves: list[dict[str, Any]]) -> None:
    """Deletes what `tensorstore_write` wrote under `url`, one request per object (never a
    listing: some emulators list more than the prefix asked for)."""
    keys = [
        f"{leaf['leaf']}/{key}"
        for leaf in leaves
        for key in ["zarr.json", *(_chunk_key(r, leaf["chunk"]) for r, _ in leaf["shards"])]
    ]
    _storage.delete_objects(_storage.as_path(url), keys)


def run(
    cfg: dict[str, Any],
    tr: _state.Training,
    memory_root: Path,
    sync: Callable[..., Any],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Alternates jaxckpt saves persisted to `cfg["store_url"]` with baseline writes."""
    url, pi = cfg["store_url"].rstrip("/"), jax.process_index()
    # Adam's moments are zero until the first step, and tensorstore stores no chunk that
    # equals the fill value (it deletes the key instead): both writes would skip them.
    tr.train_step()
    leaves = own_chunks(tr.state(0))
    out: dict[str, Any] = {
        "url": url,
        "arrays": len(leaves),
        "chunks": sum(len(leaf["shards"]) for leaf in leaves),
        "bytes": sum(data.nbytes for leaf in leaves for _, data in leaf["shards"]),
        "saves": [],
        "baseline": [],
    }
    ours = Jaxckpt(f"{url}/jaxckpt", memory_root, cfg, persist_every=1, memory_keep=2)
    try:
        for repeat in range(cfg["repeats"] + 1):
            step = repeat + 1
            progress(f"object store: jaxckpt save {step} until persisted")
            out["saves"].append(_persisted_save(cfg, tr, ours, step, sync) | {"warmup": not repeat})
            if step > 1:
                ours.mngr.delete(step - 1)  # collective; outside the timing
            progress(f"object store: tensorstore baseline {step}")
            prefix = f"{url}/tensorstore/{repeat}/part_{pi}"
            sync(f"store/baseline/{repeat}")
            seconds = tensorstore_write(prefix, leaves)
            out["baseline"].append(
                {
                    "warmup": not repeat,
                    "seconds": seconds,
                    "bytes": out["bytes"],
                    "bytes_per_s": out["bytes"] / seconds,
                }
            )
            delete_written(prefix, leaves)
        if not cfg.get("keep"):
            ours.mngr.delete(cfg["repeats"] + 1)
    finally:
        run_dir = ours.memory_dir
        ours.close()
    sync("store/closed")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _persisted_save(
    cfg: dict[str, Any], tr: _state.Training, ours: Jaxckpt, step: int, sync: Callable[..., Any]
) -> dict[str, Any]:
    """One save, timed until this process's part is durable on the store."""
    sync(f"store/save/{step}")
    start = time.perf_counter()
    ours.save(step, tr.state(step))
    returned = time.perf_counter() - start
    ours.mngr.wait_until_finished()
    committed = time.perf_counter() - start
    ours.handler.wait_for_persistence(cfg["timeout_s"])
    seconds = time.perf_counter() - start
    (persist,) = ours.metrics("persist", step)
    (save,) = ours.metrics("save", step)
    return {
        "step": step,
        "seconds": seconds,
        "save_wall_s": returned,
        "committed_s": committed,
        "safe_in_memory_s": save.get("safe_in_memory_s"),
        "safe_on_peers_s": save.get("safe_on_peers_s"),
        "persist_s": persist["persist_s"],
        # Before the upload (the commit in memory, the push to peers) and after it (the
        # manager's finalization, the part manifest).
        "outside_upload_s": seconds - persist["persist_s"],
        "bytes": persist["bytes"],
        "bytes_per_s": persist["bytes"] / seconds,
        "persist_bytes_per_s": persist["persist_bytes_per_s"],
    }
