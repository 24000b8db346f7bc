"""Normalization split into statistics + apply, with both statistics from ONE reduction kernel.

GroupNorm and LayerNorm are written (sd15/layers.py, jnp.var) as two dependent passes:

    mean = sum(x) / n                     kernel 1 reads x
    var  = sum((x - mean)^2) / n          kernel 2 reads x AND waits for kernel 1

Two laws make statistics one kernel and leave the apply elementwise (the absorb family then
moves `(x - mean) * rsqrt(var + eps) * w + b` into the next conv/matmul prologue):

- variance: sum(x)/n and sum((x - sum(x)/n)^2) are the two rows of ONE `moments` reduction of x
  (`eqsat.moments`): `M = Reduce("moments", x, axes)`, `M[0] = mean(x)`, `M[1] = M2`. Exact: the
  moments are defined as those two statistics, computed two-pass by the interpreter and from
  per-tile partial moments merged with Chan's formula by kernels. Nothing cancels, whatever the
  offset of x (this replaces sum(x^2) - sum(x)^2/n, which is wrong or NaN when |mean| >> std).
  Only on float32 statistics (the moments are float32; SD's norms upcast to fp32 before reducing).
  The program's mean (a view of sum(x), divided by n: `MeanTimes`) becomes that view of `M[0]`
  itself, so a kernel's mean reaches the apply unchanged (a constant row's mean is its value, and
  x - mean is 0). A sum read as such keeps its own reduction: `M[0] * n` divided by n again (which
  an extraction could pick) is an ulp of the mean off, and x - mean magnifies that ulp by 1/std.
- stacking: sum(x) and sum(x*x) over the same axes are the two rows of one reduction of
  stack(x, x*x) along a new leading axis: `Reduce(Concat(Reshape(x), Reshape(x*x)), axes + 1)`;
  each statistic is a Slice of it. It only stacks two sums the program itself computes (a
  program that writes E[x^2] - E[x]^2 keeps its own numerics; no rule introduces a sum of squares).

The patterns are found through helper relations rather than literal e-node shapes, so they match
the lifted form (`Load(Pointwise(...))` between every primitive) and the absorbed form alike:

    Scalar(e, c)                e is the constant c splatted (Lit, broadcast/reshape of one)
    StatView(e, ty, s, n, map)  e[i] = s[i[map]] / n: a broadcast/reshape/transpose of reduction s,
                                divided by n; `map` ("m:0,2") names, per axis of s, the axis of e
                                that indexes it ("-": a size-1 axis of s, always index 0)
    Centered(e, x, s)           e = x - s/n broadcast back, s = sum(x) over the axes the view drops
    SquareOf(e, x)              e = x * x
    MeanTimes(e, m, c)          e = m * c, m a view of a moments reduction's mean row: dividing e
                                by c (or multiplying it by 1/c) is m
"""

from __future__ import annotations

import math
from functools import lru_cache

from egglog import String, f64, ne, relation, rule, ruleset, union

from eqsat.lang import Acc, Binary, Concat, Expr, Lit, Load, Pointwise, Reduce, Reshape, Slice, Tensor, Transpose, Unary
from eqsat.lang import Broadcast
from eqsat.rules.dsl import py_int
from eqsat.rules.horizontal import py_string
from eqsat.types import format_type, ints, ints_key, parse_type

norm_split = ruleset(name="norm_split")

Scalar = relation("NormScalar", Expr, f64)
StatView = relation("NormStatView", Expr, String, Tensor, f64, String)
Centered = relation("NormCentered", Expr, Expr, Tensor, String)
SquareOf = relation("NormSquareOf", Expr, Expr, String)
MeanTimes = relation("NormMeanTimes", Expr, Expr, f64)

REDUCTIONS_WITH_VIEWS = ("sum", "max")


# --- view arithmetic (Python, called from the rules) --------------------------------------------


def _shape(ty: str) -> tuple[int, ...]:
    return parse_type(ty).shape


def _parse_map(text: str) -> list[int | None]:
    body = text[2:]
    return [None if part == "-" else int(part) for part in body.split(",")] if body else []


def _format_map(entries) -> str:
    return "m:" + ",".join("-" if e is None else str(e) for e in entries)


