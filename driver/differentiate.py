"""Derivatives of an optimized function: reverse mode through a planned and emitted backward, forward
mode through the original function's JVP.

Which wrapper a call takes is chosen per call, from the JAX transformations its arguments are traced
by (`differentiation_mode`):

    reverse  (`grad`, `value_and_grad`, `vjp`, `jacrev`, their `vmap`/`jit`, grad of grad):
             a `jax.custom_vjp` (`with_planned_backward`) whose
               forward  = the plan of `x -> (fn(x), residuals of jax.vjp(fn, x))`: primal outputs and
                          residuals planned and emitted together, so fusions see both (residuals that are
                          inputs are not outputs: they are kept as given). The residuals kept are the
                          matmul and conv outputs (`KEEP_HEAVY_OUTPUTS`; where `fn` has no
                          `jax.checkpoint` of its own); the backward recomputes the rest inside its
                          fused kernels;
               backward = the plan of `(residuals, cotangents) -> jax.vjp's pullback`, the transposed
                          linear program, planned and emitted with the same backend and options.
             Both are `Optimized` functions themselves, so differentiating them again (grad of grad)
             takes the same route. `jax.checkpoint` inside `fn` is respected: `jax.vjp` keeps only
             the checkpointed block's inputs as residuals and the backward recomputes the rest.
    forward  (`jvp`, `jacfwd`, `hessian` = jacfwd of jacrev, `jax.linearize`, and calls inside a
             `jit` whose outer transformation cannot be seen): a `jax.custom_jvp`
             (`with_original_derivatives`) whose rule is `jax.jvp` of the user's function, for the
             backends whose kernels have no derivative (pallas, mosaic, hybrid); the `xla` and
             `interpret` plans are jax.numpy and differentiate as they are.

A `custom_vjp` cannot be differentiated in forward mode (JAX raises "can't apply forward-mode
autodiff (jvp) to a custom_vjp function", also for the linear function `jax.linearize` returns),
hence the choice: any `JVPTrace` among the tracers, `jax.linearize` on the stack, or no JAX
differentiation visible at all (a call traced by a `jit` that a `grad` may wrap later) keeps the
custom_jvp route, which every transformation can take.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax


def any_tracer(tree) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def differentiation_mode(tree) -> str | None:
    """"reverse" when the leaves of `tree` are traced by reverse-mode differentiation only, "forward"
    when forward mode may apply (see the module docstring), None when nothing differentiates them."""
    traces = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.core.Tracer):
            _trace_kinds(leaf, traces, depth=0)
    if "JVPTrace" in traces:
        return "forward"
    if "LinearizeTrace" in traces:
        return "forward" if _inside_jax_linearize() else "reverse"
    return None


def _trace_kinds(tracer, kinds: set, depth: int) -> None:
    """The trace types of `tracer` and of the tracers it wraps (a LinearizeTracer's primal, a
    BatchTracer's value, ...): the transformations applied to a call, outermost last."""
    kinds.add(type(getattr(tracer, "_trace", None)).__name__)
    if depth > 32:
        return
    for value in getattr(tracer, "__dict__", {}).values():
        if isinstance(value, jax.core.Tracer):
            _trace_kinds(value, kinds, depth + 1)


def _inside_jax_linearize() -> bool:
    """`jax.linearize` traces with the same LinearizeTrace as `jax.vjp`, but its linear function is
    applied forward: a custom_vjp there would fail. Seen by its frame on the stack."""
    code = jax.linearize.__wrapped__.__code__ if hasattr(jax.linearize, "__wrapped__") else jax.linearize.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class _Arguments:
    """The dynamic leaves of a call's arguments, and the call rebuilt from new values for them.
    Static arguments (`is_static(i)` for positional `i`, `static_names` for keywords) are closed
    over; every other argument is a pytree of differentiable (or integer) leaves."""

    def __init__(self, args: Sequence, kwargs: dict, is_static: Callable[[int], bool], static_names: Sequence[str]):
        self.args, self.is_static = args, is_static
        self.static_kwargs = {k: v for k, v in kwargs.items() if k in static_names}
        dynamic = ([a for i, a in enumerate(args) if not is_static(i)],
                   {k: v for k, v in kwargs.items() if k not in static_names})
        self.leaves, self.tree = jax.tree_util.tree_flatten(dynamic)

    def calling(self, function: Callable) -> Callable:
        """`function` of the dynamic leaves, the static arguments put back in place."""
        def called(*values):
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(self.tree, list(values))
            dyn_args = iter(dyn_args)
            full = [a if self.is_static(i) else next(dyn_args) for i, a in enumerate(self.args)]
            return function(*full, **{**self.static_kwargs, **dyn_kwargs})
        return called


def with_original_derivatives(run: Callable, fn: Callable, args: Sequence, kwargs: dict,
                              is_static: Callable[[int], bool], static_names: Sequence[str]):
    """`run(*args, **kwargs)` (the emitted plan) with the derivatives of `fn(*args, **kwargs)`.

    Differentiated, the primal comes from the original program too: the tangents need its forward
    values anyway, so running our kernels beside it would compute the forward twice."""
    arguments = _Arguments(args, kwargs, is_static, static_names)
    planned = jax.custom_jvp(arguments.calling(run))

    @planned.defjvp
    def planned_jvp(primals, tangents):
        return jax.jvp(arguments.calling(fn), primals, tangents)

    return planned(*arguments.leaves)


@dataclass
class Residuals:
    """How the forward plan's residuals make `jax.vjp`'s pullback, filled when the forward is traced
    (once per argument signature): the pullback's pytree structure, and for each of its leaves
    where it comes from: ("input", i) a dynamic argument leaf kept as given, ("output", j) the
    forward plan's j-th residual output."""

    pullback_tree: object = None
    sources: list = field(default_factory=list)
    differentiable: list = field(default_factory=list)  # per argument leaf: has a cotangent

    def pullback(self, inputs: Sequence, outputs: Sequence):
        leaves = [inputs[i] if kind == "input" else outputs[i] for kind, i in self.sources]
        return jax.tree_util.tree_unflatten(self.pullback_tree, leaves)


# Which residuals the planned forward keeps: the outputs of matmuls and convolutions (a
# `jax.checkpoint` policy); the backward recomputes the elementwise and normalization values from
# them inside its own fused kernels. Keeping every residual `jax.vjp` keeps would make each one a
# forward output that ends a fusion: on the tiny SD 1.5 UNet's training step, 454 residuals and
# 444 + 603 planned kernels, against 100 residuals and 132 + 645 kernels this way.
KEEP_HEAVY_OUTPUTS = jax.checkpoint_policies.dots_saveable


def uses_checkpoint(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr nested in it) has a `jax.checkpoint` block."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns") and uses_checkpoint(inner):
                    return True
    return False


