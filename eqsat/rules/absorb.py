"""Activation absorption: elementwise work joins the kernels around it (DESIGN.md, family 4).

- Prologue: an elementwise/view producer is recomputed inside each consumer,
  `Load(Pointwise(e, ty), ty) = e`; a copy kernel is its input, `Pointwise(Load(t, ty), ty) = t`.
- Epilogue, bottom-up and local: an elementwise kernel over the output of a Matmul/Conv/Reduce/
  Attention `K` is `K` with the op pushed into its epilogue (bias, activation, residual add,
  mean = sum / n). The rules match whole `Pointwise` kernels, so the other operand `y` is a
  kernel body: it never mentions `Acc`, whose meaning depends on the enclosing kernel, and so
  may move into `K`'s epilogue, where it is evaluated at `K`'s output index.
- Two epilogues of one accumulator combine (silu(x @ w) = h * logistic(h) with h = x @ w).
- A reshape (or a broadcast that only adds unit axes) between `K` and the elementwise op does not
  stop the absorption: the op moves into the epilogue and the view stays on the outside
  (keepdims means: reduce, expand, divide).

- Permutes into sinks: a transpose moves through dtype-keeping elementwise ops toward the kernel
  that produces its operand, and a transposed conv output is the conv with a permuted `out_spec`
  (the NCHW <-> NHWC permutes around SD's convs). Matmuls have no output layout in the language;
  their consumers read a permuted output as index arithmetic in their prologue instead.
"""

from __future__ import annotations

from functools import lru_cache

from egglog import String, StringLike, f64, function, i64, rewrite, rule, ruleset, set_, union, var

from eqsat.lang import (
    Acc, Attention, Binary, Broadcast, Concat, Constant, Conv, DynamicSlice, Expr, Input, Iota, Lit, Load, Matmul, Pad,
    Pointwise, Reduce, Ref, Reshape, Select, Slice, Tensor, Transpose, Unary,
)
from eqsat.rules import Example, dim, flag, py_string, py_true, tensor
from eqsat.types import format_type, ints, parse_type

absorb = ruleset(name="absorb")

# Binary ops whose operands have the result's dtype (so a reshaped operand's type is known).
_SAME_DTYPE_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "rem", "atan2", "and", "or", "xor",
                             "nextafter", "shift_left", "shift_right_arithmetic", "shift_right_logical"})


@lru_cache(maxsize=None)
def _same_shape(first: str, second: str) -> str:
    return flag(parse_type(first).shape == parse_type(second).shape)


@lru_cache(maxsize=None)
def _retype(dtype_of: str, shape_of: str) -> str:
    """`dtype_of`'s dtype with `shape_of`'s shape."""
    return format_type(parse_type(dtype_of).dtype, parse_type(shape_of).shape)


@lru_cache(maxsize=None)
def _same_dtype_op(op: str) -> str:
    return flag(op in _SAME_DTYPE_OPS)


@lru_cache(maxsize=None)
def _expand_only(dims: str, source: str, target: str) -> str:
    """Is `broadcast_in_dim(source -> target, dims)` a reshape (it only inserts unit axes)?"""
    src, dst, mapped = parse_type(source).shape, parse_type(target).shape, ints(dims)
    if list(mapped) != sorted(mapped) or len(mapped) != len(src):
        return "0"
    if any(dst[d] != s for d, s in zip(mapped, src)):
        return "0"
    return flag(all(dst[axis] == 1 for axis in range(len(dst)) if axis not in mapped))


def _kinds(a: Expr, b: Expr, c: Expr, key: String, axes: String, scale: f64):
    """Each kernel kind with an epilogue over shared pattern variables, as a pair:
    `(epilogue, ty) -> Tensor` and the kind's `core` (the kernel without its epilogue, see below).
    Attention's score bias is one more pattern variable (`absorb_attention_bias`, an Expr)."""
    bias = var("absorb_attention_bias", Expr)
    return (
        (lambda epi, ty: Matmul(a, b, key, epi, ty), matmul_core(a, b, key)),
        (lambda epi, ty: Conv(a, b, key, epi, ty), conv_core(a, b, key)),
        (lambda epi, ty: Reduce(key, a, axes, epi, ty), reduce_core(key, a, axes)),
        (lambda epi, ty: Attention(a, b, c, bias, scale, epi, ty), attention_core(a, b, c, bias)),
    )


# --- the epilogue guard: what an expression reads ---------------------------------------------------
# An epilogue may read `y` only if `y` does not depend on the kernel's own core; otherwise the
# plan computes the core twice (a residual x + f(x) absorbed into x's producer, silu's
# h * logistic(h) as h's kernel reading logistic(h) from a twin, a norm's apply absorbed into the
# producer of its own statistics). Builder handles are a topological order, so "every tensor `y`
# reads is older than the oldest kernel with K's core" is a cheap sufficient condition. Inputs
# and constants have order -1: they depend on nothing.


