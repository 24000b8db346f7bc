"""Flash-attention recognition: softmax(q·kᵀ·scale)·v written out primitive by primitive is one
`Attention` kernel, so the [B, H, Sq, Sk] score matrix is never materialized.

The lifted pattern (sd15/layers.py `attention`, `jax.nn.softmax`, or the explicit form):

    s = dot_general(q4, k4)            Matmul, batch (B, H), contracting D      [B, H, Sq, Sk]
    s = convert(s) * scale             optional convert; mul (or div) by a scalar, any number
    m = max(s, -1) broadcast back      Reduce max over the last axis, then views
    e = exp(s - m)
    p = e / (sum(e, -1) broadcast back)
    o = dot_general(convert(p), v4)    Matmul, batch (B, H), contracting Sk     [B, H, Sq, D]

with q4/k4/v4 read through any layout the dot_generals name (SD: [B, S, H, D] head splits).
Then `o == Attention(Transpose(q4), Transpose(k4), Transpose(v4), Lit(0.0), scale, Acc, ty)`: the head
permutes are views inside the operands, and `o`'s own layout ([B, H, Sq, D]) is Attention's.
Subtracting the row max does not change softmax (any row-constant shift cancels); requiring
the max of the same scores only keeps the match specific.

Other ranks (`_score_layout`, `_value_layout`): the QK dot_general may have one or more batch axes
and any number of free q axes (one contracted axis, one key axis); its scores (batch..., q free...,
Sk) are a row-major reshape of Attention's [B, H, Sq, Sk] (batch axes merged into B and H, q's free
axes into Sq). Not none: a dot_general without batch axes is every plain matmul, and taking each for
scores grew the UNet's e-graph by 968 nodes and its greedy plan by 5 kernels. q and k are
`Reshape(Transpose(..))` views (`Heads` records q's [B, H, Sq, D] type), scores stay scores
through size-1 transposes and key-keeping reshapes (`score_views`), and at the PV the bias
(`BiasType`), v and the output go through reshapes too: jax.nn's rank-5 grouped scores, equinox's
rank-3 vmapped heads, torch's merged-heads bmm (a headless [T, D] attention does not fuse).

Found through helper relations that see through `Load(Pointwise(..))` copies, so the lifted form
and the absorbed form both match (StatView and Scalar are shared with `norm_split`):

    Scores(e, q, k, scale, ty)         e = scale · q·kᵀ, q and k as [B, H, S, D] Exprs
    Biased(e, q, k, bias, scale, ty)   e = scale · q·kᵀ + bias (either operand order)
    Shifted / Exps / Probs             s - rowmax(s), exp of that, exp / rowsum(exp), over scores s
                                       that are Scores (bias `Lit(0.0, f32[B,H,Sq,Sk])`) or Biased

Grouped queries (GQA: G query heads per K/V head; `_grouped_scores`, `_grouped_value_layout`): rows
are independent, so scores whose (batch, head) and query axes are interleaved by a transpose (jax.nn's
[B, K, T, G, S] moved to [G, B, K, T, S]) are the scores of q's rows moved the same way against k
broadcast over the query axes that moved in among (batch, head) (`KeyHeads` records k's type,
`Regrouped` the move, so a row max taken before it still reads each row's max); at the PV, v is
broadcast the same way and Attention's output is split and permuted to the product's layout. The
K/V heads are views: nothing is repeated in memory. (A `jnp.repeat` of the K/V heads is a broadcast
the kernel reads through already.)

Spellings (benchmarks/spellings.py): a scale is any `Constant` (a Scalar, or a `sqrt`/`rsqrt`/float
convert of one computed at run time: `/ jnp.sqrt(d).astype(dtype)`); `where(mask, s, c)` with c -inf
or in the lowest binade of the scores' dtype (its lowest finite value, jax's 0.7 times that) is
`s + where(mask, 0, c')` with a float32 bias (`masked_scores`; c is found by `FillValue`, which also reads the scalar constant tensors a
nested jit's literal becomes); jax.nn.softmax on 16-bit scores (exp in fp16, its row sum widened to
fp32 and narrowed back: `RoundedStat`) is Probs; and the `bhqk,bkhd->bqhd` einsum, which puts v on
the left of the PV matmul, is Attention's output transposed (`flash_attention_value_lhs`).

Masked attention (flash attention with an additive score bias: CLIP's causal mask, ALiBi, ...)
adds `bias` to the scaled scores before the softmax; `bias` is any Expr of the scores' shape
(a `Binary` add's operands have the output's shape: a [1, 1, S, S] mask arrives as its
`Broadcast`), read by the kernel per score tile. A bias added before the scale (or scaled
afterwards) is not matched.
"""

from __future__ import annotations

from functools import lru_cache

import math

import numpy as np
from egglog import String, eq, f64, ne, relation, rule, ruleset, union

from eqsat.lang import (
    Acc, Attention, Binary, Broadcast, Constant as ConstantTensor, Expr, Lit, Load, Matmul, Pointwise, Reduce, Reshape, Select, Tensor, Transpose,
    Unary,
)
from eqsat.rules.horizontal import py_string
from eqsat.rules.norm_split import Scalar, StatView, _map_broadcast, scalar_rules, stat_view_rules
from eqsat.types import format_type, ints, parse_type

attention = ruleset(name="attention")
scalar_rules(attention)
stat_view_rules(attention)

Scores = relation("AttentionScores", Expr, Expr, Expr, f64, String)
Biased = relation("AttentionBiased", Expr, Expr, Expr, Expr, f64, String)
Shifted = relation("AttentionShifted", Expr, Expr, Expr, Expr, f64, String)
Exps = relation("AttentionExps", Expr, Expr, Expr, Expr, f64, String)
Probs = relation("AttentionProbs", Expr, Expr, Expr, Expr, f64, String)
Constant = relation("AttentionConstant", Expr, f64)
RoundedStat = relation("AttentionRoundedStat", Expr, String, Tensor, String)
FillValue = relation("AttentionFillValue", Expr, String)
Heads = relation("AttentionHeads", Expr, String)      # (q4, its [B, H, Sq, D] type)
KeyHeads = relation("AttentionKeyHeads", Expr, String)  # (k4, its [B, H, Sk, D] type)
Regrouped = relation("AttentionRegrouped", Expr, Expr, String)  # (s, x, perm): scores s = Transpose(x, perm)
BiasType = relation("AttentionBiasType", Expr, String)  # (a score bias, its type)

F32_LOWEST = float(np.finfo(np.float32).min)



def _split(dims: str) -> tuple[tuple[int, ...], ...]:
    return tuple(ints(part) for part in dims.split(";"))


def _retyped(ty: str, shape) -> str:
    return format_type(parse_type(ty).dtype, list(shape))


def _permuted(ty: str, perm: tuple[int, ...]) -> str:
    shape = parse_type(ty).shape
    return _retyped(ty, [shape[p] for p in perm])


def _perm_text(perm) -> str:
    return ",".join(map(str, perm))


def _keeps_flat_order(shape, order) -> bool:
    """Whether reading `shape`'s axes in `order` moves only size-1 axes (a transpose that is a reshape)."""
    moved = [a for a in order if shape[a] != 1]
    return moved == sorted(moved)


def _heads(batch: list[int]) -> tuple[int, int]:
    """Attention's (B, H) for score batch extents `batch`: the last is H, the rest merge into B."""
    return (math.prod(batch[:-1]), batch[-1]) if batch else (1, 1)


