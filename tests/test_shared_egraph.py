"""Plans made on the thread's shared e-graph (rules registered once, the program's state pushed and
popped: `driver.optimize._SharedEGraph`) equal plans made on a fresh e-graph, one after another and
from two threads at once, and a lowering's e-graph and builder are rebuilt when asked for."""

from __future__ import annotations

import threading

import jax
import numpy as np

import eqsat
from eqsat.saturate import count_nodes
from eqsat.schedule import default_schedule


def layer_norm_mlp(x, w, b):
    h = x @ w + b
    return jax.nn.gelu((h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5))


def relu_mlp(x, w, b):
    return jax.nn.relu(x @ w + b) @ w


def softmax_rows(x, w, b):
    return jax.nn.softmax(x * b, axis=-1) + x @ w


ARGS = (np.ones((8, 16), np.float32), np.ones((16, 16), np.float32), np.ones(16, np.float32))
FIELDS = ("e_nodes", "iterations", "fused_kernels", "plan_seconds", "plan_bytes")


def _stats(fn, rulesets=None):
    stats = eqsat.optimize(fn, rulesets=rulesets, cache=False, progress=False).lower(*ARGS).stats
    return {name: stats[name] for name in FIELDS}


def test_plans_on_the_shared_egraph_equal_fresh_ones_in_any_order():
    fresh = {fn: _stats(fn, rulesets=default_schedule()) for fn in (layer_norm_mlp, relu_mlp, softmax_rows)}
    for fn in (layer_norm_mlp, relu_mlp, softmax_rows, relu_mlp, layer_norm_mlp):
        assert _stats(fn) == fresh[fn], fn.__name__


def test_the_egraph_and_builder_of_a_shared_plan_are_rebuilt_on_first_use():
    lowered = eqsat.optimize(layer_norm_mlp, cache=False, progress=False).lower(*ARGS)
    assert lowered._rebuild is not None  # planned on the shared e-graph
    assert sum(count_nodes(lowered.egraph).values()) == lowered.stats["e_nodes"]
    assert set(lowered.builder.handles) >= set(lowered.program.outputs)
    assert lowered.saturation.e_nodes == lowered.stats["e_nodes"]
    np.testing.assert_allclose(lowered(*ARGS), jax.jit(layer_norm_mlp)(*ARGS), rtol=1e-5, atol=1e-5)


def test_two_threads_planning_at_once_get_the_plans_of_one():
    """egglog e-graphs stay on their thread: each thread plans on its own shared e-graph."""
    want = {fn: _stats(fn) for fn in (layer_norm_mlp, softmax_rows)}
    got, errors = {}, []

    def plan(fn):
        try:
            for _ in range(3):
                got.setdefault(fn, []).append(_stats(fn))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=plan, args=(fn,)) for fn in want]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for fn, stats in got.items():
        assert stats == [want[fn]] * 3, fn.__name__
