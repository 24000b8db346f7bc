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
per point within one expression evaluation; the matmul's pre-pass hoists it per row block). It
merges TB tiles per step (`emit.expr.merge_partials_at`: a block of TB tiles loaded at once and
reduced with vector reductions, TB a power of two with TB x the point's lanes <= 4096 elements),
so its serial chain is ceil(tiles / TB) steps, not tiles. Row statistics have few tiles (the
host's N tiles); GroupNorm statistics of big convs have many (every M x N tile: 192 at SD 1.5's
64x64 latents, 4096 at the VAE's 512x512 output), merged in ceil(192 / TB) or ceil(4096 / TB)
steps (one step for 192 tiles at a point of up to 16 lanes).

`merged(statistic, buffer)` is the finished statistic in plain jax (the same merge as the readers'):
for what reads a statistic outside a Pallas template (an XLA fallback kernel, an opaque primitive,
a loop's operands, the plan's outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from emit.expr import evaluate_whole
from emit.pallas import triton
from eqsat.term import Term

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
