"""The haloed Mosaic GPU conv's output stored in the conv's own NHWC layout and a residual read as it
lies (`emit/mosaic/conv_halo.py`, `eqsat.tiling.mosaic.PixelView`): each CTA's flat rows cut into
pixel-row segments, each moved by static-size TMA copies (`row_pieces`), no flat output sliced by XLA
and no residual gathered onto the flat grid. The segments against every pixel of several grids
(tiles starting and ending mid-row, strips, stride 2, the phase form), the kernel in GPU interpret
mode against `lax` (outputs start NaN there: a pixel never stored shows), plans with a residual
epilogue against the XLA emitter and `jax.jit` on 15x15 and 17x9 images with 3 channels per group
and adversarial values, the compiled program's launches (no slice or gather fusion around the conv)
and sm_90a compiles without a GPU."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.mosaic import matmul as mm
from emit.pallas import XlaFallbackWarning
from emit.pallas.conv import ConvGeometry
from eqsat.tiling.mosaic import (HaloGrid, MosaicBlocks, halo_blocks, phase_geometry, pixel_view, row_pieces,
                                 segment_geometry)
from sd15 import layers
from tests.test_emit_mosaic_conv_halo import _adversarial_input, _assert_close, _bound, _params
from tests.test_emit_mosaic_conv_stride import _params as _stride_params

S, F16 = jax.ShapeDtypeStruct, jnp.float16


def _geometry(shape, out, window=3, stride=1, strips=1):
    pad = window // 2
    params = (_params if stride == 1 else _stride_params)(shape, (window, window, shape[-1], out), ((pad, pad),) * 2)
    ho, wo = ((shape[1] + 2 * pad - window) // stride + 1, (shape[2] + 2 * pad - window) // stride + 1)
    return ConvGeometry(params, shape, (window, window, shape[-1], out), (shape[0], ho, wo, out))


# --- the segments: every output pixel once, from its own flat row ---------------------------------------


@pytest.mark.parametrize("shape,window,stride,strips,tile_m,phases", [
    ((1, 15, 15, 64), 3, 1, 1, 64, False),     # pitch 17: tiles start and end mid-row
    ((1, 17, 9, 64), 3, 1, 1, 128, False),     # pitch 11, 128-row tiles (two 64-row sub-tiles each)
    ((1, 8, 8, 64), 3, 1, 1, 64, False),       # rows shorter than their pitch's 10 in a 64-row sub-tile
    ((1, 64, 64, 64), 3, 1, 1, 128, False),    # SD 1.5's 64x64
    ((1, 15, 15, 64), 3, 2, 1, 64, False),     # stride 2: output pitch 9 for 8 pixels
    ((1, 4, 30, 64), 3, 1, 3, 64, False),      # 3 strips of 10 columns
    ((1, 5, 6, 64), 1, 1, 1, 64, False),       # a 1x1 without padding: the rows are the pixels
    ((1, 7, 9, 64), 3, 1, 1, 64, True),        # the phase form over a 7x9 source
])
def test_every_output_pixel_is_stored_once_from_its_own_flat_row(shape, window, stride, strips, tile_m, phases):
    geometry = _geometry(shape, 64, window, stride)
    if phases:
        geometry = phase_geometry(_geometry((1, 2 * shape[1], 2 * shape[2], 64), 64))
    grid = HaloGrid(geometry, tile_m, strips)
    view = pixel_view(grid, 64, phases)
    pieces, segment = row_pieces(grid, view, 64), segment_geometry(grid, view)
    ho, wo = geometry.out_size
    stored = np.zeros((ho, wo), int)
    for strip in range(strips):
        for m in range(grid.m_tiles):
            for em in range(tile_m // 64):
                window_start = m * tile_m + em * 64
                for taken, row, oy, x, size in ch.segments(jnp.int32(window_start), pieces, segment, 64):
                    if taken is not None and not bool(taken):
                        continue
                    row, oy, x = int(row), int(oy), int(x)
                    assert 0 <= row and row + size <= 64  # inside the sub-tile
                    for i in range(size):  # the flat row holds the pixel the copy puts it at
                        q = window_start + row + i
                        if view.rows == 1 and view.py == 1:
                            py, px = divmod(x + i, wo)
                            assert (q // grid.out_pitch, q % grid.out_pitch) == (py, px)
                            stored[py, px] += 1
                        else:
                            assert (q // grid.out_pitch, q % grid.out_pitch) == (oy, x + i)
                            stored[oy, strip * grid.strip_width + x + i] += 1
    np.testing.assert_array_equal(stored, np.ones((ho, wo), int))


# --- the kernel on its own -----------------------------------------------------------------------------


def _kernel_with_residual(x, w, r, params, geometry, blocks, strips=1):
    grid = HaloGrid(geometry, blocks.tile_m, strips)
    view = pixel_view(grid, geometry.out_features)

    @jax.jit
    def run(x, w, r):
        out = ch.build([x], ch.layout_weight(w, params.rhs_spec, geometry.out_features), grid, blocks,
                       out_dtype=jnp.float32, interpret=True,
                       operands=[mm.EpilogueOperand("pixel", r.reshape(view.shape(geometry.batch)))],
                       epilogue=lambda acc, tiles: acc + tiles[0].astype(jnp.float32), view=view)
        return ch.unview(out, geometry)

    return run(x, w, r)


@pytest.mark.parametrize("shape,stride,strips,tiles", [
    ((1, 15, 15, 64), 1, 1, (64, 64)),
    ((2, 17, 9, 64), 1, 1, (128, 64)),
    pytest.param((1, 15, 15, 64), 2, 1, (64, 64), marks=pytest.mark.slow),
    pytest.param((1, 3, 30, 64), 1, 3, (64, 64), marks=pytest.mark.slow),
])
def test_the_kernel_stores_each_pixel_and_adds_the_residual_read_as_it_lies(shape, stride, strips, tiles):
    """A 3x3 conv plus a float16 residual read by TMA in the output's own layout: every pixel stored
    (no NaN left from the interpreter's fill), equal to `lax`'s conv plus the residual."""
    rng = np.random.default_rng(sum(shape))
    geometry = _geometry(shape, 64, 3, stride)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float16)
    w = jnp.asarray(0.1 * rng.standard_normal((3, 3, shape[-1], 64)), jnp.float16)
    r = jnp.asarray(1e3 * rng.standard_normal((shape[0], *geometry.out_size, 64)), jnp.float16)
    blocks = MosaicBlocks(*tiles, 64, stages=3, compute_wgs=1)
    got = np.asarray(_kernel_with_residual(x, w, r, geometry.params, geometry, blocks, strips))
    expected = np.asarray(mc.reference(x, w, geometry.params), np.float32) + np.asarray(r, np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)


# --- plans through backend="mosaic" ---------------------------------------------------------------------


def _gn_silu_conv_residual(x, w, b, gamma, beta, r):
    """A resnet's conv2: GroupNorm (3 channels per group) + SiLU, a 3x3 conv with a bias, a residual."""
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5))) + r


