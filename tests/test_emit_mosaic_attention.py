"""The Mosaic GPU attention template (`emit/mosaic/attention.py`) in GPU interpret mode (simulated
SMEM, warpgroups, barriers, TMA): the template against a float64 softmax on adversarial values
(logits ~1e4 and ~3e8, all-equal scores, equal logits ~2.5e9, rows masked by -inf or finfo.min,
keys finite only in the masked tail block; every output within v's range over its weighted keys), plans emitted with `backend="mosaic"` against the XLA emitter and `jax.jit` (77 tokens,
heads of 40, CLIP's causal bias, batch 1-2), the Triton fallback, and one compile for sm_90a
without a GPU at an SD 1.5 shape (PTX: wgmma, TMA, no spills).

One interpreted kernel costs ~10 s here: shapes are tiny (every test here runs in under 15 s)."""

from __future__ import annotations

import re
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
from emit.mosaic import attention as ma
from emit.pallas import XlaFallbackWarning

# --- the template against float64 ------------------------------------------------------------------


def causal(q_len, kv_len, fill=np.finfo(np.float32).min):
    return np.where(np.arange(q_len)[:, None] >= np.arange(kv_len)[None, :], 0.0, fill).astype(np.float32)


def float64_attention(q, k, v, scale, bias):
    """softmax(q kᵀ scale + bias) v in float64 over `[batch, heads, seq, head]` (a row with no finite
    score is NaN, as `jax.nn.softmax` gives) and the largest |q kᵀ scale|."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    logits = scores if bias is None else scores + np.asarray(bias, np.float64)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", weights, v), float(np.abs(scores).max())


def adversarial_bias(rng, q_len, kv_len):
    """Random finite logits with rows of -inf (NaN out), of finfo.min (uniform weights), finite only
    at the last key (in the masked tail block) and finite only at the first key."""
    bias = rng.normal(size=(q_len, kv_len)).astype(np.float32) * 3
    for row, fill in zip(range(0, q_len, 4), [-np.inf, np.finfo(np.float32).min, "last", "first"] * q_len):
        if fill == "last":
            bias[row, :-1] = -np.inf
        elif fill == "first":
            bias[row, 1:] = -np.inf
        else:
            bias[row] = fill
    return bias[None, None]


def assert_within_values(out, v, bias):
    """Each output lane is an average of v over the keys its row can weight (a finite bias): between
    their least and greatest value, up to the 16-bit rounding of P and of the output. Holds at any
    logit magnitude, where the float64 comparison's tolerance (float32 scores) grows with the logits."""
    v = np.asarray(v, np.float64)[:, :, None]  # [batch, heads, 1, kv, head]
    shape = out.shape[:3] + (v.shape[3],)
    weighted = np.ones(shape, bool) if bias is None else np.broadcast_to(np.asarray(bias) > -np.inf, shape)
    low = np.where(weighted[..., None], v, np.inf).min(axis=3)
    high = np.where(weighted[..., None], v, -np.inf).max(axis=3)
    rows = weighted.any(axis=3)[..., None] & np.ones(out.shape, bool)
    slack = 2e-2 * float(np.abs(v).max())
    assert np.all(np.isfinite(out[rows])), "a non-finite output where some key has a finite logit"
    assert np.all((out[rows] >= low[rows] - slack) & (out[rows] <= high[rows] + slack)), \
        f"outside v's range by {max(float(np.max(low[rows] - out[rows])), float(np.max(out[rows] - high[rows])))}"


def check_against_float64(q, k, v, scale, bias, blocks, layouts=ma.Layouts()):
    out = ma.build(q, k, v, scale=scale, bias=bias, blocks=blocks, layouts=layouts, interpret=True)
    out = np.asarray(out, np.float64)
    assert out.shape == q.shape
    expected, max_logit = float64_attention(q, k, v, scale, bias)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert_within_values(out, v, bias)
    atol = 2e-2 + 16 * np.finfo(np.float32).eps * max_logit * float(np.abs(np.asarray(v, np.float64)).max())
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=atol, equal_nan=True)


