"""The per-kernel backend choice and what every template backend shares: the emission errors, a
kernel's operands, and whether a kernel launches anything.

Both template packages sit above this module: `emit.pallas` (its emission loop, `run_kernels`,
asks `emit_on_mosaic` here for the kernels of `backend="mosaic"`) and `emit.mosaic` (whose
templates reuse `emit.pallas`'s helpers). Nothing here imports either package at import time; a
Mosaic template module is loaded by name when a kernel first needs it.

    produced = emit_on_mosaic(call, ctx)     # None: not a Mosaic kernel, or its template declined
    if produced is None: produced = <its Triton template>
    mosaic_prepared_layouts(term), mosaic_side_values(tensor)   # what a shared Mosaic emission passes
    mosaic_halo_table(conv)                                     # the table a Triton kernel writes for it
"""

from __future__ import annotations

import importlib
import warnings

from eqsat.term import Term

# Kernel op -> its Mosaic GPU template module (`backend="mosaic"`).
MOSAIC_TEMPLATES: dict[str, str] = {
    "Matmul": "emit.mosaic.matmul",
    "Conv": "emit.mosaic.conv",
    "Attention": "emit.mosaic.attention",
}


class EmitError(RuntimeError):
    """The plan cannot be emitted as given (a broken contract between extraction and emission: a
    bug in eqsat, never the user's). The message names the kernel or tensor and the reason."""


class TemplateError(EmitError):
    """A template failed on a kernel the plan gave it. The message names the kernel, its op and the
    unmet condition."""


class TritonFallbackWarning(UserWarning):
    """A kernel of the `mosaic` backend ran through its Pallas Triton template instead."""


def loaded_tensors(*exprs: Term) -> list[Term]:
    """The distinct tensors `Load`ed by `exprs` (Expr terms), in first-seen order: a kernel's operands."""
    from emit.expr import expr_nodes

    seen: dict[int, Term] = {}
    for node in expr_nodes(*exprs):
        if node.op == "Load" and id(node.args[0]) not in seen:
            seen[id(node.args[0])] = node.args[0]
    return list(seen.values())


def kernel_exprs(term: Term) -> list[Term]:
    """The Expr arguments of a kernel term (operands, epilogue, bias ...)."""
    return [arg for arg in term.args if isinstance(arg, Term) and arg.sort == "Expr"]


def is_empty(kernel) -> bool:
    """Whether the kernel writes no element or reads an operand with none (a zero-size axis)."""
    from eqsat.types import parse_type

    tensors = [kernel.term, *kernel.hosted, *loaded_tensors(*kernel_exprs(kernel.term))]
    return any(0 in parse_type(t.ty).shape for t in tensors if t.sort == "Tensor")


def runs_on_mosaic(term: Term) -> bool:
    """Whether the `mosaic` backend tries the kernel `term` with a Mosaic GPU template."""
    return term.op in MOSAIC_TEMPLATES


def emit_on_mosaic(kernel, ctx) -> dict | None:
    """The values of `kernel.term` from its Mosaic template, or None when the caller should run its
    Triton template: the kernel has no Mosaic template or launches nothing (silently), or the
    template does not cover its form (`NotImplementedError`: a `TritonFallbackWarning` names the
    kernel and the reason). Any other exception is a broken contract: `TemplateError`."""
    if not runs_on_mosaic(kernel.term) or is_empty(kernel):
        return None
    module = importlib.import_module(MOSAIC_TEMPLATES[kernel.term.op])
    try:
        return module.emit(kernel, ctx)
    except NotImplementedError as error:
        reason = str(error) or f"{module.__name__} does not cover this {kernel.term.op}"
    except (KeyError, AssertionError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise TemplateError(f"{kernel.name} ({kernel.term.op}): {module.__name__} failed on a kernel the plan "
                            f"gave it: {type(error).__name__}: {str(error) or type(error).__name__}") from error
    warnings.warn(f"{kernel.name} ({kernel.term.op}) runs through its Triton template: {reason}",
                  TritonFallbackWarning, stacklevel=3)
    return None


# Where the Mosaic templates keep what a shared emission (`emit.pallas.emit_shared`) passes them
# besides the values they read: the prepared weight layouts, the other forms of tensors they leave.
MOSAIC_LAYOUTS = "emit.mosaic.layouts"


def mosaic_prepared_layouts(term: Term) -> list[Term]:
    """The weight layouts the prepare stage may have made for Mosaic kernel `term`
    (`emit.mosaic.layouts.prepared_layouts`, loaded by name)."""
    return importlib.import_module(MOSAIC_LAYOUTS).prepared_layouts(term)


def mosaic_halo_table(term: Term):
    """The vector table the haloed Mosaic conv `term` reads (`emit.mosaic.conv.halo_table`, loaded by
    name), or None."""
    return importlib.import_module(MOSAIC_TEMPLATES["Conv"]).halo_table(term)


def mosaic_side_values(tensor: Term) -> list:
    """The keys of other forms of `tensor` Mosaic templates leave in the context for its readers
    (`emit.mosaic.layouts.side_values`, loaded by name)."""
    return importlib.import_module(MOSAIC_LAYOUTS).side_values(tensor)


# --- which backend emits each kernel: the cost model's choice -------------------------------------

# An emission backend -> how the cost model prices its dense kernels (`eqsat.cost.devices.Device.backend`).
COST_BACKENDS = {"pallas": "triton", "mosaic": "mosaic", "hybrid": "hybrid", "routed": "auto"}


def cost_backend(backend: str) -> str:
    """The cost model's backend for an emission backend (resolved: not "auto"): `routed` prices
    each kernel by whichever route is cheapest; `xla` and `interpret` keep the default pricing."""
    return COST_BACKENDS.get(backend, "triton")


def on_hopper() -> bool:
    """Whether jax's default backend is a GPU of compute capability 9 (H100, H200)."""
    import jax

    if jax.default_backend() != "gpu":
        return False
    capability = str(getattr(jax.devices()[0], "compute_capability", "") or "")
    return capability.split(".")[0] == "9"


def plan_routes(plan, device=None) -> dict:
    """Kernel term -> "triton" | "mosaic" | "library" for every dense kernel of `plan`, as the cost
    model chooses them with the `auto` backend on `device` (default the plan's device profile):
    `eqsat.cost.roofline.choose_route`, with the statistics the plan hosts on each kernel. What the
    `routed` backend emits and what `report()` and `benchmarks.kernels` show."""
    from eqsat.cost import get_device, hosted_reductions
    from eqsat.cost import kernels as kernel_order
    from eqsat.cost.backends import DENSE
    from eqsat.cost.devices import with_backend
    from eqsat.cost.roofline import choose_route, finished_statistics

    device = with_backend(get_device(device if device is not None else plan.device), "auto")
    outputs = list(plan.outputs)
    hosting = hosted_reductions(outputs)
    finished = finished_statistics(kernel_order(outputs, hosting), hosting, device, outputs)
    routes = {}
    for kernel in plan.kernels:
        if kernel.op in DENSE:
            routes[kernel.term] = choose_route(kernel.term, device, finished, tuple(kernel.hosted))[0]
    return routes
