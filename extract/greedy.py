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

A conv's input expression is computed by its template once per window tap and output-channel
tile (`extract.prologue`), so a conv node does not take its input class's context-free best: for
each class of that tree it compares computing it (charged per evaluation) with reading a tensor
one of the class's `Load` nodes names (`Load(P)`: `P` materialized, paid through `deps`), and
keeps its choices for its own kernel's slots. The classes it looked at wake it up when they change.

Order: Kahn's (a node is first evaluated once all its children have a value); then every node
whose children (or whose read tensors' costs) changed is re-evaluated, in Kahn order, until no
class changes: the fixed point (with a budget of evaluations per node). If a stale set lets a
cycle through, the node closing it is banned and the pass reruns.

Rounds (`ROUNDS`), each polished (below) and scored by the caller's `score` (the finished plan's
price, `extract.score_selection`), the best kept:

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

Kernel size: a choice computing more than `MAX_KERNEL_TREE` expression nodes in one kernel (as a
tree) loses to any within it, and such a class may read a tensor computing it instead (the one
exception to the cycle check above: only the class's own bit comes back through that tensor); the
polish's contexts stop at as many slots (`MAX_CONTEXT_SLOTS`). A chain whose every step is cheaper
to recompute than to store is then cut every few hundred nodes instead of growing one kernel per
layer by a layer each, which made the plan quadratic in the depth.

Polish (`polish`): local moves on each round's plan, each kept only if the modeled plan cost
drops, with incremental reference counts: switch a kernel's node (a bias add `Pointwise` over a
matmul -> the matmul with the add in its epilogue); read a tensor the plan materializes anyway
instead of recomputing it; let a conv read a new tensor holding (part of) its input expression,
when that kernel costs less than the template's recompute; retire a tensor by switching all its
readers at once (a narrow matmul
whose readers can read a slice of a wider one already in the plan; a reduction hosted in a
producer's epilogue may move to another producer, or to its own kernel, so that producer can
retire). Regional ILPs run after the polish find nothing left to gain on the SD 1.5 UNet.

Cost of the polish: each move is judged by walking the kernel's expression slots (its context,
at most `MAX_CONTEXT_SLOTS`); a context depends only on that kernel's own slot choices, so it is
memoized per kernel until one of them changes, and the work is linear in the plan
(`PolishReport.slots_visited`). A `deadline` stops the rounds, skips the polish when it has passed
already, and stops the polish between two moves or while it reads the plan, keeping the plan so far
(`GreedyResult.stopped`); a polish that kept no move is not scored again.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from eqsat.cost.roofline import HOSTED_OPS
from eqsat.lang import KERNEL_OPS
from eqsat.types import parse_type
from extract.prologue import operand_charge, prologue_charge
from extract.serialized import (
    EPSILON,
    GLOBAL,
    EGraphData,
    Selection,
    reachable_classes,
    strongly_connected,
)

# The clock `extract_time_limit` is counted on: the CPU seconds of the thread that extracts (all of
# extraction runs on it), so that a busy machine (a shared CI runner, a compile beside it) gets the
# same plan an idle one does, not a cut-short one. Not the process's CPU time: that read sums every
# thread of the process, and a process that has run JAX has dozens (42 µs a read with 45 threads after
# planning the text encoder, against 0.5 µs for this thread's; up to 0.7 ms under cProfile in the UNet).
cpu_clock = time.thread_time
# Wall seconds between two reads of `cpu_clock` in the polish's per-move check (a UNet plan checks
# ~6,800 times; a perf_counter read is still ~10x cheaper). One thread's CPU time grows no faster
# than the wall clock, so the limit is still honored to within this interval.
CLOCK_READ_INTERVAL = 0.005

_TOLERANCE = 1e-17
# Expression nodes one kernel may compute, counted as a tree (what the pass sums `local` over): a
# choice past it loses to any choice within it, whatever their costs, and an expression class past
# it may read the tensor whose kernel computes it (`Load(P)`, `P` computing the class's inner
# choice) although its bit comes back through `P`. Without it a residual stream of tiny tensors
# (issue 18's chain `x = x + silu(layernorm(x @ w + b))`, 24 wide) is cheaper to recompute than to
# store at any depth, so layer k's kernel recomputed all k layers and read 2k tensors: the plan,
# and its extraction, emission and compilation, grew with the square of the depth. The largest SD
# 1.5 kernel computes 219 (a UNet attention block), the VAE's 74, the text encoder's 46.
MAX_KERNEL_TREE = 512


@dataclass
class GreedyResult:
    selection: Selection
    score: float
    sweeps: float  # node evaluations per node, summed over rounds
    rounds: list[tuple[str, float]]  # (round name, score)
    polish: "PolishReport | None" = None
    stopped: str | None = None  # "time_limit" when the deadline skipped a round or cut the polish short
    seconds: dict = field(default_factory=dict)  # wall time per phase: prepare, each round, polish


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
        # Conv nodes whose template evaluates their input expression more than once, and the Load
        # nodes of each class (what such a conv may read instead of computing the class).
        self.prologue_costs = costs if getattr(costs, "prologues", None) else None
        self.operand_repeats = getattr(costs, "operand_repeats", None) or {}
        self.prologues = {n: p for n, p in (getattr(costs, "prologues", None) or {}).items()
                          if graph.node_class[n] in self.parents}
        self.loads_of: dict[int, list[int]] = {}
        for cls in classes:
            for node in graph.class_nodes[cls]:
                if graph.node_op[node] == "Load":
                    self.loads_of.setdefault(cls, []).append(node)


