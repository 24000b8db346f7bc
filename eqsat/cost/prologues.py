"""The work of a kernel's operand expressions as its template runs them.

The conv template (`emit/pallas/conv.py`, an implicit GEMM) computes its input expression at an
index tile for every window tap and every output-channel tile: each input element once per tap
that reads it and per `ceil(Cout / block_n)` tiles, at every node of the expression (views and
broadcasts are index arithmetic: a statistic broadcast over the tile is computed per element).
Channel ranges split by a concat (`concat(h, skip)`, a merged shortcut) run over their own taps.
The matmul template computes its A expression once per N tile, its B expression once per M tile.
"""

from __future__ import annotations

from eqsat.conv_params import ConvParams
from eqsat.cost.terms import COMPUTE_OPS, HOSTED_OPS, Term, compute_flops, expr_nodes, reduction_flops, size_of
from eqsat.cost.tiles import ConvPrograms, conv_parts, conv_prologue_evaluations, matmul_shape
from eqsat.tiling.conv import UncoveredConv
from eqsat.types import parse_type


def prologue_node_flops(op: str, points: float, evaluations: float, reduced: int = 0, reduction: str = "",
                        name: str = "") -> float:
    """Flops of one node of a conv's input expression as the template runs it: a compute node once
    per point of its K range's index tile (`points` elements of the range's expression; a statistic
    broadcast over the tile is computed per element), `evaluations` times
    (`conv_prologue_evaluations`); a `RowReduce` reduces its `reduced` elements `evaluations` times;
    views, literals and loads compute nothing (a load's bytes are read once per kernel). `name`:
    a compute node's op name (`compute_flops`)."""
    if op in COMPUTE_OPS:
        return compute_flops(op, name, points) * evaluations
    if op == "RowReduce":
        return reduction_flops(reduction, reduced) * evaluations
    return 0.0


def conv_prologue_flops(conv: Term) -> tuple[float, set[int]]:
    """The flops a `Conv` kernel spends on its input expression as the template runs it, and the
    ids of the expression nodes they cover: each node `prologue_node_flops` per K range it is in.
    A hosted statistic's merge is not included (`conv_prologue_work`, `eqsat.cost.merges`)."""
    flops, covered, _lanes = conv_prologue_work(conv)
    return flops, covered


def conv_prologue_work(conv: Term) -> tuple[float, set[int], dict]:
    """`conv_prologue_flops`, and per hosted statistic the input expression loads, the lanes that
    merge its partials when it is read unfinished: once per program and channel chunk (the
    template hoists what does not vary over the pixels), at every evaluation where it does."""
    lhs, rhs, params, _epilogue, ty = conv.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    try:
        programs = ConvPrograms.of(lhs.ty, rhs.ty, params, ty)
    except UncoveredConv:  # a transposed or grouped conv (a backward's): the XLA emitter runs it, input once
        programs = None
    flops, covered, lanes = 0.0, set(), {}
    for part, taps, fraction in conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window):
        per_point = 1.0 if programs is None else conv_prologue_evaluations(lhs.ty, rhs.ty, params, ty, taps)
        points = size_of(part.ty) * fraction
        stack, seen = [part], set()
        while stack:
            node = stack.pop()
            if id(node) in seen or node.sort != "Expr":
                continue
            seen.add(id(node))
            evaluations = 1.0 if programs is None else programs.evaluations(node.ty, per_point)
            if node.op == "RowReduce":
                flops += prologue_node_flops(node.op, points, evaluations, size_of(node.args[1].ty), node.args[0])
            elif node.op == "Load" and node.args[0].op in HOSTED_OPS:
                statistic = node.args[0]
                lanes[statistic] = lanes.get(statistic, 0.0) + points * (
                    1.0 if programs is None else programs.evaluations(statistic.ty, per_point))
            else:
                flops += prologue_node_flops(node.op, points, evaluations,
                                             name=node.args[0] if node.op in COMPUTE_OPS else "")
            covered.add(id(node))
            stack.extend(node.children)
    return flops, covered, lanes


def matmul_prologue_flops(matmul: Term) -> tuple[float, set[int]]:
    """The flops a `Matmul` kernel spends on its operand expressions as the template runs them,
    and the ids of the nodes they cover: each program (batch, M tile, N tile) computes its A tile's
    expression (a LayerNorm apply, GEGLU's `value * gelu(gate)`) and its pre-pass row statistics
    over its rows, so the A prologue runs once per N tile (`n_tiles = N / block_n`, the template's
    `MatmulBlocks`), the B prologue once per M tile; the epilogue once per output element."""
    lhs, rhs, _dims, _epilogue, _ty = matmul.args
    shape = matmul_shape(matmul)
    flops, covered = 0.0, set()
    for operand, repeats in ((lhs, shape.n_tiles), (rhs, shape.m_tiles)):
        for node in expr_nodes(operand):
            if id(node) in covered:
                continue
            covered.add(id(node))
            if node.op in COMPUTE_OPS:
                flops += compute_flops(node.op, node.args[0], size_of(node.ty)) * repeats
            elif node.op == "RowReduce":
                flops += reduction_flops(node.args[0], size_of(node.args[1].ty)) * repeats
    return flops, covered
