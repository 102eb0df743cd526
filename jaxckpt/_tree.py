"""Walking the training-state pytree: which leaves are arrays, keys, scalars, iterators."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt import _format

SCALAR_TYPES = (bool, int, float, str)


def is_iterator(x: Any) -> bool:
    """Grain iterators and anything else with get_state()/set_state()."""
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


def is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """(path, leaf) pairs in a stable order, and the treedef.

    Iterators are leaves even when they happen to be pytrees.
    """
    pairs, treedef = flatten_with_keys(tree)
    return [(path, leaf) for path, _, leaf in pairs], treedef


def flatten_with_keys(tree: Any) -> tuple[list[tuple[str, tuple[tuple[str, Any], ...], Any]], Any]:
    """(path, encoded key entries, leaf) triples and the treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_iterator)
    return [(jax.tree_util.keystr(p), encode_keys(p), leaf) for p, leaf in pairs], treedef


def encode_keys(path: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key if isinstance(k.key, (int, str)) else str(k.key)
            out.append(("d", key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("s", k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("a", k.name))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("f", k.key))
        else:
            out.append(("d", str(k)))
    return tuple(out)


def nest(entries: Sequence[tuple[tuple[tuple[str, Any], ...], Any]]) -> Any:
    """Rebuilds nested dicts and lists from (encoded keys, value) pairs.

    Sequences become lists; dicts, attributes and flattened indices become dicts.
    """
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    groups: dict[Any, list[tuple[tuple[tuple[str, Any], ...], Any]]] = {}
    kinds = set()
    for keys, value in entries:
        kinds.add(keys[0][0])
        groups.setdefault(keys[0][1], []).append((keys[1:], value))
    nested = {k: nest(v) for k, v in groups.items()}
    if kinds == {"s"}:
        return [nested[i] for i in sorted(nested)]
    return nested


def kind_of(path: str, leaf: Any) -> str:
    """The leaf kind a saved value has.

    Raises:
      TypeError: for a leaf jaxckpt cannot save, naming its path.
    """
    if is_iterator(leaf):
        return _format.ITERATOR
    if isinstance(leaf, jax.Array):
        return _format.ARRAY
    if isinstance(leaf, np.ndarray):
        return _format.NUMPY
    if isinstance(leaf, (np.generic, *SCALAR_TYPES)):
        return _format.SCALAR
    raise TypeError(
        f"Cannot checkpoint the leaf at {path or '<root>'} of type {type(leaf).__name__}: "
        "jaxckpt saves jax.Array (typed PRNG keys included), numpy arrays, Python or numpy "
        "scalars and iterators with get_state()/set_state(). Convert it to one of these or "
        "remove it from the saved state."
    )


def scalar_record(path: str, leaf: Any) -> _format.LeafRecord:
    """The manifest record of a scalar leaf, holding its value."""
    if isinstance(leaf, np.generic):
        return _format.LeafRecord(
            path, _format.SCALAR, value=leaf.item(), scalar_type=np.dtype(leaf.dtype).name
        )
    return _format.LeafRecord(path, _format.SCALAR, value=leaf, scalar_type=type(leaf).__name__)


def scalar_value(record: _format.LeafRecord) -> Any:
    """The Python or numpy value a scalar record was saved from."""
    builtin = {"int": int, "float": float, "bool": bool, "str": str}
    if record.scalar_type in builtin:
        return builtin[record.scalar_type](record.value)
    return np.dtype(record.scalar_type).type(record.value)


def encode_iterator_state(path: str, state: Any) -> Any:
    """Makes an iterator state JSON-safe (grain's DataLoader returns bytes)."""
    if isinstance(state, bytes):
        return {"__bytes__": base64.b64encode(state).decode("ascii")}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"The iterator at {path} returned a state jaxckpt cannot store as JSON ({e}); "
            "get_state() must return bytes or JSON-compatible values."
        ) from e
    return state


def decode_iterator_state(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"__bytes__"}:
        return base64.b64decode(state["__bytes__"])
    return state


def describe_paths(paths: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(p or "<root>" for p in list(paths)[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
