"""`jaxckpt bench --reshard`: the directions a restore changes the layout in, what a
process needs of a target, the saved values, and the figures.

A direction saves a state of float32 leaves in one layout and restores it onto
another: a finer or a coarser mesh, another process count, another axis order,
replicated <-> sharded. What a process *needs* is the bytes of the distinct regions
its devices hold in the target sharding (`needed_regions`); what it *read* is the sum
of the restore metrics' `bytes_by_tier`. Nothing here measures: `_reshard_phases`
does, in the worker processes, and `_reshard_cli` starts them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from jaxckpt.bench._figure import Figure
from jaxckpt.tools import _table

LEAVES: Final = 4
COLUMNS: Final = 1024
ROW_MULTIPLE: Final = 64  # rows divide every mesh of the directions below
# Bytes read / bytes needed, on every tier (issue 39).
BYTES_TARGET: Final = "<= 1.1"

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Layout:
    """A sharding over the first `devices` devices: a mesh of `mesh_shape` named `axes`,
    the leaves partitioned by `spec` (a PartitionSpec's entries; () replicates)."""

    devices: int
    mesh_shape: tuple[int, ...]
    axes: tuple[str, ...]
    spec: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if math.prod(self.mesh_shape) != self.devices or len(self.axes) != len(self.mesh_shape):
            raise ValueError(
                f"Layout: mesh_shape {self.mesh_shape} with axes {self.axes} does not hold "
                f"{self.devices} devices."
            )

    def sharding(self, devices: Sequence[Any]) -> Any:
        """The NamedSharding over `devices` (the first `self.devices` of them)."""
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if len(devices) < self.devices:
            raise ValueError(f"Layout needs {self.devices} devices, got {len(devices)}.")
        grid = np.array(list(devices)[: self.devices]).reshape(self.mesh_shape)
        return NamedSharding(Mesh(grid, self.axes), PartitionSpec(*self.spec))

    def describe(self) -> str:
        """`P('x', 'y') on 2x4` or `P() on 8`."""
        spec = ", ".join(repr(s) for s in self.spec)
        return f"P({spec}) on {'x'.join(map(str, self.mesh_shape))}"


def _rows(n: int) -> Layout:
    return Layout(n, (n,), ("x",), ("x", None))


@dataclasses.dataclass(frozen=True)
class Direction:
    """One change of layout: saved by `save_processes` in `save`, restored by
    `restore_processes` onto `target` (the devices split evenly among the processes)."""

    name: str
    what: str
    save: Layout
    target: Layout
    save_processes: int = 1
    restore_processes: int = 1
    # A multi-process direction: the saving job's nodes lost before the restoring job
    # starts (their memory roots removed), and the nodes the restoring job runs on
    # (a lost one named again starts with an empty memory root: a replacement node).
    lost: tuple[str, ...] = ()
    restart_nodes: tuple[str, ...] = ()

    @property
    def multiprocess(self) -> bool:
        return self.save_processes > 1 or self.restore_processes > 1

    def devices_per_process(self, saving: bool) -> int:
        """Devices each process of the saving (or restoring) job starts with; one process
        starts with every device any one-process direction's mesh uses."""
        if not self.multiprocess:
            return ONE_PROCESS_DEVICES
        if saving:
            return self.save.devices // self.save_processes
        return self.target.devices // self.restore_processes

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers it is restored from: the memory tiers (own, and peers' with several
        processes; "peer" after a node loss), then the persistent tier once every memory
        tier lost the step."""
        return ("peer" if self.lost else "memory", "persistent")


ONE_PROCESS_DEVICES: Final = 64
DIRECTIONS: Final = (
    # The saving mesh itself: what a restore costs where no layout changes (the baseline
    # of the others; tiles assembled into whole-chunk shards cost a copy here).
    Direction("same_2", "the same mesh, 2 -> 2 shards", _rows(2), _rows(2)),
    Direction("finer_2_8", "finer mesh, 2 -> 8 shards", _rows(2), _rows(8)),
    Direction("finer_8_64", "finer mesh, 8 -> 64 shards", _rows(8), _rows(64)),
    Direction("coarser_8_2", "coarser mesh, 8 -> 2 shards", _rows(8), _rows(2)),
    Direction(
        "axis_order",
        "axis order, P('x','y') -> P('y','x')",
        Layout(8, (2, 4), ("x", "y"), ("x", "y")),
        Layout(8, (2, 4), ("x", "y"), ("y", "x")),
    ),
    Direction(
        "replicated_to_sharded",
        "replicated -> sharded (8)",
        Layout(8, (8,), ("x",), ()),
        _rows(8),
    ),
    Direction(
        "sharded_to_replicated",
        "sharded (8) -> replicated",
        _rows(8),
        Layout(8, (8,), ("x",), ()),
    ),
    # Two devices a process, as hosts of one kind: fewer hosts hold fewer shards.
    Direction(
        "procs_4_2",
        "4 -> 2 processes (8 -> 4 shards)",
        _rows(8),
        _rows(4),
        4,
        2,
        lost=("node1", "node3"),
        restart_nodes=("node0", "node2"),
    ),
    Direction(
        "procs_2_4",
        "2 -> 4 processes (4 -> 8 shards)",
        _rows(4),
        _rows(8),
        2,
        4,
        lost=("node0",),
        restart_nodes=("node0", "node1", "node2", "node3"),
    ),
    # Another axis sharded across processes: each process needs half of every saved
    # chunk (the one-process directions need every byte of the state in that process).
    Direction(
        "rows_to_columns",
        "P('x', None) -> P(None, 'x'), 2 processes",
        _rows(4),
        Layout(4, (4,), ("x",), (None, "x")),
        2,
        2,
        restart_nodes=("node0", "node1"),
    ),
)
BY_NAME: Final = {d.name: d for d in DIRECTIONS}
# The two timing targets: from own memory, 2 -> 8 shards, against the floor; the
# cold restore onto a 4x finer mesh from the persistent tier, against Orbax's.
FLOOR_TARGETS: Final = {("finer_2_8", "memory"): "<= 2"}
ORBAX_TARGETS: Final = {("finer_2_8", "persistent"): "<= 0.5"}


def rows_for(state_mib: float) -> int:
    """Rows of each of the `LEAVES` (rows, `COLUMNS`) float32 leaves for `state_mib` MiB."""
    rows = int(state_mib * 2**20 / 4 / COLUMNS / LEAVES)
    return max(ROW_MULTIPLE, rows - rows % ROW_MULTIPLE)


def values(leaf: int, region: Region) -> np.ndarray:
    """The saved values of `leaf` in `region` (a function of the global index only, so
    any process can check any shard it restored)."""
    (r0, r1), (c0, c1) = region
    rows = np.arange(r0, r1, dtype=np.int64)[:, None]
    cols = np.arange(c0, c1, dtype=np.int64)[None, :]
    # Exact in float32 (< 2**24) and different in every element of a leaf's row block.
    return ((rows * COLUMNS + cols) * 7 + leaf * 1_000_003) % (1 << 24)


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """A device's index (slices, None for whole) as (start, stop) per dimension."""
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop)
        for s, dim in zip(index, shape, strict=True)
    )


