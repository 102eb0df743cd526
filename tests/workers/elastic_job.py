"""A training job whose state does not depend on the process count
(tests/test_elastic_multiprocess.py): the examples' loop (``examples/training.py``: resume,
save every step, hot spares, stop when asked) on a linear model of integer data.

The loss is the sum of the model's outputs over the batch, so its gradient is a sum of
the batch's integers (exact in float32, in any order, on any number of devices) and
adamw's update is elementwise: the state after step s is the same bit for bit whatever
mesh computed it. A job shrunk and grown back must then end in the very state an
uninterrupted run ends in.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root

from examples import training

FEATURES, OUTPUTS = 8, 24  # OUTPUTS divisible by 4 and 2 devices: the kernel is sharded
READ_S = 0.008  # per record: a step takes about 0.1 s, as a data loader would make it


class SlowRecords(Sequence[np.ndarray]):
    """Integer records, each read in `READ_S`: the job takes its time, so that the
    launcher's registration and stop come while it trains."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return self._rows[i]
        time.sleep(READ_S)
        return self._rows[i]


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), (FEATURES, OUTPUTS)))
        self.b = nnx.Param(jnp.zeros((OUTPUTS,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


def loss_fn(model: Linear, batch: jax.Array, key: jax.Array) -> jax.Array:
    del key
    return jnp.sum(model(batch.astype(jnp.float32)))


def make_task(args: argparse.Namespace) -> training.Task:
    rows = (np.arange(240 * FEATURES, dtype=np.int32).reshape(240, FEATURES) * 7) % 10
    return training.Task(
        make_model=lambda rngs: Linear(rngs),
        records=SlowRecords(rows),
        loss_fn=loss_fn,
        global_batch=args.batch or 24,
        learning_rate=1e-2,
    )


if __name__ == "__main__":
    raise SystemExit(training.main(__doc__, lambda parser: None, make_task))
