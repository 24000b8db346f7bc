"""Sibling reductions stacked into one kernel (`extract.siblings`): which stack, and that the stacked
plan computes what the unstacked one does, through the interpreter and the emitted kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import eqsat
from extract.plan import Plan


def group_norm(x, groups: int):
    """GroupNorm without affine on channels-last [B, H, W, C], as sd15/layers.py spells it."""
    b, h, w, c = x.shape
    y = x.reshape(b, h * w, groups, c // groups)
    n = y.shape[1] * y.shape[3]
    mean = jnp.sum(y, axis=(1, 3), keepdims=True) / n
    centered = y - mean
    var = jnp.sum(centered * centered, axis=(1, 3), keepdims=True) / n
    return (centered * lax.rsqrt(var + 1e-5)).reshape(x.shape)


def two_norms_of_one_stream(x, shift):
    """Two GroupNorms of views of one activation (a transformer block's norms of one residual
    stream): their statistics are independent siblings."""
    return group_norm(x, 2) * group_norm(x + shift, 2)


def norm_of_a_norm(x, shift):
    """The second statistics read the first norm's output: dependent, never one kernel."""
    return group_norm(group_norm(x, 2) + shift, 2)


def sums_as_outputs(x, y):
    """Sibling sums that are the function's outputs: left as they are."""
    return jnp.sum(x * y, axis=(0, 1)), jnp.sum(x, axis=(0, 1))


def _lower(fn, *args, backend="xla"):
    return eqsat.optimize(fn, backend=backend, cache=False, progress=False).lower(*args)


def _unstacked(lowered) -> Plan:
    plan = lowered.plan
    return Plan.build(lowered.extraction.terms, program=plan.program, class_of=lowered.extraction.class_of,
                      class_components=lowered.extraction.class_components, device=plan.device,
                      extractor=plan.extractor)


def _stacked_kernels(plan) -> list:
    return [k for k in plan.kernels if k.op == "Reduce" and k.term.args[1].op == "Concat"]


def _args(shape=(2, 5, 7, 6), offset=0.0, seed=0):
    rng = np.random.default_rng(seed)
    x = (offset + rng.standard_normal(shape)).astype(np.float32)
    shift = rng.standard_normal(shape[-1]).astype(np.float32)
    return x, shift


def test_independent_statistics_of_one_stream_are_one_kernel():
    x, shift = _args()
    lowered = _lower(two_norms_of_one_stream, x, shift)
    stacked = _stacked_kernels(lowered.plan)
    assert len(stacked) == 1
    assert stacked[0].term.args[0] == "moments" and stacked[0].term.ty == "f32[2,2,2,2]"
    assert len(lowered.plan.kernels) == len(_unstacked(lowered).kernels) - 1


def test_dependent_statistics_stay_apart():
    x, shift = _args()
    lowered = _lower(norm_of_a_norm, x, shift)
    assert _stacked_kernels(lowered.plan) == []
    assert len(lowered.plan.kernels) == len(_unstacked(lowered).kernels)


def test_reductions_that_are_outputs_stay_apart():
    x, y = _args((4, 6, 5), seed=1)[0], _args((4, 6, 5), seed=2)[0]
    lowered = _lower(sums_as_outputs, x, y)
    assert _stacked_kernels(lowered.plan) == []


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_stacked_plan_matches_jax(backend):
    # 3 channels per group, 35 pixels, an offset large against the spread, a constant channel
    x, shift = _args(offset=1e4, seed=3)
    x[:, :, :, 4] = 7.0
    optimized = eqsat.optimize(two_norms_of_one_stream, backend=backend, cache=False, progress=False)
    assert len(_stacked_kernels(optimized.lower(x, shift).plan)) == 1
    got = np.asarray(optimized(x, shift))
    want = np.asarray(jax.jit(two_norms_of_one_stream)(x, shift))
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@settings(max_examples=12, deadline=None)
@given(offset=st.sampled_from([0.0, 1e4, -3e5, 1e-30]), scale=st.sampled_from([1.0, 1e-6, 1e6, 0.0]),
       pixels=st.sampled_from([(1, 1), (3, 5), (7, 7)]), seed=st.integers(0, 2**16))
def test_stacking_changes_no_value(offset, scale, pixels, seed):
    """The stacked plan and the unstacked one, both through the reference interpreter: every row of
    the stacked reduction is its member's reduction, so the values are the same, NaN and inf included."""
    rng = np.random.default_rng(seed)
    x = (offset + scale * rng.standard_normal((2, *pixels, 6))).astype(np.float32)
    shift = (scale * rng.standard_normal(6)).astype(np.float32)
    lowered = _lower(two_norms_of_one_stream, x, shift)
    stacked, unstacked = lowered.plan, _unstacked(lowered)
    assert len(_stacked_kernels(stacked)) == 1
    np.testing.assert_array_equal(np.asarray(stacked.evaluate(x, shift)), np.asarray(unstacked.evaluate(x, shift)))
