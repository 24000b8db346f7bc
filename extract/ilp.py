"""Exact extraction as an integer linear program (`scipy.optimize.milp`, HiGHS).

The program chooses the same thing the plan is made of: one node per materialized tensor class
(shared by all readers) and, inside each kernel, one node per expression class it computes (an
expression is recomputed in every kernel that uses it). Variables, one binary per line:

    x[T, n]     tensor class T is produced by node n (a kernel or a leaf)
    y[T, E, m]  inside the kernel of T, expression class E is computed by node m
    y[T, n, E, m]  the same inside conv node n's input expression, which its template computes per
                window tap and output-channel tile: m costs that many evaluations (`extract.prologue`)
    o[T]        (continuous, 0..|C|-1) topological position of tensor class T on a cycle C
    o[T, E]     (continuous) position of E inside T's kernel, on expression cycles only

Constraints:

    sum_n x[R, n] = 1                      every root is produced
    sum_n x[T, n] <= 1, sum_m y[T,E,m] <= 1   at most one node per slot
    x[T, n] <= sum_m y[T, E, m]            a kernel's expression children are computed in it
                                           (a conv's input: sum_m y[T, n, E, m])
    y[T, E, m] <= sum_m' y[T, E', m']      so are an expression's expression children
    y[T, n, E, m] + sum_(m' != m) y[T, E, m'] <= 1   one node per class and kernel
    x or y <= sum_n x[D, n]                a read tensor D (a Load's or an operand) is produced
    o[T] - o[D] >= 1 - M (1 - x or y)      reads go to earlier tensors (acyclic), for T, D on a
                                           cycle of the tensor graph; the same for o[T, E]

Objective: the sum of node costs (`EGraphData.node_costs`) over chosen `x` and `y`: launch,
output write and dense flops for each kernel, each read once per kernel, each expression node's
flops once per kernel, a conv input's as often as the template evaluates them (the K-range part
of a class is the first a breadth-first walk from the input reaches it by); the roofline model of
`eqsat.cost.kernel_cost`, up to partial reads through slices, a class shared by two K ranges
(charged once here) and a matmul's operand expressions (once here, once per N or M tile in
`Selection.cost`: `extract.prologue.operand_charge`); `extract.extract` compares the ILP's plan with
the greedy one on the finished plan's price.

A region: only tensor classes in `region` are free; the rest keep the `incumbent` selection.
An outside tensor may be read if the incumbent materializes it (or it is an input); region
tensors that outside kernels read stay produced; an outside tensor that depends (in the
incumbent) on region tensors orders after them.

Expression contexts are cut at `max_context_classes` classes per kernel: deeper inlining must go
through a `Load`. `node_limit` (branch-and-bound nodes) keeps the solve deterministic; at the
`time_limit` HiGHS stops with the best solution so far and the result says `stopped="time_limit"`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from extract.serialized import EPSILON, GLOBAL, EGraphData, Selection, reachable_classes

_LEAF_OPS = frozenset({"Input", "Constant", "LoopArg"})
_SCALE = 1e6  # solve in microseconds: HiGHS's absolute tolerances would swallow costs in seconds


@dataclass
class IlpResult:
    selection: Selection | None   # None when no solution was found in time
    status: str                   # "optimal", "feasible" (a limit stopped it), "infeasible", "too large", ...
    objective: float
    variables: int
    constraints: int
    seconds: float
    stopped: str | None = None    # "time_limit" when HiGHS stopped at the time limit

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"


class _Rows:
    """Sparse constraint rows `lb <= a.x <= ub`."""

    def __init__(self):
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, terms, lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in terms:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def __len__(self) -> int:
        return len(self.lb)


def extract_ilp(graph: EGraphData, roots, costs, *, region=None, incumbent: Selection | None = None,
                time_limit: float = 10.0, node_limit: int | None = 2000, max_context_classes: int = 64,
                max_variables: int = 200_000, banned=()) -> IlpResult:
    """Solve the extraction ILP for `roots` (class indices); see the module docstring."""
    started = time.perf_counter()
    roots = list(roots)
    banned = set(banned)
    is_tensor = [s == "Tensor" for s in graph.class_sort]
    reachable = reachable_classes(graph, roots)
    all_tensors = [c for c in reachable if is_tensor[c]]
    free = set(all_tensors) if region is None else {c for c in region if is_tensor[c]} & set(all_tensors)
    if region is not None and incumbent is None:
        raise ValueError("a region needs an incumbent selection for the classes outside it")

    # --- outside the region: what the incumbent materializes, needs from us, and depends on ----
    paid: set[int] = set()
    required: set[int] = {r for r in roots if r in free}
    depends_on: dict[int, set[int]] = {}  # outside tensor -> region tensors below it
    if region is not None:
        order = incumbent.postorder()
        outside_tensors = [c for c, ctx in order if ctx == GLOBAL and is_tensor[c] and c not in free]
        paid = set(outside_tensors)
        for tensor in outside_tensors:
            reads = _context_reads(incumbent, tensor)
            required.update(r for r in reads if r in free)
            below: set[int] = set()
            for r in reads:
                if r in free:
                    below.add(r)
                else:
                    below |= depends_on.get(r, set())
            depends_on[tensor] = below
        for r in roots:
            if r not in free and r not in paid:
                return IlpResult(None, "root outside region", float("nan"), 0, 0, 0.0)

    def readable(tensor: int) -> bool:
        return tensor in free or tensor in paid or _is_leaf_class(graph, tensor)

    # --- variables -------------------------------------------------------------------------
    var_slot: list[tuple] = []   # (class, context) per variable; a context is GLOBAL, a tensor class,
    var_node: list[int] = []     # or ("input", conv node, tensor class) for a conv's input expression
    var_cost: dict[int, float] = {}  # objective terms other than the node's own cost
    slot_vars: dict[tuple, list[int]] = {}
    prologues = getattr(costs, "prologues", None) or {}

    def new_var(cls: int, context, node: int) -> int:
        index = len(var_node)
        var_slot.append((cls, context))
        var_node.append(node)
        slot_vars.setdefault((cls, context), []).append(index)
        return index

    contexts: dict[int, list[int]] = {}
    input_parts: dict[tuple, dict[int, tuple[float, float]]] = {}
    for tensor in sorted(free):
        convs = []
        for node in graph.class_nodes[tensor]:
            if node not in banned:
                new_var(tensor, GLOBAL, node)
                if node in prologues:
                    convs.append(node)
        must = _incumbent_context(incumbent, tensor) if incumbent is not None else []
        contexts[tensor] = _context_classes(graph, tensor, is_tensor, banned, max_context_classes, must)
        for cls in contexts[tensor]:
            for node in graph.class_nodes[cls]:
                if node not in banned:
                    new_var(cls, tensor, node)
        for conv in convs:  # its input expression, charged as often as its template computes it
            context = ("input", conv, tensor)
            input_parts[context] = parts = _prologue_parts(graph, prologues[conv], set(contexts[tensor]))
            for cls, (points, evaluations) in parts.items():
                for node in graph.class_nodes[cls]:
                    if node not in banned:
                        charge = costs.in_prologue(node, points, evaluations)
                        var = new_var(cls, context, node)
                        if charge is not None:
                            var_cost[var] = charge
        if len(var_node) > max_variables:
            return IlpResult(None, "too large", float("nan"), len(var_node), 0, time.perf_counter() - started)
    # Outside tensors read by region kernels but not free: constants (always there or forbidden).
    num_x = len(var_node)

    rows = _Rows()
    fixed_zero: set[int] = set()
    # Tensor-level dependency edges (for cycle constraints): (var, reader tensor, read tensor).
    tensor_edges: list[tuple[int, int, int]] = []
    expr_edges: list[tuple[int, int, int, int]] = []  # (var, context, parent class, child class)

    for var in range(num_x):
        cls, context = var_slot[var]
        node = var_node[var]
        owner = cls if context == GLOBAL else context[2] if isinstance(context, tuple) else context
        scope = owner if not isinstance(context, tuple) else context  # where its expression children live
        prologue = prologues.get(node) if context == GLOBAL else None
        for child in sorted(set(c for c in graph.node_children[node] if c >= 0)):
            if is_tensor[child]:
                if not readable(child):
                    fixed_zero.add(var)
                    continue
                if child == owner:
                    fixed_zero.add(var)  # a kernel reading its own output
                    continue
                if child in free:
                    rows.add([(var, 1.0)] + [(v, -1.0) for v in slot_vars.get((child, GLOBAL), [])], -np.inf, 0.0)
                    tensor_edges.append((var, owner, child))
                else:
                    for below in sorted(depends_on.get(child, ())):
                        tensor_edges.append((var, owner, below))
            else:
                child_scope = scope
                if prologue is not None and child == prologue.lhs and ("input", node, cls) in input_parts:
                    child_scope = ("input", node, cls)
                child_vars = slot_vars.get((child, child_scope))
                if not child_vars:
                    fixed_zero.add(var)  # beyond the context cut
                    continue
                if child == cls and context != GLOBAL:
                    fixed_zero.add(var)
                    continue
                rows.add([(var, 1.0)] + [(v, -1.0) for v in child_vars], -np.inf, 0.0)
                if context != GLOBAL:
                    expr_edges.append((var, scope, cls, child))

    for slot, variables in slot_vars.items():
        cls, context = slot
        if context == GLOBAL and cls in required:
            rows.add([(v, 1.0) for v in variables], 1.0, 1.0)
        else:
            rows.add([(v, 1.0) for v in variables], 0.0, 1.0)
        if isinstance(context, tuple):  # one node per class in a kernel: as its input, and elsewhere in it
            elsewhere = slot_vars.get((cls, context[2]), ())
            for v in variables:
                others = [(w, 1.0) for w in elsewhere if var_node[w] != var_node[v]]
                if others:
                    rows.add([(v, 1.0)] + others, 0.0, 1.0)

    # --- acyclicity: positions on cycles of the possible-read graph ------------------------
    order_index: dict[tuple[int, int], int] = {}
    extra = 0

    def cyclic_edges(edges, key_of):
        """The edges whose endpoints share a strongly connected component."""
        successors: dict = {}
        for edge in edges:
            a, b = key_of(edge)
            successors.setdefault(a, set()).add(b)
            successors.setdefault(b, set())
        label = _scc(successors)
        return [edge for edge in edges if label[key_of(edge)[0]] == label[key_of(edge)[1]]], label

    cyc_tensor, tensor_label = cyclic_edges(tensor_edges, lambda e: (e[1], e[2]))
    cyc_expr, expr_label = cyclic_edges(expr_edges, lambda e: ((e[1], e[2]), (e[1], e[3])))
    component_size: dict = {}
    for key, lab in tensor_label.items():
        component_size[("t", lab)] = component_size.get(("t", lab), 0) + 1
    for key, lab in expr_label.items():
        component_size[("e", lab)] = component_size.get(("e", lab), 0) + 1

    def position(key) -> int:
        nonlocal extra
        if key not in order_index:
            order_index[key] = num_x + extra
            extra += 1
        return order_index[key]

    big_m: dict[int, float] = {}
    for var, reader, read in cyc_tensor:
        size = component_size[("t", tensor_label[reader])]
        a, b = position(("t", reader)), position(("t", read))
        big_m[a] = big_m[b] = float(size - 1)
        rows.add([(a, 1.0), (b, -1.0), (var, -float(size))], 1.0 - size, np.inf)
    for var, context, parent, child in cyc_expr:
        size = component_size[("e", expr_label[(context, parent)])]
        a, b = position(("e", context, parent)), position(("e", context, child))
        big_m[a] = big_m[b] = float(size - 1)
        rows.add([(a, 1.0), (b, -1.0), (var, -float(size))], 1.0 - size, np.inf)

    total = num_x + extra
    c = np.zeros(total)
    for var in range(num_x):
        c[var] = (var_cost.get(var, costs[var_node[var]]) + EPSILON) * _SCALE
    integrality = np.zeros(total)
    integrality[:num_x] = 1
    lower = np.zeros(total)
    upper = np.ones(total)
    for var in fixed_zero:
        upper[var] = 0.0
    for index in range(num_x, total):
        upper[index] = big_m.get(index, 1.0)
    if not len(rows):
        return IlpResult(None, "empty", float("nan"), total, 0, time.perf_counter() - started)
    matrix = coo_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows), total)).tocsr()
    options = {"time_limit": max(time_limit - (time.perf_counter() - started), 0.1), "presolve": True,
               "mip_rel_gap": 1e-7}
    if node_limit is not None:
        options["node_limit"] = node_limit
    result = milp(c, integrality=integrality, bounds=Bounds(lower, upper),
                  constraints=LinearConstraint(matrix, np.array(rows.lb), np.array(rows.ub)), options=options)
    seconds = time.perf_counter() - started
    stopped = "time_limit" if result.status == 1 and result.message.startswith("Time limit") else None
    if result.x is None:
        status = {2: "infeasible", 3: "unbounded"}.get(result.status, "no solution")
        return IlpResult(None, status, float("nan"), total, len(rows), seconds, stopped)
    status = "optimal" if result.status == 0 else "feasible"
    chosen = np.flatnonzero(result.x[:num_x] > 0.5)
    nodes: dict[tuple[int, int], int] = {}
    for var in chosen:
        cls, context = var_slot[var]
        slot = (cls, context[2]) if isinstance(context, tuple) else (cls, context)
        if slot not in nodes:
            nodes[slot] = var_node[var]
    if region is not None:
        for slot, node in incumbent.nodes.items():
            cls, context = slot
            owner = cls if context == GLOBAL and is_tensor[cls] else context
            if owner == GLOBAL:
                owner = None
            if (owner is None or owner not in free) and not (context == GLOBAL and cls in free):
                nodes.setdefault(slot, node)
    selection = Selection(graph, nodes, roots)
    try:
        reached = selection.postorder()
    except ValueError:
        return IlpResult(None, "invalid", float(result.fun) / _SCALE, total, len(rows), seconds, stopped)
    selection.nodes = {slot: nodes[slot] for slot in reached}
    return IlpResult(selection, status, float(result.fun) / _SCALE, total, len(rows), seconds, stopped)


def _prologue_parts(graph: EGraphData, prologue, classes: set[int]) -> dict[int, tuple[float, float]]:
    """(points, evaluations per element) of each class in `classes` a conv's input may reach: the
    concats along the feature axis split it into K-range parts (`extract.prologue`); first reach wins."""
    parts: dict[int, tuple[float, float]] = {}
    queue = [(prologue.lhs, 0, prologue.channels, 0)]
    seen = {prologue.lhs}
    head = 0
    while head < len(queue):
        cls, lo, hi, points = queue[head]
        head += 1
        if points == 0:  # still splitting at concats: this class is its own part
            own = graph.class_type[cls]
            part_points = _size(own)
        else:
            part_points = points
        parts[cls] = (part_points, prologue.evaluations(lo, hi))
        for node in graph.class_nodes[cls]:
            op, literals = graph.node_op[node], graph.node_literals[node]
            if op == "Load":
                continue
            kids = [c for c in graph.node_children[node] if c >= 0]
            if points == 0 and op == "Concat" and literals[2] == prologue.axis:
                split = lo + literals[3]
                reached = [(kids[0], lo, split, 0), (kids[1], split, hi, 0)]
            else:
                reached = [(c, lo, hi, part_points) for c in kids]
            for key in reached:
                if key[0] in classes and key[0] not in seen:
                    seen.add(key[0])
                    queue.append(key)
    return parts


def _size(ty) -> int:
    from eqsat.types import parse_type

    return parse_type(ty).size if ty else 0


def _is_leaf_class(graph: EGraphData, cls: int) -> bool:
    return any(graph.node_op[n] in _LEAF_OPS for n in graph.class_nodes[cls])


def _context_reads(selection: Selection, tensor: int) -> set[int]:
    """The tensor classes the kernel of `tensor` reads under `selection`."""
    reads: set[int] = set()
    seen = {(tensor, GLOBAL)}
    stack = [(tensor, GLOBAL)]
    graph = selection.graph
    while stack:
        slot = stack.pop()
        for child in selection.child_slots(slot):
            if graph.class_sort[child[0]] == "Tensor":
                reads.add(child[0])
            elif child not in seen:
                seen.add(child)
                stack.append(child)
    return reads


def _incumbent_context(selection: Selection, tensor: int) -> list[int]:
    """The expression/list classes the kernel of `tensor` computes under `selection` (if chosen)."""
    if (tensor, GLOBAL) not in selection.nodes:
        return []
    graph = selection.graph
    seen = {(tensor, GLOBAL)}
    stack = [(tensor, GLOBAL)]
    classes: list[int] = []
    while stack:
        slot = stack.pop()
        for child in selection.child_slots(slot):
            if graph.class_sort[child[0]] == "Tensor" or child in seen:
                continue
            seen.add(child)
            classes.append(child[0])
            stack.append(child)
    return classes


def _context_classes(graph: EGraphData, tensor: int, is_tensor, banned, limit: int, must=()) -> list[int]:
    """Expression/list classes a kernel of `tensor` may compute: `must` (the incumbent's), then
    breadth first from the kernel's operands until `limit` classes."""
    seen: dict[int, None] = dict.fromkeys(must)
    frontier: list[int] = []
    for node in graph.class_nodes[tensor]:
        if node in banned:
            continue
        for child in graph.node_children[node]:
            if child >= 0 and not is_tensor[child] and child not in seen:
                seen[child] = None
                frontier.append(child)
    head = 0
    limit = max(limit, len(seen) + 8)
    while head < len(frontier) and len(seen) < limit:
        cls = frontier[head]
        head += 1
        for node in graph.class_nodes[cls]:
            if node in banned:
                continue
            for child in graph.node_children[node]:
                if child >= 0 and not is_tensor[child] and child not in seen and len(seen) < limit:
                    seen[child] = None
                    frontier.append(child)
    return sorted(seen)


def _scc(successors: dict) -> dict:
    """Strongly connected component label per key of `successors` (iterative Tarjan)."""
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    label: dict = {}
    counter = 0
    for start in sorted(successors, key=repr):
        if start in index:
            continue
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(successors[start], key=repr)))]
        while work:
            key, it = work[-1]
            advanced = False
            for child in it:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors[child], key=repr))))
                    advanced = True
                    break
                if child in on_stack:
                    low[key] = min(low[key], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[key])
            if low[key] == index[key]:
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    label[member] = key
                    if member == key:
                        break
    return label

