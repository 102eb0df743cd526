"""What the tools show of two things that decide restorability behind the scenes.

Quarantined copies (`memory/_quarantine`): a memory-tier part whose slab failed its
CRC-32Cs carries a `.corrupt` marker and is never offered again: no inventory,
restore plan or `latest_restorable_step` counts it. `jaxckpt ls` and `verify` list
such copies (the memory root, the part, why and by which process, as the marker
records them) and count them as no copy.

The kept area (`persistent/_kept`, `<ckpt>/.jaxckpt-kept/`, filesystems only): the newest
durable step hard-linked out of the manager's reach. `jaxckpt ls` lists each kept
step, whether it is complete, and whether the next `latest_restorable_step` puts its
step directory back (the manager deleted it and no newer step is durable).

Read only, as the rest of the tools.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from jaxckpt.memory import _memory_tier, _quarantine
from jaxckpt.persistent import _index, _kept
from jaxckpt.tools import _table

_PART_RE = re.compile(r"^part_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Quarantined:
    """One quarantined memory copy: `part` of `step`, in the tier under `root`."""

    root: Path
    step: int
    part: int
    part_dir: Path
    why: str | None  # as the marker records it (None: not recorded)
    marked_by: int | None  # the process that marked it (None: not recorded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "step": self.step,
            "part": self.part,
            "why": self.why,
            "marked_by": self.marked_by,
        }


def _names(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:  # gone meanwhile (retention), or never there
        return []


def quarantined(root: Path, tier: _memory_tier.MemoryTier) -> list[Quarantined]:
    """Every quarantined copy in `tier` (the run's tier under the memory root `root`)."""
    out = []
    for step in tier.steps():
        step_dir = tier.step_dir(step)
        for name in _names(step_dir):
            m = _PART_RE.match(name)
            if m is None or not _quarantine.is_quarantined(step_dir / name):
                continue
            try:
                why, by = _quarantine.recorded(step_dir / name)
            except OSError:  # removed meanwhile
                continue
            out.append(Quarantined(root, step, int(m.group(1)), step_dir / name, why, by))
    return out


def why_text(q: dict[str, Any]) -> str:
    """The reason of a quarantined copy (`Quarantined.to_dict`), with who marked it."""
    why = q["why"] or "reason not recorded"
    return why if q["marked_by"] is None else f"{why}; marked by process {q['marked_by']}"


def checked_now(q: Quarantined) -> dict[str, Any]:
    """`q` as JSON, its reason read from the slab now where the marker has none."""
    out = q.to_dict()
    if q.why is None:
        try:
            found = _quarantine.damage(q.part_dir)
        except OSError as e:
            found = f"unreadable ({e})"
        out["why"] = f"not recorded; checked now: {found or 'every chunk checks out now'}"
    return out


def quarantine_notes(entries: Sequence[dict[str, Any]]) -> list[str]:
    """One line per quarantined copy (`Quarantined.to_dict`), for `jaxckpt ls`."""
    return [
        f"step {q['step']}: copy of part {q['part']} in {q['root']} is quarantined "
        f"({why_text(q)}); never offered to a restore"
        for q in entries
    ]


@dataclasses.dataclass(frozen=True)
class KeptStep:
    """One step in the kept area, for one item."""

    step: int
    name: str  # the step directory's name
    parts: tuple[int, ...]  # the item's parts in the kept area
    part_count: int | None  # how many the step has (None: no readable index manifest)
    complete: bool  # every part of the item is there
    step_dir_exists: bool  # the manager still lists the step (the same files)
    newer_durable: int | None  # the newest step after it durable in the directory
    # Whether the next `latest_restorable_step` puts the step directory back
    # (`_kept.to_reinstate`, the decision `_kept.reinstate` acts on).
    reinstated_next: bool

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "parts": list(self.parts)}


def kept_steps(directory: Path, item: str, durable: Collection[int]) -> list[KeptStep]:
    """The steps of `item` in the kept area of the local checkpoint `directory`, oldest
    first; `durable` are the steps durable in the directory itself."""
    area = _kept.kept_dir(directory)
    back = _kept.to_reinstate(directory, [item])
    out = []
    for step, name in _kept.kept_steps(directory).items():
        item_dir = area / name / item
        if not item_dir.is_dir():
            continue
        parts = tuple(
            int(m.group(1)) for n in _names(item_dir) if (m := _PART_RE.match(n)) is not None
        )
        newer = [s for s in durable if s > step]
        out.append(
            KeptStep(
                step=step,
                name=name,
                parts=tuple(sorted(parts)),
                part_count=_index.part_count(item_dir),
                complete=_kept.is_complete(item_dir),
                step_dir_exists=(directory / name / item).is_dir(),
                newer_durable=max(newer) if newer else None,
                reinstated_next=back == (step, name),
            )
        )
    return sorted(out, key=lambda k: k.step)


def kept_notes(entries: Sequence[dict[str, Any]], area: str) -> list[str]:
    """One line per kept step (`KeptStep.to_dict`), for `jaxckpt ls`."""
    out = []
    for k in entries:
        count = "?" if k["part_count"] is None else k["part_count"]
        have = f"parts {_table.owners(k['parts'])} of {count}"
        head = f"kept: step {k['step']} in {area} ({'complete' if k['complete'] else 'incomplete'}: {have})"
        if k["step_dir_exists"]:
            tail = "hard links of its step directory's files (no extra space)"
        elif k["reinstated_next"]:
            tail = (
                "its step directory was deleted by the manager; the next "
                "latest_restorable_step puts it back"
            )
        elif not k["complete"]:
            tail = "its step directory is gone; not put back until every part is there"
        elif k["newer_durable"] is not None:
            tail = (
                f"its step directory is gone; not put back: step {k['newer_durable']} is "
                "newer and durable"
            )
        else:
            tail = "its step directory is gone; not put back: a newer kept step is complete"
        out.append(f"{head}: {tail}")
    return out