def _pass(problem: _Problem, banned: set[int], paid: frozenset[int], shared: bool, max_evaluations_per_node: int):
    graph, costs, mask, is_tensor = problem.graph, problem.costs, problem.mask, problem.is_tensor
    children, node_class, node_op = problem.children, graph.node_class, graph.node_op
    weights = _Weights(len(problem.bit_of))
    unpaid = ~sum(mask[cls] for cls in paid if cls in mask)
    share = {cls: (problem.readers.get(cls, 1) if shared else 1) for cls in problem.bit_of}

    prologues = problem.prologues
    watchers: dict[int, set[int]] = {}  # class -> conv nodes whose input choice depends on it
    sizes: dict[int, int] = {}
    prologue_evaluations: dict[tuple, float] = {}
    load_tensor = {load: graph.node_children[load][0] for loads in problem.loads_of.values() for load in loads}

    def size_of(cls: int) -> int:
        if cls not in sizes:
            ty = graph.class_type[cls]
            sizes[cls] = parse_type(ty).size if ty else 0
        return sizes[cls]

    a_node: dict[int, int] = {}
    a_local: dict[int, float] = {}
    a_deps: dict[int, int] = {}
    a_tree: dict[int, int] = {}  # expression nodes the choice computes in its kernel, as a tree
    i_node: dict[int, int] = {}
    i_local: dict[int, float] = {}
    i_deps: dict[int, int] = {}
    i_tree: dict[int, int] = {}
    # The part of an expression class's `local` its template recomputes (not its loads): a matmul
    # charges its A expression's once per N tile and its B expression's once per M tile.
    a_compute: dict[int, float] = {}
    i_compute: dict[int, float] = {}
    operand_repeats = problem.operand_repeats

    def better(local, deps, old_local, old_deps) -> bool:
        delta = (local - old_local
                 + weights.total(deps & ~old_deps & unpaid) - weights.total(old_deps & ~deps & unpaid))
        return delta < -_TOLERANCE

    def preferred(local, deps, tree, old_local, old_deps, old_tree) -> bool:
        """A candidate within `MAX_KERNEL_TREE` beats one past it; otherwise the cheaper (`better`)."""
        if (tree > MAX_KERNEL_TREE) != (old_tree > MAX_KERNEL_TREE):
            return tree <= MAX_KERNEL_TREE
        return better(local, deps, old_local, old_deps)

    def tree_cut(cls: int, node: int) -> bool:
        """Whether `node` is a `Load` of a tensor whose kernel computes `cls` (through its inner
        choice, which does not read that tensor) while `cls`'s best choice so far computes more
        than `MAX_KERNEL_TREE` nodes: reading it there cuts the tree."""
        if node_op[node] != "Load" or a_tree.get(cls, 0) <= MAX_KERNEL_TREE or cls not in i_node:
            return False
        tensor = children[node][0]
        return tensor in a_node and not i_deps[cls] & mask[tensor]

    def evaluate(node: int) -> bool:
        cls = node_class[node]
        tensor = is_tensor[cls]
        own = mask.get(cls, 0)
        local = costs[node]
        compute = 0.0 if tensor or node_op[node] == "Load" else local
        deps = 0
        tree = 0 if tensor else 1
        prologue = prologues.get(node)
        repeats = operand_repeats.get(node)
        for position, child in enumerate(children[node]):
            if child not in a_node:
                return False
            if is_tensor[child]:
                deps |= a_deps[child] | mask[child]
                continue
            if position == 0 and prologue is not None:  # a conv's input: computed per tap and tile, or loaded
                found = input_choice(node, prologue, own)
                if found is None:
                    return False
                child_local, child_deps, child_tree, child_compute = found[0], found[1], 1, 0.0
            else:
                child_local, child_deps, child_tree = a_local[child], a_deps[child], a_tree[child]
                child_compute = a_compute[child]
                if tensor and child_deps & own:
                    if child not in i_node or i_deps[child] & own:
                        return False
                    child_local, child_deps, child_tree = i_local[child], i_deps[child], i_tree[child]
                    child_compute = i_compute[child]
            if repeats is not None and position < 2:  # a matmul's A (per N tile) or B (per M tile)
                local += (repeats[position] - 1) * child_compute
            local += child_local
            compute += child_compute
            deps |= child_deps | mask.get(child, 0)
            tree += child_tree
        if deps & own:
            # A `Load(P)` whose kernel `P` computes this class past `MAX_KERNEL_TREE`: `P`'s kernel
            # computes the class's inner choice, which does not read `P`, so reading `P` here closes
            # no cycle (only the class's own bit came back through `P`).
            if not tree_cut(cls, node):
                return False
            deps &= ~own
        changed = False
        current = a_node.get(cls)
        if current is None or (current == node and (local, deps, tree) != (a_local[cls], a_deps[cls], a_tree[cls])) or (
                current != node and preferred(local, deps, tree, a_local[cls], a_deps[cls], a_tree[cls])):
            a_node[cls], a_local[cls], a_deps[cls], a_tree[cls] = node, local, deps, tree
            a_compute[cls] = compute
            if tensor:
                value = local if math.isfinite(local) else 1e300
                weights.values[problem.bit_of[cls]] = value / share[cls]
            changed = True
        if not tensor and node_op[node] != "Load":
            current = i_node.get(cls)
            if current is None or (current == node and (local, deps, tree) != (i_local[cls], i_deps[cls], i_tree[cls])) or (
                    current != node and preferred(local, deps, tree, i_local[cls], i_deps[cls], i_tree[cls])):
                i_node[cls], i_local[cls], i_deps[cls], i_tree[cls] = node, local, deps, tree
                i_compute[cls] = compute
                changed = True
        return changed

    def base_node(cls: int, own: int) -> int | None:
        """The node of expression class `cls` inside the kernel of the class with bit `own`."""
        if not a_deps[cls] & own:
            return a_node[cls]
        if cls in i_node and not i_deps[cls] & own:
            return i_node[cls]
        return None

    def input_choice(node: int, prologue, own: int, overrides: dict | None = None):
        """(local, deps) of conv `node`'s input expression: each class of its tree (the best nodes so
        far) either computed as often as the template evaluates it (`extract.prologue`) or read from
        a tensor one of its `Load` nodes names, whichever the comparison of the rest of the pass
        prefers. None if no choice is free of a cycle. `overrides` receives, per class, the choices
        that differ from the class's own best node (for the selection)."""
        # Keys: (class, lo, hi, points): points 0 while descending concats on the feature axis.
        values: dict[tuple, tuple | None] = {}
        on_path: set[tuple] = set()
        root_key = (prologue.lhs, 0, prologue.channels, 0)
        stack: list[tuple[tuple, bool]] = [(root_key, False)]
        while stack:
            key, ready = stack.pop()
            if key in values:
                continue
            cls = key[0]
            if not ready:
                watchers.setdefault(cls, set()).add(node)
                if cls not in a_node:
                    values[key] = None
                    continue
                chosen = base_node(cls, own)
                on_path.add(key)
                stack.append((key, True))
                if chosen is not None and node_op[chosen] != "Load":
                    for child_key in input_children(chosen, key, prologue):
                        if child_key not in values and child_key not in on_path:
                            stack.append((child_key, False))
                continue
            on_path.discard(key)
            chosen = base_node(cls, own)
            best = None
            if chosen is not None and node_op[chosen] != "Load":
                local, deps, feasible = input_charge(chosen, key, prologue), 0, True
                for child_key in input_children(chosen, key, prologue):
                    value = values.get(child_key)
                    if value is None:
                        feasible = False
                        break
                    local += value[0]
                    deps |= value[1] | mask.get(child_key[0], 0)
                if feasible and not deps & own:
                    best = (local, deps, chosen)
            for load in problem.loads_of.get(cls, ()):
                tensor_cls = load_tensor[load]
                watchers.setdefault(tensor_cls, set()).add(node)
                if load in banned or tensor_cls not in a_node:
                    continue
                deps = a_deps[tensor_cls] | mask[tensor_cls]
                if deps & own:
                    continue
                if best is None or (best[2] != load and better(costs[load], deps, best[0], best[1])):
                    best = (costs[load], deps, load)
            values[key] = best
        root = values.get(root_key)
        if root is None:
            return None
        if overrides is not None:
            walk, seen = [root_key], set()
            while walk:
                key = walk.pop()
                if key in seen or values.get(key) is None:
                    continue
                seen.add(key)
                chosen = values[key][2]
                if chosen != a_node[key[0]]:
                    overrides.setdefault(key[0], chosen)
                if node_op[chosen] != "Load":
                    walk.extend(input_children(chosen, key, prologue))
        return root[0], root[1]

    def input_children(chosen: int, key: tuple, prologue) -> list[tuple]:
        cls, lo, hi, points = key
        kids = children[chosen]
        if points == 0 and node_op[chosen] == "Concat" and graph.node_literals[chosen][2] == prologue.axis:
            split = lo + graph.node_literals[chosen][3]
            return [(kids[0], lo, split, 0), (kids[1], split, hi, 0)]
        if points == 0:
            points = size_of(cls)
        return [(c, lo, hi, points) for c in kids]

    def input_charge(chosen: int, key: tuple, prologue) -> float:
        cls, lo, hi, points = key
        if points == 0:
            if node_op[chosen] == "Concat" and graph.node_literals[chosen][2] == prologue.axis:
                return costs[chosen]
            points = size_of(cls)
        evaluations = prologue_evaluations.get((id(prologue), lo, hi))
        if evaluations is None:
            evaluations = prologue_evaluations[(id(prologue), lo, hi)] = prologue.evaluations(lo, hi)
        charge = problem.prologue_costs.in_prologue(chosen, points, evaluations)
        return costs[chosen] if charge is None else charge + EPSILON

    def users(cls: int) -> list[int]:
        """The nodes to re-evaluate when class `cls` changes: its parents, for a tensor (whose cost
        re-ranks its readers' comparisons) the parents of its `Load`s, and the convs whose input
        choice looked at it."""
        found = problem.parents[cls]
        if a_tree.get(cls, 0) > MAX_KERNEL_TREE:  # its other nodes may now win: compare them again
            found = found + [n for n in graph.class_nodes[cls] if n not in banned]
        if is_tensor[cls]:
            found = found + [p for load in problem.load_classes.get(cls, ()) for p in problem.parents[load]]
        if cls in watchers:
            found = found + sorted(watchers[cls])
        return found

    # Kahn's order; a node already evaluated whose inputs change later in it is queued for the fixed point.
    nodes = [n for cls in problem.classes for n in graph.class_nodes[cls] if n not in banned]
    pending = {n: len(set(children[n])) for n in nodes}
    order: list[int] = []
    position: dict[int, int] = {}
    stale: set[int] = set()
    queue = deque(n for n in nodes if pending[n] == 0)
    while queue:
        node = queue.popleft()
        position[node] = len(order)
        order.append(node)
        cls = node_class[node]
        had_value = cls in a_node
        if evaluate(node):
            for user in users(cls):
                at = position.get(user)
                if at is not None:
                    stale.add(at)
        if not had_value and cls in a_node:
            for parent in problem.parents[cls]:
                if parent in pending:
                    pending[parent] -= 1
                    if pending[parent] == 0:
                        queue.append(parent)
    # Fixed point: re-evaluate the users of every class that changed, in Kahn order, until quiet.
    heap = sorted(stale)
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
        for user in users(node_class[node]):
            at = position.get(user)
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
        if node in prologues:
            overrides: dict[int, int] = {}
            if input_choice(node, prologues[node], own, overrides) is not None:
                for child, choice in overrides.items():
                    chosen[(child, cls)] = choice
    # The input choices of the convs a class did not choose, for the polish's fallback: switching
    # such a class to its conv (a residual add into conv2's epilogue, say) keeps the conv's reads.
    unchosen: dict[tuple[int, int], int] = {}
    for cls, chosen_node in a_node.items():
        if not is_tensor[cls]:
            continue
        for node in graph.class_nodes[cls]:
            if node in prologues and node != chosen_node and node not in banned:
                overrides = {}
                if input_choice(node, prologues[node], mask[cls], overrides) is not None:
                    for child, choice in overrides.items():
                        unchosen.setdefault((child, cls), choice)
    return Selection(graph, chosen, list(problem.roots), fallback=unchosen), sweeps


