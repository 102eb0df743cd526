"""The step index's text: written once per step, read in part by every process.

A step's index (`index.json` in its item directory) holds every part's index
manifest. Every process of a restore reads it, and at N processes it is O(N):
~2.9 KB a part for the benchmark's tree as version 1 wrote it, 48.6 MB at 16,384
processes. Parsed whole by every process, that was 2.2 s of CPU each (4.9 s on a
busier machine), and on an object store 800 GB of reads for one restore, for a
process that needs its own part alone (a restore looks in other parts only where
its own copy fails: `_plan.StepPlan.chunk_owner`).

So the index (version 2) is laid out to be read in part, still as one object
(a memory-only step costs the persistent store at most 4 writes whatever N is):

    jaxckpt-index 2 <header length, 12 digits>\\n          the prefix, 29 bytes
    <header>\\n            checksummed JSON: the leaf records once (each distinct
                          sharding once, its device ids as runs: a mesh's ids are
                          O(N)), the process count, the parts' NaN/Inf count,
                          the owners (a count where they are 0..N-1)
    <one row per part>    in owner order, 33 bytes each: the entry's offset (from
                          the first entry) and length, and its CRC-32C, in hex
    <entries>             each part's manifest without the leaf records: JSON

A reader reads the first `HEAD_BYTES` (the prefix and, for any common tree, the
header: one request), and for a part its row and its entry (two ranged requests,
or none where they lie in the bytes read already); each entry is checked against
its row's checksum and parsed when first asked for (`StepIndex`): 67 KB and a
few ms a process at 16,384 processes (`jaxckpt bench --scale`). A reader that asks
for more than a few parts (a tool, a search of every holder's part) reads the
rest at once instead. One object read in ranges rather than one object per group
of parts: the writes per step stay one whatever N (a group per object would cost
a write per group). Rows of fixed width rather than an offset table in the
header: a JSON table of every part would be O(N) for every reader to parse
again; a row is found by the part's position alone. A damaged entry fails the
lookup of that part alone (`DamagedEntryError`, naming the part and the index);
the header's own checksum guards what every part shares.

Steps saved by earlier versions are still read: a version-1 index (one JSON
object, every part's manifest in it, read and parsed whole: `parse_step_index`)
and the per-part `index_<p>.json` before it (`_index.read_index`). An index of a
newer version is refused, asking for an upgrade.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import dataclasses
import json
import threading
import zlib
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any, Final

from jaxckpt import _resources
from jaxckpt.format import _checked_json, _checksum, _finite, _format

Index = Mapping[int, _format.PartManifest]  # owner -> index manifest

STEP_INDEX_FORMAT: Final = "jaxckpt-index"
STEP_INDEX_VERSION: Final = 2
_V1: Final = 1  # one JSON object, every part's manifest in it
_PREFIX: Final = f"{STEP_INDEX_FORMAT} "
_PREFIX_BYTES: Final = len(_PREFIX) + len("2 ") + 12 + 1
_ROW_BYTES: Final = 16 + 8 + 8 + 1
# What a reader reads first: the prefix and the header (the leaf records: ~80 bytes
# each), and for a step of few parts the whole index.
HEAD_BYTES: Final = 1 << 16
# Parts a reader may read one by one (two ranged reads each); asked for more, it reads
# the whole index once (a tool's look at every part, a search of every holder's part).
_PARTS_READ_ALONE: Final = 8
# Leaf record fields that may differ between processes' records of one per-process leaf
# (the rest is compared by the save's agreement): each part records its own.
_OWN_LEAF_FIELDS: Final = ("scalar_type", "uncommitted", "sharding")
# A header's leaf record: the position of its sharding in the header's `shardings`.
_SHARDING_AT: Final = "sharding_at"
# An entry's first member: its part's NaN/Inf count (None: not counted).
_NONFINITE_TOTAL: Final = "nonfinite_total"
# Manifest members that are the same in every part, written once in the step index.
_SHARED_MEMBERS: Final = ("format", "version", "leaves", "jaxckpt_version")


class DamagedEntryError(ValueError):
    """A part's entry of a step index does not match its checksum, or cannot be read."""


def entry(manifest: _format.PartManifest) -> str:
    """What this process hands to the step index's writer: its index manifest without
    the leaf records (the same in every part, which the agreement checks), but with
    its own values of the fields a per-process leaf's record may hold differently;
    compressed."""
    # First, where the writer finds it without parsing the entry: the header sums it.
    d = {_NONFINITE_TOTAL: _finite.total(manifest.nonfinite), **manifest.to_dict(leaves=False)}
    for name in _SHARED_MEMBERS:
        d.pop(name, None)
    d["own_leaves"] = _own_leaf_fields(manifest.leaves)
    return base64.b64encode(zlib.compress(json.dumps(d, separators=(",", ":")).encode())).decode()


