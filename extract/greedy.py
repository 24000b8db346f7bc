"""Greedy DAG-aware extraction: bottom-up costs where every materialized tensor is paid once.

Each e-class keeps its best node and two numbers that say what choosing it costs:

- `local`: the node's own cost plus, through `Expr`/`TensorList` children, their `local`s (an
  expression inside one kernel is computed there, so it is summed as a tree), and
- `deps`: the set of tensor classes that must be materialized for it (a Python int used as a
  bitset; a tensor child contributes its bit and its own `deps`).

The total of a choice is `local + W(deps)`, `W` summing the current `local` of each tensor class
in the set, so a tensor shared by several consumers is counted once. Two candidates of a class
are compared through the symmetric difference of their sets only, which is small in practice.

An Expr class also keeps `inner`, its best node other than a `Load`: a consumer may read
`Load(P)` while `P`'s own kernel computes the body that `Load(P)` equals (one e-class, two slots,
see `serialized.Selection`). A kernel node of class `P` whose child's best choice depends on `P`
uses the child's `inner` choice; a candidate that still depends on its own class is a cycle and
is skipped. Classes on cycles of the class graph get bits too (weight 0), only for that check.

Order: Kahn's (a node is first evaluated once all its children have a value); then every node
whose children (or whose read tensors' costs) changed is re-evaluated, in Kahn order, until no
class changes: the fixed point (with a budget of evaluations per node). If a stale set lets a cycle through, the
node closing it is banned and the search reruns.

Rounds, each scored by the caller's `score` (the plan's roofline cost), the best kept:
1. shared: a tensor's weight is divided among the classes that could read it. An expression
   inlined into k consumers is computed k times, while a tensor is written once and read k times;
   without the split, inlining always looks cheaper locally (the tensor's cost includes the same
   expression) and long elementwise chains get recomputed in every consumer. The split also lets
   one horizontally fused kernel (QKV) win over three separate ones that each look cheaper alone;
2. reuse: tensors that round 1 materializes count as already paid, so a consumer may reuse a
   tensor another consumer needs anyway instead of recomputing it (in a fused epilogue, say);
3. plain: whole weights.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from extract.serialized import (
    EPSILON,
    GLOBAL,
    EGraphData,
    Selection,
    reachable_classes,
    strongly_connected,
)

_TOLERANCE = 1e-17


@dataclass
class GreedyResult:
    selection: Selection
    score: float
    sweeps: float  # node evaluations per node, summed over rounds
    rounds: list[tuple[str, float]]  # (round name, score)


class _Weights:
    """`W(bits)`: the sum of per-bit weights over a Python-int bitset."""

    def __init__(self, count: int):
        self.values = np.zeros(max(count, 1), dtype=np.float64)
        self.nbytes = (count + 7) // 8 or 1

    def total(self, bits: int) -> float:
        if not bits:
            return 0.0
        if bits.bit_count() <= 48:
            values = self.values
            total = 0.0
            while bits:
                low = bits & -bits
                total += values[low.bit_length() - 1]
                bits ^= low
            return float(total)
        raw = np.frombuffer(bits.to_bytes(self.nbytes, "little"), dtype=np.uint8)
        mask = np.unpackbits(raw, bitorder="little")[: len(self.values)].astype(bool)
        return float(self.values[mask].sum())


class _Problem:
    """What every pass shares: reachable classes, bits, candidate nodes, parents."""

    def __init__(self, graph: EGraphData, roots: list[int], costs):
        self.graph = graph
        self.roots = roots
        self.costs = [c + EPSILON for c in costs]
        classes = reachable_classes(graph, roots)
        self.classes = classes
        scc = strongly_connected(graph, classes)
        scc_size: dict[int, int] = {}
        for cls in classes:
            scc_size[scc[cls]] = scc_size.get(scc[cls], 0) + 1
        self.is_tensor = [False] * graph.num_classes
        self.bit_of: dict[int, int] = {}
        for cls in classes:
            tensor = graph.class_sort[cls] == "Tensor"
            self.is_tensor[cls] = tensor
            looped = any(cls in graph.node_children[n] for n in graph.class_nodes[cls])
            if tensor or scc_size[scc[cls]] > 1 or looped:
                self.bit_of[cls] = len(self.bit_of)
        self.mask = {cls: 1 << bit for cls, bit in self.bit_of.items()}
        self.children: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, list[int]] = {cls: [] for cls in classes}
        for cls in classes:
            for node in graph.class_nodes[cls]:
                kids = tuple(c for c in graph.node_children[node] if c >= 0)
                self.children[node] = kids
                for child in sorted(set(kids)):
                    self.parents[child].append(node)
        # Sharing: how many distinct classes read each tensor class (through its Load classes).
        load_classes: dict[int, set[int]] = {}
        for cls in classes:
            for node in graph.class_nodes[cls]:
                if graph.node_op[node] == "Load":
                    load_classes.setdefault(graph.node_children[node][0], set()).add(cls)
        self.load_classes = {tensor: sorted(loads) for tensor, loads in load_classes.items()}
        self.readers: dict[int, int] = {}
        for tensor, loads in load_classes.items():
            readers = {graph.node_class[p] for load in loads for p in self.parents.get(load, ())}
            self.readers[tensor] = max(1, len(readers))


def _pass(problem: _Problem, banned: set[int], paid: frozenset[int], shared: bool, max_evaluations_per_node: int):
    graph, costs, mask, is_tensor = problem.graph, problem.costs, problem.mask, problem.is_tensor
    children, node_class, node_op = problem.children, graph.node_class, graph.node_op
    weights = _Weights(len(problem.bit_of))
    unpaid = ~sum(mask[cls] for cls in paid if cls in mask)
    share = {cls: (problem.readers.get(cls, 1) if shared else 1) for cls in problem.bit_of}

    a_node: dict[int, int] = {}
    a_local: dict[int, float] = {}
    a_deps: dict[int, int] = {}
    i_node: dict[int, int] = {}
    i_local: dict[int, float] = {}
    i_deps: dict[int, int] = {}

    def better(local, deps, old_local, old_deps) -> bool:
        delta = (local - old_local
                 + weights.total(deps & ~old_deps & unpaid) - weights.total(old_deps & ~deps & unpaid))
        return delta < -_TOLERANCE

    def evaluate(node: int) -> bool:
        cls = node_class[node]
        tensor = is_tensor[cls]
        own = mask.get(cls, 0)
        local = costs[node]
        deps = 0
        for child in children[node]:
            if child not in a_node:
                return False
            if is_tensor[child]:
                deps |= a_deps[child] | mask[child]
                continue
            child_local, child_deps = a_local[child], a_deps[child]
            if tensor and child_deps & own:
                if child not in i_node or i_deps[child] & own:
                    return False
                child_local, child_deps = i_local[child], i_deps[child]
            local += child_local
            deps |= child_deps | mask.get(child, 0)
        if deps & own:
            return False
        changed = False
        current = a_node.get(cls)
        if current is None or (current == node and (local, deps) != (a_local[cls], a_deps[cls])) or (
                current != node and better(local, deps, a_local[cls], a_deps[cls])):
            a_node[cls], a_local[cls], a_deps[cls] = node, local, deps
            if tensor:
                value = local if math.isfinite(local) else 1e300
                weights.values[problem.bit_of[cls]] = value / share[cls]
            changed = True
        if not tensor and node_op[node] != "Load":
            current = i_node.get(cls)
            if current is None or (current == node and (local, deps) != (i_local[cls], i_deps[cls])) or (
                    current != node and better(local, deps, i_local[cls], i_deps[cls])):
                i_node[cls], i_local[cls], i_deps[cls] = node, local, deps
                changed = True
        return changed

    nodes = [n for cls in problem.classes for n in graph.class_nodes[cls] if n not in banned]
    pending = {n: len(set(children[n])) for n in nodes}
    order: list[int] = []
    queue = deque(n for n in nodes if pending[n] == 0)
    while queue:
        node = queue.popleft()
        order.append(node)
        cls = node_class[node]
        had_value = cls in a_node
        evaluate(node)
        if not had_value and cls in a_node:
            for parent in problem.parents[cls]:
                if parent in pending:
                    pending[parent] -= 1
                    if pending[parent] == 0:
                        queue.append(parent)
    # Fixed point: re-evaluate the users of every class that changed, in Kahn order, until quiet.
    # A tensor whose cost changed also re-ranks its readers' comparisons: wake them too.
    position = {node: i for i, node in enumerate(order)}
    heap = list(range(len(order)))
    queued = set(heap)
    evaluations = 0
    budget = max_evaluations_per_node * max(len(order), 1)
    while heap and evaluations < budget:
        index = heapq.heappop(heap)
        queued.discard(index)
        node = order[index]
        evaluations += 1
        if not evaluate(node):
            continue
        cls = node_class[node]
        woken = problem.parents[cls]
        if is_tensor[cls]:
            woken = woken + [p for load in problem.load_classes.get(cls, ()) for p in problem.parents[load]]
        for parent in woken:
            at = position.get(parent)
            if at is not None and at not in queued:
                queued.add(at)
                heapq.heappush(heap, at)
    sweeps = evaluations / max(len(order), 1)

    missing = [r for r in problem.roots if r not in a_node]
    if missing:
        raise ValueError(f"no acyclic extraction for classes {[graph.class_ids[r] for r in missing]}")
    # The selection: every class's best node globally, plus the inner slots kernels use.
    chosen: dict[tuple[int, int], int] = {(cls, GLOBAL): node for cls, node in a_node.items()}
    for cls, node in a_node.items():
        if not is_tensor[cls]:
            continue
        own = mask[cls]
        for child in children[node]:
            if not is_tensor[child] and a_deps[child] & own and child in i_node:
                chosen[(child, cls)] = i_node[child]
    return Selection(graph, chosen, list(problem.roots)), sweeps


def _acyclic_pass(problem: _Problem, banned: set[int], paid, shared: bool, max_evaluations_per_node: int):
    banned = set(banned)
    for _ in range(64):
        selection, sweeps = _pass(problem, banned, paid, shared, max_evaluations_per_node)
        cycle = selection.find_cycle()
        if cycle is None:
            reached = selection.postorder()
            selection.nodes = {slot: selection.nodes[slot] for slot in reached}
            return selection, sweeps
        banned.add(selection.nodes[cycle[0]])  # break the cycle at its entry and search again
    raise RuntimeError("greedy extraction could not break its cycles")


def extract_greedy(graph: EGraphData, roots, costs, *,
                   score: Callable[[Selection, float], float] | None = None,
                   max_evaluations_per_node: int = 16,
                   rounds: tuple[str, ...] = ("shared", "reuse", "plain"), banned=()) -> GreedyResult:
    """A greedy DAG-aware selection for `roots` (class indices) under per-node `costs` (seconds).

    `score(selection, cutoff)` rates a finished selection (default: the sum of node costs it
    reaches); it may return `inf` once the rating exceeds `cutoff`. The best-scoring round wins
    (the first on ties). Deterministic: the same graph, roots and costs give the same selection.
    """
    problem = _Problem(graph, list(roots), costs)
    if score is None:
        def score(selection: Selection, cutoff: float) -> float:
            return selection.node_sum(problem.costs)
    best: Selection | None = None
    best_score = math.inf
    total_sweeps = 0.0
    history: list[tuple[str, float]] = []
    seen: dict[tuple, float] = {}
    first_materialized: frozenset[int] = frozenset()
    for name in rounds:
        if name == "reuse" and not first_materialized:
            continue
        paid = first_materialized if name == "reuse" else frozenset()
        selection, sweeps = _acyclic_pass(problem, set(banned), paid, name == "shared", max_evaluations_per_node)
        total_sweeps += sweeps
        key = tuple(sorted(selection.nodes.items()))
        value = seen[key] if key in seen else score(selection, best_score)
        seen[key] = value
        history.append((name, value))
        if not first_materialized:
            first_materialized = frozenset(
                cls for cls, context in selection.nodes if context == GLOBAL and problem.is_tensor[cls])
        if best is None or value < best_score * (1 - 1e-12):  # a later round must be strictly better
            best, best_score = selection, value
    assert best is not None
    return GreedyResult(best, best_score, total_sweeps, history)
