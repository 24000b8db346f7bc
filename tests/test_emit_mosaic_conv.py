"""The Mosaic GPU conv template (`emit/mosaic/conv.py`) in GPU interpret mode: the flat-grid layout
and tap offsets against `lax.conv_general_dilated`, plans of small JAX functions emitted with
`backend="mosaic"` against the XLA emitter and `jax.jit` (3x3 and merged 1x1 shortcut, GroupNorm +
SiLU prologue with 3 channels per group, `concat(h, skip)`, stride 2 on odd sizes, nearest-2x
upsample, NCHW ends, bias / time-embedding / residual epilogues) on 5x7 and 15x15 images with
adversarial values, the Triton fallback, and one compile for sm_90a without a GPU.

GPU interpret mode costs seconds per kernel here: shapes are tiny and the slow cases are marked."""

from __future__ import annotations

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
from emit.mosaic import matmul as mm
from emit.pallas import XlaFallbackWarning
from emit.pallas.conv import ConvGeometry
from eqsat.conv_params import ConvParams
from sd15 import layers
from tests.test_emit_mosaic import compile_mosaic

NHWC_HWIO = ("NHWC", "HWIO", "NHWC")


def _params(x_shape, w_shape, strides, padding, dilation=(1, 1), dn=NHWC_HWIO) -> ConvParams:
    numbers = lax.conv_dimension_numbers(x_shape, w_shape, dn)
    return ConvParams(strides=tuple(strides), padding=tuple(padding), lhs_dilation=(1, 1),
                      rhs_dilation=tuple(dilation), lhs_spec=tuple(numbers.lhs_spec),
                      rhs_spec=tuple(numbers.rhs_spec), out_spec=tuple(numbers.out_spec))


def _template_conv(x, w, params, taps, blocks):
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    grid = mc.FlatGrid(ConvGeometry(params, x.shape, w.shape, out_shape))
    (r,) = mc.plan_taps(grid, [(x.shape[params.lhs_spec[1]], taps)])
    n_padded = -(-w.shape[params.rhs_spec[0]] // blocks.cta_tile_n) * blocks.cta_tile_n
    @jax.jit
    def run(x, w):
        flat = mc.build([mc.layout_input(x, grid, params.lhs_spec, r)],
                        [mc.layout_weights(w, params.rhs_spec, r, n_padded)], [r], grid, out_dtype=jnp.float32,
                        blocks=blocks, interpret=True)
        return mc.unflatten(flat, grid, w.shape[params.rhs_spec[0]])

    return run(x, w)


@pytest.mark.parametrize("shape,window,strides,padding,dilation", [
    ((1, 5, 7, 3), 3, (1, 1), ((1, 1), (1, 1)), (1, 1)),     # 3 channels, no tile divides anything
    ((2, 7, 5, 20), 3, (2, 2), ((1, 1), (1, 1)), (1, 1)),    # stride 2 on odd sizes: four phases
    ((1, 6, 9, 70), 3, (1, 2), ((0, 2), (1, 0)), (2, 1)),    # two channel chunks, dilation, uneven padding
])
def test_the_flat_grid_matches_lax_conv(shape, window, strides, padding, dilation):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float16)
    w = jnp.asarray(0.2 * rng.standard_normal((window, window, shape[-1], 24)), jnp.float16)
    params = _params(x.shape, w.shape, strides, padding, dilation)
    out = _template_conv(x, w, params, ((0, window), (0, window)), mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(mc.reference(x, w, params)), rtol=2e-3, atol=2e-3)


