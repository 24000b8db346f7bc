"""The `row_stats` family: LayerNorm statistics computed inside the matmul that reads them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import eqsat
from eqsat import rules


def layernorm_linear(x, g, b, w):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return ((x - mean) / jnp.sqrt(var + 1e-5) * g + b) @ w


def spatial_norm_linear(x, g, b, w):
    """GroupNorm-like statistics over the spatial axis, then a matmul over channels."""
    mean = jnp.mean(x, axis=1, keepdims=True)
    var = jnp.var(x, axis=1, keepdims=True)
    return ((x - mean) / jnp.sqrt(var + 1e-5) * g + b) @ w


def args(b=2, s=8, c=16, n=24, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, s, c)).astype(np.float32), rng.normal(size=(c,)).astype(np.float32),
            rng.normal(size=(c,)).astype(np.float32), (rng.normal(size=(c, n)) * 0.2).astype(np.float32))


def ops_in(term) -> set[str]:
    seen, stack, ops = set(), [term], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        ops.add(node.op)
        stack.extend(node.children)
    return ops


def test_row_stats_rules_are_sound():
    report = rules.check("row_stats", examples=4)
    assert report.examples == 3


def test_layernorm_then_linear_is_one_matmul_kernel():
    fast = eqsat.optimize(layernorm_linear)
    inputs = args()
    lowered = fast.lower(*inputs)
    kernels = lowered.plan.kernels
    assert [k.term.op for k in kernels] == ["Matmul"], lowered.report()
    assert "RowReduce" in ops_in(kernels[0].term)
    np.testing.assert_allclose(np.asarray(fast(*inputs)), np.asarray(layernorm_linear(*inputs)),
                               rtol=1e-4, atol=1e-4)


def test_statistics_over_other_axes_keep_their_kernel():
    fast = eqsat.optimize(spatial_norm_linear)
    inputs = args()
    lowered = fast.lower(*inputs)
    ops = [k.term.op for k in lowered.plan.kernels]
    assert "Reduce" in ops and "Matmul" in ops, lowered.report()
    assert all("RowReduce" not in ops_in(k.term) for k in lowered.plan.kernels)
    np.testing.assert_allclose(np.asarray(fast(*inputs)), np.asarray(spatial_norm_linear(*inputs)),
                               rtol=1e-4, atol=1e-4)
