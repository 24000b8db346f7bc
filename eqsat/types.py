"""Tensor types as the strings every term carries: `"f32[2,320,64,64]"`, `"bool[]"`.

A JAX PRNG key array's element type is written as JAX names it, `"key<fry>[4]"` (threefry2x32
keys; `key<rbg>`, ...): a key is opaque data of its implementation's size (8 bytes for threefry:
two uint32 words).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_DTYPE_TO_CODE = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
    "int32": "i32", "int64": "i64", "int16": "i16", "int8": "i8",
    "uint32": "u32", "uint64": "u64", "uint16": "u16", "uint8": "u8", "bool": "bool",
    "complex64": "c64", "complex128": "c128",
}
_CODE_TO_DTYPE = {code: name for name, code in _DTYPE_TO_CODE.items()}


@dataclass(frozen=True)
class TensorType:
    dtype: str            # numpy/jax dtype name, e.g. "float16"
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __str__(self) -> str:
        return format_type(self.dtype, self.shape)


def is_key(dtype_name: str) -> bool:
    """Whether `dtype_name` names a JAX PRNG key type (`"key<fry>"`)."""
    return dtype_name.startswith("key<") and dtype_name.endswith(">")


def dtype_name(dtype) -> str:
    """The name of a numpy/jax dtype (`"float16"`, `"key<fry>"`)."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    if isinstance(name, str) and is_key(name):
        return name
    return np.dtype(dtype).name


@lru_cache(maxsize=None)
def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named `dtype` (a key: its implementation's key data)."""
    if is_key(dtype):
        from jax._src.random import prng

        tag = dtype[len("key<"):-1]
        for impl in prng.prngs.values():
            if impl.tag == tag:
                return prng.KeyTy(impl).itemsize
        raise ValueError(f"unknown PRNG key type {dtype!r}")
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def format_type(dtype, shape) -> str:
    """`format_type("float16", (2, 4))` -> `"f16[2,4]"`."""
    name = dtype_name(dtype)
    code = name if is_key(name) else _DTYPE_TO_CODE.get(name)
    if code is None:
        raise ValueError(f"unsupported dtype {name!r}")
    return f"{code}[{','.join(str(int(d)) for d in shape)}]"


@lru_cache(maxsize=65536)
def parse_type(text: str) -> TensorType:
    """`parse_type("f16[2,4]")` -> `TensorType("float16", (2, 4))`."""
    code, _, rest = text.partition("[")
    if (code not in _CODE_TO_DTYPE and not is_key(code)) or not rest.endswith("]"):
        raise ValueError(f"not a type string: {text!r}")
    dims = rest[:-1]
    return TensorType(_CODE_TO_DTYPE.get(code, code), tuple(int(d) for d in dims.split(",")) if dims else ())


def type_of(aval) -> str:
    """The type string of a jax aval or array."""
    return format_type(dtype_name(aval.dtype), aval.shape)


def with_dtype(text: str, dtype: str) -> str:
    return format_type(dtype, parse_type(text).shape)


def with_shape(text: str, shape) -> str:
    return format_type(parse_type(text).dtype, shape)


def ints(text: str) -> tuple[int, ...]:
    """`ints("0,2,1")` -> `(0, 2, 1)`; `ints("")` -> `()`."""
    return tuple(int(part) for part in text.split(",")) if text else ()


def ints_key(values) -> str:
    """`ints_key((0, 2, 1))` -> `"0,2,1"`."""
    return ",".join(str(int(v)) for v in values)
