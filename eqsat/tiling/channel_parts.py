"""An input expression cut along one axis where the tensors it reads change: the haloed Mosaic conv
(`emit.mosaic.conv_halo`) stages one tensor per K range, so a GroupNorm + SiLU over `concat(h, skip)`
runs as two ranges, each the same expression over the channels of one side.

    concat_splits(expr, axis)           where `Concat`s split `expr` along `axis` (its coordinates)
    restrict(expr, axis, start, stop)   `expr[..., start:stop, ...]` as an expression whose views
                                        and loads read only those elements (no `Concat` left there)
    distribute_reshapes(expr)           the same values with each `Reshape` over a concat pushed
                                        through the elementwise ops below it

Both follow the axis through elementwise ops, `Broadcast`, `Transpose`, unit-stride `Slice` and
`Reshape`s that split or merge it as its outermost factor (a GroupNorm's `[.., C] <-> [.., G, C/G]`,
cuts on group boundaries); anything else raises `NotRestrictable`. A concat inside a group
(1920 = 1280 + 640 in groups of 60) is cut after `distribute_reshapes` (`channel_parts`): a GroupNorm
apply `Reshape(f(Reshape(concat, [.., G, C/G]), stats[.., G, 1]), [.., C])` becomes `f(concat,
Reshape(stats broadcast to [.., G, C/G], [.., C]))`, elementwise over channels, its statistics
read per channel through a view.
"""

from __future__ import annotations

import math

from eqsat.types import ints, parse_type, with_shape

ELEMENTWISE = ("Unary", "Binary", "Select")
Term = object  # eqsat.term.Term by duck typing (importing it would import egglog); new terms are made by
# the class of the term they replace (`_like`)


def _like(term, op: str, *args):
    return type(term)(op, *args)


class NotRestrictable(ValueError):
    """The expression cannot be cut along the axis there (a view that scatters it, a strided slice)."""


def _shape(term: Term) -> tuple[int, ...]:
    return parse_type(term.ty).shape


def reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """The reshape's axis groups of equal products `(input axes, output axes)`, in order (a group
    of trailing size-1 axes may have none on one side)."""
    groups, i, o = [], 0, 0
    while i < len(in_shape) or o < len(out_shape):
        ins, outs, pi, po = [], [], 1, 1
        if i < len(in_shape):
            ins.append(i)
            pi, i = pi * in_shape[i], i + 1
        if o < len(out_shape):
            outs.append(o)
            po, o = po * out_shape[o], o + 1
        while pi != po:
            if pi < po:
                ins.append(i)
                pi, i = pi * in_shape[i], i + 1
            else:
                outs.append(o)
                po, o = po * out_shape[o], o + 1
        groups.append((ins, outs))
    return groups


def _outermost(axes, shape) -> tuple[int, int]:
    """The group's first axis of size > 1 (its first axis when all are 1) and the product after it."""
    lead = next((a for a in axes if shape[a] != 1), axes[0])
    return lead, math.prod(shape[a] for a in axes[axes.index(lead) + 1:])


def _reshape_axis(term: Term, axis: int):
    """For a `Reshape` cut along output `axis`: `(input axis, output inner product, input inner
    product, the group's other input axes, None)`; None when `axis` is a size-1 axis the reshape
    adds. When `axis` is an inner factor of its group (a GroupNorm's `C/G`), `(None, the product of
    it and the factors inside it, input inner product, other input axes, the group's lead input
    axis)`: concats may cut the lead input axis at multiples of that block only."""
    x = term.args[0]
    in_shape, out_shape = _shape(x), _shape(term)
    for ins, outs in reshape_groups(in_shape, out_shape):
        if axis in outs:
            if not ins:  # size-1 axes the reshape adds: nothing to cut
                return None
            lead_out, inner_out = _outermost(outs, out_shape)
            lead_in, inner_in = _outermost(ins, in_shape)
            if lead_out != axis:  # an inner factor: uncut where concats cut only the factors outside it
                lead_in, inner_in = _outermost(ins, in_shape)
                block = math.prod(out_shape[a] for a in outs[outs.index(axis):])
                return None, block, inner_in, [a for a in ins if a != lead_in], lead_in
            return lead_in, inner_out, inner_in, [a for a in ins if a != lead_in], None
    raise AssertionError((in_shape, out_shape, axis))


