"""How often a kernel's template evaluates its input expression, as extraction charges it.

The conv template (`emit/pallas/conv.py`, an implicit GEMM) computes its input expression (its
prologue: a GroupNorm apply + SiLU, say) at an index tile for every window tap and every
output-channel tile, so each element of it is computed `conv_prologue_evaluations` times (27 for
a 3×3 conv with 320 output channels), and `eqsat.cost.kernel_cost` charges the plan that way. A
node's own cost (`EGraphData.node_costs`) counts its flops once; this module is what extraction
charges instead inside a conv, the same way in every extractor:

- `NodeCosts`: the per-node seconds (a list, as before) with, per `Conv` node, its
  `ConvPrologue` (input class, feature axis, the weight's K ranges and how many times each
  evaluates an input element), and per node the seconds of one evaluation at one point of a tile
  (`point_seconds`: compute nodes) or of one evaluation (`evaluation_seconds`: a `RowReduce`).
- `prologue_charge(graph, costs, prologue, resolve)`: the seconds a conv kernel spends on its
  input expression under a choice of nodes (`resolve(class) -> node`), and the classes that
  covers (their once-only costs are not added again): the input splits at concats along its
  feature axis into K-range parts, each node of a part is charged per point of the part and per
  evaluation (`roofline.prologue_node_flops`), a node that does not vary over the pixels once per
  program and channel chunk (`roofline.ConvPrograms`), a `Load` stays one read per kernel, plus,
  for a hosted statistic, the merge of its partials once per program and chunk or, where that
  costs more, one finalize (`eqsat.cost.merges`; the plan's choice for a statistic with one
  reader). This is `roofline.conv_prologue_flops` and `roofline.merge_cost` on the built term.

A matmul's template computes its A expression once per N tile and its B expression once per M tile
(`NodeCosts.operand_repeats`, `operand_charge`), as `eqsat.cost.kernel_cost` charges it
(`eqsat.cost.prologues.matmul_prologue_flops`).

A plain list of costs (no `prologues`) charges every node once, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from eqsat.conv_params import ConvParams
from eqsat.cost import get_device
from eqsat.cost.merges import conv_host_tiles, finalize_seconds, merge_flops_per_lane
from eqsat.cost.roofline import (ConvPrograms, conv_prologue_evaluations, partial_tiles, prologue_node_flops,
                                 reduction_flops, zero_pad_taps)
from eqsat.cost.tiles import MatmulShape
from eqsat.types import parse_type


def _size(ty) -> int:
    return parse_type(ty).size if ty else 0


@dataclass(frozen=True)
class ConvPrologue:
    """A `Conv` node's input expression as the template evaluates it."""

    lhs: int                                     # the input expression's class
    axis: int                                    # its feature axis (K ranges split it)
    channels: int                                # its size along `axis`
    ranges: tuple[tuple[int, int, float, int], ...]   # (start, stop, evaluations per element, taps) per K range
    programs: ConvPrograms                            # what runs per program instead of per pixel

    def evaluations(self, lo: int, hi: int, ty: str | None = None) -> float:
        """Evaluations per element of the input channels [lo, hi), averaged over the K ranges there;
        with a node's type `ty`, as that node is charged (`ConvPrograms.evaluations`)."""
        total = 0.0
        for start, stop, evaluations, taps in self.ranges:
            overlap = min(stop, hi) - max(start, lo)
            if overlap > 0:
                total += overlap * (evaluations if ty is None else self.programs.evaluations(ty, evaluations))
        return total / max(hi - lo, 1)


