"""Attention and normalization fuse whatever the spelling (benchmarks/spellings.py): each spelling
plans its fused kernel and computes what jax.jit computes (XLA emitter; Pallas interpret on a few);
`lowered.explain()` names the blocker of a spelling that does not fuse and has no entry for fused ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from benchmarks.spellings import SPELLINGS, is_fused, statistics_passes
from eqsat.rules.attention import _where_not_low_enough

FUSED = list(SPELLINGS)  # every spelling fuses


def _tolerance(args):
    return 2e-2 if any(np.asarray(a).dtype == np.float16 for a in args) else 2e-5


def _lower(name, backend="xla", seed=0):
    spelling = SPELLINGS[name]
    args = spelling.args(np.random.default_rng(seed))
    return spelling, args, eqsat.optimize(spelling.fn, progress=False, backend=backend).lower(*args)


@pytest.mark.parametrize("name", FUSED)
def test_spelling_fuses_and_matches_jit(name):
    spelling, args, lowered = _lower(name)
    kinds = lowered.plan.kinds()
    if spelling.family == "attention":
        assert kinds.get("attention") == 1 and not kinds.get("matmul"), kinds
    else:
        assert statistics_passes(lowered) == spelling.norms, kinds
    assert is_fused(spelling, lowered)
    assert [m for m in lowered.explain() if m.family == "attention"] == []
    expected = np.asarray(jax.jit(spelling.fn)(*args), np.float32)
    tol = _tolerance(args)
    np.testing.assert_allclose(np.asarray(lowered(*args), np.float32), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", [
    "attention: einsum bthd", "attention: / jnp.sqrt(d) at run time", "attention: where(mask, s, finfo.min)",
    "attention: where(mask, s, -inf)", "attention: flax causal, fp16", "layernorm: flax (E[x²]-E[x]²)",
    "attention: jax.nn.dot_product_attention", "attention: jax.nn.dot_product_attention causal",
    "attention: equinox MultiheadAttention (no batch axis)", "attention: equinox MultiheadAttention, fp16",
    "attention: jax.nn.dot_product_attention GQA causal", "attention: GQA, kv heads jnp.repeat-ed, fp16",
])
def test_spelling_pallas_interpret_matches_jit(name):
    spelling, args, lowered = _lower(name, backend="pallas")
    expected = np.asarray(jax.jit(spelling.fn)(*args), np.float32)
    tol = _tolerance(args)
    got = np.asarray(lowered.executable("pallas", interpret=True)(*args), np.float32)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


def test_fully_masked_rows_stay_uniform():
    """where(mask, s, finfo.min) over a row with every key masked is the mean of v, as jax computes it."""
    spelling = SPELLINGS["attention: where(mask, s, finfo.min)"]
    q, k, v = spelling.args(np.random.default_rng(1))
    mask = np.tril(np.ones((9, 9), bool))
    mask[4] = False

    def f(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    lowered = eqsat.optimize(f, progress=False, backend="xla").lower(q, k, v)
    assert lowered.plan.kinds().get("attention") == 1, lowered.plan.kinds()
    got = np.asarray(lowered(q, k, v))
    np.testing.assert_allclose(got, np.asarray(jax.jit(f)(q, k, v)), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[:, :, 4], v.mean(axis=2), rtol=2e-5, atol=2e-5)


def _two_axis_contraction(q, k, v):
    """Scores contracted over two axes (head dim split in two): not a single-D attention."""
    s = jnp.einsum("bhqxd,bhkxd->bhqk", q, k)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def test_explain_names_the_layout_blocker_of_unfused_attention():
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 7, 2, 4)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, 7, 5)).astype(np.float32)
    lowered = eqsat.optimize(_two_axis_contraction, progress=False, backend="xla").lower(q, k, v)
    assert lowered.plan.kinds().get("matmul") == 2 and not lowered.plan.kinds().get("attention")
    missed = [m for m in lowered.explain() if m.family == "attention"]
    assert [m.kind for m in missed] == ["matmul"], missed
    assert "one contracting axis" in missed[0].needed and "dims '4,3;4,3;0,1;0,1'" in missed[0].found, missed[0]
    assert "-> f32[1,2,7,7]" in missed[0].found, missed[0]
    assert "attention: QK matmul" in lowered.report()


def test_explain_names_the_value_layout_of_an_unfused_pv():
    """V with two free axes ([B, H, S, X, D] read as values of width X·D): not Attention's [B, H, Sk, D]."""
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, 5, 3, 4)).astype(np.float32)

    def f(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5, axis=-1)
        return jnp.einsum("bhqk,bhkxd->bhqxd", p, v)

    lowered = eqsat.optimize(f, progress=False, backend="xla").lower(q, k, v)
    assert lowered.plan.kinds().get("matmul") == 2
    (missed,) = [m for m in lowered.explain() if m.family == "attention"]
    assert missed.found.startswith("PV matmul is dot_general(f32[1,2,5,5], f32[1,2,5,3,4]"), missed
    assert "one contracted and one free axis" in missed.needed, missed


