"""The gather template: `Gather(operand, indices, key)` (embedding lookups and any `lax.gather`).

A pointwise kernel over the output (`emit.pallas.pointwise.build`) whose value at output index `o`
is `lax.gather`'s, computed as index arithmetic (`payloads[key] = (gather_p, params)`):

- the batch position is `o` without its offset dims; the start vector is the `indices` expression
  read at (batch position, k) for each k of `start_index_map` (the index vector is the last axis);
- the operand index is the start vector placed on `start_index_map` (clamped to
  `[0, operand_dim - slice_size]` in clip/promise_in_bounds mode), plus `o`'s offset dims on the
  operand's uncollapsed, unbatched axes, plus the batch position on `operand_batching_dims`;
- in fill mode (`GatherScatterMode.FILL_OR_DROP`) a slice whose start is out of bounds reads
  `fill_value` (NaN for floats, the dtype's minimum for signed ints, maximum for unsigned, True for bools).

Both `operand` and `indices` are `Expr`s read through `emit.expr` (views stay in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from emit.expr import both, compile_expr
from emit.pallas import EmitContext, KernelCall, loaded_tensors
from emit.pallas.pointwise import build as build_pointwise
from eqsat.term import Term
from eqsat.types import parse_type


def _fill_value(value, dtype):
    """`lax.gather`'s fill value (built inside the kernel: a kernel captures no array constants)."""
    if value is not None:
        return jnp.asarray(value, dtype)
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(True)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return jnp.asarray(jnp.iinfo(dtype).min, dtype)
    return jnp.asarray(jnp.iinfo(dtype).max, dtype)


def gather_value(operand: Term, indices: Term, params: dict, out_shape):
    """The value function `f(memory, index, mask)` of `lax.gather(operand, indices, **params)`."""
    dims = params["dimension_numbers"]
    slice_sizes = tuple(int(s) for s in params["slice_sizes"])
    mode = lax.GatherScatterMode.from_any(params.get("mode"))
    operand_shape = parse_type(operand.ty).shape
    indices_shape = parse_type(indices.ty).shape
    offset_dims = tuple(dims.offset_dims)
    collapsed = tuple(dims.collapsed_slice_dims)
    start_map = tuple(dims.start_index_map)
    operand_batching = tuple(getattr(dims, "operand_batching_dims", ()))
    indices_batching = tuple(getattr(dims, "start_indices_batching_dims", ()))
    batch_out_dims = [d for d in range(len(out_shape)) if d not in offset_dims]
    slice_axes = [d for d in range(len(operand_shape)) if d not in collapsed and d not in operand_batching]
    if len(indices_shape) != len(batch_out_dims) + 1 or indices_shape[-1] != len(start_map):
        raise ValueError(f"gather indices {indices_shape} do not end in an index vector of {len(start_map)}")
    read_operand, read_indices = compile_expr(operand), compile_expr(indices)
    dtype = parse_type(operand.ty).dtype
    fill_value = params.get("fill_value")

    def value(memory, index, mask):
        batch = tuple(index[d] for d in batch_out_dims)
        full: list = [0] * len(operand_shape)
        in_bounds = True
        for k, axis in enumerate(start_map):
            start = read_indices(memory, batch + (k,), mask).astype(jnp.int32)
            limit = operand_shape[axis] - slice_sizes[axis]
            if mode == lax.GatherScatterMode.FILL_OR_DROP:
                in_bounds = both(in_bounds, (start >= 0) & (start <= limit))
            full[axis] = jnp.clip(start, 0, limit)
        for operand_axis, indices_axis in zip(operand_batching, indices_batching):
            full[operand_axis] = batch[indices_axis]
        for axis, out_dim in zip(slice_axes, offset_dims):
            full[axis] = full[axis] + index[out_dim]
        result = read_operand(memory, tuple(full), both(mask, in_bounds))
        return result if in_bounds is True else jnp.where(in_bounds, result, _fill_value(fill_value, dtype))

    return value


def reference(operand: jax.Array, indices: jax.Array, params: dict) -> jax.Array:
    """`lax.gather` itself."""
    return lax.gather_p.bind(operand, indices, **params)


def emit(kernel: KernelCall, ctx: EmitContext) -> dict:
    term = kernel.term
    if term.op != "Gather":
        raise NotImplementedError(f"the gather template does not emit {term.op}")
    operand, indices, key, ty = term.args
    primitive, params = ctx.payloads[key]
    if primitive is not lax.gather_p:
        raise NotImplementedError(f"payload {key} is {primitive}, not gather")
    out_type = parse_type(ty)
    tensors = loaded_tensors(operand, indices)
    value = build_pointwise(gather_value(operand, indices, params, out_type.shape), tensors,
                            [ctx.operand(t) for t in tensors], jax.ShapeDtypeStruct(out_type.shape, out_type.dtype),
                            name=kernel.name, interpret=ctx.interpret)
    return {term: value}

