"""`TieredCheckpointHandler.prepare_restore`: what a restore onto a target compiles (the
reshard of leaves replicated across processes), compiled ahead, on a hot spare."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from multiproc import run

import jaxckpt


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_prepared_restore_compiles_nothing(tmp_path: Path) -> None:
    roots, domains = [str(tmp_path / "node0"), str(tmp_path / "node1")], ["host0", "host1"]
    args = {"ckpt": str(tmp_path / "ckpt")}
    run("save", roots, domains, args, worker="mp_prepare.py")
    results = [r.result for r in run("restore", roots, domains, args, worker="mp_prepare.py")]
    for r in results:
        assert r is not None and r["equal"], results
        # Unprepared, a restore onto leaves replicated across processes compiles (the
        # reshard); prepared, the compilation happened in prepare_restore instead.
        assert r["plain_compiles"] >= 1 and r["prepare_compiles"] >= 1, results
        assert r["leaves"] == 2 and r["prepared_compiles"] == 0, results


def _saved(tmp_path: Path) -> Path:
    handler = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(str(tmp_path / "memory")))
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_handlers={"train": handler})
    mngr.save(3, args=ocp.args.Composite(train=jaxckpt.TieredSave({"w": jnp.ones(8)})))
    mngr.wait_until_finished()
    mngr.close()
    return tmp_path / "ckpt" / "3" / "train"


def test_preparing_in_one_process_compiles_nothing_and_checks_the_target(tmp_path: Path) -> None:
    item = _saved(tmp_path)
    target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}
    # One process holds every replica: a restore reshards nothing.
    assert jaxckpt.TieredCheckpointHandler.prepare_restore(item, jaxckpt.TieredRestore(target)) == 0
    with pytest.raises(ValueError, match="expected shape"):
        jaxckpt.TieredCheckpointHandler.prepare_restore(
            item, jaxckpt.TieredRestore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
        )
    with pytest.raises(FileNotFoundError, match="holds no jaxckpt index"):
        jaxckpt.TieredCheckpointHandler.prepare_restore(
            tmp_path / "ckpt" / "9" / "train", jaxckpt.TieredRestore(target)
        )
