"""The flash-attention Pallas template (`emit/pallas/attention.py`), in interpret mode: the template
against its plain-jnp reference, and plans of small attention functions emitted with
`backend="pallas"` against the XLA emitter and `jax.jit`. Sequence lengths and head dims are not
powers of two (77 tokens; heads of 40, 80, 160), so the padded key block and head-dim lanes are
exercised everywhere."""

from __future__ import annotations

import glob
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
from emit.pallas import XlaFallbackWarning
from emit.pallas import attention as at
from emit.pallas.triton import gather_load

TOLERANCE = {np.float32: (2e-5, 2e-5), np.float16: (2e-2, 2e-2)}  # (rtol, atol); outputs are O(1)


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))


# --- the template on hand-written closures --------------------------------------------------------

# Operand prologues that are infinite at a padded head-dim lane or key (where 0 is read): a
# template that forgot a mask would turn the scores or the output into NaN.
PROLOGUES = {"q": lambda x: jnp.log(x * x), "k": lambda x: 1 / x, "v": lambda x: 1 / x}


def run_template(q, k, v, bias, blocks=None, scale=None, prologues=PROLOGUES):
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale

    def operand(position, length, name):
        def tile(refs, index, mask):
            b, h, s, d = index
            x = gather_load(refs[position], ((b * heads + h) * length + s) * head_dim + d, mask)
            return prologues[name](x).astype(x.dtype)
        return tile

    def bias_tile(refs, index, mask):
        b, h, rows, cols = index
        return gather_load(refs[3], rows * kv_len + cols, mask)

    problem = at.AttentionProblem(batch, heads, q_len, kv_len, head_dim, operand(0, q_len, "q"),
                                  operand(1, kv_len, "k"), operand(2, kv_len, "v"),
                                  bias_tile if bias is not None else None, scale,
                                  lambda refs, acc, index, mask: acc, q.dtype)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    return at.build(problem, inputs, blocks=blocks, interpret=True)


def template_reference(q, k, v, bias, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (PROLOGUES[name](jnp.asarray(x)).astype(x.dtype) for name, x in zip("qkv", (q, k, v)))
    return at.reference(q, k, v, scale, None if bias is None else bias[None, None])


def causal(q_len, kv_len, fill=np.finfo(np.float32).min):
    return np.where(np.arange(q_len)[:, None] >= np.arange(kv_len)[None, :], 0.0, fill).astype(np.float32)


def normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def away_from_zero(rng, shape, dtype):
    """Magnitudes in [0.5, 2] with random signs: the prologues above stay finite and O(1)."""
    return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 2.0, shape)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_causal_77_tokens_head_dim_40(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (away_from_zero(rng, (2, 2, 77, 40), dtype) for _ in range(3))
    bias = causal(77, 77)
    out = run_template(q, k, v, bias, at.AttentionBlocks(32, 32))  # 3 query blocks, 3 key blocks
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, template_reference(q, k, v, bias), dtype)


@pytest.mark.parametrize("head_dim,q_len,kv_len", [(80, 77, 10), (160, 20, 77)])
def test_head_dims_80_160_and_cross_lengths(head_dim, q_len, kv_len):
    rng = np.random.default_rng(1)
    q = away_from_zero(rng, (1, 2, q_len, head_dim), np.float16)
    k, v = (away_from_zero(rng, (1, 2, kv_len, head_dim), np.float16) for _ in range(2))
    assert_close(run_template(q, k, v, None), template_reference(q, k, v, None), np.float16)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim,splits", [(512, None), (64, 4), (48, 1)])
