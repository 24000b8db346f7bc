"""What a Mosaic GPU template executes, read from the template's own configuration.

`eqsat.cost.work` states the Pallas Triton templates' work; this module states the Mosaic GPU
templates' (`emit/mosaic/`), from the objects they build their kernels with (`MosaicBlocks`, the
conv's `FlatGrid`, `plan_taps` and `default_blocks`, the attention's `AttentionBlocks`,
`padded_head`: `eqsat.tiling.mosaic`, which the templates import), so the model cannot drift from them:

| template | CTAs | wgmma flops (padded) | TMA loads (global -> SMEM, per CTA) | XLA fusions launched around it |
|---|---|---|---|---|
| matmul | batch · M/tile_m · N/cta_n | 2 · batch · M↑ · N↑ · K↑64 | A `[tile_m, K↑]` (or its prologue's source blocks, per step; a `RowReduce` in A: its row pass's `[tile_m, K]` blocks once more before the pipeline), B `[K↑, cta_n]`, epilogue tiles / vectors | an A that is not a view of one tensor in `[batch, rows, K]` order (transposes that cancel count as one) and whose prologue the kernel does not compute (`prologue_reads`), a B likewise: written laid out (its prologue computed once there); each array Mosaic's TMA cannot use as it lies (`matmul_in_place`: 77 rows, K = 72; an output smaller than its tiles) padded to the tiles (A, B, a residual, a row or column vector whose stride is not 16-byte aligned) and the padded output sliced back (inside its readers' fusions: no launch of its own); an A or a residual that another Mosaic matmul stored padded read from that padded store as it lies (`reads_padded_rows`, `padded_residuals`); an attention's output with padded heads (`reads_padded_heads`: prepared weight, K = H·48) read as it lies, else sliced ("attention output sliced") |
| conv (haloed: stride 1 or 2, ≤ 3x3, NHWC, K ranges of 64k channels each: `halo_parts`; over a nearest-2x upsample its phase form: the source's grid, N = 4 phases, 2x2 taps each; wide rows in column strips: `halo_tiling`) | batch · strips · m_tiles · N/tile_n (`HaloGrid`: tile_m flat rows of one image's strip, pitch W + 2, or strip width + 2; at stride 2 output pitch Wp/2) | 2 · batch · m_padded · N↑ · Σ taps · C | per K range and 64-channel chunk the CTA's padded rows and halo (`row_copies` copies of its strip's columns inside the image: `copied_columns` over the strips; two row phases at stride 2) and the range's vectors; per step a `[64, tile_n]` weight tile; the row mask; epilogue sub-tiles | the weights gathered in step order `[steps·64, N↑]` unless read as prepared (`halo_weight_in_place`: one tensor stored `[ky, kx, in, out]`, N a multiple of the tile); the ranges' vectors gathered per channel into one float32 table (unless one range reads only views; written by the Triton kernel finishing a statistic it gathers, no fusion: `emit.pallas.tables`); where the kernel does not store the output's pixels itself (`stores_pixels`: an NHWC output whose channels the N tiles divide) the output unflattened and a residual on the flat rows, unless the flat rows are the output's (a 1x1 conv without padding; storing pixels, a residual read at the output's own index is read as it lies, `pixel_reads`, and only the pixels are stored); the row mask of such a conv is a constant XLA materializes once per grid, shared by the convs of that grid, not charged (the inputs are read as they lie, the prologues run in SMEM: their repeats beyond once per element, halo rows and N tiles, are `alu_flops`) |
| conv (flat grid, the others) | m_padded/tile_m · N/cta_n (the flat grid's rows) | 2 · m_padded · N↑ · steps · 64 | per step one `[tile_m, 64]` A tile (each tap re-reads the input through L2) and a `[64, cta_n]` B tile | the input laid out: NHWC, padded, stride phases, one shifted copy per column shift (prologue once per element); the weights as `[steps·64, N↑]`; a residual gathered onto the flat grid; the output unflattened |
| attention | batch · heads · q↑/(64·wgs) | 4 · batch · heads · q↑ · kv↑ · head↑16 | Q once, K and V per key block (and the bias) | q, k, v not read where they lie (`stored_heads`: heads of one `[B, S, heads·D]` tensor, its sequence whole tiles, D a multiple of 16) written laid out, one multi-output fusion per source tensor; a materialized float32 bias; the padded output sliced (`attention_glue`) |

↑: rounded up to the tile. `steps` = Σ over K ranges of taps × 64-channel chunks (`plan_taps`).

`MosaicWork` holds that work: a `TemplateWork` (template `mosaic.<kind>`, CTAs as programs, the
padded wgmma flops, pipeline steps; `eqsat.cost.work`'s waves, serial steps and SM utilization
apply to it as to the Triton templates), the pipeline `stages`, the TMA bytes and the distinct
bytes the kernel itself reads from HBM (the laid-out operands), and the `Glue` fusions with their
HBM bytes. `eqsat.cost.backends` prices it with the roofline's own pieces:

    launch · (1 + glue fusions) + HBM bytes (the kernel's distinct reads and writes, as the roofline
    counts them, + each fusion's laid-out write and its read by the kernel) / bandwidth
    + vector flops (operand expressions once per element, in their fusion; the epilogue on the padded tile)
    + the dense work as the Triton templates' is priced: on the data sheet the useful flops at the
      peak; on a calibrated device `work.mma_seconds` of the padded wgmma (and the attention's
      softmax instructions), and its TMA bytes beyond the distinct ones (re-reads served by L2) at
      L2_BANDWIDTH, overlapped with it (the longer of the two; a one-stage ring adds them)

No Mosaic template has been timed on a GPU yet: their `TEMPLATE_FACTORS` are absent (factor 1,
no serial-step time), so on a calibrated device the Mosaic kernels run at the wgmma peak while the
Triton ones carry their measured 4-8x: an optimistic comparison until `benchmarks.calibration`
fits them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from eqsat.conv_params import ConvParams
from eqsat.cost.hosting import hosts_of, side_inputs
from eqsat.cost.terms import (VIEW_OPS, Term, args_of, expr_nodes, itemsize_of, node_vector_flops, own_flops,
                              size_of)
from eqsat.cost.tiles import conv_parts
from eqsat.cost.work import TemplateWork
from eqsat.tiling.conv import ConvGeometry
from eqsat.tiling.mosaic import (ATTENTION_EPILOGUE_OPS, CHUNK, EPILOGUE_OPS, MAX_HEAD, MMA_DTYPES, AttentionBlocks,
                                 FlatGrid, MosaicBlocks, default_blocks, fit_ring, fit_smem, fits_tiles,
                                 halo_input_loads, halo_parts, halo_tiling, halo_uncovered, matmul_in_place, minor_tile, padded_head,
                                 phase_blocks, phase_geometry, plan_taps, upsample_source, prologue_blocks, stores_pixels,
                                 tile_fits, vector_fits)
from eqsat.tiling.mosaic import SM_COUNT
from eqsat.tiling.mosaic import matmul_blocks as tiled_matmul_blocks
from eqsat.types import ints, parse_type

MOSAIC_OPS = frozenset({"Matmul", "Conv", "Attention"})
# L2 -> SM bandwidth of an H100 SXM: 5.5 TB/s measured on the H100 PCIe's 114 SMs (Chips and Cheese,
# "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023; NVIDIA publishes none) scaled to 132 SMs:
# the rate at which a conv's tap re-reads and a matmul's repeated A and B tiles reach SMEM beyond
# their first read from HBM. With >= 2 pipeline stages those loads overlap the wgmma (the loop
# takes the longer of the two); with one they add.
L2_BANDWIDTH = 5.5e12 * 132 / 114
# Instructions per score of the Mosaic attention's online softmax, counted from its source
# (`emit/mosaic/attention.py`: a subtraction of the row max and a multiply into base 2, a max, an
# `ex2.approx`, the row-sum add, the conversion of P to 16 bits; masks on the last key block only).
# Its sm_90a PTX, read at SD 1.5's 4096 x 4096 keys, heads of 40: +0.94 instructions per score in
# the key loop (12.8) against the one-FMA form it replaced (11.8, inexact at the max key: issue 17).
SOFTMAX_INSTRUCTIONS_PER_SCORE = 7
INSTRUCTION_FLOPS = 2


@dataclass(frozen=True)
class Glue:
    """An XLA fusion the template launches before or after its kernel: the laid-out copy it writes
    (which the kernel then reads), and what else it reads beyond what the roofline already charges
    the kernel (the kernel's sources are read once, by the fusion instead of the kernel; a padded
    output is written by the kernel and read back by the slice)."""

    what: str
    write_bytes: float
    read_bytes: float = 0.0
    launches: int = 1  # 0: the copy is written by another kernel of the plan (no launch of its own)

    @property
    def bytes(self) -> float:
        """HBM bytes it adds: its copy written and read by the kernel, and its other reads."""
        return 2 * self.write_bytes + self.read_bytes


@dataclass(frozen=True)
class MosaicWork:
    """The work of one kernel as its Mosaic GPU template's configuration runs it."""

    work: TemplateWork                 # template "mosaic.<kind>", CTAs, padded wgmma flops, pipeline steps
    stages: int                        # SMEM buffers in flight
    tma_bytes: float                   # global -> SMEM TMA loads of all CTAs (re-reads included)
    kernel_read_bytes: float           # distinct bytes the kernel reads (its laid-out operands)
    store_bytes: float                 # the kernel's TMA stores (its padded output)
    padded_outputs: int                # output elements the epilogue runs on (the padded tile grid)
    glue: tuple[Glue, ...] = field(default_factory=tuple)
    warpgroups: int = 3                # the memory warpgroup and the compute ones (128 threads each)
    haloed: bool = False               # a conv on the haloed template (`emit.mosaic.conv_halo`)
    weight_columns: int = 0            # the haloed conv's weight columns (N↑; 4 · Cout in the phase form)
    padded_store: tuple[int, int, int] | None = None  # the matmul's `[batch, rows, cols]` when not in place
    tile_m: int = 0                    # the haloed conv's output rows per CTA

    @property
    def ctas(self) -> int:
        return self.work.programs

    @property
    def wgmma_flops(self) -> float:
        return self.work.mma_flops

    @property
    def glue_launches(self) -> int:
        return sum(g.launches for g in self.glue)

    @property
    def glue_bytes(self) -> float:
        return sum(g.bytes for g in self.glue)

    @property
    def l2_bytes(self) -> float:
        """TMA bytes beyond each laid-out operand's first read from HBM: served by L2."""
        return max(0.0, self.tma_bytes - self.kernel_read_bytes)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _itemsize(ty: str) -> int:
    return itemsize_of(parse_type(ty).dtype)


