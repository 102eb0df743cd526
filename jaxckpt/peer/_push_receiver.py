"""A push received: one memory-tier part arriving at a holder's peer service.

The part's manifest comes first and is checked (its run, its place, every chunk
inside the announced slab); the slab is received into a free slab of the memory
tier when there is one, its chunks checked against the manifest on a shared pool
while later ones still arrive; the part becomes visible with a rename only when
every chunk matched. The wire format is defined in `_wire`.
"""

import concurrent.futures
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Protocol

from jaxckpt import _resources
from jaxckpt.format import _format, _tiles
from jaxckpt.memory import _fs, _memory_tier, _slab
from jaxckpt.peer import _wire

_MAX_PUSH_HEADER_BYTES: Final = 1 << 16
_MAX_MANIFEST_BYTES: Final = 1 << 30  # read into memory whole
_RECV_STEP: Final = 8 << 20  # bytes received between hand-offs of complete chunks to checks
_DRAIN_BYTES: Final = 1 << 20
PART_PLACE: Final = re.compile(r"step_[0-9]+/part_[0-9]+")
# Checks chunks of received slabs (CRC-32C releases the GIL): shared by all pushes.
_verify_pool: Final = _resources.SHARED.pool(min(4, os.cpu_count() or 1), "jaxckpt-peer-verify")


class Service(Protocol):
    """What a push needs of its service (`_request_handler.ServiceConfig` has it)."""

    @property
    def run_id(self) -> str: ...
    @property
    def max_push_bytes(self) -> int: ...
    @property
    def commit_lock(self) -> threading.Lock: ...
    @property
    def take_free_slab(self) -> Callable[[Path, int], bool]: ...


