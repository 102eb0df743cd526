"""The examples' input pipeline: one global data stream, each process reading its rows.

Global batch ``i`` depends only on ``(seed, i)`` and each process reads the rows of it
that land on its devices, so the iterator's state is the GLOBAL position
``{"next_index": i}``, equal on every process: a checkpoint resumes onto another process
count with the same global batches (:func:`make_data_iterator`, docs/multihost.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from examples.sharding import batch_sharding

Batch = Any


def process_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """Returns the rows ``[lo, hi)`` of every global batch that this process feeds.

    They are the rows ``sharding.batch_sharding`` places on this process's devices, so the
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
        mesh: The training mesh (see ``sharding.make_mesh``).

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


def abstract_batch(records: Sequence[Any] | np.ndarray, global_batch: int, mesh: Mesh) -> Batch:
    """The global batch as ShapeDtypeStructs, from one record (no data is read)."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (global_batch, *np.shape(x)), np.asarray(x).dtype, sharding=sharding
        ),
        records[0],
    )