@lru_cache(maxsize=None)
def _score_layout(dims: str, q_ty: str, k_ty: str, out_ty: str) -> str:
    """"q perm|q permuted type|k perm|k permuted type|q4 type|k4 type|form" putting q and k in
    Attention's [B, H, S, D]: q and k are permuted to (batch..., free..., contracting) and, where that
    is not already [B, H, S, D] ("form" is "reshape"), reshaped there (the batch axes merge into B and
    H, q's free axes into Sq). "" unless one axis is contracted per side and k has one free axis. The
    scores (batch..., q free..., k free) are then a row-major reshape of Attention's [B, H, Sq, Sk]."""
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _split(dims)
    if len(lhs_contract) != 1 or len(rhs_contract) != 1 or not lhs_batch:
        return ""
    q_shape, k_shape = parse_type(q_ty).shape, parse_type(k_ty).shape
    q_free = [a for a in range(len(q_shape)) if a not in lhs_batch + lhs_contract]
    k_free = [a for a in range(len(k_shape)) if a not in rhs_batch + rhs_contract]
    if len(k_free) != 1 or len(parse_type(out_ty).shape) != len(lhs_batch) + len(q_free) + 1:
        return ""
    q_perm, k_perm = (*lhs_batch, *q_free, *lhs_contract), (*rhs_batch, *k_free, *rhs_contract)
    batch, head_dim = [q_shape[a] for a in lhs_batch], q_shape[lhs_contract[0]]
    q4 = (*_heads(batch), math.prod(q_shape[a] for a in q_free), head_dim)
    k4 = (*_heads(batch), k_shape[k_free[0]], head_dim)
    q_permuted, k_permuted = _permuted(q_ty, q_perm), _permuted(k_ty, k_perm)
    form = "view" if len(lhs_batch) == 2 and len(q_free) == 1 else "reshape"
    return "|".join((_perm_text(q_perm), q_permuted, _perm_text(k_perm), k_permuted, _retyped(q_ty, q4),
                     _retyped(k_ty, k4), form))


def _probs_free(p_shape, p_batch, p_contract, q4_shape) -> list[int] | None:
    """The free axes of probabilities p (shape `p_shape`) in a PV dot_general batched on `p_batch` and
    contracted on `p_contract`, when p reads as Attention's [B, H, Sq, Sk] probabilities: contracted
    on its last (key) axis, (batch..., free..., key) a reshape of p, and B·H and Sq those of q4 (when
    given); else None."""
    last = len(p_shape) - 1
    if p_contract != (last,):
        return None
    free = [a for a in range(last) if a not in p_batch]
    if not _keeps_flat_order(p_shape, (*p_batch, *free, last)):
        return None
    if q4_shape and (math.prod(p_shape[a] for a in p_batch) != q4_shape[0] * q4_shape[1]
                     or math.prod(p_shape[a] for a in free) != q4_shape[2]):
        return None
    return free


def _value_view(v_ty: str, v_batch, v_contract, q4_shape, p_shape) -> tuple[str, str, str, int] | None:
    """(v perm, v permuted type, v4 type, D) putting v in [B, H, Sk, D]; None unless one axis of v
    is contracted and one is free."""
    v_shape = parse_type(v_ty).shape
    v_free = [a for a in range(len(v_shape)) if a not in v_batch + v_contract]
    if len(v_contract) != 1 or len(v_free) != 1:
        return None
    perm = (*v_batch, *v_contract, *v_free)
    head_dim = v_shape[v_free[0]]
    v4 = (*q4_shape[:2], p_shape[-1], head_dim)
    return _perm_text(perm), _permuted(v_ty, perm), _retyped(v_ty, v4), head_dim


