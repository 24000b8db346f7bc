"""The soundness check every rule ships with: examples, random draws, and extractions against JAX.

`check(ruleset)` lifts every example at random shapes and values (hypothesis), runs the ruleset,
asserts the named rules matched (or, for must-not-fire examples, did not), and evaluates many
extractions of the output e-classes with the reference interpreter against the plain-JAX function.
A mismatch raises `RuleCheckError` naming the rule (re-run alone to localize it) and the
counterexample.

Import these from `eqsat.rules`, not from here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from eqsat.rules.dsl import _base_name, rule_name, rules_of
from eqsat.rules.existence import SerializedGraph, extractions
from eqsat.term import Term, postorder


# --- examples ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """A plain-JAX program for the soundness check.

    `args(draw)` draws its arguments (use `dim` and `tensor`); `rules` are the generator names
    that must match on it (`fires=True`) or must not (`fires=False`, a guarded rule's negative case).
    `support` families run with the ruleset under check, when its left sides only appear after
    theirs (views of views across kernels need prologue absorption first).
    """

    fn: Callable[..., Any]
    args: Callable[[Callable], tuple]
    rules: tuple[str, ...]
    fires: bool = True
    name: str = ""
    support: tuple[str, ...] = ()   # families run alongside (e.g. "absorb" to bring views together)

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", "example")


def dim(draw, low: int = 1, high: int = 4) -> int:
    """A random extent in [low, high]."""
    from hypothesis import strategies as st

    return draw(st.integers(low, high))


def tensor(draw, shape, dtype: str = "float32", low: float = -2.0, high: float = 2.0) -> np.ndarray:
    """A random array (values from a drawn seed: cheap to shrink, reproducible)."""
    from hypothesis import strategies as st

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(int(low), int(high) + 1, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)



# --- the checker -------------------------------------------------------------------------------------


class RuleCheckError(AssertionError):
    """A rule made an unsound equality, or did not (or did) fire where an example says it must (not)."""

    def __init__(self, message: str, *, rule: str | None = None, example: str | None = None, counterexample=None):
        super().__init__(message)
        self.rule = rule
        self.example = example
        self.counterexample = counterexample


@dataclass
class CheckReport:
    ruleset: str
    examples: int = 0
    draws: int = 0
    extractions: int = 0
    matches: Counter = field(default_factory=Counter)   # rule name -> matches over all draws
    rules: list[str] = field(default_factory=list)      # every rule of the ruleset

    @property
    def never_matched(self) -> list[str]:
        return [name for name in self.rules if not self.matches.get(name)]

    def __str__(self) -> str:
        return (f"{self.ruleset}: {self.examples} examples, {self.draws} draws, {self.extractions} extractions "
                f"evaluated, matches {dict(self.matches)}; never matched: {self.never_matched}")


def format_terms(roots: Sequence[Term], width: int = 160) -> str:
    """A readable listing of a term DAG: one line per Tensor term, Exprs inline."""
    names: dict[int, str] = {}
    lines = []

    def show(term: Term) -> str:
        if term.sort == "Tensor" and id(term) in names:
            return names[id(term)]
        parts = [show(a) if isinstance(a, Term) else repr(a) for a in term.args]
        return f"{term.op}({', '.join(parts)})"

    for term in postorder(roots):
        if term.sort == "Tensor":
            text = show(term)
            names[id(term)] = f"%{len(names)}"
            lines.append(f"{names[id(term)]} = {text}"[:width])
    lines.append("outputs: " + ", ".join(names.get(id(r), show(r)) for r in roots))
    return "\n".join(lines)


def _tolerance(dtype) -> tuple[float, float]:
    return (2e-2, 2e-2) if np.dtype(dtype).itemsize <= 2 else (2e-4, 2e-4)


def _close(actual, expected) -> str | None:
    """None if `actual` equals `expected` (to a dtype tolerance); else why not."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if not np.issubdtype(expected.dtype, np.inexact):
        return None if np.array_equal(actual, expected) else "values differ"
    rtol, atol = _tolerance(expected.dtype)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(e), initial=0.0))) if e.size else 1.0
    if np.allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True):
        return None
    return f"max abs error {float(np.nanmax(np.abs(a - e))):.3g} (scale {scale:.3g})"


