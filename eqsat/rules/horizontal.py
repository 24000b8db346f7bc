"""Horizontal fusion: kernels that share an input become one wider kernel.

Two laws, both "beyond the seeds" (DESIGN.md, family 5):

- Matmuls that read the same `a` with identity epilogues are column blocks of one matmul over the
  concatenated weights: QKV of self-attention, the time projections of every ResNet (they all read
  silu(temb)), the K/V projections of every cross-attention (they all read the text context).
  With N such matmuls the rules build ONE chain of N-1 Concats of the weights (in builder-handle
  order; the group's sorted handle list is a merged function value, so order needs no pairwise
  matching) and ONE wide matmul over the whole chain; every member is a direct Slice of it. The
  e-graph grows by O(N) e-nodes, not by one matmul per subset, and the extractor sees one choice.
- `dot(a, W) + dot(b, V)` is one matmul over the concatenated contraction range, and the same for
  convolutions: a 1x1 shortcut conv added to a 3x3 conv is one 3x3 conv over the channel-concat
  of both inputs whose weight holds the 1x1 weight at the centre tap (ResNet conv2 + conv_shortcut).

Shapes are arithmetic on type strings; the rules call Python (`PyObject`) for it: `py_string`
returns a computed string, `py_int` an integer, and a helper that returns "" means "no match".
"""

from __future__ import annotations

from functools import lru_cache

from egglog import BigInt, BigRat, PyObject, String, StringLike, function, i64, ne, relation, rule, ruleset, set_, union

from eqsat.lang import Acc, Binary, Broadcast, Concat, Conv, Expr, Lit, Load, Matmul, Pad, Pointwise, Ref, Slice, Tensor
from eqsat.types import format_type, ints, parse_type

horizontal = ruleset(name="horizontal")


# --- calling Python from a rule ------------------------------------------------------------------


def py_string(fn, *args) -> String:
    """`fn(*args)` on the strings `args` (egglog `String`s; i64s via `.to_string()`), as a `String`."""
    return PyObject(fn)(*(PyObject.from_string(a) for a in args)).to_string()


def py_int(fn, *args) -> i64:
    """`int(fn(*args))` as an `i64` (String -> BigInt -> BigRat -> f64 -> i64: exact below 2**53)."""
    return BigRat(BigInt.from_string(py_string(fn, *args)), BigInt(1)).to_f64().to_i64()


def _dims(dims: str) -> tuple[tuple[int, ...], ...]:
    return tuple(ints(part) for part in dims.split(";"))


def _shape(ty: str) -> tuple[int, ...]:
    return parse_type(ty).shape


def _dtype(ty: str) -> str:
    return parse_type(ty).dtype


def _resize(ty: str, axis: int, size: int) -> str:
    shape = list(_shape(ty))
    shape[axis] = size
    return format_type(_dtype(ty), shape)


# --- shared-input matmuls -> one wide matmul ---------------------------------------------------


@lru_cache(maxsize=None)
def _wide_group(dims: str, rhs_ty: str, out_ty: str) -> str:
    """The group key of a matmul that can be widened along its one rhs free axis; "" if none.

    Eligible: no batch dimensions, a rank-2 rhs (a weight) contracted on one axis, so the rhs free
    axis is the other one and the output's last axis is that free axis.
    """
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _dims(dims)
    if lhs_batch or rhs_batch or len(rhs_contract) != 1 or len(_shape(rhs_ty)) != 2:
        return ""
    return f"{dims}|{_dtype(rhs_ty)}|{_dtype(out_ty)}"


@lru_cache(maxsize=None)
def _rhs_free_axis(dims: str) -> str:
    return str(1 - _dims(dims)[1][0])


@lru_cache(maxsize=None)
def _extent(ty: str, axis: str) -> str:
    return str(_shape(ty)[int(axis)])


@lru_cache(maxsize=None)
def _last_axis(ty: str) -> str:
    return str(len(_shape(ty)) - 1)


@lru_cache(maxsize=None)
def _concat_type(first: str, second: str, axis: str) -> str:
    """The type of `concatenate([first, second], axis)`; "" if the other axes or dtypes differ."""
    a, b, axis = _shape(first), _shape(second), int(axis)
    if _dtype(first) != _dtype(second) or len(a) != len(b):
        return ""
    if any(x != y for k, (x, y) in enumerate(zip(a, b)) if k != axis):
        return ""
    return _resize(first, axis, a[axis] + b[axis])


