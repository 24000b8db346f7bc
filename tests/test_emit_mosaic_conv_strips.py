"""The haloed Mosaic GPU conv over rows too wide to stage (`emit/mosaic/conv_halo.py`, `HaloGrid.strips`):
each row cut into column strips, each strip a grid of its own whose halo columns are its neighbours'
pixels (zero padding only at the image's edges), in GPU interpret mode against
`lax.conv_general_dilated`, the XLA emitter and `jax.jit` (15x15 images cut into 3 and 5 strips,
300-pixel rows, adversarial values); the strips' masks and columns; one compile for sm_90a."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import emit
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.pallas.conv import ConvGeometry
from eqsat.cost.mosaic import conv_work
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks, halo_tiling, strip_counts
from tests.test_emit_mosaic_conv_halo import _adversarial_input, _assert_close, _bound, _params, run_on_grid
from tests.test_emit_mosaic_conv_ranges import (_plan, _run_haloed, assert_compiles_to_one_pipelined_mosaic_kernel,
                                                 assert_haloed_matches_xla_and_jit)

S, F16 = jax.ShapeDtypeStruct, jnp.float16


def _strip_conv(x, w, params, strips, tiles=(64, 64)):
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    geometry = ConvGeometry(params, x.shape, w.shape, out_shape)
    blocks = MosaicBlocks(*tiles, 64, stages=3, compute_wgs=1)
    grid = HaloGrid(geometry, blocks.tile_m, strips)
    return run_on_grid(x, w, params, grid, blocks, out_shape[-1])


def test_a_strips_columns_and_mask():
    """15 columns, padding 1, 3 strips of 5 outputs: pitch 7; strip 0 copies input columns 0..5 to SMEM
    column 1 (column 0 is the padding), strip 1 columns 4..10 to 0, strip 2 columns 9..14 to 0 (column
    6 is the padding); the mask is 1 exactly there, on the image's rows."""
    params = _params((1, 15, 15, 64), (3, 3, 64, 8), ((1, 1), (1, 1)))
    grid = HaloGrid(ConvGeometry(params, (1, 15, 15, 64), (3, 3, 64, 8), (1, 15, 15, 8)), 64, 3)
    assert (grid.strip_width, grid.pitch, grid.out_rows, grid.m_tiles, grid.m_padded) == (5, 7, 105, 2, 384)
    assert [grid.strip_columns(s) for s in range(3)] == [(0, 6, 1), (4, 7, 0), (9, 6, 0)]
    assert grid.copied_columns == 15 + 2 * 2
    mask = ch.row_mask(grid).reshape(3, 2, -1)
    for s, (_start, columns, at) in enumerate(grid.strip_columns(s) for s in range(3)):
        for m in range(2):
            first = m * 64 // 7
            for j in range(grid.staging):
                yp, xp = first + j // 7, j % 7
                expected = j < grid.staged_rows * 7 and at <= xp < at + columns and 1 <= yp <= 15
                assert mask[s, m, j] == expected, (s, m, j)


@pytest.mark.parametrize("strips,window,pad", [(3, 3, 1), (5, 3, 1), (3, 1, 0)])
def test_strips_match_lax_conv(strips, window, pad):
    rng = np.random.default_rng(strips)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((window, window, 64, 72)), jnp.float16)
    params = _params(x.shape, w.shape, ((pad, pad), (pad, pad)))
    got = _strip_conv(x, w, params, strips)
    np.testing.assert_allclose(np.asarray(got), np.asarray(mc.reference(x, w, params)), rtol=2e-3, atol=2e-3)


def test_wide_rows_take_strips_only_where_one_row_does_not_fit():
    """A 64-wide row stages whole; 512 (a TMA box is 256: 2 strips would stage 258) and 256 x 512
    channels (a whole row's staging is over SMEM) take strips of 128."""
    def geometry(width, channels):
        params = _params((1, 8, width, channels), (3, 3, channels, 128), ((1, 1), (1, 1)))
        return ConvGeometry(params, (1, 8, width, channels), (3, 3, channels, 128), (1, 8, width, 128))

    assert strip_counts(geometry(64, 128))[0] == 1
    assert halo_tiling(geometry(64, 128), 128)[1](64).strips == 1
    assert strip_counts(geometry(512, 128))[:2] == [4, 8]
    blocks, grid_of = halo_tiling(geometry(512, 128), 128)
    assert grid_of(blocks.tile_m).strips == 4 and grid_of(blocks.tile_m).pitch == 130
    blocks, grid_of = halo_tiling(geometry(256, 512), 128)
    assert grid_of(blocks.tile_m).strips == 2


