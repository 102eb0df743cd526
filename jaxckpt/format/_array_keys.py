"""An array leaf's zarr3 array as plain tensorstore shows it: its name and attributes.

IMPORTANT: part of the on-disk format (see `_format`), a compatibility promise. From
format version 3 each ARRAY and NUMPY leaf's array under `part_<owner>/arrays/` is
named by the leaf's tree path (`with_array_keys`, recorded as `LeafRecord.array_key`),
so that a user finds a parameter without jaxckpt, and says in its zarr3 attributes what
it holds (`array_attributes`).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Final

from jaxckpt.format import _format

_KEY_CHARS: Final = frozenset(string.ascii_letters + string.digits + "_-")
_MAX_KEY_CHARS: Final = 200  # a file name has at most 255 bytes


def _escape(entry: str) -> str:
    """`entry` with every character but letters, digits, `_` and `-` %-escaped (UTF-8)."""
    return "".join(
        c if c in _KEY_CHARS else "".join(f"%{b:02X}" for b in c.encode()) for c in entry
    )


def with_array_keys(records: tuple[_format.LeafRecord, ...]) -> tuple[_format.LeafRecord, ...]:
    """`records` with every ARRAY and NUMPY leaf named: `array_key` is its tree path,
    each entry escaped, joined by dots (`params.Dense_0.kernel`, `opt_state.0.mu.w`).

    Keys are unique within a tree: one that repeats another (a dict with both 0 and
    "0" as keys) or is too long for a file name gets `~<leaf index>` appended (`~`
    is escaped everywhere else).
    """
    out, seen = [], set()
    for i, record in enumerate(records):
        if record.kind not in (_format.ARRAY, _format.NUMPY):
            out.append(record)
            continue
        key = ".".join(_escape(str(k)) for _, k in record.keys) or "_"
        if len(key) > _MAX_KEY_CHARS or key in seen:
            key = f"{key[:_MAX_KEY_CHARS]}~{i}"
        seen.add(key)
        out.append(dataclasses.replace(record, array_key=key))
    return tuple(out)


def array_attributes(
    record: _format.LeafRecord, step: int, owner: int, sharding: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The zarr3 attributes of a leaf's array in `owner`'s part of `step`: enough to
    use it without jaxckpt (`sharding`: the owner's own, of a per-process leaf)."""
    sharding = sharding or record.sharding
    described = {
        "path": record.path,
        "shape": list(record.shape) if record.shape is not None else None,
        "dtype": record.dtype,
        "key_impl": record.key_impl,
        "sharding": sharding,
        "per_process": record.per_process or None,
        "step": step,
        "owner": owner,
        "chunks": (
            "only this owner's share of its shards (split among their replicas); see its "
            "manifest.json"
            if record.replicas
            else "only those this owner wrote (its replica 0 shards); see its manifest.json"
        ),
    }
    return {_format.FORMAT_NAME: {k: v for k, v in described.items() if v is not None}}
