"""What a kernel's template executes, read from the template's own configuration.

The roofline (`eqsat.cost.roofline`) counts a kernel's distinct bytes and its useful flops. The
templates execute more: tiles padded to powers of two, an MMA instruction chosen by the tile
(`wgmma` for a warpgroup tile of >= 64 rows, `mma.sync` below), a grid that fills the 132 SMs in
waves. `template_work(kernel)` states that work, from the same config objects the emitters use
(`eqsat.tiling`: `MatmulBlocks`, `ConvConfig` and the conv `grid`, `AttentionBlocks`,
`FinalizeConfig`, which `emit.pallas` runs), so the model cannot drift from the templates:

| template | programs | MMA instruction | MMA flops (what the tiles multiply) | serial steps of a program |
|---|---|---|---|---|
| matmul | batch · M tiles · N tiles | wgmma if block_m >= 64 | 2 · batch · M↑ · N↑ · K↑ (↑: rounded up to the tile) | K / block_k |
| conv | batch · spatial tiles · Cout tiles | wgmma if the dot's M (a row tile's width, a flat tile's block_m) >= 64 | 2 · batch · tiles · dots · dot M · Cout↑ · Σ_ranges taps · Cin↑ | Σ_ranges taps · Cin↑ / block_k |
| attention | batch · heads · query blocks · value splits | wgmma if block_q >= 64 | 2 · batch · heads · q↑ · keys↑ · head dim↑ (`head_pieces`) · (value splits + 1) | key blocks |
| finalize | slots | none | none | partial values one thread loads (`FinalizeConfig.loads_per_thread`) |

`serial` = waves × serial steps: the dependent steps (a K chunk's loads then its MMA; a merge
step's loads) the slowest SM runs one after another, what a kernel with few programs or a long
K loop waits on whatever its bandwidth and MMA rate.

`waves` = ceil(programs / (SMs · CTAS_PER_SM)); `sm_utilization` = programs / (waves · SMs ·
CTAS_PER_SM), the share of the SMs the MMA work keeps busy (a 40-CTA conv uses 30 % of them).
CTAS_PER_SM is 1: `benchmarks.kernels` read 1 CTA per SM for 80/84 convs, 60/100 matmuls and 22/32
attention kernels of the UNet from ptxas's register counts; the model does not compile.

The counts the roofline already has come from the same place: a conv's prologue evaluations
(`tiles.conv_prologue_evaluations`: `eqsat.tiling.conv.prologue_evaluations` of the tile the model
chose, `cheapest_conv_tile`), a matmul's A prologue per N tile (`tiles.matmul_shape`,
`MatmulBlocks`); tests/test_cost_work.py checks both against the template configs for every kernel
of the SD 1.5 plans.
"""

from __future__ import annotations

import math

from eqsat.conv_params import ConvParams
from eqsat.cost import mma as conv_choice
from eqsat.cost.devices import ALU_FACTOR, MEMORY_FACTOR  # noqa: F401 (fitted with the factors in eqsat.cost.mma)
from eqsat.cost.mma import (  # noqa: F401 (the template-work vocabulary, importable from here as before)
    CONV_PROLOGUE_INSTRUCTIONS, CTAS_PER_SM, INSTRUCTION_FLOPS, MMA_SYNC_SHARE, SM_COUNT, SOFTMAX_INSTRUCTIONS_PER_SCORE,
    TEMPLATE_FACTORS, WGMMA_MIN_ROWS, TemplateFactors, TemplateWork, _conv_work, _round_up, cheapest_conv_tile,
    conv_tile_seconds, mma_seconds, rate)
from eqsat.cost.partials import fields, statistic_slots, statistic_tiles
from eqsat.cost.terms import args_of, nonzero_weight_elements, own_flops
from eqsat.cost.tiles import MatmulShape, conv_parts
from eqsat.tiling.attention import AttentionBlocks, dot_itemsize, head_pieces, key_loop_trips, tail_width
from eqsat.tiling.conv import ConvGeometry, KRange, single_tap
from eqsat.tiling.matmul import MatmulBlocks
from eqsat.tiling.partials import FinalizeConfig
from eqsat.types import parse_type

