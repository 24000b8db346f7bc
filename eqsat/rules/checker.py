"""The soundness check every rule ships with: examples, random draws, and extractions against JAX.

`check(ruleset)` lifts every example at random shapes and values (hypothesis), runs the ruleset,
asserts the named rules matched (or, for must-not-fire examples, did not), and evaluates many
extractions of the output e-classes with the reference interpreter against the plain-JAX function.
A mismatch raises `RuleCheckError` naming the rule (re-run alone to localize it) and the
counterexample.

Values are adversarial: every draw's extractions are evaluated on the values its example drew and
again, at the same shapes, on each of `VALUE_REGIMES` (`values`: means large against the spread,
constant rows, zeros, tiny and huge magnitudes, NaN and infinities), since a rewrite that is exact
in real arithmetic can still cancel, overflow or lose a NaN in floating point. Results must match
the function's to a tolerance relative to each output's largest finite magnitude, NaN exactly where
the function gives NaN and infinities exactly where it gives them (`_close`).

The default numerical contract is backward stability: on top of that tolerance, a result may
differ from the function's by `SENSITIVITY_FACTOR` times what the function itself changes when its
float inputs are perturbed by `PERTURBATION_ULPS` ulps (`_sensitivity`, element by element). That
is what rounding inside any correct implementation amounts to, and it is large only where the
function is ill-conditioned (a LayerNorm of a nearly constant row amplifies the rounding of its
mean by 1/sqrt(eps)); E[x^2] - E[x]^2 at an offset errs by eps * mean^2, far beyond it. A rule
that needs more states its contract on its examples: the regimes it is held to
(`Example.regimes`) and an error allowed on top, computed from the drawn arguments
(`Example.tolerance`: e.g. a few ulps of the largest |argument| for a law that rounds differently
by more than its inputs' perturbation explains).

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
    regimes: tuple[str, ...] | None = None  # adversarial value regimes it is held to (None: all of VALUE_REGIMES)
    tolerance: Callable[[list], Any] | None = None  # extra absolute error allowed, from the argument leaves

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", "example")


def dim(draw, low: int = 1, high: int = 4) -> int:
    """A random extent in [low, high]."""
    from hypothesis import strategies as st

    return draw(st.integers(low, high))


def tensor(draw, shape, dtype: str = "float32", low: float = -2.0, high: float = 2.0,
           regime: str = "uniform") -> np.ndarray:
    """A random array (values from a drawn seed: cheap to shrink, reproducible): uniform in
    [low, high], or floats of one of `VALUE_REGIMES` (see `values`)."""
    from hypothesis import strategies as st

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(int(low), int(high) + 1, size=shape).astype(dtype)
    return values(shape, dtype, regime, rng, low, high)


# Adversarial values every draw is evaluated on besides its own (float arguments; same shapes).
VALUE_REGIMES = ("offset", "constant_rows", "zeros", "tiny", "huge", "nonfinite")
# Largest |value| of the offset and constant regimes, and the tiny/huge scales, by itemsize:
# float16 overflows at 65504 (a square of 1e3 already does).
_BOUND = {2: 1e3, 4: 1e6, 8: 1e6}
_TINY = {2: 1e-2, 4: 1e-15, 8: 1e-15}
_HUGE = {2: 1e2, 4: 1e15, 8: 1e15}


def values(shape, dtype, regime: str, rng: np.random.Generator, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    """Float values of one regime:

        uniform        uniform in [low, high]
        offset         m + s * normal: spread s in [1e-2, 10], |m| / s in [10, 1e4] (a mean large
                       against the spread: what cancels in E[x^2] - E[x]^2)
        constant_rows  every row (last axis) one value, |value| up to 1e4, rows far apart
        zeros          all zeros
        tiny / huge    uniform in [-2, 2] times 1e-15 / 1e15 (float16: 1e-2 / 1e2)
        nonfinite      uniform in [-2, 2] with NaN, +inf and -inf at an eighth of the places (at least one)

    Offsets and constants stay below 1e6 (float16: 1e3) so that squares stay finite.
    """
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    bound = _BOUND[dtype.itemsize]
    if regime == "uniform":
        out = rng.uniform(low, high, size=shape)
    elif regime == "offset":
        spread = 10 ** rng.uniform(-2, 1)
        mean = rng.choice([-1.0, 1.0]) * spread * 10 ** rng.uniform(1, 4)
        shrink = min(1.0, bound / (abs(mean) + 10 * spread))
        out = (mean + spread * rng.standard_normal(shape)) * shrink
    elif regime == "constant_rows":
        rows = shape[:-1]
        row_values = rng.choice([-1.0, 1.0], size=rows) * np.minimum(10 ** rng.uniform(-1, 4, size=rows), bound)
        out = np.broadcast_to(np.asarray(row_values)[..., None], shape) if shape else row_values
    elif regime == "zeros":
        out = np.zeros(shape)
    elif regime in ("tiny", "huge"):
        out = rng.uniform(-2.0, 2.0, size=shape) * (_TINY if regime == "tiny" else _HUGE)[dtype.itemsize]
    elif regime == "nonfinite":
        out = rng.uniform(-2.0, 2.0, size=shape)
        flat = out.reshape(-1)
        if flat.size:
            places = rng.choice(flat.size, size=max(1, flat.size // 8), replace=False)
            flat[places] = rng.choice([np.nan, np.inf, -np.inf], size=places.size)
        out = flat.reshape(shape)
    else:
        raise ValueError(f"unknown value regime {regime!r}; known: uniform, {', '.join(VALUE_REGIMES)}")
    return np.asarray(out).astype(dtype)


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


def _close(actual, expected, slack=0.0) -> str | None:
    """None if `actual` equals `expected`, else why not: NaN exactly where `expected` has NaN,
    infinities exactly where it has them, finite values to the dtype's tolerance relative to the
    output's largest finite magnitude, plus `slack` (a scalar, or an array of the output's shape:
    the contract, see the module docstring)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if not np.issubdtype(expected.dtype, np.inexact):
        return None if np.array_equal(actual, expected) else "values differ"
    rtol, atol = _tolerance(expected.dtype)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        return (f"NaN at {int((nan_a & ~nan_e).sum())} places the function is not NaN, "
                f"not NaN at {int((nan_e & ~nan_a).sum())} places it is")
    infinite = np.isinf(a) | np.isinf(e)
    if not np.array_equal(a[infinite], e[infinite]):
        return f"infinities differ at {int((a[infinite] != e[infinite]).sum())} places"
    finite = np.isfinite(e)
    scale = float(np.abs(e[finite]).max(initial=0.0))
    error = np.abs(a[finite] - e[finite])
    allowed = rtol * np.abs(e[finite]) + atol * scale + np.broadcast_to(slack, e.shape)[finite]
    if np.all(error <= allowed):
        return None
    worst = int(np.argmax(error - allowed))
    return (f"max abs error {float(error.max()):.3g} (scale {scale:.3g}); worst {float(error[worst]):.3g} "
            f"where {float(allowed[worst]):.3g} is allowed")


