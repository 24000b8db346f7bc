"""The haloed Mosaic GPU conv over several K ranges and over a nearest-2x upsample (`emit/mosaic/conv_halo.py`), in GPU interpret mode:
each range its own staged tensor, channel offset, window and prologue (a concat under a GroupNorm
cut per tensor by `eqsat.tiling.channel_parts`, a 1x1 shortcut merged with a 3x3 conv), against
`lax.conv_general_dilated`, the XLA emitter and `jax.jit` on 15x15 images with 3 channels per
group and adversarial values; the cut itself against slicing the whole expression (also a concat
inside a group: cut after `distribute_reshapes`); one compile for sm_90a without a GPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import emit
import eqsat
from emit.expr import evaluate_whole, expr_nodes
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.pallas.conv import ConvGeometry, k_ranges
from eqsat.tiling.channel_parts import NotRestrictable, channel_parts, concat_splits
from eqsat.tiling.mosaic import HaloGrid, halo_blocks, halo_parts
from eqsat.types import parse_type
from sd15 import layers
from tests.test_emit_mosaic import compile_mosaic
from tests.test_emit_mosaic_conv_halo import _adversarial_input, _assert_close, _bound, _params, run_recording_builds


def _gn_silu_concat_conv(h, skip, gamma, beta, w, b):
    """An up-block resnet's conv1: GroupNorm (3 channels per group) + SiLU over concat(h, skip), 3x3."""
    x = jnp.concatenate([h, skip], axis=-1)
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5)))


def _conv_and_shortcut(x, h, gamma, beta, w, b, ws, bs):
    """A resnet's conv2 over GroupNorm + SiLU of h plus the 1x1 shortcut of x (one conv, two K ranges)."""
    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b, "s.weight": ws, "s.bias": bs}
    return layers.conv2d(p, "s", x) + layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", h, h.shape[-1] // 3,
                                                                                            1e-5)))


def _plan(fn, args):
    return eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan


def _run_haloed(plan, args, inputs):
    """The plan on the Mosaic backend; its conv must be the haloed kernel staging `inputs` (shapes)."""
    out, calls = run_recording_builds(emit.emit(plan, "mosaic", interpret=True), args)
    assert calls == [inputs], calls
    return out


def assert_haloed_matches_xla_and_jit(plan, fn, args, inputs, scale):
    """The plan's haloed conv (staging `inputs`) against the XLA emitter and `jax.jit(fn)`: NaN exactly
    where jit has NaN, elsewhere within `_assert_close`'s bound for values of `scale`."""
    out = np.asarray(_run_haloed(plan, args, inputs), np.float32)
    expected = np.asarray(emit.emit(plan, "xla")(*args), np.float32)
    jitted = np.asarray(jax.jit(fn)(*args), np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(jitted))
    finite = ~np.isnan(jitted)
    _assert_close(np.where(finite, out, 0), np.where(finite, expected, 0), np.where(finite, jitted, 0), scale=scale)


def assert_compiles_to_one_pipelined_mosaic_kernel(plan, args, path, monkeypatch):
    """The plan compiled for an H100 (deviceless): one Mosaic GPU kernel, wgmma with an MMA in flight,
    TMA loads, no spills; `compile_mosaic`'s (report, ptx path, counts, resources)."""
    report, ptx_path, counts, resources = compile_mosaic(plan, args, path, monkeypatch)
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    assert counts.tensor_core == "wgmma" and counts.wgmma_wait_depth >= 1, counts
    assert counts.tma_loads >= 4, counts
    assert resources.spill_bytes == 0, resources
    return report, ptx_path, counts, resources


# --- the kernel on its own ---------------------------------------------------------------------------


