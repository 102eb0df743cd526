"""Every dtype and scalar type either round-trips exactly or is refused at save.

Round trip means the same type, dtype and bits (NaN payloads and -0.0
included) through memory, to host with a None target, and from persistent
storage alone. A refusal is a TypeError naming the leaf, raised by the save of
that very step (asynchronous manager included), which leaves the previous step
restorable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
import shutil
import struct
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract, manager, mesh_1d, restore, save
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.format import _format, _tree
from jaxckpt.persistent import _zarr
from jaxckpt.save import _snapshot

JAX_DTYPES = [
    "bool",
    "int2",
    "int4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint2",
    "uint4",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float4_e2m1fn",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
]
# tensorstore's zarr3 driver has no such type: refused at save, with what to do instead.
NOT_STORED = {"uint2": "astype", "uint4": "astype", "float8_e4m3": "bitcast"}
SUB_BYTE_BITS = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4}
X64 = {"int64", "uint64", "float64", "complex128"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One leaf: how to make it, and the refusal expected (a regex) or None."""

    make: Callable[[], Any]
    refused: str | None = None
    x64: bool = False


def dtype_of(name: str) -> np.dtype:
    return np.dtype(getattr(jnp, name)) if name != "bool" else np.dtype(bool)


def every_bit_pattern(name: str) -> np.ndarray:
    """(32, 8) values of `name` covering its bit patterns: every pattern of a 1-byte or
    smaller type; random bits of wider ones, plus -0.0, infinities and NaNs with payloads."""
    dtype = dtype_of(name)
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    if dtype == np.bool_:
        return (np.arange(256) % 2 == 1).reshape(32, 8)
    if name in SUB_BYTE_BITS:
        return (
            (np.arange(256) % 2 ** SUB_BYTE_BITS[name]).astype(np.uint8).view(dtype).reshape(32, 8)
        )
    if dtype.itemsize == 1:
        return np.arange(256, dtype=np.uint8).view(dtype).reshape(32, 8)
    data = np.frombuffer(rng.bytes(256 * dtype.itemsize), dtype).copy()
    if dtype.kind in "fc":
        part = dtype.itemsize // (2 if dtype.kind == "c" else 1)
        bits = data.view(f"u{part}")  # the float parts (real and imaginary of complex)
        info = jnp.finfo(np.dtype(f"f{part}") if name != "bfloat16" else dtype)
        exponent = ((1 << info.nexp) - 1) << info.nmant
        sign = 1 << (8 * part - 1)
        quiet = 1 << (info.nmant - 1)
        specials = [sign, exponent, sign | exponent, exponent | quiet | 0x5, exponent | 0x3]
        bits[: len(specials)] = specials  # -0.0, inf, -inf, quiet and signaling NaN payloads
        bits[len(specials)] = sign | exponent | quiet | 0x1  # a negative NaN
    return data.reshape(32, 8)


def jax_array(name: str) -> jax.Array:
    data = every_bit_pattern(name)
    x = jax.device_put(data, NamedSharding(mesh_1d(), P("data")))
    assert np.asarray(x).tobytes() == data.tobytes()  # JAX itself keeps the bits
    return x


def refusal(name: str) -> str:
    return {"astype": r"x\.astype\(np\.uint8\)", "bitcast": r"bitcast"}[NOT_STORED[name]]


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


CASES: dict[str, Case] = {}
for _name in JAX_DTYPES:
    _refused = (
        rf"jax\.Array at \['leaf'\] with dtype {_name}.*{refusal(_name)}"
        if _name in NOT_STORED
        else None
    )
    CASES[f"jax-{_name}"] = Case(lambda n=_name: jax_array(n), _refused, _name in X64)
    _refused = (
        rf"numpy array at \['leaf'\] with dtype {_name}.*{refusal(_name)}"
        if _name in NOT_STORED
        else None
    )
    CASES[f"numpy-{_name}"] = Case(lambda n=_name: every_bit_pattern(n), _refused)
