"""Hosted statistics written by the Mosaic GPU matmul's and convs' epilogues as per-tile partials
(`RowStatistic`: one output per matmul row; `GroupStatistic`: one per (image, channel group) of a
conv's output, below).

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
on Triton merge the partials where they read them; a Mosaic matmul or conv reads them finished: the
driver finishes them before it emits the kernel, once, by `emit.pallas.partials.finalize`, and keeps
them for every later reader (`emit.pallas.finish_read_statistics`).

A conv's GroupNorm statistic (`GroupStatistic.of`, `eqsat.cost.backends.group_statistic_declined`:
its only host, a body reading only the conv's output, slot = image · groups + channel // cpg) is
computed per stored sub-tile by `group_partials` (columns first, groups as column ranges, the group
scalars placed into `[slots]` vectors cast to the WGMMA row layout) and merged across sub-tiles;
each CTA (and compute warpgroup) writes one `[fields, slots]` row (`write_group_partials`).

Where a haloed conv is a statistic's only host and a kernel of its own would finish it otherwise
(`eqsat.cost.finish`), the conv's last CTA also finishes it and writes the vector tables of the
Mosaic convs reading it (`emit.mosaic.finish`: a ticket counter in GMEM, the CTA that draws the
last ticket merges every row): no finalize kernel after it. Merging in the readers instead
stays blocked in jax 0.10.2 (the per-group -> per-channel expansion needs a per-lane SMEM gather).
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


# --- per-(image, channel group) statistics of a conv's output ------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupStatistic:
    """A statistic a Mosaic conv's epilogue writes (a GroupNorm's moments of the conv's output):
    `body(out_tile)` its fp32 body at each element of an output sub-tile (as stored); slot =
    image · `groups` + channel // `cpg` (`eqsat.cost.backends.group_statistic_declined`)."""

    op: str
    body: Callable[[jax.Array], jax.Array]
    images: int
    groups: int
    cpg: int

    @property
    def fields(self) -> int:
        return ex.PARTIAL_FIELDS[self.op]

    @property
    def slots(self) -> int:
        return self.images * self.groups

    @property
    def padded_slots(self) -> int:
        """The slot vectors' length in registers: whole 64-element WGMMA row vectors."""
        return -(-self.slots // 64) * 64

    @classmethod
    def of(cls, reduction: Term, term: Term) -> "GroupStatistic":
        """The statistic the Mosaic conv `term` writes for `reduction`, or `NotImplementedError`
        (the driver then reduces it) for one it does not (`group_statistic_declined`)."""
        from eqsat.conv_params import ConvParams
        from eqsat.cost.backends import group_form, group_statistic_declined
        from eqsat.cost.mosaic import _host_elements
        from eqsat.types import ints, parse_type

        reason = group_statistic_declined(reduction, term)
        if reason is not None:
            raise NotImplementedError(reason)
        from emit.pallas.conv import _body_index, _place, _spine_path

        out_spec = ConvParams.parse(term.args[2]).out_spec
        out_shape = tuple(parse_type(term.ty).shape)
        _reason, groups, cpg = group_form(_host_elements(reduction.args[2], term), ints(reduction.args[3]),
                                          out_spec, out_shape)
        path = _spine_path(reduction.args[2], term)
        compiled = ex.compile_expr(path[0])

        def body(out_tile):
            em, en = out_tile.shape
            zero = np.zeros((1, 1), np.int64)
            index, _ok = _body_index(path, _place(out_spec, (zero, np.arange(en).reshape(1, en),
                                                             np.arange(em).reshape(em, 1), zero)))
            value = compiled(_OutputMemory(term, out_tile), index, True)
            return jnp.broadcast_to(value, (em, en)).astype(jnp.float32)

        return cls(reduction.args[1], body, out_shape[out_spec[0]], groups, cpg)


def _as_row_vector(vector: jax.Array, interpreted: bool) -> jax.Array:
    """`vector` in the WGMMA row layout (Mosaic GPU 0.10.2's layout inference did not finish within
    minutes on 32- and 64-slot iota vectors left to it; cast, they compile in seconds)."""
    if interpreted:
        return vector
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(vector, plgpu.Layout.WGMMA.reduce(1))


def _as_column_vector(vector: jax.Array, interpreted: bool) -> jax.Array:
    if interpreted:
        return vector
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(vector, plgpu.Layout.WGMMA.reduce(0))


def group_partials(statistic: GroupStatistic, stored: jax.Array, row_image: jax.Array, first_image,
                   channel0, images_span: int, interpreted: bool) -> tuple[jax.Array, ...]:
    """A sub-tile's partials of every slot, `fields` `[padded_slots]` vectors (count 0 for slots it
    does not touch): `stored` the output sub-tile `[em, en]` as stored, `row_image` `[em]` int32
    the image of each row (-1 where the row is not an output pixel), `first_image` the first of the
    `images_span` images its rows may hold, `channel0` the conv output channel of its first column
    (columns past the conv's channels, `groups · cpg`, do not count).

    Columns first: each column's count and sum over the rows of one image, then per group (the
    `ceil((en - 1) / cpg) + 1` groups its columns may touch) the count and rough mean from those
    vectors; the deviations from each column's group mean, summed per column, give the group's drift
    and sum of squares (`tile_partials`' corrected two-pass); each group's sums are placed at its
    slot as they are found, the moments finished on the slot vectors. No vector integer division:
    groups are column ranges, `channel0 // cpg` a scalar."""
    em, en = stored.shape
    body = statistic.body(stored)
    cpg, channels = statistic.cpg, statistic.groups * statistic.cpg
    span = min(statistic.groups, -(-(en - 1) // cpg) + 1)
    column = _as_column_vector(channel0 + lax.broadcasted_iota(jnp.int32, (en,), 0), interpreted)
    first_group = lax.div(channel0, cpg)
    slot_ids = _as_row_vector(lax.broadcasted_iota(jnp.int32, (statistic.padded_slots,), 0), interpreted)
    zeros = _as_row_vector(jnp.zeros((statistic.padded_slots,), jnp.float32), interpreted)
    out = [zeros] * statistic.fields
    for j in range(images_span):
        image = first_image + j
        rows = lax.broadcast_in_dim(row_image == image, (em, en), (0,))
        live = lambda v: jnp.where(rows, v, 0.0)  # noqa: E731
        column_sum = jnp.sum(live(body), axis=0)
        # a group's count is its image's rows times its columns here: scalars, no column vector
        rows_here = jnp.sum(jnp.sum(live(jnp.ones_like(body)), axis=1), axis=0) / en
        column_end = jnp.minimum(channel0 + en, channels)
        base = image * statistic.groups + first_group
        inside = lambda k: ((column >= (first_group + k) * cpg) & (column < (first_group + k + 1) * cpg)  # noqa: E731
                            & (column < channels))
        # Each group's scalars go straight into [slots] vectors (2 registers a field), not kept per
        # group: kept, they pushed a 2-warpgroup flat-grid conv (168 registers) into spilling.
        count_at, total_at, column_mean = zeros, zeros, jnp.zeros((en,), jnp.float32)
        for k in range(span):
            start = (first_group + k) * cpg
            columns = jnp.maximum(jnp.minimum(start + cpg, column_end) - jnp.maximum(start, channel0), 0)
            count = rows_here * columns.astype(jnp.float32)
            total = jnp.sum(jnp.where(inside(k), column_sum, 0.0), axis=0)
            column_mean = jnp.where(inside(k), total / jnp.maximum(count, 1.0), column_mean)
            at = slot_ids == base + k
            count_at, total_at = jnp.where(at, count, count_at), jnp.where(at, total, total_at)
        if statistic.op == "sum":
            part = (total_at,)
        else:
            deviation = live(body - lax.broadcast_in_dim(column_mean, (em, en), (1,)))
            column_drift = jnp.sum(deviation, axis=0)
            column_square = jnp.sum(deviation * deviation, axis=0)
            drift_at, square_at = zeros, zeros
            for k in range(span):
                at = slot_ids == base + k
                drift_at = jnp.where(at, jnp.sum(jnp.where(inside(k), column_drift, 0.0), axis=0), drift_at)
                square_at = jnp.where(at, jnp.sum(jnp.where(inside(k), column_square, 0.0), axis=0), square_at)
            safe = jnp.maximum(count_at, 1.0)
            correction = drift_at / safe
            part = (count_at, total_at / safe + correction, jnp.maximum(square_at - drift_at * correction, 0.0))
        touched = count_at > 0
        out = [jnp.where(touched, value, field) for value, field in zip(part, out)]
    return tuple(out)


def write_group_partials(statistics, partials, smems, gmems, tile) -> None:
    """A tile's slot vectors (per statistic, per field) through SMEM to row `tile` of each
    statistic's `[tiles, fields, slots]` output, by TMA (the first `slots` of each padded vector)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for part, smem in zip(partials, smems):
        for f, value in enumerate(part):
            smem[f] = value
    plgpu.commit_smem()
    for statistic, smem, gmem in zip(statistics, smems, gmems):
        for f in range(statistic.fields):
            plgpu.copy_smem_to_gmem(smem.at[f, pl.ds(0, statistic.slots)], gmem.at[tile, f])
