"""One part on its way to persistent storage, and what every store does with it.

A `PersistJob` is the typed request the persistence queue (`_persister`) hands to
the store the part goes to (`_store.PersistentStore.persist`). Whatever the store,
persisting a part waits for the save that queued it to end its commit
(`PersistJob.await_commit`), writes the part's chunks from its memory slab as
zarr3 arrays, each checked against its CRC-32C first (`write_chunks`), and ends
with one `persist` event (`persist_metrics`); how the part is then made durable is
the store's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from jaxckpt.format import _array_keys, _chunking, _format, _tiles
from jaxckpt.memory import _memory_tier, _readers, _slab
from jaxckpt.persistent import _step_dirs, _zarr


@dataclasses.dataclass(frozen=True)
class PersistJob:
    """Persist one committed memory part into a (soon to be final) item directory."""

    manifest: _format.PartManifest
    source_part: Path
    item_dir: Path  # where the manager is writing the step now
    final_item_dir: Path  # where it will be once the manager finalizes the step
    pin: _memory_tier.Pin | None = None  # memory-tier pin on the source step, released when done
    # Made for a step finalized before the job (`_persister.part_job`: resumed after a
    # restart by `_recovery.Recovery`, or the newest step at `release_memory`): its
    # deletion since (nobody restores it any more) is no failure.
    resumed: bool = False
    # Set by the save once its commit ended (True: it succeeded); the job is queued as
    # soon as the part is in memory, and makes nothing durable before it is True.
    committed: concurrent.futures.Future[bool] | None = None

    def await_commit(self, timeout_s: float) -> None:
        """Waits until the save that queued this job has ended its commit.

        Raises:
          StepNeverFinalized: if that commit failed (the save said so; not a
            persistence failure).
          TimeoutError: if it does not end within `timeout_s`.
        """
        if self.committed is None:
            return
        step = self.manifest.step
        try:
            ok = self.committed.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"The save of step {step} did not end its commit within {timeout_s:.0f} s."
            ) from None
        if not ok:
            raise _step_dirs.StepNeverFinalized(
                f"The save of step {step} failed after its part was in memory (the save "
                "raised why); it is not persisted."
            )


async def write_chunks(
    manifest: _format.PartManifest,
    source: Path,
    dst: dict[str, Any],
    compression: str | None,
    *,
    empty: bool = False,
) -> None:
    """Writes every chunk of a memory part's slab into the part's zarr3 arrays at the
    kvstore `dst`, from views of the slab (no copy on the way), each verified first.

    Raises:
      ValueError: if a chunk does not match its checksum (nothing of it is written).
    """
    slab = _slab.Reader(source / _slab.SLAB_FILE)
    views: dict[int, list[tuple[_chunking.Region, np.ndarray]]] = {}
    for leaf, chunks in manifest.chunks.items():
        record = manifest.leaves[leaf]
        for chunk in chunks:
            for tile in _tiles.tiles(record, chunk):
                view = _readers.tile_view(slab, record, chunk, tile)
                if not tile.matches(view):
                    raise ValueError(
                        f"{_tiles.describe(chunk, tile).capitalize()} of leaf {record.path} in "
                        f"{source} does not match its checksum; the part was not persisted."
                    )
                views.setdefault(leaf, []).append((tile.region, view))
    await _zarr.settle(
        [
            _zarr.write_chunks(
                _zarr.array_kvstore(dst, manifest.leaves[leaf]),
                manifest.leaves[leaf],
                data,
                compression,
                empty=empty,
                crc32c=True,
                attributes=_array_keys.array_attributes(
                    manifest.leaves[leaf],
                    manifest.step,
                    manifest.owner,
                    manifest.shardings.get(leaf),
                ),
            )
            for leaf, data in views.items()
        ]
    )


def with_persist_time(manifest: _format.PartManifest, copy_s: float) -> _format.PartManifest:
    """`manifest` recording `copy_s`, the time its chunks took to write, as `persist_s`."""
    return dataclasses.replace(manifest, metrics={**manifest.metrics, "persist_s": copy_s})


def persist_metrics(
    manifest: _format.PartManifest, copy_s: float, **extra: float
) -> dict[str, Any]:
    """The `persist` event of one part; `copy_s` is the time spent copying (or
    uploading) and verifying its chunks, as recorded in the part's manifest."""
    return {
        "event": "persist",
        "step": manifest.step,
        "process": manifest.owner,
        "bytes": manifest.nbytes,
        "persist_s": copy_s,
        "persist_bytes_per_s": manifest.nbytes / max(copy_s, 1e-9),
        **extra,
    }
