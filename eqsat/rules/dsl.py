"""The rule-writing vocabulary: Python helpers a rule calls, typed patterns, and rule names.

Shapes live in type strings; rules that need shape arithmetic call (cached) Python functions on
them through `py_string` / `py_int` / `py_true`. A rule's name is its generator's name (with "/i"
when it yields several rules) and its law is the generator's docstring, first line.

Import these from `eqsat.rules`, not from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eqsat import lang


# --- calling Python from a rule ----------------------------------------------------------------------
# Shapes live in type strings; rules that need shape arithmetic call (cached) Python functions on
# them. A helper returns a string; "" conventionally means "does not apply".


def py_string(fn, *args):
    """`fn(*args)` on egglog `String`s (pass i64s as `.to_string()`), as an egglog `String`."""
    from egglog import PyObject

    return PyObject(fn)(*(PyObject.from_string(a) for a in args)).to_string()


def py_int(fn, *args):
    """`int(fn(*args))` as an egglog `i64` (via BigInt -> BigRat -> f64: exact below 2**53)."""
    from egglog import BigInt, BigRat

    return BigRat(BigInt.from_string(py_string(fn, *args)), BigInt(1)).to_f64().to_i64()


def py_true(fn, *args):
    """A rule condition: `fn(*args)` returned "1"."""
    from egglog import String, eq

    return eq(py_string(fn, *args)).to(String("1"))


def flag(value: bool) -> str:
    """The "1"/"0" a `py_true` helper returns."""
    return "1" if value else "0"


def typed_forms(ty, sort: str = "Expr", prefix: str = "_typed") -> list:
    """Every constructor of `sort` as a pattern whose type argument is `ty` (other arguments fresh).

    Expr pattern variables carry no type; `eq(x).to(form)` for each form binds `x`'s type to
    `ty`, one rule per constructor (e.g. an identity reshape is a `Reshape(x, ty)` whose `x` is
    some `C(..., ty)`).
    """
    from egglog import String, f64, i64, var

    sorts = {"String": String, "i64": i64, "f64": f64}
    forms = []
    for op, (result, args) in lang.OPS.items():
        if result != sort or not args or args[-1] != "String":
            continue
        constructor = lang.CONSTRUCTORS[op]
        fresh = []
        for index, arg_sort in enumerate(args[:-1]):
            bound = sorts.get(arg_sort) or {"Tensor": lang.Tensor, "Expr": lang.Expr,
                                            "TensorList": lang.TensorList}[arg_sort]
            fresh.append(var(f"{prefix}_{op}_{index}", bound))
        forms.append(constructor(*fresh, ty))
    return forms


# --- rule names --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleInfo:
    name: str   # the generator's name (with "/i" when it yields several rules)
    law: str    # the generator's docstring, first line

    def __str__(self) -> str:
        return f"{self.name}: {self.law}" if self.law else self.name


_RULE_INFO: dict[Any, RuleInfo] = {}


def _name_rules(ruleset) -> None:
    """Record which generator made each rule (must run before egglog resolves the generators)."""
    from egglog.egraph import set_current_ruleset
    from egglog.thunk import Unresolved

    for thunk in list(getattr(ruleset, "deferred_rule_gens", [])):
        state = getattr(thunk, "state", None)
        if not isinstance(state, Unresolved) or not state.args:
            continue
        generator = state.args[0]
        with set_current_ruleset(ruleset):
            rules = thunk()
        name = generator.__name__.lstrip("_")
        law = (generator.__doc__ or "").strip().splitlines()[0] if generator.__doc__ else ""
        for index, rule in enumerate(rules):
            _RULE_INFO.setdefault(rule.decl, RuleInfo(name if len(rules) == 1 else f"{name}/{index}", law))


def rules_of(ruleset) -> list[tuple[Any, RuleInfo]]:
    """The rules of `ruleset` as (egglog declaration, name and law), in registration order."""
    from egglog.pretty import pretty_decl

    _name_rules(ruleset)
    decls = ruleset.__egg_decls__
    out = []
    for decl in ruleset.__egg_ruleset__.rules:
        info = _RULE_INFO.get(decl) or RuleInfo(pretty_decl(decls, decl), "")
        out.append((decl, info))
    return out


def rule_name(ruleset, decl) -> str:
    from egglog.pretty import pretty_decl

    info = _RULE_INFO.get(decl)
    if info is not None:
        return info.name
    try:
        return pretty_decl(ruleset.__egg_decls__, decl)
    except Exception:  # a support family's unnamed rule
        return repr(decl)[:120]


def _base_name(name: str) -> str:
    return name.split("/")[0]
