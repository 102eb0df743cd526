"""`jaxckpt verify`: read every chunk of every copy of a step in reach, check its CRC-32.

A copy is one part (the chunks one process saved) in one place: a memory root
given on the command line, or the checkpoint directory (local, or on an object
store: `gs://`, `s3://`). Every chunk is read with tensorstore, exactly as a
restore reads it, and compared with the checksum in the step's index manifest.

A memory copy quarantined earlier (`_quarantine`: its slab failed its CRC-32Cs) is
known damage: not read again, no copy, and listed apart (`quarantined`) from the
bad copies this run finds; it does not change the exit status.

A part in place that its store does not count as persisted (on an object store:
one without its `manifest.json`, an upload that has not finished: `_object_store`)
is no copy, is not read, and the report says so (`not_checked`), as it says which
memory tiers were not looked at. A read that gets no answer within the store's
bound (`PersistentStore.read_timeout_s`) makes the copy unreadable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxckpt.coord import _plan
from jaxckpt.format import _format
from jaxckpt.memory import _readers, _slab
from jaxckpt.persistent import _storage, _store, _zarr_reader
from jaxckpt.tools import _catalog, _table, _trust

# (chunks done, chunks in all, bytes done, bytes in all)
Progress = Callable[[int, int, int, int], None]

_CONCURRENCY = 32  # chunk reads in flight per copy
# Tensorstore's error when a chunk fails the zarr3 `crc32c` codec that persisted
# arrays end with (format v3): the chunk's bytes do not match their checksum.
_DIGEST_MISMATCH = "Digest mismatch"


@dataclasses.dataclass(frozen=True)
class CopyReport:
    """The verdict on one copy of one part."""

    tier: str  # "memory" or "persistent"
    location: str  # the memory root, or the checkpoint directory
    part: int  # the owner process
    chunks: int  # chunks checked
    nbytes: int  # bytes checked
    problems: tuple[str, ...] = ()  # one line per bad chunk (or a whole-copy problem)
    slices: int = 0  # of the chunks, slices of shards shared with data-parallel replicas

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "problems": list(self.problems), "ok": self.ok}


@dataclasses.dataclass(frozen=True)
class _Copy:
    tier: str
    location: Path
    part: int
    part_dir: Path
    problem: str | None = None  # known bad before reading a chunk


def _copies(catalog: _catalog.Catalog, info: _catalog.StepInfo) -> tuple[list[_Copy], list[str]]:
    """The copies of the step in reach, and what was found but is no copy to check."""
    out, skipped = [], []
    for root in catalog.roots:
        for owner in root.tier.parts(info.step):
            part_dir = root.tier.part_dir(info.step, owner)
            if owner in info.memory and root.path in info.memory[owner]:
                out.append(_Copy(_plan.MEMORY, root.path, owner, part_dir))
            elif (root.path, owner, _catalog.UNREADABLE) in info.stale:
                out.append(_Copy(_plan.MEMORY, root.path, owner, part_dir, _catalog.UNREADABLE))
    if info.item_dir is not None:
        for owner in sorted(info.index):
            part_dir = info.item_dir / _format.part_dir_name(owner)
            if owner in info.persisted:
                out.append(_Copy(_plan.PERSISTENT, catalog.directory, owner, part_dir))
            elif owner not in info.incomplete:
                continue
            elif not catalog.store.is_persisted(info.item_dir, owner):
                # A part in place that its store does not count as persisted: on an
                # object store, its manifest is written last: the upload has not
                # finished (or was abandoned, or garbage collection is retiring it).
                skipped.append(
                    f"part {owner} in {info.item_dir} (its upload has not finished: no "
                    f"{_format.MANIFEST_FILE} yet, so it is not a durable copy)"
                )
            else:
                # A persisted part is renamed into place complete (and on an object store
                # its manifest is written last), so a part whose manifest does not match
                # the index is damaged (or from another save).
                problem = "manifest missing, unreadable or from another save"
                out.append(_Copy(_plan.PERSISTENT, catalog.directory, owner, part_dir, problem))
    return out, skipped


async def _verify_copy(
    copy: _Copy, manifest: _format.PartManifest, on_chunk: Callable[[int], None]
) -> CopyReport:
    # A read that gets no answer within the store's bound is reported unreadable, and
    # the rest of that copy is not read.
    timeout = _store.at(copy.part_dir).read_timeout_s
    records = [(leaf, c) for leaf, cs in sorted(manifest.chunks.items()) for c in cs]
    total = sum(c.nbytes for _, c in records)
    if copy.problem:
        on_chunk(total)
        return CopyReport(copy.tier, str(copy.location), copy.part, 0, 0, (copy.problem,))
    try:
        reader: _readers.ChunkReader = (
            _readers.SlabReader(copy.part_dir / _slab.SLAB_FILE, lent=False)
            if copy.tier == _plan.MEMORY
            else _zarr_reader.ZarrReader(_storage.kvstore(copy.part_dir))  # file, gcs or s3
        )
    except OSError as e:
        on_chunk(total)
        problem = f"unreadable ({str(e).splitlines()[0][:200]})"
        return CopyReport(copy.tier, str(copy.location), copy.part, 0, 0, (problem,))
    problems: list[str] = []
    limit = asyncio.Semaphore(_CONCURRENCY)
    silent: list[str] = []  # set once the store gave no answer: the rest is not read

    async def check(leaf: int, chunk: _format.ChunkRecord) -> None:
        rec = manifest.leaves[leaf]
        assert rec.stored_shape is not None and rec.chunk_shape is not None
        where = f"{rec.path} {'slice' if rec.replicas else 'chunk'} {chunk.index}"
        async with limit:
            try:
                if silent:
                    raise TimeoutError(silent[0])
                await asyncio.to_thread(
                    _readers.read_chunk,
                    reader,
                    leaf,
                    rec,
                    chunk,
                    timeout if timeout is not None else 1e9,
                )
            except _readers.ChecksumMismatchError:
                problems.append(f"{where}: checksum mismatch")
            except TimeoutError as e:
                if not silent:
                    silent.append(str(e) or f"no answer within {_table.duration(timeout)}")
                problems.append(f"{where}: not read ({silent[0]})")
            except Exception as e:
                if _DIGEST_MISMATCH in str(e):  # the crc32c codec caught it before we could
                    problems.append(f"{where}: checksum mismatch")
                else:
                    problems.append(f"{where}: unreadable ({str(e).splitlines()[0][:200]})")
        on_chunk(chunk.nbytes)

    await asyncio.gather(*(check(leaf, c) for leaf, c in records))
    return CopyReport(
        copy.tier,
        str(copy.location),
        copy.part,
        len(records),
        total,
        tuple(sorted(problems)),
        manifest.slices,
    )


def verify(
    catalog: _catalog.Catalog, step: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Checks every copy of `step` in reach.

    Returns:
      A JSON-able report: one entry per copy, the parts with no copy in reach,
      and `ok` (every copy good and every part has one).

    Raises:
      FileNotFoundError: if the step is nowhere, or has no index manifest.
    """
    info = catalog.step(step)
    if not info.index:
        raise FileNotFoundError(
            f"Step {step} in {info.item_dir} has no readable jaxckpt index manifest."
        )
    copies, not_checked = _copies(catalog, info)
    copies = [c for c in copies if c.part in info.index]
    if not catalog.roots:
        why = "no --memory-root given"
        if catalog.remote:
            why += f": they are on the hosts' local filesystems, not in {catalog.directory}"
        not_checked.insert(0, f"the memory tiers ({why})")
    sizes = [info.index[c.part].nbytes for c in copies]
    total_chunks = sum(sum(len(cs) for cs in info.index[c.part].chunks.values()) for c in copies)
    done = {"chunks": 0, "bytes": 0}

    def on_chunk(nbytes: int) -> None:
        done["chunks"] += 1
        done["bytes"] += nbytes
        if progress is not None:
            progress(done["chunks"], total_chunks, done["bytes"], sum(sizes))

    async def run() -> list[CopyReport]:
        return [await _verify_copy(c, info.index[c.part], on_chunk) for c in copies]

    reports = asyncio.run(run())
    covered = {r.part for r in reports if r.ok}
    no_good_copy = [o for o in info.owners if o not in covered]
    return {
        "directory": str(catalog.directory),
        "item": catalog.item,
        "step": step,
        "copies": [r.to_dict() for r in reports],
        "bad_copies": sum(not r.ok for r in reports),
        "parts_without_good_copy": no_good_copy,
        "not_checked": not_checked,
        # Known damage: copies quarantined earlier, not read again and no copy.
        "quarantined": [_trust.checked_now(q) for q in info.quarantined],
        "ok": all(r.ok for r in reports) and not no_good_copy,
    }


