"""Terms outside the e-graph: an interned DAG of `Term(op, args)` nodes with `eqsat.lang.OPS` ops.

Lifting produces terms, the builder writes them into egglog without nesting, extraction turns
the serialized e-graph back into terms, and the interpreter evaluates them. Terms are interned
(structurally equal terms are the same object), so `is`, `==` and `hash` are all by identity and
a DAG of any depth costs no recursion to compare.
"""

from __future__ import annotations

import weakref
from typing import Iterator, Union

from eqsat.lang import OPS

Arg = Union["Term", str, int, float]

_interned: "weakref.WeakValueDictionary[tuple, Term]" = weakref.WeakValueDictionary()


class Term:
    __slots__ = ("op", "args", "children", "__weakref__")

    op: str
    args: tuple[Arg, ...]
    children: tuple["Term", ...]  # the Term arguments, in order (walked often: computed once)

    def __new__(cls, op: str, *args: Arg) -> "Term":
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
        sorts = OPS[op][1]
        if len(args) != len(sorts):
            raise TypeError(f"{op} takes {len(sorts)} arguments ({', '.join(sorts)}), got {len(args)}")
        normalized = tuple(_normalize(arg, sort, op) for arg, sort in zip(args, sorts))
        key = (op, tuple((id(a), 0) if isinstance(a, Term) else (a, type(a).__name__) for a in normalized))
        existing = _interned.get(key)
        if existing is not None:
            return existing
        self = object.__new__(cls)
        self.op = op
        self.args = normalized
        self.children = tuple(a for a in normalized if isinstance(a, Term))
        _interned[key] = self
        return self

    @property
    def sort(self) -> str:
        return OPS[self.op][0]

    @property
    def ty(self) -> str:
        """The type string (last argument) of a Tensor or Expr term."""
        if self.sort == "TensorList":
            raise TypeError("a TensorList has no single type")
        return self.args[-1]  # type: ignore[return-value]

    def __repr__(self) -> str:
        parts = [a.op + "(...)" if isinstance(a, Term) else repr(a) for a in self.args]
        return f"{self.op}({', '.join(parts)})"

    def __reduce__(self):
        return (Term, (self.op, *self.args))


def _normalize(arg, sort: str, op: str):
    if sort in ("Tensor", "Expr", "TensorList"):
        if not isinstance(arg, Term) or arg.sort != sort:
            raise TypeError(f"{op}: expected a {sort} term, got {arg!r}")
        return arg
    if sort == "String":
        if not isinstance(arg, str):
            raise TypeError(f"{op}: expected a string, got {arg!r}")
        return arg
    if sort == "i64":
        return int(arg)
    if sort == "f64":
        return float(arg)
    raise AssertionError(sort)


def tensor_list(tensors) -> Term:
    """A `TCons` list of `tensors`."""
    result = Term("TNil")
    for tensor in reversed(list(tensors)):
        result = Term("TCons", tensor, result)
    return result


def list_items(lst: Term) -> list[Term]:
    """The tensors of a `TCons` list, iteratively."""
    items = []
    while lst.op == "TCons":
        items.append(lst.args[0])
        lst = lst.args[1]
    return items


def postorder(roots, children=None) -> Iterator[Term]:
    """Every term reachable from `roots`, children before parents, each once (no recursion).
    `children(node)`: the nodes to descend into (default: all of `node.children`)."""
    seen: set[int] = set()
    stack: list[tuple[Term, bool]] = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            yield node
            continue
        stack.append((node, True))
        for child in reversed(node.children if children is None else children(node)):
            if id(child) not in seen:
                stack.append((child, False))
