"""Row statistics inside the matmul that reads them (beyond the seeds).

After `norm_split` and `absorb`, a LayerNorm feeding a linear layer is two kernels:

    stats = Reduce(moments, x, over C)                      kernel 1 reads x
    y     = Matmul(((x - mean) * rsqrt(var + eps)) * g + b, W)  kernel 2 reads x and stats

A matmul kernel walks every full row of its lhs along the contraction axis K, so it can compute
any reduction over K of that row itself (a pre-pass over the row block's K strips; for moments,
each strip's count/mean/M2 merged by Chan's formula, `eqsat.moments`) and drop kernel 1. The law is the trivial one,

    Load(Reduce(op, body, "a", epi, ty), ty) = RowReduce(op, body, a, epi, ty)

(a `RowReduce` is the same reduction, computed inside the reading kernel); the family's work is
deciding WHERE it is worth stating: only for reductions a matmul's lhs reads as row statistics.
Two context relations find them:

    RowFull(e, axis, k)   e is evaluated by a kernel that walks full rows of length k along `axis`
                          (seeded at a Matmul's lhs with one contraction axis; through elementwise
                          Unary/Binary/Select of that shape, and a Broadcast that maps `axis`)
    RowStat(e, k)         e is evaluated once per row of length k: its index space lacks the row
                          axis (a Broadcast along `axis`, or a keepdims axis of extent 1 under
                          RowFull); through elementwise ops and views

and `Load(Reduce(op, body, (a,), ...))` under `RowStat(_, k)` whose body has extent k along `a`
gets its `RowReduce`. A reduction over any other axes (GroupNorm statistics over space feeding a
matmul over channels) never reaches `RowStat` and keeps its kernel.
"""

from __future__ import annotations

from functools import lru_cache

from egglog import String, eq, i64, relation, rule, ruleset, union

from eqsat.lang import (
    Binary, Broadcast, Expr, Load, Matmul, Reduce, Reshape, RowReduce, Select, Slice, Tensor, Transpose, Unary,
)
from eqsat.rules import Example, dim, py_int, py_true, tensor, typed_forms
from eqsat.types import ints, parse_type

row_stats = ruleset(name="row_stats")

# The context relations advance one term level per iteration and the family adds one e-node per
# statistic: the default schedule runs it to its fixpoint in one stage iteration (eqsat.schedule).
FIXPOINT_STAGE = True

RowFull = relation("RowFull", Expr, i64, i64)
RowStat = relation("RowStat", Expr, i64)


# --- shape arithmetic (Python, called from the rules) --------------------------------------------


@lru_cache(maxsize=None)
def _lhs_axis(dims: str, lhs_ty: str) -> str:
    """The lhs contraction axis of matmul `dims` when there is exactly one, else -1."""
    contract = ints(dims.split(";")[0]) if dims else ()
    shape = parse_type(lhs_ty).shape
    return str(contract[0]) if len(contract) == 1 and shape[contract[0]] > 1 else "-1"


@lru_cache(maxsize=None)
def _extent(ty: str, axis: str) -> str:
    shape = parse_type(ty).shape
    a = int(axis)
    return str(shape[a]) if 0 <= a < len(shape) else "-1"


@lru_cache(maxsize=None)
def _kind(ty: str, axis: str, k: str) -> str:
    """Under RowFull(e, axis, k), e of type `ty`: "full" (extent k), "row" (extent 1), else ""."""
    extent = _extent(ty, axis)
    return "full" if extent == k else "row" if extent == "1" else ""


@lru_cache(maxsize=None)
def _is_full(ty: str, axis: str, k: str) -> str:
    return "1" if _kind(ty, axis, k) == "full" else "0"


@lru_cache(maxsize=None)
def _is_row(ty: str, axis: str, k: str) -> str:
    return "1" if _kind(ty, axis, k) == "row" else "0"


@lru_cache(maxsize=None)
def _source_axis(dims: str, axis: str) -> str:
    """The operand axis a Broadcast maps onto output `axis` (-1: none, the row axis is broadcast)."""
    mapped = ints(dims)
    a = int(axis)
    return str(mapped.index(a)) if a in mapped else "-1"


@lru_cache(maxsize=None)
def _row_reduce_axis(axes: str, body_ty: str, k: str) -> str:
    """The one reduced axis when the reduction is over exactly one axis of extent k, else -1."""
    reduced = ints(axes)
    if len(reduced) != 1:
        return "-1"
    return str(reduced[0]) if parse_type(body_ty).shape[reduced[0]] == int(k) else "-1"


# --- the rules ----------------------------------------------------------------------------------


@row_stats.register
def _seed(lhs: Expr, rhs: Expr, dims: String, epi: Expr, ty: String, lt: String, t: Tensor):
    """Matmul(lhs, ..) with one contraction axis a of extent k => RowFull(lhs, a, k)."""
    for form in typed_forms(lt, prefix="_row_seed"):
        axis = py_int(_lhs_axis, dims, lt)
        yield rule(t == Matmul(lhs, rhs, dims, epi, ty), eq(lhs).to(form), axis >= i64(0)).then(
            RowFull(lhs, axis, py_int(_extent, lt, axis.to_string())))