@lru_cache(maxsize=None)
def _merge_members(old: str, new: str) -> str:
    """The union of two member lists "handle:width,...", sorted by handle."""
    entries = dict(tuple(map(int, e.split(":"))) for e in (old + "," + new).split(",") if e)
    return ",".join(f"{h}:{entries[h]}" for h in sorted(entries))


def _entries(members: str) -> list[tuple[str, int]]:
    return [(h, int(w)) for h, w in (e.split(":") for e in members.split(","))]


@lru_cache(maxsize=None)
def _member_entry(handle: str, ty: str) -> str:
    return f"{handle}:{_shape(ty)[-1]}"


@lru_cache(maxsize=None)
def _count(members: str) -> str:
    return str(len(members.split(",")))


@lru_cache(maxsize=None)
def _position(members: str, handle: str) -> str:
    """The member's index in handle order ("" if absent)."""
    handles = [h for h, _ in _entries(members)]
    return str(handles.index(handle)) if handle in handles else ""


@lru_cache(maxsize=None)
def _offset(members: str, handle: str) -> str:
    """The first output column of the member in the wide matmul: the widths of those before it."""
    total = 0
    for h, width in _entries(members):
        if h == handle:
            return str(total)
        total += width
    return ""


@lru_cache(maxsize=None)
def _first(members: str) -> str:
    return members.split(":", 1)[0]


def _as_int(text) -> i64:
    return BigRat(BigInt.from_string(text), BigInt(1)).to_f64().to_i64()


# (a, group, handle, rhs, rhs type, output type, dims): matmul `Ref(handle)` reads `a` and can widen.
WideMember = relation("WideMember", Expr, String, i64, Expr, String, String, String)
# (a, members, level, position, rhs, rhs type, dims): the weights of the members (a list value of
# `wide_members`) at positions [position, position + 2**level), concatenated (fewer at the end of
# the list): a balanced tree. Keyed by the list itself, so a list that grows later starts afresh.
WideNode = relation("WideNode", Expr, String, i64, i64, Expr, String, String)
# (a, members, wide matmul, its type): the matmul over the weights of every member of the list.
WideMatmul = relation("WideMatmul", Expr, String, Tensor, String)


@function(egg_fn="WideMembers", merge=lambda old, new: py_string(_merge_members, old, new))
def wide_members(a: Expr, group: StringLike) -> String:
    """The group of matmuls reading `a`: "handle:width,..." sorted by handle (width: output columns)."""


@horizontal.register
def _wide_member(a: Expr, w: Tensor, dims: String, tw: String, t: String, i: i64):
    """A lifted matmul `Ref(i)` of `a` and a weight, identity epilogue: a member of `a`'s group."""
    group = py_string(_wide_group, dims, tw, t)
    yield rule(
        Ref(i) == Matmul(a, Load(w, tw), dims, Acc(t), t),
        ne(group).to(String("")),
    ).then(
        WideMember(a, group, i, Load(w, tw), tw, t, dims),
        set_(wide_members(a, group)).to(py_string(_member_entry, i.to_string(), t)),
    )


@horizontal.register
def _wide_concat(a: Expr, group: String, members: String, i: i64, level: i64, p: i64, q: i64,
                 rhs: Expr, rhs2: Expr, trhs: String, trhs2: String, t: String, dims: String):
    """The weights of a group of two or more, concatenated along N as a balanced tree (log N iterations)."""
    count = py_int(_count, members)
    position = py_string(_position, members, i.to_string())
    yield rule(
        wide_members(a, group) == members,
        count >= i64(2),
        WideMember(a, group, i, rhs, trhs, t, dims),
        ne(position).to(String("")),
    ).then(WideNode(a, members, i64(0), _as_int(position), rhs, trhs, dims))
    span = i64(1) << level
    axis_w = py_int(_rhs_free_axis, dims)
    width = py_int(_extent, trhs, axis_w.to_string())
    wide_ty = py_string(_concat_type, trhs, trhs2, axis_w.to_string())
    # node(level + 1, p) = concat(node(level, p), node(level, p + 2**level)) for p a multiple of 2**(level+1)
    yield rule(
        WideNode(a, members, level, p, rhs, trhs, dims),
        p % (span * 2) == i64(0),
        span < count,
        q == p + span,
        WideNode(a, members, level, q, rhs2, trhs2, dims),
    ).then(WideNode(a, members, level + 1, p, Concat(rhs, rhs2, axis_w, width, wide_ty), wide_ty, dims))
    # ... and node(level + 1, p) = node(level, p) when the list ends before p + 2**level
    yield rule(
        WideNode(a, members, level, p, rhs, trhs, dims),
        p % (span * 2) == i64(0),
        span < count,
        p + span >= count,
    ).then(WideNode(a, members, level + 1, p, rhs, trhs, dims))


