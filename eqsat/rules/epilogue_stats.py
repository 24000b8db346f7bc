"""Statistics from the producer's epilogue (beyond the seeds).

After `norm_split`, a GroupNorm is a statistics kernel and an apply absorbed into the next conv:

    x     = Conv(...)                                           kernel 1 writes x
    stats = Reduce(moments, x, over (C/G, H, W))                kernel 2 reads x again
    y     = Conv((x - mean) * rsqrt(var + eps) * g + b, W)      kernel 3 reads x and stats

GroupNorm statistics reduce over space, so the conv reading them cannot recompute them the way a
matmul recomputes LayerNorm's row statistics (`row_stats`). But the kernel that WRITES x has every
element of x in registers once: each of its output tiles writes its partial statistics (a partial
sum, or partial moments count/mean/M2) into its own slot of a small fp32 buffer, the kernel
reading the statistic merges the slots in tile order (Chan's formula for moments,
`eqsat.moments`), and kernel 2 disappears: no atomics, no zeroing, deterministic. The law is
trivial,

    Reduce(op, body, axes, Acc, ty) = EpilogueReduce(x, op, body, axes, ty)      op in {sum, moments}

(an `EpilogueReduce` is the same reduction, computed by the kernel producing `x`); the family's work
is stating it only where `x`'s kernel can compute it: where the body reads `x` at the element being
written. A body over `concat(h, skip)` (the up blocks' first GroupNorm) is hosted by both kernels,
each writing partials for the elements it writes. Three context relations find those bodies, top-down from the reduction:

    Want(e)      e is (part of) the body of a sum or moments reduction with the identity epilogue
    Of(e, x)     e's element i is computed from ONE element of x, or of another kernel output
                 concatenated with it (Concat), through index maps (Reshape, Transpose, Slice) and
                 elementwise ops whose operands read the same element (x*x) or side values; x is
                 written by a Matmul, Conv or Attention kernel
    Safe(e)      a side value: built from literals and tensors no statistics depend on (inputs,
                 constants, matmul/conv/gather outputs: a bias, a time-embedding projection),
                 reaching the body through a Broadcast

A centered variance written sum((x - mean(x))^2) reads a statistic of x itself, which does not exist
while x's kernel runs: `Load` of a Reduce is never Safe, so that form is not hosted; its `moments`
form (`norm_split`: each tile centres its own values on its own mean) is. What the rules cannot
see (a side input that depends on x through a matmul) the plan checks on the extracted terms
(`eqsat.cost.hosting`), running such a reduction as its own kernel.
"""

from __future__ import annotations

from egglog import String, f64, i64, relation, rule, ruleset, union

from eqsat.lang import (
    Acc, Attention, Binary, Broadcast, Concat, Conv, EpilogueReduce, Expr, Gather, Input, Iota, Lit, Load, Matmul,
    Constant, Pointwise, Reduce, Reshape, Select, Slice, Tensor, Transpose, Unary,
)
from eqsat.rules import Example, dim, tensor

epilogue_stats = ruleset(name="epilogue_stats")

# The context relations advance one term level per iteration and the family adds one e-node per
# statistic: the default schedule runs it to its fixpoint in one stage iteration (eqsat.schedule).
FIXPOINT_STAGE = True

Want = relation("EpiWant", Expr)
SideWant = relation("EpiSideWant", Expr)
Of = relation("EpiOf", Expr, Tensor)
Safe = relation("EpiSafe", Expr)


# The reductions a producer's tiles can compute as per-tile partials (see `eqsat.cost.hosting`).
HOSTED = ("sum", "moments")


@epilogue_stats.register
def _want(r: Tensor, body: Expr, axes: String, ty: String, op: String, ta: String, v: f64, tl: String):
    """Reduce(sum or moments, body, axes, Acc(ty), ty), or a sum with a scalar epilogue op(Acc, c) => Want(body)."""
    for reduction in HOSTED:
        yield rule(r == Reduce(String(reduction), body, axes, Acc(ty), ty)).then(Want(body))
    yield rule(r == Reduce(String("sum"), body, axes, Binary(op, Acc(ta), Lit(v, tl), ty), ty)).then(Want(body))