def _q4_shape(q4_ty: str, p_shape, p_batch) -> tuple[int, ...]:
    """q4's shape, or (B, H, Sq) as the scores layout would put p's batch and free axes."""
    if q4_ty:
        return parse_type(q4_ty).shape
    batch = [p_shape[a] for a in p_batch]
    return (*_heads(batch), math.prod(p_shape[:-1]) // max(1, math.prod(batch)), 0)


@lru_cache(maxsize=None)
def _value_layout(dims: str, p_ty: str, v_ty: str, out_ty: str, q4_ty: str = "", b_ty: str = "") -> str:
    """"v perm|v permuted type|v4 type|bias4 type|attention type|form" for o = dot_general(p, v) with
    p Attention's [B, H, Sq, Sk] probabilities up to a reshape (`_probs_free`): o (batch..., p free...,
    D) is a reshape of Attention's [B, H, Sq, D] ("form" "view": it is that type, and v needs no
    reshape); "" otherwise. q4_ty and b_ty ("": not known, explain()'s check) are the scores'
    [B, H, Sq, D] q and the bias's type (p's shape)."""
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _split(dims)
    p_shape = parse_type(p_ty).shape
    q4_shape = _q4_shape(q4_ty, p_shape, lhs_batch)
    if _probs_free(p_shape, lhs_batch, lhs_contract, q4_shape if q4_ty else ()) is None:
        return ""
    view = _value_view(v_ty, rhs_batch, rhs_contract, q4_shape, p_shape)
    if view is None:
        return ""
    v_perm, v_permuted, v4, head_dim = view
    p4 = (*q4_shape[:3], p_shape[-1])
    form = "view" if tuple(p_shape) == p4 and lhs_batch == (0, 1) else "reshape"
    return "|".join((v_perm, v_permuted, v4, _retyped(b_ty or p_ty, p4), _retyped(out_ty, (*q4_shape[:3], head_dim)),
                     form))


@lru_cache(maxsize=None)
def _value_lhs_layout(dims: str, v_ty: str, p_ty: str, out_ty: str, q4_ty: str = "", b_ty: str = "") -> str:
    """"v perm|v permuted type|v4 type|bias4 type|attention type|unpermuted type|permutation|form" for
    o = dot_general(v, p) (v on the left, the einsum `bhqk,bkhd->bqhd` spelling): o is (batch..., D,
    p free...), a permute of Attention's [B, H, Sq, D] reshaped to (batch..., p free..., D) (the
    unpermuted type; "form" "view": no reshape, the rank-4 [B, H, D, Sq]); "" unless p is Attention's
    probabilities up to a reshape (`_probs_free`) and v has one contracted and one free axis."""
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _split(dims)
    p_shape = parse_type(p_ty).shape
    q4_shape = _q4_shape(q4_ty, p_shape, rhs_batch)
    free = _probs_free(p_shape, rhs_batch, rhs_contract, q4_shape if q4_ty else ())
    if free is None:
        return ""
    view = _value_view(v_ty, lhs_batch, lhs_contract, q4_shape, p_shape)
    if view is None:
        return ""
    v_perm, v_permuted, v4, head_dim = view
    batch = [p_shape[a] for a in rhs_batch]
    unpermuted = (*batch, *(p_shape[a] for a in free), head_dim)
    nb, nf = len(batch), len(free)
    perm = (*range(nb), nb + nf, *range(nb, nb + nf))
    p4 = (*q4_shape[:3], p_shape[-1])
    form = "view" if tuple(p_shape) == p4 and rhs_batch == (0, 1) else "reshape"
    return "|".join((v_perm, v_permuted, v4, _retyped(b_ty or p_ty, p4), _retyped(out_ty, (*q4_shape[:3], head_dim)),
                     _retyped(out_ty, unpermuted), _perm_text(perm), form))


def _head_split(lead, heads: int) -> int | None:
    """The first j with prod(lead[:j]) == heads (B·H), or None: the axes before j index (batch, head)."""
    for j in range(len(lead) + 1):
        if math.prod(lead[:j]) == heads:
            return j
    return None


@lru_cache(maxsize=None)
def _grouped_scores(permutation: str, x_ty: str, q_ty: str, k_ty: str) -> str:
    """"q split|q perm|q permuted|q'|k split|k perm|k permuted|broadcast dims|broadcast type|k'" for
    scores x (a row-major reshape of [B, H, Sq, Sk] for q4 `q_ty`, k4 `k_ty`) transposed by a
    permutation that keeps the key axis last but moves rows across (batch, head) axes: grouped-query
    attention as jax.nn.dot_product_attention writes it ([B, K, T, G, S] scores moved to [G, B, K, T, S]).

    Rows are independent, so the moved scores are Attention's for q' = q's rows moved the same way,
    [B', H', Sq', D] with (B', H') the moved axes up to the last (batch, head) one and Sq' the rest, and
    k' = k broadcast over the query axes moved in among them (G: each group reads its K/V head, as
    GQA does; query axes moved behind a (batch, head) axis join (B', H') too: k cannot vary along Sq').
    "" when the transpose moves the key axis or only size-1 axes (`_keeps_rows`: the same scores), or
    x's rows do not split into (batch, head) axes then query axes."""
    perm = ints(permutation)
    x_shape, q4, k4 = parse_type(x_ty).shape, parse_type(q_ty).shape, parse_type(k_ty).shape
    lead = x_shape[:-1]
    if (len(perm) != len(x_shape) or perm[-1] != len(lead) or _keeps_rows(permutation, x_ty)
            or math.prod(lead) != q4[0] * q4[1] * q4[2]):
        return ""
    split = _head_split(lead, q4[0] * q4[1])
    if split is None:
        return ""
    head_axes = [a for a in range(split) if lead[a] > 1]
    order = perm[:-1]
    cut = 1 + max((order.index(a) for a in head_axes), default=-1)
    moved = [lead[a] for a in order]
    heads = _heads(moved[:cut])
    rows = math.prod(moved[cut:])
    head_dim, keys = q4[3], x_shape[-1]
    q_split = (*lead, head_dim)
    q_perm = (*order, len(lead))
    by_position = sorted(head_axes, key=order.index)
    k_split = (*(lead[a] for a in head_axes), keys, head_dim)
    k_perm = (*(head_axes.index(a) for a in by_position), len(head_axes), len(head_axes) + 1)
    dims = (*(order.index(a) for a in by_position), cut, cut + 1)
    return "|".join((
        _retyped(q_ty, q_split), _perm_text(q_perm), _retyped(q_ty, [q_split[a] for a in q_perm]),
        _retyped(q_ty, (*heads, rows, head_dim)),
        _retyped(k_ty, k_split), _perm_text(k_perm), _retyped(k_ty, [k_split[a] for a in k_perm]),
        _perm_text(dims), _retyped(k_ty, (*moved[:cut], keys, head_dim)), _retyped(k_ty, (*heads, keys, head_dim)),
    ))


@lru_cache(maxsize=None)
def _is_permuted_row_view(view: str, row_ty: str, scores_ty: str, permutation: str) -> str:
    """"ok" if a StatView map reads a row statistic of scores x (one value per row: `row_ty` is x's
    shape without its key axis) at the row of [..., j] of `scores_ty` = Transpose(x, permutation):
    each axis a of the statistic longer than 1 is indexed by the axis x's axis a moved to."""
    entries = [None if e == "-" else int(e) for e in view[2:].split(",")] if view[2:] else []
    row, scores, perm = parse_type(row_ty).shape, parse_type(scores_ty).shape, ints(permutation)
    if len(entries) != len(row) or len(perm) != len(row) + 1 or len(scores) != len(perm):
        return ""
    for axis, (entry, extent) in enumerate(zip(entries, row)):
        if extent == 1:
            if entry is not None and scores[entry] != 1:
                return ""
        elif entry != perm.index(axis):
            return ""
    return "ok"


@lru_cache(maxsize=None)
def _grouped_value_layout(dims: str, p_ty: str, v_ty: str, out_ty: str, q4_ty: str, b_ty: str, v_left: str) -> str:
    """"v perm|v permuted|v squeezed|broadcast dims|broadcast type|v4|bias4|attention|o split|o perm" for
    o = dot_general(p, v) (v_left "1": dot_general(v, p)) with p Attention's [B, H, Sq, Sk] probabilities
    for q4 `q4_ty` up to a row-major reshape, when p's batch and free axes are interleaved (grouped
    queries: [G, B, K, T, S] probabilities batched on B and K, G and T free): v4 is v broadcast over the
    free axes among the (batch, head) ones, and o is Attention's output split to p's axes, permuted to
    the dot_general's order. "" when the in-order layouts (`_value_layout`, `_value_lhs_layout`) apply,
    or a batch axis of p lies among Sq's axes, or v has not one contracted and one free axis. With q4
    unknown ("": explain()'s check) the (batch, head) axes end at p's last batch axis."""
    lhs_contract, rhs_contract, lhs_batch, rhs_batch = _split(dims)
    if v_left == "1":
        v_contract, p_contract, v_batch, p_batch = lhs_contract, rhs_contract, lhs_batch, rhs_batch
        if _value_lhs_layout(dims, v_ty, p_ty, out_ty, q4_ty):
            return ""
    else:
        p_contract, v_contract, p_batch, v_batch = lhs_contract, rhs_contract, lhs_batch, rhs_batch
        if _value_layout(dims, p_ty, v_ty, out_ty, q4_ty):
            return ""
    p_shape, v_shape = parse_type(p_ty).shape, parse_type(v_ty).shape
    lead, keys = p_shape[:-1], p_shape[-1]
    v_free = [a for a in range(len(v_shape)) if a not in v_batch + v_contract]
    if p_contract != (len(lead),) or len(v_contract) != 1 or len(v_free) != 1 or not p_batch:
        return ""
    if q4_ty:
        q4 = parse_type(q4_ty).shape
        split = _head_split(lead, q4[0] * q4[1])
        if split is None or math.prod(lead[split:]) != q4[2]:
            return ""
    else:
        split = 1 + max((a for a in p_batch if lead[a] > 1), default=-1)
    if any(a >= split and lead[a] > 1 for a in p_batch):
        return ""
    kept = sorted((pa, va) for pa, va in zip(p_batch, v_batch) if pa < split)
    v_perm = (*(va for _, va in kept), *(va for pa, va in zip(p_batch, v_batch) if pa >= split),
              v_contract[0], v_free[0])
    head_dim = v_shape[v_free[0]]
    squeezed = (*(lead[pa] for pa, _ in kept), keys, head_dim)
    broadcast_dims = (*(pa for pa, _ in kept), split, split + 1)
    heads = tuple(parse_type(q4_ty).shape[:2]) if q4_ty else _heads(list(lead[:split]))
    rows = math.prod(lead[split:])
    p_free = [a for a in range(len(lead)) if a not in p_batch]
    d_axis = len(lead)
    out_perm = (*p_batch, d_axis, *p_free) if v_left == "1" else (*p_batch, *p_free, d_axis)
    return "|".join((
        _perm_text(v_perm), _retyped(v_ty, [v_shape[a] for a in v_perm]), _retyped(v_ty, squeezed),
        _perm_text(broadcast_dims), _retyped(v_ty, (*lead[:split], keys, head_dim)),
        _retyped(v_ty, (*heads, keys, head_dim)), _retyped(b_ty or p_ty, (*heads, rows, keys)),
        _retyped(out_ty, (*heads, rows, head_dim)), _retyped(out_ty, (*lead, head_dim)), _perm_text(out_perm),
    ))


@lru_cache(maxsize=None)
def _keeps_rows(permutation: str, ty: str) -> str:
    """"1" if transposing scores of type `ty` by `permutation` only moves size-1 axes and keeps the
    key axis last: the result is a row-major reshape of the scores, rows intact."""
    perm, shape = ints(permutation), parse_type(ty).shape
    return "1" if perm and perm[-1] == len(shape) - 1 and _keeps_flat_order(shape, perm) else ""


@lru_cache(maxsize=None)
def _keeps_last(x_ty: str, ty: str) -> str:
    """"1" if a reshape from `x_ty` to `ty` keeps the last (key) axis: rows intact."""
    x_shape, shape = parse_type(x_ty).shape, parse_type(ty).shape
    return "1" if x_shape and shape and x_shape[-1] == shape[-1] else ""


@lru_cache(maxsize=None)
def _last_axis(ty: str) -> str:
    return str(len(parse_type(ty).shape) - 1)


@lru_cache(maxsize=None)
def _is_row_view(view: str, row_ty: str, scores_ty: str) -> str:
    """"ok" if a StatView map reads a row statistic (of type `row_ty`, one value per row of scores
    flat-equal to these) at the row of [..., j] of `scores_ty`: its non-unit axes index the scores'
    leading axes in order, and every leading axis they leave out has extent 1."""
    entries = [None if e == "-" else int(e) for e in view[2:].split(",")] if view[2:] else []
    row, scores = parse_type(row_ty).shape, parse_type(scores_ty).shape
    if len(entries) != len(row) or not scores:
        return ""
    mapped = []
    for entry, extent in zip(entries, row):
        if extent == 1:
            if entry is not None and scores[entry] != 1:
                return ""
        elif entry is None or entry >= len(scores) - 1 or scores[entry] != extent:
            return ""
        else:
            mapped.append(entry)
    if mapped != sorted(set(mapped)):
        return ""
    left_out = [a for a in range(len(scores) - 1) if a not in mapped]
    return "ok" if all(scores[a] == 1 for a in left_out) else ""


@lru_cache(maxsize=None)
def _as_f32(ty: str) -> str:
    """`ty`'s shape as float32 (the type of Attention's no-bias `Lit`)."""
    return format_type("float32", parse_type(ty).shape)


@lru_cache(maxsize=None)
def _part(text: str, index: str) -> str:
    return text.split("|")[int(index)]


def _field(layout, index: int) -> String:
    return py_string(_part, layout, String(str(index)))


def _dtype(ty: str):
    import jax.numpy as jnp

    return jnp.dtype(parse_type(ty).dtype)


@lru_cache(maxsize=None)
def _is_float(ty: str) -> str:
    import jax.numpy as jnp

    return "1" if jnp.issubdtype(_dtype(ty), jnp.floating) else ""


@lru_cache(maxsize=None)
def _fits(value: str, ty: str) -> str:
    """"1" if `value` converted to `ty`'s float dtype does not overflow to an infinity it was not."""
    import jax.numpy as jnp

    number = float(value)
    return "1" if not math.isfinite(number) or abs(number) <= float(jnp.finfo(_dtype(ty)).max) else ""


@lru_cache(maxsize=None)
def _scalar_key_value(key: str) -> str:
    """The value of a lifted scalar constant `scalar:<dtype>:<repr>` ("" for any other key)."""
    kind, _, rest = key.partition(":")
    return rest.partition(":")[2] if kind == "scalar" else ""


@lru_cache(maxsize=None)
def _mask_fill(value: str, ty: str) -> str:
    """How `where(mask, s, value)` masks scores of type `ty`: "-inf" when `value` is -inf in that
    dtype, "lowest" when it is finite and in the dtype's lowest binade (at or below -2**(maxexp - 1):
    finfo.min as flax writes it, 0.7·finfo.min as jax.nn.dot_product_attention does), else ""."""
    import jax.numpy as jnp

    if not _is_float(ty):
        return ""
    dtype = _dtype(ty)
    with np.errstate(over="ignore"):  # a fill below the dtype's range rounds to -inf: that is the question
        rounded = float(np.asarray(float(value)).astype(dtype))
    if rounded == -math.inf:
        return "-inf"
    return "lowest" if rounded <= -(2.0 ** (jnp.finfo(dtype).maxexp - 1)) else ""


@attention.register
def _constants(e: Expr, x: Expr, c: f64, ty: String, dims: String):
    """Constant(e, c): e is c at every index up to the rounding of e's dtype: a Scalar, or a sqrt, rsqrt
    or float convert of a Constant computed at run time (`/ jnp.sqrt(d).astype(dtype)`), through views
    and copies. c is the exact (f64) value: a scale rounded to fp16 by the program is applied unrounded,
    a relative change below 2**-11 of the scores, inside the fp16 tolerance of the checker."""
    float_ty = ne(py_string(_is_float, ty)).to(String(""))
    yield rule(Scalar(e, c)).then(Constant(e, c))
    yield rule(e == Unary("sqrt", x, ty), Constant(x, c)).then(Constant(e, c ** f64(0.5)))
    yield rule(e == Unary("rsqrt", x, ty), Constant(x, c)).then(Constant(e, c ** f64(-0.5)))
    fits = ne(py_string(_fits, c.to_string(), ty)).to(String(""))
    yield rule(e == Unary("convert", x, ty), Constant(x, c), float_ty, fits).then(Constant(e, c))
    yield rule(e == Broadcast(x, dims, ty), Constant(x, c)).then(Constant(e, c))
    yield rule(e == Reshape(x, ty), Constant(x, c)).then(Constant(e, c))
    yield rule(e == Load(Pointwise(x, ty), ty), Constant(x, c)).then(Constant(e, c))


@attention.register
def _scores(
    e: Expr, x: Expr, k: Expr, m: Tensor, qt: Tensor, kt: Tensor, q: Expr, key: Expr,
    dims: String, tq: String, tk: String, t: String, ty: String, scale: f64, c: f64,
):
    """Scores(e, q, k, scale): e = scale · q·kᵀ (a batched matmul, then scalar mul/div and converts), q and
    k as Attention's [B, H, S, D] (views of the matmul's operands): e is a row-major reshape of the
    [B, H, Sq, Sk] scores, keys on its last axis (batch axes, q's free axes, k's free axis)."""
    layout = py_string(_score_layout, dims, tq, tk, t)
    q_permuted = Transpose(Load(qt, tq), _field(layout, 0), _field(layout, 1))
    k_permuted = Transpose(Load(kt, tk), _field(layout, 2), _field(layout, 3))
    matmul = (e == Load(m, t), m == Matmul(Load(qt, tq), Load(kt, tk), dims, Acc(t), t), ne(layout).to(String("")))
    yield rule(*matmul, eq(_field(layout, 6)).to(String("view"))).then(
        Scores(e, q_permuted, k_permuted, f64(1.0), t), Heads(q_permuted, _field(layout, 4)),
        KeyHeads(k_permuted, _field(layout, 5)))
    q_view, k_view = Reshape(q_permuted, _field(layout, 4)), Reshape(k_permuted, _field(layout, 5))
    yield rule(*matmul, eq(_field(layout, 6)).to(String("reshape"))).then(
        Scores(e, q_view, k_view, f64(1.0), t), Heads(q_view, _field(layout, 4)), KeyHeads(k_view, _field(layout, 5)))
    yield rule(e == Binary("mul", x, k, ty), Scores(x, q, key, scale, ty), Constant(k, c)).then(
        Scores(e, q, key, scale * c, ty))
    yield rule(e == Binary("mul", k, x, ty), Scores(x, q, key, scale, ty), Constant(k, c)).then(
        Scores(e, q, key, scale * c, ty))
    yield rule(e == Binary("div", x, k, ty), Scores(x, q, key, scale, ty), Constant(k, c), ne(c).to(f64(0.0))).then(
        Scores(e, q, key, scale / c, ty))
    yield rule(e == Unary("convert", x, ty), Scores(x, q, key, scale, t)).then(Scores(e, q, key, scale, ty))
    yield rule(e == Load(Pointwise(x, ty), ty), Scores(x, q, key, scale, ty)).then(Scores(e, q, key, scale, ty))


@attention.register
def _score_views(e: Expr, x: Expr, q: Expr, k: Expr, scale: f64, perm: String, tx: String, ty: String):
    """A transpose that only moves size-1 axes (the key axis last) or a reshape that keeps the key
    axis of scores is a row-major reshape of them: the same scores (jax.nn.dot_product_attention's
    [B, H, T, G=1, S] scores moved to [G, B, H, T, S])."""
    yield rule(e == Transpose(x, perm, ty), Scores(x, q, k, scale, tx), ne(py_string(_keeps_rows, perm, tx)).to(String(""))).then(
        Scores(e, q, k, scale, ty))
    yield rule(e == Reshape(x, ty), Scores(x, q, k, scale, tx), ne(py_string(_keeps_last, tx, ty)).to(String(""))).then(
        Scores(e, q, k, scale, ty))


@attention.register
def _grouped_score_views(e: Expr, x: Expr, y: Expr, q: Expr, k: Expr, scale: f64, perm: String, tx: String,
                         ty: String, tq: String, tk: String):
    """Scores moved across their (batch, head) axes, the key axis last (grouped queries: jax.nn's
    [B, K, T, G, S] scores moved to [G, B, K, T, S]) are the scores of q's rows moved the same way
    against k broadcast over the moved-in query axes (`_grouped_scores`); Regrouped remembers the
    move for the row max taken before it."""
    layout = py_string(_grouped_scores, perm, tx, tq, tk)
    q_moved = Reshape(Transpose(Reshape(q, _field(layout, 0)), _field(layout, 1), _field(layout, 2)), _field(layout, 3))
    k_moved = Reshape(Broadcast(Transpose(Reshape(k, _field(layout, 4)), _field(layout, 5), _field(layout, 6)),
                                _field(layout, 7), _field(layout, 8)), _field(layout, 9))
    yield rule(e == Transpose(x, perm, ty), Scores(x, q, k, scale, tx), Heads(q, tq), KeyHeads(k, tk),
               ne(layout).to(String(""))).then(
        Scores(e, q_moved, k_moved, scale, ty), Heads(q_moved, _field(layout, 3)), KeyHeads(k_moved, _field(layout, 9)),
        Regrouped(e, x, perm))
    yield rule(e == Load(Pointwise(y, ty), ty), Regrouped(y, x, perm)).then(Regrouped(e, x, perm))


@attention.register
def _biased_scores(e: Expr, x: Expr, b: Expr, q: Expr, k: Expr, scale: f64, ty: String, tx: String):
    """Biased(e, q, k, b, scale): e = scale · q·kᵀ + b, the bias b any Expr of the scores' shape (either
    order), and a float convert of that (equinox's float32 softmax of 16-bit masked logits; the kernel
    adds the bias to float32 scores, as converted scores are Scores)."""
    yield rule(e == Binary("add", x, b, ty), Scores(x, q, k, scale, ty)).then(
        Biased(e, q, k, b, scale, ty), BiasType(b, ty))
    yield rule(e == Binary("add", b, x, ty), Scores(x, q, k, scale, ty)).then(
        Biased(e, q, k, b, scale, ty), BiasType(b, ty))
    yield rule(e == Load(Pointwise(x, ty), ty), Biased(x, q, k, b, scale, ty)).then(Biased(e, q, k, b, scale, ty))
    yield rule(e == Unary("convert", x, ty), Biased(x, q, k, b, scale, tx), ne(py_string(_is_float, ty)).to(String(""))).then(
        Biased(e, q, k, b, scale, ty))


@attention.register
def _fill_values(e: Expr, x: Expr, c: f64, key: String, ty: String, dims: String):
    """FillValue(e, v): e is the scalar written `v` at every index: a Constant, or a lifted scalar
    constant tensor (a literal passed into a nested jit, as `jnp.where` gets its fill), through
    views, float converts and copies (whether the rounded value still masks is `_mask_fill`'s call)."""
    yield rule(Constant(e, c)).then(FillValue(e, c.to_string()))
    value = py_string(_scalar_key_value, key)
    yield rule(e == Load(ConstantTensor(key, ty), ty), ne(value).to(String(""))).then(FillValue(e, value))
    yield rule(e == Unary("convert", x, ty), FillValue(x, key), ne(py_string(_is_float, ty)).to(String(""))).then(
        FillValue(e, key))
    yield rule(e == Broadcast(x, dims, ty), FillValue(x, key)).then(FillValue(e, key))
    yield rule(e == Reshape(x, ty), FillValue(x, key)).then(FillValue(e, key))
    yield rule(e == Load(Pointwise(x, ty), ty), FillValue(x, key)).then(FillValue(e, key))


@attention.register
def _masked_scores(
    e: Expr, x: Expr, pred: Expr, fill: Expr, q: Expr, k: Expr, b: Expr, scale: f64, value: String, ty: String,
):
    """where(mask, s, c) = s + where(mask, 0, c') as a float32 score bias, for scores s (plain or
    biased, either select order) and c -inf (c' = -inf) or in the lowest binade of the scores'
    dtype (`_mask_fill`; c' = float32's lowest: s + c' rounds to c' for |s| < 2**103, so a fully
    masked row stays uniform, and exp(c - rowmax) is 0 in both forms wherever the row has an
    unmasked score above c + 104, for float32 scores any score of |s| < 2**103). A bias already added is kept under the mask (float32 scores only). Contract: finite
    scores; an infinite or NaN score under the mask reaches the softmax through the bias form (the
    select hid it)."""
    fill_kind = py_string(_mask_fill, value, ty)
    bias_ty = py_string(_as_f32, ty)
    for kind, bias_value in (("-inf", -math.inf), ("lowest", F32_LOWEST)):
        masked, open_ = Lit(bias_value, bias_ty), Lit(0.0, bias_ty)
        is_fill = (FillValue(fill, value), eq(fill_kind).to(String(kind)))
        yield rule(e == Select(pred, fill, x, ty), Scores(x, q, k, scale, ty), *is_fill).then(
            Biased(e, q, k, Select(pred, masked, open_, bias_ty), scale, ty),
            BiasType(Select(pred, masked, open_, bias_ty), bias_ty))
        yield rule(e == Select(pred, x, fill, ty), Scores(x, q, k, scale, ty), *is_fill).then(
            Biased(e, q, k, Select(pred, open_, masked, bias_ty), scale, ty),
            BiasType(Select(pred, open_, masked, bias_ty), bias_ty))
        yield rule(e == Select(pred, fill, x, ty), Biased(x, q, k, b, scale, ty), *is_fill, eq(ty).to(bias_ty)).then(
            Biased(e, q, k, Select(pred, masked, b, ty), scale, ty), BiasType(Select(pred, masked, b, ty), ty))
        yield rule(e == Select(pred, x, fill, ty), Biased(x, q, k, b, scale, ty), *is_fill, eq(ty).to(bias_ty)).then(
            Biased(e, q, k, Select(pred, b, masked, ty), scale, ty), BiasType(Select(pred, b, masked, ty), ty))


@attention.register
def _softmax(
    e: Expr, s: Expr, x: Expr, row: Expr, r: Tensor, q: Expr, k: Expr, b: Expr, scale: f64, ty: String, tr: String,
    view: String, narrow: Expr, wide: Expr, tw: String, axes: String, other: Expr, to: String, q0: Expr, k0: Expr,
    perm: String,
):
    """exp(s - rowmax(s)) / rowsum(exp(s - rowmax(s))) over scores s (plain or biased): Shifted, Exps, Probs.
    The row statistics reduce the last (key) axis and are read back at each score's row (`_is_row_view`);
    the row max of plain scores may be taken over them or another reshape of them (jax's
    dot_product_attention takes it before moving a size-1 axis; any row-constant shift cancels)."""
    row_ok = ne(py_string(_is_row_view, view, tr, ty)).to(String(""))
    last = eq(axes).to(py_string(_last_axis, ty))
    row_max = (e == Binary("sub", s, row, ty), StatView(row, ty, r, f64(1.0), view), row_ok)
    bias_ty = py_string(_as_f32, ty)
    no_bias = Lit(0.0, bias_ty)
    yield rule(
        *row_max, r == Reduce("max", other, axes, Acc(tr), tr), eq(axes).to(py_string(_last_axis, to)),
        Scores(other, q, k, scale, to), Scores(s, q, k, scale, ty),
    ).then(Shifted(e, q, k, no_bias, scale, ty), BiasType(no_bias, bias_ty))
    # the row max of grouped scores taken before they were moved: read back through the same move
    moved_ok = ne(py_string(_is_permuted_row_view, view, tr, ty, perm)).to(String(""))
    yield rule(
        e == Binary("sub", s, row, ty), StatView(row, ty, r, f64(1.0), view), r == Reduce("max", other, axes, Acc(tr), tr),
        eq(axes).to(py_string(_last_axis, to)), Scores(other, q0, k0, scale, to), Regrouped(s, other, perm),
        Scores(s, q, k, scale, ty), moved_ok,
    ).then(Shifted(e, q, k, no_bias, scale, ty), BiasType(no_bias, bias_ty))
    yield rule(*row_max, r == Reduce("max", s, axes, Acc(tr), tr), last, Biased(s, q, k, b, scale, ty)).then(
        Shifted(e, q, k, b, scale, ty))
    yield rule(e == Unary("exp", x, ty), Shifted(x, q, k, b, scale, ty)).then(Exps(e, q, k, b, scale, ty))
    yield rule(
        e == Binary("div", x, row, ty),
        Exps(x, q, k, b, scale, ty),
        StatView(row, ty, r, f64(1.0), view),
        r == Reduce("sum", x, axes, Acc(tr), tr),
        last,
        row_ok,
    ).then(Probs(e, q, k, b, scale, ty))
    yield rule(e == Unary("convert", x, ty), Probs(x, q, k, b, scale, tr)).then(Probs(e, q, k, b, scale, ty))
    # jax.nn.softmax on 16-bit scores: exp in 16 bits, the row sum over exp widened to float32 and
    # narrowed back before the division (exp is exp in any float dtype; the rounding differs)
    yield rule(e == Unary("convert", x, ty), Exps(x, q, k, b, scale, tr), ne(py_string(_is_float, ty)).to(String(""))).then(
        Exps(e, q, k, b, scale, ty))
    yield rule(
        e == Binary("div", x, narrow, ty),
        Exps(x, q, k, b, scale, ty),
        RoundedStat(narrow, ty, r, view),
        r == Reduce("sum", wide, axes, Acc(tr), tr),
        last,
        Exps(wide, q, k, b, scale, tw),
        row_ok,
    ).then(Probs(e, q, k, b, scale, ty))
    for relation_ in (Shifted, Exps, Probs):
        yield rule(e == Load(Pointwise(x, ty), ty), relation_(x, q, k, b, scale, ty)).then(
            relation_(e, q, k, b, scale, ty))


@attention.register
def _flash_attention(
    o: Tensor, p: Expr, vt: Tensor, q: Expr, k: Expr, b: Expr, scale: f64, dims: String, tp: String, tv: String,
    t: String, tq: String, tb: String,
):
    """dot(softmax(q·kᵀ·scale + b), v) = Attention(q, k, v, b, scale): the score matrix stays on chip.
    Probabilities of any rank (a reshape of [B, H, Sq, Sk]: `_value_layout`) read v as [B, H, Sk, D]
    and the bias as [B, H, Sq, Sk] through reshapes, and the product is Attention's output reshaped."""
    layout = py_string(_value_layout, dims, tp, tv, t, tq, tb)
    v_permuted = Transpose(Load(vt, tv), _field(layout, 0), _field(layout, 1))
    matched = (
        o == Matmul(p, Load(vt, tv), dims, Acc(t), t),
        Probs(p, q, k, b, scale, tp),
        Heads(q, tq),
        BiasType(b, tb),
        ne(layout).to(String("")),
    )
    yield rule(*matched, eq(_field(layout, 5)).to(String("view"))).then(
        union(o).with_(Attention(q, k, v_permuted, b, scale, Acc(t), t)))
    attention_ty = _field(layout, 4)
    attention_ = Attention(q, k, Reshape(v_permuted, _field(layout, 2)), Reshape(b, _field(layout, 3)), scale,
                           Acc(attention_ty), attention_ty)
    yield rule(*matched, eq(_field(layout, 5)).to(String("reshape"))).then(
        union(o).with_(Pointwise(Reshape(Load(attention_, attention_ty), t), t)))


@attention.register
def _grouped_flash_attention(
    o: Tensor, p: Expr, vt: Tensor, q: Expr, k: Expr, b: Expr, scale: f64, dims: String, tp: String, tv: String,
    t: String, tq: String, tb: String,
):
    """dot(softmax(q·kᵀ·scale + b), v) (either operand order) with the probabilities' batch and free axes
    interleaved (grouped queries: [G, B, K, T, S] batched on B, K) = Attention(q, k, v4, b, scale) split
    and permuted to the product's layout, v4 = v broadcast over the query axes among (batch, head)
    (`_grouped_value_layout`): each group of query heads reads its K/V head."""
    for v_left in ("0", "1"):
        layout = py_string(_grouped_value_layout, dims, tp, tv, t, tq, tb, String(v_left))
        v4 = Reshape(Broadcast(Reshape(Transpose(Load(vt, tv), _field(layout, 0), _field(layout, 1)), _field(layout, 2)),
                               _field(layout, 3), _field(layout, 4)), _field(layout, 5))
        attention_ty = _field(layout, 7)
        attention_ = Attention(q, k, v4, Reshape(b, _field(layout, 6)), scale, Acc(attention_ty), attention_ty)
        product = Matmul(Load(vt, tv), p, dims, Acc(t), t) if v_left == "1" else Matmul(p, Load(vt, tv), dims, Acc(t), t)
        yield rule(o == product, Probs(p, q, k, b, scale, tp), Heads(q, tq), BiasType(b, tb), ne(layout).to(String(""))).then(
            union(o).with_(Pointwise(Transpose(Reshape(Load(attention_, attention_ty), _field(layout, 8)),
                                               _field(layout, 9), t), t)))


@attention.register
def _rounded_stats(e: Expr, x: Expr, s: Tensor, ty: String, tx: String, dims: String, view: String):
    """RoundedStat(e, ty, s, map): a StatView of s (n = 1) seen through float converts too: e[i] =
    round(s[i[map]]) in e's dtype (the 16-bit softmax's row sum narrowed back before its division)."""
    yield rule(StatView(e, ty, s, f64(1.0), view)).then(RoundedStat(e, ty, s, view))
    yield rule(e == Unary("convert", x, ty), RoundedStat(x, tx, s, view), ne(py_string(_is_float, ty)).to(String(""))).then(
        RoundedStat(e, ty, s, view))
    broadcast = py_string(_map_broadcast, view, tx, dims, ty)
    yield rule(e == Broadcast(x, dims, ty), RoundedStat(x, tx, s, view), ne(broadcast).to(String(""))).then(
        RoundedStat(e, ty, s, broadcast))
    yield rule(e == Load(Pointwise(x, ty), ty), RoundedStat(x, ty, s, view)).then(RoundedStat(e, ty, s, view))


@attention.register
def _flash_attention_value_lhs(
    o: Tensor, p: Expr, vt: Tensor, q: Expr, k: Expr, b: Expr, scale: f64, dims: String, tp: String, tv: String,
    t: String, tq: String, tb: String,
):
    """dot(v, softmax(q·kᵀ·scale + b)) over Sk = transpose(Attention(q, k, v, b, scale)): the einsum
    `bhqk,bkhd->bqhd` puts v on the left, so the matmul writes [B, H, D, Sq] (at other ranks (batch...,
    D, q free...): Attention's output reshaped, then permuted); the views are its readers' to fold."""
    layout = py_string(_value_lhs_layout, dims, tv, tp, t, tq, tb)
    v_permuted = Transpose(Load(vt, tv), _field(layout, 0), _field(layout, 1))
    attention_ty = _field(layout, 4)
    matched = (
        o == Matmul(Load(vt, tv), p, dims, Acc(t), t),
        Probs(p, q, k, b, scale, tp),
        Heads(q, tq),
        BiasType(b, tb),
        ne(layout).to(String("")),
    )
    attention_ = Attention(q, k, v_permuted, b, scale, Acc(attention_ty), attention_ty)
    yield rule(*matched, eq(_field(layout, 7)).to(String("view"))).then(
        union(o).with_(Pointwise(Transpose(Load(attention_, attention_ty), String("0,1,3,2"), t), t)))
    reshaped = Attention(q, k, Reshape(v_permuted, _field(layout, 2)), Reshape(b, _field(layout, 3)), scale,
                         Acc(attention_ty), attention_ty)
    unpermuted = Reshape(Load(reshaped, attention_ty), _field(layout, 5))
    yield rule(*matched, eq(_field(layout, 7)).to(String("reshape"))).then(
        union(o).with_(Pointwise(Transpose(unpermuted, _field(layout, 6), t), t)))


# --- soundness examples (eqsat.rules.check) ------------------------------------------------------


def _sd15_attention(q, k, v):
    """SD 1.5's multi-head attention (2 heads) on [B, S, H*D] projections."""
    from eqsat.rules.model_spellings import multi_head_attention

    return multi_head_attention(q, k, v, 2)


def _sd15_attention_args(draw):
    from eqsat.rules import dim, tensor

    batch, width, kv_len = dim(draw, 1, 2), 2 * dim(draw, 1, 3), dim(draw)
    return (tensor(draw, (batch, dim(draw), width)), tensor(draw, (batch, kv_len, width)),
            tensor(draw, (batch, kv_len, width)))


def _softmax_attention(q, k, v):
    """jax.nn.softmax over [B, H, S, D] operands, scale by division."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _softmax_other_axis(q, k, v):
    """Normalized over the query axis: not attention."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-2), v)


def _bhsd_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, q_len, kv_len, head_dim = (dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw))
    return (tensor(draw, (batch, heads, q_len, head_dim)), tensor(draw, (batch, heads, kv_len, head_dim)),
            tensor(draw, (batch, heads, kv_len, head_dim)))


