"""Weak types: a restored array is weakly typed where its target is.

A weakly typed array (`jnp.asarray(1e-3)`, a learning rate made from a Python
float) takes the dtype of what it meets: `lr * bf16` stays bfloat16. A saved
array's bytes carry no weak type, and an array built from them is strongly
typed, so a restore that dropped it would change the resumed job's dtypes
(`lr * bf16` becomes float32). The target says what it wants
(`jax.eval_shape` keeps the weak type in its `ShapeDtypeStruct`s; Orbax's own
restore drops it).

JAX has no public way to make an array weakly typed: only Python scalars are.
This module is the one place that reaches for JAX's private
`lax._convert_element_type` (what `jax.numpy` itself uses), with the dtype
unchanged: the values, the sharding and whether the array is committed stay
as they are. jax is pinned to 0.10.x (`pyproject.toml`), where
`tests/test_dtypes.py` checks it.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src.lax import lax as lax_internal  # private: see the module docstring


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
    return lax_internal._convert_element_type(value, value.dtype, weak_type=True)
