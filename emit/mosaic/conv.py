"""The Mosaic GPU conv template: a plan's `Conv(lhs, rhs, params, epilogue, ty)` as an implicit GEMM
on Hopper tensor cores, run by the Mosaic matmul kernel (`emit.mosaic.matmul`: TMA into a
swizzled SMEM ring by a memory warpgroup, wgmma by compute warpgroups, the epilogue in registers).

    plan_taps  the pipeline steps of a conv: (K range, tap, channel chunk) and where each reads
    build      the kernel over an input laid out by `layout_input` and weights by `layout_weights`
    reference  the same conv with `lax.conv_general_dilated`
    emit       a plan's `Conv` kernel as this template

The GEMM's M is the output pixels on a *flat padded grid*: each image's input, zero-padded by the
conv's padding and split into its stride phases (`phase (py, px)` holds padded rows `py::sy`,
columns `px::sx`), is stored NHWC as `[batch * Hi * Wq, channels]` rows, the row pitch `Wq` rounded
up to 8 pixels; output pixel `(b, oy, ox)` is row `q = (b * Hi + oy) * Wq + ox` of the output, and
tap `(ky, kx)` reads row `q + (ky·dy // sy) * Wq` of phase `(ky·dy % sy, kx·dx % sx)` in the copy of
the input moved up by `j = kx·dx // sx` rows. So every tap is a shift by whole 8-row SMEM tiles (a
TMA copy into the swizzled tile layout must start on one; Mosaic's layout inference refuses a
dynamic row start it cannot prove a multiple of 8): one `[tile_m, 64]` TMA copy at an element offset
(`pl.Element`) per (tap, 64-channel chunk), wgmma over it, with output tiles spanning rows and
images (>= 64 pixels at every resolution). The column shifts cost one input copy each (3 for a 3x3
at stride 1, 2 at stride 2), written by the XLA fusion that lays the input out. Rows `ox >= Wo` and
`oy >= Ho` of the grid are computed and dropped (14 % of a 64x64 image; 60 % of an 8x8 one).
Weights are laid out per step as `[steps * 64, Cout]` so step t reads B block t, as a matmul's K does.

K ranges (`emit.pallas.conv.k_ranges`): `concat(h, skip)` inputs and a merged 1x1 shortcut
(`concat(pad(w1x1), w3x3)`) are ranges side by side along the input's channels; a range runs
only its nonzero taps (the shortcut: its centre tap). Stride 2 is four phases, each a range's
channel block; a nearest-2x upsample is part of the input expression.

Convs the haloed template covers (`emit.mosaic.conv_halo`: stride 1 or 2, up to 3x3, an NHWC input,
K ranges of 64k channels each: concats, also inside a GroupNorm group, and merged shortcuts, a 3x3
over a nearest-2x upsample in its phase form, wide rows in column strips) run there: it reads each
range's tensor as it lies and applies its input expression in SMEM. For the others (fewer than 64
channels: conv_in's 4), the input expression of each range (a GroupNorm apply + SiLU
from hosted statistics, an upsample view, an NCHW permute) is evaluated whole before the kernel as
one XLA fusion that writes the laid-out input (padding applied after it, so a tap in the padding
reads 0, not prologue(0)): each input element is computed once, but it costs HBM writes of the
shifted copies and a read, and each tap re-reads its rows through L2. The epilogue (bias,
time-embedding row, residual, cast) is mapped onto the flat grid on the host
(`emit.mosaic.matmul.mapped_operands`). A statistic the plan hosts on the conv alone, one output
per (image, channel group) (a GroupNorm's), is written by the epilogue as per-tile partials
(`emit.mosaic.partials.GroupStatistic`: the flat rows that are output pixels, tagged by image in a
row table); other hosted statistics are left to the driver (its own reduce kernel).

Raises `NotImplementedError` (the kernel then runs through the Triton template with a
`TritonFallbackWarning`) for: operands other than two fp16 or two bf16, transposed or grouped
convs, negative padding, epilogues that select by index, and a tap offset past a TMA box.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from emit import expr as ex
from emit.mosaic import conv_halo
from emit.mosaic.conv_halo import layout_weights  # noqa: F401 (both conv kernels lay weights out so)
from emit.mosaic import matmul as mm
from emit.mosaic.partials import GroupStatistic
from emit.pallas.conv import ConvGeometry, _place, k_ranges
from eqsat.conv_params import ConvParams
from eqsat.term import Term
from eqsat.tiling import mosaic as tiling
from eqsat.tiling.mosaic import CHUNK, RangeTaps, default_blocks, plan_taps  # noqa: F401 (shared with the cost model)
from eqsat.types import parse_type


class FlatGrid(tiling.FlatGrid):
    """The flat padded grid of one conv (see the module docstring; `eqsat.tiling.mosaic.FlatGrid`,
    which the cost model reads) and the output index of its rows."""

    def output_index(self, q: np.ndarray, n: np.ndarray) -> tuple[tuple, np.ndarray]:
        """The conv output's index at flat rows `q` and channels `n` (NumPy, clamped to (0, 0) off the
        output) and where a row is an output pixel."""
        hi, wq = self.phase_size
        (ho, wo), batch = self.geometry.out_size, self.geometry.batch
        b, oy, ox = q // (hi * wq), (q // wq) % hi, q % wq
        valid = (b < batch) & (oy < ho) & (ox < wo)
        b, oy, ox = (np.where(valid, v, 0) for v in (b, oy, ox))
        return _place(self.geometry.params.out_spec, (b, n, oy, ox)), valid


def step_offset(grid: FlatGrid, ranges: Sequence[RangeTaps]):
    """The A window's offset function: pipeline step -> (row offset, column block), index arithmetic
    on int32 scalars (evaluated by the memory warpgroup, no tables)."""
    sx = grid.strides[1]
    (dy, dx), (sy, _) = grid.geometry.params.rhs_dilation, grid.strides
    wq = grid.phase_size[1]

    def of_range(r: RangeTaps, t):
        (y0, _), (x0, x1) = r.taps
        local = t - r.first_step
        tap, chunk = lax.div(local, r.chunks), lax.rem(local, r.chunks)
        ky, kx = y0 + lax.div(tap, x1 - x0), x0 + lax.rem(tap, x1 - x0)
        ry, rx = ky * dy, kx * dx
        phase = lax.rem(ry, sy) * sx + lax.rem(rx, sx)
        shift = lax.div(rx, sx) - r.shifts[0]
        return lax.div(ry, sy) * wq, r.column_block + (shift * grid.phases + phase) * r.chunks + chunk

    def offset(t):
        row, column = of_range(ranges[0], t)
        for r in ranges[1:]:
            later = t >= r.first_step
            r_row, r_column = of_range(r, t)
            row, column = lax.select(later, r_row, row), lax.select(later, r_column, column)
        return pl.multiple_of(row, 8), column  # the A tile's SMEM tiling (8 rows) needs it

    return offset


# --- operand layouts --------------------------------------------------------------------------------


def layout_input(x: jax.Array, grid: FlatGrid, spec: Sequence[int], r: RangeTaps) -> jax.Array:
    """One K range's input `x` (axes in `spec` order: batch, feature, spatial) as `[rows, shifts *
    phases * 64 * chunks]`: NHWC, zero-padded by the conv's padding (after the prologue that made `x`),
    split into stride phases, channels zero-padded, one copy per column shift j its taps read (rows
    moved up by j: a TMA copy starts on an 8-row tile, so a tap one pixel right cannot be a view)."""
    channels_padded = r.chunks * CHUNK
    p = grid.geometry.params
    x = jnp.transpose(x, (spec[0], spec[2], spec[3], spec[1]))
    b, h, w, c = x.shape
    (sy, sx), (hi, wq) = grid.strides, grid.phase_size
    (pad_y, _), (pad_x, _) = p.padding
    x = jnp.pad(x, ((0, 0), (pad_y, hi * sy - h - pad_y), (pad_x, wq * sx - w - pad_x), (0, channels_padded - c)))
    x = x.reshape(b, hi, sy, wq, sx, channels_padded).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b * hi * wq, sy * sx * channels_padded)
    copies = [jnp.pad(x[j:], ((0, j), (0, 0))) for j in range(*r.shifts)]
    return jnp.concatenate(copies, axis=1) if len(copies) > 1 else copies[0]


def build(inputs: Sequence[jax.Array], weights: Sequence[jax.Array], ranges: Sequence[RangeTaps], grid: FlatGrid,
          *, epilogue: mm.EpilogueFn = lambda acc, _: acc, operands: Sequence[mm.EpilogueOperand] = (),
          out_dtype=None, blocks: mm.MosaicBlocks | None = None, interpret=None, name: str = "conv",
          statistics: Sequence = ()):
    """The conv on the flat grid, `[grid.rows, out_features]` (rows off the output included): `inputs`
    and `weights` per range from `layout_input` / `layout_weights`, `operands` of the epilogue
    laid out over the flat grid's rows (`mapped_operands`). With `statistics`
    (`emit.mosaic.partials.GroupStatistic`): `(out, partials)`, each statistic's
    `[tiles, fields, slots]` over the rows that are output pixels (`row_images`)."""
    steps = sum(r.steps for r in ranges)
    blocks = blocks or default_blocks(grid, weights[0].shape[1], steps)
    halo = grid.halo
    m_padded = -(-grid.rows // blocks.tile_m) * blocks.tile_m
    a = jnp.concatenate(list(inputs), axis=1) if len(inputs) > 1 else inputs[0]
    a = mm.pad_to(a, (m_padded + halo, a.shape[1]))
    b = jnp.concatenate(list(weights), axis=0) if len(weights) > 1 else weights[0]
    window = mm.AWindow(halo, step_offset(grid, ranges))
    hi, wq = grid.phase_size
    out = mm.build(a[None], b[None], epilogue=epilogue, operands=operands, out_dtype=out_dtype, blocks=blocks,
                   interpret=interpret, name=name, a_window=window, group_statistics=statistics,
                   row_image=row_images(grid, m_padded) if statistics else None, rows_per_image=hi * wq)
    if statistics:
        out, partials = out
        return out[0, :grid.rows], partials
    return out[0, :grid.rows]


def row_images(grid: FlatGrid, rows: int) -> np.ndarray:
    """`[rows]` int32: the image of each flat row, -1 where the row is not an output pixel."""
    hi, wq = grid.phase_size
    q = np.arange(rows)
    _index, valid = grid.output_index(q, np.zeros(1, np.int64))
    return np.where(valid, q // (hi * wq), -1).astype(np.int32)


def unflatten(out: jax.Array, grid: FlatGrid, out_features: int) -> jax.Array:
    """The flat grid's output as the conv's output (its `out_spec` layout), rows off the output dropped."""
    hi, wq = grid.phase_size
    (ho, wo), g = grid.geometry.out_size, grid.geometry
    out = out.reshape(g.batch, hi, wq, -1)[:, :ho, :wo, :out_features]  # [b, oy, ox, n]
    order = [0] * 4
    for position, axis in enumerate(g.params.out_spec):
        order[axis] = (0, 3, 1, 2)[position]
    return jnp.transpose(out, order)


def reference(lhs: jax.Array, rhs: jax.Array, params: ConvParams, epilogue=None) -> jax.Array:
    """The same conv with `lax.conv_general_dilated` (fp32 accumulation), then `epilogue`."""
    acc = lax.conv_general_dilated(lhs, rhs, **params.lax_kwargs(), preferred_element_type=jnp.float32)
    return acc if epilogue is None else epilogue(acc)


# --- emit: a plan's Conv term ---------------------------------------------------------------------


def _geometry(term: Term) -> ConvGeometry:
    lhs, rhs, params_key, _epilogue, ty = term.args
    params = ConvParams.parse(params_key)
    try:
        geometry = ConvGeometry(params, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape, parse_type(ty).shape)
    except ValueError as error:  # a transposed, grouped or non-2-D conv
        raise NotImplementedError(str(error)) from error
    if any(lo < 0 or hi < 0 for lo, hi in params.padding):
        raise NotImplementedError(f"negative padding {params.padding}")
    if 0 in geometry.out_size or 0 in (geometry.batch, geometry.in_features, geometry.out_features):
        raise NotImplementedError("an empty conv")
    return geometry


def sub_tile_epilogue(epilogue: Term, out_spec):
    """`tensors -> (acc [em, en], operand tiles) -> the epilogue on an output sub-tile`, the n-th
    operand tile answering the n-th `Load` of `tensors` (as `emit.mosaic.matmul.mapped_operands`
    met them on the host)."""
    compiled = ex.compile_expr(epilogue)

    def of(tensors):
        def tile_epilogue(acc, tiles):
            em, en = acc.shape
            index = _place(out_spec, (np.zeros((1, 1), np.int64), np.arange(en).reshape(1, en),
                                      np.arange(em).reshape(em, 1), np.zeros((1, 1), np.int64)))
            check = mm._reads_accumulator_at(index)

            def accumulator(acc_ty, at, mask):
                check(at)
                return acc

            memory = mm._TileMemory(tensors, tiles)
            value = compiled(memory, index, True, accumulator)
            if memory.cursor != len(tensors):
                raise AssertionError("the epilogue's loads in the kernel differ from the host's")
            return jnp.broadcast_to(value, (em, en))

        return tile_epilogue

    return of


def halo_table(term: Term) -> tuple | None:
    """`(shape, rows)` of the float32 vector table the haloed template reads for the conv `term`
    (`emit.mosaic.conv_halo.table_rows`), from types alone; None where it reads none or the haloed
    template does not take the conv. What `emit.pallas.tables` asks the Triton kernel finishing a
    statistic the table gathers to write beside it."""
    lhs, rhs, _params_key, _epilogue, _ty = term.args
    if parse_type(lhs.ty).dtype != parse_type(rhs.ty).dtype or parse_type(lhs.ty).dtype not in mm.MMA_DTYPES:
        return None
    try:
        *_, loads = conv_halo.halo_loads(_geometry(term), k_ranges(term))
    except NotImplementedError:  # HaloUncovered among them
        return None
    return conv_halo.table_rows(loads)


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Conv` kernel (`emit.pallas.KernelCall`) in `ctx`, as a
    Mosaic GPU kernel, plus the partials (`emit.pallas.partials.Partials`) of each hosted statistic
    it writes (`emit.mosaic.partials.GroupStatistic`; the others the driver reduces after it); forms
    not covered raise `NotImplementedError` (`emit.mosaic` then uses the Triton template)."""
    from emit.mosaic.finish import Finished
    from emit.pallas.partials import Partials
    from eqsat.interpret import _Evaluator

    term = kernel.term
    lhs, rhs, params_key, epilogue, ty = term.args
    lhs_type, rhs_type, out_type = parse_type(lhs.ty), parse_type(rhs.ty), parse_type(ty)
    if lhs_type.dtype != rhs_type.dtype or lhs_type.dtype not in mm.MMA_DTYPES:
        raise NotImplementedError(f"{lhs_type.dtype} x {rhs_type.dtype} operands (wgmma here multiplies two "
                                  f"fp16 or two bf16 operands)")
    if jnp.dtype(out_type.dtype).itemsize not in (2, 4) or jnp.dtype(out_type.dtype).kind != "f":
        raise NotImplementedError(f"a {out_type.dtype} result")
    missing = sorted({node.op for node in ex.expr_nodes(epilogue)} - mm.EPILOGUE_OPS)
    if missing:
        raise NotImplementedError(f"an epilogue with {', '.join(missing)} (the Mosaic epilogue maps views and "
                                  "elementwise ops onto the output tile)")
    geometry = _geometry(term)
    params, grid = geometry.params, FlatGrid(geometry)
    parts = k_ranges(term)
    ranges = plan_taps(grid, [(part.channels, part.taps) for part in parts])
    steps = sum(r.steps for r in ranges)
    blocks = default_blocks(grid, geometry.out_features, steps)
    n_padded = -(-geometry.out_features // blocks.cta_tile_n) * blocks.cta_tile_n

    statistics, computed = [], []
    for reduction in kernel.hosted:
        if ctx.pending.get(reduction) is not None:
            continue  # an earlier host wrote partials: not a statistic this template writes alone
        try:
            statistics.append(GroupStatistic.of(reduction, term))
        except NotImplementedError:
            continue  # the driver reduces it after this kernel
        computed.append(reduction)
    try:
        out, partials = conv_halo.emit(kernel, ctx, geometry, parts, sub_tile_epilogue(epilogue, params.out_spec),
                                       statistics, finished=bool(computed) and set(computed) <= ctx.finishing,
                                       reductions=computed)
        return {**out, **{r: jnp.reshape(p.value, parse_type(r.ty).shape) if isinstance(p, Finished) else Partials(p)
                          for r, p in zip(computed, partials)}}
    except conv_halo.HaloUncovered:
        pass  # the flat-grid template below: its input laid out by an XLA fusion
    m_padded = -(-grid.rows // blocks.tile_m) * blocks.tile_m
    q = np.arange(m_padded).reshape(1, m_padded, 1)
    out_index, _valid = grid.output_index(q, np.arange(geometry.out_features).reshape(1, 1, -1))
    tensors, operands = mm.mapped_operands(epilogue, out_index, (1, m_padded, geometry.out_features), ctx.value)

    # Operand expressions (views, casts, a GroupNorm apply + SiLU) evaluated whole: XLA fuses each
    # into one pass that writes the range's input in the flat grid's layout.
    known = _Evaluator({}, ctx.constants, ctx.payloads)
    known.values = ctx.values
    evaluator = _Evaluator({}, ctx.constants, ctx.payloads, parent=known)
    values = evaluator.run([e for part in parts for e in (part.lhs, part.rhs)])
    dot_dtype = jnp.dtype(lhs_type.dtype)
    inputs, weights = [], []
    for part, r, x, w in zip(parts, ranges, values[0::2], values[1::2]):
        x = lax.slice_in_dim(x, part.lhs_offset, part.lhs_offset + part.channels, axis=params.lhs_spec[1])
        w = lax.slice_in_dim(w, part.rhs_offset, part.rhs_offset + part.channels, axis=params.rhs_spec[1])
        (y0, y1), (x0, x1) = part.taps
        w_window = tuple(parse_type(part.rhs.ty).shape[a] for a in params.rhs_spec[2:])
        if w_window != (y1 - y0, x1 - x0):  # the full window: keep the taps the range runs
            w = lax.slice_in_dim(w, y0, y1, axis=params.rhs_spec[2])
            w = lax.slice_in_dim(w, x0, x1, axis=params.rhs_spec[3])
        inputs.append(layout_input(x.astype(dot_dtype), grid, params.lhs_spec, r))
        weights.append(layout_weights(w.astype(dot_dtype), params.rhs_spec, r, n_padded))

    flat = build(inputs, weights, ranges, grid, epilogue=sub_tile_epilogue(epilogue, params.out_spec)(tensors),
                 operands=operands, out_dtype=out_type.dtype, blocks=blocks, interpret=ctx.interpret, name=kernel.name,
                 statistics=statistics)
    flat, partials = flat if statistics else (flat, ())
    return {term: unflatten(flat, grid, geometry.out_features), **{r: Partials(p) for r, p in zip(computed, partials)}}