def test_two_ranges_one_from_a_channel_offset_one_over_the_centre_tap():
    """Range 0: channels 64..127 of a 128-channel tensor, 3x3; range 1: a 64-channel tensor over
    the centre tap only (a merged 1x1 shortcut): their sum, against two `lax` convs."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((1, 15, 15, 128)), jnp.float16)
    b = jnp.asarray(rng.standard_normal((1, 15, 15, 64)), jnp.float16)
    w3 = jnp.asarray(0.1 * rng.standard_normal((3, 3, 64, 72)), jnp.float16)
    w1 = jnp.asarray(0.1 * rng.standard_normal((1, 1, 64, 72)), jnp.float16)
    params = _params((1, 15, 15, 64), w3.shape, ((1, 1), (1, 1)))
    out_shape = (1, 15, 15, 72)
    geometry = ConvGeometry(params, (1, 15, 15, 128), (3, 3, 128, 72), out_shape)
    grid_of = functools.partial(HaloGrid, geometry)
    blocks = halo_blocks(grid_of, grid_of(128).out_rows, 72, batch=1)
    grid = grid_of(blocks.tile_m)
    n_padded = -(-72 // blocks.tile_n) * blocks.tile_n
    parts = ch.plan_parts([(64, ((0, 3), (0, 3)), 64, ()), (64, ((1, 2), (1, 2)), 0, ())])
    assert [(p.first_chunk, p.first_step, p.steps, p.weight_channel) for p in parts] == [(0, 0, 9, 0), (1, 9, 1, 64)]

    @jax.jit
    def run(a, b, w3, w1):  # the conv's weight over [a's 64, b's 64] channels: b's only at the centre tap
        w = jnp.concatenate([w3, jnp.pad(w1, ((1, 1), (1, 1), (0, 0), (0, 0)))], axis=2)
        flat = ch.build([a, b], ch.layout_weight(w, params.rhs_spec, n_padded), grid, blocks, parts=parts,
                        out_dtype=jnp.float32, interpret=True)
        return ch.unflatten(flat, grid, 72)

    one = _params((1, 15, 15, 64), w1.shape, ((0, 0), (0, 0)))
    expected = mc.reference(a[..., 64:], w3, params) + mc.reference(b, w1, one)
    np.testing.assert_allclose(np.asarray(run(a, b, w3, w1)), np.asarray(expected), rtol=2e-3, atol=2e-3)


def test_a_range_must_be_whole_chunks():
    with pytest.raises(ch.HaloUncovered, match="32 channels"):
        ch.plan_parts([(64, ((0, 3), (0, 3)), 0, ()), (32, ((1, 2), (1, 2)), 0, ())])


# --- the cut per tensor ------------------------------------------------------------------------------


def _conv_lhs(fn, args):
    (conv,) = [k for k in _plan(fn, args).kernels if k.op == "Conv"]
    return conv.term


def _values(expr, rng):
    return {n.args[0]: jnp.asarray(rng.standard_normal(parse_type(n.args[0].ty).shape) + 3.0,
                                   parse_type(n.args[0].ty).dtype)
            for n in expr_nodes(expr) if n.op == "Load"}


S, F16 = jax.ShapeDtypeStruct, jnp.float16
CONCAT_ARGS = (S((1, 15, 15, 192), F16), S((1, 15, 15, 192), F16), S((384,), F16), S((384,), F16),
               S((16, 384, 3, 3), F16), S((16,), F16))


def test_the_cut_of_a_groupnorm_over_a_concat_is_a_slice_of_the_whole():
    """silu(GroupNorm(concat(h, skip))) cut at the concat: each part reads one tensor (no `Concat`
    left), and evaluates to the whole expression's channels; arbitrary sub-ranges too."""
    term = _conv_lhs(_gn_silu_concat_conv, CONCAT_ARGS)
    lhs = term.args[0]
    assert concat_splits(lhs, 3) == {192}
    values = _values(lhs, np.random.default_rng(0))
    whole = np.asarray(evaluate_whole(lhs, values), np.float32)
    parts = channel_parts(lhs, 3, 0, 384)
    assert [(a, b) for _e, a, b in parts] == [(0, 192), (192, 384)]
    for expr, a, b in parts + channel_parts(lhs, 3, 96, 288):
        assert "Concat" not in {n.op for n in expr_nodes(expr)}
        np.testing.assert_array_equal(np.asarray(evaluate_whole(expr, values), np.float32), whole[..., a:b])
    assert [(r, o, c) for _e, r, o, c, _t in halo_parts([(lhs, 0, 384, ((0, 3), (0, 3)))])] == [(0, 0, 192),
                                                                                                 (0, 192, 192)]


INSIDE_ARGS = (S((1, 15, 15, 64), F16), S((1, 15, 15, 128), F16), S((192,), F16), S((192,), F16),
               S((16, 192, 3, 3), F16), S((16,), F16))