def _compare(actuals, expecteds, slacks=None) -> str | None:
    if len(actuals) != len(expecteds):
        return f"{len(actuals)} outputs != {len(expecteds)}"
    for i, (a, e) in enumerate(zip(actuals, expecteds)):
        why = _close(a, e, 0.0 if slacks is None else slacks[i])
        if why is not None:
            return f"output {i}: {why}"
    return None


# The default contract (module docstring): perturbations of the inputs and how much of the
# function's response to them a result may show.
PERTURBATION_ULPS = 8
PERTURBATIONS = 2
SENSITIVITY_FACTOR = 2.0


def _outputs(fn, args) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(fn(*jax.tree.map(jax.numpy.asarray, args)))]


def _sensitivity(fn, args, expected: list[np.ndarray]) -> list[np.ndarray]:
    """Per output, the largest change of `fn` when every float input is scaled by 1 + u * ulps * eps
    (u uniform in [-1, 1] per element, `PERTURBATIONS` draws): 0 where the function is exact."""
    import jax

    rng = np.random.default_rng(0)
    changes = [np.zeros(np.shape(e)) for e in expected]

    def perturb(leaf):
        array = np.asarray(leaf)
        if not np.issubdtype(array.dtype, np.floating):
            return leaf
        eps = float(np.finfo(array.dtype).eps)
        factor = 1 + rng.uniform(-1, 1, size=array.shape) * PERTURBATION_ULPS * eps
        return (array.astype(np.float64) * factor).astype(array.dtype)

    for _ in range(PERTURBATIONS):
        for change, moved, e in zip(changes, _outputs(fn, jax.tree.map(perturb, args)), expected):
            if np.issubdtype(np.asarray(e).dtype, np.inexact):
                with np.errstate(invalid="ignore"):  # inf - inf: an infinity that stays put
                    delta = np.abs(np.asarray(moved, np.float64) - np.asarray(e, np.float64))
                np.maximum(change, np.where(np.isnan(delta), 0.0, delta), out=change)
    return changes


