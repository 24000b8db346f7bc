"""Weight layouts a Mosaic template reads, as tensor terms the prepare stage can compute once
(`emit.prepare.split_plan` asks `prepared_layouts` for each per-call kernel the Mosaic backend
emits; the template finds the prepared tensor in its context's values, else lays the weight out
per call as before).

    halo_weight_layout(conv)   the haloed conv's `[window · C, N↑]` weight, or its phase form's
                               `[4 · 2 · 2 · C, Cout]` sums of taps (`emit.mosaic.conv_halo`)
    head_padded_weight(mm, D)  a projection's `[K, N]` weight with zero columns after each head of D
                               (rows=True: zero rows, to_out), heads padded to wgmma's width for the
                               attention (`emit.mosaic.attention`; chosen by `emit.prepare`)
    prepared_layouts(kernel)   every such layout of one kernel (what a shared emission passes it)
    side_values(tensor)        the keys of a tensor's other forms templates leave in the context

A layout is a `Pointwise` term over the kernel's own weight expression (views of prepared weights,
a merged shortcut's `concat(w, pad(w1x1))`), built the same way here at split time and in the
template at emission, so the interned term is the key both sides meet on. Only layouts that are
not already a view of the weight are made (a prepared `[ky, kx, in, out]` weight whose N the tiles
divide is read as it lies).
"""

from __future__ import annotations

import functools
import math

from eqsat.term import Term
from eqsat.types import ints_key, parse_type, with_shape


def halo_weight_layout(term: Term) -> Term | None:
    """The tensor the haloed conv template reads as its weight when the prepare stage computes it:
    `conv_halo.layout_weight` (rows `[ky, kx, in]`, N zero-padded to the template's tiles) or, for a
    conv over a nearest-2x upsample, `conv_halo.phase_weights` as `[16 · C, Cout]`; None when the
    template does not take the conv, or reads its weight in place already."""
    from emit.pallas.conv import k_ranges
    from eqsat.conv_params import ConvParams
    from eqsat.cost.mosaic import conv_work, halo_weight_in_place
    from eqsat.tiling.conv import ConvGeometry
    from eqsat.tiling.mosaic import upsample_source

    if term.op != "Conv":
        return None
    lhs, rhs, params_key, _epilogue, ty = term.args
    if parse_type(lhs.ty).dtype != parse_type(rhs.ty).dtype:
        return None
    try:
        work = conv_work(term)
        params = ConvParams.parse(params_key)
        geometry = ConvGeometry(params, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape, parse_type(ty).shape)
        ranges = k_ranges(term)
    except (NotImplementedError, ValueError):
        return None
    if not work.haloed:
        return None
    spec = params.rhs_spec
    hwio = _transpose(rhs, (spec[2], spec[3], spec[1], spec[0]))  # [ky, kx, in, out]
    kh, kw, cin, cout = parse_type(hwio.ty).shape
    if len(ranges) == 1 and upsample_source(ranges[0].lhs, geometry) is not None:
        layout = _reshape(phase_weights(hwio), (16 * cin, cout))
    elif halo_weight_in_place(rhs, params_key, None, work.weight_columns, cout, None, prepared=False):
        return None
    else:
        layout = _reshape(hwio, (kh * kw * cin, cout))
        if work.weight_columns > cout:
            layout = _pad_columns(layout, work.weight_columns)
    return Term("Pointwise", layout, layout.ty)


def phase_weights(hwio: Term) -> Term:
    """`conv_halo.phase_weights` as a term over a `[3, 3, C, Cout]` weight: per output phase `(py, px)`
    the 2x2 window whose tap `(a, b)` sums, in the same order, the taps reading that source pixel;
    `[4, 2, 2, C, Cout]`."""
    from eqsat.tiling.mosaic import PHASE_OFFSET

    _, _, cin, cout = parse_type(hwio.ty).shape
    phases = []
    for py in (0, 1):
        for px in (0, 1):
            rows = []
            for a in (0, 1):
                taps = [functools.reduce(_add, [_tap(hwio, ky, kx) for ky in range(3) for kx in range(3)
                                                if (PHASE_OFFSET[py, ky], PHASE_OFFSET[px, kx]) == (py + a, px + b)])
                        for b in (0, 1)]
                rows.append(_concat(taps, 1))            # [1, 2, C, Cout]
            phases.append(_reshape(_concat(rows, 0), (1, 2, 2, cin, cout)))
    return _concat(phases, 0)


def _tap(hwio: Term, ky: int, kx: int) -> Term:
    return _slice(_slice(hwio, 0, ky, ky + 1), 1, kx, kx + 1)


def _slice(x: Term, axis: int, start: int, stop: int) -> Term:
    shape = list(parse_type(x.ty).shape)
    shape[axis] = stop - start
    return Term("Slice", x, axis, start, stop, 1, with_shape(x.ty, shape))


def _add(x: Term, y: Term) -> Term:
    return Term("Binary", "add", x, y, x.ty)


def _concat(parts: list[Term], axis: int) -> Term:
    out = parts[0]
    for part in parts[1:]:
        shape = list(parse_type(out.ty).shape)
        split = shape[axis]
        shape[axis] += parse_type(part.ty).shape[axis]
        out = Term("Concat", out, part, axis, split, with_shape(out.ty, shape))
    return out


def _reshape(x: Term, shape) -> Term:
    return Term("Reshape", x, with_shape(x.ty, shape))


def _transpose(x: Term, order) -> Term:
    shape = parse_type(x.ty).shape
    return Term("Transpose", x, ints_key(order), with_shape(x.ty, [shape[a] for a in order]))


