"""Extraction that scales: its work grows linearly with the program, and its time limit holds.

The programs are the benchmark's residual MLP (`benchmarks.scale`: LayerNorm, Linear, exact GELU,
Linear, residual add per layer) at small depths and widths, and issue 18's residual chain
(`benchmarks.scale.residual_chain`: `x = x + silu(layernorm(x @ w + b))`, 24 wide), whose tiny
residual stream is cheaper to recompute than to store at any depth: without the kernel-size bound
(`extract.greedy.MAX_KERNEL_TREE`) layer k's kernel recomputed all k layers before it. Work is
counted, not timed: the expression slots the polish's kernel walks visit, the greedy pass's node
evaluations, the tensors a kernel reads. The time limit is tested with a clock that ticks once per
reading, so where the polish stops is exact, and on a chain with no time at all.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
import extract.greedy as greedy_module
from benchmarks.scale import chain_arguments, mlp_arguments, residual_chain, residual_mlp
from eqsat.cost.roofline import _kernel_body
from driver.optimize import ExtractionLimitWarning
from extract import extract, load
from extract.greedy import MAX_CONTEXT_SLOTS, MAX_KERNEL_TREE, extract_greedy, polish

SMALL = dict(batch=2, tokens=8, width=16, hidden=32, dtype=jnp.float32)


def lowered(layers: int, **options):
    return eqsat.optimize(residual_mlp, progress=False, **options).lower(*mlp_arguments(layers, **SMALL))


@pytest.fixture(scope="module")
def depths():
    """Lowerings of the MLP at 4, 8 and 16 layers (generous extraction time limit: no stop)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtractionLimitWarning)  # an ample limit neither warns...
        return {layers: lowered(layers, extract_time_limit=600.0) for layers in (4, 8, 16)}


def test_extraction_work_grows_linearly_with_the_layers(depths):
    polish_work = {n: low.extraction.details["greedy"]["polish"]["slots_visited"] for n, low in depths.items()}
    walks = {n: low.extraction.details["greedy"]["polish"]["walks"] for n, low in depths.items()}
    sweeps = {n: low.extraction.details["greedy"]["evaluations_per_node"] for n, low in depths.items()}
    for small, large in ((4, 8), (8, 16)):
        # Twice the layers: about twice the work (a quadratic polish would be about 4x).
        assert polish_work[large] <= 2.3 * polish_work[small], polish_work
        assert walks[large] <= 2.3 * walks[small], walks
        assert sweeps[large] <= 1.15 * sweeps[small], sweeps
        assert depths[large].stats["fused_kernels"] == 2 * depths[small].stats["fused_kernels"]
    for low in depths.values():  # ...nor flags
        assert low.stats["extract_limit_reached"] is None and low.extraction.limit_reached is None
        assert not any("extraction stopped" in message for message in low.warnings)


def test_a_tiny_extraction_time_limit_stops_and_says_so(depths):
    with pytest.warns(ExtractionLimitWarning, match="extraction stopped by its time limit"):
        limited = lowered(4, extract_time_limit=0.0)
    assert limited.stats["extract_limit_reached"] == "time_limit"
    assert limited.extraction.limit_reached == "time_limit"
    assert any("extraction stopped by its time limit" in message for message in limited.warnings)
    details = limited.extraction.details
    assert details["greedy"]["polish"]["stopped"] == "time_limit"
    assert len([name for name, _ in details["greedy"]["rounds"] if name != "polish"]) == 1  # later rounds skipped
    assert details["ilp"]["status"] == "not started: time limit"
    # The best plan so far: a complete plan, never better than the unhurried one, computing the same.
    assert limited.plan.seconds >= depths[4].plan.seconds * (1 - 1e-9)
    rng = np.random.default_rng(0)
    x_spec, layer_specs = mlp_arguments(4, **SMALL)
    x = rng.standard_normal(x_spec.shape).astype(np.float32)
    layers = [{k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p.items()} for p in layer_specs]
    np.testing.assert_allclose(np.asarray(limited(x, layers)), np.asarray(jax.jit(residual_mlp)(x, layers)),
                               rtol=2e-4, atol=2e-4)


