"""What a kernel's template executes, read from the template's own configuration.

The roofline (`eqsat.cost.roofline`) counts a kernel's distinct bytes and its useful flops. The
templates execute more: tiles padded to powers of two, an MMA instruction chosen by the tile
(`wgmma` for a warpgroup tile of >= 64 rows, `mma.sync` below), a grid that fills the 132 SMs in
waves. `template_work(kernel)` states that work, from the same config objects the emitters use
(`emit.pallas.matmul.MatmulBlocks`, `emit.pallas.conv.ConvConfig`,
`emit.pallas.attention.AttentionBlocks`, `emit.pallas.partials.FinalizeConfig`), so the model
cannot drift from the templates:

| template | programs | MMA instruction | MMA flops (what the tiles multiply) | serial steps of a program |
|---|---|---|---|---|
| matmul | batch · M tiles · N tiles | wgmma if block_m >= 64 | 2 · batch · M↑ · N↑ · K↑ (↑: rounded up to the tile) | K / block_k |
| conv | batch · spatial tiles · Cout tiles | wgmma if the dot's M (tile width) >= 64 | 2 · batch · tiles · rows · width · Cout↑ · Σ_ranges taps · Cin↑ | Σ_ranges taps · Cin↑ / block_k |
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
(`roofline.conv_prologue_evaluations` over `roofline.conv_tile`, `ConvConfig.tile`), a matmul's A
prologue per N tile (`merges.matmul_shape`, `MatmulBlocks`); tests/test_cost_work.py checks both
against the template configs for every kernel of the SD 1.5 plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    from eqsat.cost.merges import matmul_shape
    from eqsat.cost.roofline import _args_of, own_flops
    from emit.pallas.matmul import MatmulBlocks

    shape = matmul_shape(term)
    blocks = MatmulBlocks.get_default(max(shape.m, 1), max(shape.n, 1), max(shape.k, 1))
    programs = shape.batch * shape.m_tiles * shape.n_tiles
    padded = 2.0 * shape.batch * (shape.m_tiles * blocks.block_m) * (shape.n_tiles * blocks.block_n) \
        * _round_up(shape.k, blocks.block_k)
    mma = "wgmma" if blocks.block_m >= WGMMA_MIN_ROWS and blocks.num_warps >= 4 else "mma.sync"
    return TemplateWork("matmul", programs, mma, padded, own_flops("Matmul", _args_of(term)),
                        steps=-(-shape.k // blocks.block_k))


def conv_config(term):
    """The conv template's `ConvConfig` and geometry for a `Conv` term, and its K ranges as
    (channels, taps): what `emit.pallas.conv` builds for it."""
    from eqsat.conv_params import ConvParams
    from eqsat.cost.roofline import _conv_parts
    from emit.pallas.conv import ConvConfig, ConvGeometry, KRange

    lhs, rhs, params, _epilogue, ty = term.args
    p = ConvParams.parse(params)
    geometry = ConvGeometry(p, tuple(parse_type(lhs.ty).shape), tuple(parse_type(rhs.ty).shape),
                            tuple(parse_type(ty).shape))
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    parts = _conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window)
    ranges = [(round(parse_type(part.ty).shape[p.lhs_spec[1]] * fraction), taps) for part, taps, fraction in parts]
    config = ConvConfig.get_default(geometry, [KRange(channels, None, None) for channels, _ in ranges])
    return config, geometry, ranges


def conv_work(term) -> TemplateWork:
    from eqsat.cost.roofline import _args_of, nonzero_weight_elements, own_flops
    from emit.pallas.conv import _grid

    config, geometry, ranges = conv_config(term)
    rows, width = config.tile(geometry)
    programs = math.prod(_grid(geometry, config))
    k_padded = sum(taps * _round_up(channels, config.block_k) for channels, taps in ranges)
    steps = sum(taps * -(-channels // config.block_k) for channels, taps in ranges)
    padded = 2.0 * programs * rows * width * config.block_n * k_padded
    mma = "wgmma" if width >= WGMMA_MIN_ROWS and config.num_warps >= 4 else "mma.sync"
    useful = own_flops("Conv", _args_of(term), nonzero_weight_elements(term.args[1]))
    return TemplateWork("conv", programs, mma, padded, useful, steps=steps)


def attention_work(term) -> TemplateWork:
    from eqsat.cost.roofline import _args_of, own_flops
    from emit.pallas.attention import AttentionBlocks, head_pieces, key_loop_trips, tail_width

    q, k = term.args[0], term.args[1]
    q_shape, k_shape = parse_type(q.ty).shape, parse_type(k.ty).shape
    q_len, head_dim, kv_len = q_shape[-2], q_shape[-1], k_shape[-2]
    heads = math.prod(q_shape[:-2])
    blocks = AttentionBlocks.get_default(q_len, kv_len, head_dim)
    q_blocks = -(-q_len // blocks.block_q)
    keys = key_loop_trips(kv_len, blocks.block_k) * blocks.block_k
    if kv_len % blocks.block_k:
        keys += tail_width(kv_len, blocks.block_k)
    width = sum(w for _, w in head_pieces(head_dim))
    padded = 4.0 * heads * q_blocks * blocks.block_q * keys * width
    mma = "wgmma" if blocks.block_q >= WGMMA_MIN_ROWS and blocks.num_warps >= 4 else "mma.sync"
    scores = heads * q_blocks * blocks.block_q * keys
    return TemplateWork("attention", heads * q_blocks, mma, padded, own_flops("Attention", _args_of(term)),
                        steps=-(-kv_len // blocks.block_k),
                        alu_flops=scores * SOFTMAX_INSTRUCTIONS_PER_SCORE * INSTRUCTION_FLOPS)


def finalize_work(statistic) -> TemplateWork:
    from eqsat.cost.merges import fields, statistic_slots, statistic_tiles
    from emit.pallas.partials import FinalizeConfig

    config = FinalizeConfig.of(statistic_tiles(statistic), fields(statistic), statistic_slots(statistic))
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


# --- the calibrated device model ---------------------------------------------------------------
#
# A kernel's modeled seconds (`modeled_seconds`):
#
#     launch + memory · bytes / hbm_bandwidth + mma · mma_flops / (rate(instruction) · sm_utilization)
#            + alu · vector_flops / peak_fp32 + serial · waves · steps
#
# `bytes` and `vector_flops` are the roofline's (distinct bytes; every prologue evaluation, merge
# and epilogue op) plus the template's own vector work (`TemplateWork.alu_flops`: attention's
# softmax), `mma_flops` and the instruction the template's (`TemplateWork`); rate(wgmma) is
# the dense fp16 peak, rate(mma.sync) MMA_SYNC_SHARE of it. The four factors per template
# (`TEMPLATE_FACTORS`: how many times slower than the data-sheet peak each resource runs in that
# template; `serial` in seconds per step) are fitted to the per-kernel device times measured on an H200
# (`python -m benchmarks.calibration --fit`, benchmarks/README.md): few constants, one per
# (template, resource), no per-kernel fudge. The H200 has the H100's 132 SMs and clocks (the same
# MMA and ALU peaks) and 4.8 TB/s of HBM against 3.35: the fit divides bytes by the H200's bandwidth
# and the model applies the same factors to each device's own bandwidth, so the H100 model is the
# H200 fit with only the memory term scaled by 4.8 / 3.35.

# mma.sync on sm_90 peaks at about 2/3 of wgmma's dense fp16 rate (Luo et al., "Benchmarking and
# Dissecting the Nvidia Hopper GPU Architecture", 2024: 495-660 TFLOP/s against 989).
MMA_SYNC_SHARE = 2 / 3


@dataclass(frozen=True)
class TemplateFactors:
    """How many times its data-sheet time each resource of a template's kernels takes (fitted)."""

    memory: float = 1.0
    mma: float = 1.0
    alu: float = 1.0
    serial: float = 0.0  # seconds per serial step (`TemplateWork.serial`)