def _differentiable(leaf) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(leaf), jax.numpy.inexact)


@dataclass
class PlannedVJP:
    """The planned forward (with residuals) and backward of one function for one argument signature."""

    forward: object       # driver.optimize.Optimized of (*leaves) -> (outputs, residual outputs)
    backward: object      # driver.optimize.Optimized of (residual outputs, inputs kept, cotangents) -> cotangents
    residuals: Residuals

    @classmethod
    def of(cls, flat_fn: Callable, optimize: Callable, keep: Callable | None = KEEP_HEAVY_OUTPUTS) -> "PlannedVJP":
        """`optimize(function)` plans and emits a function with the caller's backend and options.
        `keep`: a `jax.checkpoint` policy choosing the residuals kept (None: every one jax.vjp keeps);
        the backward recomputes the others from them."""
        residuals = Residuals()
        chosen = {}

        def kept_by_policy(*leaves):
            # A function with its own `jax.checkpoint` chooses its residuals: an outer policy
            # would reach into its blocks and keep what it recomputes.
            if "policy" not in chosen:
                chosen["policy"] = None if uses_checkpoint(jax.make_jaxpr(flat_fn)(*leaves).jaxpr) else keep
            if chosen["policy"] is None:
                return flat_fn(*leaves)
            return jax.checkpoint(flat_fn, policy=chosen["policy"])(*leaves)

        def forward_with_residuals(*leaves):
            # Integer leaves are closed over, not differentiated: no float0 cotangents in the backward.
            residuals.differentiable = [_differentiable(leaf) for leaf in leaves]

            def of_differentiable(*values):
                values = iter(values)
                return kept_by_policy(*(next(values) if d else leaf
                                        for leaf, d in zip(leaves, residuals.differentiable)))

            outputs, pullback = jax.vjp(of_differentiable,
                                        *(leaf for leaf, d in zip(leaves, residuals.differentiable) if d))
            pullback_leaves, residuals.pullback_tree = jax.tree_util.tree_flatten(pullback)
            positions = {id(leaf): i for i, leaf in enumerate(leaves)}
            kept, residuals.sources = [], []
            for leaf in pullback_leaves:
                if id(leaf) in positions:
                    residuals.sources.append(("input", positions[id(leaf)]))
                else:
                    residuals.sources.append(("output", len(kept)))
                    kept.append(leaf)
            return outputs, kept

        def backward(kept, inputs, cotangents):
            return list(residuals.pullback(inputs, kept)(cotangents))

        return cls(optimize(forward_with_residuals), optimize(backward), residuals)

    def inputs_kept(self, leaves: Sequence) -> list:
        """The argument leaves the pullback reads (None for the others: nothing kept)."""
        used = {i for kind, i in self.residuals.sources if kind == "input"}
        return [leaf if i in used else None for i, leaf in enumerate(leaves)]

    def cotangents(self, planned: Sequence) -> tuple:
        """The backward plan's cotangents of the differentiable leaves, None for the others."""
        planned = iter(planned)
        return tuple(next(planned) if d else None for d in self.residuals.differentiable)


def with_planned_backward(vjp: PlannedVJP, args: Sequence, kwargs: dict, is_static: Callable[[int], bool],
                          static_names: Sequence[str]):
    """`fn(*args, **kwargs)` as a `jax.custom_vjp` whose forward and backward are `vjp`'s plans."""
    arguments = _Arguments(args, kwargs, is_static, static_names)

    @jax.custom_vjp
    def planned(*leaves):
        return vjp.forward(*leaves)[0]

    def planned_forward(*leaves):
        outputs, kept = vjp.forward(*leaves)
        return outputs, (kept, vjp.inputs_kept(leaves))

    def planned_backward(saved, cotangents):
        kept, inputs = saved
        return vjp.cotangents(vjp.backward(kept, inputs, cotangents))

    planned.defvjp(planned_forward, planned_backward)
    return planned(*arguments.leaves)


def flat_function(fn: Callable, args: Sequence, kwargs: dict, is_static: Callable[[int], bool],
                  static_names: Sequence[str]) -> Callable:
    """`fn` as a function of the call's dynamic leaves (what `PlannedVJP.of` plans)."""
    return _Arguments(args, kwargs, is_static, static_names).calling(fn)
