"""Convolution: an implicit GEMM in Pallas Triton (kernel | build | reference).

A `Conv(lhs, rhs, params, epilogue, ty)` kernel runs as a GEMM whose M axis is the output pixels,
N the output channels and K the input channels times the window's taps. Each program owns
block_n channels and one spatial tile of one image, summed over every tap (ky, kx) and every
block_k chunk of input channels, in one of two shapes (`ConvConfig.flat`; the cost model picks
per shape, `eqsat.cost.mma.conv_config`):

Row tiles (`_row_tile_sums`): `th` rows × `tw` columns (`ConvConfig.tile`: 2 × 64 on images 64 or
more wide), one fp32 accumulator per row, `tw` the dots' M. Per chunk and column tap kx, each
input row the tile reads is computed once and feeds every output row r reading it through a row
tap ky (r·sy + ky·dy = that row):

    A_row[x, c] = prologue(b, c, row, (x0 + x)·sx − pad_x + kx·dx)           (0 in the padding)
    W[c, n]     = weight(n, c, ky, kx)
    acc[r]     += dot(A_row, W)                                              (2-D, fp32 result)

so a 3×3 conv computes its input 3 × (th + 2) / th times per element and output-channel tile,
not 9 (Pallas Triton cannot shift a tile in registers, so the column taps still recompute).
A K range whose input and weight are plain loads (`KRange.direct`: nothing to recompute) runs
`_direct_row_sums` instead: taps inner, each output row's input row loaded at every tap and fed
to the dot as loaded, one dot per accumulator and tap, so Triton pipelines the loads into shared
memory and keeps the wgmma in flight (a row reused by several dots of one step, through a select,
made it wait for every wgmma). A computed input's dots wait for 0 either way, on flat tiles too
(measured in sm_90a PTX: Triton in jax 0.10.2 keeps no wgmma in flight whose register operand is
written inside the loop).

Flat tiles (`_flat_tile_sums`): `block_m` consecutive output pixels of one image in row-major
order (several rows of a 32-, 16- or 8-wide image), one accumulator, the dot's M = block_m (64 or
128: wgmma where a row tile of a narrow image would multiply with mma.sync). Each pixel's output
row and column are index arithmetic, so every tap gathers its own input tile:

    A[p, c]  = prologue(b, c, oy(p)·sy − pad_y + ky·dy, ox(p)·sx − pad_x + kx·dx)
    acc     += dot(A, W[ky, kx])

computing the input 9 times per element and output-channel tile for a 3×3 conv (the cost model
charges that: `eqsat.tiling.conv.prologue_evaluations`).

`prologue` and `weight` are closures evaluated at index tiles: one int32 array per axis of the
operand, broadcast-compatible ([tw, 1] pixels, [1, block_k] channels), with a validity
mask. They are the conv's operand expressions compiled by `emit.expr`, so an input read through
a view (NCHW↔NHWC permute, nearest-2× upsample `y // 2`) or through GroupNorm apply + SiLU is
computed on the fly and never stored. Zero padding applies AFTER the prologue: a tap in the
padding contributes 0, not prologue(0). Which operand axis is batch, feature or spatial comes
from the conv's dimension numbers (`eqsat.conv_params.ConvParams`), never from an assumed layout.

K ranges (`KRange`): the input channels split into consecutive ranges, each with its own
closures and taps. `concat(h, skip)` is two ranges reading two buffers; a merged 1×1 shortcut
(`Conv(concat(x, h), concat(pad(w1x1), w3x3))`) runs the 1×1 range over the centre tap only, so
its zero weight taps cost nothing (the cost model's `nonzero_weight_elements` assumes exactly
this). Skipping a zero-weight tap differs from the dense conv only where the prologue is inf or
NaN there (the dense conv computes 0·inf = NaN).

The epilogue closure maps the fp32 accumulator tile to the output tile at the output index
(bias, time-embedding row, residual, cast); the tile is stored through the output's dimension
numbers, so conv_out writes NCHW directly.

Statistics of the output (`TileStatistic`, an `EpilogueReduce` the plan hosts on this conv: the
next GroupNorm's sum/M2): while the tile is in registers, each program writes its own partial
(a sum, or count, mean and M2 computed two-pass over the tile) for every statistic output into
its row of a small fp32 partials buffer, a second output of the kernel: no atomics, no zeroing,
no index tables (each element's statistic output is index arithmetic in the kernel). The kernels
reading the statistic merge the rows in tile order where they read it (`emit.expr.read_partials`,
Chan et al.'s formula), so the result is deterministic and no merge kernel runs. A statistic over
`concat(h, skip)` has one buffer: the later host copies the earlier one's rows in front of its
own (`emit.pallas.partials`). `merge_partials` is a pairwise merge in plain jax (tests).

    emit(kernel, ctx)              the dispatch entry (`emit.pallas`): a KernelCall in an EmitContext
    run(term, operands, ...)       a Conv term with its tensors bound: output (and partials)
    build(geometry, ranges, ...)   the pallas_call over closures: grid, tiles, validation
    reference(lhs, rhs, params)    lax.conv_general_dilated with fp32 accumulation

Loops: channel chunks outer, column taps inner, input rows and row taps unrolled (row tiles);
channel chunks outer, taps inner (flat tiles). What the input
expression computes per (batch, channel) (GroupNorm's scale and shift, the merge of a hosted
statistic's partials) does not vary over a tile: it is evaluated once per chunk at pixel (0, 0)
(`emit.expr.CompiledExpr.hoist`) and reused at every tap, on a [1, block_k] tile.

Tiling: the geometry (`ConvGeometry`), K ranges (`KRange`), tiles (`ConvConfig`), grid and
prologue evaluations are `eqsat.tiling.conv`'s (importable from here too), which the cost model
reads as well. Cost: per output-channel tile, a 3×3 conv evaluates its per-pixel prologue for
each input row of each row tile at each column tap, or at each flat tile's pixels at every tap,
and its per-(batch, channel) part once per program and chunk; `eqsat.cost.tiles` charges exactly
that (`conv_tile`, `conv_prologue_evaluations`, `ConvPrograms`; tests/test_emit_conv_flat.py
counts the evaluations in the running kernel).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from emit.expr import chan_merge, compile_expr, expr_nodes, linearize, piece_moments, reshape_index
from emit.pallas import loaded_tensors, triton
from emit.pallas.contiguous import ContiguousMemory
from emit.pallas.partials import Partials, copy_prefix
from emit.pallas.triton import RefMemory
from eqsat.conv_params import ConvParams
from eqsat.cost import mma as conv_choice  # the tile shape the cost model chooses (a module: tests may force one)
from eqsat.term import Term
from eqsat.tiling import dot_itemsize
from eqsat.tiling.conv import (  # the tiling, shared with the cost model; importable from here too
    DEFAULT_BLOCK_K, DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, DEFAULT_BLOCK_W, MAX_TILE_ROWS, MIN_BLOCK, ConvConfig,
    ConvGeometry, KRange, UncoveredConv, grid, output_channel_tiles, output_tile)
from eqsat.types import format_type, ints, parse_type

# (refs, index, mask) -> tile: an operand expression evaluated at an index tile. `refs` are the
# kernel's flat input refs, `index` one int32 array per axis of the operand.
OperandFn = Callable[[Sequence, tuple, jax.Array], jax.Array]
# (refs, acc, index, mask) -> output tile: the epilogue over the fp32 accumulator tile.
EpilogueFn = Callable[[Sequence, jax.Array, tuple, jax.Array], jax.Array]

next_pow2 = triton.next_pow2


# --- index placement ------------------------------------------------------------------------


def _place(spec: Sequence[int], values: Sequence) -> tuple:
    """An index tuple in an operand's axis order: `values[i]` goes to axis `spec[i]`."""
    index = [None] * len(spec)
    for axis, value in zip(spec, values):
        index[axis] = value
    return tuple(index)