def _causal_attention(q, k, v):
    """CLIP's self-attention: SD 1.5's multi-head attention (2 heads) plus the causal mask."""
    from eqsat.rules.model_spellings import causal_bias, multi_head_attention

    return multi_head_attention(q, k, v, 2, bias=causal_bias(q.shape[1]))


def _causal_args(draw):
    from eqsat.rules import dim, tensor

    batch, length, width = dim(draw, 1, 2), dim(draw), 2 * dim(draw, 1, 3)
    return tuple(tensor(draw, (batch, length, width)) for _ in range(3))


def _biased_attention(q, k, v, bias):
    """jax.nn.softmax of bias + scores (bias on the left), a [1, H, Sq, Sk] bias broadcast over batch."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(bias + scores, axis=-1), v)


def _bias_before_scale(q, k, v, bias):
    """(q·kᵀ + bias) · scale: the bias is scaled too, not an additive score bias; must not match."""
    import jax
    import jax.numpy as jnp

    scores = (jnp.einsum("bhqd,bhkd->bhqk", q, k) + bias) * 0.5
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _bhsd_bias_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, q_len, kv_len, head_dim = (dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw))
    return (tensor(draw, (batch, heads, q_len, head_dim)), tensor(draw, (batch, heads, kv_len, head_dim)),
            tensor(draw, (batch, heads, kv_len, head_dim)), tensor(draw, (1, heads, q_len, kv_len), low=-4.0))


def _square_args(draw):
    from eqsat.rules import dim, tensor

    shape = (dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw))
    return tensor(draw, shape), tensor(draw, shape), tensor(draw, shape)


def _runtime_sqrt_scale(q, k, v):
    """flax's scale: q / jnp.sqrt(d).astype(dtype) (a sqrt computed at run time), and rsqrt on the scores."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * lax.rsqrt(jnp.float32(3.0))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _where_lowest(q, k, v, mask):
    """flax's mask: where(mask, s, finfo.min); `mask` random, so whole rows are masked too."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _where_inf_biased(q, k, v, mask):
    """where(~mask, -inf, s + bias): the other select order, over biased scores (the bias a mask too)."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5 + jnp.where(mask[..., ::-1], 0.0, -1e4)
    scores = jnp.where(~mask, -jnp.inf, scores)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _where_not_low_enough(q, k, v, mask):
    """where(mask, s, -1e4): a fill above float32's lowest finite value is a score the row may reach
    (nothing bounds s), not a mask; must not match."""
    import jax
    import jax.numpy as jnp

    scores = jnp.where(mask, jnp.einsum("bhqd,bhkd->bhqk", q, k), -1e4)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _bhsd_mask_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, q_len, kv_len, head_dim = (dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw))
    return (tensor(draw, (batch, heads, q_len, head_dim)), tensor(draw, (batch, heads, kv_len, head_dim)),
            tensor(draw, (batch, heads, kv_len, head_dim)), tensor(draw, (1, 1, q_len, kv_len), dtype="bool"))


