"""The benchmark's training state and train step: an MLP's params plus optax adam state.

Weights are FSDP-sharded by rows over every device of every process, biases and
the adam step counter are replicated, so each process owns (replica_id 0) about
1/N of the bytes. The train step is one jitted, donated adam update on a fixed
batch: a real workload, with no input pipeline in the measurement.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS: Final = "data"
# Bytes per weight element in the saved state: the parameter, adam's mu and nu (float32).
_STATE_BYTES_PER_PARAM: Final = 3 * 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """The MLP: `layers` square `width` x `width` layers, `batch` rows per step."""

    width: int
    layers: int
    batch: int

    @property
    def state_bytes(self) -> int:
        return self.layers * (self.width * self.width + self.width) * _STATE_BYTES_PER_PARAM


def shape_for(state_gib: float, devices: int, batch_per_device: int) -> Shape:
    """The MLP whose params + adam state come closest to `state_gib` GiB.

    The width is a multiple of the device count (rows are sharded over devices)
    and at most 4096, so that a multi-GiB state is many arrays, as in a model.
    """
    target = state_gib * 2**30
    width = 4096
    while width > 256 and target / (width * width * _STATE_BYTES_PER_PARAM) < 4:
        width //= 2
    width = max(devices, width - width % devices)
    layers = max(1, round(target / (width * width * _STATE_BYTES_PER_PARAM)))
    return Shape(width, layers, batch_per_device * devices)


def mesh() -> Mesh:
    """A 1-D mesh over every device of every process."""
    return Mesh(np.array(jax.devices()), (AXIS,))


def row_sharding(m: Mesh, transposed: bool = False) -> NamedSharding:
    """How 2-D leaves are sharded: by rows (saving), or by columns (a mesh change)."""
    return NamedSharding(m, P(None, AXIS) if transposed else P(AXIS, None))


def shardings_like(tree: Any, m: Mesh, transposed: bool = False) -> Any:
    """Row (or column) sharding for 2-D leaves, replicated for the rest."""
    replicated = NamedSharding(m, P())
    return jax.tree_util.tree_map(
        lambda x: row_sharding(m, transposed) if np.ndim(x) == 2 else replicated, tree
    )


def _loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for i in range(len(params)):
        layer = params[f"layer{i:03d}"]
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean((h - y) ** 2)


@dataclasses.dataclass
class Training:
    """Everything a benchmark loop needs: the state, the step, the batch, the layout."""

    mesh: Mesh
    params: Any
    opt_state: Any
    batch: tuple[jax.Array, jax.Array]
    step_fn: Callable[..., Any]
    param_shardings: Any
    opt_shardings: Any
    dispatch_s: float = 0.0

    def state(self, step: int) -> dict[str, Any]:
        """The pytree that is checkpointed: params, optax state and the step number."""
        return {"params": self.params, "opt_state": self.opt_state, "step": step}

    def train_step(self) -> float:
        """One donated adam update; blocks until the new state exists; returns the loss.

        `dispatch_s` is how long the call took to return (the loop thread's Python and
        jax's dispatch, before the step's computation is waited for)."""
        start = time.perf_counter()
        self.params, self.opt_state, loss = self.step_fn(self.params, self.opt_state, *self.batch)
        self.dispatch_s = time.perf_counter() - start
        jax.block_until_ready((self.params, self.opt_state))
        return float(loss)

    def abstract(self, transposed: bool = False) -> dict[str, Any]:
        """A restore target for `state()`, optionally with every 2-D leaf column-sharded."""
        state = self.state(0)
        shardings = shardings_like(state, self.mesh, transposed)
        return jax.tree_util.tree_map(
            lambda x, s: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                if isinstance(x, jax.Array)
                else x
            ),
            state,
            shardings,
        )


def build(shape: Shape, seed: int = 0) -> Training:
    """Creates the sharded state and compiles the train step (collective)."""
    m = mesh()
    abstract_params = {
        f"layer{i:03d}": {
            "w": jax.ShapeDtypeStruct((shape.width, shape.width), jnp.float32),
            "b": jax.ShapeDtypeStruct((shape.width,), jnp.float32),
        }
        for i in range(shape.layers)
    }
    param_shardings = shardings_like(abstract_params, m)
    scale = 1.0 / math.sqrt(shape.width)

    def init(key: jax.Array) -> Any:
        keys = iter(jax.random.split(key, 2 * shape.layers))
        return jax.tree_util.tree_map(
            lambda a: scale * jax.random.normal(next(keys), a.shape, a.dtype), abstract_params
        )

    params = jax.jit(init, out_shardings=param_shardings)(jax.random.key(seed))
    tx = optax.adam(1e-3)
    opt_shardings = shardings_like(jax.eval_shape(tx.init, abstract_params), m)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    batch_sharding = NamedSharding(m, P(AXIS, None))

    def data(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(key)
        dims = (shape.batch, shape.width)
        return jax.random.normal(kx, dims), jax.random.normal(ky, dims)

    batch = jax.jit(data, out_shardings=(batch_sharding, batch_sharding))(jax.random.key(seed + 1))

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_fn = jax.jit(
        step,
        donate_argnums=(0, 1),
        out_shardings=(param_shardings, opt_shardings, NamedSharding(m, P())),
    )
    return Training(m, params, opt_state, batch, step_fn, param_shardings, opt_shardings)


def own_shards(tree: Any) -> list[jax.Array]:
    """This process's replica-0 shards of every jax.Array leaf (what a save must copy)."""
    return [
        shard.data
        for leaf in jax.tree_util.tree_leaves(tree)
        if isinstance(leaf, jax.Array)
        for shard in leaf.addressable_shards
        if shard.replica_id == 0
    ]


def raw_device_to_host(shards: list[jax.Array]) -> list[np.ndarray]:
    """The floor of a save's stall: start every transfer, then copy each shard to host."""
    for s in shards:
        s.copy_to_host_async()
    return [np.array(s, copy=True) for s in shards]
