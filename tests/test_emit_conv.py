"""The conv template (`emit/pallas/conv.py`) in interpret mode.

Two levels: `Conv` terms built here and run by `conv.run` against `conv.reference` and the
reference interpreter (layouts, strides, windows, tails of several tiles, NaN, padding after the
prologue); and plans of small JAX functions (`eqsat.optimize(...).lower(...)`) emitted with
`backend="pallas"` against `backend="xla"` and the plain function (a tiny ResNet block with its
GroupNorm prologue, time embedding and merged shortcut, conv after upsample, conv over
concat(h, skip), a stride-2 downsampler, conv_in/conv_out with their NCHW permutes). Tolerances
are keyed by dtype. Shapes are small and blocks large: interpret mode costs ~35 µs per grid step.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat.cost import mma
from jax import lax

import emit
import eqsat
from emit.pallas import XlaFallbackWarning, conv
from eqsat.conv_params import ConvParams
from eqsat.interpret import evaluate
from eqsat.lift import CONVERT
from eqsat.term import Term
from eqsat.types import format_type, parse_type
from sd15 import layers

TOLERANCE = {jnp.float32: 2e-4, jnp.float16: 2e-2, jnp.bfloat16: 6e-2}
NHWC_HWIO = ("NHWC", "HWIO", "NHWC")
SMALL_TILES = conv.ConvConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def _close(actual, expected, dtype=jnp.float32, scale=1.0):
    tol = TOLERANCE[jnp.dtype(dtype).type] * scale
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol, equal_nan=True)


# --- Conv terms ---------------------------------------------------------------------------------


def _input(name, shape, dtype="float32"):
    return Term("Input", name, format_type(dtype, shape))


def _load(tensor):
    return Term("Load", tensor, tensor.ty)


def _params(lhs_shape, rhs_shape, layouts, strides, padding):
    numbers = lax.conv_dimension_numbers(lhs_shape, rhs_shape, layouts)
    return ConvParams.from_lax(strides, padding, (1, 1), (1, 1), numbers)


def _conv_term(lhs, rhs, params, out_dtype="float32", epilogue=lambda acc: acc):
    """`Conv(lhs, rhs)` with an fp32 accumulator, `epilogue(acc)`, then a cast to `out_dtype`."""
    shape = jax.eval_shape(
        lambda a, b: lax.conv_general_dilated(a, b, **params.lax_kwargs()),
        jax.ShapeDtypeStruct(_shape(lhs), jnp.float32), jax.ShapeDtypeStruct(_shape(rhs), jnp.float32)).shape
    body = epilogue(Term("Acc", format_type("float32", shape)))
    if out_dtype != "float32":
        body = Term("Unary", CONVERT, body, format_type(out_dtype, shape))
    return Term("Conv", lhs, rhs, params.key, body, format_type(out_dtype, shape))


def _shape(expr):
    from eqsat.types import parse_type

    return parse_type(expr.ty).shape


def _run_both(term, env, config=SMALL_TILES):
    """(template output, interpreter output) of a Conv term whose inputs are bound by `env`."""
    values = {t: env[t.args[0]] for t in _inputs_of(term)}
    out = conv.run(term, values, config=config, interpret=True, name="test:conv")
    (expected,) = evaluate([term], env)
    return out, expected


def _inputs_of(term):
    from eqsat.term import postorder

    return [node for node in postorder([term]) if node.op == "Input"]


LAYOUTS = [("NHWC", "OIHW", "NHWC"), ("NCHW", "OIHW", "NCHW"), ("NHWC", "HWIO", "NCHW")]


def _operand_shapes(layouts, batch, height, width, cin, cout, window):
    sizes = {"N": batch, "H": height, "W": width, "C": cin}
    lhs = tuple(sizes[c] for c in layouts[0])
    wsizes = {"O": cout, "I": cin, "H": window[0], "W": window[1]}
    return lhs, tuple(wsizes[c] for c in layouts[1])


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("window,strides,padding", [
    ((3, 3), (1, 1), ((1, 1), (1, 1))),
    ((3, 3), (2, 2), ((1, 1), (1, 1))),
    ((1, 1), (1, 1), ((0, 0), (0, 0))),
    ((3, 1), (2, 1), ((0, 2), (0, 0))),   # asymmetric window and padding, stride in one axis
], ids=["3x3", "3x3-stride2", "1x1", "3x1-asym"])
def test_geometry_follows_the_dimension_numbers(layouts, window, strides, padding):
    lhs_shape, rhs_shape = _operand_shapes(layouts, 2, 7, 5, 6, 20, window)
    x, w = _input("x", lhs_shape), _input("w", rhs_shape)
    term = _conv_term(_load(x), _load(w), _params(lhs_shape, rhs_shape, layouts, strides, padding))
    rng = np.random.default_rng(0)
    env = {"x": rng.normal(size=lhs_shape).astype(np.float32), "w": rng.normal(size=rhs_shape).astype(np.float32)}
    env["x"].flat[17] = np.nan  # propagates to the outputs whose window covers it, as in lax
    out, expected = _run_both(term, env)
    assert np.isnan(np.asarray(expected)).any()
    _close(out, expected)
    _close(out, conv.reference(env["x"], env["w"], _params(lhs_shape, rhs_shape, layouts, strides, padding)))


ROW_TILES = [conv.ConvConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2, block_w=16),
             conv.ConvConfig(block_m=64, block_n=16, block_k=16, num_warps=4, num_stages=2, block_w=16)]


@pytest.mark.parametrize("config", ROW_TILES, ids=["2-rows", "4-rows"])
@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda l: "-".join(l))
@pytest.mark.parametrize("strides,dilation,padding", [
    ((1, 1), (1, 1), ((1, 1), (1, 1))),
    ((2, 1), (1, 1), ((1, 1), (0, 2))),
    ((1, 1), (2, 2), ((2, 2), (2, 2))),
], ids=["same", "stride2-asym", "dilated"])
def test_row_tiles_of_plain_loads_match_computed_inputs(config, layouts, strides, dilation, padding):
    """Rows of several output rows on a 15x15 image (the last tile partly past the bottom), 19 input
    channels in 2 chunks of 16 and 20 output channels in 2 tiles: a plain input and weight run the direct
    loop (`_direct_row_sums`: every row loaded at every tap), `x * 1` the computed one (each input row
    computed once per column tap, reused by the row taps); both equal lax's conv and the interpreter,
    NaN and inf included."""
    lhs_shape, rhs_shape = _operand_shapes(layouts, 2, 15, 15, 19, 20, (3, 3))
    x, w = _input("x", lhs_shape), _input("w", rhs_shape)
    params = ConvParams.from_lax(strides, padding, (1, 1), dilation, lax.conv_dimension_numbers(lhs_shape, rhs_shape, layouts))
    computed = Term("Binary", "mul", _load(x), Term("Lit", 1.0, x.ty), x.ty)
    assert conv.zero_where_masked(_load(x)) and not conv.zero_where_masked(computed)
    rng = np.random.default_rng(5)
    env = {"x": (1e4 + rng.normal(size=lhs_shape)).astype(np.float32), "w": rng.normal(size=rhs_shape).astype(np.float32)}
    env["x"].flat[40] = np.nan
    env["x"].flat[700] = np.inf
    exact = conv.reference(env["x"], env["w"], params)
    for lhs in (_load(x), computed):
        out, expected = _run_both(_conv_term(lhs, _load(w), params), env, config)
        assert np.isnan(np.asarray(exact)).any()
        np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(exact)))
        finite = np.isfinite(np.asarray(exact))
        _close(np.where(finite, out, 0), np.where(finite, exact, 0), scale=1e4)
        _close(np.where(finite, out, 0), np.where(finite, expected, 0), scale=1e4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    lhs_shape, rhs_shape = (1, 6, 6, 40), (24, 40, 3, 3)
    x, w = _input("x", lhs_shape, dtype), _input("w", rhs_shape, dtype)
    params = _params(lhs_shape, rhs_shape, LAYOUTS[0], (1, 1), ((1, 1), (1, 1)))
    term = _conv_term(_load(x), _load(w), params, out_dtype=dtype)
    rng = np.random.default_rng(1)
    # An offset large against the spread: a 16-bit accumulator would lose the small terms.
    env = {"x": jnp.asarray(300.0 + rng.normal(size=lhs_shape), dtype),
           "w": jnp.asarray(rng.normal(size=rhs_shape) * 0.1, dtype)}
    out, expected = _run_both(term, env)
    assert out.dtype == jnp.dtype(dtype)
    exact = conv.reference(env["x"].astype(jnp.float32), env["w"].astype(jnp.float32), params)
    scale = float(jnp.max(jnp.abs(exact)))
    _close(out / scale, exact / scale, dtype)
    _close(out / scale, expected.astype(jnp.float32) / scale, dtype)


def test_zero_padding_applies_after_the_prologue():
    """A tap in the padding contributes 0, not prologue(0): here prologue(x) = x + 1."""
    lhs_shape, rhs_shape = (1, 5, 5, 3), (4, 3, 3, 3)
    x, w = _input("x", lhs_shape), _input("w", rhs_shape)
    ty = x.ty
    shifted = Term("Binary", "add", _load(x), Term("Lit", 1.0, ty), ty)
    params = _params(lhs_shape, rhs_shape, LAYOUTS[0], (1, 1), ((1, 1), (1, 1)))
    term = _conv_term(shifted, _load(w), params)
    env = {"x": np.zeros(lhs_shape, np.float32), "w": np.ones(rhs_shape, np.float32)}
    out, expected = _run_both(term, env)
    _close(out, expected)
    # 3 channels x the taps inside the image: 4 at a corner, 6 on an edge, 9 inside.
    np.testing.assert_array_equal(np.asarray(out)[0, :, :, 0], 3 * np.outer([2, 3, 3, 3, 2], [2, 3, 3, 3, 2]))


def test_a_merged_shortcut_runs_its_1x1_range_over_the_centre_tap_only():
    """`Conv(concat(h, x), concat(w3x3, pad(w1x1)))`: two K ranges, the second over one tap; a NaN
    in x's prologue at a skipped tap stays out (the dense conv would compute 0 * NaN there)."""
    h_shape, x_shape = (1, 6, 6, 5), (1, 6, 6, 3)
    h, x = _input("h", h_shape), _input("x", x_shape)
    w3, w1 = _input("w3", (4, 5, 3, 3)), _input("w1", (4, 3, 1, 1))
    lhs = Term("Concat", _load(h), _load(x), 3, 5, format_type("float32", (1, 6, 6, 8)))
    padded = Term("Pad", _load(w1), Term("Lit", 0.0, "f32[]"), "0,0,0;0,0,0;1,1,0;1,1,0", "f32[4,3,3,3]")
    rhs = Term("Concat", _load(w3), padded, 1, 5, "f32[4,8,3,3]")
    params = _params((1, 6, 6, 8), (4, 8, 3, 3), LAYOUTS[0], (1, 1), ((1, 1), (1, 1)))
    term = _conv_term(lhs, rhs, params)
    parts = conv.k_ranges(term)
    assert [(p.start, p.channels, p.taps) for p in parts] == [(0, 5, ((0, 3), (0, 3))), (5, 3, ((1, 2), (1, 2)))]
    assert parts[1].rhs is _load(w1)
    rng = np.random.default_rng(2)
    env = {name: rng.normal(size=_shape(t)).astype(np.float32) for name, t in
           [("h", h), ("x", x), ("w3", w3), ("w1", w1)]}
    out, expected = _run_both(term, env)
    _close(out, expected)
    env["x"][0, 0, 0, 0] = np.inf  # read by the centre tap of output (0, 0) only
    out, expected = _run_both(term, env)
    assert np.isinf(np.asarray(out)[0, 0, 0]).all() and np.isfinite(np.asarray(out)[0, 1:, 1:]).all()
    assert np.isnan(np.asarray(expected)[0, 1, 1]).all()  # the dense conv: 0 * inf at a zero tap


