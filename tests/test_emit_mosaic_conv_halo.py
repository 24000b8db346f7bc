"""The haloed Mosaic GPU conv (`emit/mosaic/conv_halo.py`) in GPU interpret mode: the kernel on its
own against `lax.conv_general_dilated` (3x3 and 1x1, one and two channel chunks, padded outputs), its
row mask, plans emitted with `backend="mosaic"` against the XLA emitter and `jax.jit` (GroupNorm +
SiLU with 3 channels per group read from hosted statistics, on 15x15 images, adversarial values),
which convs it takes and which it leaves to the flat-grid template, and one compile for sm_90a
without a GPU.

GPU interpret mode costs seconds per kernel here: shapes are tiny and the slow cases are marked."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.pallas import XlaFallbackWarning
from emit.pallas.conv import ConvGeometry
from eqsat.conv_params import ConvParams
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks, halo_blocks
from sd15 import layers
from tests.test_emit_mosaic import compile_mosaic


def _params(x_shape, w_shape, padding) -> ConvParams:
    numbers = lax.conv_dimension_numbers(x_shape, w_shape, ("NHWC", "HWIO", "NHWC"))
    return ConvParams(strides=(1, 1), padding=padding, lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                      lhs_spec=tuple(numbers.lhs_spec), rhs_spec=tuple(numbers.rhs_spec),
                      out_spec=tuple(numbers.out_spec))


def run_on_grid(x, w, params, grid, blocks, out_features: int):
    """`ch.build` of one input on `grid` in GPU interpret mode, unflattened: the conv's output (float32)."""
    n_padded = -(-out_features // blocks.tile_n) * blocks.tile_n

    @jax.jit
    def run(x, w):
        flat = ch.build([x], ch.layout_weight(w, params.rhs_spec, n_padded), grid, blocks,
                        out_dtype=jnp.float32, interpret=True)
        return ch.unflatten(flat, grid, out_features)

    return run(x, w)


def _haloed_conv(x, w, params, blocks=None):
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    geometry = ConvGeometry(params, x.shape, w.shape, out_shape)
    grid_of = functools.partial(HaloGrid, geometry)
    blocks = blocks or halo_blocks(grid_of, grid_of(128).out_rows, out_shape[-1], batch=x.shape[0])
    grid = grid_of(blocks.tile_m)
    return run_on_grid(x, w, params, grid, blocks, out_shape[-1])


@pytest.mark.parametrize("shape,window,out,tiles", [
    ((1, 15, 15, 64), 3, 64, None),                                     # 4 CTAs of 64 rows, pitch 17
    ((1, 15, 15, 64), 3, 80, (128, 128)),                               # 2 CTAs of 128 rows, N padded to 128
    pytest.param((2, 7, 9, 128), 3, 80, None, marks=pytest.mark.slow),  # two chunks, two images
    ((2, 5, 6, 128), 1, 72, None),                                      # a 1x1: no halo
])
def test_the_haloed_kernel_matches_lax_conv(shape, window, out, tiles):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((window, window, shape[-1], out)), jnp.float16)
    pad = window // 2
    params = _params(x.shape, w.shape, ((pad, pad), (pad, pad)))
    blocks = None if tiles is None else MosaicBlocks(*tiles, 64, stages=3, compute_wgs=1)
    got = _haloed_conv(x, w, params, blocks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(mc.reference(x, w, params)), rtol=2e-3, atol=2e-3)


def test_the_row_mask_zeroes_the_padding_of_each_ctas_staged_rows():
    """A 3x3 conv on a 3x5 image: pitch 7, 3 output rows (21 flat rows) in one 64-row CTA, which
    stages padded rows 0..4 (the image in rows 1..3, columns 1..5 of each)."""
    params = _params((1, 3, 5, 64), (3, 3, 64, 8), ((1, 1), (1, 1)))
    grid = HaloGrid(ConvGeometry(params, (1, 3, 5, 64), (3, 3, 64, 8), (1, 3, 5, 8)), 64)
    assert (grid.pitch, grid.out_rows, grid.m_tiles, grid.halo) == (7, 21, 1, 16)
    assert grid.staged_rows == 12 and grid.staging == 128  # ceil((0 + 64 + 16) / 7) padded rows
    mask = ch.row_mask(grid)[0]
    image = mask[:5 * 7].reshape(5, 7)
    expected = np.zeros((5, 7))
    expected[1:4, 1:6] = 1
    np.testing.assert_array_equal(image, expected)
    assert not mask[5 * 7:].any()


