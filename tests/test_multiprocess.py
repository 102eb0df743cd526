"""Recovery across processes: 4 JAX processes x 2 CPU devices on loopback, gloo collectives.

Every process is a "host" with its own memory root and failure domain; a node
loss is deleting its memory root. See tests/workers/mp_worker.py for the scenarios.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def restores(results) -> list[list[dict]]:
    """Per restore request, every process's answer."""
    per_process = [r.result["restores"] for r in results]
    return [list(x) for x in zip(*per_process, strict=True)]


def holders_of(base: Path, step: int, owner: int) -> list[str]:
    name = f"step_{step:012d}/part_{owner:05d}"
    return sorted(p.parts[-4] for p in base.glob(f"node*/run-*/{name}"))


def test_crash_node_loss_resize_and_rack_loss(tmp_path):
    base = tmp_path / "hosts"
    ckpt = str(tmp_path / "ckpt")
    roots = [str(base / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]
    common = {"ckpt": ckpt, "replicas": 1}

    # Steps 1-3 in memory and on one peer each; step 2 also persisted. Then a crash.
    saved = run(
        "save", roots, domains, {**common, "steps": [1, 2, 3], "persist_every": 2, "crash": True}
    )
    assert all(r.result["steps"] == [1, 2, 3] for r in saved)
    for owner in range(4):
        held = holders_of(base, 3, owner)
        assert len(held) == 2 and f"node{owner}" in held, (owner, held)

    # Process crash: every process restores from memory, nothing from persistent storage.
    (crash,) = restores(run("restore", roots, domains, {**common, "restores": [{"step": 3}]}))
    assert all(r["bad"] == [] and "persistent" not in r["bytes_by_tier"] for r in crash), crash

    # Node loss: node1's memory is gone; its part comes from its peer. The next save
    # re-creates full redundancy (node1 holds its own part of step 4 again, plus a replica).
    shutil.rmtree(roots[1])
    out = run("restore", roots, domains, {**common, "restores": [{"step": 3}], "then_save": 4})
    (loss,) = restores(out)
    assert all(r["bad"] == [] for r in loss), loss
    assert loss[1]["tier"] == "peer" and "persistent" not in loss[1]["bytes_by_tier"]
    assert all(r.result["bad_after_save"] == [] for r in out), out
    assert len(holders_of(base, 4, 1)) == 2 and "node1" in holders_of(base, 4, 1)

    # Node loss and a smaller job: 3 processes, a 6-device mesh, straight from memory tiers.
    shutil.rmtree(roots[1])
    three = [roots[0], roots[2], roots[3]]
    (resized,) = restores(
        run(
            "restore",
            three,
            [domains[0], domains[2], domains[3]],
            {**common, "restores": [{"step": 4, "mesh": [3, 2]}]},
        )
    )
    assert all(r["bad"] == [] and "persistent" not in r["bytes_by_tier"] for r in resized), resized

    # Two failure domains lost, holding every copy of part 1 of steps 3 and 4: the newest
    # restorable step is the persisted step 2, restored only when asked for.
    for holder in holders_of(base, 4, 1):
        shutil.rmtree(base / holder, ignore_errors=True)
    step4, step2 = restores(
        run("restore", roots, domains, {**common, "restores": [{"step": 4}, {"step": 2}]})
    )
    for r in step4:
        assert (
            "Step 4 cannot be restored" in r["error"]
            and "newest restorable step is 2" in r["error"]
        ), r
    assert all(r["bad"] == [] for r in step2), step2
    assert any("persistent" in r["bytes_by_tier"] for r in step2)


def test_restore_from_memory_onto_fewer_hosts_and_another_mesh(tmp_path):
    base = tmp_path / "hosts"
    ckpt = str(tmp_path / "ckpt")
    # Two hosts with two processes each; each host's processes share its memory root.
    roots = [str(base / h) for h in ("hostA", "hostA", "hostB", "hostB")]
    domains = ["hostA", "hostA", "hostB", "hostB"]
    run(
        "save",
        roots,
        domains,
        {
            "ckpt": ckpt,
            "replicas": 1,
            "persist_every": 1000,
            "steps": [1, 2],
            "local_iterator_steps": [2],
            "crash": True,
        },
    )

    # The same two hosts, one process each, a 2x2 mesh with transposed specs.
    args = {
        "ckpt": ckpt,
        "replicas": 1,
        "restores": [
            {"step": 1, "mesh": [2, 2], "transposed": True},
            {"step": 2, "mesh": [2, 2]},  # per-process iterator states, no mapping: refused
            {"step": 2, "mesh": [2, 2], "iterator_fn": True},
        ],
    }
    same, refused, mapped = restores(run("restore", [roots[0], roots[2]], ["hostA", "hostB"], args))
    assert all(r["bad"] == [] and set(r["bytes_by_tier"]) <= {"memory", "peer"} for r in same), same
    assert all("iterator_state_fn" in r["error"] for r in refused), refused
    assert all(r["bad"] == [] for r in mapped), mapped

    # One host left: its memory root holds its own parts and the other host's replicas.
    # Restoring needs no replica placement, although replicas=1 cannot be met any more.
    (alone,) = restores(
        run(
            "restore",
            [roots[0]],
            ["hostA"],
            {"ckpt": ckpt, "replicas": 1, "restores": [{"step": 1, "mesh": [2]}]},
        )
    )
    assert alone[0]["bad"] == [] and set(alone[0]["bytes_by_tier"]) == {"memory"}, alone


def test_kill_during_replication_keeps_the_previous_step(tmp_path):
    base = tmp_path / "hosts"
    ckpt = str(tmp_path / "ckpt")
    roots = [str(base / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]
    common = {"ckpt": ckpt, "replicas": 1, "persist_every": 1000}
    results = run(
        "save",
        roots,
        domains,
        {**common, "steps": [1, 2]},
        env={1: {"JAXCKPT_FAULT": "replicate@2@1"}},
        expect_ok=False,
        timeout=120,
    )
    assert results[1].returncode == -9  # killed itself mid-push of step 2
    assert not (Path(ckpt) / "2").exists()  # step 2 never finalized
    (after,) = restores(run("restore", roots, domains, {**common, "restores": [{"step": 1}]}))
    assert all(r["bad"] == [] for r in after), after


def test_a_process_that_never_answers_gives_a_timeout_not_a_hang(tmp_path):
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    domains = ["node0", "node1"]
    ckpt = str(tmp_path / "ckpt")
    run("save", roots, domains, {"ckpt": ckpt, "replicas": 1, "persist_every": 1000, "steps": [1]})
    args = {
        "ckpt": ckpt,
        "replicas": 1,
        "timeout_s": 4,
        "absent": [1],
        "absent_s": 8,
        "restores": [{"step": 1}],
    }
    results = run("restore", roots, domains, args, timeout=120)
    (answer,) = results[0].result["restores"]
    assert answer["error"].startswith("TimeoutError") and "[1]" in answer["error"], answer
    assert answer["seconds"] < 15, answer  # bounded by timeout_s, with margin for a loaded machine