@epilogue_stats.register
def _descend(e: Expr, x: Expr, y: Expr, z: Expr, op: String, s: String, ty: String, a: i64, b: i64, c: i64,
             d: i64):
    """Want(f(x, ..)) => Want(x) for f elementwise or an index map the producer can follow."""
    for form, operands in (
        (Unary(op, x, ty), (x,)), (Binary(op, x, y, ty), (x, y)), (Select(x, y, z, ty), (x, y, z)),
        (Reshape(x, ty), (x,)), (Transpose(x, s, ty), (x,)), (Slice(x, a, b, c, d, ty), (x,)),
        (Concat(x, y, a, b, ty), (x, y)),
    ):
        yield rule(Want(e), e == form).then(*(Want(o) for o in operands))


@epilogue_stats.register
def _producer(e: Expr, t: Tensor, ty: String, lhs: Expr, rhs: Expr, v: Expr, p: String, epi: Expr, tt: String,
              scale: f64, bias: Expr):
    """Want(Load(x)) with x written by a Matmul, Conv or Attention kernel => Of(Load(x), x).

    Not a Pointwise producer: elementwise work is absorbed into its readers, and hosting a
    reduction there would force it to be materialized (a kernel that need not exist)."""
    for host in (Matmul(lhs, rhs, p, epi, tt), Conv(lhs, rhs, p, epi, tt),
                 Attention(lhs, rhs, v, bias, scale, epi, tt)):
        yield rule(Want(e), e == Load(t, ty), t == host).then(Of(e, t))


@epilogue_stats.register
def _of(e: Expr, x: Expr, y: Expr, z: Expr, t: Tensor, u: Tensor, op: String, s: String, ty: String, a: i64,
        b: i64, c: i64, d: i64):
    """Of(x, t) => Of(f(x, ..), t) through index maps, elementwise ops whose other operands are the same
    read (x*x) or side values, and concats (of the same producer, or of several: a skip connection)."""
    yield rule(Want(e), e == Unary(op, x, ty), Of(x, t)).then(Of(e, t))
    yield rule(Want(e), e == Reshape(x, ty), Of(x, t)).then(Of(e, t))
    yield rule(Want(e), e == Transpose(x, s, ty), Of(x, t)).then(Of(e, t))
    yield rule(Want(e), e == Slice(x, a, b, c, d, ty), Of(x, t)).then(Of(e, t))
    yield rule(Want(e), e == Binary(op, x, x, ty), Of(x, t)).then(Of(e, t))
    yield rule(Want(e), e == Binary(op, x, y, ty), Of(x, t), Safe(y)).then(Of(e, t))
    yield rule(Want(e), e == Binary(op, x, y, ty), Safe(x), Of(y, t)).then(Of(e, t))
    yield rule(Want(e), e == Select(x, y, y, ty), Safe(x), Of(y, t)).then(Of(e, t))
    yield rule(Want(e), e == Concat(x, y, a, b, ty), Of(x, t), Of(y, u)).then(Of(e, t))


