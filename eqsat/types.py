"""Tensor types as the strings every term carries: `"f32[2,320,64,64]"`, `"bool[]"`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_DTYPE_TO_CODE = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
    "int32": "i32", "int64": "i64", "int16": "i16", "int8": "i8",
    "uint32": "u32", "uint64": "u64", "uint16": "u16", "uint8": "u8", "bool": "bool",
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
        import jax.numpy as jnp

        return jnp.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __str__(self) -> str:
        return format_type(self.dtype, self.shape)


def format_type(dtype, shape) -> str:
    """`format_type("float16", (2, 4))` -> `"f16[2,4]"`."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPE_TO_CODE:
        raise ValueError(f"unsupported dtype {name!r}")
    return f"{_DTYPE_TO_CODE[name]}[{','.join(str(int(d)) for d in shape)}]"


@lru_cache(maxsize=65536)
def parse_type(text: str) -> TensorType:
    """`parse_type("f16[2,4]")` -> `TensorType("float16", (2, 4))`."""
    code, _, rest = text.partition("[")
    if code not in _CODE_TO_DTYPE or not rest.endswith("]"):
        raise ValueError(f"not a type string: {text!r}")
    dims = rest[:-1]
    return TensorType(_CODE_TO_DTYPE[code], tuple(int(d) for d in dims.split(",")) if dims else ())


def type_of(aval) -> str:
    """The type string of a jax aval or array."""
    return format_type(np.dtype(aval.dtype).name, aval.shape)


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
