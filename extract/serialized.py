"""The serialized e-graph, read once into flat arrays.

Input: `egraph._serialize().to_json()` (egglog's own Python term conversion recurses and fails at
SD 1.5 size, so extraction never uses it). That JSON maps node ids to

    {"op": "Matmul", "children": [node ids...], "eclass": "Tensor-4", "subsumed": false, ...}

where `op` is a constructor name of `eqsat.lang.OPS`, or, for a primitive leaf, its literal text
(`"\\"f32[2]\\""`, `3`, `0.5`), and each child id names one node of the child's e-class (with
`split_primitive_outputs`, every primitive is its own class). `Ref` nodes (unextractable builder
handles) are not extraction candidates; their i64 child is the `Builder` handle of a lifted term,
which maps an e-class back to that term (`EGraphData.handles`).

Everything here is indexed by dense integers: e-classes `0..num_classes-1` in order of first
appearance, candidate nodes `0..num_nodes-1` in JSON order. No recursion anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from eqsat.lang import KERNEL_OPS, OPS
from eqsat.serialized import parse_serialized
from eqsat.types import parse_type
from extract.prologue import operand_charge, prologue_charge

PRIMITIVE_SORTS = ("String", "i64", "f64", "bool", "Unit")


def _size(ty) -> int:
    return parse_type(ty).size if ty else 0


def parse_literal(text: str, sort: str):
    """The Python value of a primitive leaf's text: `'"f32[2]"'` -> `"f32[2]"`, `"3"` -> `3`."""
    if sort == "String":
        try:
            return json.loads(text)
        except ValueError:
            return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    if sort == "i64":
        return int(text)
    if sort == "f64":
        return float(text)
    if sort == "bool":
        return text == "true"
    return text


@dataclass
class EGraphData:
    """A serialized e-graph as arrays (see the module docstring)."""

    class_ids: list[str]                       # class index -> egglog class id ("Tensor-4")
    class_sort: list[str]                      # "Tensor" | "Expr" | "TensorList" | primitive sort
    class_type: list[str | None]               # the type string of a Tensor/Expr class
    class_nodes: list[list[int]]               # class index -> candidate node indices
    node_op: list[str]                         # node index -> constructor name
    node_class: list[int]                      # node index -> its class
    node_children: list[tuple[int, ...]]       # node index -> child class per argument, -1 at literals
    node_literals: list[tuple]                 # node index -> literal per argument, None at children
    handles: dict[int, int] = field(default_factory=dict)          # builder handle -> class
    class_handles: dict[int, list[int]] = field(default_factory=dict)  # class -> sorted handles

    @property
    def num_classes(self) -> int:
        return len(self.class_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.node_op)

    def child_classes(self, node: int) -> tuple[int, ...]:
        """The non-literal children of `node`, in argument order (repeats kept)."""
        return tuple(c for c in self.node_children[node] if c >= 0)

    def node_args(self, node: int) -> tuple:
        """`node`'s arguments with children replaced by their class's type (None for lists)."""
        return tuple(
            lit if child < 0 else self.class_type[child]
            for child, lit in zip(self.node_children[node], self.node_literals[node])
        )

    def node_costs(self, device="h100"):
        """Seconds of each node's own work (`eqsat.cost.node_cost`), the extraction objective's terms,
        with what a conv template evaluates more than once (`extract.prologue.NodeCosts`)."""
        from extract.prologue import node_costs

        return node_costs(self, device)

    def nonzero_weight_elements(self, cls: int, depth: int = 4) -> int:
        """`eqsat.cost.roofline.nonzero_weight_elements` of the cheapest form in weight class `cls`
        (a concat of zero-padded parts: the sum of the parts)."""
        best = _size(self.class_type[cls])
        if depth == 0:
            return best
        for node in self.class_nodes[cls]:
            op, kids = self.node_op[node], self.node_children[node]
            if op == "Concat":
                best = min(best, self.nonzero_weight_elements(kids[0], depth - 1)
                           + self.nonzero_weight_elements(kids[1], depth - 1))
            elif op == "Pad" and self._is_zero_class(kids[1]):
                best = min(best, self.nonzero_weight_elements(kids[0], depth - 1))
        return best

    def _is_zero_class(self, cls: int) -> bool:
        return any(self.node_op[n] == "Lit" and float(self.node_literals[n][0]) == 0.0 for n in self.class_nodes[cls])

    def slice_fraction(self, node: int) -> float:
        """The part of its operand a Slice/DynamicSlice node reads (elements out / elements in)."""
        child = next(c for c in self.node_children[node] if c >= 0)
        return _size(self.class_type[self.node_class[node]]) / max(_size(self.class_type[child]), 1)

    def gather_fraction(self, node: int) -> float:
        """The part of its table a Gather reads, at most all of it (output elements / table elements)."""
        table = self.node_children[node][0]
        return _size(self.class_type[self.node_class[node]]) / max(_size(self.class_type[table]), 1)

    def roots_of_handles(self, handles) -> list[int]:
        """The classes of builder handles (e.g. `[builder.handle(t) for t in program.outputs]`)."""
        return [self.handles[int(h)] for h in handles]