@lru_cache(maxsize=None)
def _identity_map(ty: str) -> str:
    return _format_map(range(len(_shape(ty))))


@lru_cache(maxsize=None)
def _map_broadcast(view: str, x_ty: str, dims: str, ty: str) -> str:
    """`view` after `Broadcast(x, dims, ty)`: an axis of x indexed by s moves to `dims[axis]`."""
    dims_ = ints(dims)
    x_shape, out_shape = _shape(x_ty), _shape(ty)
    out = []
    for entry in _parse_map(view):
        if entry is None or x_shape[entry] == 1:
            out.append(None)
        elif out_shape[dims_[entry]] != x_shape[entry]:
            return ""
        else:
            out.append(dims_[entry])
    return _format_map(out)


@lru_cache(maxsize=None)
def _map_reshape(view: str, x_ty: str, ty: str) -> str:
    """`view` after a reshape that only inserts or removes size-1 axes ("" for any other reshape)."""
    x_shape, out_shape = _shape(x_ty), _shape(ty)
    x_axes = [a for a, n in enumerate(x_shape) if n != 1]
    out_axes = [a for a, n in enumerate(out_shape) if n != 1]
    if [x_shape[a] for a in x_axes] != [out_shape[a] for a in out_axes]:
        return ""
    moved = dict(zip(x_axes, out_axes))
    return _format_map(None if e is None or x_shape[e] == 1 else moved[e] for e in _parse_map(view))


@lru_cache(maxsize=None)
def _map_transpose(view: str, permutation: str) -> str:
    perm = ints(permutation)
    return _format_map(None if e is None else perm.index(e) for e in _parse_map(view))


@lru_cache(maxsize=None)
def _is_mean_view(view: str, x_ty: str, axes: str, n: str, s_ty: str) -> str:
    """"ok" if `view` reads s at the axes of x that `axes` keep, in order, and n = their count."""
    x_shape, reduced = _shape(x_ty), ints(axes)
    kept = [a for a in range(len(x_shape)) if a not in reduced]
    entries = _parse_map(view)
    if len(entries) != len(kept):
        return ""
    for entry, axis, extent in zip(entries, kept, _shape(s_ty)):
        if entry != axis and not (entry is None and extent == 1):
            return ""
    count = math.prod(x_shape[a] for a in reduced)
    return "ok" if math.isclose(float(n), count, rel_tol=1e-6) else ""


def _view(fn, *args) -> String:
    return py_string(fn, *args)


# --- the analyses -------------------------------------------------------------------------------


def scalar_rules(target):
    """Register the Scalar analysis (shared with the attention family) into ruleset `target`."""

    @target.register
    def _scalars(e: Expr, x: Expr, c: f64, ty: String, dims: String):
        """Scalar(e, c): e is the constant c at every index (a Lit, or a view or copy of one)."""
        yield rule(e == Lit(c, ty)).then(Scalar(e, c))
        yield rule(e == Broadcast(x, dims, ty), Scalar(x, c)).then(Scalar(e, c))
        yield rule(e == Reshape(x, ty), Scalar(x, c)).then(Scalar(e, c))
        yield rule(e == Load(Pointwise(x, ty), ty), Scalar(x, c)).then(Scalar(e, c))

    return _scalars


scalar_rules(norm_split)