def _acyclic_pass(problem: _Problem, banned: set[int], paid, shared: bool, max_evaluations_per_node: int):
    banned = set(banned)
    for _ in range(64):
        selection, sweeps = _pass(problem, banned, paid, shared, max_evaluations_per_node)
        try:
            pruned = selection.pruned()
        except ValueError:  # a cycle (or a gap: then find_cycle finds none and the error stands)
            cycle = selection.find_cycle()
            if cycle is None:
                raise
            banned.add(selection.node_of(cycle[0]))  # break the cycle at its entry and search again
            continue
        pruned.fallback = {**(selection.fallback or {}), **selection.nodes}
        return pruned, sweeps
    raise RuntimeError("greedy extraction could not break its cycles")


ROUNDS = ("horizontal", "shared")  # also available: "reuse", "horizontal+reuse", "plain"


def extract_greedy(graph: EGraphData, roots, costs, *,
                   score: Callable[[Selection, float], float] | None = None,
                   max_evaluations_per_node: int = 16, rounds: tuple[str, ...] = ROUNDS,
                   polish_passes: int = 3, banned=(), deadline: float | None = None) -> GreedyResult:
    """A greedy DAG-aware selection for `roots` (class indices) under per-node `costs` (seconds).

    `score(selection, cutoff)` rates a finished selection (default: `Selection.cost`, the sum of
    node costs; `extract.extract` passes the finished plan's price); it may return `inf` once past
    `cutoff`. Each distinct round's selection is improved by `polish`, the best-scoring first, and
    the best-scoring result wins (the first on ties; `polish_passes=0`: the best round, unpolished).
    Deterministic: the same graph, roots and costs give the same selection, unless `deadline` (a
    `cpu_clock()` value) comes first: a round after the first runs only if it and the polish
    (each timed like the last round) fit before it, a polish after the first only if it fits (timed
    like the last one), a polish stops between two moves early enough to rate its plan before it
    (timed like the longest rating of a round's plan), and `stopped` says "time_limit"
    when any of these happened. `polish` in the result is the winning polish's report.
    """
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    problem = _Problem(graph, list(roots), costs)
    seconds["prepare"] = time.perf_counter() - started
    if score is None:
        def score(selection: Selection, cutoff: float) -> float:
            return selection.cost(costs, cutoff)
    total_sweeps = 0.0
    history: list[tuple[str, float]] = []
    seen: dict[tuple, float] = {}
    materialized: dict[str, frozenset[int]] = {}
    candidates: list[tuple[float, int, str, Selection]] = []  # distinct round selections
    stopped = None
    last_round = 0.0
    score_seconds = 0.0  # the longest rating of a round's plan: a polished plan is rated too, after its polish
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
        if candidates and deadline is not None and cpu_clock() + 2 * last_round > deadline:
            stopped = "time_limit"  # another round and the polish would not fit: polish what we have
            break
        began, began_cpu = time.perf_counter(), cpu_clock()
        selection, sweeps = _acyclic_pass(problem, set(banned), paid, shared, max_evaluations_per_node)
        total_sweeps += sweeps
        materialized[name] = frozenset(
            cls for cls, context in selection.nodes if context == GLOBAL and problem.is_tensor[cls])
        key = tuple(sorted(selection.nodes.items()))
        fresh = key not in seen
        if fresh:
            scored = cpu_clock()
            value = score(selection, math.inf if polish_passes else min((c[0] for c in candidates), default=math.inf))
            score_seconds = max(score_seconds, cpu_clock() - scored)
        else:
            value = seen[key]
        seen[key] = value
        history.append((name, value))
        seconds[name] = time.perf_counter() - began
        last_round = cpu_clock() - began_cpu
        if fresh:
            candidates.append((value, len(candidates), name, selection))
    assert candidates
    # Each distinct round's plan is polished, the best unpolished first, and the best polished plan
    # kept (a later one must be strictly better): the polish moves a round's plan to a local optimum,
    # and which round reaches the better one is not what their unpolished scores say (the UNet on
    # `h100-calibrated`: "shared" scores below "horizontal" unpolished, above it polished).
    candidates.sort(key=lambda c: (c[0], c[1]))
    best, best_score = candidates[0][3], candidates[0][0]
    report = None
    if polish_passes and deadline is not None and cpu_clock() > deadline:
        stopped = "time_limit"  # no time left for the polish: the best round's plan as it is
        report = PolishReport(stopped="time_limit")
        candidates = []
    elif not polish_passes:
        candidates = []
    last_polish = 0.0
    for index, (value, _, name, selection) in enumerate(candidates):
        if index and deadline is not None and cpu_clock() + last_polish > deadline:
            stopped = "time_limit"  # another polish would not fit: keep the best so far
            break
        began, began_cpu = time.perf_counter(), cpu_clock()
        try:
            polished, polish_report = polish(selection, costs, fallback=selection.fallback, max_passes=polish_passes,
                                             deadline=None if deadline is None else deadline - score_seconds)
        except ValueError:  # a move closed a cycle the checks missed: keep the unpolished plan
            polished, polish_report = selection, None
        stopped = stopped or (polish_report.stopped if polish_report else None)
        if polish_report is not None and not polish_report.moves:  # nothing changed: nothing to score again
            polished_value = value
        else:
            polished_value = score(polished, math.inf)
        history.append(("polish" if len(candidates) == 1 else f"polish {name}", polished_value))
        if report is None or polished_value < best_score * (1 - 1e-12):
            report = polish_report if polish_report is not None else report
        if polished_value < best_score * (1 - 1e-12):
            polished.fallback = selection.fallback
            best, best_score = polished, polished_value
        seconds["polish" if len(candidates) == 1 else f"polish {name}"] = time.perf_counter() - began
        last_polish = cpu_clock() - began_cpu
    return GreedyResult(best, best_score, total_sweeps, history, report, stopped, seconds)


