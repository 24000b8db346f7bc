"""Writing terms into an egglog `EGraph` without nesting.

egglog-python converts expressions recursively and `let` makes one global table per binding
(quadratic in memory); parsing one large program is quadratic too. So every Tensor term gets a
handle `Ref(i)` (unextractable) and is written as `(union (Ref i) (Op ... (Ref j) ...))`, in
postorder, a few hundred commands per parse. Expr trees inside one kernel are written inline.
"""

from __future__ import annotations

import json

from egglog import EGraph

from eqsat import lang
from eqsat.term import Term, postorder

_CHUNK = 256


def declare(egraph: EGraph) -> None:
    """Make every constructor of the language known to `egraph`."""
    for constructor in lang.CONSTRUCTORS.values():
        egraph._callable_to_egg(constructor)


def _literal(value, sort: str) -> str:
    if sort == "String":
        return json.dumps(value)
    if sort == "i64":
        return str(int(value))
    if sort == "f64":
        text = repr(float(value))
        if text in ("inf", "-inf", "nan"):
            return {"inf": "inf", "-inf": "-inf", "nan": "NaN"}[text]
        return text if ("." in text or "e" in text) else text + ".0"
    raise AssertionError(sort)


class Builder:
    """Adds terms to an e-graph; `handle(term)` is the `Ref` index of an added Tensor term."""

    def __init__(self, egraph: EGraph | None = None):
        self.egraph = egraph if egraph is not None else EGraph()
        declare(self.egraph)
        self.handles: dict[Term, int] = {}
        self._pending: list[str] = []

    def handle(self, term: Term) -> int:
        return self.handles[term]

    def add(self, roots) -> list[int]:
        """Add `roots` (Tensor terms) and everything they reach; returns their handles."""
        for node in postorder(roots):
            if node.sort != "Tensor" or node in self.handles:
                continue
            index = len(self.handles)
            self.handles[node] = index
            self._pending.append(f"(union (Ref {index}) {self._render(node)})")
            if len(self._pending) >= _CHUNK:
                self._flush()
        self._flush()
        return [self.handles[r] for r in roots]

    def _render(self, term: Term) -> str:
        # Iterative rendering of one kernel's Expr tree; Tensor children are handles.
        out: dict[int, str] = {}
        stack: list[tuple[Term, bool]] = [(term, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in out:
                continue
            if node is not term and node.sort == "Tensor":
                out[id(node)] = f"(Ref {self.handles[node]})"
                continue
            if not ready:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children if id(c) not in out)
                continue
            sorts = lang.OPS[node.op][1]
            parts = [out[id(a)] if isinstance(a, Term) else _literal(a, s) for a, s in zip(node.args, sorts)]
            out[id(node)] = f"({node.op}{''.join(' ' + p for p in parts)})"
        return out[id(term)]

    def _flush(self) -> None:
        if not self._pending:
            return
        program = "\n".join(self._pending)
        self._pending.clear()
        commands = self.egraph._egraph.parse_program(program)
        self.egraph._egraph.run_program(*commands)