class _TickingClock:
    """A clock (`extract.greedy.cpu_clock`) that advances one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_polish_stops_between_moves_and_keeps_the_plan_so_far(depths, monkeypatch):
    low = depths[8]
    graph = load(low.egraph._serialize())
    roots = graph.roots_of_handles([low.builder.handle(t) for t in low.program.outputs])
    costs = graph.node_costs()
    raw = extract_greedy(graph, roots, costs, rounds=("horizontal",), polish_passes=0)  # leaves moves to make
    full, report = polish(raw.selection, costs, fallback=raw.selection.fallback)
    assert report.stopped is None and report.kernel_switches + report.reuses + report.retirements > 0
    clock = _TickingClock()
    monkeypatch.setattr(greedy_module, "cpu_clock", clock)
    previous = math.inf
    for readings in (0, 1, 3, 10, 30, 100):
        clock.now = 0.0
        partial, partial_report = polish(raw.selection, costs, fallback=raw.selection.fallback, deadline=readings)
        partial.postorder()  # complete and acyclic
        value = partial.cost(costs)
        assert raw.score * (1 + 1e-12) >= value >= full.cost(costs) * (1 - 1e-12)
        assert value <= previous * (1 + 1e-12)  # a later stop keeps every earlier move
        previous = value
        if partial_report.stopped is None:
            assert partial.nodes == full.nodes
        else:
            assert partial_report.stopped == "time_limit"
    assert clock.now > 0


def test_extract_without_time_skips_the_ilp_and_says_so(depths):
    low = depths[4]
    result = extract(low.egraph._serialize(), [low.builder.handle(t) for t in low.program.outputs], time_limit=0.0)
    assert result.limit_reached == "time_limit"
    assert result.details["ilp"]["status"] == "not started: time limit"
    assert set(result.details["seconds"]) >= {"load", "greedy", "ilp", "terms"}


# --- issue 18's residual chain ------------------------------------------------------------------


def _extraction_inputs(low):
    return low.egraph._serialize(), [low.builder.handle(t) for t in low.program.outputs]


def test_the_limit_keeps_back_the_build_of_terms_and_plan(depths):
    """The time limit bounds the whole stage: what building the chosen terms and the Plan will take
    (`build_reserve`) is kept back from the search. A reserve as large as the limit leaves the
    search only its first round, however generous the limit; no reserve leaves it all."""
    data, handles = _extraction_inputs(depths[4])
    starved = extract(data, handles, time_limit=1000.0, build_reserve=1000.0)
    assert starved.limit_reached == "time_limit"
    assert starved.details["greedy"]["polish"]["stopped"] == "time_limit"
    assert starved.details["ilp"]["status"] == "not started: time limit"
    ample = extract(data, handles, time_limit=1000.0, build_reserve=0.0)
    assert ample.limit_reached is None
    assert ample.cost <= starved.cost * (1 + 1e-12)


def test_a_polish_stops_in_time_to_rate_its_plan(depths, monkeypatch):
    """Each polished plan is rated after its polish (a full pricing of the plan), so the polish's
    deadline is the search's less the longest rating of a round's plan."""
    low = depths[4]
    graph = load(low.egraph._serialize())
    roots = graph.roots_of_handles([low.builder.handle(t) for t in low.program.outputs])
    costs = graph.node_costs("h100")
    clock = _TickingClock()
    monkeypatch.setattr(greedy_module, "cpu_clock", clock)
    deadlines = []

    def recording_polish(selection, costs, **options):
        deadlines.append(options["deadline"])
        return selection, None

    def slow_score(selection, cutoff=math.inf):
        clock.now += 7.0  # every rating takes 7 s (plus the clock's own ticks)
        return selection.cost(costs, cutoff)

    monkeypatch.setattr(greedy_module, "polish", recording_polish)
    extract_greedy(graph, roots, costs, score=slow_score, rounds=("shared",), deadline=1000.0)
    assert deadlines == [1000.0 - 8.0]  # 7 s and the one tick of reading the clock after it


def test_no_ilp_solver_for_a_graph_it_cannot_take(depths, monkeypatch):
    """Every node of a reachable tensor class is an ILP variable, so a graph with more than
    `ilp_max_variables` of them never starts the solver (nor imports scipy for it)."""
    import extract as extraction

    data, handles = _extraction_inputs(depths[4])
    graph = load(data)
    roots = graph.roots_of_handles(handles)
    bound = extraction.ilp_variables_at_least(graph, roots)
    from extract.ilp import extract_ilp

    assert 0 < bound <= extract_ilp(graph, roots, graph.node_costs("h100"), time_limit=60).variables

    def no_solver(*args, **kwargs):
        raise AssertionError("the ILP was started")

    monkeypatch.setattr(extraction, "extract_ilp", no_solver)
    result = extract(graph, roots=roots, time_limit=1000.0, ilp_max_variables=bound - 1)
    assert result.details["ilp"]["status"] == "too large" and result.details["ilp"]["variables"] == bound
    assert result.limit_reached is None and result.extractor == "greedy"


def _chain_values(layers: int, seed: int = 0):
    x_spec, weight_specs, bias_specs = chain_arguments(layers)
    rng = np.random.default_rng(seed)
    x = (3.0 + rng.standard_normal(x_spec.shape)).astype(np.float32)  # an offset larger than the spread
    weights = [(0.3 * rng.standard_normal(s.shape)).astype(np.float32) for s in weight_specs]
    biases = [(0.3 * rng.standard_normal(s.shape)).astype(np.float32) for s in bias_specs]
    return x, weights, biases


def _expression_nodes(kernel) -> int:
    """Distinct expression nodes `kernel` computes (the polish's slots, at most `MAX_CONTEXT_SLOTS`)."""
    return len({id(node) for node, _ in _kernel_body(kernel) if node.sort == "Expr"})


@pytest.fixture(scope="module")
def chains():
    """The chain at 48 and 96 layers, unhurried; recomputed from the start, the last kernel of 96
    layers would compute ~2600 expression nodes and read 193 tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtractionLimitWarning)
        return {layers: eqsat.optimize(residual_chain, progress=False, backend="xla", extract_time_limit=600.0)
                .lower(*chain_arguments(layers)) for layers in (48, 96)}


def test_the_polish_never_inlines_past_the_greedy_bound():
    assert MAX_CONTEXT_SLOTS <= MAX_KERNEL_TREE


def test_a_deep_chain_keeps_its_kernels_bounded_and_its_work_linear(chains):
    most_reads = {n: max(len(k.inputs) for k in low.plan.kernels) for n, low in chains.items()}
    largest = {n: max(_expression_nodes(k.term) for k in low.plan.kernels) for n, low in chains.items()}
    for n, low in chains.items():
        assert largest[n] <= MAX_CONTEXT_SLOTS, largest
        assert low.stats["extract_limit_reached"] is None
    # Twice the layers: kernels no larger, about twice the kernels and the work.
    assert most_reads[96] <= most_reads[48] + 2, most_reads
    assert largest[96] <= largest[48] * 1.1 + 80, largest
    kernels = {n: len(low.plan.kernels) for n, low in chains.items()}
    assert 1.8 * kernels[48] <= kernels[96] <= 2.2 * kernels[48], kernels
    polish_work = {n: low.extraction.details["greedy"]["polish"]["slots_visited"] for n, low in chains.items()}
    assert polish_work[96] <= 2.5 * polish_work[48], polish_work  # measured 2.3 (quadratic: 4)
    sweeps = {n: low.extraction.details["greedy"]["evaluations_per_node"] for n, low in chains.items()}
    assert sweeps[96] <= 1.15 * sweeps[48], sweeps


@pytest.mark.parametrize("layers", [48, 96])
def test_a_cut_chain_computes_what_jax_computes(chains, layers):
    low = chains[layers]
    args = _chain_values(layers, seed=layers)
    expected = np.asarray(jax.jit(residual_chain)(*args))
    np.testing.assert_allclose(np.asarray(low(*args)), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(low.executable("interpret")(*args)), expected, rtol=1e-4, atol=1e-4)


def test_a_chain_with_no_time_does_no_work_past_its_first_round(chains):
    """`extract_time_limit=0`: the first greedy round runs (there must be a plan), nothing after it:
    no second round, no polish walk, no ILP; the plan is complete and computes the program."""
    with pytest.warns(ExtractionLimitWarning, match="extraction stopped by its time limit"):
        low = eqsat.optimize(residual_chain, progress=False, backend="xla", extract_time_limit=0.0) \
            .lower(*chain_arguments(96))
    details = low.extraction.details
    assert low.stats["extract_limit_reached"] == "time_limit"
    assert [name for name, _ in details["greedy"]["rounds"]] == ["horizontal"]
    assert details["greedy"]["polish"]["walks"] == 0 and details["greedy"]["polish"]["stopped"] == "time_limit"
    assert details["ilp"]["status"] == "not started: time limit"
    phases = details["greedy"]["phases"]
    past_the_first_round = details["seconds"]["greedy"] - phases["prepare"] - phases["horizontal"]
    assert past_the_first_round < 1.0, details["seconds"]  # generous: it is bookkeeping, not search
    assert low.plan.seconds >= chains[96].plan.seconds * (1 - 1e-9)
    args = _chain_values(96, seed=1)
    np.testing.assert_allclose(np.asarray(low(*args)), np.asarray(jax.jit(residual_chain)(*args)),
                               rtol=1e-4, atol=1e-4)