def covers(op: str, args) -> bool:
    """Whether a Mosaic template takes a kernel of `op` with these argument types (else the
    `mosaic` backend runs it through its Triton template): 16-bit operands of one dtype, a float
    result; a conv that is 2-D, ungrouped, not transposed; a padded head of at most 192 lanes."""
    if op not in MOSAIC_OPS:
        return False
    out_ty = args[-1]
    operands = (args[0], args[1]) if op != "Attention" else (args[0], args[1], args[2])
    dtypes = {parse_type(t).dtype for t in operands if isinstance(t, str)}
    out = parse_type(out_ty).dtype if isinstance(out_ty, str) else ""
    if len(dtypes) != 1 or next(iter(dtypes)) not in MMA_DTYPES or out not in ("float16", "bfloat16", "float32"):
        return False
    if op == "Conv":
        try:
            _conv_geometry(args[0], args[1], args[2], args[4])
        except (ValueError, NotImplementedError):
            return False
    if op == "Attention":
        shapes = [parse_type(t).shape for t in operands]
        if any(len(s) != 4 for s in shapes) or shapes[1] != shapes[2] or padded_head(shapes[0][3]) > MAX_HEAD:
            return False
    return True


def covers_term(kernel: Term) -> bool:
    """`covers` for a kernel term, and its epilogue only of the ops the template maps onto its
    output tile (`EPILOGUE_OPS`; an `Iota` or a `Concat` there goes to the Triton template)."""
    if not covers(kernel.op, args_of(kernel)):
        return False
    epilogue = kernel.args[5] if kernel.op == "Attention" else kernel.args[3]
    allowed = ATTENTION_EPILOGUE_OPS if kernel.op == "Attention" else EPILOGUE_OPS
    return all(node.op in allowed for node in expr_nodes(epilogue))


# --- operand expressions -------------------------------------------------------------------------


def stored_axes(expr: Term | None) -> tuple[int, ...] | None:
    """For an operand expression that reads one tensor as it lies up to one permutation (a `Load`
    through reshapes, under at most one `Transpose`: a prepared weight stored `[K, N]` and read back
    as the `[N, K]` the plan names), each of its axes' position in the stored row-major order;
    None for anything else. The tensor's stored order is its template's (`written_order`: the Mosaic
    attention writes `[B, S, H, D]`), so a transpose that cancels it, under reshapes (the attention's
    output read back as `[B, S, H·D]`), is the identity. Types only (None): the identity."""
    if expr is None:
        return None
    node, outer = expr, False
    while node.op == "Reshape":
        node, outer = node.args[0], True
    perm = None
    if node.op == "Transpose":
        perm, node = ints(node.args[1]), node.args[0]
    inner = False
    while node.op == "Reshape":
        node, inner = node.args[0], True
    if node.op != "Load":
        return None
    written = None if inner else written_order(node.args[0])
    if perm is None and written is None:
        return tuple(range(len(parse_type(expr.ty).shape)))
    composed = tuple(written[a] for a in perm) if written is not None and perm is not None else (perm or written)
    if not outer:
        return tuple(composed)
    shape = parse_type(node.ty).shape if perm is None else [parse_type(node.ty).shape[a] for a in perm]
    kept = [position for position, size in zip(composed, shape) if size != 1]
    return tuple(range(len(parse_type(expr.ty).shape))) if kept == sorted(kept) else None


def written_order(tensor: Term) -> tuple[int, ...] | None:
    """Where a Mosaic template stores each axis of the tensor it writes, when not in the term's own
    order: the attention's `[B, H, S, D]` output as `[B, S, H, D]` when it reads q so
    (`seq_major`, `emit.mosaic.attention.Layouts`); else None (row-major in its own order)."""
    if tensor.op == "Attention" and seq_major(tensor.args[0]):
        return (0, 2, 1, 3)
    return None


def seq_major(operand: Term) -> bool:
    """`emit.mosaic.attention.reads_seq_major` on shapes: an attention operand `[B, H, S, D]` that is a
    view of one tensor in which consecutive sequence positions lie further apart than consecutive
    heads (a `[B, S, H·D]` projection read per head, a fused QKV's slice)."""
    _, heads, seq, _ = parse_type(operand.ty).shape
    if heads == 1 or seq == 1:
        return False
    origin, next_head, next_row = (view_offset(operand, i) for i in ((0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0)))
    if origin is None or next_head is None or next_row is None:
        return False
    return abs(next_row - origin) > abs(next_head - origin)


@dataclass(frozen=True)
class StoredHeads:
    """An attention operand `[B, H, S, D]` that is heads `head0 .. head0 + H` of one tensor stored
    `[B, S, heads, D]` (a `[B, S, heads·D]` projection's output; a fused QKV's q, k or v at head
    `head0` = its column offset / D): the kernel TMA-reads its tiles there, no copy."""

    tensor: Term
    heads: int
    head0: int


