"""docs/operations.md: a persisted array is read with plain tensorstore, as shown."""

from __future__ import annotations

import re

import jax
import numpy as np
from helpers import REPO, manager, mesh_1d, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def snippet() -> str:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("## Reading a persisted array without jaxckpt", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_documented_read_returns_the_saved_parameter(memory_root, ckpt_dir):
    mesh = mesh_1d()
    kernel = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    state = {
        "params": {"Dense_0": {"kernel": jax.device_put(kernel, NamedSharding(mesh, P("data")))}},
        "rng": jax.random.key(3),
        "step": 7,
    }
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 7, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    scope = {"ckpt": f"file://{ckpt_dir}", "step": 7}
    exec(snippet(), scope)
    np.testing.assert_array_equal(scope["values"], kernel)
    about = scope["about"]
    assert about["path"] == "['params']['Dense_0']['kernel']"
    assert (about["dtype"], about["shape"]) == ("float32", [8, 16])
    assert about["sharding"]["spec"] == ["data"] and about["step"] == 7
    assert sorted(p.name for p in (ckpt_dir / "7/train/part_00000/arrays").iterdir()) == [
        "params.Dense_0.kernel",
        "rng",
    ]