def test_a_concat_inside_a_group_is_cut_after_distributing_the_reshapes():
    """concat(64, 128) with 3 channels per group: channel 64 lies inside group 21, whose statistic
    mixes both tensors. The group's reshape does not cut there (`NotRestrictable`); pushed through
    the GroupNorm's elementwise ops (`distribute_reshapes`: statistics read per channel through a
    view) it does, and each part (and an arbitrary sub-range across the concat) evaluates to the
    whole expression's channels, bit for bit."""
    from eqsat.tiling.channel_parts import distribute_reshapes

    lhs = _conv_lhs(_gn_silu_concat_conv, INSIDE_ARGS).args[0]
    with pytest.raises(NotRestrictable, match="reshaped block of 3"):
        concat_splits(lhs, 3)
    assert concat_splits(distribute_reshapes(lhs), 3) == {64}
    values = _values(lhs, np.random.default_rng(0))
    whole = np.asarray(evaluate_whole(lhs, values), np.float32)
    np.testing.assert_array_equal(np.asarray(evaluate_whole(distribute_reshapes(lhs), values), np.float32), whole)
    parts = channel_parts(lhs, 3, 0, 192)
    assert [(a, b) for _e, a, b in parts] == [(0, 64), (64, 192)]
    for expr, a, b in parts + channel_parts(lhs, 3, 31, 95):
        assert "Concat" not in {n.op for n in expr_nodes(expr)}
        np.testing.assert_array_equal(np.asarray(evaluate_whole(expr, values), np.float32), whole[..., a:b])
    assert [(r, o, c) for _e, r, o, c, _t in halo_parts([(lhs, 0, 192, ((0, 3), (0, 3)))])] == [(0, 0, 64),
                                                                                                 (0, 64, 128)]


def test_a_concat_of_fewer_than_64_channels_inside_a_group_stays_on_the_flat_grid():
    """concat(32, 160): the cut is found, but a 32-channel K range is not whole TMA chunks."""
    args = (S((1, 15, 15, 32), F16), S((1, 15, 15, 160), F16), *INSIDE_ARGS[2:])
    term = _conv_lhs(_gn_silu_concat_conv, args)
    parts = halo_parts([(r.lhs, 0, r.channels, r.taps) for r in k_ranges(term)])
    assert [c for _e, _r, _o, c, _t in parts] == [32, 160]
    from eqsat.cost.mosaic import conv_work
    assert "input laid out" in {g.what for g in conv_work(term).glue}


# --- plans through backend="mosaic" ------------------------------------------------------------------


def _concat_args(rng, h, skip, channels=384):
    gamma = jnp.asarray(rng.standard_normal(channels) + 1.0, jnp.float16)
    beta = jnp.asarray(rng.standard_normal(channels), jnp.float16)
    w = jnp.asarray(0.05 * rng.standard_normal((16, channels, 3, 3)), jnp.float16)
    b = jnp.asarray(rng.standard_normal(16), jnp.float16)
    return (jnp.asarray(h, jnp.float16), jnp.asarray(skip, jnp.float16), gamma, beta, w, b)


@pytest.mark.slow
def test_a_groupnorm_silu_conv_over_a_concat():
    """An up-block conv1 on a 15x15 image: h (offset 1e4, spread 1) and skip (offset -300, spread
    1e-3, a constant channel block) each staged by TMA with its own prologue (per-channel statistics
    of the concat's groups, gamma, beta), against XLA and jit."""
    rng = np.random.default_rng(2)
    h = 1e4 + rng.standard_normal((1, 15, 15, 192))
    skip = -300.0 + 1e-3 * rng.standard_normal((1, 15, 15, 192))
    skip[..., :30] = 7.0
    args = _concat_args(rng, h, skip)
    plan = _plan(_gn_silu_concat_conv, args)
    out = _run_haloed(plan, args, [(1, 15, 15, 192), (1, 15, 15, 192)])
    expected = emit.emit(plan, "xla")(*args)
    _assert_close(out, expected, jax.jit(_gn_silu_concat_conv)(*args), scale=_bound(*args[2:]))


