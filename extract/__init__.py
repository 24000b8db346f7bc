"""Extraction: the serialized e-graph -> the chosen term DAG -> a `Plan`.

    data = extract.load(egraph._serialize())                 # parse the JSON once
    result = extract.extract(data, handles, device="h100")   # roots by builder handle
    result.terms, result.extractor, result.seconds

`method`: "greedy" (`extract.greedy`: greedy rounds, then local-move polish), "ilp"
(`extract.ilp` on the whole graph, the greedy plan if the ILP finds nothing better in time), or
"auto": greedy, then the ILP on the whole graph when it has at most `ilp_max_variables`
variables, else on regions of the greedy plan (windows of `region_kernels` kernels of its order)
while `region_budget` ILP variables last (default 0: after the greedy's polish, regional ILPs on
the SD 1.5 UNet found nothing to improve in ~15 regions and cost ~0.5 s each); a region's answer
replaces the plan only if the modeled cost drops. `result.extractor` says what produced the plan: "greedy", "ilp", or
"greedy+ilp(k/n regions)" when k of the n regions improved it.

Every candidate plan (each greedy round's, polished; the ILP's; a region's) is rated by the cost
model on the terms it builds (`score_selection`: `eqsat.cost.dag_cost`, the price `Plan.build`
reports, finalize kernels included), so all methods are compared on the cost the plan reports;
the per-node objective the searches minimize (`EGraphData.node_costs`) does not charge a finalize
kernel or a matmul prologue's recompute per tile, so it only guides them. Deterministic: ties keep the earlier candidate, the ILP runs under a
branch-and-bound node limit, regions are visited in order under a budget counted in variables.

`time_limit` (CPU seconds of the extracting thread) bounds the whole extraction, counted from the call:
reading the e-graph, the search, and building the chosen terms and the caller's `Plan`, for which
`build_reserve` seconds (default `BUILD_SECONDS_PER_NODE` per e-node, measured) are kept back from
the search. A greedy round after the first runs only if it and the polish look like fitting (the
first always runs: there must be a plan), the polish is skipped when no time is left after the
rounds and otherwise stops between two moves (or while still reading the plan), the ILP is not
started (or HiGHS stops at the limit), and the regional ILPs stop; the plan is the best found so
far and `result.limit_reached` says "time_limit" (None when every step ran to its end). Only then
does the result depend on the machine's speed. `result.details["seconds"]` times each step. The
ILP's solver (scipy) is imported only when the whole-graph ILP could fit `ilp_max_variables` (its
nodes in reachable tensor classes are each a variable) or regions will be solved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eqsat.cost import dag_cost, get_device
from extract.greedy import GreedyResult, cpu_clock, extract_greedy
from extract.serialized import EGraphData, Selection, load, reachable_classes

if TYPE_CHECKING:
    from extract.ilp import IlpResult

__all__ = ["Extraction", "extract", "load", "EGraphData", "Selection", "score_selection", "Plan"]


def extract_ilp(*args, **kwargs):
    """`extract.ilp.extract_ilp`, imported on first use: it imports scipy.optimize (1-4 s here), which
    a process rebuilding its plans from the plan cache (`extract.plan` only) never needs."""
    from extract.ilp import extract_ilp as solve

    return solve(*args, **kwargs)


def __getattr__(name):
    if name in ("Plan", "Kernel", "Buffer"):
        from extract import plan

        return getattr(plan, name)
    raise AttributeError(name)


@dataclass
class Extraction:
    """The chosen DAG: its root terms, the selection behind them, and how it was found."""

    graph: EGraphData
    selection: Selection
    terms: list                      # root Terms, in the order of the roots
    class_of: dict                   # Tensor Term -> e-class index
    extractor: str                   # "greedy" | "ilp" | "greedy+ilp(k/n regions)"
    cost: float                      # modeled seconds of the plan
    seconds: float                   # wall time of the extraction
    details: dict = field(default_factory=dict)
    limit_reached: str | None = None  # "time_limit" when the time limit cut the search short


def score_selection(selection: Selection, device="h100", cutoff: float = math.inf) -> float:
    """The modeled seconds of the plan a selection builds, as `eqsat.cost` prices the finished plan
    (`dag_cost`, what `Plan.build` reports: every kernel, the statistics it hosts, and the finalize
    kernels of the statistics the plan finishes once); `inf` once past `cutoff`."""
    terms, _ = selection.to_terms()
    total = dag_cost(terms, get_device(device)).seconds
    return math.inf if total > cutoff else total


# CPU seconds that building the chosen terms and then the `Plan` take per e-node of the graph,
# kept back from the search (the 600-layer residual chain, 51k e-nodes: 0.24 s of terms and 0.26 s of
# Plan; the SD 1.5 UNet, 18k e-nodes: 0.03 s and 0.35 s), so the time limit bounds the whole stage.
BUILD_SECONDS_PER_NODE = 2e-5


def extract(data, handles=None, *, roots=None, device="h100", method: str = "auto",
            time_limit: float = 5.0, ilp_max_variables: int = 5_000, region_kernels: int = 24,
            region_budget: int = 0, node_limit: int | None = 1000, build_reserve: float | None = None
            ) -> Extraction:
    """Extract the plan of `handles` (builder handles of the root terms) or `roots` (classes)."""
    started = time.perf_counter()
    started_cpu = cpu_clock()
    seconds: dict[str, float] = {}
    graph = data if isinstance(data, EGraphData) else load(data)
    if roots is None:
        if handles is None:
            raise ValueError("pass the roots' builder handles or their class indices")
        roots = graph.roots_of_handles(handles)
    roots = list(roots)
    device = get_device(device)
    costs = graph.node_costs(device)
    seconds["load"] = time.perf_counter() - started
    if build_reserve is None:
        build_reserve = BUILD_SECONDS_PER_NODE * graph.num_nodes
    deadline = started_cpu + time_limit - build_reserve  # CPU seconds: plans do not depend on the machine's load

    def score(selection: Selection, cutoff: float = math.inf) -> float:
        return score_selection(selection, device, cutoff)

    details: dict = {"seconds": seconds}
    if method not in ("auto", "greedy", "ilp"):
        raise ValueError(f"unknown extraction method {method!r}")
    began = time.perf_counter()
    greedy: GreedyResult = extract_greedy(graph, roots, costs, score=score, deadline=deadline)
    seconds["greedy"] = time.perf_counter() - began
    best, best_cost, extractor = greedy.selection, greedy.score, "greedy"
    limit_reached = greedy.stopped
    details["greedy"] = {"cost": greedy.score, "rounds": greedy.rounds, "evaluations_per_node": greedy.sweeps,
                         "seconds": time.perf_counter() - started, "phases": greedy.seconds,
                         "polish": greedy.polish.as_dict() if greedy.polish else None, "stopped": greedy.stopped}
    if method in ("auto", "ilp"):
        began = time.perf_counter()
        remaining = deadline - cpu_clock()
        lower_bound = ilp_variables_at_least(graph, roots)
        max_variables = ilp_max_variables if method == "auto" else 10 * ilp_max_variables
        if remaining <= 0:
            details["ilp"] = {"status": "not started: time limit", "objective": math.nan, "variables": 0,
                              "constraints": 0, "seconds": 0.0, "stopped": "time_limit"}
            limit_reached = "time_limit"
        elif lower_bound > max_variables and not (method == "auto" and region_budget > 0):
            details["ilp"] = {"status": "too large", "objective": math.nan, "variables": lower_bound,
                              "constraints": 0, "seconds": 0.0, "stopped": None}
        else:
            whole = extract_ilp(graph, roots, costs, time_limit=remaining, node_limit=node_limit,
                                max_variables=max_variables)
            details["ilp"] = _ilp_details(whole)
            limit_reached = limit_reached or whole.stopped
            if whole.selection is not None:
                value = score(whole.selection)
                details["ilp"]["cost"] = value
                if value < best_cost * (1 - 1e-12) or (method == "ilp" and value <= best_cost * (1 + 1e-12)):
                    best, best_cost, extractor = whole.selection, value, "ilp"
            elif whole.status == "too large" and method == "auto" and region_budget > 0:
                best, best_cost, extractor, regional = _regional(
                    graph, roots, costs, best, best_cost, score, deadline, region_kernels, node_limit, region_budget)
                details["regions"] = regional
                limit_reached = limit_reached or regional["stopped"]
        seconds["ilp"] = time.perf_counter() - began
    began = time.perf_counter()
    terms, class_of = best.to_terms()
    seconds["terms"] = time.perf_counter() - began
    return Extraction(graph, best, terms, class_of, extractor, best_cost, time.perf_counter() - started, details,
                      limit_reached)


def ilp_variables_at_least(graph: EGraphData, roots) -> int:
    """A lower bound on the whole-graph ILP's variables (`extract.ilp`): one per node of each
    tensor class reachable from `roots`, before any context or prologue variable."""
    return sum(len(graph.class_nodes[c]) for c in reachable_classes(graph, roots) if graph.class_sort[c] == "Tensor")


def _ilp_details(result: IlpResult) -> dict:
    return {"status": result.status, "objective": result.objective, "variables": result.variables,
            "constraints": result.constraints, "seconds": result.seconds, "stopped": result.stopped}


def regions_of(selection: Selection, per_region: int) -> list[set[int]]:
    """Windows of `per_region` kernels of the selection's order, plus the tensor classes it does not
    use, each joined to the window of the first used class it touches (a reader or an operand)."""
    graph = selection.graph
    order = selection.kernel_classes()
    home: dict[int, int] = {}
    for index, cls in enumerate(order):
        home[cls] = index // max(per_region, 1)
    tensors = [c for c in reachable_classes(graph, selection.roots) if graph.class_sort[c] == "Tensor"]
    # Neighbours through expression classes: a tensor's operands and readers.
    neighbours: dict[int, list[int]] = {c: [] for c in tensors}
    for cls in tensors:
        stack = [child for node in graph.class_nodes[cls] for child in graph.node_children[node] if child >= 0]
        seen: set[int] = set()
        while stack and len(seen) < 256:
            child = stack.pop()
            if child in seen:
                continue
            seen.add(child)
            if graph.class_sort[child] == "Tensor":
                neighbours[cls].append(child)
                if child in neighbours:
                    neighbours[child].append(cls)
                continue
            stack.extend(c for node in graph.class_nodes[child] for c in graph.node_children[node] if c >= 0)
    for _ in range(4):  # unused classes join a neighbour's window, a few hops out
        for cls in tensors:
            if cls not in home:
                homes = sorted(home[n] for n in neighbours[cls] if n in home)
                if homes:
                    home[cls] = homes[-1]
    windows: dict[int, set[int]] = {}
    for cls, window in home.items():
        windows.setdefault(window, set()).add(cls)
    return [windows[w] for w in sorted(windows)]


def _regional(graph, roots, costs, best, best_cost, score, deadline, per_region, node_limit, budget):
    regions = regions_of(best, per_region)
    improved = solved = spent = 0
    stopped = None
    for region in regions:
        if spent >= budget:
            break
        remaining = deadline - cpu_clock()
        if remaining <= 0.05:
            stopped = "time_limit"
            break
        result = extract_ilp(graph, roots, costs, region=region, incumbent=best, time_limit=remaining,
                             node_limit=node_limit, max_variables=budget - spent)
        spent += result.variables
        stopped = stopped or result.stopped
        if result.status == "too large":
            continue
        solved += 1
        if result.selection is None:
            continue
        value = score(result.selection, best_cost)
        if value < best_cost * (1 - 1e-12):
            best, best_cost = result.selection, value
            improved += 1
    extractor = f"greedy+ilp({improved}/{len(regions)} regions)" if improved else "greedy"
    return best, best_cost, extractor, {"regions": len(regions), "solved": solved, "improved": improved,
                                        "variables": spent, "stopped": stopped}
