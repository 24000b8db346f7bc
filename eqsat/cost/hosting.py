"""Reductions computed in their producers' epilogues (`EpilogueReduce`): when that is legal.

`EpilogueReduce(producer, op, body, axes, ty)` is `Reduce(op, body, axes, Acc(ty), ty)` computed by
the kernels that write the tensors its body reads: every output tile writes its partial reduction
(a partial sum; for `moments`, count, mean and M2 of its own elements) into its own slot of a small
fp32 partials buffer while the tile's values are still in registers, and each kernel reading the
statistic merges the slots in tile order (Chan's formula for moments, `eqsat.moments`): no
atomics, no memset, a deterministic result. When the body concatenates several kernels' outputs
(GroupNorm over a skip connection: `concat(h, skip)`), each of those kernels writes the slots of
the tiles it writes; `producer` is the first of them.

The rules state it wherever it is worth trying; whether the *extracted* term can be hosted is
decided here, on the chosen terms. The body is split into its spine (what the hosts compute) and
side values (what they read besides):

    Load(T), T a Matmul/Conv/Attention output (`HOST_OPS`)   spine, hosted by T
    Unary, Reshape, Transpose of a spine                     spine (each element still comes from
                                                             one element of one host)
    Concat of spines reading different hosts                 spine (each element from one side)
    Slice of a spine, Concat of two reads of one host        not hostable (a host element would
                                                             feed no slot, or two)
    Binary/Select whose spine operands are one and the same  spine (x*x: both read the same element)
      term, the others side values
    anything else (Broadcast, Lit, Iota, a Load of an input   side value; must not read a host
      or of another kernel, ...)

Where its partials are merged (in each reader, or once by a `finalize` kernel) is
`eqsat.cost.merges`' choice.

Legal when the body is a spine, `op` is `sum` or `moments` (partials that merge), and no side
input depends on a host (it must exist when the host runs). Otherwise the reduction is its own `Reduce` kernel
(`eqsat.cost.kernels` lists it, `kernel_cost` prices it as one): a plan never counts a fusion it
could not emit.
"""

from __future__ import annotations

import weakref
from typing import Iterable

HOST_OPS = frozenset({"Pointwise", "Matmul", "Conv", "Attention"})
HOSTED_REDUCTIONS = frozenset({"sum", "moments"})
_THROUGH = frozenset({"Unary", "Reshape", "Transpose"})
_ELEMENTWISE = frozenset({"Binary", "Select"})


class _NotHostable(Exception):
    pass


def _side_loads(expr, out: dict) -> None:
    seen: set[int] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "Load":
            out[id(node.args[0])] = node.args[0]
            continue
        stack.extend(child for child in node.children if child.sort == "Expr")


def _split(body) -> tuple[list, list]:
    """(hosts, side inputs) of a reduction body; raises `_NotHostable`.

    Each host element must reach the body at exactly one element (a tile adds each element it
    writes to one slot): two spine paths to one host (`concat(x, x)`, `tile`) are not hostable,
    nor is a slice of a host (the host writes elements the body does not read)."""
    hosts: dict[int, object] = {}
    side: dict[int, object] = {}
    memo: dict[int, frozenset] = {}  # id -> the hosts its spine reads (empty: a side value)

    def spine(node) -> frozenset:
        key = id(node)
        if key in memo:
            return memo[key]
        if node.op == "Load" and node.args[0].op in HOST_OPS:
            hosts[id(node.args[0])] = node.args[0]
            result = frozenset({id(node.args[0])})
        elif node.op in _THROUGH:
            result = spine(node.args[0] if node.op != "Unary" else node.args[1])
        elif node.op == "Slice":
            if spine(node.args[0]):
                raise _NotHostable("a slice of a producer (its tiles write elements the body does not read)")
            result = frozenset()
        elif node.op == "Concat":
            left, right = spine(node.args[0]), spine(node.args[1])
            if bool(left) != bool(right):
                raise _NotHostable("a concat of a spine and a side value")
            if left & right:
                raise _NotHostable("a concat reading one producer twice (each element would feed two slots)")
            result = left | right
        elif node.op in _ELEMENTWISE:
            operands = [c for c in node.children if c.sort == "Expr"]
            spines = {id(c): c for c in operands if spine(c)}
            if len(spines) > 1:
                raise _NotHostable("an elementwise op of two different reads of the producers")
            result = spine(next(iter(spines.values()))) if spines else frozenset()
        else:
            result = frozenset()
        if not result:
            _side_loads(node, side)
        memo[key] = result
        return result

    if not spine(body):
        raise _NotHostable("the body reads no producer at the element it writes")
    for key in hosts:
        side.pop(key, None)
    return list(hosts.values()), list(side.values())


def _depends_on(tensor, targets: set[int], cache: dict[int, bool]) -> bool:
    """Whether computing `tensor` needs any term of `targets` (ids), by an iterative walk."""
    stack = [(tensor, False)]
    while stack:
        node, ready = stack.pop()
        key = id(node)
        if key in cache:
            continue
        if key in targets:
            cache[key] = True
            continue
        children = node.children
        if ready:
            cache[key] = any(cache.get(id(c), False) for c in children)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in cache)
    return cache[id(tensor)]


_hosts_memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # terms are interned and immutable


def hosts_of(reduction) -> list | None:
    """The kernel terms computing `reduction` (an `EpilogueReduce`) in their epilogues, in body
    order, or None when it must run as its own kernel (also None for any other term)."""
    if reduction.op != "EpilogueReduce" or reduction.args[1] not in HOSTED_REDUCTIONS:
        return None
    try:
        hosts = _hosts_memo[reduction]
    except KeyError:
        hosts = _hosts_memo[reduction] = _find_hosts(reduction)
    return None if hosts is None else list(hosts)


def _find_hosts(reduction) -> tuple | None:
    try:
        hosts, side = _split(reduction.args[2])
    except _NotHostable:
        return None
    if reduction.args[0] not in hosts:
        return None
    targets = {id(h) for h in hosts}
    cache: dict[int, bool] = {}
    if any(_depends_on(tensor, targets, cache) for tensor in side):
        return None
    return tuple(hosts)


def side_inputs(reduction) -> list:
    """What a hostable reduction's body reads besides its hosts (they must run before the hosts)."""
    try:
        return _split(reduction.args[2])[1]
    except _NotHostable:
        return []


def hosted_reductions(roots: Iterable) -> dict:
    """Every `EpilogueReduce` reachable from `roots` -> its host kernel terms (None: runs alone).

    Like `eqsat.cost.kernels`, a `Loop`'s body is not entered: its reductions belong to the body's
    own plan (the loop's cost)."""
    found: dict = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "EpilogueReduce":
            found[node] = hosts_of(node)
        stack.extend((node.args[1],) if node.op == "Loop" else node.children)
    return found