def stat_view_rules(target):
    """Register the StatView analysis (shared with the attention family) into ruleset `target`."""

    @target.register
    def _stat_views(
        e: Expr, x: Expr, k: Expr, s: Tensor, body: Expr, op: String, axes: String, ts: String, tx: String,
        ty: String, dims: String, view: String, n: f64, c: f64,
    ):
        """StatView(e, ty, s, n, map): e[i] = s[i[map]] / n, through views, scalar divisions and copies."""
        for reduction in REDUCTIONS_WITH_VIEWS:
            yield rule(
                e == Load(s, ts), s == Reduce(reduction, body, axes, Acc(ts), ts),
            ).then(StatView(e, ts, s, f64(1.0), _view(_identity_map, ts)))
        broadcast = _view(_map_broadcast, view, tx, dims, ty)
        yield rule(e == Broadcast(x, dims, ty), StatView(x, tx, s, n, view), ne(broadcast).to(String(""))).then(
            StatView(e, ty, s, n, broadcast))
        reshape = _view(_map_reshape, view, tx, ty)
        yield rule(e == Reshape(x, ty), StatView(x, tx, s, n, view), ne(reshape).to(String(""))).then(
            StatView(e, ty, s, n, reshape))
        yield rule(e == Transpose(x, dims, ty), StatView(x, tx, s, n, view)).then(
            StatView(e, ty, s, n, _view(_map_transpose, view, dims)))
        yield rule(e == Binary("div", x, k, ty), StatView(x, ty, s, n, view), Scalar(k, c)).then(
            StatView(e, ty, s, n * c, view))
        yield rule(e == Binary("mul", x, k, ty), StatView(x, ty, s, n, view), Scalar(k, c), ne(c).to(f64(0.0))).then(
            StatView(e, ty, s, n / c, view))
        yield rule(e == Binary("mul", k, x, ty), StatView(x, ty, s, n, view), Scalar(k, c), ne(c).to(f64(0.0))).then(
            StatView(e, ty, s, n / c, view))
        # max(-inf, x) = x (jax.nn.softmax guards its row max so)
        yield rule(e == Binary("max", k, x, ty), StatView(x, ty, s, n, view), Scalar(k, f64(-math.inf))).then(
            StatView(e, ty, s, n, view))
        yield rule(e == Binary("max", x, k, ty), StatView(x, ty, s, n, view), Scalar(k, f64(-math.inf))).then(
            StatView(e, ty, s, n, view))
        yield rule(e == Load(Pointwise(x, ty), ty), StatView(x, ty, s, n, view)).then(StatView(e, ty, s, n, view))

    return _stat_views


stat_view_rules(norm_split)


@norm_split.register
def _centered(e: Expr, x: Expr, m: Expr, s: Tensor, axes: String, n: f64, view: String, tx: String, ts: String):
    """Centered(e, x, s): e = x - sum(x)/n broadcast back over the reduced axes."""
    mean_ok = py_string(_is_mean_view, view, tx, axes, n.to_string(), ts)
    yield rule(
        e == Binary("sub", x, m, tx),
        StatView(m, tx, s, n, view),
        s == Reduce("sum", x, axes, Acc(ts), ts),
        ne(mean_ok).to(String("")),
    ).then(Centered(e, x, s, tx))
    yield rule(e == Load(Pointwise(m, tx), tx), Centered(m, x, s, tx)).then(Centered(e, x, s, tx))


@norm_split.register
def _squares(e: Expr, x: Expr, d: Expr, d2: Expr, s: Tensor, tx: String):
    """SquareOf(e, x): e = x * x (mul, square, integer_pow:2), and squares of centered values."""
    yield rule(e == Binary("mul", x, x, tx)).then(SquareOf(e, x, tx))
    yield rule(e == Unary("square", x, tx)).then(SquareOf(e, x, tx))
    yield rule(e == Unary("integer_pow:2", x, tx)).then(SquareOf(e, x, tx))
    # (x - m) * (x - m) written with two separately lifted (but equal) subtractions
    yield rule(e == Binary("mul", d, d2, tx), Centered(d, x, s, tx), Centered(d2, x, s, tx)).then(SquareOf(e, d, tx))
    yield rule(e == Load(Pointwise(d, tx), tx), SquareOf(d, x, tx)).then(SquareOf(e, x, tx))


# --- the laws -----------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _float32(ty: str) -> str:
    return "ok" if parse_type(ty).dtype == "float32" else ""


@lru_cache(maxsize=None)
def _part(text: str, index: str) -> str:
    return text.split("|")[int(index)]


@lru_cache(maxsize=None)
def _moments_layout(ts: str) -> str:
    """"[2]+s type|[1]+s type": the moments of statistics of type `ts`, and one row of them."""
    s = parse_type(ts)
    return f"{format_type('float32', (2, *s.shape))}|{format_type('float32', (1, *s.shape))}"


@lru_cache(maxsize=None)
def _count(tx: str, axes: str) -> str:
    """How many elements of x (type `tx`) a reduction over `axes` reduces, as a decimal string."""
    return str(math.prod(_shape(tx)[a] for a in ints(axes)))