@function(egg_fn="AbsorbOrder", merge=lambda old, new: old.min(new))
def order(t: Tensor) -> i64:
    """The smallest builder handle in `t`'s e-class (-1 for inputs and constants); a rule that makes
    a kernel outside any lifted e-class gives it its source's order."""


@function(egg_fn="AbsorbReads", merge=lambda old, new: old.min(new))
def reads(e: Expr) -> i64:
    """The largest `order` of the tensors `e` loads, minimized over `e`'s equivalent forms (no row
    for forms over `Acc`: those are never kernel bodies)."""


@function(egg_fn="AbsorbMatmulCore", merge=lambda old, new: old.min(new))
def matmul_core(a: Expr, b: Expr, dims: StringLike) -> i64:
    """The smallest `order` of a Matmul over (a, b, dims), whatever its epilogue."""


@function(egg_fn="AbsorbConvCore", merge=lambda old, new: old.min(new))
def conv_core(a: Expr, b: Expr, params: StringLike) -> i64:
    """The smallest `order` of a Conv over (a, b, params)."""


@function(egg_fn="AbsorbReduceCore", merge=lambda old, new: old.min(new))
def reduce_core(op: StringLike, body: Expr, axes: StringLike) -> i64:
    """The smallest `order` of a Reduce of (op, body, axes)."""


@function(egg_fn="AbsorbAttentionCore", merge=lambda old, new: old.min(new))
def attention_core(q: Expr, k: Expr, v: Expr, bias: Expr) -> i64:
    """The smallest `order` of an Attention over (q, k, v, bias)."""


@absorb.register
def _reads(t: Tensor, i: i64, name: String, ty: String, x: Expr, y: Expr, z: Expr, w: Expr, op: String, v: f64,
           s: String, a: i64, b: i64, c: i64, rw: i64, ry: i64, rz: i64, epi: Expr, scale: f64):
    """Bookkeeping for the epilogue guard: `order` of tensors and cores, `reads` of expressions."""
    yield rule(t == Ref(i)).then(set_(order(t)).to(i))
    yield rule(t == Input(name, ty)).then(set_(order(t)).to(i64(-1)))
    yield rule(t == Constant(name, ty)).then(set_(order(t)).to(i64(-1)))
    for kernel, core in _kinds(x, y, z, name, s, scale):
        yield rule(t == kernel(epi, ty), order(t) == i).then(set_(core).to(i))
    yield rule(x == Load(t, ty), order(t) == i).then(set_(reads(x)).to(i))
    yield rule(x == Lit(v, ty)).then(set_(reads(x)).to(i64(-1)))
    yield rule(x == Iota(a, ty)).then(set_(reads(x)).to(i64(-1)))
    for form in (Unary(op, y, ty), Reshape(y, ty), Transpose(y, s, ty), Broadcast(y, s, ty),
                 Slice(y, a, b, c, i, ty)):
        yield rule(x == form, reads(y) == ry).then(set_(reads(x)).to(ry))
    for form in (Binary(op, y, z, ty), Concat(y, z, a, b, ty), Pad(y, z, s, ty), DynamicSlice(y, a, z, b, ty)):
        yield rule(x == form, reads(y) == ry, reads(z) == rz).then(set_(reads(x)).to(ry.max(rz)))
    yield rule(x == Select(y, z, w, ty), reads(y) == ry, reads(z) == rz, reads(w) == rw).then(
        set_(reads(x)).to(ry.max(rz).max(rw)))


# --- prologues ---------------------------------------------------------------------------------------


@absorb.register
def _prologue(e: Expr, ty: String):
    """Load(Pointwise(e, ty), ty) = e: an elementwise/view producer is recomputed by its consumer."""
    yield rewrite(Load(Pointwise(e, ty), ty)).to(e)


@absorb.register
def _copy(t: Tensor, ty: String):
    """Pointwise(Load(t, ty), ty) = t: a copy kernel is its input."""
    yield rewrite(Pointwise(Load(t, ty), ty)).to(t)


# --- epilogues ---------------------------------------------------------------------------------------


@absorb.register
def _epilogue_unary(a: Expr, b: Expr, c: Expr, key: String, axes: String, scale: f64, epi: Expr,
                    op: String, tk: String, ty: String):
    """Pointwise(Unary(op, Load(K(.., epi, tk)), ty)) = K(.., Unary(op, epi, ty), ty)."""
    for kernel, _ in _kinds(a, b, c, key, axes, scale):
        yield rewrite(Pointwise(Unary(op, Load(kernel(epi, tk), tk), ty), ty)).to(kernel(Unary(op, epi, ty), ty))