def test_grouped_queries_fuse_whatever_the_group_layout():
    """jax.nn.dot_product_attention's grouped queries (G query heads per K/V head, the group axis moved
    in front of the batch axes) plan one attention kernel reading each K/V head for its G query heads;
    also with one K/V head (multi-query) and G = 1 (plain multi-head)."""
    rng = np.random.default_rng(3)
    for heads, kv_heads in ((4, 2), (5, 1), (3, 3)):
        q = rng.standard_normal((2, 7, heads, 40)).astype(np.float32) * 3 + 50  # offset large against the spread
        k, v = (rng.standard_normal((2, 77, kv_heads, 40)).astype(np.float32) for _ in range(2))
        fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
        lowered = eqsat.optimize(fn, progress=False, backend="xla").lower(q, k, v)
        assert lowered.plan.kinds().get("attention") == 1 and not lowered.plan.kinds().get("matmul"), lowered.plan.kinds()
        got, want = np.asarray(lowered(q, k, v)), np.asarray(jax.jit(fn)(q, k, v))
        # scores reach ~160: a float32 ulp of a score (1.5e-5) is a relative error of a probability
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        exact = _grouped_attention_float64(q, k, v)
        assert np.abs(got - exact).max() <= 2 * np.abs(want - exact).max() + 1e-6


def _grouped_attention_float64(q, k, v):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def test_explain_names_a_mask_fill_that_does_not_mask():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 7, 5)).astype(np.float32) for _ in range(3))
    mask = np.tril(np.ones((7, 7), bool))
    lowered = eqsat.optimize(lambda q, k, v: _where_not_low_enough(q, k, v, mask), progress=False,
                             backend="xla").lower(q, k, v)
    assert lowered.plan.kinds().get("matmul") == 2
    (missed,) = lowered.explain()
    assert missed.found == "softmax input is select(mask, s, -1e+04)", missed
    assert "-inf" in missed.needed and "float32's lowest" in missed.needed


def _matmul_args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)


def test_explain_has_no_entry_for_a_fused_matmul():
    lowered = eqsat.optimize(lambda x, w: jax.nn.relu(x @ w), progress=False, backend="xla").lower(*_matmul_args())
    assert lowered.plan.kinds() == {"matmul": 1}
    assert lowered.explain() == []
    assert "not fused: every heavy kernel is fused" in lowered.report()


def test_explain_names_an_epilogue_kept_out_by_another_reader():
    def f(x, w):
        h = x @ w
        return jax.nn.gelu(h) + 1.0, h

    lowered = eqsat.optimize(f, progress=False, backend="xla").lower(*_matmul_args())
    assert lowered.plan.kinds() == {"matmul": 1, "pointwise": 1}
    (missed,) = lowered.explain()
    assert (missed.family, missed.kind, missed.kernel) == ("absorb", "matmul", 0)
    assert "the program's outputs also read" in missed.found


def test_explain_names_an_epilogue_read_through_a_permute():
    lowered = eqsat.optimize(lambda x, w: jax.nn.gelu(x @ w).T, progress=False, backend="xla").lower(*_matmul_args())
    (missed,) = lowered.explain()
    assert missed.family == "absorb" and "transpose(1,0) to f32[3,4]" in missed.found, missed


def test_bthd_attention_output_permute_is_the_only_entry():
    _, _, lowered = _lower("attention: einsum bthd")
    (missed,) = lowered.explain()
    assert (missed.family, missed.kind) == ("absorb", "attention")
    assert "transpose(0,2,1,3)" in missed.found, missed


def test_explain_names_a_norm_statistic_as_the_epilogue_blocker():
    def f(x, w):
        h = x @ w
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5)

    lowered = eqsat.optimize(f, progress=False, backend="xla").lower(*_matmul_args())
    absorb = [m for m in lowered.explain() if m.family == "absorb"]
    assert absorb and all(m.kind == "matmul" for m in absorb), lowered.explain()
    assert any("a moments of it (f32[2,4], hosted in its epilogue)" in m.found and "complete only once every tile" in m.needed for m in absorb), absorb


def test_the_rule_families_model_spellings_are_sd15s_own_layers():
    """`eqsat.rules.model_spellings` (the soundness examples' GroupNorm, LayerNorm and attention,
    written without importing the model) computes what `sd15.layers` computes, bit for bit."""

    from eqsat.rules import model_spellings
    from sd15 import clip, layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(50.0, 0.01, (2, 5, 5, 6)), jnp.float16)  # offset large against the spread
    w, b = jnp.asarray(rng.normal(size=6), jnp.float32), jnp.asarray(rng.normal(size=6), jnp.float32)
    params = {"n.weight": w, "n.bias": b}
    np.testing.assert_array_equal(model_spellings.group_norm(x, w, b, 3, 1e-5), layers.group_norm(params, "n", x, 3, 1e-5))
    np.testing.assert_array_equal(model_spellings.layer_norm(x, w, b, 1e-5), layers.layer_norm(params, "n", x, 1e-5))
    q, k, v = (jnp.asarray(rng.normal(size=(2, 77, 80)), jnp.float16) for _ in range(3))  # 77 tokens, head dim 40
    bias = model_spellings.causal_bias(77)
    np.testing.assert_array_equal(bias, clip.causal_bias(77))
    np.testing.assert_array_equal(model_spellings.multi_head_attention(q, k, v, 2, bias),
                                  layers.attention(q, k, v, 2, bias=bias))
