"""Weight layouts of the haloed Mosaic conv laid out once by the prepare stage (`emit.mosaic.layouts`,
`emit.prepare._template_layouts`): a conv over a nearest-2x upsample (its phase form's sums of taps),
a conv with its 1x1 shortcut merged (`concat(w, pad(w1x1))`) and a conv to 4 outputs (N padded to
the tile) read their weight from a prepared tensor, never lay it out per call; in GPU interpret mode
against the XLA emitter and `jax.jit` on 15x15 images with adversarial values; the cost model
charges the per-call weight fusion only where one runs; the per-call stage compiled for sm_90a."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.mosaic import conv_halo as ch
from emit.mosaic.layouts import halo_weight_layout
from emit.prepare import Prepared
from eqsat.cost.mosaic import mosaic_work
from sd15 import layers
from tests.test_emit_mosaic_conv_halo import _assert_close, run_recording_builds
from tests.test_emit_mosaic_conv_ranges import _conv_and_shortcut, _upsample_conv

S, F16 = jax.ShapeDtypeStruct, jnp.float16


def _upsample(params, x):
    return _upsample_conv(x, params["w"], params["b"])


def _shortcut(params, x, h):
    p = params
    return _conv_and_shortcut(x, h, p["gamma"], p["beta"], p["w"], p["b"], p["ws"], p["bs"])


def _conv_out(params, x):
    """diffusers' `conv_out`: GroupNorm + SiLU, then a 3x3 conv to 4 channels (N padded to the tile)."""
    p = {"n.weight": params["gamma"], "n.bias": params["beta"], "c.weight": params["w"], "c.bias": params["b"]}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, x.shape[-1] // 3, 1e-5)))