# --- plans through backend="mosaic" ------------------------------------------------------------------


def _gn_silu_conv(x, gamma, beta, w, b):
    """GroupNorm with 3 channels per group, SiLU, a 3x3 conv with a bias."""
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5)))


def _emitted(fn, args):
    """(mosaic callable, xla callable, plan); the conv must run on the haloed template (no fallback)."""
    plan = eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan
    assert [k.kind for k in plan.kernels].count("conv") == 1
    return emit.emit(plan, "mosaic", interpret=True), emit.emit(plan, "xla"), plan


def run_recording_builds(run, args):
    """(`run(*args)`, the input shapes each haloed kernel it built stages): no fallback to Triton
    (XLA fallbacks of other kernels allowed)."""
    builds = []
    original = ch.build
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        patch.setattr(ch, "build", lambda *a, **k: builds.append([x.shape for x in a[0]]) or original(*a, **k))
        out = run(*args)
    return out, builds


def _run_haloed(mosaic, args, traced: bool = True):
    """`mosaic(*args)`; when it traces the plan here (`traced`), its conv must be the haloed kernel
    over the plan's input itself."""
    out, builds = run_recording_builds(mosaic, args)
    calls = [shape for staged in builds for shape in staged]
    assert calls == ([args[0].shape] if traced else []), calls  # the kernel stages the plan's input itself
    return out


def _assert_close(got, *expected, scale):
    for e in expected:
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(e, np.float32) / scale,
                                   atol=4e-3, rtol=0)


def _bound(gamma, beta, w, b):
    """|silu(groupnorm)| <= |gamma| * sqrt(group size) + |beta| (+1), times the weights' sums, + |b|."""
    act = np.abs(np.asarray(gamma, np.float32)) * np.sqrt(3.0) + np.abs(np.asarray(beta, np.float32)) + 1.0
    return float(np.max(np.abs(np.asarray(w, np.float32)).sum(axis=(2, 3)) @ act)) + float(np.max(np.abs(b))) + 1.0


def test_a_groupnorm_silu_conv_on_two_15x15_images():
    """192 channels (64 groups of 3) -> 80 on two 15x15 images, an offset of 40 against a spread of 1:
    the prologue (per-image statistics gathered per channel, gamma, beta, SiLU) evaluated in SMEM."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(40.0 + rng.standard_normal((2, 15, 15, 192)), jnp.float16)
    gamma, beta = (jnp.asarray(rng.standard_normal(192), jnp.float16) for _ in range(2))
    w = jnp.asarray(0.1 * rng.standard_normal((80, 192, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(80), jnp.float16)
    args = (x, gamma, beta, w, b)
    mosaic, xla, _ = _emitted(_gn_silu_conv, args)
    out = _run_haloed(mosaic, args)
    assert out.shape == (2, 15, 15, 80)
    _assert_close(out, xla(*args), jax.jit(_gn_silu_conv)(*args), scale=_bound(gamma, beta, w, b))


def _adversarial_input(draw, shape):
    offset = draw(st.sampled_from((0.0, 1.0, -300.0, 1e4)))
    scale = draw(st.sampled_from((1.0, 1e-3, 3e2, 0.0)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = offset + scale * rng.standard_normal(shape)
    if draw(st.booleans()):
        x[..., rng.integers(0, shape[-1], size=shape[-1] // 4)] = offset  # constant channels
    if draw(st.booleans()):
        x[:, rng.integers(0, shape[1])] = 0.0  # a row of zeros
    return x.astype(np.float16)


_PLANS: dict = {}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_groupnorm_silu_conv_matches_xla_and_jit_on_adversarial_values(data):
    """GroupNorm (64 groups of 3) + SiLU -> 3x3 conv (192 -> 64) on a 15x15 image: offsets of 1e4
    against a spread of 1, tiny and large scales, constant channels, zero rows, zero weights."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _adversarial_input(data.draw, (1, 15, 15, 192))
    gamma = (rng.standard_normal(192) + data.draw(st.sampled_from((0.0, 1.0)))).astype(np.float16)
    beta = (rng.standard_normal(192) + data.draw(st.sampled_from((0.0, -2.0)))).astype(np.float16)
    w = (data.draw(st.sampled_from((0.1, 0.0))) * rng.standard_normal((64, 192, 3, 3))).astype(np.float16)
    b = (rng.standard_normal(64) + data.draw(st.sampled_from((0.0, 5.0)))).astype(np.float16)
    args = (x, gamma, beta, w, b)
    first = "plan" not in _PLANS
    if first:
        _PLANS["plan"] = _emitted(_gn_silu_conv, args)[:2]
    mosaic, xla = _PLANS["plan"]
    out = _run_haloed(mosaic, args, traced=first)
    _assert_close(out, xla(*args), jax.jit(_gn_silu_conv)(*args), scale=_bound(gamma, beta, w, b))