@row_stats.register
def _full(e: Expr, x: Expr, y: Expr, z: Expr, op: String, ty: String, axis: i64, k: i64):
    """RowFull(op(x, ..), a, k) with the op at full rows => RowFull(x, a, k) (elementwise operands)."""
    full = lambda: py_true(_is_full, ty, axis.to_string(), k.to_string())  # noqa: E731
    yield rule(RowFull(e, axis, k), e == Unary(op, x, ty), full()).then(RowFull(x, axis, k))
    yield rule(RowFull(e, axis, k), e == Binary(op, x, y, ty), full()).then(RowFull(x, axis, k), RowFull(y, axis, k))
    yield rule(RowFull(e, axis, k), e == Select(x, y, z, ty), full()).then(
        RowFull(x, axis, k), RowFull(y, axis, k), RowFull(z, axis, k))


@row_stats.register
def _to_row(e: Expr, x: Expr, y: Expr, z: Expr, op: String, dims: String, ty: String, axis: i64, k: i64):
    """RowFull(e, a, k) with e of extent 1 along a (keepdims) => RowStat(e, k)."""
    row = lambda: py_true(_is_row, ty, axis.to_string(), k.to_string())  # noqa: E731
    for form in (Unary(op, x, ty), Binary(op, x, y, ty), Select(x, y, z, ty), Broadcast(x, dims, ty)):
        yield rule(RowFull(e, axis, k), e == form, row()).then(RowStat(e, k))


@row_stats.register
def _broadcast(e: Expr, x: Expr, dims: String, ty: String, axis: i64, k: i64):
    """RowFull(Broadcast(x, dims), a, k): a not mapped => RowStat(x, k); a mapped from b => RowFull(x, b, k)."""
    source = py_int(_source_axis, dims, axis.to_string())
    full = py_true(_is_full, ty, axis.to_string(), k.to_string())
    yield rule(RowFull(e, axis, k), e == Broadcast(x, dims, ty), full, eq(source).to(i64(-1))).then(RowStat(x, k))
    yield rule(RowFull(e, axis, k), e == Broadcast(x, dims, ty), full, source >= i64(0)).then(RowFull(x, source, k))


@row_stats.register
def _stat(e: Expr, x: Expr, y: Expr, z: Expr, op: String, s: String, ty: String, a: i64, b: i64, c: i64,
          d: i64, k: i64):
    """RowStat(f(x, ..), k) => RowStat(x, k): per-row values are computed from per-row values (elementwise, views)."""
    for form, operands in (
        (Unary(op, x, ty), (x,)), (Binary(op, x, y, ty), (x, y)), (Select(x, y, z, ty), (x, y, z)),
        (Reshape(x, ty), (x,)), (Transpose(x, s, ty), (x,)), (Broadcast(x, s, ty), (x,)),
        (Slice(x, a, b, c, d, ty), (x,)),
    ):
        yield rule(RowStat(e, k), e == form).then(*(RowStat(o, k) for o in operands))


@row_stats.register
def _row_reduce(e: Expr, op: String, body: Expr, axes: String, epi: Expr, ty: String, bt: String, k: i64):
    """Load(Reduce(op, body, "a", epi, ty), ty) = RowReduce(op, body, a, epi, ty), read as a row statistic of extent k."""
    for form in typed_forms(bt, prefix="_row_body"):
        axis = py_int(_row_reduce_axis, axes, bt, k.to_string())
        yield rule(RowStat(e, k), e == Load(Reduce(op, body, axes, epi, ty), ty), eq(body).to(form),
                   axis >= i64(0)).then(union(e).with_(RowReduce(op, body, axis, epi, ty)))


# --- soundness examples ------------------------------------------------------------------------------


def _ln_args(draw):
    b, s, c, n = dim(draw, 1, 2), dim(draw, 1, 3), dim(draw, 2, 5), dim(draw, 1, 4)
    return tensor(draw, (b, s, c)), tensor(draw, (c,)), tensor(draw, (c,)), tensor(draw, (c, n))


def _layernorm_linear(x, g, b, w):
    """LayerNorm over the last axis, then a linear layer (the transformer block's to_q / ff.proj)."""
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return ((x - mean) / jnp.sqrt(var + 1e-5) * g + b) @ w


def _rms_linear(x, g, b, w):
    """RMSNorm (no keepdims: the statistic is broadcast back along the row axis) then a linear layer."""
    from jax import lax
    import jax.numpy as jnp

    ms = jnp.mean(x * x, axis=-1)
    scale = lax.broadcast_in_dim(lax.rsqrt(ms + 1e-5), x.shape, (0, 1))
    return (x * scale * g) @ w


def _gn_args(draw):
    b, s, c, n = dim(draw, 1, 2), dim(draw, 2, 4), dim(draw, 2, 4), dim(draw, 1, 3)
    return tensor(draw, (b, s, c)), tensor(draw, (c,)), tensor(draw, (c,)), tensor(draw, (c, n))


def _spatial_norm_linear(x, g, b, w):
    """Statistics over the spatial axis (GroupNorm-like), then a matmul over channels: not row statistics."""
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=1, keepdims=True)
    return ((x - mean) * g + b) @ w


EXAMPLES = [
    Example(_layernorm_linear, _ln_args, ("seed", "full", "to_row", "stat", "row_reduce"),
            support=("absorb", "norm_split")),
    Example(_rms_linear, _ln_args, ("seed", "broadcast", "row_reduce"), support=("absorb",)),
    Example(_spatial_norm_linear, _gn_args, ("row_reduce",), fires=False,
            name="spatial statistics feeding a matmul over channels", support=("absorb",)),
]
