"""What a template's MMA loop costs, and the conv tile the model chooses (below `eqsat.cost.tiles`,
which reads that choice, and `eqsat.cost.work`, which states every template's work).

    TemplateWork          programs, MMA instruction, padded and useful MMA flops, serial steps
    mma_seconds(work, d)  its time on device `d` (calibrated: `TEMPLATE_FACTORS`)
    conv_config(g, r)     the conv template's config for geometry `g` and K ranges `r`: the tile
                          shape the model prices lowest (`cheapest_conv_tile`), `eqsat.tiling.conv`'s
                          K chunks and stages for it. The emitter (`emit.pallas.conv`) and the cost
                          model both call this, so they cannot choose apart.

The tilings (`eqsat.tiling`) are arithmetic on shapes; the choice among them is the cost model's, so
it lives here and not there (the tilings import nothing from the cost model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from eqsat.cost.devices import H100_CALIBRATED
from eqsat.tiling.conv import ConvConfig, ConvGeometry, KRange
from eqsat.tiling.conv import grid as conv_grid
from eqsat.tiling.conv import prologue_evaluations

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
    device = device or H100_CALIBRATED
    ranges = [(geometry.in_features, geometry.taps)]
    work = _conv_work(config, geometry, ranges, 0.0)
    inputs = geometry.batch * geometry.in_features * math.prod(geometry.in_size)
    evaluations = prologue_evaluations(geometry, config) * inputs
    return mma_seconds(work, device) + device.vector_seconds(
        evaluations * CONV_PROLOGUE_INSTRUCTIONS * INSTRUCTION_FLOPS)


_CHEAPEST: dict[ConvGeometry, ConvConfig] = {}


# Tiles priced within this share of the cheapest count as a tie (`cheapest_conv_tile`): the
# tile-dependent price is not finer than that (it assumes CONV_PROLOGUE_INSTRUCTIONS per input
# evaluation whatever the real prologue; conv_in's is a convert).
TILE_PRICE_TOLERANCE = 0.01


def cheapest_conv_tile(geometry: ConvGeometry) -> ConvConfig:
    """The `ConvConfig.candidates` tile the model prices lowest (`conv_tile_seconds`): the tile
    shape `conv_config` gives the template. Among the tiles within `TILE_PRICE_TOLERANCE` of the
    cheapest, the one with the fewest dots per program (accumulators live at once), then the
    cheapest, then the earlier candidate. A 1×1 conv's row tile of 2 × 64 pixels and its flat tile
    of 128 do the same work, and the UNet's conv_in (4 input channels) prices its row tile 0.7 %
    below the flat one; with two accumulators through an epilogue that computes hosted GroupNorm
    statistics per row they spilled (ptxas, sm_90a: 255 registers and 88 B, and 16 B), with one
    they do not (254 registers)."""
    cached = _CHEAPEST.get(geometry)
    if cached is None:
        candidates = ConvConfig.candidates(geometry)
        priced = [(conv_tile_seconds(geometry, c), c.tile(geometry)[0], i) for i, c in enumerate(candidates)]
        cheapest = min(seconds for seconds, _, _ in priced)
        near = [p for p in priced if p[0] <= cheapest * (1 + TILE_PRICE_TOLERANCE)]
        cached = _CHEAPEST[geometry] = candidates[min(near, key=lambda p: (p[1], p[0], p[2]))[2]]
    return cached


def conv_config(geometry: ConvGeometry, ranges: Sequence[KRange] = (), itemsize: int = 2) -> ConvConfig:
    """The conv template's config: the cheapest tile shape (`cheapest_conv_tile`) with the K
    chunks and pipeline stages `ConvConfig.for_tile` gives it for these K ranges and operand bytes."""
    return ConvConfig.for_tile(cheapest_conv_tile(geometry), geometry, ranges, itemsize)
