"""A restore from the memory tier copies nothing: on CPU the restored arrays live on
the pages of the tier's slab (a mapping of its file), as many leaves as there are."""

from __future__ import annotations

import jax
import numpy as np
from helpers import abstract, manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def _mapping_of(address: int) -> str:
    """The path of the file mapped at `address` in this process ("" if anonymous)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def test_restored_shards_live_on_the_slab_pages(memory_root, ckpt_dir):
    sharding = NamedSharding(mesh_1d(), P("data"))
    state = {
        f"w{i}": jax.device_put(np.arange(8 * 4096, dtype=np.float32) + i, sharding)
        for i in range(40)
    }
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    with manager(ckpt_dir, handler) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        target = abstract(state)
        restored = restore(mngr, 1, target)
        for k, a in restored.items():
            np.testing.assert_array_equal(np.asarray(a), np.asarray(state[k]))
            for shard in a.addressable_shards:
                where = _mapping_of(shard.data.unsafe_buffer_pointer())
                assert where.startswith(memory_root) and where.endswith("/slab"), (k, where)
