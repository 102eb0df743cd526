"""Three test hosts, each in its own network namespace with its own address.

Multi-host here is otherwise loopback on one network stack. These hosts meet
over a bridge (tests/support/netns.py): the jax.distributed coordinator listens on
host 0's address and every peer service on its host's, and the test cuts the
data link of one host (the peer services' network; the coordinator and the
collectives have their own) while the others push a save's replicas to it and
while they read a restore from it. Skipped with the reason where namespaces cannot be
made (not root, no iproute2); the `tc netem` test also where the kernel has no
netem. See tests/workers/mp_netns.py for the worker.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import netns
import portpicker
import pytest
from multiproc import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TIMEOUT_S = 8.0  # TierOptions.timeout_s: a stalled peer is given up after half of it
HOSTS = 3  # replicas=1 on a ring: 0's copy on 1, 1's on 2, 2's on 0
TIMEOUT = 120  # seconds on a quiet machine for one launch

_WHY = netns.reason()
needs_namespaces = pytest.mark.skipif(_WHY is not None, reason=f"no test hosts: {_WHY}")


class Conductor(threading.Thread):
    """Starts each phase once every worker reached it, after changing the network as the
    phase asks (`actions[name](hosts)`)."""

    def __init__(self, sync: Path, hosts: netns.Hosts, phases: list[str], actions: dict):
        super().__init__(daemon=True)
        self.sync, self.hosts, self.phases, self.actions = sync, hosts, phases, actions
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for name in [*self.phases, "end"]:
                while not all((self.sync / f"{name}.{p}").exists() for p in range(HOSTS)):
                    if self.stop.wait(0.02):
                        return
                if name in self.actions:
                    self.actions[name](self.hosts)
                (self.sync / f"{name}.go").touch()
        except BaseException as e:  # reported by the test
            self.error = e


def launch(tmp_path: Path, hosts: netns.Hosts, phases: list, actions: dict) -> list[dict]:
    sync = tmp_path / "sync"
    sync.mkdir()
    roots = [str(tmp_path / "hosts" / f"node{i}") for i in range(HOSTS)]
    coordinator = f"{hosts.addresses[0]}:{portpicker.pick_unused_port()}"
    env = {
        i: {"MP_COORDINATOR": coordinator, "MP_PEER_HOST": hosts.data_addresses[i]}
        for i in range(HOSTS)
    }
    args = {
        "ckpt": str(tmp_path / "ckpt"),
        "sync": str(sync),
        "timeout_s": TIMEOUT_S,
        "persist_every": 1,
        "phases": phases,
    }
    conductor = Conductor(sync, hosts, [name for name, _ in phases], actions)
    conductor.start()
    try:
        results = run(
            "network",
            roots,
            [f"node{i}" for i in range(HOSTS)],
            args,
            env=env,
            worker="mp_netns.py",
            prefix={i: hosts.prefix(i) for i in range(HOSTS)},
            timeout=TIMEOUT,
        )
    finally:
        conductor.stop.set()
        conductor.join(5)
    assert conductor.error is None, conductor.error
    return [r.result for r in results]


def ok(result: dict, phase: str) -> dict:
    entry = result[phase]
    assert "error" not in entry, (phase, entry)
    return entry


@needs_namespaces
def test_a_partitioned_host_during_a_push_and_during_a_restore(tmp_path):
    phases = [
        ("save_1", 1),
        ("restore_from_peer", 1),
        ("save_2_partitioned", 2),
        ("save_3", 3),
        ("restore_0_partitioned", 3),
        ("save_4", 4),
    ]
    actions = {
        "save_2_partitioned": lambda h: h.partition(2),  # 1 pushes to 2, 2 to 0
        "save_3": lambda h: h.partition(2, cut=False),
        "restore_0_partitioned": lambda h: h.partition(0),  # 2 reads its part from 0
        "save_4": lambda h: h.partition(0, cut=False),
    }
    with netns.Hosts(HOSTS) as hosts:
        results = launch(tmp_path, hosts, phases, actions)

    for p, r in enumerate(results):
        # Every host met the others at its own addresses, over the bridges.
        assert r["peer_host"] == hosts.data_addresses[p], r
        assert r["addresses"] == hosts.data_addresses, r
        assert r["holders"] == [[1], [2], [0]][p], r["holders"]
        assert ok(r, "save_1")["skipped"] == [], r
        restored = ok(r, "restore_from_peer")
        assert restored["dropped"] == 1 and restored["value"] == {"bad": [], "tier": "peer"}, r

        # Host 2's data link is down while 1 pushes to it and it pushes to 0: those copies
        # are skipped, the save succeeds on every process, none waits past the timeout.
        saved = ok(r, "save_2_partitioned")
        assert saved["skipped"] == {1: [2], 2: [0]}.get(p, []), (p, saved)
        assert saved["seconds"] < TIMEOUT_S, (p, saved)
        assert ok(r, "save_3")["skipped"] == [], r

        # Host 0's data link is down during the restore: 2 cannot read its part from 0, nor
        # 0 its own from 1; both fall back to persistent storage. Every value is right.
        restored = ok(r, "restore_0_partitioned")
        assert restored["value"]["bad"] == [], (p, restored)
        tier = "peer" if p == 1 else "persistent"
        assert restored["value"]["tier"] == tier, (p, restored)
        assert restored["seconds"] < TIMEOUT_S, (p, restored)
        assert ok(r, "save_4")["skipped"] == [], r


_NETEM = netns.netem_reason() if _WHY is None else _WHY


@pytest.mark.skipif(_NETEM is not None, reason=f"no tc netem: {_NETEM}")
def test_a_slow_lossy_network_still_saves_and_restores_from_peers(tmp_path):
    def shape(h: netns.Hosts) -> None:
        for i in range(HOSTS):
            h.shape(i, "netem", "delay", "20ms", "loss", "1%")

    phases = [("save_1", 1), ("restore_from_peer", 1)]
    with netns.Hosts(HOSTS) as hosts:
        started = time.monotonic()
        results = launch(tmp_path, hosts, phases, {"save_1": shape})
    for r in results:
        assert ok(r, "save_1")["skipped"] == [], r
        assert ok(r, "restore_from_peer")["value"] == {"bad": [], "tier": "peer"}, r
    assert time.monotonic() - started < 120
