"""Rule families, their registry, and the soundness checker every rule ships with.

A family is a module `eqsat/rules/<name>.py` exposing one egglog ruleset named like the module
(`eqsat.rules.absorb.absorb`) and a list `EXAMPLES` of `Example`s: plain-JAX programs whose
lifted form contains the rules' left sides. Rules are registered generator-style; a generator's
name names its rules and its docstring states the law:

    @absorb.register
    def prologue(e: Expr, ty: String):
        \"\"\"Load(Pointwise(e, ty), ty) = e: an elementwise producer is recomputed by its consumer.\"\"\"
        yield rewrite(Load(Pointwise(e, ty), ty)).to(e)

`check(ruleset)` lifts every example at random shapes and values (hypothesis), runs the ruleset,
asserts the named rules matched (or, for must-not-fire examples, did not), and evaluates many
extractions of the output e-classes with the reference interpreter against the plain-JAX function.
A mismatch raises `RuleCheckError` naming the rule (re-run alone to localize it) and the
counterexample.

Also here, for rule writers and tests:

    registry(), family_ruleset(name), rules_of(ruleset)   the families and their named rules
    seed(egraph, program)              facts a family reads from the program's payloads (hoist, functionalize)
    py_string / py_int / py_true       shape arithmetic on type strings in Python, from a rule
    typed_forms(ty)                    bind an Expr variable's type (one pattern per constructor)
    SerializedGraph, extractions       random acyclic plans of a serialized e-graph
    min_kernel_plan(graph, roots)      the plan with the fewest kernels (exact ILP; small graphs)
"""

from __future__ import annotations

import importlib
import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from eqsat import lang
from eqsat.term import Term, postorder

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


# --- the serialized e-graph and a small random DAG extractor ----------------------------------------

_LANG_SORTS = frozenset({"Tensor", "Expr", "TensorList"})


class SerializedGraph:
    """`egraph._serialize().to_json()` as e-classes of language nodes, plus `Ref` handles -> e-class."""

    def __init__(self, data: str | dict):
        data = json.loads(data) if isinstance(data, str) else data
        nodes, class_data = data["nodes"], data["class_data"]
        self.op: dict[str, str] = {}
        self.children: dict[str, list[str]] = {}
        self.eclass: dict[str, str] = {}
        self.members: dict[str, list[str]] = defaultdict(list)
        self.handle_class: dict[int, str] = {}
        self.node_class: dict[str, str] = {node_id: node["eclass"] for node_id, node in nodes.items()}
        for node_id, node in nodes.items():
            op, cls = node["op"], node["eclass"]
            sort = class_data.get(cls, {}).get("type")
            if op == "Ref":
                self.handle_class[int(nodes[node["children"][0]]["op"])] = cls
                continue
            if node.get("subsumed"):
                continue  # equal, but not extractable (e.g. a LoopArg merged with its operand)
            if sort in _LANG_SORTS:
                if op not in lang.OPS:
                    continue  # helper functions of some family: not part of any plan
            elif node["children"]:
                continue  # a helper function's row in a primitive class; primitives are leaves
            self.op[node_id] = op
            self.children[node_id] = list(node["children"])
            self.eclass[node_id] = cls
            self.members[cls].append(node_id)
        self.sort = {cls: info.get("type") for cls, info in class_data.items()}

    def child_classes(self, node_id: str) -> list[str]:
        return [self.node_class[c] for c in self.children[node_id]]

    def reachable(self, roots: Sequence[str]) -> list[str]:
        """Classes reachable from `roots` through any node."""
        seen, order, stack = set(roots), [], list(roots)
        while stack:
            cls = stack.pop()
            order.append(cls)
            for node in self.members.get(cls, []):
                for child in self.child_classes(node):
                    if child not in seen:
                        seen.add(child)
                        stack.append(child)
        return order

    def extract(self, roots: Sequence[str], rng: random.Random, force: tuple[str, str] | None = None,
                budget: int = 20_000) -> dict[str, str] | None:
        """A random acyclic choice of one node per needed class (`force`: (class, node) must be used).

        Depth-first with backtracking: a node is rejected when it would close a cycle. Returns
        None when the budget of node visits runs out.
        """
        towards: set[str] = set()
        if force is not None:
            parents: dict[str, set[str]] = defaultdict(set)
            for node, cls in self.eclass.items():
                for child in self.child_classes(node):
                    parents[child].add(cls)
            stack = [force[0]]
            towards = {force[0]}
            while stack:
                for parent in parents[stack.pop()]:
                    if parent not in towards:
                        towards.add(parent)
                        stack.append(parent)
        choice: dict[str, str] = {}
        active: set[str] = set()
        visits = [0]

        def order(cls: str) -> list[str]:
            if force is not None and cls == force[0]:
                return [force[1]]
            nodes = list(self.members[cls])
            rng.shuffle(nodes)
            if towards:
                nodes.sort(key=lambda n: not any(c in towards for c in self.child_classes(n)))
            return nodes

        def visit(cls: str) -> bool:
            if cls in choice:
                return True
            if cls in active or not self.members.get(cls):
                return False
            visits[0] += 1
            if visits[0] > budget:
                return False
            active.add(cls)
            for node in order(cls):
                if all(visit(child) for child in self.child_classes(node)):
                    choice[cls] = node
                    active.discard(cls)
                    return True
            active.discard(cls)
            return False

        import sys

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            ok = all(visit(root) for root in roots)
        finally:
            sys.setrecursionlimit(limit)
        return choice if ok else None

    def terms(self, choice: dict[str, str], roots: Sequence[str]) -> list[Term]:
        """The Terms of `roots` under `choice` (children before parents, no recursion)."""
        built: dict[str, Term] = {}
        opened: set[str] = set()
        stack: list[tuple[str, bool]] = [(root, False) for root in roots]
        while stack:
            cls, ready = stack.pop()
            if cls in built:
                continue
            node = choice[cls]
            op = self.op[node]
            sorts = lang.OPS[op][1]
            if not ready:
                if cls in opened:
                    raise ValueError(f"the choice of nodes is cyclic at e-class {cls}")
                opened.add(cls)
                stack.append((cls, True))
                for child, sort in zip(self.children[node], sorts):
                    if sort in _LANG_SORTS and self.node_class[child] not in built:
                        stack.append((self.node_class[child], False))
                continue
            args = []
            for child, sort in zip(self.children[node], sorts):
                if sort in _LANG_SORTS:
                    args.append(built[self.node_class[child]])
                else:
                    args.append(_literal(self.op[child], sort))
            built[cls] = Term(op, *args)
        return [built[root] for root in roots]


