"""A small CNN image classifier on synthetic digits, checkpointed every step with jaxckpt.

In the spirit of Flax's MNIST example (two conv + avg-pool stages, two dense layers), on
data that needs no download: 28x28 seven-segment digits 0-9, each drawn with a random
offset, stroke width and brightness plus Gaussian noise, all from ``--data-seed``.

Run::

    python examples/classifier.py --quick --no-checkpoint
    python examples/classifier.py --quick --ckpt-dir /tmp/cls-ckpt --steps 50
    python -m jaxckpt.launch -n 4 -- python examples/classifier.py --quick --ckpt-dir /tmp/c

The checkpointing lines are in ``checkpointing.py`` (``make_manager``, ``save``,
``restore_latest``), with the layout of the saved state; the loop is ``training.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

if __package__ in (None, ""):  # run as a script: the repository root holds `examples`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from examples import training

SIZE = 28
NUM_CLASSES = 10
# Seven segments a..g lit per digit (a top, b upper right, c lower right, d bottom,
# e lower left, f upper left, g middle).
SEGMENTS = ("abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg")
# Segment -> (y0, x0, y1, x1) of its centre line, in pixels of a centred digit.
GEOMETRY = {
    "a": (5, 9, 5, 18),
    "b": (5, 18, 13, 18),
    "c": (13, 18, 22, 18),
    "d": (22, 9, 22, 18),
    "e": (13, 9, 22, 9),
    "f": (5, 9, 13, 9),
    "g": (13, 9, 13, 18),
}


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Width of the network."""

    conv1: int = 32
    conv2: int = 64
    hidden: int = 256
    dropout: float = 0.1


QUICK = CNNConfig(conv1=8, conv2=16, hidden=64)


class CNN(nnx.Module):
    """conv-relu-avgpool x2, dense-relu-dropout, dense."""

    def __init__(self, cfg: CNNConfig, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, cfg.conv1, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(cfg.conv1, cfg.conv2, kernel_size=(3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(cfg.conv2 * (SIZE // 4) ** 2, cfg.hidden, rngs=rngs)
        self.dense2 = nnx.Linear(cfg.hidden, NUM_CLASSES, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, images: jax.Array, key: jax.Array) -> jax.Array:
        """Returns logits ``[batch, 10]`` for images ``[batch, 28, 28, 1]``."""
        pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.conv1(images)))
        x = pool(nnx.relu(self.conv2(x)))
        x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
        return self.dense2(self.dropout(x, rngs=key))


def make_digits(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Draws ``count`` noisy seven-segment digits.

    Args:
        count: Number of images.
        seed: Seed of every random choice; equal seeds give equal arrays.

    Returns:
        ``(images, labels)``: float32 ``[count, 28, 28, 1]`` in about [0, 1] and int32
        ``[count]``.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, count).astype(np.int32)
    shift = rng.integers(-3, 4, (count, 2, 1, 1))
    half_width = rng.uniform(0.8, 1.8, (count, 1, 1))
    brightness = rng.uniform(0.6, 1.0, (count, 1, 1))
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    yy, xx = yy[None] - shift[:, 0], xx[None] - shift[:, 1]
    images: np.ndarray = np.zeros((count, SIZE, SIZE), np.float32)
    for name, (y0, x0, y1, x1) in GEOMETRY.items():
        lit = np.array([name in SEGMENTS[label] for label in labels])[:, None, None]
        # Distance from each pixel to the segment's centre line (an axis-aligned box).
        dy = np.maximum(np.maximum(y0 - yy, yy - y1), 0)
        dx = np.maximum(np.maximum(x0 - xx, xx - x1), 0)
        stroke = np.clip(half_width + 0.5 - np.hypot(dy, dx), 0, 1)
        images = np.maximum(images, np.where(lit, stroke, 0))
    images = images * brightness + rng.normal(0, 0.25, images.shape)
    return images[..., None].astype(np.float32), labels


class DigitRecords(Sequence[dict[str, np.ndarray]]):
    """The data set as a random-access sequence of ``{"image", "label"}`` records."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self._images, self._labels = images, labels

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: Any) -> Any:
        return {"image": self._images[index], "label": self._labels[index]}


def loss_fn(model: CNN, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of a ``{"image", "label"}`` batch."""
    logits = model(batch["image"], key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def add_args(parser: argparse.ArgumentParser) -> None:
    """The classifier's own flags (``--batch`` and the rest are in ``training.add_common_args``)."""
    parser.add_argument("--examples", type=int, default=None, help="data set size")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)


def make_task(args: argparse.Namespace) -> training.Task:
    """The model, digits and loss that the flags ask for."""
    cfg = QUICK if args.quick else CNNConfig()
    images, labels = make_digits(args.examples or (2048 if args.quick else 16384), args.data_seed)
    return training.Task(
        make_model=lambda rngs: CNN(cfg, rngs=rngs),
        records=DigitRecords(images, labels),
        loss_fn=loss_fn,
        global_batch=args.batch or (32 if args.quick else 128),
        learning_rate=args.lr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Trains the classifier; see ``--help``."""
    return training.main(__doc__, add_args, make_task, argv)


if __name__ == "__main__":
    raise SystemExit(main())