def load(serialized) -> EGraphData:
    """Read `egraph._serialize()` (or its `.to_json()` text, or the parsed dict) into arrays.

    Only the classes extraction can see are indexed (those of candidate nodes, of their children and
    of builder handles), in order of first appearance: egglog also serializes its helper relations
    and one class per primitive, which no candidate needs."""
    data = parse_serialized(serialized)
    raw_nodes: dict = data["nodes"]
    class_data: dict = data.get("class_data", {})

    def sort_of(cid: str) -> str:
        return class_data.get(cid, {}).get("type") or cid.rsplit("-", 1)[0]

    # Which nodes are primitive leaves (and their values), candidates, or builder handles.
    literal_of: dict[str, object] = {}
    candidates: list[tuple[str, dict]] = []
    refs: list[tuple[str, dict]] = []
    needed: set[str] = set()
    for nid, node in raw_nodes.items():
        op = node["op"]
        children = node["children"]
        if op in OPS:
            if not node.get("subsumed", False):
                candidates.append((nid, node))
            continue
        if op == "Ref":
            refs.append((nid, node))
            continue
        if not children:
            cid = node["eclass"]
            sort = sort_of(cid)
            if sort in PRIMITIVE_SORTS or nid.startswith("primitive"):
                try:
                    literal_of[nid] = parse_literal(op, sort)
                except ValueError:
                    literal_of[nid] = op
    class_of_node: dict[str, str] = {}
    for nid, node in candidates:
        needed.add(node["eclass"])
        for child in node["children"]:
            if child not in literal_of:
                child_node = raw_nodes.get(child)
                if child_node is not None:
                    needed.add(child_node["eclass"])
    for nid, node in refs:
        needed.add(node["eclass"])

    class_index: dict[str, int] = {}
    class_ids: list[str] = []
    for nid, node in raw_nodes.items():  # first appearance, as egglog lists the nodes
        cid = node["eclass"]
        if cid in needed and cid not in class_index:
            class_index[cid] = len(class_ids)
            class_ids.append(cid)
    class_sort = [sort_of(cid) for cid in class_ids]

    node_op: list[str] = []
    node_class: list[int] = []
    node_children: list[tuple[int, ...]] = []
    node_literals: list[tuple] = []
    for nid, node in candidates:
        children = node["children"]
        kids = []
        for child in children:
            if child in literal_of:
                kids.append(-1)
                continue
            child_node = raw_nodes.get(child)
            if child_node is None:
                break  # a child the serialization left out: not a candidate
            kids.append(class_index[child_node["eclass"]])
        else:
            node_op.append(node["op"])
            node_class.append(class_index[node["eclass"]])
            node_children.append(tuple(kids))
            node_literals.append(tuple(literal_of.get(c) for c in children))

    handles: dict[int, int] = {}
    class_handles: dict[int, list[int]] = {}
    for nid, node in refs:
        child = node["children"][0]
        if child not in literal_of:
            continue
        handle = int(literal_of[child])
        cls = class_index[node["eclass"]]
        handles[handle] = cls
        class_handles.setdefault(cls, []).append(handle)
    for values in class_handles.values():
        values.sort()

    class_nodes: list[list[int]] = [[] for _ in class_ids]
    for node, cls in enumerate(node_class):
        class_nodes[cls].append(node)
    class_type: list[str | None] = [None] * len(class_ids)
    for node, op in enumerate(node_op):
        cls = node_class[node]
        if class_type[cls] is None and OPS[op][0] != "TensorList":
            ty = node_literals[node][-1]
            class_type[cls] = ty if isinstance(ty, str) else None
    return EGraphData(class_ids, class_sort, class_type, class_nodes, node_op, node_class, node_children,
                      node_literals, handles, class_handles)


