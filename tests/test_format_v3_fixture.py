"""A step saved by jaxckpt's format 3 (before tiles: every chunk whole, one CRC-32C each)
still restores, from its memory tier and from persistent storage, onto its own mesh and
onto others. The fixture (tests/fixtures/format_v3) was written by jaxckpt at format 3:
a (64, 32) float32 leaf on a 4 x 2 mesh, a replicated int32 leaf, a typed key and a
scalar, step 3, run id `fixture-v3`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import manager, restore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

FIXTURE = Path(__file__).parent / "fixtures" / "format_v3"


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "fixture")
    return tmp_path / "fixture"


def _target(spec):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    return {
        "w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, spec)),
        "b": jax.ShapeDtypeStruct((16,), np.int32, sharding=NamedSharding(mesh, P("y"))),
        "key": jax.eval_shape(lambda: jax.random.key(0)),
        "step": 0,
    }


def _check(restored, spec) -> None:
    np.testing.assert_array_equal(
        restored["w"], np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    )
    assert restored["w"].sharding.spec == spec
    np.testing.assert_array_equal(restored["b"], np.arange(16, dtype=np.int32))
    np.testing.assert_array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(7))
    )
    assert restored["step"] == 3


def test_the_fixture_is_format_3():
    manifest = FIXTURE / "ckpt/3/train/part_00000/manifest.json"
    raw = json.loads(manifest.read_text())
    assert raw["version"] == 3 and all("tile_shape" not in leaf for leaf in raw["leaves"])


@pytest.mark.parametrize("spec", [P("x", "y"), P("y", "x"), P(None, "y")], ids=str)
@pytest.mark.parametrize("tier", ["memory", "persistent"])
def test_a_format_3_step_restores_onto_any_mesh_from_every_tier(copy, spec, tier):
    memory = copy / "memory"
    if tier == "persistent":
        shutil.rmtree(memory)
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(memory), run_id="fixture-v3"))
    with manager(copy / "ckpt", h) as mngr:
        restored = restore(mngr, 3, _target(spec))
        assert h.last_restore_metrics["tier"] == tier
    _check(restored, spec)