def test_convs_it_does_not_take_run_on_the_flat_grid_template():
    """Too few channels for a 64-channel TMA chunk (in any K range), a stride of 3: the flat-grid
    template (its input laid out by an XLA fusion), no Triton fallback. K ranges of 64k channels
    (a concat, a merged 1x1 shortcut over the centre tap) are the haloed template's."""
    from eqsat.tiling.mosaic import halo_uncovered

    p = _params((1, 8, 8, 32), (3, 3, 32, 8), ((1, 1), (1, 1)))
    g = ConvGeometry(p, (1, 8, 8, 32), (3, 3, 32, 8), (1, 8, 8, 8))
    assert "32 input channels" in halo_uncovered(g, [(32, ((0, 3), (0, 3)))], 2)
    g = ConvGeometry(p, (1, 8, 8, 64), (3, 3, 64, 8), (1, 8, 8, 8))
    assert halo_uncovered(g, [(64, ((0, 3), (0, 3)))], 2) is None
    assert "32 input channels" in halo_uncovered(g, [(32, ((0, 3), (0, 3))), (32, ((0, 3), (0, 3)))], 2)
    assert halo_uncovered(g, [(64, ((0, 3), (0, 3))), (64, ((1, 2), (1, 2)))], 2) is None  # concat + shortcut
    assert "K ranges" in halo_uncovered(g, [(64, ((1, 4), (1, 2)))], 2)
    strided = dataclasses.replace(p, strides=(2, 2))  # stride 2: the haloed template's (two row phases)
    g = ConvGeometry(strided, (1, 8, 8, 64), (3, 3, 64, 8), (1, 4, 4, 8))
    assert halo_uncovered(g, [(64, ((0, 3), (0, 3)))], 2) is None
    g = ConvGeometry(dataclasses.replace(p, strides=(3, 3)), (1, 8, 8, 64), (3, 3, 64, 8), (1, 3, 3, 8))
    assert "strides" in halo_uncovered(g, [(64, ((0, 3), (0, 3)))], 2)


# --- compiled for an H100 without a GPU ----------------------------------------------------------


