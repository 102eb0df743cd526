"""Arrays built from a step's verified chunks, in the target's sharding, on any mesh.

For each target shard (any sharding, any process count) only the chunks that
intersect this process's target shards are read (`_chunk_reads`, verified, with
fallback). A per-process leaf (every part holds its own value) is read from the one
owner the caller names. A leaf replicated across processes is read 1/R a process
(`_read_layout`) and left in that layout (`Placed.resharding`): the reshard onto
its target is a collective, the restore choreography's exchange `reshard`. The
engine itself only reads and places bytes on this process's devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Final

import jax
import numpy as np

from jaxckpt import _resources
from jaxckpt.coord import _plan, _read_layout, _replicas
from jaxckpt.format import _chunking, _format, _sharding
from jaxckpt.restore import _chunk_reads


class Restorer:
    """Reads the leaves of one planned step into the shapes and shardings of a target.

    Synchronous: its verified chunks come from `chunks` (`_chunk_reads.ChunkReads`); a
    large leaf is read on a thread while the next leaves are asked for.
    """

    def __init__(
        self,
        plan: _plan.StepPlan,
        reader_for: _chunk_reads.ReaderFor,
        process_index: int,
        redact: Callable[[str], str] = str,
        timeout_s: float = 120.0,
        on_damaged: _chunk_reads.OnDamaged | None = None,
        spread: bool = False,
        from_persistent: bool = False,
    ):
        """`spread`: a leaf replicated across processes is read 1/R a process (several
        processes: every process restores, and their plans and targets agree), left in
        that layout by `place` for the reshard onto its target (`Placed.resharding`).

        `from_persistent`: some part of the step is in no process's memory, so the job
        reads from persistent storage (the same on every process: the inventories'
        exchange). Its replicated leaves of saved chunks of `_replicas.MIN_CHUNK_BYTES`
        on are then read in whole saved chunks where the target's split would have two
        processes read one chunk (`_read_layout.read_layout(whole_chunks=True)`). From
        memory and peers, and for smaller chunks, a chunk read twice costs less than a
        read layout of its own (a program to compile, a reshard that moves more).
        """
        self._plan = plan
        self._whole_chunks = from_persistent
        self._spread = spread
        self.chunks = _chunk_reads.ChunkReads(
            plan, reader_for, process_index, redact, timeout_s, on_damaged
        )

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes read from each tier."""
        return self.chunks.bytes_by_tier

    @property
    def bytes_needed(self) -> int:
        """Bytes of the distinct regions read (what reading exactly them would read)."""
        return self.chunks.bytes_needed

    @property
    def failures(self) -> list[str]:
        """What went wrong with each source that a chunk fell back from."""
        return self.chunks.failures

    def finish(self) -> None:
        """Lets go of what the readers hold for this restore once its arrays are placed
        (`ChunkReads.finish`)."""
        self.chunks.finish()

    # ---- leaves -------------------------------------------------------------

    def array(
        self, leaf: int, sharding: jax.sharding.Sharding, owner: int | None = None
    ) -> Deferred:
        """The saved array leaf, laid out with `sharding` (any mesh), read to host: put
        on its devices by `place`, together with the others.

        `owner` names the part to read a per-process leaf from.
        """
        record = self._plan.leaves[leaf]
        assert record.stored_shape is not None and record.shape is not None
        data_sharding = _data_sharding(record, sharding)
        # Replicated across processes: each of the R reads a distinct 1/R, and a collective
        # over the replica axes carries it to the others (`place`): no byte read twice.
        layout = (
            _layout(record, data_sharding, self._whole_chunks)
            if owner is None and self._spread
            else None
        )
        read_as = layout.sharding if layout is not None else data_sharding
        shape = layout.shape if layout is not None else tuple(record.stored_shape)
        index_map = read_as.addressable_devices_indices_map(shape)
        regions = [_chunking.normalize_region(r or (), shape) for r in index_map.values()]
        # Replicated targets ask for the same region on many devices: read it once. A
        # padded layout's region is a part of the stored array, filled out with zeros.
        unique = {_chunking.region_key(r): r for r in regions}
        stored = {
            key: layout.stored_region(r) if layout is not None else r for key, r in unique.items()
        }
        wanted = (  # a slot of padding alone reads nothing
            stored
            if layout is None
            else {k: r for k, r in stored.items() if all(s.stop > s.start for s in r)}
        )

        def read() -> dict[tuple[tuple[int, int], ...], np.ndarray]:
            regions = self.chunks.read_regions(leaf, list(wanted.values()), owner)
            got = dict(zip(wanted, regions, strict=True))
            if layout is None:
                return got
            dtype = np.dtype(record.stored_dtype)
            return {
                k: layout.pad(
                    got[k] if k in got else np.zeros([s.stop - s.start for s in stored[k]], dtype),
                    r,
                )
                for k, r in unique.items()
            }

        assert record.stored_dtype is not None
        itemsize = np.dtype(record.stored_dtype).itemsize
        nbytes = itemsize * sum(math.prod(s.stop - s.start for s in r) for r in wanted.values())
        reading: concurrent.futures.Future[dict[tuple[tuple[int, int], ...], np.ndarray]]
        if nbytes >= _BACKGROUND_LEAF_BYTES:
            reading = LEAF_POOL.submit(read)  # while the next leaves are asked for
        else:
            reading = concurrent.futures.Future()
            reading.set_result(read())
        return Deferred(record, read_as, reading, data_sharding if layout else None, shape, layout)

    def place(self, values: list[Any]) -> Placed:
        """`values` with every `Deferred` among them put on this process's devices as a
        jax.Array, once every leaf is read: one `make_array_from_callback` a leaf, which
        puts all its host buffers on their devices in one call (a `device_put` per shard
        costs ~0.4 ms: seconds for a tree of thousands of leaves). Leaves read 1/R a
        process (`array`) stay in their read layout, listed for the reshard onto their
        targets (`Placed.resharding`); nothing here involves another process."""
        out: list[Any] = list(values)
        deferred = [(k, v) for k, v in enumerate(values) if isinstance(v, Deferred)]
        try:
            pending = [(k, d, d.reading.result()) for k, d in deferred]
        except BaseException:
            # IMPORTANT: no read may still run when the restore fails (and unpins the step).
            for _, d in deferred:
                d.reading.cancel()
            concurrent.futures.wait([d.reading for _, d in deferred])
            raise
        spread: list[tuple[int, jax.Array, jax.sharding.Sharding, Deferred]] = []
        for k, d, bufs in pending:
            shape = d.shape

            def shard(index: Any, bufs: Any = bufs, shape: Any = shape) -> np.ndarray:
                return bufs[_chunking.region_key(_chunking.normalize_region(index, shape))]

            data = jax.make_array_from_callback(shape, d.sharding, shard)
            if d.then is not None:
                spread.append((k, data, d.then, d))
                continue
            out[k] = _with_key_impl(data, d.record)
        resharding = _read_layout.Resharding(
            tuple(data for _, data, _, _ in spread),
            tuple(target for _, _, target, _ in spread),
            tuple(d.layout for *_, d in spread),
        )
        return Placed(out, resharding, tuple((k, d.record) for k, *_, d in spread))

    def host_array(self, leaf: int, owner: int | None = None) -> np.ndarray:
        """The whole saved array leaf as one numpy array (`owner`: as for `array`)."""
        record = self._plan.leaves[leaf]
        assert record.stored_shape is not None
        whole = tuple(slice(0, n) for n in record.stored_shape)
        return self.chunks.read_regions(leaf, [whole], owner)[0]


