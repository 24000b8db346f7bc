"""Small pointwise kernels computed in their readers instead of launched: a pass on the extracted plan.

A pointwise kernel over a statistic (`mean = sum / n` of a GroupNorm in a backward pass, a
`[2, 32]` tensor) costs a launch, 4 µs on an H100, for a few dozen elements; each of its readers
could compute it for almost nothing at every point where it reads it. Extraction leaves some such
kernels in its plans (on the SD 1.5 UNet's fine-tuning step, 80 in the backward plan, each read by
3 to 9 kernels). This pass inlines every candidate into all its readers at once
(`Load(P)` -> `P`'s body) and `Plan.build` keeps the result only when the cost model prices the
whole plan lower, so a reader whose template evaluates an operand many times (a conv's prologue
per tap) is charged for it.

Candidates: `Pointwise` kernels that are not plan outputs, read only through `Load`, with at most
`MAX_BODY_NODES` expression nodes (the recompute in each reader stays small) and at most
`1 / MIN_READER_RATIO` of the points every kernel reading them evaluates (its output; a
reduction's body) (a statistic-sized tensor read
by activation-sized kernels, whose launches its own would dominate).

    outputs, rebuilt = inline_small_kernels(plan)   # rebuilt: new term -> the term it replaces
"""

from __future__ import annotations

from eqsat.cost.terms import size_of
from eqsat.term import Term
from extract.siblings import reads_only_through_loads, substitute

MIN_READER_RATIO = 16
MAX_BODY_NODES = 16



def _body_nodes(expr: Term, limit: int) -> int:
    """Expression nodes of `expr` as a tree (stops counting past `limit`)."""
    count, stack = 0, [expr]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if node.op != "Load":
            stack.extend(node.children)
    return count


def inline_small_kernels(plan) -> tuple[list, dict]:
    """`plan.outputs` with every candidate (module docstring) computed in its readers, and the map
    from each rebuilt term to the term it replaces; `(plan.outputs, {})` when there is none."""
    outputs = list(plan.outputs)
    smallest_reader: dict = {}
    for kernel in plan.kernels:
        size = size_of((kernel.term.args[1] if kernel.op == "Reduce" else kernel.term).ty)  # the points it evaluates
        for tensor in kernel.inputs:
            smallest_reader[tensor] = min(size, smallest_reader.get(tensor, size))
    small = {k.term for k in plan.kernels
             if k.op == "Pointwise" and not k.hosted and k.term in smallest_reader
             and size_of(k.term.ty) * MIN_READER_RATIO <= smallest_reader[k.term]
             and _body_nodes(k.term.args[0], MAX_BODY_NODES) <= MAX_BODY_NODES}
    small = reads_only_through_loads(outputs, small)
    if not small:
        return outputs, {}
    replace = {Term("Load", term, term.ty): term.args[0] for term in small}
    rebuilt = substitute(outputs, replace)
    changed = {new: old for old, new in rebuilt.items() if new is not old and old.sort == "Tensor"}
    return [rebuilt.get(o, o) for o in outputs], changed