@lru_cache(maxsize=None)
def _reciprocal(c: str, k: str) -> str:
    """"ok" when c * k = 1 (a multiplication by a float32 1/c divides by c)."""
    return "ok" if math.isclose(float(c) * float(k), 1.0, rel_tol=1e-6) else ""


@norm_split.register
def _variance(v: Tensor, s: Tensor, body: Expr, d: Expr, x: Expr, axes: String, tx: String, ts: String):
    """sum(x)/n = M[0] (`_means`, where the program divides its sum) and sum((x - sum(x)/n)^2) = M[1]
    for M = moments(x, axes): one stable statistics kernel."""
    layout = py_string(_moments_layout, ts)
    tm, t1 = py_string(_part, layout, String("0")), py_string(_part, layout, String("1"))
    both = Load(Reduce("moments", x, axes, Acc(tm), tm), tm)
    mean = Reshape(Slice(both, 0, 0, 1, 1, t1), ts)
    n = f64.from_i64(py_int(_count, tx, axes))
    yield rule(
        v == Reduce("sum", body, axes, Acc(ts), ts),
        SquareOf(body, d, tx),
        Centered(d, x, s, tx),
        s == Reduce("sum", x, axes, Acc(ts), ts),
        ne(py_string(_float32, ts)).to(String("")),
    ).then(
        MeanTimes(Load(s, ts), mean, n),
        union(Load(v, ts)).with_(Reshape(Slice(both, 0, 1, 2, 1, t1), ts)),
    )


@norm_split.register
def _means(e: Expr, x: Expr, k: Expr, m: Expr, c: f64, c2: f64, ty: String, dims: String):
    """MeanTimes(e, m, c): e = m * c through views and copies; e / c = m and e * (1/c) = m.

    Views of the mean row are made only where the program views its sum, so the e-graph grows by
    the program's own views of that sum."""
    yield rule(e == Broadcast(x, dims, ty), MeanTimes(x, m, c)).then(MeanTimes(e, Broadcast(m, dims, ty), c))
    yield rule(e == Reshape(x, ty), MeanTimes(x, m, c)).then(MeanTimes(e, Reshape(m, ty), c))
    yield rule(e == Transpose(x, dims, ty), MeanTimes(x, m, c)).then(MeanTimes(e, Transpose(m, dims, ty), c))
    yield rule(e == Load(Pointwise(x, ty), ty), MeanTimes(x, m, c)).then(MeanTimes(e, m, c))
    yield rule(e == Binary("div", x, k, ty), MeanTimes(x, m, c), Scalar(k, c)).then(union(e).with_(m))
    reciprocal = py_string(_reciprocal, c.to_string(), c2.to_string())
    yield rule(e == Binary("mul", x, k, ty), MeanTimes(x, m, c), Scalar(k, c2), ne(reciprocal).to(String(""))).then(
        union(e).with_(m))
    yield rule(e == Binary("mul", k, x, ty), MeanTimes(x, m, c), Scalar(k, c2), ne(reciprocal).to(String(""))).then(
        union(e).with_(m))


@lru_cache(maxsize=None)
def _stacked(tx: str, axes: str, ts: str) -> str:
    """"[1]+x type|[2]+x type|axes+1|[1]+s type|[2]+s type" for stacking two statistics of x."""
    x, s = parse_type(tx), parse_type(ts)
    return "|".join((
        format_type(x.dtype, (1, *x.shape)), format_type(x.dtype, (2, *x.shape)),
        ints_key(a + 1 for a in ints(axes)),
        format_type(s.dtype, (1, *s.shape)), format_type(s.dtype, (2, *s.shape)),
    ))