def needed_regions(shape: tuple[int, ...], sharding: Any) -> list[Region]:
    """The distinct regions this process's devices hold of an array of `shape` in
    `sharding` (from its `addressable_devices_indices_map`), in a fixed order."""
    indices = sharding.addressable_devices_indices_map(shape).values()
    return sorted({region_of(tuple(index), shape) for index in indices})


def region_bytes(region: Region, itemsize: int = 4) -> int:
    return math.prod(b - a for a, b in region) * itemsize


def needed_bytes(shape: tuple[int, ...], sharding: Any, itemsize: int = 4) -> int:
    """The bytes this process needs of an array of `shape` restored onto `sharding`."""
    return sum(region_bytes(r, itemsize) for r in needed_regions(shape, sharding))


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def figures(results: Sequence[dict[str, Any]]) -> list[Figure]:
    """Three figures per direction and tier, each the worst process's: bytes read against
    bytes needed, the restore against the floor, and against Orbax's restore."""
    out = []
    for d in DIRECTIONS:
        procs = [r for r in results if r["direction"] == d.name]
        if not procs:
            continue
        for tier in d.tiers:
            ident = f"r.{d.name}.{tier}"
            worst = max(procs, key=functools.partial(_overread, tier=tier))
            out.append(
                Figure(
                    f"{ident}.bytes",
                    f"{d.what}, {tier}: bytes read (busiest process)",
                    float(_read(worst, tier)),
                    "B",
                    float(worst["needed_bytes"]),
                    "bytes its devices need (distinct target regions)",
                    BYTES_TARGET,
                )
            )
            seconds = max(_median(p["tiers"][tier]["seconds"]) or 0.0 for p in procs)
            out.append(
                Figure(
                    f"{ident}.floor",
                    f"{d.what}, {tier}: restore",
                    seconds,
                    "s",
                    max(_median(p["tiers"][tier]["floor_s"]) or 0.0 for p in procs),
                    "floor: needed bytes read from the same tier + CRC-32C + device_put",
                    FLOOR_TARGETS.get((d.name, tier)),
                )
            )
            out.append(
                Figure(
                    f"{ident}.orbax",
                    f"{d.what}, {tier}: restore",
                    seconds,
                    "s",
                    max(_median(p["orbax"]["seconds"]) or 0.0 for p in procs),
                    "Orbax StandardRestore onto the same target (cold)",
                    ORBAX_TARGETS.get((d.name, tier)),
                )
            )
    return out