def operands(rng, batch, q_len, kv_len, heads, head_dim, dtype, values):
    q = rng.standard_normal((batch, heads, q_len, head_dim))
    k = rng.standard_normal((batch, heads, kv_len, head_dim))
    v = rng.standard_normal((batch, heads, kv_len, head_dim))
    if values == "huge":  # logits ~1e4: q, k ~ 100
        q, k = 100 * q, 100 * k
    elif values == "extreme":  # every q, k 2e4 (fp16's range): all logits equal, ~2.5e9 at scale 40^-0.5
        q, k = np.full_like(q, 2e4), np.full_like(k, 2e4)
    elif values == "tiny":  # scores ~1e-6, v near fp16's smallest normal
        q, k, v = 1e-3 * q, 1e-3 * k, 1e-4 * v
    elif values == "offset":  # every score offset by ~1e3 against a spread of ~1
        q, k = q + 30.0, k + 30.0
    elif values == "equal":  # every key equal: uniform weights over exactly the real keys
        k = np.broadcast_to(k[:, :, :1], k.shape)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def test_77_tokens_heads_of_40_causal_two_warpgroups():
    """CLIP's shape, tiny: 77 queries (two compute warpgroups of 64 rows, the second mostly padding),
    77 keys (one full block, one masked tail of 13), 2 heads of 40 (padded to 48), causal finfo.min bias."""
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, 1, 77, 77, 2, 40, jnp.float16, "normal")
    check_against_float64(q, k, v, 40**-0.5, causal(77, 77)[None, None], ma.AttentionBlocks(64, 64, 2, 2))


@pytest.mark.parametrize("values", ["huge", "equal"])
def test_adversarial_scores_without_bias(values):
    """Base-2 path (no bias, scale·log2 e <= 1): logits ~1e4, or all-equal scores over 77 keys whose
    padded slots must get no weight; one compute warpgroup, bf16, q and v read head-major."""
    rng = np.random.default_rng(1)
    q, k, v = operands(rng, 1, 40, 77, 2, 40, jnp.bfloat16, values)
    check_against_float64(q, k, v, 40**-0.5, None, ma.AttentionBlocks(64, 64, 2, 1), ma.Layouts(False, False))


def test_adversarial_bias_rows_natural_scale():
    """A bias with -inf rows (NaN, as softmax), finfo.min rows (uniform), rows finite only at the last
    key (in the tail block) or the first; a scale of 3e3 (scores stay natural); 2 batches, 130 keys
    (two full blocks through a 2-slot ring, then the tail)."""
    rng = np.random.default_rng(2)
    q, k, v = operands(rng, 2, 20, 130, 1, 40, jnp.float16, "normal")
    check_against_float64(q, k, v, 3e3, adversarial_bias(rng, 20, 130), ma.AttentionBlocks(64, 64, 2, 1),
                          ma.Layouts(True, False))


def test_a_one_slot_ring():
    """130 keys through a ring of one slot (what `build` falls back to when SMEM is short): the memory
    warpgroup refills the slot only after both MMAs of the step have read it."""
    rng = np.random.default_rng(9)
    q, k, v = operands(rng, 1, 20, 130, 1, 40, jnp.float16, "normal")
    check_against_float64(q, k, v, 40**-0.5, causal(20, 130)[None, None], ma.AttentionBlocks(64, 64, 1, 1))


