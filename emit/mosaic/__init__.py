"""Mosaic GPU templates (Hopper: TMA, SMEM tiles, warp-specialized wgmma) and the `mosaic` backend's
dispatch: which kernels it emits through them.

`backend="mosaic"` emits each kernel whose op has a Mosaic template (`TEMPLATES`) through it and
every other kernel as `backend="pallas"` does (its Pallas Triton template, or XLA where none
covers it). A template has the contract of `emit.pallas`'s (`emit(kernel, ctx)` -> values, kernels
named `<component>:<kind>`, expressions compiled by `emit.expr`); a form it does not cover raises
`NotImplementedError("why")`, and the kernel then goes to its Triton template with a
`TritonFallbackWarning` naming the kernel and the reason — never silently. Without a GPU the
kernels run in GPU interpret mode (`emit.mosaic.matmul.interpret_params`), as the Triton ones run
with `interpret=True`.

    if runs_on_mosaic(call.term): produced = emit_kernel(call, ctx)
"""

from __future__ import annotations

import importlib
import warnings

from eqsat.term import Term

TEMPLATES: dict[str, str] = {
    "Matmul": "emit.mosaic.matmul",
    "Attention": "emit.mosaic.attention",
}


class TritonFallbackWarning(UserWarning):
    """A kernel of the `mosaic` backend ran through its Pallas Triton template instead."""


def runs_on_mosaic(term: Term) -> bool:
    """Whether the `mosaic` backend tries the kernel `term` with a Mosaic GPU template."""
    return term.op in TEMPLATES


def emit_kernel(kernel, ctx) -> dict:
    """The values of `kernel.term` from its Mosaic template, or from `emit.pallas.emit_kernel` (its
    Triton template) with a `TritonFallbackWarning` when the Mosaic template does not cover it."""
    from emit.pallas import TemplateError, emit_kernel as emit_triton, is_empty

    if is_empty(kernel):
        return emit_triton(kernel, ctx)
    module = importlib.import_module(TEMPLATES[kernel.term.op])
    try:
        return module.emit(kernel, ctx)
    except NotImplementedError as error:
        reason = str(error) or f"{module.__name__} does not cover this {kernel.term.op}"
    except (KeyError, AssertionError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise TemplateError(f"{kernel.name} ({kernel.term.op}): {module.__name__} failed on a kernel the plan "
                            f"gave it: {type(error).__name__}: {str(error) or type(error).__name__}") from error
    warnings.warn(f"{kernel.name} ({kernel.term.op}) runs through its Triton template: {reason}",
                  TritonFallbackWarning, stacklevel=2)
    return emit_triton(kernel, ctx)
