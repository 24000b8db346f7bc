"""The `epilogue_stats` family and hosting: normalization statistics computed by the producing kernel."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqsat
from eqsat.cost import hosted_reductions, hosts_of, kernels
from eqsat.interpret import evaluate
from eqsat.term import Term
from extract.plan import Plan

DN = ("NHWC", "HWIO", "NHWC")


def conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DN)


def group_norm(h, groups, eps=1e-5):
    b, hh, ww, c = h.shape
    g = h.reshape(b, hh, ww, groups, c // groups).astype(jnp.float32)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.var(g, axis=(1, 2, 4), keepdims=True)
    return ((g - mean) * lax.rsqrt(var + eps)).reshape(h.shape).astype(h.dtype)


def resnet_half(x, w1, w2):
    """conv -> GroupNorm -> SiLU -> conv (a ResNet block's first half)."""
    return conv(jax.nn.silu(group_norm(conv(x, w1), groups=4)), w2)


def up_block_norm(x, wa, wb, w):
    """GroupNorm over concat(h, skip) with a group straddling the boundary (6 + 2 channels, 2 groups
    of 4), then a conv: the skip connection of an up block."""
    h = jnp.concatenate([conv(x, wa), conv(x, wb)], axis=-1)
    return conv(jax.nn.silu(group_norm(h, groups=2)), w)


def _normal(rng, shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def test_groupnorm_statistics_come_from_the_producing_conv():
    rng = np.random.default_rng(0)
    inputs = (_normal(rng, (2, 6, 6, 3)), _normal(rng, (3, 3, 3, 8), 0.3), _normal(rng, (3, 3, 8, 4), 0.3))
    fast = eqsat.optimize(resnet_half)
    lowered = fast.lower(*inputs)
    plan = lowered.plan
    assert [k.kind for k in plan.kernels] == ["conv", "conv"], lowered.report()
    assert plan.hosted_reductions == 1
    first = plan.kernels[0]
    assert [t.op for t in first.outputs] == ["Conv", "EpilogueReduce"]
    assert first.outputs[1].args[1] == "moments"  # mean and variance as one stable statistic
    np.testing.assert_allclose(np.asarray(fast(*inputs)), np.asarray(resnet_half(*inputs)), rtol=1e-4, atol=1e-4)


def test_groupnorm_over_a_skip_concat_is_hosted_by_both_convs():
    rng = np.random.default_rng(1)
    inputs = (_normal(rng, (1, 4, 4, 3)), _normal(rng, (1, 1, 3, 6)), _normal(rng, (1, 1, 3, 2)),
              _normal(rng, (3, 3, 8, 2), 0.3))
    fast = eqsat.optimize(up_block_norm)
    lowered = fast.lower(*inputs)
    plan = lowered.plan
    assert [k.kind for k in plan.kernels] == ["conv", "conv", "conv"], lowered.report()
    hosting = [k for k in plan.kernels if len(k.outputs) > 1]
    assert len(hosting) == 2 and hosting[0].outputs[1] is hosting[1].outputs[1]
    assert plan.hosted_reductions == 1
    assert sum(b.term.op == "EpilogueReduce" for b in plan.buffers) == 1  # one buffer, two writers
    np.testing.assert_allclose(np.asarray(fast(*inputs)), np.asarray(up_block_norm(*inputs)), rtol=1e-4, atol=1e-4)


# --- what the plan refuses to host ----------------------------------------------------------------


def _matmul(n=4):
    x = Term("Input", "x", f"f32[{n},{n}]")
    w = Term("Input", "w", f"f32[{n},{n}]")
    t = Term("Matmul", Term("Load", x, f"f32[{n},{n}]"), Term("Load", w, f"f32[{n},{n}]"), "1;0;;",
             Term("Acc", f"f32[{n},{n}]"), f"f32[{n},{n}]")
    return t, Term("Load", t, f"f32[{n},{n}]")


def _env(n=4):
    rng = np.random.default_rng(2)
    return {"x": _normal(rng, (n, n)), "w": _normal(rng, (n, n))}


def test_a_sum_of_squares_is_hosted_and_keeps_its_value():
    t, lt = _matmul()
    body = Term("Binary", "mul", lt, lt, "f32[4,4]")
    hosted = Term("EpilogueReduce", t, "sum", body, "0", "f32[4]")
    assert hosts_of(hosted) == [t]
    assert kernels([hosted]) == [t]
    env = _env()
    expected = np.sum((env["x"] @ env["w"]) ** 2, axis=0)
    np.testing.assert_allclose(np.asarray(evaluate([hosted], env)[0]), expected, rtol=1e-5)
    plan = Plan.build([hosted])
    assert plan.kernels[0].outputs == [t, hosted] and plan.hosted_reductions == 1
    # the plan returns the statistic: it is finished once, after its host (`eqsat.cost.merges`)
    assert [k.kind for k in plan.kernels] == ["matmul", "finalize"] and plan.kernels[1].outputs == [hosted]
    described = json.loads(plan.to_json())["kernels"][0]
    assert described["outputs"] == ["%0", "%0.1"] and described["hosted"][0].startswith("EpilogueReduce(%0")


def test_reading_the_producer_at_another_element_is_not_hosted():
    t, lt = _matmul()
    body = Term("Binary", "mul", lt, Term("Transpose", lt, "1,0", "f32[4,4]"), "f32[4,4]")
    reduction = Term("EpilogueReduce", t, "sum", body, "0", "f32[4]")
    assert hosts_of(reduction) is None
    assert kernels([reduction]) == [t, reduction]  # runs as its own kernel


def test_a_side_value_computed_from_the_producer_is_not_hosted():
    t, lt = _matmul()
    mean = Term("Reduce", "sum", lt, "1", Term("Acc", "f32[4]"), "f32[4]")
    centered = Term("Binary", "sub", lt, Term("Broadcast", Term("Load", mean, "f32[4]"), "0", "f32[4,4]"), "f32[4,4]")
    reduction = Term("EpilogueReduce", t, "sum", Term("Binary", "mul", centered, centered, "f32[4,4]"), "1", "f32[4]")
    assert hosts_of(reduction) is None
    assert reduction in kernels([reduction])


def test_only_sums_and_moments_are_hosted():
    """Per-tile partials merge for sums and moments (Chan's formula); a max is its own kernel."""
    t, lt = _matmul()
    assert hosts_of(Term("EpilogueReduce", t, "max", lt, "0", "f32[4]")) is None
    moments = Term("EpilogueReduce", t, "moments", lt, "0", "f32[2,4]")
    assert hosts_of(moments) == [t] and kernels([moments]) == [t]
    env = _env()
    h = (env["x"] @ env["w"]).astype(np.float64)
    expected = np.stack([h.mean(0), ((h - h.mean(0)) ** 2).sum(0)])
    np.testing.assert_allclose(np.asarray(evaluate([moments], env)[0]), expected, rtol=1e-5, atol=1e-5)


def test_the_variance_of_a_matmul_centered_on_its_own_mean_is_not_stated_hosted():
    """sum(h) can be hosted by h's matmul; sum((h - mean(h))^2) reads a statistic of h: the rules
    state only the first (norm_split, which would rewrite the variance, is left out)."""
    from eqsat import rules

    def centered(x, w):
        h = x @ w
        d = h - jnp.mean(h, axis=1, keepdims=True)
        return jnp.sum(d * d, axis=1)

    rng = np.random.default_rng(3)
    inputs = (_normal(rng, (3, 4)), _normal(rng, (4, 5)))
    lowered = eqsat.optimize(centered, rulesets=["absorb", "epilogue_stats"]).lower(*inputs)
    graph = rules.SerializedGraph(lowered.egraph._serialize().to_json())
    hosted_classes = {graph.eclass[n] for n, op in graph.op.items() if op == "EpilogueReduce"}
    reduce_classes = {graph.eclass[n] for n, op in graph.op.items() if op == "Reduce"}
    assert len(hosted_classes) == 1  # the bare sum of h only (its mean's 1/n moved out)
    assert reduce_classes - hosted_classes  # the variance (and the mean with its 1/n) are not
    np.testing.assert_allclose(np.asarray(lowered(*inputs)), np.asarray(centered(*inputs)), rtol=1e-4, atol=1e-4)


def test_statistics_inside_a_scan_body_stay_with_the_loop():
    """A GroupNorm inside a scan body is hosted by the body's conv; the plan (one Loop kernel) runs right."""

    def two_blocks(x, w1, w2):
        return lax.scan(lambda c, _: (resnet_half(c, w1, w2), None), x, None, length=2)[0]

    rng = np.random.default_rng(4)
    inputs = (_normal(rng, (1, 4, 4, 4)), _normal(rng, (3, 3, 4, 8), 0.3), _normal(rng, (3, 3, 8, 4), 0.3))
    lowered = eqsat.optimize(two_blocks).lower(*inputs)
    assert [k.op for k in lowered.plan.kernels] == ["Loop"]
    body = lowered.plan.kernels[0].term.args[2]
    assert any(hosts for hosts in hosted_reductions([body]).values())
    np.testing.assert_allclose(np.asarray(lowered(*inputs)), np.asarray(two_blocks(*inputs)), rtol=1e-4, atol=1e-4)