def test_output_lanes_split_over_programs(dtype, head_dim, splits):
    """The VAE's 512-lane head by default splits its output lanes over 2 programs per query block
    (`AttentionBlocks.value_splits`), each recomputing the scores; 64 lanes forced into 4 splits of
    16; 77 queries against 45 keys with a -3e38 bias row and q ~ 30 (logits ~ 1e3 at 512 lanes),
    against the reference."""
    rng = np.random.default_rng(8)
    q = away_from_zero(rng, (1, 1, 77, head_dim), dtype) * dtype(30 if head_dim == 512 else 1)
    k, v = (away_from_zero(rng, (1, 1, 45, head_dim), dtype) for _ in range(2))
    bias = causal(77, 45, fill=-3e38)
    blocks = at.AttentionBlocks.get_default(77, 45, head_dim)
    if splits is not None:
        blocks = at.AttentionBlocks(32, 16, value_splits=splits)
    assert blocks.value_splits == (2 if head_dim == 512 else splits)
    prologues = {"q": lambda x: x, "k": lambda x: 1 / x, "v": lambda x: 1 / x}
    out = run_template(q, k, v, bias, blocks, prologues=prologues)
    qr, kr, vr = (prologues[n](jnp.asarray(x)).astype(x.dtype) for n, x in zip("qkv", (q, k, v)))
    assert_close(out, at.reference(qr, kr, vr, head_dim**-0.5, bias[None, None]), dtype)


def test_a_split_head_must_be_one_piece():
    rng = np.random.default_rng(9)
    q = away_from_zero(rng, (1, 1, 16, 80), np.float32)  # 80 lanes = 64 + 16: no even split
    with pytest.raises(ValueError, match="value splits"):
        run_template(q, q, q, None, at.AttentionBlocks(16, 16, value_splits=2))


def test_rows_with_no_finite_score_are_nan_like_softmax():
    """A bias of -inf over a whole query row (and a fully masked upper block): NaN as in
    `jax.nn.softmax`, and every other row exact; a huge finite bias stays finite."""
    rng = np.random.default_rng(2)
    q, k, v = (away_from_zero(rng, (1, 1, 40, 24), np.float32) for _ in range(3))
    bias = causal(40, 40, fill=-np.inf)
    bias[5, :] = -np.inf
    bias[7, :] = -3e38
    out = run_template(q, k, v, bias, at.AttentionBlocks(16, 16))
    expected = template_reference(q, k, v, bias)
    assert np.isnan(np.asarray(out)[0, 0, 5]).all() and np.isfinite(np.asarray(out)[0, 0, 7]).all()
    assert_close(out, expected, np.float32)


def test_blocks_are_validated():
    with pytest.raises(ValueError, match="block_q=48 must be a power of two >= 16"):
        at.AttentionBlocks(48, 64).validate()
    assert at.AttentionBlocks.get_default(77, 77, 40) == at.AttentionBlocks(64, 64, num_warps=4)
    assert at.AttentionBlocks.get_default(10, 10, 40) == at.AttentionBlocks(16, 16, num_warps=4)
    assert at.AttentionBlocks.get_default(4096, 77, 40) == at.AttentionBlocks(256, 64, num_warps=16)
    assert at.AttentionBlocks.get_default(1024, 1024, 80) == at.AttentionBlocks(128, 64, num_warps=8)
    assert at.AttentionBlocks.get_default(4096, 4096, 160) == at.AttentionBlocks(128, 64, num_warps=8)
    assert at.AttentionBlocks.get_default(256, 256, 160) == at.AttentionBlocks(64, 64, num_warps=4)
    assert at.AttentionBlocks.get_default(4096, 4096, 512) == at.AttentionBlocks(64, 32, num_warps=8, value_splits=2)
    with pytest.raises(ValueError, match="value_splits=3"):
        at.AttentionBlocks(64, 64, value_splits=3).validate()


@pytest.mark.parametrize("head_dim,pieces", [
    (40, ((0, 32), (32, 16))), (80, ((0, 64), (64, 16))), (160, ((0, 128), (128, 32))), (64, ((0, 64),)),
    (8, ((0, 16),)), (77, ((0, 64), (64, 16))), (112, ((0, 64), (64, 32), (96, 16))), (512, ((0, 512),)),
])
def test_head_pieces_are_powers_of_two_covering_the_head(head_dim, pieces):
    assert at.head_pieces(head_dim) == pieces
    assert head_dim <= sum(w for _, w in pieces) < head_dim + at.MIN_DOT_BLOCK


def test_key_blocks_full_then_one_narrow_tail():
    assert (at.key_loop_trips(77, 64), at.tail_width(77, 64)) == (1, 16)  # 80 key slots for 77 keys
    assert (at.key_loop_trips(4096, 64), 4096 % 64) == (64, 0)
    assert (at.key_loop_trips(10, 16), at.tail_width(10, 16)) == (0, 16)
    assert (at.key_loop_trips(133, 64), at.tail_width(133, 64)) == (2, 16)
    assert (at.key_loop_trips(100, 64), at.tail_width(100, 64)) == (1, 64)


