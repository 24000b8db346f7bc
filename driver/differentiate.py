"""Derivatives of an optimized function: the emitted plan when it is only evaluated, the original
function's JVP when it is differentiated.

Pallas kernels have no general differentiation rule (`jax.grad` through a `pallas_call` that reads
`pl.program_id` fails inside Pallas with a bare `AssertionError`), so a call that JAX may
differentiate (some argument is a tracer: under `grad`, `jvp`, `vjp`, `hessian`, `jit`, `vmap`) runs
the plan inside a `jax.custom_jvp` whose rule is `jax.jvp` of the user's own function:

    evaluated:      out = the emitted plan (our kernels)
    differentiated: out, tangent out = jax.jvp(fn, primals, tangents)   (jax's own derivative)

Differentiated, the primal comes from the original program too: the tangents need its forward
values anyway, so running our kernels beside it would compute the forward twice.

Reverse mode comes from JAX linearizing and transposing that rule, so `grad`, `value_and_grad`,
`vjp`, `jvp`, `jacfwd`/`jacrev` and `hessian` (the rule is itself differentiable) all work on every
backend, and `jax.checkpoint` inside `fn` is respected where the tangents are computed. What this
does not do yet (issue 20): plan and emit the backward pass itself; the tangent program runs as
`jax.jit` would run it, recomputing the forward values it needs (no residuals are kept from our
kernels). Calls with concrete arguments only (no tracer) cannot be differentiated and run the plan
directly, so the prepare stage's cache by argument identity keeps working.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax


def any_tracer(tree) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def with_original_derivatives(run: Callable, fn: Callable, args: Sequence, kwargs: dict,
                              is_static: Callable[[int], bool], static_names: Sequence[str]):
    """`run(*args, **kwargs)` (the emitted plan) with the derivatives of `fn(*args, **kwargs)`.

    Static arguments (`is_static(i)` for positional `i`, `static_names` for keywords) are closed
    over; every other argument is a pytree of differentiable (or integer) leaves."""
    static_kwargs = {k: v for k, v in kwargs.items() if k in static_names}
    dynamic = ([a for i, a in enumerate(args) if not is_static(i)],
               {k: v for k, v in kwargs.items() if k not in static_names})
    leaves, tree = jax.tree_util.tree_flatten(dynamic)

    def rebuild(values):
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(tree, list(values))
        dyn_args = iter(dyn_args)
        full = [a if is_static(i) else next(dyn_args) for i, a in enumerate(args)]
        return full, {**static_kwargs, **dyn_kwargs}

    def call_with(function):
        def called(*values):
            full, keywords = rebuild(values)
            return function(*full, **keywords)
        return called

    planned = jax.custom_jvp(call_with(run))

    @planned.defjvp
    def planned_jvp(primals, tangents):
        return jax.jvp(call_with(fn), primals, tangents)

    return planned(*leaves)
