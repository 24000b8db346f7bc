"""Rule families and their registry; the one place rule authors import from.

A family is a module `eqsat/rules/<name>.py` exposing one egglog ruleset named like the module
(`eqsat.rules.absorb.absorb`) and a list `EXAMPLES` of `Example`s: plain-JAX programs whose
lifted form contains the rules' left sides. Rules are registered generator-style; a generator's
name names its rules and its docstring states the law:

    @absorb.register
    def prologue(e: Expr, ty: String):
        \"\"\"Load(Pointwise(e, ty), ty) = e: an elementwise producer is recomputed by its consumer.\"\"\"
        yield rewrite(Load(Pointwise(e, ty), ty)).to(e)

The public rule-authoring API, all importable from `eqsat.rules` (a ruleset outside the package
uses exactly these; `check(my_ruleset, cases=[Example(...)])` checks it):

    Example, dim, tensor               soundness examples: a plain-JAX program and how to draw its arguments
    check(ruleset, examples=N)         the hypothesis soundness check -> CheckReport, or RuleCheckError
    VALUE_REGIMES, values              the adversarial values every draw is also evaluated on (an
                                       Example states the regimes it is held to: `regimes=`)
    py_string / py_int / py_true, flag shape arithmetic on type strings in Python, from a rule
    typed_forms(ty)                    bind an Expr variable's type (one pattern per constructor)
    rules_of(ruleset), rule_name       a ruleset's rules with their names and laws
    registry(), family_ruleset(name)   the shipped families; seed(egraph, program) states their facts
    SerializedGraph, extractions       random acyclic plans of a serialized e-graph
    min_kernel_plan(graph, roots)      the plan with the fewest kernels (exact ILP; small graphs)
    format_terms(roots), kernel_terms  reading a plan

They live in `dsl.py` (calling Python from a rule, rule names), `checker.py` (examples and the
soundness check) and `existence.py` (serialized e-graphs, random extractions, the fewest-kernel ILP).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from eqsat.rules.checker import (
    VALUE_REGIMES, CheckReport, Example, RuleCheckError, check, dim, format_terms, resolve_ruleset, tensor, values,
)
from eqsat.rules.dsl import RuleInfo, _name_rules, flag, py_int, py_string, py_true, rule_name, rules_of, typed_forms
from eqsat.rules.existence import SerializedGraph, extractions, kernel_terms, min_kernel_plan

__all__ = [
    "FAMILIES", "family_module", "family_ruleset", "registry", "seed", "examples_of",
    "Example", "dim", "tensor", "check", "CheckReport", "RuleCheckError", "resolve_ruleset", "format_terms",
    "VALUE_REGIMES", "values",
    "py_string", "py_int", "py_true", "flag", "typed_forms", "RuleInfo", "rules_of", "rule_name",
    "SerializedGraph", "extractions", "kernel_terms", "min_kernel_plan",
]

FAMILIES = (
    "view_folding", "functionalize", "concat_slice", "absorb", "horizontal", "norm_split", "hoist", "attention",
    "row_stats", "epilogue_stats",
)

# --- the registry ------------------------------------------------------------------------------------


def family_module(name: str) -> ModuleType | None:
    """The module of family `name`, or None while it has not been written yet."""
    if name not in FAMILIES:
        raise KeyError(f"unknown rule family {name!r}; known: {', '.join(FAMILIES)}")
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            return None
        raise
    _name_rules(getattr(module, name))
    return module


def family_ruleset(name: str):
    """The ruleset of family `name` (the module attribute of the same name), or None if absent."""
    module = family_module(name)
    return None if module is None else getattr(module, name)


def registry() -> dict[str, Any]:
    """Every family that exists: name -> its ruleset, in `FAMILIES` order."""
    found = {}
    for name in FAMILIES:
        ruleset = family_ruleset(name)
        if ruleset is not None:
            found[name] = ruleset
    return found


def seed(egraph, program, families=None) -> int:
    """Let every family that reads facts from outside the e-graph (loop payloads, scatter kinds)
    state them for `program` (each family module's `seed(egraph, program)`); returns how many."""
    count = 0
    for name in (families if families is not None else FAMILIES):
        module = family_module(name)
        if module is not None and callable(getattr(module, "seed", None)):
            count += module.seed(egraph, program)
    return count


def examples_of(ruleset) -> list["Example"]:
    """The `EXAMPLES` of the family that owns `ruleset` ([] for a user's own ruleset)."""
    for name in FAMILIES:
        module = family_module(name)
        if module is not None and getattr(module, name) is ruleset:
            return list(getattr(module, "EXAMPLES", []))
    return []
