"""Landing slabs: where a restore receives a peer's chunks, lent to the restored arrays.

After a node loss the restarted process reads its part from a peer. Received into
freshly allocated buffers, every page is first touched by the receive itself (on a
VM that backs guest memory lazily, 0.4-0.7 GB/s), one after the other. Instead the
chunks land in one tmpfs file laid out as the owner's slab (each chunk at its
recorded offset):

- a spare slab of the memory tier when there is one (`MemoryTier.take_free_slab`):
  its pages exist, so the bytes arrive at memory speed;
- else a new file whose pages two background threads allocate and map
  (`MADV_POPULATE_WRITE`, else `posix_fallocate`) ahead of the receives, in offset
  order, while they run: the page faults of a fresh replacement node overlap the
  transfer instead of following it.

The file is unlinked as soon as it is mapped: nothing else can take it, nothing is
left behind by a crash, and its pages live exactly as long as a view of the mapping
does. The restore hands those views to `device_put`; on CPU JAX keeps them without a
copy (64-byte aligned), so the slab is lent to the restored arrays, as a slab of the
tier's own memory is (`MemoryTier.lend`). `finish()` frees the pages of chunks the
restore did not use (a restore onto another mesh reads only some of a part).

IMPORTANT: a page is written through the mapping only once it exists (populated or
allocated): a full tmpfs then fails the allocation with an OSError, which the
restore treats as a failed source, never with a SIGBUS on a mapped page.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import numpy as np
from absl import logging as log

from jaxckpt import _checksum, _format, _memory_tier, _readers, _slab

_STEP: Final = 4 << 20  # pages made ready per call, ahead of the receives
_MAKERS: Final = min(2, os.cpu_count() or 1)  # threads making pages ready
_STREAMS: Final = 2  # receives of a prefetched part at once (more only add contention)
_MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; Python's mmap module does not name it
_PAGE: Final = mmap.PAGESIZE


def part_bytes(manifest: _format.PartManifest) -> int:
    """The size of a part's slab, from its chunk records (0 if none has an offset)."""
    ends = [
        c.offset + c.nbytes
        for chunks in manifest.chunks.values()
        for c in chunks
        if c.offset is not None
    ]
    return -(-max(ends, default=0) // _slab.ALIGN) * _slab.ALIGN


class LandingSlab:
    """A mapped, unlinked tmpfs file of `size` bytes that a peer's chunks land in.

    Args:
      memory: the tier whose spare slab to take, and where to make the file.
      size: the owner's slab size (`part_bytes`).
    """

    def __init__(self, memory: _memory_tier.MemoryTier, size: int):
        self.size = size
        path = memory.run_dir / ".staging" / f"landing-{uuid.uuid4().hex}"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.reused = size > 0 and memory.take_free_slab(path, size)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.unlink(path)  # IMPORTANT: before anything can fail: nothing is left behind
            os.ftruncate(fd, max(size, 1))
            whole = self.reused and os.fstat(fd).st_blocks * 512 >= size
            # Not populated here even when every page exists: the threads below map
            # them beside the receives (half a GiB of page tables takes ~0.1 s).
            self._map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED)
            self._fd = os.dup(fd)  # for `posix_fallocate` where madvise cannot populate
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, np.uint8)
        self._ready = size if whole else 0  # bytes [0, _ready) exist
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._kept: list[tuple[int, int]] = []
        self._done: set[int] = set()  # steps made ready, beyond `_ready`
        self._threads = []
        if size:
            steps = -(-size // _STEP)
            for k in range(min(_MAKERS, steps)):
                thread = threading.Thread(
                    target=self._make_ready,
                    args=(range(k, steps, _MAKERS),),
                    name="jaxckpt-landing",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _make_ready(self, steps: range) -> None:
        """Allocates and maps the pages of `steps` (of `_STEP` bytes each), in offset
        order, ahead of the receives (on several threads: the first touch of guest
        memory is the hypervisor's work, and runs in parallel on several CPUs)."""
        populate = True
        try:
            for i in steps:
                with self._cond:
                    if self._stop or self._error is not None:
                        return
                start = i * _STEP
                length = min(_STEP, self.size - start)
                if populate:
                    try:
                        self._map.madvise(_MADV_POPULATE_WRITE, start, length)
                    except OSError as e:
                        if e.errno != errno.EINVAL:  # EFAULT/ENOMEM: the tier is full
                            raise OSError(
                                errno.ENOSPC, f"No room for a landing slab of {self.size} bytes"
                            ) from e
                        populate = False  # a kernel without MADV_POPULATE_WRITE
                if not populate:
                    os.posix_fallocate(self._fd, start, length)
                with self._cond:
                    self._done.add(i)
                    while self._ready < self.size and self._ready // _STEP in self._done:
                        self._done.discard(self._ready // _STEP)
                        self._ready = min(self.size, self._ready + _STEP)
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def view(self, offset: int, nbytes: int, timeout_s: float) -> np.ndarray:
        """The bytes [offset, offset + nbytes) as a writable uint8 view, once they exist.

        Raises:
          ValueError: if the range is not inside the slab.
          OSError: if its pages could not be allocated (a full tier).
          TimeoutError: if they are not ready within `timeout_s`.
        """
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"Chunk bytes [{offset}, {offset + nbytes}) lie outside the landing slab "
                f"({self.size} bytes): the manifest is damaged."
            )
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._ready >= offset + nbytes or self._error is not None, timeout_s
            ):
                raise TimeoutError(f"The landing slab's pages were not ready in {timeout_s:g} s.")
            if self._ready < offset + nbytes:
                assert self._error is not None
                raise OSError(f"The landing slab cannot hold the chunk: {self._error}")
        return self._view[offset : offset + nbytes]

    def keep(self, offset: int, nbytes: int) -> None:
        """Marks bytes [offset, offset + nbytes) as handed to the restore: `finish`
        gives back the pages of every other byte."""
        with self._cond:
            self._kept.append((offset, nbytes))

    def finish(self) -> None:
        """Stops making pages ready and frees those of every byte not handed to the
        restore (`keep`): chunks never received, or received ahead but not asked for
        (the mapping itself lives on with the views the restored arrays keep)."""
        with self._cond:
            self._stop = True
        for thread in self._threads:
            thread.join()
        with self._cond:
            ready, kept = self._ready, sorted(self._kept)
        for start, end in _gaps(kept, ready):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_REMOVE, start, end - start)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1
        del self._view
        with contextlib.suppress(BufferError):
            self._map.close()  # only if no restored array kept a view (BufferError else)


