"""Test hosts in their own network namespaces, joined by two bridges.

`Hosts(n)` makes n namespaces `<id>h<i>`, each with two veths whose other ends
are on two bridges in a hub namespace `<id>hub`, so nothing of it touches this
machine's own network: the addresses exist only there. Like a GPU cluster's
two fabrics, one network carries the job's control and collectives (the
jax.distributed coordinator, gloo; 10.213.0.0/24, host i at 10.213.0.(10 + i),
`eth0`, which is also the host's name) and the other the host network the peer
data service uses (10.213.1.0/24, `eth1`, `data_addresses`): a partition of a
host's data link leaves the job alive, as a partition of the collective fabric
would not (gloo and the coordinator's heartbeats would stop it). `<id>` is new for every run, so a leftover of a crashed run never
collides, and `close()` deletes every namespace (with its veths, bridge and
qdiscs) even after a failure. `reason()` says why namespaces cannot be made
here (not root, no `ip`, a kernel without them), `netem_reason()` why
`tc netem` cannot be used.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

SUBNET = "10.213.0"  # control: the coordinator and gloo
DATA_SUBNET = "10.213.1"  # the peer data service


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def reason() -> str | None:
    """Why test hosts in network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    try:
        with Hosts(1):
            pass
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        return f"cannot make a network namespace with a veth and a bridge: {detail}"
    return None


def netem_reason() -> str | None:
    """Why `tc qdisc ... netem` cannot be used here, or None."""
    if shutil.which("tc") is None:
        return "`tc` (iproute2) is not installed"
    with Hosts(1) as hosts:
        try:
            hosts.shape(0, "netem", "delay", "1ms")
        except subprocess.CalledProcessError as e:
            return f"tc netem is not available in this kernel: {e.stderr.strip()}"
    return None


class Hosts:
    """`n` test hosts on one bridge (see the module docstring)."""

    def __init__(self, n: int):
        self.n = n
        self.id = "jx" + secrets.token_hex(3)
        self.hub = f"{self.id}hub"
        self.names = [f"{self.id}h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(n)]
        self.data_addresses = [f"{DATA_SUBNET}.{10 + i}" for i in range(n)]
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        for ns in (self.hub, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
        for bridge in ("bridge0", "bridge1"):
            _ip("-n", self.hub, "link", "add", "name", bridge, "type", "bridge")
            _ip("-n", self.hub, "link", "set", "dev", bridge, "up")
        for i, ns in enumerate(self.names):
            nets = (
                ("eth0", "bridge0", self.addresses[i]),
                ("eth1", "bridge1", self.data_addresses[i]),
            )
            for dev, bridge, address in nets:
                # Both ends are made in the hub, then one end moves into the host.
                end = self._hub_end(i, dev)
                _ip("-n", self.hub, "link", "add", "name", end, "type", "veth", "peer", "name", dev)
                _ip("-n", self.hub, "link", "set", "dev", dev, "netns", ns)
                _ip("-n", self.hub, "link", "set", "dev", end, "master", bridge, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "dev", dev, "up")

    def _hub_end(self, i: int, dev: str) -> str:
        return f"h{i}{dev}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i, whose host name is then its
        address (gloo, JAX's CPU collectives, listens on what the host name resolves to)."""
        rename = 'hostname "$0" && exec "$@"'
        return [*self.exec(i), "unshare", "--uts", "--", "sh", "-c", rename, self.addresses[i]]

    def exec(self, i: int) -> list[str]:
        """The command prefix that runs a program in host i's namespace."""
        return ["ip", "netns", "exec", self.names[i]]

    def shape(self, i: int, *qdisc: str, dev: str = "eth1") -> None:
        """Puts a root qdisc (`"netem", "delay", "20ms"`) on host i's data interface."""
        subprocess.run(
            [*self.exec(i), "tc", "qdisc", "replace", "dev", dev, "root", *qdisc],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )

    def partition(self, i: int, cut: bool = True) -> None:
        """Cuts host i's data link (its end on the data bridge goes down), or heals it."""
        _ip("-n", self.hub, "link", "set", "dev", self._hub_end(i, "eth1"), "down" if cut else "up")
        if not cut:  # forget the neighbours that failed to answer meanwhile
            for ns in self.names:
                _ip("-n", ns, "neigh", "flush", "dev", "eth1")

    def close(self) -> None:
        """Deletes every namespace made (their veths, the bridge and qdiscs go with them)."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