def _pad_columns(x: Term, columns: int) -> Term:
    rows, cols = parse_type(x.ty).shape
    zero = Term("Lit", 0.0, with_shape(x.ty, ()))
    return Term("Pad", x, zero, f"0,0,0;0,{columns - cols},0", with_shape(x.ty, (rows, columns)))


def prepared_layouts(term: Term) -> list[Term]:
    """Every layout of a kernel's weights the prepare stage may have made for the Mosaic templates
    (what they look up in their context's values): what a shared emission must pass them
    (`emit.pallas.emit_shared`). The haloed conv's; a projection's with padded heads, for every head
    width its N is whole heads of (`emit.mosaic.matmul.prepared_head_padding`), and to_out's with zero
    rows (`prepared_padded_input`)."""
    from eqsat.cost.mosaic import reads_padded_heads

    if term.op == "Conv":
        layouts = [halo_weight_layout(term)]
    elif term.op == "Matmul":
        lhs, rhs, dims, _epilogue, ty = term.args
        n = parse_type(ty).shape[-1] if parse_type(ty).shape else 1
        layouts = [head_padded_weight(term, head) for head in padded_head_widths(n)]
        found = reads_padded_heads(lhs, rhs, dims)
        if found is not None:
            layouts.append(head_padded_weight(term, found[1], rows=True))
    else:
        layouts = []
    return [layout for layout in layouts if layout is not None]


def padded_head_widths(n: int) -> list[int]:
    """The head widths a projection's `n` output columns could be whole heads of that wgmma pads
    (`eqsat.tiling.mosaic.padded_head`): the widths `head_padded_weight` is asked for."""
    from eqsat.tiling.mosaic import MAX_HEAD, padded_head

    return [head for head in range(1, min(n, MAX_HEAD) + 1) if n % head == 0 and padded_head(head) != head]


def side_values(term: Term) -> list:
    """The keys under which a Mosaic template leaves, beside a tensor's value, another form of it in
    its context's values for the kernels that read it (`padded_heads_key`, `padded_rows_key`): what a shared emission
    passes in for the tensors a kernel reads and hands back for the tensor it writes."""
    return [padded_heads_key(term), padded_rows_key(term)]


def padded_rows_key(tensor: Term) -> tuple:
    """The key under which the Mosaic matmul leaves, in its context's values, the padded `[1, rows,
    columns]` array it stored `tensor` in when TMA could not store it as it lies (77-token rows;
    `eqsat.cost.mosaic.padded_store`), for the Mosaic matmuls that read it as their A or a residual
    (`eqsat.cost.mosaic.reads_padded_rows`, `padded_residuals`) instead of padding its slice again."""
    return ("mosaic rows padded", tensor)


def prepared_halo_weight(ctx, term: Term, columns: int):
    """The haloed conv's weight as the prepare stage laid it out (`halo_weight_layout`), when the
    context holds it with `columns` columns (the template's N↑, or Cout in the phase form); else None
    (the template lays the weight out per call)."""
    layout = halo_weight_layout(term)
    value = ctx.values.get(layout) if layout is not None else None
    if value is None or value.shape[-1] != columns:
        return None
    return value


# --- heads padded to wgmma's width in the projections' weights (the Mosaic attention) --------------


def padded_heads_key(tensor: Term) -> tuple:
    """The key under which a Mosaic template leaves, in its context's values, `tensor` stored with
    each head zero-padded to wgmma's width (`[..., groups · padded]` for `[..., groups · head]`): a
    projection computed with `head_padded_weight`'s columns (`emit.mosaic.matmul`), read by the
    attention as it lies (`emit.mosaic.attention`)."""
    return ("mosaic heads padded", tensor)


def head_padded_weight(term: Term, head: int, rows: bool = False) -> Term | None:
    """The prepared weight a `Matmul` (no batch axes) reads to write its `[.., N]` output with each
    of its `N / head` column groups zero-padded to `padded_head(head)` columns: its `[K, N]` weight
    with zero columns after each group (SD 1.5's to_q/k/v have no bias: the padded columns come out
    0); with `rows`, the weight with zero rows after each of its `K / head` row groups, for A an
    attention's output with padded heads (to_out: its padded lanes meet zeros). None when the matmul
    has batch axes or N (K) is not whole heads."""
    from emit.pallas.matmul import DotAxes
    from eqsat.tiling.mosaic import padded_head

    if term.op != "Matmul":
        return None
    lhs, rhs, dims, _epilogue, _ty = term.args
    axes = DotAxes.of(dims, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape)
    rhs_shape = parse_type(rhs.ty).shape
    k = math.prod(rhs_shape[a] for a in axes.rhs_contract)
    n = math.prod(rhs_shape[a] for a in axes.rhs_free)
    padded = padded_head(head)
    if axes.batch_shape or (k if rows else n) % head or padded == head:
        return None
    matrix = _reshape(_transpose(rhs, (*axes.rhs_contract, *axes.rhs_free)), (k, n))
    zero = Term("Lit", 0.0, with_shape(matrix.ty, ()))
    if rows:
        grouped = _reshape(matrix, (k // head, head, n))
        wide = Term("Pad", grouped, zero, f"0,0,0;0,{padded - head},0;0,0,0",
                    with_shape(grouped.ty, (k // head, padded, n)))
        layout = _reshape(wide, (k // head * padded, n))
    else:
        grouped = _reshape(matrix, (k, n // head, head))
        wide = Term("Pad", grouped, zero, f"0,0,0;0,0,0;0,{padded - head},0",
                    with_shape(grouped.ty, (k, n // head, padded)))
        layout = _reshape(wide, (k, n // head * padded))
    return Term("Pointwise", layout, layout.ty)
