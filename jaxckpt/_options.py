"""`TierOptions`: how many copies to keep where, validated on construction."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import socket
from typing import Final

from jaxckpt.format import _tiles
from jaxckpt.persistent import _paths

PERSIST_COMPRESSIONS: Final = (None, "zstd", "gzip", "blosc")
# The longest `timeout_s`: a week. Every wait it bounds (threads, sockets, the
# coordination service) accepts it; a longer one would leave a job stuck on a dead
# peer for longer than any job runs unattended.
MAX_TIMEOUT_S: Final = 7 * 24 * 3600.0
# A host name (RFC 1123 labels) or, checked apart, an IP address.
_HOSTNAME_RE: Final = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


@dataclasses.dataclass(frozen=True)
class TierOptions:
    """Options of `TieredCheckpointHandler`.

    Attributes:
      memory_root: directory of this host's memory tier; use a tmpfs (for example
        `/dev/shm/jaxckpt`) so that a snapshot survives the training process.
        Each run gets a sub-directory named after its run id.
      replicas: how many other processes, each in a failure domain other than
        the owner's, hold a copy of every chunk a process owns.
      persist_every: a step is written to the CheckpointManager's directory
        when `step % persist_every == 0`, or when its save asks for it
        (`TieredSave(state, persist=True)`); other steps live only in memory tiers.
      failure_domain: this process's failure domain (a host, a rack), or a path
        of them, widest first (`"zone-a/rack-3/host-17"`): copies then go
        outside the owner's host always, and outside its zone, else its rack,
        where `replicas` and balance allow; defaults to the
        `JAXCKPT_FAILURE_DOMAIN` environment variable, else the hostname.
      memory_keep: how many of the newest finalized steps each memory tier
        keeps; older ones are deleted once a newer step is finalized by the
        CheckpointManager (a step still waiting to be persisted is kept until it
        is), so a crash at any moment leaves a finalized step in memory.
      persist_compression: zarr3 codec for persisted chunks (`None`, "zstd",
        "gzip" or "blosc"); memory tiers are always uncompressed.
      run_id: names this run's data in memory tiers; defaults to a hash of the
        CheckpointManager's directory (its real path, so any spelling of it
        finds the same tier), so a restarted job finds its snapshots and
        another job never reads them. Restore reads the run id recorded in the
        step's index instead. 1-255 ASCII letters, digits, '-', '_', '.',
        starting with a letter or digit.
      timeout_s: the longest any wait on another process, a peer or a
        background queue may take before it fails with an error; finite, at
        most a week (`MAX_TIMEOUT_S`).
      peer_host: interface the peer data service binds to and advertises (an
        IP address or a host name).
      pinned_host_staging: copy device shards to host through the devices'
        `pinned_host` memory (one batched `device_put`; JAX reuses the pinned
        pool, so after the first save it runs at DMA speed, and the host sees
        the result without another copy). `None` (default): on accelerators
        that have a `pinned_host` memory; on CPU a shard already is host memory
        (see `hold_cpu_arrays`).
      hold_cpu_arrays: on CPU, hold the saved arrays' buffers as they are (no
        copy) until the memory tier has their bytes, instead of copying them
        into the step's slab before `save()` returns (the checksums are computed
        in the background either way). Holding makes `save()` return at once
        but keeps the next train step from reusing those buffers if it donates
        them: that step then writes into fresh memory (page faults, and up to one more copy of
        the state in RSS). Hold when the train step does not donate its state;
        the default copies, at memory speed into pages the tier already has.
      spare_slabs: keep the slabs of retired steps (at most a step's worth) for
        the next saves and received replicas to refill: their pages exist, so
        the copy runs at memory speed. The tier then holds about one step more
        than `memory_keep` at rest (during a save it holds that anyway). False
        frees them at once: `memory_keep` steps at rest, and each save writes
        fresh tmpfs pages (2-3x slower to safe in memory).
      memory_budget: bytes of host memory this host's memory tier may hold at rest:
        the kept steps (own parts and the replicas held for peers) plus the spare
        slabs. None (default): no cap, a spare for every part of the newest step.
        With a budget, a retired slab stays a spare only while it fits beside the
        kept steps and the spares already kept, and the tier logs what it chose
        (once per change; a warning when the budget leaves a part without a
        spare). It decides the spares only: `memory_keep` steps are always kept,
        and during a save the tier holds one step more whatever the budget. A
        budget of (memory_keep + 1) x (1 + replicas) x each process's bytes keeps
        every spare.
      count_nonfinite: count the NaN and Inf values of every floating leaf in the
        pass the save already makes over every byte (off the training thread),
        record them in the step's manifests and save metrics, and log a warning
        for a step that has any; `latest_restorable_step(..., finite=True)` then
        skips such steps. On by default (its cost is a figure of the benchmark).
      relay_group: how many processes of one rack (the failure domain without
        its last level, or the whole domain when it has one level) share one
        relay for the exchanges after the peers' set-up: each posts its value to
        the group's leader over the peer data service, and only the leaders
        call the jax.distributed coordinator, whose one queue serves every call
        of the job. None (default): about sqrt(N / 20) for N processes, at most
        32, which balances the coordinator's calls (two a group at ~50 us)
        against a leader's (two a member at ~1 ms): none below 80 processes.
        1 turns relays off. Process 0's value decides for the job.
      tile_bytes: the smallest tile a saved chunk is cut into: a large chunk is cut
        along every dimension (into up to 8 pieces each, while tiles stay at least
        this big), each tile with its own checksum, so that a restore onto another
        mesh reads and verifies only the tiles its shards need, from every tier.
        None saves every chunk whole: a restore onto the saving mesh then keeps the
        memory tier's pages without a copy (on CPU; `jaxckpt bench --reshard`'s
        `same_2`, 64 MiB from memory: 11.3 ms against 17.8 ms tiled, whose shards are
        assembled from their tiles with one copy), and a restore onto a finer mesh reads whole chunks. Smaller tiles read
        less onto much finer meshes and cost more bookkeeping per byte.
    """

    memory_root: str
    replicas: int = 0
    persist_every: int = 100
    failure_domain: str | None = None
    memory_keep: int = 1
    persist_compression: str | None = None
    run_id: str | None = None
    timeout_s: float = 120.0
    peer_host: str = "127.0.0.1"
    pinned_host_staging: bool | None = None
    hold_cpu_arrays: bool = False
    spare_slabs: bool = True
    memory_budget: int | None = None
    count_nonfinite: bool = True
    relay_group: int | None = None
    tile_bytes: int | None = _tiles.DEFAULT_TILE_BYTES

    def __post_init__(self) -> None:
        # Every field is checked here, so that a bad value fails on this line, naming
        # the field, and never later in the first save (e.g. `int(inf)` there).
        root = self.memory_root
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str) or not root or "\0" in root:
            raise ValueError(
                "TierOptions.memory_root must be a non-empty path (a str or os.PathLike naming "
                f"a directory, such as /dev/shm/jaxckpt), got {self.memory_root!r}."
            )
        object.__setattr__(self, "memory_root", root)
        _check_int("replicas", self.replicas, minimum=0)
        _check_int("persist_every", self.persist_every, minimum=1)
        _check_int("memory_keep", self.memory_keep, minimum=1)
        compression = self.persist_compression
        if compression is not None and (
            not isinstance(compression, str) or compression not in PERSIST_COMPRESSIONS
        ):
            raise ValueError(
                f"TierOptions.persist_compression must be one of {PERSIST_COMPRESSIONS}, "
                f"got {self.persist_compression!r}."
            )
        timeout = self.timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT_S
        ):
            raise ValueError(
                "TierOptions.timeout_s must be a positive, finite number of seconds, at most "
                f"{MAX_TIMEOUT_S:.0f} (a week), got {timeout!r}."
            )
        if self.run_id is not None and not _paths.is_valid_run_id(self.run_id):
            raise ValueError(
                "TierOptions.run_id may only hold 1-255 ASCII letters, digits, '-', '_' and "
                "'.', starting with a letter or digit (it names a directory: '.' or '..' "
                f"would name the memory root or its parent), got {self.run_id!r}."
            )
        if self.pinned_host_staging is not None and not isinstance(self.pinned_host_staging, bool):
            raise ValueError(
                "TierOptions.pinned_host_staging must be None (automatic), True or False, "
                f"got {self.pinned_host_staging!r}."
            )
        for name in ("hold_cpu_arrays", "spare_slabs", "count_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TierOptions.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.memory_budget is not None:
            _check_int("memory_budget", self.memory_budget, minimum=1)
            if not self.spare_slabs:
                raise ValueError(
                    "TierOptions.memory_budget decides how many spare slabs to keep, but "
                    "spare_slabs=False keeps none: set one or the other, got memory_budget="
                    f"{self.memory_budget!r} with spare_slabs=False."
                )
        if self.relay_group is not None:
            _check_int("relay_group", self.relay_group, minimum=1)
        if self.tile_bytes is not None:
            _check_int("tile_bytes", self.tile_bytes, minimum=1)
        domain = self.failure_domain
        if domain is not None and (not isinstance(domain, str) or not domain.strip()):
            raise ValueError(
                "TierOptions.failure_domain must be None (the JAXCKPT_FAILURE_DOMAIN "
                "environment variable, else the hostname) or a non-empty str naming a host or "
                f"rack, got {domain!r}."
            )
        if domain is not None and "" in domain.split("/"):
            raise ValueError(
                "TierOptions.failure_domain is a path of levels, widest first, split on '/' "
                "(such as 'zone-a/rack-3/host-17'), so no level may be empty (no leading, "
                f"trailing or doubled '/'), got {domain!r}."
            )
        if not _is_host(self.peer_host):
            raise ValueError(
                "TierOptions.peer_host must be an IP address or a host name of this host's "
                f"network interface (such as 127.0.0.1 or 10.0.0.5), got {self.peer_host!r}."
            )

    @property
    def resolved_failure_domain(self) -> str:
        """The failure domain this process is in."""
        return (
            self.failure_domain or os.environ.get("JAXCKPT_FAILURE_DOMAIN") or socket.gethostname()
        )


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TierOptions.{name} must be an integer >= {minimum}, got {value!r}.")


def _is_host(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return _HOSTNAME_RE.fullmatch(value) is not None