def _sd_conv2(x, w, b, gamma, beta, r):
    """SD 1.5's resnet conv2: GroupNorm (32 groups) + SiLU, a 3x3 conv with a bias, a residual."""
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, 32, 1e-5))) + r


def _conv_two_residuals(x, w, b, r, s):
    """A 3x3 conv with a bias and two tensors of its output's shape in its epilogue."""
    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x) + r * s


def _downsample(x, w, b):
    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x, stride=2)


def _plan(fn, args):
    return eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan


def _run_storing_pixels(plan, args):
    """The plan on the Mosaic backend; its one conv must be the haloed kernel storing pixels, every
    tile operand of its epilogue read as it lies (`pixel`), none gathered onto flat rows."""
    calls = []
    original = ch.build
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        patch.setattr(ch, "build", lambda *a, **k: calls.append(k) or original(*a, **k))
        out = emit.emit(plan, "mosaic", interpret=True)(*args)
    assert len(calls) == 1 and calls[0]["view"] is not None, calls
    assert "tile" not in [o.kind for o in calls[0]["operands"]], calls[0]["operands"]
    return out, [o.kind for o in calls[0]["operands"]]


def _residual_args(rng, x, out=64, offset=0.0):
    c = x.shape[-1]
    gamma, beta = (jnp.asarray(rng.standard_normal(c), jnp.float16) for _ in range(2))
    w = jnp.asarray(0.05 * rng.standard_normal((out, c, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(out), jnp.float16)
    r = jnp.asarray(offset + rng.standard_normal((*x.shape[:3], out)), jnp.float16)
    return (jnp.asarray(x, jnp.float16), w, b, gamma, beta, r)


def _check_against_xla_and_jit(plan, fn, args, out, scale):
    expected = np.asarray(emit.emit(plan, "xla")(*args), np.float32)
    jitted = np.asarray(jax.jit(fn)(*args), np.float32)
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(jitted))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(jitted))
    finite = np.isfinite(jitted)
    _assert_close(np.where(finite, out, 0), np.where(finite, expected, 0), np.where(finite, jitted, 0), scale=scale)


