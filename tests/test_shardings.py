"""Saved shardings keep their mesh's axis types (Auto, Explicit, Manual)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import manager, restore, save
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import _sharding


def handler(memory_root: str) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
def test_restored_sharding_keeps_the_axis_types(memory_root, ckpt_dir, axis_type):
    # jax.make_mesh makes Explicit axes by default; an Auto copy of the mesh breaks
    # the next jitted op that meets arrays of the original under jax.set_mesh.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    with manager(ckpt_dir, handler(memory_root)) as mngr:
        save(mngr, 1, {"x": x})
        mngr.wait_until_finished()
        meta = mngr.item_metadata(1).train
        assert meta["x"].sharding.mesh.axis_types == (axis_type,)
        no_sharding = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)}  # gets the saved sharding
        for target in (meta, no_sharding):
            y = restore(mngr, 1, target)["x"]
            assert y.sharding == x.sharding
            assert jax.typeof(y) == jax.typeof(x)
            with jax.set_mesh(mesh):
                z = jax.jit(lambda a, b: a * 2 + b)(y, x)
            np.testing.assert_array_equal(np.asarray(z), np.arange(16.0) * 3)


def test_mixed_axis_types_round_trip_through_json():
    types = (AxisType.Explicit, AxisType.Auto, AxisType.Manual)
    mesh = jax.make_mesh((2, 2, 2), ("data", "model", "pipe"), axis_types=types)
    sharding = NamedSharding(mesh, P("data", "model"))
    desc = _sharding.describe(sharding)
    assert desc["axis_types"] == ["Explicit", "Auto", "Manual"]
    assert _sharding.rebuild(desc) == sharding


def test_descriptions_without_axis_types_rebuild_auto():
    # Manifests written before axis types were recorded.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    desc = _sharding.describe(NamedSharding(mesh, P("data")))
    del desc["axis_types"]
    rebuilt = _sharding.rebuild(desc)
    assert isinstance(rebuilt, NamedSharding)
    assert rebuilt.mesh.axis_types == (AxisType.Auto,)
    assert rebuilt == NamedSharding(mesh, P("data"))