# --- adversarial scores: base-2 softmax, unmasked full key blocks, a narrow masked tail ----------

IDENTITY = {name: (lambda x: x) for name in "qkv"}


def float64_attention(q, k, v, bias, scale, prologues):
    """softmax(q kᵀ scale + bias) v in float64 from the prologues' values (in the operands' dtype),
    and the largest |q kᵀ scale|; a row with no finite score is NaN, as `jax.nn.softmax` gives."""
    q, k, v = (np.asarray(prologues[n](jnp.asarray(x)).astype(x.dtype), np.float64) for n, x in zip("qkv", (q, k, v)))
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    logits = scores if bias is None else scores + np.asarray(bias, np.float64)
    peak = logits.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - peak)
        weights = weights / weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", weights, v), float(np.abs(scores).max())


def adversarial_bias(rng, kind, q_len, kv_len):
    """None, or a float32 [q_len, kv_len] bias: causal with -inf or finfo.min, or random finite with
    rows of -inf (NaN out), rows of finfo.min (uniform weights), rows finite only at the last key
    (in the tail block) and rows finite only at the first key."""
    if kind == "none":
        return None
    if kind == "causal_inf":
        return causal(q_len, kv_len, -np.inf)
    if kind == "causal_min":
        return causal(q_len, kv_len)
    bias = rng.normal(size=(q_len, kv_len)).astype(np.float32) * 3
    for row, fill in zip(range(0, q_len, 4), [-np.inf, np.finfo(np.float32).min, "last", "first"] * q_len):
        if fill == "last":
            bias[row, :-1] = -np.inf
        elif fill == "first":
            bias[row, 1:] = -np.inf
        else:
            bias[row] = fill
    return bias


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_adversarial_scores_match_a_float64_softmax(data):
    """Logits of ~1e4 (base-2 path: identity prologues on values ~100; natural path: a scale of 3e3),
    all-equal scores, -inf / finfo.min masked rows and columns, key lengths with no tail (64), only a
    tail (10), one or two full blocks and a tail (77, 133), heads of 24/40/64/80, fp16 and fp32,
    against float64: the error is the rounding of the logits (|logit| eps) on O(1) outputs."""
    check_adversarial(
        dtype=data.draw(st.sampled_from([np.float32, np.float16]), "dtype"),
        q_len=data.draw(st.sampled_from([1, 20, 77]), "q_len"),
        kv_len=data.draw(st.sampled_from([10, 64, 77, 133]), "kv_len"),
        head_dim=data.draw(st.sampled_from([24, 40, 64, 80]), "head_dim"),
        values=data.draw(st.sampled_from(["normal", "huge", "huge_natural", "equal"]), "values"),
        bias_kind=data.draw(st.sampled_from(["none", "causal_inf", "causal_min", "rows"]), "bias"),
        blocks=data.draw(st.sampled_from([None, at.AttentionBlocks(16, 16), at.AttentionBlocks(32, 64)]), "blocks"),
        seed=data.draw(st.integers(0, 2**16), "seed"))


@pytest.mark.parametrize("values,bias_kind", [("huge", "none"), ("huge_natural", "rows")])
def test_adversarial_scores_in_256_row_tiles(values, bias_kind):
    """The UNet 64² tiles (256 query rows, 16 warps) on 300 queries (the second block mostly
    padding) and 77 keys, fp16."""
    check_adversarial(np.float16, 300, 77, 40, values, bias_kind, at.AttentionBlocks(256, 64, num_warps=16), 11)