# --- polish: local moves on a finished selection ---------------------------------------------------

# Expression slots one kernel may compute, counted once each: more is runaway inlining, not a
# candidate. No more than the greedy pass allows (`MAX_KERNEL_TREE` counts a tree, so at least the
# slots), or a retirement would undo its cuts and inline a deep residual stream again.
MAX_CONTEXT_SLOTS = MAX_KERNEL_TREE
RETIRE_STEPS = 8          # slot switches one kernel may make to stop reading a tensor


@dataclass
class PolishReport:
    """What `polish` did and what it cost: moves kept by kind, and the work (kernel contexts walked,
    expression slots visited: linear in the plan) that found them."""

    passes: int = 0
    kernel_switches: int = 0   # move 1: another node for a kernel
    reuses: int = 0            # move 2: a slot reads a tensor the plan materializes anyway
    retirements: int = 0       # move 3: every reader of a tensor stops reading it
    materializations: int = 0  # move 2b: a conv (matmul) reads a new tensor instead of recomputing its input (operand)
    walks: int = 0             # kernel contexts walked
    slots_visited: int = 0     # expression slots those walks visited
    memo_hits: int = 0         # contexts answered without a walk (the kernel's slots had not changed)
    stopped: str | None = None  # "time_limit" when the deadline cut the polish short

    @property
    def moves(self) -> int:
        return self.kernel_switches + self.reuses + self.retirements + self.materializations

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _OutOfTime(Exception):
    """The polish's deadline passed while it was still reading the plan."""