@lru_cache(maxsize=None)
def _wide_type(member_ty: str, wide_rhs_ty: str, dims: str) -> str:
    """The output type of a member's matmul with the wide weight (its last axis widened)."""
    axis_w = int(_rhs_free_axis(dims))
    return _resize(member_ty, len(_shape(member_ty)) - 1, _shape(wide_rhs_ty)[axis_w])


@horizontal.register
def _wide_matmul(a: Expr, group: String, members: String, level: i64, j: i64, rhs: Expr, member_rhs: Expr,
                 trhs: String, tw: String, t: String, dims: String, wide: Tensor, wide_ty: String):
    """Load(M_j) = Load(dot(a, concat(W_1..W_N)))[.., offset_j : offset_j + n_j] for every member j."""
    count = py_int(_count, members)
    out_ty = py_string(_wide_type, t, trhs, dims)
    yield rule(
        WideNode(a, members, level, i64(0), rhs, trhs, dims),
        (i64(1) << level) >= count,
        WideMember(a, group, _as_int(py_string(_first, members)), member_rhs, tw, t, dims),
    ).then(WideMatmul(a, members, Matmul(a, rhs, dims, Acc(out_ty), out_ty), out_ty))
    axis_out = py_int(_last_axis, t)
    offset = py_string(_offset, members, j.to_string())
    n_j = py_int(_extent, t, axis_out.to_string())
    start = _as_int(offset)
    yield rule(
        WideMatmul(a, members, wide, wide_ty),
        WideMember(a, group, j, member_rhs, tw, t, dims),
        ne(offset).to(String("")),
    ).then(union(Load(Ref(j), t)).with_(Slice(Load(wide, wide_ty), axis_out, start, start + n_j, 1, t)))


# --- dot(a, W) + dot(b, V) -> one matmul (or conv) over the concatenated contraction range ------


@lru_cache(maxsize=None)
def _part(text: str, index: str) -> str:
    return text.split("|")[int(index)]


@lru_cache(maxsize=None)
def _matmul_merge(dims: str, ta: str, tb: str, tw: str, tv: str) -> str:
    """"lc|Ka|concat(a,b) type|rc|Kw|concat(W,V) type" when two matmuls differ only in their one
    contracted extent; "" otherwise."""
    lhs_contract, rhs_contract, _, _ = _dims(dims)
    if len(lhs_contract) != 1 or len(rhs_contract) != 1:
        return ""
    (lc,), (rc,) = lhs_contract, rhs_contract
    tab, twv = _concat_type(ta, tb, str(lc)), _concat_type(tw, tv, str(rc))
    if not (tab and twv):
        return ""
    return "|".join(map(str, (lc, _shape(ta)[lc], tab, rc, _shape(tw)[rc], twv)))


def _pad_config(rank: int, lows: dict[int, int], highs: dict[int, int]) -> str:
    return ";".join(f"{lows.get(d, 0)},{highs.get(d, 0)},0" for d in range(rank))


