"""Saved shardings: describe one as JSON, rebuild it when its devices exist."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


def describe(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    """A JSON description of `sharding` for the manifest.

    A named sharding keeps its mesh's axis types ("Auto", "Explicit", "Manual"):
    `jax.make_mesh` makes Explicit axes, and an array on an Auto copy of that
    mesh cannot meet arrays of the original in a jitted op under `jax.set_mesh`.
    """
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return {
            "type": "named",
            "axis_names": list(mesh.axis_names),
            "axis_types": [t.name for t in mesh.axis_types],
            "mesh_shape": list(mesh.devices.shape),
            "device_ids": [int(d.id) for d in mesh.devices.flat],
            "spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
        }
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return {"type": "single", "device_id": int(device.id)}  # type: ignore[attr-defined]
    return {"type": "other", "repr": repr(sharding)}


def rebuild(desc: dict[str, Any] | None) -> jax.sharding.Sharding | None:
    """The saved sharding, or None if it cannot be built in this runtime.

    Descriptions written before axis types were recorded rebuild with Auto axes
    (what `Mesh` made then); an axis type this JAX does not know gives None.
    """
    if not desc:
        return None
    devices = {d.id: d for d in jax.devices()}
    if desc["type"] == "named":
        if not all(i in devices for i in desc["device_ids"]):
            return None
        names = tuple(desc["axis_names"])
        type_names = desc.get("axis_types", ["Auto"] * len(names))
        if not all(t in AxisType.__members__ for t in type_names):
            return None
        grid = np.array([devices[i] for i in desc["device_ids"]]).reshape(desc["mesh_shape"])
        spec = PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in desc["spec"]))
        axis_types = tuple(AxisType[t] for t in type_names)
        return NamedSharding(Mesh(grid, names, axis_types=axis_types), spec)
    if desc["type"] == "single" and desc["device_id"] in devices:
        return SingleDeviceSharding(devices[desc["device_id"]])
    return None


def with_trailing_dims(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
    """The sharding of `jax.random.key_data(keys)` for keys sharded as `sharding`."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * ndim)))
    if isinstance(sharding, SingleDeviceSharding) or sharding.is_fully_replicated:
        return sharding
    raise TypeError(
        f"Cannot restore typed PRNG keys onto {sharding!r}; use a NamedSharding or a single device."
    )