CASES.update(
    {
        "jax-0d": Case(lambda: jnp.bfloat16(-0.0)),  # a 0-d jax.Array, not a scalar
        "numpy-0d": Case(lambda: np.array(np.float32(-0.0))),
        "numpy-empty": Case(lambda: np.zeros((0, 3), np.float32)),
        "numpy-str": Case(lambda: np.array(["a", "bc"]), r"\['leaf'\] with dtype <U2: text"),
        "numpy-bytes": Case(lambda: np.array([b"a"]), r"\['leaf'\] with dtype \|S1: text"),
        "numpy-object": Case(
            lambda: np.array([{}, 1], dtype=object), r"\['leaf'\] with dtype object: text"
        ),
        "numpy-structured": Case(
            lambda: np.zeros(3, [("a", "<i4"), ("b", "<f4")]), r"\['leaf'\] .*each field"
        ),
        "numpy-datetime64": Case(
            lambda: np.arange(3).astype("datetime64[s]"), r"\['leaf'\] .*datetime64\[s\].*view"
        ),
        "numpy-timedelta64": Case(
            lambda: np.arange(3).astype("timedelta64[ms]"), r"\['leaf'\] .*timedelta64\[ms\]"
        ),
        "numpy-big-endian": Case(
            lambda: np.arange(3, dtype=">f4"), r"\['leaf'\] with dtype >f4: its byte order"
        ),
        "numpy-masked": Case(
            lambda: np.ma.masked_array([1.0, 2.0], mask=[True, False]),
            r"masked array at \['leaf'\]",
        ),
    }
)
SCALARS: dict[str, Any] = {
    "bool": True,
    "int": -7,
    "int-huge": -(2**100),
    "float": 0.1,
    "float-neg-zero": -0.0,
    "float-nan-payload": struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_1234))[0],
    "float-inf": float("-inf"),
    "complex": complex(1.5, -0.0),
    "complex-nan": complex(float("nan"), float("inf")),
    "str": "héllo \u2603",
    "str-empty": "",
    "np.bool_": np.bool_(True),
    "np.int8": np.int8(-128),
    "np.int16": np.int16(-(2**15)),
    "np.int32": np.int32(-(2**31)),
    "np.int64": np.int64(-(2**63)),
    "np.uint8": np.uint8(255),
    "np.uint16": np.uint16(2**16 - 1),
    "np.uint32": np.uint32(2**32 - 1),
    "np.uint64": np.uint64(2**64 - 1),
    "np.float16": np.float16(-0.0),
    "np.float32-nan-payload": np.frombuffer(struct.pack("<I", 0xFFC0_0042), np.float32)[0],
    "np.float64": np.float64(0.1),
    "np.longdouble": np.longdouble(1) / np.longdouble(3),
    "np.complex64": np.complex64(1 + 2j),
    "np.complex128-nan": np.complex128(complex(float("nan"), -0.0)),
    "np.str_": np.str_("abc"),
    "np.bytes_": np.bytes_(b"\x00ab"),
    "np.datetime64-ns": np.datetime64("2024-01-02T03:04:05.123456789", "ns"),
    "np.datetime64-D": np.datetime64(5, "D"),
    "np.datetime64-NaT": np.datetime64("NaT", "s"),
    "np.timedelta64": np.timedelta64(-3, "ms"),
    "bfloat16": np.dtype(jnp.bfloat16).type(1.5),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn).type(-0.0),
    "int4": np.dtype(jnp.int4).type(-3),
}
CASES.update({f"scalar-{k}": Case(lambda v=v: v) for k, v in SCALARS.items()})
CASES.update(
    {
        "scalar-IntEnum": Case(lambda: Color.RED, r"scalar at \['leaf'\] .*subclass of int"),
        "scalar-str-subclass": Case(lambda: Name("x"), r"scalar at \['leaf'\] .*subclass of str"),
        "scalar-np.void-structured": Case(
            lambda: np.zeros(1, [("a", "<i4")])[0], r"scalar at \['leaf'\] .*not come back"
        ),
    }
)