def min_kernel_plan(graph: SerializedGraph, roots: Sequence[str], *, forbid: Sequence[str] = (),
                    time_limit: float = 60.0) -> list[Term] | None:
    """A plan of `roots` with the fewest kernels the e-graph offers (to show that a fused plan exists).

    An exact ILP (`scipy.optimize.milp`): a 0/1 variable per node and per class, every used class
    picks a node, a picked node uses its children's classes, an order per class forbids cycles;
    minimize kernels, then nodes. Nodes whose op is in `forbid` are never picked. None if no plan
    exists. For small e-graphs (tests, examples), not SD-sized ones: the cost-model extractor lives
    in `extract/`.
    """
    import scipy.sparse as sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    classes = graph.reachable(roots)
    class_index = {cls: i for i, cls in enumerate(classes)}
    nodes = [(cls, node) for cls in classes for node in graph.members.get(cls, []) if graph.op[node] not in forbid]
    n_nodes, n_classes = len(nodes), len(classes)
    # variables: nodes x, classes y, orders o
    n_vars = n_nodes + 2 * n_classes
    y = lambda c: n_nodes + class_index[c]  # noqa: E731
    o = lambda c: n_nodes + n_classes + class_index[c]  # noqa: E731
    rows, cols, vals, lower, upper = [], [], [], [], []

    def constraint(coefficients: dict[int, float], lo: float, hi: float) -> None:
        row = len(lower)
        for col, val in coefficients.items():
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    big = float(n_classes + 1)
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, (cls, node) in enumerate(nodes):
        by_class[cls].append(i)
        for child in set(graph.child_classes(node)):
            constraint({i: 1.0, y(child): -1.0}, -np.inf, 0.0)              # x_n <= y_child
            if child == cls:
                constraint({i: 1.0}, 0.0, 0.0)                                # a node inside its own class
            else:
                constraint({o(cls): 1.0, o(child): -1.0, i: -big}, 1.0 - big, np.inf)  # o_c >= o_d + 1 if x_n
    for cls in classes:
        coefficients = {i: 1.0 for i in by_class[cls]}
        coefficients[y(cls)] = -1.0
        constraint(coefficients, 0.0, 0.0)                                    # a used class picks one node
    for root in roots:
        constraint({y(root): 1.0}, 1.0, 1.0)
    cost = np.zeros(n_vars)
    for i, (cls, node) in enumerate(nodes):
        cost[i] = (1000.0 if graph.op[node] in lang.KERNEL_OPS else 0.0) + 1.0
    integrality = np.ones(n_vars)
    integrality[n_nodes + n_classes:] = 0
    lo_bounds = np.zeros(n_vars)
    hi_bounds = np.ones(n_vars)
    hi_bounds[n_nodes + n_classes:] = big
    matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(lower), n_vars))
    result = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
                  bounds=Bounds(lo_bounds, hi_bounds), options={"time_limit": time_limit})
    if result.x is None or not result.success:
        return None
    choice = {cls: node for i, (cls, node) in enumerate(nodes) if result.x[i] > 0.5}
    return graph.terms(choice, roots)


def kernel_terms(roots: Sequence[Term]) -> list[Term]:
    """The kernel terms of a plan (loop bodies included)."""
    return [term for term in postorder(roots) if term.op in lang.KERNEL_OPS]


def _literal(text: str, sort: str):
    if sort == "String":
        return json.loads(text)
    if sort == "i64":
        return int(text)
    if sort == "f64":
        return float(text)
    raise AssertionError(sort)


def extractions(graph: SerializedGraph, roots: Sequence[str], *, limit: int = 32, seed: int = 0) -> list[list[Term]]:
    """Up to `limit` distinct plans of `roots`: random ones, and one forcing each alternative node."""
    rng = random.Random(seed)
    forced = [(cls, node) for cls in graph.reachable(roots) if graph.sort.get(cls) in _LANG_SORTS
              for node in graph.members.get(cls, []) if len(graph.members[cls]) > 1]
    rng.shuffle(forced)
    plans: dict[tuple[int, ...], list[Term]] = {}
    attempts = [None] * 3 + forced
    for force in attempts:
        if len(plans) >= limit:
            break
        choice = graph.extract(roots, rng, force)
        if choice is None:
            continue
        terms = graph.terms(choice, roots)
        plans.setdefault(tuple(id(t) for t in terms), terms)
    return list(plans.values())


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