def stored_heads(operand: Term | None, rows_tile: int, padded_heads: bool = False) -> StoredHeads | None:
    """The operand as `StoredHeads` when the Mosaic attention reads it in place
    (`emit.mosaic.attention.emit`): a view (`view_offset`) of one tensor of the operand's dtype whose
    element `(b, h, s, d)` lies at `b·S·C + s·C + (head0 + h)·D + d` (C the tensor's row of `heads`
    heads of D), D a multiple of wgmma's 16 (no head padding; any D with `padded_heads`: the heads
    of a projection that writes them padded, `padded_by_projection`) and S of `rows_tile` (the
    CTA's query rows, or the key block: no sequence padding); else None (XLA writes the operand
    laid out)."""
    if operand is None:
        return None
    batch, heads, seq, head = parse_type(operand.ty).shape
    if (head != padded_head(head) and not padded_heads) or seq % rows_tile or seq < 2:
        return None
    node = operand
    while node.op in ("Reshape", "Transpose", "Slice", "Broadcast"):
        node = node.args[0]
    if node.op != "Load" or parse_type(node.ty).dtype != parse_type(operand.ty).dtype:
        return None
    tensor = node.args[0]
    at = functools.partial(_offset_at, operand)
    origin = at(0, 0, 0, 0)
    if origin is None:
        return None
    pitch = at(0, 0, 1, 0)
    if pitch is None or (pitch := pitch - origin) <= 0 or pitch % head or origin % pitch % head or origin >= pitch:
        return None
    expected = lambda b, h, s, d: origin + b * seq * pitch + s * pitch + h * head + d  # noqa: E731
    corners = [(b, h, s, d) for b in {0, batch - 1} for h in {0, heads - 1} for s in {0, 1, seq - 1}
               for d in {0, 1 % head, head - 1}]
    if any(at(*index) != expected(*index) for index in corners):
        return None
    if math.prod(parse_type(tensor.ty).shape) != batch * seq * pitch:
        return None
    return StoredHeads(tensor, pitch // head, origin // head)


def padded_by_projection(operand: Term | None, rows_tile: int) -> StoredHeads | None:
    """The operand's `stored_heads` (heads of D not a multiple of 16 allowed) when they are heads of a
    `Matmul` that writes them zero-padded to wgmma's width, each of its `N / D` column groups: a
    weight the prepare stage lays out (`prepared_weight`; `emit.mosaic.layouts.head_padded_weight`,
    zero columns after each head) and an epilogue that keeps 0 at 0 (a cast, no bias: SD 1.5's
    to_q/k/v); `emit.prepare` checks that nothing else reads the projection. Else None."""
    found = stored_heads(operand, rows_tile, padded_heads=True) if operand is not None else None
    if found is None or padded_head(parse_type(operand.ty).shape[3]) == parse_type(operand.ty).shape[3]:
        return None
    projection = found.tensor
    if projection.op != "Matmul" or not zero_preserving(projection.args[3]) or not prepared_weight(projection.args[1]):
        return None
    return found


def padded_attention_output(attention: Term) -> int | None:
    """The padded head `emit.mosaic.attention` writes its output at, `[B, S, H, padded]` unsliced
    in its context (`emit.mosaic.layouts.padded_heads_key`), when the head is padded and the output
    is written seq-major with whole query tiles; else None (the output is sliced to its head)."""
    if attention.op != "Attention":
        return None
    q, k = attention.args[0], attention.args[1]
    _, _, q_len, head_dim = parse_type(q.ty).shape
    blocks = AttentionBlocks.get_default(q_len, parse_type(k.ty).shape[2], head_dim)
    head = padded_head(head_dim)
    if head == head_dim or q_len % (blocks.block_q * blocks.compute_wgs) or not seq_major(q):
        return None
    return head


def reads_padded_heads(lhs: Term | None, rhs: Term | None, dims: str) -> tuple[Term, int] | None:
    """`(attention, head_dim)` when a matmul's A is an attention's output read `[M, H·D]` in the
    order it is stored (to_out over `[B, S, H, D]`), the attention writes it with padded heads
    (`padded_attention_output`) and the weight is prepared (`prepared_weight`: the prepare stage
    lays it out with zero rows after each head, `emit.mosaic.layouts.head_padded_weight(rows=True)`):
    the matmul then reads the padded output as it lies, K = H·padded. Else None."""
    if lhs is None or rhs is None or not is_view(lhs) or not prepared_weight(rhs):
        return None
    tensors = loaded_tensors(lhs)
    if len(tensors) != 1 or padded_attention_output(tensors[0]) is None:
        return None
    attention = tensors[0]
    shape = matmul_layout(lhs.ty, rhs.ty, dims)
    head_dim = parse_type(attention.ty).shape[3]
    if shape.batch != 1 or shape.k % head_dim or size_of(lhs.ty) != size_of(attention.ty) or \
            not read_in_order(lhs, shape.lhs_order, shape.lhs_ordered):
        return None
    return attention, head_dim


def padded_store(tensor: Term) -> tuple[int, int, int] | None:
    """`(batch, rows, columns)` of the padded array the Mosaic matmul template stores `tensor` in when
    Mosaic's TMA cannot store it as it lies (`matmul_in_place`: 77-token rows), kept unsliced in the
    context for the readers that take it (`emit.mosaic.layouts.padded_rows_key`); None when `tensor`
    is not a Mosaic matmul's output or is stored in place."""
    if tensor.op != "Matmul" or not covers_term(tensor):
        return None
    return mosaic_work_cached(tensor).padded_store  # once per term: a chain of matmuls asks down the chain


def takes_padded_store(tensor: Term, rows: int, columns: int, exact_columns: bool) -> bool:
    """Whether a Mosaic matmul reading `tensor` as a `[rows, columns]` matrix (batch 1, in its stored
    order) reads its padded store (`padded_store`) as it lies: one batch, at least `rows` rows (the
    rows past them are computed into rows the reader drops, TMA's zeros past the store's end) and
    `columns` columns, exactly so for an A (padded columns would add to the sum over K)."""
    store = padded_store(tensor)
    if store is None or size_of(tensor.ty) != rows * columns:
        return False
    batch, stored_rows, stored_columns = store
    return batch == 1 and stored_rows >= rows and (stored_columns == columns if exact_columns
                                                   else stored_columns >= columns)


def reads_padded_rows(lhs: Term | None, rhs: Term | None, dims: str) -> Term | None:
    """The matmul whose padded store (`padded_store`) a matmul reads as its A as it lies: A a view of
    that one tensor in `[rows, K]` order, batch 1, the store's columns exactly K. Else None."""
    if lhs is None or rhs is None or not is_view(lhs):
        return None
    tensors = loaded_tensors(lhs)
    if len(tensors) != 1:
        return None
    shape = matmul_layout(lhs.ty, rhs.ty, dims)
    if shape.batch != 1 or not read_in_order(lhs, shape.lhs_order, shape.lhs_ordered) or \
            not takes_padded_store(tensors[0], shape.m, shape.k, exact_columns=True):
        return None
    return tensors[0]


def padded_residuals(epilogue: Term | None, batch: int, m: int, n: int) -> list[Term]:
    """The tensors of the output's size an epilogue reads whose padded store a matmul of one batch
    reads as it lies (`takes_padded_store`): a residual a padded matmul wrote."""
    if epilogue is None or batch != 1:
        return []
    return [t for t in loaded_tensors(epilogue) if takes_padded_store(t, m, n, exact_columns=False)]


def zero_preserving(epilogue: Term) -> bool:
    """Whether a matmul epilogue is its accumulator, converted at most (0 stays 0, reads nothing else)."""
    node = epilogue
    while node.op == "Unary" and node.args[0] == "convert":
        node = node.args[1]
    return node.op == "Acc"


def _offset_at(operand: Term, *index) -> int | None:
    return view_offset(operand, index)


def view_offset(expr: Term, index) -> int | None:
    """The flat offset, in the one tensor a view expression loads (through reshapes, transposes,
    slices and broadcasts), of its element at `index`; None for anything else."""
    node, at = expr, [int(i) for i in index]
    while True:
        shape = parse_type(node.ty).shape
        if node.op == "Load":
            return int(np.ravel_multi_index(at, shape)) if shape else 0
        if node.op == "Reshape":
            child = node.args[0]
            flat = int(np.ravel_multi_index(at, shape)) if shape else 0
            at = [int(i) for i in np.unravel_index(flat, parse_type(child.ty).shape)] if parse_type(child.ty).shape else []
        elif node.op == "Transpose":
            child, perm = node.args[0], ints(node.args[1])
            inner = [0] * len(perm)
            for position, axis in enumerate(perm):
                inner[axis] = at[position]
            at = inner
        elif node.op == "Slice":
            child, axis, start, _stop, stride = node.args[:5]
            at[axis] = start + at[axis] * stride
        elif node.op == "Broadcast":
            child, dims = node.args[0], ints(node.args[1])
            child_shape = parse_type(child.ty).shape
            at = [at[d] if child_shape[i] != 1 else 0 for i, d in enumerate(dims)]
        else:
            return None
        node = child


def read_in_order(expr: Term | None, order: tuple[int, ...], ordered_by_type: bool) -> bool:
    """Whether the template reads the operand `expr` as it lies when it wants its axes in `order`
    (batch, rows, K for A; batch, K, columns for B): a view of one tensor whose stored order lists
    them so (size-1 axes aside; transposes cancel, no copy). Types only: `ordered_by_type`."""
    if expr is None:
        return ordered_by_type
    axes = stored_axes(expr)
    if axes is None:
        return False
    shape = parse_type(expr.ty).shape
    kept = [axes[a] for a in order if shape[a] != 1]
    return kept == sorted(kept)


def is_view(expr: Term | None) -> bool:
    """Whether an operand expression computes nothing (loads and index arithmetic only)."""
    if expr is None:
        return True
    return all(node.op in VIEW_OPS or node.op in ("Load", "Lit") for node in expr_nodes(expr))


def once_flops(*exprs: Term, seen: set | None = None) -> float:
    """Vector flops of expressions computed once per element (as an XLA fusion does), each node once;
    nodes whose id is in `seen` are not counted again (and those counted are added to it)."""
    flops, seen = 0.0, set() if seen is None else seen
    for expr in exprs:
        for node in expr_nodes(expr):
            if id(node) in seen:
                continue
            seen.add(id(node))
            flops += node_vector_flops(node)
    return flops


def loaded_tensors(expr: Term) -> list[Term]:
    """The distinct tensors `expr` loads, in the order its nodes first load them."""
    tensors, seen = [], set()
    for node in expr_nodes(expr):
        if node.op == "Load" and id(node.args[0]) not in seen:
            seen.add(id(node.args[0]))
            tensors.append(node.args[0])
    return tensors


def pixel_reads(epilogue: Term | None, out_elements: int) -> list[int]:
    """Itemsizes of the tensors of the output's size an epilogue reads only at the output's own
    element (through elementwise nodes and reshapes: a residual): the haloed conv storing pixels
    reads them as they lie (`emit.mosaic.conv_halo.pixel_operands`), one per tensor."""
    if epilogue is None:
        return []
    own, other = {}, set()
    stack = [(epilogue, True)]
    seen = set()
    while stack:
        node, at_own = stack.pop()
        if (id(node), at_own) in seen:
            continue
        seen.add((id(node), at_own))
        if node.op == "Load":
            tensor = node.args[0]
            if at_own and size_of(tensor.ty) == out_elements:
                own[id(tensor)] = _itemsize(tensor.ty)
            else:
                other.add(id(tensor))
            continue
        through = at_own and node.op in ("Unary", "Binary", "Select", "Reshape")
        stack.extend((child, through and size_of(child.ty) == size_of(node.ty))
                     for child in node.children if child.sort == "Expr")
    return [item for key, item in own.items() if key not in other]


@dataclass(frozen=True)
class EpilogueReads:
    """The epilogue's operands as the Mosaic templates lay them out (`mapped_operands`): tiles
    (a residual: `[rows, columns]`), column vectors (a bias) and row vectors, with their itemsizes."""

    tiles: tuple[int, ...] = ()
    cols: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()

    @property
    def smem_operands(self) -> list[tuple[str, int]]:
        """(kind, itemsize) of each, as `emit.mosaic.matmul.smem_bytes` takes them."""
        return ([("tile", i) for i in self.tiles] + [("col", i) for i in self.cols]
                + [("row", i) for i in self.rows])

    @classmethod
    def of(cls, epilogue: Term | None, out_elements: int, rows: int) -> "EpilogueReads":
        """By size: a loaded tensor of the output's size is a tile, one of `rows` elements (when not
        the column count) a row vector, anything else a column vector."""
        if epilogue is None:
            return cls()
        tiles, cols, row_vectors = [], [], []
        for tensor in loaded_tensors(epilogue):
            size, item = size_of(tensor.ty), _itemsize(tensor.ty)
            if size >= out_elements:
                tiles.append(item)
            elif size == rows and out_elements // max(rows, 1) != rows:
                row_vectors.append(item)
            else:
                cols.append(item)
        return cls(tuple(tiles), tuple(cols), tuple(row_vectors))


# --- matmul ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulLayout:
    batch: int
    m: int
    n: int
    k: int
    lhs_ordered: bool   # A's axes are (batch, rows, K) already
    rhs_ordered: bool   # B's axes are (batch, K, columns) already
    lhs_order: tuple[int, ...] = ()  # A's axes in the order the template reads them
    rhs_order: tuple[int, ...] = ()


def matmul_layout(lhs_ty: str, rhs_ty: str, dims: str) -> MatmulLayout:
    lhs, rhs = parse_type(lhs_ty).shape, parse_type(rhs_ty).shape
    lc, rc, lb, rb = (ints(part) if part else () for part in (dims.split(";") + ["", "", "", ""])[:4])
    lf = tuple(a for a in range(len(lhs)) if a not in lc and a not in lb)
    rf = tuple(a for a in range(len(rhs)) if a not in rc and a not in rb)
    batch, k = math.prod(lhs[a] for a in lb), math.prod(lhs[a] for a in lc)
    m, n = math.prod(lhs[a] for a in lf), math.prod(rhs[a] for a in rf)
    return MatmulLayout(batch, m, n, k, (*lb, *lf, *lc) == tuple(range(len(lhs))),
                        (*rb, *rc, *rf) == tuple(range(len(rhs))), (*lb, *lf, *lc), (*rb, *rc, *rf))


def matmul_blocks(m: int, n: int, k: int) -> MosaicBlocks:
    """The template's `MosaicBlocks` for an `m x k @ k x n` matmul (`emit.mosaic.matmul`)."""
    return tiled_matmul_blocks(max(m, 1), max(n, 1), max(k, 1))


# A expressions the matmul template computes in the kernel, per A tile in SMEM: elementwise ops on
# [rows, K] tiles of tensors as they lie (a column window of one: GEGLU's halves) and on vectors
# along the rows (a mean, a reciprocal deviation) or along K (gamma, beta). Not a `Transpose` (a
# permuted source, NCHW read as tokens: not [rows, K] tiles). A `RowReduce` (a LayerNorm computing
# its own statistics) is computed by a pass of the kernel over its CTA's rows before the pipeline
# (`row_reduce_declined`, `emit.mosaic.row_statistics`): the expression then reads its value as row
# vectors in registers ("stat" reads).
PROLOGUE_OPS = frozenset({"Load", "Lit", "Unary", "Binary", "Select", "Reshape", "Broadcast", "Slice"})
ROW_PASS_FIELDS = {"sum": 1, "moments": 2}  # the reductions the kernel's row pass computes: their fields
# The longest row the pass reduces: its `length / tile_k` chunks are read again by every N-tile CTA
# before the first MMA (SD 1.5's LayerNorms: 320 to 1280).
ROW_PASS_MAX_LENGTH = 2048

def row_reduces(expr: Term) -> list[Term]:
    """The `RowReduce` nodes of `expr` outside any other (the ones the row pass computes), in order."""
    found, seen, stack = [], set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "RowReduce":
            found.append(node)
            continue
        stack.extend(reversed([c for c in node.children if c.sort == "Expr"]))
    return found


def row_reduce_declined(node: Term, tile_k: int) -> str | None:
    """Why the matmul's row pass does not compute the `RowReduce` `node` of its A expression, or None:
    a sum or moments, an epilogue of prologue ops on its one accumulator (a mean: the sum / K), a
    body of prologue ops (no reduction inside) over at most `ROW_PASS_MAX_LENGTH` elements, a
    multiple of the K step."""
    op, body, axis, epilogue, _ty = node.args
    if op not in ROW_PASS_FIELDS:
        return f"a {op} RowReduce in A (the row pass computes sums and moments)"
    outer = {n.op for n in expr_nodes(epilogue)} - PROLOGUE_OPS - {"Acc"}
    if outer or len({n for n in expr_nodes(epilogue) if n.op == "Acc"}) != 1:
        return f"a RowReduce in A whose epilogue has {', '.join(sorted(outer)) or 'several accumulators'}"
    inner = {n.op for n in expr_nodes(body)} - PROLOGUE_OPS
    if inner:
        return f"a RowReduce in A whose body has {', '.join(sorted(inner))}"
    length = parse_type(body.ty).shape[axis]
    if length % tile_k or length > ROW_PASS_MAX_LENGTH:
        return (f"a RowReduce in A over {length} elements (the row pass takes multiples of {tile_k} up to "
                f"{ROW_PASS_MAX_LENGTH})")
    return None


def split_row_reduces(expr: Term) -> tuple[Term, list[tuple[Term, Term]]]:
    """`expr` with each outer `RowReduce` replaced by its epilogue reading a stand-in tensor of its
    accumulator's type (an `Input` named after its place) for the accumulator, and the
    `(stand-in, RowReduce)` pairs: what the prologue reads once the row pass has computed the
    reductions (`row_reduce_declined` says which it takes: one accumulator in the epilogue)."""
    Node = type(expr)  # eqsat.term.Term (the cost model reads terms by duck typing, imports none)

    def rebuilt(node, replace, memo):
        if node in replace:
            return replace[node]
        if node not in memo:
            args = [rebuilt(a, replace, memo) if isinstance(a, Node) and a.sort == "Expr" else a for a in node.args]
            memo[node] = Node(node.op, *args)
        return memo[node]

    pairs, replace = [], {}
    for i, node in enumerate(row_reduces(expr)):
        epilogue = node.args[3]
        accumulators = {n for n in expr_nodes(epilogue) if n.op == "Acc"}
        acc_ty = next(iter(accumulators)).ty if accumulators else node.ty
        stand_in = Node("Input", f"mosaic-row-pass-{i}", acc_ty)
        loaded = Node("Load", stand_in, acc_ty)
        replace[node] = rebuilt(epilogue, {acc: loaded for acc in accumulators}, {})
        pairs.append((stand_in, node))
    if not pairs:
        return expr, []
    return rebuilt(expr, replace, {}), pairs


def derived_sum(node: Term, nodes: list[Term]) -> int | None:
    """The index in `nodes` of the `moments` reduction of the same body and axis as the `sum` `node`
    (the row pass reads the sum off its mean: `emit.mosaic.row_statistics.RowPass.derived`), or None."""
    if node.args[0] != "sum":
        return None
    return next((i for i, other in enumerate(nodes) if other.args[0] == "moments"
                 and other.args[1] is node.args[1] and other.args[2] == node.args[2]), None)


def prologue_reads(lhs: Term, rhs: Term, dims: str, out_ty: str) -> "list[tuple[str, int]] | str":
    """The A prologue's sources as the matmul template reads them in the kernel, `(kind, itemsize)`
    each (`tile`, `col` along K, `row` along the rows; the row pass's `stat`, `pass_tile`,
    `pass_col`: `_PASS_KINDS`); or why the template does not compute this A in the kernel (A read
    as it lies needs no prologue; other forms XLA computes whole, one fusion). By sizes and types,
    as `EpilogueReads` (`emit.mosaic.matmul.prologue_sources` maps the loads by their indices and
    also declines, to the fusion, a tile that is not a `[rows, K]` window)."""
    shape = matmul_layout(lhs.ty, rhs.ty, dims)
    batch, m, n, k = shape.batch, shape.m, shape.n, shape.k
    blocks = prologue_blocks(matmul_blocks(m, n, k))
    if read_in_order(lhs, shape.lhs_order, shape.lhs_ordered) and matmul_in_place(m, n, k, blocks).a:
        return "A is read as it lies"
    for node in row_reduces(lhs):
        why = row_reduce_declined(node, blocks.tile_k)
        if why is not None:
            return why
    applied, passes = split_row_reduces(lhs)
    ops = {node.op for node in expr_nodes(applied)}
    if not ops <= PROLOGUE_OPS:
        return f"an A expression with {', '.join(sorted(ops - PROLOGUE_OPS))}"
    if k % blocks.tile_k:
        return f"K = {k} is not a multiple of the {blocks.tile_k}-element steps"
    stand_ins = {id(stand_in): node for stand_in, node in passes}
    reads = []
    for tensor in loaded_tensors(applied):
        if id(tensor) in stand_ins:  # a reduction's fields as row vectors in registers
            reads.extend([("stat", 4)] * ROW_PASS_FIELDS[stand_ins[id(tensor)].args[0]])
            continue
        why = _read_of(tensor, batch, m, k, blocks.tile_k, reads)
        if why is not None:
            return why
    if not any(kind == "tile" for kind, _ in reads):
        return "no [rows, K] tile"
    read_by_a = {id(t) for t in loaded_tensors(applied)}
    for _stand_in, node in passes:
        if derived_sum(node, [n for _, n in passes]) is not None:
            continue  # read off the moments pass of the same body
        length = parse_type(node.args[1].ty).shape[node.args[2]]
        body_reads: list = []
        for tensor in loaded_tensors(node.args[1]):
            if id(tensor) not in read_by_a:
                return "a RowReduce in A over a tensor the expression does not read itself"
            why = _read_of(tensor, batch, m, length, blocks.tile_k, body_reads)
            if why is not None:
                return why
        if any(kind == "row" for kind, _ in body_reads):
            return "a RowReduce in A whose body reads a vector along the rows"
        reads.extend((f"pass_{kind}", item) for kind, item in body_reads)
    return reads


def _read_of(tensor: Term, batch: int, m: int, k: int, tile_k: int, reads: list) -> str | None:
    """Append how the prologue reads `tensor` over `[batch, m, k]` to `reads` (tiles, row or K
    vectors), or return why it cannot."""
    size, item = size_of(tensor.ty), _itemsize(tensor.ty)
    dims_of = parse_type(tensor.ty).shape
    if parse_type(tensor.ty).dtype not in ("float16", "bfloat16", "float32"):
        return f"a source of {parse_type(tensor.ty).dtype}"
    if size >= batch * m * k and dims_of:
        pitch = dims_of[-1]
        store = padded_store(tensor)  # 77-token rows: read from the matmul's padded store (`load_sources`)
        stored = store is not None and store[0] == 1 and store[2] == pitch and \
            fits_tiles(store[1], pitch, minor_tile(tile_k, item))
        if not fits_tiles(size // max(pitch, 1), pitch, minor_tile(tile_k, item)) and not stored:
            return f"a source [{size // max(pitch, 1)}, {pitch}] Mosaic's TMA cannot tile"
        # one [rows, K] window per K columns of it (GEGLU's [rows, 2K]: its value and gate halves)
        reads.extend([("tile", item)] * max(1, size // (batch * m * k)))
    elif size % m == 0 and vector_fits(m, item):  # one row vector per M values (stacked statistics)
        reads.extend([("row", item)] * max(1, size // (batch * m)))
    elif size % k == 0 and vector_fits(k, item):
        reads.extend([("col", item)] * max(1, size // (batch * k)))
    else:
        return f"a source of {size} elements, neither a [rows, K] tile nor a vector along the rows or K"
    return None


def prologue_read_bytes(kind: str, rows: int, k: int, steps: int) -> int:
    """Elements one CTA (or, with `rows` = M, the kernel once) reads of a prologue read of `kind`
    over `rows` rows and `k` columns in `steps` pipeline steps: a row vector is re-read per step."""
    return {"tile": rows * k, "col": k, "row": rows * steps, "stat": 0, "pass_tile": rows * k,
            "pass_col": k}[kind]


def row_statistic_declined(reduction: Term, host: Term) -> str | None:
    """Why the Mosaic matmul `host` does not write the hosted statistic `reduction` as per-tile
    partials (`emit.mosaic.partials`; the driver then reduces it after the host), or None when it
    does: its only host, a body reading nothing but the host's output through ops the epilogue
    lowers, one statistic output per output row in row order, the output written in place."""
    return _row_statistic_declined(reduction, host)


def epilogue_body_declined(reduction: Term, host: Term, template: str, writes: str):
    """`(why not, None)` when the Mosaic `template` (the host's op: "Matmul", "Conv") cannot compute
    the hosted statistic `reduction` in its epilogue, else `(None, ids)`: the host output's flat
    element each element of the statistic's body reads (`_host_elements`). What every epilogue
    statistic needs: its only host, a sum or moments, a body reading nothing but the host's output
    through ops the epilogue lowers."""
    if host.op != template:
        return f"a {host.op} host (the Mosaic {template.lower()} writes {writes})", None
    _producer, op, body, _axes, _ty = reduction.args
    if op not in ("sum", "moments"):
        return f"a {op} statistic", None
    if hosts_of(reduction) != [host]:
        return "a statistic with several hosts (or none)", None
    if side_inputs(reduction):
        return f"a body reading other tensors than the {template.lower()}'s output", None
    missing = sorted({node.op for node in expr_nodes(body)} - EPILOGUE_OPS)
    if missing:
        return f"a body with {', '.join(missing)}", None
    ids = _host_elements(body, host)
    if ids is None:
        return "a body that reads the output through a view the epilogue does not invert", None
    return None, ids


@functools.lru_cache(maxsize=4096)
def _row_statistic_declined(reduction: Term, host: Term) -> str | None:
    why, ids = epilogue_body_declined(reduction, host, "Matmul", "row statistics")
    if why is not None:
        return why
    axes = reduction.args[3]
    lhs, rhs, dims, _epilogue, out_ty = host.args
    n = matmul_layout(lhs.ty, rhs.ty, dims).n
    reduced = set(ints(axes))
    kept = [a for a in range(ids.ndim) if a not in reduced]
    grids = np.indices(ids.shape, sparse=True)
    slot = np.zeros((), np.int64)
    for a in kept:
        slot = slot * ids.shape[a] + grids[a]
    if not np.array_equal(np.broadcast_to(slot, ids.shape), ids // n):
        return "a statistic that is not one output per row of the matmul, in row order"
    if "output sliced" in {g.what for g in matmul_work(host).glue}:
        return "a padded output (its rows past M would be slots)"
    return None


def _host_elements(body: Term, host: Term):
    """The flat index into `host`'s output each element of `body` reads (its spine: views and
    elementwise ops), or None for a spine through anything else."""
    if body.op == "Load":
        if body.args[0] is not host:
            return None
        shape = parse_type(host.ty).shape
        return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    if body.op == "Unary":
        return _host_elements(body.args[1], host)
    if body.op == "Reshape":
        inner = _host_elements(body.args[0], host)
        return None if inner is None else inner.reshape(parse_type(body.ty).shape)
    if body.op == "Transpose":
        inner = _host_elements(body.args[0], host)
        return None if inner is None else np.transpose(inner, ints(body.args[1]))
    if body.op in ("Binary", "Select"):
        operands = {id(c): c for c in body.children if c.sort == "Expr"}  # x * x reads one element once
        found = [e for e in (_host_elements(c, host) for c in operands.values()) if e is not None]
        if len(found) != 1 or found[0].shape != tuple(parse_type(body.ty).shape):
            return None
        return found[0]
    return None


def prologue_declined(lhs: Term | None, rhs: Term | None, dims: str, out_ty: str) -> str | None:
    """None when the matmul template computes A in the kernel (`prologue_reads`), else why not."""
    if lhs is None or rhs is None:
        return "types only"
    reads = prologue_reads(lhs, rhs, dims, out_ty)
    return reads if isinstance(reads, str) else None


def matmul_work(term: Term) -> MosaicWork:
    lhs, rhs, dims, epilogue, ty = term.args
    return matmul_work_of(lhs.ty, rhs.ty, dims, ty, lhs, rhs, epilogue)


def matmul_work_of(lhs_ty: str, rhs_ty: str, dims: str, out_ty: str, lhs: Term | None = None,
                   rhs: Term | None = None, epilogue: Term | None = None) -> MosaicWork:
    """`emit.mosaic.matmul.build` on these operands: its CTAs, wgmma, TMA bytes and the fusions
    that lay A and B out (an operand computed or permuted, or padded to the tiles) and slice the
    padded output. From types alone (an e-node) operands are taken as read in place."""
    shape = matmul_layout(lhs_ty, rhs_ty, dims)
    item, out_item = _itemsize(lhs_ty), _itemsize(out_ty)
    reads = EpilogueReads.of(epilogue, shape.batch * shape.m * shape.n, shape.m)
    useful_k, padded_a = shape.k, reads_padded_heads(lhs, rhs, dims)
    padded_rows = reads_padded_rows(lhs, rhs, dims) if padded_a is None else None
    sliced_a = padded_a is None and lhs is not None and any(padded_attention_output(t) is not None
                                                             for t in loaded_tensors(lhs))
    if padded_a is not None:  # an attention's output with padded heads, its rows of the weight zero-padded
        attention, head_dim = padded_a
        shape = dataclasses.replace(shape, k=shape.k // head_dim * padded_head(head_dim))
    prologue = prologue_reads(lhs, rhs, dims, out_ty) if lhs is not None and rhs is not None else "types only"
    in_kernel = not isinstance(prologue, str)
    blocks = matmul_blocks(shape.m, shape.n, shape.k)
    blocks = fit_smem(prologue_blocks(blocks) if in_kernel else blocks, item, out_item, reads.smem_operands,
                      prologue=prologue if in_kernel else None)
    mp, np_, kp = (_round_up(shape.m, blocks.tile_m), _round_up(shape.n, blocks.cta_tile_n),
                   _round_up(shape.k, blocks.tile_k))
    ctas = shape.batch * (mp // blocks.tile_m) * (np_ // blocks.cta_tile_n)
    # which arrays the kernel uses as they lie (`matmul_in_place`), which are padded to the tiles
    place = matmul_in_place(shape.m, shape.n, shape.k, blocks, out_item)
    m, n, k, batch = shape.m, shape.n, shape.k, shape.batch
    (ma, ka), (kb, nb) = (m, k) if place.a else (mp, kp), (k, n) if place.b else (kp, np_)
    rows, cols = (m, n) if place.out else (mp, np_)
    a_bytes, b_bytes = batch * ma * ka * item, batch * kb * nb * item
    glue = [Glue("attention output sliced", 0.0, read_bytes=2 * a_bytes)] if sliced_a else []
    if in_kernel:  # the prologue's sources as they lie instead of A (the row pass re-reads them from L2)
        a_bytes = batch * sum(size * {"tile": m * k, "col": k, "row": m}.get(kind, 0) for kind, size in prologue)
    elif padded_rows is not None:  # a matmul's padded store read as it lies
        a_bytes = padded_store(padded_rows)[1] * k * item
    elif not ((padded_a is not None or read_in_order(lhs, shape.lhs_order, shape.lhs_ordered)) and place.a):
        glue.append(Glue("A laid out", a_bytes))
    if not (read_in_order(rhs, shape.rhs_order, shape.rhs_ordered) and place.b):
        glue.append(Glue("B laid out", b_bytes))
    a_tile_bytes = blocks.tile_m * kp * item if not in_kernel else sum(
        size * prologue_read_bytes(kind, blocks.tile_m, kp, kp // blocks.tile_k) for kind, size in prologue)
    tma = ctas * (a_tile_bytes + kp * blocks.cta_tile_n * item)
    tma += ctas * (sum(reads.tiles) * blocks.tile_m * blocks.cta_tile_n + sum(reads.cols) * blocks.cta_tile_n
                   + sum(reads.rows) * blocks.tile_m)
    epilogue_read = 0
    stored = padded_residuals(epilogue, batch, m, n)
    tiles = list(reads.tiles)
    for tensor in stored:  # a residual a padded matmul stored, read as it lies
        epilogue_read += math.prod(padded_store(tensor)) * _itemsize(tensor.ty)
        tiles.remove(_itemsize(tensor.ty))
    for item_bytes in tiles:
        if tile_fits(m, n, blocks, item_bytes):
            epilogue_read += batch * m * n * item_bytes
        else:
            epilogue_read += batch * rows * cols * item_bytes
            glue.append(Glue("residual padded", batch * rows * cols * item_bytes))
    for what, vectors, length, padded in (("column", reads.cols, n, cols), ("row", reads.rows, m, rows)):
        for item_bytes in vectors:
            if vector_fits(length, item_bytes):
                epilogue_read += batch * length * item_bytes
            else:
                epilogue_read += batch * padded * item_bytes
                glue.append(Glue(f"{what} vector padded", batch * padded * item_bytes))
    if not place.out:  # read back by the slice, which XLA fuses into its readers' fusions (a pad, a layout)
        glue.append(Glue("output sliced", 0.0, read_bytes=2 * batch * rows * cols * out_item, launches=0))
    # the prologue runs once per A tile of each CTA: (N tiles - 1) times more than once per element
    # (its row pass too: each CTA reduces its rows over the whole row)
    again = once_flops(lhs) * (np_ // blocks.cta_tile_n - 1) if in_kernel else 0.0
    work = TemplateWork("mosaic.matmul", ctas, "wgmma", 2.0 * shape.batch * mp * np_ * kp,
                        2.0 * shape.batch * shape.m * shape.n * useful_k, steps=kp // blocks.tile_k, alu_flops=again)
    return MosaicWork(work, blocks.stages, tma, a_bytes + b_bytes + epilogue_read,
                      batch * rows * cols * out_item, batch * mp * np_, tuple(glue), blocks.compute_wgs + 1,
                      padded_store=None if place.out else (batch, rows, cols))


# --- conv ----------------------------------------------------------------------------------------


def _conv_geometry(lhs_ty: str, rhs_ty: str, params: str, out_ty: str) -> ConvGeometry:
    p = ConvParams.parse(params)
    geometry = ConvGeometry(p, parse_type(lhs_ty).shape, parse_type(rhs_ty).shape, parse_type(out_ty).shape)
    if any(lo < 0 or hi < 0 for lo, hi in p.padding):
        raise NotImplementedError(f"negative padding {p.padding}")
    return geometry


def conv_ranges(term: Term) -> list[tuple[int, int]]:
    """A `Conv` term's K ranges as the template runs them (`emit.pallas.conv.k_ranges`: the input
    channels split where the input or the weight is a concat): `(channels, taps)` each."""
    lhs, rhs, params, _epilogue, _ty = term.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    return [(round(parse_type(part.ty).shape[p.lhs_spec[1]] * fraction), taps)
            for part, taps, fraction in conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window)]


def window_of(taps: int, window: tuple[int, int]) -> tuple:
    """The window a K range of `taps` nonzero weight taps runs: the whole window, or one tap (a
    merged 1x1 shortcut: its centre). Where in the window it lies changes which shifted copy its
    steps read, not how many steps, copies or bytes."""
    kh, kw = window
    if taps == 1 and (kh, kw) != (1, 1):
        return (kh // 2, kh // 2 + 1), (kw // 2, kw // 2 + 1)
    return (0, kh), (0, kw)


def range_exprs(term: Term) -> list[tuple] | None:
    """A `Conv` term's K ranges as the haloed template reads them: `(input expression, 0, channels,
    taps)` each (`conv_parts`), or None when a range covers only part of its expression (a weight
    concat over an input that is not one: the template stages whole expressions)."""
    lhs, rhs, params, _epilogue, _ty = term.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    out = []
    for part, taps, fraction in conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window):
        if fraction != 1:
            return None
        out.append((part, 0, parse_type(part.ty).shape[p.lhs_spec[1]], window_of(taps, window)))
    return out


def conv_work(term: Term) -> MosaicWork:
    lhs, rhs, params, epilogue, ty = term.args
    return conv_work_of(lhs.ty, rhs.ty, params, ty, conv_ranges(term), epilogue, range_exprs(term) or False, rhs)


def conv_work_of(lhs_ty: str, rhs_ty: str, params: str, out_ty: str, ranges=None,
                 epilogue: Term | None = None, exprs=None, rhs: Term | None = None) -> MosaicWork:
    """`emit.mosaic.conv_halo.build` on this conv where it takes it (`halo_conv_work`), else
    `emit.mosaic.conv.build`: the flat padded grid's CTAs, its pipeline steps (taps × 64-channel
    chunks per K range), the TMA bytes (each step's A tile re-read through L2), and the fusions:
    the input laid out (padded, phases, one copy per column shift), the weights as `[steps·64, N↑]`,
    a residual gathered onto the flat grid, the output unflattened. `ranges`: `(channels, taps)`
    per K range (`conv_ranges`; an e-node's: the weight's, as `eqsat.cost.work.conv_weight_ranges`
    reads them), or `(channels, window)`; default one range over the whole window. `exprs`: the
    ranges' input expressions (`range_exprs`), False when the haloed template cannot stage them,
    None when unknown (an e-node: each range priced as a staged tensor without a prologue)."""

    geometry = _conv_geometry(lhs_ty, rhs_ty, params, out_ty)
    grid = FlatGrid(geometry)
    window = tuple(geometry.window)
    if ranges is None:
        ranges = [(geometry.in_features, math.prod(window))]
    ranges = [(c, window_of(t, window) if isinstance(t, int) else t) for c, t in ranges]
    halo_geometry, phase_outputs = geometry, None
    if exprs and len(exprs) == 1 and upsample_source(exprs[0][0], geometry) is not None:
        source = upsample_source(exprs[0][0], geometry)  # four output phases of a conv over the source
        halo_geometry, phase_outputs = phase_geometry(geometry), geometry.out_features
        exprs = [(source, *exprs[0][1:])]
    if exprs is not False:
        parts = halo_parts(exprs) if exprs is not None else [(None, i, 0, c, t) for i, (c, t) in enumerate(ranges)]
        if not isinstance(parts, str) and halo_uncovered(halo_geometry, [(c, t) for _e, _r, _o, c, t in parts],
                                                         _itemsize(lhs_ty), [e for e, *_ in parts if e is not None]) is None:
            if phase_outputs:  # a phase's 2x2 taps
                parts = [(e, r, o, c, ((0, 2), (0, 2))) for e, r, o, c, _t in parts]
            work = halo_conv_work(halo_geometry, lhs_ty, rhs_ty, params, out_ty, epilogue, parts, phase_outputs,
                                  rhs)
            if work is not None:
                return work
    taps = plan_taps(grid, ranges)
    steps = sum(r.steps for r in taps)
    cout = geometry.out_features
    item, out_item = _itemsize(lhs_ty), _itemsize(out_ty)
    out_elements = size_of(out_ty)
    reads = EpilogueReads.of(epilogue, out_elements, out_elements // max(cout, 1))
    blocks = fit_smem(default_blocks(grid, cout, steps), item, out_item, reads.smem_operands)
    m_padded = _round_up(grid.rows, blocks.tile_m)
    n_padded = _round_up(cout, blocks.cta_tile_n)
    ctas = (m_padded // blocks.tile_m) * (n_padded // blocks.cta_tile_n)
    columns = sum(r.column_blocks(grid.phases) * CHUNK for r in taps)
    a_bytes = (m_padded + grid.halo) * columns * item
    b_bytes = steps * CHUNK * n_padded * item
    glue = [Glue("input laid out", a_bytes), Glue("weights laid out", b_bytes)]
    for item_bytes in reads.tiles:
        glue.append(Glue("residual on the flat grid", m_padded * cout * item_bytes))
    store = m_padded * n_padded * out_item
    glue.append(Glue("output unflattened", 0.0, read_bytes=2 * store))
    tma = ctas * steps * CHUNK * (blocks.tile_m + blocks.cta_tile_n) * item
    tma += ctas * (sum(reads.tiles) * blocks.tile_m * blocks.cta_tile_n + sum(reads.cols) * blocks.cta_tile_n)
    epilogue_read = sum(reads.tiles) * m_padded * n_padded + sum(reads.cols) * n_padded
    useful = own_flops("Conv", (lhs_ty, rhs_ty, params, None, out_ty))
    work = TemplateWork("mosaic.conv", ctas, "wgmma", 2.0 * m_padded * n_padded * steps * CHUNK, useful,
                        steps=steps)
    return MosaicWork(work, blocks.stages, tma, a_bytes + b_bytes + epilogue_read, store, m_padded * n_padded,
                      tuple(glue), blocks.compute_wgs + 1)


# Tensors whose Triton kernel (a plan `Reduce`; a hosted statistic's driver `reduce` or `finalize`)
# also writes the vector table of a haloed conv gathering them (`emit.pallas.tables`): no fusion.
TABLE_WRITERS = frozenset({"EpilogueReduce", "Reduce"})
TABLE_BY_STATISTIC = "prologue vectors per channel, written by the statistic's kernel"


def halo_conv_work(geometry: ConvGeometry, lhs_ty: str, rhs_ty: str, params: str, out_ty: str,
                   epilogue: Term | None = None, parts=None, phase_outputs: int | None = None,
                   rhs: Term | None = None) -> MosaicWork | None:
    """`emit.mosaic.conv_halo.build` on this conv (None where its staged rows do not fit SMEM): CTAs
    of `tile_m` flat rows of one image's padded grid x `tile_n` outputs; per K range (`parts`:
    `halo_parts`' `(expression, range, offset, channels, taps)`, default one over all channels and
    the whole window) and 64-channel chunk the staged input rows (the CTA's and the halo) and the
    range's per-channel vectors by TMA, per step (chunk x tap) a `[64, tile_n]` weight tile; the
    inputs read as they lie (no fusion), the fusions: the weights as `[steps·64, N↑]` unless the
    kernel reads them as they lie (`halo_weight_in_place`: the prepared layout), the vectors
    gathered per channel into one float32 table (unless one range reads them all as views), and
    where the kernel does not store the output's pixels (`stores_pixels`) a residual mapped onto the
    flat rows and the output unflattened; storing pixels, the pixels of the output and of each
    residual read at its own index (`pixel_reads`) are the TMA bytes, no padded rows. The input expressions run on every
    staged element of every CTA (halo rows in two CTAs, each output-channel tile again): their flops
    beyond one evaluation per element are `alu_flops`. `phase_outputs`: the phase form of a conv over
    a nearest-2x upsample (`phase_geometry`: `geometry` is the source's, N four phases of that many
    outputs, each CTA its phase's 2x2 taps, `phase_blocks`)."""
    item, out_item = _itemsize(lhs_ty), _itemsize(out_ty)
    batch, cout = geometry.batch, geometry.out_features
    kh, kw = geometry.window
    if parts is None:
        parts = [(None, 0, 0, geometry.in_features, ((0, kh), (0, kw)))]
    out_elements = size_of(out_ty)
    vector_loads = [halo_input_loads(e, e.ty)[1] if e is not None else [] for e, *_ in parts]
    # one range whose vectors are views of their tensors reads each in place; else one float32 table
    gathered = len(parts) > 1 or any(size_of(node.args[0].ty) != parts[0][3] for node in vector_loads[0])
    rows = [len(loads) for loads in vector_loads]
    if gathered:
        vectors = [4] * max(rows) if any(rows) else []  # SMEM rows of the shared table
        per_chunk = [4 * n * CHUNK for n in rows]
    else:
        vectors = [_itemsize(node.args[0].ty) for node in vector_loads[0]]
        per_chunk = [sum(vectors) * CHUNK]
    reads = EpilogueReads.of(epilogue, out_elements, out_elements // max(cout, 1))
    in_place = pixel_reads(epilogue, out_elements)
    tiling = halo_tiling(geometry, cout, vectors, reads.smem_operands, out_item, batch)
    if tiling is None:
        return None
    blocks, grid_of = tiling
    if phase_outputs:
        blocks = phase_blocks(blocks, phase_outputs)
        if blocks is None:
            return None
    grid = grid_of(blocks.tile_m)
    chunks = [channels // CHUNK for _e, _r, _o, channels, _t in parts]
    taps = [(y1 - y0) * (x1 - x0) for *_, ((y0, y1), (x0, x1)) in parts]
    steps = sum(c * t for c, t in zip(chunks, taps))
    m_padded = grid.m_padded
    n_padded = _round_up(cout, blocks.tile_n)
    n_tiles = n_padded // blocks.tile_n
    ctas = batch * grid.strips * grid.m_tiles * n_tiles
    sub_tiles = (blocks.tile_m // blocks.epi_m) * (blocks.tile_n // blocks.epi_n)
    # stored as pixels (`stores_pixels`): the output's pixels and a residual's, in segments; no flat rows
    pixels = stores_pixels(geometry, n_padded, blocks.tile_n, bool(phase_outputs))
    pixel_tiles = [i for i in in_place if pixels]
    flat_tiles = list(reads.tiles)
    for i in pixel_tiles:
        flat_tiles.remove(i)
    pixel_bytes = batch * math.prod(geometry.out_size) * n_padded * sum(pixel_tiles)
    per_cta = (sum(c * v for c, v in zip(chunks, per_chunk))
               + steps * CHUNK * blocks.tile_n * item + grid.staging * 2
               + sub_tiles * (sum(flat_tiles) * blocks.epi_m * blocks.epi_n + sum(reads.cols) * blocks.epi_n
                              + sum(reads.rows) * blocks.epi_m))
    # each staged row: its strip's columns inside the image (`HaloGrid.strip_columns`), per chunk
    staged = batch * grid.m_tiles * n_tiles * sum(chunks) * grid.row_copies * grid.copied_columns * CHUNK * item
    x_bytes = sum(channels for *_, channels, _t in parts) * batch * math.prod(geometry.in_size) * item
    w_bytes = steps * CHUNK * n_padded * item
    widest = max(channels for *_, channels, _t in parts)
    vector_bytes = (batch * sum(rows) * widest * 4 if gathered  # B' = batch: at most
                    else sum(batch * parts[0][3] * v for v in vectors))
    mask_bytes = grid.strips * grid.m_tiles * grid.staging * 2
    epilogue_read = (batch * m_padded * (sum(flat_tiles) * n_padded + sum(reads.rows)) + sum(reads.cols) * n_padded
                     + pixel_bytes)
    glue = []
    if not halo_weight_in_place(rhs, params, parts, n_padded, cout, phase_outputs):
        glue.append(Glue("weights laid out", w_bytes))
    if gathered and any(rows):  # per-group statistics gathered per channel, with the other vectors: one small
        # fusion, or written beside a statistic it gathers by the Triton kernel finishing it (`emit.pallas.tables`)
        by_statistic = any(node.args[0].op in TABLE_WRITERS for loads in vector_loads for node in loads)
        glue.append(Glue(TABLE_BY_STATISTIC, vector_bytes, launches=0) if by_statistic
                    else Glue("prologue vectors per channel", vector_bytes))
    # the flat rows are the output's own NHWC rows (a 1x1 conv without padding, whole tiles): the
    # residual is read and the output written in place (`mapped_operands` and `unflatten` are views)
    (ho, wo), out_spec = geometry.out_size, tuple(ConvParams.parse(params).out_spec)
    flat_is_output = not phase_outputs and grid.pitch == wo and m_padded == ho * wo and out_spec == (0, 3, 1, 2)
    for item_bytes in flat_tiles:
        if not flat_is_output:
            glue.append(Glue("residual on the flat grid", batch * m_padded * cout * item_bytes))
    if phase_outputs:  # a column vector gathered onto the phase-major columns, unless one value per output
        # channel (a bias: read at each phase's columns as it lies, `emit.mosaic.conv_halo.phase_vectors`)
        per_phase = [t for t in loaded_tensors(epilogue) if size_of(t.ty) == phase_outputs]
        gathered = list(reads.cols)
        for tensor in per_phase:
            if _itemsize(tensor.ty) in gathered:
                gathered.remove(_itemsize(tensor.ty))
        glue += [Glue("column vector per phase", n_padded * item_bytes) for item_bytes in gathered]
    store = batch * m_padded * n_padded * out_item
    if pixels:
        store = batch * math.prod(geometry.out_size) * n_padded * out_item
    elif not (flat_is_output and n_padded == cout):
        glue.append(Glue("output unflattened", 0.0, read_bytes=2 * store))
    evaluated = ctas * sum(chunks) * grid.staging * CHUNK  # the prologues run on every staged slab
    exprs = [e for e, *_ in parts if e is not None]
    in_elements = batch * math.prod(geometry.in_size) * geometry.in_features  # the staged tensors' elements
    per_element = once_flops(*exprs) / max(in_elements, 1) if exprs else 0.0
    conv_out = parse_type(out_ty).shape[ConvParams.parse(params).out_spec[1]]  # (the phase form's is 4x)
    weight_elements = conv_out * sum(channels * t for (*_, channels, _taps), t in zip(parts, taps))  # zero taps skipped
    useful = own_flops("Conv", (lhs_ty, rhs_ty, params, None, out_ty), weight_elements)
    work = TemplateWork("mosaic.conv", ctas, "wgmma", 2.0 * batch * m_padded * n_padded * steps * CHUNK, useful,
                        steps=steps, alu_flops=max(0.0, evaluated - in_elements) * per_element)
    kernel_reads = x_bytes + w_bytes + vector_bytes + mask_bytes + epilogue_read
    return MosaicWork(work, blocks.stages, ctas * per_cta + staged + pixel_bytes, kernel_reads, store,
                      batch * m_padded * n_padded,
                      tuple(glue), 1, haloed=True, weight_columns=n_padded,
                      tile_m=blocks.tile_m)


def halo_weight_in_place(rhs: Term | None, params: str, parts, n_padded: int, cout: int,
                         phase_outputs: int | None, prepared: bool = True) -> bool:
    """Whether the haloed conv reads its weight as it lies, no fusion before it: one tensor stored
    `[ky, kx, in, out]` row-major (the layout `emit.prepare` gives a conv's weight) whose outputs the
    tiles divide (`emit.mosaic.conv_halo.layout_weight` is a view), or, `prepared`, a weight the
    prepare stage computes from parameters (`prepared_weight`): it lays the template's weight out
    once (`emit.mosaic.layouts.halo_weight_layout`: a merged shortcut's concat, N padded, the phase
    form's sums of taps). Types only (`rhs` None, an e-node): a weight of parameters, laid out once."""
    if rhs is None:
        return prepared or (not phase_outputs and n_padded == cout and len({taps for *_, taps in parts}) == 1)
    if prepared and prepared_weight(rhs):
        return True
    if phase_outputs or n_padded != cout:
        return False
    spec = ConvParams.parse(params).rhs_spec
    return read_in_order(rhs, (spec[2], spec[3], spec[1], spec[0]), False)


def prepared_weight(expr: Term) -> bool:
    """Whether an operand expression reads only tensors the prepare stage computed from parameters
    and constants (`Pointwise` kernels over inputs and constants, e.g. a weight laid out K x N), at
    least one: `emit.prepare` then lays the template's weight out once too."""
    loads = loaded_tensors(expr)
    if not loads:
        return False
    seen: set[int] = set()
    stack = list(loads)
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.op == "Constant" or (tensor.op == "Input" and tensor not in loads):
            continue
        if tensor.op != "Pointwise":
            return False
        stack.extend(loaded_tensors(tensor.args[0]))
    return True


# --- attention -----------------------------------------------------------------------------------


def attention_work(term: Term) -> MosaicWork:
    q, k, v, bias, _scale, _epilogue, ty = term.args
    has_bias = not (bias.op == "Lit" and bias.args[0] == 0.0)
    bias_ty = bias.ty if has_bias else None
    return attention_work_of(q.ty, k.ty, ty, bias_ty, q, v, k, bias if has_bias else None)


def attention_work_of(q_ty: str, k_ty: str, out_ty: str, bias_ty: str | None = None, q: Term | None = None,
                      v: Term | None = None, k: Term | None = None, bias: Term | None = None) -> MosaicWork:
    """`emit.mosaic.attention.build`: CTAs of `compute_wgs` 64-row query tiles, Q·Kᵀ and P·V at the
    padded head (a multiple of 16) over the padded keys, TMA of Q once and K, V (and the bias) per
    key block; the fusions: q / k / v computed, copied or padded (`attention_glue`), a float32 bias,
    the padded output sliced."""

    batch, heads, q_len, head_dim = parse_type(q_ty).shape
    kv_len = parse_type(k_ty).shape[2]
    blocks = AttentionBlocks.get_default(q_len, kv_len, head_dim)
    head = padded_head(head_dim)
    rows = blocks.block_q * blocks.compute_wgs
    q_pad, kv_pad = _round_up(q_len, rows), _round_up(kv_len, blocks.block_kv)
    item, out_item = _itemsize(q_ty), _itemsize(out_ty)
    bh = batch * heads
    ctas = bh * (q_pad // rows)
    kv_steps = kv_pad // blocks.block_kv
    dtype, out_dtype = parse_type(q_ty).dtype, parse_type(out_ty).dtype
    ring = fit_ring(blocks, kv_len, head, itemsize_of(dtype), itemsize_of(out_dtype), dtype != out_dtype,
                    bias_ty is not None)
    q_bytes, kv_bytes = bh * q_pad * head * item, bh * kv_pad * head * item
    glue = attention_glue(q, k, v, q_bytes, kv_bytes, blocks, q_pad != q_len, kv_pad != kv_len, head != head_dim)
    tma = ctas * rows * head * item + ctas * kv_steps * 2 * blocks.block_kv * head * item
    kernel_reads = q_bytes + 2 * kv_bytes
    if bias_ty is not None:
        b_shape = parse_type(bias_ty).shape
        lead = math.prod(b_shape[:-2]) if len(b_shape) > 2 else 1
        bias_bytes = lead * q_pad * kv_pad * 4
        # a bias that reads no tensor (a causal mask from iotas) XLA folds into a constant: no launch
        constant = bias is not None and not loaded_tensors(bias)
        glue.append(Glue("bias materialized", bias_bytes, launches=0 if constant else 1))
        tma += ctas * kv_steps * rows * blocks.block_kv * 4
        kernel_reads += bias_bytes
    store = bh * q_pad * head * out_item
    # heads padded over whole query tiles: the output is left padded for its reader (`reads_padded_heads`:
    # to_out reads it as it lies; a reader that cannot is charged the slice, `matmul_work_of`)
    kept_padded = q is not None and head != head_dim and q_pad == q_len and seq_major(q)
    if (q_pad, head) != (q_len, head_dim) and not kept_padded:  # inside its reader's layout fusion
        glue.append(Glue("output sliced", 0.0, read_bytes=2 * store, launches=0))
    scores = bh * q_pad * kv_pad
    work = TemplateWork("mosaic.attention", ctas, "wgmma", 4.0 * scores * head,
                        own_flops("Attention", (q_ty, k_ty)), steps=kv_steps,
                        alu_flops=scores * SOFTMAX_INSTRUCTIONS_PER_SCORE * INSTRUCTION_FLOPS)
    return MosaicWork(work, ring, tma, kernel_reads, store, bh * q_pad * head, tuple(glue),
                      blocks.compute_wgs + 1)


def attention_glue(q: Term | None, k: Term | None, v: Term | None, q_bytes: float, kv_bytes: float,
                   blocks: AttentionBlocks, q_rows_padded: bool, kv_rows_padded: bool,
                   head_padded: bool) -> list[Glue]:
    """The fusions `emit.mosaic.attention.build` launches before its kernel: each of q, k and v that
    the kernel does not read where it lies (`reads_as_it_lies`: computed, a copy of part of a tensor,
    or padded: heads of 40 to 48 unless the projection writes them so, `padded_by_projection`; 77
    keys to the 80 of their step) is written laid out, those reading one activation (a fused QKV's,
    the text K/V projection's; biases aside) by one multi-output fusion. K is read as it
    lies too (a transposed SMEM operand, no Kᵀ)."""
    rows = {"q": blocks.block_q * blocks.compute_wgs, "k": blocks.block_kv, "v": blocks.block_kv}
    rows_padded = {"q": q_rows_padded, "k": kv_rows_padded, "v": kv_rows_padded}
    sizes = {"q": q_bytes, "k": kv_bytes, "v": kv_bytes}
    groups: dict = {}
    for name, operand in (("q", q), ("k", k), ("v", v)):
        in_place = padded_by_projection(operand, rows[name]) is not None if head_padded else \
            reads_as_it_lies(operand, rows[name])
        if rows_padded[name] or not in_place:
            tensors = loaded_tensors(operand) if operand is not None else []
            # siblings reading one activation (a fused QKV's, each slice plus its own bias) fuse into one
            source = id(max(tensors, key=lambda t: size_of(t.ty))) if tensors else name
            groups.setdefault(source, []).append(name)
    glue = []
    for names in groups.values():
        what = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        glue.append(Glue(f"{what} laid out", sum(sizes[n] for n in names)))
    return glue


def reads_as_it_lies(operand: Term | None, rows_tile: int) -> bool:
    """Whether the Mosaic attention reads an operand `[B, H, S, D]` (not padded) with no copy: heads
    of one tensor stored `[B, S, heads, D]` (`stored_heads`), or a whole tensor stored in the term's
    own order `[B, H, S, D]`. Types only (None): yes."""
    if operand is None:
        return True
    if stored_heads(operand, rows_tile) is not None:
        return True
    node = operand
    while node.op == "Reshape":
        node = node.args[0]
    if node.op != "Load" or parse_type(node.ty).dtype != parse_type(operand.ty).dtype:
        return False
    return math.prod(parse_type(node.ty).shape) == math.prod(parse_type(operand.ty).shape)


def mosaic_work_cached(kernel: Term) -> MosaicWork:
    """`mosaic_work`, once per kernel term (a plan prices each kernel several times, and each matmul
    asks for its producer's `padded_store`)."""
    cached = _WORK.get(id(kernel))
    if cached is None or cached[0] is not kernel:
        cached = _WORK[id(kernel)] = (kernel, mosaic_work(kernel))
    return cached[1]


_WORK: dict[int, tuple] = {}


def mosaic_work(kernel: Term) -> MosaicWork:
    """The `MosaicWork` of a `Matmul`, `Conv` or `Attention` kernel term."""
    if kernel.op == "Matmul":
        return matmul_work(kernel)
    if kernel.op == "Conv":
        return conv_work(kernel)
    if kernel.op == "Attention":
        return attention_work(kernel)
    raise ValueError(f"no Mosaic template for {kernel.op}")


def node_mosaic_work(op: str, args, ranges=None) -> MosaicWork:
    """`mosaic_work` of a dense e-node from its argument types (operands read in place); a conv's
    weight K ranges `(channels, taps)` when known."""
    if op == "Matmul":
        return matmul_work_of(args[0], args[1], args[2], args[4])
    if op == "Conv":
        return conv_work_of(args[0], args[1], args[2], args[4], ranges)
    if op == "Attention":  # an e-node's bias is a type, not a value: priced as none (a zero bias)
        return attention_work_of(args[0], args[1], args[-1])
    raise ValueError(f"no Mosaic template for {op}")


# --- hosted statistics finished in their producer -----------------------------------------------
#
# A statistic whose only host is a haloed Mosaic conv may be finished by the conv's own last CTA
# (`emit.mosaic.finish`, `eqsat.cost.finish`): no finalize kernel after it (one launch saved), a
# serial tail instead. That CTA, after every other, brings `ceil(tiles / FINISH_BLOCK_TILES)` blocks
# of `[fields, FINISH_BLOCK_TILES, slots]` fp32 partials (whole blocks, the ragged last one too) to
# SMEM one after the other, just written so read from L2 at one SM's share of its bandwidth, and
# stores the finished `[rows, slots]` (and the vector tables of the Mosaic convs reading it, a few KB,
# not charged). The ticket is one atomic per CTA (not charged).

FINISH_BLOCK_TILES = 64  # `emit.mosaic.finish.BLOCK_TILES`: a WGMMA-layout block of tiles


def finish_tail_seconds(tiles: int, fields: int, slots: int) -> float:
    """The modeled serial tail of finishing a `[tiles, fields, slots]` statistic in the producer's
    last CTA (`emit.mosaic.finish.finish`)."""
    blocks = -(-tiles // FINISH_BLOCK_TILES)
    rows = 2 if fields == 3 else 1
    moved = 4 * slots * (blocks * fields * FINISH_BLOCK_TILES + rows)
    return moved * SM_COUNT / L2_BANDWIDTH