def _gn_silu_conv_residual(x, w, b, gamma, beta, r):
    from sd15 import layers

    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5))) + r


def _wide_args(rng, x):
    gamma, beta = (jnp.asarray(rng.standard_normal(192), jnp.float16) for _ in range(2))
    w = jnp.asarray(0.05 * rng.standard_normal((80, 192, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(80), jnp.float16)
    r = jnp.asarray(rng.standard_normal((*x.shape[:3], 80)), jnp.float16)
    return (jnp.asarray(x, jnp.float16), w, b, gamma, beta, r)


_PLANS: dict = {}


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_groupnorm_silu_conv_over_300_pixel_rows(data):
    """GroupNorm (64 groups of 3) + SiLU -> 3x3 conv (192 -> 80) + a residual on 2 x 300 pixels: rows
    wider than a TMA box, run as 2 strips of 150 (each staging its columns and the neighbour's halo
    pixel, the prologue applied before the padding is zeroed): offsets up to 1e4 against a spread of
    1, tiny and large scales, constant channels, zero rows, a NaN or inf on the strips' seam (NaN
    where jit has NaN); against XLA and jit."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _adversarial_input(data.draw, (1, 2, 300, 192)).astype(np.float32)
    if data.draw(st.booleans()):  # on the strips' seam: staged by both strips (one's pixel, the other's halo)
        x[0, 1, data.draw(st.sampled_from((149, 150))), 7] = data.draw(st.sampled_from((np.nan, np.inf)))
    args = _wide_args(rng, x)
    if "plan" not in _PLANS:
        _PLANS["plan"] = _plan(_gn_silu_conv_residual, args)
    plan = _PLANS["plan"]
    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    assert "input laid out" not in {g.what for g in conv_work(conv.term).glue}
    assert_haloed_matches_xla_and_jit(plan, _gn_silu_conv_residual, args, [(1, 2, 300, 192)],
                                      _bound(*args[3:5], args[1], args[2]) + 8)


@pytest.mark.slow
def test_compiles_for_sm90a_in_strips(tmp_path, monkeypatch):
    """A 3x3 conv over 4 rows of 512 pixels (192 -> 128, a GroupNorm + SiLU prologue, a residual) compiles
    for an H100 in strips: wgmma with an MMA in flight, TMA loads, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (S((1, 4, 512, 192), F16), S((128, 192, 3, 3), F16), S((128,), F16), S((192,), F16), S((192,), F16),
            S((1, 4, 512, 128), F16))
    plan = _plan(_gn_silu_conv_residual, args)
    assert_compiles_to_one_pipelined_mosaic_kernel(plan, args, tmp_path, monkeypatch)


@pytest.mark.slow
def test_an_upsample_conv_over_a_wide_source_runs_its_phases_in_strips():
    """A 3x3 conv over the nearest-2x upsample of a 2 x 260 source (64 -> 64 channels): the phase form
    over the source's grid in 2 strips of 130 (the VAE's last upsampler, 256 wide, likewise), against
    XLA and jit."""
    from tests.test_emit_mosaic_conv_ranges import _upsample_args, _upsample_conv

    rng = np.random.default_rng(9)
    args = _upsample_args(rng.standard_normal((1, 2, 260, 64)), rng, out=64)
    plan = _plan(_upsample_conv, args)
    out = _run_haloed(plan, args, [(1, 2, 260, 64)])
    assert out.shape == (1, 4, 520, 64)
    expected = emit.emit(plan, "xla")(*args)
    scale = float(np.abs(np.asarray(args[1], np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 8.0
    _assert_close(out, expected, jax.jit(_upsample_conv)(*args), scale=scale)
