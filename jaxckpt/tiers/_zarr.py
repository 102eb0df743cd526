"""Chunks on any kvstore: zarr3 arrays written and read with tensorstore.

The persistent tier keeps each array leaf of a part as one zarr3 array whose
chunk grid is the saved shard shape, so every saved shard is exactly one chunk.
A compression codec may be added, and every array ends with zarr3's standard
`crc32c` codec, so that any zarr3 reader verifies every chunk it reads. (The
memory and peer tiers keep slabs instead: `_slab`.)

A leaf saved in tiles (`_tiles`) keeps each chunk as one zarr3 shard
(`sharding_indexed`) whose inner chunks are its tiles, each followed by its
CRC-32C: a restore that needs some tiles of a chunk reads only those (a ranged
read each, on a file or an object store), and the checksum zarr3 verifies is the
tile's own (`ChunkRecord.tiles`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt.format import _chunking, _format
from jaxckpt.tiers import _storage

_COMPRESSION_CODECS: dict[str | None, list[dict[str, Any]]] = {
    None: [],
    "zstd": [{"name": "zstd", "configuration": {"level": 1}}],
    "gzip": [{"name": "gzip", "configuration": {"level": 1}}],
    "blosc": [
        {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle"}}
    ],
}

# Plenty of cache-free concurrency for many small chunks on tmpfs.
# Object stores: bounded request retries and concurrency (`_storage.CONTEXT_SPEC`).
_CONTEXT = ts.Context(
    {
        "file_io_concurrency": {"limit": 64},
        "data_copy_concurrency": {"limit": 8},
        **_storage.CONTEXT_SPEC,
    }
)


def _context_for(kvstore: dict[str, Any]) -> ts.Context:
    """The context to open an array on `kvstore` with.

    An object store's array gets a cache pool of its own (the concurrency limits
    stay shared): a metadata entry cached by an earlier open would be revalidated
    by its storage generation, which some S3-compatible stores and emulators do
    not return ("Malformed StorageGeneration"); each open reads `zarr.json` afresh.
    """
    if kvstore.get("driver") in ("file", "memory"):
        return _CONTEXT
    return ts.Context({"cache_pool": {}}, parent=_CONTEXT)


def kvstore_at(kvstore: dict[str, Any], *parts: str) -> dict[str, Any]:
    """`kvstore` with `parts` joined onto its path (a directory)."""
    base = kvstore.get("path", "")
    if base and not base.endswith("/"):
        base += "/"
    return {**kvstore, "path": base + "/".join(parts) + "/"}


def array_kvstore(part_kvstore: dict[str, Any], record: _format.LeafRecord) -> dict[str, Any]:
    """Where the zarr3 array of an ARRAY or NUMPY leaf is in a part."""
    assert record.array_key is not None, record.path
    return kvstore_at(part_kvstore, _format.ARRAYS_DIR, record.array_key)


def file_kvstore(path: str) -> dict[str, Any]:
    return {"driver": "file", "path": str(path).rstrip("/") + "/"}


def _fill_value(dtype: str | None) -> Any:
    """The zarr3 fill value of `dtype` in JSON: complex numbers are [real, imag]."""
    if dtype == "bool":
        return False
    if dtype is not None and np.dtype(dtype).kind == "c":
        return [0, 0]
    return 0


def create(
    kvstore: dict[str, Any],
    record: _format.LeafRecord,
    compression: str | None = None,
    *,
    empty: bool = False,
    attributes: dict[str, Any] | None = None,
    crc32c: bool = False,
) -> ts.Future:
    """Creates (replacing any old one) the zarr3 array of an array leaf, with
    `attributes` (see `_array_keys.array_attributes`) in its metadata and, with
    `crc32c`, a checksum after every chunk.

    With `empty`, the caller has removed any old array's `zarr.json`, and no old
    chunk is deleted (on an object store that is a listing and a request per
    object, and some emulators list more than the prefix asked for): chunks
    written now replace the old ones, and a manifest never lists the others.
    """
    assert record.stored_shape is not None and record.chunk_shape is not None
    codecs = (
        [{"name": "bytes", "configuration": {"endian": "little"}}]
        + _COMPRESSION_CODECS[compression]
        + ([{"name": "crc32c"}] if crc32c else [])
    )
    if record.tile_shape is not None:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(record.tile_shape),
                    "codecs": codecs,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    # At the start: a plain range read (some object stores, the GCS
                    # emulator among them, ignore a suffix range such as "bytes=-516").
                    "index_location": "start",
                },
            }
        ]
    metadata = {
        "shape": list(record.stored_shape),
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": list(record.chunk_shape)},
        },
        "chunk_key_encoding": {"name": "default"},
        "data_type": record.stored_dtype,
        "codecs": codecs,
        "fill_value": _fill_value(record.stored_dtype),
    }
    if attributes:
        metadata["attributes"] = attributes
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata}
    return ts.open(spec, create=True, delete_existing=not empty, context=_context_for(kvstore))


def open_array(kvstore: dict[str, Any], record: _format.LeafRecord | None = None) -> ts.Future:
    """Opens an existing zarr3 array for reading; with `record`, fails unless its stored
    dtype, shape and chunk shape are the ones the manifest records."""
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kvstore}
    if record is not None:
        assert record.stored_shape is not None and record.chunk_shape is not None
        spec["dtype"] = record.stored_dtype
        spec["schema"] = {
            "domain": {"shape": list(record.stored_shape)},
            "chunk_layout": {
                "read_chunk": {"shape": list(record.tile_shape or record.chunk_shape)},
                "write_chunk": {"shape": list(record.chunk_shape)},
            },
        }
    return ts.open(spec, open=True, context=_context_for(kvstore))


async def settle(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Awaits every one of `awaitables`, then raises the first failure, if any.

    Unlike `asyncio.gather`, a failure (say ENOSPC) does not return while the
    other writes are still in flight: a caller that removes the directory they
    write into on failure would otherwise race them and leave files behind.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if tasks:
        await asyncio.wait(tasks)
    # Retrieving every exception (not only the first) keeps asyncio from logging the rest.
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]


async def write_chunks(
    kvstore: dict[str, Any],
    record: _format.LeafRecord,
    pieces: Sequence[tuple[_chunking.Region, np.ndarray]],
    compression: str | None = None,
    *,
    empty: bool = False,
    attributes: dict[str, Any] | None = None,
    crc32c: bool = False,
) -> None:
    """Writes whole chunks of one leaf into a new zarr3 array (options as in `create`):
    `pieces` are (region, values) that together cover each chunk written: whole chunks,
    or the tiles of a tiled leaf's chunks (written in one transaction, so that each
    chunk, a zarr3 shard, is encoded and stored once)."""
    array = await create(
        kvstore, record, compression, empty=empty, attributes=attributes, crc32c=crc32c
    )
    if record.tile_shape is None:
        await settle([array[region].write(data) for region, data in pieces])
        return
    txn = ts.Transaction()
    staged = array.with_transaction(txn)
    await settle([staged[region].write(data) for region, data in pieces])
    await txn.commit_async()
