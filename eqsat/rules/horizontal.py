"""Horizontal fusion: kernels that share an input become one wider kernel.

Two laws, both "beyond the seeds" (DESIGN.md, family 5):

- Matmuls that read the same `a` with identity epilogues are column blocks of one matmul over the
  concatenated weights: QKV of self-attention, the time projections of every ResNet (they all read
  silu(temb)), the K/V projections of every cross-attention (they all read the text context).
  With N such matmuls the rules build ONE chain of N-1 prefix matmuls (ordered by builder handle),
  each a Concat of the previous prefix's weights and the next member's, so the e-graph grows by
  O(N) e-nodes, not by one matmul per subset. Every member (and every prefix) is a Slice of the
  next prefix, so the widest prefix serves them all.
- `dot(a, W) + dot(b, V)` is one matmul over the concatenated contraction range, and the same for
  convolutions: a 1x1 shortcut conv added to a 3x3 conv is one 3x3 conv over the channel-concat
  of both inputs whose weight holds the 1x1 weight at the centre tap (ResNet conv2 + conv_shortcut).

Shapes are arithmetic on type strings; the rules call Python (`PyObject`) for it: `py_string`
returns a computed string, `py_int` an integer, and a helper that returns "" means "no match".
"""

from __future__ import annotations

from functools import lru_cache

from egglog import BigInt, BigRat, PyObject, String, StringLike, function, i64, i64Like, ne, relation, rule, ruleset
from egglog import set_, union

from eqsat.lang import Acc, Binary, Concat, Conv, Expr, Lit, Load, Matmul, Pad, Ref, Slice, Tensor
from eqsat.types import format_type, ints, ints_key, parse_type

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


# (a, group, handle, rhs, rhs type, output type, dims): matmul `Ref(handle)` reads `a` and can widen.
WideMember = relation("WideMember", Expr, String, i64, Expr, String, String, String)
# (a, group, handle, prefix, prefix rhs, its type, prefix type): `prefix` is the wide matmul over
# the group's members up to and including `handle`, in handle order.
WidePrefix = relation("WidePrefix", Expr, String, i64, Tensor, Expr, String, String)


@function(egg_fn="WideFirst", merge=lambda old, new: old.min(new))
def wide_first(a: Expr, group: StringLike) -> i64:
    """The smallest handle of the group of matmuls reading `a`."""


@function(egg_fn="WideNext", merge=lambda old, new: old.min(new))
def wide_next(a: Expr, group: StringLike, handle: i64Like) -> i64:
    """The next larger handle after `handle` in the group of matmuls reading `a`."""


@horizontal.register
def _shared_input(
    a: Expr, w: Tensor, w2: Tensor, dims: String, tw: String, tw2: String, t: String, t2: String, group: String,
    i: i64, j: i64, prefix: Tensor, rhs: Expr, rhs2: Expr, trhs: String, tp: String,
):
    # a lifted matmul with identity epilogue and a weight rhs joins the group of matmuls reading `a`
    yield rule(
        Ref(i) == Matmul(a, Load(w, tw), dims, Acc(t), t),
        ne(py_string(_wide_group, dims, tw, t)).to(String("")),
    ).then(WideMember(a, py_string(_wide_group, dims, tw, t), i, Load(w, tw), tw, t, dims))
    # the chain of a group starts at its smallest handle ...
    yield rule(WideMember(a, group, i, rhs, tw, t, dims)).then(set_(wide_first(a, group)).to(i))
    # ... and links each member to the next larger handle of a different matmul
    yield rule(
        WideMember(a, group, i, rhs, tw, t, dims),
        WideMember(a, group, j, rhs2, tw2, t2, dims),
        i < j,
        ne(Ref(i)).to(Ref(j)),
    ).then(set_(wide_next(a, group, i)).to(j))
    # the first member is its own prefix
    yield rule(
        wide_first(a, group) == i,
        WideMember(a, group, i, rhs, tw, t, dims),
    ).then(WidePrefix(a, group, i, Ref(i), rhs, tw, t))
    # Load(P) == Slice(Load(P'), 0:n) and Load(M_j) == Slice(Load(P'), n:n+n_j), P' = matmul(a, concat(rhs_P, W_j))
    axis_w = py_int(_rhs_free_axis, dims)
    axis_out = py_int(_last_axis, tp)
    n = py_int(_extent, trhs, axis_w.to_string())
    n_j = py_int(_extent, t2, py_string(_last_axis, t2))
    wide_rhs_ty = py_string(_concat_type, trhs, tw2, axis_w.to_string())
    wide_ty = py_string(_concat_type, tp, t2, axis_out.to_string())
    wide_rhs = Concat(rhs, rhs2, axis_w, n, wide_rhs_ty)
    wide = Matmul(a, wide_rhs, dims, Acc(wide_ty), wide_ty)
    yield rule(
        WidePrefix(a, group, i, prefix, rhs, trhs, tp),
        wide_next(a, group, i) == j,
        WideMember(a, group, j, rhs2, tw2, t2, dims),
    ).then(
        union(Load(prefix, tp)).with_(Slice(Load(wide, wide_ty), axis_out, 0, n, 1, tp)),
        union(Load(Ref(j), t2)).with_(Slice(Load(wide, wide_ty), axis_out, n, n + n_j, 1, t2)),
        WidePrefix(a, group, j, wide, wide_rhs, wide_rhs_ty, wide_ty),
    )


# --- dot(a, W) + dot(b, V) -> one matmul over the concatenated contraction range ---------------


@lru_cache(maxsize=None)
def _contract_axes(dims: str, lhs_a: str, lhs_b: str, rhs_a: str, rhs_b: str) -> str:
    """"lhs_axis,rhs_axis" when the two matmuls differ only in their one contracted extent; else ""."""
    lhs_contract, rhs_contract, _, _ = _dims(dims)
    if len(lhs_contract) != 1 or len(rhs_contract) != 1:
        return ""
    (lc,), (rc,) = lhs_contract, rhs_contract
    if not (_concat_type(lhs_a, lhs_b, str(lc)) and _concat_type(rhs_a, rhs_b, str(rc))):
        return ""
    return f"{lc},{rc}"


@lru_cache(maxsize=None)
def _field(text: str, index: str) -> str:
    return text.split(",")[int(index)]


@horizontal.register
def _concat_contraction(
    e: Expr, m1: Tensor, m2: Tensor, a: Tensor, b: Tensor, w: Tensor, v: Tensor,
    dims: String, ta: String, tb: String, tw: String, tv: String, t: String,
):
    axes = py_string(_contract_axes, dims, ta, tb, tw, tv)
    lc, rc = py_int(_field, axes, String("0")), py_int(_field, axes, String("1"))
    lhs = Concat(Load(a, ta), Load(b, tb), lc, py_int(_extent, ta, lc.to_string()), py_string(_concat_type, ta, tb, lc.to_string()))
    rhs = Concat(Load(w, tw), Load(v, tv), rc, py_int(_extent, tw, rc.to_string()), py_string(_concat_type, tw, tv, rc.to_string()))
    # dot(a, W) + dot(b, V) == dot(concat(a, b, K), concat(W, V, K))
    yield rule(
        e == Binary("add", Load(m1, t), Load(m2, t), t),
        m1 == Matmul(Load(a, ta), Load(w, tw), dims, Acc(t), t),
        m2 == Matmul(Load(b, tb), Load(v, tv), dims, Acc(t), t),
        ne(m1).to(m2),
        ne(axes).to(String("")),
    ).then(union(e).with_(Load(Matmul(lhs, rhs, dims, Acc(t), t), t)))