class PushReceiver:
    """Receives the pushes of one connection into the run directory.

    Args:
      config: the service the connection talks to.
      rfile: the connection's request body stream.
      resolve: joins a relative path to the run directory, refusing paths that
        lead outside it.
      temp_path: a fresh temporary path in the run directory, given its purpose.
    """

    def __init__(
        self,
        config: Service,
        rfile: Any,
        resolve: Callable[[str], str],
        temp_path: Callable[[str], str],
    ) -> None:
        self._config, self._rfile = config, rfile
        self._resolve, self._temp_path = resolve, temp_path

    def length(self, content_length: str | None) -> int:
        """The push body's length; 411 without one, 413 over the service's limit."""
        if content_length is None or not content_length.isdigit():
            raise _wire.Refusal(411, "A push needs a Content-Length header.")
        if int(content_length) > self._config.max_push_bytes:
            raise _wire.Refusal(
                413,
                f"Push of {content_length} bytes exceeds this peer's limit of "
                f"{self._config.max_push_bytes} bytes (PeerServer max_push_bytes).",
            )
        return int(content_length)

    def destination(self, rel: str) -> str:
        """The path a push to ``rel`` writes; 400 unless ``rel`` is a part's place."""
        if not PART_PLACE.fullmatch(rel):
            raise _wire.Refusal(
                400, f"Push destination {rel!r} is not a part's place (step_<n>/part_<n>)."
            )
        return self._resolve(rel)

    def receive(self, rel: str, total: int) -> tuple[int, str | None]:
        """Receives a ``total``-byte push body to ``rel`` and commits it there.

        Returns:
          The payload's bytes, and where the part it replaced was moved (for
          `ServiceConfig.retire_part`, after answering), or None.

        Raises:
          _wire.Refusal: a malformed, misplaced or damaged push; nothing was kept.
        """
        sizes = self._read_header(total)
        dest = self.destination(rel)
        tmp = self._temp_path("push")
        committed = False
        try:
            os.mkdir(tmp)
            try:
                manifest = self._receive_manifest(rel, sizes, tmp)
                slab = _slab.Incoming(
                    os.path.join(tmp, _slab.SLAB_FILE),
                    sizes.slab_bytes,
                    self._config.take_free_slab,
                )
            except (_wire.Refusal, OSError) as e:
                if isinstance(e, (ConnectionError, TimeoutError)):
                    raise
                # The pusher sends the whole body before it reads an answer: read
                # the slab's bytes away, so that it gets this refusal, not a reset.
                self._drain(sizes.slab_bytes)
                raise
            with slab:
                check = _SlabCheck(manifest, slab.view, sizes.slab_bytes)
                try:
                    self.receive_slab(_slab.SLAB_FILE, sizes.slab_bytes, slab, check, _RECV_STEP)
                finally:
                    # IMPORTANT: no check may still read the mapping when it is closed.
                    check.wait()
            damaged = check.damaged()
            if damaged:
                raise _wire.Refusal(400, damaged)
            old = self._temp_path("old")
            # IMPORTANT: commit only after every byte arrived and every chunk matched its
            # manifest; `replace_dir` moves an existing destination away before renaming
            # over it, so readers see the old part or the new one, never a mix.
            with self._config.commit_lock:
                had_old = _fs.replace_dir(tmp, dest, keep_old_at=old)
                committed = True
        finally:
            if not committed:
                _fs.remove_entry(tmp)
        return sizes.payload_bytes, old if had_old else None

    def receive_slab(
        self, name: str, size: int, slab: _slab.Incoming, check: "_SlabCheck", step: int
    ) -> None:
        """Receives the next ``size`` body bytes into ``slab``.

        Each ``step`` bytes, the chunks completed so far go to ``check``, so chunks
        are verified while later ones still arrive.

        Note: tests/workers/mp_worker.py replaces this method on a receiver (a holder
        dying mid-receive); keep its positional signature.
        """
        done = 0
        while done < size:
            want = min(step, size - done)
            got = slab.receive(self._rfile, done, want)
            if got != want:
                raise ConnectionResetError(
                    f"Client disconnected after {done + got} of {size} bytes of {name!r}."
                )
            done += got
            check.received(done)
        check.received(size)

    def _receive_manifest(
        self, rel: str, sizes: _wire.PushHeader, tmp: str
    ) -> _format.PartManifest:
        """Receives the pushed part's manifest into ``tmp`` and checks it.

        Raises:
          _wire.Refusal: 400 unless the manifest is a part manifest of this run whose
            place is ``rel`` and whose chunks all lie inside the announced slab.
        """
        data = _wire.read_exact(self._rfile, sizes.manifest_bytes)
        try:
            manifest = _format.PartManifest.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _wire.Refusal(
                400, f"The pushed {_format.MANIFEST_FILE} is not a valid part manifest: {e}"
            ) from e
        step_dir = _memory_tier.MemoryTier.step_name(manifest.step)
        place = f"{step_dir}/{_format.part_dir_name(manifest.owner)}"
        run_id = self._config.run_id
        if manifest.run_id != run_id or place != rel:
            raise _wire.Refusal(
                400,
                f"The pushed part (run {manifest.run_id!r}, step {manifest.step}, owner "
                f"{manifest.owner}) belongs at {place!r} of run {manifest.run_id!r}, not at "
                f"{rel!r} of run {run_id!r}.",
            )
        for leaf, chunk in _chunks(manifest):
            if chunk.offset is None or chunk.offset < 0 or chunk.nbytes < 0:
                raise _wire.Refusal(
                    400, f"{_describe(manifest, leaf, chunk)} has no place in a slab."
                )
            if _end(chunk) > sizes.slab_bytes:
                raise _wire.Refusal(
                    400,
                    f"{_describe(manifest, leaf, chunk)} lies outside the pushed "
                    f"{sizes.slab_bytes}-byte slab.",
                )
        with open(os.path.join(tmp, _format.MANIFEST_FILE), "xb") as out:
            out.write(data)
        return manifest

    def _drain(self, size: int) -> None:
        """Reads and drops the next ``size`` body bytes."""
        buf = memoryview(bytearray(max(1, min(size, _DRAIN_BYTES))))
        while size:
            got = self._rfile.readinto(buf[: min(size, len(buf))]) or 0
            if not got:
                raise ConnectionResetError("Client disconnected during a refused push.")
            size -= got

    def _read_header(self, total: int) -> _wire.PushHeader:
        size = _wire.read_u32(self._rfile) if total >= 4 else -1
        if not 0 <= size <= min(_MAX_PUSH_HEADER_BYTES, total - 4):
            raise _wire.Refusal(400, f"Bad push header length {size} for a {total}-byte body.")
        try:
            header = _wire.decode_push_header(_wire.read_exact(self._rfile, size))
        except ValueError as e:
            raise _wire.Refusal(400, str(e)) from e
        if _wire.push_body_length(size, header) != total:
            raise _wire.Refusal(400, "Content-Length does not match the sizes in the push header.")
        if header.manifest_bytes > _MAX_MANIFEST_BYTES:
            raise _wire.Refusal(
                400, f"A pushed manifest of {header.manifest_bytes} bytes is implausibly large."
            )
        return header


