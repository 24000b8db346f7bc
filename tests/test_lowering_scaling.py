"""Lowering work grows linearly with the program (issue 8 §6): counted, not timed.

The residual MLP of `benchmarks.scale` at a few depths (tiny shapes: the work counted does not
depend on them). What used to grow faster than the program: one egglog command per lifted term
(each costs time growing with the e-graph), and a second serialization of the whole e-graph to
count its classes.
"""

from __future__ import annotations

import math

import pytest
from egglog import EGraph

import eqsat
from benchmarks.scale import mlp_arguments, residual_mlp
from eqsat import egraph as egraph_module
from eqsat.egraph import Builder
from eqsat.lift import lift

SHAPE = dict(batch=1, tokens=8, width=16, hidden=32)


class _CountingEGraph:
    """Stands in for egglog's engine object: counts `run_program` calls and the commands passed."""

    def __init__(self, engine):
        self.engine, self.calls, self.commands = engine, 0, 0

    def run_program(self, *commands):
        self.calls += 1
        self.commands += len(commands)
        return self.engine.run_program(*commands)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _build_counted(layers: int) -> tuple[Builder, _CountingEGraph, int]:
    program = lift(residual_mlp, *mlp_arguments(layers, **SHAPE))
    builder = Builder()
    state = builder.egraph._state
    counting = _CountingEGraph(state.egraph)
    state.egraph = counting
    try:
        builder.add(program.outputs)
    finally:
        state.egraph = counting.engine
    return builder, counting, len(builder.handles)


def test_builder_issues_a_constant_number_of_egglog_calls():
    small, small_count, small_terms = _build_counted(2)
    large, large_count, large_terms = _build_counted(8)
    assert large_terms > 3 * small_terms
    assert small_count.calls == large_count.calls == 2  # declare the rules, run them once
    # one command per rule of `_CHUNK` unions (plus adding the ruleset and the run), not one per term
    assert large_count.commands == math.ceil(large_terms / egraph_module._CHUNK) + 2
    assert small_count.commands == math.ceil(small_terms / egraph_module._CHUNK) + 2


def test_builder_rules_make_every_handle_its_term():
    """Every term's `Ref` is in the class of the term itself: the e-graph has one class per distinct
    Tensor term, as the one-union-per-command builder made."""
    builder, _, terms = _build_counted(3)
    data = builder.egraph._serialize().to_json()
    from extract.serialized import load

    graph = load(data)
    assert len(graph.handles) == terms
    tensor_classes = {cls for cls in graph.handles.values()}
    assert len(tensor_classes) == terms  # no two distinct lifted terms merged, none left out


def test_two_builds_into_one_egraph_add_to_it():
    """`Builder.add` twice into the same e-graph: the second call's rules get their own ruleset."""
    first = lift(residual_mlp, *mlp_arguments(1, **SHAPE))
    second = lift(lambda x, layers: residual_mlp(x * 2.0, layers), *mlp_arguments(1, **SHAPE))
    builder = Builder(EGraph())
    a = builder.add(first.outputs)
    b = builder.add(second.outputs)
    assert a != b
    from extract.serialized import load

    graph = load(builder.egraph._serialize())
    assert set(graph.handles) == set(range(len(builder.handles)))


def _lower_counting_serializations(monkeypatch, layers: int):
    calls = []
    original = EGraph._serialize

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EGraph, "_serialize", counted)
    lowered = eqsat.optimize(residual_mlp, progress=False).lower(*mlp_arguments(layers, **SHAPE))
    monkeypatch.setattr(EGraph, "_serialize", original)
    return lowered, len(calls)


@pytest.mark.parametrize("layers", [1, 4])
def test_lowering_serializes_the_egraph_once(monkeypatch, layers):
    lowered, serializations = _lower_counting_serializations(monkeypatch, layers)
    assert serializations == 1
    stats = lowered.stats
    # the class count comes from that one serialization and is the saturated e-graph's own
    from eqsat.saturate import count_classes

    assert stats["e_classes"] == count_classes(lowered.egraph) > 0
    assert stats["fused_kernels"] == 2 * layers


def test_saturation_work_grows_linearly_with_layers():
    """Same number of ruleset runs at every depth, e-nodes linear in the layers."""
    stats = {}
    for layers in (2, 4, 6):
        lowered = eqsat.optimize(residual_mlp, progress=False).lower(*mlp_arguments(layers, **SHAPE))
        stats[layers] = lowered.stats
    assert stats[2]["iterations"] == stats[4]["iterations"] == stats[6]["iterations"]
    per_two_layers = stats[4]["e_nodes"] - stats[2]["e_nodes"]
    assert per_two_layers > 0
    assert stats[6]["e_nodes"] - stats[4]["e_nodes"] == per_two_layers
    assert stats[6]["e_classes"] - stats[4]["e_classes"] == stats[4]["e_classes"] - stats[2]["e_classes"]