def _half_softmax_attention(q, k, v):
    """jax.nn.softmax on float16 scores (exp in fp16, the row sum widened to fp32 and narrowed back), q
    scaled before the matmul, the probabilities' einsum written with v on the left ([B, T, H, D] out)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * q.shape[-1] ** -0.5, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).astype(jnp.float32)


def _bshd_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, q_len, kv_len, head_dim = (dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw))
    return (tensor(draw, (batch, q_len, heads, head_dim)), tensor(draw, (batch, kv_len, heads, head_dim)),
            tensor(draw, (batch, kv_len, heads, head_dim)))


def _tokens(draw) -> int:
    """A sequence length: small, or CLIP's 77."""
    from hypothesis import strategies as st

    return draw(st.sampled_from((1, 2, 3, 5, 77)))


def _head_dim(draw) -> int:
    """A head dim: small, or SD 1.5's 40."""
    from hypothesis import strategies as st

    return draw(st.sampled_from((1, 3, 4, 40)))


def _jax_nn_attention(q, k, v):
    """jax.nn.dot_product_attention on [B, T, H, D]: grouped scores of rank 5 [B, H_kv, T, G, S], moved
    to [G, B, H_kv, T, S] for the softmax, the row max taken before the move, v on the left of the PV."""
    import jax

    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def _jax_nn_causal_attention(q, k, v):
    """is_causal=True: where(causal, s, 0.7 · float32's lowest) on the moved rank-5 scores."""
    import jax

    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _jax_nn_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, q_len, kv_len, head_dim = dim(draw, 1, 2), dim(draw, 1, 2), _tokens(draw), _tokens(draw), _head_dim(draw)
    return (tensor(draw, (batch, q_len, heads, head_dim)), tensor(draw, (batch, kv_len, heads, head_dim)),
            tensor(draw, (batch, kv_len, heads, head_dim)))