def test_a_channel_concat_is_two_k_ranges_over_two_buffers():
    h, skip = _input("h", (2, 4, 4, 6)), _input("skip", (2, 4, 4, 3))
    w = _input("w", (5, 9, 3, 3))
    lhs = Term("Concat", _load(h), _load(skip), 3, 6, "f32[2,4,4,9]")
    term = _conv_term(lhs, _load(w), _params((2, 4, 4, 9), (5, 9, 3, 3), LAYOUTS[0], (1, 1), ((1, 1), (1, 1))))
    parts = conv.k_ranges(term)
    assert [(p.lhs, p.lhs_offset, p.rhs_offset) for p in parts] == [(_load(h), 0, 0), (_load(skip), 0, 6)]
    rng = np.random.default_rng(3)
    env = {"h": rng.normal(size=(2, 4, 4, 6)).astype(np.float32),
           "skip": rng.normal(size=(2, 4, 4, 3)).astype(np.float32), "w": rng.normal(size=(5, 9, 3, 3)).astype(np.float32)}
    out, expected = _run_both(term, env)
    _close(out, expected)


def test_unsupported_convs_are_refused_with_a_reason():
    lhs_shape, rhs_shape = (1, 4, 4, 4), (4, 2, 3, 3)
    numbers = lax.conv_dimension_numbers(lhs_shape, rhs_shape, LAYOUTS[0])
    grouped = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), numbers, feature_group_count=2)
    with pytest.raises(ValueError, match="grouped"):
        conv.ConvGeometry(grouped, lhs_shape, rhs_shape, (1, 4, 4, 4))
    dilated = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (2, 2), (1, 1), numbers)
    with pytest.raises(ValueError, match="lhs_dilation"):
        conv.ConvGeometry(dilated, lhs_shape, (4, 4, 3, 3), (1, 7, 7, 4))
    with pytest.raises(ValueError, match="power of two"):
        conv.ConvConfig(block_m=48)


