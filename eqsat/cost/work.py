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
| attention | batch · heads · query blocks | wgmma if block_q >= 64 | 4 · batch · heads · q↑ · keys↑ · head dim↑ (`head_pieces`) | key blocks |
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
from dataclasses import dataclass

from eqsat.conv_params import ConvParams
from eqsat.cost.devices import ALU_FACTOR, MEMORY_FACTOR  # noqa: F401 (fitted with the factors below)
from eqsat.cost.partials import fields, statistic_slots, statistic_tiles
from eqsat.cost.terms import args_of, nonzero_weight_elements, own_flops
from eqsat.cost.tiles import MatmulShape, conv_parts
from eqsat.tiling.attention import AttentionBlocks, dot_itemsize, head_pieces, key_loop_trips, tail_width
from eqsat.tiling.conv import ConvConfig, ConvGeometry, KRange
from eqsat.tiling.conv import grid as conv_grid
from eqsat.tiling.conv import prologue_evaluations
from eqsat.tiling.matmul import MatmulBlocks
from eqsat.tiling.partials import FinalizeConfig
from eqsat.types import parse_type

SM_COUNT = 132  # H100 SXM and H200: the same 132 SMs at the same clocks
CTAS_PER_SM = 1
WGMMA_MIN_ROWS = 64  # a warpgroup MMA's M tile: Triton emits wgmma for dot tiles of >= 64 rows
# Instructions per score of the attention template's online softmax (max, exp, rescale, masks):
# ~50 in the sm_90 PTX of the UNet's attention kernels (issue 16), each 2 flops at the fp32 peak.
SOFTMAX_INSTRUCTIONS_PER_SCORE = 50
INSTRUCTION_FLOPS = 2


