"""The conv template's flat tiles (`ConvConfig(flat=True)`: one dot over `block_m` consecutive
pixels of an image, several of its rows) in interpret mode, and the cost model's choice between
flat and row tiles.

Flat tiles of 32 pixels on 15-, 7- and 5-wide images start and end mid-row, so every tile
gathers its input across row boundaries and from the padding. Checked against `conv.reference`
(`lax.conv`), the reference interpreter, the XLA emitter and `jax.jit`, with NaN, offset and
huge values; the prologue evaluations counted in the running kernel equal the cost model's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat.cost import mma
from jax import lax

from emit.pallas import conv
from eqsat.conv_params import ConvParams
from eqsat.cost import roofline, work
from eqsat.interpret import evaluate
from eqsat.tiling.conv import prologue_evaluations, single_tap
from eqsat.term import Term
from eqsat.types import format_type, parse_type
from sd15 import layers
from test_emit_conv import (LAYOUTS, NHWC_HWIO, _close, _conv_term, _emit_and_compare, _group_stats, _input, _load,
                            _normal, _operand_shapes, _params, _resnet_params, _run_both)

FLAT = conv.ConvConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2, flat=True)


@pytest.fixture
def flat_tiles(monkeypatch):
    """Every conv planned and emitted inside runs on `FLAT` tiles (block_k from its K ranges)."""
    def flat(geometry, ranges=(), itemsize=2):
        widest = max((r.channels for r in ranges), default=geometry.in_features)
        return dataclasses.replace(FLAT, block_k=16 if widest <= 16 else 32)

    monkeypatch.setattr(mma, "conv_config", flat)
    return monkeypatch


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("size,window,strides,padding", [
    ((15, 15), (3, 3), (1, 1), ((1, 1), (1, 1))),
    ((15, 15), (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((7, 5), (1, 1), (1, 1), ((0, 0), (0, 0))),
    ((7, 5), (3, 1), (2, 1), ((0, 2), (0, 0))),   # asymmetric window and padding, stride in one axis
], ids=["15x15-3x3", "15x15-stride2", "7x5-1x1", "7x5-3x1-asym"])
def test_flat_tiles_follow_the_dimension_numbers(layouts, size, window, strides, padding):
    lhs_shape, rhs_shape = _operand_shapes(layouts, 2, *size, 6, 20, window)
    x, w = _input("x", lhs_shape), _input("w", rhs_shape)
    params = _params(lhs_shape, rhs_shape, layouts, strides, padding)
    term = _conv_term(_load(x), _load(w), params)
    rng = np.random.default_rng(20)
    env = {"x": rng.normal(size=lhs_shape).astype(np.float32), "w": rng.normal(size=rhs_shape).astype(np.float32)}
    env["x"].flat[29] = np.nan  # propagates to the outputs whose window covers it, as in lax
    out, expected = _run_both(term, env, FLAT)
    assert np.isnan(np.asarray(expected)).any()
    _close(out, expected)
    _close(out, conv.reference(env["x"], env["w"], params))


def test_flat_tiles_in_half_precision_with_huge_and_offset_inputs():
    """fp16 operands 1e4 off their spread and a huge weight row: the dot accumulates in fp32."""
    rng = np.random.default_rng(21)
    x = (1e3 + rng.normal(size=(1, 7, 7, 24))).astype(np.float16)
    w = (rng.normal(size=(3, 3, 24, 18)) * 1e-3).astype(np.float16)
    w[..., 5] = 30.0
    params = _params(x.shape, w.shape, NHWC_HWIO, (1, 1), ((1, 1), (1, 1)))
    xt, wt = _input("x", x.shape, "float16"), _input("w", w.shape, "float16")
    term = _conv_term(_load(xt), _load(wt), params)
    out = conv.run(term, {xt: x, wt: w}, config=FLAT, interpret=True)
    expected = conv.reference(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), params)
    scale = float(jnp.max(jnp.abs(expected)))
    _close(out / scale, expected / scale, jnp.float16)


@pytest.mark.parametrize("values", ["offset", "constant-groups", "huge"])
def test_groupnorm_moments_of_flat_tiles(values):
    """48 channels in 16 groups of 3 on 2 images of 5x5 (32-pixel tiles end mid-row; one tile per
    image ends 7 pixels in): the merged per-tile (count, mean, M2) equal the two-pass moments."""
    rng = np.random.default_rng(22)
    shape = (2, 5, 5, 48)
    x = {"offset": 1e4 + rng.normal(size=shape),
         "constant-groups": np.repeat(rng.normal(size=(2, 1, 1, 16, 1)) * 100, 3, axis=4)
         .repeat(5, axis=1).repeat(5, axis=2).reshape(shape),
         "huge": 1e18 * (3 + rng.normal(size=shape))}[values].astype(np.float32)
    xt, wt = _input("x", shape), _input("w", (48, 48, 1, 1))
    term = _conv_term(_load(xt), _load(wt), _params(shape, (48, 48, 1, 1), LAYOUTS[0], (1, 1), ((0, 0), (0, 0))))
    stats = _group_stats(term, 16)
    env = {"x": x, "w": np.eye(48, dtype=np.float32).reshape(48, 48, 1, 1)}
    out, partials = conv.run(term, {xt: x, wt: env["w"]}, hosted=[stats], config=FLAT, interpret=True)
    assert partials[stats].shape[0] == 2 * 1 * 3  # 2 images x 1 flat tile x 3 channel tiles
    merged = np.asarray(conv.merge_partials(partials[stats], "moments")).reshape(2, 2, 16)
    (expected,) = evaluate([stats], env)
    expected = np.asarray(expected)
    np.testing.assert_allclose(merged[0], expected[0], rtol=1e-5, atol=1e-6 * 48 * float(np.abs(x).max()))
    spread = expected[1]
    noise = 75 * (8 * np.finfo(np.float32).eps * float(np.abs(x).max())) ** 2
    rtol = 2e-3 if values == "offset" else 1e-4
    np.testing.assert_allclose(merged[1], spread, rtol=rtol, atol=max(noise, 1e-6 * float(np.abs(spread).max())))
    _close(out, x)


def test_hosted_sums_of_a_strided_flat_conv():
    rng = np.random.default_rng(23)
    x, w = rng.normal(size=(2, 7, 7, 6)).astype(np.float32), (rng.normal(size=(9, 6, 3, 3)) * 0.3).astype(np.float32)
    xt, wt = _input("x", x.shape), _input("w", w.shape)
    term = _conv_term(_load(xt), _load(wt), _params(x.shape, w.shape, LAYOUTS[0], (2, 2), ((1, 1), (1, 1))))
    b, h, ww, c = parse_type(term.ty).shape
    body = Term("Reshape", _load(term), format_type("float32", (b, h * ww, 3, 3)))
    stats = Term("EpilogueReduce", term, "sum", body, "1,3", format_type("float32", (b, 3)))
    out, partials = conv.run(term, {xt: x, wt: w}, hosted=[stats], config=dataclasses.replace(FLAT, block_m=16),
                             interpret=True)
    expected_out, expected = evaluate([term, stats], {"x": x, "w": w})
    _close(out, expected_out)
    np.testing.assert_allclose(np.asarray(conv.merge_partials(partials[stats], "sum")).reshape(b, 3),
                               np.asarray(expected), rtol=1e-5, atol=1e-4)


# --- plans on flat tiles, against the XLA emitter and jax.jit --------------------------------------------


def test_a_resnet_block_on_flat_tiles(flat_tiles):
    """ResnetBlock2D at 7x7, 6 -> 12 channels in 2 groups (3 and 6 channels per group): GroupNorm +
    SiLU prologues (their per-(batch, channel) part hoisted), the time-embedding row, norm2's
    statistics from conv1's flat tiles, the 1x1 shortcut merged into conv2 as a one-tap K range."""
    rng = np.random.default_rng(24)
    params = _resnet_params(rng, 6, 12, 8, jnp.float32)
    x = _normal(rng, 2, 7, 7, 6) + 3.0
    temb = _normal(rng, 2, 8)

    def block(p, x, temb):
        return layers.resnet_block(p, "r", x, temb, 2, 1e-5)

    plan = _emit_and_compare(block, (params, x, temb), expect_convs=2, monkeypatch=flat_tiles)
    conv1, conv2 = [k for k in plan.kernels if k.kind == "conv"]
    assert len(conv1.outputs) == 2
    assert ((1, 2), (1, 2)) in [part.taps for part in conv.k_ranges(conv2.term)]