def matmul_work(term) -> TemplateWork:
    lhs, rhs, dims, _epilogue, _ty = term.args
    return matmul_work_of(lhs.ty, rhs.ty, dims)


def matmul_work_of(lhs_ty: str, rhs_ty: str, dims: str) -> TemplateWork:
    shape = MatmulShape(lhs_ty, rhs_ty, dims)
    blocks = MatmulBlocks.get_default(max(shape.m, 1), max(shape.n, 1), max(shape.k, 1), dot_itemsize(lhs_ty, rhs_ty))
    programs = shape.batch * shape.m_tiles * shape.n_tiles
    padded = 2.0 * shape.batch * (shape.m_tiles * blocks.block_m) * (shape.n_tiles * blocks.block_n) \
        * _round_up(shape.k, blocks.block_k)
    mma = "wgmma" if blocks.block_m >= WGMMA_MIN_ROWS and blocks.num_warps >= 4 else "mma.sync"
    return TemplateWork("matmul", programs, mma, padded, 2.0 * shape.batch * shape.m * shape.n * shape.k,
                        steps=-(-shape.k // blocks.block_k))


def conv_config(term):
    """The conv template's `ConvConfig` and geometry for a `Conv` term, and its K ranges as
    (channels, taps): what `emit.pallas.conv` builds for it."""
    lhs, rhs, params, _epilogue, ty = term.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    parts = conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window)
    ranges = [(round(parse_type(part.ty).shape[p.lhs_spec[1]] * fraction), taps) for part, taps, fraction in parts]
    return _conv_config_of(lhs.ty, rhs.ty, params, ty, ranges)


def _conv_config_of(lhs_ty: str, rhs_ty: str, params: str, out_ty: str, ranges):
    geometry = ConvGeometry(ConvParams.parse(params), tuple(parse_type(lhs_ty).shape),
                            tuple(parse_type(rhs_ty).shape), tuple(parse_type(out_ty).shape))
    config = conv_choice.conv_config(geometry, [KRange(channels, None, None, single_tap(geometry) if taps == 1 else None)
                                                for channels, taps in ranges])
    return config, geometry, ranges


def conv_work(term) -> TemplateWork:
    config, geometry, ranges = conv_config(term)
    return _conv_work(config, geometry, ranges,
                      own_flops("Conv", args_of(term), nonzero_weight_elements(term.args[1])))


def conv_work_of(lhs_ty: str, rhs_ty: str, params: str, out_ty: str, weight_elements: int | None = None,
                 ranges: list[tuple[int, int]] | None = None) -> TemplateWork:
    """`conv_work` from types and the weight's K ranges (`(channels, taps)` each, as
    `conv_weight_ranges` reads them; what an e-node's cost has, `extract.prologue.weight_ranges`).
    The template also splits K where only the input is a concat; those ranges differ from the
    weight's only in K padding (none when the parts are multiples of block_k, as in SD 1.5).
    Without `ranges`: one range, its taps the nonzero weight elements per channel pair."""
    if ranges is None:
        p = ConvParams.parse(params)
        rhs = parse_type(rhs_ty).shape
        cout, cin = rhs[p.rhs_spec[0]], rhs[p.rhs_spec[1]]
        elements = math.prod(rhs) if weight_elements is None else weight_elements
        ranges = [(cin, max(1, round(elements / max(cout * cin, 1))))]
    config, geometry, ranges = _conv_config_of(lhs_ty, rhs_ty, params, out_ty, list(ranges))
    return _conv_work(config, geometry, ranges, own_flops("Conv", (lhs_ty, rhs_ty, params, None, out_ty), weight_elements))


def conv_weight_ranges(term) -> list[tuple[int, int]]:
    """A `Conv` term's K ranges as its weight splits them (`(channels, taps)`, a concat of the
    weight's in-features, a zero-padded window): what the cost model prices its MMA over, the same
    on the term and on its e-node (`conv_work_of`)."""
    lhs, rhs, params, _epilogue, _ty = term.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    return [(round(parse_type(lhs.ty).shape[p.lhs_spec[1]] * fraction), taps)
            for _part, taps, fraction in conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window, split_input=False)]