def _compare(actuals, expecteds) -> str | None:
    if len(actuals) != len(expecteds):
        return f"{len(actuals)} outputs != {len(expecteds)}"
    for i, (a, e) in enumerate(zip(actuals, expecteds)):
        why = _close(a, e)
        if why is not None:
            return f"output {i}: {why}"
    return None


@dataclass
class _Lifted:
    program: Any
    env: dict[str, Any]
    expected: list[Any]


def _lift(example: Example, args: tuple) -> _Lifted:
    import jax

    from eqsat.interpret import evaluate
    from eqsat.lift import lift

    program = lift(example.fn, *args)
    leaves = jax.tree.leaves(args)
    env = {f"arg{i}": leaf for i, leaf in enumerate(leaves)}
    with jax.default_matmul_precision("highest"):
        expected = [np.asarray(x) for x in jax.tree.leaves(example.fn(*jax.tree.map(jax.numpy.asarray, args)))]
        naive = evaluate(list(program.outputs), env, program.constants, program.payloads)
    why = _compare([np.asarray(x) for x in naive], expected)
    if why is not None:
        raise RuleCheckError(
            f"example {example.label}: the lifted program already differs from the function ({why}); "
            "a lift or interpreter bug, not a rule's", example=example.label, counterexample=args)
    return _Lifted(program, env, expected)


def _saturate(ruleset, lifted: _Lifted, iterations: int, support: Sequence[str] = ()):
    from eqsat.egraph import Builder
    from eqsat.rules import family_ruleset, seed  # the registry imports this module

    builder = Builder()
    handles = builder.add(list(lifted.program.outputs))
    seed(builder.egraph, lifted.program)
    schedule = ruleset
    for name in support:
        helper = family_ruleset(name)
        if helper is not None and helper is not ruleset:
            schedule = schedule + helper
    matches: Counter = Counter()
    for _ in range(iterations):  # until nothing changes (analyses settle one level per iteration)
        report = builder.egraph.run(schedule)
        matches.update({decl: count for decl, count in report.num_matches_per_rule.items() if count})
        if not report.updated:
            break
    return builder, handles, matches


def _plans(builder, handles, extractions_limit: int, seed: int) -> list[list[Term]]:
    graph = SerializedGraph(builder.egraph._serialize().to_json())
    roots = [graph.handle_class[h] for h in handles]
    return extractions(graph, roots, limit=extractions_limit, seed=seed)


def _first_wrong(plans, lifted: _Lifted) -> tuple[list[Term], str] | None:
    import jax

    from eqsat.interpret import evaluate

    program = lifted.program
    for plan in plans:
        with jax.default_matmul_precision("highest"):
            try:
                values = evaluate(plan, lifted.env, program.constants, program.payloads)
            except Exception as error:  # an ill-typed term is as wrong as a wrong value
                return plan, f"evaluation failed: {type(error).__name__}: {error}"
        why = _compare([np.asarray(v) for v in values], lifted.expected)
        if why is not None:
            return plan, why
    return None


def _single(ruleset, decl):
    from egglog.egraph import RewriteOrRule, Ruleset

    single = Ruleset(None)
    single.append(RewriteOrRule(ruleset.__egg_decls__, decl))
    return single


def resolve_ruleset(ruleset):
    """A family name, a family module, or a ruleset -> the ruleset."""
    from eqsat.rules import family_ruleset  # the registry imports this module

    if isinstance(ruleset, str):
        found = family_ruleset(ruleset)
        if found is None:
            raise KeyError(f"rule family {ruleset!r} does not exist yet")
        return found
    if isinstance(ruleset, ModuleType):
        return getattr(ruleset, ruleset.__name__.rsplit(".", 1)[-1])
    return ruleset


