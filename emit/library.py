"""Which kernels the `hybrid` backend hands to XLA's GPU libraries instead of a Pallas template.

`backend="hybrid"` (what `"auto"` picks on a GPU) emits each kernel of the plan through the
emitter that is faster for its kind, as measured on a GPU, not assumed:

- `Conv` and `Matmul` through the XLA emitter (`emit.xla`): XLA lowers them to cuDNN / cuBLAS (or
  its own Triton GEMMs) and fuses the kernel's prologue and epilogue into fusions around the call;
- every other kind (flash attention, pointwise with its fused expression, reductions, hosted
  statistics, gathers, loops) through its Pallas template, as `backend="pallas"` does.

The evidence (`python -m benchmarks.gpu` and `python -m benchmarks.conv_sweep` on an NVIDIA H200,
jax 0.11.2; `benchmarks/results/`): the Pallas Triton conv template ran SD 1.5's GroupNorm+SiLU ->
3x3 convs at 2-7 TFLOP/s, 11-15x slower than `jax.jit`'s cuDNN path at its best of 8 tile
configurations on every UNet shape, and the UNet step's 84 convs took 76 ms against 1.9 ms modeled;
its 100 matmuls took 26 ms (18x their model), cuBLAS's take a few milliseconds. The attention
template (2.8 ms for the UNet's 32) is faster than XLA's unfused softmax attention. Until a conv or
matmul template beats the library on the same shapes (issues 16 and 17: vector loads, wgmma,
Mosaic GPU), the library runs them. `LIBRARY_OPS` is the one place to change that.

A statistic hosted in a library kernel's epilogue (the next GroupNorm's moments) is computed by
that kernel, finished, when it is the statistic's only host; with several hosts it is left to the
driver, which reduces it once after its last host (`emit.pallas.run_kernels`).
"""

from __future__ import annotations

from eqsat.term import Term

LIBRARY_OPS = frozenset({"Conv", "Matmul"})


def runs_in_library(term: Term) -> bool:
    """Whether the `hybrid` backend emits the kernel `term` through XLA's libraries."""
    return term.op in LIBRARY_OPS
