"""`eqsat.cost.work`: for every kernel of the three full-size SD 1.5 plans (abstract, fp16), the cost
model's counts (programs, MMA flops and instruction, prologue evaluations, N and M tiles, output-channel
tiles, finalize programs) equal what the template's own configuration implies."""

from __future__ import annotations

import math

import pytest

import eqsat
from eqsat.conv_params import ConvParams
from eqsat.cost import merges, roofline, work
from eqsat.cost.roofline import _args_of, nonzero_weight_elements, own_flops
from eqsat.types import parse_type
from sd15.workloads import workloads


@pytest.fixture(scope="module", params=["text_encoder", "vae", "unet"])
def plan(request):
    workload = workloads(batch=2, dtype="float16", components=(request.param,))[request.param]
    lowered = eqsat.optimize(workload.fn, params_argnums=0, progress=False, extract_time_limit=120.0).lower(*workload.args)
    split = getattr(lowered, "split", None)
    return split.per_call if split is not None else lowered.plan


def _check_conv(term):
    from emit.pallas.conv import _grid
    from eqsat.tiling.conv import prologue_evaluations

    config, geometry, ranges = work.conv_config(term)
    w = work.conv_work(term)
    rows, width = config.tile(geometry)  # (dots, dot M): a row tile's rows of `width`, or one flat dot
    assert w.programs == math.prod(_grid(geometry, config))
    assert w.mma == ("wgmma" if width >= 64 else "mma.sync")
    # The roofline's tile, output-channel tiles and prologue evaluations are the template's.
    lhs, rhs, params, _epilogue, ty = term.args
    assert roofline.conv_tile(lhs.ty, rhs.ty, params, ty) == (rows, width)
    assert roofline.conv_output_tiles(geometry.out_features, config.block_n) == -(-geometry.out_features // config.block_n)
    p = ConvParams.parse(params)
    kh, kw = geometry.window
    out_h, out_w = geometry.out_size
    in_h, in_w = geometry.in_size
    cout_tiles = -(-geometry.out_features // config.block_n)
    if config.flat:
        expected = -(-out_h * out_w // width) * width * kh * kw * cout_tiles / (in_h * in_w)
    else:
        input_rows = len({r * p.strides[0] + ky * p.rhs_dilation[0] for r in range(rows) for ky in range(kh)})
        expected = -(-out_h // rows) * -(-out_w // width) * input_rows * kw * width * cout_tiles / (in_h * in_w)
    assert roofline.conv_prologue_evaluations(lhs.ty, rhs.ty, params, ty) == pytest.approx(expected)
    assert prologue_evaluations(geometry, config) == pytest.approx(expected)
    # MMA flops: every program multiplies its whole tile over every K chunk of every range's taps.
    useful = own_flops("Conv", _args_of(term), nonzero_weight_elements(rhs))
    padded_k = sum(taps * -(-channels // config.block_k) * config.block_k for channels, taps in ranges)
    assert w.mma_flops == 2.0 * w.programs * rows * width * config.block_n * padded_k
    assert w.useful_mma_flops == useful <= w.mma_flops
    assert sum(channels for channels, _ in ranges) == geometry.in_features


def _check_matmul(term):
    from emit.pallas.matmul import MatmulBlocks

    shape = merges.matmul_shape(term)
    blocks = MatmulBlocks.get_default(shape.m, shape.n, shape.k)
    w = work.matmul_work(term)
    assert (shape.block_m, shape.block_n) == (blocks.block_m, blocks.block_n)
    m_tiles, n_tiles = -(-shape.m // blocks.block_m), -(-shape.n // blocks.block_n)
    assert (shape.m_tiles, shape.n_tiles) == (m_tiles, n_tiles)
    assert w.programs == shape.batch * m_tiles * n_tiles
    assert w.mma == ("wgmma" if blocks.block_m >= 64 else "mma.sync")
    k_padded = -(-shape.k // blocks.block_k) * blocks.block_k
    assert w.mma_flops == 2.0 * shape.batch * m_tiles * blocks.block_m * n_tiles * blocks.block_n * k_padded
    assert w.useful_mma_flops == 2.0 * shape.batch * shape.m * shape.n * shape.k <= w.mma_flops
    # The A prologue is evaluated once per N tile, the B prologue once per M tile.
    flops, _ = roofline.matmul_prologue_flops(term)
    lhs, rhs = term.args[0], term.args[1]
    expected = 0.0
    seen = set()
    for operand, repeats in ((lhs, n_tiles), (rhs, m_tiles)):
        for node in roofline._expr_nodes(operand):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op in roofline.COMPUTE_OPS:
                expected += roofline.compute_flops(node.op, node.args[0], parse_type(node.ty).size) * repeats
            elif node.op == "RowReduce":
                expected += roofline.reduction_flops(node.args[0], parse_type(node.args[1].ty).size) * repeats
    assert flops == expected


def _check_attention(term):
    from emit.pallas.attention import AttentionBlocks, head_pieces

    q_shape, k_shape = parse_type(term.args[0].ty).shape, parse_type(term.args[1].ty).shape
    blocks = AttentionBlocks.get_default(q_shape[-2], k_shape[-2], q_shape[-1])
    w = work.attention_work(term)
    q_blocks = -(-q_shape[-2] // blocks.block_q)
    splits = blocks.value_splits  # programs per query block; each computes every score
    assert w.programs == math.prod(q_shape[:-2]) * q_blocks * splits
    width = sum(p for _, p in head_pieces(q_shape[-1]))
    assert width >= q_shape[-1] and w.useful_mma_flops <= w.mma_flops
    keys = w.mma_flops / (2.0 * (splits + 1) * (w.programs // splits) * blocks.block_q * width)
    assert keys >= k_shape[-2] and keys - k_shape[-2] < blocks.block_k


def test_every_kernel_counts_what_its_template_runs(plan):
    seen = set()
    for kernel in plan.kernels:
        term = kernel.term
        if kernel.kind == "finalize":
            w = work.finalize_work(term)
            assert w.programs == merges.statistic_slots(term) and w.steps > 0
        elif term.op == "Conv":
            _check_conv(term)
        elif term.op == "Matmul":
            _check_matmul(term)
        elif term.op == "Attention":
            _check_attention(term)
        else:
            assert work.template_work(term).mma_flops == 0.0
        seen.add(kernel.kind)
    assert seen & {"conv", "matmul", "attention"}


def test_the_calibrated_device_prices_the_templates_work():
    """On `h100-calibrated` a matmul e-node costs its launch, its write at MEMORY_FACTOR, and its template's padded
    MMA at the instruction's rate over the SMs it fills plus its serial K steps; `h200-calibrated`
    differs only in the memory term (same SMs and clocks); `h100` is the data sheet."""
    from eqsat.cost import get_device, node_cost

    h100, h200, sheet = get_device("h100-calibrated"), get_device("h200-calibrated"), get_device("h100")
    lhs, rhs, out = "f16[77,768]", "f16[768,3072]", "f16[77,3072]"  # a CLIP MLP matmul: M padded to 128
    args = (lhs, rhs, "1;0;;", out, out)
    w = work.node_work("Matmul", args)
    assert w.mma == "wgmma" and w.programs == 2 * 48 and w.steps == 24
    assert w.mma_flops == 2.0 * 128 * 3072 * 768 > w.useful_mma_flops == 2.0 * 77 * 3072 * 768
    f = work.TEMPLATE_FACTORS["matmul"]
    mma = f.mma * w.mma_flops / (h100.peak_fp16 * w.sm_utilization) + f.serial * w.serial
    nbytes = 77 * 3072 * 2
    cost = node_cost("Matmul", args, h100)
    assert cost.seconds == pytest.approx(h100.launch_overhead + work.MEMORY_FACTOR * nbytes / h100.hbm_bandwidth + mma)
    assert node_cost("Matmul", args, h200).seconds == pytest.approx(
        cost.seconds - work.MEMORY_FACTOR * nbytes * (1 / h100.hbm_bandwidth - 1 / h200.hbm_bandwidth))
    assert node_cost("Matmul", args, sheet).seconds == pytest.approx(
        sheet.launch_overhead + nbytes / sheet.hbm_bandwidth + w.useful_mma_flops / sheet.peak_fp16)
    # 16-row tiles multiply with mma.sync, at MMA_SYNC_SHARE of the rate.
    small = work.node_work("Matmul", ("f16[16,768]", rhs, "1;0;;", "f16[16,3072]", "f16[16,3072]"))
    assert small.mma == "mma.sync"
    assert work.rate("mma.sync", h100) == pytest.approx(work.MMA_SYNC_SHARE * work.rate("wgmma", h100))


def test_a_conv_term_and_its_e_node_price_the_same_mma():
    """`kernel_cost` prices a conv's MMA over its weight's K ranges (`conv_weight_ranges`), as the e-node
    does (`extract.prologue` passes the same ranges); 32x32 images: the model's flat 128-pixel
    tiles, wgmma (32-wide row tiles would multiply with mma.sync)."""
    from eqsat.conv_params import ConvParams
    from eqsat.term import Term

    params = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1),
                                 ((0, 3, 1, 2), (0, 1, 2, 3), (0, 3, 1, 2))).key
    x = Term("Input", "x", "f16[2,32,32,640]")
    w = Term("Input", "w", "f16[640,640,3,3]")
    conv = Term("Conv", Term("Load", x, x.ty), Term("Load", w, w.ty), params, Term("Acc", "f32[2,32,32,640]"),
                "f16[2,32,32,640]")
    priced = work.priced_work(conv)
    assert priced == work.conv_work(conv) and priced.mma == "wgmma"
    assert work.conv_weight_ranges(conv) == [(640, 9)]
    assert work.node_work("Conv", (x.ty, w.ty, params, None, conv.ty), None, [(640, 9)]) == priced