def test_a_groupnorm_silu_conv_over_a_concat_inside_a_group():
    """concat(64, 128) in groups of 3 (group 21 spans both tensors) on a 15x15 image: h (offset 1e4,
    spread 1) and skip (offset -300, spread 1e-3, a constant block) staged by TMA each with its own
    prologue, the straddling group's statistics gathered per channel, against XLA and jit."""
    rng = np.random.default_rng(12)
    h = 1e4 + rng.standard_normal((1, 15, 15, 64))
    skip = -300.0 + 1e-3 * rng.standard_normal((1, 15, 15, 128))
    skip[..., :30] = 7.0
    args = _concat_args(rng, h, skip, 192)
    plan = _plan(_gn_silu_concat_conv, args)
    out = _run_haloed(plan, args, [(1, 15, 15, 64), (1, 15, 15, 128)])
    expected = emit.emit(plan, "xla")(*args)
    _assert_close(out, expected, jax.jit(_gn_silu_concat_conv)(*args), scale=_bound(*args[2:]))


_PLANS: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("split", [192, 64])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_concat_conv_matches_xla_and_jit_on_adversarial_values(split, data):
    """The same conv on adversarial h and skip, the concat on a group boundary (192) or inside group
    21 (64): offsets up to 1e4 against a spread of 1, tiny and large scales, constant channels, zero
    rows; NaN in h reaches every output it touches, as in jit."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    h = _adversarial_input(data.draw, (1, 15, 15, split)).astype(np.float32)
    skip = _adversarial_input(data.draw, (1, 15, 15, 384 - split)).astype(np.float32)
    if data.draw(st.booleans()):
        h[0, 7, 7, 5] = np.nan
    args = _concat_args(rng, h, skip)
    if split not in _PLANS:
        _PLANS[split] = _plan(_gn_silu_concat_conv, args)
    plan = _PLANS[split]
    assert_haloed_matches_xla_and_jit(plan, _gn_silu_concat_conv, args,
                                      [(1, 15, 15, split), (1, 15, 15, 384 - split)], _bound(*args[2:]))


@pytest.mark.slow
def test_a_conv_with_its_shortcut_merged():
    """conv2 (GroupNorm + SiLU of h, 3x3) + the 1x1 shortcut of x, two 15x15 images: one haloed kernel
    staging x (centre tap) and h (9 taps), its bias sum in the epilogue, against XLA and jit."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16)
    h = jnp.asarray(50.0 + rng.standard_normal((2, 15, 15, 192)), jnp.float16)
    gamma, beta = (jnp.asarray(rng.standard_normal(192), jnp.float16) for _ in range(2))
    w = jnp.asarray(0.05 * rng.standard_normal((64, 192, 3, 3)), jnp.float16)
    ws = jnp.asarray(0.1 * rng.standard_normal((64, 64, 1, 1)), jnp.float16)
    b, bs = (jnp.asarray(rng.standard_normal(64), jnp.float16) for _ in range(2))
    args = (x, h, gamma, beta, w, b, ws, bs)
    plan = _plan(_conv_and_shortcut, args)
    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    assert [(r.channels, r.taps) for r in k_ranges(conv.term)] == [(64, ((1, 2), (1, 2))), (192, ((0, 3), (0, 3)))]
    out = _run_haloed(plan, args, [(2, 15, 15, 64), (2, 15, 15, 192)])
    expected = emit.emit(plan, "xla")(*args)
    shortcut = float(np.max(np.abs(np.asarray(ws, np.float32)).sum(axis=(1, 2, 3)))) * float(np.max(np.abs(x)))
    _assert_close(out, expected, jax.jit(_conv_and_shortcut)(*args), scale=_bound(gamma, beta, w, b) + shortcut)


# --- compiled for an H100 without a GPU ----------------------------------------------------------