# --- statistics of the output, computed by the conv's tiles -------------------------------------------


def _group_stats(conv_term, groups, op="moments"):
    """`EpilogueReduce(conv, op, reshape(conv -> [B, HW, G, C/G]), over (HW, C/G))`: GroupNorm's
    statistics of an NHWC conv output."""
    b, h, w, c = _shape(conv_term)
    body = Term("Reshape", _load(conv_term), format_type("float32", (b, h * w, groups, c // groups)))
    ty = format_type("float32", (2, b, groups) if op == "moments" else (b, groups))
    return Term("EpilogueReduce", conv_term, op, body, "1,3", ty)


@pytest.mark.parametrize("values,config", [
    ("offset", SMALL_TILES), ("offset", conv.ConvConfig(32, 16, 16)), ("offset", None),
    ("constant-groups", SMALL_TILES), ("tiny", conv.ConvConfig(32, 16, 16)), ("huge", SMALL_TILES),
], ids=["offset-16x16-tiles", "offset-tiles-over-two-images", "offset-default", "constant-groups",
        "tiny", "huge"])
def test_hosted_groupnorm_moments_are_stable_and_match_two_pass(config, values):
    """48 channels in 16 groups of 3 (group 5 straddles the 16-channel tiles), 2 images of 4x4
    (a 32-pixel tile covers both): per-tile (count, mean, M2) merged by Chan's formula equal the
    two-pass moments, with values offset far from their spread, constant groups (M2 exactly 0),
    and tiny and huge magnitudes. A 1x1 identity conv makes the output the drawn values."""
    rng = np.random.default_rng(10)
    x = {"offset": 1e4 + rng.normal(size=(2, 4, 4, 48)),
         "constant-groups": np.repeat(rng.normal(size=(2, 1, 1, 16, 1)) * 100, 3, axis=4)
         .repeat(4, axis=1).repeat(4, axis=2).reshape(2, 4, 4, 48),
         "tiny": 1e-30 * rng.normal(size=(2, 4, 4, 48)),
         "huge": 1e18 * (3 + rng.normal(size=(2, 4, 4, 48)))}[values].astype(np.float32)
    xt, wt = _input("x", x.shape), _input("w", (48, 48, 1, 1))
    term = _conv_term(_load(xt), _load(wt), _params(x.shape, (48, 48, 1, 1), LAYOUTS[0], (1, 1), ((0, 0), (0, 0))))
    stats = _group_stats(term, 16)
    env = {"x": x, "w": np.eye(48, dtype=np.float32).reshape(48, 48, 1, 1)}
    out, partials = conv.run(term, {xt: env["x"], wt: env["w"]}, hosted=[stats], config=config, interpret=True)
    merged = np.asarray(conv.merge_partials(partials[stats], "moments")).reshape(2, 2, 16)
    (expected,) = evaluate([stats], env)
    expected = np.asarray(expected)
    # Sums cancel (signed values): their error is relative to the sum of magnitudes.
    np.testing.assert_allclose(merged[0], expected[0], rtol=1e-5, atol=1e-6 * 48 * float(np.abs(x).max()))
    # Each piece's mean is off by ~eps * offset, so M2 carries a relative error ~ eps * offset / spread
    # (6e-4 at offset 1e4, spread 1); E[x^2] - E[x]^2 would be off by eps * (offset / spread)^2 ~ 6.
    # A constant group's M2 is rounding noise on both sides: at most n * (a few ulps of |x|)^2.
    spread = np.asarray(expected[1])
    rtol = 2e-3 if values == "offset" else 1e-4
    noise = 48 * (4 * np.finfo(np.float32).eps * float(np.abs(x).max())) ** 2
    np.testing.assert_allclose(merged[1], spread, rtol=rtol, atol=max(noise, 1e-6 * float(np.abs(spread).max())))
    assert (merged[1] >= 0).all()


def test_hosted_sums_and_a_half_precision_output():
    """`sum` statistics read the output as stored (fp16 here), not the fp32 accumulator."""
    rng = np.random.default_rng(11)
    x, w = rng.normal(size=(2, 5, 5, 6)).astype(np.float16), (rng.normal(size=(9, 6, 3, 3)) * 0.3).astype(np.float16)
    xt, wt = _input("x", x.shape, "float16"), _input("w", w.shape, "float16")
    term = _conv_term(_load(xt), _load(wt), _params(x.shape, w.shape, LAYOUTS[0], (2, 2), ((1, 1), (1, 1))),
                      out_dtype="float16")
    b, h, ww, c = _shape(term)
    body = Term("Unary", CONVERT, Term("Reshape", _load(term), format_type("float16", (b, h * ww, 3, 3))),
                format_type("float32", (b, h * ww, 3, 3)))
    stats = Term("EpilogueReduce", term, "sum", body, "1,3", format_type("float32", (b, 3)))
    out, partials = conv.run(term, {xt: x, wt: w}, hosted=[stats], config=SMALL_TILES, interpret=True)
    merged = conv.merge_partials(partials[stats], "sum").reshape(b, 3)
    expected_out, expected = evaluate([term, stats], {"x": x, "w": w})
    _close(out, expected_out, jnp.float16)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(expected), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(out, np.float32).reshape(b, -1, 3, 3).sum((1, 3)),
                               rtol=1e-5, atol=1e-4)


def test_a_statistic_reading_each_element_twice_is_left_to_the_driver():
    """`sum(concat(x, x * x))` (the E[x^2] form a program may write itself): each element would go
    to two slots, so the template refuses it and the driver computes it as its own kernel."""
    xt, wt = _input("x", (1, 4, 4, 3)), _input("w", (3, 3, 1, 1))
    term = _conv_term(_load(xt), _load(wt), _params((1, 4, 4, 3), (3, 3, 1, 1), LAYOUTS[0], (1, 1), ((0, 0), (0, 0))))
    y = _load(term)
    both = Term("Concat", y, Term("Binary", "mul", y, y, y.ty), 0, 1, "f32[2,4,4,3]")
    stats = Term("EpilogueReduce", term, "sum", both, "1,2,3", "f32[2]")
    values = {xt: np.ones((1, 4, 4, 3), np.float32), wt: np.ones((3, 3, 1, 1), np.float32)}
    with pytest.raises(NotImplementedError, match="more than once"):
        conv.run(term, values, hosted=[stats], interpret=True)
    out, partials = conv.run(term, values, hosted=[stats], interpret=True, skip_unsupported=True)
    assert partials == {}


def test_merge_partials_is_chans_formula_in_a_fixed_order():
    from eqsat.moments import partial_moments, two_pass

    rng = np.random.default_rng(12)
    x = (5e3 + rng.normal(size=(3, 70))).astype(np.float32)
    pieces = partial_moments(x, (1,), 8)                  # [9 pieces (the last one short), 3, 3 rows]
    merged = conv.merge_partials(pieces, "moments")
    np.testing.assert_allclose(np.asarray(merged), np.asarray(two_pass(x, (1,))), rtol=1e-3)  # eps * offset / spread
    np.testing.assert_array_equal(np.asarray(merged), np.asarray(conv.merge_partials(pieces, "moments")))
    huge = partial_moments(np.float32(1e18) * x, (1,), 8)  # n * delta^2 would overflow float32
    assert np.isfinite(np.asarray(conv.merge_partials(huge, "moments"))).all()


# --- plans of small JAX functions -------------------------------------------------------------------


def _normal(rng, *shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _emit_and_compare(fn, args, dtype=jnp.float32, *, expect_convs: int, monkeypatch=None):
    """Lower `fn`, emit its plan with the Pallas templates (interpret mode) and with XLA; both
    equal the plain function. Every conv runs in the template, and so does every statistic the
    plan hosts on a conv. Returns the plan."""
    lowered = eqsat.optimize(fn, extractor="greedy").lower(*args)  # the plan is not what this tests
    plan = lowered.plan
    assert sum(k.kind == "conv" for k in plan.kernels) == expect_convs, lowered.report()
    produced: list = []
    if monkeypatch is not None:
        template = conv.emit

        def spy(kernel, ctx):
            values = template(kernel, ctx)
            produced.extend(values)
            return values

        monkeypatch.setattr(conv, "emit", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)  # every conv runs in the template
        pallas = emit.emit(plan, "pallas", interpret=True)(*args)
    if monkeypatch is not None:
        hosted = [t for k in plan.kernels if k.kind == "conv" for t in k.outputs[1:]]
        assert set(hosted) <= set(produced)
    xla = emit.emit(plan, "xla")(*args)
    plain = jax.jit(fn)(*args)
    for got in (pallas, xla):
        scale = max(1.0, float(jnp.max(jnp.abs(plain.astype(jnp.float32)))))
        _close(got.astype(jnp.float32) / scale, plain.astype(jnp.float32) / scale, dtype)
    return plan


def _resnet_params(rng, cin, cout, temb, dtype):
    p = {}
    for name, shape in [("norm1.weight", (cin,)), ("norm1.bias", (cin,)), ("conv1.weight", (cout, cin, 3, 3)),
                        ("conv1.bias", (cout,)), ("time_emb_proj.weight", (cout, temb)),
                        ("time_emb_proj.bias", (cout,)), ("norm2.weight", (cout,)), ("norm2.bias", (cout,)),
                        ("conv2.weight", (cout, cout, 3, 3)), ("conv2.bias", (cout,))]:
        p[f"r.{name}"] = _normal(rng, *shape, scale=0.3, dtype=dtype)
    if cin != cout:
        p["r.conv_shortcut.weight"] = _normal(rng, cout, cin, 1, 1, scale=0.3, dtype=dtype)
        p["r.conv_shortcut.bias"] = _normal(rng, cout, scale=0.3, dtype=dtype)
    return p


@pytest.mark.parametrize("dtype", [jnp.float32], ids=["f32"])  # fp16: the smaller plans below
def test_a_resnet_block_with_groupnorm_prologues_and_a_merged_shortcut(dtype, monkeypatch):
    """sd15's ResnetBlock2D at tiny width: 6 -> 12 channels in 2 groups (3 and 6 channels per
    group), GroupNorm + SiLU read in both convs' prologues, the time-embedding row and the 1x1
    shortcut merged into conv2 as a second K range."""
    rng = np.random.default_rng(4)
    params = _resnet_params(rng, 6, 12, 8, dtype)
    x = _normal(rng, 2, 8, 8, 6, dtype=dtype) + 3.0  # an offset: the statistics must not cancel
    temb = _normal(rng, 2, 8, dtype=dtype)

    def block(p, x, temb):
        return layers.resnet_block(p, "r", x, temb, 2, 1e-5)

    plan = _emit_and_compare(block, (params, x, temb), dtype, expect_convs=2, monkeypatch=monkeypatch)
    conv1, conv2 = [k for k in plan.kernels if k.kind == "conv"]
    assert len(conv1.outputs) == 2  # norm2's statistics come from conv1's tiles
    assert ((1, 2), (1, 2)) in [part.taps for part in conv.k_ranges(conv2.term)]  # the 1x1 shortcut range


def test_groupnorm_statistics_over_a_skip_concat_come_from_both_convs(monkeypatch):
    """An up block's GroupNorm over concat(h, skip) with a group straddling the boundary (6 + 2
    channels in 2 groups of 4): each conv writes partials for its channels, the second merges."""
    def up_block_norm(x, wa, wb, w):
        h = jnp.concatenate([lax.conv_general_dilated(x, wa, (1, 1), "SAME", dimension_numbers=NHWC_HWIO),
                             lax.conv_general_dilated(x, wb, (1, 1), "SAME", dimension_numbers=NHWC_HWIO)], axis=-1)
        g = h.reshape(1, 4, 4, 2, 4)
        g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) * lax.rsqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-5)
        return lax.conv_general_dilated(jax.nn.silu(g.reshape(h.shape)), w, (1, 1), "SAME", dimension_numbers=NHWC_HWIO)

    rng = np.random.default_rng(13)
    args = (_normal(rng, 1, 4, 4, 3), _normal(rng, 1, 1, 3, 6), _normal(rng, 1, 1, 3, 2), _normal(rng, 3, 3, 8, 2, scale=0.3))
    plan = _emit_and_compare(up_block_norm, args, expect_convs=3, monkeypatch=monkeypatch)
    assert [len(k.outputs) for k in plan.kernels] == [2, 2, 1]


def test_groupnorm_groups_straddle_channel_chunks():
    """96 channels in 32 groups of 3 and 64-channel K chunks: group 21 spans two chunks."""
    rng = np.random.default_rng(5)
    x, w = _normal(rng, 1, 4, 4, 96) * 2.0 + 5.0, _normal(rng, 16, 96, 3, 3, scale=0.2)
    gamma, beta = _normal(rng, 96), _normal(rng, 96)

    def fn(x, w, gamma, beta):
        p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": jnp.zeros(16)}
        return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, 32, 1e-5)))

    plan = _emit_and_compare(fn, (x, w, gamma, beta), expect_convs=1)
    (kernel,) = [k for k in plan.kernels if k.kind == "conv"]
    geometry = conv.ConvGeometry(ConvParams.parse(kernel.term.args[2]), (1, 4, 4, 96), (16, 96, 3, 3), (1, 4, 4, 16))
    assert mma.conv_config(geometry).block_k == 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_a_conv_after_a_nearest_upsample_reads_y_over_2(dtype):
    rng = np.random.default_rng(6)
    x, w, b = _normal(rng, 1, 4, 4, 6, dtype=dtype), _normal(rng, 6, 6, 3, 3, scale=0.3, dtype=dtype), \
        _normal(rng, 6, dtype=dtype)

    def up(x, w, b):
        return layers.upsample({"u.conv.weight": w, "u.conv.bias": b}, "u", x)

    plan = _emit_and_compare(up, (x, w, b), dtype, expect_convs=1)
    assert len(plan.kernels) == 1  # the upsampled tensor is never stored


