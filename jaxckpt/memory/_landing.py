"""Landing slabs: where a restore receives a peer's chunks, lent to the restored arrays.

After a node loss the restarted process reads its part from a peer. Received into
freshly allocated buffers, every page is first touched by the receive itself (on a
VM that backs guest memory lazily, 0.4-0.7 GB/s), one after the other. Instead the
chunks land in one tmpfs file laid out as the owner's slab (each chunk at its
recorded offset):

- a spare slab of the memory tier when there is one (`MemoryTier.take_free_slab`):
  its pages exist; mapped with its page tables made in one call (`MAP_POPULATE`), or
  taken still mapped where this process filled it (`_slab.take_kept`), the bytes
  arrive at memory speed without a page fault;
- else a new file whose pages background threads allocate and map
  (`MADV_POPULATE_WRITE`, else `posix_fallocate`) ahead of the receives, one thread
  along each range a stream receives, while it runs: the page faults of a fresh
  replacement node overlap the transfer instead of following it.

The reader receives a prefetched part in a few consecutive runs of tiles, one
request each (`LandingReader`): each tile's CRC-32C is computed MiB by MiB as it
lands, and the tile is handed over as soon as its last byte has (a chunk saved
whole is one tile: `_tiles`).

The file is unlinked as soon as it is mapped: nothing else can take it, nothing is
left behind by a crash, and its pages live exactly as long as a view of the mapping
does. The restore hands those views to `device_put`; on CPU JAX keeps them without a
copy (64-byte aligned), so the slab is lent to the restored arrays, as a slab of the
tier's own memory is (`MemoryTier.lend`). `finish()` frees the pages of chunks the
restore did not use (a restore onto another mesh reads only some of a part).

IMPORTANT: a page is written through the mapping only once it exists (populated or
allocated, `LandingSlab.ensure`): a full tmpfs then fails the allocation with an
OSError, which the restore treats as a failed source, never with a SIGBUS on a
mapped page.
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

from jaxckpt.format import _checksum, _format, _tiles
from jaxckpt.memory import _memory_tier, _readers, _slab

_STEP: Final = 4 << 20  # pages made ready per call, ahead of the receives
_STREAMS: Final = 2  # receives of a prefetched part at once (more only add contention)
# The most bytes a `fetch` receives before telling `progress` (`fetch_range`'s pieces):
# a streamed receive makes the pages of the next piece exist before it lands.
PIECE: Final = 1 << 20
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

    Its pages are made to exist in steps of `_STEP` bytes: all at once for a spare
    slab, else by `make_ahead`'s threads and, for what they have not reached, by the
    caller of `ensure` itself (making a page exist twice is harmless).

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
            kept = _slab.take_kept(fd) if self.reused else None
            os.ftruncate(fd, max(size, 1))
            whole = self.reused and os.fstat(fd).st_blocks * 512 >= size
            if kept is not None and whole and kept[1] >= size:
                # Filled by this process and still mapped: pages and page tables exist.
                self._map = kept[0]
            else:
                if kept is not None:
                    with contextlib.suppress(BufferError):  # a view still in use keeps it
                        kept[0].close()
                # Every page of a spare exists: its page tables are made in one call
                # (~15 ms a 0.5 GiB, against a fault per page while receiving).
                populate = mmap.MAP_POPULATE if whole else 0
                self._map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | populate)
            self._fd = os.dup(fd)  # for `posix_fallocate` where madvise cannot populate
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, np.uint8, count=max(size, 1))
        self._lock = threading.Lock()
        # The steps whose pages exist (of `_STEP` bytes each).
        self._made = set(range(-(-size // _STEP))) if whole else set()
        self._populate = True  # False on a kernel without MADV_POPULATE_WRITE
        self._stop = threading.Event()
        self._kept: list[tuple[int, int]] = []
        self._threads: list[threading.Thread] = []

    def make_ahead(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Starts making the pages of each byte range [start, end) exist, in offset
        order, one thread a range, ahead of the stream that receives it (on several
        threads: the first touch of guest memory is the hypervisor's work, and runs in
        parallel on several CPUs)."""
        for start, end in ranges:
            steps = range(start // _STEP, -(-end // _STEP))
            if all(i in self._made for i in steps):
                continue
            thread = threading.Thread(
                target=self._make_quietly, args=(steps,), name="jaxckpt-landing", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _make_quietly(self, steps: range) -> None:
        try:
            for i in steps:
                if self._stop.is_set():
                    return
                self._make(i)
        except OSError:
            return  # the receive that needs the page makes it, and raises the error

    def _make(self, i: int) -> None:
        """Makes the pages of step `i` exist (a no-op if they do)."""
        if i in self._made:
            return
        start = i * _STEP
        length = min(_STEP, self.size - start)
        if self._populate:
            try:
                self._map.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EFAULT/ENOMEM: the tier is full
                    raise OSError(
                        errno.ENOSPC, f"No room for a landing slab of {self.size} bytes"
                    ) from e
                self._populate = False  # a kernel without MADV_POPULATE_WRITE
        if not self._populate:
            os.posix_fallocate(self._fd, start, length)
        with self._lock:
            self._made.add(i)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The bytes [offset, offset + nbytes) as a writable uint8 view: write only
        bytes whose pages `ensure` made exist.

        Raises:
          ValueError: if the range is not inside the slab.
        """
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"Chunk bytes [{offset}, {offset + nbytes}) lie outside the landing slab "
                f"({self.size} bytes): the manifest is damaged."
            )
        return self._view[offset : offset + nbytes]

    def ensure(self, offset: int, nbytes: int) -> None:
        """Makes the pages of bytes [offset, offset + nbytes) exist, here where no
        thread has made them yet.

        Raises:
          OSError: if they cannot be allocated (a full tier).
        """
        for i in range(offset // _STEP, -(-(offset + nbytes) // _STEP) if nbytes else 0):
            self._make(i)

    def keep(self, offset: int, nbytes: int) -> None:
        """Marks bytes [offset, offset + nbytes) as handed to the restore: `finish`
        gives back the pages of every other byte."""
        with self._lock:
            self._kept.append((offset, nbytes))

    def finish(self) -> None:
        """Stops making pages and frees those of every byte not handed to the restore
        (`keep`): chunks never received, or received ahead but not asked for (the
        mapping itself lives on with the views the restored arrays keep)."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        with self._lock:
            kept = sorted(self._kept)
        for start, end in _gaps(kept, self.size):
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
        bytes from `offset`, at most `PIECE` bytes at a time, calling
        `progress(received so far)` after each (`fetch_range` with a progress).
      landing: where they land.
      prefetch: the (offset, nbytes) of tiles to receive at once, before the restore
        asks for them (a restore onto the saving mesh needs every tile of its own
        part: `spans_of`): cut into `_STREAMS` consecutive runs, each received with
        one request for the bytes it spans, its pages made ahead of it; others are
        received when asked for, one request each.
      timeout_s: the longest a prefetched chunk's receive may wait.
    """

    verifies_checksums = True

    def __init__(
        self,
        fetch: Callable[..., None],
        landing: LandingSlab,
        prefetch: Sequence[tuple[int, int]] = (),
        timeout_s: float = 120.0,
    ):
        self._fetch = fetch
        self._landing = landing
        self._cond = threading.Condition()
        # (offset, nbytes) -> CRC-32C. IMPORTANT: not the offset alone: a zero-size chunk
        # (an empty shard) lies at the offset of the chunk after it (`_slab.layout`), and
        # arrives first: its CRC would pass for that chunk's, still on its way.
        self._arrived: dict[tuple[int, int], int] = {}
        # Set once a receive got no answer (a partition, a dead or stalled peer): every
        # later read fails at once, so the restore marks this source dead and reads the
        # next one instead of waiting for the peer again, chunk after chunk.
        self._no_answer: BaseException | None = None
        self._streams: list[threading.Thread] = []
        spans = sorted(prefetch)
        self._prefetched = set(spans)
        groups = _groups(spans, _STREAMS)
        landing.make_ahead((g[0][0], g[-1][0] + g[-1][1]) for g in groups)
        for group in groups:
            thread = threading.Thread(
                target=self._stream, args=(group, timeout_s), name="jaxckpt-landing-recv"
            )
            thread.daemon = True
            thread.start()
            self._streams.append(thread)

    def prefetch(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tiles: Sequence[_tiles.Tile],
        timeout_s: float = 120.0,
    ) -> None:
        """Starts receiving `tiles` of `chunk` (of a part not received ahead whole): each
        run of them one after the other in the slab as one stream (a tile a request costs
        a round trip each), checked as it lands; `read` takes each."""
        base = _readers.slab_offset(record, chunk)
        for run in _tiles.runs(tiles):
            spans = [(base + t.offset, t.nbytes) for t in run]
            with self._cond:
                if len(spans) < 2 or any(s in self._prefetched for s in spans):
                    continue  # read when asked for, or on its way already
                self._prefetched.update(spans)
            self._landing.make_ahead([(spans[0][0], spans[-1][0] + spans[-1][1])])
            thread = threading.Thread(
                target=self._stream, args=(spans, timeout_s), name="jaxckpt-landing-recv"
            )
            thread.daemon = True
            thread.start()
            self._streams.append(thread)

    def _receive(self, offset: int, nbytes: int, timeout_s: float) -> tuple[np.ndarray, int]:
        """Receives one tile into its place (one request); (its bytes, their CRC-32C)."""
        into = self._landing.view(offset, nbytes)
        self._landing.ensure(offset, nbytes)
        crc, seen = 0, 0

        def progress(done: int) -> None:
            nonlocal crc, seen
            crc = _checksum.crc32c(into[seen:done], crc)  # the MiB just received
            seen = done

        self._fetch(offset, into.data, timeout_s, progress)
        if seen != nbytes:
            crc = _checksum.crc32c(into[seen:], crc)
        return into, crc

    def _stream(self, spans: Sequence[tuple[int, int]], timeout_s: float) -> None:
        """Receives consecutive tiles (`spans`, in offset order) with one request for the
        byte range they span: each tile's CRC-32C is computed MiB by MiB as its bytes land
        and the tile is handed over (`read`) as soon as its last byte has, while the
        rest streams on. The pages of each piece exist before it is received."""
        start, end = spans[0][0], spans[-1][0] + spans[-1][1]
        into = self._landing.view(start, end - start)
        at, crc, seen = 0, 0, 0  # the tile being received, its CRC so far, bytes checked

        def progress(done: int) -> None:
            nonlocal at, crc, seen
            while at < len(spans) and seen < done:
                offset, nbytes = spans[at]
                lo, hi = max(seen, offset - start), min(done, offset - start + nbytes)
                if hi > lo:
                    crc = _checksum.crc32c(into[lo:hi], crc)
                seen = max(seen, hi)
                if hi < offset - start + nbytes:
                    break  # the rest of this tile is still on its way
                with self._cond:
                    self._arrived[spans[at]] = crc
                    self._cond.notify_all()
                at, crc = at + 1, 0
            seen = done
            self._landing.ensure(start + done, min(PIECE, end - start - done))

        try:
            self._landing.ensure(start, min(PIECE, end - start))
            self._fetch(start, into.data, timeout_s, progress)
            progress(end - start)  # a fetch that did not report its last piece
        except BaseException as e:
            with self._cond:  # the tiles not arrived: asked for again, one by one
                for span in spans:
                    if span not in self._arrived:
                        self._prefetched.discard(span)
                if isinstance(e, (TimeoutError, ConnectionError)):
                    self._no_answer = e
                self._cond.notify_all()
            log.warning("jaxckpt: receiving part of a peer's slab ahead failed: %s", e)

    def read(
        self,
        leaf: int,
        record: _format.LeafRecord,
        chunk: _format.ChunkRecord,
        tile: _tiles.Tile,
        timeout_s: float,
    ) -> np.ndarray:
        offset = _readers.slab_offset(record, chunk) + tile.offset
        key = (offset, tile.nbytes)
        what = _tiles.describe(chunk, tile)
        with self._cond:
            if not self._cond.wait_for(
                lambda: key in self._arrived or key not in self._prefetched, timeout_s
            ):
                raise TimeoutError(
                    f"{what.capitalize()} of {record.path} did not arrive within {timeout_s:g} s."
                )
            crc = self._arrived.get(key)
            no_answer = self._no_answer
        if crc is None and no_answer is not None:
            raise TimeoutError(f"The peer gave no answer: {no_answer}") from no_answer
        if crc is None:  # not prefetched, or its stream failed: received now
            into, got = self._receive(offset, tile.nbytes, timeout_s)
        else:
            into, got = self._landing.view(offset, tile.nbytes), crc
        matches = got == tile.crc32c if tile.crc32c is not None else tile.matches(into)
        if not matches:
            raise _readers.ChecksumMismatchError(f"checksum mismatch of {what} of {record.path}")
        data = _readers.from_bytes(into, record, tile)
        self._landing.keep(offset, tile.nbytes)
        return data

    def finish(self) -> None:
        for thread in self._streams:
            thread.join()
        self._landing.finish()


def spans_of(manifest: _format.PartManifest) -> list[tuple[int, int]]:
    """The (offset, nbytes) in its slab of every tile of a part: what tells a tile apart
    (a zero-size chunk shares its offset with the next chunk)."""
    return [
        (c.offset + t.offset, t.nbytes)
        for leaf, chunks in manifest.chunks.items()
        for c in chunks
        if c.offset is not None
        for t in _tiles.tiles(manifest.leaves[leaf], c)
    ]


def _groups(spans: Sequence[tuple[int, int]], count: int) -> list[Sequence[tuple[int, int]]]:
    """`spans` (in offset order) cut into up to `count` consecutive runs of about
    equal bytes."""
    total = sum(n for _, n in spans)
    out: list[Sequence[tuple[int, int]]] = []
    start, run = 0, 0
    for i, (_, n) in enumerate(spans):
        run += n
        if run >= total / count and len(out) < count - 1:
            out.append(spans[start : i + 1])
            start, run = i + 1, 0
    if start < len(spans):
        out.append(spans[start:])
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