def check_adversarial(dtype, q_len, kv_len, head_dim, values, bias_kind, blocks, seed):
    rng = np.random.default_rng(seed)
    shape_q, shape_kv = (1, 2, q_len, head_dim), (1, 2, kv_len, head_dim)
    scale, prologues = head_dim**-0.5, PROLOGUES
    if values == "huge":  # scale·log2 e <= 1: scores go straight to base 2
        prologues = IDENTITY
        q, k = normal(rng, shape_q, dtype, 100.0), normal(rng, shape_kv, dtype, 100.0)
    else:
        q, k = away_from_zero(rng, shape_q, dtype), away_from_zero(rng, shape_kv, dtype)
        if values == "huge_natural":
            scale = 3e3  # scale·log2 e > 1: natural scores, differences to base 2
        if values == "equal":
            k = np.broadcast_to(k[:, :, :1], shape_kv).copy()
    v = away_from_zero(rng, shape_kv, dtype)
    bias = adversarial_bias(rng, bias_kind, q_len, kv_len)
    out = np.asarray(run_template(q, k, v, bias, blocks, scale=scale, prologues=prologues), np.float64)
    expected, max_logit = float64_attention(q, k, v, bias, scale, prologues)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    v_max = float(np.abs(np.asarray(prologues["v"](jnp.asarray(v)), np.float64)).max())
    atol = (2e-2 if dtype == np.float16 else 1e-5) + 16 * np.finfo(np.float32).eps * max_logit * v_max
    np.testing.assert_allclose(out, expected, rtol=2e-2 if dtype == np.float16 else 1e-5, atol=atol, equal_nan=True)


def test_all_equal_scores_average_the_real_keys_only():
    """Constant scores over 77 keys (one full block of 64 and a 16-slot tail of 13): uniform weights
    over exactly the 77 keys, whatever the padded slots of k and v hold (their prologues are inf)."""
    rng = np.random.default_rng(7)
    q = away_from_zero(rng, (1, 1, 77, 40), np.float32)
    k = np.broadcast_to(away_from_zero(rng, (1, 1, 1, 40), np.float32), (1, 1, 77, 40)).copy()
    v = away_from_zero(rng, (1, 1, 77, 40), np.float32)
    out = run_template(q, k, v, None, at.AttentionBlocks(64, 64))
    expected = np.broadcast_to((1 / v).mean(axis=2, keepdims=True), out.shape)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


# --- plans of JAX functions -----------------------------------------------------------------------


def emitted(fn, args):
    plan = eqsat.optimize(fn).lower(*args).plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = emit.emit(plan, "pallas", interpret=True)(*args)
    return pallas, emit.emit(plan, "xla")(*args), jax.jit(fn)(*args), plan


