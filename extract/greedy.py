"""Greedy DAG-aware extraction: bottom-up costs where every materialized tensor is paid once,
then local moves on the finished plan.

Bottom-up pass. Each e-class keeps its best node and what choosing it costs:

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
class changes: the fixed point (with a budget of evaluations per node). If a stale set lets a
cycle through, the node closing it is banned and the pass reruns.

Rounds (`ROUNDS`), each scored by the caller's `score` (the plan's roofline cost), the best kept:

- "horizontal": tensors read only through slices by several classes (a QKV matmul, stacked norm
  statistics, the shared K/V projection of the text context: horizontal fusions) count as paid.
  Each reader alone prefers its own narrow kernel, cheaper than the wide one; only together do
  they save launches and reads. Tensor weights are shared as in "shared".
- "shared": a tensor's weight is divided among the classes that could read it. An expression
  inlined into k consumers is computed k times, while a tensor is written once and read k times;
  with whole weights ("plain") inlining always looks cheaper locally (the tensor's cost includes
  the same expression) and long elementwise chains get recomputed in every consumer.
- "reuse" / "horizontal+reuse" (not default): what "shared" / "horizontal" materialized counts
  as paid.

Polish (`polish`): local moves on the best round's plan, each kept only if the modeled plan cost
drops, with incremental reference counts: switch a kernel's node (a bias add `Pointwise` over a
matmul -> the matmul with the add in its epilogue); read a tensor the plan materializes anyway
instead of recomputing it; retire a tensor by switching all its readers at once (a narrow matmul
whose readers can read a slice of a wider one already in the plan; a reduction hosted in a
producer's epilogue may move to another producer, or to its own kernel, so that producer can
retire). Regional ILPs run after the polish find nothing left to gain on the SD 1.5 UNet.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from eqsat.cost.roofline import HOSTED_OPS
from eqsat.lang import KERNEL_OPS
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
        # Horizontal candidates: tensors read only through slices, by two or more classes (one
        # wide matmul for Q, K and V; both statistics of a norm from one reduction).
        self.sliced: set[int] = set()
        for tensor, loads in load_classes.items():
            users = [p for load in loads for p in self.parents.get(load, ())]
            if users and all(graph.node_op[p] in ("Slice", "DynamicSlice") for p in users):
                if len({graph.node_class[p] for p in users}) >= 2:
                    self.sliced.add(tensor)
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
            full = selection.nodes
            selection = selection.pruned()
            selection.fallback = full
            return selection, sweeps
        banned.add(selection.node_of(cycle[0]))  # break the cycle at its entry and search again
    raise RuntimeError("greedy extraction could not break its cycles")


ROUNDS = ("horizontal", "shared")  # also available: "reuse", "horizontal+reuse", "plain"


def extract_greedy(graph: EGraphData, roots, costs, *,
                   score: Callable[[Selection, float], float] | None = None,
                   max_evaluations_per_node: int = 16, rounds: tuple[str, ...] = ROUNDS,
                   polish_passes: int = 3, banned=()) -> GreedyResult:
    """A greedy DAG-aware selection for `roots` (class indices) under per-node `costs` (seconds).

    `score(selection, cutoff)` rates a finished selection (default: `Selection.cost`, the plan's
    modeled seconds); it may return `inf` once past `cutoff`. The best-scoring round wins (the
    first on ties) and is then improved by `polish` (`polish_passes=0` skips that). Deterministic:
    the same graph, roots and costs give the same selection.
    """
    problem = _Problem(graph, list(roots), costs)
    if score is None:
        def score(selection: Selection, cutoff: float) -> float:
            return selection.cost(costs, cutoff)
    best: Selection | None = None
    best_score = math.inf
    total_sweeps = 0.0
    history: list[tuple[str, float]] = []
    seen: dict[tuple, float] = {}
    materialized: dict[str, frozenset[int]] = {}
    for name in rounds:
        shared = name != "plain"
        if name == "plain" or name == "shared":
            paid: frozenset[int] = frozenset()
        elif name == "reuse":
            paid = materialized.get("shared", frozenset())
        elif name == "horizontal":
            paid = frozenset(problem.sliced)
            if not paid:
                continue
        elif name == "horizontal+reuse":
            if "horizontal" not in materialized:
                continue
            paid = materialized["horizontal"]
        else:
            raise ValueError(f"unknown greedy round {name!r}; known: plain, {', '.join(ROUNDS)}")
        selection, sweeps = _acyclic_pass(problem, set(banned), paid, shared, max_evaluations_per_node)
        total_sweeps += sweeps
        materialized[name] = frozenset(
            cls for cls, context in selection.nodes if context == GLOBAL and problem.is_tensor[cls])
        key = tuple(sorted(selection.nodes.items()))
        value = seen[key] if key in seen else score(selection, best_score)
        seen[key] = value
        history.append((name, value))
        if best is None or value < best_score * (1 - 1e-12):  # a later round must be strictly better
            best, best_score = selection, value
    assert best is not None
    if polish_passes:
        try:
            polished = polish(best, costs, fallback=best.fallback, max_passes=polish_passes)
        except ValueError:  # a move closed a cycle the checks missed: keep the unpolished plan
            polished = best
        value = score(polished, math.inf)
        history.append(("polish", value))
        if value < best_score * (1 - 1e-12):
            polished.fallback = best.fallback
            best, best_score = polished, value
    return GreedyResult(best, best_score, total_sweeps, history)


# --- polish: local moves on a finished selection ---------------------------------------------------


def polish(selection: Selection, costs, *, fallback: dict | None = None, max_passes: int = 3) -> Selection:
    """Improve `selection` by local moves, each kept only if the plan's modeled cost drops.

    Moves, for every kernel of the plan in order:
    - switch the kernel's node (a bias-add `Pointwise` over a matmul -> the matmul with the add in
      its epilogue, say), and
    - switch one expression node inside the kernel, for this kernel only (read `Load(T)` instead
      of recomputing `T`, or one slice of a wide matmul instead of another).
    A move may read only tensors the plan already materializes earlier in its order, so the plan
    stays acyclic; tensors no kernel reads any more after the move are dropped, and their cost with
    them. `fallback` (slot -> node, e.g. a greedy pass's choice for every class) supplies nodes
    for expression classes the selection does not reach yet.
    """
    graph = selection.graph
    node_op, sort = graph.node_op, graph.class_sort
    nodes: dict = dict(fallback or {})
    nodes.update(selection.nodes)
    roots = list(selection.roots)

    def resolve(child: int, owner: int, overrides: dict) -> tuple[int, int]:
        return (child, GLOBAL) if sort[child] == "Tensor" else (child, owner)

    def lookup(slot, overrides: dict):
        node = overrides.get(slot)
        if node is None:
            node = nodes.get(slot)
        if node is None and slot[1] != GLOBAL:
            node = nodes.get((slot[0], GLOBAL))
        return node

    def context(owner: int, kernel_node: int, overrides: dict):
        """(cost, reads, slots) of the kernel of class `owner` built from `kernel_node`; `slots` are
        its expression slots in the order met, each as (slot, tensor it loads or -1, index of its
        parent slot in `slots` or -1)."""
        total = costs[kernel_node]
        reads: set[int] = set()
        hosted = node_op[kernel_node] in HOSTED_OPS  # costs its own node only (`Selection.cost`)
        if not hosted and node_op[kernel_node] not in KERNEL_OPS:
            return total, reads, []
        loads: dict = {}
        state: dict = {}  # slot -> 1 while on the depth-first path, 2 when done
        slots: list = []
        stack = [((owner, GLOBAL), kernel_node, -1, False)]
        while stack:
            slot, node, parent_index, leaving = stack.pop()
            if leaving:
                state[slot] = 2
                continue
            if slot in state:
                continue  # entered already through another parent
            state[slot] = 1
            index = -1
            if slot[1] != GLOBAL:
                index = len(slots)
                slots.append((slot, graph.node_children[node][0] if node_op[node] == "Load" else -1, parent_index))
                if node_op[node] != "Load":
                    total += costs[node]
                if index > 4096:
                    return math.inf, reads, slots  # runaway inlining: not a candidate
            stack.append((slot, node, parent_index, True))
            parent_op = node_op[node]
            for child in graph.node_children[node]:
                if child < 0:
                    continue
                child_slot = resolve(child, owner, overrides)
                if child_slot[1] == GLOBAL and sort[child] == "Tensor":
                    reads.add(child)
                    continue
                child_node = lookup(child_slot, overrides)
                if child_node is None:
                    return math.inf, reads, slots
                if node_op[child_node] == "Load":
                    entry = loads.setdefault(child_slot, [False, 0.0, child_node])
                    if parent_op in ("Slice", "DynamicSlice"):
                        entry[1] += graph.slice_fraction(node)
                    elif parent_op == "Gather" and graph.node_children[node][0] == child:
                        entry[1] += graph.gather_fraction(node)
                    else:
                        entry[0] = True
                mark = state.get(child_slot)
                if mark == 1:
                    return math.inf, reads, slots  # a cycle inside the kernel
                if mark is None:
                    stack.append((child_slot, child_node, index, False))
        if hosted:
            return costs[kernel_node], reads, slots
        for whole, fraction, load_node in loads.values():
            read = costs[load_node]
            total += read if whole else read * min(1.0, fraction)
        return total, reads, slots

    load_nodes: dict[int, list[int]] = {}
    for cls_nodes in graph.class_nodes:
        for n in cls_nodes:
            if node_op[n] == "Load":
                load_nodes.setdefault(graph.node_class[n], []).append(n)
    current = Selection(graph, nodes, roots)
    order = [cls for cls, ctx in current.postorder() if ctx == GLOBAL and sort[cls] == "Tensor"]
    position = {cls: i for i, cls in enumerate(order)}
    kernel_cost: dict[int, float] = {}
    kernel_reads: dict[int, set[int]] = {}
    refcount: dict[int, int] = {cls: 0 for cls in order}
    for cls in order:
        cost, reads, _ = context(cls, nodes[(cls, GLOBAL)], {})
        kernel_cost[cls], kernel_reads[cls] = cost, reads
        for read in reads:
            refcount[read] = refcount.get(read, 0) + 1
    for root in roots:
        refcount[root] = refcount.get(root, 0) + 1

    def freed(owner: int, old_reads: set[int], new_reads: set[int]) -> tuple[float, list[int]]:
        """Cost and classes dropped when `owner` stops reading `old_reads - new_reads`."""
        drop: dict[int, int] = {}
        gone: list[int] = []
        saved = 0.0
        stack = [r for r in old_reads if r not in new_reads]
        while stack:
            tensor = stack.pop()
            drop[tensor] = drop.get(tensor, 0) + 1
            if refcount.get(tensor, 0) - drop[tensor] == 0 and tensor not in new_reads:
                gone.append(tensor)
                saved += kernel_cost.get(tensor, 0.0)
                stack.extend(kernel_reads.get(tensor, ()))
        return saved, gone

    state = {"dirty": False}

    def reorder() -> None:
        """Recompute a topological order of the plan's tensors from the kernels' reads."""
        seen: set[int] = set()
        fresh: list[int] = []
        for root in roots:
            stack = [(root, False)]
            while stack:
                tensor, done = stack.pop()
                if done:
                    fresh.append(tensor)
                    continue
                if tensor in seen:
                    continue
                seen.add(tensor)
                stack.append((tensor, True))
                stack.extend((r, False) for r in sorted(kernel_reads.get(tensor, ())) if r not in seen)
        position.clear()
        position.update({cls: i for i, cls in enumerate(fresh)})
        state["dirty"] = False

    def depends(tensor: int, owner: int) -> bool:
        """Whether `tensor` (transitively) reads `owner` in the current plan."""
        if state["dirty"]:
            reorder()
        floor = position[owner]
        stack, seen = [tensor], {tensor}
        while stack:
            t = stack.pop()
            if t == owner:
                return True
            for r in kernel_reads.get(t, ()):
                if r not in seen and position.get(r, -1) >= floor:
                    seen.add(r)
                    stack.append(r)
        return False

    def valid(owner: int, reads: set[int]) -> bool:
        if state["dirty"]:
            reorder()
        for r in reads:
            if r == owner:
                return False
            if r not in position or (refcount.get(r, 0) == 0 and r not in roots):
                if not any(node_op[n] in ("Input", "Constant", "LoopArg") for n in graph.class_nodes[r]):
                    return False
                continue
            if position[r] > position[owner] and depends(r, owner):
                return False
        return True

    def apply(owner: int, cost: float, reads: set[int], gone: list[int]) -> None:
        for r in reads - kernel_reads[owner]:
            refcount[r] = refcount.get(r, 0) + 1
            if r not in position or position[r] > position[owner]:
                state["dirty"] = True
        stack = list(kernel_reads[owner] - reads)
        while stack:
            tensor = stack.pop()
            refcount[tensor] -= 1
            if refcount[tensor] == 0:
                stack.extend(kernel_reads.get(tensor, ()))
        kernel_cost[owner], kernel_reads[owner] = cost, reads

    for _ in range(max_passes):
        improved = False
        if state["dirty"]:
            reorder()
        order = sorted(position, key=position.get)
        for owner in order:
            if refcount.get(owner, 0) == 0:
                continue
            node = nodes[(owner, GLOBAL)]
            if node_op[node] not in KERNEL_OPS and node_op[node] not in HOSTED_OPS:
                continue
            # Move 1: another node for the kernel (or hosted reduction) itself.
            for alternative in graph.class_nodes[owner]:
                if alternative == node:
                    continue
                cost, reads, _ = context(owner, alternative, {})
                if not math.isfinite(cost) or not valid(owner, reads):
                    continue
                saved, gone = freed(owner, kernel_reads[owner], reads)
                if cost - kernel_cost[owner] - saved < -1e-12:
                    apply(owner, cost, reads, gone)
                    nodes[(owner, GLOBAL)] = node = alternative
                    improved = True
            if node_op[node] not in KERNEL_OPS:
                continue
            # Move 2: read a tensor the plan materializes anyway instead of recomputing it here
            # (switch an expression slot, in this kernel only, to a `Load` of that tensor).
            _, _, slots = context(owner, node, {})
            for slot, loaded, _ in slots:
                if loaded >= 0:
                    continue
                cls = slot[0]
                for alternative in load_nodes.get(cls, ()):
                    tensor = graph.node_children[alternative][0]
                    if refcount.get(tensor, 0) == 0 or lookup(slot, {}) == alternative:
                        continue
                    overrides = {(cls, owner): alternative}
                    cost, reads, _ = context(owner, node, overrides)
                    if not math.isfinite(cost) or not valid(owner, reads):
                        continue
                    saved, gone = freed(owner, kernel_reads[owner], reads)
                    if cost - kernel_cost[owner] - saved < -1e-12:
                        apply(owner, cost, reads, gone)
                        nodes[(cls, owner)] = alternative
                        improved = True
                        break
        # Move 3: retire a tensor: every kernel that reads it switches expression slots (in its
        # own context) until it does not, all at once; a narrow matmul whose readers can all read
        # a slice of a wider one already in the plan goes away only this way.
        readers: dict[int, set[int]] = {}
        for owner in order:
            if refcount.get(owner, 0) > 0:
                for read in kernel_reads[owner]:
                    readers.setdefault(read, set()).add(owner)
        for tensor in reversed(order):
            if refcount.get(tensor, 0) == 0 or tensor in roots or node_op[nodes[(tensor, GLOBAL)]] not in KERNEL_OPS:
                continue
            plan_moves = []
            for owner in sorted(readers.get(tensor, ()), key=lambda o: position.get(o, -1)):
                if refcount.get(owner, 0) == 0 or owner not in position:
                    continue
                move = _retire_in(owner, tensor, nodes, context, graph, valid, lambda r: r != tensor)
                if move is None:
                    plan_moves = None
                    break
                plan_moves.append((owner, *move))
            if not plan_moves:
                continue
            delta = sum(cost - kernel_cost[owner] for owner, cost, _, _ in plan_moves)
            # What retiring frees: the tensor and whatever only it (and the old reads) kept alive.
            drop: dict[int, int] = {}
            for owner, _, reads, _ in plan_moves:
                for r in kernel_reads[owner] - reads:
                    drop[r] = drop.get(r, 0) + 1
            saved = 0.0
            stack = [r for r in drop if refcount.get(r, 0) - drop[r] == 0]
            freed_set: set[int] = set()
            new_reads = set().union(*(reads for _, _, reads, _ in plan_moves))
            while stack:
                t = stack.pop()
                if t in freed_set or t in new_reads:
                    continue
                freed_set.add(t)
                saved += kernel_cost.get(t, 0.0)
                for r in kernel_reads.get(t, ()):
                    drop[r] = drop.get(r, 0) + 1
                    if refcount.get(r, 0) - drop[r] == 0:
                        stack.append(r)
            if tensor not in freed_set or delta - saved >= -1e-12:
                continue
            for owner, cost, reads, overrides in plan_moves:
                apply(owner, cost, reads, [])
                nodes.update(overrides)
                for r in reads:
                    readers.setdefault(r, set()).add(owner)
            improved = True
        if not improved:
            break
    return Selection(graph, nodes, roots).pruned()


def _retire_in(owner, tensor, nodes, context, graph, valid, allowed):
    """Overrides that stop kernel `owner` from reading `tensor`: (cost, reads, overrides) or None.

    Greedy: repeatedly take the cheapest single switch of a slot on the way to a `tensor` load
    (in `owner`'s context) that lowers the number of such loads, until none is left. A hosted
    reduction reads its producer itself, not through a slot: every form of its class is tried
    (another producer's epilogue, its own kernel), each with its slots switched the same way."""
    current = nodes[(owner, GLOBAL)]
    if graph.node_op[current] not in HOSTED_OPS:
        return _retire_from(owner, tensor, current, {}, nodes, context, graph, valid)
    best = None
    for start in graph.class_nodes[owner]:
        overrides = {} if start == current else {(owner, GLOBAL): start}
        found = _retire_from(owner, tensor, start, overrides, nodes, context, graph, valid)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _retire_from(owner, tensor, kernel_node, overrides, nodes, context, graph, valid):
    overrides = dict(overrides)
    cost, reads, slots = context(owner, kernel_node, overrides)
    for _ in range(8):
        loads = sum(1 for _, t, _ in slots if t == tensor)
        if tensor not in reads and loads == 0:
            return cost, reads, overrides
        on_path: dict = {}
        for index, (slot, t, parent) in enumerate(slots):
            if t != tensor:
                continue
            while index >= 0 and index not in on_path:
                on_path[index] = None
                index = slots[index][2]
        best = None
        for index in sorted(on_path):
            slot = slots[index][0]
            cls = slot[0]
            if len(graph.class_nodes[cls]) < 2:
                continue
            chosen = overrides.get((cls, owner), nodes.get((cls, owner), nodes.get((cls, GLOBAL))))
            for alternative in graph.class_nodes[cls]:
                if alternative == chosen:
                    continue
                trial = dict(overrides)
                trial[(cls, owner)] = alternative
                c, r, sl = context(owner, kernel_node, trial)
                if not math.isfinite(c) or not valid(owner, r - {tensor}):
                    continue
                n = sum(1 for _, t, _ in sl if t == tensor)
                if n >= loads and tensor in r:
                    continue
                if best is None or (n, c) < (best[0], best[1]):
                    best = (n, c, r, sl, trial)
        if best is None:
            return None
        _, cost, reads, slots, overrides = best
    return None
