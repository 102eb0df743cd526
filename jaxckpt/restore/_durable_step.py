"""A durable step, read leaf by leaf from persistent storage with every chunk checked.

What `export` reads: the step's index manifests, then each array leaf's chunks
from every process's persisted part (zarr3 through tensorstore: file, gs://,
s3://), each checked against its CRC-32C, one chunk at a time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxckpt.format import _chunking, _format
from jaxckpt.memory import _readers
from jaxckpt.persistent import _index, _paths, _step_dirs, _storage, _zarr_reader


@dataclasses.dataclass
class DurableStep:
    """A durable step's parts, read chunk by chunk with checks."""

    item_dir: Path
    step: int
    index: _index.Index
    leaves: tuple[_format.LeafRecord, ...]
    names: list[str]  # per leaf: the exported name
    timeout_s: float

    @classmethod
    def open(cls, root: Path, step: int, item: str | None, timeout_s: float) -> DurableStep:
        item = item or only_item(root, step)
        steps = _paths.finalized_steps(root, item)
        if step not in steps:
            raise FileNotFoundError(
                f"export: step {step} of item {item!r} is not in {root} (finalized steps: "
                f"{sorted(steps)})."
            )
        item_dir = steps[step]
        index = _index.read_index(item_dir)
        if not index:
            raise FileNotFoundError(f"export: {item_dir} holds no jaxckpt index manifest.")
        first = index[min(index)]
        missing = sorted(set(range(first.process_count)) - _index.persisted_parts(item_dir, index))
        if missing:
            raise FileNotFoundError(
                f"export: step {step} is not durable: the part(s) of process(es) {missing} are "
                f"not persisted in {item_dir}. Export reads persistent storage only: choose a "
                "durable step (`jaxckpt ls` shows them) or save one with "
                "jaxckpt.TieredSave(state, persist=True)."
            )
        return cls(item_dir, step, index, first.leaves, names(first.leaves), timeout_s)

    def nbytes(self, i: int) -> int:
        rec = self.leaves[i]
        if rec.kind not in (_format.ARRAY, _format.NUMPY):
            return 0
        assert rec.stored_shape is not None and rec.stored_dtype is not None
        return math.prod(rec.stored_shape) * np.dtype(rec.stored_dtype).itemsize

    def chunks(self, i: int) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        """(region, values) of every saved chunk of array leaf `i`, checked against its
        CRC-32C (a per-process leaf: process 0's)."""
        rec = self.leaves[i]
        assert rec.stored_shape is not None and rec.chunk_shape is not None
        owners = [min(self.index)] if rec.per_process else sorted(self.index)
        for owner in owners:
            part = self.item_dir / _format.part_dir_name(owner)
            reader = _zarr_reader.ZarrReader(_storage.kvstore(part))
            for chunk in self.index[owner].chunks.get(i, ()):
                where = f"chunk {chunk.index} of {rec.path} in process {owner}'s part of step "
                where += f"{self.step} ({part})"
                try:
                    data = _readers.read_chunk(reader, i, rec, chunk, self.timeout_s)
                except _readers.ChecksumMismatchError as e:
                    raise ValueError(
                        f"export: {where} does not match its checksum ({e}): the copy is "
                        "damaged (`jaxckpt verify` checks every copy)."
                    ) from e
                except (OSError, ValueError, TimeoutError) as e:  # tensorstore: ValueError
                    raise ValueError(f"export: {where} cannot be read: {e}") from e
                yield _chunking.chunk_region(chunk.index, rec.stored_shape, rec.chunk_shape), data

    def fill(self, i: int, dest: np.ndarray) -> None:
        for region, data in self.chunks(i):
            dest[region] = data

    def scalar(self, i: int) -> Any:
        rec = self.leaves[i]
        return self.index[min(self.index)].scalars.get(i) if rec.per_process else rec.value


def only_item(root: Path, step: int) -> str:
    """The one jaxckpt item (a directory with a step index, or older per-part index
    manifests) of `step` in `root`."""
    items: set[str] = set()
    if root.is_dir():
        for step_dir in root.iterdir():
            if (
                _step_dirs.is_temporary(step_dir.name)
                or _step_dirs.step_of_name(step_dir.name) != step
            ):
                continue
            items |= {p.name for p in step_dir.iterdir() if _index.has_index(p)}
    if len(items) != 1:
        raise ValueError(
            f"export: step {step} in {root} holds {len(items)} jaxckpt items "
            f"({sorted(items)}): name one (--item, item=)."
            if items
            else f"export: {root} holds no jaxckpt step {step}."
        )
    return items.pop()


def names(leaves: tuple[_format.LeafRecord, ...]) -> list[str]:
    """Each leaf's exported name: its tree path's keys joined by dots (unique)."""
    out, seen = [], set()
    for i, rec in enumerate(leaves):
        name = ".".join(str(k) for _, k in rec.keys) or "_"
        if name in seen:
            name = f"{name}~{i}"
        seen.add(name)
        out.append(name)
    return out
