"""Scenarios for tests/test_agreement_multiprocess.py: processes that disagree must all fail, at once.

Run by tests/support/multiproc.py, one JAX process per "host" (see mp_worker.py).
"""

from __future__ import annotations

import mp_worker  # starts JAX: 2 CPU devices per process, jax.distributed on loopback

# isort: split

import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp_worker import ROWS, attempt, check, expected, manager, mesh, state, target

import jaxckpt
from jaxckpt.coord import _multihost
from jaxckpt.format import _format


def keys_in_store(label: str) -> int:
    """jaxckpt's keys in the coordinator's store once every process is out of its exchanges."""
    multihost_utils.sync_global_devices(f"keys-{label}")
    count = len(_multihost.stored_keys())
    multihost_utils.sync_global_devices(f"keys-{label}-counted")
    return count


def exchange_seconds(rounds: int) -> float:
    """The median time of one exchange of a digest-sized value between all processes."""
    multihost_utils.sync_global_devices("exchange-timing")
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        _multihost.allgather("0" * 32, tag="timing", timeout_s=20)
        times.append(time.perf_counter() - started)
    return sorted(times)[rounds // 2]


def corrupt_part(roots: list[str], step: int, owner: int) -> list[str]:
    """Flips bytes in every chunk of `owner`'s part of `step` in every memory root."""
    hit = []
    for root in roots:
        for part in Path(root).glob(f"run-*/step_{step:012d}/part_{owner:05d}"):
            manifest = _format.PartManifest.from_json((part / "manifest.json").read_text())
            slab = part / "slab"
            with open(slab, "r+b") as f:
                for chunks in manifest.chunks.values():
                    for c in chunks:
                        if c.nbytes:
                            f.seek(c.offset)
                            byte = f.read(1)[0]
                            f.seek(c.offset)
                            f.write(bytes([byte ^ 0xFF]))
            hit.append(str(slab))
    return hit


def scenario_agreement(args: dict) -> dict:
    """Saves and restores where one process differs from the others; see the test."""
    pi = jax.process_index()
    mngr, h = manager(
        args["ckpt"], replicas=1, persist_every=1000, timeout_s=args["timeout_s"], memory_keep=2
    )
    m = mesh()
    out: dict = {}

    def save(step: int, tree: dict) -> None:
        mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(tree)))
        mngr.wait_until_finished()  # an asynchronous manager raises a failed commit here

    def restore(step: int, tgt: dict) -> list[str]:
        restored = mngr.restore(step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(tgt)))
        return check(restored.train, step)

    out["save_1"] = attempt(lambda: save(1, state(1, m)))

    # Process 1 saves an extra leaf (a global array it alone has in its tree).
    extra = state(2, m)
    if pi == 1:
        sharding = NamedSharding(m, P(m.axis_names[0]))
        extra["extra"] = jax.make_array_from_callback(
            (ROWS,), sharding, lambda idx: np.zeros((ROWS,), np.float32)[idx]
        )
    out["save_2_extra_leaf"] = attempt(lambda: save(2, extra))

    # Process 2 saves "w" with another sharding (replicated instead of row-sharded).
    other = state(3, m)
    if pi == 2:
        w = np.asarray(expected(3)["w"])
        other["w"] = jax.make_array_from_callback(w.shape, NamedSharding(m, P()), lambda i: w[i])
    out["save_3_other_sharding"] = attempt(lambda: save(3, other))

    # The job goes on: every process's exchanges are still in step.
    out["save_4"] = attempt(lambda: save(4, state(4, m)))
    out["keys_after_save_4"] = keys_in_store("save4")

    # A target that is wrong on process 1 only.
    bad = target(m)
    if pi == 1:
        bad["w"] = jax.ShapeDtypeStruct((ROWS, 4), np.float32, sharding=bad["w"].sharding)
    out["restore_wrong_target_on_1"] = attempt(lambda: restore(4, bad))
    out["restore_4"] = attempt(lambda: restore(4, target(m)))

    # Every copy of process 1's part of step 4 damaged: only process 1 reads it.
    multihost_utils.sync_global_devices("before-corruption")
    if pi == 1:
        out["corrupted_files"] = len(corrupt_part(args["roots"], 4, 1))
    multihost_utils.sync_global_devices("after-corruption")
    out["restore_corrupt_for_1"] = attempt(lambda: restore(4, target(m)))

    # Many more saves and restores: the store holds nothing of finished exchanges (but
    # the last one's outcome).
    for step in range(5, 5 + args["more_saves"]):
        save(step, state(step, m))
    out["restore_last"] = attempt(lambda: restore(step, target(m)))
    out["keys_after_more"] = keys_in_store("more")
    out["agree_s"] = h.last_save_metrics.get("agree_s")  # the agreement's cost in a commit
    out["exchange_s"] = exchange_seconds(20)
    out["saves"] = 4 + args["more_saves"]
    mngr.close()
    return out


if __name__ == "__main__":
    mp_worker.main(globals())