def test_tap_offsets_are_shifts_of_the_flat_grid():
    """Tap (ky, kx) of a stride-2 conv reads phase (ky % 2, kx % 2), the copy shifted by kx // 2
    pixels, at ky // 2 rows of the phase image (its pitch rounded up to 8: TMA fills 8-row tiles)."""
    params = _params((1, 9, 7, 4), (3, 3, 4, 8), (2, 2), ((1, 1), (1, 1)))
    grid = mc.FlatGrid(ConvGeometry(params, (1, 9, 7, 4), (3, 3, 4, 8), (1, 5, 4, 8)))
    assert grid.phase_size == (6, 8) and grid.phases == 4
    assert grid.tap_shift(0, 0) == (0, 0, 0) and grid.tap_shift(2, 1) == (1, 0, 8)
    assert grid.tap_shift(1, 2) == (2, 1, 0) and grid.halo == 8
    ranges = mc.plan_taps(grid, [(4, ((0, 3), (0, 3))), (70, ((1, 2), (1, 2)))])
    assert [(r.first_step, r.column_block, r.steps, r.shifts) for r in ranges] == [(0, 0, 9, (0, 2)), (9, 8, 2, (0, 1))]
    offset = mc.step_offset(grid, ranges)
    rows = [tuple(int(v) for v in offset(jnp.int32(t))) for t in range(11)]
    assert rows[5] == (0, 1 * 4 + 2)  # tap (1, 2): shift 1, phase 2
    assert rows[7] == (8, 0 * 4 + 1)  # tap (2, 1): shift 0, phase 1, one phase row down
    assert rows[9:] == [(0, 8 + 3 * 2), (0, 8 + 3 * 2 + 1)]  # the 1x1 range: phase 3, chunks 0 and 1


# --- plans through backend="mosaic" ------------------------------------------------------------------


def _normal(rng, *shape, scale=1.0, offset=0.0, dtype=jnp.float16):
    return jnp.asarray(offset + rng.normal(size=shape) * scale, dtype)


def _mosaic_xla_jit(fn, args, *, expect_convs: int):
    """(mosaic output, xla output, jit output, plan); no conv may fall back."""
    plan = eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan
    assert sum(k.kind == "conv" for k in plan.kernels) == expect_convs
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        mosaic = emit.emit(plan, "mosaic", interpret=True)(*args)
    return mosaic, emit.emit(plan, "xla")(*args), jax.jit(fn)(*args), plan


def _assert_close(got, *expected, scale=None):
    """fp16 outputs agree to a few ulps of the output's magnitude (summation order differs)."""
    ref = np.asarray(expected[0], np.float32)
    scale = scale if scale is not None else max(1.0, float(np.max(np.abs(ref))))
    for e in expected:
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(e, np.float32) / scale,
                                   atol=4e-3, rtol=0)


def test_conv_bias_residual_on_a_5x7_image():
    rng = np.random.default_rng(1)
    x, w, b, r = (_normal(rng, 2, 5, 7, 3), _normal(rng, 20, 3, 3, 3, scale=0.3), _normal(rng, 20),
                  _normal(rng, 2, 5, 7, 20))

    def fn(x, w, b, r):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x) + r

    _assert_close(*_mosaic_xla_jit(fn, (x, w, b, r), expect_convs=1)[:3])


@pytest.mark.slow
def test_a_resnet_block_groupnorm_silu_prologue_time_row_and_merged_shortcut():
    """sd15's ResnetBlock2D, 6 -> 12 channels in 2 groups (3 and 6 channels per group) on 15x15:
    GroupNorm + SiLU prologues from hosted statistics, the time-embedding row in conv1's epilogue,
    the 1x1 shortcut merged into conv2 as a K range over its centre tap."""
    rng = np.random.default_rng(4)
    names = [("norm1.weight", (6,)), ("norm1.bias", (6,)), ("conv1.weight", (12, 6, 3, 3)), ("conv1.bias", (12,)),
             ("time_emb_proj.weight", (12, 8)), ("time_emb_proj.bias", (12,)), ("norm2.weight", (12,)),
             ("norm2.bias", (12,)), ("conv2.weight", (12, 12, 3, 3)), ("conv2.bias", (12,)),
             ("conv_shortcut.weight", (12, 6, 1, 1)), ("conv_shortcut.bias", (12,))]
    params = {f"r.{n}": _normal(rng, *s, scale=0.3) for n, s in names}
    x = _normal(rng, 1, 15, 15, 6, offset=40.0)  # an offset large against the spread
    x = x.at[0, 3].set(40.0)  # a constant row
    temb = _normal(rng, 1, 8)

    def block(p, x, temb):
        return layers.resnet_block(p, "r", x, temb, 2, 1e-5)

    mosaic, xla, jitted, plan = _mosaic_xla_jit(block, (params, x, temb), expect_convs=2)
    conv2 = [k for k in plan.kernels if k.kind == "conv"][1]
    assert any(part.taps == ((1, 2), (1, 2)) for part in mc.k_ranges(conv2.term))
    _assert_close(mosaic, xla, jitted)


