"""Below the persistent-store seam: bytes on a local (POSIX) directory or an object store.

The checkpoint directory a CheckpointManager hands the handler is either a
local path or a URL on an object store (`gs://bucket/...`, `s3://bucket/...`).
What the two stores do differently is `_store.PersistentStore`'s (`_store.at`
chooses); this module holds what both need, telling a file from an object by the
path alone:

- `as_path`: a `pathlib.Path` for a local directory; an `etils.epath.Path` for
  a URL (gcsfs or s3fs underneath), which offers the same methods used on it
  here (`/`, `name`, `parent`, `exists`, `is_dir`, `iterdir`, `glob`,
  `read_text`). `Path(os.fspath(url))` must never be used: it silently turns
  `gs://b/x` into the local relative path `gs:/b/x`. `absolute`: the same as
  an `epath.Path`, a local path made absolute (what Orbax's specs need).
- `kvstore`: the tensorstore kvstore spec of a directory: `file`, `gcs` or `s3`.
  Tensorstore's `gcs` kvstore reads `TENSORSTORE_GCS_HTTP_URL` (an emulator) and
  application default credentials itself; its `s3` kvstore does not read
  `AWS_ENDPOINT_URL`, so the endpoint and region are put into the spec from the
  standard AWS variables (any S3-compatible store: MinIO, R2, ...).
- `write_file`: a file that appears whole or not at all: a rename on a local
  filesystem (`_fs.write_atomic`), one PUT on an object store (an object is
  never visible half-written). `read_bytes`, `read_range`, `exists`: one read (of
  all or part of a file) or look, never answered from a cached listing; `write_object`, `delete_objects`: bounded
  object-store requests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import tensorstore as ts
from etils import epath

from jaxckpt.memory import _fs

# Object stores jaxckpt persists to, by URL scheme -> tensorstore kvstore driver.
_DRIVERS = {"gs": "gcs", "s3": "s3"}

# Bounded retries of each object-store request (tensorstore's own default retries a
# request 32 times for minutes); the persister retries a whole part on top of this.
_REQUEST_RETRIES = {"max_retries": 4, "initial_delay": "100ms", "max_delay": "2s"}
CONTEXT_SPEC: dict[str, Any] = {
    "gcs_request_retries": _REQUEST_RETRIES,
    "s3_request_retries": _REQUEST_RETRIES,
    "gcs_request_concurrency": {"limit": 64},
    "s3_request_concurrency": {"limit": 64},
}


# A bound on one object-store request that gets no answer at all (tensorstore's
# requests have no timeout of their own); TimeoutError after it.
REQUEST_TIMEOUT_S = 30.0


def scheme(path: str | os.PathLike[str]) -> str | None:
    """The object-store scheme of `path` ('gs' or 's3'), None for a local path."""
    text = str(path)
    for name in _DRIVERS:
        if text.startswith(f"{name}://"):
            return name
    return None


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a location on an object store rather than a filesystem."""
    return scheme(path) is not None


def as_path(path: str | os.PathLike[str]) -> Path:
    """`path` as an object with pathlib's methods: a `pathlib.Path` if local, else an
    `epath.Path` (typed as `Path`: it offers the same methods used on it here)."""
    if is_remote(path):
        return cast(Path, epath.Path(str(path)))
    return Path(os.fspath(path))


def absolute(path: str | os.PathLike[str]) -> epath.Path:
    """`path` as an `epath.Path` that names it wherever it is read from: a local path
    made absolute (Orbax's tensorstore specs need one), a URL as it is."""
    if is_remote(path):
        return epath.Path(os.fspath(path))
    return epath.Path(os.path.abspath(os.fspath(path)))


