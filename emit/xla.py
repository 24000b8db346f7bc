"""The XLA emitter: a plan as one jitted JAX function, each kernel computed with jax.numpy / lax.

It is the reference every Pallas template is tested against and the fast path on a CPU. A kernel's
value comes from the reference interpreter (`eqsat.interpret`) applied to that one kernel term,
its inputs bound to the values already computed, so the semantics are the interpreter's, not a
second copy of them. Each kernel is traced under `jax.named_scope(kernel.name)`, so XLA's
profile and HLO metadata read like the plan; XLA is then free to fuse across kernels.

    values = emit_kernel(KernelCall(term, "mid_block.resnets.0:pointwise", hosted), ctx)
"""

from __future__ import annotations

from eqsat.interpret import _Evaluator


def emit_kernel(kernel, ctx) -> dict:
    """`{kernel.term: value, **{hosted: value}}` for an `emit.pallas.KernelCall` in an `EmitContext`.

    Hosted statistics (`EpilogueReduce`) are plain reductions here: the interpreter's value of
    `Reduce(op, body, axes)`.
    """
    known = _Evaluator({}, ctx.constants, ctx.payloads)
    known.values = ctx.values  # read-only parent: the kernel's operands (and loop args) by term
    evaluator = _Evaluator({}, ctx.constants, ctx.payloads, parent=known)
    # Every output of a multi-output Opaque/Loop is its own kernel term: run the primitive once.
    evaluator.multi = ctx.shared.setdefault("interpreter multi-output results", {})
    terms = [kernel.term, *kernel.hosted]
    return dict(zip(terms, evaluator.run(terms)))