def test_a_conv_over_a_skip_concat():
    """concat(h, skip) as two K ranges (Cin 6 + 3 -> 5) on a 5x7 image."""
    rng = np.random.default_rng(7)
    h, s = _normal(rng, 2, 5, 7, 6), _normal(rng, 2, 5, 7, 3)
    w, b = _normal(rng, 5, 9, 3, 3, scale=0.3), _normal(rng, 5)

    def fn(h, s, w, b):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", jnp.concatenate([h, s], -1))

    mosaic, xla, jitted, plan = _mosaic_xla_jit(fn, (h, s, w, b), expect_convs=1)
    assert len(mc.k_ranges(plan.kernels[0].term)) == 2
    _assert_close(mosaic, xla, jitted)


def test_a_stride_2_downsampler_on_an_odd_image():
    """Stride 2 on 5x7 (padding 1): four phases of 4x5, a 3x4 output."""
    rng = np.random.default_rng(8)
    x, w, b = _normal(rng, 2, 5, 7, 6), _normal(rng, 6, 6, 3, 3, scale=0.3), _normal(rng, 6)

    def down(x, w, b):
        return layers.downsample({"d.conv.weight": w, "d.conv.bias": b}, "d", x)

    mosaic, xla, jitted, _ = _mosaic_xla_jit(down, (x, w, b), expect_convs=1)
    assert mosaic.shape == (2, 3, 4, 6)
    _assert_close(mosaic, xla, jitted)


def test_upsample_and_nchw_ends():
    """conv_in reads an NCHW latent through a permute, an upsampler conv reads y // 2, conv_out
    writes NCHW."""
    rng = np.random.default_rng(9)
    args = (_normal(rng, 1, 4, 5, 3), _normal(rng, 6, 4, 3, 3, scale=0.3), _normal(rng, 6),
            _normal(rng, 6, 6, 3, 3, scale=0.3), _normal(rng, 6), _normal(rng, 4, 6, 3, 3, scale=0.3), _normal(rng, 4))

    def ends(x, w_in, b_in, w_up, b_up, w_out, b_out):
        p = {"conv_in.weight": w_in, "conv_in.bias": b_in, "up.conv.weight": w_up, "up.conv.bias": b_up,
             "conv_out.weight": w_out, "conv_out.bias": b_out}
        h = layers.conv2d(p, "conv_in", x.transpose(0, 2, 3, 1))
        h = layers.upsample(p, "up", h)
        return layers.conv2d(p, "conv_out", layers.silu(h)).transpose(0, 3, 1, 2)

    mosaic, xla, jitted, _ = _mosaic_xla_jit(ends, args, expect_convs=3)
    assert mosaic.shape == (1, 4, 10, 6)  # a 5x3 image, upsampled to 10x6
    _assert_close(mosaic, xla, jitted)


def _f16_adversarial(draw, shape, scales=(1.0, 1e-3, 3e2, 0.0), offsets=(0.0, 1.0, -300.0, 2e3)):
    offset, scale = draw(st.sampled_from(offsets)), draw(st.sampled_from(scales))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = offset + scale * rng.standard_normal(shape)
    if len(shape) == 4 and draw(st.booleans()):
        x[:, rng.integers(0, shape[1])] = offset  # a constant image row
    return x.astype(np.float16)


def _groupnorm_silu_conv(x, gamma, beta, w, b):
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, 3, 1e-5)))