class _SlabCheck:
    """Verifies a pushed slab's chunks against their manifest while the slab arrives.

    Each chunk is checked (its tiles' CRC-32Cs, or a legacy CRC-32) as soon as all of its
    bytes are in, on a shared pool, while later chunks still arrive.
    """

    def __init__(self, manifest: _format.PartManifest, data: memoryview, size: int) -> None:
        self._manifest, self._data, self._size = manifest, data, size
        self._chunks = sorted(_chunks(manifest), key=lambda lc: _end(lc[1]))
        self._next = 0
        self._jobs: list[concurrent.futures.Future[list[tuple[int, _format.ChunkRecord]]]] = []

    def received(self, upto: int) -> None:
        """Queues the checks of the chunks that lie wholly before byte ``upto``."""
        first = self._next
        while self._next < len(self._chunks) and _end(self._chunks[self._next][1]) <= upto:
            self._next += 1
        if self._next > first:
            self._jobs.append(_verify_pool.submit(self._verify, first, self._next))

    def _verify(self, first: int, stop: int) -> list[tuple[int, _format.ChunkRecord]]:
        return [(leaf, c) for leaf, c in self._chunks[first:stop] if self._is_damaged(leaf, c)]

    def _is_damaged(self, leaf: int, chunk: _format.ChunkRecord) -> bool:
        """Whether a tile of `chunk` fails its checksum (or the manifest cannot say
        where its tiles are: a leaf it does not have, a tile grid that does not fit)."""
        leaves = self._manifest.leaves
        if not 0 <= leaf < len(leaves):
            return True
        try:
            data = self._data[_end(chunk) - chunk.nbytes : _end(chunk)]
            return _tiles.damaged(leaves[leaf], chunk, data) is not None
        except ValueError:
            return True

    def wait(self) -> None:
        """Returns once no queued check runs any more."""
        concurrent.futures.wait(self._jobs)

    def damaged(self) -> str:
        """After `wait`: why the received slab is refused, or "" if every chunk matched."""
        bad = [b for job in self._jobs for b in job.result()]
        if not bad:
            return ""
        first = _describe(self._manifest, *bad[0])
        more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
        return (
            f"{first}{more} does not match the checksum in the pushed manifest: the "
            f"{self._size}-byte slab was damaged in transit or changed while it was sent. "
            "Nothing was kept."
        )


def _chunks(manifest: _format.PartManifest) -> list[tuple[int, _format.ChunkRecord]]:
    """(leaf index, chunk) for every chunk of a part."""
    return [(leaf, c) for leaf, cs in sorted(manifest.chunks.items()) for c in cs]


def _end(chunk: _format.ChunkRecord) -> int:
    """Where a chunk ends in its slab (checked to have an offset before any use)."""
    return (chunk.offset or 0) + chunk.nbytes


def _describe(manifest: _format.PartManifest, leaf: int, chunk: _format.ChunkRecord) -> str:
    path = manifest.leaves[leaf].path if 0 <= leaf < len(manifest.leaves) else f"#{leaf}"
    where = (
        f", bytes [{chunk.offset}, {_end(chunk)}) of the slab" if chunk.offset is not None else ""
    )
    return f"Chunk {list(chunk.index)} of leaf {path!r} (step {manifest.step}{where})"
