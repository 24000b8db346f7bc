"""The row pass of the Mosaic matmul's A prologue (`emit.mosaic.matmul`): a LayerNorm whose operand
computes its own statistics (a `RowReduce` over each row of A, sum or moments) has them computed by
the kernel, over its CTA's `tile_m` rows, before the first pipeline step.

    RowPass                  one reduction: its op, its body as a function of its sources' chunk values
    compute_row_statistics   the pass in the kernel: the reductions' fields as `[tile_m]` fp32 vectors

The compute warpgroup (the prologue's only one) walks the row in `tile_k`-column chunks: each chunk's
blocks of the body's sources (`[tile_m, tile_k]` tiles of tensors as they lie, `[tile_k]` vectors
along the row) come by TMA into two SMEM slots (chunk c + 1 is in flight while chunk c is reduced;
the slot it fills was read one chunk earlier), the body is evaluated on them in registers
(`emit.expr`) and each row of the chunk reduced: a sum, or the chunk's mean and M2 two-pass about
its rough mean, corrected once (`chunk_moments`: `emit.expr.piece_moments`' form). Chunks merge in
order: sums added, moments by Chan's formula for equal counts
(`n = c · tile_k` merging `tile_k`: mean += δ / (c + 1), M2 += M2_c + δ² · tile_k · c / (c + 1)),
so offsets large against the spread cost nothing and a constant row has M2 exactly 0. The first
chunk starts the merge (no splat-layout zeros enter the loop carry). The vectors stay in registers
(the WGMMA row layout) and the prologue broadcasts them along K at every step. A sum of the body
of a moments pass (a LayerNorm's mean as sum / K beside its variance's moments) is read off that
pass's mean (`RowPass.derived`: mean · length), not reduced again.

Each CTA reads its rows over the whole row once more than the pipeline does (from L2: the pipeline
reads the same tensor); N-tile CTAs each run the pass for their rows. The cost model charges both
(`eqsat.cost.mosaic.prologue_reads`: `pass_tile`/`pass_col` TMA bytes; the reduction's flops per
N tile) and takes rows up to `ROW_PASS_MAX_LENGTH` elements (`row_reduce_declined`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax



def chunk_moments(body: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's mean and M2 over a whole chunk `[rows, cols]` fp32: two-pass about the rough mean,
    corrected once by the deviations' mean (`emit.mosaic.partials.tile_partials` without a mask)."""
    cols = body.shape[1]
    rough = jnp.sum(body, axis=1) / cols
    deviation = body - lax.broadcast_in_dim(rough, body.shape, (0,))
    drift = jnp.sum(deviation, axis=1)
    correction = drift / cols
    m2 = jnp.sum(deviation * deviation, axis=1) - drift * correction
    return rough + correction, jnp.maximum(m2, 0.0)


@dataclasses.dataclass(frozen=True)
class RowPass:
    """One `RowReduce` of the A expression: `fn(values)` is its fp32 body on a `[tile_m, tile_k]`
    chunk from its sources' values there (vectors broadcast), in `sources`' order; `sources` are
    `emit.mosaic.matmul.PrologueSource`s of kind `tile` or `col` over a row of `length` elements.
    `derived`: a sum of the same body as the moments pass of that index, read off its mean
    (`mean · length`, no pass of its own: LayerNorm's mean as sum / K beside its moments)."""

    op: str
    fn: Callable[[Sequence[jax.Array]], jax.Array] | None
    sources: tuple
    length: int
    derived: int | None = None

    @property
    def fields(self) -> int:
        return 1 if self.op == "sum" else 2


def pass_smem(passes: Sequence[RowPass], tile_m: int, tile_k: int, swizzled: Callable) -> list:
    """The two-slot SMEM buffers of every pass's sources, in order (`swizzled(minor, dtype)`: the
    transforms of a tile's blocks)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    buffers = []
    for row_pass in passes:  # a derived pass has no sources
        for source in row_pass.sources:
            dtype = source.dtype
            if source.kind == "tile":
                buffers.append(plgpu.SMEM((2, tile_m, tile_k), dtype, transforms=swizzled(tile_k, dtype)))
            else:
                buffers.append(plgpu.SMEM((2, tile_k), dtype))
    return buffers


def compute_row_statistics(passes: Sequence[RowPass], gmems: Sequence[Any], smems: Sequence[Any], barriers,
                           *, first_row: Callable[[Any], Any], tile_m: int, tile_k: int,
                           interpreted: bool) -> list[tuple[jax.Array, ...]]:
    """Each pass's fields over the CTA's rows (`(sum,)` or `(mean, M2)`, `[tile_m]` fp32 vectors).
    `gmems`/`smems`: the passes' sources' arrays (`[rows, pitch]` tiles, `[rows, length]` vector
    views) and two-slot SMEM buffers, in order; `barriers`: per pass that reads (not `derived`), one
    per slot (as many arrivals as the pass has sources); `first_row(source)`: the source row of the CTA's first
    row (a tile) or the vector's row (a `col`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    results, offset = [None] * len(passes), 0
    reading = [p for p, row_pass in enumerate(passes) if row_pass.derived is None]
    for p in reading:
        row_pass = passes[p]
        count = len(row_pass.sources)
        own = list(zip(row_pass.sources, gmems[offset:offset + count], smems[offset:offset + count]))
        offset += count
        steps = row_pass.length // tile_k

        def issue(step, slot, own=own, p=p):
            barrier = barriers[reading.index(p)].at[slot]
            for source, gmem, smem in own:
                columns = pl.ds(source.col0 + step * tile_k, tile_k)
                src = gmem.at[pl.ds(first_row(source), tile_m), columns] if source.kind == "tile" else \
                    gmem.at[first_row(source), columns]
                plgpu.copy_gmem_to_smem(src, smem.at[slot], barrier)

        def chunk(slot, own=own, p=p, row_pass=row_pass):
            plgpu.barrier_wait(barriers[reading.index(p)].at[slot])
            values = []
            for source, _gmem, smem in own:
                if source.kind == "tile":
                    values.append(smem.at[slot][...])
                    continue
                vector = smem.at[slot][...] if interpreted else \
                    plgpu.load(smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
                values.append(lax.broadcast_in_dim(vector, (tile_m, tile_k), (1,)))
            body = jnp.broadcast_to(row_pass.fn(values), (tile_m, tile_k)).astype(jnp.float32)
            if row_pass.op == "sum":
                return (jnp.sum(body, axis=1),)
            return chunk_moments(body)

        issue(0, 0)
        if steps > 1:
            issue(1, 1)
        first = chunk(0)
        if steps == 1:
            results[p] = first
            continue

        def merge(c, carry, issue=issue, chunk=chunk, steps=steps, op=row_pass.op):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < steps)
            def _prefetch():  # into the slot chunk c - 1 was read from
                issue(c + 1, 1 - slot)

            part = chunk(slot)
            if op == "sum":
                return (carry[0] + part[0],)
            mean, m2 = carry
            weight = 1.0 / (c + 1).astype(jnp.float32)  # tile_k of (c + 1) · tile_k values
            delta = part[0] - mean
            return mean + delta * weight, m2 + part[1] + delta * delta * (tile_k * c.astype(jnp.float32) * weight)

        results[p] = lax.fori_loop(1, steps, merge, first)
    for p, row_pass in enumerate(passes):
        if row_pass.derived is not None:
            results[p] = (results[row_pass.derived][0] * float(row_pass.length),)
    return results
