"""What only the Pallas Triton lowering needs; every Triton-specific call of `emit/pallas/` lives here.

jax 0.10.2 facts this module encodes (`jax/_src/pallas/triton/lowering.py`):

- A bare `pallas_call` on a GPU goes to Mosaic GPU: `pallas_call` here always passes
  `compiler_params=CompilerParams(num_warps=..., num_stages=...)` so it lowers through Triton
  (and runs with `interpret=True` on a machine without a GPU).
- Every operand and result is passed as a flat 1-D ref in `pl.ANY` memory (a Triton pointer):
  a kernel reads any element through `RefMemory.load`, a *gather load*
  `plgpu.load(ref.at[flat_index_array], mask=..., other=0)` at the row-major offset of an
  index tile (so a transposed, reshaped, sliced or broadcast operand is read in place), and
  writes with `store` (a contiguous `pl.ds` block or a scattered index array, masked).
- Every value inside a kernel must have power-of-two dimensions (`next_pow2`; tails are masked).
- There is no `erf` lowering: `emit.expr.erf` is a float32 polynomial (|error| < 1e-6).
- `concatenate` only lowers on `[..., 1]` blocks: templates split K ranges instead.
- Outputs start uninitialised in interpret mode, and masked atomics do not run there: a template
  writes every element of its outputs and uses no atomics (statistics go to per-tile partials).
- The LLVM that XLA runs for Triton does not contract `a * b + c` (PTX `mul.rn` then `add.rn`):
  `fma` is one `fma.rn.f32` (`math.fma`; `a * b + c` where the kernel is interpreted).

Index arithmetic is int32: tensors must have fewer than 2**31 elements (checked).

    out = pallas_call(kernel, [x, w], [jax.ShapeDtypeStruct(shape, dtype)], grid=(n,),
                      name="mid_block.attentions.0:pointwise", interpret=None)
    def kernel(x_ref, w_ref, out_ref):                        # flat refs, in operand order
        memory = RefMemory({x_term: x_ref, w_term: w_ref})
        value = compile_expr(body)(memory, index, mask)
        store(out_ref, pl.ds(start, block), value, mask)
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from emit.expr import Index, Mask, clip, erf, is_static, linearize, partials_layout, read_partials, shape_of
from eqsat.term import Term
from eqsat.types import parse_type
from emit.pallas import manual

__all__ = [
    "CompilerParams", "RefMemory", "compiler_params", "erf", "flat", "fma", "gather_load", "next_pow2",
    "pallas_call", "store", "MAX_ELEMENTS",
]

CompilerParams = pltriton.CompilerParams
MAX_ELEMENTS = 2**31 - 1  # int32 index arithmetic


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, int(n).bit_length() - 1)


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> CompilerParams:
    """The Triton compiler parameters every kernel passes explicitly (never Mosaic GPU's default)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def flat(array) -> jax.Array:
    """`array` as the flat 1-D operand a kernel reads (rank 0 becomes [1]); free in XLA (a bitcast)."""
    array = jnp.asarray(array)
    if array.size > MAX_ELEMENTS:
        raise ValueError(f"a tensor of {array.size} elements exceeds the int32 index range of the kernels")
    return jnp.reshape(array, (max(1, array.size),))


def pallas_call(kernel: Callable, operands: Sequence, out_shapes: Sequence[jax.ShapeDtypeStruct], *,
                grid: tuple[int, ...], name: str, interpret: bool | None, num_warps: int = 4, num_stages: int = 2,
                input_output_aliases: Mapping[int, int] | None = None) -> list[jax.Array]:
    """Run `kernel(*operand_refs, *out_refs)` over `grid` with every operand and result a flat ref.

    Operands are flattened here; results come back in their `out_shapes` (reshaped from flat).
    `interpret=None` leaves the choice to the platform the computation is lowered for
    (`lax.platform_dependent`: interpreted on a CPU, compiled by Triton on a GPU), so one traced
    function runs on this machine and compiles for an H100 (`measure.xla_target.compile_for_h100`).
    `input_output_aliases` maps operand positions to result positions (the result starts as that
    operand: an in-place update writes only what it changes).
    """
    flats = [flat(operand) for operand in operands]
    mat = manual.manual_type(flats)  # inside a shard_map: the manual axes the results vary over
    if mat is not None:
        flats = manual.vary_alike(flats, mat)
    varying = {} if mat is None else {"manual_axis_type": mat}
    flat_shapes = [jax.ShapeDtypeStruct((max(1, math.prod(s.shape)),), s.dtype, **varying) for s in out_shapes]
    for shape in out_shapes:
        if math.prod(shape.shape) > MAX_ELEMENTS:
            raise ValueError(f"{name}: a result of {math.prod(shape.shape)} elements exceeds the int32 index range")
    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    def call(interpret_here: bool):
        return pl.pallas_call(
            kernel,
            out_shape=flat_shapes,
            grid=tuple(int(g) for g in grid),
            in_specs=[any_spec] * len(flats),
            out_specs=[any_spec] * len(flat_shapes),
            input_output_aliases=dict(input_output_aliases or {}),
            compiler_params=compiler_params(num_warps, num_stages),
            interpret=interpret_here,
            name=name,
        )

    def interpreted(*xs):
        if mat is None or not mat.varying:
            return call(True)(*xs)
        avals = [jax.typeof(r) for r in jax.eval_shape(call(True), *xs)]
        return manual.interpreted(lambda *ys: call(True)(*ys), xs, avals)

    if interpret is None:  # decided where it is lowered: interpreted on a CPU, Triton on a GPU
        results = lax.platform_dependent(*flats, cpu=interpreted, default=lambda *xs: call(False)(*xs))
    else:
        results = interpreted(*flats) if interpret else call(False)(*flats)
    return [jnp.reshape(result, shape.shape) for result, shape in zip(results, out_shapes)]


def _fma_abstract_eval(a, b, c):
    if not (a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype):
        raise ValueError(f"fma of {a.str_short()}, {b.str_short()}, {c.str_short()}: one shape and dtype")
    return a


def _fma_triton_lowering(ctx, a, b, c):
    from jax._src.lib.mlir.dialects import math as math_dialect

    return math_dialect.fma(a, b, c)


def _register_fma():
    from jax._src import core as jax_core
    from jax._src.interpreters import mlir
    from jax._src.pallas.triton import lowering as triton_lowering

    primitive = jax_core.Primitive("eqsat_fma")

    def unfused(a, b, c):
        return a * b + c

    primitive.def_impl(unfused)
    primitive.def_abstract_eval(_fma_abstract_eval)
    mlir.register_lowering(primitive, mlir.lower_fun(unfused, multiple_results=False))
    triton_lowering.register_lowering(primitive)(_fma_triton_lowering)
    return primitive


_fma_p = _register_fma()


def fma(a, b, c) -> jax.Array:
    """`a * b + c` rounded once (one `fma.rn`), broadcast to one shape in the widest operand's float dtype."""
    a, b, c = (jnp.asarray(x) for x in (a, b, c))
    dtype = jnp.result_type(a, b, c)
    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    return _fma_p.bind(*(jnp.broadcast_to(x.astype(dtype), shape) for x in (a, b, c)))


def gather_load(ref, offsets, mask: Mask = True, *, size: int | None = None) -> jax.Array:
    """`ref`'s elements at flat `offsets` (an int array, or an int for one element), 0 where `mask` is
    False. With a mask the offsets are used as they are: a masked lane addresses nothing on the GPU
    (and interpret mode clamps it), and offsets that are `start + iota` stay provably contiguous,
    so Triton can vectorize the load (a clamp hides that: every element became a scalar load).
    Without a mask (every lane live) they are clamped to `[0, size)`."""
    size = ref.shape[0] if size is None else size
    if is_static(offsets):
        offsets = jnp.full((1,), min(max(int(offsets), 0), size - 1), jnp.int32)
        value = pltriton.load(ref.at[offsets])
        return jnp.reshape(value, ())
    if isinstance(mask, bool):
        offsets = jnp.clip(offsets, 0, size - 1)
        if not mask:
            return jnp.zeros(offsets.shape, ref.dtype)
        return pltriton.load(ref.at[offsets])
    shape = jnp.broadcast_shapes(offsets.shape, mask.shape)
    offsets, mask = jnp.broadcast_to(offsets, shape), jnp.broadcast_to(mask, shape)
    return pltriton.load(ref.at[offsets], mask=mask, other=jnp.zeros((), ref.dtype))


def store(ref, where, value, mask: Mask = True) -> None:
    """Write `value` into flat `ref` at `where`: a `pl.ds` block or an int offsets array (masked; live
    lanes must not repeat an offset)."""
    if not isinstance(where, pl.Slice) and not is_static(where):
        shape = jnp.broadcast_shapes(where.shape, jnp.shape(value), () if isinstance(mask, bool) else mask.shape)
        where = jnp.broadcast_to(where, shape)
        value = jnp.broadcast_to(value, shape)
        if not isinstance(mask, bool):
            mask = jnp.broadcast_to(mask, shape)
            # Masked lanes address one past the end: interpret mode writes every lane back (masked ones
            # with the old value), so a masked lane must never share an offset with a live one.
            where = jnp.where(mask, where, ref.shape[0])
    value = jnp.asarray(value).astype(ref.dtype)
    if isinstance(mask, bool):
        if mask:
            pltriton.store(ref.at[where], value)
        return
    pltriton.store(ref.at[where], value, mask=mask)


class RefMemory:
    """`emit.expr.Memory` over flat refs: `Load(T)` gathers from `refs[T]` at the linearized index.

    `refs` maps a tensor term to its flat ref (what `pallas_call` hands the kernel); the tensor's
    shape comes from its type. `chunk_elements` bounds the tile of in-kernel row reductions. A
    statistic (`EpilogueReduce`) bound to its hosts' per-tile partials is merged where it is read
    (`partials_source` lets the expression compiler merge once per point; `load` merges each time).
    """

    def __init__(self, refs: Mapping[Term, object], *, chunk_elements: int = 4096):
        self.refs = dict(refs)
        self.chunk_elements = chunk_elements

    def _ref(self, tensor: Term):
        try:
            return self.refs[tensor]
        except KeyError:
            raise KeyError(f"the kernel has no operand for {tensor!r}") from None

    def partials_source(self, statistic: Term):
        """`(layout, load)` when `statistic`'s ref holds its per-tile partials, else None."""
        ref = self._ref(statistic)
        layout = partials_layout(statistic, ref.shape[0])
        return None if layout is None else (layout, lambda offsets: gather_load(ref, offsets))

    def merged_statistic(self, tensor: Term, index: Index) -> jax.Array | None:
        """A statistic bound to its hosts' partials, merged at `index`; None for any other tensor."""
        found = self.partials_source(tensor) if tensor.op == "EpilogueReduce" else None
        return None if found is None else read_partials(tensor, index, *found)

    def load(self, tensor: Term, index: Index, mask: Mask) -> jax.Array:
        ref = self._ref(tensor)
        merged = self.merged_statistic(tensor, index)
        if merged is not None:
            return merged
        shape = parse_type(tensor.ty).shape
        if isinstance(mask, bool):
            index = tuple(clip(entry, 0, size - 1) for entry, size in zip(index, shape))
        offsets = linearize(index, shape)
        if not is_static(offsets) and not isinstance(mask, bool):
            offsets = jnp.broadcast_to(offsets, shape_of((offsets, mask)))
        return gather_load(ref, offsets, mask, size=max(1, math.prod(shape)))

