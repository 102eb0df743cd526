"""Tiles: a chunk cut along every dimension, each tile checksummed and read alone.

Pure tile arithmetic, the slab's tile-major layout, and tiled steps restored onto
other meshes from memory and from persistent storage, a damaged tile falling back
alone. (Bytes read over bytes needed where a process needs part of a chunk:
tests/test_reshard_multiprocess.py.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_tree_equal, manager, restore, save
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import _checksum, _format, _tiles
from jaxckpt.memory import _slab
from jaxckpt.persistent import _zarr_reader

# ---- pure arithmetic ------------------------------------------------------------------


def test_a_chunk_under_two_tiles_stays_whole():
    assert _tiles.tile_shape_for((128, 256), 4, 128 << 10) is None
    assert _tiles.tile_shape_for((7,), 4, 1) is None  # odd: cannot be split evenly


def test_tiles_split_every_dimension_up_to_eight_ways_largest_first():
    # 32 MiB of float32 and tiles of at least 256 KiB: both axes split 8 ways.
    assert _tiles.tile_shape_for((2048, 4096), 4, 256 << 10) == (256, 512)
    # Larger tiles: the wider axis is split first, then the other.
    assert _tiles.tile_shape_for((2048, 4096), 4, 4 << 20) == (1024, 1024)
    # A typed key's data dimension (the last here) is never split.
    assert _tiles.tile_shape_for((4096, 2), 4, 1, splittable=1) == (512, 2)
    # An extent that stops being even stops being split.
    assert _tiles.tile_shape_for((6, 1 << 20), 1, 1) == (3, 1 << 17)


def _record(shape, chunk, tile, dtype="float32"):
    return _format.LeafRecord(
        "['w']",
        _format.ARRAY,
        shape=shape,
        dtype=dtype,
        stored_shape=shape,
        stored_dtype=dtype,
        chunk_shape=chunk,
        tile_shape=tile,
    )


def test_the_tiles_of_a_chunk_cover_it_once_in_byte_order():
    record = _record((100, 60), (50, 60), (16, 32))
    chunk = _format.ChunkRecord((1, 0), 50 * 60 * 4, offset=0, tiles=tuple(range(8)))
    tiles = _tiles.tiles(record, chunk)
    covered = np.zeros((100, 60), int)
    offset = 0
    for t in tiles:
        covered[t.region] += 1
        assert t.offset == offset and t.nbytes == 4 * np.prod(t.shape)
        offset += t.nbytes
    assert offset == chunk.nbytes
    assert (covered[50:] == 1).all() and (covered[:50] == 0).all()
    # Tiles at the chunk's end are cut short: 50 rows = 16 + 16 + 16 + 2.
    assert [t.shape for t in tiles[-2:]] == [(2, 32), (2, 28)]
    assert _tiles.overlapping(tiles, (slice(60, 70), slice(0, 10))) == [tiles[0], tiles[2]]


def test_a_chunk_whose_tile_checksums_do_not_fit_its_grid_is_refused():
    record = _record((64, 64), (64, 64), (32, 32))
    chunk = _format.ChunkRecord((0, 0), 64 * 64 * 4, offset=0, tiles=(1, 2, 3))
    with pytest.raises(ValueError, match=r"\['w'\] records 3 tile checksums.*makes 4"):
        _tiles.tiles(record, chunk)


def test_chunk_and_leaf_records_round_trip_their_tiles():
    record = _record((64, 64), (64, 64), (32, 32))
    chunk = _format.ChunkRecord((0, 0), 16384, offset=64, tiles=(1, 2, 3, 4))
    assert _format.LeafRecord.from_dict(record.to_dict()) == record
    assert _format.ChunkRecord.from_dict(chunk.to_dict()) == chunk


# ---- the slab ----------------------------------------------------------------------------


@pytest.mark.parametrize("reuse", [False, True], ids=["new-file", "reused-slab"])
def test_a_slab_holds_each_tile_whole_one_after_the_other(tmp_path, reuse):
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal((40, 64)).astype(np.float32), np.arange(9, dtype=np.int64)]
    regions = [_tiles.regions_in_chunk((40, 64), (16, 32)), None]
    path = tmp_path / "slab"
    if reuse:
        path.write_bytes(b"\xff" * 65536)
    offsets, size = _slab.layout([c.nbytes for c in chunks])
    crcs = _slab.write(path, chunks, offsets, size, tiles=regions)
    raw = path.read_bytes()
    tiles = [chunks[0][r] for r in regions[0]]
    expected = b"".join(t.tobytes() for t in tiles)
    assert raw[offsets[0] : offsets[0] + len(expected)] == expected
    assert crcs == [
        [_checksum.crc32c(np.ascontiguousarray(t)) for t in tiles],
        [_checksum.crc32c(chunks[1])],
    ]
    # Filled without checksums (the CPU path), checksummed in place: the same ones.
    assert _slab.write(path, chunks, offsets, size, checksum=False, tiles=regions) == []
    sizes = [[t.nbytes for t in tiles], None]
    assert _slab.checksums(path, offsets, [c.nbytes for c in chunks], tiles=sizes) == crcs
    _slab.forget_all()


# ---- restores onto other meshes: bytes read over bytes needed -----------------------------

TILE_BYTES = 4096
ROWS, COLS = 256, 256  # float32: 256 KiB; on 2 shards, 128 KiB chunks of 32x32 tiles


def _mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


# (saved on, restored onto): mesh shape, axis names, spec.
DIRECTIONS = {
    "finer-2-to-8": (((2,), ("x",), P("x")), ((8,), ("x",), P("x"))),
    "coarser-8-to-2": (((8,), ("x",), P("x")), ((2,), ("x",), P("x"))),
    "rows-to-columns": (((2,), ("x",), P("x")), ((8,), ("x",), P(None, "x"))),
    "axis-order": (((2, 4), ("x", "y"), P("x", "y")), ((2, 4), ("x", "y"), P("y", "x"))),
    "replicated-to-sharded": (((8,), ("x",), P()), ((8,), ("x",), P("x", None))),
    "sharded-to-replicated": (((2,), ("x",), P("x")), ((8,), ("x",), P())),
}


def _weights(mesh_spec):
    shape, names, spec = mesh_spec
    values = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return jax.device_put(values, NamedSharding(_mesh(shape, names), spec))


def _target(mesh_spec):
    shape, names, spec = mesh_spec
    return jax.ShapeDtypeStruct(
        (ROWS, COLS), np.float32, sharding=_mesh_sharding(shape, names, spec)
    )


def _tiled_handler(memory_root: str) -> jaxckpt.TieredCheckpointHandler:
    return jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=1, tile_bytes=TILE_BYTES)
    )


def _save_persisted(mngr, h, state) -> None:
    """Saves `state` as step 1 and waits until it is in memory and persisted."""
    save(mngr, 1, state)
    mngr.wait_until_finished()
    h.wait_for_persistence()


def _mesh_sharding(shape, names, spec):
    return NamedSharding(_mesh(shape, names), spec)


@pytest.mark.parametrize("tier", ["memory", "persistent"])
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_a_tiled_step_restores_onto_another_mesh_reading_each_tile_once(tmp_path, direction, tier):
    saved_on, onto = DIRECTIONS[direction]
    memory_root = str(tmp_path / "memory")
    state = {"w": _weights(saved_on)}
    h = _tiled_handler(memory_root)
    with manager(tmp_path / "ckpt", h) as mngr:
        _save_persisted(mngr, h, state)
        if tier == "persistent":
            shutil.rmtree(memory_root)
        restored = restore(mngr, 1, {"w": _target(onto)})
        metrics = h.last_restore_metrics
    assert_tree_equal(restored, state)
    assert restored["w"].sharding.is_equivalent_to(_target(onto).sharding, 2)
    assert set(metrics["bytes_by_tier"]) == {tier}
    # One process needs every byte: each tile read once reads exactly that. (What a
    # process reads of a chunk it needs a part of: tests/test_reshard_multiprocess.py.)
    assert sum(metrics["bytes_by_tier"].values()) == metrics["bytes_needed"] == ROWS * COLS * 4


def _memory_part(memory_root: str, step: int) -> Path:
    (manifest,) = [
        p
        for p in Path(memory_root).glob(f"**/part_00000/{_format.MANIFEST_FILE}")
        if ".staging" not in p.parts and f"{step}" in p.parent.parent.name
    ]
    return manifest.parent


def test_a_damaged_tile_falls_back_alone(tmp_path):
    """One flipped byte in one tile of a memory copy: that tile alone is read from the
    persistent tier, every other byte still from memory."""
    saved_on, _ = DIRECTIONS["finer-2-to-8"]
    memory_root = str(tmp_path / "memory")
    state = {"w": _weights(saved_on)}
    h = _tiled_handler(memory_root)
    with manager(tmp_path / "ckpt", h) as mngr:
        _save_persisted(mngr, h, state)
        part = _memory_part(memory_root, 1)
        manifest = _format.PartManifest.from_json((part / _format.MANIFEST_FILE).read_text())
        record = manifest.leaves[0]
        chunk = manifest.chunks[0][1]
        tile = _tiles.tiles(record, chunk)[5]
        assert chunk.offset is not None
        with open(part / _slab.SLAB_FILE, "r+b") as f:
            f.seek(chunk.offset + tile.offset + 7)
            byte = f.read(1)[0]
            f.seek(chunk.offset + tile.offset + 7)
            f.write(bytes([byte ^ 0x10]))
        restored = restore(mngr, 1, {"w": _target(saved_on)})
        metrics = h.last_restore_metrics
    assert_tree_equal(restored, state)
    assert metrics["fallbacks"] == 1
    assert metrics["bytes_by_tier"] == {
        "persistent": tile.nbytes,
        "memory": ROWS * COLS * 4 - tile.nbytes,
    }


def test_the_persistent_copy_keeps_tiles_as_checksummed_inner_chunks(tmp_path):
    saved_on, _ = DIRECTIONS["finer-2-to-8"]
    h = _tiled_handler(str(tmp_path / "memory"))
    with manager(tmp_path / "ckpt", h) as mngr:
        _save_persisted(mngr, h, {"w": _weights(saved_on)})
    meta = json.loads((tmp_path / "ckpt/1/train/part_00000/arrays/w/zarr.json").read_text())
    (codec,) = meta["codecs"]
    assert codec["name"] == "sharding_indexed"
    assert codec["configuration"]["chunk_shape"] == [32, 32]
    assert [c["name"] for c in codec["configuration"]["codecs"]] == ["bytes", "crc32c"]


def _run_plan(values: np.ndarray, tile: int):
    """A one-part plan of a 1-D leaf saved as one chunk of tiles of `tile` elements, and
    the chunk's bytes as a slab holds them."""
    from test_format import manifest

    from jaxckpt.coord import _plan

    n = values.size
    leaf = dataclasses.replace(
        manifest(0).leaves[0], shape=(n,), stored_shape=(n,), chunk_shape=(n,), tile_shape=(tile,)
    )
    crcs = tuple(_checksum.crc32c(values[k : k + tile]) for k in range(0, n, tile))
    chunk = _format.ChunkRecord((0,), values.nbytes, offset=0, tiles=crcs)
    index = {0: dataclasses.replace(manifest(0), leaves=(leaf,), chunks={0: (chunk,)})}
    return _plan.plan_step(5, index, me=0, held={0: {0}}, persisted=set())