# Fitted by `python -m benchmarks.calibration --fit` on benchmarks/results/gpu-h200-2ce0105.json
# (jax 0.11.2, NVIDIA H200, backend pallas; UNet, VAE and text encoder at full size).
TEMPLATE_FACTORS: dict[str, TemplateFactors] = {
    "matmul": TemplateFactors(),
    "conv": TemplateFactors(),
    "attention": TemplateFactors(),
    "finalize": TemplateFactors(),
    "other": TemplateFactors(),
}


def rate(mma: str | None, device) -> float:
    """Dense fp16 flop/s of an MMA instruction on `device`."""
    return device.peak_fp16 * (MMA_SYNC_SHARE if mma == "mma.sync" else 1.0)


def modeled_seconds(work: TemplateWork, nbytes: float, vector_flops: float, device,
                    factors: dict[str, TemplateFactors] | None = None) -> float:
    """A kernel's calibrated seconds (see above): launch + its resources at the template's factors."""
    f = (factors or TEMPLATE_FACTORS).get(work.template) or (factors or TEMPLATE_FACTORS)["other"]
    seconds = device.launch_overhead + f.memory * nbytes / device.hbm_bandwidth
    seconds += f.alu * (vector_flops + work.alu_flops) / device.peak_fp32 + f.serial * work.serial
    if work.mma_flops:
        seconds += f.mma * work.mma_flops / (rate(work.mma, device) * work.sm_utilization)
    return seconds
