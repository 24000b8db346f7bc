"""Rule authoring as a public API: a ruleset written outside the package, with only `eqsat.rules`
and `eqsat.lang`, goes through the soundness check and into `eqsat.optimize`.

The ruleset here is the one `notebooks/03_writing_a_fusion_rule.ipynb` builds: a mask written with
`jnp.where(mask, scores, -inf)` is an additive score bias, so masked attention becomes one
`Attention` kernel. (Since issue 20 the shipped `attention` family covers such masks itself, its
`masked_scores` rule; this ruleset stays the worked example of writing one outside the package.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from egglog import String, f64, relation, rule, ruleset, union

import eqsat
from eqsat.lang import Binary, Broadcast, Constant, Expr, Lit, Load, Pointwise, Select, Unary
from eqsat.rules import VALUE_REGIMES, Example, RuleCheckError, check, dim, flag, py_true, rules_of, tensor
from eqsat.schedule import as_schedule, default_schedule

NegInf = relation("TestRuleApiNegInf", Expr)


def _is_neg_inf_scalar(key: str) -> str:
    """Does a scalar Constant's key (`scalar:<dtype>:<value>`) hold -inf?"""
    return flag(key.startswith("scalar:") and float(key.rsplit(":", 1)[1]) == -math.inf)


def _neg_inf_rules(target):
    @target.register
    def neg_inf(e: Expr, x: Expr, key: String, ty: String, dims: String):
        """NegInf(e): e is -inf at every index (a literal, a scalar constant, or a view or copy of one)."""
        yield rule(e == Lit(f64(-math.inf), ty)).then(NegInf(e))
        yield rule(e == Load(Constant(key, ty), ty), py_true(_is_neg_inf_scalar, key)).then(NegInf(e))
        yield rule(e == Broadcast(x, dims, ty), NegInf(x)).then(NegInf(e))
        yield rule(e == Unary("convert", x, ty), NegInf(x)).then(NegInf(e))
        yield rule(e == Load(Pointwise(x, ty), ty), NegInf(x)).then(NegInf(e))


mask_bias = ruleset(name="test_mask_bias")
_neg_inf_rules(mask_bias)


@mask_bias.register
def where_is_bias(e: Expr, m: Expr, fill: Expr, s: Expr, ty: String):
    """where(m, s, -inf) = s + where(m, 0, -inf): a -inf fill is an additive bias (exact for finite s)."""
    yield rule(e == Select(m, fill, s, ty), NegInf(fill)).then(
        union(e).with_(Binary("add", s, Select(m, fill, Lit(0.0, ty), ty), ty)))


unguarded = ruleset(name="test_mask_bias_unguarded")


@unguarded.register
def any_fill_is_bias(e: Expr, m: Expr, fill: Expr, s: Expr, ty: String):
    """where(m, s, c) = s + where(m, 0, c) for any fill c: wrong unless c is -inf."""
    yield rule(e == Select(m, fill, s, ty)).then(
        union(e).with_(Binary("add", s, Select(m, fill, Lit(0.0, ty), ty), ty)))


def masked_attention(q, k, v, mask):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.5
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def masked_attention_args(draw):
    batch, heads, q_len, kv_len, head_dim = dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw)
    return (tensor(draw, (batch, heads, q_len, head_dim)), tensor(draw, (batch, heads, kv_len, head_dim)),
            tensor(draw, (batch, heads, kv_len, head_dim)), tensor(draw, (q_len, kv_len), "bool"))


def zero_masked(x, mask):
    return jnp.where(mask, x, 0.0)


def zero_masked_args(draw):
    shape = (dim(draw), dim(draw))
    return tensor(draw, shape), tensor(draw, shape, "bool")


# The law is exact for finite scores: where a masked score is NaN or +inf, `where` gives -inf and the
# sum NaN. The example states that contract; the last test shows the check holds the rule to it.
FINITE = tuple(regime for regime in VALUE_REGIMES if regime != "nonfinite")
CASES = [
    Example(masked_attention, masked_attention_args, ("where_is_bias",), regimes=FINITE),
    Example(zero_masked, zero_masked_args, ("where_is_bias",), fires=False),
]


def test_a_user_ruleset_is_named_and_checked():
    names = {info.name: info.law for _, info in rules_of(mask_bias)}
    assert set(names) == {*(f"neg_inf/{i}" for i in range(5)), "where_is_bias"}
    assert names["where_is_bias"].startswith("where(m, s, -inf) = s + where(m, 0, -inf)")
    report = check(mask_bias, examples=2, cases=CASES)
    assert report.matches["where_is_bias"] > 0 and not report.never_matched, report
    assert report.extractions > 0


def test_an_unsound_user_rule_is_caught():
    cases = [Example(zero_masked, zero_masked_args, ("any_fill_is_bias",))]
    with pytest.raises(RuleCheckError) as caught:
        check(unguarded, examples=3, cases=cases)
    assert caught.value.rule == "any_fill_is_bias" and caught.value.example == "zero_masked"


def test_a_user_ruleset_runs_with_the_shipped_families():
    args = [jax.ShapeDtypeStruct((1, 2, 7, 5), jnp.float32)] * 3 + [jax.ShapeDtypeStruct((7, 7), jnp.bool_)]
    shipped = eqsat.optimize(masked_attention, progress=False).lower(*args)
    extended = eqsat.optimize(masked_attention, rulesets=default_schedule(extra=[mask_bias]), progress=False)
    lowered = extended.lower(*args)
    assert shipped.plan.kinds() == {"attention": 1}, shipped.plan.kinds()  # masked_scores, shipped
    assert lowered.plan.kinds() == {"attention": 1}, lowered.plan.kinds()
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((1, 2, 7, 5)).astype(np.float32) for _ in range(3)]
    values.append(np.tril(np.ones((7, 7), bool)))
    np.testing.assert_allclose(np.asarray(extended(*values)), np.asarray(masked_attention(*values)),
                               rtol=1e-5, atol=1e-5)


def test_family_names_and_user_rulesets_compose_into_one_schedule():
    schedule = as_schedule(["absorb", mask_bias])
    assert schedule.names == ("absorb", "test_mask_bias")
    assert default_schedule(["absorb"], extra=[mask_bias]).names == ("absorb", "test_mask_bias")


def test_the_check_holds_a_rule_to_nonfinite_values_unless_its_contract_says_otherwise():
    def neg_inf_masked(x, mask):
        return jnp.where(mask, x, -jnp.inf)

    unbounded = [Example(neg_inf_masked, zero_masked_args, ("where_is_bias",), regimes=("nonfinite",))]
    with pytest.raises(RuleCheckError, match="NaN at") as caught:
        check(mask_bias, examples=4, cases=unbounded)
    assert caught.value.example == "neg_inf_masked"
    bounded = [Example(neg_inf_masked, zero_masked_args, ("where_is_bias",), regimes=FINITE)]
    assert check(mask_bias, examples=4, cases=bounded).matches["where_is_bias"] > 0