@dataclass(frozen=True)
class TemplateWork:
    """The work of one kernel as its template's configuration runs it."""

    template: str                 # matmul | conv | attention | finalize | other
    programs: int = 1
    mma: str | None = None        # "wgmma" | "mma.sync" | None
    mma_flops: float = 0.0        # flops the MMA instructions execute, padding included
    useful_mma_flops: float = 0.0  # the unpadded flops (the roofline's dense flops)
    steps: int = 0                # serial steps of one program (table above)
    alu_flops: float = 0.0        # vector work the template runs beyond the roofline's nodes (softmax)

    @property
    def waves(self) -> int:
        return max(1, -(-self.programs // (SM_COUNT * CTAS_PER_SM)))

    @property
    def serial(self) -> int:
        """Serial steps of the slowest SM: waves × a program's steps."""
        return self.waves * self.steps

    @property
    def sm_utilization(self) -> float:
        return min(1.0, self.programs / (self.waves * SM_COUNT * CTAS_PER_SM))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


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
    config = ConvConfig.get_default(geometry, [KRange(channels, None, None) for channels, _ in ranges])
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


def _conv_work(config, geometry, ranges, useful: float) -> TemplateWork:
    rows, width = config.tile(geometry)  # (dots, dot M): rows of a row tile, one dot of a flat tile
    programs = math.prod(conv_grid(geometry, config))
    k_padded = sum(taps * _round_up(channels, config.block_k) for channels, taps in ranges)
    steps = sum(taps * -(-channels // config.block_k) for channels, taps in ranges)
    padded = 2.0 * programs * rows * width * config.block_n * k_padded
    mma = "wgmma" if width >= WGMMA_MIN_ROWS and config.num_warps >= 4 else "mma.sync"
    return TemplateWork("conv", programs, mma, padded, useful, steps=steps)


# What the model assumes one evaluation of a conv's input expression costs when it chooses the
# tile shape: GroupNorm apply + SiLU, ~25 PTX instructions per evaluation in the UNet's convs (issue
# 16), the input of most SD 1.5 convs. The choice sees the geometry only (so a conv's term, its
# e-nodes and the emitter choose alike); the roofline then charges the real expression.
CONV_PROLOGUE_INSTRUCTIONS = 25


def conv_tile_seconds(geometry: ConvGeometry, config: ConvConfig, device=None) -> float:
    """The modeled time of a conv's tile-dependent work under `config` on the calibrated H100: its
    MMA (padded, at its instruction's rate over the SMs it fills), serial K steps and the input
    expression recomputed per tap (`prologue_evaluations`, `CONV_PROLOGUE_INSTRUCTIONS` each)."""
    from eqsat.cost.devices import H100_CALIBRATED

    device = device or H100_CALIBRATED
    ranges = [(geometry.in_features, geometry.taps)]
    work = _conv_work(config, geometry, ranges, 0.0)
    inputs = geometry.batch * geometry.in_features * math.prod(geometry.in_size)
    evaluations = prologue_evaluations(geometry, config) * inputs
    return mma_seconds(work, device) + device.vector_seconds(
        evaluations * CONV_PROLOGUE_INSTRUCTIONS * INSTRUCTION_FLOPS)


_CHEAPEST: dict[ConvGeometry, ConvConfig] = {}


def cheapest_conv_tile(geometry: ConvGeometry) -> ConvConfig:
    """The `ConvConfig.candidates` tile the model prices lowest (`conv_tile_seconds`; the row tile
    on ties): what `ConvConfig.get_default` runs."""
    cached = _CHEAPEST.get(geometry)
    if cached is None:
        candidates = ConvConfig.candidates(geometry)
        cached = _CHEAPEST[geometry] = min(candidates, key=lambda c: conv_tile_seconds(geometry, c))
    return cached


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
    padded = 4.0 * heads * q_blocks * blocks.block_q * keys * width
    mma = "wgmma" if blocks.block_q >= WGMMA_MIN_ROWS and blocks.num_warps >= 4 else "mma.sync"
    scores = heads * q_blocks * blocks.block_q * keys
    return TemplateWork("attention", heads * q_blocks, mma, padded, own_flops("Attention", (q_ty, k_ty)),
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


# --- the calibrated device model ---------------------------------------------------------------
#
# On a calibrated device (`eqsat.cost.devices`: `h100-calibrated`, `h200-calibrated`) a kernel costs
#
#     launch + MEMORY_FACTOR · bytes / hbm_bandwidth + ALU_FACTOR · vector_flops / peak_fp32
#            + mma · mma_flops / (rate(instruction) · sm_utilization) + serial · waves · steps
#
# `bytes` and `vector_flops` are the roofline's (distinct bytes; every prologue evaluation, merge
# and epilogue op) plus the template's own vector work (`TemplateWork.alu_flops`: attention's
# softmax); `mma_flops`, the instruction, the waves and steps the template's (`TemplateWork`);
# rate(wgmma) is the dense fp16 peak, rate(mma.sync) MMA_SYNC_SHARE of it. MEMORY_FACTOR and
# ALU_FACTOR are one number for every kernel (a byte or a flop costs the same whichever template
# runs it, so extraction can price them per e-node); `mma` and `serial` (seconds per step) are per
# template (`TEMPLATE_FACTORS`). All are fitted to the per-kernel device times measured on an H200
# (`python -m benchmarks.calibration --fit`, benchmarks/README.md; MEMORY_FACTOR and ALU_FACTOR live
# in `eqsat.cost.devices`, which applies them): few constants, no per-kernel
# fudge. The H200 has the H100's 132 SMs and clocks (the same MMA and ALU peaks) and 4.8 TB/s of
# HBM against 3.35: the fit divides bytes by the H200's bandwidth and the H100 model applies the
# same factors to its own, so only the memory term scales (by 4.8 / 3.35) from one to the other.

# mma.sync on sm_90 peaks at about 2/3 of wgmma's dense fp16 rate (Luo et al., "Benchmarking and
# Dissecting the Nvidia Hopper GPU Architecture", 2024: 495-660 TFLOP/s against 989).
MMA_SYNC_SHARE = 2 / 3


@dataclass(frozen=True)
class TemplateFactors:
    """A template's fitted MMA factor (times the instruction's peak time) and serial-step time."""

    mma: float = 1.0
    serial: float = 0.0  # seconds per serial step (`TemplateWork.serial`)


# Fitted by `python -m benchmarks.calibration --fit` on benchmarks/results/gpu-h200-2ce0105.json
# (jax 0.11.2, NVIDIA H200, backend pallas; UNet, VAE and text encoder at full size, 338 measured
# kernel names). The fit puts bytes and vector flops at their data-sheet rates (both factors at
# their lower bound, 1) and the excess in the MMA loops: 4.3x (conv) and 8.5x (matmul) the MMA
# instruction's peak time, and 0.27-0.62 µs per serial K step (loads not overlapped with the MMA:
# every `wgmma.wait_group` waits for 0, issue 16). Attention's MMA runs at its peak; its time is the
# softmax's instructions and 0.43 µs per key block. The finalize factor was fitted on the measured
# template (one warp merging 32 slots: 12,288 serial loads per thread at T = 4096, 33 ns each) and
# applies to today's (one program per slot, 96 loads per thread at T = 4096): an extrapolation.
TEMPLATE_FACTORS: dict[str, TemplateFactors] = {
    "matmul": TemplateFactors(mma=8.461, serial=2.662e-07),
    "conv": TemplateFactors(mma=4.272, serial=6.241e-07),
    "attention": TemplateFactors(mma=1.0, serial=4.272e-07),
    "finalize": TemplateFactors(mma=1.0, serial=3.348e-08),
}


def rate(mma: str | None, device, dtype: str = "float16") -> float:
    """Dense flop/s of an MMA instruction on `device` for operands of `dtype`."""
    return device.peak(dtype, True) * (MMA_SYNC_SHARE if mma == "mma.sync" else 1.0)


def mma_seconds(work: TemplateWork, device, dtype: str = "float16") -> float:
    """The template's own work on `device` beyond bytes and the roofline's vector flops: on a
    calibrated device its MMA (padded, at its instruction's rate, the SMs it fills), its serial
    steps and its own vector work; on a roofline device the useful dense flops at the peak."""
    if not getattr(device, "calibrated", False):
        return work.useful_mma_flops / device.peak(dtype, True) if work.useful_mma_flops else 0.0
    f = TEMPLATE_FACTORS.get(work.template, TemplateFactors(serial=0.0))
    seconds = f.serial * work.serial + device.vector_seconds(work.alu_flops)
    if work.mma_flops:
        seconds += f.mma * work.mma_flops / (rate(work.mma, device, dtype) * work.sm_utilization)
    return seconds
