"""`export`: a durable jaxckpt step out as a plain Orbax checkpoint or safetensors files.

No lock-in: evaluation, serving and fine-tuning pipelines read Orbax checkpoints
or safetensors, not jaxckpt. An export reads the step's persisted parts (every
process's zarr3 arrays, through tensorstore: file, gs://, s3://), checks every
chunk against its CRC-32C, assembles each leaf whole, and hands it to the format's
own library: Orbax's `CheckpointManager` (with `StandardSave`) or
`safetensors.serialize_file`. Nothing of jaxckpt is needed to read the result.

Leaf by leaf, with bounded host memory:

- orbax: each leaf is assembled, one chunk at a time, into its own file in a
  scratch directory beside the output and handed to Orbax as a read-only
  `np.memmap`; Orbax writes at most `save_concurrent_gb` (1 GB here) at a time.
  Anonymous memory: about one chunk plus Orbax's 1 GB in flight; the staged
  leaves are file-backed pages the kernel may drop. Needs disk room for one more
  copy of the step until the export ends (the scratch directory is removed).
- safetensors: leaves are assembled in memory into the current shard, which is
  written (and let go) before a leaf would take it past `max_shard_bytes`: at
  most max(`max_shard_bytes`, the largest leaf) of host memory.

What a format cannot hold: iterator states (a data pipeline's position) are not
exported (named in the report). Typed PRNG keys are exported as their key data
(`jax.random.key_data`: uint32, the key's shape plus the impl's trailing dims);
the impl is recorded (safetensors `__metadata__`, Orbax custom metadata) for
`jax.random.wrap_key_data(data, impl=...)`. A per-process leaf (a numpy array,
a process-local array or scalar saved by every process) is exported with
process 0's value. safetensors holds numeric tensors only: numeric scalars
become 0-d tensors (numbers in Orbax); other scalars (strings, None) are named
and skipped in both formats (Orbax's `StandardSave` refuses strings).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import orbax.checkpoint as ocp

from jaxckpt.format import _format
from jaxckpt.persistent import _storage
from jaxckpt.restore import _durable_step

FORMATS: Final = ("orbax", "safetensors")
ORBAX_ITEM: Final = "default"  # a single-item CheckpointManager's item name
DEFAULT_MAX_SHARD_BYTES: Final = 5 * 10**9  # what large models ship (`max_shard_size="5GB"`)
SAFETENSORS_INDEX: Final = "model.safetensors.index.json"
_ORBAX_CONCURRENT_GB: Final = 1

Progress = Callable[[int, int, int, int], None]  # (leaves done, leaves, bytes done, bytes)


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote.

    Attributes:
      out: the output directory.
      format: "orbax" or "safetensors".
      step: the exported step.
      leaves: exported name -> the leaf's tree path.
      skipped: tree path -> why it was not exported.
      key_impls: exported name -> PRNG impl, for leaves exported as key data.
      files: the files a reader opens (safetensors shards and index; the Orbax
        step's item directory).
      bytes: array bytes exported.
    """

    out: Path
    format: str
    step: int
    leaves: Mapping[str, str]
    skipped: Mapping[str, str]
    key_impls: Mapping[str, str]
    files: tuple[Path, ...]
    bytes: int


