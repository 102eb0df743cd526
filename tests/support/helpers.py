"""Helpers shared by the tests: states, managers, subprocess runs."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import patience
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.run import _choreography

REPO = Path(__file__).resolve().parents[2]
# What a child Python process needs to import jaxckpt and the test modules by name.
TEST_PYTHONPATH = ":".join(
    str(p) for p in (REPO, REPO / "tests" / "support", REPO / "tests" / "workers")
)


def mesh_1d(n: int = 8, name: str = "data") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,))


def manager(
    ckpt_dir: Any,
    handler: jaxckpt.TieredCheckpointHandler,
    *,
    use_async: bool = True,
    registry: bool = True,
    **options: Any,
) -> ocp.CheckpointManager:
    """A CheckpointManager around `handler` for the item "train", whose garbage
    collection keeps the newest durable step (`jaxckpt.manager_options`)."""
    opts = jaxckpt.manager_options(
        ckpt_dir, handler=handler, enable_async_checkpointing=use_async, **options
    )
    if registry:
        reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
        reg.add("train", jaxckpt.TieredSave, handler)
        reg.add("train", jaxckpt.TieredRestore, handler)
        return ocp.CheckpointManager(ckpt_dir, handler_registry=reg, options=opts)
    return ocp.CheckpointManager(ckpt_dir, item_handlers={"train": handler}, options=opts)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, **items: Any) -> None:
    mngr.save(step, args=ocp.args.Composite(train=jaxckpt.TieredSave(state), **items))


def restore(mngr: ocp.CheckpointManager, step: int, target: Any) -> Any:
    return mngr.restore(step, args=ocp.args.Composite(train=jaxckpt.TieredRestore(target))).train


def sharded_state(mesh: Mesh, seed: int = 0) -> dict[str, Any]:
    """Arrays of several shardings, a typed key, numpy and scalars."""
    rng = np.random.default_rng(seed)
    row = NamedSharding(mesh, P(mesh.axis_names[0]))
    return {
        "w": jax.device_put(rng.standard_normal((16, 6)).astype(np.float32), row),
        "b": jax.device_put(rng.standard_normal(5).astype(np.float32), NamedSharding(mesh, P())),
        "h": jax.device_put(rng.standard_normal((8, 4)).astype(jax.numpy.bfloat16), row),
        "keys": jax.device_put(jax.random.split(jax.random.key(seed), 8), row),
        "legacy_key": jax.random.PRNGKey(seed),
        "table": rng.integers(0, 100, (3, 3)),
        "step": 7,
        "scale": np.float32(0.5),
        "name": "run",
    }


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs with shardings for arrays; everything else as is."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree_util.tree_map(one, tree)


def assert_tree_equal(a: Any, b: Any) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert type(np.asarray(x).dtype) is type(np.asarray(y).dtype)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def train_state(mesh: Mesh, data_seed: int = 0) -> tuple[dict[str, Any], Any]:
    """A flax nnx model's params, optax adamw state, a typed key, a grain iterator and a step."""
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    fsdp = NamedSharding(mesh, P(mesh.axis_names[0]))
    params = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, fsdp if x.ndim == 2 else NamedSharding(mesh, P())), params
    )
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree_util.tree_map(jax.numpy.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial moments
    data = iter(grain.MapDataset.range(1000).shuffle(seed=data_seed).batch(4).to_iter_dataset())
    next(data), next(data)
    state = {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key(42),
        "data": data,
        "step": 2,
    }
    return state, tx


def fresh_iterator(data_seed: int = 0) -> Any:
    return iter(grain.MapDataset.range(1000).shuffle(seed=data_seed).batch(4).to_iter_dataset())


def attach_peers(h: jaxckpt.TieredCheckpointHandler, peers: Any, monkeypatch: Any) -> None:
    """Makes `h`'s run use `peers` (a stand-in for the peer service, in one process)
    instead of meeting the other processes of a jax.distributed job."""
    h.inspect().run.adopt(peers)  # met already: a save's or restore's meeting finds them
    if hasattr(peers, "exchange_inventories"):  # their pretend job's inventories
        monkeypatch.setattr(
            _choreography,
            "exchange_inventories",
            lambda run_id, local, timeout_s: peers.exchange_inventories(local),
        )


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def run_page_code(code: str, where: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs a page's code as a script in `where`, as a reader would: this checkout's
    jaxckpt (whichever one the environment has installed), CPU devices, nothing else
    from this process's environment. Raises unless it exits 0; returns the process."""
    script = where / "page.py"
    script.write_text(code)
    proc = patience.run(
        [sys.executable, str(script)],
        cwd=where,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 180) -> str:
    """Runs `code` in a new interpreter (8 CPU devices); returns stdout, raises on failure."""
    prelude = "import os, jax\njax.config.update('jax_num_cpu_devices', 8)\n"
    full_env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": TEST_PYTHONPATH,
        **(env or {}),
    }
    proc = patience.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        timeout=timeout,
        env=full_env,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def slab_chunk(part_dir: Path, leaf_path: str, index: tuple[int, ...]) -> tuple[Path, int, int]:
    """(slab file, offset, nbytes) of one chunk of the leaf at `leaf_path` in a memory or
    peer part directory, as its manifest records it."""
    from jaxckpt.format import _format
    from jaxckpt.memory import _slab

    manifest = _format.PartManifest.from_json((part_dir / _format.MANIFEST_FILE).read_text())
    leaf = [r.path for r in manifest.leaves].index(leaf_path)
    chunk = next(c for c in manifest.chunks[leaf] if c.index == tuple(index))
    assert chunk.offset is not None
    return part_dir / _slab.SLAB_FILE, chunk.offset, chunk.nbytes


def flip_slab_byte(
    part_dir: Path, leaf_path: str, index: tuple[int, ...], at: int = 0, bit: int = 0x40
) -> None:
    """Flips one bit of byte `at` (negative: from the end) of a chunk in a part's slab."""
    slab, offset, nbytes = slab_chunk(part_dir, leaf_path, index)
    with open(slab, "r+b") as f:
        f.seek(offset + (at % nbytes))
        byte = f.read(1)[0]
        f.seek(offset + (at % nbytes))
        f.write(bytes([byte ^ bit]))


# ---- filesystems that cannot be written ------------------------------------------------


def _mount(args: list[str], what: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {what} (needs root and mount rights): {done.stderr.strip()}")


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path`, unmounted on the way out whatever happens (needs
    root; skips the test otherwise, saying why)."""
    path.mkdir(parents=True)
    _mount(["-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], f"a {size} tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(source: Path, path: Path) -> Iterator[Path]:
    """`source` seen read-only at `path` (a read-only bind mount), unmounted on the way
    out whatever happens (needs root; skips the test otherwise, saying why). As root,
    permission bits would not stop a write; a read-only mount does."""
    path.mkdir(parents=True)
    _mount(["--bind", str(source), str(path)], f"a bind of {source}")
    try:
        _mount(["-o", "remount,ro,bind", str(path)], "a read-only bind")
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Writes into `directory` until its filesystem is full (ENOSPC)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        block = b"\0" * (1 << 16)
        while True:
            os.write(fd, block)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def index_manifest(item_dir: Path, owner: int = 0) -> dict[str, Any]:
    """`owner`'s index manifest of the step in `item_dir`, as a manifest's JSON members
    (read from the step's combined index, or from an older step's `index_<p>.json`)."""
    from jaxckpt.persistent import _index

    return _index.read_index(item_dir)[owner].to_dict()


def as_per_part_index(item_dir: Path) -> list[Path]:
    """Rewrites a step's combined index as the layout of earlier versions, one
    `index_<p>.json` per part; returns those files."""
    from jaxckpt.format import _format
    from jaxckpt.persistent import _index

    index = _index.read_index(item_dir)
    assert index, f"{item_dir} holds no index"
    files = []
    for owner, manifest in index.items():
        path = item_dir / _format.index_file(owner)
        path.write_text(manifest.to_json())
        files.append(path)
    (item_dir / _format.STEP_INDEX_FILE).unlink()
    return files