@lru_cache(maxsize=None)
def _conv_merge(p1: str, p2: str, tx1: str, tx2: str, tw1: str, tw2: str) -> str:
    """How conv(x1, w1, p1) + conv(x2, w2, p2) is one conv over concatenated input features.

    Both convs must agree on layouts, strides, no dilation, no groups, and on every input axis but
    the feature axis. The smaller kernel is zero-padded to the larger one at offset
    `o = pad_big_lo - pad_small_lo` per spatial axis (0 <= o <= k_big - k_small): then
    out[i] reads x[i*s + a + o - pad_big] * w[a] = x[i*s + a - pad_small] * w[a] in both.
    Returns "feature axis|C1|concat(x1,x2) type|in-feature axis|I1|concat(w1',w2') type|
    pad config w1|w1' type|pad config w2|w2' type|params of the merged conv|zero's type", or "".
    """
    from eqsat.conv_params import ConvParams

    try:
        c1, c2 = ConvParams.parse(p1), ConvParams.parse(p2)
    except ValueError:
        return ""
    same = ("strides", "lhs_spec", "rhs_spec", "out_spec")
    if any(getattr(c1, name) != getattr(c2, name) for name in same):
        return ""
    for c in (c1, c2):
        if set(c.lhs_dilation) | set(c.rhs_dilation) != {1} or c.feature_groups != 1 or c.batch_groups != 1:
            return ""
    feature, in_feature, spatial = c1.lhs_spec[1], c1.rhs_spec[1], c1.rhs_spec[2:]
    tx = _concat_type(tx1, tx2, str(feature))
    w1, w2 = _shape(tw1), _shape(tw2)
    if not tx or _dtype(tw1) != _dtype(tw2) or len(w1) != len(w2) or w1[c1.rhs_spec[0]] != w2[c1.rhs_spec[0]]:
        return ""
    k1, k2 = [w1[d] for d in spatial], [w2[d] for d in spatial]
    if all(a <= b for a, b in zip(k1, k2)):
        big = c2
        lows1 = {d: c2.padding[k][0] - c1.padding[k][0] for k, d in enumerate(spatial)}
        lows2 = {d: 0 for d in spatial}
    elif all(b <= a for a, b in zip(k1, k2)):
        big = c1
        lows1 = {d: 0 for d in spatial}
        lows2 = {d: c1.padding[k][0] - c2.padding[k][0] for k, d in enumerate(spatial)}
    else:
        return ""
    kernel = [max(a, b) for a, b in zip(k1, k2)]
    highs1 = {d: kernel[k] - w1[d] - lows1[d] for k, d in enumerate(spatial)}
    highs2 = {d: kernel[k] - w2[d] - lows2[d] for k, d in enumerate(spatial)}
    if any(v < 0 for v in (*lows1.values(), *lows2.values(), *highs1.values(), *highs2.values())):
        return ""
    padded1, padded2 = list(w1), list(w2)
    for k, d in enumerate(spatial):
        padded1[d] = padded2[d] = kernel[k]
    tw1p, tw2p = format_type(_dtype(tw1), padded1), format_type(_dtype(tw2), padded2)
    tw = _concat_type(tw1p, tw2p, str(in_feature))
    if not tw:
        return ""
    return "|".join(map(str, (
        feature, _shape(tx1)[feature], tx, in_feature, w1[in_feature], tw,
        _pad_config(len(w1), lows1, highs1), tw1p, _pad_config(len(w2), lows2, highs2), tw2p,
        big.key, format_type(_dtype(tw1), ()),
    )))


# (value, kind, lhs, lhs type, rhs, rhs type, params, type): value = the kernel's core result,
# `kind` "Matmul" or "Conv", `params` its dims / conv params key.
KernelValue = relation("HorizontalKernelValue", Expr, String, Expr, String, Expr, String, String, String)
# (value, kind, lhs, lhs type, rhs, rhs type, params, type, c): value = core result + c (a bias, a
# time embedding, ...), as an epilogue (absorbed form) or as an add kernel after it (lifted form).
KernelPlus = relation("HorizontalKernelPlus", Expr, String, Expr, String, Expr, String, String, String, Expr)

_KERNELS = (("Matmul", Matmul), ("Conv", Conv))


@horizontal.register
def _kernel_values(
    v: Expr, v0: Expr, m: Tensor, x: Tensor, w: Tensor, b: Tensor, c: Expr, lhs: Expr, rhs: Expr,
    kind: String, p: String, tx: String, tw: String, tb: String, t: String, dims: String,
):
    """KernelValue(v, ..): v = dot/conv(lhs, rhs); KernelPlus(v, .., c): v = dot/conv(lhs, rhs) + c."""
    for name, kernel in _KERNELS:
        core = (String(name), Load(x, tx), tx, Load(w, tw), tw, p, t)
        yield rule(v == Load(m, t), m == kernel(Load(x, tx), Load(w, tw), p, Acc(t), t)).then(KernelValue(v, *core))
        # absorbed: Acc + c in the epilogue, c a (broadcast) load so it cannot read the accumulator
        for bias in (Load(b, t), Broadcast(Load(b, tb), dims, t)):
            for epilogue in (Binary("add", Acc(t), bias, t), Binary("add", bias, Acc(t), t)):
                yield rule(v == Load(m, t), m == kernel(Load(x, tx), Load(w, tw), p, epilogue, t)).then(
                    KernelPlus(v, *core, bias))
    # lifted: an add after the kernel (outside any kernel, so c reads no accumulator), and copies
    plus = (kind, lhs, tx, rhs, tw, p, t)
    yield rule(v == Binary("add", v0, c, t), KernelValue(v0, *plus)).then(KernelPlus(v, *plus, c))
    yield rule(v == Binary("add", c, v0, t), KernelValue(v0, *plus)).then(KernelPlus(v, *plus, c))
    yield rule(v == Load(Pointwise(v0, t), t), KernelPlus(v0, *plus, c)).then(KernelPlus(v, *plus, c))