def _jax_nn_causal_args(draw):
    from eqsat.rules import dim, tensor

    batch, heads, length, head_dim = dim(draw, 1, 2), dim(draw, 1, 2), _tokens(draw), _head_dim(draw)
    return tuple(tensor(draw, (batch, length, heads, head_dim)) for _ in range(3))


def _merged_heads(q, k, v):
    """torch's bmm spelling: [B, H, Sq, Sk] scores reshaped to [B·H, Sq, Sk], softmax, then a PV
    batched over B·H with v reshaped to match."""
    import jax
    import jax.numpy as jnp

    batch, heads, q_len, _ = q.shape
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).reshape(batch * heads, q_len, k.shape[2]) * 0.5
    merged_v = v.reshape(batch * heads, *v.shape[2:])
    return jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(scores, axis=-1), merged_v)


def _equinox_attention(q, k, v, mask):
    """equinox MultiheadAttention's core on [T, H, D]: heads by vmap (rank-3 scores [H, T, S]), the
    logits masked with finfo.min, soft-maxed in float32 and cast back."""
    import jax
    import jax.numpy as jnp

    def head(q, k, v):
        q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        logits = jnp.einsum("sd,Sd->sS", q, k)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits.astype(jnp.result_type(logits.dtype, jnp.float32))).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)

    return jax.vmap(head, in_axes=1, out_axes=1)(q, k, v)


