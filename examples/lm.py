"""A small decoder-only transformer language model, checkpointed every step with jaxckpt.

In the spirit of Flax's lm1b example: token + position embeddings, N pre-LayerNorm blocks
of causal self-attention and an MLP, a final LayerNorm and a (tied or untied) output head,
trained with adamw on bytes (vocabulary 256). The corpus needs no download: it is the
Python source of the installed ``optax`` package, files in sorted order, cut to
``--corpus-kb``; the same venv always yields the same bytes.

Run::

    python examples/lm.py --quick --no-checkpoint
    python examples/lm.py --quick --ckpt-dir /tmp/lm-ckpt --steps 50
    python -m jaxckpt.launch -n 4 -- python examples/lm.py --quick --ckpt-dir /tmp/lm-ckpt

The checkpointing lines are in ``checkpointing.py`` (``make_manager``, ``save``,
``restore_latest``), with the layout of the saved state; the loop is ``training.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

if __package__ in (None, ""):  # run as a script: the repository root holds `examples`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from examples import training

VOCAB = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Size of the model and of a training example."""

    seq_len: int = 128
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 4
    mlp_dim: int = 1024
    dropout: float = 0.1
    tied_head: bool = True


QUICK = LMConfig(seq_len=64, d_model=64, num_heads=4, num_layers=2, mlp_dim=256)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            cfg.num_heads, cfg.d_model, decode=False, keep_rngs=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.mlp_dim, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_dim, cfg.d_model, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array) -> jax.Array:
        k_attn, k_mlp = jax.random.split(key)
        h = self.attn(self.ln1(x), mask=mask, deterministic=True)
        x = x + self.dropout(h, rngs=k_attn)
        h = self.down(nnx.gelu(self.up(self.ln2(x))))
        return x + self.dropout(h, rngs=k_mlp)


class TransformerLM(nnx.Module):
    """Decoder-only transformer over bytes."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
        self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = None if cfg.tied_head else nnx.Linear(cfg.d_model, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array, key: jax.Array) -> jax.Array:
        """Returns next-byte logits of shape ``tokens.shape + (256,)``."""
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        keys = jax.random.split(key, len(self.blocks))
        for block, k in zip(self.blocks, keys, strict=True):
            x = block(x, mask, k)
        x = self.ln_f(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def load_corpus(max_bytes: int) -> np.ndarray:
    """Returns up to ``max_bytes`` of the installed optax sources as uint8 tokens."""
    root = pathlib.Path(optax.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def make_records(corpus: np.ndarray, seq_len: int) -> np.ndarray:
    """Cuts the corpus into non-overlapping windows of ``seq_len + 1`` tokens (int32)."""
    n = (len(corpus) - 1) // seq_len
    starts = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return corpus[starts].astype(np.int32)


def loss_fn(model: TransformerLM, tokens: jax.Array, key: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy of a ``[batch, seq_len + 1]`` token batch."""
    logits = model(tokens[:, :-1], key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def add_args(parser: argparse.ArgumentParser) -> None:
    """The LM's own flags (``--batch`` and the rest are in ``training.add_common_args``)."""
    parser.add_argument("--corpus-kb", type=int, default=None, help="corpus size in KiB")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--untied-head", action="store_true")


def make_task(args: argparse.Namespace) -> training.Task:
    """The model, corpus and loss that the flags ask for."""
    cfg = dataclasses.replace(QUICK if args.quick else LMConfig(), tied_head=not args.untied_head)
    corpus_kb = args.corpus_kb or (256 if args.quick else 1024)
    return training.Task(
        make_model=lambda rngs: TransformerLM(cfg, rngs=rngs),
        records=make_records(load_corpus(corpus_kb * 1024), cfg.seq_len),
        loss_fn=loss_fn,
        global_batch=args.batch or (16 if args.quick else 32),
        learning_rate=args.lr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Trains the language model; see ``--help``."""
    return training.main(__doc__, add_args, make_task, argv)


if __name__ == "__main__":
    raise SystemExit(main())