def assert_exact(restored: Any, original: Any, *, to_host: bool = False) -> None:
    """Same type, dtype, shape and bits; jax.Arrays keep their sharding (or come back
    as numpy with `to_host`)."""
    if isinstance(original, (jax.Array, np.ndarray)):
        expected_type = np.ndarray if to_host or isinstance(original, np.ndarray) else jax.Array
        assert isinstance(restored, expected_type), type(restored)
        if expected_type is jax.Array:
            assert restored.sharding == original.sharding
        r, o = np.asarray(restored), np.asarray(original)
        assert (r.dtype, r.shape) == (o.dtype, o.shape)
        assert r.tobytes() == o.tobytes(), "the bits differ"
        return
    assert type(restored) is type(original), (type(restored), type(original))
    if isinstance(original, np.generic):
        assert restored.dtype == original.dtype
        assert restored.tobytes() == original.tobytes(), (restored, original)
    elif isinstance(original, (float, complex)):
        pack = lambda z: struct.pack("<dd", z.real, z.imag)  # noqa: E731
        assert pack(restored) == pack(original), (restored, original)
    else:
        assert restored == original


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_round_trips_exactly_or_is_refused_at_save(memory_root, ckpt_dir, case, use_async):
    before = {"w": np.arange(4.0)}
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with (
        jax.enable_x64(True) if case.x64 else contextlib.nullcontext(),
        manager(ckpt_dir, h, use_async=use_async) as mngr,
    ):
        save(mngr, 1, before)
        leaf = case.make()
        if case.refused is not None:
            with pytest.raises(TypeError, match=case.refused):
                save(mngr, 2, {"leaf": leaf})  # raised by this very save, async or not
            mngr.wait_until_finished()
            assert mngr.all_steps() == [1]
            assert_exact(restore(mngr, 1, None)["w"], before["w"])
            save(mngr, 3, before)  # the manager still works
            mngr.wait_until_finished()
            assert mngr.all_steps() == [1, 3]
            return
        state = {"leaf": leaf}
        save(mngr, 2, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()  # raises if persisting it failed
        assert_exact(restore(mngr, 2, abstract(state))["leaf"], leaf)
        assert_exact(restore(mngr, 2, None)["leaf"], leaf, to_host=True)
        shutil.rmtree(memory_root)  # persistent storage alone, no peers
        assert_exact(restore(mngr, 2, abstract(state))["leaf"], leaf)
        if isinstance(leaf, (jax.Array, np.ndarray)) and leaf.size:
            assert h.last_restore_metrics["tier"] == "persistent"


@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if c.refused is not None], ids=lambda n: n
)
def test_async_save_refuses_before_any_io(name):
    # async_save validates again (for args built around __post_init__): the snapshot
    # refuses the leaf before copying anything.
    case = CASES[name]
    with pytest.raises(TypeError, match=case.refused):
        _snapshot.take({"leaf": case.make()}, 0)


@pytest.mark.parametrize("name", JAX_DTYPES)
def test_storable_dtypes_are_what_the_installed_tensorstore_stores(tmp_path, name):
    # The list validation refuses by is static: it must match this tensorstore.
    record = _format.LeafRecord(
        "x", _format.ARRAY, stored_shape=(4,), stored_dtype=name, chunk_shape=(4,)
    )
    try:
        _zarr.create(_zarr.file_kvstore(str(tmp_path)), record).result()
        stored = True
    except ValueError:
        stored = False
    assert stored == (name in _tree.STORABLE_DTYPES)


def test_refusal_lists_what_is_stored():
    with pytest.raises(TypeError) as e:
        jaxckpt.TieredSave({"leaf": np.zeros(2, jnp.uint4)})
    assert re.search(
        r"^\[process 0\] Cannot checkpoint the numpy array at \['leaf'\]", str(e.value)
    )
    assert "complex64" in str(e.value) and "int4" in str(e.value)


