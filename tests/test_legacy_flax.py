"""flax.training.checkpoints with `orbax_checkpointer=`: refused at once, with the manager form."""

from __future__ import annotations

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from flax.training import checkpoints

import jaxckpt


@pytest.mark.parametrize("checkpointer", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_legacy_flax_save_is_refused_at_once(memory_root, tmp_path, checkpointer):
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root))
    ckptr = checkpointer(handler)
    state = {"w": jnp.arange(8.0), "step": 3}
    # The error comes from the call itself, not later from another save or a wait.
    with pytest.raises(ValueError, match=r"ocp\.CheckpointManager\(ckpt_dir") as refused:
        checkpoints.save_checkpoint_multiprocess(
            str(tmp_path / "ck"), state, 3, orbax_checkpointer=ckptr
        )
    assert "checkpoint_3" in str(refused.value) and "[process 0]" in str(refused.value)
    ckptr.close()


def test_a_bare_checkpointer_with_an_explicit_step_still_saves(memory_root, tmp_path):
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    ckptr = ocp.Checkpointer(handler)
    ckptr.save(tmp_path / "one" / "item", args=jaxckpt.TieredSave({"w": jnp.ones(3)}, step=7))
    assert (tmp_path / "one" / "item" / "index.json").exists()
    ckptr.close()
