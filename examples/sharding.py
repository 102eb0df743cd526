"""The examples' mesh and shardings: a ``(data, fsdp)`` mesh over every device of the job.

Parameters and optimizer state are FSDP-sharded (:func:`with_fsdp_shardings`); a batch is
split over every device (:func:`batch_sharding`), which is what lets each process read
only its rows of it (``data.process_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS: Final = "data"
FSDP_AXIS: Final = "fsdp"

PyTree = Any


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
