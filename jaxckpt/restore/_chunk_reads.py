"""Reading one planned step's verified chunks: where from, and the fallback on failure.

A region of a leaf is read tile by tile (`_tiles`: a chunk saved whole is one tile):
only the tiles that intersect it, each from the parts that hold its chunk, each
part from its sources fastest first (`_plan.StepPlan`): own memory, a peer's
memory, persistent storage (`reader_factory`). A tile's bytes are checked against
its CRC-32C; on any error the next source is tried for that tile alone, and a copy
whose bytes failed their checksum is told to `on_damaged` once (`quarantiner`) so
that it is not offered again. A step in this process's memory tier is pinned while
it is read (`pin_memory`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import numpy as np
from absl import logging as log

from jaxckpt import _resources
from jaxckpt.coord import _multihost, _plan
from jaxckpt.format import _chunking, _format, _tiles
from jaxckpt.memory import _landing, _memory_tier, _quarantine, _readers
from jaxckpt.persistent import _storage, _zarr_reader
from jaxckpt.restore import _assembly

ReaderFor = Callable[[_plan.Source, int], _readers.ChunkReader]  # (source, owner) -> reader
# (source, owner, what is wrong): told once per copy whose bytes failed their checksum.
OnDamaged = Callable[[_plan.Source, int, str], None]

# Chunks of one leaf are read in parallel from this many bytes on (below, the
# hand-off to a thread costs more than it saves).
_PARALLEL_BYTES = 4 << 20
_TASK_BYTES = 2 << 20  # tiles read (and copied into place) by one task
_POOL: Final = _resources.SHARED.pool(min(8, os.cpu_count() or 1), "jaxckpt-restore")


class ChunkUnavailableError(OSError):
    """No source of a chunk gave verified bytes."""


class PeerRanges(Protocol):
    """What a restore needs of a run's peers: byte ranges of a held slab, and telling
    a holder that its copy gave bytes that failed their checksum."""

    def slab_range_reader(self, holder: int, step: int, owner: int) -> Callable[..., None]: ...

    def report_damaged(self, holder: int, step: int, owner: int, why: str) -> None: ...


def quarantiner(
    memory: _memory_tier.MemoryTier, peers: PeerRanges | None, step: int, process_index: int
) -> OnDamaged:
    """The `Restorer`'s `on_damaged` for one step: a copy in this process's memory tier
    that gave bytes failing their checksum is quarantined here; a peer's copy is
    checked (and quarantined) by its holder, told through its peer service. Either
    way no inventory offers it again, so a resumed job does not pick that copy (or,
    without another one, that step) again."""

    def on_damaged(source: _plan.Source, owner: int, why: str) -> None:
        if source.tier == _plan.MEMORY:
            _quarantine.quarantine(memory.part_dir(step, owner), why, process_index)
        elif source.tier == _plan.PEER and peers is not None and source.holder is not None:
            peers.report_damaged(source.holder, step, owner, why)

    return on_damaged


def reader_factory(
    item_dir: Path,
    memory: _memory_tier.MemoryTier,
    peers: PeerRanges | None,
    step: int,
    manifests: Mapping[int, _format.PartManifest] | None = None,
    process_index: int | None = None,
    timeout_s: float = 120.0,
) -> ReaderFor:
    """The chunk reader of each (source, owner) of one step's plan: own memory (its slab,
    lent to the restore), a peer's memory (byte ranges, received into a landing slab
    lent to the restored arrays: `_landing`, all of `process_index`'s own part at
    once; into new buffers without the part's manifest in `manifests`), or
    persistent storage."""

    def reader_for(source: _plan.Source, owner: int) -> _readers.ChunkReader:
        if source.tier == _plan.MEMORY:
            return _readers.SlabReader(memory.slab(step, owner), memory.lend(step, owner))
        if source.tier == _plan.PEER and peers is not None and source.holder is not None:
            fetch = peers.slab_range_reader(source.holder, step, owner)
            manifest = (manifests or {}).get(owner)
            landing = _landing.landing_for(memory, manifest) if manifest is not None else None
            if landing is None or manifest is None:
                return _readers.RangeReader(fetch)
            # Its own part is what a process restoring after a node loss onto the saving
            # layout needs whole: received at once. Onto another process count, the
            # restore asks for the runs of tiles it needs (`ChunkReads._prefetch`).
            own = owner == process_index and (
                _format.saved_process_count(manifests or {}) == _multihost.process_count()
            )
            spans = _landing.spans_of(manifest) if own else []
            return _landing.LandingReader(fetch, landing, spans, timeout_s)
        if source.tier == _plan.PERSISTENT:
            return _zarr_reader.ZarrReader(
                _storage.kvstore(item_dir / _format.part_dir_name(owner))
            )
        raise ValueError(f"No reader for {source.describe()}.")

    return reader_for


def pin_memory(
    memory: _memory_tier.MemoryTier, plan: _plan.StepPlan, process_index: int
) -> tuple[_plan.StepPlan, _memory_tier.Pin | None]:
    """Pins the planned step in this process's memory tier while it is restored, if
    the tier holds parts of it.

    Its slabs are read in place and lent to the restored arrays (and the peers
    read theirs): the pin keeps the step from being retired (and its slabs
    refilled) meanwhile. A step that cannot be pinned is not read from this
    tier: the plan without it, logged. A tier `prepare` could not write offers
    nothing (`memory_parts`) and is not pinned.

    Returns:
      The plan to read with, and the pin to release once read (None: no pin).
    """
    if memory.unwritable is not None or not memory.parts(plan.step):
        return plan, None
    try:
        return plan, memory.pin(plan.step)
    except OSError as e:
        log.warning(
            "jaxckpt: [process %d] the restore of step %d skips the memory tier %s: the "
            "step cannot be pinned there while it is read (%s); reading its parts from "
            "peers and persistent storage instead.",
            process_index,
            plan.step,
            memory.run_dir,
            e,
        )
        return plan.without(_plan.MEMORY), None


class ChunkReads:
    """Reads the verified chunks of one planned step, each from the first source that
    gives bytes matching their checksum; synchronous, with one bounded thread pool for
    a leaf's chunks (a leaf of small chunks is read inline, a large one in parallel).

    Attributes:
      bytes_by_tier: bytes read from each tier.
      bytes_needed: bytes of the distinct regions asked for (`read_regions`): what a
        read of exactly the target's bytes would read.
      failures: what went wrong with each source that a chunk fell back from.
    """

    def __init__(
        self,
        plan: _plan.StepPlan,
        reader_for: ReaderFor,
        process_index: int,
        redact: Callable[[str], str] = str,
        timeout_s: float = 120.0,
        on_damaged: OnDamaged | None = None,
    ):
        self._plan = plan
        self._on_damaged = on_damaged
        self._damaged: set[tuple[_plan.Source, int]] = set()  # told to `on_damaged` already
        self._redact = redact
        self._reader_for = reader_for
        self._process_index = process_index
        self._owners_of = plan.chunk_owner(process_index)  # its own part first
        self._readers: dict[tuple[_plan.Source, int], _readers.ChunkReader] = {}
        self._chunk_records: dict[tuple[int, int], dict[tuple[int, ...], _format.ChunkRecord]] = {}
        self._tile_lists: dict[tuple[int, int, tuple[int, ...]], list[_tiles.Tile]] = {}
        self._lock = threading.Lock()
        self.bytes_by_tier: dict[str, int] = {}
        self.bytes_needed = 0
        self.failures: list[str] = []
        self._timeout_s = timeout_s
        self._dead: set[_plan.Source] = set()  # sources that did not answer in time

    def finish(self) -> None:
        """Lets go of what the readers hold for this restore once its arrays are placed
        (a landing slab's page-making thread, the pages of chunks never received); the
        restored arrays keep the pages they use."""
        with self._lock:
            readers = list(self._readers.values())
        for reader in readers:
            finish = getattr(reader, "finish", None)
            if finish is not None:
                finish()

    def _reader(self, source: _plan.Source, owner: int) -> _readers.ChunkReader:
        key = (source, owner)
        with self._lock:  # leaves are read on several threads
            reader = self._readers.get(key)
            if reader is None:
                reader = self._readers[key] = self._reader_for(source, owner)
        return reader

    def _saved_chunks(self, owner: int, leaf: int) -> dict[tuple[int, ...], _format.ChunkRecord]:
        """index -> record of the chunks of `leaf` in the part of `owner`."""
        key = (owner, leaf)
        found = self._chunk_records.get(key)
        if found is None:
            saved = self._plan.manifests[owner].chunks.get(leaf, ())
            found = self._chunk_records[key] = {c.index: c for c in saved}
        return found

    def _tiles_of(self, leaf: int, index: tuple[int, ...], owner: int | None) -> list[_tiles.Tile]:
        """The tiles of chunk `index` of `leaf`, as the first part that holds it records
        them (every copy of a chunk is cut alike)."""
        owners = (owner,) if owner is not None else self._owners_of((leaf, index), True)
        for o in owners:
            chunk = self._saved_chunks(o, leaf).get(index)
            if chunk is not None:
                return self._chunk_tiles(o, leaf, chunk)
        record = self._plan.leaves[leaf]
        raise ChunkUnavailableError(
            f"Chunk {index} of {record.path} is in no part of step {self._plan.step}"
            + (f" (looked in the part of process {owner})." if owner is not None else ".")
        )

    def _chunk_tiles(self, owner: int, leaf: int, chunk: _format.ChunkRecord) -> list[_tiles.Tile]:
        """The tiles of `owner`'s copy of `chunk` of `leaf` (worked out once)."""
        key = (owner, leaf, chunk.index)
        found = self._tile_lists.get(key)
        if found is None:
            found = self._tile_lists[key] = _tiles.tiles(self._plan.leaves[leaf], chunk)
        return found

    def _read_tile(
        self, leaf: int, index: tuple[int, ...], tile: int, owner: int | None = None
    ) -> np.ndarray:
        """Verified tile `tile` of chunk `index`: from `owner`'s part (a per-process
        leaf), else from the parts that hold it, in the plan's order
        (`StepPlan.chunk_owners`), each from its sources fastest first."""
        record = self._plan.leaves[leaf]
        key = (leaf, index)
        owners = (owner,) if owner is not None else self._owners_of(key, False)
        tried: list[str] = []
        data = self._read_from(leaf, record, index, tile, owners, tried)
        if data is None and owner is None and tried:  # its own copy failed: any other
            others = tuple(o for o in self._owners_of(key, True) if o not in owners)
            owners += others
            data = self._read_from(leaf, record, index, tile, others, tried)
        if data is not None:
            return data
        where = f"chunk {index}" if tile == 0 else f"tile {tile} of chunk {index}"
        if not tried:
            raise ChunkUnavailableError(
                f"{where.capitalize()} of {record.path} is in no part of step {self._plan.step}"
                + (f" (looked in the part of process {owner})." if owner is not None else ".")
            )
        parts = ", ".join(str(o) for o in owners)
        raise ChunkUnavailableError(
            f"[process {self._process_index}] No verified copy of {where} of {record.path} "
            f"(part of process {parts}) at step {self._plan.step}: " + "; ".join(tried)
        )

    def _read_from(
        self,
        leaf: int,
        record: _format.LeafRecord,
        index: tuple[int, ...],
        tile: int,
        owners: tuple[int, ...],
        tried: list[str],
    ) -> np.ndarray | None:
        """The tile from the first of `owners`' parts that holds its chunk and gives
        verified bytes; None (each failure added to `tried`) where none does."""
        for o in owners:
            expected = self._saved_chunks(o, leaf).get(index)
            if expected is not None:
                tiles = self._chunk_tiles(o, leaf, expected)
                if tile >= len(tiles):
                    tried.append(f"part of process {o}: its chunk {index} has no tile {tile}")
                    continue
                data = self._read_copy(leaf, record, o, expected, tiles[tile], tried)
                if data is not None:
                    return data
        return None

    def _read_copy(
        self,
        leaf: int,
        record: _format.LeafRecord,
        owner: int,
        expected: _format.ChunkRecord,
        tile: _tiles.Tile,
        tried: list[str],
    ) -> np.ndarray | None:
        """The tile from the first source of `owner`'s part that gives verified bytes;
        None (each failure added to `tried`) where none does."""
        sources = self._plan.sources.get(owner, ())
        if not sources:
            tried.append(f"part of process {owner}: no source holds it")
        for source in sources:
            if source in self._dead:
                tried.append(f"{source.describe()}: gave no answer earlier in this restore")
                continue
            try:
                reader = self._reader(source, owner)
                data = reader.read(leaf, record, expected, tile, self._timeout_s)
            except TimeoutError as e:
                self._dead.add(source)
                # The reader's own message states the bound it waited for (a peer's range
                # read waits half the timeout), not the restore's.
                why = self._redact(str(e)) or f"no answer within {self._timeout_s:g} s"
                tried.append(f"{source.describe()}: {why}")
                continue
            except _readers.ChecksumMismatchError as e:
                tried.append(f"{source.describe()}: {self._redact(str(e))}")
                self._damaged_copy(source, owner, str(e))
                continue
            except Exception as e:
                tried.append(f"{source.describe()}: {self._redact(str(e))}")
                continue
            # A reader that checks as it receives has raised on a mismatch already.
            checked = getattr(reader, "verifies_checksums", False)
            if not checked and not tile.matches(data):
                tried.append(f"{source.describe()}: checksum mismatch")
                what = _tiles.describe(expected, tile)
                self._damaged_copy(source, owner, f"checksum mismatch of {what} of {record.path}")
                continue
            with self._lock:
                self.bytes_by_tier[source.tier] = (
                    self.bytes_by_tier.get(source.tier, 0) + data.nbytes
                )
                self.failures.extend(tried)
            if tried:
                log.warning(
                    "jaxckpt: %s of %s: fell back to %s after %s",
                    _tiles.describe(expected, tile),
                    record.path,
                    source.describe(),
                    tried,
                )
            return data
        return None

    def _prefetch(
        self,
        leaf: int,
        keys: Sequence[_assembly.Key],
        tiles: Mapping[_assembly.Key, _tiles.Tile],
        owner: int | None,
    ) -> None:
        """Starts reading `keys` (tiles) at once where the first source of the first part
        that holds them can (a persisted array's tiles: ranged reads on a pool; a peer's:
        a request a run; own memory: the pages of each run mapped in one call); each is
        still checked, and falls back alone, when it is read."""
        by_chunk: dict[tuple[int, ...], list[_tiles.Tile]] = {}
        for i, k in keys:
            by_chunk.setdefault(i, []).append(tiles[i, k])
        for i, wanted in by_chunk.items():
            owners = (owner,) if owner is not None else self._owners_of((leaf, i), False)
            for o in owners:
                chunk = self._saved_chunks(o, leaf).get(i)
                sources = [s for s in self._plan.sources.get(o, ()) if s not in self._dead]
                if chunk is None or not sources:
                    continue
                try:
                    reader = self._reader(sources[0], o)
                except Exception:
                    break  # the reads say why, and fall back
                prefetch = getattr(reader, "prefetch", None)
                if prefetch is not None:
                    prefetch(leaf, self._plan.leaves[leaf], chunk, wanted)
                break

    def _damaged_copy(self, source: _plan.Source, owner: int, why: str) -> None:
        """Tells `on_damaged` (once per copy) that `source`'s copy of `owner`'s part
        failed a checksum, so that it is quarantined and not offered again."""
        with self._lock:
            if self._on_damaged is None or (source, owner) in self._damaged:
                return
            self._damaged.add((source, owner))
        try:
            self._on_damaged(source, owner, why)
        except Exception as e:  # the restore goes on with the other copies either way
            log.warning(
                "jaxckpt: [process %d] could not quarantine the damaged copy of part %d of "
                "step %d (%s): %s",
                self._process_index,
                owner,
                self._plan.step,
                source.describe(),
                self._redact(str(e)),
            )

    def read_regions(
        self, leaf: int, regions: Sequence[_chunking.Region], owner: int | None = None
    ) -> list[np.ndarray]:
        """The verified saved bytes of each of `regions` of `leaf` (in its stored shape and
        dtype): only the tiles they intersect are read, each once (`owner`: the part to
        read a per-process leaf from)."""
        record = self._plan.leaves[leaf]
        assert (
            record.stored_shape is not None
            and record.chunk_shape is not None
            and record.stored_dtype
        )
        shape, chunk_shape = record.stored_shape, record.chunk_shape
        itemsize = np.dtype(record.stored_dtype).itemsize
        # Each region's tiles: those of the chunks it overlaps that it intersects.
        tiles_of: dict[tuple[int, ...], list[_tiles.Tile]] = {}
        wanted: list[list[tuple[tuple[int, ...], _tiles.Tile]]] = []
        for region in regions:
            found: list[tuple[tuple[int, ...], _tiles.Tile]] = []
            for i in _chunking.chunks_overlapping(region, shape, chunk_shape):
                if i not in tiles_of:
                    tiles_of[i] = self._tiles_of(leaf, i, owner)
                found.extend((i, t) for t in _tiles.overlapping(tiles_of[i], region))
            wanted.append(found)
        with self._lock:
            self.bytes_needed += itemsize * sum(
                math.prod(s.stop - s.start for s in r) for r in regions
            )
        into = _assembly.Assembly(regions, wanted, np.dtype(record.stored_dtype))

        def read(keys: Sequence[_assembly.Key]) -> None:
            for key in keys:
                into.place(key, self._read_tile(leaf, key[0], key[1], owner))

        keys = sorted(into.needed)
        self._prefetch(leaf, keys, into.needed, owner)
        if len(keys) > 1 and sum(t.nbytes for t in into.needed.values()) >= _PARALLEL_BYTES:
            for _ in _POOL.map(read, _assembly.batches(keys, into.needed, _TASK_BYTES)):
                pass  # (raises the first failure)
        else:
            read(keys)
        return into.finish()