@dataclass
class _Lifted:
    program: Any
    env: dict[str, Any]
    expected: list[Any]
    fn: Callable[..., Any]
    args: tuple = ()
    regime: str = "drawn"       # which values: the example's own draw, or a VALUE_REGIMES entry
    extra: Any = 0.0            # the example's own contract on these values (`Example.tolerance`)
    sensitivity: list | None = None  # the function's, per output (`_sensitivity`), once it is needed

    def compare(self, actuals) -> str | None:
        """Why `actuals` break the contract on these values, or None. The function's sensitivity is
        computed only for results that the dtype tolerance and `extra` alone reject."""
        import jax

        actuals = [np.asarray(a) for a in actuals]
        if _compare(actuals, self.expected, [self.extra] * len(self.expected)) is None:
            return None
        if self.sensitivity is None:
            with jax.default_matmul_precision("highest"):
                self.sensitivity = _sensitivity(self.fn, self.args, self.expected)
        return _compare(actuals, self.expected, [SENSITIVITY_FACTOR * change + self.extra
                                                 for change in self.sensitivity])


def _lift(example: Example, args: tuple, program=None, regime: str = "drawn") -> _Lifted:
    """The program of `example` (lifted from `args` unless given) with its expected values on `args`."""
    import jax

    from eqsat.interpret import evaluate
    from eqsat.lift import lift

    if program is None:
        program = lift(example.fn, *args)
    leaves = jax.tree.leaves(args)
    env = {f"arg{i}": leaf for i, leaf in enumerate(leaves)}
    with jax.default_matmul_precision("highest"):
        expected = _outputs(example.fn, args)
        naive = evaluate(list(program.outputs), env, program.constants, program.payloads)
    extra = example.tolerance(leaves) if example.tolerance is not None else 0.0
    lifted = _Lifted(program, env, expected, example.fn, args, regime, extra)
    why = lifted.compare(naive)
    if why is not None:
        raise RuleCheckError(
            f"example {example.label}: the lifted program already differs from the function on {regime} values "
            f"({why}); a lift or interpreter bug, not a rule's", example=example.label, counterexample=args)
    return lifted


def _revalued(args: tuple, regime: str, rng: np.random.Generator) -> tuple:
    """`args` with every float array replaced by `regime` values of its shape and dtype."""
    import jax

    def redraw(leaf):
        array = np.asarray(leaf)
        if not np.issubdtype(array.dtype, np.floating):
            return leaf
        return values(array.shape, array.dtype, regime, rng)

    return jax.tree.map(redraw, args)


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
                results = evaluate(plan, lifted.env, program.constants, program.payloads)
            except Exception as error:  # an ill-typed term is as wrong as a wrong value
                return plan, f"evaluation failed: {type(error).__name__}: {error}"
        why = lifted.compare(results)
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
    """The hypothesis property of one example: every extraction evaluates to the function's value,
    on the drawn values and on adversarial values of the same shapes (`VALUE_REGIMES`)."""
    from hypothesis import strategies as st

    draws = [0]
    regimes = VALUE_REGIMES if example.regimes is None else example.regimes

    def prop(data):
        args = example.args(data.draw)
        value_seed = data.draw(st.integers(0, 2**32 - 1))
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
        for index, regime in enumerate(regimes):
            if wrong is not None:
                break
            rng = np.random.default_rng([value_seed, index])
            lifted = _lift(example, _revalued(args, regime, rng), lifted.program, regime)
            wrong = _first_wrong(plans, lifted)
        if wrong is None:
            return
        culprit = _localize(ruleset, named, matched, lifted, iterations, extractions_per_draw, example.support)
        plan, why = wrong
        raise RuleCheckError(
            f"{report.ruleset}: rule {culprit} is unsound on example {example.label} ({lifted.regime} values): "
            f"{why}\narguments: {[(np.shape(a), str(np.asarray(a).dtype)) for a in args]}\n"
            f"rules that matched: {dict(matched)}\nwrong plan:\n{format_terms(plan)}",
            rule=culprit, example=example.label, counterexample=lifted.args)

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
