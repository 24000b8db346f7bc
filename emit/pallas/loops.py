"""`Opaque` and `Loop` kernels: the original primitive, and loop bodies emitted kernel by kernel.

- `Opaque(key, operands, index)`: `payloads[key] = (primitive, params)` bound to the operands'
  values, as XLA runs it (no template covers it by definition). A multi-output primitive runs once
  per (key, operands); each `index` picks its output.
- `Loop(key, operands, body, index)`: the payload's `kind` (layouts in `eqsat.lift`) becomes
  `lax.scan`, `lax.while_loop` or `lax.switch`, whose step binds the body's `LoopArg`s and emits
  the body's own kernels in order (`body_kernels`: what the body's results need that is not
  computed outside the loop) through the same dispatch as the top level, so a scanned matmul is
  a Pallas matmul inside the scan. Statistics a body's kernel could host run as their own
  reduce kernels there.
"""

from __future__ import annotations

from jax import lax

from emit.pallas import EmitContext, KernelCall, run_kernels
from eqsat.lang import KERNEL_OPS
from eqsat.term import Term, list_items


def _shared(ctx: EmitContext, key, compute):
    results = ctx.shared.get(key)
    if results is None:
        results = compute()
        ctx.shared[key] = results
    return results


def body_kernels(items: list[Term], known) -> list[Term]:
    """The kernel terms computing a loop body's `items`, producers first, stopping at tensors
    already `known` (computed outside the loop: a hoisted value, another loop's output)."""
    order: list[Term] = []
    done: set[int] = set()
    stack: list[tuple[Term, bool]] = [(item, False) for item in reversed(items)]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        if ready:
            done.add(id(node))
            if node.op in KERNEL_OPS or node.op == "EpilogueReduce":
                order.append(node)
            continue
        if node.sort == "Tensor" and node in known:
            done.add(id(node))
            continue
        stack.append((node, True))
        children = (node.args[1],) if node.op == "Loop" else node.children
        stack.extend((child, False) for child in reversed(children) if id(child) not in done)
    return order


def _body_calls(ctx: EmitContext, items: list[Term], loop_name: str) -> list[KernelCall]:
    """The body's kernels as calls; each `EpilogueReduce` is its own reduce kernel inside a loop body."""
    return [KernelCall(term, ctx.kernel_name(term, default=loop_name)) for term in body_kernels(items, ctx.values)]


def _loop_args(key: str, items: list[Term], known) -> dict[int, Term]:
    """Loop `key`'s `LoopArg` terms in its body, by index (not looking past tensors already `known`)."""
    found: dict[int, Term] = {}
    seen: set[int] = set()
    stack = list(items)
    while stack:
        node = stack.pop()
        if id(node) in seen or (node.sort == "Tensor" and node in known):
            continue
        seen.add(id(node))
        if node.op == "LoopArg" and node.args[0] == key:
            found[node.args[1]] = node
        stack.extend(node.children)
    return found


def _run_body(ctx: EmitContext, key: str, args_by_index: dict[int, Term], calls, items, values: list) -> list:
    bound = {term: values[i] for i, term in args_by_index.items()}
    child = ctx.child(bound)
    run_kernels(calls, child)
    return [child.value(item) for item in items]


def run_loop(term: Term, ctx: EmitContext, name: str) -> list:
    """Every output of the loop `term` belongs to (computed once per loop)."""
    key, operands, body, _index, _ty = term.args
    spec = ctx.payloads[key]
    items = list_items(body)
    values = [ctx.value(t) for t in list_items(operands)]
    args = _loop_args(key, items, ctx.values)
    kind = spec["kind"]
    if kind == "scan":
        n_consts, n_carry = spec["num_consts"], spec["num_carry"]
        consts, init, xs = values[:n_consts], values[n_consts:n_consts + n_carry], values[n_consts + n_carry:]
        calls = _body_calls(ctx, items, name)

        def step(carry, x):
            outs = _run_body(ctx, key, args, calls, items, consts + list(carry) + list(x))
            return tuple(outs[:n_carry]), tuple(outs[n_carry:])

        final, ys = lax.scan(step, tuple(init), tuple(xs), length=spec["length"], reverse=spec["reverse"],
                             unroll=spec.get("unroll", 1))
        return list(final) + list(ys)
    if kind == "while":
        n_consts = spec["num_consts"]
        consts, init = values[:n_consts], values[n_consts:]
        predicate, carried = items[0], items[1:]
        predicate_calls = _body_calls(ctx, [predicate], name)
        step_calls = _body_calls(ctx, carried, name)
        return list(lax.while_loop(
            lambda carry: _run_body(ctx, key, args, predicate_calls, [predicate], consts + list(carry))[0],
            lambda carry: tuple(_run_body(ctx, key, args, step_calls, carried, consts + list(carry))),
            tuple(init)))
    if kind == "cond":
        n_out = spec["num_outputs"]
        index, *ops = values

        def branch(b):
            branch_items = items[b * n_out:(b + 1) * n_out]
            calls = _body_calls(ctx, branch_items, name)
            return lambda *args_: tuple(_run_body(ctx, key, args, calls, branch_items, [index, *args_]))

        return list(lax.switch(index, [branch(b) for b in range(spec["num_branches"])], *ops))
    raise ValueError(f"unknown loop kind {kind!r} in {name}")


def run_opaque(term: Term, ctx: EmitContext) -> list:
    """Every output of the opaque primitive `term` is one of (computed once)."""
    key, operands, _index, _ty = term.args
    primitive, params = ctx.payloads[key]
    out = primitive.bind(*[ctx.value(t) for t in list_items(operands)], **params)
    return list(out) if primitive.multiple_results else [out]


def emit(kernel: KernelCall, ctx: EmitContext) -> dict:
    term = kernel.term
    if term.op == "Opaque":
        results = _shared(ctx, ("Opaque", term.args[0], term.args[1]), lambda: run_opaque(term, ctx))
        return {term: results[term.args[2]]}
    if term.op == "Loop":
        results = _shared(ctx, ("Loop", term.args[0], term.args[1], term.args[2]),
                          lambda: run_loop(term, ctx, kernel.name))
        return {term: results[term.args[3]]}
    raise NotImplementedError(f"the loops module does not emit {term.op}")