class _Context(NamedTuple):
    """One kernel as a choice of nodes builds it: its modeled cost, the tensor classes it reads, and
    its expression slots in depth-first order, each `(class, tensor it loads or -1, parent index)`."""

    cost: float
    reads: frozenset
    slots: tuple
    prologue: frozenset = frozenset()  # the classes of a conv's input expression (`extract.prologue`)



class _Polish:
    """The state of one polish: the plan's nodes, each kernel's cost and reads, reference counts and a
    topological order, and a memo of kernel contexts.

    A kernel's context (`context(owner, kernel_node, local)`) depends only on the nodes chosen for its
    own expression slots: `local` (the move being tried), then this kernel's slot choices
    (`inner[owner]`), then the selection's default for the class (expression defaults never change
    during a polish). So a context is memoized per kernel and forgotten only when one of that kernel's
    slots changes: passes after the first, and the repeated trials of a retirement, cost no walks for
    kernels nothing touched."""

    def __init__(self, selection: Selection, costs, fallback: dict | None, deadline: float | None):
        graph = self.graph = selection.graph
        self.costs = costs
        self.deadline = deadline
        self.next_clock_read = 0.0
        self.report = PolishReport()
        nodes: dict = dict(fallback or {})
        nodes.update(selection.nodes)
        self.nodes = nodes
        self.roots = list(selection.roots)
        self.root_set = set(self.roots)
        sort = graph.class_sort
        self.is_tensor = [s == "Tensor" for s in sort]
        self.kids = [tuple(c for c in children if c >= 0) for children in graph.node_children]
        self.default: dict[int, int] = {}
        self.inner: dict[int, dict[int, int]] = {}
        for (cls, ctx), node in nodes.items():
            if ctx == GLOBAL:
                if not self.is_tensor[cls]:
                    self.default[cls] = node
            else:
                self.inner.setdefault(ctx, {})[cls] = node
        self.memo: dict[int, dict] = {}
        self.prologues = getattr(costs, "prologues", None) or {}
        self.operand_repeats = getattr(costs, "operand_repeats", None) or {}
        self.load_nodes: dict[int, list[int]] = {}
        for node, op in enumerate(graph.node_op):
            if op == "Load":
                self.load_nodes.setdefault(graph.node_class[node], []).append(node)
        self.leaf_classes = {cls for cls in range(graph.num_classes)
                             if any(graph.node_op[n] in ("Input", "Constant", "LoopArg") for n in graph.class_nodes[cls])}
        current = Selection(graph, nodes, self.roots)
        order = [cls for cls, ctx in current.postorder() if ctx == GLOBAL and sort[cls] == "Tensor"]
        self.position = {cls: i for i, cls in enumerate(order)}
        self.dirty = False
        self.kernel_cost: dict[int, float] = {}
        self.kernel_reads: dict[int, frozenset] = {}
        self.refcount: dict[int, int] = {cls: 0 for cls in order}
        for cls in order:
            if self.out_of_time():  # counting the plan's kernels is the polish's first walk of it
                raise _OutOfTime
            self._count(cls)
        for root in self.roots:
            self.refcount[root] = self.refcount.get(root, 0) + 1

    def _count(self, cls: int) -> None:
        """Compute kernel `cls`'s context and count its reads; a kernel it reads that has no context
        yet (read only through another kernel's slot choice) gets one too."""
        stack = [cls]
        while stack:
            owner = stack.pop()
            if owner in self.kernel_reads:
                continue
            found = self.context(owner, self.nodes[(owner, GLOBAL)])
            self.kernel_cost[owner], self.kernel_reads[owner] = found.cost, found.reads
            for read in found.reads:
                self.refcount[read] = self.refcount.get(read, 0) + 1
                if read not in self.kernel_reads and self._is_kernel(read):
                    stack.append(read)

    def _is_kernel(self, cls: int) -> bool:
        node = self.nodes.get((cls, GLOBAL))
        return node is not None and self.graph.node_op[node] in KERNEL_OPS

    # --- kernel contexts ---

    def slot_node(self, cls: int, owner: int) -> int | None:
        """The node of expression class `cls` inside the kernel of `owner`."""
        node = self.inner.get(owner, {}).get(cls)
        return self.default.get(cls) if node is None else node

    def set_slot(self, cls: int, owner: int, node: int) -> None:
        self.nodes[(cls, owner)] = node
        self.inner.setdefault(owner, {})[cls] = node
        self.memo.pop(owner, None)

    def context(self, owner: int, kernel_node: int, local: dict | None = None) -> _Context:
        key = (kernel_node, tuple(sorted(local.items())) if local else ())
        memo = self.memo.setdefault(owner, {})
        found = memo.get(key)
        if found is None:
            found = memo[key] = self._walk(owner, kernel_node, local or {})
        else:
            self.report.memo_hits += 1
        return found

    def _walk(self, owner: int, kernel_node: int, local: dict) -> _Context:
        graph, costs = self.graph, self.costs
        node_op, node_children, kids, is_tensor = graph.node_op, graph.node_children, self.kids, self.is_tensor
        total = costs[kernel_node]
        op = node_op[kernel_node]
        hosted = op in HOSTED_OPS  # costs its own node only (`Selection.cost`)
        if not hosted and op not in KERNEL_OPS:
            return _Context(total, frozenset(), ())
        self.report.walks += 1
        inner = self.inner.get(owner, {})
        default = self.default
        covered: set[int] = set()
        prologue = self.prologues.get(kernel_node)
        repeated = kernel_node in self.operand_repeats
        if prologue is not None or repeated:  # a conv's input / a matmul's operands, as often as computed

            def resolve(cls: int) -> int | None:
                node = local.get(cls)
                if node is None:
                    node = inner.get(cls)
                return default.get(cls) if node is None else node

            if prologue is not None:
                charge, covered = prologue_charge(graph, costs, prologue, resolve)
            else:
                charge, covered = operand_charge(graph, costs, kernel_node, resolve)
            total += charge
            if not math.isfinite(total):
                return _Context(math.inf, frozenset(), ())
        reads: set[int] = set()
        loads: dict[int, list] = {}  # Load slot's class -> [read whole?, sliced fraction, Load node]
        state: dict[int, int] = {}  # class -> 1 while on the depth-first path, 2 when done
        slots: list = []
        stack = [(owner, kernel_node, -1, False)]  # the kernel itself, then its expression slots
        first = True
        while stack:
            cls, node, parent_index, leaving = stack.pop()
            if leaving:
                state[cls] = 2
                continue
            if cls in state:
                continue  # entered already through another parent
            state[cls] = 1
            index = -1
            if first:
                first = False
            else:
                index = len(slots)
                is_load = node_op[node] == "Load"
                slots.append((cls, node_children[node][0] if is_load else -1, parent_index))
                if not is_load and cls not in covered:
                    total += costs[node]
                if index > MAX_CONTEXT_SLOTS:
                    self.report.slots_visited += len(slots)
                    return _Context(math.inf, frozenset(reads), tuple(slots))
            stack.append((cls, node, parent_index, True))
            parent_op = node_op[node]
            for child in kids[node]:
                if is_tensor[child]:
                    reads.add(child)
                    continue
                child_node = local.get(child)
                if child_node is None:
                    child_node = inner.get(child)
                    if child_node is None:
                        child_node = default.get(child)
                        if child_node is None:
                            self.report.slots_visited += len(slots)
                            return _Context(math.inf, frozenset(reads), tuple(slots))
                if node_op[child_node] == "Load":
                    entry = loads.get(child)
                    if entry is None:
                        entry = loads[child] = [False, 0.0, child_node]
                    if parent_op in ("Slice", "DynamicSlice"):
                        entry[1] += graph.slice_fraction(node)
                    elif parent_op == "Gather" and node_children[node][0] == child:
                        entry[1] += graph.gather_fraction(node)
                    else:
                        entry[0] = True
                mark = state.get(child)
                if mark == 1:
                    self.report.slots_visited += len(slots)
                    return _Context(math.inf, frozenset(reads), tuple(slots))  # a cycle inside the kernel
                if mark is None:
                    stack.append((child, child_node, index, False))
        self.report.slots_visited += len(slots)
        if hosted:
            return _Context(costs[kernel_node], frozenset(reads), tuple(slots))
        for whole, fraction, load_node in loads.values():
            read = costs[load_node]
            total += read if whole else read * min(1.0, fraction)
        return _Context(total, frozenset(reads), tuple(slots), frozenset(covered))

    # --- reference counts, order, legality ---

    def freed(self, old_reads, new_reads) -> float:
        """The cost dropped when a kernel stops reading `old_reads - new_reads`."""
        refcount, kernel_cost, kernel_reads = self.refcount, self.kernel_cost, self.kernel_reads
        drop: dict[int, int] = {}
        saved = 0.0
        stack = [r for r in old_reads if r not in new_reads]
        while stack:
            tensor = stack.pop()
            drop[tensor] = drop.get(tensor, 0) + 1
            if refcount.get(tensor, 0) - drop[tensor] == 0 and tensor not in new_reads:
                saved += kernel_cost.get(tensor, 0.0)
                stack.extend(kernel_reads.get(tensor, ()))
        return saved

    def reorder(self) -> None:
        """Recompute a topological order of the plan's tensors from the kernels' reads."""
        kernel_reads = self.kernel_reads
        seen: set[int] = set()
        fresh: list[int] = []
        for root in self.roots:
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
        self.position = {cls: i for i, cls in enumerate(fresh)}
        self.dirty = False

    def depends(self, tensor: int, owner: int) -> bool:
        """Whether `tensor` (transitively) reads `owner` in the current plan."""
        if self.dirty:
            self.reorder()
        position, kernel_reads = self.position, self.kernel_reads
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

    def valid(self, owner: int, reads) -> bool:
        """Whether kernel `owner` may read `reads`: live tensors (or leaves), none that depends on it."""
        if self.dirty:
            self.reorder()
        position, refcount = self.position, self.refcount
        for r in reads:
            if r == owner:
                return False
            if r not in position or (refcount.get(r, 0) == 0 and r not in self.root_set):
                if r not in self.leaf_classes:
                    return False
                continue
            if position[r] > position[owner] and self.depends(r, owner):
                return False
        return True

    def apply(self, owner: int, found: _Context) -> None:
        """Kernel `owner` now costs `found.cost` and reads `found.reads`."""
        refcount, kernel_reads = self.refcount, self.kernel_reads
        for r in found.reads - kernel_reads[owner]:
            refcount[r] = refcount.get(r, 0) + 1
            if r not in self.position or self.position[r] > self.position[owner]:
                self.dirty = True
            if r not in kernel_reads and self._is_kernel(r):
                self._count(r)
        stack = list(kernel_reads[owner] - found.reads)
        while stack:
            tensor = stack.pop()
            refcount[tensor] -= 1
            if refcount[tensor] == 0:
                stack.extend(kernel_reads.get(tensor, ()))
        self.kernel_cost[owner], kernel_reads[owner] = found.cost, found.reads

    def out_of_time(self) -> bool:
        if self.deadline is None:
            return False
        now = time.perf_counter()
        if now < self.next_clock_read:
            return False
        self.next_clock_read = now + CLOCK_READ_INTERVAL
        if cpu_clock() > self.deadline:
            self.report.stopped = "time_limit"
            return True
        return False

    # --- the moves ---

    def run(self, max_passes: int) -> Selection:
        for _ in range(max_passes):
            self.report.passes += 1
            if self.dirty:
                self.reorder()
            order = sorted(self.position, key=self.position.get)
            improved = self.switch_and_reuse(order)
            if self.report.stopped:
                break
            improved = self.retire(order) or improved
            if self.report.stopped or not improved:
                break
        return Selection(self.graph, self.nodes, self.roots).pruned()

    def switch_and_reuse(self, order: list[int]) -> bool:
        graph, nodes, node_op = self.graph, self.nodes, self.graph.node_op
        improved = False
        for owner in order:
            if self.refcount.get(owner, 0) == 0:
                continue
            node = nodes[(owner, GLOBAL)]
            if node_op[node] not in KERNEL_OPS and node_op[node] not in HOSTED_OPS:
                continue
            if self.out_of_time():
                return improved
            # Move 1: another node for the kernel (or hosted reduction) itself.
            for alternative in graph.class_nodes[owner]:
                if alternative == node:
                    continue
                found = self.context(owner, alternative)
                if not math.isfinite(found.cost) or not self.valid(owner, found.reads):
                    continue
                saved = self.freed(self.kernel_reads[owner], found.reads)
                if found.cost - self.kernel_cost[owner] - saved < -1e-12:
                    self.apply(owner, found)
                    nodes[(owner, GLOBAL)] = node = alternative
                    self.report.kernel_switches += 1
                    improved = True
            if node_op[node] not in KERNEL_OPS:
                continue
            # Move 2: read a tensor the plan materializes anyway instead of recomputing it here
            # (switch an expression slot, in this kernel only, to a `Load` of that tensor).
            for cls, loaded, _ in self.context(owner, node).slots:
                if loaded >= 0:
                    continue
                for alternative in self.load_nodes.get(cls, ()):
                    tensor = graph.node_children[alternative][0]
                    if self.refcount.get(tensor, 0) == 0 or self.slot_node(cls, owner) == alternative:
                        continue
                    found = self.context(owner, node, {cls: alternative})
                    if not math.isfinite(found.cost) or not self.valid(owner, found.reads):
                        continue
                    saved = self.freed(self.kernel_reads[owner], found.reads)
                    if found.cost - self.kernel_cost[owner] - saved < -1e-12:
                        self.apply(owner, found)
                        self.set_slot(cls, owner, alternative)
                        self.report.reuses += 1
                        improved = True
                        break
            if node in self.prologues or node in self.operand_repeats:
                improved = self.materialize(owner, node) or improved
        return improved

    def materialize(self, owner: int, node: int) -> bool:
        """Move 2b: a conv computes its input expression per tap and per output-channel tile (a
        matmul its A expression per N tile, its B per M tile); store a tensor of it the plan does
        not have yet (one kernel more) and read that instead, when the two kernels cost less than
        the recompute. The new kernel may read only tensors the
        plan has (or leaves) that do not depend on the conv."""
        graph, nodes, node_op = self.graph, self.nodes, self.graph.node_op
        for cls, loaded, _ in self.context(owner, node).slots:
            if loaded >= 0 or cls not in self.context(owner, node).prologue:
                continue
            for alternative in self.load_nodes.get(cls, ()):
                tensor = graph.node_children[alternative][0]
                if tensor == owner or self.refcount.get(tensor, 0) > 0 or tensor in self.leaf_classes:
                    continue  # already in the plan: move 2's
                tensor_node = nodes.get((tensor, GLOBAL))
                if tensor_node is None or node_op[tensor_node] not in KERNEL_OPS:
                    continue
                made = self.context(tensor, tensor_node)
                if not math.isfinite(made.cost) or tensor in made.reads or not self.valid(owner, made.reads):
                    continue
                found = self.context(owner, node, {cls: alternative})
                if not math.isfinite(found.cost) or not self.valid(owner, found.reads - {tensor}):
                    continue
                saved = self.freed(self.kernel_reads[owner], found.reads | made.reads)
                if found.cost + made.cost - self.kernel_cost[owner] - saved < -1e-12:
                    self.kernel_cost[tensor], self.kernel_reads[tensor] = made.cost, made.reads
                    self.refcount.setdefault(tensor, 0)
                    for read in made.reads:
                        self.refcount[read] = self.refcount.get(read, 0) + 1
                    self.dirty = True
                    self.apply(owner, found)
                    self.set_slot(cls, owner, alternative)
                    self.report.materializations += 1
                    return True
        return False

    def retire(self, order: list[int]) -> bool:
        """Move 3: retire a tensor: every kernel that reads it switches expression slots (in its own
        context) until it does not, all at once; a narrow matmul whose readers can all read a slice
        of a wider one already in the plan goes away only this way."""
        nodes, node_op, refcount, kernel_reads = self.nodes, self.graph.node_op, self.refcount, self.kernel_reads
        improved = False
        readers: dict[int, set[int]] = {}
        for owner in order:  # a leaf class a move made readable (an input) has no kernel and no reads
            if refcount.get(owner, 0) > 0:
                for read in kernel_reads.get(owner, ()):
                    readers.setdefault(read, set()).add(owner)
        for tensor in reversed(order):
            if refcount.get(tensor, 0) == 0 or tensor in self.root_set or tensor not in kernel_reads or \
                    node_op[nodes[(tensor, GLOBAL)]] not in KERNEL_OPS:
                continue
            if self.out_of_time():
                return improved
            moves = []
            for owner in sorted(readers.get(tensor, ()), key=lambda o: self.position.get(o, -1)):
                if refcount.get(owner, 0) == 0 or owner not in self.position:
                    continue
                if self.out_of_time():  # a tensor with many readers is many context walks
                    return improved
                move = self.retire_in(owner, tensor)
                if move is None:
                    moves = None
                    break
                moves.append((owner, *move))
            if not moves:
                continue
            delta = sum(found.cost - self.kernel_cost[owner] for owner, found, _, _ in moves)
            # What retiring frees: the tensor and whatever only it (and the old reads) kept alive.
            drop: dict[int, int] = {}
            for owner, found, _, _ in moves:
                for r in kernel_reads[owner] - found.reads:
                    drop[r] = drop.get(r, 0) + 1
            saved = 0.0
            stack = [r for r in drop if refcount.get(r, 0) - drop[r] == 0]
            freed_set: set[int] = set()
            new_reads = set().union(*(found.reads for _, found, _, _ in moves))
            while stack:
                t = stack.pop()
                if t in freed_set or t in new_reads:
                    continue
                freed_set.add(t)
                saved += self.kernel_cost.get(t, 0.0)
                for r in kernel_reads.get(t, ()):
                    drop[r] = drop.get(r, 0) + 1
                    if refcount.get(r, 0) - drop[r] == 0:
                        stack.append(r)
            if tensor not in freed_set or delta - saved >= -1e-12:
                continue
            for owner, found, start, local in moves:
                self.apply(owner, found)
                nodes[(owner, GLOBAL)] = start
                for cls, node in local.items():
                    self.set_slot(cls, owner, node)
                for r in found.reads:
                    readers.setdefault(r, set()).add(owner)
            self.report.retirements += 1
            improved = True
        return improved

    def retire_in(self, owner: int, tensor: int):
        """How kernel `owner` stops reading `tensor`: (context, kernel node, slot switches) or None.

        Greedy: repeatedly take the cheapest single switch of a slot on the way to a `tensor` load
        (in `owner`'s context) that lowers the number of such loads, until none is left. A hosted
        reduction reads its producer itself, not through a slot: every form of its class is tried
        (another producer's epilogue, its own kernel), each with its slots switched the same way."""
        graph = self.graph
        current = self.nodes[(owner, GLOBAL)]
        if graph.node_op[current] not in HOSTED_OPS:
            return self.retire_from(owner, tensor, current)
        best = None
        for start in graph.class_nodes[owner]:
            found = self.retire_from(owner, tensor, start)
            if found is not None and (best is None or found[0].cost < best[0].cost):
                best = found
        return best

    def retire_from(self, owner: int, tensor: int, kernel_node: int):
        class_nodes = self.graph.class_nodes
        local: dict[int, int] = {}
        found = self.context(owner, kernel_node)
        for _ in range(RETIRE_STEPS):
            slots = found.slots
            loads = sum(1 for _, t, _ in slots if t == tensor)
            if tensor not in found.reads and loads == 0:
                return found, kernel_node, local
            on_path: dict[int, None] = {}
            for index, (_, t, _) in enumerate(slots):
                if t != tensor:
                    continue
                while index >= 0 and index not in on_path:
                    on_path[index] = None
                    index = slots[index][2]
            best = None
            for index in sorted(on_path):
                cls = slots[index][0]
                if len(class_nodes[cls]) < 2:
                    continue
                chosen = local.get(cls, self.slot_node(cls, owner))
                for alternative in class_nodes[cls]:
                    if alternative == chosen:
                        continue
                    trial = dict(local)
                    trial[cls] = alternative
                    candidate = self.context(owner, kernel_node, trial)
                    if not math.isfinite(candidate.cost) or not self.valid(owner, candidate.reads - {tensor}):
                        continue
                    n = sum(1 for _, t, _ in candidate.slots if t == tensor)
                    if n >= loads and tensor in candidate.reads:
                        continue
                    if best is None or (n, candidate.cost) < (best[0], best[1].cost):
                        best = (n, candidate, trial)
            if best is None:
                return None
            _, found, local = best
        return None