def _equinox_args(draw):
    """[T, H, D] operands and a random [T, S] mask (rows with every key masked among them)."""
    from eqsat.rules import dim, tensor

    heads, q_len, kv_len, head_dim = dim(draw, 1, 3), _tokens(draw), _tokens(draw), _head_dim(draw)
    return (tensor(draw, (q_len, heads, head_dim)), tensor(draw, (kv_len, heads, head_dim)),
            tensor(draw, (kv_len, heads, head_dim)), tensor(draw, (q_len, kv_len), dtype="bool"))


def _equinox_half_args(draw):
    """float16 operands: the masked 16-bit logits converted for equinox's float32 softmax."""
    q, k, v, mask = _equinox_args(draw)
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), mask


def _single_head(q, k, v):
    """softmax(q·kᵀ)·v on [T, D] operands: scores without batch axes, which the family does not take
    for scores (a plain matmul has none); must not match."""
    import jax

    return jax.nn.softmax(q @ k.T * 0.25, axis=-1) @ v


def _single_head_args(draw):
    from eqsat.rules import tensor

    q_len, kv_len, head_dim = _tokens(draw), _tokens(draw), _head_dim(draw)
    return tensor(draw, (q_len, head_dim)), tensor(draw, (kv_len, head_dim)), tensor(draw, (kv_len, head_dim))