@absorb.register
def _epilogue_binary(a: Expr, b: Expr, c: Expr, key: String, axes: String, scale: f64, epi: Expr,
                     op: String, y: Expr, tk: String, ty: String, p: Tensor, ry: i64, rk: i64):
    """Pointwise(Binary(op, Load(K(.., epi, tk)), y, ty)) = K(.., Binary(op, epi, y, ty), ty) (and y on the left).

    Guards: the operand is K's whole output (not a broadcast scalar), and y reads only tensors
    older than K's core (y does not depend on K: no plan computes the core twice).
    """
    for kernel, core in _kinds(a, b, c, key, axes, scale):
        source = Load(kernel(epi, tk), tk)
        for body, epilogue in ((Binary(op, source, y, ty), Binary(op, epi, y, ty)),
                               (Binary(op, y, source, ty), Binary(op, y, epi, ty))):
            yield rule(
                p == Pointwise(body, ty),
                py_true(_same_shape, tk, ty),
                reads(y) == ry,
                core == rk,
                ry < rk,
            ).then(union(p).with_(kernel(epilogue, ty)))


@absorb.register
def _epilogue_merge(a: Expr, b: Expr, c: Expr, key: String, axes: String, scale: f64, e1: Expr, e2: Expr,
                    op: String, t1: String, t2: String, ty: String):
    """Pointwise(Binary(op, Load(K(.., e1)), Load(K(.., e2)), ty)) = K(.., Binary(op, e1, e2, ty), ty)."""
    for kernel, _ in _kinds(a, b, c, key, axes, scale):
        yield rewrite(Pointwise(Binary(op, Load(kernel(e1, t1), t1), Load(kernel(e2, t2), t2), ty), ty)).to(
            kernel(Binary(op, e1, e2, ty), ty), py_true(_same_shape, t1, ty), py_true(_same_shape, t2, ty))


@absorb.register
def _epilogue_through_view(a: Expr, b: Expr, c: Expr, key: String, axes: String, scale: f64, epi: Expr,
                           op: String, y: Expr, dims: String, tk: String, tv: String, ty: String, p: Tensor,
                           ry: i64, rk: i64):
    """Pointwise(op(V(Load(K(.., epi, tk))), y)) = Pointwise(V(Load(K(.., op(epi, Reshape(y)))))), V a reshape/expand."""
    at_k = py_string(_retype, ty, tk)  # the op's result type at K's shape
    same_dtype = py_true(_same_dtype_op, op)  # so y's dtype is ty's
    y_at_k = Reshape(y, at_k)
    for kernel, core in _kinds(a, b, c, key, axes, scale):
        source = Load(kernel(epi, tk), tk)
        older = (reads(y) == ry, core == rk, ry < rk)  # y does not depend on K (see _epilogue_binary)
        views = (
            (Reshape(source, tv), lambda inner: Reshape(inner, ty), ()),
            (Broadcast(source, dims, tv), lambda inner: Broadcast(inner, dims, ty),
             (py_true(_expand_only, dims, tk, tv),)),
        )
        for view, rebuild, guard in views:
            yield rule(p == Pointwise(Unary(op, view, ty), ty), *guard).then(
                union(p).with_(Pointwise(rebuild(Load(kernel(Unary(op, epi, at_k), at_k), at_k)), ty)))
            yield rule(p == Pointwise(Binary(op, view, y, ty), ty), same_dtype, *guard, *older).then(
                union(p).with_(Pointwise(rebuild(Load(kernel(Binary(op, epi, y_at_k, at_k), at_k), at_k)), ty)))
            yield rule(p == Pointwise(Binary(op, y, view, ty), ty), same_dtype, *guard, *older).then(
                union(p).with_(Pointwise(rebuild(Load(kernel(Binary(op, y_at_k, epi, at_k), at_k), at_k)), ty)))


# --- sinks: a permute of a kernel's output as that kernel's output layout -----------------------------


@lru_cache(maxsize=None)
def _permuted_out_spec(params: str, permutation: str) -> str:
    """The conv params whose output is `transpose(output, permutation)`."""
    from dataclasses import replace

    from eqsat.conv_params import ConvParams

    p = ConvParams.parse(params)
    perm = ints(permutation)
    inverse = [0] * len(perm)
    for position, axis in enumerate(perm):
        inverse[axis] = position
    return replace(p, out_spec=tuple(inverse[axis] for axis in p.out_spec)).key


@absorb.register
def _transpose_of_binary(op: String, x: Expr, y: Expr, p: String, t: String, t2: String):
    """Transpose(Binary(op, x, y), p) = Binary(op, Transpose(x, p), Transpose(y, p)) (ops keeping the dtype)."""
    yield rewrite(Transpose(Binary(op, x, y, t), p, t2)).to(
        Binary(op, Transpose(x, p, t2), Transpose(y, p, t2), t2), py_true(_same_dtype_op, op))