def polish(selection: Selection, costs, *, fallback: dict | None = None, max_passes: int = 3,
           deadline: float | None = None) -> tuple[Selection, PolishReport]:
    """Improve `selection` by local moves, each kept only if the plan's modeled cost drops.

    Moves, for every kernel of the plan in order:
    - switch the kernel's node (a bias-add `Pointwise` over a matmul -> the matmul with the add in
      its epilogue, say), and
    - switch one expression node inside the kernel, for this kernel only (read `Load(T)` instead
      of recomputing `T`, or one slice of a wide matmul instead of another);
    then, for every tensor, retire it by switching all its readers at once.
    A move may read only tensors the plan already materializes earlier in its order, so the plan
    stays acyclic; tensors no kernel reads any more after the move are dropped, and their cost with
    them. `fallback` (slot -> node, e.g. a greedy pass's choice for every class) supplies nodes
    for expression classes the selection does not reach yet. Past `deadline` (a
    `cpu_clock()` value) the polish stops between two moves and returns the plan so far,
    with `report.stopped == "time_limit"`.
    """
    try:
        state = _Polish(selection, costs, fallback, deadline)
    except _OutOfTime:  # the deadline came before the first move: the plan as it was
        return selection, PolishReport(stopped="time_limit")
    return state.run(max_passes), state.report