def test_a_conv_over_a_skip_concat():
    rng = np.random.default_rng(7)
    h, s = _normal(rng, 2, 4, 4, 6), _normal(rng, 2, 4, 4, 3)
    w, b = _normal(rng, 5, 9, 3, 3, scale=0.3), _normal(rng, 5)

    def cat(h, s, w, b):
        return layers.conv2d({"c.weight": w, "c.bias": b}, "c", jnp.concatenate([h, s], -1))

    plan = _emit_and_compare(cat, (h, s, w, b), expect_convs=1)
    assert len(plan.kernels) == 1 and len(conv.k_ranges(plan.kernels[0].term)) == 2


def test_a_stride_2_downsampler_with_odd_size():
    rng = np.random.default_rng(8)
    x, w, b = _normal(rng, 2, 9, 7, 5), _normal(rng, 5, 5, 3, 3, scale=0.3), _normal(rng, 5)

    def down(x, w, b):
        return layers.downsample({"d.conv.weight": w, "d.conv.bias": b}, "d", x)

    _emit_and_compare(down, (x, w, b), expect_convs=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_conv_in_and_conv_out_read_and_write_nchw(dtype):
    """The UNet's ends: conv_in reads an NCHW latent through a permute, conv_out writes NCHW."""
    rng = np.random.default_rng(9)
    args = (_normal(rng, 2, 4, 8, 8, dtype=dtype), _normal(rng, 6, 4, 3, 3, scale=0.3, dtype=dtype),
            _normal(rng, 6, dtype=dtype), _normal(rng, 4, 6, 3, 3, scale=0.3, dtype=dtype), _normal(rng, 4, dtype=dtype))

    def ends(x, w_in, b_in, w_out, b_out):
        p = {"conv_in.weight": w_in, "conv_in.bias": b_in, "conv_out.weight": w_out, "conv_out.bias": b_out}
        h = layers.conv2d(p, "conv_in", x.transpose(0, 2, 3, 1))
        return layers.conv2d(p, "conv_out", layers.silu(h)).transpose(0, 3, 1, 2)

    plan = _emit_and_compare(ends, args, dtype, expect_convs=2)
    assert len(plan.kernels) == 2  # no permute kernels


# --- compiled for an H100 without a GPU ---------------------------------------------------------------


def test_every_conv_kind_compiles_for_sm90_on_tensor_cores(tmp_path):
    """conv_in (NCHW read), an upsampler conv, a conv over a skip concat and conv_out (NCHW write),
    fp16 at 64 channels: four Triton kernels in the executable, each on tensor cores, with wgmma
    wherever the config's dot M is >= 64 pixels: the 64x64 images' row tiles and conv_in's 32x32
    image on the tile the model chooses for it (a flat tile of 64 or 128 pixels)."""
    from measure.xla_target import compile_for_h100

    shapes = jax.ShapeDtypeStruct
    c, dt = 64, jnp.float16

    def net(x, skip, p):
        h = layers.conv2d(p, "conv_in", x.transpose(0, 2, 3, 1))
        u = layers.upsample(p, "up", h)
        h = layers.conv2d(p, "cat", jnp.concatenate([u, skip], -1))
        return layers.conv2d(p, "conv_out", layers.silu(h)).transpose(0, 3, 1, 2)

    params = {"conv_in.weight": (c, 4, 3, 3), "conv_in.bias": (c,), "up.conv.weight": (c, c, 3, 3),
              "up.conv.bias": (c,), "cat.weight": (c, 2 * c, 3, 3), "cat.bias": (c,),
              "conv_out.weight": (4, c, 3, 3), "conv_out.bias": (4,)}
    args = (shapes((2, 4, 32, 32), dt), shapes((2, 64, 64, c), dt), {k: shapes(s, dt) for k, s in params.items()})
    plan = eqsat.optimize(net).lower(*args).plan
    assert [k.kind for k in plan.kernels] == ["conv"] * 4
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args, keep_dump=tmp_path / "dump")
    if report is None:
        pytest.skip("no H100 compile target here (the CUDA plugin): python -m measure.cuda_target install")
    assert report.by_category == {"Pallas (Triton)": 4}
    ptx = [path.read_text() for path in (tmp_path / "dump").glob("*.ptx")]
    kernels = [text for text in ptx if ".entry" in text]
    assert len(kernels) == 4 and all("wgmma.mma_async" in text or "mma.sync" in text for text in kernels)
    wide = []
    for kernel in plan.kernels:
        lhs, rhs, params, _epilogue, ty = kernel.term.args
        geometry = conv.ConvGeometry(ConvParams.parse(params), parse_type(lhs.ty).shape, parse_type(rhs.ty).shape,
                                     parse_type(ty).shape)
        wide.append(mma.conv_config(geometry).tile(geometry)[1] >= 64)
    assert wide == [True] * 4
    assert sum("wgmma.mma_async" in text for text in kernels) == 4