def reachable_classes(graph: EGraphData, roots) -> list[int]:
    """Every class reachable from `roots` through any candidate node (sorted)."""
    seen = set(roots)
    stack = list(roots)
    while stack:
        cls = stack.pop()
        for node in graph.class_nodes[cls]:
            for child in graph.node_children[node]:
                if child >= 0 and child not in seen:
                    seen.add(child)
                    stack.append(child)
    return sorted(seen)


def strongly_connected(graph: EGraphData, classes) -> list[int]:
    """SCC label per class of the class graph (class -> child classes of any of its nodes).

    Iterative Tarjan; classes not in `classes` get -1. Labels are dense and deterministic.
    """
    members = set(classes)
    label = [-1] * graph.num_classes
    index = [-1] * graph.num_classes
    low = [0] * graph.num_classes
    on_stack = [False] * graph.num_classes
    stack: list[int] = []
    counter = 0
    next_label = 0

    def successors(cls: int) -> list[int]:
        out = []
        for node in graph.class_nodes[cls]:
            out.extend(c for c in graph.node_children[node] if c >= 0 and c in members)
        return out

    for start in sorted(members):
        if index[start] != -1:
            continue
        work = [(start, iter(successors(start)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        while work:
            cls, it = work[-1]
            advanced = False
            for child in it:
                if index[child] == -1:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack[child] = True
                    work.append((child, iter(successors(child))))
                    advanced = True
                    break
                if on_stack[child]:
                    low[cls] = min(low[cls], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[cls])
            if low[cls] == index[cls]:
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    label[member] = next_label
                    if member == cls:
                        break
                next_label += 1
    return label


# --- a selection: which node fills each slot -----------------------------------------------------
#
# A tensor is materialized once and shared, so a Tensor class has one node for the whole plan:
# slot `(cls, GLOBAL)`. An Expr is computed inside a kernel, and the same Expr class may be
# computed differently in different kernels: inside the kernel of tensor class `P`, Expr class
# `E` is slot `(E, P)`, whose node is `nodes[(E, P)]` if the selection has one, else the default
# `nodes[(E, GLOBAL)]`; its Expr children are slots of `P` again. That is what lets a consumer
# read `Load(P)` while `P`'s own kernel computes the body that `Load(P)` equals
# (`Load(Pointwise(e)) == e` puts both in one e-class).

GLOBAL = -1
EPSILON = 1e-15  # seconds added to every node: ties go to fewer nodes, and costs grow strictly upward

Slot = tuple[int, int]


@dataclass
class Selection:
    """`nodes[(cls, context)]` = the chosen node; see the comment above for how slots resolve."""

    def node_of(self, slot: Slot) -> int | None:
        node = self.nodes.get(slot)
        if node is None and slot[1] != GLOBAL:
            node = self.nodes.get((slot[0], GLOBAL))
        return node

    graph: EGraphData
    nodes: dict[Slot, int]
    roots: list[int]
    fallback: dict[Slot, int] | None = field(default=None, repr=False)  # choices for unreached classes

    def child_slots(self, slot: Slot) -> list[Slot]:
        cls, context = slot
        graph = self.graph
        node = self.node_of(slot)
        inner = cls if graph.class_sort[cls] == "Tensor" else context
        out = []
        for child in graph.node_children[node]:
            if child < 0:
                continue
            out.append((child, GLOBAL) if graph.class_sort[child] == "Tensor" else (child, inner))
        return out

    def postorder(self) -> list[Slot]:
        """The slots reached from the roots, children first; `ValueError` on a cycle or a gap.

        Remembered until `nodes` is replaced (a selection's `nodes` dict is never edited in place)."""
        cached = self.__dict__.get("_postorder")
        if cached is not None and cached[0] is self.nodes:
            return list(cached[1])
        order: list[Slot] = []
        state: dict[Slot, int] = {}  # 1 = on the stack, 2 = done
        for root in self.roots:
            start = (root, GLOBAL)
            if state.get(start) == 2:
                continue
            stack: list[tuple[Slot, bool]] = [(start, False)]
            while stack:
                slot, expanded = stack.pop()
                if expanded:
                    state[slot] = 2
                    order.append(slot)
                    continue
                mark = state.get(slot)
                if mark == 2:
                    continue
                if mark == 1:
                    raise ValueError(f"cyclic selection through class {self.graph.class_ids[slot[0]]}")
                if self.node_of(slot) is None:
                    raise ValueError(f"nothing selected for class {self.graph.class_ids[slot[0]]}")
                state[slot] = 1
                stack.append((slot, True))
                for child in self.child_slots(slot):
                    child_state = state.get(child)
                    if child_state == 1:
                        raise ValueError(f"cyclic selection through class {self.graph.class_ids[child[0]]}")
                    if child_state is None:
                        stack.append((child, False))
        self._postorder = (self.nodes, tuple(order))
        return order

    def find_cycle(self) -> list[Slot] | None:
        """The slots of one cycle reachable from the roots (None if acyclic)."""
        state: dict[Slot, int] = {}
        for root in self.roots:
            start = (root, GLOBAL)
            if state.get(start) == 2:
                continue
            path = [start]
            state[start] = 1
            stack = [(start, self.child_slots(start) if self.node_of(start) is not None else [], 0)]
            while stack:
                slot, children, position = stack[-1]
                if position < len(children):
                    stack[-1] = (slot, children, position + 1)
                    child = children[position]
                    mark = state.get(child)
                    if mark == 1:
                        return path[path.index(child):]
                    if mark is None:
                        state[child] = 1
                        path.append(child)
                        stack.append((child, self.child_slots(child) if self.node_of(child) is not None else [], 0))
                    continue
                stack.pop()
                path.pop()
                state[slot] = 2
        return None

    def node_sum(self, costs) -> float:
        """The sum of `costs` over the selected nodes reached (each slot once)."""
        return sum(costs[self.node_of(slot)] for slot in self.postorder())

    def to_terms(self) -> tuple[list, dict]:
        """The `eqsat.term.Term`s of the roots, and the class of each Tensor term built.

        Remembered until `nodes` is replaced, as `postorder` (extraction builds the terms of the
        plan it keeps when it rates it, and again to return it)."""
        cached = self.__dict__.get("_terms")
        if cached is not None and cached[0] is self.nodes:
            return list(cached[1]), dict(cached[2])
        roots, class_of = self._build_terms()
        self.__dict__["_terms"] = (self.nodes, roots, class_of)
        return list(roots), dict(class_of)

    def _build_terms(self) -> tuple[list, dict]:
        from eqsat.term import Term

        graph = self.graph
        built: dict[Slot, object] = {}
        class_of: dict[object, int] = {}
        for slot in self.postorder():
            node = self.node_of(slot)
            children = iter(self.child_slots(slot))
            args = [lit if child < 0 else built[next(children)]
                    for child, lit in zip(graph.node_children[node], graph.node_literals[node])]
            term = Term(graph.node_op[node], *args)
            built[slot] = term
            if graph.class_sort[slot[0]] == "Tensor":
                class_of.setdefault(term, slot[0])
        return [built[(r, GLOBAL)] for r in self.roots], class_of

    def cost(self, costs, cutoff: float = float("inf")) -> float:
        """The plan's modeled seconds, from node `costs` (`EGraphData.node_costs`) without building
        terms: each kernel pays its own node and, once per kernel, each expression slot it computes
        (so an expression inlined into two kernels is paid twice), a conv's input expression as
        often as its template evaluates it and a matmul's operands once per tile (`extract.prologue`);
        a tensor read only through slices
        pays the slices (as `eqsat.cost.kernel_reads`). Returns `inf` once past `cutoff`."""
        graph = self.graph
        node_op, sort = graph.node_op, graph.class_sort
        prologues = getattr(costs, "prologues", None) or {}
        repeats = getattr(costs, "operand_repeats", None) or {}
        total = 0.0
        for cls, context in self.postorder():
            if context != GLOBAL or sort[cls] != "Tensor":
                continue
            node = self.node_of((cls, GLOBAL))
            total += costs[node]
            if node_op[node] not in KERNEL_OPS:
                continue
            covered: set[int] = set()
            if node in prologues:  # a conv's input expression, as often as its template computes it
                charge, covered = prologue_charge(graph, costs, prologues[node],
                                                  lambda c, owner=cls: self.node_of((c, owner)))
                total += charge
            elif node in repeats:  # a matmul's operand expressions, once per N (A) or M (B) tile
                charge, covered = operand_charge(graph, costs, node, lambda c, owner=cls: self.node_of((c, owner)))
                total += charge
            seen = {(cls, GLOBAL)}
            stack = [(cls, GLOBAL)]
            loads: dict[Slot, list] = {}  # Load slot -> [read whole?, sliced fraction]
            while stack:
                slot = stack.pop()
                parent_node = self.node_of(slot)
                parent_op = node_op[parent_node]
                for child in self.child_slots(slot):
                    if sort[child[0]] == "Tensor":
                        continue
                    child_node = self.node_of(child)
                    if node_op[child_node] == "Load":
                        entry = loads.setdefault(child, [False, 0.0])
                        if parent_op in ("Slice", "DynamicSlice"):
                            entry[1] += graph.slice_fraction(parent_node)
                        elif parent_op == "Gather" and graph.node_children[parent_node][0] == child[0]:
                            entry[1] += graph.gather_fraction(parent_node)
                        else:
                            entry[0] = True
                    if child not in seen:
                        seen.add(child)
                        if node_op[child_node] != "Load" and child[0] not in covered:
                            total += costs[child_node]
                        stack.append(child)
            for slot, (whole, fraction) in loads.items():
                read = costs[self.node_of(slot)]
                total += read if whole else read * min(1.0, fraction)
            if total > cutoff:
                return float("inf")
        return total

    def kernel_classes(self) -> list[int]:
        """Tensor classes whose selected node is a kernel, producers first."""
        return [cls for cls, context in self.postorder()
                if context == GLOBAL and self.graph.node_op[self.node_of((cls, context))] in KERNEL_OPS]

    def pruned(self) -> "Selection":
        """The same selection with exactly the slots it reaches, each with its node spelled out."""
        order = self.postorder()
        nodes = {slot: self.node_of(slot) for slot in order}
        pruned = Selection(self.graph, nodes, list(self.roots), self.fallback)
        pruned._postorder = (nodes, tuple(order))  # the same slots are reached in the same order
        return pruned