class _ViewsOf:
    """A reader of tiles from one buffer: views of it (in place), or copies."""

    def __init__(self, data: np.ndarray, copies: bool):
        self.data, self.copies = data, copies

    def read(self, leaf, record, chunk, tile, timeout_s):
        view = self.data.view(np.uint8)[tile.offset : tile.offset + tile.nbytes]
        view = view.view(np.float32).reshape(tile.shape)
        return view.copy() if self.copies else view


@pytest.mark.parametrize("copies", [False, True], ids=["in-place", "copies"])
def test_a_region_that_is_a_run_of_tiles_is_a_view_of_them_where_read_in_place(copies):
    """Tiles that split the first dimension only lie one after the other: a region made
    of several is a view of where they were read (a mapped slab), without a copy; read
    into copies, it is assembled from them."""
    from jaxckpt.restore import _chunk_reads

    values = np.arange(64, dtype=np.float32)
    reader = _ViewsOf(values, copies)
    reads = _chunk_reads.ChunkReads(_run_plan(values, 8), lambda source, owner: reader, 0)
    first, tail = reads.read_regions(0, [(slice(0, 32),), (slice(40, 64),)])
    np.testing.assert_array_equal(first, values[:32])
    np.testing.assert_array_equal(tail, values[40:])
    assert np.shares_memory(first, values) is not copies
    assert np.shares_memory(tail, values) is not copies
    # A region across part of a tile is copied out whatever the reader gives.
    (part,) = reads.read_regions(0, [(slice(4, 20),)])
    np.testing.assert_array_equal(part, values[4:20])
    assert not np.shares_memory(part, values)


