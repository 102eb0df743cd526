"""docs/switching.md: every Python block runs as written, top to bottom, in one process.

The guide shards over a 2-device mesh and runs a jitted step after each resume, so a
restore target that commits a fresh (uncommitted) array to one device fails here.
"""

from __future__ import annotations

from helpers import REPO, python_blocks, run_page_code

GUIDE = REPO / "docs" / "switching.md"


def test_the_switching_guide_runs(tmp_path):
    blocks = python_blocks(GUIDE)
    assert len(blocks) >= 5, "the guide lost its code"
    assert 'jax_num_cpu_devices", 2' in blocks[0], "the guide no longer runs on a 2-device mesh"
    # The guide's memory root is /dev/shm/jaxckpt; this run keeps its own.
    code = "\n".join(blocks).replace('"/dev/shm/jaxckpt"', repr(str(tmp_path / "memory")))
    run_page_code(code, tmp_path, timeout=300)