def test_a_conv_over_a_skip_concat_on_flat_tiles(flat_tiles):
    rng = np.random.default_rng(25)
    h, s = _normal(rng, 2, 5, 7, 6), _normal(rng, 2, 5, 7, 3) * 1e3
    w, b = _normal(rng, 5, 9, 3, 3, scale=0.3), _normal(rng, 5)

    def cat(h, s, w, b):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", jnp.concatenate([h, s], -1))

    plan = _emit_and_compare(cat, (h, s, w, b), expect_convs=1)
    assert len(conv.k_ranges(plan.kernels[0].term)) == 2


def test_a_stride_2_downsampler_on_flat_tiles(flat_tiles):
    rng = np.random.default_rng(26)
    x, w, b = _normal(rng, 2, 15, 15, 5), _normal(rng, 5, 5, 3, 3, scale=0.3), _normal(rng, 5)

    def down(x, w, b):
        return layers.downsample({"d.conv.weight": w, "d.conv.bias": b}, "d", x)

    _emit_and_compare(down, (x, w, b), expect_convs=1)


# --- the cost model charges what the tiles evaluate ------------------------------------------------------


def _counted_evaluations(term, config, values):
    """Per K range, the input expression's evaluations per input element as the running kernel
    makes them: each call of a range's `lhs` closure at runtime (a debug callback: once per grid
    step, chunk and tap) evaluates pixels x block_k channels."""
    counts: list[list[int]] = []

    def counting(fn, count):
        def evaluate_counted(refs, index, mask, **kwargs):
            pixels = mask.shape[0]
            jax.debug.callback(lambda: count.append(pixels))
            return fn(refs, index, mask, **kwargs)
        return evaluate_counted

    build = conv.build

    def counted_build(geometry, ranges, *args, **kwargs):
        counted = []
        for k_range in ranges:
            counts.append([])
            counted.append(dataclasses.replace(k_range, lhs=counting(k_range.lhs, counts[-1])))
        return build(geometry, counted, *args, **kwargs)

    conv.build = counted_build
    try:
        jax.block_until_ready(conv.run(term, values, config=config, interpret=True))
    finally:
        conv.build = build
    return counts


