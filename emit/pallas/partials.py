"""Statistics computed in their producers' epilogues, as per-tile partials (the host side).

A hosted statistic (`EpilogueReduce(producer, op, body, axes, ty)`, op `sum` or `moments`) is
written by the kernels that produce its body (its hosts: one conv, or both convs of
`concat(h, skip)`) into one fp32 buffer `[tiles, fields, slots]`: each output tile writes, for
every statistic output (slot), its sum (`fields` = 1) or its count, mean and M2 (`fields` = 3)
into its own row, so there are no atomics and nothing to zero. The kernels reading the statistic
merge the rows in a fixed order where they read it (`emit.expr.read_partials`): no merge kernel.

Several hosts share one buffer, in the order they run: the first writes its tiles; each later host
takes the buffer so far as an input, copies it into the front of its own partials output
(`copy_prefix`, a few elements per program) and writes its tiles after it. The buffer is complete
after the last host, with no XLA concatenate between them.

    prefix = ctx.pending.get(reduction)          # the earlier hosts' partials, or None
    ... the host kernel writes [prefix tiles + own tiles, fields, slots] ...
    return {term: out, reduction: Partials(buffer)}

Cost: a reader merges at every point it reads, so each read costs `fields` x tiles loads (memoized
per point within one expression evaluation; the matmul's pre-pass hoists it per row block, the
conv template per program and channel chunk). It merges TB tiles per step
(`emit.expr.merge_partials_at`: a block of TB tiles loaded at once and reduced with vector
reductions, TB a power of two with TB x the point's lanes <= 4096 elements), so its serial chain
is ceil(tiles / TB) steps, not tiles. Where the merges of a statistic's readers would cost more
than finishing it once (a pointwise reader merges at every element: with hundreds of tiles that
is 100x the reader's own work), the plan finishes it once instead (`eqsat.cost.merges`):

`finalize(statistic, buffer, name=, interpret=)` is the finished statistic as one small Pallas
kernel (a plan kernel of kind `finalize`, where the cost model prefers finishing a statistic once to
merging it in its readers: `eqsat.cost.merges`): one program per slot (`FinalizeConfig`), each
merging every tile of its slot with the readers' blocked merge (`emit.expr.merge_partials_at`) in
blocks of `FINALIZE_BLOCK_TILES` tiles spread over `FINALIZE_WARPS` warps (8 tiles x 3 fields per
thread: no spills, where 32 slots x 128 tiles on one warp spilled 35 KB in the VAE), and writes
the finished statistic; readers then load it like any tensor (`emit.expr.partials_layout` tells it
from partials by its size). The slots run in parallel on as many SMs, the tiles in
ceil(tiles / FINALIZE_BLOCK_TILES) serial steps (one for T <= 1024, four at the VAE's 4096).

`merged(statistic, buffer)` is the finished statistic in plain jax (the same merge as the readers'):
for what reads a statistic outside a Pallas template (an XLA fallback kernel, an opaque primitive,
a loop's operands, the plan's outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from emit.expr import evaluate_whole, merge_partials_at, partials_layout
from emit.pallas import triton
from eqsat.term import Term
from eqsat.tiling.partials import (  # the merge's blocking, shared with the cost model
    FINALIZE_BLOCK_TILES, FINALIZE_WARPS, FinalizeConfig)
from eqsat.types import parse_type

COPY_BLOCK = 1024  # elements a program copies per step of `copy_prefix`


@dataclass(frozen=True)
class Partials:
    """What a host returns for a statistic it computed: the partials of every host so far, its own
    tiles last (`[tiles, fields, slots]` fp32)."""

    buffer: jax.Array


def copy_prefix(src_ref, dst_ref, size: int, program, programs: int) -> None:
    """Copy the first `size` elements of flat `src_ref` into `dst_ref`, this `program`'s share of
    `programs` (consecutive elements, `COPY_BLOCK` per step): every element by exactly one program."""
    if size == 0:
        return
    share = -(-size // programs)
    block = min(triton.next_pow2(share), COPY_BLOCK)
    steps = -(-share // block)
    lane = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def copy(step, carry):
        within = step * block + lane
        offsets = program * share + within
        ok = (within < share) & (offsets < size)
        triton.store(dst_ref, offsets, triton.gather_load(src_ref, offsets, ok), ok)
        return carry

    if steps == 1:
        copy(0, 0)
    else:
        lax.fori_loop(0, steps, copy, 0)


def merged(statistic: Term, buffer: jax.Array) -> jax.Array:
    """The finished statistic from its partials, in plain jax (the readers' merge, the same order)."""
    return evaluate_whole(Term("Load", statistic, statistic.ty), {statistic: buffer})


def finalize(statistic: Term, buffer: jax.Array, *, name: str, interpret: bool | None, tables=None) -> jax.Array:
    """The finished `statistic` (its type: `[2, *kept]` mean and M2 for moments, else `[*kept]`) from
    its hosts' per-tile partials `buffer`, as one Pallas kernel: program `i` merges slot `i` over
    every tile (`merge_partials_at`, `FinalizeConfig`). `tables` (`emit.pallas.tables.TableWrites`):
    the Mosaic convs' vector tables it writes too (each program its slot's entries and a share of
    the rest; `tables.results`)."""
    op = statistic.args[1]
    shape = parse_type(statistic.ty).shape
    layout = partials_layout(statistic, buffer.size)
    if layout is None:  # one tile's partials are the statistic itself
        return jnp.reshape(buffer, shape).astype(jnp.float32)
    tiles, fields, slots = layout
    config = FinalizeConfig.of(tiles, fields, slots)
    rows = 2 if op == "moments" else 1

    extra = len(tables.operands) if tables is not None else 0

    def kernel(partials_ref, *refs):
        table_in, (out_ref, *table_out) = refs[:extra], refs[extra:]
        slot = jnp.full((1,), pl.program_id(0), jnp.int32)
        load = lambda offsets: triton.gather_load(partials_ref, offsets)  # noqa: E731
        merged = merge_partials_at(op, load, tiles, slots, slot, budget=config.block_tiles)
        for row, value in enumerate(merged if op == "moments" else (merged,)):
            triton.store(out_ref, row * slots + slot, value.astype(jnp.float32))
            if tables is not None:
                tables.scatter(table_in, table_out, row * slots + slot, value)
        if tables is not None:
            tables.copy(table_in, table_out, pl.program_id(0), config.programs)

    out = jax.ShapeDtypeStruct((rows * slots,), jnp.float32)
    operands = [jnp.reshape(buffer, (-1,)), *(tables.operands if tables is not None else ())]
    flat, *written = triton.pallas_call(kernel, operands, [out, *(tables.out_shapes if tables is not None else ())],
                                        grid=(config.programs,), name=name, interpret=interpret,
                                        num_warps=config.num_warps)
    if tables is not None:
        tables.results = written
    return jnp.reshape(flat, shape)
