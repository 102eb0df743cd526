"""Landing slabs: a peer's chunks received into a spare slab, or into pages made ready
ahead of the transfer, and lent to the restored arrays (one process, a fake peer)."""

from __future__ import annotations

import itertools
import threading
import time
import types
from unittest import mock

import jax
import numpy as np
import pytest
from test_memory_tier import commit_step

from jaxckpt.format import _checksum, _format, _tiles
from jaxckpt.memory import _landing, _slab
from jaxckpt.memory._memory_tier import MemoryTier

SHAPE = (512, 1024)  # float32: 2 MiB a chunk


def _leaf() -> _format.LeafRecord:
    return _format.LeafRecord(
        "w",
        _format.ARRAY,
        shape=(4 * SHAPE[0], SHAPE[1]),
        dtype="float32",
        stored_shape=(4 * SHAPE[0], SHAPE[1]),
        stored_dtype="float32",
        chunk_shape=SHAPE,
    )


def _empty_leaf() -> _format.LeafRecord:
    return _format.LeafRecord(
        "empty",
        _format.ARRAY,
        shape=(0, 8),
        dtype="float32",
        stored_shape=(0, 8),
        stored_dtype="float32",
        chunk_shape=(1, 8),
    )


def _peer_part(seed: int = 0) -> tuple[list[np.ndarray], list[_format.ChunkRecord], bytes]:
    """Four chunks of one leaf, laid out as the owner's slab, and that slab's bytes."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(4)]
    offsets, size = _slab.layout([v.nbytes for v in values])
    slab = bytearray(size)
    for v, o in zip(values, offsets, strict=True):
        slab[o : o + v.nbytes] = v.tobytes()
    chunks = [
        _format.ChunkRecord((i, 0), v.nbytes, crc32c=_checksum.crc32c(v), offset=o)
        for i, (v, o) in enumerate(zip(values, offsets, strict=True))
    ]
    return values, chunks, bytes(slab)


def _fetcher(slab: bytes, calls: list | None = None):
    """A fake peer: fills `into` with bytes [offset, offset + len(into)) of its slab,
    1 MiB at a time, telling `progress` after each, as `fetch_range` does."""

    def fetch(offset: int, into: memoryview, timeout_s: float, progress=None) -> None:
        if calls is not None:
            calls.append((offset, len(into)))
        for start in range(0, len(into), 1 << 20):
            end = min(start + (1 << 20), len(into))
            into[start:end] = slab[offset + start : offset + end]
            if progress is not None:
                progress(end)

    return fetch


def _tier_with_spares(tmp_path, size: int, spare: str = "sparse") -> MemoryTier:
    """A tier whose step 1 slab is a spare: "sparse" (no page allocated), "filled"
    (every page exists), or "kept" (filled by this process through a mapping it
    keeps, as a save fills a reused slab)."""
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    for step in (1, 2):
        commit_step(tier, step, owner=0, size=size)
    if spare != "sparse":
        slab = tier.part_dir(1, 0) / _slab.SLAB_FILE
        junk = [np.full(size, 0xAB, np.uint8)]
        _slab.write(slab, junk, [0], size)  # an existing file: filled through a kept mapping
        if spare == "filled":
            _slab.forget_all()
    tier.retain(1, upto=2)  # step 1's slab becomes a spare
    return tier


def _whole(leaf, chunk):
    """A chunk saved whole, as the one tile a reader reads."""
    (tile,) = _tiles.tiles(leaf, chunk)
    return tile


def _spans(chunks):
    """The (offset, nbytes) of each chunk: what a landing reader receives ahead."""
    return [(c.offset, c.nbytes) for c in chunks]


def _spares(tier: MemoryTier) -> int:
    return sum(1 for _ in (tier.run_dir / ".free").iterdir())


def _restore(tier: MemoryTier, slab: bytes, chunks, order=None, prefetch=False) -> list[jax.Array]:
    """What a restore does with a peer's part: read every chunk (asked for, or all of
    them received ahead), put it on a device. Checks that JAX kept each chunk where
    it landed (no copy: the slab is lent), that each chunk was received once, and
    that a part received ahead took one request per stream, not one per chunk."""
    manifest = types.SimpleNamespace(chunks={0: tuple(chunks)}, owner=1, step=3)
    landing = _landing.landing_for(tier, manifest)
    assert landing is not None and landing.size == len(slab)
    calls: list[int] = []
    reader = _landing.LandingReader(
        _fetcher(slab, calls), landing, _spans(chunks) if prefetch else (), timeout_s=5.0
    )
    leaf, device = _leaf(), jax.devices()[0]
    read = {
        i: reader.read(0, leaf, chunks[i], _whole(leaf, chunks[i]), 5.0)
        for i in order or range(len(chunks))
    }
    arrays = [jax.device_put(read[i], device) for i in range(len(chunks))]
    jax.block_until_ready(arrays)
    for i, a in enumerate(arrays):
        assert a.addressable_data(0).unsafe_buffer_pointer() == read[i].ctypes.data
    reader.finish()
    received = sorted(calls)
    for (offset, nbytes), (after, _) in itertools.pairwise(received):
        assert offset + nbytes <= after  # no byte received twice
    for c in chunks:
        assert any(o <= c.offset and c.offset + c.nbytes <= o + n for o, n in received)
    if prefetch:
        assert len(received) <= _landing._STREAMS
    return arrays


@pytest.mark.parametrize("spare", ["sparse", "filled", "kept"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_spare_slab_receives_the_chunks_and_is_lent_not_reused(tmp_path, prefetch, spare):
    values, chunks, slab = _peer_part()
    tier = _tier_with_spares(tmp_path, len(slab), spare)
    assert _spares(tier) == 1
    arrays = _restore(tier, slab, chunks, prefetch=prefetch)
    assert _spares(tier) == 0  # the restore took the spare: its pages existed already
    for a, v in zip(arrays, values, strict=True):
        np.testing.assert_array_equal(np.asarray(a), v)  # bit-exact (float32 bytes)
    # The tier goes on: saves fill every slab it has (spares included), steps retire.
    # None of it may touch the pages the restored arrays live on.
    for step in (3, 4, 5):
        commit_step(tier, step, owner=0, size=len(slab))
        tier.retain(1, upto=step)
        for path in [*(tier.run_dir / ".free").iterdir(), *tier.run_dir.rglob("slab")]:
            with open(path, "r+b") as f:
                f.write(b"\xff" * len(slab))
    for a, v in zip(arrays, values, strict=True):
        assert np.asarray(a).tobytes() == v.tobytes()
    # No landing file is left in the tier.
    assert not list((tier.run_dir / ".staging").glob("landing-*"))


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_fresh_node_makes_pages_ready_while_receiving(tmp_path, prefetch):
    """No spare (a replacement node): the pages are made ready in offset order beside
    the receives; a chunk far ahead waits for its pages, then lands whole."""
    values, chunks, slab = _peer_part(seed=1)
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    arrays = _restore(tier, slab, chunks, order=[3, 0, 2, 1], prefetch=prefetch)
    for a, v in zip(arrays, values, strict=True):
        assert np.asarray(a).tobytes() == v.tobytes()


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_chunk_is_checked_as_it_arrives(tmp_path, prefetch):
    """The reader checks each chunk's CRC-32C (computed MiB by MiB as it lands): a
    damaged one is refused, so the restore falls back to another source."""
    values, chunks, slab = _peer_part(seed=3)
    damaged = bytearray(slab)
    damaged[chunks[1].offset + 12345] ^= 0x40
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    landing = _landing.LandingSlab(tier, len(slab))
    reader = _landing.LandingReader(
        _fetcher(bytes(damaged)), landing, _spans(chunks) if prefetch else (), timeout_s=5.0
    )
    assert reader.verifies_checksums
    try:
        assert (
            reader.read(0, _leaf(), chunks[0], _whole(_leaf(), chunks[0]), 5.0).tobytes()
            == values[0].tobytes()
        )
        with pytest.raises(ValueError, match=r"checksum mismatch of chunk \(1, 0\) of w"):
            reader.read(0, _leaf(), chunks[1], _whole(_leaf(), chunks[1]), 5.0)
    finally:
        reader.finish()


def test_pages_of_chunks_never_received_are_freed(tmp_path):
    """A restore onto another mesh reads some chunks of a part: the rest is given back."""
    values, chunks, slab = _peer_part(seed=2)
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    landing = _landing.LandingSlab(tier, len(slab))
    reader = _landing.LandingReader(_fetcher(slab), landing)
    got = reader.read(0, _leaf(), chunks[2], _whole(_leaf(), chunks[2]), 5.0)
    kept = jax.device_put(got, jax.devices()[0])
    reader.finish()
    assert np.asarray(kept).tobytes() == values[2].tobytes()
    offset = chunks[2].offset
    page = _landing._PAGE
    assert _landing._gaps([(offset, chunks[2].nbytes)], len(slab)) == [
        (0, offset // page * page),
        (-(-(offset + chunks[2].nbytes) // page) * page, len(slab) // page * page),
    ]
    assert _landing._gaps([(0, 10), (5, 20)], 3 * page) == [(page, 3 * page)]


def test_a_range_outside_the_slab_is_refused(tmp_path):
    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    landing = _landing.LandingSlab(tier, 4096)
    try:
        with pytest.raises(ValueError, match="outside the landing slab"):
            landing.view(4000, 200)
    finally:
        landing.finish()


def test_the_part_size_comes_from_its_chunk_records():
    chunks = {
        0: (_format.ChunkRecord((0,), 100, offset=0), _format.ChunkRecord((1,), 100, offset=128)),
        1: (_format.ChunkRecord((0,), 1, offset=256),),
    }
    assert _landing.part_bytes(types.SimpleNamespace(chunks=chunks)) == 320
    assert _landing.part_bytes(types.SimpleNamespace(chunks={})) == 0


def test_a_zero_size_chunk_at_the_offset_of_the_next_is_not_taken_for_it(tmp_path):
    """A zero-size chunk (an empty shard) is laid out at the offset of the chunk after it
    (`_slab.layout`): while that chunk is still on its way, the empty one has arrived at
    the same offset. A read of the real chunk waits for its own bytes, not the empty
    chunk's checksum (which failed it: "damaged on the way", the holder's copy whole)."""
    values, chunks, slab = _peer_part(seed=4)
    empty = _format.ChunkRecord((0, 0), 0, crc32c=_checksum.crc32c(b""), offset=chunks[1].offset)
    part = [chunks[0], empty, *chunks[1:]]
    first_piece, go_on = threading.Event(), threading.Event()
    fetch = _fetcher(slab)

    def slow(offset: int, into: memoryview, timeout_s: float, progress=None) -> None:
        def told(done: int) -> None:
            if progress is not None:
                progress(done)
            if offset + done > chunks[1].offset:  # chunk 0 and part of chunk 1 landed
                first_piece.set()
                assert go_on.wait(5.0)  # the rest waits for the reads below

        fetch(offset, into, timeout_s, told)

    tier = MemoryTier(str(tmp_path), "run-a")
    tier.prepare("ckpt", 0)
    landing = _landing.LandingSlab(tier, len(slab))
    # One stream: the empty chunk lands with the first byte of chunk 1 (after chunk 0).
    with mock.patch.object(_landing, "_STREAMS", 1):
        reader = _landing.LandingReader(slow, landing, _spans(part), timeout_s=5.0)
    leaves = [_leaf(), _empty_leaf(), _leaf(), _leaf(), _leaf()]
    try:
        assert first_piece.wait(5.0)
        got: dict[int, np.ndarray | BaseException] = {}

        def read(i: int) -> None:
            try:
                got[i] = reader.read(0, leaves[i], part[i], _whole(leaves[i], part[i]), 5.0)
            except BaseException as e:
                got[i] = e

        readers = [threading.Thread(target=read, args=(i,)) for i in (1, 2)]
        for t in readers:
            t.start()
        readers[0].join(5.0)  # the empty chunk: at once
        time.sleep(0.2)  # chunk 1's read, if it did not wait, has failed by now
        go_on.set()
        for t in readers:
            t.join(5.0)
    finally:
        go_on.set()
        reader.finish()
    assert isinstance(got[1], np.ndarray) and got[1].size == 0, got[1]
    assert isinstance(got[2], np.ndarray), got[2]
    assert got[2].tobytes() == values[1].tobytes()