class NodeCosts(list):
    """Seconds of each node's own work (a list, the extraction objective's terms) and what a conv's
    template repeats (see the module docstring)."""

    def __init__(self, seconds, prologues: dict[int, ConvPrologue], point_seconds: list[float],
                 evaluation_seconds: list[float], flop_seconds: float = 0.0, device="h100",
                 operand_repeats: dict[int, tuple[int, int]] | None = None, row_lanes: dict[int, int] | None = None):
        super().__init__(seconds)
        self.prologues = prologues
        # Matmul node -> (N tiles, M tiles): its A expression runs once per N tile, B once per M tile;
        # and the lanes of its pre-pass, which merges a row statistic's partials once per program row.
        self.operand_repeats = operand_repeats or {}
        self.row_lanes = row_lanes or {}
        self.point_seconds = point_seconds
        self.evaluation_seconds = evaluation_seconds
        self.flop_seconds = flop_seconds  # seconds of one vector flop
        self.device = device

    def in_prologue(self, node: int, points: float, evaluations: float) -> float | None:
        """The seconds of `node` inside a conv's input expression (`points` per evaluation, each
        `evaluations` times), or None for a node charged as usual (views, literals; a `Load`)."""
        per_point, per_evaluation = self.point_seconds[node], self.evaluation_seconds[node]
        if not per_point and not per_evaluation:
            return None
        return (per_point * points + per_evaluation) * evaluations


def node_costs(graph, device="h100") -> NodeCosts:
    """`NodeCosts` of every node of `graph` (an `EGraphData`) on `device`."""
    from eqsat.cost import node_cost

    device = get_device(device)
    vector = device.vector_seconds(1.0)
    # The Mosaic templates and the library calls compute a kernel's operand expressions once per
    # element, in the XLA fusion that lays the operand out (`eqsat.cost.backends`): no recompute.
    once = device.backend in ("mosaic", "hybrid")
    cache: dict[tuple, float] = {}
    seconds: list[float] = []
    point_seconds: list[float] = []
    evaluation_seconds: list[float] = []
    prologues: dict[int, ConvPrologue] = {}
    prologue_cache: dict[tuple, ConvPrologue | None] = {}
    operand_repeats: dict[int, tuple[int, int]] = {}
    row_lanes: dict[int, int] = {}
    for node, op in enumerate(graph.node_op):
        weights = graph.nonzero_weight_elements(graph.node_children[node][1]) if op == "Conv" else None
        key = (op, graph.node_args(node), weights)
        value = cache.get(key)
        if value is None:
            value = node_cost(op, key[1], device, weights).seconds
            cache[key] = value
        seconds.append(value)
        name = graph.node_literals[node][0] if op in ("Unary", "Binary") else ""
        point_seconds.append(prologue_node_flops(op, 1.0, 1.0, name=name) * vector)
        if op == "RowReduce":
            reduced = _size(graph.class_type[graph.node_children[node][1]])
            evaluation_seconds.append(reduction_flops(graph.node_literals[node][0], reduced) * vector)
        else:
            evaluation_seconds.append(0.0)
        if op == "Matmul":
            args = graph.node_args(node)
            shape = MatmulShape(args[0], args[1], args[2])
            if not once:
                operand_repeats[node] = (shape.n_tiles, shape.m_tiles)
            row_lanes[node] = shape.batch * shape.m_tiles * shape.block_m * shape.n_tiles
        if op == "Conv":
            lhs, rhs = graph.node_children[node][0], graph.node_children[node][1]
            key = (lhs, rhs, graph.node_literals[node][2], graph.node_literals[node][4])
            if key not in prologue_cache:
                prologue_cache[key] = conv_prologue(graph, *key)
            if prologue_cache[key] is not None and not once:
                prologues[node] = prologue_cache[key]
            if device.calibrated:  # its MMA over the weight's own K ranges, as `kernel_cost` prices it
                args = graph.node_args(node)
                rhs_spec = ConvParams.parse(args[2]).rhs_spec
                ranges = tuple((stop - start, taps) for start, stop, taps in
                               weight_ranges(graph, rhs, rhs_spec, parse_type(args[1]).shape))
                range_key = (op, args, weights, ranges)
                if range_key not in cache:
                    cache[range_key] = node_cost(op, args, device, weights, ranges).seconds
                seconds[-1] = cache[range_key]
    return NodeCosts(seconds, prologues, point_seconds, evaluation_seconds, vector, device, operand_repeats, row_lanes)