def sdpa(q, k, v):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1).astype(v.dtype), v)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_plan_attention_77_tokens_head_dim_40(dtype):
    rng = np.random.default_rng(3)
    args = tuple(normal(rng, (2, 2, 77, 40), dtype) for _ in range(3))
    pallas, xla, jit, plan = emitted(sdpa, args)
    assert [k.term.op for k in plan.kernels] == ["Attention"]
    assert_close(pallas, xla, dtype)
    assert_close(pallas, jit, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("values", ["huge", "equal"])
def test_plan_attention_adversarial_scores(dtype, values):
    """77 tokens, head dim 40: logits ~1e4 (q, k ~ 100) or all-equal scores (k's rows equal)."""
    rng = np.random.default_rng(6)
    if values == "huge":
        args = (normal(rng, (1, 2, 77, 40), dtype, 100.0), normal(rng, (1, 2, 77, 40), dtype, 100.0),
                normal(rng, (1, 2, 77, 40), dtype))
    else:
        k = np.broadcast_to(normal(rng, (1, 2, 1, 40), dtype), (1, 2, 77, 40)).copy()
        args = (normal(rng, (1, 2, 77, 40), dtype), k, normal(rng, (1, 2, 77, 40), dtype))
    pallas, xla, jit, plan = emitted(sdpa, args)
    assert [k.term.op for k in plan.kernels] == ["Attention"]
    q, k, v = (np.asarray(x, np.float64) for x in args)
    max_logit = float(np.abs(np.einsum("bhqd,bhkd->bhqk", q, k)).max()) * 40**-0.5
    atol = TOLERANCE[dtype][1] + 16 * np.finfo(np.float32).eps * max_logit * float(np.abs(v).max())
    for other in (xla, jit):
        np.testing.assert_allclose(np.asarray(pallas, np.float32), np.asarray(other, np.float32),
                                   rtol=TOLERANCE[dtype][0], atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_plan_attention_head_dim_512_splits_its_output_lanes(dtype):
    """The VAE's one head of 512 lanes (two programs per query block share its output lanes), 40
    queries and 21 keys, q ~ 20 (logits ~ 400): against the XLA emitter and `jax.jit`."""
    rng = np.random.default_rng(7)
    args = (normal(rng, (1, 1, 40, 512), dtype, 20.0), normal(rng, (1, 1, 21, 512), dtype),
            normal(rng, (1, 1, 21, 512), dtype))
    assert at.AttentionBlocks.get_default(40, 21, 512).value_splits == 2
    pallas, xla, jit, plan = emitted(sdpa, args)
    assert [k.term.op for k in plan.kernels] == ["Attention"]
    assert_close(pallas, xla, dtype)
    assert_close(pallas, jit, dtype)


def test_plan_clip_causal_attention_reads_heads_through_views():
    """sd15's multi-head attention with CLIP's causal bias: q/k/v are [B, S, H*D] tensors read
    per head through reshape/transpose views, the bias a [1, 1, S, S] constant broadcast."""
    from sd15.clip import causal_bias
    from sd15.layers import attention

    rng = np.random.default_rng(4)
    q, k, v = (normal(rng, (2, 77, 4 * 40), np.float32) for _ in range(3))
    pallas, xla, jit, plan = emitted(lambda q, k, v: attention(q, k, v, 4, bias=causal_bias(77)), (q, k, v))
    (term,) = [k.term for k in plan.kernels if k.term.op == "Attention"]
    assert term.args[3].op != "Lit", "the causal bias was dropped"
    assert_close(pallas, xla, np.float32)
    assert_close(pallas, jit, np.float32)


def test_plan_cross_attention_with_a_short_context():
    from sd15.unet import cross_attention

    width, context_width, heads = 80, 48, 2
    rng = np.random.default_rng(5)
    params = {"a.to_q.weight": normal(rng, (width, width), np.float32, 0.2),
              "a.to_k.weight": normal(rng, (width, context_width), np.float32, 0.2),
              "a.to_v.weight": normal(rng, (width, context_width), np.float32, 0.2),
              "a.to_out.0.weight": normal(rng, (width, width), np.float32, 0.2),
              "a.to_out.0.bias": normal(rng, (width,), np.float32)}
    x, context = normal(rng, (1, 77, width), np.float32), normal(rng, (1, 10, context_width), np.float32)
    pallas, xla, jit, plan = emitted(lambda p, x, c: cross_attention(p, "a", x, c, heads), (params, x, context))
    assert "Attention" in [k.term.op for k in plan.kernels]
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(jit), rtol=1e-4, atol=1e-4)


# --- compiled for an H100 (no GPU needed) ------------------------------------------------------------


def test_compiles_for_sm90_with_tensor_cores(tmp_path):
    """CLIP-like causal attention, 8 heads of 80 over 77 tokens, fp16: one Pallas kernel, wgmma/mma."""
    from measure.xla_target import compile_for_h100

    bias = causal(77, 77)[None, None]

    def masked(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * 80**-0.5 + bias
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1).astype(v.dtype), v)

    args = [jax.ShapeDtypeStruct((2, 8, 77, 80), jnp.float16)] * 3
    plan = eqsat.optimize(masked).lower(*args).plan
    assert [k.term.op for k in plan.kernels] == ["Attention"]
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args, keep_dump=tmp_path / "dump")
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.kernels == 1 and set(report.by_category) == {"Pallas (Triton)"}, report.by_category
    ptx = "".join(open(path).read() for path in glob.glob(str(tmp_path / "dump" / "*.ptx")))
    assert re.search(r"\b(wgmma\.mma_async|mma\.sync)\.\S*f16", ptx), "no tensor-core instruction in the PTX"