def check(ruleset, examples: int = 10, *, cases: Sequence[Example] | None = None, iterations: int = 32,
          extractions_per_draw: int = 24, rules: Sequence[str] | None = None) -> CheckReport:
    """Check `ruleset` (a ruleset, family module or family name) for soundness on its `EXAMPLES`.

    For each example, `examples` hypothesis draws of shapes and values: lift, run the ruleset until
    it changes nothing (at most `iterations` times), then evaluate up to `extractions_per_draw` distinct extractions of the
    outputs (random acyclic ones and one forcing each alternative e-node) against the function.
    Also asserts that each example's rules matched at least once over its draws (or never, for
    `fires=False`). `rules` restricts the examples to those naming one of these rules.
    Raises `RuleCheckError` (rule, example, counterexample); returns a `CheckReport`.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from eqsat.rules import examples_of  # the registry imports this module

    ruleset = resolve_ruleset(ruleset)
    named = rules_of(ruleset)
    report = CheckReport(ruleset=_ruleset_label(ruleset), rules=list(dict.fromkeys(info.name for _, info in named)))
    chosen = list(cases) if cases is not None else examples_of(ruleset)
    if rules is not None:
        wanted = set(rules)
        chosen = [c for c in chosen if wanted & {_base_name(r) for r in c.rules} | wanted & set(c.rules)]
    for example in chosen:
        fired: Counter = Counter()
        prop = _property(ruleset, named, example, fired, report, iterations, extractions_per_draw)
        settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))(given(st.data())(prop))()
        report.examples += 1
        report.draws += examples
        report.matches.update(fired)
        fired_families = Counter()
        for name, count in fired.items():
            fired_families[_base_name(name)] += count
        for name in example.rules:
            count = fired.get(name, 0) or fired_families.get(name, 0)
            if example.fires and not count:
                raise RuleCheckError(f"{report.ruleset}: rule {name} never matched on example {example.label} "
                                     f"(matched: {dict(fired)})", rule=name, example=example.label)
            if not example.fires and count:
                raise RuleCheckError(f"{report.ruleset}: guarded rule {name} fired {count} times on its "
                                     f"must-not-fire example {example.label}", rule=name, example=example.label)
    return report


def _property(ruleset, named, example: Example, fired: Counter, report: CheckReport, iterations: int,
              extractions_per_draw: int):
    """The hypothesis property of one example: every extraction evaluates to the function's value."""
    draws = [0]

    def prop(data):
        args = example.args(data.draw)
        lifted = _lift(example, args)
        builder, handles, decl_matches = _saturate(ruleset, lifted, iterations, example.support)
        matched: Counter = Counter()
        for decl, count in decl_matches.items():
            matched[rule_name(ruleset, decl)] += count
        fired.update(matched)
        draws[0] += 1
        plans = _plans(builder, handles, extractions_per_draw, seed=draws[0])
        if not plans:
            raise RuleCheckError(f"{report.ruleset}: no acyclic extraction of example {example.label}'s outputs "
                                 "(the checker's extractor failed)", example=example.label, counterexample=args)
        report.extractions += len(plans)
        wrong = _first_wrong(plans, lifted)
        if wrong is None:
            return
        culprit = _localize(ruleset, named, matched, lifted, iterations, extractions_per_draw, example.support)
        plan, why = wrong
        raise RuleCheckError(
            f"{report.ruleset}: rule {culprit} is unsound on example {example.label}: {why}\n"
            f"arguments: {[(np.shape(a), str(np.asarray(a).dtype)) for a in args]}\n"
            f"rules that matched: {dict(matched)}\nwrong plan:\n{format_terms(plan)}",
            rule=culprit, example=example.label, counterexample=args)

    return prop


def _ruleset_label(ruleset) -> str:
    ident = getattr(ruleset, "ident", None)
    return ident.name if ident is not None else "ruleset"


def _localize(ruleset, named, matched: Counter, lifted: _Lifted, iterations: int, limit: int,
              support: Sequence[str] = ()) -> str:
    """The rule that is wrong on its own (with the support families), else the rules that matched."""
    for decl, info in named:
        if not matched.get(info.name):
            continue
        single = _single(ruleset, decl)
        builder, handles, _ = _saturate(single, lifted, iterations, support)
        if _first_wrong(_plans(builder, handles, limit, seed=0), lifted) is not None:
            return info.name
    return "combination of " + ", ".join(sorted(matched))