@pytest.mark.parametrize("side", [(15, 15), (17, 9)])
def test_a_resnet_conv2_with_its_residual_stores_nhwc(side):
    """GroupNorm (64 groups of 3) + SiLU -> 3x3 conv (192 -> 64) + bias + residual on two images: the
    residual one `pixel` operand (with the bias a column), the output the kernel's own."""
    rng = np.random.default_rng(side[0])
    args = _residual_args(rng, rng.standard_normal((2, *side, 192)))
    plan = _plan(_gn_silu_conv_residual, args)
    out, kinds = _run_storing_pixels(plan, args)
    assert sorted(kinds) == ["col", "pixel"] and out.shape == (2, *side, 64)
    _check_against_xla_and_jit(plan, _gn_silu_conv_residual, args, out, _bound(args[3], args[4], args[1], args[2]))


def test_two_residuals_on_8x8_images():
    """A 3x3 conv (128 -> 128) plus the product of two tensors of its output's shape on an 8x8 image:
    two `pixel` operands of 24 conditional copies each (more barriers than one group holds)."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((1, 8, 8, 128)), jnp.float16)
    w = jnp.asarray(0.05 * rng.standard_normal((128, 128, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(128), jnp.float16)
    r, s = (jnp.asarray(rng.standard_normal((1, 8, 8, 128)), jnp.float16) for _ in range(2))
    args = (x, w, b, r, s)
    plan = _plan(_conv_two_residuals, args)
    out, kinds = _run_storing_pixels(plan, args)
    assert kinds.count("pixel") == 2
    scale = float(np.abs(np.asarray(w, np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 16.0
    _check_against_xla_and_jit(plan, _conv_two_residuals, args, out, scale)


_PLANS: dict = {}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_residual_conv_matches_xla_and_jit_on_adversarial_values(data):
    """17x9 images: inputs offset by up to 1e4 against a spread of 1, constant channels, zero rows,
    zero weights, a residual offset by 1e4 or zero, a NaN and an inf in the residual that reach
    exactly their own pixels."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _adversarial_input(data.draw, (1, 17, 9, 192))
    args = list(_residual_args(rng, x, offset=data.draw(st.sampled_from((0.0, 1e4)))))
    if data.draw(st.booleans()):
        args[1] = jnp.zeros_like(args[1])
    r = np.asarray(args[5]).copy()
    if data.draw(st.booleans()):
        r[:] = 0
    r[0, 3, 4, 9], r[0, 16, 8, 63] = np.nan, np.inf
    args[5] = jnp.asarray(r)
    args = tuple(args)
    if "plan" not in _PLANS:
        _PLANS["plan"] = _plan(_gn_silu_conv_residual, args)
    plan = _PLANS["plan"]
    out, _ = _run_storing_pixels(plan, args)
    scale = _bound(args[3], args[4], args[1], args[2]) + float(np.nanmax(np.abs(np.where(np.isfinite(r), r, 0))))
    _check_against_xla_and_jit(plan, _gn_silu_conv_residual, args, out, scale)


