"""Data-parallel replicas share the save, and are the copies: JAX processes x 2 CPU devices
on loopback (gloo), meshes ('dp', 'fsdp') with dp across processes. See tests/workers/mp_replicas.py.

Every process is a "host" with its own memory root and failure domain; a node loss is
deleting its memory root.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from multiproc import run

from jaxckpt import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = "mp_replicas.py"
NETWORK = ("peer", "persistent")


def _per_request(results) -> list[list[dict]]:
    per_process = [r.result["restores"] for r in results]
    return [list(x) for x in zip(*per_process, strict=True)]


def _even(values: list[float], within: float = 0.05) -> bool:
    mean = sum(values) / len(values)
    return mean > 0 and all(abs(v - mean) <= within * mean for v in values)


def _holders(base: Path, step: int, owner: int) -> list[str]:
    name = f"step_{step:012d}/part_{owner:05d}"
    return sorted(p.parts[-4] for p in base.glob(f"node*/run-*/{name}"))


def _ok(restores: list[dict]) -> bool:
    return all("error" not in r and r["bad"] == [] for r in restores)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def _tools_show_slices(capsys, ckpt: str, roots: list[str]) -> None:
    """`jaxckpt ls/inspect/verify` say who holds which slice of step 2 (R = 2)."""
    memory = [a for r in roots for a in ("--memory-root", r)]
    code, text = _cli(capsys, "ls", ckpt, *memory, "--json")
    assert code == 0
    (step2,) = [s for s in json.loads(text)["steps"] if s["step"] == 2]
    assert step2["replicas"] == 4 and len(step2["slices"]) == 4  # "full" is on all 4
    code, text = _cli(capsys, "ls", ckpt, *memory)
    assert code == 0 and "SLICES" in text and "R=4:" in text
    code, text = _cli(capsys, "inspect", ckpt, 2, *memory, "--json")
    leaves = {leaf["path"]: leaf for leaf in json.loads(text)["leaves"]}
    w = leaves["['w']"]
    assert (w["replicas"], w["cut"], w["slices_per_shard"]) == (2, 0, 2)
    # Each process holds one slice of each of its two fsdp shards: 4 x 2 = 8 slices.
    assert sorted(w["slices"]) == ["0", "1", "2", "3"]
    assert sorted(tuple(i) for idx in w["slices"].values() for i in idx) == [
        (i, 0) for i in range(8)
    ]
    assert leaves["['odd']"]["slices_per_shard"] == 3  # 3 rows a shard, R = 2
    # Zero-size: never cut, each (empty) shard saved by one of its replicas.
    empty = leaves["['empty']"]
    assert empty["cut"] is None and empty["bytes"] == 0 and len(empty["slices"]) == 4
    code, text = _cli(capsys, "inspect", ckpt, 2, *memory)
    assert "SLICES (shards held by R processes" in text and "['w']  R=2, 2 slices a shard" in text
    code, text = _cli(capsys, "verify", ckpt, 2, *memory, "--no-progress")
    assert code == 0 and "SLICES" in text, text


def test_dp2_fsdp4_on_4_processes(tmp_path: Path, capsys) -> None:
    base = tmp_path / "hosts"
    ckpt = str(tmp_path / "ckpt")
    roots = [str(base / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]

    # Step 1 (persisted) and 2 on dp=2 x fsdp=4, step 3 on dp=4 x fsdp=2 (R = 4).
    saves = [{"step": 1, "dp": 2}, {"step": 2, "dp": 2}, {"step": 3, "dp": 4}]
    saved = run(
        "save", roots, domains, {"ckpt": ckpt, "saves": saves, "persist_every": 2}, worker=WORKER
    )
    saved_ = [r.result["saves"] for r in saved]
    for k in range(3):
        metrics = [s[k] for s in saved_]
        assert _even([m["bytes"] for m in metrics]), metrics
        assert _even([m["replicate_bytes"] for m in metrics]), metrics
    # One copy of every byte in the job, spread evenly (the whole tree is ~3.2 MiB).
    assert sum(s[0]["bytes"] for s in saved_) == sum(s[1]["bytes"] for s in saved_)
    # With R = 2 and replicas=1, each part's copy is on the partner holding the same shards:
    # 0 <-> 2 and 1 <-> 3 (dp rows are processes 0-1 and 2-3).
    for owner, partner in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert _holders(base, 2, owner) == sorted([f"node{owner}", f"node{partner}"])

    _tools_show_slices(capsys, ckpt, roots)

    # A restart of every process: all from memory, nothing over the network (each reads
    # its own slices, a collective over dp carries them to the partner; the small fully
    # replicated "ln" and "scale", held by all 4 processes, were saved by each); then the same
    # after process 0's own slice was damaged in its memory (it falls back to the copy on
    # its partner, over the network); then onto dp=4 x fsdp=2.
    full, damaged, other, lost = _per_request(
        run(
            "restore",
            roots,
            domains,
            {
                "ckpt": ckpt,
                "restores": [
                    {"step": 2, "dp": 2},
                    {"step": 2, "dp": 2, "corrupt": [[0, 0]]},
                    {"step": 2, "dp": 4},
                    # Both memory copies of part 0 of step 3 (R = 4, not persisted) damaged.
                    {"step": 3, "dp": 4, "corrupt": [[0, 0], [1, 0]]},
                ],
            },
            worker=WORKER,
        )
    )
    assert _ok(full) and _ok(damaged) and _ok(other), (full, damaged, other)
    print("restart of every process, bytes by tier:", [r["bytes_by_tier"] for r in full])
    for r in full:
        assert set(r["bytes_by_tier"]) == {"memory"}, full  # 0 peer, 0 persistent bytes
    # No good copy of a slice: every process raises the same type (the reads are agreed
    # on before the collective that reshards them, so none is left waiting in it).
    assert all(r.get("error", "").startswith("FileNotFoundError") for r in lost), lost
    assert "No verified copy of chunk" in lost[0]["error"], lost[0]
    assert damaged[0]["bytes_by_tier"].get("peer") and damaged[0]["fallbacks"], damaged[0]
    assert all(set(r["bytes_by_tier"]) == {"memory"} for r in damaged[1:]), damaged

    # Node loss: node1's memory is gone; its slices come from its partner's memory (node3).
    shutil.rmtree(roots[1])
    loss, persisted, onto_dp4 = _per_request(
        run(
            "restore",
            roots,
            domains,
            {
                "ckpt": ckpt,
                "restores": [
                    {"step": 2, "dp": 2},
                    {"step": 2, "dp": 2, "forget": True},
                    {"step": 2, "dp": 4, "forget": True},
                ],
            },
            worker=WORKER,
        )
    )
    assert _ok(loss), loss
    print("node loss, bytes by tier:", [(r["bytes_by_tier"], r["fallbacks"]) for r in loss])
    assert set(loss[1]["bytes_by_tier"]) == {"peer"}, loss[1]
    # Every memory tier gone: the persisted step 2 is read once across the job (each
    # replica group reads 1/R, a collective over dp does the rest), "odd" too, whose sizes
    # no dp split divides: each of its shards (3 rows, 1 chunk a row) is read as 2 rows by
    # one replica and 1 by the other, padded to a common slot.
    assert _ok(persisted), persisted
    assert all(set(r["bytes_by_tier"]) == {"persistent"} for r in persisted), persisted
    read = sum(r["bytes_by_tier"]["persistent"] for r in persisted)
    saved_bytes = sum(s[1]["bytes"] for s in saved_)
    print("persistent restore, bytes by tier:", [r["bytes_by_tier"] for r in persisted])
    # (Small shards saved by each holder are read by each, from its own part: as saved.)
    assert read == saved_bytes, (read, saved_bytes)
    print(
        "seconds: restart", [r["seconds"] for r in full], "node loss", [r["seconds"] for r in loss]
    )
    # Onto dp=4 x fsdp=2 from persistent storage: another split, whose even parts of "cols"
    # would be half a saved chunk each, read whole by two processes; read in whole chunks,
    # every byte is read once across the job here too ("bias" and the keys, shards too
    # small to cut, saved whole by both their holders, are read once a copy: as saved).
    assert _ok(onto_dp4), onto_dp4
    assert all(set(r["bytes_by_tier"]) == {"persistent"} for r in onto_dp4), onto_dp4
    onto = sum(r["bytes_by_tier"]["persistent"] for r in onto_dp4)
    print("onto dp=4 from persistent:", [(r["bytes_by_tier"], r["seconds"]) for r in onto_dp4])
    assert onto == saved_bytes, (onto, saved_bytes)


def test_dp2_fsdp2_on_2_processes_and_onto_fewer_processes(tmp_path: Path) -> None:
    base = tmp_path / "hosts"
    ckpt = str(tmp_path / "ckpt")
    roots = [str(base / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]
    saves = [{"step": 1, "dp": 2}]
    # dp=2 x fsdp=4 on 4 processes, then restored by 2 processes (dp=2 x fsdp=2) from the
    # memory tiers of node0 and node1, which hold every part (their own and their
    # partners'): nothing is read from persistent storage.
    run("save", roots, domains, {"ckpt": ckpt, "saves": saves, "persist_every": 100}, worker=WORKER)
    (fewer,) = _per_request(
        run(
            "restore",
            roots[:2],
            domains[:2],
            {"ckpt": ckpt, "restores": [{"step": 1, "dp": 2}]},
            worker=WORKER,
        )
    )
    assert _ok(fewer) and all("persistent" not in r["bytes_by_tier"] for r in fewer), fewer
    # dp=2 x fsdp=2 on 2 processes (each holds every shard): even shares, and a restart
    # restores from memory alone.
    ckpt2 = str(tmp_path / "ckpt2")
    two = [str(base / f"pair{i}") for i in range(2)]
    saved = run(
        "save",
        two,
        ["a", "b"],
        {"ckpt": ckpt2, "saves": [{"step": 5, "dp": 2}], "persist_every": 100},
        worker=WORKER,
    )
    metrics = [r.result["saves"][0] for r in saved]
    assert _even([m["bytes"] for m in metrics]) and _even([m["replicate_bytes"] for m in metrics])
    (restart,) = _per_request(
        run(
            "restore",
            two,
            ["a", "b"],
            {"ckpt": ckpt2, "restores": [{"step": 5, "dp": 2}]},
            worker=WORKER,
        )
    )
    assert _ok(restart) and all(set(r["bytes_by_tier"]) == {"memory"} for r in restart), restart