def conv_prologue(graph, lhs: int, rhs: int, params: str, out_ty: str) -> ConvPrologue | None:
    """The `ConvPrologue` of a conv reading input class `lhs` with weight class `rhs` (None when
    the template evaluates its input once per element: nothing to add)."""
    from eqsat.conv_params import ConvParams
    from eqsat.tiling.conv import UncoveredConv

    p = ConvParams.parse(params)
    lhs_ty, rhs_ty = graph.class_type[lhs], graph.class_type[rhs]
    if not lhs_ty or not rhs_ty:
        return None
    rhs_shape = parse_type(rhs_ty).shape
    channels = parse_type(lhs_ty).shape[p.lhs_spec[1]]
    try:
        ranges = tuple((start, stop, conv_prologue_evaluations(lhs_ty, rhs_ty, params, out_ty, taps), taps)
                       for start, stop, taps in weight_ranges(graph, rhs, p.rhs_spec, rhs_shape))
    except UncoveredConv:  # a transposed or grouped conv (a backward's): not the template's, no re-evaluation
        return None
    if all(abs(evaluations - 1.0) < 1e-12 for _, _, evaluations, _ in ranges):
        return None
    return ConvPrologue(lhs, p.lhs_spec[1], channels, ranges,
                        ConvPrograms.of(lhs_ty, rhs_ty, params, out_ty))


def weight_ranges(graph, rhs: int, rhs_spec, rhs_shape, depth: int = 4) -> list[tuple[int, int, int]]:
    """(start, stop, taps) per K range of a conv weight class: its in-feature axis split where the
    weight is a concat, a range over `pad(w, 0)` on the window axes running over `w`'s taps only
    (the conv template skips zero taps). The form with the fewest non-zero weights, like
    `EGraphData.nonzero_weight_elements`."""
    axis = rhs_spec[1]
    window = math.prod(rhs_shape[a] for a in rhs_spec[2:])

    def best(cls: int, remaining: int) -> tuple[int, list[tuple[int, int, int]]]:
        shape = parse_type(graph.class_type[cls]).shape
        found = (math.prod(shape), [(0, shape[axis], window)])
        if remaining == 0:
            return found
        for node in graph.class_nodes[cls]:
            op, kids, literals = graph.node_op[node], graph.node_children[node], graph.node_literals[node]
            if op == "Concat" and literals[2] == axis:
                left, right = best(kids[0], remaining - 1), best(kids[1], remaining - 1)
                split = literals[3]
                candidate = (left[0] + right[0], left[1] + [(a + split, b + split, t) for a, b, t in right[1]])
            elif op == "Pad" and graph._is_zero_class(kids[1]):
                inner_shape = parse_type(graph.class_type[kids[0]]).shape
                taps = zero_pad_taps(literals[2], inner_shape, rhs_spec)
                if taps is None:
                    continue
                candidate = (math.prod(inner_shape), [(0, shape[axis], taps)])
            else:
                continue
            if candidate[0] < found[0]:
                found = candidate
        return found

    return best(rhs, depth)[1]


def prologue_charge(graph, costs: NodeCosts, prologue: ConvPrologue,
                    resolve: Callable[[int], int | None]) -> tuple[float, set[int]]:
    """The seconds a conv spends on its input expression when each class `c` of it is computed by
    node `resolve(c)`, and the classes charged (see the module docstring); `inf` if one has no node."""
    node_op, node_children, node_literals = graph.node_op, graph.node_children, graph.node_literals
    total = 0.0
    covered: set[int] = set()
    descend = [(prologue.lhs, 0, prologue.channels)]
    while descend:
        cls, lo, hi = descend.pop()
        node = resolve(cls)
        if node is None:
            return math.inf, covered
        if node_op[node] == "Concat" and node_literals[node][2] == prologue.axis:
            covered.add(cls)
            total += costs[node]
            left, right = node_children[node][0], node_children[node][1]
            split = lo + node_literals[node][3]
            descend += [(right, split, hi), (left, lo, split)]
            continue
        points = _size(graph.class_type[cls])
        stack, seen = [cls], set()
        while stack:
            part_cls = stack.pop()
            if part_cls in seen:
                continue
            seen.add(part_cls)
            node = resolve(part_cls)
            if node is None:
                return math.inf, covered
            covered.add(part_cls)
            if node_op[node] == "Load":  # a read: charged once per kernel by the caller
                tensor = resolve(node_children[node][0])
                if tensor is not None and node_op[tensor] == "EpilogueReduce":  # merged per program and chunk
                    total += _statistic_merge_seconds(graph, costs, tensor, points * prologue.evaluations(
                        lo, hi, graph.class_type[node_children[node][0]]), resolve)
                continue
            charge = costs.in_prologue(node, points, prologue.evaluations(lo, hi, graph.class_type[part_cls]))
            total += costs[node] if charge is None else charge
            stack.extend(c for c in node_children[node] if c >= 0)
    return total, covered


