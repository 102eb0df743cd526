"""The on-disk format: one JSON manifest per (step, owner process) "part".

IMPORTANT: this format is a compatibility promise. Every tier (memory, peer,
persistent) stores a part with the same manifest:

    part_<owner>/manifest.json      a `PartManifest` (this module)

memory and peer tiers (the hot path: one file, filled and read at memory speed):

    part_<owner>/slab               every chunk <owner> wrote, at aligned offsets

persistent tier (plain zarr3, any tensorstore kvstore):

    part_<owner>/arrays/<key>/      one zarr3 array per array leaf, chunk grid =
                                    the saved shard shape, holding only the chunks
                                    that <owner> wrote (its share of its shards); <key>
                                    is the leaf's tree path, and the array's attributes
                                    say what it holds (both: `_array_keys`)

and the CheckpointManager's item directory always holds the step's index: one
`index.json` (every part's manifest, the leaf records once; `_index`), written
by one process; steps saved by earlier versions hold `index_<owner>.json` (the
same manifest) per part instead, and are still read. Each manifest carries its
own checksum (`_checked_json`). Change a field only together with
`FORMAT_VERSION` and a reader for the old version.

Versions: 1 saved numpy arrays once (process 0) and scalars inside the leaf
records. 2 saves every value that can differ per process (process-local
jax.Arrays, numpy arrays, scalars) in every process's own part: such a leaf's
record says `per_process`, its chunks are in each owner's `chunks`, a scalar's
value is in each owner's `scalars` and a process-local array's sharding in
each owner's `shardings`; the leaf records stay identical in every part.
3 names each array by the leaf's tree path (`LeafRecord.array_key`, e.g.
`params.Dense_0.kernel`) instead of its index in the tree, so that a user can
find a parameter with plain tensorstore; checksums chunks with CRC-32C instead
of zlib's CRC-32; and keeps a memory or peer part in one slab file (`_slab`),
each chunk at the `offset` its record gives.
Versions 1 and 2 are still read (every field added since has a default; their
arrays are named by leaf index). A field added within a version has a default
that older manifests get, and older readers ignore it: `persist`, `weak_types`
and `nonfinite` (in 3; `nonfinite` absent: not counted), and a leaf's
`replicas`, `cut` and `slices` (in 3): a shard held by R > 1 processes
(data-parallel replicas) is cut into chunks that its holders save a share each
(`_replicas`), so its `chunk_shape` is finer than the shard shape; the chunk
grid says everything a reader needs, and each part's `chunks` say who holds
which slice (a jaxckpt from before these leaf fields refuses them; leaf fields
a reader does not know are ignored from them on).
4 cuts each chunk of a large leaf into tiles (`_tiles`): the leaf's `tile_shape`
gives the grid, a chunk's bytes are its tiles one after the other (each in C
order), and the chunk's `tiles` holds each tile's CRC-32C instead of one
`crc32c` for the chunk. A chunk of a leaf without `tile_shape` is saved as in 3.
(Readers of 3 would take tiled bytes for a chunk in C order: hence the version.)
Versions 1-3 are still read, and their chunks are one tile each.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from jaxckpt import _resources
from jaxckpt.format import _checked_json, _checksum

FORMAT_NAME: Final = "jaxckpt"
FORMAT_VERSION: Final = 4
READABLE_VERSIONS: Final = (1, 2, 3, 4)
MANIFEST_FILE: Final = "manifest.json"
ARRAYS_DIR: Final = "arrays"


def _installed_version() -> str:
    try:
        return importlib.metadata.version("jaxckpt")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


JAXCKPT_VERSION: Final = _installed_version()  # the writer's version, informational

# Leaf kinds.
ARRAY: Final = "array"  # jax.Array (typed PRNG keys are stored as their key data)
NUMPY: Final = "numpy"  # np.ndarray, one chunk (v1: process 0's; v2: per process)
SCALAR: Final = "scalar"  # Python or numpy scalar, value in the manifest (v2: per process)
ITERATOR: Final = "iterator"  # anything with get_state()/set_state(), state per process


def index_file(owner: int) -> str:
    """Name of a part's manifest copy in the CheckpointManager's item directory."""
    return f"index_{owner:05d}.json"


# The step's combined index (`_step_index.step_index_text`): every part's index manifest in one
# object, written by one process. Steps saved before it hold one `index_file` per part.
STEP_INDEX_FILE: Final = "index.json"


def part_dir_name(owner: int) -> str:
    """Name of a part's directory in every tier."""
    return f"part_{owner:05d}"


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One saved chunk: its place in the leaf's chunk grid, size, checksum and place
    in its part's slab (memory and peer tiers).

    Attributes:
      index: the chunk's index in the leaf's chunk grid.
      nbytes: its size (C order, the stored dtype).
      crc32c: CRC-32C of its bytes (format version 3).
      offset: where it starts in the part's slab file (format version 3).
      crc32: zlib CRC-32 of its bytes (format versions 1-2 only).
      tiles: the CRC-32C of each of its tiles, in byte order (format version 4, a
        leaf with a `tile_shape`; `crc32c` is then None): see `_tiles`.
    """

    index: tuple[int, ...]
    nbytes: int
    crc32c: int | None = None
    offset: int | None = None
    crc32: int | None = None
    tiles: tuple[int, ...] | None = None

    @property
    def checksum(self) -> tuple[str, Any]:
        """(kind, value) of the recorded checksum."""
        if self.tiles is not None:
            return ("tiles", self.tiles)
        return ("crc32c", self.crc32c) if self.crc32c is not None else ("crc32", self.crc32)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": list(self.index), "nbytes": self.nbytes}
        for k in ("crc32c", "offset", "crc32"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.tiles is not None:
            d["tiles"] = list(self.tiles)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChunkRecord:
        def opt(k: str) -> int | None:
            return int(d[k]) if d.get(k) is not None else None

        return cls(
            tuple(int(i) for i in d["index"]),
            int(d["nbytes"]),
            crc32c=opt("crc32c"),
            offset=opt("offset"),
            crc32=opt("crc32"),
            tiles=tuple(int(c) for c in d["tiles"]) if d.get("tiles") is not None else None,
        )


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """What every process knows of one leaf of the saved tree.

    Attributes:
      path: the leaf's tree path, as `jax.tree_util.keystr` prints it.
      keys: the same path as entries ("d", key) dict, ("s", i) sequence,
        ("a", name) attribute, ("f", key) flattened index.
      kind: one of ARRAY, NUMPY, SCALAR, ITERATOR.
      shape: global shape the user sees (arrays).
      dtype: dtype name the user sees (`key<fry>` for typed keys).
      stored_shape: shape of the zarr array (typed keys: shape + key data dims).
      stored_dtype: dtype of the zarr array.
      chunk_shape: the chunk grid (the saved shard shape).
      sharding: description of the saved sharding (see `_sharding.describe`).
      key_impl: PRNG implementation name of a typed key array.
      value: the JSON value of a SCALAR; `scalar_type` says how to rebuild it.
      scalar_type: "int", "float", "bool", "str" or a numpy dtype name.
      per_process: every process saved its own value (a process-local
        jax.Array, a numpy array, a scalar): the leaf's chunks, scalar value
        and sharding are in each owner's part, not in this record.
      uncommitted: the saved jax.Array was not committed to its devices (made
        outside any mesh or device_put); restored uncommitted when no target
        sharding is given.
      array_key: the name of the leaf's zarr3 array under `arrays/` (ARRAY and
        NUMPY leaves): see `with_array_keys`.
      replicas: R, how many processes hold each shard of a global array, when
        more than one (data-parallel replicas; None: one). Each saves a share.
      cut: the dimension a replicated shard is cut along into `slices` chunks
        (`chunk_shape` is the shard shape with that dimension divided); None:
        the shard is one chunk, saved whole by one of its holders.
      slices: chunks per shard along `cut` (None where not cut).
      tile_shape: the tile grid each chunk is cut into (format version 4; None: chunks
        are saved whole): see `_tiles`.
    """

    path: str
    kind: str
    keys: tuple[tuple[str, Any], ...] = ()
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    stored_shape: tuple[int, ...] | None = None
    stored_dtype: str | None = None
    chunk_shape: tuple[int, ...] | None = None
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    value: Any = None
    scalar_type: str | None = None
    per_process: bool = False
    uncommitted: bool = False
    array_key: str | None = None
    replicas: int | None = None
    cut: int | None = None
    slices: int | None = None
    tile_shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        # Flags and empty fields are written only when set, so version-1 records read
        # back unchanged. (By hand: `dataclasses.asdict` deep-copies, 40x slower.)
        d: dict[str, Any] = {}
        for name in _LEAF_FIELDS:
            v = getattr(self, name)
            if v is None or v is False:
                continue
            if name == "keys":
                v = [list(k) for k in v]
            elif isinstance(v, tuple):
                v = list(v)
            d[name] = v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LeafRecord:
        kw = {k: v for k, v in d.items() if k in _LEAF_FIELD_SET}  # later fields: ignored
        kw["keys"] = tuple((str(t), v) for t, v in kw.get("keys", ()))
        for k in ("shape", "stored_shape", "chunk_shape", "tile_shape"):
            if kw.get(k) is not None:
                kw[k] = tuple(int(i) for i in kw[k])
        return cls(**kw)


_LEAF_FIELDS: Final = tuple(f.name for f in dataclasses.fields(LeafRecord))
_LEAF_FIELD_SET: Final = frozenset(_LEAF_FIELDS)


@dataclasses.dataclass(frozen=True)
class PartManifest:
    """Everything one process saved for one step.

    Attributes:
      step: the training step.
      run_id: the run the part belongs to; data of other runs is never read.
      save_id: random id of this save of this part; a memory or peer copy is
        only used when it matches the `index_<owner>.json` in the item directory.
      owner: the process that wrote the part.
      process_count: how many processes saved this step.
      failure_domain: the owner's failure domain.
      leaves: the whole tree, identical in every part of a step.
      chunks: leaf index -> the chunks `owner` wrote.
      iterator_states: leaf index -> `owner`'s iterator state (JSON).
      scalars: leaf index -> `owner`'s value of a per-process scalar (JSON).
      shardings: leaf index -> `owner`'s sharding of a per-process jax.Array.
      created: wall-clock time of the snapshot.
      metrics: measurements of the save (stall, bytes, ...), informational.
      persist: whether the save asked for the step's persistence
        (`TieredSave(persist=True)`), whatever `TierOptions.persist_every` says.
        Added in version 3 with a default (False).
      weak_types: the indices of the array leaves saved weakly typed (a learning
        rate made from a Python float): the saved tree's metadata gives them
        back weakly typed, so a restore through it keeps `lr * bf16` in
        bfloat16. Added in version 3 with a default (none), written only when
        there are some.
      nonfinite: leaf index -> how many NaN/Inf values `owner`'s chunks of that
        floating leaf hold, for the leaves that hold any; None: not counted
        (`TierOptions.count_nonfinite` off, or a manifest from before it).
        Added in version 3 with a default (None).
    """

    step: int
    run_id: str
    save_id: str
    owner: int
    process_count: int
    failure_domain: str
    leaves: tuple[LeafRecord, ...]
    chunks: Mapping[int, tuple[ChunkRecord, ...]]
    iterator_states: Mapping[int, Any]
    created: float
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scalars: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    shardings: Mapping[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    persist: bool = False
    weak_types: tuple[int, ...] = ()
    nonfinite: Mapping[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for cs in self.chunks.values() for c in cs)

    @property
    def slices(self) -> int:
        """How many of this part's chunks are its owner's share of shards it holds with
        other data-parallel replicas (leaves with `replicas`)."""
        return sum(len(cs) for i, cs in self.chunks.items() if self.leaves[i].replicas)

    @property
    def replicas(self) -> int:
        """The most processes any shard of the step is held by (1: no replicated leaf)."""
        return max((r.replicas or 1 for r in self.leaves), default=1)

    def to_dict(self, leaves: bool = True) -> dict[str, Any]:
        """The manifest as a dict; `leaves=False` leaves the leaf records out (None):
        the callers that write them once per tree (`to_json`, the step index)."""
        d = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "run_id": self.run_id,
            "save_id": self.save_id,
            "owner": self.owner,
            "process_count": self.process_count,
            "failure_domain": self.failure_domain,
            "leaves": [leaf.to_dict() for leaf in self.leaves] if leaves else None,
            "chunks": remembered(_CHUNK_DICTS, self.chunks, self._chunk_dicts),
            "iterator_states": {str(i): s for i, s in self.iterator_states.items()},
            "scalars": {str(i): v for i, v in self.scalars.items()},
            "shardings": {str(i): s for i, s in self.shardings.items()},
            "created": self.created,
            "metrics": dict(self.metrics),
            "persist": self.persist,
            "jaxckpt_version": JAXCKPT_VERSION,
        } | (
            {}
            if self.nonfinite is None
            else {"nonfinite": {str(i): n for i, n in self.nonfinite.items()}}
        )
        if self.weak_types:
            d["weak_types"] = list(self.weak_types)
        return d

    def _chunk_dicts(self) -> dict[str, list[dict[str, Any]]]:
        return {str(i): [c.to_dict() for c in cs] for i, cs in self.chunks.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartManifest:
        if d.get("format") != FORMAT_NAME:
            raise ValueError(f"Not a jaxckpt manifest (format={d.get('format')!r}).")
        if d.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"jaxckpt manifest version {d.get('version')!r} is not supported by this "
                f"jaxckpt (reads versions {', '.join(map(str, READABLE_VERSIONS))}); "
                "upgrade jaxckpt."
            )
        leaves = tuple(LeafRecord.from_dict(x) for x in d["leaves"])
        if d["version"] < 3:  # arrays named by leaf index
            leaves = tuple(
                dataclasses.replace(r, array_key=str(i)) if r.kind in (ARRAY, NUMPY) else r
                for i, r in enumerate(leaves)
            )
        return cls(
            step=int(d["step"]),
            run_id=str(d["run_id"]),
            save_id=str(d["save_id"]),
            owner=int(d["owner"]),
            process_count=int(d["process_count"]),
            failure_domain=str(d["failure_domain"]),
            leaves=leaves,
            chunks={
                int(i): tuple(ChunkRecord.from_dict(c) for c in cs) for i, cs in d["chunks"].items()
            },
            iterator_states={int(i): s for i, s in d["iterator_states"].items()},
            created=float(d["created"]),
            metrics=dict(d.get("metrics", {})),
            scalars={int(i): v for i, v in d.get("scalars", {}).items()},
            shardings={int(i): s for i, s in d.get("shardings", {}).items()},
            persist=bool(d.get("persist", False)),
            weak_types=tuple(int(i) for i in d.get("weak_types", ())),
            nonfinite=(
                {int(i): int(n) for i, n in d["nonfinite"].items()}
                if d.get("nonfinite") is not None
                else None
            ),
        )

    def is_due(self, persist_every: int) -> bool:
        """Whether this step is to be persisted: asked for, or due by `persist_every`."""
        return self.persist or self.step % persist_every == 0

    def to_json(self) -> str:
        """The manifest as JSON, its CRC-32C (of the text before it) as the last member.

        The leaf records, the bulk of a big tree's manifest and the same at every
        save of one tree, are serialized once per `leaves` tuple.
        """
        d = self.to_dict(leaves=False)
        body = json.dumps(d, separators=(",", ":")).replace(
            '"leaves":null', '"leaves":' + _leaves_json(self.leaves), 1
        )
        return _checked_json.with_checksum(body)

    @classmethod
    def from_json(cls, text: str | bytes) -> PartManifest:
        """Parses (and checks) a manifest; the same text is parsed once per process.

        Raises:
          ValueError: if the text is damaged (its checksum does not match) or is no
            jaxckpt manifest of a readable version.
        """
        raw = text.encode() if isinstance(text, str) else bytes(text)
        key = (len(raw), _checksum.crc32c(raw))
        cached = _PARSED.get(key)
        if cached is not None and cached[0] == raw:
            return cached[1]
        manifest = cls.from_dict(_checked_json.checked(raw))
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED), (-1, -1)), None)
        _PARSED[key] = (raw, manifest)
        return manifest


def _leaves_json(leaves: tuple[LeafRecord, ...]) -> str:
    """The JSON of a tree's leaf records, once per tree (`remembered`: the snapshot hands
    the same tuple to every save of an unchanged tree, so a save's cost of it does not
    grow with the leaf count)."""
    return remembered(
        _LEAVES_JSON,
        leaves,
        lambda: json.dumps([leaf.to_dict() for leaf in leaves], separators=(",", ":")),
    )


_V = TypeVar("_V")


def remembered(memo: dict[int, tuple[object, _V]], of: object, compute: Callable[[], _V]) -> _V:
    """`compute()`, what `of` (never changed once made) gives, remembered in `memo` for
    the last few such objects by identity. The caller does not change what it gets."""
    hit = memo.get(id(of))
    if hit is not None and hit[0] is of:
        return hit[1]
    value = compute()
    with _REMEMBERING:  # commits of several items may run at once
        if len(memo) >= _REMEMBERED:
            memo.pop(next(iter(memo), -1), None)
        memo[id(of)] = (of, value)
    return value


_LEAVES_JSON: dict[int, tuple[object, str]] = _resources.SHARED.cache({})
# A save's chunk records as dicts: its memory manifest and its step index entry both
# write them (the manifest is replaced in between, with the same `chunks`).
_CHUNK_DICTS: dict[int, tuple[object, dict[str, Any]]] = _resources.SHARED.cache({})
_REMEMBERED: Final = 4
_REMEMBERING: Final = threading.Lock()

# Parsed manifests by text: a restore reads the same manifests (index, memory, persisted
# copies) several times, and a 4000-leaf one takes ~0.1 s to parse.
_PARSED: dict[tuple[int, int], tuple[bytes, PartManifest]] = _resources.SHARED.cache({})
_PARSED_MAX: Final = 64


def saved_process_count(manifests: Mapping[int, PartManifest]) -> int:
    """How many processes saved the step whose index manifests are `manifests`: what a
    step index read in part records in its header (`process_count`: no part's entry
    parsed for it), else the most any part records."""
    recorded = getattr(manifests, "process_count", None)
    if isinstance(recorded, int):
        return recorded
    return max((m.process_count for m in manifests.values()), default=0)