def _gaps(ranges: Iterable[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The whole pages of [0, end) that no (offset, nbytes) range touches."""
    out, at = [], 0
    for offset, nbytes in sorted(ranges):
        start = -(-at // _PAGE) * _PAGE
        stop = offset // _PAGE * _PAGE
        if stop > start:
            out.append((start, stop))
        at = max(at, offset + nbytes)
    start = -(-at // _PAGE) * _PAGE
    stop = end // _PAGE * _PAGE
    if stop > start:
        out.append((start, stop))
    return out


class LandingReader:
    """Chunks of a part held by a peer, received (byte ranges of its slab) straight
    into a landing slab that the restored arrays keep, each chunk's CRC-32C computed
    MiB by MiB as its bytes arrive, while they are in cache: the reader checks every
    chunk it returns (`verifies_checksums`), so the restore does not read it again.

    Args:
      fetch: `(offset, into, timeout_s, progress)`: fills `into` with the slab's
        bytes from `offset`, calling `progress(received so far)` as they arrive.
      landing: where they land.
      prefetch: chunks to receive at once, on `_STREAMS` threads in offset order,
        before the restore asks for them (a restore onto the saving mesh needs every
        chunk of its own part); others are received when asked for.
      timeout_s: the longest a prefetched chunk's receive may wait.
    """

    verifies_checksums = True

    def __init__(
        self,
        fetch: Callable[..., None],
        landing: LandingSlab,
        prefetch: Sequence[_format.ChunkRecord] = (),
        timeout_s: float = 120.0,
    ):
        self._fetch = fetch
        self._landing = landing
        self._cond = threading.Condition()
        self._arrived: dict[int, int | BaseException] = {}  # offset -> CRC-32C, or the error
        # Set once a receive got no answer (a partition, a dead or stalled peer): every
        # later read fails at once, so the restore marks this source dead and reads the
        # next one instead of waiting for the peer again, chunk after chunk.
        self._no_answer: BaseException | None = None
        self._streams: list[threading.Thread] = []
        chunks = sorted((c for c in prefetch if c.offset is not None), key=lambda c: c.offset or 0)
        self._prefetched = {c.offset for c in chunks}
        for group in _groups(chunks, _STREAMS):
            thread = threading.Thread(
                target=self._stream, args=(group, timeout_s), name="jaxckpt-landing-recv"
            )
            thread.daemon = True
            thread.start()
            self._streams.append(thread)

    def _receive(self, chunk: _format.ChunkRecord, timeout_s: float) -> tuple[np.ndarray, int]:
        """Receives one chunk into its place; (its bytes, their CRC-32C)."""
        assert chunk.offset is not None
        into = self._landing.view(chunk.offset, chunk.nbytes, timeout_s)
        crc, seen = 0, 0

        def progress(done: int) -> None:
            nonlocal crc, seen
            crc = _checksum.crc32c(into[seen:done], crc)  # the MiB just received
            seen = done

        self._fetch(chunk.offset, into.data, timeout_s, progress)
        if seen != chunk.nbytes:
            crc = _checksum.crc32c(into[seen:], crc)
        return into, crc

    def _stream(self, chunks: Sequence[_format.ChunkRecord], timeout_s: float) -> None:
        for i, chunk in enumerate(chunks):
            assert chunk.offset is not None
            try:
                _, result = self._receive(chunk, timeout_s)
            except BaseException as e:
                with self._cond:  # this chunk and the rest of the stream: asked for again
                    for later in chunks[i:]:
                        self._prefetched.discard(later.offset)
                    if isinstance(e, (TimeoutError, ConnectionError)):
                        self._no_answer = e
                    self._cond.notify_all()
                log.warning("jaxckpt: receiving part of a peer's slab ahead failed: %s", e)
                return
            with self._cond:
                self._arrived[chunk.offset] = result
                self._cond.notify_all()

    def read(
        self, leaf: int, record: _format.LeafRecord, chunk: _format.ChunkRecord, timeout_s: float
    ) -> np.ndarray:
        offset = _readers.slab_offset(record, chunk)
        with self._cond:
            if not self._cond.wait_for(
                lambda: offset in self._arrived or offset not in self._prefetched, timeout_s
            ):
                raise TimeoutError(f"Chunk {chunk.index} of {record.path} did not arrive in time.")
            crc = self._arrived.get(offset)
            no_answer = self._no_answer
        if crc is None and no_answer is not None:
            raise TimeoutError(f"The peer gave no answer: {no_answer}") from no_answer
        if crc is None:  # not prefetched, or its stream failed: received now
            into, got = self._receive(chunk, timeout_s)
        else:
            assert isinstance(crc, int)
            into, got = self._landing.view(offset, chunk.nbytes, timeout_s), crc
        matches = (
            got == chunk.crc32c
            if chunk.crc32c is not None
            else _checksum.matches(None, chunk.crc32, into)
        )
        if not matches:
            raise ValueError(f"checksum mismatch of chunk {chunk.index} of {record.path}")
        data = _readers.from_bytes(into, record, chunk)
        self._landing.keep(offset, chunk.nbytes)
        return data

    def finish(self) -> None:
        for thread in self._streams:
            thread.join()
        self._landing.finish()


def _groups(
    chunks: Sequence[_format.ChunkRecord], count: int
) -> list[Sequence[_format.ChunkRecord]]:
    """`chunks` (in offset order) cut into up to `count` consecutive runs of about
    equal bytes."""
    total = sum(c.nbytes for c in chunks)
    out: list[Sequence[_format.ChunkRecord]] = []
    start, run = 0, 0
    for i, c in enumerate(chunks):
        run += c.nbytes
        if run >= total / count and len(out) < count - 1:
            out.append(chunks[start : i + 1])
            start, run = i + 1, 0
    if start < len(chunks):
        out.append(chunks[start:])
    return out


def landing_for(
    memory: _memory_tier.MemoryTier, manifest: _format.PartManifest
) -> LandingSlab | None:
    """A landing slab for a peer's part, or None where none can be made (then the
    chunks are received into new buffers, as before; the reason is logged)."""
    size = part_bytes(manifest)
    if not size:
        return None
    try:
        return LandingSlab(memory, size)
    except OSError as e:
        log.warning(
            "jaxckpt: no landing slab for part %d of step %d (%s): receiving into new buffers",
            manifest.owner,
            manifest.step,
            e,
        )
        return None