@pytest.mark.parametrize("head_dim,kv_len", [(80, 77), (160, 130)])
def test_heads_of_80_and_160(head_dim, kv_len):
    """Head dims that wgmma takes as they are (multiples of 16), 32/64-byte swizzles, a float32 result;
    77 keys in one masked step, or 130 in two full blocks through a 2-slot ring and a masked tail."""
    rng = np.random.default_rng(3)
    q, k, v = operands(rng, 1, 64, kv_len, 1, head_dim, jnp.float16, "normal")
    out = ma.build(q, k, v, scale=head_dim**-0.5, out_dtype=jnp.float32, interpret=True)
    assert out.dtype == jnp.float32
    expected, _ = float64_attention(q, k, v, head_dim**-0.5, None)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_adversarial_property(data):
    """Random forms against float64: fp16/bf16; 1, 20 or 77 queries (one or two compute warpgroups);
    10 (a tail only), 64 (no tail), 77 or 130 keys (a tail after one or two full blocks, a ring of
    2 refilled); heads of 16, 24 (padded to 32), 40 (to 48) and 80; logits ~1e4 (~3e8 at a scale of
    3e3), offset by ~1e3, tiny, all equal, or all equal at ~2.5e9 (fp16's range); no bias, causal with -inf or finfo.min, or rows masked whole / but one key; scales
    1/sqrt(d) (base-2 path) or 3e3 (natural); either layout of q and v."""
    dtype = data.draw(st.sampled_from([jnp.float16, jnp.bfloat16]), "dtype")
    q_len = data.draw(st.sampled_from([1, 20, 77]), "q_len")
    kv_len = data.draw(st.sampled_from([10, 64, 77, 130]), "kv_len")
    head_dim = data.draw(st.sampled_from([16, 24, 40, 80]), "head_dim")
    values = data.draw(st.sampled_from(["normal", "huge", "tiny", "offset", "equal", "extreme"]), "values")
    bias_kind = data.draw(st.sampled_from(["none", "causal_inf", "causal_min", "rows"]), "bias")
    scale = data.draw(st.sampled_from([head_dim**-0.5, 3e3]), "scale")
    layouts = ma.Layouts(data.draw(st.booleans(), "q_seq_major"), data.draw(st.booleans(), "v_seq_major"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), "seed"))
    q, k, v = operands(rng, 1, q_len, kv_len, 2, head_dim, dtype, values)
    bias = {"none": None, "causal_inf": causal(q_len, kv_len, -np.inf)[None, None],
            "causal_min": causal(q_len, kv_len)[None, None]}.get(bias_kind)
    if bias_kind == "rows":
        bias = adversarial_bias(rng, q_len, kv_len)
    check_against_float64(q, k, v, scale, bias, None, layouts)


@pytest.mark.parametrize("kv_len", [10, 130])
def test_huge_natural_scores(kv_len):
    """Issue 17's bug (found by the property in session 10): logits ~3e8 (q, k ~ 100, a scale of
    3e3) gave inf rows. The max was taken over `s · scale` rounded but the exponent computed as
    `s · scale - m` contracted into one FMA (XLA's CPU fusions here; the sm_90a PTX did the same):
    the max key's p came out ~8e5, past fp16. 10 keys (the tail step alone) and 130 (two full
    blocks and a tail); the scores now stay unscaled and the scale goes into the exponent."""
    rng = np.random.default_rng(55)
    q, k, v = operands(rng, 1, 1, kv_len, 2, 40, jnp.float16, "huge")
    check_against_float64(q, k, v, 3e3, None, None, ma.Layouts(False, False))


def test_equal_logits_at_fp16_range_average_every_key():
    """q = k = 2e4: every logit ~2.5e9 at a scale of 40^-0.5, all equal, so each row averages v over
    its 77 keys. The one-FMA base-2 form, `2^(s · scale·log2 e - m)` with m = max(s) · scale·log2 e
    rounded, gave the max key `2^(±2^7)` (m's rounding error): NaN rows. Causal finfo.min bias too."""
    rng = np.random.default_rng(11)
    q, k, v = operands(rng, 1, 20, 77, 1, 40, jnp.float16, "extreme")
    for bias in (None, causal(20, 77)[None, None]):
        out = np.asarray(ma.build(q, k, v, scale=40**-0.5, bias=bias, interpret=True), np.float64)
        weights = np.ones((20, 77)) if bias is None else (bias[0, 0] == 0)
        expected = weights @ np.asarray(v, np.float64)[0, 0] / weights.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(out[0, 0], expected, rtol=0, atol=4e-3)


@pytest.mark.parametrize("scale,sign,unit", [(40**-0.5, 1.0, 40**-0.5 * ma.LOG2_E), (3e3, 1.0, 3e3 * ma.LOG2_E),
                                             (-2.0, -1.0, 2.0 * ma.LOG2_E), (0.0, 0.0, ma.LOG2_E),
                                             (1e-46, 0.0, ma.LOG2_E), (3e38, 0.0, ma.LOG2_E)])
def test_exponent_unit(scale, sign, unit):
    """Without a bias the scores stay unscaled (negated for a negative scale: the max is then the
    least score) unless the unit is no normal float32; with a bias they are natural."""
    assert ma.exponent_unit(scale, False) == (sign, unit)
    assert ma.exponent_unit(scale, True) == (0.0, ma.LOG2_E)