@epilogue_stats.register
def _side(e: Expr, x: Expr, y: Expr, t: Tensor, op: String, s: String, ty: String, tt: String, lhs: Expr,
          rhs: Expr, p: String, epi: Expr, name: String, a: i64, b: i64, c: i64, d: i64, v: f64):
    """Side values: Want(Broadcast(x)) => SideWant(x); Safe from literals, inputs, constants and
    matmul/conv/gather outputs, through elementwise ops and views; Broadcast(Safe) is Safe."""
    yield rule(Want(e), e == Broadcast(x, s, ty)).then(SideWant(x))
    for form, operands in ((Unary(op, x, ty), (x,)), (Binary(op, x, y, ty), (x, y)), (Reshape(x, ty), (x,)),
                           (Transpose(x, s, ty), (x,)), (Slice(x, a, b, c, d, ty), (x,)),
                           (Broadcast(x, s, ty), (x,))):
        yield rule(SideWant(e), e == form).then(*(SideWant(o) for o in operands))
        yield rule(SideWant(e), e == form, *(Safe(o) for o in operands)).then(Safe(e))
    yield rule(SideWant(e), e == Lit(v, ty)).then(Safe(e))
    yield rule(SideWant(e), e == Iota(a, ty)).then(Safe(e))
    for leaf in (Input(name, tt), Constant(name, tt), Matmul(lhs, rhs, p, epi, tt), Conv(lhs, rhs, p, epi, tt),
                 Gather(lhs, rhs, p, tt)):
        yield rule(SideWant(e), e == Load(t, ty), t == leaf).then(Safe(e))
    yield rule(Want(e), e == Broadcast(x, s, ty), Safe(x)).then(Safe(e))
    yield rule(Want(e), e == Lit(v, ty)).then(Safe(e))


@epilogue_stats.register
def _host(r: Tensor, body: Expr, axes: String, ty: String, t: Tensor):
    """Reduce(op, body, axes, Acc(ty), ty) with Of(body, x) = EpilogueReduce(x, op, body, axes, ty), op sum or moments."""
    for reduction in HOSTED:
        yield rule(r == Reduce(String(reduction), body, axes, Acc(ty), ty), Of(body, t)).then(
            union(r).with_(EpilogueReduce(t, String(reduction), body, axes, ty)))


@epilogue_stats.register
def _split_epilogue(r: Tensor, body: Expr, axes: String, op: String, ta: String, v: f64, tl: String, ty: String):
    """Reduce(sum, body, axes, op(Acc, c), ty) = Pointwise(op(Load(Reduce(sum, body, axes, Acc)), c)): a
    scalar epilogue (a mean's 1/n) moves to the readers, so the bare sum can be hosted."""
    yield rule(Want(body), r == Reduce(String("sum"), body, axes, Binary(op, Acc(ta), Lit(v, tl), ty), ty)).then(
        union(r).with_(Pointwise(
            Binary(op, Load(Reduce(String("sum"), body, axes, Acc(ta), ta), ta), Lit(v, tl), ty), ty)))


# --- soundness examples ------------------------------------------------------------------------------


def _conv_gn_args(draw):
    b, h, c = dim(draw, 1, 2), dim(draw, 2, 4), dim(draw, 1, 3)
    cin, cout = dim(draw, 1, 3), c * _GROUPS
    return (tensor(draw, (b, h, h, cin)), tensor(draw, (3, 3, cin, cout)), tensor(draw, (cout,)),
            tensor(draw, (3, 3, cout, cout)))


_GROUPS = 2