@pytest.mark.slow
def test_a_downsampler_stores_nhwc():
    """`Downsample2D` (stride 2, 64 -> 64) on two 15x15 images stores its 8x8 outputs itself."""
    rng = np.random.default_rng(5)
    args = (jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16),
            jnp.asarray(0.1 * rng.standard_normal((64, 64, 3, 3)), jnp.float16),
            jnp.asarray(rng.standard_normal(64), jnp.float16))
    plan = _plan(_downsample, args)
    out, _ = _run_storing_pixels(plan, args)
    assert out.shape == (2, 8, 8, 64)
    scale = float(np.abs(np.asarray(args[1], np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 8.0
    _check_against_xla_and_jit(plan, _downsample, args, out, scale)


@pytest.mark.slow
def test_an_upsample_conv_stores_its_phases_interleaved():
    """The phase form (a 3x3 over the nearest-2x upsample of a 7x9 source, 64 -> 64): each phase's
    CTAs store their pixels at (2i + py, 2j + px) of the output, no depth-to-space fusion."""
    from tests.test_emit_mosaic_conv_ranges import _upsample_args, _upsample_conv

    rng = np.random.default_rng(6)
    args = _upsample_args(rng.standard_normal((1, 7, 9, 64)), rng, out=64)
    plan = _plan(_upsample_conv, args)
    out, _ = _run_storing_pixels(plan, args)
    assert out.shape == (1, 14, 18, 64)
    scale = float(np.abs(np.asarray(args[1], np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 8.0
    _check_against_xla_and_jit(plan, _upsample_conv, args, out, scale)


# --- compiled for an H100 without a GPU ------------------------------------------------------------------


def _skip_without_target():
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")


@pytest.mark.slow
def test_compiles_with_no_slice_or_gather_around_the_conv():
    """SD 1.5's resnet conv2 at 16x16 (320 -> 320, GroupNorm + SiLU, a residual) with
    `backend="mosaic"`, compiled for an H100: besides the Pallas kernels (the statistics, the conv)
    and the weight's layout (no prepare stage here), no launch slices the conv's output or gathers
    its residual (before: a `loop_slice_fusion` and a `loop_gather_fusion`)."""
    from measure.xla_target import compile_for_h100

    _skip_without_target()
    args = (S((2, 16, 16, 320), F16), S((320, 320, 3, 3), F16), S((320,), F16), S((320,), F16), S((320,), F16),
            S((2, 16, 16, 320), F16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = eqsat.optimize(_sd_conv2, backend="mosaic", progress=False, cache=False).lower(*args).plan
        report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    glue = [launch.name for launch in report.launches  # the weight's layout reads only an argument
            if launch.counted in ("kernel", "copy") and not launch.category.startswith("Pallas")
            and not launch.reads_only_inputs]
    assert not [name for name in glue if "slice" in name or "gather" in name or "transpose" in name], glue


@pytest.mark.slow
@pytest.mark.parametrize("form", ["residual 17x9", "stride 2", "phases", "two residuals 8x8"])
def test_compiles_for_sm90a_storing_pixels(form, tmp_path, monkeypatch):
    """Each form compiles for an H100 storing pixels: wgmma with an MMA in flight, TMA loads, no spills."""
    from tests.test_emit_mosaic_conv_ranges import _upsample_conv, assert_compiles_to_one_pipelined_mosaic_kernel

    _skip_without_target()
    fn, args = {
        "residual 17x9": (_gn_silu_conv_residual, (S((2, 17, 9, 192), F16), S((64, 192, 3, 3), F16), S((64,), F16),
                                                   S((192,), F16), S((192,), F16), S((2, 17, 9, 64), F16))),
        "stride 2": (_downsample, (S((2, 32, 32, 320), F16), S((320, 320, 3, 3), F16), S((320,), F16))),
        "phases": (_upsample_conv, (S((2, 8, 8, 320), F16), S((320, 320, 3, 3), F16), S((320,), F16))),
        # 2 x 24 conditional copies: more barriers than one Mosaic barrier group holds (32)
        "two residuals 8x8": (_conv_two_residuals, (S((1, 8, 8, 128), F16), S((128, 128, 3, 3), F16), S((128,), F16),
                                                    S((1, 8, 8, 128), F16), S((1, 8, 8, 128), F16))),
    }[form]
    plan = _plan(fn, args)
    calls = []
    original = ch.build
    with pytest.MonkeyPatch.context() as patch:  # traced here: the conv stores pixels
        patch.setattr(ch, "build", lambda *a, **k: calls.append(k) or original(*a, **k))
        jax.eval_shape(emit.emit(plan, "mosaic", interpret=False), *args)
    assert len(calls) == 1 and calls[0]["view"] is not None
    assert [o.kind for o in calls[0]["operands"]].count("pixel") == (2 if "two" in form else "residual" in form)
    assert_compiles_to_one_pipelined_mosaic_kernel(plan, args, tmp_path, monkeypatch)