_RUNS: dict = {}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_groupnorm_silu_conv_matches_xla_and_jit_on_adversarial_values(data):
    """GroupNorm (3 groups of 3 channels) + SiLU -> 3x3 conv (9 -> 20 channels) on a 5x7 image, fp16:
    offsets large against the spread, tiny and large scales, constant rows, zeros."""
    x = _f16_adversarial(data.draw, (1, 5, 7, 9))
    gamma = _f16_adversarial(data.draw, (9,), scales=(1.0,), offsets=(0.0, 1.0))
    beta = _f16_adversarial(data.draw, (9,), scales=(1.0,), offsets=(0.0, -2.0))
    w = _f16_adversarial(data.draw, (20, 9, 3, 3), scales=(0.3, 0.0), offsets=(0.0,))
    b = _f16_adversarial(data.draw, (20,), scales=(1.0,), offsets=(0.0, 5.0))
    args = (x, gamma, beta, w, b)
    if "plan" not in _RUNS:
        plan = eqsat.optimize(_groupnorm_silu_conv, extractor="greedy", progress=False).lower(*args).plan
        _RUNS["plan"] = (emit.emit(plan, "mosaic", interpret=True), emit.emit(plan, "xla"))
    mosaic, xla = _RUNS["plan"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        out = mosaic(*args)
    # |silu(groupnorm)| <= |gamma| * sqrt(group size) + |beta| + ..., times the weights' row sums
    act = np.abs(gamma.astype(np.float32)) * 3.0 + np.abs(beta.astype(np.float32))
    bound = float(np.max(np.abs(w.astype(np.float32)).sum(axis=(2, 3)) @ act)) + float(np.max(np.abs(b))) + 1.0
    _assert_close(out, xla(*args), jax.jit(_groupnorm_silu_conv)(*args), scale=bound)


def test_a_float32_conv_runs_through_the_triton_template_with_a_warning():
    rng = np.random.default_rng(2)
    x, w, b = _normal(rng, 1, 5, 7, 3, dtype=jnp.float32), _normal(rng, 4, 3, 3, 3, dtype=jnp.float32), \
        _normal(rng, 4, dtype=jnp.float32)

    def fn(x, w, b):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x)

    plan = eqsat.optimize(fn, extractor="greedy", progress=False).lower(x, w, b).plan
    with pytest.warns(TritonFallbackWarning, match="float32"):
        out = emit.emit(plan, "mosaic", interpret=True)(x, w, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(fn)(x, w, b)), rtol=1e-4, atol=1e-4)


def test_emit_pallas_does_not_import_emit_mosaic():
    """The import arrows point one way: `emit.pallas` asks `emit.backends`, never `emit.mosaic`."""
    import subprocess
    import sys

    code = "import sys, emit.pallas, emit.pallas.conv; print('emit.mosaic' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --- compiled for an H100 without a GPU ----------------------------------------------------------


def _conv_bias(x, w, b):
    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x)


@pytest.mark.slow
def test_compiles_for_sm90a_with_pipelined_wgmma_and_tma(tmp_path, monkeypatch):
    """A 3x3 conv + bias at a 16x16x128 -> 128 shape, fp16, `backend="mosaic"`: one Mosaic GPU
    kernel whose PTX issues wgmma with a wait depth of 1, TMA copies in and out, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (jax.ShapeDtypeStruct((2, 16, 16, 128), jnp.float16), jax.ShapeDtypeStruct((128, 128, 3, 3), jnp.float16),
            jax.ShapeDtypeStruct((128,), jnp.float16))
    plan = eqsat.optimize(_conv_bias, progress=False).lower(*args).plan
    assert [k.kind for k in plan.kernels] == ["conv"]
    report, ptx_path, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    assert counts.tensor_core == "wgmma" and counts.wgmma_wait_depth >= 1, counts
    assert counts.tma_loads >= 2, counts
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx_path.read_text()), "no TMA store"
    assert resources.spill_bytes == 0, resources