@pytest.mark.parametrize("config", [FLAT, dataclasses.replace(FLAT, flat=False, block_m=64),
                                    None], ids=["flat", "row", "default"])
def test_the_model_counts_the_evaluations_the_tiles_make(config):
    """A 3x3 conv over concat(x, skip) with a merged 1x1 shortcut on the skip (a one-tap range) on
    a 7x7 image, 16-channel ranges: the evaluations the kernel makes per input element equal
    `eqsat.tiling.conv.prologue_evaluations` of its config, and with the default config (the
    model's choice) what the roofline and extraction charge (`conv_prologue_evaluations`)."""
    lhs_shape = (2, 7, 7, 32)
    x, skip = _input("x", (2, 7, 7, 16)), _input("skip", (2, 7, 7, 16))
    lhs = Term("Concat", _load(x), _load(skip), 3, 16, format_type("float32", lhs_shape))
    w3, w1 = _input("w3", (20, 16, 3, 3)), _input("w1", (20, 16, 1, 1))
    padded = Term("Pad", _load(w1), Term("Lit", 0.0, "f32[]"), "0,0,0;0,0,0;1,1,0;1,1,0", "f32[20,16,3,3]")
    rhs = Term("Concat", _load(w3), padded, 1, 16, "f32[20,32,3,3]")
    params = _params(lhs_shape, (20, 32, 3, 3), LAYOUTS[0], (1, 1), ((1, 1), (1, 1)))
    term = _conv_term(lhs, rhs, params)
    rng = np.random.default_rng(27)
    values = {t: rng.normal(size=parse_type(t.ty).shape).astype(np.float32) for t in (x, skip, w3, w1)}
    counts = _counted_evaluations(term, config, values)
    geometry = conv.ConvGeometry(params, lhs_shape, (20, 32, 3, 3), parse_type(term.ty).shape)
    used = config or mma.conv_config(geometry, [conv.KRange(16, None, None)] * 2)
    inputs = 2 * 7 * 7 * 16
    per_element = [sum(count) * used.block_k / inputs for count in counts]  # 16 channels: one chunk
    # Both ranges are plain loads: a row tile loads them per output row and tap (`direct`).
    assert per_element == pytest.approx([prologue_evaluations(geometry, used, direct=True),
                                         prologue_evaluations(geometry, used, (1, 1), direct=True)])
    if config is None:
        assert used.flat  # where the roofline's count (a computed input's) is the direct one too
        assert per_element == pytest.approx([roofline.conv_prologue_evaluations(lhs.ty, rhs.ty, params.key, term.ty),
                                             roofline.conv_prologue_evaluations(lhs.ty, rhs.ty, params.key, term.ty, 1)])
        images_tiles = conv._grid(geometry, used)[0]
        assert roofline.ConvPrograms.of(lhs.ty, rhs.ty, params.key, term.ty).tiles * 2 == images_tiles


