"""Copies that failed their checksums: found, and never offered again.

A memory-tier part (a process's own, or a replica it holds for a peer) whose
slab no longer matches the CRC-32Cs of its manifest (a flipped bit in RAM, a
stray write) cannot be restored. A restore that reads it falls back to another
copy of the same chunk; so that a *resumed* job does not pick the same step and
fail again, the part is quarantined where it lies: an empty marker file in the
part directory, which `MemoryTier.parts` (and so every inventory, every restore
plan and `latest_restorable_step`) honours. The marker is made empty first, so it
needs no page of the tier (a full tmpfs can still be marked); the reason and the
marking process are then written into it where they fit (`recorded`, which the
`jaxckpt ls`/`verify` tools show). It survives the process (tmpfs outlives it) and
goes with the step when retention removes it.

Who marks: the process that read the bad bytes from its own tier; the holder of
a peer copy, told by the process that read the bad bytes from it (which marks
nothing itself: bytes damaged in transit are not the holder's copy), after it
checked its own copy again (`check_and_quarantine`); and every process, for
every part it holds, on `latest_restorable_step(mngr, verify=True)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Final

from jaxckpt.format import _format, _tiles
from jaxckpt.memory import _slab

log = logging.getLogger(__name__)

MARKER: Final = ".corrupt"


def is_quarantined(part_dir: Path) -> bool:
    """Whether the part at `part_dir` was found damaged."""
    return (part_dir / MARKER).exists()


def recorded(part_dir: Path) -> tuple[str | None, int | None]:
    """(why, the process that marked it) as the marker of the quarantined part at
    `part_dir` records them; None for what it does not record (a marker written by an
    older jaxckpt, or on a tier too full for its text).

    Raises:
      OSError: if the marker cannot be read (it is gone: the step was removed).
    """
    text = (part_dir / MARKER).read_text(errors="replace")
    try:
        record = json.loads(text)
    except ValueError:  # empty (an older jaxckpt's, a full tier's) or half-written
        return None, None
    if not isinstance(record, dict):
        return None, None
    why, process = record.get("why"), record.get("process")
    return (
        why if isinstance(why, str) and why else None,
        process if isinstance(process, int) else None,
    )


def damage(part_dir: Path) -> str | None:
    """What is wrong with the part at `part_dir` (its first chunk whose bytes do not
    match the CRC-32C its manifest records, or an unreadable manifest), or None if
    every chunk checks out. Reads the whole slab: its size at CRC-32C speed.

    Raises:
      OSError: if the part cannot be read at all (it is gone, an I/O error).
    """
    try:
        manifest = _format.PartManifest.from_json((part_dir / _format.MANIFEST_FILE).read_bytes())
    except ValueError as e:
        return f"its manifest is damaged ({e})"
    chunks = [
        (leaf, c)
        for leaf, cs in sorted(manifest.chunks.items())
        for c in cs
        if c.offset is not None and (c.crc32c is not None or c.tiles is not None)
    ]
    slab = part_dir / _slab.SLAB_FILE
    size = slab.stat().st_size
    for leaf, c in chunks:
        assert c.offset is not None
        if c.offset + c.nbytes > size:
            return (
                f"chunk {c.index} of {manifest.leaves[leaf].path} ends at byte "
                f"{c.offset + c.nbytes}, past the end of its slab ({size} bytes)"
            )
    tiles = [_tiles.tiles(manifest.leaves[leaf], c) for leaf, c in chunks]
    crcs = _slab.checksums(
        slab,
        [c.offset or 0 for _, c in chunks],
        [c.nbytes for _, c in chunks],
        tiles=[[t.nbytes for t in ts] for ts in tiles],
    )
    for (leaf, c), got, expected in zip(chunks, crcs, tiles, strict=True):
        for crc, tile in zip(got, expected, strict=True):
            if crc != tile.crc32c:
                what = _tiles.describe(c, tile)
                return f"checksum mismatch of {what} of {manifest.leaves[leaf].path}"
    return None


def quarantine(part_dir: Path, why: str, process_index: int) -> bool:
    """Marks the part at `part_dir` damaged, so that no inventory offers it again;
    False (logged) if the marker cannot be written (a read-only tier)."""
    try:
        (part_dir / MARKER).touch()
    except OSError as e:
        log.warning(
            "jaxckpt: [process %d] the memory-tier copy %s is damaged (%s) but cannot be "
            "quarantined: %s. Restores fall back to other copies while it lasts.",
            process_index,
            part_dir,
            why,
            e,
        )
        return False
    with contextlib.suppress(OSError):  # the reason, for the tools; marked already
        (part_dir / MARKER).write_text(json.dumps({"why": why, "process": process_index}))
    log.warning(
        "jaxckpt: [process %d] quarantined the memory-tier copy %s: %s. It is not offered "
        "again (latest_restorable_step and restores use other copies or older steps).",
        process_index,
        part_dir,
        why,
    )
    return True


def check_and_quarantine(part_dir: Path, process_index: int) -> str | None:
    """Checks the part at `part_dir` (`damage`) and quarantines it if it is damaged;
    what is wrong with it, or None. A part already quarantined is not read again."""
    if is_quarantined(part_dir):
        return "quarantined earlier"
    why = damage(part_dir)
    if why is not None:
        quarantine(part_dir, why, process_index)
    return why


def verify_tier(parts: list[Path], process_index: int) -> tuple[list[Path], int, float]:
    """Checks and quarantines every part of `parts` (`check_and_quarantine`); the parts
    found damaged, the bytes read and the seconds it took. A part that cannot be read
    (removed meanwhile by retention) is skipped."""
    start, nbytes, damaged = time.perf_counter(), 0, []
    for part_dir in parts:
        try:
            if is_quarantined(part_dir):
                continue
            nbytes += (part_dir / _slab.SLAB_FILE).stat().st_size
            if check_and_quarantine(part_dir, process_index) is not None:
                damaged.append(part_dir)
        except OSError as e:
            log.info("jaxckpt: not verifying %s: %s", part_dir, e)
    return damaged, nbytes, time.perf_counter() - start
