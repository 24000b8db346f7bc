"""Concat/slice pushdown (DESIGN.md, family 3).

- A slice of a concat reads one side, or (on another axis) is the concat of the sliced sides.
- Elementwise work over concats with the same split is the concat of the elementwise parts.
- A slice of an elementwise result is the elementwise op over the sliced operands, and a slice of
  a matmul's output along the weight's free axis is the matmul with the weight sliced: so the two
  halves of a GEGLU projection (`value, gate = split(x @ W + b)`) are matmuls of their own.
- A concat along the contraction axis is a K range: `dot(concat(a1, a2, K), W)` is
  `dot(a1, W[:k1]) + dot(a2, W[k1:])`, the second product added in the first's epilogue; the
  same for a convolution over a channel concat (the skip connections of the UNet's up blocks).
  `eqsat.rules.horizontal` has the other direction (dot + dot -> one dot over concatenated K).

Types of the parts are computed in Python (`py_string`) from the whole's type.
"""

from __future__ import annotations

from functools import lru_cache

from egglog import String, i64, ne, rewrite, rule, ruleset, union

from eqsat.lang import Acc, Binary, Concat, Conv, Expr, Load, Matmul, Slice, Tensor, Unary
from eqsat.rules import Example, dim, flag, py_int, py_string, py_true, tensor
from eqsat.types import format_type, ints, parse_type

concat_slice = ruleset(name="concat_slice")

# Binary ops whose operands have the result's dtype (so a sliced operand's type is known).
_SAME_DTYPE_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "rem", "atan2", "and", "or", "xor"})


@lru_cache(maxsize=None)
def _resize(ty: str, axis: str, extent: str) -> str:
    """`ty` with `axis` of extent `extent`."""
    t = parse_type(ty)
    shape = list(t.shape)
    shape[int(axis)] = int(extent)
    return format_type(t.dtype, shape)


@lru_cache(maxsize=None)
def _rest(ty: str, axis: str, split: str) -> str:
    """`ty` with `axis` shortened by `split` (the right side of a concat)."""
    t = parse_type(ty)
    shape = list(t.shape)
    shape[int(axis)] -= int(split)
    return format_type(t.dtype, shape)


@lru_cache(maxsize=None)
def _same_dtype_op(op: str) -> str:
    return flag(op in _SAME_DTYPE_OPS)


def _dims(dims: str) -> tuple[tuple[int, ...], ...]:
    return tuple(ints(part) for part in dims.split(";"))


@lru_cache(maxsize=None)
def _rhs_free_axis(dims: str, weight: str, out: str, axis: str) -> str:
    """The weight axis that output `axis` slices (a rank-2 weight, no batch, one contraction, `axis`
    the output's last axis); "" otherwise."""
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _dims(dims)
    if lhs_batch or rhs_batch or len(rhs_contract) != 1 or len(parse_type(weight).shape) != 2:
        return ""
    if int(axis) != len(parse_type(out).shape) - 1:
        return ""
    return str(1 - rhs_contract[0])


@lru_cache(maxsize=None)
def _matmul_k_axes(dims: str, axis: str) -> str:
    """The weight's contraction axis when `axis` is the lhs's one contraction axis; else ""."""
    lhs_contract, rhs_contract, _, _ = _dims(dims)
    if len(lhs_contract) != 1 or lhs_contract[0] != int(axis):
        return ""
    return str(rhs_contract[0])


@lru_cache(maxsize=None)
def _conv_k_axes(params: str, axis: str) -> str:
    """The weight's in-feature axis when `axis` is the input's feature axis (no grouping); else ""."""
    from eqsat.conv_params import ConvParams

    p = ConvParams.parse(params)
    if p.feature_groups != 1 or p.batch_groups != 1 or p.lhs_spec[1] != int(axis):
        return ""
    return str(p.rhs_spec[1])


@lru_cache(maxsize=None)
def _extent(ty: str, axis: str) -> str:
    return str(parse_type(ty).shape[int(axis)])


# --- slices of concats -------------------------------------------------------------------------------


@concat_slice.register
def _slice_of_concat(x: Expr, y: Expr, axis: i64, split: i64, start: i64, stop: i64, stride: i64,
                     t: String, ts: String):
    """Concat(x, y)[s:e] = x[s:e] if e <= split, = y[s-split:e-split] if s >= split (along the concat
    axis; forward strides: a reversed slice's [start, stop) is not its interval)."""
    whole = Slice(Concat(x, y, axis, split, t), axis, start, stop, stride, ts)
    yield rewrite(whole).to(Slice(x, axis, start, stop, stride, ts), stop <= split, stride >= 1)
    yield rewrite(whole).to(Slice(y, axis, start - split, stop - split, stride, ts), start >= split, stride >= 1)


