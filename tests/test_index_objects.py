"""A memory-only step costs the object store the same few object writes at any
process count: jaxckpt's one combined index, written by one process, beside
Orbax's own step metadata (written three times) and its two commit markers
(docs/object_stores.md states the count).

Each case starts an emulator (tests/support/object_stores.py) and 1, 2 or 4 JAX processes
that save memory-only steps into it; the emulator's request log names every
object written.
"""

from __future__ import annotations

import collections

import pytest
from multiproc import run
from object_stores import running

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = [1, 2, 3]  # none due for persistence (persist_every=1000)
# Orbax's writes of a step (process 0's): `_CHECKPOINT_METADATA` when the step directory is
# made, updated after the save and at the commit; `commit_success.txt` in the step and item.
ORBAX_WRITES = sorted(
    ["_CHECKPOINT_METADATA"] * 3 + ["commit_success.txt", "train/commit_success.txt"]
)
JAXCKPT_WRITES = ["train/index.json"]  # the step's index, whatever the process count


def writes_per_step(names: list[str], root: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = collections.defaultdict(list)
    for name in names:
        head, _, rest = name.removeprefix(f"{root}/").partition("/")
        if name.startswith(f"{root}/") and head.isdigit():
            out[int(head)].append(rest)
    return out


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_objects_written_per_memory_only_step_do_not_grow_with_processes(kind, tmp_path):
    per_count = {}
    with running(kind, tmp_path) as emulator:  # one emulator, a directory per count
        for processes in (1, 2, 4):
            root = f"run{processes}"
            roots = [str(tmp_path / f"mem-{processes}-{i}") for i in range(processes)]
            domains = [f"node{i}" for i in range(processes)]
            args = {"url": emulator.url(root), "steps": STEPS, "replicas": int(processes > 1)}
            env = {i: emulator.env() for i in range(processes)}
            results = run(
                "memory_only_saves", roots, domains, args, env=env, worker="mp_objects.py"
            )
            for r in results:  # the steps are whole: the last one restores from memory
                assert r.result["bad"] == [] and r.result["tier"] == "memory", r.result
            written = writes_per_step(emulator.object_writes(), root)
            assert sorted(written) == STEPS, (processes, written)
            for step in STEPS:
                objects = sorted(written[step])
                # The step's index is one object, never one per process; nothing else is
                # jaxckpt's.
                assert objects == sorted(ORBAX_WRITES + JAXCKPT_WRITES), (processes, step, objects)
            per_count[processes] = {step: sorted(written[step]) for step in STEPS}
    # The same objects at 1, 2 and 4 processes.
    assert per_count[1] == per_count[2] == per_count[4], per_count