def _summed(kind, t, v1: Expr, v2: Expr, operands1, operands2, c1: Expr, c2: Expr):
    """(facts on the two added values, the epilogue of the merged kernel): each value plain or + bias."""
    plain1, plain2 = KernelValue(v1, kind, *operands1, t), KernelValue(v2, kind, *operands2, t)
    biased1, biased2 = KernelPlus(v1, kind, *operands1, t, c1), KernelPlus(v2, kind, *operands2, t, c2)
    yield [plain1, plain2], Acc(t)
    yield [biased1, plain2], Binary("add", Acc(t), c1, t)
    yield [plain1, biased2], Binary("add", Acc(t), c2, t)
    yield [biased1, biased2], Binary("add", Acc(t), Binary("add", c1, c2, t), t)


@horizontal.register
def _concat_contraction(
    e: Expr, v1: Expr, v2: Expr, a: Expr, b: Expr, w: Expr, v: Expr, c1: Expr, c2: Expr,
    dims: String, ta: String, tb: String, tw: String, tv: String, t: String,
):
    """dot(a, W) + dot(b, V) = dot(concat(a, b, K), concat(W, V, K)) (biases add up in the epilogue)."""
    merge = py_string(_matmul_merge, dims, ta, tb, tw, tv)
    field = [py_string(_part, merge, String(str(k))) for k in range(6)]
    lc, ka, rc, kw = (_as_int(field[k]) for k in (0, 1, 3, 4))
    lhs = Concat(a, b, lc, ka, field[2])
    rhs = Concat(w, v, rc, kw, field[5])
    for facts, merged in _summed(String("Matmul"), t, v1, v2, (a, ta, w, tw, dims), (b, tb, v, tv, dims), c1, c2):
        yield rule(
            e == Binary("add", v1, v2, t),
            *facts,
            ne(v1).to(v2),
            ne(merge).to(String("")),
        ).then(union(e).with_(Load(Matmul(lhs, rhs, dims, merged, t), t)))


@horizontal.register
def _concat_conv_features(
    e: Expr, v1: Expr, v2: Expr, x1: Expr, x2: Expr, w1: Expr, w2: Expr, c1: Expr, c2: Expr,
    p1: String, p2: String, tx1: String, tx2: String, tw1: String, tw2: String, t: String,
):
    """conv(x1, w1) + conv(x2, w2) = conv(concat(x1, x2, C), concat(pad(w1), pad(w2), I)): a 1x1 shortcut
    joins a 3x3 conv as extra input channels with its weight at the centre tap."""
    # NOTE: exact for finite inputs only: a padded tap multiplies an input the 1x1 conv never reads
    # by 0, and 0 * inf is NaN (its examples are held to the finite value regimes).
    merge = py_string(_conv_merge, p1, p2, tx1, tx2, tw1, tw2)
    field = [py_string(_part, merge, String(str(k))) for k in range(12)]
    feature, c_1, in_feature, i_1 = (_as_int(field[k]) for k in (0, 1, 3, 4))
    zero = Lit(0.0, field[11])
    lhs = Concat(x1, x2, feature, c_1, field[2])
    rhs = Concat(Pad(w1, zero, field[6], field[7]), Pad(w2, zero, field[8], field[9]), in_feature, i_1, field[5])
    for facts, merged in _summed(String("Conv"), t, v1, v2, (x1, tx1, w1, tw1, p1), (x2, tx2, w2, tw2, p2), c1, c2):
        yield rule(
            e == Binary("add", v1, v2, t),
            *facts,
            ne(v1).to(v2),
            ne(merge).to(String("")),
        ).then(union(e).with_(Load(Conv(lhs, rhs, field[10], merged, t), t)))


