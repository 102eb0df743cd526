"""Process-local values across processes: 4 JAX processes x 2 CPU devices on loopback.

Every process saves its own value of a process-local jax.Array, a numpy array
and a scalar; it gets its own back on the same process count, from any tier;
on another count, values equal everywhere restore, differing ones are refused
by name unless a mapping function picks them. See tests/workers/mp_process_local.py.
"""

from __future__ import annotations

import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = "mp_process_local.py"
LOCAL = ("loc", "pinned", "key", "np", "s")


def _check_common(leaves: dict) -> None:
    assert leaves["same"]["values"] == [0.0, 1.0, 2.0, 3.0], leaves["same"]
    assert leaves["g"]["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], leaves["g"]
    assert leaves["w_ok"] is True, leaves["w"]


def test_process_local_values(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    roots = [str(tmp_path / "hosts" / f"node{i}") for i in range(4)]
    domains = [f"node{i}" for i in range(4)]
    saved = run("save", roots, domains, {"ckpt": ckpt}, worker=WORKER)
    assert all(r.result["steps"] == [1, 2] for r in saved)

    # Same process count: every process gets its own saved value, from every tier.
    same = run("same_count", roots, domains, {"ckpt": ckpt}, worker=WORKER)
    for p, r in enumerate(same):
        error = r.result.pop("global_target").get("error", "")
        assert error.startswith("ValueError") and "['loc']" in error, error
        assert "one global array cannot hold" in error, error
        for phase, got in r.result.items():
            assert "error" not in got, (p, phase, got)
            leaves = got["leaves"]
            for name in LOCAL:
                assert leaves[name]["values"] == [float(p)], (p, phase, name, leaves[name])
            _check_common(leaves)
            if not phase.endswith("_none"):
                assert leaves["loc"]["committed"] is False  # the target was uncommitted
                assert leaves["key"]["committed"] is False
                assert leaves["pinned"]["fully_addressable"] and leaves["w"]["committed"]
                assert leaves["s"]["type"] == "int" and leaves["np"]["numpy"]
        tiers = {phase: set(got["bytes_by_tier"]) for phase, got in r.result.items()}
        assert tiers["memory"] <= {"memory", "peer"}, tiers
        assert tiers["persistent"] == {"persistent"}, tiers
        if p == 1:
            assert "peer" in tiers["peer"] and "persistent" not in tiers["peer"], tiers

    # Two processes: differing values are refused by name (with or without a target),
    # a mapping function picks them, and values equal on every process need none.
    other = run("other_count", roots[:2], domains[:2], {"ckpt": ckpt}, worker=WORKER)
    for p, r in enumerate(other):
        res = r.result
        for key in ("refused", "refused_none"):
            error = res[key].get("error", "")
            assert error.startswith("ValueError"), (p, key, res[key])
            for name in LOCAL:
                assert f"['{name}']" in error, (name, error)
            assert "['same']" not in error and "per_process_fn" in error, error
        for key in ("mapped", "mapped_none"):
            leaves = res[key]["leaves"]
            for name in LOCAL:
                assert leaves[name]["values"] == [float(2 * p + 1)], (p, key, name, leaves[name])
            _check_common(leaves)
        assert res["calls"] == sorted([f"['{n}']" for n in LOCAL] * 2), res["calls"]
        for key in ("equal", "equal_none"):
            leaves = res[key]["leaves"]
            for name in LOCAL:
                assert leaves[name]["values"] == [7.0], (p, key, name, leaves[name])
            _check_common(leaves)