# --- kernel -----------------------------------------------------------------------------------


def _iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _flat_offset(index: Sequence[jax.Array], shape: Sequence[int]) -> jax.Array:
    offset, stride = 0, 1
    for i, size in zip(reversed(index), reversed(shape)):
        offset = offset + i * stride
        stride *= size
    return offset


def _conv_kernel(*refs, geometry: ConvGeometry, ranges: tuple[KRange, ...], epilogue: EpilogueFn,
                 config: ConvConfig, n_inputs: int, dot_dtype, statistics: tuple["_Layout", ...],
                 prefix_sizes: tuple[int, ...]):
    # Every ref is flat (`triton.pallas_call`): operands, then the earlier hosts' partials of each
    # statistic that has some, then the output and each statistic's partials.
    inputs = refs[:n_inputs]
    prefix_refs = refs[n_inputs:n_inputs + sum(size > 0 for size in prefix_sizes)]
    out_ref = refs[n_inputs + sum(size > 0 for size in prefix_sizes)]
    partial_refs = refs[n_inputs + sum(size > 0 for size in prefix_sizes) + 1:]
    g, p = geometry, geometry.params
    bn = config.block_n
    n = pl.program_id(1) * bn + _iota(bn)[None, :]                                      # [1, bn]
    cols_ok = n < g.out_features
    if config.flat:
        b, tiles = _flat_tile_sums(inputs, g, ranges, config, dot_dtype, n, cols_ok)
    else:
        b, tiles = _row_tile_sums(inputs, g, ranges, config, dot_dtype, n, cols_ok)

    program, programs = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1), math.prod(_grid(g, config))
    fields = [None] * len(statistics)
    # Each statistic's channel parts depend on the output channels only: found once, not per row.
    column_parts = [None if layout.per_row else
                    _column_parts(layout, layout.statistic.slot_at(_place(p.out_spec, (0, n, 0, 0))), cols_ok)
                    for layout in statistics]
    for acc, oy_tile, ox, rows_ok in tiles:
        out_mask = rows_ok & cols_ok
        out_index = _place(p.out_spec, (b, n, oy_tile, ox))
        value = jnp.broadcast_to(epilogue(inputs, acc, out_index, out_mask), acc.shape)
        # Masked lanes point one past the end: never touched on the GPU, dropped in interpret mode.
        offset = jnp.where(out_mask, _flat_offset(out_index, g.out_shape), math.prod(g.out_shape))
        triton.store(out_ref, offset, value, out_mask)

        stored = value.astype(out_ref.dtype)  # what readers of the output see
        for s_i, (layout, partial_ref, prefix_size) in enumerate(zip(statistics, partial_refs, prefix_sizes)):
            body, body_ok = layout.statistic.value(inputs, stored, out_index, out_mask)
            slot_at = layout.statistic.slot_at
            if layout.per_row:
                tile_row = prefix_size // (layout.fields * layout.slots) + pl.program_id(1)
                _write_row_partials(layout, partial_ref, body, out_mask & body_ok, rows_ok,
                                    slot_at(_place(p.out_spec, (b, 0, oy_tile, ox))), tile_row)
                continue
            row_part = slot_at(_place(p.out_spec, (b, 0, oy_tile, ox))) - slot_at(_place(p.out_spec, (0, 0, 0, 0)))
            part = _tile_partials(layout, body, out_mask & body_ok, rows_ok, row_part, column_parts[s_i])
            fields[s_i] = part if fields[s_i] is None else _merge_fields(layout, fields[s_i], part)

    prefixes = iter(prefix_refs)
    for layout, partial_ref, prefix_size, part in zip(statistics, partial_refs, prefix_sizes, fields):
        if prefix_size:
            copy_prefix(next(prefixes), partial_ref, prefix_size, program, programs)
        if not layout.per_row:
            _store_partials(layout, partial_ref, part, prefix_size // (layout.fields * layout.slots) + program)


def _zero_padded(tile, mask, zero_masked: bool, dot_dtype):
    """An operand tile as the dot takes it: 0 outside `mask` (zero padding applies after the
    prologue), by a select unless the operand already reads 0 there (`KRange.lhs_zero_masked`).
    Without the select a loaded tile reaches the dot as loaded: Triton stages it in shared memory
    and issues the wgmma asynchronously (`wgmma.wait_group 1`); through the select it is a register
    operand and every wgmma waits for 0. The flat tile uses that; the row tile keeps the select."""
    if not zero_masked:
        tile = jnp.where(mask, tile, 0)
    return tile if tile.dtype == dot_dtype else tile.astype(dot_dtype)


def _row_tile_sums(inputs, g: ConvGeometry, ranges, config: ConvConfig, dot_dtype, n, cols_ok):
    """A row tile's accumulators: `th` output rows × `tw` output columns of one image, each row its
    own [tw, bn] accumulator; each input row's expression computed once per column tap and reused
    by every row tap. Returns the batch index and `(acc, rows, columns, valid)` per output row."""
    p = g.params
    bk = config.block_k
    (in_h, in_w), (out_h, out_w) = g.in_size, g.out_size
    (stride_y, stride_x), (dil_y, dil_x) = p.strides, p.rhs_dilation
    (pad_y, _), (pad_x, _) = p.padding
    # The batch index is the program's, so what the input expression computes per (batch, channel)
    # (GroupNorm's scale and shift, the merge of its statistic's partials) is evaluated on a
    # [1, block_k] tile once per channel chunk (`hoist`), not per pixel and tap.
    th, tw = config.tile(g)
    tiles_y, tiles_x = pl.cdiv(out_h, th), pl.cdiv(out_w, tw)
    b = lax.div(pl.program_id(0), tiles_y * tiles_x)                                   # scalar
    tile = lax.rem(pl.program_id(0), tiles_y * tiles_x)
    row0, col0 = lax.div(tile, tiles_x) * th, lax.rem(tile, tiles_x) * tw
    ox = col0 + _iota(tw)[:, None]                                                     # [tw, 1]
    cols_in = ox < out_w
    ox = jnp.where(cols_in, ox, 0)
    accs = tuple(jnp.zeros((tw, config.block_n), jnp.float32) for _ in range(th))
    for k_range in ranges:
        (y0, y1), (x0, x1) = k_range.window(g)
        chunks = -(-k_range.channels // bk)
        if k_range.direct:
            accs = _direct_row_sums(inputs, g, k_range, config, dot_dtype, n, cols_ok, b, row0, ox, cols_in, accs)
            continue
        # Input row r_in (from the tile's first) feeds output row r through tap ky where
        # r·stride + ky·dilation == r_in: each input row's expression is computed once per column tap.
        uses: dict[int, list[tuple[int, int]]] = {}
        for r in range(th):
            for ky in range(y1 - y0):
                uses.setdefault(r * stride_y + ky * dil_y, []).append((r, ky))

        def chunk_step(chunk, accs, k_range=k_range, y0=y0, x0=x0, x1=x1, uses=uses):
            channel = chunk * bk + _iota(bk)
            channel_ok = channel[None, :] < k_range.channels
            hoisted = None if k_range.hoist is None else \
                k_range.hoist(inputs, _place(p.lhs_spec, (b, channel[None, :], 0, 0)), channel_ok)
            w_mask = (channel[:, None] < k_range.channels) & cols_ok

            def column_tap(kx, accs):
                ix = ox * stride_x - pad_x + (x0 + kx) * dil_x
                x_ok = cols_in & (ix >= 0) & (ix < in_w)
                weights = {}
                accs = list(accs)
                for r_in, targets in sorted(uses.items()):
                    iy = row0 * stride_y - pad_y + y0 * dil_y + r_in
                    a_mask = x_ok & (iy >= 0) & (iy < in_h) & channel_ok
                    # The row index as a [tw, 1] tile, so a node depending on it is seen as per pixel.
                    index = _place(p.lhs_spec, (b, channel[None, :], jnp.full((tw, 1), iy, jnp.int32), ix))
                    a = k_range.lhs(inputs, index, a_mask) if hoisted is None else \
                        k_range.lhs(inputs, index, a_mask, hoisted=hoisted)
                    # Always through the select: staged in shared memory instead (as the flat tile's
                    # are), the rows of the UNet's 64² convs spilled 104-168 B at 255 registers.
                    a = _zero_padded(a, a_mask, False, dot_dtype)
                    for r, ky in targets:
                        if ky not in weights:
                            tap_index = (jnp.full((1, 1), ky, jnp.int32), jnp.reshape(kx, (1, 1)))
                            w = k_range.rhs(inputs, _place(p.rhs_spec, (n, channel[:, None], *tap_index)), w_mask)
                            weights[ky] = _zero_padded(w, w_mask, False, dot_dtype)
                        accs[r] = accs[r] + lax.dot(a, weights[ky], preferred_element_type=jnp.float32)
                return tuple(accs)

            return column_tap(0, accs) if x1 - x0 == 1 else lax.fori_loop(0, x1 - x0, column_tap, accs)

        accs = chunk_step(0, accs) if chunks == 1 else lax.fori_loop(0, chunks, chunk_step, accs)

    return b, [(acc, jnp.full((tw, 1), row0 + r, jnp.int32), ox, cols_in & (row0 + r < out_h))
               for r, acc in enumerate(accs)]


def _direct_row_sums(inputs, g: ConvGeometry, k_range: KRange, config: ConvConfig, dot_dtype, n, cols_ok, b, row0,
                     ox, cols_in, accs):
    """A row tile's sums over a K range whose input and weight are plain loads (`KRange.lhs_zero_masked`
    and `rhs_zero_masked`): taps inner, each output row's input row loaded at every tap and fed to
    the dot as loaded, one dot per accumulator per tap. Reusing an input row across row taps (as
    `_row_tile_sums` does for a computed input) puts several dots on one accumulator in one loop
    step and the row through a select, and Triton then waits for every wgmma (`wait_group 0`);
    here both operands are pipelined loads and each dot only feeds the loop's next step, so the
    wgmma stay in flight (`wait_group` = rows). A load costs what a recompute of a plain input
    costs: nothing but bytes from L2 (`eqsat.tiling.conv.prologue_evaluations`, `direct`)."""
    p = g.params
    bk = config.block_k
    th, tw = config.tile(g)
    (in_h, in_w) = g.in_size
    (stride_y, stride_x), (dil_y, dil_x) = p.strides, p.rhs_dilation
    (pad_y, _), (pad_x, _) = p.padding
    (y0, y1), (x0, x1) = k_range.window(g)
    chunks, taps_x = -(-k_range.channels // bk), x1 - x0

    def chunk_step(chunk, accs):
        channel = chunk * bk + _iota(bk)
        channel_ok = channel[None, :] < k_range.channels
        hoisted = None if k_range.hoist is None else \
            k_range.hoist(inputs, _place(p.lhs_spec, (b, channel[None, :], 0, 0)), channel_ok)
        w_mask = (channel[:, None] < k_range.channels) & cols_ok

        def tap(t, accs):
            ky, kx = lax.div(t, taps_x), lax.rem(t, taps_x)
            ix = ox * stride_x - pad_x + (x0 + kx) * dil_x
            x_ok = cols_in & (ix >= 0) & (ix < in_w)
            tap_index = (jnp.reshape(ky, (1, 1)), jnp.reshape(kx, (1, 1)))
            w = k_range.rhs(inputs, _place(p.rhs_spec, (n, channel[:, None], *tap_index)), w_mask)
            w = _zero_padded(w, w_mask, True, dot_dtype)
            accs = list(accs)
            for r in range(th):
                iy = (row0 + r) * stride_y - pad_y + (y0 + ky) * dil_y
                a_mask = x_ok & (iy >= 0) & (iy < in_h) & channel_ok
                index = _place(p.lhs_spec, (b, channel[None, :], jnp.full((tw, 1), iy, jnp.int32), ix))
                a = k_range.lhs(inputs, index, a_mask) if hoisted is None else \
                    k_range.lhs(inputs, index, a_mask, hoisted=hoisted)
                a = _zero_padded(a, a_mask, True, dot_dtype)
                accs[r] = accs[r] + lax.dot(a, w, preferred_element_type=jnp.float32)
            return tuple(accs)

        taps = (y1 - y0) * taps_x
        return tap(jnp.int32(0), accs) if taps == 1 else lax.fori_loop(0, taps, tap, accs)

    return chunk_step(0, accs) if chunks == 1 else lax.fori_loop(0, chunks, chunk_step, accs)


def _flat_tile_sums(inputs, g: ConvGeometry, ranges, config: ConvConfig, dot_dtype, n, cols_ok):
    """A flat tile's accumulator: `block_m` consecutive output pixels of one image (row-major, so
    several rows of a narrow image) as one [block_m, bn] dot M, their input computed at every tap.
    Returns the batch index and one `(acc, rows, columns, valid)`."""
    p = g.params
    bm, bk = config.block_m, config.block_k
    (in_h, in_w), (out_h, out_w) = g.in_size, g.out_size
    (stride_y, stride_x), (dil_y, dil_x) = p.strides, p.rhs_dilation
    (pad_y, _), (pad_x, _) = p.padding
    tiles = config.spatial_tiles(g)
    b = lax.div(pl.program_id(0), tiles)                                               # scalar
    pixel = lax.rem(pl.program_id(0), tiles) * bm + _iota(bm)[:, None]                 # [bm, 1]
    pixels_ok = pixel < out_h * out_w
    pixel = jnp.where(pixels_ok, pixel, 0)
    oy, ox = lax.div(pixel, out_w), lax.rem(pixel, out_w)  # non-negative: no floor fix-up (Triton)
    acc = jnp.zeros((bm, config.block_n), jnp.float32)

    for k_range in ranges:
        (y0, y1), (x0, x1) = k_range.window(g)
        chunks = -(-k_range.channels // bk)
        taps_x = x1 - x0

        def chunk_step(chunk, acc, k_range=k_range, y0=y0, x0=x0, taps_x=taps_x):
            channel = chunk * bk + _iota(bk)
            channel_ok = channel[None, :] < k_range.channels
            hoisted = None if k_range.hoist is None else \
                k_range.hoist(inputs, _place(p.lhs_spec, (b, channel[None, :], 0, 0)), channel_ok)
            w_mask = (channel[:, None] < k_range.channels) & cols_ok

            def tap(t, acc):
                ky, kx = lax.div(t, taps_x), lax.rem(t, taps_x)
                iy = oy * stride_y - pad_y + (y0 + ky) * dil_y
                ix = ox * stride_x - pad_x + (x0 + kx) * dil_x
                a_mask = pixels_ok & (iy >= 0) & (iy < in_h) & (ix >= 0) & (ix < in_w) & channel_ok
                index = _place(p.lhs_spec, (b, channel[None, :], iy, ix))
                a = k_range.lhs(inputs, index, a_mask) if hoisted is None else \
                    k_range.lhs(inputs, index, a_mask, hoisted=hoisted)
                a = _zero_padded(a, a_mask, k_range.lhs_zero_masked, dot_dtype)
                tap_index = (jnp.reshape(ky, (1, 1)), jnp.reshape(kx, (1, 1)))
                w = k_range.rhs(inputs, _place(p.rhs_spec, (n, channel[:, None], *tap_index)), w_mask)
                w = _zero_padded(w, w_mask, k_range.rhs_zero_masked, dot_dtype)
                return acc + lax.dot(a, w, preferred_element_type=jnp.float32)

            taps = (y1 - y0) * taps_x
            return tap(jnp.int32(0), acc) if taps == 1 else lax.fori_loop(0, taps, tap, acc)

        acc = chunk_step(0, acc) if chunks == 1 else lax.fori_loop(0, chunks, chunk_step, acc)
    return b, [(acc, oy, ox, pixels_ok)]


# --- build ------------------------------------------------------------------------------------


_grid = grid


def tile_pixels(geometry: ConvGeometry, config: ConvConfig) -> list[np.ndarray]:
    """The output pixels (flat, batch-major) of each program's tile, in program order."""
    th, tw = config.tile(geometry)
    out_h, out_w = geometry.out_size
    tiles = []
    if config.flat:
        image = out_h * out_w
        return [b * image + np.arange(start, min(start + config.block_m, image))
                for b in range(geometry.batch) for start in range(0, image, config.block_m)]
    for b in range(geometry.batch):
        for y in range(0, out_h, th):
            for x in range(0, out_w, tw):
                rows, cols = np.arange(y, min(y + th, out_h)), np.arange(x, min(x + tw, out_w))
                tiles.append((b * out_h * out_w + rows[:, None] * out_w + cols[None, :]).ravel())
    return tiles


def build(geometry: ConvGeometry, ranges: Sequence[KRange], epilogue: EpilogueFn, inputs: Sequence[jax.Array],
          out_dtype, *, statistics: Sequence["TileStatistic"] = (), prefixes: Sequence[jax.Array | None] = (),
          config: ConvConfig | None = None, dot_dtype=None, interpret: bool = False, name: str = "conv"):
    """Run the conv template: `inputs` are the arrays the closures read (flattened here, so the
    closures see flat refs in the same order). Returns the output of `geometry.out_shape`, or,
    with `statistics`, `(output, [partials of each statistic])` (see `TileStatistic`). A statistic's
    `prefixes` entry (None, or its earlier hosts' partials `[tiles, fields, slots]`) is copied into
    the front of its partials, this conv's tiles written after it."""
    ranges = tuple(ranges)
    if not ranges:
        raise ValueError("a conv needs at least one K range")
    total = sum(r.channels for r in ranges)
    if total != geometry.in_features:
        raise ValueError(f"K ranges cover {total} input channels, the conv has {geometry.in_features}")
    for r in ranges:
        r.window(geometry)
    dot_dtype = jnp.dtype(dot_dtype or out_dtype)
    config = config or conv_choice.conv_config(geometry, ranges, dot_dtype.itemsize)
    if dot_dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise ValueError(f"dot dtype {dot_dtype} is not one of float16, bfloat16, float32")
    grid = _grid(geometry, config)
    layouts = tuple(_Layout.of(statistic, geometry, config) for statistic in statistics)
    prefixes = tuple(prefixes) or (None,) * len(layouts)
    if len(prefixes) != len(layouts):
        raise ValueError(f"{len(prefixes)} partials prefixes for {len(layouts)} statistics")
    prefix_tiles = []
    for layout, prefix in zip(layouts, prefixes):
        row = layout.fields * layout.slots
        if prefix is not None and (prefix.dtype != jnp.float32 or prefix.size % row):
            raise ValueError(f"earlier hosts' partials {prefix.shape} {prefix.dtype} are not fp32 [tiles, "
                             f"{layout.fields}, {layout.slots}]")
        prefix_tiles.append(0 if prefix is None else prefix.size // row)
    kernel = functools.partial(_conv_kernel, geometry=geometry, ranges=ranges, epilogue=epilogue, config=config,
                               n_inputs=len(inputs), dot_dtype=dot_dtype, statistics=layouts,
                               prefix_sizes=tuple(t * l.fields * l.slots for t, l in zip(prefix_tiles, layouts)))
    out_shapes = [jax.ShapeDtypeStruct(geometry.out_shape, out_dtype)]
    out_shapes += [jax.ShapeDtypeStruct((t + (grid[1] if layout.per_row else grid[0] * grid[1]), layout.fields,
                                         layout.slots), jnp.float32)
                   for t, layout in zip(prefix_tiles, layouts)]
    operands = [*inputs, *(prefix for prefix in prefixes if prefix is not None)]
    out, *partials_out = triton.pallas_call(kernel, operands, out_shapes, grid=grid, name=name,
                                            interpret=interpret, num_warps=config.num_warps,
                                            num_stages=config.num_stages)
    return (out, partials_out) if statistics else out



# --- statistics of the epilogue value ----------------------------------------------------------


@dataclass(frozen=True)
class TileStatistic:
    """A reduction of the conv's output computed by its output tiles (an `EpilogueReduce` hosted here).

    `value(refs, out_tile, out_index, mask) -> (body [bm, bn] fp32, ok)` is the reduction's body at
    each output element (`out_tile` is the output as stored, `ok` where the body reads it), and
    `slot_at(out_index)` the reduction output (row-major over its kept axes, `0 <= slot < slots`)
    an output element belongs to: index arithmetic, on numpy arrays on the host (`slot_of[m, n]`,
    pixel m, output channel n) and on index tiles in the kernel (no index tables). `op` "sum" writes
    per tile the partial sum of every slot (`[tiles, 1, slots]`); "moments" its count, mean and M2
    (`[tiles, 3, slots]`, two-pass over the tile's elements of that slot; 0, 0, 0 for slots the
    tile does not touch), tiles in row-major (M tile, N tile) order; readers merge them in that
    order (`emit.expr.read_partials`; `merge_partials` here, pairwise, for tests).

    The slot must split into a pixel part plus a channel part (GroupNorm: batch·groups + channel //
    group size), and an output tile may touch at most `MAX_ROW_SLOTS` pixel parts: each tile sums
    its rows per pixel part, then its columns per channel part, with no atomics.
    """

    op: str
    value: Callable
    slot_of: np.ndarray
    slots: int
    slot_at: Callable

    def __post_init__(self):
        if self.op not in ("sum", "moments"):
            raise NotImplementedError(f"a conv epilogue computes sum or moments statistics, not {self.op!r}")


MAX_ROW_SLOTS = 8
MAX_SLOTS = 8192


def _tile_distinct(values: np.ndarray, tiles: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per tile (the entries of `values` it holds): its distinct values, ascending and 0-padded
    (`distinct[tile, rank]`), and how many it has. All tiles at once (a tile per row, sorted):
    a 512x512 image has thousands of tiles."""
    lengths = np.array([len(members) for members in tiles])
    valid = np.arange(lengths.max())[None, :] < lengths[:, None]
    held = np.full(valid.shape, np.iinfo(np.int64).max, np.int64)  # padding sorts last
    held[valid] = values[np.concatenate(tiles)]
    held.sort(axis=1)
    new = valid.copy()
    new[:, 1:] &= held[:, 1:] != held[:, :-1]
    counts = new.sum(axis=1)
    tile, position = np.nonzero(new)
    distinct = np.zeros((len(tiles), counts.max()), np.int32)
    distinct[tile, np.cumsum(new, axis=1)[tile, position] - 1] = held[tile, position]
    return distinct, counts.astype(np.int32)


def _splits_into_parts(table: np.ndarray) -> bool:
    """Whether `table[m, n] == table[m, 0] - table[0, 0] + table[0, n]` everywhere. Checked on the
    part the table stores: along an axis of stride 0 (a broadcast view: the slot of a VAE's
    GroupNorm is its channel's alone) every entry is the first, where the identity always holds."""
    stored = table[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in table.strides)]
    return np.array_equal(stored, (stored[:, 0] - stored[0, 0])[:, None] + stored[0, :][None, :])


def _part_gaps(parts: np.ndarray, used: np.ndarray) -> np.ndarray:
    """The positive differences of two distinct parts of one tile, over every tile."""
    live = np.arange(parts.shape[1])[None, :] < used[:, None]
    gaps = parts[:, :, None].astype(np.int64) - parts[:, None, :]
    return np.unique(gaps[live[:, :, None] & live[:, None, :] & (gaps > 0)])


@dataclass(frozen=True)
class _Layout:
    """A `TileStatistic` laid out for one tiling: each pixel's and channel's local slot part.

    `per_row`: a statistic of each pixel over the channels (LayerNorm after `proj_in`): every
    pixel is its own slot, so a tile writes one partial per row (over its columns) into row `N
    tile` of the partials (`[N tiles, fields, slots]`, each slot written by the one M tile that
    holds the pixel), as the matmul template writes row statistics; the part tables are empty."""

    statistic: TileStatistic
    row_parts: np.ndarray     # [M tiles, rows] the distinct pixel parts of each M tile (0-padded)
    row_used: np.ndarray      # [M tiles] how many of them each tile has
    col_parts: np.ndarray     # [N tiles, cols]
    col_used: np.ndarray      # [N tiles]
    per_row: bool = False

    @classmethod
    def of(cls, statistic: TileStatistic, geometry: ConvGeometry, config: ConvConfig) -> "_Layout":
        table = np.asarray(statistic.slot_of, np.int64)
        if table.shape != (geometry.pixels, geometry.out_features):
            raise ValueError(f"slot table {table.shape} != (pixels, out channels) {(geometry.pixels, geometry.out_features)}")
        if not _splits_into_parts(table):
            raise NotImplementedError("the statistic's output does not split into a pixel part plus a channel part")
        rows, cols = table[:, 0] - table[0, 0], table[0, :]
        # Per row only when this host's pixels are every slot: a slot no row writes would be unset.
        if np.all(cols == cols[0]) and len(np.unique(rows)) == len(rows) == statistic.slots > MAX_ROW_SLOTS:
            none, no_parts = np.zeros(0, np.int32), np.zeros((0, 0), np.int32)
            return cls(statistic, no_parts, none, no_parts, none, per_row=True)
        if not 0 < statistic.slots <= MAX_SLOTS:
            raise NotImplementedError(f"a statistic with {statistic.slots} outputs (at most {MAX_SLOTS} per tile)")
        row_parts, row_used = _tile_distinct(rows, tile_pixels(geometry, config))
        channels = np.arange(geometry.out_features)
        col_parts, col_used = _tile_distinct(cols, [channels[i:i + config.block_n]
                                                    for i in range(0, geometry.out_features, config.block_n)])
        if row_parts.shape[1] > MAX_ROW_SLOTS:
            raise NotImplementedError(f"an output tile touches {row_parts.shape[1]} pixel parts of the statistic "
                                      f"(at most {MAX_ROW_SLOTS})")
        layout = cls(statistic, row_parts, row_used, col_parts, col_used)
        layout._check_distinct()
        return layout

    def _check_distinct(self) -> None:
        """Within a tile, distinct (pixel part, channel part) pairs are distinct slots. Two pairs of
        one M tile and one N tile collide (a + b == a' + b', a != a') exactly when a - a' == b' - b:
        a gap between two pixel parts of an M tile equal to one between two channel parts of an N
        tile; every M tile meets every N tile, so the gaps of all tiles are compared at once."""
        if np.intersect1d(_part_gaps(self.row_parts, self.row_used), _part_gaps(self.col_parts, self.col_used)).size:
            raise NotImplementedError("two pixel/channel parts of one tile name the same statistic output")

    @property
    def fields(self) -> int:
        return 3 if self.statistic.op == "moments" else 1

    @property
    def slots(self) -> int:
        return self.statistic.slots



# Larger than any slot part; the sum of two still fits int32.
_NO_PART = 1 << 29


def _distinct_parts(parts: jax.Array, valid: jax.Array, count: int) -> list[jax.Array]:
    """The `count` smallest distinct values of `parts` where `valid`, ascending, as scalars
    (`_NO_PART` past the last one): the slot parts of one tile, found in the kernel."""
    found, previous = [], None
    for _ in range(count):
        live = valid if previous is None else valid & (parts > previous)
        previous = jnp.min(jnp.where(live, parts, _NO_PART))
        found.append(previous)
    return found


def _column_parts(layout: _Layout, col_part, cols_ok) -> tuple[jax.Array, jax.Array]:
    """The channel parts of a tile's columns (`col_part` [1, bn], found by successive minima, at
    most the layout's column count: no index table is read): `part_of_rank` [cols, 1], the rank-th
    smallest part (`_NO_PART` past the last), and `in_part` [cols, bn], which column holds which."""
    n_cols = layout.col_parts.shape[1]
    cols = next_pow2(n_cols)
    col_part = jnp.broadcast_to(jnp.asarray(col_part, jnp.int32), cols_ok.shape)
    rank = _iota(cols)[:, None]                                                             # [cols, 1]
    part_of_rank = jnp.full((cols, 1), _NO_PART, jnp.int32)
    for r, part in enumerate(_distinct_parts(col_part, cols_ok, n_cols)):
        part_of_rank = jnp.where(rank == r, part, part_of_rank)
    return part_of_rank, (col_part == part_of_rank) & cols_ok


def _tile_partials(layout: _Layout, body, valid, rows_ok, row_part, column_parts) -> list[jax.Array]:
    """A tile's partial statistic of every slot (`[1, slots]` per field: a sum, or count, mean, M2).

    `row_part` [rows, 1] is each element's pixel part, `column_parts` its columns' channel parts
    (`_column_parts`; slot = row part + channel part). The tile's distinct pixel parts are found by
    successive minima (at most `MAX_ROW_SLOTS`), so no index table is read."""
    n_rows = layout.row_parts.shape[1]
    slots = next_pow2(layout.slots)
    row_part = jnp.broadcast_to(jnp.asarray(row_part, jnp.int32), rows_ok.shape)
    part_of_rank, in_part = column_parts
    slot = _iota(slots)[None, :]                                                            # [1, slots]
    body = jnp.where(valid, body, 0.0)
    fields = [jnp.zeros((1, slots), jnp.float32) for _ in range(layout.fields)]

    def per_part(column_values):  # [1, bn] -> [cols, 1]: summed over each channel part
        return jnp.sum(jnp.where(in_part, column_values, 0.0), axis=1, keepdims=True)

    for part in _distinct_parts(row_part, rows_ok, n_rows):
        rows_r = valid & (row_part == part)
        count = per_part(jnp.sum(jnp.where(rows_r, 1.0, 0.0), axis=0, keepdims=True))
        total = per_part(jnp.sum(jnp.where(rows_r, body, 0.0), axis=0, keepdims=True))
        hit = ((part + part_of_rank) == slot) & (count > 0)                                 # [cols, slots]
        if layout.statistic.op == "sum":
            parts = (total,)
        else:  # two-pass over the tile about the part's rough mean, corrected once (`piece_moments`)
            rough = total / jnp.maximum(count, 1.0)
            column_mean = jnp.sum(jnp.where(in_part, rough, 0.0), axis=0, keepdims=True)  # [1, bn]
            centred = jnp.where(rows_r, body - column_mean, 0.0)
            drift = per_part(jnp.sum(centred, axis=0, keepdims=True))
            correction = drift / jnp.maximum(count, 1.0)
            m2 = per_part(jnp.sum(centred * centred, axis=0, keepdims=True)) - drift * correction
            parts = (count, rough + correction, jnp.maximum(m2, 0.0))
        fields = [f + jnp.sum(jnp.where(hit, part, 0.0), axis=0, keepdims=True) for f, part in zip(fields, parts)]
    return fields


def _merge_fields(layout: _Layout, a: list[jax.Array], b: list[jax.Array]) -> list[jax.Array]:
    """Two parts of one tile (its rows) merged: sums added, moments by Chan's formula."""
    if layout.statistic.op == "sum":
        return [a[0] + b[0]]
    return list(chan_merge(a, b))


def _store_partials(layout: _Layout, partial_ref, fields: list[jax.Array], tile) -> None:
    """A tile's partials (`_tile_partials`) into its own row `tile` of `partial_ref`."""
    slot = _iota(next_pow2(layout.slots))[None, :]
    for f, value in enumerate(fields):
        offset = (tile * layout.fields + f) * layout.slots + slot
        ok = slot < layout.slots
        triton.store(partial_ref, jnp.where(ok, offset, partial_ref.shape[0]), value, ok)


def _write_row_partials(layout: _Layout, partial_ref, body, valid, rows_ok, slot, tile) -> None:
    """This tile's partial of each of its rows (a `per_row` layout: `slot` [bm, 1] is the row's
    slot) over its own columns, into row `tile` of `partial_ref`: a sum, or count, mean and M2
    two-pass over the row's columns. A row with no valid column writes 0, 0, 0 (an empty tile)."""
    valid = jnp.broadcast_to(valid, body.shape)
    body = jnp.where(valid, body, 0.0)
    if layout.statistic.op == "sum":
        fields = (jnp.sum(body, axis=1, keepdims=True),)
    else:
        fields = piece_moments(body, valid, 1)
    for f, value in enumerate(fields):
        offset = (tile * layout.fields + f) * layout.slots + slot
        triton.store(partial_ref, jnp.where(rows_ok, offset, partial_ref.shape[0]), value, rows_ok)


def merge_partials(partials: jax.Array, op: str) -> jax.Array:
    """A statistic from its tiles' partials (`[tiles, fields, slots]`, see `TileStatistic`): merged
    pairwise in a fixed order, Chan et al.'s formula for moments. Returns `[slots]` (sum) or
    `[2, slots]` (moments: mean, M2)."""
    parts = jnp.asarray(partials, jnp.float32)
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = jnp.concatenate([parts, jnp.zeros((1, *parts.shape[1:]), jnp.float32)])
        a, b = parts[0::2], parts[1::2]
        if op == "sum":
            parts = a + b
            continue
        n_a, mean_a, m2_a = a[:, 0], a[:, 1], a[:, 2]
        n_b, mean_b, m2_b = b[:, 0], b[:, 1], b[:, 2]
        n = n_a + n_b
        weight = n_b / jnp.maximum(n, 1.0)
        delta = mean_b - mean_a
        # The delta^2 term only where both sides hold elements: an empty side's mean is 0, not a value.
        spread = jnp.where(n_a * n_b > 0, delta * delta * (n_a * weight), 0.0)
        parts = jnp.stack([n, mean_a + delta * weight, m2_a + m2_b + spread], axis=1)
    if op == "sum":
        return parts[0, 0]
    return jnp.stack([parts[0, 1], parts[0, 2]])


# --- reference --------------------------------------------------------------------------------


def reference(lhs: jax.Array, rhs: jax.Array, params: ConvParams,
              epilogue: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """The same conv with `lax.conv_general_dilated` (fp32 accumulation), then `epilogue`."""
    acc = lax.conv_general_dilated(lhs, rhs, **params.lax_kwargs(), preferred_element_type=jnp.float32)
    return acc if epilogue is None else epilogue(acc)


# --- from a Conv term ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _RangeTerms:
    """One K range of a `Conv` term: which subexpressions produce it, at which offsets.

    `lhs` holds the range's channels from `lhs_offset`, `rhs` its in-features from `rhs_offset`;
    `rhs` is evaluated at taps counted from `taps`' first row/column (a zero-padded weight
    `pad(w1x1)` is read as `w1x1` over the one tap it covers)."""

    start: int
    channels: int
    lhs: Term
    lhs_offset: int
    rhs: Term
    rhs_offset: int
    taps: tuple[tuple[int, int], tuple[int, int]]


def _concat_bounds(expr: Term, axis: int, base: int, out: set[int]) -> None:
    while expr.op == "Concat" and expr.args[2] == axis:
        left, right, _, split, _ = expr.args
        out.add(base + split)
        _concat_bounds(left, axis, base, out)
        expr, base = right, base + split


def _descend(expr: Term, axis: int, start: int, stop: int) -> tuple[Term, int]:
    """The subexpression of concats along `axis` holding [start, stop), and where it starts in it."""
    while expr.op == "Concat" and expr.args[2] == axis:
        left, right, _, split, _ = expr.args
        if stop <= split:
            expr = left
        elif start >= split:
            expr, start, stop = right, start - split, stop - split
        else:
            break
    return expr, start


def _zero_pad_window(rhs: Term, spec: Sequence[int], window: tuple[int, int]):
    """`(inner, taps)` when `rhs` is `pad(inner, 0)` on the window axes only (no interior padding),
    else None: the taps outside `inner` multiply zeros and are skipped."""
    if rhs.op != "Pad" or rhs.args[1].op != "Lit" or float(rhs.args[1].args[0]) != 0.0:
        return None
    config = [ints(part) for part in rhs.args[2].split(";")]
    taps = []
    for axis, (lo, hi, interior) in enumerate(config):
        spatial = axis in spec[2:]
        if interior != 0 or lo < 0 or hi < 0 or (not spatial and (lo, hi) != (0, 0)):
            return None
    for i, axis in enumerate(spec[2:]):
        lo, hi, _ = config[axis]
        taps.append((lo, window[i] - hi))
    return rhs.args[0], tuple(taps)


def k_ranges(term: Term) -> list[_RangeTerms]:
    """The K ranges of a `Conv` term: its input channels split wherever the lhs or the weight is
    a concat along the feature axis; each range reads only its own parts."""
    lhs, rhs, params_key, _epilogue, _ty = term.args
    params = ConvParams.parse(params_key)
    lhs_axis, rhs_axis = params.lhs_spec[1], params.rhs_spec[1]
    channels = parse_type(lhs.ty).shape[lhs_axis]
    window = tuple(parse_type(rhs.ty).shape[a] for a in params.rhs_spec[2:])
    bounds: set[int] = {0, channels}
    _concat_bounds(lhs, lhs_axis, 0, bounds)
    _concat_bounds(rhs, rhs_axis, 0, bounds)
    edges = sorted(bounds)
    ranges = []
    for start, stop in zip(edges, edges[1:]):
        lhs_part, lhs_offset = _descend(lhs, lhs_axis, start, stop)
        rhs_part, rhs_offset = _descend(rhs, rhs_axis, start, stop)
        taps = ((0, window[0]), (0, window[1]))
        padded = _zero_pad_window(rhs_part, params.rhs_spec, window)
        if padded is not None:
            rhs_part, taps = padded
        ranges.append(_RangeTerms(start, stop - start, lhs_part, lhs_offset, rhs_part, rhs_offset, taps))
    return ranges


def _shifted(index: tuple, axis: int, offset: int) -> tuple:
    index = list(index)
    if offset:
        index[axis] = index[axis] + offset
    return tuple(index)


def _operand(expr: Term, tensors: Sequence[Term], feature_axis: int, offset: int,
             memory: type[RefMemory] = RefMemory) -> OperandFn:
    """A K-range closure: `expr` compiled, read at the range's local feature index + `offset`
    (from a `memory` over the kernel's refs: the weight's `ContiguousMemory` loads unit-stride
    runs along the output channels of a prepared HWIO copy as vectors)."""
    compiled = compile_expr(expr)

    def evaluate(refs, index, mask, hoisted=None):
        return compiled(memory(dict(zip(tensors, refs))), _shifted(index, feature_axis, offset), mask,
                        hoisted=hoisted)

    return evaluate


_ZERO_PRESERVING_VIEWS = {"Reshape": 0, "Transpose": 0, "Slice": 0, "Broadcast": 0}


def zero_where_masked(expr: Term) -> bool:
    """Whether `expr`, evaluated under a mask, is 0 at every masked lane: a tensor's load (a masked
    load reads 0) through views that pass the mask on and converts (0 stays 0). A `Pad` or `Concat`
    is not: lanes in a pad's border read its fill, whatever the mask."""
    while True:
        if expr.op in _ZERO_PRESERVING_VIEWS:
            expr = expr.args[_ZERO_PRESERVING_VIEWS[expr.op]]
        elif expr.op == "Unary" and expr.args[0] == "convert":
            expr = expr.args[1]
        else:
            return expr.op == "Load" and expr.args[0].op != "EpilogueReduce"


def _hoisted_part(expr: Term, tensors: Sequence[Term], feature_axis: int, offset: int, pixel_axis: int):
    """A K range's `hoist`: the values of `expr`'s nodes at a pixel-free index, reused at every tap
    by the nodes whose index there does not vary over the pixels (`emit.expr.CompiledExpr.hoist`)."""
    if not any(node.op in ("Unary", "Binary", "Select", "RowReduce")
               or (node.op == "Load" and node.args[0].op == "EpilogueReduce") for node in expr_nodes(expr)):
        return None  # reads only: nothing computed per (batch, channel)
    compiled = compile_expr(expr)

    def hoist(refs, index, mask):
        return compiled.hoist(RefMemory(dict(zip(tensors, refs))), _shifted(index, feature_axis, offset), mask,
                              free_axis=pixel_axis)

    return hoist


def _epilogue(expr: Term, tensors: Sequence[Term]) -> EpilogueFn:
    compiled = compile_expr(expr)

    def evaluate(refs, acc, index, mask):
        def bound(ty, acc_index, acc_mask):
            if len(acc_index) != len(index) or any(a is not b for a, b in zip(acc_index, index)):
                raise NotImplementedError("the conv epilogue reads its accumulator through a view")
            return acc.astype(parse_type(ty).dtype)

        return compiled(RefMemory(dict(zip(tensors, refs))), index, mask, bound)

    return evaluate


_THROUGH = {"Unary": (1,), "Reshape": (0,), "Transpose": (0,), "Slice": (0,), "Concat": (0, 1),
            "Binary": (1, 2), "Select": (0, 1, 2)}


def _spine_path(body: Term, producer: Term) -> list[Term] | None:
    """The nodes from a reduction body down to `Load(producer)` through views and elementwise ops
    (the spine `eqsat.cost.hosting` allows), or None when the body does not read `producer` so.
    Each `Concat` on the spine (a statistic over `concat(h, skip)`: several hosts) is replaced by
    this host's side padded to the concat's shape (`_own_side`), so the path's top is the body as
    this host computes it at the elements it writes, reading no other host's output.

    Raises `NotImplementedError` when the body reads one element of `producer` at several body
    elements (`concat(x, x * x)`): the tile would have to add each element to several slots."""
    found: list[list[Term]] = []
    stack = [[body]]
    while stack:
        path = stack.pop()
        node = path[-1]
        if node.op == "Load":
            if node.args[0] is producer:
                found.append(path)
            continue
        positions = _THROUGH.get(node.op, ())
        if node.op == "Concat":  # two sides are two reads, even of one term (`concat(x, x)`)
            stack.extend(path + [node.args[p]] for p in positions)
            continue
        children = {id(node.args[p]): node.args[p] for p in positions}  # x * x reads one element once
        stack.extend(path + [child] for child in children.values())
    if len(found) > 1:
        raise NotImplementedError("the statistic reads each element of the conv's output more than once")
    return _own_side(found[0]) if found else None


def _own_side(path: list[Term]) -> list[Term]:
    """`path` rebuilt bottom-up with each `Concat(x, y)` on it replaced by `Pad(side, 0)`, `side` its
    operand on the path, padded back to the concat's shape: equal to the concat wherever `side`
    holds the element, so elementwise ops above the concat stay in the host's part."""
    rebuilt = [path[-1]]
    for node, old in zip(reversed(path[:-1]), reversed(path[1:])):
        new = rebuilt[0]
        if node.op == "Concat":
            x, _y, axis, split, ty = node.args
            shape = parse_type(ty).shape
            lo = 0 if old is x else split
            hi = shape[axis] - lo - parse_type(old.ty).shape[axis]
            config = ";".join(f"{lo},{hi},0" if a == axis else "0,0,0" for a in range(len(shape)))
            fill = Term("Lit", 0.0, format_type(parse_type(ty).dtype, ()))
            rebuilt.insert(0, Term("Pad", new, fill, config, ty))
        else:
            rebuilt.insert(0, Term(node.op, *(new if arg is old else arg for arg in node.args)))
    return rebuilt


def _body_index(path: list[Term], index: tuple, stop: int = 0):
    """The index into `path[stop]` (default: the body) reading `Load(producer)` at `index`, and where
    it exists: the spine's views inverted, bottom-up. Plain operators only, so it runs on numpy
    tables and in kernels alike."""
    ok = True
    for level in range(len(path) - 2, stop - 1, -1):
        node, child = path[level], path[level + 1]
        op = node.op
        if op == "Reshape":
            index = reshape_index(index, parse_type(child.ty).shape, parse_type(node.ty).shape)
        elif op == "Transpose":
            permutation = ints(node.args[1])
            index = tuple(index[permutation[k]] for k in range(len(permutation)))
        elif op == "Slice":
            _, axis, start, _stop, stride, ty = node.args
            shifted = index[axis] - start
            ok = ok & (shifted >= 0) & (shifted % stride == 0) & (shifted // stride < parse_type(ty).shape[axis])
            index = index[:axis] + (shifted // stride,) + index[axis + 1:]
        elif op == "Pad":  # a concat's side (`_own_side`): shifted by its low padding
            index = tuple(entry + ints(part)[0] for entry, part in zip(index, node.args[2].split(";")))
    return index, ok


class _TileMemory:
    """Memory whose `Load(producer)` is the output tile in registers (the spine reads it at the
    element being written), every other tensor read from its ref."""

    def __init__(self, memory: RefMemory, producer: Term, tile: jax.Array):
        self.memory, self.producer, self.tile = memory, producer, tile
        self.chunk_elements = memory.chunk_elements

    def load(self, tensor, index, mask):
        if tensor is self.producer:
            return self.tile
        return self.memory.load(tensor, index, mask)


def _statistic_part(reduction: Term, term: Term) -> list[Term]:
    """The spine from the reduction's body (as this host computes it) to `Load(term)`."""
    path = _spine_path(reduction.args[2], term)
    if path is None:
        raise NotImplementedError(f"{reduction!r} does not read this conv's output at the element it writes")
    return path


def _statistic(reduction: Term, term: Term, geometry: ConvGeometry, tensors: Sequence[Term]) -> TileStatistic:
    """The part of an `EpilogueReduce` that the conv `term` computes: the elements it writes."""
    _producer, op, body, axes_key, ty = reduction.args
    path = _statistic_part(reduction, term)
    body_shape = parse_type(body.ty).shape
    reduced = set(ints(axes_key))
    kept = [a for a in range(len(body_shape)) if a not in reduced]
    kept_shape = [body_shape[a] for a in kept]
    out_h, out_w = geometry.out_size

    def output_index(m, n):
        b, oy, ox = m // (out_h * out_w), (m // out_w) % out_h, m % out_w
        return _place(geometry.params.out_spec, (b, n, oy, ox))

    def slot_at(out_index):
        """The statistic output an output element adds to (numpy on the host, index tiles in the kernel)."""
        index, _ok = _body_index(path, out_index)
        return linearize(tuple(index[a] for a in kept), kept_shape)

    # The slot of every output element, on the host (numpy): [pixels, out channels].
    pixels = np.arange(geometry.pixels)[:, None]
    channels = np.arange(geometry.out_features)[None, :]
    _index, ok = _body_index(path, output_index(pixels, channels))
    if ok is not True and not np.all(ok):
        raise NotImplementedError(f"{reduction!r} reads only part of this conv's output")
    slot_of = np.broadcast_to(slot_at(output_index(pixels, channels)), (geometry.pixels, geometry.out_features))
    # The body below its top views (GroupNorm's reshape to [batch, pixels, groups, channels]), at the
    # output's own index: a reshape evaluated at an index it then inverts again hid the unit stride
    # along the output channels from Triton, and what the body reads beside the tile (the time
    # embedding of `h + temb`) loaded 4 bytes at a time.
    top = 0
    while top < len(path) - 1 and path[top].op in ("Reshape", "Transpose"):
        top += 1
    compiled = compile_expr(path[top])

    def value(refs, out_tile, out_index, mask):
        body_index, body_ok = _body_index(path, out_index, stop=top)
        memory = _TileMemory(RefMemory(dict(zip(tensors, refs))), term, out_tile)
        body_mask = mask if body_ok is True else mask & body_ok
        return compiled(memory, body_index, body_mask).astype(jnp.float32), body_ok

    return TileStatistic(op, value, slot_of, max(1, math.prod(kept_shape)), slot_at)


def _statistic_reads(hosted: Sequence[Term], term: Term) -> list[Term]:
    """The expressions the statistics this conv hosts evaluate (their part of each body)."""
    parts = []
    for reduction in hosted:
        try:
            path = _statistic_part(reduction, term)
        except NotImplementedError:
            continue
        parts.append(path[0])
    return parts


def run(term: Term, operands: Mapping[Term, jax.Array], *, hosted: Sequence[Term] = (),
        prefixes: Mapping[Term, jax.Array] | None = None, config: ConvConfig | None = None,
        interpret: bool = False, name: str = "conv", skip_unsupported: bool = False):
    """The output of the `Conv` kernel `term`, the tensors it reads bound by `operands`.

    With `hosted` (`EpilogueReduce` terms this conv computes in its epilogue) returns `(output,
    {reduction: partials})`: per-tile partials of the elements this conv writes (`TileStatistic`;
    readers merge them, `emit.expr.read_partials`), after the earlier hosts' partials of that
    statistic in `prefixes` (a statistic over `concat(h, skip)`). A statistic the template cannot
    compute raises `NotImplementedError`, or with `skip_unsupported` is left out of the dict."""
    if term.op != "Conv":
        raise ValueError(f"the conv template emits Conv kernels, not {term.op}")
    lhs, rhs, params_key, epilogue, ty = term.args
    params = ConvParams.parse(params_key)
    geometry = ConvGeometry(params, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape, parse_type(ty).shape)
    tensors = loaded_tensors(lhs, rhs, epilogue, *_statistic_reads(hosted, term))
    tensors = [t for t in tensors if t is not term]  # the statistics read the output from registers
    # Index tiles are [pixels, channels]: a node whose index has length 1 on axis 0 is per (batch, channel).
    ranges = [KRange(part.channels, _operand(part.lhs, tensors, params.lhs_spec[1], part.lhs_offset),
                     _operand(part.rhs, tensors, params.rhs_spec[1], part.rhs_offset, ContiguousMemory), part.taps,
                     _hoisted_part(part.lhs, tensors, params.lhs_spec[1], part.lhs_offset, pixel_axis=0),
                     zero_where_masked(part.lhs), zero_where_masked(part.rhs))
              for part in k_ranges(term)]
    config = config or conv_choice.conv_config(geometry, ranges, dot_itemsize(lhs.ty, rhs.ty))
    statistics, computed = [], []
    for reduction in hosted:
        try:
            statistic = _statistic(reduction, term, geometry, tensors)
            _Layout.of(statistic, geometry, config)
        except NotImplementedError:
            if not skip_unsupported:
                raise
            continue
        statistics.append(statistic)
        computed.append(reduction)
    dot_dtype = jnp.promote_types(parse_type(lhs.ty).dtype, parse_type(rhs.ty).dtype)
    prefixes = prefixes or {}
    result = build(geometry, ranges, _epilogue(epilogue, tensors), [operands[t] for t in tensors],
                   parse_type(ty).dtype, statistics=statistics, prefixes=[prefixes.get(r) for r in computed],
                   config=config, dot_dtype=dot_dtype, interpret=interpret, name=name)
    if not hosted:
        return result
    if not statistics:
        return result, {}
    out, partials = result
    return out, dict(zip(computed, partials))


def emit(kernel, ctx) -> dict:
    """Emit a `Conv` kernel (`emit.pallas.KernelCall`) in an `emit.pallas.EmitContext`: returns
    `{kernel.term: output}` plus, for each hosted statistic (`EpilogueReduce`) it computes, its
    partials (`emit.pallas.partials.Partials`): those of the hosts run before it (GroupNorm over
    `concat(h, skip)`, `ctx.pending`) followed by its own tiles. Readers merge them. A statistic
    this template cannot compute is left to the driver (its own kernel)."""
    term = kernel.term
    hosted = list(kernel.hosted)
    reads = loaded_tensors(term.args[0], term.args[1], term.args[3], *_statistic_reads(hosted, term))
    operands = {t: ctx.operand(t) for t in reads if t is not term}
    if not hosted:
        return {term: run(term, operands, interpret=ctx.interpret, name=kernel.name)}
    prefixes = {r: ctx.pending[r] for r in hosted if ctx.pending.get(r) is not None}
    out, partials = run(term, operands, hosted=hosted, prefixes=prefixes, interpret=ctx.interpret,
                        name=kernel.name, skip_unsupported=True)
    return {term: out, **{reduction: Partials(buffer) for reduction, buffer in partials.items()}}