def attention_work(term) -> TemplateWork:
    return attention_work_of(term.args[0].ty, term.args[1].ty, term.args[2].ty)


def attention_work_of(q_ty: str, k_ty: str, v_ty: str | None = None) -> TemplateWork:
    q_shape, k_shape = parse_type(q_ty).shape, parse_type(k_ty).shape
    q_len, head_dim, kv_len = q_shape[-2], q_shape[-1], k_shape[-2]
    heads = math.prod(q_shape[:-2])
    blocks = AttentionBlocks.get_default(q_len, kv_len, head_dim, dot_itemsize(q_ty, k_ty, v_ty or k_ty))
    q_blocks = -(-q_len // blocks.block_q)
    keys = key_loop_trips(kv_len, blocks.block_k) * blocks.block_k
    if kv_len % blocks.block_k:
        keys += tail_width(kv_len, blocks.block_k)
    width = sum(w for _, w in head_pieces(head_dim))
    splits = blocks.value_splits  # each of a query block's programs computes every score, and its lanes of p·v
    padded = 2.0 * heads * q_blocks * blocks.block_q * keys * width * (splits + 1)
    mma = "wgmma" if blocks.block_q >= WGMMA_MIN_ROWS and blocks.num_warps >= 4 else "mma.sync"
    scores = heads * q_blocks * splits * blocks.block_q * keys
    return TemplateWork("attention", heads * q_blocks * splits, mma, padded, own_flops("Attention", (q_ty, k_ty)),
                        steps=-(-kv_len // blocks.block_k),
                        alu_flops=scores * SOFTMAX_INSTRUCTIONS_PER_SCORE * INSTRUCTION_FLOPS)


def finalize_work(statistic) -> TemplateWork:
    return finalize_work_of(statistic_tiles(statistic), fields(statistic), statistic_slots(statistic))


def finalize_work_of(tiles: int, fields: int, slots: int) -> TemplateWork:
    config = FinalizeConfig.of(tiles, fields, slots)
    return TemplateWork("finalize", config.programs, steps=config.loads_per_thread)


def template_work(kernel) -> TemplateWork:
    """The `TemplateWork` of a kernel term (a `Matmul`, `Conv`, `Attention`); other kernels'
    templates are elementwise (`pointwise`, `reduce`, ...): no MMA."""
    if kernel.op == "Matmul":
        return matmul_work(kernel)
    if kernel.op == "Conv":
        return conv_work(kernel)
    if kernel.op == "Attention":
        return attention_work(kernel)
    return TemplateWork("other")


def priced_work(kernel) -> TemplateWork:
    """The `TemplateWork` the cost model prices a kernel term with: `template_work`, a conv's K
    ranges as its weight splits them (`conv_weight_ranges`), so that a term and its e-node cost the same."""
    if kernel.op == "Conv":
        lhs, rhs, params, _epilogue, ty = kernel.args
        return conv_work_of(lhs.ty, rhs.ty, params, ty, nonzero_weight_elements(rhs), conv_weight_ranges(kernel))
    return template_work(kernel)


def node_work(op: str, args, weight_elements: int | None = None, ranges=None) -> TemplateWork:
    """`template_work` of a dense kernel e-node from its argument types (`eqsat.cost.node_cost`);
    a conv's weight K ranges `ranges` (`(channels, taps)`) when known."""
    if op == "Matmul":
        return matmul_work_of(args[0], args[1], args[2])
    if op == "Conv":
        return conv_work_of(args[0], args[1], args[2], args[4], weight_elements, ranges)
    if op == "Attention":
        return attention_work_of(args[0], args[1], args[2])
    return TemplateWork("other")
