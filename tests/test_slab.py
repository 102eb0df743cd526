"""Slabs: layout, writing (fresh and reused), checksums, bounded reads. No jax needed."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jaxckpt.format import _checksum
from jaxckpt.memory import _slab


def test_layout_aligns_every_chunk():
    offsets, size = _slab.layout([1, 64, 65, 0, 3])
    assert offsets == [0, 64, 128, 256, 256]
    assert size == 320
    assert all(o % _slab.ALIGN == 0 for o in offsets)


@pytest.mark.parametrize("reuse", [False, True])
def test_write_then_read_back(tmp_path, reuse):
    rng = np.random.default_rng(0)
    chunks = [
        rng.standard_normal((5, 7)).astype(np.float32),
        np.arange(10, dtype=np.int64)[::2],  # not contiguous
        np.zeros((0,), np.float32),
        rng.integers(0, 255, 3, dtype=np.uint8),
    ]
    path = tmp_path / "slab"
    if reuse:  # a retired slab, larger than needed and full of old bytes
        path.write_bytes(b"\xff" * 8192)
    offsets, size = _slab.layout([c.nbytes for c in chunks])
    crcs = _slab.write(path, chunks, offsets, size)
    assert path.stat().st_size == size
    assert crcs == [[_checksum.crc32c(c)] for c in chunks]
    reader = _slab.Reader(path)
    for c, o in zip(chunks, offsets, strict=True):
        view = reader.view(o, c.nbytes)
        np.testing.assert_array_equal(view.view(c.dtype).reshape(c.shape), c)


def test_crc32c_is_the_castagnoli_checksum():
    assert _checksum.crc32c(b"123456789") == 0xE3069283
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert _checksum.crc32c(data.T) == _checksum.crc32c(np.ascontiguousarray(data.T))
    assert _checksum.matches(_checksum.crc32c(data), None, data)
    assert _checksum.matches(None, _checksum.crc32(data), data)  # format v1-2 records
    assert not _checksum.matches(None, None, data)


def test_a_range_outside_the_slab_is_refused(tmp_path):
    path = tmp_path / "slab"
    path.write_bytes(b"x" * 100)
    reader = _slab.Reader(path)
    with pytest.raises(ValueError, match=r"outside the slab .* truncated"):
        reader.view(64, 64)
    assert reader.view(100, 0).nbytes == 0


def test_a_full_tier_fails_cleanly_on_a_reused_slab(tmp_path, monkeypatch):
    """A reused slab's pages are allocated before any copy: ENOSPC, not SIGBUS."""
    path = tmp_path / "slab"
    path.write_bytes(b"\0" * 64)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        _slab.write(path, [np.ones(1 << 20, np.uint8)], [0], 1 << 20)  # grows past its pages


def test_batches_cover_every_chunk_once_in_order():
    sizes = [10] * 1000 + [100 << 20, 5, 7]
    runs = _slab._batches(sizes)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    assert len(runs) <= _slab._WORKERS + 2  # no task per small chunk
    assert _slab._batches([]) == []


def _kept_inodes() -> set[int]:
    return {ino for _, ino in _slab._KEPT}


def test_a_copy_without_checksums_then_checksums_in_place(tmp_path):
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal(1000), np.arange(7, dtype=np.int16), np.zeros(0, np.uint8)]
    offsets, size = _slab.layout([c.nbytes for c in chunks])
    path = tmp_path / "slab"
    for _ in range(2):  # a new file (written), then the same one again (mapped)
        assert _slab.write(path, chunks, offsets, size, checksum=False) == []
        got = _slab.checksums(path, offsets, [c.nbytes for c in chunks])
        assert got == [[_checksum.crc32c(c)] for c in chunks]
    # A damaged byte changes the checksum computed in place.
    with open(path, "r+b") as f:
        f.seek(offsets[1])
        f.write(b"\x00\x01")
    assert _slab.checksums(path, offsets, [c.nbytes for c in chunks])[1] != [
        _checksum.crc32c(chunks[1])
    ]
    _slab.forget_all()


def test_a_refilled_slab_keeps_its_mapping_until_it_is_unlinked(tmp_path):
    """A slab refilled by the next saves is mapped once; moved by rename it is the
    same file; once unlinked its mapping goes (its pages with it)."""
    _slab.forget_all()
    path = tmp_path / "slab"
    path.write_bytes(b"\x00" * 4096)  # a retired slab, reused
    ino = path.stat().st_ino
    data = [np.arange(512, dtype=np.float32)]
    offsets, size = _slab.layout([data[0].nbytes])
    _slab.write(path, data, offsets, size)
    kept = _slab._KEPT[(path.stat().st_dev, ino)].mapping
    moved = tmp_path / "free-slab"
    path.rename(moved)  # retired, then taken by the next save
    data = [np.arange(512, dtype=np.float32) + 1]
    assert _slab.write(moved, data, offsets, size) == [[_checksum.crc32c(data[0])]]
    assert _slab._KEPT[(moved.stat().st_dev, ino)].mapping is kept  # no new mapping
    np.testing.assert_array_equal(
        _slab.Reader(moved).view(0, data[0].nbytes).view(np.float32), data[0]
    )
    # Another size: mapped anew.
    bigger = [np.arange(2048, dtype=np.float32)]
    offsets, size = _slab.layout([bigger[0].nbytes])
    _slab.write(moved, bigger, offsets, size)
    assert _slab._KEPT[(moved.stat().st_dev, ino)].mapping is not kept
    moved.unlink()
    _slab.forget_unlinked()
    assert ino not in _kept_inodes()


def test_at_most_a_few_slabs_stay_mapped(tmp_path):
    _slab.forget_all()
    data = [np.ones(64, np.uint8)]
    offsets, size = _slab.layout([64])
    for i in range(_slab._MAX_KEPT + 3):
        path = tmp_path / f"slab{i}"
        path.write_bytes(b"\x00" * size)
        _slab.write(path, data, offsets, size)
    assert len(_slab._KEPT) == _slab._MAX_KEPT
    _slab.forget_all()
    assert not _slab._KEPT


def test_a_view_outlives_its_forgotten_mapping(tmp_path):
    """A mapping forgotten while a copy uses it (another handler closed, or more than
    `_MAX_KEPT` kept) stays mapped until the copy's view is gone."""
    path = tmp_path / "slab"
    path.write_bytes(b"\x00" * 4096)
    with open(path, "r+b") as f:
        view = _slab.kept_view(f.fileno(), 4096)
    _slab.forget_all()
    assert not _slab._KEPT
    view[:4] = [1, 2, 3, 4]  # still mapped, shared with the file
    assert path.read_bytes()[:4] == b"\x01\x02\x03\x04"
