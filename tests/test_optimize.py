"""`eqsat.optimize`: the stages end to end on small JAX functions."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from eqsat.optimize import SaturationLimitWarning


def mlp(x, w1, b1, w2, b2):
    with jax.named_scope("layer1"):
        h = x @ w1 + b1
        h = h * jax.nn.sigmoid(h)
    with jax.named_scope("layer2"):
        return x + (h @ w2 + b2)


def mlp_args(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    shapes = [(8, 16), (16, 32), (32,), (32, 16), (16,)]
    return [(rng.standard_normal(s) * 0.3).astype(dtype) for s in shapes]


def close(got, want, tol=1e-4):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


def test_optimize_lowers_plans_and_runs_like_the_function():
    fast = eqsat.optimize(mlp)
    args = mlp_args()
    lowered = fast.lower(*args)
    stats = lowered.stats
    for key in ("naive_kernels", "fused_kernels", "plan_bytes", "plan_peak_bytes", "seconds", "extractor",
                "saturated", "limit_reached"):
        assert key in stats, key
    assert set(stats["seconds"]) == {"lift", "build", "saturate", "extract"}
    assert stats["fused_kernels"] < stats["naive_kernels"]
    assert stats["fused_kernels"] == len(lowered.plan.kernels)
    assert lowered.plan.naive_kernels == stats["naive_kernels"]
    assert stats["plan_bytes"] == pytest.approx(lowered.plan.bytes)
    close(fast(*args), mlp(*args))
    close(lowered(*args), mlp(*args))
    report = lowered.report()
    assert "naive kernels" in report and "layer1" in report and "total" in report
    assert lowered.egraph is lowered.builder.egraph and lowered.program.outputs


def test_lowerings_are_cached_per_signature_and_accept_shape_structs():
    fast = eqsat.optimize(mlp)
    args = mlp_args()
    first = fast.lower(*args)
    assert fast.lower(*mlp_args(seed=1)) is first  # same shapes and dtypes
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    assert fast.lower(*specs) is first
    halves = [a.astype(np.float16) for a in args]
    other = fast.lower(*halves)
    assert other is not first and other.program.inputs[0].ty.startswith("f16")


def test_decorator_forms_pytrees_and_static_arguments():
    @eqsat.optimize
    def scaled(tree, k):
        return {"out": tree["a"] * k + jnp.sin(tree["b"])}

    @eqsat.optimize(static_argnums=(1,), extractor="greedy", device="a100")
    def power(x, n):
        for _ in range(n):
            x = jnp.tanh(x) * 2.0
        return x

    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((2, 3), np.float32)}
    close(scaled(tree, np.float32(3.0)), {"out": tree["a"] * 3 + np.sin(tree["b"])})
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    want = x
    for _ in range(3):
        want = np.tanh(want) * 2.0
    close(power(x, 3), want)
    lowered = power.lower(x, 3)
    assert lowered.stats["device"] == "a100" and lowered.stats["fused_kernels"] == 1
    assert power.lower(x, 2) is not lowered  # a new static value is a new signature


def test_a_saturation_limit_warns_and_still_returns_a_valid_plan():
    args = mlp_args()
    with pytest.warns(SaturationLimitWarning, match="iteration_limit"):
        lowered = eqsat.optimize(mlp, iteration_limit=1).lower(*args)
    assert lowered.stats["saturated"] is False and lowered.stats["limit_reached"] == "iteration_limit"
    assert lowered.stats["fused_kernels"] <= lowered.stats["naive_kernels"]
    close(lowered(*args), mlp(*args))


def test_extractors_and_rulesets_can_be_chosen():
    args = mlp_args()
    plans = {}
    for extractor in ("greedy", "ilp", "auto"):
        lowered = eqsat.optimize(mlp, extractor=extractor).lower(*args)
        plans[extractor] = lowered.plan
        close(lowered(*args), mlp(*args))
    assert plans["ilp"].seconds <= plans["greedy"].seconds * (1 + 1e-9)
    assert plans["auto"].seconds <= plans["greedy"].seconds * (1 + 1e-9)
    only_absorb = eqsat.optimize(mlp, rulesets=["absorb"]).lower(*args)
    assert set(only_absorb.saturation.seconds) == {"absorb"}
    nothing = eqsat.optimize(mlp, rulesets=[]).lower(*args)
    assert nothing.stats["fused_kernels"] == nothing.stats["naive_kernels"]


def test_eqsat_optimize_is_callable_even_after_importing_the_module():
    import importlib

    module = importlib.import_module("eqsat.optimize")
    assert callable(module)
    assert callable(eqsat.optimize)
    fast = eqsat.optimize(jnp.exp)
    close(fast(np.zeros(3, np.float32)), np.ones(3))


def test_the_progress_bar_can_be_forced_or_silenced(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SaturationLimitWarning)
        eqsat.optimize(jnp.sin, progress=False).lower(np.zeros(4, np.float32))
    assert "eqsat" not in capsys.readouterr().err
    eqsat.optimize(jnp.cos, progress=True).lower(np.zeros(4, np.float32))
    assert "eqsat" in capsys.readouterr().err
