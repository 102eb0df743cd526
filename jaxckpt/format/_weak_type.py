"""Weak types: a restored array is weakly typed where its target is.

A weakly typed array (`jnp.asarray(1e-3)`, a learning rate made from a Python
float) takes the dtype of what it meets: `lr * bf16` stays bfloat16. A saved
array's bytes carry no weak type, and an array built from them is strongly
typed, so a restore that dropped it would change the resumed job's dtypes
(`lr * bf16` becomes float32). The target says what it wants
(`jax.eval_shape` keeps the weak type in its `ShapeDtypeStruct`s; Orbax's own
restore drops it).

JAX has no public way to make an array weakly typed: only Python scalars are.
`_internals.weakly_typed` reaches JAX's private conversion for it (checked per
installed version by `tests/test_internals.py`); the values, the sharding and
whether the array is committed stay as they are.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxckpt import _internals


def as_target(value: Any, target: Any) -> Any:
    """`value` (a restored leaf), weakly typed if it is a jax.Array and `target` (its
    target leaf: a `jax.ShapeDtypeStruct` or an array) is; else `value` as it is."""
    if (
        getattr(target, "weak_type", False) is not True
        or not isinstance(value, jax.Array)
        or value.weak_type
        or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    ):
        return value
    return _internals.weakly_typed(value)
