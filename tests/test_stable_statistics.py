"""Statistics that do not cancel (issue 8 §1): every fused form of a normalization's statistics —
split off its norm (`norm_split`), recomputed inside the matmul reading it (`row_stats`), computed
in the epilogue of the kernel writing its input (`epilogue_stats`) — matches `jax.jit` on inputs
whose mean is large against their spread, and on constant rows.

The tolerances catch cancellation: E[x^2] - E[x]^2 in float32 loses every digit of a variance of
1e-4 at an offset of 100 (relative error ~10, or a negative variance and NaN after rsqrt); the
stable forms are off by a few float32 roundings of the spread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from sd15.layers import group_norm, layer_norm

DN = ("NHWC", "HWIO", "NHWC")


def _ops(term) -> list:
    seen, stack, out = set(), [term], []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        if node is term or node.sort != "Tensor":
            stack.extend(node.children)
    return out


EPS32 = float(np.finfo(np.float32).eps)


def _rounding_tolerance(offset: float, spread: float) -> float:
    """What float32 rounding of inputs at `offset` does to values normalized by `spread`: the mean
    is known to a few ulps of the offset, whatever the order of the sum (jit's or ours)."""
    return 8 * EPS32 * abs(offset) / spread


def _assert_matches_jit(fn, *args, atol):
    ours, reference = np.asarray(eqsat.optimize(fn)(*args)), np.asarray(jax.jit(fn)(*args))
    assert np.isfinite(reference).all()
    assert np.isfinite(ours).all(), f"{np.isnan(ours).sum()} NaN of {ours.size}"
    np.testing.assert_allclose(ours, reference, rtol=0, atol=atol)


def _ln_params(width, seed=0):
    rng = np.random.default_rng(seed)
    return {"n.weight": jnp.asarray(1 + 0.1 * rng.normal(size=width), jnp.float32),
            "n.bias": jnp.asarray(0.1 * rng.normal(size=width), jnp.float32)}


# --- the cases -------------------------------------------------------------------------------


def test_variance_of_rows_far_from_zero():
    """The issue's example: jnp.var of 100 + 0.01 randn (we gave [0.0029, -0.00098, ...])."""
    x = jnp.asarray(100.0 + 0.01 * np.random.RandomState(0).randn(4, 64), jnp.float32)
    ours = np.asarray(eqsat.optimize(lambda x: x.var(-1))(x))
    reference = np.asarray(jax.jit(lambda x: x.var(-1))(x))
    exact = np.var(np.asarray(x, np.float64), axis=-1)
    assert np.all(ours > 0)
    np.testing.assert_allclose(ours, reference, rtol=1e-3)
    np.testing.assert_allclose(ours, exact, rtol=1e-3)


@pytest.mark.parametrize("offset", [300.0, -5e3])
def test_layer_norm_far_from_zero(offset):
    x = jnp.asarray(offset + 0.1 * np.random.default_rng(1).normal(size=(2, 5, 48)), jnp.float32)
    params = _ln_params(48)
    atol = max(1e-4, _rounding_tolerance(offset, 0.1))
    _assert_matches_jit(lambda x: layer_norm(params, "n", x, 1e-6), x, atol=atol)


def test_layer_norm_of_constant_rows_is_its_bias():
    """Constant rows (eps 1e-6): zero variance, so the output is the bias, where E[x^2] - E[x]^2
    goes negative and rsqrt makes NaN (it did: 480 of 480). The values sum exactly in float32, so
    the mean is exact in any order and the centred values are exactly zero."""
    values = 300.25 + 0.5 * np.arange(10, dtype=np.float32)
    x = jnp.asarray(np.broadcast_to(values.reshape(2, 5, 1), (2, 5, 48)), jnp.float32)
    params = _ln_params(48)
    fn = lambda x: layer_norm(params, "n", x, 1e-6)  # noqa: E731
    _assert_matches_jit(fn, x, atol=1e-5)
    np.testing.assert_allclose(np.asarray(eqsat.optimize(fn)(x)), np.broadcast_to(params["n.bias"], x.shape),
                               atol=1e-5)


def test_layer_norm_then_linear_recomputes_stable_row_statistics():
    """The statistics recomputed in the matmul's K pre-pass (`RowReduce`) are moments too."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(250.0 + 0.05 * rng.normal(size=(2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)
    params = _ln_params(32)
    fn = lambda x, w: layer_norm(params, "n", x, 1e-6) @ w  # noqa: E731
    plan = eqsat.optimize(fn).lower(x, w).plan
    assert [k.op for k in plan.kernels] == ["Matmul"]
    assert any(n.op == "RowReduce" for n in _ops(plan.kernels[0].term))
    _assert_matches_jit(fn, x, w, atol=max(1e-4, _rounding_tolerance(250.0, 0.05)))


def _group_norm_input(offset, seed=3):
    rng = np.random.default_rng(seed)
    return jnp.asarray(offset + 0.05 * rng.normal(size=(2, 4, 4, 12)), jnp.float32)


@pytest.mark.parametrize("offset", [50.0, 1e4])
def test_group_norm_far_from_zero(offset):
    params = _ln_params(12, seed=4)
    fn = lambda x: group_norm(params, "n", x, 4, 1e-6)  # noqa: E731  3 channels per group
    _assert_matches_jit(fn, _group_norm_input(offset), atol=max(1e-4, _rounding_tolerance(offset, 0.05)))


def test_group_norm_of_constant_groups_is_its_bias():
    """Constant groups (eps 1e-6), exactly summable values: NaN in 192 of 384 outputs before."""
    x = jnp.asarray(np.broadcast_to((7.25 + np.arange(4, dtype=np.float32) * 123.5).repeat(3), (2, 4, 4, 12)),
                    jnp.float32)
    params = _ln_params(12, seed=5)
    fn = lambda x: group_norm(params, "n", x, 4, 1e-6)  # noqa: E731
    _assert_matches_jit(fn, x, atol=1e-5)


def _resnet_half(x, w1, bias, w2, gn):
    """conv -> GroupNorm -> SiLU -> conv, the GroupNorm's input far from zero (a large conv bias)."""
    h = lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=DN) + bias
    return lax.conv_general_dilated(jax.nn.silu(group_norm(gn, "n", h, 2, 1e-6)), w2, (1, 1), "SAME",
                                    dimension_numbers=DN)


