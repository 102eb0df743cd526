"""A zone lost at once in a real job whose failure domains are paths (zone/rack/host).

6 JAX processes in 2 zones of 3 hosts; with one replica every copy is placed in the
other zone (`_placement.place_replicas`), so losing a whole zone leaves a copy of
every part. The simulation of the same at 24 processes is
tests/test_correlated_failures.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
from multiproc import run
from test_multiprocess import restores

from jaxckpt import cli

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

DOMAINS = [
    "zone-a/rack-1/host-0",
    "zone-a/rack-1/host-1",
    "zone-a/rack-2/host-2",
    "zone-b/rack-3/host-3",
    "zone-b/rack-3/host-4",
    "zone-b/rack-4/host-5",
]


def test_a_lost_zone_restores_from_the_other_and_ls_shows_each_hosts_path(tmp_path, capsys):
    roots = [str(tmp_path / "hosts" / f"p{i}") for i in range(len(DOMAINS))]
    common = {"ckpt": str(tmp_path / "ckpt"), "replicas": 1}
    args = {**common, "steps": [1, 2, 3], "persist_every": 2}
    assert all(r.result["steps"] == [1, 2, 3] for r in run("save", roots, DOMAINS, args))

    # Each memory root shows its host's whole path, and holds one other part, of the
    # other zone.
    flags = [x for r in roots for x in ("--memory-root", r)]
    assert cli.main(["ls", common["ckpt"], *flags, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for i, root in enumerate(report["memory_roots"]):
        assert root["domain"] == DOMAINS[i], root
        held = root["steps"]["3"]
        assert held["own"] == [i] and len(held["replica"]) == 1, held
        zone = DOMAINS[i].split("/")[0]
        assert not DOMAINS[held["replica"][0]].startswith(zone + "/"), (i, held)

    # Zone a lost (every root of its three hosts): its parts come from zone b's peers.
    for p in range(3):
        shutil.rmtree(roots[p])
    (three,) = restores(run("restore", roots, DOMAINS, {**common, "restores": [{"step": 3}]}))
    assert all(r["bad"] == [] and "persistent" not in r["bytes_by_tier"] for r in three), three
    assert [r["tier"] for r in three] == ["peer"] * 3 + ["memory"] * 3, three