def _lowered(fn, args, backend="mosaic"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(fn, params_argnums=0, backend=backend, progress=False, cache=False).lower(*args)


def _per_call_conv(split):
    (conv,) = [k for k in split.per_call.kernels if k.op == "Conv"]
    return conv


def _run_prepared(split, args):
    """The split on the Mosaic backend in interpret mode, the per-call conv never laying its weight
    out (`phase_weights` and `layout_weight` are not called at emission)."""
    def refuse(*_a, **_k):
        raise AssertionError("the weight was laid out per call")

    run = Prepared(split, "mosaic", interpret=True)
    prepared = run.prepare(*args)  # the prepare stage may lay out (that is its job)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch, "phase_weights", refuse)
        patch.setattr(ch, "layout_weight", refuse)
        out, builds = run_recording_builds(lambda *a: run.per_call(prepared, *a), args)
    assert len(builds) == 1, builds
    return out


def _params_upsample(rng, cin=64, cout=128, scale=0.1):
    return {"w": jnp.asarray(scale * rng.standard_normal((cout, cin, 3, 3)), F16),
            "b": jnp.asarray(rng.standard_normal(cout), F16)}


def test_the_layout_terms_are_made_only_where_the_template_would_lay_the_weight_out():
    """Upsample: the phase form's `[16 C, Cout]`; merged shortcut: `[9 (C + Cs), N]`; 4 outputs:
    N padded to 64; a plain 3x3 conv whose prepared weight the kernel reads as it lies: none."""
    cases = [
        (_upsample, ({"w": S((128, 64, 3, 3), F16), "b": S((128,), F16)}, S((2, 7, 9, 64), F16)), (16 * 64, 128)),
        (_shortcut, (_shortcut_specs(64, 192, 64), S((2, 15, 15, 64), F16), S((2, 15, 15, 192), F16)),
         (9 * 256, 64)),
        (_conv_out, (_conv_out_specs(192, 4), S((2, 15, 15, 192), F16)), (9 * 192, 64)),
    ]
    for fn, args, shape in cases:
        split = _lowered(fn, args).split
        conv = _per_call_conv(split)
        layout = halo_weight_layout(conv.term)
        assert layout is not None and tuple(layout.ty.split("[")[1].rstrip("]").split(",")) == tuple(map(str, shape))
        assert layout in split.prepared_tensors and layout in [k.term for k in split.prepared.kernels]
        assert "weights laid out" not in [g.what for g in mosaic_work(conv.term).glue]
    plain = _lowered(_conv_out, (_conv_out_specs(192, 64), S((2, 15, 15, 192), F16))).split
    assert halo_weight_layout(_per_call_conv(plain).term) is None


def test_without_a_prepare_stage_the_model_charges_the_weight_fusion():
    args = (S((2, 7, 9, 64), F16), S((128, 64, 3, 3), F16), S((128,), F16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = eqsat.optimize(_upsample_conv, backend="mosaic", progress=False, cache=False).lower(*args).plan
    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    assert "weights laid out" in [g.what for g in mosaic_work(conv.term).glue]


def test_a_triton_plan_prepares_no_template_layout():
    args = ({"w": S((128, 64, 3, 3), F16), "b": S((128,), F16)}, S((2, 7, 9, 64), F16))
    split = _lowered(_upsample, args, backend="pallas").split
    assert halo_weight_layout(_per_call_conv(split).term) not in split.prepared_tensors


def _shortcut_specs(cout, ch_, cs):
    return {"gamma": S((ch_,), F16), "beta": S((ch_,), F16), "w": S((cout, ch_, 3, 3), F16), "b": S((cout,), F16),
            "ws": S((cout, cs, 1, 1), F16), "bs": S((cout,), F16)}


def _conv_out_specs(cin, cout):
    return {"gamma": S((cin,), F16), "beta": S((cin,), F16), "w": S((cout, cin, 3, 3), F16), "b": S((cout,), F16)}


@pytest.mark.slow
def test_a_prepared_upsample_conv_matches_xla_and_jit():
    """15x15 sources (64 -> 128 channels): an offset of 1e4 against a spread of 1 in one image, a
    constant channel, a zero row, an inf; the prepared phase weights against XLA and jit."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 15, 15, 64)).astype(np.float32)
    x[0] += 1e4
    x[1, :, :, 5] = 3.0
    x[1, 4] = 0.0
    x[1, 9, 2, 7] = np.inf
    params = _params_upsample(rng)
    args = (params, jnp.asarray(x, F16))
    split = _lowered(_upsample, args).split
    out = np.asarray(_run_prepared(split, args), np.float32)
    expected = np.asarray(emit.emit(split.plan, "xla")(*args), np.float32)
    jitted = np.asarray(jax.jit(_upsample)(*args), np.float32)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(jitted))
    finite = np.isfinite(jitted)
    scale = float(np.abs(np.asarray(params["w"], np.float32)).sum(axis=(1, 2, 3)).max()) * 1.1e4 + 8.0
    _assert_close(np.where(finite, out, 0), np.where(finite, expected, 0), np.where(finite, jitted, 0), scale=scale)


@pytest.mark.slow
def test_a_prepared_merged_shortcut_and_a_4_channel_conv_match_xla_and_jit():
    """conv2 + its merged 1x1 shortcut (3 channels per group, h offset by 1e4 against a spread of 1,
    a constant channel, zeros) and conv_out's 3x3 to 4 channels, both reading prepared weights."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), F16)
    h = rng.standard_normal((2, 15, 15, 192)).astype(np.float32) + 1e4
    h[:, :, :, 10] = 7.0
    h[1, 3] = 0.0
    h = jnp.asarray(h, F16)
    params = {"gamma": jnp.asarray(rng.standard_normal(192), F16), "beta": jnp.asarray(rng.standard_normal(192), F16),
              "w": jnp.asarray(0.05 * rng.standard_normal((64, 192, 3, 3)), F16),
              "b": jnp.asarray(rng.standard_normal(64), F16),
              "ws": jnp.asarray(0.1 * rng.standard_normal((64, 64, 1, 1)), F16),
              "bs": jnp.asarray(rng.standard_normal(64), F16)}
    args = (params, x, h)
    split = _lowered(_shortcut, args).split
    out = _run_prepared(split, args)
    scale = float(np.abs(np.asarray(params["w"], np.float32)).sum(axis=(1, 2, 3)).max()) * 30.0 + 30.0
    _assert_close(out, emit.emit(split.plan, "xla")(*args), jax.jit(_shortcut)(*args), scale=scale)

    params = {"gamma": params["gamma"], "beta": params["beta"],
              "w": jnp.asarray(0.05 * rng.standard_normal((4, 192, 3, 3)), F16), "b": jnp.asarray([1.0, 0, -2, 3], F16)}
    args = (params, h)
    split = _lowered(_conv_out, args).split
    out = _run_prepared(split, args)
    scale = float(np.abs(np.asarray(params["w"], np.float32)).sum(axis=(1, 2, 3)).max()) * 30.0 + 30.0
    _assert_close(out, emit.emit(split.plan, "xla")(*args), jax.jit(_conv_out)(*args), scale=scale)


@pytest.mark.slow
def test_compiles_for_sm90a_with_the_upsample_weights_prepared(tmp_path):
    """The per-call stage of a prepared 16x16 -> 32x32 upsample conv (320 -> 320) compiles for an
    H100 with one Mosaic kernel and one launch fewer than the same conv emitted without the prepare
    stage (its phase weights summed per call)."""
    from measure.xla_target import compile_for_h100, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    params = {"w": S((320, 320, 3, 3), F16), "b": S((320,), F16)}
    x = S((2, 16, 16, 320), F16)
    split = _lowered(_upsample, (params, x)).split
    run = Prepared(split, "mosaic", interpret=False)
    prepared = split.prepared_specs()
    report = compile_for_h100(lambda pre, p, x: run.per_call(pre, p, x), prepared, params, x)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = eqsat.optimize(_upsample_conv, backend="mosaic", progress=False, cache=False).lower(
            x, params["w"], params["b"]).plan
    naive = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), x, params["w"], params["b"])
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1 == naive.by_category.get("Pallas (Mosaic GPU)")
    assert report.kernels + report.copies == naive.kernels + naive.copies - 1, (report.by_category,
                                                                               naive.by_category)


def test_a_1x1_conv_without_padding_keeps_its_all_ones_mask_a_literal():
    """2 x 8x8 images, 1x1, 64 -> 64: every staged row is an input pixel (the row mask is all ones);
    the kernel gets one extra, unread zero tile (so XLA embeds the constant instead of launching a
    broadcast) and matches `lax` in GPU interpret mode."""
    from jax import lax

    from tests.test_emit_mosaic_conv_halo import _haloed_conv, _params

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 64)), F16)
    w = jnp.asarray(0.1 * rng.standard_normal((1, 1, 64, 64)), F16)
    params = _params(x.shape, w.shape, ((0, 0), (0, 0)))
    masks = []
    original = ch.build

    def recording(xs, w_, grid, *a, **k):
        masks.append(ch.row_mask(grid))
        return original(xs, w_, grid, *a, **k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch, "build", recording)
        out = _haloed_conv(x, w, params)
    assert masks and masks[0].all()
    expected = lax.conv_general_dilated(x.astype(jnp.float32), w.astype(jnp.float32), (1, 1), ((0, 0), (0, 0)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-2, atol=2e-2)
