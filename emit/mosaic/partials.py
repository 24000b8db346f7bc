"""Hosted statistics written by the Mosaic GPU matmul's epilogue as per-tile partials.

A statistic the plan hosts on a Mosaic matmul (`EpilogueReduce(term, op, body, axes, ty)`, op `sum`
or `moments`, one statistic output per output row: a LayerNorm over the matmul's last axis) is
computed from the epilogue's output, as stored (cast to the output dtype), while it is in
registers: each compute warpgroup evaluates the body on its `[epi_m, epi_n]` sub-tiles, masked to
the columns it owns (a clamped last N tile recomputes its neighbour's columns: those do not
count, nor columns past N), reduces each sub-tile along its columns (`tile_partials`: the sum, or
count, mean and M2 two-pass, `emit.expr.piece_moments`' corrected form) and merges its sub-tiles in
order (`merge_partials`, Chan's formula). The warpgroup's `[epi_m]` vectors go to SMEM and by TMA to
its own row of the buffer `[tiles, fields, slots]` of `emit.pallas.partials` (tile = the
warpgroup's N tile, `n_cta · compute_wgs + wg`; slot = the output row): no atomics, nothing to
zero, each entry written once (a clamped last M tile writes its neighbour's rows again, with the
same values). Readers merge the tiles (`emit.expr.read_partials`) as they do the Triton hosts'.

Mosaic GPU 0.10.2 (warpgroup lowering, compiled for sm_90a) reduces a `[64, 64]` WGMMA-layout fp32
array in registers along its columns (`jnp.sum(x, axis=1)`: a `[64]` vector in the WGMMA row
layout, broadcast back with `lax.broadcast_in_dim(v, (m, n), (0,))`) or its rows (`axis=0`), and
a vector of those to a scalar (`jnp.sum(jnp.sum(x, axis=1), axis=0)`); not both axes at once
(`jnp.sum(x)`: "Failed to infer a possible set of layouts"), and a scalar broadcast to a vector
stores only at 1 or a multiple of 128 elements ("Arrays with the splat layout can only be stored
when they have a single element or a multiple of 128 elements").

`RowStatistic.of(reduction, term, axes)` decides which statistics the template writes; the cost
model asks the same question on terms (`eqsat.cost.mosaic.row_statistic_declined`): a single host, a body
reading nothing but this matmul's output (through the ops the epilogue lowers), one output per
row in row order, and an output the kernel writes in place (no padded rows to drop). Any other
hosted statistic is left to the driver (its own reduce kernel after the host), as before. Readers
on Triton merge the partials where they read them; a Mosaic matmul reads them finished, merged once
by `emit.pallas.partials.finalize` (`emit.mosaic.matmul.emit`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from emit import expr as ex
from eqsat.term import Term


@dataclasses.dataclass(frozen=True)
class RowStatistic:
    """A statistic the matmul's epilogue writes: `body(out_tile)` is its fp32 body at each element
    of an output sub-tile (as stored), each row of the output its own slot."""

    op: str
    body: Callable[[jax.Array], jax.Array]

    @property
    def fields(self) -> int:
        return ex.PARTIAL_FIELDS[self.op]

    @classmethod
    def of(cls, reduction: Term, term: Term, axes) -> "RowStatistic":
        """The part of `reduction` the Mosaic matmul `term` computes; raises `NotImplementedError`
        (the driver then reduces it) for a statistic it does not write (`row_statistic_declined`)."""
        from eqsat.cost.mosaic import row_statistic_declined

        reason = row_statistic_declined(reduction, term)
        if reason is not None:
            raise NotImplementedError(reason)
        from emit.pallas.conv import _body_index, _spine_path

        path = _spine_path(reduction.args[2], term)
        compiled = ex.compile_expr(path[0])
        with_batch = bool(axes.batch_shape)

        def body(out_tile):
            em, en = out_tile.shape
            b = np.zeros((1, 1), np.int64) if with_batch else 0
            index, _ok = _body_index(path, axes.out_index(b, np.arange(em).reshape(em, 1),
                                                          np.arange(en).reshape(1, en)))
            value = compiled(_OutputMemory(term, out_tile), index, True)
            return jnp.broadcast_to(value, (em, en)).astype(jnp.float32)

        return cls(reduction.args[1], body)


class _OutputMemory:
    """The body's memory: its one `Load` (of the matmul's output) is the output sub-tile."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self, term: Term, tile: jax.Array):
        self.term, self.tile = term, tile

    def load(self, tensor: Term, index, mask):
        if tensor is not self.term:
            raise AssertionError(f"a hosted statistic's body reads {tensor!r}, not the matmul's output")
        return self.tile


def _rows(matrix: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """Broadcast a `[rows]` vector back along the columns of `matrix`."""
    return lambda vector: lax.broadcast_in_dim(vector, matrix.shape, (0,))


def tile_partials(op: str, body: jax.Array, valid: jax.Array) -> tuple[jax.Array, ...]:
    """Per row of `body` `[rows, cols]` fp32, over its `valid` columns: `(sum,)`, or `(count, mean,
    M2)` two-pass about the rough mean, corrected once (`emit.expr.piece_moments`): `[rows]` vectors."""
    live = lambda v: jnp.where(valid, v, 0.0)  # noqa: E731
    if op == "sum":
        return (jnp.sum(live(body), axis=1),)
    back = _rows(body)
    count = jnp.sum(live(jnp.ones_like(body)), axis=1)
    safe = jnp.maximum(count, 1.0)
    rough = jnp.sum(live(body), axis=1) / safe
    deviation = live(body - back(rough))
    drift = jnp.sum(deviation, axis=1)
    correction = drift / safe
    m2 = jnp.sum(deviation * deviation, axis=1) - drift * correction
    return count, rough + correction, jnp.maximum(m2, 0.0)


def merge_partials(op: str, first: tuple[jax.Array, ...], then: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Two sub-tiles' partials of the same rows merged, `first` first (a sum; Chan's formula)."""
    if op == "sum":
        return (first[0] + then[0],)
    return ex.chan_merge(first, then)
