"""Restores onto other meshes and process counts read only the tiles they need: JAX
processes x 2 CPU devices on loopback. See tests/workers/mp_reshard.py.

Every process is a "host" with its own memory root and failure domain; a node loss is
deleting its memory root. The measure is each process's bytes read (all tiers) over the
bytes its target shards need, from the restore's metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = "mp_reshard.py"
TILE_BYTES = 1024  # "w" is 256 KiB: a saved chunk of 64 KiB is cut 8 x 8


def _spec(mesh: str, *spec) -> dict:
    return {"mesh": mesh, "spec": list(spec)}


def _roots(tmp_path: Path, n: int) -> tuple[list[str], list[str]]:
    return [str(tmp_path / f"node{i}") for i in range(n)], [f"host{i}" for i in range(n)]


def _ratios(results, k: int) -> list[float]:
    """Each process's bytes read over bytes needed in restore k."""
    out = []
    for r in results:
        got = r.result["restores"][k]
        assert got["equal"], got
        out.append(sum(got["bytes_by_tier"].values()) / got["bytes_needed"])
    return out


def _tiers(results, k: int) -> set[str]:
    return {t for r in results for t in r.result["restores"][k]["bytes_by_tier"]}


# (saved as, restored onto), on 2 processes.
DIRECTIONS = {
    "rows-to-columns": (_spec("all", "x"), _spec("all", None, "x")),
    "finer-interleaved": (_spec("one-each", "x"), _spec("interleaved", "x")),
    "coarser": (_spec("all", "x"), _spec("one-each", "x")),
    "axis-order": (_spec("grid", "x", "y"), _spec("grid", "y", "x")),
    "replicated-to-sharded": (_spec("all"), _spec("all", "x")),
    "sharded-to-replicated": (_spec("all", "x"), _spec("all")),
}


def test_every_direction_reads_what_it_needs_from_memory_and_from_persistent(tmp_path):
    roots, domains = _roots(tmp_path, 2)
    ckpt = str(tmp_path / "ckpt")
    names = sorted(DIRECTIONS)
    saves = [DIRECTIONS[n][0] for n in names]
    run(
        "save",
        roots,
        domains,
        {"ckpt": ckpt, "saves": saves, "tile_bytes": TILE_BYTES},
        worker=WORKER,
    )
    restores = [{"step": k, **DIRECTIONS[n][1]} for k, n in enumerate(names)]
    lost = [{**r, "forget": [0, 1]} for r in restores]
    results = run(
        "restore", roots, domains, {"ckpt": ckpt, "restores": restores + lost}, worker=WORKER
    )
    for k, name in enumerate(names):
        assert _tiers(results, k) == {"memory"}, name
        assert max(_ratios(results, k)) <= 1.1, (name, _ratios(results, k))
        j = len(names) + k
        assert _tiers(results, j) == {"persistent"}, name
        assert max(_ratios(results, j)) <= 1.1, (name, "persistent", _ratios(results, j))


def test_without_tiles_a_process_reads_whole_chunks(tmp_path):
    """The measure can fail: chunks saved whole are read whole (half of each is needed)."""
    roots, domains = _roots(tmp_path, 2)
    ckpt = str(tmp_path / "ckpt")
    saved, onto = DIRECTIONS["rows-to-columns"]
    run("save", roots, domains, {"ckpt": ckpt, "saves": [saved], "tile_bytes": None}, worker=WORKER)
    results = run(
        "restore", roots, domains, {"ckpt": ckpt, "restores": [{"step": 0, **onto}]}, worker=WORKER
    )
    assert min(_ratios(results, 0)) >= 1.9


@pytest.mark.parametrize("saved_on,restored_on", [(4, 2), (2, 4)], ids=["4-to-2", "2-to-4"])
def test_another_process_count_reads_what_it_needs_from_peers_and_from_persistent(
    tmp_path, saved_on, restored_on
):
    """Saved by one process count, restored by another onto column shards (a quarter or a
    half of every saved chunk a process): after a node loss (process 1's memory gone; new
    nodes have none) from memory and peers, then after every memory tier is lost from
    persistent storage."""
    roots, domains = _roots(tmp_path, max(saved_on, restored_on))
    ckpt = str(tmp_path / "ckpt")
    run(
        "save",
        roots[:saved_on],
        domains[:saved_on],
        {"ckpt": ckpt, "saves": [_spec("all", "x")], "tile_bytes": TILE_BYTES},
        worker=WORKER,
    )
    onto = {"step": 0, **_spec("all", None, "x")}
    restores = [{**onto, "forget": [1]}, {**onto, "forget": list(range(restored_on))}]
    results = run(
        "restore",
        roots[:restored_on],
        domains[:restored_on],
        {"ckpt": ckpt, "restores": restores},
        worker=WORKER,
    )
    assert "peer" in _tiers(results, 0)
    assert max(_ratios(results, 0)) <= 1.1, _ratios(results, 0)
    assert _tiers(results, 1) == {"persistent"}
    assert max(_ratios(results, 1)) <= 1.1, _ratios(results, 1)
