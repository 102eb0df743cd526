"""Test hosts in their own network namespaces: one address each, joined by a bridge.

`Hosts(n)` makes n namespaces `<id>h<i>`, each with a veth whose other end is on
a bridge in a hub namespace `<id>hub`, so nothing of it touches this machine's
own network: the addresses (10.213.0.0/24, host i at 10.213.0.(10 + i)) exist
only there. `<id>` is new for every run, so a leftover of a crashed run never
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

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def reason() -> str | None:
    """Why test hosts in network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
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
        _ip("-n", self.hub, "link", "add", "name", "bridge0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "dev", "bridge0", "up")
        for i, ns in enumerate(self.names):
            # Both ends are made in the hub, then one end moves into the host.
            _ip(
                "-n",
                self.hub,
                "link",
                "add",
                "name",
                self._hub_end(i),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
            )
            _ip("-n", self.hub, "link", "set", "dev", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", "dev", self._hub_end(i), "master", "bridge0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "dev", "eth0", "up")

    def _hub_end(self, i: int) -> str:
        return f"host{i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def shape(self, i: int, *qdisc: str) -> None:
        """Puts a root qdisc (`"netem", "delay", "20ms"`) on host i's interface."""
        subprocess.run(
            [*self.prefix(i), "tc", "qdisc", "replace", "dev", "eth0", "root", *qdisc],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )

    def partition(self, i: int, cut: bool = True) -> None:
        """Cuts host i off from every other host (its end on the bridge goes down), or
        heals it."""
        _ip("-n", self.hub, "link", "set", "dev", self._hub_end(i), "down" if cut else "up")

    def cut(self, i: int, j: int, cut: bool = True) -> None:
        """Drops every packet between hosts i and j (both still reach the others), or
        heals it: each sends to the other's address at a MAC address nobody has."""
        for a, b in ((i, j), (j, i)):
            if cut:
                _ip("-n", self.names[a], "neigh", "replace", self.addresses[b], "lladdr",
                    "02:00:00:00:00:01", "nud", "permanent", "dev", "eth0")  # fmt: skip
            else:
                _ip("-n", self.names[a], "neigh", "del", self.addresses[b], "dev", "eth0")

    def close(self) -> None:
        """Deletes every namespace made (their veths, the bridge and qdiscs go with them)."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