def _conv_groupnorm_conv(x, w1, bias, w2):
    """conv -> GroupNorm (NHWC, 2 groups) -> SiLU -> conv: a ResNet block's first half."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    dn = ("NHWC", "HWIO", "NHWC")
    h = lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dn) + bias
    b, hh, ww, c = h.shape
    g = h.reshape(b, hh, ww, _GROUPS, c // _GROUPS)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.var(g, axis=(1, 2, 4), keepdims=True)
    normed = ((g - mean) * lax.rsqrt(var + 1e-5)).reshape(h.shape)
    return lax.conv_general_dilated(jax.nn.silu(normed), w2, (1, 1), "SAME", dimension_numbers=dn)


def _skip_args(draw):
    b, h, c1, c2, cin = dim(draw, 1, 2), dim(draw, 2, 3), dim(draw, 1, 3), dim(draw, 1, 3), dim(draw, 1, 2)
    return (tensor(draw, (b, h, h, cin)), tensor(draw, (1, 1, cin, c1)), tensor(draw, (1, 1, cin, c2)),
            tensor(draw, (1, 1, c1 + c2, 2)))


def _groupnorm_over_skip_concat(x, wa, wb, w):
    """GroupNorm of concat(conv_a(x), conv_b(x)) along channels (an up block's skip connection), one
    group spanning both parts, then a 1x1 conv: both producing convs add their elements."""
    import jax.numpy as jnp
    from jax import lax

    dn = ("NHWC", "HWIO", "NHWC")
    h = jnp.concatenate([lax.conv_general_dilated(x, wa, (1, 1), "SAME", dimension_numbers=dn),
                         lax.conv_general_dilated(x, wb, (1, 1), "SAME", dimension_numbers=dn)], axis=-1)
    mean = jnp.mean(h, axis=(1, 2, 3), keepdims=True)
    var = jnp.mean(h * h, axis=(1, 2, 3), keepdims=True) - mean * mean
    normed = (h - mean) * lax.rsqrt(var + 1e-5)
    return lax.conv_general_dilated(normed, w, (1, 1), "SAME", dimension_numbers=dn)


def _time_bias_args(draw):
    b, s, c, t = dim(draw, 1, 2), dim(draw, 2, 4), dim(draw, 2, 4), dim(draw, 1, 3)
    return tensor(draw, (b, s, c)), tensor(draw, (c, c)), tensor(draw, (b, t)), tensor(draw, (t, c))


def _sum_sq_with_time_bias(x, w, temb, wt):
    """Sum of squares of (x @ w + a per-batch projection broadcast over rows): the side value is safe."""
    import jax.numpy as jnp

    h = x @ w + (temb @ wt)[:, None, :]
    return jnp.sum(h * h, axis=1), h


def _centered_args(draw):
    b, s, c = dim(draw, 1, 2), dim(draw, 2, 4), dim(draw, 2, 4)
    return tensor(draw, (b, s, c)), tensor(draw, (c, c))


def _centered_variance(x, w):
    """sum((h - mean(h))^2) reads a statistic of h itself: never hosted by h's kernel."""
    import jax.numpy as jnp

    h = x @ w
    d = h - jnp.mean(h, axis=1, keepdims=True)
    return jnp.sum(d * d, axis=1)


def _mean_args(draw):
    b, k, n = dim(draw, 1, 4), dim(draw, 1, 4), dim(draw, 2, 5)
    return tensor(draw, (b, k)), tensor(draw, (k, n))


def _mean_of_a_matmul(x, w):
    """A mean (sum with a 1/n epilogue) of a matmul output: the 1/n moves out, the sum is hosted."""
    import jax.numpy as jnp

    return jnp.mean(x @ w, axis=1)


def _input_args(draw):
    return tensor(draw, (dim(draw, 1, 3), dim(draw, 2, 5))), tensor(draw, (dim(draw, 1, 3), dim(draw, 2, 5)))


def _sums_of_arguments(x, y):
    """Reductions of function arguments: no kernel writes x or y, nothing can host their sums."""
    import jax.numpy as jnp

    return jnp.sum(x, axis=1), jnp.sum(y, axis=0)


def _max_args(draw):
    b, c = dim(draw, 1, 3), dim(draw, 2, 4)
    return tensor(draw, (b, c)), tensor(draw, (c, c))


def _max_of_a_matmul(x, w):
    """A max reduction of a matmul output: only sums and moments are hosted (per-tile partials)."""
    import jax.numpy as jnp

    return jnp.max(x @ w, axis=1)


EXAMPLES = [
    Example(_conv_groupnorm_conv, _conv_gn_args, ("want", "descend", "producer", "of", "host"),
            support=("absorb", "norm_split")),
    Example(_groupnorm_over_skip_concat, _skip_args, ("want", "descend", "producer", "of", "host"),
            support=("absorb",)),
    Example(_sum_sq_with_time_bias, _time_bias_args, ("want", "producer", "of", "side", "host"),
            support=("absorb",)),
    Example(_mean_of_a_matmul, _mean_args, ("want", "producer", "split_epilogue", "host"), support=("absorb",)),
    Example(_sums_of_arguments, _input_args, ("host",), fires=False, name="sums of function arguments"),
    Example(_max_of_a_matmul, _max_args, ("host",), fires=False, name="max of a matmul", support=("absorb",)),
]
