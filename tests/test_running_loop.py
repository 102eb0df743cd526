"""Saving and restoring from a thread that runs an event loop, as a Jupyter cell does.

A notebook cell runs inside the kernel's asyncio loop, so any `asyncio.run`
on the save or restore path raises "cannot be called from a running event
loop". Each test here runs its calls inside `asyncio.run(cell())`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import abstract, assert_tree_equal, manager, mesh_1d, restore, save, sharded_state

import jaxckpt


def state_for(step: int) -> dict[str, Any]:
    return {**sharded_state(mesh_1d(), seed=step), "step": step}


@pytest.mark.parametrize("use_async", [False, True])
def test_manager_save_and_restore_in_a_running_loop(memory_root, ckpt_dir, use_async):
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))

    async def cell() -> Any:
        with manager(ckpt_dir, h, use_async=use_async) as mngr:
            save(mngr, 1, state_for(1))
            mngr.wait_until_finished()
            h.wait_for_persistence()
            return restore(mngr, 1, abstract(state_for(1)))

    assert_tree_equal(asyncio.run(cell()), state_for(1))


def test_handler_save_and_restore_in_a_running_loop(memory_root, ckpt_dir):
    """The handler's own synchronous `save` and `restore`, called directly."""
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, run_id="loop"))
    item = ckpt_dir / "3" / "train"
    item.mkdir(parents=True)

    async def cell() -> Any:
        h.save(item, jaxckpt.TieredSave(state_for(3)))
        return h.restore(item, jaxckpt.TieredRestore(abstract(state_for(3))))

    assert_tree_equal(asyncio.run(cell()), state_for(3))
    h.close()
