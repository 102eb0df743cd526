"""Slabs: layout, writing (fresh and reused), checksums, bounded reads. No jax needed."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jaxckpt import _checksum, _slab


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
    assert crcs == [_checksum.crc32c(c) for c in chunks]
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
