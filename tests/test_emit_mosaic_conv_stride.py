"""The haloed Mosaic GPU conv at stride 2 (`emit/mosaic/conv_halo.py`, `HaloGrid.stride`): the padded
input rows staged in two row phases (even and odd padded rows), each tap reading every other staged
row (a `[staging / 2, 2, 64]` view of the staging: no phase copies of the input), in GPU interpret
mode against `lax.conv_general_dilated`, the XLA emitter and `jax.jit` on 15x15 and 16x16 images with
padding 1 (and the VAE encoder's (0, 1)), a GroupNorm (3 channels per group) + SiLU prologue and
adversarial values (offsets 1e4 against a spread of 1, constant channels, zero rows, NaN and inf);
the staging's rows and mask; one compile for sm_90a without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import emit
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.pallas.conv import ConvGeometry
from eqsat.conv_params import ConvParams
from eqsat.cost.mosaic import conv_work
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks, halo_tiling
from sd15 import layers
from tests.test_emit_mosaic_conv_halo import _adversarial_input, _assert_close, _bound, run_on_grid
from tests.test_emit_mosaic_conv_ranges import (_plan, _run_haloed, assert_compiles_to_one_pipelined_mosaic_kernel,
                                                 assert_haloed_matches_xla_and_jit)

S, F16 = jax.ShapeDtypeStruct, jnp.float16


def _params(x_shape, w_shape, padding, stride=2) -> ConvParams:
    numbers = lax.conv_dimension_numbers(x_shape, w_shape, ("NHWC", "HWIO", "NHWC"))
    return ConvParams(strides=(stride, stride), padding=padding, lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                      lhs_spec=tuple(numbers.lhs_spec), rhs_spec=tuple(numbers.rhs_spec),
                      out_spec=tuple(numbers.out_spec))


def _geometry(x_shape, w_shape, padding):
    params = _params(x_shape, w_shape, padding)
    out = jax.eval_shape(lambda: mc.reference(jnp.zeros(x_shape, F16), jnp.zeros(w_shape, F16), params)).shape
    return ConvGeometry(params, x_shape, w_shape, out)


def test_the_stride_2_grid_stages_two_row_phases():
    """15x15, padding 1: padded pitch 17 rounded to 18 (output pitch 9, 8 outputs a row); a 64-row CTA
    spans output rows oy0 .. oy0 + 7 and stages padded rows 2 (oy0 + i) + phase for i < 9 (row phase 0
    also the row below its last output row); the mask is 1 on the image's pixels of each phase."""
    grid = HaloGrid(_geometry((1, 15, 15, 64), (3, 3, 64, 8), ((1, 1), (1, 1))), 64)
    assert grid.geometry.out_size == (8, 8)
    assert (grid.stride, grid.pitch, grid.out_pitch, grid.out_rows, grid.m_tiles) == (2, 18, 9, 72, 2)
    assert (grid.staged_rows, grid.row_copies, grid.phase_rows) == (9, 18, 162)
    assert grid.staging >= 2 * grid.phase_rows and grid.staging % 64 == 0
    mask = ch.row_mask(grid)
    for m in range(2):
        oy0 = m * 64 // 9
        for j in range(grid.staging):
            phase, local = divmod(j, 162)
            yp, xp = 2 * (oy0 + local // 18) + phase, local % 18
            expected = phase < 2 and 1 <= yp <= 15 and 1 <= xp <= 15
            assert mask[m, j] == expected, (m, j)


def _stride2(x, w, params, tiles=None):
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    geometry = ConvGeometry(params, x.shape, w.shape, out_shape)
    if tiles is None:
        blocks, grid_of = halo_tiling(geometry, out_shape[-1], batch=x.shape[0])
        grid = grid_of(blocks.tile_m)
    else:
        blocks = MosaicBlocks(*tiles, 64, stages=3, compute_wgs=1)
        grid = HaloGrid(geometry, blocks.tile_m)
    return run_on_grid(x, w, params, grid, blocks, out_shape[-1])


@pytest.mark.parametrize("shape,window,padding,tiles", [
    ((2, 16, 16, 64), 3, ((1, 1), (1, 1)), None),        # even: 8x8 outputs, pitch 18
    ((1, 15, 15, 64), 3, ((1, 1), (1, 1)), (128, 64)),   # odd: 8x8 outputs, pitch 17 -> 18, one CTA
    ((1, 15, 16, 128), 3, ((0, 1), (0, 1)), None),       # the VAE encoder's padding (0, 1), two chunks
    ((1, 9, 11, 64), 1, ((0, 0), (0, 0)), None),         # a 1x1 at stride 2
])
def test_stride_2_matches_lax_conv(shape, window, padding, tiles):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((window, window, shape[-1], 72)), jnp.float16)
    params = _params(x.shape, w.shape, padding)
    got = _stride2(x, w, params, tiles)
    np.testing.assert_allclose(np.asarray(got), np.asarray(mc.reference(x, w, params)), rtol=2e-3, atol=2e-3)


# --- plans through backend="mosaic" ------------------------------------------------------------------


