"""docs/switching.md: every Python block runs as written, top to bottom, in one process.

The guide shards over a 2-device mesh and runs a jitted step after each resume, so a
restore target that commits a fresh (uncommitted) array to one device fails here.
"""

from __future__ import annotations

import re
import sys

import patience
from helpers import REPO

GUIDE = REPO / "docs" / "switching.md"


def test_the_switching_guide_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 5, "the guide lost its code"
    assert 'jax_num_cpu_devices", 2' in blocks[0], "the guide no longer runs on a 2-device mesh"
    # The guide's memory root is /dev/shm/jaxckpt; this run keeps its own.
    code = "\n".join(blocks).replace('"/dev/shm/jaxckpt"', repr(str(tmp_path / "memory")))
    script = tmp_path / "guide.py"
    script.write_text(code)
    proc = patience.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        # PYTHONPATH: this checkout's jaxckpt, whichever one the environment has installed.
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