# ---- the persistent tier: tiles read as the bytes their files hold ------------------------


def _persisted_only(tmp_path, state, **options):
    """Saves `state` (tiled, persisted) as step 1 and drops it from memory: the handler,
    and the part's array directory of leaf 'w'."""
    memory_root = str(tmp_path / "memory")
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=1, tile_bytes=TILE_BYTES, **options)
    )
    with manager(tmp_path / "ckpt", h) as mngr:
        _save_persisted(mngr, h, state)
    shutil.rmtree(memory_root)
    return h, tmp_path / "ckpt/1/train/part_00000/arrays/w"


def _shard(array_dir: Path, index=(0, 0)) -> tuple[Path, np.ndarray]:
    """A chunk's shard file and its index: (offset, nbytes) of each inner chunk (tile)."""
    path = array_dir.joinpath("c", *map(str, index))
    meta = json.loads((array_dir / "zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    n = int(np.prod([c // i for c, i in zip(chunk, inner, strict=True)]))
    return path, np.frombuffer(path.read_bytes()[: 16 * n], "<u8").reshape(n, 2)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _restore_persisted(tmp_path, h, onto):
    with manager(tmp_path / "ckpt", h) as mngr:
        return restore(mngr, 1, {"w": _target(onto)}), h.last_restore_metrics


@pytest.mark.parametrize("where", ["values", "stored-crc"])
def test_a_damaged_persisted_tile_is_refused_by_name(tmp_path, where):
    """A tile read as the bytes its shard holds is checked against the manifest: a
    flipped byte in its values, or in the CRC-32C zarr3 keeps after them, is refused
    and named (no other copy: the restore fails)."""
    saved_on, onto = DIRECTIONS["finer-2-to-8"]
    _, array_dir = _persisted_only(tmp_path, {"w": _weights(saved_on)})
    path, index = _shard(array_dir)
    offset, nbytes = (int(x) for x in index[5])
    _flip(path, offset + (7 if where == "values" else nbytes - 2))
    with pytest.raises(FileNotFoundError, match=r"tile 5 of chunk \(0, 0\) of \['w'\]"):
        _restore_persisted(tmp_path, _tiled_handler(str(tmp_path / "memory")), onto)


def test_a_damaged_shard_index_is_refused_by_name(tmp_path):
    saved_on, onto = DIRECTIONS["finer-2-to-8"]
    _, array_dir = _persisted_only(tmp_path, {"w": _weights(saved_on)})
    path, _ = _shard(array_dir, (1, 0))
    _flip(path, 3)
    with pytest.raises(FileNotFoundError, match=r"chunk \(1, 0\) of \['w'\].*shard index"):
        _restore_persisted(tmp_path, _tiled_handler(str(tmp_path / "memory")), onto)


def test_tiles_of_the_fill_value_that_zarr3_does_not_store_restore(tmp_path):
    """zarr3 stores no inner chunk (and no shard) that is all fill value: such tiles
    restore as zeros, checked like any other."""
    saved_on, onto = DIRECTIONS["finer-2-to-8"]
    values = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    values[:40, :] = 0  # tile (0, 0) of chunk (0, 0) and more
    values[ROWS // 2 :] = 0  # all of chunk (1, 0): no shard at all
    state = {"w": jax.device_put(values, _mesh_sharding(*saved_on))}
    h, array_dir = _persisted_only(tmp_path, state)
    _, index = _shard(array_dir)
    assert int(index[0][0]) == 2**64 - 1  # not stored
    assert not array_dir.joinpath("c", "1", "0").exists()
    restored, metrics = _restore_persisted(tmp_path, h, onto)
    assert_tree_equal(restored, state)
    assert metrics["fallbacks"] == 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_tiles_cut_short_or_compressed_are_read_through_tensorstore(tmp_path, compression):
    """Tiles cut short at the array's end (zarr3 stores them whole, filled out, as a
    shard of a chunk that ends there) and compressed ones are decoded by tensorstore;
    the others are read as bytes. Either way every tile has the values saved and the
    manifest's checksum."""
    import asyncio

    from jaxckpt.memory import _readers
    from jaxckpt.persistent import _storage, _zarr

    record = dataclasses.replace(_record((100, 60), (64, 60), (32, 30)), array_key="w")
    values = np.arange(100 * 60, dtype=np.float32).reshape(100, 60)
    chunks, pieces = [], []
    for index, rows in [((0, 0), 64), ((1, 0), 36)]:  # 36 rows: tiles of 32 and 4
        bare = _format.ChunkRecord(index, rows * 60 * 4, offset=0, tiles=(0,) * 4)
        tiles = _tiles.tiles(record, bare)
        crcs = tuple(_checksum.crc32c(values[t.region]) for t in tiles)
        chunks.append(dataclasses.replace(bare, tiles=crcs))
        pieces += [(t.region, values[t.region]) for t in tiles]
    part = _storage.kvstore(tmp_path / "part")
    kvstore = _zarr.array_kvstore(part, record)
    asyncio.run(_zarr.write_chunks(kvstore, record, pieces, compression, crc32c=True))
    reader = _zarr_reader.ZarrReader(part)
    for chunk in chunks:
        got = _readers.read_chunk(reader, 0, record, chunk, 10.0)  # every tile checked
        np.testing.assert_array_equal(got, values[64 * chunk.index[0] :][:64])
    layout = _zarr.raw_layout(_zarr.open_array(kvstore, record).result(), record)
    if compression is None:
        assert layout == _zarr.RawLayout((32, 30), (2, 2), 4, layout.fill)
    else:
        assert layout is None


# ---- the slab's mapping after a restore ----------------------------------------------------


def _mapped(path: Path) -> bool:
    """Whether this process maps the file at `path` (its /proc/self/maps)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("tile_bytes", [TILE_BYTES, None], ids=["copied", "kept-in-place"])
def test_a_restore_lets_go_of_the_slab_it_no_longer_uses(tmp_path, tile_bytes):
    """A restore from memory maps its slab; the mapping is let go (off the restore's
    path) once the restore is done with it, unless its arrays keep views of it: then it
    stays, and their values with it, until they are freed."""
    import gc
    import time

    memory_root = str(tmp_path / "memory")
    saved_on, onto = DIRECTIONS["finer-2-to-8"]
    if tile_bytes is None:
        onto = saved_on  # chunks saved whole, onto the saving mesh: each shard a view
    state = {"w": _weights(saved_on)}
    h = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=10**6, tile_bytes=tile_bytes)
    )
    with manager(tmp_path / "ckpt", h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        slab = _memory_part(memory_root, 1) / _slab.SLAB_FILE
        _slab.forget_all()  # the save's own mapping
        restored = restore(mngr, 1, {"w": _target(onto)})

        def let_go(deadline_s: float = 30.0) -> bool:
            end = time.monotonic() + deadline_s
            while _mapped(slab) and time.monotonic() < end:
                time.sleep(0.05)
            return not _mapped(slab)

        if tile_bytes is None:
            time.sleep(0.2)  # the unmapper has had its chance
            assert _mapped(slab)
            assert_tree_equal(restored, state)
            del restored
            gc.collect()
        else:
            assert_tree_equal(restored, state)
        assert let_go(), f"{slab} is still mapped"
