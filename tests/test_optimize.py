"""`eqsat.optimize`: the stages end to end on small JAX functions."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from driver.optimize import SaturationLimitWarning


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


def test_no_progress_bar_by_default_when_nobody_watches(monkeypatch, capsys):
    """stderr a log or a pipe (not a terminal): the default shows nothing, however long the lowering."""
    from driver import optimize as optimize_module

    monkeypatch.setattr(optimize_module, "_on_a_terminal", lambda: False)
    slow = 6.0  # past the bar's delay
    clock = iter(range(0, 10_000, int(slow)))
    monkeypatch.setattr("tqdm.std.time", lambda: float(next(clock)))
    eqsat.optimize(jnp.tan).lower(np.zeros(4, np.float32))
    assert "eqsat" not in capsys.readouterr().err


# --- loops stay loops ---------------------------------------------------------------------------

def rnn(h, xs, w, u, b):
    def cell(h, x):
        h = jnp.tanh(h @ w + x @ u + b)
        return h, h * 2.0
    return jax.lax.scan(cell, h, xs)


def rnn_args(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(2, 16), (5, 2, 8), (16, 16), (8, 16), (16,)]
    return [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in shapes]


def all_kernels(kernels):
    """Kernels and, recursively, the kernels of their loop bodies."""
    for kernel in kernels:
        yield kernel
        yield from all_kernels(kernel.body)


def test_a_scan_is_one_loop_kernel_that_lists_its_fused_body():
    args = rnn_args()
    lowered = eqsat.optimize(rnn).lower(*args)
    plan = lowered.plan
    loops = [k for k in plan.kernels if k.kind == "loop"]
    assert len(loops) == 1 and len(plan.kernels) == 1 and lowered.stats["fused_kernels"] == 1
    (loop,) = loops
    assert [t.args[3] for t in loop.outputs] == [0, 1]        # both outputs of the scan, one kernel
    body_kinds = [k.kind for k in loop.body]
    assert "matmul" in body_kinds and "opaque" not in body_kinds and "loop" not in body_kinds
    assert len(loop.body) < plan.naive_loop_body_kernels == 7  # 2 matmuls, broadcast b, 2 adds, tanh, mul
    assert plan.naive_kernels == lowered.stats["naive_kernels"] == 1
    assert plan.loop_body_kernels == len(loop.body)
    assert plan.kinds() == {"loop": 1} and lowered.stats["loop_body_kernels"] == len(loop.body)
    report = lowered.report()
    assert "loop" in report and f"{len(loop.body)} kernel{'s' if len(loop.body) > 1 else ''} inside loop bodies" in report
    assert "matmul" in report                                  # the body's kinds in the table
    data = json.loads(plan.to_json())
    (entry,) = data["kernels"]
    assert entry["kind"] == "loop" and len(entry["outputs"]) == 2
    assert [k["kind"] for k in entry["body"]] == body_kinds and data["loop_body_kernels"] == len(loop.body)
    close(eqsat.optimize(rnn)(*args), rnn(*args))
    close(eqsat.optimize(rnn, backend="interpret")(*args), rnn(*args))


def test_ref_writes_in_fori_loops_and_cond_branches_leave_no_opaque_kernel():
    def counts(x):
        r = jax.new_ref(x)

        def body(i, carry):
            r[i] = r[i] + 1.0
            return carry

        jax.lax.fori_loop(0, x.shape[0], body, 0)
        return r[...]

    def branches(p, x):
        r = jax.new_ref(x)

        def yes():
            r[0] = r[0] * 2.0

        def no():
            r[1] = r[1] + 3.0

        jax.lax.cond(p, yes, no)
        return r[...] * 2.0

    x = np.arange(1.0, 6.0, dtype=np.float32)
    for fn, args in ((counts, (x,)), (branches, (True, x)), (branches, (False, x))):
        lowered = eqsat.optimize(fn).lower(*args)
        kinds = [k.kind for k in all_kernels(lowered.plan.kernels)]
        assert "loop" in kinds and "opaque" not in kinds, kinds
        assert any(k.body for k in lowered.plan.kernels)
        close(eqsat.optimize(fn)(*args), jax.jit(fn)(*args))
