"""The floor of a restore onto another layout: the bytes a process needs, read once from
the same tier, checksummed and put onto the target sharding.

Before the clock starts, each distinct target region this process needs is written,
contiguous, into one file in the tier's directory (the memory tier's tmpfs, or the
persistent tier's filesystem). What is timed is what no restore can skip: the needed
bytes read (from tmpfs: mapped, as a restore from memory maps its slab; from the
persistent tier: read into host memory, from a cold page cache), the CRC-32C of every
region, and one `device_put` per target device, assembled into the target's arrays.
A floor from a peer adds the needed bytes sent over loopback TCP (`ring_transfer`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxckpt.bench import _baselines, _reshard
from jaxckpt.format import _checksum
from jaxckpt.memory import _slab


class Floor:
    """The needed regions of `leaves` (shape, sharding) in one file under `directory`.

    Args:
      directory: the tier's directory (tmpfs for memory, the work dir for persistent).
      leaves: each leaf's global shape and target sharding, in the restored tree's order.
      mapped: whether reads map the file (tmpfs) or read it into host memory (disk).
    """

    def __init__(
        self, directory: Path, leaves: Sequence[tuple[tuple[int, ...], Any]], mapped: bool
    ):
        self.leaves = list(leaves)
        self.mapped = mapped
        self.path = directory / f".floor-{uuid.uuid4().hex[:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        self.regions: list[list[tuple[_reshard.Region, int]]] = []  # (region, offset)
        offset = 0
        with open(self.path, "wb") as f:
            for i, (shape, sharding) in enumerate(self.leaves):
                placed = []
                for region in _reshard.needed_regions(shape, sharding):
                    f.write(_reshard.values(i, region).astype(np.float32).tobytes())
                    placed.append((region, offset))
                    offset += _reshard.region_bytes(region)
                self.regions.append(placed)
            f.flush()
            os.fsync(f.fileno())
        self.nbytes = offset

    def arrays(self) -> list[np.ndarray]:
        """The needed bytes as host arrays (what a peer floor sends over loopback)."""
        data = np.fromfile(self.path, np.uint8)
        return [data] if data.size else []

    def read(self) -> float:
        """Seconds to read every needed region (a cold read where not `mapped`), check its
        CRC-32C and put it on its target devices; the arrays are built and waited for."""
        if not self.mapped:
            _baselines.evict_page_cache(self.path.parent)
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            data = self._load(stack)
            out = []
            for (shape, sharding), placed in zip(self.leaves, self.regions, strict=True):
                by_region = {}
                for region, offset in placed:
                    nbytes = _reshard.region_bytes(region)
                    block = data[offset : offset + nbytes]
                    _checksum.crc32c(memoryview(block))  # type: ignore[arg-type]
                    by_region[region] = block.view(np.float32).reshape([b - a for a, b in region])
                shards = [
                    jax.device_put(by_region[_reshard.region_of(tuple(index), shape)], device)
                    for device, index in sharding.addressable_devices_indices_map(shape).items()
                ]
                out.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
            jax.block_until_ready(out)
        return time.perf_counter() - start

    def _load(self, stack: contextlib.ExitStack) -> np.ndarray:
        """The file's bytes: mapped (closed with `stack`), or read into host memory."""
        if not self.nbytes:
            return np.zeros(0, np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        stack.callback(os.close, fd)
        if self.mapped:
            # Not closed here: the arrays put on CPU devices may keep its pages (as a
            # restore from memory keeps the slab's); it is unmapped when they are freed.
            # Its pages mapped in one call, as a restore maps the tiles it reads
            # (`_slab.Reader.populate`): cheaper than a page fault per 64 KiB.
            pages = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_READ)
            with contextlib.suppress(OSError):  # a kernel before 5.14: faulted in instead
                pages.madvise(_slab.MADV_POPULATE_READ, 0, self.nbytes)
            return np.frombuffer(pages, np.uint8)
        # Page-aligned (private anonymous pages, as a restore's buffers: a shared mapping's
        # pages cost more to fault in), as a restore's landing buffer: a CPU device may
        # then keep the bytes without a copy of its own.
        pages = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        data = np.frombuffer(pages, np.uint8)
        view, done = memoryview(pages), 0
        while done < self.nbytes:
            done += os.preadv(fd, [view[done:]], done)
        return data

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