def render(report: dict[str, Any], limit: int = 5) -> str:
    rows = [
        [
            c["part"],
            c["tier"],
            c["location"],
            c["chunks"],
            _table.size(c["nbytes"]),
            "ok" if c["ok"] else f"BAD ({len(c['problems'])} problem(s))",
        ]
        for c in report["copies"]
    ]
    out = [f"step {report['step']} of {report['directory']}  item {report['item']!r}", ""]
    headers = ["PART", "TIER", "WHERE", "CHUNKS", "BYTES", "STATUS"]
    if any(c.get("slices") for c in report["copies"]):  # data-parallel replicas' shares
        headers.insert(4, "SLICES")
        for row, c in zip(rows, report["copies"], strict=True):
            row.insert(4, c.get("slices", 0))
    right = tuple(i for i, h in enumerate(headers) if h in ("PART", "CHUNKS", "SLICES", "BYTES"))
    out.append(_table.table(headers, rows, right=right) if rows else "no copy in reach")
    for c in report["copies"]:
        out += [
            f"  part {c['part']} ({c['tier']}, {c['location']}): {p}" for p in c["problems"][:limit]
        ]
        if len(c["problems"]) > limit:
            out.append(f"  ... and {len(c['problems']) - limit} more")
    good = len(report["copies"]) - report["bad_copies"]
    out += ["", f"{good} good cop{'y' if good == 1 else 'ies'}, {report['bad_copies']} bad."]
    out += [
        f"Quarantined earlier (known damage, not read, never offered to a restore): part "
        f"{q['part']} in {q['root']}: {_trust.why_text(q)}."
        for q in report.get("quarantined", ())
    ]
    out += [f"Not checked: {what}." for what in report.get("not_checked", ())]
    if report["parts_without_good_copy"]:
        out.append(
            "No good copy in reach of part(s) "
            f"{_table.owners(report['parts_without_good_copy'])}: with these copies the step "
            "cannot be restored (pass the --memory-root of every host to see all copies)."
        )
    return "\n".join(out)