def _overread(p: dict[str, Any], tier: str) -> float:
    """A process's bytes read from `tier` over the bytes it needs."""
    return _read(p, tier) / max(1, p["needed_bytes"])


def _read(p: dict[str, Any], tier: str) -> int:
    """The bytes a process's restores from `tier` read (the most of its repeats)."""
    return max(sum(b.values()) for b in p["tiers"][tier]["bytes_by_tier"])


def per_process_table(results: Sequence[dict[str, Any]]) -> str:
    """Every process's restores: bytes read / needed, where from, seconds, floor, Orbax."""
    rows = []
    for r in results:
        orbax = _median(r["orbax"]["seconds"])
        for tier, t in r["tiers"].items():
            seconds, floor = _median(t["seconds"]), _median(t["floor_s"])
            read = _read(r, tier)
            sources = {k: v for b in t["bytes_by_tier"] for k, v in b.items()}
            rows.append(
                (
                    r["direction"],
                    r["process"],
                    tier,
                    _table.size(read),
                    _table.size(r["needed_bytes"]),
                    f"{read / max(1, r['needed_bytes']):.2f}",
                    "+".join(sorted(sources)) or "-",
                    _disk(t, r["orbax"]) if tier == "persistent" else "-",
                    _table.duration(seconds),
                    _table.duration(floor),
                    f"{seconds / floor:.2f}" if seconds and floor else "-",
                    f"{seconds / orbax:.2f}" if seconds and orbax else "-",
                    "yes" if t["verified"] and r["orbax"]["verified"] else "NO",
                )
            )
    headers = (
        "direction",
        "process",
        "tier",
        "read",
        "needed",
        "read/needed",
        "from",
        "disk read (Orbax's)",
        "restore",
        "floor",
        "/floor",
        "/Orbax",
        "verified",
    )
    return _table.table(headers, rows, right=(1, 3, 4, 5, 7, 8, 9, 10, 11))


def _disk(ours: dict[str, Any], orbax: dict[str, Any]) -> str:
    """The bytes a process's cold restores read from the disk (median), and Orbax's:
    what its page cache did not serve (`device_bytes`)."""

    def median(t: dict[str, Any]) -> str:
        got = [b for b in t.get("device_bytes", ()) if b is not None]
        return _table.size(statistics.median(got)) if got else "?"

    return f"{median(ours)} ({median(orbax)})"