def _data_sharding(record: _format.LeafRecord, sharding: jax.sharding.Sharding) -> Any:
    """The sharding of a leaf's stored data: a typed PRNG key's key data has trailing dims."""
    assert record.stored_shape is not None and record.shape is not None
    if not record.key_impl:
        return sharding
    return _sharding.with_trailing_dims(sharding, len(record.stored_shape) - len(record.shape))


def _layout(
    record: _format.LeafRecord, data_sharding: jax.sharding.Sharding, from_persistent: bool
) -> _read_layout.ReadLayout | None:
    """How the replicas of a leaf share its read (`_read_layout.read_layout`); from
    persistent storage in whole saved chunks where they are large (see `Restorer`)."""
    assert record.stored_shape is not None
    whole_chunks = (
        from_persistent
        and record.chunk_shape is not None
        and math.prod(record.chunk_shape) * np.dtype(record.stored_dtype).itemsize
        >= _replicas.MIN_CHUNK_BYTES
    )
    return _read_layout.read_layout(
        data_sharding, record.stored_shape, record.chunk_shape, whole_chunks
    )


def compile_reshard(
    leaves: list[tuple[_format.LeafRecord, jax.sharding.Sharding]], from_persistent: bool = False
) -> int:
    """Compiles, without running it, the reshard that `Restorer.place` runs for these leaves
    (a restore's array leaves in the target's order, read onto these shardings by all the
    processes of this job): the restore then finds the program compiled. Local: no read,
    no exchange, no collective.

    Returns:
        How many of the leaves the reshard carries (0: the restore runs none).
    """
    if jax.process_count() == 1:
        return 0  # nothing is replicated across processes (`Restorer` takes no agreement)
    read, targets, layouts = [], [], []
    for record, sharding in leaves:
        data_sharding = _data_sharding(record, sharding)
        layout = _layout(record, data_sharding, from_persistent)
        if layout is not None:
            dtype = np.dtype(record.stored_dtype)
            read.append(jax.ShapeDtypeStruct(layout.shape, dtype, sharding=layout.sharding))
            targets.append(data_sharding)
            layouts.append(layout)
    if read:
        _read_layout.compile_reshard(read, targets, layouts)
    return len(read)