def _geometry(batch, channels, size, cout, window=3, stride=1):
    lhs, rhs = (batch, size, size, channels), (window, window, channels, cout)
    pad = window // 2
    params = ConvParams.from_lax((stride, stride), ((pad, pad), (pad, pad)), (1, 1), (1, 1),
                                 lax.conv_dimension_numbers(lhs, rhs, NHWC_HWIO))
    out = (size + 2 * pad - window) // stride + 1
    return conv.ConvGeometry(params, lhs, rhs, (batch, out, out, cout))


@pytest.mark.parametrize("batch,channels,size,cout,window,stride,flat", [
    (2, 320, 64, 320, 3, 1, False),   # UNet 64x64: 2 x 64 row tiles (wgmma), 3 x 2 evaluations per element
    (2, 640, 32, 640, 3, 1, True),    # 32x32: 4 x 32 row tiles would multiply with mma.sync on 80 CTAs
    (2, 1280, 16, 1280, 3, 1, True),
    (2, 1280, 8, 1280, 3, 1, True),   # 8x8: row tiles pad 8 columns to 16
    (2, 2560, 8, 1280, 1, 1, True),   # a 1x1 shortcut: flat tiles recompute nothing more
    (1, 128, 512, 128, 3, 1, False),  # VAE 512x512
    (2, 320, 64, 320, 1, 1, True),    # a 1x1 conv at 64x64: row and flat tiles tie; one accumulator wins
    (2, 4, 64, 320, 3, 1, True),      # conv_in: 4 input channels, the row tile 0.7 % cheaper: a tie
], ids=["unet-64", "unet-32", "unet-16", "unet-8", "unet-8-1x1", "vae-512", "unet-64-1x1", "unet-conv-in"])
def test_the_model_chooses_flat_tiles_where_row_tiles_miss_wgmma(batch, channels, size, cout, window, stride, flat):
    """The default config is the cheapest candidate by `conv_tile_seconds`: flat tiles (wgmma, at
    most 9 evaluations per element and Cout tile) on the low-resolution convs, row tiles where the
    image is 64 or more wide (the same MMA, fewer evaluations)."""
    geometry = _geometry(batch, channels, size, cout, window, stride)
    config = mma.conv_config(geometry)
    assert config.flat == flat
    assert work.conv_tile_seconds(geometry, config) <= (1 + mma.TILE_PRICE_TOLERANCE) * min(
        work.conv_tile_seconds(geometry, c) for c in conv.ConvConfig.candidates(geometry))
    dots, m = config.tile(geometry)
    assert m >= 64  # every one of these has >= 64 output pixels per image: wgmma


def test_operands_that_read_zero_outside_their_mask_skip_the_select():
    """`zero_where_masked`: a masked load through views and converts reads 0 at masked lanes (the
    flat tile then feeds it to the dot as loaded); a pad's border, arithmetic or a statistic do not."""
    x = Term("Input", "x", "f16[2,4,6]")
    load = Term("Load", x, x.ty)
    assert conv.zero_where_masked(load)
    assert conv.zero_where_masked(Term("Transpose", Term("Reshape", load, "f16[8,6]"), "1,0", "f16[6,8]"))
    assert conv.zero_where_masked(Term("Unary", "convert", Term("Slice", load, 2, 0, 4, 1, "f16[2,4,4]"), "f32[2,4,4]"))
    pad = Term("Pad", load, Term("Lit", 1.0, "f16[]"), "0,0,0;0,0,0;1,1,0", "f16[2,4,8]")
    assert not conv.zero_where_masked(pad)
    assert not conv.zero_where_masked(Term("Unary", "exp", load, load.ty))


def test_a_flat_conv_of_a_plain_input_pipelines_its_wgmma(tmp_path):
    """A 3x3 conv on a 32x32 image (flat tiles: one dot per tap) whose input and weight are plain
    loads, fp16, compiled for sm_90a: its wgmma waits with a group in flight (`wgmma.wait_group 1`:
    loads overlap the MMA), every global load moves >= 8 bytes, nothing spills. Through the zero
    select (`_zero_padded` without `zero_masked`) the same kernel waits for 0."""
    import re

    from measure import xla_target

    if xla_target.unavailable_reason() is not None:
        pytest.skip(str(xla_target.unavailable_reason()))
    geometry = _geometry(1, 64, 32, 64)
    assert mma.conv_config(geometry).flat
    text, counts, resources = _compiled_plain_conv(geometry, tmp_path)
    assert counts.wgmma and counts.wgmma_wait_depth >= 1, re.findall(r"wgmma.wait_group.sync.aligned \d+", text)
    assert counts.vector_load_bytes == counts.global_load_bytes, counts
    assert resources.spill_bytes == 0, resources


