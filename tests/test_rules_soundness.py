"""Every rule of every shipped family is sound: `eqsat.rules.check` on the family's EXAMPLES.

`check` lifts each example at random shapes and values (hypothesis), runs the family, asserts the
example's rules matched (or, for guarded rules' negative examples, did not), and evaluates many
extractions of the outputs with the reference interpreter against the plain-JAX function. Here we
also require that every rule generator of a family matched on at least one of its examples.
"""

from __future__ import annotations

import numpy as np
import pytest
from egglog import String, rewrite, ruleset

from eqsat import rules
from eqsat.lang import Expr, Load, Pointwise, Unary

FAMILIES = list(rules.registry())


def test_registry_lists_every_family_in_order():
    assert rules.FAMILIES == ("view_folding", "functionalize", "concat_slice", "absorb", "horizontal",
                              "norm_split", "hoist", "attention", "row_stats", "epilogue_stats")
    assert list(rules.registry()) == list(rules.FAMILIES)  # every family ships


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_sound_and_every_rule_fires(family):
    report = rules.check(family, examples=3)
    assert report.examples > 0 and report.extractions >= report.draws
    generators = {name.split("/")[0] for name in report.rules}
    fired = {name.split("/")[0] for name, count in report.matches.items() if count}
    missing = sorted(generators - fired)
    assert not missing, f"{family}: rules never exercised by an example: {missing}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rule_states_its_law(family):
    for _, info in rules.rules_of(rules.family_ruleset(family)):
        assert info.law, f"{family}: rule {info.name} has no law (generator docstring)"


# --- the checker itself catches an unsound rule and names it ------------------------------------------

broken = ruleset(name="broken_for_test")


@broken.register
def _drop_exp(e: Expr, t: String, ty: String):
    """Load(Pointwise(exp(e))) = e: wrong on purpose."""
    yield rewrite(Load(Pointwise(Unary("exp", e, ty), ty), ty)).to(e)


def _exp_then_add(x):
    import jax.numpy as jnp

    return jnp.exp(x) + 1.0


def _vector(draw):
    return (rules.tensor(draw, (rules.dim(draw, 2, 4),)),)


def test_check_names_an_unsound_rule_and_its_counterexample():
    case = rules.Example(_exp_then_add, _vector, ("drop_exp",))
    with pytest.raises(rules.RuleCheckError) as caught:
        rules.check(broken, examples=2, cases=[case])
    assert caught.value.rule == "drop_exp"
    assert caught.value.example == "_exp_then_add"
    assert isinstance(caught.value.counterexample[0], np.ndarray)


def test_check_fails_a_rule_that_never_matches():
    case = rules.Example(lambda x: x * 2.0, _vector, ("drop_exp",), name="no exp here")
    with pytest.raises(rules.RuleCheckError, match="never matched"):
        rules.check(broken, examples=1, cases=[case])


def test_check_fails_a_guarded_rule_that_fires_on_its_negative_example():
    case = rules.Example(_exp_then_add, _vector, ("drop_exp",), fires=False, name="must not fire")
    with pytest.raises(rules.RuleCheckError):
        rules.check(broken, examples=1, cases=[case])