@dataclasses.dataclass
class Deferred:
    """An array leaf being read to host (a large one on a thread, while the next
    leaves are asked for), one buffer per distinct target region; not yet placed."""

    record: _format.LeafRecord
    sharding: jax.sharding.Sharding
    reading: concurrent.futures.Future[dict[tuple[tuple[int, int], ...], np.ndarray]]
    then: jax.sharding.Sharding | None = None  # the target, resharded onto from `sharding`
    shape: tuple[int, ...] = ()  # of the array read (a padded read layout's: see `layout`)
    layout: _read_layout.ReadLayout | None = None  # how the replicas shared the read


@dataclasses.dataclass(frozen=True)
class Placed:
    """Every leaf on this process's devices (`values`), but those read 1/R a process:
    they are in their read layout, listed in `resharding` for the collective that
    carries them onto their targets; `resharded` puts its result in their places."""

    values: list[Any]
    resharding: _read_layout.Resharding
    _spread: tuple[tuple[int, _format.LeafRecord], ...] = ()  # (position, record) of each

    def resharded(self, arrays: Sequence[jax.Array]) -> list[Any]:
        """`values`, with the leaves of `resharding` replaced by `arrays` (their targets')."""
        out = list(self.values)
        for (k, record), whole in zip(self._spread, arrays, strict=True):
            out[k] = _with_key_impl(whole, record)
        return out


def _with_key_impl(data: jax.Array, record: _format.LeafRecord) -> Any:
    """`data` as typed PRNG keys where the leaf was saved as such."""
    return jax.random.wrap_key_data(data, impl=record.key_impl) if record.key_impl else data


# Leaves of this many bytes on are read on `LEAF_POOL`, several at once (a peer's
# byte ranges overlap their round trips and checks); smaller ones inline, where a
# hand-off would cost more than the read.
_BACKGROUND_LEAF_BYTES = 1 << 20
LEAF_POOL: Final = _resources.SHARED.pool(min(4, os.cpu_count() or 1), "jaxckpt-restore-leaf")