def concat_splits(expr: Term, axis: int, memo=None) -> frozenset[int]:
    """Positions along `axis` (in `expr`'s coordinates, strictly inside it) where a `Concat` below
    switches tensors."""
    memo = {} if memo is None else memo
    key = (id(expr), axis)
    if key in memo:
        return memo[key]
    extent = _shape(expr)[axis]
    op = expr.op
    if op in ("Load", "Lit", "Iota", "Acc"):
        out = frozenset()
    elif op in ELEMENTWISE:
        out = frozenset().union(*(concat_splits(a, axis, memo) for a in expr.children))
    elif op == "Concat":
        x, y, along, split, _ = expr.args
        if along == axis:
            out = (concat_splits(x, axis, memo) | {split}
                   | {split + p for p in concat_splits(y, axis, memo)})
        else:
            out = concat_splits(x, axis, memo) | concat_splits(y, axis, memo)
    elif op == "Broadcast":
        x, dims, _ = expr.args
        source = [j for j, d in enumerate(ints(dims)) if d == axis and _shape(x)[j] == extent]
        out = concat_splits(x, source[0], memo) if source else frozenset()
    elif op == "Transpose":
        out = concat_splits(expr.args[0], ints(expr.args[1])[axis], memo)
    elif op == "Slice":
        x, along, start, stop, stride, _ = expr.args
        inner = concat_splits(x, axis, memo)
        if along != axis:
            out = inner
        elif stride == 1:
            out = frozenset(p - start for p in inner if start < p < stop)
        elif any(start < p < stop for p in inner) or stride < 0:
            raise NotRestrictable(f"a slice of stride {stride} across a concat")
        else:
            out = frozenset()
    elif op == "Reshape":
        x = expr.args[0]
        mapped = _reshape_axis(expr, axis)
        lead_in, inner_out, inner_in, others, group_lead = mapped if mapped is not None else (None, 1, 1, [], None)
        if any(concat_splits(x, a, memo) for a in others):
            raise NotRestrictable("a reshape merging an axis split by a concat as an inner factor")
        if group_lead is not None and any(p * inner_in % inner_out for p in concat_splits(x, group_lead, memo)):
            raise NotRestrictable(f"a concat inside a reshaped block of {inner_out}")
        out = set()
        for p in concat_splits(x, lead_in, memo) if lead_in is not None else ():
            if (p * inner_in) % inner_out:
                raise NotRestrictable(f"a concat at {p} inside a reshaped group of {inner_out}")
            out.add(p * inner_in // inner_out)
        out = frozenset(out)
    else:
        raise NotRestrictable(f"a {op} in the input expression")
    out = frozenset(p for p in out if 0 < p < extent)
    memo[key] = out
    return out


def restrict(expr: Term, axis: int, start: int, stop: int, memo=None) -> Term:
    """`expr` at `[start, stop)` along `axis` only: an expression of that extent there, whose
    `Concat`s inside the cut are resolved to their side; each subexpression below them that no
    concat cuts is kept as it is, read through a `Slice` (so its loads and their views are the same
    reads as in `expr`)."""
    memo = {} if memo is None else memo
    shape = _shape(expr)
    if (start, stop) == (0, shape[axis]):
        return expr
    if not 0 <= start < stop <= shape[axis]:
        raise ValueError(f"[{start}, {stop}) is not inside axis {axis} of {shape}")
    key = (id(expr), axis, start, stop)
    if key in memo:
        return memo[key]
    new_shape = list(shape)
    new_shape[axis] = stop - start
    ty = with_shape(expr.ty, new_shape)
    op, args = expr.op, expr.args
    if not concat_splits(expr, axis):  # one tensor below: a slice of it (what it reads, and how, unchanged)
        out = _like(expr, "Slice", expr, axis, start, stop, 1, ty)
    elif op == "Lit":
        out = _like(expr, "Lit", args[0], ty)
    elif op in ELEMENTWISE:
        out = _like(expr, op, *[restrict(a, axis, start, stop, memo) if hasattr(a, "op") else a for a in args[:-1]], ty)
    elif op == "Concat":
        x, y, along, split, _ = args
        if along != axis:
            out = _like(expr, "Concat", restrict(x, axis, start, stop, memo), restrict(y, axis, start, stop, memo), along,
                       split, ty)
        elif stop <= split:
            out = restrict(x, axis, start, stop, memo)
        elif start >= split:
            out = restrict(y, axis, start - split, stop - split, memo)
        else:
            raise NotRestrictable(f"[{start}, {stop}) straddles a concat at {split}")
    elif op == "Broadcast":
        x, dims, _ = args
        source = [j for j, d in enumerate(ints(dims)) if d == axis and _shape(x)[j] == shape[axis]]
        out = _like(expr, "Broadcast", restrict(x, source[0], start, stop, memo) if source else x, dims, ty)
    elif op == "Transpose":
        x, permutation, _ = args
        out = _like(expr, "Transpose", restrict(x, ints(permutation)[axis], start, stop, memo), permutation, ty)
    elif op == "Slice":
        x, along, s0, s1, stride, _ = args
        if along != axis:
            out = _like(expr, "Slice", restrict(x, axis, start, stop, memo), along, s0, s1, stride, ty)
        elif stride == 1:
            out = restrict(x, axis, s0 + start, s0 + stop, memo)
        else:
            out = _like(expr, "Slice", x, along, s0 + start * stride, s0 + stop * stride, stride, ty)
    elif op == "Reshape":
        x = args[0]
        lead_in, inner_out, inner_in, _others, _lead = _reshape_axis(expr, axis) or (None, 1, 1, [], None)
        if lead_in is None:
            raise NotRestrictable(f"a cut of axis {axis}, an inner factor of a reshape")
        if (start * inner_out) % inner_in or (stop * inner_out) % inner_in:
            raise NotRestrictable(f"[{start}, {stop}) of axis {axis} cuts a reshaped group of {inner_in}")
        out = _like(expr, "Reshape", restrict(x, lead_in, start * inner_out // inner_in, stop * inner_out // inner_in, memo),
                   ty)
    else:
        raise NotRestrictable(f"a {op} in the input expression")
    memo[key] = out
    return out


def _holds_concat(expr: Term, memo: dict) -> bool:
    if id(expr) not in memo:
        memo[id(expr)] = expr.op == "Concat" or (expr.op != "Load"
                                                  and any(_holds_concat(c, memo) for c in expr.children))
    return memo[id(expr)]


def distribute_reshapes(expr: Term, memo=None, concats=None) -> Term:
    """`expr` with every `Reshape` whose input holds a `Concat` pushed down through the elementwise
    ops below it (a reshape of an elementwise op is the op of its operands' reshapes; two reshapes
    compose into one, or cancel where the inner's input has the outer's shape; a literal takes the
    shape): the same values, the same loads, the concat no longer inside a reshaped block."""
    memo, concats = ({} if memo is None else memo), ({} if concats is None else concats)
    key = ("expr", id(expr))
    if key in memo:
        return memo[key]
    if expr.op == "Load" or not _holds_concat(expr, concats):
        out = expr
    elif expr.op == "Reshape":
        out = _push_reshape(expr.args[0], expr.ty, memo, concats)
    else:
        out = _like(expr, expr.op, *[distribute_reshapes(a, memo, concats) if hasattr(a, "op") else a
                                     for a in expr.args])
    memo[key] = out
    return out


def _push_reshape(x: Term, ty: str, memo: dict, concats: dict) -> Term:
    """`Reshape(x, ty)` pushed down (`distribute_reshapes`)."""
    key = ("reshape", id(x), ty)
    if key in memo:
        return memo[key]
    shape = parse_type(ty).shape
    if x.op in ELEMENTWISE and _holds_concat(x, concats):
        out = _like(x, x.op, *[_push_reshape(a, with_shape(a.ty, shape), memo, concats) if hasattr(a, "op") else a
                               for a in x.args[:-1]], with_shape(x.ty, shape))
    elif x.op == "Reshape":
        inner = x.args[0]
        out = (distribute_reshapes(inner, memo, concats) if _shape(inner) == shape
               else _push_reshape(inner, with_shape(x.ty, shape), memo, concats))
    elif x.op == "Lit":
        out = _like(x, "Lit", x.args[0], with_shape(x.ty, shape))
    else:
        out = _like(x, "Reshape", distribute_reshapes(x, memo, concats), with_shape(x.ty, shape))
    memo[key] = out
    return out


def channel_parts(expr: Term, axis: int, start: int, stop: int) -> list[tuple[Term, int, int]]:
    """`[start, stop)` of `expr` along `axis` cut where its concats switch tensors: `(restricted
    expression, start, stop)` per part, in order (one part, `expr` itself restricted, when none does).
    A concat inside a reshaped block (a GroupNorm group) is cut in `distribute_reshapes(expr)`."""
    try:
        splits = concat_splits(expr, axis)
    except NotRestrictable:
        expr = distribute_reshapes(expr)
        splits = concat_splits(expr, axis)
    edges = sorted({start, stop} | {p for p in splits if start < p < stop})
    memo = {}
    return [(restrict(expr, axis, a, b, memo), a, b) for a, b in zip(edges, edges[1:])]