@pytest.mark.slow
def test_compiles_for_sm90a_with_a_concat_and_a_merged_shortcut(tmp_path, monkeypatch):
    """The concat conv (two staged tensors, two prologues; also a concat inside a group) and the merged shortcut (a 1-tap range, then
    9 taps) compile for an H100: wgmma with an MMA in flight, TMA loads, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    cases = [(_gn_silu_concat_conv, CONCAT_ARGS), (_gn_silu_concat_conv, INSIDE_ARGS),
             (_conv_and_shortcut, (S((2, 16, 16, 64), F16), S((2, 16, 16, 192), F16), S((192,), F16),
                                   S((192,), F16), S((64, 192, 3, 3), F16), S((64,), F16), S((64, 64, 1, 1), F16),
                                   S((64,), F16)))]
    for i, (fn, args) in enumerate(cases):
        plan = _plan(fn, args)
        (tmp_path / str(i)).mkdir()
        assert_compiles_to_one_pipelined_mosaic_kernel(plan, args, tmp_path / str(i), monkeypatch)


# --- a conv over a nearest-2x upsample: four phases of a conv over the source ---------------------------


def _upsample_conv(x, w, b):
    """diffusers `Upsample2D`: nearest 2x, then a 3x3 conv with a bias."""
    return layers.upsample({"u.conv.weight": w, "u.conv.bias": b}, "u", x)


def _upsample_args(x, rng, out=128, weight_scale=0.1):
    w = jnp.asarray(weight_scale * rng.standard_normal((out, x.shape[-1], 3, 3)), jnp.float16)
    return (jnp.asarray(x, jnp.float16), w, jnp.asarray(rng.standard_normal(out), jnp.float16))


def test_the_phase_weights_sum_the_taps_each_source_pixel_meets():
    """Row phase 0 reads source rows i-1 (tap 0) and i (taps 1, 2); phase 1 rows i (taps 0, 1) and i+1
    (tap 2): each phase's 2x2 window against direct sums, and the four phases' 2x2 convs over the
    source interleaved against the 3x3 conv over the upsample (`lax`, float32)."""
    from eqsat.tiling.mosaic import PHASE_OFFSET

    assert [PHASE_OFFSET[0, k] for k in range(3)] == [0, 1, 1] and [PHASE_OFFSET[1, k] for k in range(3)] == [1, 1, 2]
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((5, 4, 3, 3)), jnp.float32)  # OIHW
    phased = np.asarray(ch.phase_weights(w, (0, 1, 2, 3)))  # [phase, a, b, in, out]
    wt = np.transpose(np.asarray(w), (2, 3, 1, 0))
    np.testing.assert_allclose(phased[0, 0, 0], wt[0, 0])  # phase (0, 0), source (-1, -1): tap (0, 0)
    np.testing.assert_allclose(phased[0, 1, 1], wt[1:, 1:].sum(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(phased[3, 1, 1], wt[2, 2])  # phase (1, 1), source (+1, +1): tap (2, 2)
    x = rng.standard_normal((1, 5, 6, 4)).astype(np.float32)
    up = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)
    expected = np.asarray(lax.conv_general_dilated(up, wt, (1, 1), ((1, 1), (1, 1)),
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC")))
    for p in range(4):
        py, px = divmod(p, 2)
        window = ((1 - py, py), (1 - px, px))  # the 2x2 window's source offsets (py - 1 + a, px - 1 + b)
        got = lax.conv_general_dilated(x, phased[p], (1, 1), window, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        np.testing.assert_allclose(np.asarray(got), expected[:, py::2, px::2], rtol=1e-5, atol=1e-5)


def test_an_upsample_conv_reads_the_source():
    """A 3x3 conv over the nearest-2x upsample of 2 x 7x9 images (64 -> 128 channels, a bias): one
    haloed kernel staging the source itself (no upsampled copy), against XLA and jit."""
    rng = np.random.default_rng(8)
    args = _upsample_args(rng.standard_normal((2, 7, 9, 64)), rng)
    plan = _plan(_upsample_conv, args)
    out = _run_haloed(plan, args, [(2, 7, 9, 64)])
    assert out.shape == (2, 14, 18, 128)
    expected = emit.emit(plan, "xla")(*args)
    scale = float(np.abs(np.asarray(args[1], np.float32)).sum(axis=(1, 2, 3)).max()) * 4.0 + 8.0
    _assert_close(out, expected, jax.jit(_upsample_conv)(*args), scale=scale)


_UP_PLANS: dict = {}


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_an_upsample_conv_matches_xla_and_jit_on_adversarial_values(data):
    """15x15 sources -> 30x30: offsets up to 1e4 against a spread of 1, tiny and large scales, constant
    channels, zero rows, zero weights; inf in the source reaches the outputs it touches, as in jit."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _adversarial_input(data.draw, (1, 15, 15, 64)).astype(np.float32)
    if data.draw(st.booleans()):
        x[0, 3, 4, 9] = np.inf
    args = _upsample_args(x, rng, weight_scale=data.draw(st.sampled_from((0.05, 0.0))))
    if "plan" not in _UP_PLANS:
        _UP_PLANS["plan"] = _plan(_upsample_conv, args)
    plan = _UP_PLANS["plan"]
    out = np.asarray(_run_haloed(plan, args, [(1, 15, 15, 64)]), np.float32)
    expected = np.asarray(emit.emit(plan, "xla")(*args), np.float32)
    jitted = np.asarray(jax.jit(_upsample_conv)(*args), np.float32)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(jitted))
    finite = np.isfinite(jitted)
    scale = float(np.abs(np.asarray(args[1], np.float32)).sum(axis=(1, 2, 3)).max()) * (
        float(np.max(np.abs(np.where(np.isfinite(x), x, 0)))) + 1.0) + 8.0
    _assert_close(np.where(finite, out, 0), np.where(finite, expected, 0), np.where(finite, jitted, 0), scale=scale)