def test_negative_scale_with_huge_scores():
    """A negative scale (the max is the least raw score) at logits ~3e8 against float64."""
    rng = np.random.default_rng(12)
    q, k, v = operands(rng, 1, 20, 77, 1, 40, jnp.float16, "huge")
    check_against_float64(q, k, v, -3e3, None, None)


def test_blocks_and_padding():
    assert [ma.padded_head(d) for d in (40, 80, 160, 64, 8)] == [48, 80, 160, 64, 16]
    assert [ma.swizzle_bytes(d, jnp.float16) for d in (48, 80, 160, 64)] == [32, 32, 64, 128]
    assert [ma.key_quantum(h) for h in (48, 80, 160, 64)] == [16, 16, 32, 64]
    # a short context in one step, rounded to the key quantum: 77 keys -> 80 slots (96 at 160 lanes)
    assert ma.AttentionBlocks.get_default(77, 77, 40) == ma.AttentionBlocks(64, 80, 2, 2)
    assert ma.AttentionBlocks.get_default(4096, 77, 160) == ma.AttentionBlocks(64, 96, 2, 2)
    assert ma.AttentionBlocks.get_default(77, 77, 64) == ma.AttentionBlocks(64, 128, 2, 2)
    assert ma.AttentionBlocks.get_default(4096, 4096, 40) == ma.AttentionBlocks(64, 64, 3, 2)
    assert ma.AttentionBlocks.get_default(4096, 4096, 160) == ma.AttentionBlocks(64, 64, 2, 2)
    assert ma.AttentionBlocks.get_default(10, 10, 40) == ma.AttentionBlocks(64, 16, 2, 1)
    assert ma.AttentionBlocks.get_default(20, 130, 40) == ma.AttentionBlocks(64, 64, 3, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        x = jnp.zeros((1, 1, 8, 64), jnp.float16)
        ma.build(x, x, x, scale=1.0, blocks=ma.AttentionBlocks(64, 80, 2, 1), interpret=True)
    with pytest.raises(ValueError, match="64 rows"):
        ma.AttentionBlocks(block_q=128).validate()
    with pytest.raises(NotImplementedError, match="a head of 512 lanes"):  # the VAE's single head
        x = jnp.zeros((1, 1, 64, 512), jnp.float16)
        ma.build(x, x, x, scale=1.0, interpret=True)
    with pytest.raises(NotImplementedError, match="fp16 or bf16"):
        x = jnp.zeros((1, 8, 1, 16), jnp.float32)
        ma.build(x, x, x, scale=1.0, interpret=True)


# --- plans through backend="mosaic" -----------------------------------------------------------------


def emitted(fn, args):
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    assert "Attention" in [k.term.op for k in plan.kernels]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        mosaic = emit.emit(plan, "mosaic", interpret=True)(*args)
    return plan, mosaic, emit.emit(plan, "xla")(*args), jax.jit(fn)(*args)


def assert_close(actual, expected, v):
    """fp16/bf16 outputs: each side rounds p (or the scores) to 16 bits, an error of a few 16-bit eps
    of the largest |v| they average."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    atol = 2e-2 + 8 * np.finfo(np.float16).eps * float(np.abs(np.asarray(v, np.float32)).max())
    np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=atol, equal_nan=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_plan_clip_causal_attention(batch):
    """sd15's multi-head attention with CLIP's causal bias: q/k/v are [B, 77, 2·40] fp16 tensors read
    per head through reshape/transpose views, the bias a [1, 1, 77, 77] constant the template keeps
    unbroadcast."""
    from sd15.clip import causal_bias
    from sd15.layers import attention

    rng = np.random.default_rng(4 + batch)
    args = tuple((3 * rng.standard_normal((batch, 77, 2 * 40))).astype(np.float16) for _ in range(3))
    plan, mosaic, xla, jit = emitted(lambda q, k, v: attention(q, k, v, 2, bias=causal_bias(77)), args)
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    assert term.args[3].op != "Lit", "the causal bias was dropped"
    assert ma.reads_seq_major(term.args[0]) and ma.reads_seq_major(term.args[2]), "not read in place"
    assert_close(mosaic, xla, args[2])
    assert_close(mosaic, jit, args[2])


def test_plan_cross_attention_block_reads_projections_in_place():
    """sd15's cross-attention block (to_q/to_k/to_v projections, attention, to_out with a bias), fp16,
    77 image tokens over a 10-token context, 2 heads of 40: the Attention kernel reads the
    projections' [B, S, H·D] outputs per head in place; the projections run on the Mosaic matmul
    (this plan stalled in GPU interpret mode until each interpreted Mosaic kernel ran one at a time,
    `emit.mosaic.matmul.one_at_a_time`)."""
    from sd15.unet import cross_attention

    width, context_width, heads = 80, 48, 2
    rng = np.random.default_rng(8)

    def weight(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float16)

    params = {"a.to_q.weight": weight(width, width), "a.to_k.weight": weight(width, context_width),
              "a.to_v.weight": weight(width, context_width), "a.to_out.0.weight": weight(width, width),
              "a.to_out.0.bias": weight(width)}
    x = rng.standard_normal((1, 77, width)).astype(np.float16)
    context = rng.standard_normal((1, 10, context_width)).astype(np.float16)
    plan, mosaic_out, xla, jit = emitted(lambda p, x, c: cross_attention(p, "a", x, c, heads), (params, x, context))
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    assert ma.reads_seq_major(term.args[0]) and ma.reads_seq_major(term.args[2])
    # the output passes through to_out ([80 x 80] weights of 0.2): its |values| reach ~10
    assert_close(mosaic_out, xla, np.abs(np.asarray(jit, np.float32)).max())
    assert_close(mosaic_out, jit, np.abs(np.asarray(jit, np.float32)).max())


def sdpa(q, k, v):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1).astype(v.dtype), v)


def test_plan_sdpa_huge_logits_cross_lengths():
    """No bias, 20 queries x 77 keys, logits ~1e3 (q, k ~ 30), fp16, batch 2."""
    rng = np.random.default_rng(6)
    args = (30 * rng.standard_normal((2, 2, 20, 40)), 30 * rng.standard_normal((2, 2, 77, 40)),
            rng.standard_normal((2, 2, 77, 40)))
    args = tuple(x.astype(np.float16) for x in args)
    plan, mosaic, xla, jit = emitted(sdpa, args)
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    assert not ma.reads_seq_major(term.args[0]) and not ma.reads_seq_major(term.args[2])
    assert_close(mosaic, xla, args[2])
    assert_close(mosaic, jit, args[2])


@pytest.mark.parametrize("backend", ["mosaic", "pallas"])
def test_plan_huge_natural_scores_on_both_templates(backend):
    """Issue 17's inputs through a plan (no bias, a scale of 3e3, q, k ~ 100: logits ~3e8; 20
    queries x 77 keys, heads of 40) on the Mosaic and the Triton template: the Triton template's
    natural path had the same bug (NaN rows at 64 and 130 keys in interpret mode)."""
    rng = np.random.default_rng(13)
    q, k = (100 * rng.standard_normal((1, 2, n, 40)) for n in (20, 77))
    args = tuple(x.astype(np.float16) for x in (q, k, rng.standard_normal((1, 2, 77, 40))))

    def attend(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * 3e3
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1).astype(v.dtype), v)

    plan = eqsat.optimize(attend, progress=False).lower(*args).plan
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    assert float(term.args[4]) == 3e3
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        out = np.asarray(emit.emit(plan, backend, interpret=True)(*args), np.float64)
    expected, max_logit = float64_attention(*args, 3e3, None)
    assert_within_values(out, args[2], None)
    atol = 2e-2 + 16 * np.finfo(np.float32).eps * max_logit * float(np.abs(args[2]).max())
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=atol)


def test_bias_is_kept_unbroadcast_over_what_it_does_not_read():
    """CLIP's causal mask broadcast to [B, H, S, S] in the plan is materialized as [1, 1, S, S]; a
    per-head bias keeps its head axis."""
    from eqsat.term import postorder

    mask = causal(12, 12)[None, None]
    per_head = np.arange(2 * 12 * 12, dtype=np.float32).reshape(1, 2, 12, 12)

    def fn(q, k, v, per_head):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.25 + (mask + per_head)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1).astype(v.dtype), v)

    args = (*(np.ones((2, 2, 12, 16), np.float16) for _ in range(3)), per_head)
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    env = plan.program.environment(*args)
    values = {t: jnp.asarray(env[t.args[0]]) for t in postorder([term.args[3]]) if t.op == "Input"}
    values.update({t: jnp.asarray(plan.program.constants[t.args[0]]) for t in postorder([term.args[3]])
                   if t.op == "Constant"})
    bias = ma.bias_value(term.args[3], (2, 2, 12, 12), lambda t: values[t])
    assert bias.shape == (1, 2, 12, 12)
    np.testing.assert_array_equal(np.asarray(bias)[0], mask[0] + per_head[0])


def test_float32_attention_runs_through_the_triton_template_with_a_warning():
    rng = np.random.default_rng(7)
    args = tuple(rng.standard_normal((1, 1, 20, 16)).astype(np.float32) for _ in range(3))
    plan = eqsat.optimize(sdpa, progress=False).lower(*args).plan
    with pytest.warns(TritonFallbackWarning, match="float32"):
        out = emit.emit(plan, "mosaic", interpret=True)(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(emit.emit(plan, "xla")(*args)), rtol=1e-5, atol=1e-5)


# --- compiled for an H100 without a GPU ----------------------------------------------------------


@pytest.mark.parametrize("kv_len", [77, 4096])
def test_compiles_for_sm90a_with_wgmma_tma_and_no_spills(tmp_path, monkeypatch, kv_len):
    """SD 1.5's 64x64-latent attention (4096 queries, 8 heads of 40, fp16; 77 text keys or 4096
    image keys) through `backend="mosaic"`: one Mosaic GPU kernel whose PTX issues wgmma, TMA copies
    in (K, V, Q) and out, and ptxas reports no spills."""
    from benchmarks import ptx
    from measure.xla_target import compile_for_h100, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (jax.ShapeDtypeStruct((2, 8, 4096, 40), jnp.float16),
            *[jax.ShapeDtypeStruct((2, 8, kv_len, 40), jnp.float16)] * 2)
    plan = eqsat.optimize(sdpa, progress=False).lower(*args).plan
    assert [k.term.op for k in plan.kernels] == ["Attention"]
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    (ptx_path,) = tmp_path.glob("*.ptx")
    (name, counts), = ptx.read_ptx(ptx_path.read_text()).items()
    assert counts.tensor_core == "wgmma", counts
    assert counts.tma_loads >= 3, counts
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx_path.read_text()), "no TMA store"
    resources = ptx.parse_ptxas_verbose(ptx_path.with_suffix(".ptxas").read_text())[name]
    assert resources.spill_bytes == 0, resources


@pytest.mark.parametrize("head_dim,q_len,kv_len,layouts", [
    (80, 300, 130, ma.Layouts(True, False)),   # ring of 3 with bias tiles and a float32 output tile: 232 KB
    (160, 256, 256, ma.Layouts(False, True)),  # fits only with a 1-slot ring
])
def test_compiles_with_a_bias_and_a_float32_result_within_smem(head_dim, q_len, kv_len, layouts):
    """The forms GPU interpret mode cannot check the layouts of (a per-head bias loaded in the WGMMA
    layout, a float32 output tile, either operand order, an elementwise epilogue) lower and compile
    for sm_90a; the ring shrinks until the CTA's SMEM fits an H100."""
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    blocks = ma.AttentionBlocks.get_default(q_len, kv_len, head_dim)
    head = ma.padded_head(head_dim)
    assert ma.smem_bytes(blocks, blocks.stages, head, jnp.float16, jnp.float32, True) > ma.SMEM_BYTES
    args = (jax.ShapeDtypeStruct((2, 4, q_len, head_dim), jnp.float16),
            *[jax.ShapeDtypeStruct((2, 4, kv_len, head_dim), jnp.float16)] * 2,
            jax.ShapeDtypeStruct((1, 4, q_len, kv_len), jnp.float32))

    def attend(q, k, v, bias):
        return ma.build(q, k, v, scale=head_dim**-0.5, bias=bias, layouts=layouts, out_dtype=jnp.float32,
                        epilogue=lambda o: jnp.tanh(o) * 2, interpret=False)

    report = compile_for_h100(attend, *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