# --- soundness examples (eqsat.rules.check) ------------------------------------------------------


def _linear(x, w):
    from jax import lax

    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _projections(x, wq, wk, wv):
    """QKV: three linears of one input."""
    return _linear(x, wq), _linear(x, wk), _linear(x, wv)


def _projections_args(draw):
    from eqsat.rules import dim, tensor

    width = dim(draw)
    return (tensor(draw, (dim(draw), dim(draw), width)),
            *(tensor(draw, (dim(draw), width)) for _ in range(3)))


def _unshared_projections(x, y, w1, w2):
    return _linear(x, w1), _linear(y, w2)


def _unshared_args(draw):
    from eqsat.rules import dim, tensor

    rows, width = dim(draw), dim(draw)
    return (tensor(draw, (rows, width)), tensor(draw, (rows, width)), tensor(draw, (dim(draw), width)),
            tensor(draw, (dim(draw), width)))


def _dot_plus_dot(a, b, w, v):
    return a @ w + b @ v


def _dot_plus_dot_args(draw):
    from eqsat.rules import dim, tensor

    m, k1, k2, n = dim(draw), dim(draw), dim(draw), dim(draw)
    return tensor(draw, (m, k1)), tensor(draw, (m, k2)), tensor(draw, (k1, n)), tensor(draw, (k2, n))


def _conv(x, w, stride=1):
    from jax import lax

    pad = w.shape[2] // 2
    return lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                    dimension_numbers=("NHWC", "OIHW", "NHWC"))


def _conv_plus_shortcut(h, x, w3, w1):
    """ResNet conv2 (3x3) plus the 1x1 conv_shortcut of the block input."""
    return _conv(h, w3) + _conv(x, w1)


def _conv_plus_shortcut_args(draw):
    from eqsat.rules import dim, tensor

    batch, size, c1, c2, out = dim(draw, 1, 2), dim(draw, 1, 5), dim(draw), dim(draw), dim(draw)
    return (tensor(draw, (batch, size, size, c1)), tensor(draw, (batch, size, size, c2)),
            tensor(draw, (out, c1, 3, 3)), tensor(draw, (out, c2, 1, 1)))


def _biased_conv_plus_shortcut(h, x, w3, w1, b3, b1):
    """The ResNet tail as sd15 writes it: conv2 + bias, shortcut + bias, then the residual add."""
    return (_conv(h, w3) + b3) + (_conv(x, w1) + b1)


def _biased_conv_args(draw):
    from eqsat.rules import tensor

    h, x, w3, w1 = _conv_plus_shortcut_args(draw)
    return h, x, w3, w1, tensor(draw, (w3.shape[0],)), tensor(draw, (w1.shape[0],))


def _conv_plus_strided_conv(h, x, w3, w1):
    """Different strides: outputs agree in shape but the windows do not align."""
    return _conv(h, w3) + _conv(x, w1, 2)


def _conv_strided_args(draw):
    from eqsat.rules import dim, tensor

    size, c, out = dim(draw, 1, 3), dim(draw), dim(draw)
    return (tensor(draw, (1, size, size, c)), tensor(draw, (1, 2 * size, 2 * size, c)),
            tensor(draw, (out, c, 3, 3)), tensor(draw, (out, c, 1, 1)))


def _examples():
    from eqsat.rules import Example
    from eqsat.rules.checker import VALUE_REGIMES

    finite = tuple(regime for regime in VALUE_REGIMES if regime != "nonfinite")  # concat_conv_features' NOTE
    return [
        Example(_projections, _projections_args, ("wide_member", "wide_concat", "wide_matmul")),
        Example(_unshared_projections, _unshared_args, ("wide_matmul",), fires=False),
        Example(_dot_plus_dot, _dot_plus_dot_args, ("concat_contraction",)),
        Example(_conv_plus_shortcut, _conv_plus_shortcut_args, ("concat_conv_features",), regimes=finite),
        Example(_biased_conv_plus_shortcut, _biased_conv_args, ("kernel_values", "concat_conv_features"),
                regimes=finite),
        Example(_conv_plus_strided_conv, _conv_strided_args, ("concat_conv_features",), fires=False),
    ]


EXAMPLES = _examples()