def _statistic_merge_seconds(graph, costs: NodeCosts, statistic: int, lanes: float, resolve) -> float:
    """What a conv reading the hosted statistic e-node `statistic` at `lanes` merge lanes pays for
    it: the merge in place, or at most finishing it once (the plan finishes it when that prices
    lower: `eqsat.cost.roofline.finished_statistics`; exact for a statistic with one reader). Its
    tiles are those of its producer when that is a conv (`merges.conv_host_tiles`) or a matmul (its N tiles)."""
    children, literals = graph.node_children[statistic], graph.node_literals[statistic]
    op, ty = literals[1], literals[4]
    shape = parse_type(ty).shape
    slots = max(1, math.prod(shape[1:] if op == "moments" else shape))
    producer = resolve(children[0])
    if producer is not None and graph.node_op[producer] == "Conv":
        lhs_class, rhs_class = graph.node_children[producer][:2]
        tiles = conv_host_tiles(graph.class_type[lhs_class], graph.class_type[rhs_class],
                                graph.node_literals[producer][2], graph.node_literals[producer][4], slots)
    elif producer is not None and graph.node_op[producer] == "Matmul":
        tiles = costs.operand_repeats[producer][0]  # a row per N tile (`eqsat.cost.merges.host_tiles`)
    else:
        tiles = partial_tiles(graph.class_type[children[2]])
    merge = lanes * merge_flops_per_lane(op, tiles) * costs.flop_seconds
    return min(merge, finalize_seconds(op, ty, tiles, costs.device))


def operand_charge(graph, costs: NodeCosts, node: int, resolve: Callable[[int], int | None]) -> tuple[float, set[int]]:
    """The seconds matmul `node` spends on its operand expressions when each class `c` of them is
    computed by node `resolve(c)`, and the classes charged: every node of the A expression (not
    entering the tensors it loads) once per N tile, then every node of the B expression not in A
    once per M tile, each at its own cost (`eqsat.cost.prologues.matmul_prologue_flops` on the built
    term), and a hosted statistic it loads merged as the template does (A: once per program row in
    its pre-pass, a row statistic; B: per element and M tile), or at most one finalize
    (`_statistic_merge_seconds`); `inf` if a class has no node. A `Load`'s read is left to the
    caller (one read per kernel)."""
    n_tiles, m_tiles = costs.operand_repeats[node]
    node_op, node_children = graph.node_op, graph.node_children
    lhs, rhs = node_children[node][0], node_children[node][1]
    total, covered, merged = 0.0, set(), set()
    for operand, repeats in ((lhs, n_tiles), (rhs, m_tiles)):
        stack = [operand]
        while stack:
            cls = stack.pop()
            if cls in covered or graph.class_sort[cls] != "Expr":
                continue
            chosen = resolve(cls)
            if chosen is None:
                return math.inf, covered
            if node_op[chosen] == "Load":  # its read is charged by the caller, once (not covered)
                tensor_cls = node_children[chosen][0]
                tensor = resolve(tensor_cls)
                if tensor is not None and node_op[tensor] == "EpilogueReduce" and tensor_cls not in merged:
                    merged.add(tensor_cls)  # a hosted statistic: A's pre-pass merges it per program row,
                    lanes = costs.row_lanes[node] if operand == lhs else \
                        _size(graph.class_type[cls]) * m_tiles  # B's every element per M tile
                    total += _statistic_merge_seconds(graph, costs, tensor, lanes, resolve)
                continue
            covered.add(cls)
            total += costs[chosen] * repeats
            stack.extend(c for c in node_children[chosen] if c >= 0)
    return total, covered