def _own_leaf_fields(leaves: Sequence[_format.LeafRecord]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, r in enumerate(leaves):
        if r.per_process:
            fields = {
                k: getattr(r, k) for k in _OWN_LEAF_FIELDS if getattr(r, k) not in (None, False)
            }
            if fields:
                out[str(i)] = fields
    return out


def step_index_text(leaves: Sequence[_format.LeafRecord], entries: Mapping[int, str]) -> str:
    """The step index (the layout above) from the writer's leaf records and every
    process's `entry`."""
    owners = sorted(int(p) for p in entries)
    # Each entry is written as the JSON text `entry` made (not parsed and dumped again:
    # at thousands of processes that was most of the deciding process's time).
    texts = [zlib.decompress(base64.b64decode(entries[p])) for p in owners]
    rows, offset, count, nonfinite = [], 0, 0, None
    for text in texts:
        rows.append(f"{offset:016x}{len(text):08x}{_checksum.crc32c(text):08x}\n")
        offset += len(text)
        count = max(count, _process_count(text))
        found = _nonfinite_total(text)
        if found is not None:
            nonfinite = (nonfinite or 0) + found
    header = _checked_json.with_checksum(
        json.dumps(
            {
                "format": STEP_INDEX_FORMAT,
                "version": STEP_INDEX_VERSION,
                "manifest_version": _format.FORMAT_VERSION,
                "jaxckpt_version": _format.JAXCKPT_VERSION,
                **_shared_records(leaves),
                "process_count": count,
                "nonfinite": nonfinite,
                "owners": len(owners) if owners == list(range(len(owners))) else owners,
            },
            separators=(",", ":"),
        )
    )
    prefix = f"{_PREFIX}{STEP_INDEX_VERSION} {len(header) + 1:012d}\n"
    return prefix + header + "\n" + "".join(rows) + b"".join(texts).decode()


def _process_count(text: bytes) -> int:
    """The process count an entry's JSON records (without parsing it)."""
    at = text.find(b'"process_count":')
    if at < 0:
        return 0
    digits = text[at + len(b'"process_count":') :].split(b",", 1)[0].split(b"}", 1)[0]
    return int(digits) if digits.strip().isdigit() else 0


def _nonfinite_total(text: bytes) -> int | None:
    """The NaN/Inf count an entry records first (`entry`), without parsing it."""
    lead = b'{"' + _NONFINITE_TOTAL.encode() + b'":'
    if not text.startswith(lead):
        return None
    value = text[len(lead) : text.find(b",", len(lead))]
    return int(value) if value.isdigit() else None


def _shared_records(leaves: Sequence[_format.LeafRecord]) -> dict[str, Any]:
    """The header's leaf records: each sharding (whose device ids list every device of
    its mesh: O(N), and alike in every leaf on that mesh) once in `shardings`, a
    record naming it by position; device ids as runs of consecutive ids. Once per tree
    (`_format.remembered`: the snapshot hands the same tuple to every save of an
    unchanged tree)."""
    return _format.remembered(_SHARED_RECORDS, leaves, lambda: _shared_records_of(leaves))


_SHARED_RECORDS: dict[int, tuple[object, dict[str, Any]]] = _resources.SHARED.cache({})


def _shared_records_of(leaves: Sequence[_format.LeafRecord]) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    shardings: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for r in leaves:
        d = _shared_record(r)
        sharding = d.pop("sharding", None)
        if sharding is not None:
            key = json.dumps(sharding, sort_keys=True)
            if key not in seen:
                seen[key] = len(shardings)
                shardings.append(_with_id_runs(sharding))
            d[_SHARDING_AT] = seen[key]
        records.append(d)
    return {"leaves": records, "shardings": shardings}


def _with_id_runs(sharding: dict[str, Any]) -> dict[str, Any]:
    ids = sharding.get("device_ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        return sharding
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return {**sharding, "device_ids": {"runs": runs}}


def _without_id_runs(sharding: dict[str, Any]) -> dict[str, Any]:
    ids = sharding.get("device_ids")
    if not isinstance(ids, dict):
        return sharding
    return {
        **sharding,
        "device_ids": [i for start, n in ids["runs"] for i in range(start, start + n)],
    }


def _shared_record(record: _format.LeafRecord) -> dict[str, Any]:
    d = record.to_dict()
    if record.per_process:
        for k in _OWN_LEAF_FIELDS:
            d.pop(k, None)
    return d


def parse_step_index(raw: bytes) -> Index:
    """owner -> index manifest, from a step index's text (of any version).

    Raises:
      ValueError: if the text is damaged or is no readable step index (a damaged
        entry of a version-2 index: when that part is asked for).
    """
    return read_step_index(lambda start, stop: raw[start:stop], "the step index", raw)


def read_step_index(read: Callable[[int, int | None], bytes], where: str, head: bytes) -> Index:
    """owner -> index manifest of the step index whose bytes `read(start, stop)`
    returns and whose first bytes (at least `HEAD_BYTES` of them, or all) are `head`;
    `where` names it in errors. A version-2 index is read in part: its parts' entries
    when asked for (`StepIndex`).

    Raises:
      ValueError: if the index is damaged or of no readable version.
    """
    if head.startswith(b"{"):
        if len(head) >= HEAD_BYTES:
            head = read(0, None)  # a version-1 index is read whole
        return _parse_v1(head)
    prefix = head[:_PREFIX_BYTES]
    if not prefix.startswith(_PREFIX.encode()):
        raise ValueError(f"{where} is no jaxckpt step index.")
    version, _, length = prefix[len(_PREFIX) :].strip().partition(b" ")
    if version != str(STEP_INDEX_VERSION).encode():
        raise _unreadable_version(version.decode(errors="replace"))
    if not length.isdigit():
        raise ValueError(f"{where}: its prefix is damaged.")
    header_stop = _PREFIX_BYTES + int(length)
    text = head[_PREFIX_BYTES:header_stop]
    if len(text) < int(length) and len(head) >= HEAD_BYTES:
        text = read(_PREFIX_BYTES, header_stop)
    return StepIndex(read, where, _checked_json.checked(text.rstrip(b"\n")), header_stop, head)


def _unreadable_version(version: object) -> ValueError:
    return ValueError(
        f"Not a jaxckpt step index of a readable version (format={STEP_INDEX_FORMAT!r}, "
        f"version={version!r}; this jaxckpt reads up to {STEP_INDEX_VERSION}); upgrade jaxckpt."
    )


class _Parts:
    """Builds index manifests from a step index's entries: the leaf records parsed
    once, and one tuple of them per variant of the parts' own fields (parts alike
    share it)."""

    def __init__(self, header: Mapping[str, Any]):
        # A version-2 header's shardings, once each (records on one mesh share one).
        shardings = [_without_id_runs(x) for x in header.get("shardings", ())]
        self.records = tuple(
            _format.LeafRecord.from_dict(
                {**x, "sharding": shardings[x[_SHARDING_AT]]} if _SHARDING_AT in x else x
            )
            for x in header["leaves"]
        )
        self._header = {
            "format": _format.FORMAT_NAME,
            "version": header["manifest_version"],
            "leaves": [],
        }
        self._variants: dict[str, tuple[_format.LeafRecord, ...]] = {}

    def manifest(self, owner: int, part: dict[str, Any]) -> _format.PartManifest:
        own = part.pop("own_leaves", {})
        part.pop(_NONFINITE_TOTAL, None)
        manifest = _format.PartManifest.from_dict({**part, **self._header})
        variant = json.dumps(own, sort_keys=True)
        leaves = self._variants.get(variant)
        if leaves is None:
            leaves = self._variants[variant] = tuple(
                _with_own(r, own.get(str(i), {})) if r.per_process else r
                for i, r in enumerate(self.records)
            )
        if manifest.owner != owner:
            raise ValueError(f"The step index's part {owner} records owner {manifest.owner}.")
        return dataclasses.replace(manifest, leaves=leaves)


def _with_own(record: _format.LeafRecord, own: Mapping[str, Any]) -> _format.LeafRecord:
    return dataclasses.replace(
        record, **{k: own.get(k, False if k == "uncommitted" else None) for k in _OWN_LEAF_FIELDS}
    )


class StepIndex(Mapping[int, _format.PartManifest]):
    """owner -> index manifest of a version-2 step index, each part's entry read,
    checked and parsed when first asked for: a process that asks for its own part
    reads O(1) entries. `len`, `in` and iterating the owners read no entry;
    `values()` and `items()` (tools, a restore's search of every part) read every
    entry at once. `process_count`: what the header records (no entry read).

    Raises (on a lookup):
      DamagedEntryError: if that part's entry is damaged or cannot be read.
    """

    def __init__(
        self,
        read: Callable[[int, int | None], bytes],
        where: str,
        header: Mapping[str, Any],
        header_stop: int,
        head: bytes,
    ):
        self._read = read
        self._where = where
        owners = header["owners"]
        self._owners: Sequence[int] = range(owners) if isinstance(owners, int) else owners
        self.process_count: int = header["process_count"]
        # NaN/Inf values all parts counted (None: not counted), without reading them.
        self.nonfinite: int | None = header.get("nonfinite")
        # What the part manifests' own header would say (the tools show it).
        self.manifest_version: int = header["manifest_version"]
        self.jaxckpt_version: str | None = header.get("jaxckpt_version")
        self._parts = _Parts(header)
        self._rows_at = header_stop
        self._entries_at = header_stop + _ROW_BYTES * len(self._owners)
        self._bytes = head  # the index's first bytes, read already
        self._whole = len(head) < HEAD_BYTES  # whether they are all of it
        self._parsed: dict[int, _format.PartManifest] = {}
        self._read_alone = 0  # parts whose row and entry were read on their own
        self._lock = threading.Lock()  # a restore's readers ask on several threads

    def __len__(self) -> int:
        return len(self._owners)

    def __iter__(self) -> Iterator[int]:
        return iter(self._owners)

    def __contains__(self, owner: object) -> bool:
        return isinstance(owner, int) and self._position(owner) is not None

    def __getitem__(self, owner: int) -> _format.PartManifest:
        with self._lock:
            found = self._parsed.get(owner)
            if found is None:
                i = self._position(owner) if isinstance(owner, int) else None
                if i is None:
                    raise KeyError(owner)
                found = self._parsed[owner] = self._entry(owner, i)
            return found

    def values(self) -> ValuesView[_format.PartManifest]:
        self._read_whole()
        return super().values()

    def items(self) -> ItemsView[int, _format.PartManifest]:
        self._read_whole()
        return super().items()

    def _position(self, owner: int) -> int | None:
        if isinstance(self._owners, range):
            return owner if 0 <= owner < len(self._owners) else None
        i = bisect.bisect_left(self._owners, owner)
        return i if i < len(self._owners) and self._owners[i] == owner else None

    def _range(self, start: int, stop: int) -> bytes:
        if stop <= len(self._bytes):
            return self._bytes[start:stop]
        return self._read(start, stop)

    def _read_whole(self) -> None:
        """Reads the rest of the index in one request (not one per entry)."""
        with self._lock:
            self._read_whole_locked()

    def _read_whole_locked(self) -> None:
        if not self._whole and len(self._parsed) < len(self._owners):
            with contextlib.suppress(OSError):  # each entry is then read (and fails) alone
                self._bytes = self._read(0, None)
                self._whole = True

    def _entry(self, owner: int, i: int) -> _format.PartManifest:
        where = f"{self._where}: the entry of part {owner}"
        if not self._whole:
            self._read_alone += 1
            if self._read_alone > _PARTS_READ_ALONE:
                self._read_whole_locked()
        try:
            row = self._range(self._rows_at + i * _ROW_BYTES, self._rows_at + (i + 1) * _ROW_BYTES)
            offset, length, crc = int(row[:16], 16), int(row[16:24], 16), int(row[24:32], 16)
            start = self._entries_at + offset
            text = self._range(start, start + length)
        except (OSError, ValueError) as e:
            raise DamagedEntryError(f"{where} cannot be read: {e}") from e
        if len(text) != length or _checksum.crc32c(text) != crc:
            raise DamagedEntryError(f"{where} does not match its checksum: it is damaged.")
        try:
            return self._parts.manifest(owner, json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DamagedEntryError(f"{where} is unreadable: {e}") from e


def _parse_v1(raw: bytes) -> Index:
    """owner -> index manifest, from a version-1 step index (parsed once per text)."""
    key = (len(raw), _checksum.crc32c(raw))
    cached = _PARSED.get(key)
    if cached is not None and cached[0] == raw:
        return dict(cached[1])
    d = _checked_json.checked(raw)
    if d.get("format") != STEP_INDEX_FORMAT or d.get("version") != _V1:
        raise _unreadable_version(d.get("version"))
    parts = _Parts(d)
    out = {int(owner): parts.manifest(int(owner), part) for owner, part in d["parts"].items()}
    if len(_PARSED) >= 4:
        _PARSED.pop(next(iter(_PARSED), (-1, -1)), None)
    _PARSED[key] = (raw, out)
    return dict(out)


# Parsed version-1 step indexes by text: a restore and retention read one several times.
_PARSED: dict[tuple[int, int], tuple[bytes, dict[int, _format.PartManifest]]] = (
    _resources.SHARED.cache({})
)
