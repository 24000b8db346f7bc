"""Writing terms into an egglog `EGraph` without nesting.

egglog-python converts expressions recursively and `let` makes one global table per binding
(quadratic in memory). So every Tensor term gets a handle `Ref(i)` (unextractable) and is written
as `(union (Ref i) (Op ... (Ref j) ...))`, in postorder; Expr trees inside one kernel are written
inline. The unions are built as egglog command objects (no text to parse) and become the heads of
body-less rules of one ruleset, run once: each top-level egglog command costs time that grows with
the e-graph (so one command per term is quadratic), one rule per `_CHUNK` unions keeps it linear.
"""

from __future__ import annotations

import itertools

from egglog import EGraph, bindings
from egglog.egraph_state import span

from eqsat import lang
from eqsat.term import Term, postorder

_CHUNK = 32  # unions per rule head (large heads compile slowly)
_SPAN = span()
_rulesets = itertools.count()


def declare(egraph: EGraph) -> None:
    """Make every constructor of the language known to `egraph`."""
    for constructor in lang.CONSTRUCTORS.values():
        egraph._callable_to_egg(constructor)


def _literal(value, sort: str):
    if sort == "String":
        return bindings.Lit(_SPAN, bindings.String(value))
    if sort == "i64":
        return bindings.Lit(_SPAN, bindings.Int(int(value)))
    if sort == "f64":
        return bindings.Lit(_SPAN, bindings.Float(float(value)))
    raise AssertionError(sort)


def _ref(index: int):
    return bindings.Call(_SPAN, "Ref", [bindings.Lit(_SPAN, bindings.Int(index))])


class Builder:
    """Adds terms to an e-graph; `handle(term)` is the `Ref` index of an added Tensor term."""

    def __init__(self, egraph: EGraph | None = None):
        self.egraph = egraph if egraph is not None else EGraph()
        declare(self.egraph)
        self.handles: dict[Term, int] = {}

    def handle(self, term: Term) -> int:
        return self.handles[term]

    def add(self, roots) -> list[int]:
        """Add `roots` (Tensor terms) and everything they reach; returns their handles."""
        unions = []
        for node in postorder(roots):
            if node.sort != "Tensor" or node in self.handles:
                continue
            index = len(self.handles)
            self.handles[node] = index
            unions.append(bindings.Union(_SPAN, _ref(index), self._expr(node)))
        self._run(unions)
        return [self.handles[r] for r in roots]

    def _expr(self, term: Term):
        # Iterative conversion of one kernel's Expr tree; Tensor children are handles.
        out: dict[int, object] = {}
        stack: list[tuple[Term, bool]] = [(term, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in out:
                continue
            if node is not term and node.sort == "Tensor":
                out[id(node)] = _ref(self.handles[node])
                continue
            if not ready:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children if id(c) not in out)
                continue
            sorts = lang.OPS[node.op][1]
            parts = [out[id(a)] if isinstance(a, Term) else _literal(a, s) for a, s in zip(node.args, sorts)]
            out[id(node)] = bindings.Call(_SPAN, node.op, parts)
        return out[id(term)]

    def _run(self, unions: list) -> None:
        """Apply `unions` (egglog actions) as body-less rules of a fresh ruleset, run once."""
        if not unions:
            return
        ruleset = f"eqsat_build_{next(_rulesets)}"
        rules = [bindings.RuleCommand(bindings.Rule(_SPAN, unions[start:start + _CHUNK], [], f"{ruleset}_{start}", ruleset))
                 for start in range(0, len(unions), _CHUNK)]
        egraph = self.egraph._egraph
        egraph.run_program(bindings.AddRuleset(_SPAN, ruleset), *rules)
        egraph.run_program(bindings.RunSchedule(bindings.Run(_SPAN, bindings.RunConfig(ruleset, None))))