def _shared_values(q, k, v):
    """Per-head probabilities [H, T, S] times one v [S, D] shared by every head: the PV has no batch
    axis where the scores have one, not Attention's per-head v; must not match."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("hqd,hkd->hqk", q, k)
    return jnp.einsum("hqk,kd->hqd", jax.nn.softmax(scores, axis=-1), v)


def _shared_values_args(draw):
    from eqsat.rules import dim, tensor

    heads, q_len, kv_len, head_dim = dim(draw, 2, 3), _tokens(draw), _tokens(draw), _head_dim(draw)
    return (tensor(draw, (heads, q_len, head_dim)), tensor(draw, (heads, kv_len, head_dim)),
            tensor(draw, (kv_len, head_dim)))


def _grouped_queries(q, k, v):
    """jax.nn.dot_product_attention with grouped queries (G query heads per K/V head): [B, K, T, G, S]
    scores moved to [G, B, K, T, S] for the softmax, the row max taken before the move, v on the left
    of a PV batched on B and K only."""
    import jax

    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def _grouped_args(draw):
    from hypothesis import strategies as st

    from eqsat.rules import dim, tensor

    # two or more K/V heads and query tokens: otherwise the moved scores only move size-1 axes past
    # the group axis, and the in-order rules take them (`score_views`)
    batch, kv_heads, groups = dim(draw, 1, 2), dim(draw, 2, 3), draw(st.sampled_from((2, 3)))
    q_len, kv_len, head_dim = draw(st.sampled_from((2, 3, 5, 77))), _tokens(draw), _head_dim(draw)
    return (tensor(draw, (batch, q_len, groups * kv_heads, head_dim)), tensor(draw, (batch, kv_len, kv_heads, head_dim)),
            tensor(draw, (batch, kv_len, kv_heads, head_dim)))


def _moved_keys(q, k, v):
    """Scores transposed so the keys are no longer last, then soft-maxed over the queries: must not
    be taken for grouped scores."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).transpose(0, 1, 3, 2)
    return jnp.einsum("bhkq,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def _half_tolerance(leaves):
    """fp16 attention: the kernel's float32 softmax against jax's fp16 one, a few fp16 ulps of |v|."""
    return 1e-2 * max(1.0, max(float(np.max(np.abs(leaf))) for leaf in leaves if leaf.size))


def _examples():
    from eqsat.rules import Example
    from eqsat.rules.checker import VALUE_REGIMES

    finite = tuple(regime for regime in VALUE_REGIMES if regime != "nonfinite")  # masked_scores' contract
    return [
        Example(_sd15_attention, _sd15_attention_args, ("scores", "softmax", "flash_attention")),
        Example(_softmax_attention, _bhsd_args, ("flash_attention",)),
        Example(_softmax_other_axis, _square_args, ("flash_attention",), fires=False),
        Example(_causal_attention, _causal_args, ("scores", "biased_scores", "softmax", "flash_attention")),
        Example(_biased_attention, _bhsd_bias_args, ("biased_scores", "flash_attention")),
        Example(_bias_before_scale, _bhsd_bias_args, ("flash_attention",), fires=False),
        Example(_runtime_sqrt_scale, _bhsd_args, ("constants", "scores", "flash_attention")),
        Example(_where_lowest, _bhsd_mask_args, ("fill_values", "masked_scores", "flash_attention"), regimes=finite),
        Example(_where_inf_biased, _bhsd_mask_args, ("fill_values", "masked_scores", "flash_attention"),
                regimes=finite),
        Example(_where_not_low_enough, _bhsd_mask_args, ("masked_scores",), fires=False),
        # values of 1e3 (offset, constant rows, huge) overflow the function's fp16 scores (inf - inf: NaN)
        # where the kernel's float32 scores stay finite: held to uniform draws, zeros and tiny values
        Example(_half_softmax_attention, _bshd_args, ("softmax", "rounded_stats", "flash_attention_value_lhs"),
                tolerance=_half_tolerance, regimes=("zeros", "tiny")),
        # other ranks: grouped rank-5 scores, rank-3 (vmapped heads), rank-2 (no batch axis)
        Example(_jax_nn_attention, _jax_nn_args, ("score_views", "softmax", "flash_attention_value_lhs")),
        Example(_merged_heads, _bhsd_args, ("score_views", "softmax", "flash_attention")),
        Example(_jax_nn_causal_attention, _jax_nn_causal_args,
                ("score_views", "fill_values", "masked_scores", "flash_attention_value_lhs"), regimes=finite),
        Example(_equinox_attention, _equinox_args, ("constants", "masked_scores", "softmax", "flash_attention"),
                regimes=finite),
        Example(_single_head, _single_head_args, ("flash_attention",), fires=False),  # no batch axis: not scores
        # its chain (fill broadcasts, select, convert, softmax, convert back) reaches the PV after 16
        # iterations: the Attention extraction is checked at the default 32, the fusion is test_spellings'
        Example(_equinox_attention, _equinox_half_args, ("biased_scores/3", "masked_scores"),
                name="equinox fp16", tolerance=_half_tolerance, regimes=("zeros", "tiny")),
        Example(_shared_values, _shared_values_args, ("flash_attention",), fires=False),
        Example(_grouped_queries, _grouped_args, ("grouped_score_views", "softmax", "grouped_flash_attention")),
        Example(_moved_keys, _square_args, ("grouped_score_views", "flash_attention"), fires=False),
    ]


EXAMPLES = _examples()