def export(
    directory: str | os.PathLike[str],
    step: int,
    out: str | os.PathLike[str],
    *,
    format: str = "orbax",
    item: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_progress: Progress | None = None,
    timeout_s: float = 120.0,
) -> Exported:
    """Writes durable step `step` of the jaxckpt checkpoint in `directory` to `out`.

    `format="orbax"`: `out` becomes a CheckpointManager directory holding the step
    as one `StandardSave` item (`<out>/<step>/default`): read it with
    `ocp.StandardCheckpointer().restore(<out>/<step>/default)` or
    `ocp.CheckpointManager(<out>).restore(step, args=ocp.args.StandardRestore(...))`.
    The tree keeps the saved nesting (dicts; lists where the saved node was a
    sequence).

    `format="safetensors"`: `out` holds `model-0000i-of-0000n.safetensors` shards
    of at most `max_shard_bytes` each (a larger leaf gets a shard of its own) and
    `model.safetensors.index.json` (`weight_map`: tensor name -> shard), or one
    `model.safetensors` when everything fits in one shard. Tensor names are the
    tree paths joined by dots (`params.Dense_0.kernel`).

    See the module docstring for the host memory bound and what is not exported.

    Args:
      directory: the jaxckpt CheckpointManager directory (local, gs://, s3://).
      step: a step whose every part is persisted (`jaxckpt ls` says "durable").
      out: the output directory; it must not exist or be empty.
      format: "orbax" or "safetensors".
      item: the jaxckpt item (default: the only one in the step).
      max_shard_bytes: the size cap of a safetensors shard.
      on_progress: called after each leaf with (leaves done, leaves, bytes done, bytes).
      timeout_s: the longest one chunk read may take.

    Returns:
      What was written, exported and skipped.

    Raises:
      ValueError: an unknown format, a bad size cap, an output directory that holds
        files, or a chunk whose bytes do not match their checksum.
      FileNotFoundError: if the step is not in `directory`, or not durable.
    """
    if format not in FORMATS:
        raise ValueError(f"export: format must be one of {FORMATS}, got {format!r}.")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise ValueError(f"export: max_shard_bytes must be an int, got {max_shard_bytes!r}.")
    if max_shard_bytes < 1:
        raise ValueError(f"export: max_shard_bytes must be positive, got {max_shard_bytes}.")
    source = _durable_step.DurableStep.open(_storage.as_path(directory), step, item, timeout_s)
    out_dir = Path(os.path.abspath(os.fspath(out)))
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"export: the output directory {out_dir} is not empty.")
    out_dir.mkdir(parents=True, exist_ok=True)
    write = _orbax if format == "orbax" else _safetensors
    return write(source, out_dir, max_shard_bytes, on_progress or (lambda *_: None))


def _skip_reason(rec: _format.LeafRecord) -> str | None:
    if rec.kind == _format.ITERATOR:
        return "an iterator state (a data pipeline's position), which neither format holds"
    return None


def _orbax(source: _durable_step.DurableStep, out: Path, _cap: int, progress: Progress) -> Exported:
    scratch = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        entries: list[tuple[tuple[tuple[str, Any], ...], Any]] = []
        leaves: dict[str, str] = {}
        skipped: dict[str, str] = {}
        impls: dict[str, str] = {}
        total = 0
        todo = sum(source.nbytes(i) for i in range(len(source.leaves)))
        for i, rec in enumerate(source.leaves):
            why = _skip_reason(rec)
            if why is not None:
                skipped[rec.path] = why
            elif rec.kind == _format.SCALAR:
                value, why = _scalar_tensor(rec, source.scalar(i))
                if value is None:
                    skipped[rec.path] = f"{why} (StandardSave: arrays and numbers)"
                else:
                    entries.append((rec.keys, value[()]))
                    leaves[source.names[i]] = rec.path
            else:
                entries.append((rec.keys, _staged(source, i, scratch / f"leaf_{i}")))
                leaves[source.names[i]] = rec.path
                total += source.nbytes(i)
                if rec.key_impl:
                    impls[source.names[i]] = rec.key_impl
            progress(i + 1, len(source.leaves), total, todo)
        handler = ocp.StandardCheckpointHandler(save_concurrent_gb=_ORBAX_CONCURRENT_GB)
        with ocp.CheckpointManager(out, item_handlers=handler) as mngr:
            mngr.save(
                source.step,
                args=ocp.args.StandardSave(_nest(entries)),
                custom_metadata={"jaxckpt_export": {"key_impls": impls, "skipped": skipped}},
            )
            mngr.wait_until_finished()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    item_dir = out / str(source.step) / ORBAX_ITEM
    return Exported(out, "orbax", source.step, leaves, skipped, impls, (item_dir,), total)