@absorb.register
def _conv_output_layout(a: Expr, b: Expr, params: String, p: String, t: String, t2: String, x: Expr, i: i64):
    """Transpose(Load(Conv(a, b, params)), p) = Load(Conv(a, b, params with a permuted out_spec)): a layout sink."""
    permuted = Conv(a, b, py_string(_permuted_out_spec, params, p), Acc(t2), t2)
    yield rule(x == Transpose(Load(Conv(a, b, params, Acc(t), t), t), p, t2), conv_core(a, b, params) == i).then(
        union(x).with_(Load(permuted, t2)),
        set_(order(permuted)).to(i),  # as old as the conv it re-lays out (for the epilogue guard)
    )


# --- soundness examples ------------------------------------------------------------------------------


def _matmul_args(draw):
    m, k, n = dim(draw), dim(draw), dim(draw)
    return tensor(draw, (m, k)), tensor(draw, (k, n)), tensor(draw, (n,)), tensor(draw, (m, n))


def _conv_args(draw):
    b, h, w, ci, co = dim(draw, 1, 2), dim(draw, 1, 4), dim(draw, 1, 4), dim(draw), dim(draw)
    return tensor(draw, (b, h, w, ci)), tensor(draw, (co, ci, 3, 3)), tensor(draw, (co,))


def _rows(draw):
    return (tensor(draw, (dim(draw), dim(draw), dim(draw))),)


def _bcast(bias, like):
    """`bias` broadcast along the last axis of `like`, explicitly (lax's implicit size-1 broadcasting
    is not lifted yet)."""
    from jax import lax

    return lax.broadcast_in_dim(bias, like.shape, (like.ndim - 1,))


def _rows_wide(draw):
    return (tensor(draw, (dim(draw, 2, 4), dim(draw, 2, 4))),)


def _silu(x):
    from jax import lax

    return x * lax.logistic(x)


def _linear_bias_silu(x, w, bias, residual):
    """silu(x @ w + bias) + residual."""
    h = x @ w
    return _silu(h + _bcast(bias, h)) + residual


def _tanh_of_matmul(x, w, bias, residual):
    import jax.numpy as jnp

    return jnp.tanh(x @ w) * 2.0


def _conv_bias(x, w, bias):
    from jax import lax

    y = lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "OIHW", "NHWC"))
    return _silu(y + _bcast(bias, y))


def _conv_to_nchw(x, w, bias):
    """The UNet's last step: conv_out + bias on NHWC, returned as NCHW."""
    from jax import lax

    y = lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "OIHW", "NHWC"))
    return (y + _bcast(bias, y)).transpose(0, 3, 1, 2)


def _mean_last(x):
    import jax.numpy as jnp

    return jnp.mean(x, axis=-1) - 1.0


def _mean_keepdims(x):
    import jax.numpy as jnp

    return jnp.mean(x, axis=(1, 2), keepdims=True) * 3.0


def _exp_chain(x):
    import jax.numpy as jnp

    return jnp.exp(x) * 0.5 + x


def _gated(x, w, bias, residual):
    """h * tanh(h): the other operand reads h's own core, so only the merge may fire."""
    import jax.numpy as jnp

    h = x @ w
    return h * jnp.tanh(h)


def _sum_times_x(x):
    """A full reduction broadcast back over x: the broadcast replicates, so no epilogue through it."""
    import jax.numpy as jnp

    return jnp.sum(x) * x


def _copy_of_exp(x):
    import jax.numpy as jnp

    return jnp.copy(jnp.exp(x))


EXAMPLES = [
    Example(_exp_chain, _rows, ("prologue",)),
    Example(_copy_of_exp, _rows, ("copy",)),
    Example(_linear_bias_silu, _matmul_args, ("epilogue_binary", "epilogue_merge", "epilogue_unary")),
    Example(_tanh_of_matmul, _matmul_args, ("epilogue_unary", "epilogue_binary")),
    Example(_conv_bias, _conv_args, ("epilogue_binary", "epilogue_merge")),
    Example(_mean_last, _rows, ("epilogue_binary",)),
    Example(_conv_to_nchw, _conv_args, ("transpose_of_binary", "conv_output_layout", "epilogue_binary")),
    Example(_mean_keepdims, _rows, ("epilogue_through_view",)),
    Example(_gated, _matmul_args, ("epilogue_binary",), fires=False, name="h * tanh(h) (operand reads the core)"),
    Example(_gated, _matmul_args, ("epilogue_merge", "epilogue_unary"), name="h * tanh(h)"),
    Example(_sum_times_x, _rows_wide, ("epilogue_through_view",), fires=False, name="sum_times_x (replicating broadcast)"),
]