@pytest.mark.parametrize(
    "scalar_type,value,expected",
    [
        ("bool", True, True),  # np.bool_ was saved so too, and came back a bool
        ("int", 3, 3),
        ("float", 0.5, 0.5),
        ("str", "run", "run"),
        ("float32", 0.5, np.float32(0.5)),
        ("int64", -2, np.int64(-2)),
        ("bfloat16", 1.5, np.dtype(jnp.bfloat16).type(1.5)),
    ],
)
def test_scalar_records_written_before_exact_scalars_still_read(scalar_type, value, expected):
    record = _format.LeafRecord("x", _format.SCALAR, value=value, scalar_type=scalar_type)
    assert_exact(_tree.scalar_value(record), expected)


def test_a_weakly_typed_target_gets_a_weakly_typed_array(memory_root, ckpt_dir):
    """`lr` made from a Python float is weakly typed: `lr * bf16` is bfloat16. A target
    that keeps the weak type (`jax.eval_shape` does) gets it back, values, sharding and
    committedness unchanged; a strongly typed target gets a strongly typed array."""
    mesh = mesh_1d()
    replicated = NamedSharding(mesh, P())
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))

    def init() -> dict:
        return {
            "lr": jax.device_put(jnp.asarray(1e-3), replicated),  # weak float32
            "scale": jnp.full((4,), 0.5),  # weak, uncommitted, not a scalar
            "w": jax.device_put(jnp.ones((8, 2), jnp.bfloat16), NamedSharding(mesh, P("data"))),
        }

    state = init()
    assert state["lr"].weak_type and state["scale"].weak_type and not state["w"].weak_type
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
        target = jax.eval_shape(init)
        target["lr"] = target["lr"].update(sharding=replicated)
        target["w"] = target["w"].update(sharding=state["w"].sharding)
        target["scale"] = state["scale"]  # an uncommitted array: restored uncommitted
        assert target["lr"].weak_type
        got = restore(mngr, 1, target)
        assert got["lr"].weak_type and got["scale"].weak_type and not got["w"].weak_type
        assert (got["lr"] * got["w"]).dtype == jnp.bfloat16
        assert got["lr"].sharding == replicated and got["lr"].committed
        assert not got["scale"].committed
        for k in state:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
        strong = restore(mngr, 1, abstract(state))  # no weak type asked for
        assert not strong["lr"].weak_type


def test_item_metadata_as_the_target_keeps_weak_types(memory_root, ckpt_dir):
    """`mngr.item_metadata(step).train` is a ready restore target: it carries what the
    save knew, weak types included, so after a resume through it `lr * bf16` stays
    bfloat16 (in a new process too: the weak types are in the index manifests)."""
    mesh = mesh_1d()
    state = {
        "lr": jax.device_put(jnp.asarray(1e-3), NamedSharding(mesh, P())),  # weak float32
        "w": jax.device_put(jnp.ones((8, 2), jnp.bfloat16), NamedSharding(mesh, P("data"))),
        "mu": jax.device_put(jnp.zeros((8, 2), jnp.float32), NamedSharding(mesh, P("data"))),
    }
    assert state["lr"].weak_type and not state["mu"].weak_type
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(ckpt_dir, h) as mngr:
        save(mngr, 1, state)
        mngr.wait_until_finished()
        h.wait_for_persistence()
    h = jaxckpt.TieredCheckpointHandler(jaxckpt.TierOptions(memory_root, persist_every=1))
    with manager(ckpt_dir, h) as mngr:  # the resumed job
        meta = mngr.item_metadata(1).train
        assert meta["lr"].weak_type and not meta["w"].weak_type and not meta["mu"].weak_type
        got = restore(mngr, 1, meta)
    assert got["lr"].weak_type and not got["mu"].weak_type
    assert (got["lr"] * got["w"]).dtype == jnp.bfloat16
    for k in state:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