def test_statistics_in_the_producing_conv_epilogue_are_stable():
    """The GroupNorm's moments are hosted by the conv writing its input (`EpilogueReduce`)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(1, 6, 6, 3)), jnp.float32)
    w1 = jnp.asarray(0.01 * rng.normal(size=(3, 3, 3, 8)), jnp.float32)
    bias = jnp.asarray(400.0 + rng.normal(size=8), jnp.float32)
    w2 = jnp.asarray(0.3 * rng.normal(size=(3, 3, 8, 4)), jnp.float32)
    gn = _ln_params(8, seed=7)
    fn = lambda *a: _resnet_half(*a, gn)  # noqa: E731
    plan = eqsat.optimize(fn).lower(x, w1, bias, w2).plan
    assert [k.kind for k in plan.kernels] == ["conv", "conv"]
    hosted = [t for k in plan.kernels for t in k.outputs[1:]]
    assert hosted and {t.op for t in hosted} == {"EpilogueReduce"}
    assert "moments" in {t.args[1] for t in hosted}
    _assert_matches_jit(fn, x, w1, bias, w2, atol=max(1e-4, _rounding_tolerance(400.0, 0.03)))


# --- the moments reduction and its partials -----------------------------------------------------------


def _adversarial_rows():
    rng = np.random.default_rng(8)
    return [
        1e4 + rng.normal(size=(3, 40)),                         # offset 1e4 against a spread of 1
        np.full((2, 33), 0.1) + np.arange(2)[:, None] * 300.7,  # constant rows
        np.zeros((2, 7)),
        1e-15 * rng.normal(size=(2, 9)),                        # tiny (squares ~1e-30)
        1e18 * rng.normal(size=(2, 9)),                         # huge (M2 ~ 1e37, below float32's max)
        rng.normal(size=(1, 77)) * np.where(np.arange(77) % 2, 1.0, 1e3),
    ]


@pytest.mark.parametrize("index", range(6))
def test_moments_are_the_float64_sum_and_centred_squares(index):
    """Two-pass moments (the interpreter's) are off by the mean's rounding, squared: second order in
    eps * offset. Merged per-piece partials (the kernels') carry each piece's mean rounding into the
    merge: first order in eps * offset * spread, still relative to the spread, never to offset^2."""
    from eqsat.moments import merge_partials, partial_moments, two_pass

    x = np.asarray(_adversarial_rows()[index], np.float32)
    x64 = x.astype(np.float64)
    exact = np.stack([x64.sum(-1), ((x64 - x64.mean(-1, keepdims=True)) ** 2).sum(-1)])
    n, scale = x.shape[-1], np.abs(x64).max(-1)
    spread = np.abs(x64 - x64.mean(-1, keepdims=True)).max(-1)
    mean_rounding = n * (4 * EPS32 * scale) ** 2
    two = np.asarray(two_pass(x, (1,)), np.float64)
    merged = np.asarray(merge_partials(partial_moments(x, (1,), 8)), np.float64)
    for value in (two, merged):
        assert value.shape == (2, x.shape[0]) and np.all(value[1] >= 0)
        np.testing.assert_allclose(value[0], exact[0], rtol=1e-5, atol=1e-5 * np.abs(x64).sum(-1).max())
    assert np.all(np.abs(two[1] - exact[1]) <= 1e-5 * exact[1] + mean_rounding)
    assert np.all(np.abs(merged[1] - exact[1]) <= 1e-5 * exact[1] + 2 * EPS32 * n * scale * spread + mean_rounding)


def test_partials_merge_in_a_fixed_order_whatever_the_piece_size():
    from eqsat.moments import merge_partials, partial_moments, two_pass

    x = jnp.asarray(1e3 + np.random.default_rng(9).normal(size=(2, 3, 5, 7)), jnp.float32)
    reference = np.asarray(two_pass(x, (1, 3)))
    assert reference.shape == (2, 2, 5)
    for piece in (1, 4, 21, 64):
        parts = partial_moments(x, (1, 3), piece)
        assert parts.shape == (-(-21 // piece), 3, 2, 5)
        merged = np.asarray(merge_partials(parts))
        np.testing.assert_allclose(merged, reference, rtol=2e-4)
        assert np.array_equal(merged, np.asarray(merge_partials(parts)))  # deterministic


def test_moments_propagate_nan_and_inf_like_jnp_var():
    from eqsat.moments import two_pass

    x = np.array([[1.0, np.nan, 2.0], [1.0, np.inf, 2.0], [1.0, 2.0, 3.0]], np.float32)
    value = np.asarray(two_pass(x, (1,)))
    var = np.asarray(jnp.var(x, axis=1))
    np.testing.assert_array_equal(np.isnan(value[1]), np.isnan(var))
    np.testing.assert_allclose(value[1, 2] / 3, var[2])


# --- cost: partials, no memsets ----------------------------------------------------------------------


def test_hosted_statistics_cost_partials_and_no_memset():
    from eqsat.cost import H100, hosted_cost, kernel_cost, node_cost
    from eqsat.cost.roofline import PARTIAL_TILE, partials_bytes
    from eqsat.term import Term

    assert not hasattr(H100, "memset_overhead")
    x_ty, stats_ty = "f32[2,4096,32,10]", "f32[2,2,32]"
    # 64 (batch, group) outputs, each reducing 40,960 elements: 3 tiles of PARTIAL_TILE, 3 floats each
    assert partials_bytes("moments", x_ty, stats_ty) == 64 * -(-40960 // PARTIAL_TILE) * 3 * 4
    assert partials_bytes("sum", "f32[8,64]", "f32[8]") == 8 * 1 * 4
    own = node_cost("EpilogueReduce", ("f32[2,4096,320]", "moments", x_ty, "1,3", stats_ty), H100)
    assert own.seconds == pytest.approx(own.bytes / H100.hbm_bandwidth + own.flops / H100.peak_fp32)
    assert own.seconds < H100.launch_overhead / 10

    producer = Term("Input", "h", x_ty)
    conv = Term("Pointwise", Term("Load", producer, x_ty), x_ty)
    stats = Term("EpilogueReduce", conv, "moments", Term("Load", conv, x_ty), "1,3", stats_ty)
    assert hosted_cost(stats, H100).bytes == partials_bytes("moments", x_ty, stats_ty)
    reader = Term("Pointwise", Term("Reshape", Term("Slice", Term("Load", stats, stats_ty), 0, 0, 1, 1, "f32[1,2,32]"),
                                    "f32[2,32]"), "f32[2,32]")
    # the reader reads the whole partials buffer (and merges it), even for one row of the statistic
    assert kernel_cost(reader, H100).bytes == partials_bytes("moments", x_ty, stats_ty) + 2 * 32 * 4
