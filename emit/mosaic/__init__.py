"""Mosaic GPU templates (Hopper: TMA, SMEM tiles, warp-specialized wgmma) and the `mosaic` backend's
dispatch: which kernels it emits through them.

`backend="mosaic"` emits each kernel whose op has a Mosaic template (`TEMPLATES`: the matmul,
the conv and the attention) through it and every other kernel as `backend="pallas"` does (its Pallas Triton
template, or XLA where none covers it). A template has the contract of `emit.pallas`'s
(`emit(kernel, ctx)` -> values, kernels named `<component>:<kind>`, expressions compiled by
`emit.expr`); a form it does not cover raises `NotImplementedError("why")`, and the kernel then
goes to its Triton template with a `TritonFallbackWarning` naming the kernel and the reason —
never silently. Without a GPU the kernels run in GPU interpret mode
(`emit.mosaic.matmul.interpret_params`), as the Triton ones run with `interpret=True`.

The choice itself lives in `emit.backends` (below both template packages, so `emit.pallas`'s
emission loop asks it without importing this package):

    produced = emit_on_mosaic(call, ctx) or <its Triton template>
"""

from __future__ import annotations

from emit.backends import MOSAIC_TEMPLATES as TEMPLATES
from emit.backends import TritonFallbackWarning, emit_on_mosaic, runs_on_mosaic

__all__ = ["TEMPLATES", "TritonFallbackWarning", "emit_kernel", "emit_on_mosaic", "runs_on_mosaic"]


def emit_kernel(kernel, ctx) -> dict:
    """The values of `kernel.term` from its Mosaic template (the statistics it reads finished first), or
    from `emit.pallas.emit_kernel` (its Triton template) with a `TritonFallbackWarning` when the Mosaic
    template does not cover it (`emit.pallas.emit_unshared`)."""
    from emit.pallas import emit_unshared

    return emit_unshared(kernel, ctx, mosaic=True)