@concat_slice.register
def _slice_across_concat(x: Expr, y: Expr, axis: i64, split: i64, other: i64, start: i64, stop: i64, stride: i64,
                         t: String, ts: String):
    """Concat(x, y, a)[s:e along b != a] = Concat(x[s:e], y[s:e], a)."""
    a = axis.to_string()
    yield rewrite(Slice(Concat(x, y, axis, split, t), other, start, stop, stride, ts)).to(
        Concat(Slice(x, other, start, stop, stride, py_string(_resize, ts, a, split.to_string())),
               Slice(y, other, start, stop, stride, py_string(_rest, ts, a, split.to_string())),
               axis, split, ts),
        ne(other).to(axis))


# --- elementwise over concats ------------------------------------------------------------------------


@concat_slice.register
def _unary_over_concat(op: String, x: Expr, y: Expr, axis: i64, split: i64, t: String, tu: String):
    """op(Concat(x, y)) = Concat(op(x), op(y))."""
    a, s = axis.to_string(), split.to_string()
    yield rewrite(Unary(op, Concat(x, y, axis, split, t), tu)).to(
        Concat(Unary(op, x, py_string(_resize, tu, a, s)), Unary(op, y, py_string(_rest, tu, a, s)), axis, split, tu))


@concat_slice.register
def _binary_over_concats(op: String, x1: Expr, y1: Expr, x2: Expr, y2: Expr, axis: i64, split: i64,
                         t1: String, t2: String, tb: String):
    """op(Concat(x1, y1), Concat(x2, y2)) = Concat(op(x1, x2), op(y1, y2)) for the same split."""
    a, s = axis.to_string(), split.to_string()
    yield rewrite(Binary(op, Concat(x1, y1, axis, split, t1), Concat(x2, y2, axis, split, t2), tb)).to(
        Concat(Binary(op, x1, x2, py_string(_resize, tb, a, s)), Binary(op, y1, y2, py_string(_rest, tb, a, s)),
               axis, split, tb))


# --- slices of elementwise results and of matmul outputs (GEGLU) -------------------------------------


@concat_slice.register
def _slice_of_binary(op: String, x: Expr, y: Expr, axis: i64, start: i64, stop: i64, stride: i64,
                     t: String, ts: String):
    """op(x, y)[s:e] = op(x[s:e], y[s:e]) (ops whose operands have the result's dtype)."""
    yield rewrite(Slice(Binary(op, x, y, t), axis, start, stop, stride, ts)).to(
        Binary(op, Slice(x, axis, start, stop, stride, ts), Slice(y, axis, start, stop, stride, ts), ts),
        py_true(_same_dtype_op, op))


@concat_slice.register
def _slice_of_matmul(a: Expr, w: Tensor, dims: String, axis: i64, start: i64, stop: i64, tw: String,
                     t: String, ts: String):
    """dot(a, W)[..., s:e] = dot(a, W[s:e along W's free axis]): each half of a split projection is a matmul."""
    free = py_string(_rhs_free_axis, dims, tw, t, axis.to_string())
    free_axis = py_int(_rhs_free_axis, dims, tw, t, axis.to_string())
    sliced_ty = py_string(_resize, tw, free, (stop - start).to_string())
    yield rewrite(Slice(Load(Matmul(a, Load(w, tw), dims, Acc(t), t), t), axis, start, stop, 1, ts)).to(
        Load(Matmul(a, Slice(Load(w, tw), free_axis, start, stop, 1, sliced_ty), dims, Acc(ts), ts), ts),
        ne(free).to(String("")))


# --- concat along the contraction axis: a K range ----------------------------------------------------


@concat_slice.register
def _concat_k_range(a1: Expr, a2: Expr, w: Tensor, key: String, axis: i64, split: i64, ta: String, tw: String,
                    t: String, m: Tensor):
    """dot(Concat(a1, a2, K), W) = dot(a1, W[:k1]) + dot(a2, W[k1:]) (the second in the first's epilogue); also conv."""
    lhs_axis, k1 = axis.to_string(), split.to_string()
    for kernel, k_axes in ((Matmul, _matmul_k_axes), (Conv, _conv_k_axes)):
        k = py_string(k_axes, key, lhs_axis)  # the weight's contraction axis, "" if `axis` is not K
        k_axis = py_int(k_axes, key, lhs_axis)
        first_w = Slice(Load(w, tw), k_axis, 0, split, 1, py_string(_resize, tw, k, k1))
        second_w = Slice(Load(w, tw), k_axis, split, py_int(_extent, ta, lhs_axis), 1, py_string(_rest, tw, k, k1))
        second = Load(kernel(a2, second_w, key, Acc(t), t), t)
        yield rule(
            m == kernel(Concat(a1, a2, axis, split, ta), Load(w, tw), key, Acc(t), t),
            ne(k).to(String("")),
        ).then(union(m).with_(kernel(a1, first_w, key, Binary("add", Acc(t), second, t), t)))