@norm_split.register
def _stack_statistics(s1: Tensor, s2: Tensor, x: Expr, body: Expr, axes: String, tx: String, ts: String):
    """sum(x) = R[0] and sum(x*x) = R[1] for R = sum(stack(x, x*x), axes + 1): one statistics kernel."""
    layout = py_string(_stacked, tx, axes, ts)
    x1_ty, x2_ty, stacked_axes, s1_ty, s2_ty = (py_string(_part, layout, String(str(k))) for k in range(5))
    stacked = Concat(Reshape(x, x1_ty), Reshape(body, x1_ty), 0, 1, x2_ty)
    both = Load(Reduce("sum", stacked, stacked_axes, Acc(s2_ty), s2_ty), s2_ty)
    yield rule(
        s1 == Reduce("sum", x, axes, Acc(ts), ts),
        s2 == Reduce("sum", body, axes, Acc(ts), ts),
        SquareOf(body, x, tx),
    ).then(
        union(Load(s1, ts)).with_(Reshape(Slice(both, 0, 0, 1, 1, s1_ty), ts)),
        union(Load(s2, ts)).with_(Reshape(Slice(both, 0, 1, 2, 1, s1_ty), ts)),
    )


# --- soundness examples (eqsat.rules.check) ------------------------------------------------------


def _group_norm(x, weight, bias):
    """SD 1.5's GroupNorm (2 groups) on channels-last float32 input."""
    from eqsat.rules.model_spellings import group_norm

    return group_norm(x, weight, bias, 2, 1e-5)


def _group_norm_args(draw):
    from eqsat.rules import dim, tensor

    channels = 2 * dim(draw, 1, 3)
    return (tensor(draw, (dim(draw, 1, 2), dim(draw, 1, 3), dim(draw, 1, 3), channels)),
            tensor(draw, (channels,)), tensor(draw, (channels,)))


def _layer_norm(x, weight, bias):
    from eqsat.rules.model_spellings import layer_norm

    return layer_norm(x, weight, bias, 1e-5)


def _layer_norm_args(draw):
    from eqsat.rules import dim, tensor

    width = dim(draw, 2, 6)
    return tensor(draw, (dim(draw), dim(draw), width)), tensor(draw, (width,)), tensor(draw, (width,))


def _sum_of_centered_squares(x):
    import jax.numpy as jnp

    centered = x - jnp.sum(x, axis=-1, keepdims=True) / x.shape[-1]
    return jnp.sum(centered * centered, axis=-1)


def _normalized_by_reciprocals(x):
    """Mean and variance written as sums times 1/n (no division): the mean is still the moments' row 0."""
    from jax import lax

    import jax.numpy as jnp

    inverse = 1.0 / x.shape[-1]
    centered = x - jnp.sum(x, axis=-1, keepdims=True) * inverse
    return centered * lax.rsqrt(jnp.sum(centered * centered, axis=-1, keepdims=True) * inverse + 1e-5)


def _variance16_args(draw):
    from eqsat.rules import dim, tensor

    return (tensor(draw, (dim(draw), dim(draw, 2, 4)), "float16"),)


def _mean_and_mean_of_squares(x):
    """A program that computes sum(x) and sum(x*x) itself (RMSNorm beside a mean): stacked as written."""
    import jax.numpy as jnp

    return jnp.mean(x, axis=-1), jnp.mean(x * x, axis=-1)


def _variance_other_axis(x):
    """The mean is over axis 1, the squares are summed over axis 2: no variance."""
    import jax.numpy as jnp

    centered = x - jnp.sum(x, axis=1, keepdims=True) / x.shape[1]
    return jnp.sum(centered * centered, axis=2)


def _rank3_args(draw):
    from eqsat.rules import dim, tensor

    return (tensor(draw, (dim(draw), dim(draw, 2, 4), dim(draw, 2, 4))),)


def _examples():
    from eqsat.rules import Example

    return [
        Example(_group_norm, _group_norm_args, ("variance", "means")),
        Example(_layer_norm, _layer_norm_args, ("variance", "means")),
        Example(_normalized_by_reciprocals, _rank3_args, ("variance", "means")),
        Example(_mean_and_mean_of_squares, _rank3_args, ("stack_statistics",)),
        Example(_layer_norm, _layer_norm_args, ("stack_statistics",), fires=False,
                name="layer norm (no sum of squares is introduced)"),
        Example(_sum_of_centered_squares, _variance16_args, ("variance",), fires=False, name="variance (float16)"),
        Example(_variance_other_axis, _rank3_args, ("variance",), fires=False),
    ]


EXAMPLES = _examples()