def _staged(source: _durable_step.DurableStep, i: int, path: Path) -> np.ndarray:
    """Leaf `i` assembled chunk by chunk in a file at `path`, then mapped read-only.

    The file is written through a shared mapping that is flushed and dropped once
    the leaf is whole: its pages are then page cache, not this process's memory.
    """
    rec = source.leaves[i]
    assert rec.stored_shape is not None and rec.stored_dtype is not None
    dtype, shape = np.dtype(rec.stored_dtype), rec.stored_shape
    if not source.nbytes(i):
        return np.zeros(shape, dtype)
    dest = np.memmap(path, dtype=dtype, mode="w+", shape=shape)
    source.fill(i, dest)
    dest.flush()
    del dest
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def _nest(entries: list[tuple[tuple[tuple[str, Any], ...], Any]]) -> Any:
    """The saved tree's nesting rebuilt as dicts, and lists where every index of a
    sequence node is present."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    groups: dict[Any, list[tuple[tuple[tuple[str, Any], ...], Any]]] = {}
    kinds: dict[Any, str] = {}
    for keys, value in entries:
        groups.setdefault(keys[0][1], []).append((keys[1:], value))
        kinds[keys[0][1]] = keys[0][0]
    nested = {k: _nest(v) for k, v in groups.items()}
    if all(kind == "s" for kind in kinds.values()) and sorted(nested) == list(range(len(nested))):
        return [nested[i] for i in range(len(nested))]
    return {str(k): v for k, v in nested.items()}


def _safetensors(
    source: _durable_step.DurableStep, out: Path, cap: int, progress: Progress
) -> Exported:
    try:
        import safetensors
    except ImportError as e:
        raise ValueError(
            "export: the safetensors format needs the `safetensors` package: "
            "pip install 'jaxckpt[safetensors]'."
        ) from e
    shards: list[dict[str, np.ndarray]] = [{}]
    files: list[Path] = []
    weight_map: dict[str, int] = {}
    leaves: dict[str, str] = {}
    skipped: dict[str, str] = {}
    impls: dict[str, str] = {}
    sizes = [0]
    todo = sum(source.nbytes(i) for i in range(len(source.leaves)))
    done = 0

    def flush() -> None:
        path = out / f".shard-{len(files):05d}.safetensors"
        metadata = {"format": "np", "jaxckpt_step": str(source.step)}
        metadata["jaxckpt_key_impls"] = json.dumps(impls, sort_keys=True)
        safetensors.serialize_file(
            {
                name: safetensors.TensorSpec(
                    dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes
                )
                for name, a in shards[-1].items()
            },
            path,
            metadata=metadata,
        )
        files.append(path)
        shards[-1] = {}  # let go of the shard's arrays
        shards.append({})
        sizes.append(0)

    for i, rec in enumerate(source.leaves):
        name = source.names[i]
        why = _skip_reason(rec)
        value: np.ndarray | None = None
        if why is None and rec.kind == _format.SCALAR:
            value, why = _scalar_tensor(rec, source.scalar(i))
        if why is not None:
            skipped[rec.path] = why
        else:
            n = source.nbytes(i) if value is None else value.nbytes
            if shards[-1] and sizes[-1] + n > cap:
                flush()
            if value is None:
                assert rec.stored_shape is not None and rec.stored_dtype is not None
                value = np.empty(rec.stored_shape, np.dtype(rec.stored_dtype))
                source.fill(i, value)
            shards[-1][name] = value
            sizes[-1] += value.nbytes
            weight_map[name] = len(files)
            leaves[name] = rec.path
            done += source.nbytes(i)
            if rec.key_impl:
                impls[name] = rec.key_impl
        progress(i + 1, len(source.leaves), done, todo)
    if shards[-1] or not files:
        flush()
    final = _name_shards(out, files, weight_map, leaves, impls, source.step, sum(sizes))
    return Exported(out, "safetensors", source.step, leaves, skipped, impls, final, done)


def _scalar_tensor(rec: _format.LeafRecord, scalar: Any) -> tuple[np.ndarray | None, str | None]:
    """A numeric scalar as a 0-d tensor (its saved numpy dtype, if it had one), or why not."""
    if isinstance(scalar, (bool, int, float)):
        typed = rec.scalar_type not in (None, "int", "float", "bool", "str")
        return np.asarray(scalar, dtype=rec.scalar_type if typed else None), None
    return None, f"a {rec.scalar_type} scalar, which the format cannot hold"


def _name_shards(
    out: Path,
    files: list[Path],
    weight_map: dict[str, int],
    leaves: Mapping[str, str],
    impls: Mapping[str, str],
    step: int,
    total: int,
) -> tuple[Path, ...]:
    """Renames the shards to their final names; writes the index when there are several."""
    if len(files) == 1:
        final = [out / "model.safetensors"]
    else:
        n = len(files)
        final = [out / f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for tmp, path in zip(files, final, strict=True):
        tmp.rename(path)
    if len(files) == 1:
        return tuple(final)
    index = {
        "metadata": {
            "total_size": total,
            "jaxckpt_step": step,
            "jaxckpt_paths": dict(leaves),
            "jaxckpt_key_impls": dict(impls),
        },
        "weight_map": {name: final[k].name for name, k in sorted(weight_map.items())},
    }
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return (*final, out / SAFETENSORS_INDEX)
