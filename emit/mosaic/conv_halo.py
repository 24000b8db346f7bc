"""The haloed Mosaic GPU conv: a plan's `Conv` whose inputs are read as the plan has them (NHWC, unpadded)
and whose input expressions (a GroupNorm apply + SiLU from hosted statistics, any elementwise
expression of an input and per-channel vectors) are evaluated inside the kernel, once per staged
input element, so no XLA fusion lays out, concatenates, upsamples or normalizes the input.

    HaloGrid      the flat padded grid of one image and what a CTA stages (`eqsat.tiling.mosaic`)
    PartPlan      one K range as the kernel runs it: its input, channel offset, taps, vectors
    build         the kernel over the raw inputs, the weight as it lies (`layout_weight`), a row mask
    emit          a plan's `Conv` kernel as this template, or `HaloUncovered` (then `emit.mosaic.conv`'s
                  flat-grid template runs it)

K ranges (`eqsat.tiling.mosaic.halo_parts`): the conv's K ranges (`emit.pallas.conv.k_ranges`: a
top-level `concat(h, skip)`, a merged 1x1 shortcut over the centre tap), each cut again where a
concat *inside* its expression switches tensors (`eqsat.tiling.channel_parts`: GroupNorm + SiLU over
`concat(h, skip)` is that expression over h's channels, then over skip's; a concat inside a group,
1920 = 1280 + 640 in groups of 60, is cut after `distribute_reshapes`, the straddling group's
statistics read per channel). Each range stages its own tensor (from a channel offset) with its own
prologue and vectors, one after the other through the same staging slots, weight ring and
accumulator.

The kernel is loops, not unrolled code (what Mosaic traces, lays out and compiles grows with the
ops written, not with those run): one loop over every range's chunks (a chunk's range, window and
first step are values computed from its index; each range's staging and prologue run under a
`pl.when` of it), in it a loop over a chunk's staged-row copies, one over its prologue slabs and
one over its taps (stride 2: over the window's rows, a row's taps unrolled, each picking its
pairs' element statically). Every body is written once, whatever the ranges, rows, slabs and taps.
Convs whose kernels are equal up to their names launch one jitted function (`emit.mosaic.kernel_cache`):
one Mosaic module for them.

One CTA (one compute warpgroup) owns `tile_m` rows `[q0, q0 + tile_m)` of one image's flat padded
grid (pitch `Wp = px0 + W + px1`; output pixel `(oy, ox)` is row `oy * Wp + ox`, tap `(ky, kx)` reads
padded row `q + ky * Wp + kx`) and `tile_n` output channels. Per K range, per 64-channel chunk:

1. TMA: each padded row `r0 + i` the CTA needs (`staged_rows` of them, its rows and the halo) is
   one `[W, 64]` copy from the range's input into a staging buffer at SMEM row `i * Wp + px0`, so
   SMEM holds the chunk on the padded grid; rows in the padding copy a clamped input row. Two
   staging slots: the next chunk (of this range or the next) arrives while this one computes.
2. Prologue: 64-row slabs of the staging are loaded into registers (the WGMMA layout), the range's
   input expression is applied (its per-channel operands arrive by TMA as 64-vectors: gamma and
   beta as they lie when one range reads only such views; otherwise every range's vectors, a
   GroupNorm's per-group statistics gathered per channel, are one small float32 table, written by
   the Triton kernel that finishes a statistic it gathers: `emit.pallas.tables`), padding is
   zeroed after it by a host-computed row mask (so a tap in the padding reads 0, not prologue(0)),
   and the slab is stored back in place.
3. Taps: for each tap of the range, `tile_m` staged rows from `q0 - r0 * Wp + ky * Wp + kx` (any
   row: no 8-row SMEM tile alignment, no shifted copies of the input) are copied through registers
   into a swizzled A tile (two slots), and wgmma multiplies it with the step's `[64, tile_n]` weight
   tile from a 3-slot TMA ring, one MMA kept in flight. (wgmma could take A from registers and skip
   the copy; GPU interpret mode has no wgmma with a register A, and the tests run there.)

A 3x3 conv over a nearest-2x upsample (`eqsat.tiling.mosaic.upsample_source`) runs in its *phase
form*: a conv over the source (a quarter of the staged rows, no upsampled copy) with N = 4 phases
`(py, px)` of Cout outputs; a CTA's N tile lies in one phase, which runs a 2x2 window at source
offsets `(py + a, px + b)` of the 3x3 halo with weights summing the taps that read that pixel
(`phase_weights`): 4 of the 9 taps, so an inf the phase never reads never meets a zero weight. Its
stores interleave the phases (below; on flat rows `unflatten_phases` does, depth-to-space).

Stride 2 (the UNet's downsamplers): the staging holds the padded input rows in two *row phases*
(padded rows `2j`, then `2j + 1`, `phase_rows` apart; pitch `Wp` rounded up to even), output pixel
`(oy, ox)` is flat row `oy * Wp/2 + ox`, and tap `(ky, kx)` takes every other staged row from row
phase `ky % 2` at `(oy - oy0 + ky // 2) * Wp + 2 * ox + kx`: rows of a `[staging / 2, 2, 64]` view
of the staging (Mosaic lowers a reshaped SMEM ref sliced so as a strided load; a strided slice of
the 2-D ref is refused, "Strided slices not implemented"), the pairs' element `kx % 2`. No phase
copies of the input, any width (odd too).

Rows too wide to stage (`HaloGrid.strips`, `eqsat.tiling.mosaic.halo_tiling`: the VAE's 256 and 512
pixels, over a TMA box or SMEM) run in column strips: strip s is a grid of its own (pitch
`strip_width + kw - 1`) over the padded columns `[s * strip_width, + pitch)`, its halo columns
copied from its neighbours' pixels; an edge strip copies only the columns inside the image (one of
three static copy shapes, by the strip's index), the row mask zeroes the rest.

Each input element is computed once per (CTA, output-channel tile): halo rows twice where two CTAs
stage them (`staging / tile_m` evaluations per output row). The epilogue is the matmul's
(`emit.mosaic.matmul`: operands mapped onto the flat rows on the host, TMA'd per 64 x 64 sub-tile).
The weight is read as it lies (`[ky, kx, in]` rows: a view of the weight `emit.prepare` lays out
K x N; each step's 64 rows found by index arithmetic); the inputs are read by the kernel itself.

The output leaves in the conv's own NHWC layout (`stores_pixels`: an NHWC output whose channels the
N tiles divide; else flat rows that `unflatten` slices, one XLA fusion): per 64 x 64 sub-tile, the
flat rows are cut into pixel-row segments (the pixels of one output row the sub-tile holds: a tile
may start and end mid-row, the padding columns between rows are in none), and each segment is
stored from the unswizzled SMEM sub-tile by TMA copies of static sizes (`row_pieces`: one copy
where every sub-tile's segment in that row has the same length, else one per bit of the length,
1, 2, 4, ... rows, each predicated on its bit (under `pl.when` of it in GPU interpret mode, which
has no predicated copy); `segments` computes rows and offsets from the
sub-tile's start), one bulk group per sub-tile. Every pixel is stored once, by the CTA that owns
its flat row (no races, no store past an array's end: GPU interpret mode drops a partly
out-of-bounds store whole, so nothing relies on TMA's clipping). A tile operand the epilogue reads
at the output's own index (a residual) comes in the same segments into an unswizzled SMEM tile
(`pixel_operands`: a `pixel` operand, the tensor itself; one barrier per copy, waited where it was
issued), no gather onto the flat rows; rows off the output hold stale values that are never
stored (the statistics mask them by the row-image table). The phase form's CTAs store phase
`(py, px)` at output pixels `(2i + py, 2j + px)` of a `[B·h, 2, w, 2·C]` view (`PixelView`): no
depth-to-space fusion. Stride 2 and strips cut their flat rows the same way (output pitch, a
strip's columns).
Hosted GroupNorm statistics: each CTA writes its partial row (`emit.mosaic.partials`); where the
driver asks (`emit`'s `finished`), the CTA that completes last then merges every row and writes the
finished statistic (`finish_statistics`, `emit.mosaic.finish`: a ticket counter aliased in and out,
so the kernel is `finish.counter_kernel` there).
Tiles: `eqsat.tiling.mosaic.halo_blocks` (64 or 128 rows and columns, smaller where the CTAs would
not fill the SMs) with the fewest strips that fit (`halo_tiling`).

Covers (`HaloUncovered` otherwise): stride 1 or 2, no dilation, windows up to 3x3, an NHWC input, K
ranges of a multiple of 64 channels each (TMA reads 64-channel chunks of halves), rows of at most
256 pixels or (stride 1) strips of them whose staged chunks fit SMEM, expressions that read one
tensor at their own index (from a channel offset) and otherwise only per-channel (and per-image)
vectors, concats anywhere in the expression's channels (`eqsat.tiling.channel_parts`), and for the
phase form Cout a multiple of 64. Not: fewer than 64 channels (conv_in's 4), strides of 3 or more.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from emit import expr as ex
from emit.mosaic import finish, kernel_cache
from emit.mosaic import matmul as mm
from emit.mosaic.partials import _as_column_vector, group_partials, merge_partials, write_group_partials
from emit.pallas.conv import ConvGeometry, _place
from eqsat.tiling.mosaic import (CHUNK, NHWC, PHASE_OFFSET, PROLOGUE_OPS, HaloGrid, MosaicBlocks, PixelView,
                                 halo_conv_uncovered, halo_parts, halo_tiling, halo_uncovered, phase_blocks,
                                 phase_geometry, pixel_view, row_pieces, segment_geometry, stores_pixels, tap_list,
                                 upsample_source)
from eqsat.types import parse_type


BARRIER_GROUP = 32  # barriers one `plgpu.Barrier` may hold ("Only up to 32 barriers per group supported")


class HaloUncovered(NotImplementedError):
    """A conv the haloed template does not take: `emit.mosaic.conv` runs its flat-grid template."""


# --- host side: the row mask and the prologue's operands ----------------------------------------------


def row_mask(grid: HaloGrid) -> np.ndarray:
    """`[strips · m_tiles, staging]` float16: 1 where CTA m's staged row holds an input pixel, 0 in
    the padding (and past its staged rows, and outside the image's columns in an edge strip)."""
    h, wp, stride = grid.geometry.in_size[0], grid.pitch, grid.stride
    (py0, _), _ = grid.geometry.params.padding
    j = np.arange(grid.staging)
    first = (np.arange(grid.m_tiles) * grid.tile_m) // grid.out_pitch  # the CTA's first output row
    phase, local = j // grid.phase_rows, j % grid.phase_rows  # stride 2: row phases one after the other
    yp, xp = stride * (first[:, None] + local[None, :] // wp) + phase, local % wp
    masks = []
    for strip in range(grid.strips):
        _start, columns, at = grid.strip_columns(strip)
        inside = (j < grid.row_copies * wp) & (xp >= at) & (xp < at + columns)
        masks.append(inside & (yp >= py0) & (yp < py0 + h))
    return np.concatenate(masks).astype(np.float16)


class _Recording:
    """The host pass over the input expression: each `Load` (tensor, NumPy index) in the order the
    expression compiler meets them; values are scalars."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self):
        self.loads = []

    def load(self, tensor, index, mask):
        if any(not (ex.is_static(e) or isinstance(e, np.ndarray)) for e in index):
            raise HaloUncovered(f"the input expression reads {tensor!r} at an index computed on the device")
        self.loads.append((tensor, tuple(index)))
        return jnp.zeros((), parse_type(tensor.ty).dtype)


@dataclasses.dataclass
class PartLoads:
    """What one K range's input expression reads, from types alone (`prologue_loads`): `tensors` and
    `sources` per `Load` in the compiler's order (`"input"` or the index of a vector), the `staged`
    tensor and its first channel `offset` there, per vector its tensor and `[B', C]` flat `index`
    into it, and whether that is a view of the tensor (`in_place`: read as it lies)."""

    tensors: list
    sources: list
    staged: Any
    offset: int
    vector_tensors: list
    indices: list
    in_place: list


@dataclasses.dataclass
class PartSources:
    """`PartLoads` with their values (`prologue_sources`): the staged input `x` (NHWC) and the
    per-channel `vectors` (`[B', C]` each)."""

    tensors: list
    sources: list
    x: Any
    offset: int
    vectors: list
    in_place: list


def prologue_loads(expr, lhs_shape: Sequence[int]) -> PartLoads:
    """The loads of the input expression `expr` (type `lhs_shape`, NHWC) in the compiler's order: one
    tensor read at the expression's own index, from a constant channel offset (the kernel stages it
    by TMA: the input, a `[B, H·W, C]` tensor whose reshape it is, one side of a concat), or vectors
    that depend on the image and the channel only (a GroupNorm's statistics per channel, gamma,
    beta; one image's row when none depends on the image)."""
    missing = sorted({node.op for node in ex.expr_nodes(expr)} - PROLOGUE_OPS)
    if missing:
        raise HaloUncovered(f"an input expression with {', '.join(missing)}")
    shape = tuple(lhs_shape)
    batch, height, width, channels = shape
    index = tuple(np.arange(n).reshape([n if a == d else 1 for a in range(4)]) for d, n in enumerate(shape))
    memory = _Recording()
    ex.compile_expr(expr)(memory, index, True)
    loads = PartLoads([], [], None, 0, [], [], [])
    for tensor, at in memory.loads:
        tshape = parse_type(tensor.ty).shape
        flat = np.broadcast_to(np.asarray(ex.linearize(at, tshape), np.int64), shape)
        size = int(np.prod(tshape))
        depth = size // (batch * height * width) if size % (batch * height * width) == 0 else 0
        offset = int(flat[0, 0, 0, 0])
        rows = np.arange(batch * height * width).reshape(batch, height, width, 1) * depth
        if (depth >= channels and parse_type(tensor.ty).dtype == parse_type(expr.ty).dtype
                and np.array_equal(flat, rows + offset + np.arange(channels))):
            if loads.staged is not None and (loads.staged, loads.offset) != (tensor, offset):
                raise HaloUncovered("an input expression that reads two tensors at its own index")
            if offset % 8 or offset + channels > depth:
                raise HaloUncovered(f"an input read from channel {offset} (TMA needs 16-byte aligned rows)")
            loads.staged, loads.offset = tensor, offset
            loads.sources.append("input")  # the input, a view of it, or a side of a concat read from `offset`
        elif np.array_equal(flat, np.broadcast_to(flat[:, :1, :1, :], shape)):
            dtype = jnp.dtype(parse_type(tensor.ty).dtype)
            if dtype.itemsize not in (2, 4) or dtype.kind != "f":
                raise HaloUncovered(f"a per-channel operand of dtype {dtype}")
            table = flat[:, 0, 0, :]
            by_image = batch > 1 and not np.array_equal(table, np.broadcast_to(table[:1], table.shape))
            table = table if by_image else table[:1]
            loads.vector_tensors.append(tensor)
            loads.indices.append(table)
            loads.in_place.append(table.size == size and np.array_equal(table.reshape(-1), np.arange(size)))
            loads.sources.append(len(loads.indices) - 1)
        else:
            raise HaloUncovered(f"the input expression reads {tensor!r} other than at the input's own index or "
                                "per channel")
        loads.tensors.append(tensor)
    if loads.staged is None:
        raise HaloUncovered("an input expression that reads no input tensor at its own index")
    return loads


def prologue_sources(expr, lhs_shape: Sequence[int], values, loads: PartLoads | None = None) -> PartSources:
    """`prologue_loads` of `expr` (`loads` where known) with their values (`values(tensor)`)."""
    loads = loads if loads is not None else prologue_loads(expr, lhs_shape)
    batch, height, width, _channels = lhs_shape
    vectors = []
    for tensor, index, view in zip(loads.vector_tensors, loads.indices, loads.in_place):
        value = jnp.reshape(values(tensor), (-1,))
        vectors.append(value.reshape(index.shape) if view else value[index])
    x = jnp.reshape(values(loads.staged), (batch, height, width, -1))  # a view: the same elements in order
    return PartSources(loads.tensors, loads.sources, x, loads.offset, vectors, loads.in_place)


def table_rows(parts: Sequence[PartLoads]) -> tuple[tuple, list] | None:
    """`(shape, rows)` of the one float32 table `vector_tables` gathers for these parts: `[B', R, W]`
    and per row its `(tensor, [B'_r, C_r] flat index)` (broadcast over the images, zero past C_r);
    None where the parts read no table (one part reading only views, or no vectors)."""
    if len(parts) == 1 and all(parts[0].in_place):
        return None
    rows = [(t, index) for part in parts for t, index in zip(part.vector_tensors, part.indices)]
    if not rows:
        return None
    return (max(i.shape[0] for _t, i in rows), len(rows), max(i.shape[1] for _t, i in rows)), rows


def vector_tables(parts: Sequence[PartSources], table=None) -> tuple[list, list]:
    """`(tables, copies)`: the `[B', R, C]` arrays the kernel reads the parts' vectors from, and per
    part its `(table, first row, rows)` copies per chunk. One part whose vectors are all views of
    their tensors reads each in place (a table each); otherwise every vector of every part is
    gathered into one float32 table (`table_rows`): `table` where a Triton kernel wrote it
    (`emit.pallas.tables`: the kernel finishing a statistic it reads), else one small XLA fusion."""
    if len(parts) == 1 and all(parts[0].in_place):
        return [v[:, None, :] for v in parts[0].vectors], [tuple((t, 0, 1) for t in range(len(parts[0].vectors)))]
    rows = [v for part in parts for v in part.vectors]
    if not rows:
        return [], [() for _ in parts]
    if table is None:
        images = max(v.shape[0] for v in rows)
        width = max(v.shape[1] for v in rows)
        table = jnp.stack([jnp.pad(jnp.broadcast_to(v, (images, v.shape[1])).astype(jnp.float32),
                                   ((0, 0), (0, width - v.shape[1]))) for v in rows], axis=1)
    copies, first = [], 0
    for part in parts:
        copies.append(((0, first, len(part.vectors)),) if part.vectors else ())
        first += len(part.vectors)
    return [table], copies


class _SlabMemory:
    """The in-kernel pass: the n-th `Load` is the staged input slab or a per-channel vector
    broadcast over the slab, in the order the host met them."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self, tensors, tiles):
        self.tensors, self.tiles, self.cursor = tensors, tiles, 0

    def load(self, tensor, index, mask):
        if self.cursor >= len(self.tensors) or self.tensors[self.cursor] is not tensor:
            raise AssertionError(f"the input expression's loads in the kernel differ from the host's at {tensor!r}")
        self.cursor += 1
        return self.tiles[self.cursor - 1].astype(parse_type(tensor.ty).dtype)  # a float32 table's row


def slab_prologue(expr, tensors, sources):
    """(input slab [64, 64], vector tiles [64, 64] each) -> the input expression on the slab."""
    compiled = ex.compile_expr(expr)
    index = _place(NHWC, (np.zeros((1, 1), np.int64), np.arange(CHUNK).reshape(1, CHUNK), np.zeros((1, 1), np.int64),
                          np.arange(64).reshape(64, 1)))

    def prologue(slab, vector_tiles):
        memory = _SlabMemory(tensors, [slab if s == "input" else vector_tiles[s] for s in sources])
        value = compiled(memory, index, True)
        if memory.cursor != len(tensors):
            raise AssertionError("the input expression's loads in the kernel differ from the host's")
        return jnp.broadcast_to(value, slab.shape)

    return prologue


# --- the kernel ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """One K range as the kernel runs it: `chunks` 64-channel chunks of its input from channel
    `offset`, the window `taps` `((y0, y1), (x0, x1))` it multiplies, the `(table, first row, rows)`
    vector copies its prologue reads per chunk; `first_chunk` and `first_step` count the chunks and
    (chunk, tap) steps of the ranges before it; `weight_channel` is its first input channel in the
    conv's weight (read as it lies: `[ky, kx, in]` rows)."""

    chunks: int
    taps: tuple
    offset: int = 0
    vectors: tuple = ()
    first_chunk: int = 0
    first_step: int = 0
    weight_channel: int = 0

    @property
    def tap_list(self) -> list[tuple[int, int]]:
        return tap_list(self.taps)

    @property
    def steps(self) -> int:
        return self.chunks * len(self.tap_list)


def plan_parts(parts: Sequence[tuple]) -> tuple[PartPlan, ...]:
    """`PartPlan`s of K ranges `(channels, taps, offset, vector copies[, first weight channel])`, run
    in order (the weight channels default to the ranges side by side)."""
    out, chunk, step, channel = [], 0, 0, 0
    for channels, taps, offset, vectors, *weight_channel in parts:
        if channels % CHUNK:
            raise HaloUncovered(f"a K range of {channels} channels (TMA reads 64-channel chunks)")
        first = weight_channel[0] if weight_channel else channel
        plan = PartPlan(channels // CHUNK, tuple(map(tuple, taps)), offset, tuple(vectors), chunk, step, first)
        channel = first + channels
        out.append(plan)
        chunk, step = chunk + plan.chunks, step + plan.steps
    return tuple(out)


def segments(window, pieces: Sequence, segment: tuple[int, int, int], epi_m: int) -> list[tuple]:
    """`(taken, SMEM row, view row, view column, rows)` of each TMA copy moving the `epi_m` flat rows
    from a strip's flat row `window` (an int32 scalar) as pixel-row segments: `pieces` the
    `row_pieces` (static sizes), `segment` the `segment_geometry`; `taken` None where every window
    copies the piece, else whether this one's segment length has that bit. Rows of the window off
    the output (padding columns, rows past the image) are in none."""
    pitch, width, rows = segment
    first = lax.div(window, pitch)
    out = []
    for r, piece in enumerate(pieces):
        oy = first + r
        start = jnp.maximum(window, oy * pitch)
        length = jnp.where(oy < rows, jnp.maximum(jnp.minimum(window + epi_m, oy * pitch + width) - start, 0), 0)
        for size in piece.sizes:
            if piece.conditional:  # after the larger pieces of this length
                at = start + jnp.bitwise_and(length, -2 * size)
                out.append((jnp.bitwise_and(length, size) != 0, at - window, oy, at - oy * pitch, size))
            else:
                out.append((None, start - window, oy, start - oy * pitch, size))
    return out


def _kernel(*refs, grid: HaloGrid, blocks: MosaicBlocks, parts: tuple[PartPlan, ...], n_vectors: int,
            vector_shared: tuple[bool, ...], vector_rows: tuple[int, ...], kinds: tuple[str, ...],
            operand_shared: tuple[bool, ...], prologues, epilogue, interpreted: bool, m_padded: int,
            weight_window: tuple[int, int], weight_channels: int, phase_cols: int | None = None,
            statistics: tuple = (), n_tiles: int = 1, view: PixelView | None = None, pieces: tuple = (),
            segment: tuple = (), finish_grid: tuple = (), table_plans: tuple = (), n_sources: int = 0):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x_gmems = refs[:len(parts)]
    w_gmem, mask_gmem = refs[len(parts):len(parts) + 2]
    refs = refs[len(parts) + 2:]
    vector_gmems = refs[:n_vectors]
    operand_gmems = refs[n_vectors:n_vectors + len(kinds)]
    refs = refs[n_vectors + len(kinds):]
    source_gmems, refs = refs[:n_sources], refs[n_sources:]  # the tables' other tensors, flat (`emit.mosaic.finish`)
    counter = None
    if finish_grid and not interpreted:  # the ticket counter (`emit.mosaic.finish`), an aliased input
        counter, refs = refs[0], refs[1:]
    out_gmem, *refs = refs
    partial_gmems, refs = refs[:len(statistics)], refs[len(statistics):]
    finished_gmems, table_gmems = refs[:len(refs) - len(table_plans)], refs[len(refs) - len(table_plans):]
    g = grid.geometry
    (height, _), wp = g.in_size, grid.pitch
    (py0, _), (px0, _) = g.params.padding
    steps = sum(part.steps for part in parts)
    tile_m, tile_n, stages = blocks.tile_m, blocks.tile_n, blocks.stages
    epi_m, epi_n = blocks.epi_m, blocks.epi_n
    dtype, out_dtype = x_gmems[0].dtype, out_gmem.dtype
    n_idx, m_idx, b_idx = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("b")
    strip = lax.div(m_idx, grid.m_tiles)  # a strip of the columns (`HaloGrid.strips`), rows in it:
    q0 = lax.rem(m_idx, grid.m_tiles) * tile_m
    first_row = lax.div(q0, grid.out_pitch)  # the CTA's first output row
    a_offset = q0 - first_row * grid.out_pitch  # its first flat row's column there
    phase = lax.div(n_idx * tile_n, phase_cols) if phase_cols else 0  # the phase form: this CTA's (py, px)
    if phase_cols:  # its taps (a, b) read source offsets (py + a, px + b) of the 3x3 halo
        a_offset = a_offset + lax.div(phase, 2) * wp + lax.rem(phase, 2)

    def load(ref, layout):
        # GPU interpret mode has no `plgpu.load` of a sliced ref; layouts are the compiler's business
        return ref[...] if interpreted else plgpu.load(ref, (), layout=layout)

    def operand_smem(kind, dt):
        if kind == "pixel":  # rows land at any SMEM row (one TMA copy per pixel-row segment): unswizzled
            return plgpu.SMEM((epi_m, epi_n), dt)
        if kind == "tile":
            return plgpu.SMEM((epi_m, epi_n), dt, transforms=mm._swizzled(epi_n, dt))
        return plgpu.SMEM((epi_m if kind == "row" else epi_n,), dt)

    def when(taken, action):
        if taken is None:
            action()
        else:
            pl.when(taken)(action)

    def pixel_at(gmem, oy, x, size, col):
        """The `[size, epi_n]` view box of pixels `x..` of output row `oy` (of this CTA's image, strip
        and phase), output columns `col..` (the phase form: of this CTA's phase)."""
        if phase_cols:
            row_phase, col = lax.div(phase, 2), lax.rem(phase, 2) * phase_cols + col - phase * phase_cols
        else:
            row_phase = 0
        return gmem.at[b_idx * view.rows + oy, row_phase, pl.ds(strip * grid.strip_width + x, size), pl.ds(col, epi_n)]

    def _body(staged, ring, a_tiles, mask_smem, vector_smems, out_smem, operand_smems, staged_barriers,
              ring_barriers, mask_barrier, operand_barriers, group_smems, pixel_barriers, acc_ref):

        def pixel_barrier(i):  # one per pixel operand's copy: each arrives or not, by its segment
            return pixel_barriers[i // BARRIER_GROUP].at[i % BARRIER_GROUP]

        def copy_rows(p, channels, slot, barrier, start, columns, at):
            for phase in range(grid.stride):  # stride 2: padded rows 2j, then 2j + 1
                @pl.loop(0, grid.staged_rows)
                def _row(i, phase=phase):
                    y = grid.stride * (first_row + i) + phase - py0
                    y = jnp.clip(y, 0, height - 1)  # padding rows: any row, masked later
                    plgpu.copy_gmem_to_smem(x_gmems[p].at[b_idx, y, pl.ds(start, columns), channels],
                                            staged.at[slot, pl.ds(phase * grid.phase_rows + i * wp + at, columns)],
                                            barrier)

        def stage(p, chunk, slot):
            part, barrier = parts[p], staged_barriers[p].at[slot]
            channels = pl.ds(part.offset + chunk * CHUNK, CHUNK)
            if grid.strips == 1:
                copy_rows(p, channels, slot, barrier, *grid.strip_columns(0))
            else:  # an edge strip copies the columns inside the image; an inner one all its pitch
                for edge in (0, grid.strips - 1):
                    pl.when(strip == edge)(lambda edge=edge: copy_rows(p, channels, slot, barrier,
                                                                       *grid.strip_columns(edge)))
                if grid.strips > 2:
                    inner = strip * grid.strip_width - px0
                    pl.when((strip > 0) & (strip < grid.strips - 1))(
                        lambda: copy_rows(p, channels, slot, barrier, inner, wp, 0))
            for table, row, rows in part.vectors:
                plgpu.copy_gmem_to_smem(
                    vector_gmems[table].at[0 if vector_shared[table] else b_idx, pl.ds(row, rows),
                                           pl.ds(chunk * CHUNK, CHUNK)],
                    vector_smems[table].at[slot, pl.ds(0, rows)], barrier)

        def tap_rows(slot, ky, kx):
            """The `[tile_m, 64]` staged rows tap (ky, kx) multiplies."""
            if grid.stride == 1:
                return load(staged.at[slot, pl.ds(a_offset + ky * wp + kx, tile_m)], plgpu.Layout.WGMMA)
            # every other staged row from (ky % 2) * phase_rows + 2 * a_offset + ky // 2 * wp + kx: rows
            # `row` .. of the staging viewed as [staging / 2, 2, 64] pairs, the pairs' element kx % 2
            row = (ky % 2) * grid.phase_rows // 2 + a_offset + (ky // 2) * wp // 2 + kx // 2
            if interpreted:  # GPU interpret mode has no reshaped ref: the value's pairs
                pairs = staged[slot, pl.ds(2 * row, 2 * tile_m)]
                return pairs.reshape(tile_m, 2, CHUNK)[:, kx % 2]
            view = staged.reshape(2, grid.staging // 2, 2, CHUNK)
            return plgpu.load(view.at[slot, pl.ds(row, tile_m), kx % 2, :], (), layout=plgpu.Layout.WGMMA)

        def weight_row(part, step):
            (y0, y1), (x0, x1) = part.taps
            local = step - part.first_step
            tap, chunk = lax.rem(local, (y1 - y0) * (x1 - x0)), lax.div(local, (y1 - y0) * (x1 - x0))
            ky, kx = y0 + lax.div(tap, x1 - x0), x0 + lax.rem(tap, x1 - x0)
            return (ky * weight_window[1] + kx) * weight_channels + part.weight_channel + chunk * CHUNK

        def fetch_weights(step):  # the weight as it lies, [ky, kx, in] rows (per phase in the phase form)
            slot = lax.rem(step, stages)
            rows, cols = weight_row(parts[0], step), n_idx * tile_n
            for part in parts[1:]:
                rows = lax.select(step >= part.first_step, weight_row(part, step), rows)
            if phase_cols:
                rows, cols = rows + phase * (weight_window[0] * weight_window[1] * weight_channels), cols - phase * phase_cols
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(rows, CHUNK), pl.ds(cols, tile_n)], ring.at[slot],
                                    ring_barriers.at[slot])

        plgpu.copy_gmem_to_smem(mask_gmem.at[m_idx], mask_smem, mask_barrier)
        stage(0, 0, 0)
        for step in range(min(stages - 1, steps)):
            fetch_weights(jnp.int32(step))
        plgpu.barrier_wait(mask_barrier)

        chunks = sum(part.chunks for part in parts)
        windows = [(y0, y1 - y0, x0, x1 - x0) for (y0, y1), (x0, x1) in (part.taps for part in parts)]

        def part_of(chunk):
            """The index of the K range a (global) chunk belongs to."""
            index = 0
            for part in parts[1:]:
                index = index + (chunk >= part.first_chunk).astype(jnp.int32)
            return index

        def of_part(index, values):
            """`values[index]` for a static list over the K ranges."""
            if all(v == values[0] for v in values):
                return values[0]
            value = jnp.int32(values[0])
            for q in range(1, len(values)):
                value = jnp.where(index >= q, values[q], value)
            return value

        def on_part(index, q, action):
            if len(parts) == 1:
                action()
            else:
                pl.when(index == q)(action)

        # One loop over every K range's chunks, one tap loop: the ranges differ in their staged
        # input, prologue and window (dynamic values here), not in the code that runs their taps.
        @pl.loop(0, chunks)
        def _chunk(chunk):
            slot = lax.rem(chunk, 2)
            index = part_of(chunk)

            @pl.when(chunk + 1 < chunks)
            def _prefetch():
                following = part_of(chunk + 1)
                for q, part in enumerate(parts):
                    on_part(following, q, functools.partial(stage, q, chunk + 1 - part.first_chunk, 1 - slot))

            def prologue(q, part):
                plgpu.barrier_wait(staged_barriers[q].at[slot])
                vectors = [lax.broadcast_in_dim(load(vector_smems[table].at[slot, r], plgpu.Layout.WGMMA.reduce(0)),
                                                (64, CHUNK), (1,))
                           for table, _row, rows in part.vectors for r in range(rows)]

                @pl.loop(0, grid.staging // 64)
                def _slab(s):
                    rows = staged.at[slot, pl.ds(s * 64, 64)]
                    mask = lax.broadcast_in_dim(load(mask_smem.at[s], plgpu.Layout.WGMMA.reduce(1)),
                                                (64, CHUNK), (0,))
                    value = prologues[q](load(rows, plgpu.Layout.WGMMA), vectors)
                    rows[...] = jnp.where(mask != 0, value, jnp.zeros_like(value)).astype(dtype)

            for q, part in enumerate(parts):
                on_part(index, q, functools.partial(prologue, q, part))
            plgpu.commit_smem()  # the slabs' stores are seen by every thread's tap loads below

            y0, rows, x0, columns = (of_part(index, [w[i] for w in windows]) for i in range(4))
            first_step = of_part(index, [part.first_step for part in parts])
            first_chunk = of_part(index, [part.first_chunk for part in parts])
            taps_of_chunk = rows * columns
            step0 = first_step + (chunk - first_chunk) * taps_of_chunk

            def tap_step(t, ky, kx):
                step = step0 + t
                ring_slot = lax.rem(step, stages)
                plgpu.barrier_wait(ring_barriers.at[ring_slot])
                a_slot = a_tiles.at[lax.rem(step, 2)]
                a_slot[...] = tap_rows(slot, ky, kx)
                plgpu.commit_smem()  # the A tile is seen by the tensor cores
                plgpu.wgmma(acc_ref, a_slot, ring.at[ring_slot])
                plgpu.wgmma_wait(1)  # the previous step's MMA is done: its A and weight slots are free

                @pl.when(step + stages - 1 < steps)
                def _next():
                    fetch_weights(step + stages - 1)

            if grid.stride == 1:  # one loop over the window's taps
                @pl.loop(0, taps_of_chunk)
                def _tap(t):
                    tap_step(t, y0 + lax.div(t, columns), x0 + lax.rem(t, columns))
            else:  # a loop over the window's rows: a row's taps pick their pairs' element statically
                union = range(min(w[2] for w in windows), max(w[2] + w[3] for w in windows))

                @pl.loop(0, rows)
                def _tap_row(r):
                    for kx in union:
                        tap = functools.partial(tap_step, r * columns + kx - x0, y0 + r, kx)
                        if all(w[2] <= kx < w[2] + w[3] for w in windows):
                            tap()
                        else:
                            pl.when((kx >= x0) & (kx < x0 + columns))(tap)

            plgpu.commit_smem()  # every thread's tap loads of this slot precede its next TMA

        plgpu.wgmma_wait(0)
        acc = acc_ref[...]
        rows0 = b_idx * m_padded + m_idx * tile_m
        groups = [None] * len(statistics)
        pixel_operands = [o for o, kind in enumerate(kinds) if kind == "pixel"]
        for em in range(tile_m // epi_m):
            segs = segments(q0 + em * epi_m, pieces, segment, epi_m) if view is not None else []
            for en in range(tile_n // epi_n):
                slot = (em * (tile_n // epi_n) + en) % 2
                row_slice = pl.ds(m_idx * tile_m + em * epi_m, epi_m)
                col_slice = pl.ds(n_idx * tile_n + en * epi_n, epi_n)
                tiles = []
                for o, (kind, gmem, smem) in enumerate(zip(kinds, operand_gmems, operand_smems)):
                    batch = 0 if operand_shared[o] else b_idx
                    if kind == "pixel":  # read as it lies: the output's pixel-row segments
                        first = pixel_operands.index(o) * len(segs)
                        for i, (taken, row, oy, x, size) in enumerate(segs):
                            when(taken, functools.partial(
                                plgpu.copy_gmem_to_smem, pixel_at(gmem, oy, x, size, col_slice.start),
                                smem.at[pl.ds(row, size)], pixel_barrier(first + i)))
                        for i, (taken, *_rest) in enumerate(segs):
                            when(taken, functools.partial(plgpu.barrier_wait, pixel_barrier(first + i)))
                        tiles.append(load(smem, plgpu.Layout.WGMMA))  # rows off the output: never stored
                        continue
                    if kind == "tile":
                        src = gmem.at[batch, row_slice, col_slice]
                    elif kind == "phase col":  # one phase's columns of a vector stored once (`phase_vectors`)
                        src = gmem.at[batch, pl.ds(col_slice.start - phase * phase_cols, epi_n)]
                    else:
                        src = gmem.at[batch, row_slice if kind == "row" else col_slice]
                    plgpu.copy_gmem_to_smem(src, smem, operand_barriers.at[o])
                    plgpu.barrier_wait(operand_barriers.at[o])
                    if kind == "tile":
                        tiles.append(smem[...])
                    else:
                        axis = 0 if kind == "row" else 1
                        vector = load(smem, plgpu.Layout.WGMMA.reduce(1 - axis))
                        if statistics and o == len(kinds) - 1:  # the row images: kept a vector
                            tiles.append(vector)
                            continue
                        tiles.append(lax.broadcast_in_dim(vector, (epi_m, epi_n), (axis,)))
                if statistics:  # the last operand: the image of each row (-1 off the output)
                    tiles, row_image = tiles[:-1], tiles[-1]
                value = epilogue(acc[em * epi_m:(em + 1) * epi_m, en * epi_n:(en + 1) * epi_n], tiles)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                stored = value.astype(out_dtype)
                out_smem[slot] = stored
                plgpu.commit_smem()
                if view is None:
                    plgpu.copy_smem_to_gmem(out_smem.at[slot], out_gmem.at[pl.ds(rows0 + em * epi_m, epi_m), col_slice])
                else:  # the output pixels' segments, one group per sub-tile
                    for taken, row, oy, x, size in segs:
                        store = functools.partial(plgpu.copy_smem_to_gmem, out_smem.at[slot, pl.ds(row, size)],
                                                  pixel_at(out_gmem, oy, x, size, col_slice.start),
                                                  commit_group=False)
                        if interpreted:  # GPU interpret mode has no predicated copy ("predicate not supported")
                            when(taken, store)
                        else:  # the copy's bit is its predicate: no branch to trace, lower and compile
                            store(taken)
                    plgpu.commit_smem_to_gmem_group()
                channel0 = n_idx * tile_n + en * epi_n - (phase * phase_cols if phase_cols else 0)
                for s, statistic in enumerate(statistics):
                    part = group_partials(statistic, stored, row_image, b_idx, channel0, 1, interpreted)
                    groups[s] = part if groups[s] is None else merge_partials(statistic.op, groups[s], part)
        if statistics:
            tile = (b_idx * grid.strips * grid.m_tiles + m_idx) * n_tiles + n_idx
            write_group_partials(statistics, groups, group_smems, partial_gmems, tile)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @functools.partial(
        pl.run_scoped,
        staged=plgpu.SMEM((2, grid.staging, CHUNK), dtype),
        ring=plgpu.SMEM((stages, CHUNK, tile_n), dtype, transforms=mm._swizzled(CHUNK, dtype)),
        a_tiles=plgpu.SMEM((2, tile_m, CHUNK), dtype, transforms=mm._swizzled(CHUNK, dtype)),
        mask_smem=plgpu.SMEM((grid.staging // 64, 64), mask_gmem.dtype),
        vector_smems=[plgpu.SMEM((2, rows, CHUNK), ref.dtype) for ref, rows in zip(vector_gmems, vector_rows)],
        out_smem=plgpu.SMEM((2, epi_m, epi_n), out_dtype,
                            transforms=() if view is not None else mm._swizzled(epi_n, out_dtype)),
        operand_smems=[operand_smem(kind, ref.dtype) for kind, ref in zip(kinds, operand_gmems)],
        staged_barriers=[plgpu.Barrier(num_arrivals=grid.row_copies + len(part.vectors), num_barriers=2)
                         for part in parts],
        ring_barriers=plgpu.Barrier(num_barriers=stages),
        mask_barrier=plgpu.Barrier(),
        operand_barriers=plgpu.Barrier(num_barriers=max(1, len(kinds))),
        group_smems=[plgpu.SMEM((s.fields, s.padded_slots), jnp.float32) for s in statistics],
        pixel_barriers=[plgpu.Barrier(num_barriers=min(BARRIER_GROUP, n - g))  # Mosaic: at most 32 a group
                        for n in [max(1, kinds.count("pixel") * sum(len(p.sizes) for p in pieces))]
                        for g in range(0, n, BARRIER_GROUP)],
    )
    def _scope(staged, ring, a_tiles, mask_smem, vector_smems, out_smem, operand_smems, staged_barriers,
               ring_barriers, mask_barrier, operand_barriers, group_smems, pixel_barriers):
        pl.run_scoped(functools.partial(_body, staged, ring, a_tiles, mask_smem, vector_smems, out_smem, operand_smems,
                                        staged_barriers, ring_barriers, mask_barrier, operand_barriers, group_smems,
                                        pixel_barriers),
                      plgpu.ACC((tile_m, tile_n), jnp.float32))

    if finish_grid:  # after the SMEM above is released: the CTA that completes last finishes the statistics
        finish_statistics(statistics, partial_gmems, finished_gmems, counter, finish_grid, interpreted,
                          table_plans, source_gmems, table_gmems)


def finish_statistics(statistics, partial_gmems, finished_gmems, counter, grid_shape, interpreted: bool,
                      table_plans=(), source_gmems=(), table_gmems=()) -> None:
    """Each statistic's partials finished by the CTA that takes the last ticket (`emit.mosaic.finish`;
    in GPU interpret mode the grid's last CTA): `finished_gmems[s]` `[rows · slots]`; then the vector
    tables `table_plans` (`(statistic index, finish.TablePlan)`) of the convs reading them, from the
    finished values and `source_gmems` (`finish.write_tables`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tiles = math.prod(grid_shape)
    wgmma = plgpu.Layout.WGMMA

    def layout(value):
        return value if interpreted else plgpu.layout_cast(value, wgmma)

    def load(ref):
        return ref[...] if interpreted else plgpu.load(ref, (), layout=wgmma)

    def load_vector(ref):
        if interpreted:
            return ref[...].astype(jnp.float32)
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0)).astype(jnp.float32)

    plans = [plan for _s, plan in table_plans]
    stage_shapes = finish.stage_shapes(plans, [ref.dtype for ref in source_gmems])
    width = max([-(-plan.shape[2] // finish.CHUNK) * finish.CHUNK for plan in plans] or [finish.CHUNK])
    table_rows = max([plan.shape[1] for plan in plans] or [1])

    def _finish(block_smems, out_smems, ticket_smem, barriers, table_smem, stage_smems, stage_barrier):
        plgpu.wait_smem_to_gmem(0)  # this CTA's partial rows are in GMEM
        if interpreted:
            last = finish.is_last_cta(zip(("n", "m", "b"), grid_shape))
        else:
            last = finish.take_ticket(counter, ticket_smem) == tiles - 1

        @pl.when(last)
        def _last():
            if counter is not None:
                finish.reset_counter(counter)
            for s, statistic in enumerate(statistics):
                zeros = lambda n: _as_column_vector(jnp.zeros((n,), jnp.float32), interpreted)  # noqa: E731
                finish.finish(statistic.op, statistic.slots, tiles, partial_gmems[s], finished_gmems[s],
                              block_smems[s], out_smems[s], barriers[s], load, zeros, layout)
                mine = [(plan, gmem) for (t, plan), gmem in zip(table_plans, table_gmems) if t == s]
                if mine:
                    finish.write_tables([p for p, _g in mine], out_smems[s], source_gmems, [g for _p, g in mine],
                                        table_smem, stage_smems, stage_barrier, load_vector, interpreted)

    pl.run_scoped(_finish,
                  block_smems=[plgpu.SMEM((s.fields, finish.BLOCK_TILES, s.slots), jnp.float32) for s in statistics],
                  out_smems=[plgpu.SMEM((2 if s.op == "moments" else 1, s.slots), jnp.float32) for s in statistics],
                  ticket_smem=plgpu.SMEM((1,), jnp.int32),
                  barriers=[plgpu.Barrier(num_arrivals=s.fields) for s in statistics],
                  table_smem=plgpu.SMEM((table_rows, width), jnp.float32),
                  stage_smems=[plgpu.SMEM(shape, ref.dtype) for shape, ref in zip(stage_shapes, source_gmems)],
                  stage_barrier=plgpu.Barrier(num_arrivals=max(1, finish.copy_pieces(plans))))


def layout_weights(w: jax.Array, spec: Sequence[int], r, n_padded: int) -> jax.Array:
    """One K range's weights `w` (axes in `spec` order: out, in, spatial; the window counted from its
    first tap; `r` its `eqsat.tiling.mosaic.RangeTaps`) as `[steps * 64, n_padded]`: per tap, per
    chunk, 64 input channels x the outputs (the flat-grid conv's step order)."""
    w = jnp.transpose(w, (spec[2], spec[3], spec[1], spec[0]))  # [ky, kx, in, out]
    ky, kx, cin, cout = w.shape
    w = jnp.pad(w, ((0, 0), (0, 0), (0, r.chunks * CHUNK - cin), (0, n_padded - cout)))
    return w.reshape(ky * kx * r.chunks * CHUNK, n_padded)


def layout_weight(w: jax.Array, spec: Sequence[int], n_padded: int) -> jax.Array:
    """The conv's weight `w` (axes in `spec` order: out, in, spatial) as the haloed kernel reads it,
    `[kh · kw · C, n_padded]` rows `[ky, kx, in]`: a view of a weight prepared K x N
    (`emit.prepare`), padded only where N is not a multiple of the tile; each step reads its 64 rows
    in place (a merged shortcut's zero taps are never read)."""
    w = jnp.transpose(w, (spec[2], spec[3], spec[1], spec[0]))  # [ky, kx, in, out]
    ky, kx, cin, cout = w.shape
    return jnp.pad(jnp.reshape(w, (ky * kx * cin, cout)), ((0, 0), (0, n_padded - cout)))


def build(xs: Sequence[jax.Array], w: jax.Array, grid: HaloGrid, blocks: MosaicBlocks, *,
          parts: Sequence[PartPlan] | None = None, prologues: Sequence[Callable] | None = None,
          vectors: Sequence[jax.Array] = (), epilogue: mm.EpilogueFn = lambda acc, _: acc,
          operands: Sequence[mm.EpilogueOperand] = (), out_dtype=None, interpret: Any = None,
          name: str = "conv", weight_window: tuple[int, int] | None = None,
          phase_cols: int | None = None, statistics: Sequence = (), view: PixelView | None = None,
          counter: jax.Array | None = None, tables: Sequence = (), table_sources: Sequence[jax.Array] = ()):
    """The conv on `grid` as `[batch, m_padded, N↑]` flat rows (`unflatten` makes it the conv's
    output), or with a `view` (`eqsat.tiling.mosaic.pixel_view`) the output itself in that view
    (`unview` reshapes it), each CTA storing its pixels' row segments (`row_pieces`) and reading
    `pixel` operands (a residual as it lies, in the same view) so: `xs` the raw NHWC input of each
    K range (`parts`, default one range of all of `xs[0]`'s channels over the whole window), `w` the conv's weight as it lies, `[ky, kx, in]` rows
    (`layout_weight`: `[window · C, N↑]`, `weight_window` its window, default the grid's), `prologues[p](slab, vector tiles)` range p's input expression,
    `vectors` the `[B', R, C]` tables the ranges' vector copies read, `operands` the epilogue's,
    laid out over `[B', m_padded, N↑]` flat rows. `phase_cols`: the phase form of a conv over a
    nearest-2x upsample (`phase_weights`): N is 4 blocks of `phase_cols` outputs, one per output
    phase, `w` is `phase_weights` `[4 · 2 · 2 · C, phase_cols]`, and a CTA runs its phase's taps.
    `statistics` (`emit.mosaic.partials.GroupStatistic`): `(out, partials)`, each statistic's
    `[tiles, fields, slots]`, one tile per CTA, over the rows that are output pixels. With a ticket
    `counter` (`emit.mosaic.finish.new_counter`, or the one a finishing kernel before returned) the
    CTA that completes last also finishes them: `(out, partials, finished, counter)`, each finished
    statistic `[rows · slots]` (mean then M2, or the sum), the counter to pass on; and `tables`
    (`(statistic index, emit.mosaic.finish.TablePlan)`, reading `table_sources` flat) written by the
    same CTA, after the finished ones: `[images, rows, width]` float32 each."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    g = grid.geometry
    kh, kw = g.window
    if parts is None:
        parts = plan_parts([(xs[0].shape[-1], ((0, kh), (0, kw)), 0, ())])
    prologues = prologues or [lambda slab, _: slab] * len(parts)
    if len(xs) != len(parts) or len(prologues) != len(parts):
        raise ValueError(f"{len(xs)} inputs and {len(prologues)} prologues for {len(parts)} K ranges")
    if any(x.dtype != w.dtype for x in xs) or jnp.dtype(w.dtype).itemsize != 2:
        raise HaloUncovered(f"operands {[str(x.dtype) for x in xs]} x {w.dtype}")
    reason = halo_conv_uncovered(g, jnp.dtype(w.dtype).itemsize, [CHUNK * part.chunks for part in parts])
    if reason is not None:
        raise HaloUncovered(reason)
    if blocks.tile_m != grid.tile_m:
        raise ValueError(f"blocks' tile_m {blocks.tile_m} is not the grid's {grid.tile_m}")
    out_dtype = jnp.dtype(out_dtype or w.dtype)
    batch = g.batch
    m_padded = grid.m_padded
    weight_window = tuple(weight_window or g.window)
    weight_channels = w.shape[0] // (math.prod(weight_window) * (4 if phase_cols else 1))
    n_padded = w.shape[1] if not phase_cols else 4 * phase_cols
    if phase_cols and phase_cols % blocks.tile_n:
        raise ValueError(f"tile_n {blocks.tile_n} does not divide a phase's {phase_cols} outputs")
    mask = row_mask(grid).reshape(grid.strips * grid.m_tiles, grid.staging // 64, 64)  # TMA boxes: <= 256 a side
    if mask.all():  # no padding (a 1x1 conv): XLA would make the splat constant a broadcast fusion per
        mask = np.concatenate([mask, np.zeros_like(mask[:1])])  # call; one unread zero tile keeps it a literal
    mask = jnp.asarray(mask)
    arrays, kinds, shared = [], [], []
    if view is not None and (n_padded != (4 if phase_cols else 1) * view.channels or view.channels % blocks.tile_n):
        raise ValueError(f"a pixel view of {view.channels} channels for N = {n_padded} in tiles of {blocks.tile_n}")
    for operand in operands:
        a = operand.array
        if operand.kind == "pixel":
            if view is None or tuple(a.shape) != view.shape(batch):
                raise ValueError(f"a pixel operand of shape {a.shape} for the view {view}")
            arrays.append(a)
            kinds.append("pixel")
            shared.append(False)
            continue
        if operand.kind == "col" and phase_cols and a.shape[1] == phase_cols:  # `phase_vectors`: read per phase
            arrays.append(a)
            kinds.append("phase col")
            shared.append(a.shape[0] == 1)
            continue
        target = {"tile": (a.shape[0], m_padded, n_padded), "col": (a.shape[0], n_padded),
                  "row": (a.shape[0], m_padded)}[operand.kind]
        arrays.append(mm.pad_to(a, target))
        kinds.append(operand.kind)
        shared.append(a.shape[0] == 1)
    vector_rows = tuple(max([rows for part in parts for t, _r, rows in part.vectors if t == table] or [1])
                        for table in range(len(vectors)))
    statistics = tuple(statistics)
    if statistics:  # one more epilogue operand: the image of each row, -1 off the output
        arrays.append(jnp.asarray(row_images(grid, m_padded)))
        kinds.append("row")
        shared.append(False)
    grid_shape = (n_padded // blocks.tile_n, grid.strips * grid.m_tiles, batch)
    out_shape = (batch * m_padded, n_padded) if view is None else view.shape(batch)
    finishing = counter is not None and bool(statistics)
    out_type = (jax.ShapeDtypeStruct(out_shape, out_dtype),
                *(jax.ShapeDtypeStruct((math.prod(grid_shape), s.fields, s.slots), jnp.float32) for s in statistics),
                *(jax.ShapeDtypeStruct(((2 if s.op == "moments" else 1) * s.slots,), jnp.float32)
                  for s in (statistics if finishing else ())),
                *(jax.ShapeDtypeStruct(plan.shape, jnp.float32) for _s, plan in (tables if finishing else ())))
    out_type = out_type if statistics else out_type[0]

    def call(interpret_here):
        body = functools.partial(
            _kernel, grid=grid, blocks=blocks, parts=tuple(parts), n_vectors=len(vectors),
            vector_shared=tuple(v.shape[0] == 1 for v in vectors), vector_rows=vector_rows,
            kinds=tuple(kinds), operand_shared=tuple(shared), prologues=tuple(prologues),
            epilogue=epilogue, interpreted=interpret_here, m_padded=m_padded,
            weight_window=weight_window, weight_channels=weight_channels,
            phase_cols=phase_cols, statistics=statistics, n_tiles=grid_shape[0], view=view,
            pieces=row_pieces(grid, view, blocks.epi_m) if view is not None else (),
            segment=segment_geometry(grid, view) if view is not None else (),
            finish_grid=grid_shape if finishing else (), table_plans=tuple(tables) if finishing else (),
            n_sources=len(table_sources) if finishing else 0)
        if finishing and not interpret_here:  # the counter, aliased in and out (`emit.mosaic.finish`)
            return finish.counter_kernel(body, out_type, grid_shape, ("n", "m", "b"), plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup), mm._kernel_name(name))
        return plgpu.kernel(
            body,
            out_type=out_type,
            grid=grid_shape,
            grid_names=("n", "m", "b"),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            kernel_name=mm._kernel_name(name),
            interpret=mm.interpret_params() if interpret_here else None,
        )

    def interpreted(*xs):  # GPU interpret mode takes no ref operand: the counter passes by (`emit.mosaic.finish`)
        if finishing:
            return mm.one_at_a_time(call(True), out_type, xs[:-1]), xs[-1]
        return mm.one_at_a_time(call(True), out_type, xs)

    def run(*operands):
        if interpret is None:
            return lax.platform_dependent(*operands, cpu=interpreted, default=lambda *xs: call(False)(*xs))
        if interpret:
            return interpreted(*operands)
        return call(False)(*operands)

    operands_in = (*xs, w, mask, *vectors, *arrays, *(table_sources if finishing else ()),
                   *((counter,) if finishing else ()))
    out = kernel_cache.launch(run, operands_in, mm._kernel_name(name), interpreted=interpret is True)
    if finishing:
        out, counter = out
    if statistics:
        out, *partials = out
        out = out.reshape(batch, m_padded, n_padded) if view is None else out
        if finishing:
            finished = partials[len(statistics):2 * len(statistics)]
            return out, partials[:len(statistics)], finished, counter, partials[2 * len(statistics):]
        return out, partials
    return out.reshape(batch, m_padded, n_padded) if view is None else out


def unview(out: jax.Array, conv: ConvGeometry) -> jax.Array:
    """`build`'s output in its pixel view as the conv's (NHWC) output: a reshape, no copy."""
    return out.reshape(conv.batch, *conv.out_size, conv.out_features)


def _strips_side_by_side(out: jax.Array, grid: HaloGrid, columns: int) -> jax.Array:
    """`[batch, m_padded, columns]` flat rows as `[batch, Ho, Wo, columns]` (each strip's rows of its
    pitch, the strips side by side)."""
    g, s, wp, ws = grid.geometry, grid.strips, grid.out_pitch, grid.strip_width
    ho = g.out_size[0]
    out = out[:, :, :columns].reshape(g.batch, s, grid.m_tiles * grid.tile_m, columns)[:, :, :ho * wp]
    out = out.reshape(g.batch, s, ho, wp, columns)[:, :, :, :ws]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(g.batch, ho, s * ws, columns)


def row_images(grid: HaloGrid, m_padded: int) -> np.ndarray:
    """`[batch, m_padded]` int32: image b at flat row q of image b's rows where q is an output pixel
    (`_flat_pixels`: strips, stride 2's output pitch), else -1 (the hosted statistics' rows)."""
    *_, valid = _flat_pixels(grid, m_padded)
    return np.where(valid.reshape(1, m_padded), np.arange(grid.geometry.batch)[:, None], -1).astype(np.int32)


def unflatten(out: jax.Array, grid: HaloGrid, out_features: int) -> jax.Array:
    """`build`'s flat rows as the conv's output (its `out_spec` layout)."""
    g = grid.geometry
    out = _strips_side_by_side(out, grid, out_features)
    order = [0] * 4
    for position, axis in enumerate(g.params.out_spec):
        order[axis] = (0, 3, 1, 2)[position]
    return jnp.transpose(out, order)


def _flat_pixels(grid: HaloGrid, m_padded: int) -> tuple:
    """`(row, column, valid)` of the grid's output pixel at each flat row `[1, m_padded, 1]`."""
    wp, ws, m_strip = grid.out_pitch, grid.strip_width, grid.m_tiles * grid.tile_m
    q = np.arange(m_padded).reshape(1, m_padded, 1)
    strip, local = q // m_strip, q % m_strip
    oy, ox = local // wp, local % wp
    return oy, strip * ws + ox, (oy < grid.geometry.out_size[0]) & (ox < ws) & (strip < grid.strips)


def output_index(grid: HaloGrid, m_padded: int, out_features: int) -> tuple:
    """The conv output's index at each flat row and channel, `[batch, m_padded, N]` (clamped to 0 off
    the output), for mapping the epilogue's operands onto the flat rows."""
    g = grid.geometry
    b = np.arange(g.batch).reshape(g.batch, 1, 1)
    oy, ox, valid = _flat_pixels(grid, m_padded)
    oy, ox = np.where(valid, oy, 0), np.where(valid, ox, 0)
    return _place(g.params.out_spec, (b, np.arange(out_features).reshape(1, 1, -1), oy, ox))


# --- the output and a residual as they lie: pixel-row segments ------------------------------------


def pixel_index(view: PixelView, conv: ConvGeometry) -> tuple[tuple, np.ndarray]:
    """`(index, linear)`: the conv output's index at each pixel of the view in order and output
    column (the phase form's phase-major), `[batch, pixels, N]`, and the NHWC linear position of each."""
    ho, wo = conv.out_size
    rows, cols = (ho, wo) if view.py == 1 else (ho // 2, wo // 2)
    n = np.arange(view.py * view.px * view.channels).reshape(1, 1, -1)
    b = np.arange(conv.batch).reshape(-1, 1, 1)
    pixel = np.arange(rows * cols).reshape(1, -1, 1)
    phase, c = n // view.channels, n % view.channels
    oy = (pixel // cols) * view.py + phase // 2 * (view.py - 1)
    ox = (pixel % cols) * view.px + phase % 2 * (view.px - 1)
    return _place(conv.params.out_spec, (b, c, oy, ox)), ((b * ho + oy) * wo + ox) * view.channels + c


def pixel_operands(epilogue, conv: ConvGeometry, view: PixelView, flat_index: tuple, m_padded: int, n: int,
                   values, tables: list | None = None) -> tuple[list, list]:
    """`mm.mapped_operands` where the kernel stores pixels (`build`'s `view`): a tile operand read at
    the output's own index (a residual: a tensor with the output's NHWC elements) is a `pixel`
    operand, the tensor itself in the view (a reshape: no gather); the others are mapped onto the
    flat rows (`flat_index`) as before. `tables`: as `mm.mapped_operands`' (by pixel)."""
    index, linear = pixel_index(view, conv)
    tables = [] if tables is None else tables
    tensors, by_pixel = mm.mapped_operands(epilogue, index, (conv.batch, linear.shape[1], n), values, tables)
    flat = None
    operands = []
    for i, (tensor, operand, table) in enumerate(zip(tensors, by_pixel, tables)):
        if operand.kind == "tile" and table.shape == linear.shape and np.array_equal(table, linear):
            operands.append(mm.EpilogueOperand("pixel", jnp.reshape(values(tensor), view.shape(conv.batch))))
            continue
        if operand.kind == "col":  # the same on any rows
            operands.append(operand)
            continue
        if flat is None:
            flat = mm.mapped_operands(epilogue, flat_index, (conv.batch, m_padded, n), values)[1]
        operands.append(flat[i])
    return tensors, operands


# --- a conv over a nearest-2x upsample: four output phases of a conv over the source ---------------


def phase_weights(w: jax.Array, spec: Sequence[int], n_padded: int | None = None) -> jax.Array:
    """A 3x3 weight (axes in `spec` order) as the phase form reads it: per output phase `(py, px)` a
    2x2 window whose tap `(a, b)` (source offset `(py + a, px + b)` of the 3x3 halo) sums the taps
    that read that source pixel (`PHASE_OFFSET`), `[4, 2, 2, C, Cout]` (sums of tap slices: one XLA
    fusion). Each phase reads only its own 4 source pixels, so an inf outside them never meets a 0."""
    w = jnp.transpose(w, (spec[2], spec[3], spec[1], spec[0]))  # [ky, kx, in, out]
    phases = []
    for py in (0, 1):
        for px in (0, 1):
            window = [[functools.reduce(jnp.add, [w[ky, kx] for ky in range(3) for kx in range(3)
                                                  if (PHASE_OFFSET[py, ky], PHASE_OFFSET[px, kx]) == (py + a, px + b)])
                       for b in (0, 1)] for a in (0, 1)]
            phases.append(jnp.stack([jnp.stack(row) for row in window]))
    return jnp.stack(phases)


def phase_vectors(tensors, operands, tables, cout: int, values) -> list:
    """`operands` with each column vector the phase form reads as one vector per phase (its table the
    tensor's `cout` elements in order, once per phase: a bias) given as that tensor `[1, cout]`, which
    the kernel reads at its phase's columns (`build`: kind "phase col"): no gather onto `4 · cout`
    columns per call."""
    out = list(operands)
    for i, (tensor, operand, table) in enumerate(zip(tensors, operands, tables)):
        if operand.kind != "col" or table.shape != (1, 4 * cout) or math.prod(parse_type(tensor.ty).shape) != cout \
                or not np.array_equal(table.reshape(-1), np.tile(np.arange(cout), 4)):
            continue
        out[i] = mm.EpilogueOperand("col", jnp.reshape(values(tensor), (1, cout)))
    return out


def phase_output_index(grid: HaloGrid, m_padded: int, conv: ConvGeometry) -> tuple:
    """The upsampled conv's output index at each flat row of the source grid and phase-major column
    `(py, px, c)`, `[batch, m_padded, 4 · Cout]` (clamped to 0 off the output)."""
    cout = conv.out_features
    n = np.arange(4 * cout).reshape(1, 1, -1)
    b = np.arange(conv.batch).reshape(conv.batch, 1, 1)
    i, j, valid = _flat_pixels(grid, m_padded)
    phase = n // cout
    oy, ox = np.where(valid, 2 * i + phase // 2, 0), np.where(valid, 2 * j + phase % 2, 0)
    return _place(conv.params.out_spec, (b, n % cout, oy, ox))


def unflatten_phases(out: jax.Array, grid: HaloGrid, conv: ConvGeometry) -> jax.Array:
    """`build`'s flat rows of the phase form as the upsampled conv's output (its `out_spec` layout)."""
    (h, w), cout = grid.geometry.out_size, conv.out_features
    out = _strips_side_by_side(out, grid, 4 * cout).reshape(conv.batch, h, w, 2, 2, cout)
    out = jnp.transpose(out, (0, 1, 3, 2, 4, 5)).reshape(conv.batch, 2 * h, 2 * w, cout)
    order = [0] * 4
    for position, axis in enumerate(conv.params.out_spec):
        order[axis] = (0, 3, 1, 2)[position]
    return jnp.transpose(out, order)


# --- emit: a plan's Conv term --------------------------------------------------------------------------


def halo_loads(geometry, ranges) -> tuple:
    """`(geometry, ranges, upsampled, parts, loads)` of a conv (`geometry`, its K ranges) on the
    haloed template, from types alone: over a nearest-2x upsample the source's geometry and range
    (`upsampled` its source, else None), the ranges cut per tensor (`halo_parts`) and each part's
    `prologue_loads`; `HaloUncovered` where the template does not take it."""
    params = geometry.params
    for r in ranges:
        if r.lhs_offset or r.channels != parse_type(r.lhs.ty).shape[params.lhs_spec[1]]:
            raise HaloUncovered(f"a K range over channels {r.lhs_offset}.. of a wider input expression")
    upsampled = upsample_source(ranges[0].lhs, geometry) if len(ranges) == 1 else None
    if upsampled is not None:  # four output phases of a conv over the source
        geometry = phase_geometry(geometry)
        ranges = [dataclasses.replace(ranges[0], lhs=upsampled)]
    parts = halo_parts([(r.lhs, 0, r.channels, r.taps) for r in ranges])
    if isinstance(parts, str):
        raise HaloUncovered(parts)
    reason = halo_uncovered(geometry, [(channels, taps) for _e, _r, _o, channels, taps in parts],
                            jnp.dtype(parse_type(ranges[0].lhs.ty).dtype).itemsize, [e for e, *_ in parts])
    if reason is not None:
        raise HaloUncovered(reason)
    batch, height, width = geometry.batch, *geometry.in_size
    loads = [prologue_loads(expr, (batch, height, width, channels)) for expr, _r, _o, channels, _t in parts]
    return geometry, ranges, upsampled, parts, loads


def emit(kernel, ctx, geometry, ranges, tile_epilogue, statistics: Sequence = (), finished: bool = False,
         reductions: Sequence = ()) -> tuple[dict, list]:
    """`({kernel.term: value}, partials of each of `statistics`)` for a plan's `Conv` kernel as the
    haloed template, or `HaloUncovered`. `ranges` are its K ranges (`emit.pallas.conv.k_ranges`),
    each cut per tensor (`halo_parts`); `tile_epilogue(tensors)` the epilogue on an `[epi_m, epi_n]`
    sub-tile reading those tensors' operand tiles (`emit.mosaic.conv`); `statistics` the hosted
    statistics its epilogue writes (`emit.mosaic.partials.GroupStatistic`). `finished`: its last CTA
    finishes them (`finish_statistics`, `eqsat.cost.finish.producer_finished`), each then
    `emit.mosaic.finish.Finished` (the statistic's value), with `ctx.counter` passed on, and writes
    the vector tables of the Mosaic convs gathering them (`reductions`: the statistics' terms;
    `emit.pallas.tables`: the requests waiting on them, taken off `ctx.table_requests`, the tables
    left in `ctx.tables`); where a waiting table cannot be written so (`finish.table_plan`, or its
    other tensors are not computed yet) the statistics stay partials."""
    from eqsat.interpret import _Evaluator

    term = kernel.term
    _lhs, _rhs, _params_key, epilogue, ty = term.args
    params, out_type = geometry.params, parse_type(ty)
    conv_geometry = geometry
    geometry, ranges, upsampled, parts, loads = halo_loads(geometry, ranges)
    batch, height, width = geometry.batch, *geometry.in_size
    sources = [prologue_sources(expr, (batch, height, width, channels), ctx.value, part)
               for (expr, _r, _o, channels, _t), part in zip(parts, loads)]
    for expr, part in zip(parts, sources):
        if jnp.dtype(part.x.dtype) != jnp.dtype(parse_type(expr[0].ty).dtype):
            raise HaloUncovered(f"an input tensor of {part.x.dtype} under a {parse_type(expr[0].ty).dtype} "
                                "input expression")
    written = getattr(ctx, "tables", {}).pop(term, None)  # the table a Triton kernel wrote (`emit.pallas.tables`)
    tables, copies = vector_tables(sources, written)
    if upsampled is not None:  # a phase's 2x2 taps, placed in the 3x3 halo by its phase
        parts = [(e, r, o, c, ((0, 2), (0, 2))) for e, r, o, c, _t in parts]
    plans = plan_parts([(channels, taps, part.offset, copy, 0 if upsampled is not None else ranges[r].start + offset)
                        for (_e, r, offset, channels, taps), part, copy in zip(parts, sources, copies)])

    # the epilogue's operand kinds do not depend on the tile: map them once at 128-row tiles to size SMEM
    probe = HaloGrid(geometry, 128)
    probe_index = (output_index(probe, probe.m_padded, geometry.out_features) if upsampled is None
                   else phase_output_index(probe, probe.m_padded, conv_geometry))
    _, probe_operands = mm.mapped_operands(epilogue, probe_index,
                                           (geometry.batch, probe.m_padded, geometry.out_features), ctx.value)
    vector_rows = [max([rows for plan in plans for t, _r, rows in plan.vectors if t == table] or [1])
                   for table in range(len(tables))]
    tiling = halo_tiling(geometry, geometry.out_features,
                         [jnp.dtype(v.dtype).itemsize for v, rows in zip(tables, vector_rows) for _ in range(rows)],
                         [(o.kind, jnp.dtype(o.array.dtype).itemsize) for o in probe_operands],
                         jnp.dtype(out_type.dtype).itemsize, geometry.batch)
    if tiling is None:
        raise HaloUncovered(f"rows of {geometry.in_size[1]} pixels: their staged chunks do not fit SMEM")
    blocks, grid_of = tiling
    if upsampled is not None:
        blocks = phase_blocks(blocks, conv_geometry.out_features)
        if blocks is None:
            raise HaloUncovered(f"{conv_geometry.out_features} outputs per phase (a multiple of 64 for whole tiles)")
    grid = grid_of(blocks.tile_m)
    n_padded = -(-geometry.out_features // blocks.tile_n) * blocks.tile_n
    m_padded = grid.m_padded
    out_index = (output_index(grid, m_padded, geometry.out_features) if upsampled is None
                 else phase_output_index(grid, m_padded, conv_geometry))
    view = (pixel_view(grid, conv_geometry.out_features, phases=upsampled is not None)
            if stores_pixels(conv_geometry, n_padded, blocks.tile_n, upsampled is not None) else None)
    tables_by_operand: list = []
    epi_tensors, operands = mm.mapped_operands(epilogue, out_index, (geometry.batch, m_padded, geometry.out_features),
                                               ctx.value, tables_by_operand) if view is None else \
        pixel_operands(epilogue, conv_geometry, view, out_index, m_padded, geometry.out_features, ctx.value,
                       tables_by_operand)
    if upsampled is not None:
        operands = phase_vectors(epi_tensors, operands, tables_by_operand, conv_geometry.out_features, ctx.value)

    from emit.mosaic.layouts import prepared_halo_weight

    w = prepared_halo_weight(ctx, term, conv_geometry.out_features if upsampled is not None else n_padded)
    if w is None:  # not laid out once by the prepare stage: here, per call
        known = _Evaluator({}, ctx.constants, ctx.payloads)
        known.values = ctx.values
        (w,) = _Evaluator({}, ctx.constants, ctx.payloads, parent=known).run([term.args[1]])
        if upsampled is not None:  # [phase, a, b, in, out]: rows (phase, a, b, in)
            w = jnp.reshape(phase_weights(w.astype(sources[0].x.dtype), params.rhs_spec),
                            (16 * geometry.in_features, -1))
        else:
            w = layout_weight(w.astype(sources[0].x.dtype), params.rhs_spec, n_padded)
    prologues = [slab_prologue(expr, part.tensors, part.sources) for (expr, *_), part in zip(parts, sources)]
    table_plans, table_sources, requests = [], [], []
    if finished and statistics:
        finished, table_plans, table_sources, requests = _finishing_tables(ctx, reductions)
    flat = build([part.x for part in sources], w, grid, blocks, parts=plans, prologues=prologues, vectors=tables,
                 epilogue=tile_epilogue(epi_tensors), operands=operands, out_dtype=out_type.dtype,
                 interpret=ctx.interpret, name=kernel.name, weight_window=(2, 2) if upsampled is not None else None,
                 phase_cols=conv_geometry.out_features if upsampled is not None else None, statistics=statistics,
                 view=view, counter=(finish.counter_of(ctx) if finished and statistics else None),
                 tables=table_plans, table_sources=[jnp.reshape(ctx.value(t), (-1,)) for t in table_sources])
    if finished and statistics:
        flat, _partials, values, ctx.counter, written = flat
        partials = [finish.Finished(v) for v in values]
        for request, table in zip(requests, written):
            ctx.tables[request.reader] = table
    else:
        flat, partials = flat if statistics else (flat, [])
    if view is not None:
        return {term: unview(flat, conv_geometry)}, partials
    if upsampled is not None:
        return {term: unflatten_phases(flat, grid, conv_geometry)}, partials
    return {term: unflatten(flat, grid, geometry.out_features)}, partials


def _finishing_tables(ctx, reductions) -> tuple[bool, list, list, list]:
    """`(finish, table plans, their source tensors, the requests)` for finishing `reductions` in the
    conv: every vector table waiting on them (`ctx.table_requests`) ready and plannable
    (`finish.table_plan`), taken off the waiting list; else `(False, [], [], [])`."""
    from emit.pallas import tables

    plans, sources, taken = [], [], []
    for s, reduction in enumerate(reductions):
        waiting = [r for r in getattr(ctx, "table_requests", ()) if any(t is reduction for t in r.tensors)]
        ready = tables.ready(reduction, ctx)
        if len(ready) != len(waiting):
            return False, [], [], []
        for request in ready:
            plan = finish.table_plan(request, reduction, sources)
            if plan is None:
                return False, [], [], []
            plans.append((s, plan))
            taken.append(request)
    ids = {id(r) for r in taken}
    if taken:
        ctx.table_requests[:] = [r for r in ctx.table_requests if id(r) not in ids]
    return True, plans, sources, taken