def test_a_row_tile_of_a_plain_input_pipelines_its_wgmma(tmp_path):
    """A 3x3 conv on a 64x64 image on row tiles of 2 x 64 pixels (the model's choice there), input
    and weight plain loads, fp16, compiled for sm_90a: the direct loop (one dot per row and tap)
    keeps a wgmma group per row in flight (`wgmma.wait_group 2`), loads only vectors, does not
    spill. Its computed-input loop (each row reused by the row taps) waited for 0 at 255 registers."""
    import re

    from measure import xla_target

    if xla_target.unavailable_reason() is not None:
        pytest.skip(str(xla_target.unavailable_reason()))
    geometry = _geometry(2, 320, 64, 320)
    config = mma.conv_config(geometry)
    assert not config.flat and config.tile(geometry) == (2, 64)
    text, counts, resources = _compiled_plain_conv(geometry, tmp_path)
    assert counts.wgmma and counts.wgmma_wait_depth >= 2, re.findall(r"wgmma.wait_group.sync.aligned \d+", text)
    assert counts.vector_load_bytes == counts.global_load_bytes, counts
    assert resources.spill_bytes == 0, resources


def _compiled_plain_conv(geometry, tmp_path):
    """A conv of plain fp16 loads (`geometry`) compiled for sm_90a: its PTX text, `benchmarks.ptx`
    counts and ptxas resources."""
    from benchmarks import ptx
    from measure import xla_target

    x, w = (Term("Input", name, format_type("float16", shape))
            for name, shape in (("x", geometry.lhs_shape), ("w", geometry.rhs_shape)))
    term = _conv_term(Term("Load", x, x.ty), Term("Load", w, w.ty), geometry.params, "float16")

    def fn(x_value, w_value):
        return conv.run(term, {x: x_value, w: w_value}, interpret=False)

    specs = [jax.ShapeDtypeStruct(shape, jnp.float16) for shape in (geometry.lhs_shape, geometry.rhs_shape)]
    xla_target.compile_for_h100(fn, *specs, keep_dump=tmp_path / "dump")
    [path] = [p for p in (tmp_path / "dump").glob("*.ptx") if ".entry" in p.read_text()]
    text = path.read_text()
    [counts] = ptx.read_ptx(text).values()
    [resources] = ptx.run_ptxas(path).values()
    return text, counts, resources


def test_pipeline_stages_follow_the_windowed_k_ranges():
    """2 stages where at most one K range runs a multi-tap window (a 3x3 conv, with merged 1x1
    shortcut or skip ranges), 1 where two do (they asked for 225 KB of shared memory and spilled);
    the cost model, which knows a range by its tap count, reads the same config."""
    geometry = _geometry(1, 384, 64, 128)
    full, centre = None, single_tap(geometry)
    assert centre == ((1, 2), (1, 2))
    stages = lambda taps: mma.conv_config(geometry, [conv.KRange(c, None, None, t) for c, t in taps]).num_stages
    assert stages([(384, full)]) == 2
    assert stages([(256, centre), (128, full)]) == 2
    assert stages([(128, centre), (128, centre), (128, full)]) == 2
    assert stages([(4, full), (380, full)]) == 1
    # A direct range (plain input and weight: one row per dot) does not count; two computed ones do.
    direct = lambda c, t: conv.KRange(c, None, None, t, lhs_zero_masked=True, rhs_zero_masked=True)
    computed = lambda c, t: conv.KRange(c, None, None, t, rhs_zero_masked=True)
    config = lambda ranges: mma.conv_config(geometry, ranges)
    assert config([computed(4, full), direct(380, full)]).num_stages == 2
    assert config([direct(4, full), direct(380, full)]).num_stages == 2
    assert config([computed(4, full), computed(380, full)]).num_stages == 1
    assert config([computed(4, full), direct(380, full)]).tile(geometry) == config([]).tile(geometry)
    assert work._conv_config_of(f"f16{list(geometry.lhs_shape)}".replace(" ", ""),
                                f"f16{list(geometry.rhs_shape)}".replace(" ", ""), geometry.params.key,
                                f"f16{list(geometry.out_shape)}".replace(" ", ""),
                                [(256, 1), (128, 9)])[0].num_stages == 2