@pytest.mark.slow
def test_compiles_for_sm90a_over_an_upsample(tmp_path, monkeypatch):
    """The phase form of a 16x16 -> 32x32 upsample conv (320 -> 320) compiles for an H100: wgmma with an
    MMA in flight, TMA loads, no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (S((2, 16, 16, 320), F16), S((320, 320, 3, 3), F16), S((320,), F16))
    assert_compiles_to_one_pipelined_mosaic_kernel(_plan(_upsample_conv, args), args, tmp_path, monkeypatch)


# --- what the kernel is written as: loops, whatever the ranges, rows, slabs and taps ------------------


def _kernel_primitives(shape, parts_spec, stride: int = 1):
    """The primitives (name -> count, nested jaxprs included) of the haloed kernel traced for the GPU
    (not interpreted, not lowered) over `[1, *shape, C]` inputs, one per K range of `parts_spec`."""
    size = shape[0]
    params = dataclasses.replace(_params((1, size, size, 64), (3, 3, 64, 64), ((1, 1), (1, 1))), strides=(stride,) * 2)
    out_size = -(-size // stride)
    channels = sum(c for c, *_ in parts_spec)
    geometry = ConvGeometry(params, (1, size, size, channels), (3, 3, channels, 64), (1, out_size, out_size, 64))
    grid_of = functools.partial(HaloGrid, geometry)
    blocks = halo_blocks(grid_of, grid_of(128).out_rows, 64, batch=1)
    grid = grid_of(blocks.tile_m)
    parts = ch.plan_parts(parts_spec)
    xs = [jax.ShapeDtypeStruct((1, size, size, c + offset), jnp.float16) for c, _t, offset, _v in parts_spec]
    w = jax.ShapeDtypeStruct((9 * channels, 64), jnp.float16)
    jaxpr = jax.make_jaxpr(lambda xs, w: ch.build(xs, w, grid, blocks, parts=parts, interpret=False))(xs, w)
    counts = {}

    def walk(j):
        for eqn in j.eqns:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return counts, grid


@pytest.mark.parametrize("stride", [1, 2])
def test_the_kernel_writes_its_tap_body_once_and_loops_over_rows_and_slabs(stride):
    """One wgmma in the kernel (stride 2: one per tap of a window row, the loop runs the rows) for one
    3x3 range and for two ranges (a 3x3 one from a channel offset and a centre-tap one: a merged
    shortcut); and the same kernel code on a 15x15 and a 9x9 grid,
    whose CTAs stage different numbers of rows and prologue slabs (they are loop bounds, not code)."""
    one = [(64, ((0, 3), (0, 3)), 0, ())]
    two = [(64, ((0, 3), (0, 3)), 64, ()), (64, ((1, 2), (1, 2)), 0, ())]
    small, small_grid = _kernel_primitives((9, 9), one, stride)
    large, large_grid = _kernel_primitives((15, 15), one, stride)
    ranges, _ = _kernel_primitives((15, 15), two, stride)
    assert (small_grid.staged_rows, small_grid.staging) != (large_grid.staged_rows, large_grid.staging)
    assert small == large
    assert small["wgmma_ref"] == ranges["wgmma_ref"] == (1 if stride == 1 else 3)  # stride 2: a row's 3 taps