# --- the cost model charges what the template does ------------------------------------------------------


def test_the_cost_model_uses_the_templates_output_channel_tile():
    from eqsat.cost import roofline

    assert roofline.CONV_BLOCK_N == conv.DEFAULT_BLOCK_N
    for cout in (3, 4, 16, 20, 128, 320, 640, 1280):
        assert roofline.conv_output_tiles(cout) == conv.output_channel_tiles(cout)


def test_a_conv_prologue_is_charged_per_tap_and_output_channel_tile():
    """silu(x) read by a 3x3 conv with 320 output channels on an 8x8 image: a mul and a logistic
    per input element (1 + `ALU_INSTRUCTIONS["logistic"]` flops), computed as the template tiles it
    (the model's choice here: one flat 64-pixel tile, computing its input at each of 9 taps for each
    of 3 channel tiles: 64 * 9 * 3 / 64 = 27 evaluations per element; 4-row x 16-column row tiles
    would also make 2 * 6 * 3 * 16 * 3 / 64 = 27); the 1x1 part of a merged shortcut at one tap
    (64 * 1 * 3 / 64 = 3)."""
    from eqsat.cost import kernel_cost, roofline

    x = _input("x", (1, 8, 8, 64))
    silu = Term("Binary", "mul", _load(x), Term("Unary", "logistic", _load(x), x.ty), x.ty)
    params = _params((1, 8, 8, 64), (320, 64, 3, 3), LAYOUTS[0], (1, 1), ((1, 1), (1, 1)))
    term = _conv_term(silu, _load(_input("w", (320, 64, 3, 3))), params)
    flops, covered = roofline.conv_prologue_flops(term)
    geometry = conv.ConvGeometry(params, (1, 8, 8, 64), (320, 64, 3, 3), parse_type(term.ty).shape)
    assert mma.conv_config(geometry).tile(geometry) == roofline.conv_tile(x.ty, "f32[320,64,3,3]", params.key,
                                                                                      term.ty) == (1, 64)
    ops = 1 + roofline.ALU_INSTRUCTIONS["logistic"]
    assert flops == ops * 8 * 8 * 64 * 27 and len(covered) == 3  # the Load is index arithmetic
    plain = _conv_term(_load(x), _load(_input("w", (320, 64, 3, 3))), params)
    assert kernel_cost(term).flops - kernel_cost(plain).flops == flops

    skip = _input("skip", (1, 8, 8, 32))
    lhs = Term("Concat", silu, Term("Unary", "neg", _load(skip), skip.ty), 3, 64, "f32[1,8,8,96]")
    padded = Term("Pad", _load(_input("w1", (320, 32, 1, 1))), Term("Lit", 0.0, "f32[]"), "0,0,0;0,0,0;1,1,0;1,1,0",
                  "f32[320,32,3,3]")
    rhs = Term("Concat", _load(_input("w3", (320, 64, 3, 3))), padded, 1, 64, "f32[320,96,3,3]")
    merged = _conv_term(lhs, rhs, _params((1, 8, 8, 96), (320, 96, 3, 3), LAYOUTS[0], (1, 1), ((1, 1), (1, 1))))
    flops, _ = roofline.conv_prologue_flops(merged)
    assert flops == ops * 8 * 8 * 64 * 27 + 1 * 8 * 8 * 32 * 3
