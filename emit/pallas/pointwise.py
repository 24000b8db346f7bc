"""The pointwise template: `Pointwise(body)` and the box writes `AssignStatic` / `AssignDynamic`.

Pointwise: the output is walked in flat blocks of a power-of-two size; block `i` covers offsets
`[i·B, (i+1)·B)`, masked past the end, unravelled to the output's multi-index (constant div/mod),
where `body` is evaluated by `emit.expr` (its views are index arithmetic, its loads gathers) and
stored contiguously.

Assign: the result aliases the target (`input_output_aliases`), and the grid walks only the box:
each box element is evaluated from `value` and scattered to `starts + box index` (starts clamped
as `dynamic_update_slice` clamps). Elements outside the box keep the target's values without
being touched. A target the value also reads is passed a second time, read-only, so no block reads
what another block writes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from emit.expr import Index, Mask, compile_expr, linearize, unravel
from emit.pallas import EmitContext, KernelCall, loaded_tensors
from emit.pallas.triton import RefMemory, gather_load, next_pow2, pallas_call, store
from eqsat.term import Term, list_items
from eqsat.types import ints, parse_type

ValueFn = Callable[[RefMemory, Index, Mask], jax.Array]


@dataclass(frozen=True)
class PointwiseConfig:
    block: int = 1024       # output elements per program (a power of two)
    num_warps: int = 4

    @classmethod
    def get_default(cls, size: int, interpret: bool) -> "PointwiseConfig":
        # Interpreted grid steps cost ~35 µs each: fewer, larger blocks on a CPU.
        limit = 1 << 16 if interpret else 1024
        return cls(block=min(next_pow2(size), limit))


def _pointwise_kernel(*refs, value: ValueFn, tensors: tuple[Term, ...], shape: tuple[int, ...], block: int):
    *operand_refs, out_ref = refs
    start = pl.program_id(0) * block
    offsets = start + jnp.arange(block, dtype=jnp.int32)
    size = math.prod(shape)
    mask = offsets < size if size % block else True
    index = unravel(offsets, shape)
    out = value(RefMemory(dict(zip(tensors, operand_refs))), index, mask)
    store(out_ref, pl.ds(start, block), jnp.broadcast_to(out, (block,)), mask)


def _box_kernel(*refs, value: ValueFn, tensors: tuple[Term, ...], box: tuple[int, ...],
                out_shape: tuple[int, ...], dynamic: int, static_starts: tuple[int, ...], block: int):
    start_refs = refs[1:1 + dynamic]
    operand_refs = refs[1 + dynamic:-1]
    out_ref = refs[-1]
    if dynamic:
        starts = [jnp.clip(gather_load(ref, 0).astype(jnp.int32), 0, n - b)
                  for ref, n, b in zip(start_refs, out_shape, box)]
    else:
        starts = list(static_starts)
    offsets = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    size = math.prod(box)
    mask = offsets < size if size % block else True
    index = unravel(offsets, box)
    out = value(RefMemory(dict(zip(tensors, operand_refs))), index, mask)
    target_index = tuple(i + s for i, s in zip(index, starts))
    where = jnp.broadcast_to(linearize(target_index, out_shape), (block,))
    store(out_ref, where, jnp.broadcast_to(out, (block,)), mask)


def build(value: ValueFn, tensors: Sequence[Term], operands: Sequence[jax.Array], out: jax.ShapeDtypeStruct, *,
          name: str, interpret: bool, config: PointwiseConfig | None = None) -> jax.Array:
    """A pallas_call writing `value(memory, index, mask)` at every index of `out`."""
    size = math.prod(out.shape)
    config = config or PointwiseConfig.get_default(size, interpret)
    if config.block & (config.block - 1):
        raise ValueError(f"{config.block=} must be a power of two")
    if len(tensors) != len(operands):
        raise ValueError(f"{len(tensors)} tensors for {len(operands)} operands")
    if size == 0:
        return jnp.zeros(out.shape, out.dtype)
    kernel = functools.partial(_pointwise_kernel, value=value, tensors=tuple(tensors), shape=tuple(out.shape),
                               block=config.block)
    return pallas_call(kernel, operands, [out], grid=(-(-size // config.block),), name=name,
                       interpret=interpret, num_warps=config.num_warps)[0]


def build_box(value: ValueFn, tensors: Sequence[Term], operands: Sequence[jax.Array], target: jax.Array,
              box: Sequence[int], starts: Sequence[int] | Sequence[jax.Array], *, name: str, interpret: bool,
              config: PointwiseConfig | None = None) -> jax.Array:
    """`target` with the `box` at `starts` (ints, or scalar int arrays: clamped) overwritten by `value`."""
    box = tuple(int(b) for b in box)
    if len(box) != target.ndim or len(starts) != target.ndim:
        raise ValueError(f"a {len(box)}-axis box with {len(starts)} starts for a {target.ndim}-axis target")
    if any(b > n for b, n in zip(box, target.shape)):
        raise ValueError(f"box {box} does not fit in the target {target.shape}")
    size = math.prod(box)
    if size == 0:
        return target
    dynamic = not all(isinstance(s, int) for s in starts)
    config = config or PointwiseConfig.get_default(size, interpret)
    kernel = functools.partial(
        _box_kernel, value=value, tensors=tuple(tensors), box=box, out_shape=tuple(target.shape),
        dynamic=len(starts) if dynamic else 0, static_starts=() if dynamic else tuple(
            min(max(s, 0), n - b) for s, n, b in zip(starts, target.shape, box)),
        block=config.block)
    extra = [jnp.asarray(s) for s in starts] if dynamic else []
    out = jax.ShapeDtypeStruct(target.shape, target.dtype)
    return pallas_call(kernel, [target, *extra, *operands], [out], grid=(-(-size // config.block),), name=name,
                       interpret=interpret, num_warps=config.num_warps, input_output_aliases={0: 0})[0]


def reference(body: Callable[..., jax.Array], *operands) -> jax.Array:
    """The pointwise computation in plain jax.numpy: `body` applied to whole arrays."""
    return body(*operands)


def _expr_value(expr: Term) -> ValueFn:
    compiled = compile_expr(expr)
    return lambda memory, index, mask: compiled(memory, index, mask)


def emit(kernel: KernelCall, ctx: EmitContext) -> dict:
    term = kernel.term
    out_type = parse_type(term.ty)
    out = jax.ShapeDtypeStruct(out_type.shape, out_type.dtype)
    if term.op == "Pointwise":
        body = term.args[0]
        tensors = loaded_tensors(body)
        value = build(_expr_value(body), tensors, [ctx.operand(t) for t in tensors], out, name=kernel.name,
                      interpret=ctx.interpret)
        return {term: value}
    if term.op in ("AssignStatic", "AssignDynamic"):
        target, starts, value_expr, _ = term.args
        tensors = loaded_tensors(value_expr)
        box = parse_type(value_expr.ty).shape
        if term.op == "AssignStatic":
            start_values: list = list(ints(starts))
        else:
            start_values = [ctx.value(t) for t in list_items(starts)]
        result = build_box(_expr_value(value_expr), tensors, [ctx.operand(t) for t in tensors], ctx.value(target),
                           box, start_values, name=kernel.name, interpret=ctx.interpret)
        return {term: result}
    raise NotImplementedError(f"the pointwise template does not emit {term.op}")
