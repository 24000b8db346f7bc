"""Sibling reductions stacked into one kernel: a horizontal fusion on the extracted plan.

A backward pass reduces the same activations many times over the same axes, and none of these
reductions waits for another: a GroupNorm's weight and bias gradients (`sum(g * x̂)` and `sum(g)`
over batch and pixels), the moments of the three LayerNorm inputs of a transformer block (each a
view of one residual stream), the softmax statistics of an attention's scores. Each is its own
reduction kernel after extraction: on the SD 1.5 UNet's fine-tuning step, 237 more launches than
needed. XLA's multi-output fusion merges such siblings; this pass does the same for our plans.

Reductions are stacked when they have the same op (`sum`, `max`, `min`, `moments`), the same body
type, the same reduced axes, the same output type and an identity epilogue (or a negated sum, whose
row reduces the negated body), read at least one large
tensor in common (`MIN_SHARED_FRACTION` of the body), and neither depends on the other, even through other
stacks (reachability is kept on the contracted kernel graph as stacks form, as XLA's multi-output
fusion does). The stack is one reduction of the bodies concatenated along a new leading axis,

    S = Reduce(op, concat([reshape(b1, [1, ...]), reshape(b2, [1, ...]), ...], 0), axes + 1, ...)

(`moments` of `[n, ...]` is `[2, n, ...]`), and every reader of member i reads `S[i]` (a `Slice` and
a `Reshape` of `Load(S)`) where it read the member. Same values, element for element: each row
reduces exactly its member's body over the same axes (norm_split stacks `sum(x)` and `sum(x*x)` the
same way, in the e-graph).

Why a pass on the plan and not a rewrite rule: whether two reductions may share a kernel depends on
the whole extracted program (one must not feed the other through any chain of kernels), which no
e-graph pattern sees, and grouping every same-shaped reduction in the e-graph would grow it by every
subset. Extraction and the cost model still price each stacked kernel (`Plan.build` prices the
stacked term); members that are plan outputs, hosted statistics (`EpilogueReduce`) and reductions
read other than through `Load` are left alone.

    outputs, source_of = stack_sibling_reductions(outputs, hosting)   # source_of: new term -> old term
"""

from __future__ import annotations

from eqsat.cost import kernel_reads, kernels as kernel_order
from eqsat.cost.terms import size_of
from eqsat.term import Term, postorder
from eqsat.types import format_type, ints, ints_key, parse_type

STACKED_OPS = frozenset({"sum", "max", "min", "moments"})
# A tensor counts as a shared input when it has at least this share of the reduction body's elements
# (an activation, not a weight vector or another statistic: those are read by unrelated reductions).
MIN_SHARED_FRACTION = 1 / 8
# Members per stacked kernel at most (one launch, one body per row: a bound on its code size).
MAX_STACK = 16



def _key(term: Term):
    """The stacking key of a kernel term, None when it is not a stackable reduction."""
    if term.op != "Reduce":
        return None
    op, body, axes, epilogue, ty = term.args
    if op not in STACKED_OPS or not ints(axes) or _row_body(term) is None:
        return None
    return op, body.ty, axes, ty


def _row_body(term: Term) -> Term | None:
    """What the reduction's row of a stack reduces: its body, or for `-sum(b)` the body `-b` (exact:
    negation commutes with every rounding); None for any other epilogue."""
    op, body, _, epilogue, ty = term.args
    if epilogue.op == "Acc" and epilogue.args[0] == ty:
        return body
    negated = epilogue.op == "Unary" and epilogue.args[0] == "neg" and epilogue.args[1].op == "Acc"
    if op == "sum" and negated and epilogue.args[1].args[0] == ty:  # accumulated in the output's type
        return Term("Unary", "neg", body, body.ty)
    return None


def reads_only_through_loads(roots, members: set) -> set:
    """The `members` (kernel terms) read only through `Load` by the terms reachable from `roots`, and
    not roots themselves: a pass may replace such a read with an expression."""
    bad = {m for m in members if any(r is m for r in roots)}
    for node in postorder(roots):
        if node.op != "Load":
            bad.update(child for child in node.children if child in members)
    return members - bad