def test_sm90_key_loop_is_base2_and_unmasked(tmp_path):
    """The template alone (heads of 40, 205 keys: three full blocks of 64 in the loop and a 16-slot
    tail, fp16) compiled for sm_90a, its PTX read by `benchmarks.attention_ptx`: per score of a full
    key block one `ex2.approx` and one FMA (s · scale·log2 e - m), no key mask (setp/selp only per
    row, on the padded lanes of the 16-lane head piece and as the k/v loads' predicates), under 20 instructions (50 before, with
    accurate exp and masks on every block), and no spills."""
    from benchmarks import attention_ptx
    from measure import xla_target

    if xla_target.unavailable_reason() is not None:
        pytest.skip(str(xla_target.unavailable_reason()))
    row = attention_ptx.measure(attention_ptx.Shape("sm90", 1, 2, 256, 3 * 64 + 13, 40, 1), tmp_path)
    kinds = row["loop_kinds_per_score"]
    assert row["loop_trips"] == 3 and row["blocks"]["block_k"] == 64, row
    assert 1.0 <= kinds["ex2"] <= 1.1 and kinds["fma"] >= 1.0, kinds
    # setp/selp: the per-row guards, and the predicates and zero fills of the (unclamped, vectorized)
    # k/v tile loads: 15.7 instructions per score with them against 17.8 with clamped scalar loads.
    assert kinds.get("setp", 0) <= 0.25 and kinds.get("selp", 0) <= 0.5, kinds
    assert row["loop_per_score"] < 20, row["loop_per_score"]
    assert row["spill_bytes"] == 0, row


def test_ptx_reader_counts_the_loop_body_one_statement_per_instruction():
    """`benchmarks.attention_ptx.read_kernel` on a hand-written kernel: inline-asm lines hold several
    statements, predicated ones count under their opcode, the loop is the label to the branch back."""
    from benchmarks.attention_ptx import kind, opcode, read_kernel, statements

    ptx = """
.visible .entry attention(
	.param .u64 .ptr .align 16 attention_param_0
)
.reqntid 128, 1, 1
{
	.reg .pred 	%p<3>;
	ld.param.b64 	%rd1, [attention_param_0];   // a comment; with a semicolon
$L__BB0_1:
	// begin inline asm
	mov.u16 %rs1, 0x0; @%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
	// end inline asm
	ex2.approx.ftz.f32 	%r2, %r1;
	setp.lt.s32 	%p2, %r3, 4;
	@%p2 bra 	$L__BB0_1;
	ret;
}
"""
    kernel = read_kernel(ptx)
    assert (kernel.threads, kernel.instructions, kernel.loop_instructions) == (128, 7, 5)
    assert kernel.loop_kinds == {"mov": 1, "ld.global": 1, "ex2": 1, "setp": 1, "bra": 1}
    assert [kind(opcode(s)) for s in statements("@!%p1 st.shared.b16 [%r1], %rs1;")] == ["st.shared"]


def test_sm90_vae_head_of_512_lanes_loads_vectors_without_spilling(tmp_path):
    """The VAE's mid-block attention (one head of 512 lanes over 4096 tokens, q/k/v slices of one
    fused projection plus a bias, fp16) compiled for sm_90a: k and v are read masked rather than
    clamped (16-byte loads) and the output lanes are split over 2 programs per query block, so
    nothing spills (one program accumulating 512 lanes spilled 504 B, 1,304 B with vector loads)."""
    from benchmarks import ptx
    from measure.xla_target import compile_for_h100

    def vae_attention(qkv, bias):
        q, k, v = (qkv[..., i * 512:(i + 1) * 512] + bias[i] for i in range(3))
        return sdpa(*(x[:, None] for x in (q, k, v)))

    args = [jax.ShapeDtypeStruct((1, 4096, 1536), jnp.float16), jax.ShapeDtypeStruct((3, 512), jnp.float16)]
    plan = eqsat.optimize(vae_attention).lower(*args).plan
    assert "Attention" in [k.term.op for k in plan.kernels]
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args, keep_dump=tmp_path / "dump")
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    rows = []
    for path in glob.glob(str(tmp_path / "dump" / "*.ptx")):
        if ".entry" not in open(path).read():
            continue
        counts, resources = ptx.read_ptx(open(path).read()), ptx.run_ptxas(path)
        rows += [(counts[name], resources[name]) for name in counts if "attention" in name]
    [(counts, resources)] = rows
    assert resources.spill_bytes == 0, resources
    assert counts.vector_load_bytes >= 0.9 * counts.global_load_bytes, counts
