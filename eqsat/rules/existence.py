"""The serialized e-graph as plain e-classes, random acyclic plans of it, and the fewest-kernel plan.

The soundness checker evaluates `extractions` of a rewritten e-graph; tests use `min_kernel_plan`
(an exact ILP) to show that a fused plan exists. Neither is the cost-model extractor (`extract/`).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from eqsat import lang
from eqsat.term import Term, postorder


_LANG_SORTS = frozenset({"Tensor", "Expr", "TensorList"})


class SerializedGraph:
    """`egraph._serialize().to_json()` as e-classes of language nodes, plus `Ref` handles -> e-class."""

    def __init__(self, data: str | dict):
        data = json.loads(data) if isinstance(data, str) else data
        nodes, class_data = data["nodes"], data["class_data"]
        self.op: dict[str, str] = {}
        self.children: dict[str, list[str]] = {}
        self.eclass: dict[str, str] = {}
        self.members: dict[str, list[str]] = defaultdict(list)
        self.handle_class: dict[int, str] = {}
        self.node_class: dict[str, str] = {node_id: node["eclass"] for node_id, node in nodes.items()}
        for node_id, node in nodes.items():
            op, cls = node["op"], node["eclass"]
            sort = class_data.get(cls, {}).get("type")
            if op == "Ref":
                self.handle_class[int(nodes[node["children"][0]]["op"])] = cls
                continue
            if node.get("subsumed"):
                continue  # equal, but not extractable (e.g. a LoopArg merged with its operand)
            if sort in _LANG_SORTS:
                if op not in lang.OPS:
                    continue  # helper functions of some family: not part of any plan
            elif node["children"]:
                continue  # a helper function's row in a primitive class; primitives are leaves
            self.op[node_id] = op
            self.children[node_id] = list(node["children"])
            self.eclass[node_id] = cls
            self.members[cls].append(node_id)
        self.sort = {cls: info.get("type") for cls, info in class_data.items()}

    def child_classes(self, node_id: str) -> list[str]:
        return [self.node_class[c] for c in self.children[node_id]]

    def reachable(self, roots: Sequence[str]) -> list[str]:
        """Classes reachable from `roots` through any node."""
        seen, order, stack = set(roots), [], list(roots)
        while stack:
            cls = stack.pop()
            order.append(cls)
            for node in self.members.get(cls, []):
                for child in self.child_classes(node):
                    if child not in seen:
                        seen.add(child)
                        stack.append(child)
        return order

    def extract(self, roots: Sequence[str], rng: random.Random, force: tuple[str, str] | None = None,
                budget: int = 20_000) -> dict[str, str] | None:
        """A random acyclic choice of one node per needed class (`force`: (class, node) must be used).

        Depth-first with backtracking: a node is rejected when it would close a cycle. Returns
        None when the budget of node visits runs out.
        """
        towards: set[str] = set()
        if force is not None:
            parents: dict[str, set[str]] = defaultdict(set)
            for node, cls in self.eclass.items():
                for child in self.child_classes(node):
                    parents[child].add(cls)
            stack = [force[0]]
            towards = {force[0]}
            while stack:
                for parent in parents[stack.pop()]:
                    if parent not in towards:
                        towards.add(parent)
                        stack.append(parent)
        choice: dict[str, str] = {}
        active: set[str] = set()
        visits = [0]

        def order(cls: str) -> list[str]:
            if force is not None and cls == force[0]:
                return [force[1]]
            nodes = list(self.members[cls])
            rng.shuffle(nodes)
            if towards:
                nodes.sort(key=lambda n: not any(c in towards for c in self.child_classes(n)))
            return nodes

        def visit(cls: str) -> bool:
            if cls in choice:
                return True
            if cls in active or not self.members.get(cls):
                return False
            visits[0] += 1
            if visits[0] > budget:
                return False
            active.add(cls)
            for node in order(cls):
                if all(visit(child) for child in self.child_classes(node)):
                    choice[cls] = node
                    active.discard(cls)
                    return True
            active.discard(cls)
            return False

        import sys

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            ok = all(visit(root) for root in roots)
        finally:
            sys.setrecursionlimit(limit)
        return choice if ok else None

    def terms(self, choice: dict[str, str], roots: Sequence[str]) -> list[Term]:
        """The Terms of `roots` under `choice` (children before parents, no recursion)."""
        built: dict[str, Term] = {}
        opened: set[str] = set()
        stack: list[tuple[str, bool]] = [(root, False) for root in roots]
        while stack:
            cls, ready = stack.pop()
            if cls in built:
                continue
            node = choice[cls]
            op = self.op[node]
            sorts = lang.OPS[op][1]
            if not ready:
                if cls in opened:
                    raise ValueError(f"the choice of nodes is cyclic at e-class {cls}")
                opened.add(cls)
                stack.append((cls, True))
                for child, sort in zip(self.children[node], sorts):
                    if sort in _LANG_SORTS and self.node_class[child] not in built:
                        stack.append((self.node_class[child], False))
                continue
            args = []
            for child, sort in zip(self.children[node], sorts):
                if sort in _LANG_SORTS:
                    args.append(built[self.node_class[child]])
                else:
                    args.append(_literal(self.op[child], sort))
            built[cls] = Term(op, *args)
        return [built[root] for root in roots]


def min_kernel_plan(graph: SerializedGraph, roots: Sequence[str], *, forbid: Sequence[str] = (),
                    time_limit: float = 60.0) -> list[Term] | None:
    """A plan of `roots` with the fewest kernels the e-graph offers (to show that a fused plan exists).

    An exact ILP (`scipy.optimize.milp`): a 0/1 variable per node and per class, every used class
    picks a node, a picked node uses its children's classes, an order per class forbids cycles;
    minimize kernels, then nodes. Nodes whose op is in `forbid` are never picked. None if no plan
    exists. For small e-graphs (tests, examples), not SD-sized ones: the cost-model extractor lives
    in `extract/`.
    """
    import scipy.sparse as sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    classes = graph.reachable(roots)
    class_index = {cls: i for i, cls in enumerate(classes)}
    nodes = [(cls, node) for cls in classes for node in graph.members.get(cls, []) if graph.op[node] not in forbid]
    n_nodes, n_classes = len(nodes), len(classes)
    # variables: nodes x, classes y, orders o
    n_vars = n_nodes + 2 * n_classes
    y = lambda c: n_nodes + class_index[c]  # noqa: E731
    o = lambda c: n_nodes + n_classes + class_index[c]  # noqa: E731
    rows, cols, vals, lower, upper = [], [], [], [], []

    def constraint(coefficients: dict[int, float], lo: float, hi: float) -> None:
        row = len(lower)
        for col, val in coefficients.items():
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    big = float(n_classes + 1)
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, (cls, node) in enumerate(nodes):
        by_class[cls].append(i)
        for child in set(graph.child_classes(node)):
            constraint({i: 1.0, y(child): -1.0}, -np.inf, 0.0)              # x_n <= y_child
            if child == cls:
                constraint({i: 1.0}, 0.0, 0.0)                                # a node inside its own class
            else:
                constraint({o(cls): 1.0, o(child): -1.0, i: -big}, 1.0 - big, np.inf)  # o_c >= o_d + 1 if x_n
    for cls in classes:
        coefficients = {i: 1.0 for i in by_class[cls]}
        coefficients[y(cls)] = -1.0
        constraint(coefficients, 0.0, 0.0)                                    # a used class picks one node
    for root in roots:
        constraint({y(root): 1.0}, 1.0, 1.0)
    cost = np.zeros(n_vars)
    for i, (cls, node) in enumerate(nodes):
        cost[i] = (1000.0 if graph.op[node] in lang.KERNEL_OPS else 0.0) + 1.0
    integrality = np.ones(n_vars)
    integrality[n_nodes + n_classes:] = 0
    lo_bounds = np.zeros(n_vars)
    hi_bounds = np.ones(n_vars)
    hi_bounds[n_nodes + n_classes:] = big
    matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(lower), n_vars))
    result = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
                  bounds=Bounds(lo_bounds, hi_bounds), options={"time_limit": time_limit})
    if result.x is None or not result.success:
        return None
    choice = {cls: node for i, (cls, node) in enumerate(nodes) if result.x[i] > 0.5}
    return graph.terms(choice, roots)


def kernel_terms(roots: Sequence[Term]) -> list[Term]:
    """The kernel terms of a plan (loop bodies included)."""
    return [term for term in postorder(roots) if term.op in lang.KERNEL_OPS]


def _literal(text: str, sort: str):
    if sort == "String":
        return json.loads(text)
    if sort == "i64":
        return int(text)
    if sort == "f64":
        return float(text)
    raise AssertionError(sort)


def extractions(graph: SerializedGraph, roots: Sequence[str], *, limit: int = 32, seed: int = 0) -> list[list[Term]]:
    """Up to `limit` distinct plans of `roots`: random ones, and one forcing each alternative node."""
    rng = random.Random(seed)
    forced = [(cls, node) for cls in graph.reachable(roots) if graph.sort.get(cls) in _LANG_SORTS
              for node in graph.members.get(cls, []) if len(graph.members[cls]) > 1]
    rng.shuffle(forced)
    plans: dict[tuple[int, ...], list[Term]] = {}
    attempts = [None] * 3 + forced
    for force in attempts:
        if len(plans) >= limit:
            break
        choice = graph.extract(roots, rng, force)
        if choice is None:
            continue
        terms = graph.terms(choice, roots)
        plans.setdefault(tuple(id(t) for t in terms), terms)
    return list(plans.values())