def stack_sibling_reductions(outputs, hosting: dict) -> tuple[list, dict]:
    """`outputs` with independent sibling reductions stacked (see the module docstring), and the map
    from each rebuilt term to the term it replaces (for its component and e-class). Unchanged
    outputs (and an empty map) when nothing stacks."""
    order = kernel_order(outputs, hosting)
    index = {term: i for i, term in enumerate(order)}
    for reduction, hosts in hosting.items():  # a hosted statistic is ready when its first host ran
        if hosts:
            index.setdefault(reduction, min(index[h] for h in hosts if h in index))
    candidates = {term for term in order if _key(term) is not None}
    if len(candidates) < 2:
        return list(outputs), {}
    candidates = reads_only_through_loads(outputs, candidates)

    ancestors: list[int] = []
    shared: list[set] = []
    for i, term in enumerate(order):
        bits = 0
        large = set()
        least = size_of(term.args[1].ty) * MIN_SHARED_FRACTION if term in candidates else None
        for tensor in kernel_reads(term):
            j = index.get(tensor)
            if j is not None and j != i:
                bits |= ancestors[j] | (1 << j)
            if least is not None and size_of(tensor.ty) >= least:
                large.add(tensor)
        ancestors.append(bits)
        shared.append(large)

    stacks: dict[tuple, list[dict]] = {}
    for i, term in enumerate(order):
        if term not in candidates:
            continue
        for stack in stacks.setdefault(_key(term), []):
            if (len(stack["members"]) >= MAX_STACK or not shared[i] & stack["reads"]
                    or ancestors[i] & stack["bits"] or (stack["ancestors"] >> i) & 1):
                continue
            stack["members"].append(i)
            stack["reads"] |= shared[i]
            stack["bits"] |= 1 << i
            stack["ancestors"] |= ancestors[i]
            merged, node = stack["ancestors"], stack["bits"]
            for member in stack["members"]:
                ancestors[member] = merged
            for j in range(len(order)):  # what reads any member now waits for the whole stack
                if ancestors[j] & node and not (node >> j) & 1:
                    ancestors[j] |= merged | node
            break
        else:
            stacks[_key(term)].append({"members": [i], "reads": set(shared[i]), "bits": 1 << i,
                                       "ancestors": ancestors[i]})

    replace: dict = {}  # Load(member) -> its row of the stacked reduction
    stacked_members: dict = {}  # stacked term (before rebuilding) -> its member terms
    for groups in stacks.values():
        for stack in groups:
            if len(stack["members"]) < 2:
                continue
            members = [order[i] for i in stack["members"]]
            stacked = _stacked(members)
            stacked_members[stacked] = members
            for row, member in enumerate(members):
                replace[Term("Load", member, member.ty)] = _row(stacked, row, member)
    if not replace:
        return list(outputs), {}
    rebuilt = substitute(outputs, replace)
    source_of = {new: old for old, new in rebuilt.items() if new is not old and old.sort == "Tensor"}
    for stacked, members in stacked_members.items():
        source_of[rebuilt.get(stacked, stacked)] = members[0]
    return [rebuilt.get(o, o) for o in outputs], source_of


def _stacked(members: list) -> Term:
    op, body, axes, _, ty = members[0].args
    n = len(members)
    body_shape = parse_type(body.ty).shape
    dtype = parse_type(body.ty).dtype
    row_ty = format_type(dtype, (1, *body_shape))
    rows = [Term("Reshape", _row_body(m), row_ty) for m in members]
    stacked = rows[0]
    for k, row in enumerate(rows[1:], start=1):
        stacked = Term("Concat", stacked, row, 0, k, format_type(dtype, (k + 1, *body_shape)))
    out = parse_type(ty)
    shape = (2, n, *out.shape[1:]) if op == "moments" else (n, *out.shape)
    out_ty = format_type(out.dtype, shape)
    return Term("Reduce", op, stacked, ints_key(a + 1 for a in ints(axes)), Term("Acc", out_ty), out_ty)


def _row(stacked: Term, row: int, member: Term) -> Term:
    """Member `row`'s value read from the stacked reduction: `Reshape(Slice(Load(S)))`."""
    full = parse_type(stacked.ty)
    axis = 1 if stacked.args[0] == "moments" else 0
    sliced = list(full.shape)
    sliced[axis] = 1
    view = Term("Slice", Term("Load", stacked, stacked.ty), axis, row, row + 1, 1, format_type(full.dtype, sliced))
    return Term("Reshape", view, member.ty)


def substitute(roots, replace: dict) -> dict:
    """Every term reachable from `roots` (and from the replacements) -> its rebuilt version, with each
    key of `replace` swapped for its value; iterative (plans are deep)."""
    done: dict = {}
    stack = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in done:
            continue
        if node in replace:
            target = replace[node]
            if target in done:
                done[node] = done[target]
            else:
                stack.append((node, False))
                stack.append((target, False))
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in node.children if child not in done)
            continue
        if any(done[child] is not child for child in node.children):
            args = tuple(done[a] if isinstance(a, Term) else a for a in node.args)
            done[node] = Term(node.op, *args)
        else:
            done[node] = node
    return done
