"""The reduction template: `Reduce(op, body, axes, epilogue)` and an unhosted `EpilogueReduce`.

Any axes (rows, columns, several at once, not necessarily adjacent): the reduced axes are walked
as one row-major range in power-of-two chunks (`emit.expr.reduce_at`, a `fori_loop` in a fixed
order), the kept axes are tiled in flat power-of-two blocks, masked past the end. `body` is a
prologue `Expr` evaluated at (kept block × chunk) index tiles, so a reduction over a transposed,
sliced or elementwise-transformed tensor reads it in place. Ops: sum, max, min, prod, and/or/xor,
argmax/argmin (one axis; first index wins, NaN is largest, as `lax.argmax`), and `moments`
(`f32[2, *kept]`: the mean and M2 = sum((x - mean)²), per-chunk count/mean/M2 merged with Chan's
formula: no cancellation, deterministic).

An `EpilogueReduce` its hosts computed as partials (in `ctx.partials`) is finished from them
instead (`emit.pallas.partials.finalize`: a plan kernel of kind `finalize`).

The epilogue is evaluated at the output index with `Acc` bound to the reduction there. When the
output has the accumulator's shape (the usual case) each block computes the reduction once for its
kept indices and writes every output row (both rows of `moments`); an epilogue that views `Acc`
differently is evaluated per output element.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from emit.expr import CompiledExpr, acc_dtype, compile_expr, reduce_at, select_moment, unravel
from emit.pallas import EmitContext, KernelCall, loaded_tensors
from emit.pallas.triton import RefMemory, next_pow2, pallas_call, store
from eqsat.ops import apply_reduce
from eqsat.moments import two_pass
from eqsat.term import Term
from eqsat.types import ints, parse_type


@dataclass(frozen=True)
class ReduceConfig:
    block: int        # kept (output) elements per program, a power of two
    budget: int       # elements of one (block × chunk) tile
    num_warps: int = 4

    @classmethod
    def get_default(cls, kept: int, length: int, interpret: bool) -> "ReduceConfig":
        # Interpreted grid steps cost ~35 µs each: fewer, larger tiles on a CPU.
        budget = 1 << 16 if interpret else 4096
        chunk = min(next_pow2(length), budget)
        return cls(block=min(next_pow2(kept), max(1, budget // chunk)), budget=budget)


@dataclass(frozen=True)
class ReduceProblem:
    op: str
    body_shape: tuple[int, ...]
    axes: tuple[int, ...]          # sorted, distinct
    body_dtype: str
    acc_dtype: str
    out_shape: tuple[int, ...]
    out_dtype: str

    @property
    def kept_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.body_shape)) if a not in self.axes)

    @property
    def kept_shape(self) -> tuple[int, ...]:
        return tuple(self.body_shape[a] for a in self.kept_axes)

    @property
    def reduced(self) -> tuple[int, ...]:
        return tuple(self.body_shape[a] for a in self.axes)

    @property
    def core_shape(self) -> tuple[int, ...]:
        return ((2,) if self.op == "moments" else ()) + self.kept_shape


def _kernel(*refs, problem: ReduceProblem, body: CompiledExpr, epilogue: CompiledExpr, tensors, config: ReduceConfig,
            per_row: bool, tables=None):
    operand_refs, refs = refs[:len(tensors)], refs[len(tensors):]
    extra = len(tables.operands) if tables is not None else 0
    table_in, (out_ref, *table_out) = refs[:extra], refs[extra:]
    memory = RefMemory(dict(zip(tensors, operand_refs)), chunk_elements=config.budget)
    moments = problem.op == "moments"
    cache: dict = {}

    def at_body(body_index, body_mask):
        n = len(problem.kept_axes)
        full: list = [None] * len(problem.body_shape)
        for axis, entry in zip(problem.kept_axes, body_index[:n]):
            full[axis] = entry
        for axis, entry in zip(problem.axes, body_index[n:]):
            full[axis] = entry
        return body(memory, tuple(full), body_mask)

    def acc(ty, index, mask):
        kept = tuple(index[1:]) if moments else tuple(index)
        key = tuple(("i", e) if isinstance(e, int) else ("a", id(e)) for e in kept)
        if key not in cache:
            cache[key] = (reduce_at(problem.op, at_body, kept, mask, problem.reduced,
                                    value_dtype=problem.body_dtype, out_dtype=problem.acc_dtype,
                                    budget=config.budget), kept)
        result = cache[key][0]
        return select_moment(index[0], result) if moments else result

    start = pl.program_id(0) * config.block
    offsets = start + jnp.arange(config.block, dtype=jnp.int32)
    if per_row:  # the output is the accumulator's shape: one reduction per kept block, every row written
        kept_size = math.prod(problem.kept_shape)
        mask = offsets < kept_size if kept_size % config.block else True
        kept = unravel(offsets, problem.kept_shape)
        rows = (0, 1) if moments else (None,)
        for row in rows:
            index = kept if row is None else (row,) + kept
            value = epilogue(memory, index, mask, acc)
            where = pl.ds(start + (row or 0) * kept_size, config.block)
            store(out_ref, where, jnp.broadcast_to(value, (config.block,)), mask)
            if tables is not None:
                tables.scatter(table_in, table_out, (row or 0) * kept_size + offsets,
                               jnp.broadcast_to(value, (config.block,)), offsets < kept_size)
        if tables is not None:
            tables.copy(table_in, table_out, pl.program_id(0), -(-kept_size // config.block))
        return
    size = math.prod(problem.out_shape)
    mask = offsets < size if size % config.block else True
    value = epilogue(memory, unravel(offsets, problem.out_shape), mask, acc)
    store(out_ref, pl.ds(start, config.block), jnp.broadcast_to(value, (config.block,)), mask)


def build(problem: ReduceProblem, body: Term, epilogue: Term, operands, tensors, *, name: str, interpret: bool,
          config: ReduceConfig | None = None, tables=None) -> jax.Array:
    """The pallas_call computing `epilogue(Acc = op over axes of body)` (terms compiled by `emit.expr`).
    `tables` (`emit.pallas.tables.TableWrites`, an output of the accumulator's shape only): the Mosaic
    convs' vector tables it writes too (`tables.results`)."""
    if len(set(problem.axes)) != len(problem.axes) or any(not 0 <= a < len(problem.body_shape) for a in problem.axes):
        raise ValueError(f"reduction axes {problem.axes} do not fit a body of shape {problem.body_shape}")
    if problem.op in ("argmax", "argmin") and len(problem.axes) != 1:
        raise ValueError(f"{problem.op} reduces one axis, got axes {problem.axes}")
    per_row = problem.out_shape == problem.core_shape
    kept = math.prod(problem.kept_shape) if per_row else math.prod(problem.out_shape)
    config = config or ReduceConfig.get_default(kept, math.prod(problem.reduced), interpret)
    if config.block & (config.block - 1):
        raise ValueError(f"{config.block=} must be a power of two")
    out = jax.ShapeDtypeStruct(problem.out_shape, problem.out_dtype)
    if math.prod(problem.out_shape) == 0:
        return jnp.zeros(problem.out_shape, problem.out_dtype)
    tables = tables if per_row else None
    kernel = functools.partial(_kernel, problem=problem, body=compile_expr(body), epilogue=compile_expr(epilogue),
                               tensors=tuple(tensors), config=config, per_row=per_row, tables=tables)
    extra_in, extra_out = (tables.operands, tables.out_shapes) if tables is not None else ((), ())
    value, *written = pallas_call(kernel, [*operands, *extra_in], [out, *extra_out], grid=(-(-kept // config.block),),
                                  name=name, interpret=interpret, num_warps=config.num_warps)
    if tables is not None:
        tables.results = written
    return value


def reference(op: str, body: jax.Array, axes, acc_type, epilogue: Callable = lambda acc: acc) -> jax.Array:
    """The reduction in plain jax: `epilogue(apply_reduce(op, body, axes))` (moments two-pass)."""
    axes = tuple(sorted(axes))
    if op == "moments":
        return epilogue(two_pass(body, axes))
    return epilogue(apply_reduce(op, body, axes, jnp.dtype(acc_type)))


def emit(kernel: KernelCall, ctx: EmitContext) -> dict:
    term = kernel.term
    from emit.pallas import tables

    if term.op == "EpilogueReduce" and term in ctx.partials:  # hosted: finished once from its partials
        from emit.pallas.partials import finalize

        with tables.writing(term, ctx) as writes:  # and the vector tables of Mosaic convs gathering it
            return {term: finalize(term, ctx.partials[term], name=kernel.name, interpret=ctx.interpret,
                                   tables=writes)}
    if term.op == "EpilogueReduce":
        _producer, op, body, axes, ty = term.args
        epilogue = Term("Acc", ty)
    elif term.op == "Reduce":
        op, body, axes, epilogue, ty = term.args
    else:
        raise NotImplementedError(f"the reduce template does not emit {term.op}")
    out_type, body_type = parse_type(ty), parse_type(body.ty)
    problem = ReduceProblem(op, body_type.shape, tuple(sorted(ints(axes))), body_type.dtype,
                            jnp.dtype(acc_dtype(epilogue, ty)).name, out_type.shape, out_type.dtype)
    tensors = loaded_tensors(body, epilogue)
    with tables.writing(term, ctx) as writes:
        value = build(problem, body, epilogue, [ctx.operand(t) for t in tensors], tensors, name=kernel.name,
                      interpret=ctx.interpret, tables=writes)
    return {term: value}