def kvstore(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The tensorstore kvstore spec of the directory `path` (local or object store)."""
    name = scheme(path)
    if name is None:
        return {"driver": "file", "path": os.fspath(path).rstrip("/") + "/"}
    bucket, _, key = str(path)[len(name) + 3 :].partition("/")
    spec: dict[str, Any] = {
        "driver": _DRIVERS[name],
        "bucket": bucket,
        "path": key.strip("/") + "/",
    }
    if name == "s3":
        # Tensorstore's s3 kvstore ignores AWS_ENDPOINT_URL (it would go to AWS itself).
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
    return spec


def write_file(path: Path, data: str) -> None:
    """Writes a file that readers see whole or not at all (see the module docstring)."""
    if is_remote(path):
        path.write_text(data)  # one PUT
    else:
        _fs.write_atomic(path, data)


def forget_listings(path: Path) -> None:
    """Drops this process's cached object-store listings of `path` and its parents
    (gcsfs and s3fs cache them), so that its next look, or Orbax's, sees what
    another process wrote there. Nothing on a local path."""
    if not is_remote(path):
        return
    from etils.epath import backend

    with contextlib.suppress(Exception):  # a cache only: nothing to lose
        backend.fsspec_backend.fs(str(path)).invalidate_cache(str(path))


def delete_objects(directory: Path, keys: Sequence[str]) -> None:
    """Deletes the objects `keys` under the object-store directory `directory`, one
    request each, concurrently, with tensorstore's bounded retries (a store that is
    down fails this in seconds); absent objects are fine.

    Never a prefix deletion: it lists first, and some emulators list more than the
    prefix asked for.
    """
    store = _result(ts.KvStore.open(kvstore(directory), context=_context()), directory)
    for done in [store.write(key, None) for key in keys]:
        _result(done, f"Deleting {keys} under {directory}")


def delete_tree(directory: Path) -> int:
    """Deletes every object under the object-store directory `directory`: listed afresh
    (the fsspec client, never a cached listing; only keys under `directory`, as some
    emulators list more), then deleted by `delete_objects`. Returns how many."""
    from etils.epath import backend

    forget_listings(directory)
    fs = backend.fsspec_backend.fs(str(directory))
    prefix = fs._strip_protocol(str(directory)).rstrip("/") + "/"
    keys = [name[len(prefix) :] for name in fs.find(prefix) if name.startswith(prefix)]
    delete_objects(directory, keys)
    return len(keys)


def write_object(path: Path, data: str) -> None:
    """Writes one object on an object store (one PUT: visible whole or not at all),
    with tensorstore's bounded retries."""
    store = _result(ts.KvStore.open(kvstore(path.parent), context=_context()), path)
    _result(store.write(path.name, data.encode()), f"Writing {path}")


def read_bytes(path: Path) -> bytes:
    """The bytes of the file `path`. On an object store: one request, with tensorstore's
    bounded retries, and never an answer from a cached listing (a listing cached by
    gcsfs/s3fs before an object was written by tensorstore would hide it).

    Raises:
      FileNotFoundError: if there is no such file.
    """
    if not is_remote(path):
        return path.read_bytes()
    store = _result(ts.KvStore.open(kvstore(path.parent), context=_context()), path)
    got = _result(store.read(path.name), f"Reading {path}")
    if got.state != "value":
        raise FileNotFoundError(f"{path} does not exist.")
    return bytes(got.value)


def read_range(path: Path, start: int, stop: int | None) -> bytes:
    """Bytes `start` to `stop` (None: its end) of the file `path`, fewer where the file
    ends before `stop` (a seek and a read; on an object store one ranged request).

    Raises:
      FileNotFoundError: if there is no such file.
    """
    if not is_remote(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(-1 if stop is None else stop - start)
    store = _result(ts.KvStore.open(kvstore(path.parent), context=_context()), path)
    try:
        got = _result(store.read(path.name, byte_range=slice(start, stop)), f"Reading {path}")
    except OSError as e:
        if "OUT_OF_RANGE" not in str(e):
            raise
        # The object ends before `stop`: what it holds from `start` on.
        got = _result(store.read(path.name, byte_range=slice(start, None)), f"Reading {path}")
    if got.state != "value":
        raise FileNotFoundError(f"{path} does not exist.")
    return bytes(got.value)


def exists(path: Path) -> bool:
    """Whether the file `path` exists. On an object store: one request, with
    tensorstore's bounded retries, and never an answer from a cached listing."""
    if not is_remote(path):
        return path.exists()
    store = _result(ts.KvStore.open(kvstore(path.parent), context=_context()), path)
    return _result(store.read(path.name), f"Looking for {path}").state == "value"


def _result(future: Any, what: object) -> Any:
    """`future`'s result within `REQUEST_TIMEOUT_S`; a failure as an OSError naming `what`.

    Raises:
      TimeoutError: if the store did not answer in time.
      OSError: if the request failed (after tensorstore's bounded retries).
    """
    start = time.monotonic()
    try:
        return future.result(timeout=REQUEST_TIMEOUT_S)
    except ValueError as e:
        if time.monotonic() - start >= REQUEST_TIMEOUT_S:
            raise TimeoutError(
                f"{what}: the object store did not answer within {REQUEST_TIMEOUT_S:.0f} s."
            ) from e
        raise OSError(f"{what}: the object store request failed: {e}") from e


@functools.cache
def _context() -> ts.Context:
    return ts.Context(CONTEXT_SPEC)


def identity(path: str | os.PathLike[str]) -> str:
    """A string naming the location for good: the real path of a local directory
    (every spelling of it the same), the URL of an object store location."""
    if is_remote(path):
        return str(path).rstrip("/")
    return os.path.realpath(os.fspath(path))
