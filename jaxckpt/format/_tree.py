"""Walking the training-state pytree: which leaves are arrays, keys, scalars, iterators."""

from __future__ import annotations

import base64
import functools
import json
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.format import _format

SCALAR_TYPES = (bool, int, float, complex, str)
_BUILTIN_SCALARS: dict[str, type] = {t.__name__: t for t in SCALAR_TYPES}

# The dtypes tensorstore's zarr3 driver stores (tensorstore 0.1.86; its raw-bits
# types r<N> are not used). An array of any other dtype is refused at save: left
# to the background commit it would fail there, after the save was accepted.
STORABLE_DTYPES = frozenset(
    {
        "bool",
        *(f"int{n}" for n in (2, 4, 8, 16, 32, 64)),
        *(f"uint{n}" for n in (8, 16, 32, 64)),
        "float4_e2m1fn",
        "float8_e3m4",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)


def is_iterator(x: Any) -> bool:
    """Grain iterators and anything else with get_state()/set_state()."""
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


def is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _is_key_dtype(dtype)


@functools.cache
def _is_key_dtype(dtype: Any) -> bool:  # cached: issubdtype is slow, and saves ask per leaf
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


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
        if not is_typed_key(leaf):  # keys are stored as their uint32 key data
            _check_array_dtype(path, "jax.Array", leaf.dtype)
        return _format.ARRAY
    if isinstance(leaf, np.ndarray):
        if isinstance(leaf, np.ma.MaskedArray):
            raise TypeError(
                f"Cannot checkpoint the masked array at {path or '<root>'}: jaxckpt would save "
                "its data without its mask. Save x.data and np.ma.getmaskarray(x) as two "
                "leaves and rebuild it with np.ma.MaskedArray(data, mask) after restoring."
            )
        _check_array_dtype(path, "numpy array", leaf.dtype)
        return _format.NUMPY
    if isinstance(leaf, (np.generic, *SCALAR_TYPES)):
        encode_scalar(path, leaf)  # refuses a value that would not come back exactly
        return _format.SCALAR
    raise TypeError(
        f"Cannot checkpoint the leaf at {path or '<root>'} of type {type(leaf).__name__}: "
        "jaxckpt saves jax.Array (typed PRNG keys included), numpy arrays, Python or numpy "
        "scalars and iterators with get_state()/set_state(). Convert it to one of these or "
        "remove it from the saved state."
    )


def validate(tree: Any) -> None:
    """Checks every leaf of `tree` as a save would, reading nothing and writing nothing.

    Raises:
      TypeError: for the first leaf jaxckpt cannot save and restore exactly,
        naming its path, its type or dtype, and what to do instead.
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_iterator)
    for keys, leaf in pairs:
        try:
            kind_of("", leaf)  # the path is only needed in the error: spell it out then
        except TypeError:
            kind_of(jax.tree_util.keystr(keys), leaf)
            raise


def _check_array_dtype(path: str, what: str, dtype: np.dtype) -> None:
    """Raises TypeError unless an array of `dtype` is stored and read back exactly."""
    problem = _dtype_problem(what, dtype)
    if problem is not None:
        raise TypeError(f"Cannot checkpoint the {what} at {path or '<root>'} {problem}")


@functools.cache  # per dtype, not per leaf: dtype.name alone costs microseconds
def _dtype_problem(what: str, dtype: np.dtype) -> str | None:
    """Why an array of `dtype` cannot be saved and what to save instead, or None."""
    if dtype.name in STORABLE_DTYPES and dtype.isnative:
        return None
    if not dtype.isnative:
        why, fix = "its byte order is not this machine's", "x.astype(x.dtype.newbyteorder('='))"
    elif dtype.name in ("uint2", "uint4"):
        why = f"tensorstore's zarr3 format has no {dtype.name}"
        fix = f"x.astype(np.uint8) (exact: every {dtype.name} value fits) and convert back after "
        fix += "restoring"
    elif dtype.name == "float8_e4m3":
        why = "tensorstore's zarr3 format has no float8_e4m3"
        bits = (
            "jax.lax.bitcast_convert_type(x, np.uint8)"
            if what == "jax.Array"
            else "x.view(np.uint8)"
        )
        fix = f"its bits, {bits}, and bitcast them back after restoring"
    elif dtype.kind in "USO":
        why = "text and Python objects are not array data jaxckpt can store"
        fix = "str scalars for text (a list of them is fine), or keep it out of the saved state"
    elif dtype.kind == "V":
        why = "structured and void arrays are not stored"
        fix = "each field as its own array (a dict of arrays)"
    elif dtype.kind in "Mm":
        why = "datetime and timedelta arrays are not stored"
        fix = "x.view(np.int64) and restore the unit with .view(x.dtype) after restoring"
    else:
        why, fix = "tensorstore's zarr3 format cannot store it", "a supported dtype"
    return (
        f"with dtype {dtype}: {why}. Save {fix} instead. The array dtypes jaxckpt stores "
        f"are: {', '.join(sorted(STORABLE_DTYPES))}."
    )


def encode_scalar(path: str, leaf: Any) -> tuple[str, Any]:
    """(scalar_type, JSON value) that `decode_scalar` turns back into `leaf` exactly.

    The value is readable JSON where that is exact (finite floats, ints, bools,
    text; complex numbers as [real, imag]), else {"__bits__": hex of its bytes}
    (NaN payloads, infinities, datetimes, bytes, long doubles). Numpy scalars
    keep their dtype: `scalar_type` is a dtype spec np.dtype() reads back.

    Raises:
      TypeError: if the value would not come back with its type and bits, naming the leaf.
    """
    where = f"Cannot checkpoint the scalar at {path or '<root>'} of type {type(leaf).__name__}"
    if type(leaf) in (bool, int, str):
        return type(leaf).__name__, leaf  # JSON holds these exactly
    if isinstance(leaf, np.generic):
        scalar_type = _numpy_scalar_type(leaf.dtype)
    elif type(leaf) in SCALAR_TYPES:
        scalar_type = type(leaf).__name__
    else:
        base = next(t for t in SCALAR_TYPES if isinstance(leaf, t)).__name__
        raise TypeError(
            f"{where}: it is a subclass of {base} and would come back as a plain {base}. "
            f"Save {base}(x) instead and convert it back after restoring."
        )
    if scalar_type is not None:
        # Every candidate survives JSON as is (no NaN or infinity in readable values),
        # so decoding it here is what a restore will do.
        for value in _candidates(leaf):
            if value is None:
                continue
            try:
                back = decode_scalar(scalar_type, value)
            except (TypeError, ValueError, OverflowError):
                continue
            if _same(leaf, back):
                return scalar_type, value
    raise TypeError(
        f"{where} and dtype {getattr(leaf, 'dtype', '-')}: it would not come back exactly "
        "from the manifest's JSON. Save a Python bool, int, float, complex or str, a numpy "
        "scalar of a numeric, bool, str, bytes or datetime dtype, or a numpy array instead."
    )


def decode_scalar(scalar_type: str, value: Any) -> Any:
    """The Python or numpy scalar `encode_scalar` gave (scalar_type, value) for."""
    bits = bytes.fromhex(value["__bits__"]) if isinstance(value, dict) else None
    if scalar_type in _BUILTIN_SCALARS:
        if scalar_type == "float" and bits is not None:
            return struct.unpack("<d", bits)[0]
        if scalar_type == "complex":
            return complex(*(struct.unpack("<dd", bits) if bits is not None else value))
        return _BUILTIN_SCALARS[scalar_type](value)
    dtype = np.dtype(scalar_type)
    if bits is not None:
        return np.frombuffer(bits, dtype=dtype)[0]
    if dtype.kind == "c":
        return dtype.type(complex(*value))
    return dtype.type(value)


@functools.cache
def _numpy_scalar_type(dtype: np.dtype) -> str | None:
    """A spec np.dtype() reads back as exactly `dtype`: its name where that works and
    is not a builtin's ("bool" would restore a Python bool), else its str ('<U3')."""
    for spec in (dtype.name, dtype.str):
        if spec in _BUILTIN_SCALARS:
            continue
        try:
            if np.dtype(spec) == dtype:
                return spec
        except TypeError:
            continue
    return None


def _candidates(leaf: Any) -> Iterator[Any]:
    """JSON values for a scalar, readable first; the bits only when asked for."""
    if isinstance(leaf, np.generic):
        yield _readable(leaf.item())
        yield {"__bits__": leaf.tobytes().hex()}
    else:
        yield _readable(leaf)
        yield _bits(leaf)


def _readable(value: Any) -> Any:
    """`value` as plain JSON when JSON holds it exactly, else None."""
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, complex) and math.isfinite(value.real) and math.isfinite(value.imag):
        return [value.real, value.imag]
    return None


def _bits(value: Any) -> dict[str, str] | None:
    if isinstance(value, float):
        return {"__bits__": struct.pack("<d", value).hex()}
    if isinstance(value, complex):
        return {"__bits__": struct.pack("<dd", value.real, value.imag).hex()}
    return None


def _same(a: Any, b: Any) -> bool:
    """Same type and same bits (NaN payloads and -0.0 included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.generic):
        return bool(a.dtype == b.dtype) and a.tobytes() == b.tobytes()
    if isinstance(a, (float, complex)):
        return _bits(a) == _bits(b)
    return bool(a == b)


def scalar_record(path: str, leaf: Any) -> _format.LeafRecord:
    """The manifest record of a scalar leaf, holding its value (see `encode_scalar`).

    Raises:
      TypeError: if the value would not come back exactly, naming the leaf.
    """
    scalar_type, value = encode_scalar(path, leaf)
    return _format.LeafRecord(path, _format.SCALAR, value=value, scalar_type=scalar_type)


def scalar_value(record: _format.LeafRecord) -> Any:
    """The Python or numpy value a scalar record was saved from."""
    assert record.scalar_type is not None
    return decode_scalar(record.scalar_type, record.value)


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