# --- soundness examples ------------------------------------------------------------------------------


def _pair(draw):
    n, m, c = dim(draw), dim(draw), dim(draw)
    return tensor(draw, (n, c)), tensor(draw, (m, c))


def _pair_wide(draw):
    n, m, c = dim(draw, 2, 4), dim(draw, 2, 4), dim(draw)
    return tensor(draw, (n, c)), tensor(draw, (m, c))


def _quad(draw):
    n, m, c = dim(draw), dim(draw), dim(draw)
    return tensor(draw, (n, c)), tensor(draw, (m, c)), tensor(draw, (n, c)), tensor(draw, (m, c))


def _concat_then_halves(x, y):
    import jax.numpy as jnp

    z = jnp.concatenate([x, y], axis=0)
    n = x.shape[0]
    return z[:n] * 2.0, z[n:] + 1.0


def _concat_then_columns(x, y):
    import jax.numpy as jnp

    return jnp.concatenate([x, y], axis=0)[:, 1:] * 2.0


def _concat_then_straddle(x, y):
    import jax.numpy as jnp

    return jnp.concatenate([x, y], axis=0)[1:-1] * 2.0


def _concat_then_reversed(x, y):
    """A reversal (stride -1 from the end) of a concat: its `stop` -1 is left of the split."""
    import jax.numpy as jnp

    return jnp.flip(jnp.concatenate([x, y], axis=0), 0) * 2.0


def _exp_of_concat(x, y):
    import jax.numpy as jnp

    return jnp.exp(jnp.concatenate([x, y], axis=0))


def _product_of_concats(x, y, z, w):
    import jax.numpy as jnp

    return jnp.concatenate([x, y], axis=0) * jnp.concatenate([z, w], axis=0)


def _projection(draw):
    m, k, n = dim(draw), dim(draw), dim(draw)
    return tensor(draw, (m, k)), tensor(draw, (2 * n, k)), tensor(draw, (2 * n,))


def _geglu(x, w, b):
    """diffusers' GEGLU: one projection, split in value and gate, value * gelu(gate)."""
    import jax.numpy as jnp
    from jax import lax

    h = lax.dot_general(x, w, (((1,), (1,)), ((), ()))) + b
    value, gate = jnp.split(h, 2, axis=-1)
    return value * lax.erf(gate)


def _geglu_no_bias(x, w, b):
    import jax.numpy as jnp
    from jax import lax

    value, gate = jnp.split(lax.dot_general(x, w, (((1,), (1,)), ((), ()))), 2, axis=-1)
    return value * jnp.tanh(gate)


def _k_concat(draw):
    m, k1, k2, n = dim(draw), dim(draw), dim(draw), dim(draw)
    return tensor(draw, (m, k1)), tensor(draw, (m, k2)), tensor(draw, (k1 + k2, n))


def _matmul_of_concat(a, b, w):
    import jax.numpy as jnp

    return jnp.concatenate([a, b], axis=1) @ w


def _skip_concat(draw):
    b, h, w, c1, c2, co = dim(draw, 1, 2), dim(draw), dim(draw), dim(draw), dim(draw), dim(draw)
    return tensor(draw, (b, h, w, c1)), tensor(draw, (b, h, w, c2)), tensor(draw, (co, c1 + c2, 3, 3))


def _conv_of_concat(x, skip, w):
    import jax.numpy as jnp
    from jax import lax

    z = jnp.concatenate([x, skip], axis=-1)
    return lax.conv_general_dilated(z, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "OIHW", "NHWC"))


EXAMPLES = [
    Example(_concat_then_halves, _pair, ("slice_of_concat",), support=("absorb",)),
    Example(_concat_then_columns, _pair, ("slice_across_concat",), support=("absorb",)),
    Example(_concat_then_straddle, _pair_wide, ("slice_of_concat",), fires=False, support=("absorb",),
            name="a slice across the split"),
    Example(_concat_then_reversed, _pair, ("slice_of_concat",), fires=False, support=("absorb",),
            name="a reversal of a concat"),
    Example(_exp_of_concat, _pair, ("unary_over_concat",), support=("absorb",)),
    Example(_product_of_concats, _quad, ("binary_over_concats",), support=("absorb",)),
    Example(_geglu, _projection, ("slice_of_binary", "slice_of_matmul"), support=("absorb",)),
    Example(_geglu_no_bias, _projection, ("slice_of_matmul",), support=("absorb",)),
    Example(_matmul_of_concat, _k_concat, ("concat_k_range",), support=("absorb",)),
    Example(_conv_of_concat, _skip_concat, ("concat_k_range",), support=("absorb",)),
]