def _downsample(x, w, b):
    """diffusers `Downsample2D`: a 3x3 conv of stride 2, padding 1, with a bias."""
    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x, stride=2)


def _gn_silu_downsample(x, w, b, gamma, beta):
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5)), stride=2)


@pytest.mark.parametrize("side", [16, 15])
def test_a_downsampler_reads_its_input_as_it_lies(side):
    """`Downsample2D` on two side x side images (64 -> 80 channels): one haloed kernel staging the plan's
    input itself (the model charges no input layout either), against XLA and jit."""
    rng = np.random.default_rng(side)
    x = jnp.asarray(rng.standard_normal((2, side, side, 64)), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((80, 64, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(80), jnp.float16)
    plan = _plan(_downsample, (x, w, b))
    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    assert "input laid out" not in {g.what for g in conv_work(conv.term).glue}
    out = _run_haloed(plan, (x, w, b), [(2, side, side, 64)])
    assert out.shape == (2, 8, 8, 80)
    scale = float(np.abs(np.asarray(w, np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 8.0
    _assert_close(out, emit.emit(plan, "xla")(x, w, b), jax.jit(_downsample)(x, w, b), scale=scale)


_PLANS: dict = {}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_stride_2_conv_matches_xla_and_jit_on_adversarial_values(data):
    """GroupNorm (64 groups of 3) + SiLU -> a 3x3 conv of stride 2 (192 -> 64) on a 15x15 image: the
    prologue on both row phases' staged pixels, zero padding after it; offsets up to 1e4 against a
    spread of 1, tiny and large scales, constant channels, zero rows; NaN in the input reaches every
    output that reads its group (the statistics are the plan's), as in jit."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _adversarial_input(data.draw, (1, 15, 15, 192)).astype(np.float32)
    if data.draw(st.booleans()):
        x[0, 6, 9, 4] = data.draw(st.sampled_from((np.nan, np.inf)))
    gamma, beta = (jnp.asarray(rng.standard_normal(192), jnp.float16) for _ in range(2))
    w = jnp.asarray(0.05 * rng.standard_normal((64, 192, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(64), jnp.float16)
    args = (jnp.asarray(x, jnp.float16), w, b, gamma, beta)
    if "plan" not in _PLANS:
        _PLANS["plan"] = _plan(_gn_silu_downsample, args)
    plan = _PLANS["plan"]
    assert_haloed_matches_xla_and_jit(plan, _gn_silu_downsample, args, [(1, 15, 15, 192)], _bound(gamma, beta, w, b))


@pytest.mark.slow
def test_compiles_for_sm90a_at_stride_2(tmp_path, monkeypatch):
    """The UNet's second downsampler's shape at 16x16 (2 images, 640 -> 640, stride 2) compiles for an
    H100: the strided tap rows load from the staging's pair view, wgmma with an MMA in flight, TMA
    loads, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (S((2, 16, 16, 640), F16), S((640, 640, 3, 3), F16), S((640,), F16))
    assert_compiles_to_one_pipelined_mosaic_kernel(_plan(_downsample, args), args, tmp_path, monkeypatch)


def test_every_tap_reads_inside_the_staging_and_its_rows_hold_its_pixels():
    """For images of 5 to 33 pixels a side (odd and even), 1x1 and 3x3 windows, paddings 0, 1 and (0, 1), 64- and 128-row
    CTAs: each tap's strided rows (`[staging / 2, 2, 64]` pairs from `row`) lie inside the staging,
    and the staged row tap (ky, kx) reads for output (oy, ox) is padded pixel (2 oy + ky, 2 ox + kx)."""
    for h in (5, 8, 15, 16, 33):
        for w in (5, 7, 15, 16, 31):
            for window, padding in ((3, ((1, 1), (1, 1))), (3, ((0, 1), (0, 1))), (1, ((0, 0), (0, 0)))):
                geometry = _geometry((1, h, w, 64), (window, window, 64, 8), padding)
                ho, wo = geometry.out_size
                for tile_m in (64, 128):
                    grid = HaloGrid(geometry, tile_m)
                    for m in range(grid.m_tiles):
                        q0 = m * tile_m
                        oy0, a_offset = divmod(q0, grid.out_pitch)
                        for ky in range(window):
                            for kx in range(window):
                                row = (ky % 2) * grid.phase_rows // 2 + a_offset + (ky // 2) * grid.pitch // 2 + kx // 2
                                assert 2 * (row + tile_m) <= grid.staging, (h, w, window, tile_m, m, ky, kx)
                                for j in range(tile_m):
                                    oy, ox = divmod(q0 + j, grid.out_pitch)
                                    if oy >= ho or ox >= wo:
                                        continue
                                    staged = 2 * (row + j) + kx % 2
                                    phase, local = divmod(staged, grid.phase_rows)
                                    yp, xp = 2 * (oy0 + local // grid.pitch) + phase, local % grid.pitch
                                    assert (yp, xp) == (2 * oy + ky, 2 * ox + kx), (h, w, m, ky, kx, j)
                                    assert local // grid.pitch < grid.staged_rows