@pytest.mark.slow
def test_compiles_for_sm90a_reading_the_input_in_place(tmp_path, monkeypatch):
    """A GroupNorm+SiLU 3x3 conv, 2 x 16x16x192 -> 128 fp16: the haloed kernel compiles for an H100:
    wgmma with one MMA in flight, TMA loads (input rows, vectors, weights) and stores, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (jax.ShapeDtypeStruct((2, 16, 16, 192), jnp.float16), jax.ShapeDtypeStruct((192,), jnp.float16),
            jax.ShapeDtypeStruct((192,), jnp.float16), jax.ShapeDtypeStruct((128, 192, 3, 3), jnp.float16),
            jax.ShapeDtypeStruct((128,), jnp.float16))
    plan = eqsat.optimize(_gn_silu_conv, extractor="greedy", progress=False).lower(*args).plan
    (conv,) = [k for k in plan.kernels if k.kind == "conv"]
    assert conv.term.args[0].op != "Load"  # the prologue is the conv's input expression
    report, ptx_path, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    assert ptx_path.name.startswith("c_conv"), ptx_path
    assert counts.tensor_core == "wgmma" and counts.wgmma_wait_depth >= 1, counts
    assert counts.tma_loads >= 4, counts
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx_path.read_text()), "no TMA store"
    assert resources.spill_bytes == 0, resources


def test_a_conv_over_a_matmul_output_viewed_as_nhwc():
    """A transformer block's proj_out: a 1x1 conv over `[B, H·W, C]` viewed as NHWC, plus a residual.
    The kernel stages the `[B, H·W, C]` tensor's rows through the view (no layout fusion)."""
    rng = np.random.default_rng(5)
    t = jnp.asarray(rng.standard_normal((2, 35, 64)), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((64, 64, 1, 1)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(64), jnp.float16)
    r = jnp.asarray(rng.standard_normal((2, 5, 7, 64)), jnp.float16)

    def proj_out(t, w, b, r):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", (t * 0.5).reshape(2, 5, 7, 64)) + r

    args = (t, w, b, r)
    mosaic, xla, plan = _emitted(proj_out, args)
    (conv,) = [k for k in plan.kernels if k.kind == "conv"]
    loads = [n.args[0] for n in emit.expr.expr_nodes(conv.term.args[0]) if n.op == "Load"]
    assert any(tuple(eqsat.types.parse_type(x.ty).shape) == (2, 35, 64) for x in loads), conv.term.args[0]
    out, builds = run_recording_builds(mosaic, args)
    calls = [shape for staged in builds for shape in staged]
    assert calls == [(2, 5, 7, 64)]
    scale = float(np.max(np.abs(np.asarray(xla(*args), np.float32)))) + 1.0
    _assert_close(out, xla(*args), jax.jit(proj_out)(*args), scale=scale)


@pytest.mark.slow
def test_a_resnet_block_both_convs_haloed():
    """sd15's ResnetBlock2D at 192 channels (64 groups of 3) on a 15x15 image, 2 images: conv1 with the
    GroupNorm+SiLU prologue and the time-embedding row (per image) in its epilogue, conv2 with the
    second GroupNorm+SiLU and the residual: both on the haloed template, against XLA and jax.jit."""
    rng = np.random.default_rng(11)
    names = [("norm1.weight", (192,)), ("norm1.bias", (192,)), ("conv1.weight", (192, 192, 3, 3)),
             ("conv1.bias", (192,)), ("time_emb_proj.weight", (192, 16)), ("time_emb_proj.bias", (192,)),
             ("norm2.weight", (192,)), ("norm2.bias", (192,)), ("conv2.weight", (192, 192, 3, 3)),
             ("conv2.bias", (192,))]
    params = {f"r.{n}": jnp.asarray((0.05 if len(s) == 4 else 0.5) * rng.standard_normal(s), jnp.float16)
              for n, s in names}
    x = jnp.asarray(30.0 + rng.standard_normal((2, 15, 15, 192)), jnp.float16)
    temb = jnp.asarray(rng.standard_normal((2, 16)), jnp.float16)

    def block(p, x, temb):
        return layers.resnet_block(p, "r", x, temb, 64, 1e-5)

    args = (params, x, temb)
    plan = eqsat.optimize(block, extractor="greedy", progress=False).lower(*args).plan
    assert [k.kind for k in plan.kernels].count("conv") == 2
    out, builds = run_recording_builds(emit.emit(plan, "mosaic", interpret=True), args)
    calls = [shape for staged in builds for shape in staged]
    assert len(calls) == 2, calls
    expected = emit.emit(plan, "xla")(*args)
    scale = float(np.max(np.abs(np.asarray(expected, np.float32)))) + 1.0
    _assert_close(out, expected, jax.jit(block)(*args), scale=scale)
