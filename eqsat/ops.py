"""The op-string vocabulary of `Unary`, `Binary` and `Reduce` terms and its one meaning.

Op strings are lax primitive names. The lifter writes them (`eqsat.lift`), the interpreter and the
XLA emitter evaluate them through `apply_unary` / `apply_binary` / `apply_reduce`, and the Pallas
expression compiler (`emit.expr`) follows the same semantics: the single table of what they mean.
"""

from __future__ import annotations

from typing import Callable

from jax import lax

from eqsat.moments import two_pass
from eqsat.types import ints


UNARY_OPS: dict[str, Callable] = {
    "neg": lax.neg, "sign": lax.sign, "floor": lax.floor, "ceil": lax.ceil, "is_finite": lax.is_finite,
    "exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1,
    "tanh": lax.tanh, "logistic": lax.logistic, "sin": lax.sin, "cos": lax.cos, "tan": lax.tan,
    "asin": lax.asin, "acos": lax.acos, "atan": lax.atan, "sinh": lax.sinh, "cosh": lax.cosh,
    "asinh": lax.asinh, "acosh": lax.acosh, "atanh": lax.atanh, "lgamma": lax.lgamma,
    "digamma": lax.digamma, "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lax.erf_inv,
    "bessel_i0e": lax.bessel_i0e, "bessel_i1e": lax.bessel_i1e, "abs": lax.abs, "sqrt": lax.sqrt,
    "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "square": lax.square, "not": lax.bitwise_not,
    "population_count": lax.population_count, "clz": lax.clz,
}

# "name:param" ops; the function gets x and the text after the colon.
PARAMETRIC_UNARY_OPS: dict[str, Callable] = {
    "integer_pow": lambda x, param: lax.integer_pow(x, int(param)),            # integer_pow:2
    "round": lambda x, param: lax.round(x, lax.RoundingMethod(int(param))),    # round:0 away from zero, round:1 to even
    "reduce_precision": lambda x, param: lax.reduce_precision(x, *ints(param)),  # reduce_precision:5,10
}

# "convert" is the one unary op whose meaning needs the result type: Unary("convert", x, "f16[...]").
CONVERT = "convert"

BINARY_OPS: dict[str, Callable] = {
    "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem, "pow": lax.pow,
    "max": lax.max, "min": lax.min, "atan2": lax.atan2, "nextafter": lax.nextafter,
    "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
    "eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge,
    "shift_left": lax.shift_left, "shift_right_logical": lax.shift_right_logical,
    "shift_right_arithmetic": lax.shift_right_arithmetic, "igamma": lax.igamma, "igammac": lax.igammac,
    "polygamma": lax.polygamma, "zeta": lax.zeta,
}

# Reduce ops over `axes`; argmax/argmin take one axis and produce the index dtype of the result type.
REDUCE_OPS: dict[str, Callable] = {
    "sum": lax.reduce_sum, "max": lax.reduce_max, "min": lax.reduce_min, "prod": lax.reduce_prod,
    "and": lax.reduce_and, "or": lax.reduce_or, "xor": lax.reduce_xor,
    "argmax": lambda x, axes, dtype: lax.argmax(x, axes[0], dtype),
    "argmin": lambda x, axes, dtype: lax.argmin(x, axes[0], dtype),
    "moments": two_pass,  # [mean, sum of centred squares] (eqsat.moments); not a jaxpr primitive
}


def apply_unary(op: str, x, dtype):
    """`Unary(op, x, ty)` with `dtype` the dtype of `ty`."""
    if op == CONVERT:
        return lax.convert_element_type(x, dtype)
    function = UNARY_OPS.get(op)
    if function is not None:
        return function(x)
    name, sep, param = op.partition(":")
    if sep and name in PARAMETRIC_UNARY_OPS:
        return PARAMETRIC_UNARY_OPS[name](x, param)
    raise ValueError(f"unknown unary op {op!r}")


def apply_binary(op: str, x, y):
    """`Binary(op, x, y, ty)`."""
    try:
        function = BINARY_OPS[op]
    except KeyError:
        raise ValueError(f"unknown binary op {op!r}") from None
    return function(x, y)


def apply_reduce(op: str, x, axes: tuple[int, ...], dtype):
    """The core of `Reduce(op, x, axes, ...)`; sums/products accumulate in `dtype` (the `Acc` dtype)."""
    if op in ("argmax", "argmin"):
        return REDUCE_OPS[op](x, axes, dtype)
    try:
        function = REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}") from None
    if x.dtype != dtype:
        x = lax.convert_element_type(x, dtype)
    return function(x, axes)
