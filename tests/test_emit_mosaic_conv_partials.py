"""Hosted GroupNorm statistics written by the Mosaic convs' epilogues as per-tile partials
(`emit.mosaic.partials.GroupStatistic`, the flat-grid conv through `emit.mosaic.matmul`'s windowed
epilogue, the haloed conv through `emit.mosaic.conv_halo`'s): each template's merged partials against
the two-pass statistics of its own stored output (15x15 images, 3 channels per group, offsets of 1e4
against a spread of 1, constant and zero groups, NaN, rows off the output, tiles spanning images),
plans whose conv hosts a GroupNorm read by a following kernel against the XLA emitter and `jax.jit`
with no reduce kernel after the conv, the cost model's matching decision, and a deviceless sm_90a
compile per template.

GPU interpret mode costs seconds per kernel here: shapes are tiny and the slow cases are marked."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import emit
import emit.pallas
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.mosaic import matmul as mm
from emit.mosaic.partials import GroupStatistic
from emit.pallas import XlaFallbackWarning
from emit.pallas.conv import ConvGeometry
from eqsat.conv_params import ConvParams
from eqsat.cost.backends import group_statistic_declined, writes_partials
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks
from sd15 import layers

OFFSET = 1e4
CPG = 3


def _params(x_shape, w_shape, strides=(1, 1), padding=((1, 1), (1, 1))) -> ConvParams:
    numbers = lax.conv_dimension_numbers(x_shape, w_shape, ("NHWC", "HWIO", "NHWC"))
    return ConvParams(strides=tuple(strides), padding=tuple(padding), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                      lhs_spec=tuple(numbers.lhs_spec), rhs_spec=tuple(numbers.rhs_spec),
                      out_spec=tuple(numbers.out_spec))


def _statistics(images: int, channels: int) -> list[GroupStatistic]:
    body = lambda t: t.astype(jnp.float32)  # noqa: E731
    return [GroupStatistic("moments", body, images, channels // CPG, CPG),
            GroupStatistic("sum", lambda t: 0.5 * body(t), images, channels // CPG, CPG)]


def _weights(rng, cin: int, cout: int, window: int = 3) -> np.ndarray:
    """Weights with group 1 all zero (its channels are the offset alone: a constant group) and one
    NaN in output channel 7 (group 2 is NaN, its neighbours are not)."""
    w = 0.2 * rng.standard_normal((window, window, cin, cout))
    w[..., CPG:2 * CPG] = 0.0
    w[1, 1, 0, 7] = np.nan
    return w


def _merge(op: str, partials: jax.Array) -> np.ndarray:
    """The readers' merge of `[tiles, fields, slots]` partials, in tile order (Chan's formula)."""
    from emit.pallas.conv import merge_partials

    return np.asarray(merge_partials(partials, op), np.float64)


def assert_moments_and_sum(mean, m2, total, want: np.ndarray, images: int) -> None:
    """Per-group `mean`, `m2` and `total` (of half the values) against the two-pass statistics of
    `want` `[groups, values]`: the NaN group (one per image) NaN, the mean within 2 ulps of the
    offset, M2 and the sum at fp32's bound."""
    nan = np.isnan(want).any(axis=1)
    assert nan.sum() == images and np.isnan(mean[nan]).all() and np.isnan(m2[nan]).all() and np.isnan(total[nan]).all()
    ok = ~nan
    want_mean = want.mean(axis=1)
    want_m2 = ((want - want_mean[:, None]) ** 2).sum(axis=1)
    ulp = np.spacing(np.float32(OFFSET))
    np.testing.assert_allclose(mean[ok], want_mean[ok], rtol=0, atol=2 * ulp)
    scale = np.abs(want[ok]).max() * np.abs(want[ok] - want_mean[ok, None]).max() * want.shape[1]
    np.testing.assert_allclose(m2[ok], want_m2[ok], rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(total[ok], 0.5 * want.sum(axis=1)[ok], rtol=1e-6, atol=1e-6 * np.abs(want[ok]).sum(1).max())


def _assert_group_statistics(out: np.ndarray, partials, images: int, channels: int) -> None:
    """`partials` (moments, sum) merged against the two-pass moments of `out` `[B, H, W, C]` per
    (image, group of 3 channels): mean within 2 ulps of the offset, M2 at fp32's bound, the zero
    group exactly (offset, 0), the NaN group NaN."""
    groups = channels // CPG
    want = out.reshape(images, -1, groups, CPG).transpose(0, 2, 1, 3).reshape(images * groups, -1).astype(np.float64)
    mean, m2 = _merge("moments", partials[0])
    total = _merge("sum", partials[1])
    assert mean.shape == (images * groups,)
    assert_moments_and_sum(mean, m2, total, want, images)
    constant = np.arange(images) * groups + 1
    assert (mean[constant] == OFFSET).all() and (m2[constant] == 0.0).all()  # exactly the value, no spread
    counts = np.asarray(partials[0])[:, 0].sum(axis=0)
    np.testing.assert_array_equal(counts, want.shape[1])  # every output pixel once, no row off the output


@pytest.mark.slow
def test_flat_grid_partials_are_the_group_moments_of_its_stored_output():
    """Stride 2 on two 15x15 images (8x8 outputs on a 9x16 phase grid: 144 flat rows per image, so
    the third 64-row tile holds both images, and rows with ox >= 8 or oy >= 8 are off the output),
    8 channels in, 24 out (8 groups of 3; the 64-column tile's last 40 columns are padding)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 8)), jnp.float16)
    w = jnp.asarray(_weights(rng, 8, 24), jnp.float16)
    params = _params(x.shape, w.shape, strides=(2, 2))
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    grid = mc.FlatGrid(ConvGeometry(params, x.shape, w.shape, out_shape))
    assert grid.phase_size == (9, 16)
    (r,) = mc.plan_taps(grid, [(8, ((0, 3), (0, 3)))])
    blocks = mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=1)

    @jax.jit
    def run(x, w):
        flat, partials = mc.build([mc.layout_input(x, grid, params.lhs_spec, r)],
                                  [mc.layout_weights(w, params.rhs_spec, r, 64)], [r], grid,
                                  epilogue=lambda acc, _: acc + OFFSET, out_dtype=jnp.float32, blocks=blocks,
                                  interpret=True, statistics=_statistics(2, 24))
        return mc.unflatten(flat, grid, 24), partials

    out, partials = run(x, w)
    assert [p.shape for p in partials] == [(5, 3, 16), (5, 1, 16)]  # 5 tiles (one CTA, one warpgroup each)
    _assert_group_statistics(np.asarray(out), partials, 2, 24)


@pytest.mark.parametrize("strips,strides", [(1, (1, 1)), (3, (1, 1)), (1, (2, 2))], ids=["rows", "strips", "stride2"])
def test_haloed_partials_are_the_group_moments_of_its_stored_output(strips, strides):
    """Two 15x15 images (pitch 17: rows with ox >= 15 are off the output), 64 channels in, 24 out
    (8 groups of 3): 4 CTAs of 64 rows per image, each one tile of the partials. In 3 column strips
    of 5 pixels (pitch 7: each strip's CTAs write their own tiles), and at stride 2 (8x8 outputs at
    output pitch 8 of a padded pitch 18: the staged row phases), the same moments."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16)
    w = jnp.asarray(_weights(rng, 64, 24), jnp.float16)
    params = _params(x.shape, w.shape, strides=strides)
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    geometry = ConvGeometry(params, x.shape, w.shape, out_shape)
    blocks = MosaicBlocks(64, 64, 64, stages=3, compute_wgs=1)
    grid = HaloGrid(geometry, 64, strips)
    assert grid.strips == strips and grid.stride == strides[0]

    @jax.jit
    def run(x, w):
        flat, partials = ch.build([x], ch.layout_weight(w, params.rhs_spec, 64), grid, blocks,
                                  epilogue=lambda acc, _: acc + OFFSET, out_dtype=jnp.float32, interpret=True,
                                  statistics=_statistics(2, 24))
        return ch.unflatten(flat, grid, 24), partials

    out, partials = run(x, w)
    tiles = 2 * grid.strips * grid.m_tiles
    assert [p.shape for p in partials] == [(tiles, 3, 16), (tiles, 1, 16)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(mc.reference(x, w, params), np.float32) + OFFSET, rtol=0,
                               atol=4 * np.spacing(np.float32(OFFSET)))  # the conv itself: each pixel where it belongs
    _assert_group_statistics(np.asarray(out), partials, 2, 24)


def test_row_images_mark_the_output_pixels_by_image():
    """The flat grid's row table: image b on its 8x8 output pixels of a 9x16 phase grid, -1 elsewhere;
    the haloed grid's: per image, its 3x5 outputs at pitch 7."""
    params = _params((2, 15, 15, 8), (3, 3, 8, 24), strides=(2, 2))
    grid = mc.FlatGrid(ConvGeometry(params, (2, 15, 15, 8), (3, 3, 8, 24), (2, 8, 8, 24)))
    table = mc.row_images(grid, 320)
    image = table[:288].reshape(2, 9, 16)
    for b in range(2):
        np.testing.assert_array_equal(image[b, :8, :8], b)
        assert (image[b, 8] == -1).all() and (image[b, :, 8:] == -1).all()
    assert (table[288:] == -1).all()
    params = _params((2, 3, 5, 64), (3, 3, 64, 8))
    halo = HaloGrid(ConvGeometry(params, (2, 3, 5, 64), (3, 3, 64, 8), (2, 3, 5, 8)), 64)
    table = ch.row_images(halo, 64)
    expected = np.full((3, 7), -1)
    expected[:, :5] = 0
    np.testing.assert_array_equal(table[0, :21].reshape(3, 7), expected)
    np.testing.assert_array_equal(table[1, :21].reshape(3, 7), np.where(expected == 0, 1, -1))
    assert (table[:, 21:] == -1).all()


# --- plans through backend="mosaic" ------------------------------------------------------------------


def _conv_groupnorm_conv(x, w1, b1, gamma, beta, w2, b2):
    """A 3x3 conv whose output's GroupNorm (3 channels per group) + SiLU feeds a second 3x3 conv."""
    p = {"a.weight": w1, "a.bias": b1, "n.weight": gamma, "n.bias": beta, "c.weight": w2, "c.bias": b2}
    h = layers.conv2d(p, "a", x)
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", h, h.shape[-1] // CPG, 1e-5)))


def _conv_groupnorm(x, w1, b1, gamma, beta):
    """A 3x3 conv and its output's GroupNorm (3 channels per group) + SiLU: a pointwise reader."""
    p = {"a.weight": w1, "a.bias": b1, "n.weight": gamma, "n.bias": beta}
    h = layers.conv2d(p, "a", x)
    return layers.silu(layers.group_norm(p, "n", h, h.shape[-1] // CPG, 1e-5))


def _args(rng, cin: int, mid: int, offset: float, out: int | None = None, images: int = 2):
    """Inputs on 15x15 images with an offset far from the spread in the conv's bias, a group of
    constant channels (zero weights), zeros in a row of the input."""
    x = rng.standard_normal((images, 15, 15, cin))
    x[:, 4] = 0.0
    w1 = 0.1 * rng.standard_normal((mid, cin, 3, 3))
    w1[CPG:2 * CPG] = 0.0
    args = [x, w1, offset + rng.standard_normal(mid), 1 + 0.2 * rng.standard_normal(mid), rng.standard_normal(mid)]
    if out is not None:
        args += [0.1 * rng.standard_normal((out, mid, 3, 3)), rng.standard_normal(out)]
    return tuple(jnp.asarray(a, jnp.float16) for a in args)


def _run_without_reduce_kernels(plan, args):
    """`emit.emit(plan, "mosaic")(*args)` in GPU interpret mode, no Triton fallback, recording the
    driver's reduce kernels (`emit.pallas.run_kernels` emits one for each statistic left to it)."""
    reduced = []
    original = emit.pallas.emit_kernel
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        patch.setattr(emit.pallas, "emit_kernel", lambda call, ctx: (
            reduced.append(call.name) if call.term.op == "EpilogueReduce" else None) or original(call, ctx))
        out = emit.emit(plan, "mosaic", interpret=True)(*args)
    assert reduced == [], reduced
    return out


def _hosted_on_conv(plan):
    (conv, *_) = [k for k in plan.kernels if k.op == "Conv"]
    (statistic,) = conv.hosted
    assert group_statistic_declined(statistic, conv.term) is None
    assert writes_partials(statistic, "mosaic", conv.term)
    return conv


def _close(got, *expected, atol):
    for e in expected:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(e, np.float32), rtol=2e-2, atol=atol)


def test_a_haloed_conv_hosting_a_groupnorm_read_by_a_haloed_conv():
    """64 -> 192 (64 groups of 3) -> 64 channels on two 15x15 images, an offset of 300 against a
    spread of ~1 in the first conv's output: both convs haloed, the first writes the GroupNorm's
    partials (no reduce kernel), the second reads them finished; equal to XLA's and jit's."""
    args = _args(np.random.default_rng(4), 64, 192, 300.0, out=64)
    plan = eqsat.optimize(_conv_groupnorm_conv, extractor="greedy", progress=False).lower(*args).plan
    _hosted_on_conv(plan)
    got = _run_without_reduce_kernels(plan, args)
    _close(got, emit.emit(plan, "xla")(*args), jax.jit(_conv_groupnorm_conv)(*args), atol=0.1)


@pytest.mark.slow
def test_a_flat_grid_conv_hosting_a_groupnorm_read_by_a_pointwise_kernel():
    """8 -> 24 channels (8 groups of 3) on two 15x15 images, an offset of 1e3 in the conv's bias:
    the flat-grid conv (too few channels for the haloed one) writes the partials, the Triton
    pointwise GroupNorm + SiLU merges them where it reads them; equal to XLA's and jit's."""
    args = _args(np.random.default_rng(5), 8, 24, 1e3)
    plan = eqsat.optimize(_conv_groupnorm, extractor="greedy", progress=False).lower(*args).plan
    _hosted_on_conv(plan)
    got = _run_without_reduce_kernels(plan, args)
    _close(got, emit.emit(plan, "xla")(*args), jax.jit(_conv_groupnorm)(*args), atol=2e-2)


def test_the_model_declines_statistics_the_convs_do_not_write():
    """A statistic per output pixel (a LayerNorm over a conv's channels) is not one per (image,
    channel group): the driver reduces it, and the model charges its reduce kernel."""
    from eqsat.cost.backends import hosted_extra

    def conv_layernorm(x, w, b):
        h = layers.conv2d({"a.weight": w, "a.bias": b}, "a", x)
        mean = h.astype(jnp.float32).mean(-1, keepdims=True)
        var = jnp.square(h.astype(jnp.float32) - mean).mean(-1, keepdims=True)
        return (h - mean) * lax.rsqrt(var + 1e-5)

    S = jax.ShapeDtypeStruct
    args = (S((2, 15, 15, 64), jnp.float16), S((64, 64, 3, 3), jnp.float16), S((64,), jnp.float16))
    plan = eqsat.optimize(conv_layernorm, extractor="greedy", progress=False).lower(*args).plan
    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    (statistic,) = conv.hosted
    assert "(image, channel group)" in group_statistic_declined(statistic, conv.term)
    assert not writes_partials(statistic, "mosaic", conv.term)
    assert hosted_extra(statistic, "mosaic", "h100", conv.term).seconds > 0
    args = _args(np.random.default_rng(6), 64, 192, 0.0)
    plan = eqsat.optimize(_conv_groupnorm, extractor="greedy", progress=False).lower(*args).plan
    conv = _hosted_on_conv(plan)
    assert hosted_extra(conv.hosted[0], "mosaic", "h100", conv.term).seconds == 0


# --- sm_90a ----------------------------------------------------------------------------------------------


def _compile(fn, args, tmp_path, monkeypatch):
    from measure.xla_target import unavailable_reason
    from tests.test_emit_mosaic import compile_mosaic

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    plan = eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan
    _hosted_on_conv(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report, _ptx, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    # the conv's glue (its weight laid out, its flat rows sliced back) aside: no reduce kernel
    pallas = {k: v for k, v in report.by_category.items() if k.startswith("Pallas")}
    assert pallas == {"Pallas (Mosaic GPU)": 1, "Pallas (Triton)": len(plan.kernels) - 1}, report.by_category
    assert counts.tensor_core == "wgmma" and resources.spill_bytes == 0, (counts, resources)


@pytest.mark.parametrize("cin,images,channels", [
    (192, 2, 320),   # haloed: SD 1.5's GroupNorm of 320 channels (32 groups of 10), 64 slots
    (128, 1, 128),   # haloed: the VAE's of 128 channels (32 groups of 4), 32 slots
    (4, 2, 320),     # flat grid: conv_in's 4 channels (too few for the haloed kernel), 64 slots
])
def test_compiles_for_sm90a_writing_group_partials(cin, images, channels, tmp_path, monkeypatch):
    """A 3x3 conv on 16x16 images hosting its output's GroupNorm (32 groups, read by the pointwise
    GroupNorm + SiLU): the Mosaic conv (the plan's one Mosaic kernel) compiles for an H100 with its
    statistics in the epilogue (no reduce kernel launches), wgmma, no spills."""
    S = jax.ShapeDtypeStruct

    def conv_groupnorm32(x, w1, b1, gamma, beta):
        p = {"a.weight": w1, "a.bias": b1, "n.weight": gamma, "n.bias": beta}
        return layers.silu(layers.group_norm(p, "n", layers.conv2d(p, "a", x), 32, 1e-5))

    args = (S((images, 16, 16, cin), jnp.float16), S((channels, cin, 3, 3), jnp.float16),
            *(S((channels,), jnp.float16) for _ in range(3)))
    _compile(conv_groupnorm32, args, tmp_path, monkeypatch)


def test_an_upsample_conv_in_its_phase_form_hosting_a_groupnorm():
    """A 3x3 conv over a nearest-2x upsample (64 channels of 7x7 -> 14x14, 192 out: 64 groups of 3)
    runs in the haloed template's phase form (N = 4 phases of 192 columns, each CTA's columns one
    phase's channels): it writes the GroupNorm's partials, which the pointwise GroupNorm + SiLU
    merges; equal to XLA's and jit's."""
    def upsample_conv_groupnorm(x, w, b, gamma, beta):
        p = {"u.conv.weight": w, "u.conv.bias": b, "n.weight": gamma, "n.bias": beta}
        h = layers.upsample(p, "u", x)
        return layers.silu(layers.group_norm(p, "n", h, h.shape[-1] // CPG, 1e-5))

    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 7, 7, 64))
    w = 0.1 * rng.standard_normal((192, 64, 3, 3))
    w[CPG:2 * CPG] = 0.0
    args = tuple(jnp.asarray(a, jnp.float16) for a in (x, w, 40.0 + rng.standard_normal(192),
                                                         1 + 0.2 * rng.standard_normal(192), rng.standard_normal(192)))
    plan = eqsat.optimize(upsample_conv_groupnorm, extractor="greedy", progress=False).lower(*args).plan
    _hosted_on_conv(plan)
    builds = []
    original = ch.build
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch, "build", lambda *a, **k: builds.append(k.get("phase_cols")) or original(*a, **k))
        got = _run_without_reduce_kernels(plan, args)
    assert builds == [192], builds  # the phase form
    _close(got, emit.emit(plan, "xla")(*args), jax.jit(upsample_conv_groupnorm)(*args), atol=2e-2)
