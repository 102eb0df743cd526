"""Who snapshots which slice of a replicated shard, the replica-aware placement, and how a
restore's replicas share their read (pure)."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.coord import _placement, _read_layout, _replicas
from jaxckpt.coord._placement import place_replicas
from jaxckpt.format import _chunking

MIB = 1 << 20


def _mesh_regions(
    shape: tuple[int, ...],
    spec: tuple[str | None, ...],
    axes: dict[str, int],
    process_of: dict[tuple[int, ...], int],
) -> dict[_replicas.RegionKey, list[int]]:
    """Each shard's region -> its holders, for a NamedSharding-like layout: `axes` in mesh
    order, `spec[d]` the axis dimension d is sharded over, `process_of[mesh position]`."""
    names = list(axes)
    out: dict[_replicas.RegionKey, list[int]] = {}
    for pos in itertools.product(*(range(axes[a]) for a in names)):
        region = []
        for d, n in enumerate(shape):
            axis = spec[d] if d < len(spec) else None
            if axis is None:
                region.append((0, n))
            else:
                size = n // axes[axis]
                i = pos[names.index(axis)]
                region.append((i * size, (i + 1) * size))
        out.setdefault(tuple(region), []).append(process_of[pos])
    return out


def _hsdp(dp: int, fsdp: int, devices_per_process: int) -> dict[tuple[int, ...], int]:
    """Mesh ('dp', 'fsdp'): each process holds `devices_per_process` consecutive fsdp devices
    of one dp row (dp across processes, as in HSDP)."""
    return {(r, f): (r * fsdp + f) // devices_per_process for r in range(dp) for f in range(fsdp)}


def _check_covers_once(split: _replicas.Split, shape: tuple[int, ...]) -> dict[int, int]:
    """Every chunk of the grid is saved by exactly one process; bytes per process."""
    grid = [max(1, -(-n // c)) for n, c in zip(shape, split.chunk_shape, strict=True)]
    seen: dict[tuple[int, ...], int] = {}
    for p, chunks in split.chunks.items():
        for c in chunks:
            assert c not in seen, f"chunk {c} saved by {seen[c]} and {p}"
            seen[c] = p
    if math.prod(shape):
        assert sorted(seen) == sorted(itertools.product(*(range(g) for g in grid)))
    out: dict[int, int] = {}
    for c, p in seen.items():
        out[p] = out.get(p, 0) + math.prod(_chunking.chunk_shape_at(c, shape, split.chunk_shape))
    return out


def test_hsdp_2x4_each_process_saves_half_of_its_shards() -> None:
    shape = (8 * MIB // 4,)  # 8 MiB of float32, sharded over fsdp=4, dp=2
    regions = _mesh_regions(shape, ("fsdp",), {"dp": 2, "fsdp": 4}, _hsdp(2, 4, 2))
    split = _replicas.split_regions(shape, (shape[0] // 4,), regions, 4)
    assert split.replicas == 2 and split.cut == 0 and split.slices == 2
    elements = _check_covers_once(split, shape)
    assert sorted(elements) == [0, 1, 2, 3]
    assert set(elements.values()) == {shape[0] // 4}  # exactly even
    # Each process saves only chunks of the shards it holds.
    for p, chunks in split.chunks.items():
        held = {k for k, ps in regions.items() if p in ps}
        for c in chunks:
            region = _chunking.region_key(_chunking.chunk_region(c, shape, split.chunk_shape))
            assert any(
                all(a <= x and y <= b for (x, y), (a, b) in zip(region, k, strict=True))
                for k in held
            )


@pytest.mark.parametrize("dp,fsdp", [(2, 2), (2, 4), (4, 2), (4, 1)])
def test_even_over_every_process_in_dp_x_fsdp(dp: int, fsdp: int) -> None:
    shape = (64, 4096)  # 1 MiB float32 a leaf
    regions = _mesh_regions(shape, ("fsdp", None), {"dp": dp, "fsdp": fsdp}, _hsdp(dp, fsdp, 2))
    leaves = [
        _replicas.split_regions(shape, (64 // fsdp, 4096), regions, 4, leaf=i) for i in range(4)
    ]
    total: dict[int, int] = {}
    for split in leaves:
        for p, n in _check_covers_once(split, shape).items():
            total[p] = total.get(p, 0) + n
    processes = len(set(_hsdp(dp, fsdp, 2).values()))
    assert len(total) == processes and len(set(total.values())) == 1


def test_fully_replicated_leaf_is_split_over_every_process() -> None:
    shape = (1000, 300)
    regions = {((0, 1000), (0, 300)): [0, 0, 1, 1, 2, 2, 3, 3]}  # P(): every device
    split = _replicas.split_regions(shape, shape, regions, 4)
    assert split.replicas == 4 and (split.cut, split.slices) == (0, 4)
    assert split.chunk_shape == (250, 300)
    assert set(_check_covers_once(split, shape).values()) == {250 * 300}


def test_partly_replicated_leaf_with_replicas_inside_a_process_is_not_cut() -> None:
    # dp inside a process (its two devices), fsdp across processes: R = 1.
    shape = (4 * MIB,)
    process_of = {(r, f): f for r in range(2) for f in range(4)}
    regions = _mesh_regions(shape, ("fsdp",), {"dp": 2, "fsdp": 4}, process_of)
    split = _replicas.split_regions(shape, (MIB,), regions, 1)
    assert (split.replicas, split.cut, split.slices, split.chunk_shape) == (1, None, 1, (MIB,))
    assert {p: len(cs) for p, cs in split.chunks.items()} == {0: 1, 1: 1, 2: 1, 3: 1}


def test_unreplicated_leaf_keeps_its_grid_and_owners() -> None:
    shape = (4 * MIB,)
    regions = {((i * MIB, (i + 1) * MIB),): [i] for i in range(4)}
    split = _replicas.split_regions(shape, (MIB,), regions, 4)
    assert (split.replicas, split.cut, split.chunk_shape) == (1, None, (MIB,))
    assert split.chunks == {i: ((i,),) for i in range(4)}


def test_r_not_dividing_the_chunk_count_spreads_the_leftovers() -> None:
    shape = (3, 33333)  # no dimension divisible by 2: cut in 3 along dim 0
    regions = {((0, 3), (0, 33333)): [0, 1]}
    counts = {0: 0, 1: 0}
    for leaf in range(4):
        split = _replicas.split_regions(shape, shape, regions, 4, leaf=leaf)
        assert (split.cut, split.slices, split.chunk_shape) == (0, 3, (1, 33333))
        for p, chunks in split.chunks.items():
            counts[p] += len(chunks)
        _check_covers_once(split, shape)
    assert counts == {0: 6, 1: 6}  # 2 + 1 per leaf, the extra chunk rotating


def test_non_aligned_sizes_cut_a_dimension_r_divides() -> None:
    shape = (7, 40000)  # 7 rows: cut the columns instead
    split = _replicas.split_regions(shape, shape, {((0, 7), (0, 40000)): [0, 1]}, 4)
    assert (split.cut, split.slices, split.chunk_shape) == (1, 2, (7, 20000))
    assert set(_check_covers_once(split, shape).values()) == {7 * 20000}


def test_no_dimension_divisible_by_r() -> None:
    shape = (3, 1, 50005)  # R = 4, no dimension divisible by 4
    split = _replicas.split_regions(shape, shape, {((0, 3), (0, 1), (0, 50005)): [0, 1, 2, 3]}, 4)
    assert split.cut == 2 and split.slices == 5  # 50005 = 5 x 10001: 5 the smallest >= 4
    _check_covers_once(split, shape)
    rows = _replicas.choose_cut((3,), 4, 1 << 20)
    assert rows == (0, 3)  # three 1 MiB rows over 4 replicas: one each, one idle
    # Never chunks under MIN_CHUNK_BYTES: 3 x 24003 float32 cut in 3 rows, 3 x 12003 not.
    assert _replicas.choose_cut((3, 24003), 2, 4) == (0, 3)
    assert _replicas.choose_cut((3, 12003), 2, 4) == (None, 1)
    assert _replicas.choose_cut((3, 5), 4, 4) == (None, 1)


def test_zero_size_shards_rotate_and_small_shards_are_saved_by_every_holder() -> None:
    split = _replicas.split_regions((0, 8), (0, 8), {((0, 0), (0, 8)): [0, 1]}, 4)
    assert (split.cut, split.chunk_shape) == (None, (1, 8))
    assert sum(len(c) for c in split.chunks.values()) == 1
    owners = [
        next(iter(_replicas.split_regions((0, 8), (0, 8), {((0, 0), (0, 8)): [0, 1]}, 4, i).chunks))
        for i in range(4)
    ]
    assert owners == [0, 1, 0, 1]  # empty shards saved (a record only) by each replica in turn
    # Too small to cut: each holder saves it whole, into its own part.
    small = _replicas.split_regions((16,), (16,), {((0, 16),): [0, 1]}, 4, leaf=3)
    assert small.cut is None and small.chunks == {0: ((0,),), 1: ((0,),)}
    scalar = _replicas.split_regions((), (), {(): [0, 1, 2, 2]}, 4, leaf=5)
    assert scalar.chunk_shape == () and scalar.chunks == {p: ((),) for p in range(3)}
    # On a dp x fsdp mesh a small fsdp-sharded leaf: each shard saved by both its holders.
    bias = _replicas.split_regions(
        (16,), (4,), {((i * 4, i * 4 + 4),): [i % 2, i % 2 + 2] for i in range(4)}, 4
    )
    assert bias.chunks == {0: ((0,), (2,)), 2: ((0,), (2,)), 1: ((1,), (3,)), 3: ((1,), (3,))}
    # From R x MIN_CHUNK_BYTES on a shard is cut instead, each holder saving a share.
    assert not _replicas.every_holder_saves((2 * _replicas.MIN_CHUNK_BYTES // 4,), 2, 4)
    assert _replicas.every_holder_saves((2 * _replicas.MIN_CHUNK_BYTES // 4 - 1,), 2, 4)
    assert not _replicas.every_holder_saves((16,), 1, 4)  # one holder: as ever


def test_owned_slices_are_contiguous_runs() -> None:
    assert _replicas.owned_slices(4, 2, 0) == [range(0, 2), range(2, 4)]
    assert _replicas.owned_slices(3, 2, 1) == [range(0, 1), range(1, 3)]
    assert _replicas.owned_slices(1, 3, 0) == [range(0, 1), range(1, 1), range(1, 1)]


def test_split_of_a_real_sharding_in_one_process() -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    sharding = NamedSharding(mesh, P("fsdp"))
    split = _replicas.split_of(sharding, (1024,), (1024,), (256,), 4, 0)
    assert split.replicas == 1 and split.chunks == {0: ((0,), (1,), (2,), (3,))}
    key = NamedSharding(mesh, P())
    regions = _replicas.regions_of(key, (4,), (4, 2))  # typed keys: trailing data dims
    assert list(regions) == [((0, 4), (0, 2))] and regions[((0, 4), (0, 2))] == [0] * 8


def test_partners_group_processes_holding_the_same_shards() -> None:
    # HSDP 2 x 4 on 4 processes: 0 and 2 hold fsdp shards 0-1, 1 and 3 shards 2-3;
    # a fully replicated leaf held by all does not change the groups.
    hsdp = {0: "a", 1: "b", 2: "a", 3: "b"}
    everyone = dict.fromkeys(range(4), "all")
    assert _replicas.partners([hsdp, everyone], 4) == ((2,), (3,), (0,), (1,))
    # R = 4: each process's partners in ring order after it.
    assert _replicas.partners([dict.fromkeys(range(4), "x")], 4) == (
        (1, 2, 3),
        (2, 3, 0),
        (3, 0, 1),
        (0, 1, 2),
    )
    assert _replicas.partners([], 3) == ((), (), ())


def test_placement_prefers_partners_in_other_domains() -> None:
    domains = [f"host{p}" for p in range(4)]
    partners = _replicas.partners([{0: "a", 1: "b", 2: "a", 3: "b"}], 4)
    assert place_replicas(domains, 1, partners) == ((2,), (3,), (0,), (1,))
    two = place_replicas(domains, 2, partners)
    assert [h[0] for h in two] == [2, 3, 0, 1]  # the partner first, then today's choice
    assert all(len(set(h)) == 2 and p not in h for p, h in enumerate(two))
    # R = 4, replicas = 1: a ring over the replicas, one copy held by each.
    ring = place_replicas(domains, 1, _replicas.partners([dict.fromkeys(range(4), "x")], 4))
    assert ring == ((1,), (2,), (3,), (0,))


def test_placement_falls_back_where_partners_share_a_domain() -> None:
    domains = ["n0", "n0", "n1", "n1"]  # partners 0-1 and 2-3 share a host
    partners = ((1,), (0,), (3,), (2,))
    assert place_replicas(domains, 1, partners) == place_replicas(domains, 1)
    assert place_replicas(domains, 1, None) == place_replicas(domains, 1, ())


def test_partner_placement_is_the_same_under_another_hash_seed() -> None:
    # The placement module alone (it needs only the standard library), not the package:
    # three interpreters that import jax would take seconds each.
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('p', {str(_placement.__file__)!r});"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
        "assert 'jax' not in sys.modules;"
        "print(m.place_replicas(['a','b','c','a','b','c'], 2, [(3,),(4,),(5,),(0,),(1,),(2,)]))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1


def test_read_layout_needs_replicas_across_processes() -> None:
    # One process holds every device here: nothing to spread, the restore reads as before.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    assert _read_layout.read_layout(NamedSharding(mesh, P("fsdp")), (64, 8)) is None
    assert _read_layout.read_layout(NamedSharding(mesh, P()), (64, 8)) is None
    assert (
        _read_layout.read_layout(jax.sharding.SingleDeviceSharding(jax.devices()[0]), (8,)) is None
    )


def test_padded_read_layout_reads_each_chunk_once_and_unpads_to_the_stored_array() -> None:
    # 12 rows in 4 target shards of 3 (one saved chunk a row), read by 2 replicas: slots of
    # 2 rows, the second of each shard holding 1 row and 1 of padding.
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    layout = _read_layout.ReadLayout(NamedSharding(mesh, P()), (16, 5), 0, 4, 2, 3)
    stored = np.arange(60, dtype=np.float32).reshape(12, 5)
    padded = np.empty((16, 5), np.float32)
    read_rows: list[int] = []
    for slot in range(8):
        region = (slice(2 * slot, 2 * slot + 2), slice(0, 5))
        where = layout.stored_region(region)
        read_rows += range(where[0].start, where[0].stop)
        padded[region] = layout.pad(stored[where], region)
    assert read_rows == list(range(12))  # every row read once, in order
    np.testing.assert_array_equal(np.asarray(layout.unpad(jax.numpy.asarray(padded))), stored)
    # Unpadded (a dimension divides): the read array is the stored array.
    plain = _read_layout.ReadLayout(NamedSharding(mesh, P()), (12, 5))
    region = (slice(0, 6), slice(0, 5))
    assert plain.stored_region(region) == region and plain.unpad(stored) is stored


def _processes(dp: int, fsdp: int, per_process: int) -> np.ndarray:
    """The process of each device of a ('dp', 'fsdp') mesh of `dp` x `fsdp` devices,
    `per_process` consecutive devices a process (dp across processes, as in HSDP)."""
    return np.arange(dp * fsdp).reshape(dp, fsdp) // per_process


def _chunks_read(
    layout: _read_layout.ReadLayout | None,
    target: NamedSharding,
    processes: np.ndarray,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
) -> dict[tuple[int, ...], set[int]]:
    """Saved chunk -> the processes that read it, restoring onto `target` read as `layout`
    (None: the target's own regions)."""
    sharding = target if layout is None else layout.sharding
    read_shape = shape if layout is None else layout.shape
    flat = processes.reshape(-1)
    position = {dev.id: k for k, dev in enumerate(sharding.mesh.devices.reshape(-1))}
    out: dict[tuple[int, ...], set[int]] = {}
    for dev, index in sharding.devices_indices_map(read_shape).items():
        region = _chunking.normalize_region(index, read_shape)
        stored = region if layout is None else layout.stored_region(region)
        if not all(s.stop > s.start for s in stored):
            continue  # a slot of padding alone
        for chunk in _chunking.chunks_overlapping(stored, shape, chunk_shape):
            out.setdefault(tuple(chunk), set()).add(int(flat[position[dev.id]]))
    return out


# (shape, spec, saved (dp, fsdp, devices a process), target (dp, fsdp, devices a process)):
# saved on 4 processes x 2 devices, restored onto another dp/fsdp split, or fewer processes.
OTHER_SPLITS = [
    ((24, 8192), (None, "fsdp"), (2, 4, 2), (4, 2, 2)),  # parts of half a chunk
    ((12, 32768), ("fsdp",), (2, 4, 2), (4, 2, 2)),  # cut along columns, 12 rows undivisible
    ((64, 4096), ("fsdp",), (2, 4, 2), (4, 2, 2)),
    ((12, 24003), ("fsdp",), (2, 4, 2), (4, 2, 2)),  # no dimension divides: padded
    ((256, 1024), (), (2, 4, 2), (4, 2, 2)),  # fully replicated
    ((24, 8192), (None, "fsdp"), (2, 4, 2), (2, 2, 2)),  # onto 2 processes
    ((8, 3, 8192), (None, None, "fsdp"), (4, 2, 2), (2, 4, 2)),
    ((24, 8192), (None, "fsdp"), (1, 8, 2), (4, 2, 2)),  # unreplicated before
]


@pytest.mark.parametrize(("shape", "spec", "saved", "target"), OTHER_SPLITS)
def test_restore_from_persistent_reads_every_saved_chunk_once_onto_another_split(
    shape, spec, saved, target
) -> None:
    dp, fsdp, per = saved
    axes = {"dp": dp, "fsdp": fsdp}
    regions = _mesh_regions(shape, spec, axes, _hsdp(dp, fsdp, per))
    shard_shape = tuple(b - a for a, b in next(iter(regions)))
    split = _replicas.split_regions(shape, shard_shape, regions, 4)
    # (Not a small shard, saved whole by every holder: each holder reads its own copy.)
    assert not _replicas.every_holder_saves(shard_shape, split.replicas, 4)
    dp, fsdp, per = target
    mesh = Mesh(np.array(jax.devices()[: dp * fsdp]).reshape(dp, fsdp), ("dp", "fsdp"))
    sharding = NamedSharding(mesh, P(*spec))
    procs = _processes(dp, fsdp, per)
    layout = _read_layout.read_layout(sharding, shape, split.chunk_shape, True, procs)
    read = _chunks_read(layout, sharding, procs, shape, split.chunk_shape)
    grid = [-(-n // c) for n, c in zip(shape, split.chunk_shape, strict=True)]
    assert sorted(read) == sorted(itertools.product(*map(range, grid)))  # every chunk
    assert all(len(ps) == 1 for ps in read.values()), read  # by one process
    if layout is not None:  # read as laid out, resharded onto the target: the stored array
        stored = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)

        def part(index):
            region = _chunking.normalize_region(index, layout.shape)
            return layout.pad(stored[layout.stored_region(region)], region)

        read = jax.make_array_from_callback(layout.shape, layout.sharding, part)
        (whole,) = _read_layout.reshard([read], [sharding], [layout])
        assert whole.sharding == sharding
        np.testing.assert_array_equal(np.asarray(whole), stored)


def test_reads_from_memory_and_on_the_saved_split_keep_the_even_layout() -> None:
    # From memory or peers a chunk read twice costs less than a padded collective: the
    # even split stays, parts of half a chunk included.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "fsdp"))
    sharding = NamedSharding(mesh, P(None, "fsdp"))
    procs = _processes(4, 2, 2)
    memory = _read_layout.read_layout(sharding, (24, 8192), (12, 2048), False, procs)
    assert memory is not None and memory.shape == (24, 8192)
    read = _chunks_read(memory, sharding, procs, (24, 8192), (12, 2048))
    assert max(len(ps) for ps in read.values()) == 2  # what persistent reads avoid
    # Restored onto the split it was saved from, persistent or not, the layout is the same.
    for shape, spec, dp, fsdp in [
        ((64, 4096), ("fsdp",), 2, 4),
        ((24, 8192), (None, "fsdp"), 2, 4),
        ((256, 1024), (), 2, 4),
        ((16,), ("fsdp",), 2, 4),  # small shards: saved by every holder
        ((64, 4096), ("fsdp",), 4, 2),
    ]:
        procs = _processes(dp, fsdp, 2)
        regions = _mesh_regions(shape, spec, {"dp": dp, "fsdp": fsdp}, _hsdp(dp, fsdp, 2))
        shard_shape = tuple(b - a for a, b in next(iter(regions)))
        chunks = _replicas.split_regions(shape, shard_shape, regions, 4).chunk_shape
        mesh = Mesh(np.array(jax.devices()[: dp * fsdp]).reshape(dp, fsdp), ("dp", "fsdp"))
        sharding = NamedSharding(mesh, P(*spec))
        layouts = [
            _read_layout.read_layout(sharding, shape, chunks, w, procs) for w in (False, True)
        ]
        assert layouts[0] == layouts[1], (shape, spec, layouts)


def test_zero_size_arrays_have_no_read_layout() -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "fsdp"))
    procs = _processes(4, 2, 2)
    for shape in [(0, 8), (8, 0)]:
        sharding = NamedSharding(mesh, P(None, "fsdp"))
        assert _read_layout.read_layout(sharding, shape, (1, 4), True, procs) is None


@pytest.mark.parametrize("quick", [True, False])
def test_a_reshard_compiles_quickly_when_small_on_cpu_and_restores_the_same(
    quick, monkeypatch
) -> None:
    """A small reshard on CPU compiles without the backend's optimizations (it only moves
    data; its compilation is what costs); a large one, or one off CPU, with them. Either
    way the array comes out the same."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "fsdp"))
    sharding = NamedSharding(mesh, P(None, "fsdp"))
    limit = _read_layout.QUICK_COMPILE_BYTES
    assert _read_layout.compiles_quickly([sharding], limit)
    assert not _read_layout.compiles_quickly([sharding], limit + 1)
    if not quick:
        monkeypatch.setattr(_read_layout, "QUICK_COMPILE_BYTES", 0)
    stored = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    read = jax.device_put(stored, NamedSharding(mesh, P("dp", "fsdp")))
    assert _read_layout.compiles_quickly([sharding], read.nbytes) is quick
    (whole,) = _read_layout.reshard([read], [sharding])
    assert whole.sharding == sharding
    np.testing.assert_array_equal(np.asarray(whole), stored)
