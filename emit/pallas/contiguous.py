"""Loads Triton can vectorize: a `RefMemory` that masks a tensor's innermost axis instead of clamping it.

`emit.pallas.triton.RefMemory` clamps every index entry into its axis and the flat offset into the
tensor, so masked lanes never address past it. Triton's analysis of a pointer tile (contiguity,
divisibility, mask constancy: `AxisInfo`) does not see through `min`/`max` by a constant: a
clamped run of unit-stride offsets is no longer known to be contiguous, and every lane loads alone
(`ld.global.b16`). `ContiguousMemory.load` keeps the clamp on the outer axes (a clamped row index is
still constant along the row) and bounds the innermost axis of the tensor (its last axis longer
than 1) by the mask instead: lanes whose inner index lies outside `[0, size)` read 0. The flat
offset is in range wherever the mask holds, so it is not clamped either. Where the index's
innermost entry is a unit-stride run (an operand tile read along its contiguous axis: an A tile
along K of a row-major activation, a B tile along N of a `[K, N]` weight, an epilogue's residual
along N), the offsets stay `base + iota`, and Triton loads 8 or 16 bytes per lane.

Semantics are `RefMemory`'s for every lane whose index is in range. A lane with an out-of-range
inner index and a true mask (a lane nobody reads: rows past M in a pre-pass whose mask was
dropped) reads 0 where `RefMemory` read the clamped neighbour; both are values no output keeps.

    memory = ContiguousMemory({x_term: x_ref, w_term: w_ref})
    tile = compile_expr(operand)(memory, (rows, ks), mask)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from emit.expr import Index, Mask, both, clip, is_static, linearize, shape_of
from emit.pallas.triton import RefMemory, gather_load, store
from eqsat.term import Term
from eqsat.types import parse_type


def inner_axis(shape) -> int | None:
    """The axis with unit stride in a row-major tensor of `shape`: its last axis longer than 1."""
    return next((axis for axis in reversed(range(len(shape))) if shape[axis] != 1), None)


def masked_load(ref, offsets, mask: Mask) -> jax.Array:
    """`ref`'s elements at flat `offsets`, 0 where `mask` is False; offsets where it holds are in
    range (not clamped: a unit-stride run stays visible to Triton)."""
    if isinstance(mask, bool):
        return gather_load(ref, offsets, mask)  # no mask array to guard the range: the clamped gather
    shape = jnp.broadcast_shapes(jnp.shape(offsets), mask.shape)
    offsets = jnp.broadcast_to(jnp.asarray(offsets, jnp.int32), shape)
    return pltriton.load(ref.at[offsets], mask=jnp.broadcast_to(mask, shape), other=jnp.zeros((), ref.dtype))


def masked_store(ref, offsets, value, mask: Mask, *, bound: int) -> None:
    """Write `value` into flat `ref` at `offsets` (live lanes distinct and in range, every lane's
    offset in `[0, bound)`) where `mask` holds. Masked lanes are moved past the end by adding the
    ref's size (interpret mode writes every lane back, so a masked lane must not share an offset
    with a live one, and drops lanes past the end) rather than by a select, which would hide a
    unit-stride run from Triton."""
    size = ref.shape[0]
    if isinstance(mask, bool) or bound + size > 2**31 - 1:  # no int32 headroom: the select
        return store(ref, offsets, value, mask)
    shape = jnp.broadcast_shapes(jnp.shape(offsets), jnp.shape(value), mask.shape)
    mask = jnp.broadcast_to(mask, shape)
    offsets = jnp.broadcast_to(offsets, shape) + jnp.where(mask, 0, size)
    pltriton.store(ref.at[offsets], jnp.broadcast_to(value, shape).astype(ref.dtype), mask=mask)


class ContiguousMemory(RefMemory):
    """`RefMemory` whose loads mask, rather than clamp, each tensor's innermost axis (module docstring)."""

    def load(self, tensor: Term, index: Index, mask: Mask) -> jax.Array:
        ref = self._ref(tensor)
        merged = self.merged_statistic(tensor, index)
        if merged is not None:
            return merged
        shape = parse_type(tensor.ty).shape
        inner = inner_axis(shape)
        if inner is None or is_static(index[inner]) or math.prod(shape) == 0:
            return super().load(tensor, index, mask)
        entry = index[inner]
        in_range = (entry >= 0) & (entry < shape[inner])
        entries = tuple(e if axis == inner else clip(e, 0, size - 1) for axis, (e, size) in enumerate(zip(index, shape)))
        offsets = linearize(entries, shape)
        mask = both(mask, in_range)
        if tuple(shape_of((offsets, mask))) != tuple(jnp.shape(offsets)):
            offsets = jnp.broadcast_to(offsets, shape_of((offsets, mask)))
        return masked_load(ref, offsets, mask)
