"""Soak: many per-step saves with retention; memory, tmpfs, threads and fds stay bounded.

A fresh interpreter saves every step through an async `ocp.CheckpointManager`
(memory tier on /dev/shm when it exists, `memory_keep=2`, a persisted step
every 25, the manager keeping the newest 3 plus any step still persisting) and
samples, every 25 saves after draining: RSS, bytes in the memory tier and the
checkpoint directory, live threads and open file descriptors. The test prints
the curve (`pytest -s`) and checks that nothing grows with the number of saves.

Reduced form (the default, part of `make test`): 150 saves, about 15 s.
Full form (500 saves, about a minute):

    JAXCKPT_SOAK_FULL=1 .venv/bin/python -m pytest -s tests/test_soak.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import uuid
from pathlib import Path

import patience
import pytest
from helpers import TEST_PYTHONPATH

SAVES = 500 if os.environ.get("JAXCKPT_SOAK_FULL") else 150
EVERY = 25

SOAK = """
import json, os, shutil, threading, time
from pathlib import Path
import jax, numpy as np, orbax.checkpoint as ocp, psutil
from jax.sharding import NamedSharding, PartitionSpec as P
from helpers import manager, save, restore, abstract, assert_tree_equal, mesh_1d
import jaxckpt

memory_root, ckpt = os.environ["MEMORY_ROOT"], Path(os.environ["CKPT"])
saves, every = int(os.environ["SAVES"]), int(os.environ["EVERY"])
mesh = mesh_1d()
base = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)

def state(step):
    return {
        "w": jax.device_put(base + step, NamedSharding(mesh, P("data"))),
        "b": jax.device_put(np.full(64, step, np.float32), NamedSharding(mesh, P())),
        "key": jax.random.key(step),
        "step": step,
    }

def tree_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())

me = psutil.Process()

h = jaxckpt.TieredCheckpointHandler(
    jaxckpt.TierOptions(memory_root, memory_keep=2, persist_every=25)
)
policy = h.preservation_policy(ocp.checkpoint_managers.LatestN(n=3))
mngr = manager(ckpt, h, preservation_policy=policy)
start = time.perf_counter()
for step in range(1, saves + 1):
    save(mngr, step, state(step))
    if step % every == 0:
        mngr.wait_until_finished()
        h.wait_for_persistence()
        print("SAMPLE " + json.dumps({
            "saves": step,
            "seconds": round(time.perf_counter() - start, 1),
            "rss_mib": round(me.memory_info().rss / 2**20, 1),
            "tmpfs_kib": tree_bytes(memory_root) // 1024,
            "ckpt_kib": tree_bytes(ckpt) // 1024,
            "memory_steps": len(h.inspect().memory.steps()),
            "ckpt_steps": len(mngr.all_steps()),
            "threads": threading.active_count(),
            "tasks": me.num_threads(),
            "fds": me.num_fds(),
        }), flush=True)
assert_tree_equal(restore(mngr, saves, abstract(state(saves))), state(saves))
mngr.close()
print("SOAK DONE", flush=True)
"""


def run_soak(memory_root: str, ckpt: str) -> list[dict]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": TEST_PYTHONPATH,
        "MEMORY_ROOT": memory_root,
        "CKPT": ckpt,
        "SAVES": str(SAVES),
        "EVERY": str(EVERY),
    }
    prelude = "import jax\njax.config.update('jax_num_cpu_devices', 8)\n"
    proc = patience.run(
        [sys.executable, "-c", prelude + textwrap.dedent(SOAK)],
        env=env,
        timeout=60 + SAVES,
    )
    assert proc.returncode == 0 and "SOAK DONE" in proc.stdout, (
        f"soak failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("SAMPLE ")]


@pytest.mark.slow
def test_soak_per_step_saves_stay_bounded(tmp_path):
    shm = Path("/dev/shm")
    on_tmpfs = shm.is_dir() and os.access(shm, os.W_OK)
    memory_root = shm / f"jaxckpt-soak-{uuid.uuid4().hex[:8]}" if on_tmpfs else tmp_path / "mem"
    try:
        samples = run_soak(str(memory_root), str(tmp_path / "ckpt"))
    finally:
        if on_tmpfs:
            shutil.rmtree(memory_root, ignore_errors=True)
    print(f"\nsoak curve ({SAVES} saves, memory tier on {'tmpfs' if on_tmpfs else 'disk'}):")
    cols = [
        "saves",
        "seconds",
        "rss_mib",
        "tmpfs_kib",
        "ckpt_kib",
        "memory_steps",
        "ckpt_steps",
        "threads",
        "tasks",
        "fds",
    ]
    print("  ".join(f"{c:>12}" for c in cols))
    for s in samples:
        print("  ".join(f"{s[c]:>12}" for c in cols))
    assert len(samples) == SAVES // EVERY

    warm, last = samples[1], samples[-1]  # the first 50 saves warm up caches and compiles
    # The memory tier holds memory_keep steps (+ one pinned while it persists): flat.
    assert max(s["memory_steps"] for s in samples) <= 3
    assert max(s["tmpfs_kib"] for s in samples[1:]) <= 1.5 * warm["tmpfs_kib"] + 64
    # The checkpoint directory holds LatestN(3) (+ steps still persisting): flat.
    assert max(s["ckpt_steps"] for s in samples) <= 4
    assert max(s["ckpt_kib"] for s in samples[1:]) <= 2 * warm["ckpt_kib"] + 256
    # No thread or file-descriptor leak.
    assert last["threads"] <= warm["threads"] + 2, samples
    # OS threads also count native pools (XLA, tensorstore) that grow lazily by a few.
    assert last["tasks"] <= warm["tasks"] + 8, samples
    assert last["fds"] <= warm["fds"] + 4, samples
    # RSS: no growth per save beyond allocator noise (a leak of one 64 KiB state copy
    # per save would add > 6 MiB over 100 saves).
    per_save_kib = (last["rss_mib"] - warm["rss_mib"]) * 1024 / (last["saves"] - warm["saves"])
    assert per_save_kib < 48, f"RSS grows {per_save_kib:.0f} KiB per save: {samples}"
