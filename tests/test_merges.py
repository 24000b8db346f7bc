"""Where hosted statistics merge (`eqsat.cost.merges`), and the finalize kernel that finishes one once.

- `emit.pallas.partials.finalize` (interpret mode) against the float64 merge of adversarial
  partials: 300 tiles, about a third empty holding NaN, mean 1e4 against a spread of 1e-2, a
  constant slot (M2 exactly 0), 37 slots (two programs, the last partial);
- plans whose statistic is finished once run like `jax.jit` through the Pallas and XLA emitters:
  GroupNorm with 3 channels per group on odd sizes, read by a pointwise kernel;
- the model's merge work per reader is what the template executes: a pointwise reader merges at
  every element, a conv reader once per program and channel chunk of its grid (the conv template's
  own grid and tiles), a matmul's row statistic once per program row; in the SD 1.5 tiny UNet and
  VAE plans (the full-size UNet: tests/test_sd15_unet_plan.py) every kernel's merge work is that of
  its term, finalize kernels follow their hosts.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat.cost import mma
from jax import lax

import emit
import eqsat
from emit.pallas import XlaFallbackWarning
from emit.pallas.partials import finalize
from eqsat.cost import merges, roofline
from eqsat.term import Term
from eqsat.types import format_type

OFFSET, SPREAD, CONSTANT = 1e4, 1e-2, 1234.5
EPS = float(np.finfo(np.float32).eps)
PLANNING = dict(extractor="greedy", extract_time_limit=120.0)


def _statistic(slots: int, op: str = "moments") -> Term:
    body = Term("Input", "x", format_type("float32", (slots, 64)))
    ty = format_type("float32", (2, slots) if op == "moments" else (slots,))
    return Term("EpilogueReduce", body, op, Term("Load", body, body.ty), "1", ty)


def _partials(tiles: int, slots: int, rng) -> np.ndarray:
    """Moments partials `[tiles, 3, slots]`: 1..5 samples of mean 1e4 and spread 1e-2 per tile and
    slot, about a third of the tiles empty (count 0, mean and M2 NaN), slot 0 constant."""
    counts = rng.integers(1, 6, size=(tiles, slots)).astype(np.float32)
    counts[rng.random((tiles, slots)) < 1 / 3] = 0
    counts[0] = np.maximum(counts[0], 1)
    means = (OFFSET + SPREAD * rng.normal(size=(tiles, slots))).astype(np.float32)
    means[:, 0] = CONSTANT
    m2 = (SPREAD ** 2 * counts * rng.random((tiles, slots))).astype(np.float32)
    m2[:, 0] = 0.0
    parts = np.stack([counts, np.where(counts > 0, means, np.nan), np.where(counts > 0, m2, np.nan)], axis=1)
    return parts.astype(np.float32)


def _exact(parts: np.ndarray) -> np.ndarray:
    p = np.asarray(parts, np.float64)
    n = p[:, 0]
    mean, m2 = np.where(n > 0, p[:, 1], 0.0), np.where(n > 0, p[:, 2], 0.0)
    total = n.sum(0)
    merged = (n * mean).sum(0) / np.maximum(total, 1.0)
    return np.stack([merged, (m2 + n * (mean - merged) ** 2).sum(0)])


@pytest.mark.parametrize("tiles,slots", [(300, 37), (7, 3), (1, 5), (2500, 3)])
def test_finalize_is_the_exact_merge_of_the_partials(tiles, slots):
    parts = _partials(tiles, slots, np.random.default_rng(tiles + slots))
    statistic = _statistic(slots)
    got = np.asarray(finalize(statistic, jnp.asarray(parts), name="test:finalize", interpret=True), np.float64)
    exact = _exact(parts)
    assert got.shape == (2, slots)
    np.testing.assert_allclose(got[0], exact[0], rtol=4 * EPS)
    np.testing.assert_allclose(got[1], exact[1], rtol=1e-5, atol=1e-30)
    assert got[1, 0] == 0.0 and np.float32(got[0, 0]) == np.float32(CONSTANT)  # a constant slot: its value


def test_finalize_of_sums_adds_the_tiles():
    rng = np.random.default_rng(2)
    sums = rng.normal(size=(300, 1, 37)).astype(np.float32) * 1e3
    got = finalize(_statistic(37, "sum"), jnp.asarray(sums), name="test:finalize", interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), sums[:, 0].astype(np.float64).sum(0), rtol=300 * EPS,
                               atol=1e-2)


def test_finalize_of_a_vae_statistic_compiles_for_an_h100_without_spills(tmp_path):
    """The VAE's largest statistic (4096 tiles of 32 GroupNorm slots; before one warp merged all 32
    slots in 128-tile blocks: 255 registers and 1 KB of spills per kernel) compiles for sm_90a with
    no spill: 8 tiles x 3 fields per thread (`FinalizeConfig`)."""
    from benchmarks import ptx
    from measure.xla_target import compile_for_h100

    statistic = _statistic(32)
    try:
        ptxas = ptx.ptxas_path()
    except ptx.PtxasMissing:
        pytest.skip("no ptxas (pip package nvidia-cuda-nvcc-cu12)")
    report = compile_for_h100(lambda buffer: finalize(statistic, buffer, name="vae:finalize", interpret=False),
                              jax.ShapeDtypeStruct((4096, 3, 32), jnp.float32), keep_dump=tmp_path)
    if report is None:
        pytest.skip("no H100 compile target here (the CUDA plugin): python -m measure.cuda_target install")
    found = {}
    for path in tmp_path.rglob("*.ptx"):
        if ".version" in path.read_text(errors="replace")[:4000]:
            found.update(ptx.run_ptxas(path, ptxas=ptxas))
    assert "vae_finalize" in found, sorted(found)
    resources = found["vae_finalize"]
    assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0, resources
    assert resources.registers <= 128, resources


def _group_norm_silu(x, groups):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups).astype(jnp.float32)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    y = ((g - mean) * lax.rsqrt(var + 1e-5)).reshape(x.shape)
    return jax.nn.silu(y)


@pytest.mark.parametrize("share_limit", [None, 0.0])
def test_a_statistic_read_by_a_pointwise_kernel_merged_in_place_or_finished_once(share_limit, monkeypatch):
    """GroupNorm (3 channels per group, 5x7 images, offset 1e4) of a conv's output, applied with SiLU
    in a pointwise kernel: at this size the model merges it in the pointwise reader (cheaper than a
    launch); finishing every statistic a reader merges (`share_limit` 0) puts a `finalize` kernel
    after the conv instead. Both plans run like `jax.jit` through the Pallas (interpret) and XLA
    emitters."""
    import extract.plan

    if share_limit is not None:
        monkeypatch.setattr(extract.plan, "finished_statistics",
                            lambda *args: roofline.finished_statistics(*args, share_limit=share_limit))
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 5, 7, 6)).astype(np.float32))
    w = jnp.asarray((0.1 * rng.normal(size=(3, 3, 6, 6))).astype(np.float32))

    def fn(x, w):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + OFFSET
        return y, _group_norm_silu(y, 2)

    plan = eqsat.optimize(fn, **PLANNING).lower(x, w).plan
    hosts = [k for k in plan.kernels if k.kind == "conv" and len(k.outputs) > 1]
    assert len(hosts) == 1, plan.kinds()
    pointwise = [k for k in plan.kernels if k.kind == "pointwise"]
    if share_limit is None:
        assert "finalize" not in plan.kinds() and pointwise[0].merge_seconds > 0
    else:
        assert plan.kinds().get("finalize") == 1 and pointwise[0].merge_seconds == 0.0
        assert [k.kind for k in plan.kernels].index("finalize") == hosts[0].index + 1
    want = jax.jit(fn)(x, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = emit.emit(plan, "pallas", interpret=True)(x, w)
    for backend_out in (pallas, emit.emit(plan, "xla")(x, w)):
        for got, ref in zip(backend_out, want):
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=2e-3, atol=2e-3)


# --- the model's merge work is the template's --------------------------------------------------------


def _conv_reader(batch, side, channels, out_channels, groups):
    """conv(silu(group_norm(y))) with y's GroupNorm statistic hosted by the conv writing y."""
    from eqsat.conv_params import ConvParams

    shape = (batch, side, side, channels)
    ty = format_type("float16", shape)
    x = Term("Input", "x", ty)
    w0 = Term("Input", "w0", format_type("float16", (channels, channels, 3, 3)))
    numbers = lax.conv_dimension_numbers(shape, (channels, channels, 3, 3), ("NHWC", "OIHW", "NHWC"))
    params = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), numbers).key
    host = Term("Conv", Term("Load", x, ty), Term("Load", w0, w0.ty), params, Term("Acc", ty), ty)
    grouped = format_type("float32", (batch, side, side, groups, channels // groups))
    body = Term("Unary", "convert_element_type:float32",
                Term("Reshape", Term("Load", host, ty), format_type("float16", (batch, side, side, groups,
                                                                               channels // groups))), grouped)
    stat_ty = format_type("float32", (2, batch, groups))
    statistic = Term("EpilogueReduce", host, "moments", body, "1,2,4", stat_ty)
    read = Term("Broadcast", Term("Reshape", Term("Slice", Term("Load", statistic, stat_ty), 0, 0, 1, 1,
                                                  format_type("float32", (1, batch, groups))),
                                  format_type("float32", (batch, groups))), "0,3",
                format_type("float32", (batch, groups, 1)))
    return host, statistic, read, params, shape


def test_a_conv_readers_merge_runs_once_per_program_and_channel_chunk():
    """The lanes a conv merges a statistic its input reads per (batch, channel) at: the template's
    programs (`emit.pallas.conv` grid: images x spatial tiles x output-channel tiles) times the input
    channels (its hoist runs once per channel chunk on a [1, block_k] tile)."""
    from emit.pallas import conv
    from eqsat.conv_params import ConvParams

    batch, side, channels, out_channels, groups = 2, 32, 320, 320, 32
    host, statistic, _read, params, shape = _conv_reader(batch, side, channels, out_channels, groups)
    # The reader: conv(x * mean) with `mean` the statistic's sum broadcast per (batch, channel).
    ty = host.ty
    sums = Term("Slice", Term("Load", statistic, statistic.ty), 0, 0, 1, 1, format_type("float32", (1, batch, groups)))
    per_channel = Term("Broadcast", Term("Reshape", sums, format_type("float32", (batch, groups))), "0,3",
                       format_type("float32", (batch, side, side, groups)))
    wide = Term("Reshape", Term("Broadcast", per_channel, "0,1,2,3",
                                format_type("float32", (batch, side, side, groups, channels // groups))),
                format_type("float32", shape))
    lhs = Term("Binary", "mul", Term("Unary", "convert_element_type:float32", Term("Load", host, ty),
                                     format_type("float32", shape)), wide, format_type("float32", shape))
    w1 = Term("Input", "w1", format_type("float16", (out_channels, channels, 3, 3)))
    out_ty = format_type("float32", (batch, side, side, out_channels))
    reader = Term("Conv", lhs, Term("Load", w1, w1.ty), params, Term("Acc", out_ty), out_ty)
    geometry = conv.ConvGeometry(ConvParams.parse(params), shape, (out_channels, channels, 3, 3),
                                 (batch, side, side, out_channels))
    grid = conv._grid(geometry, mma.conv_config(geometry))
    assert merges.merge_lanes(reader, statistic) == math.prod(grid) * channels
    tiles = merges.statistic_tiles(statistic)
    assert tiles == math.prod(conv._grid(geometry, mma.conv_config(geometry)))  # host: one row per program
    flops = merges.reader_merge_flops(reader, statistic)
    assert flops == math.prod(grid) * channels * tiles * merges.MERGE_INSTRUCTIONS["moments"] * merges.INSTRUCTION_FLOPS
    assert roofline.merge_cost(reader).flops == flops
    assert roofline.merge_cost(reader, finished=frozenset({statistic})).flops == 0.0
    # A pointwise reader of the same statistic merges at every element: far more than a finalize.
    pointwise = Term("Pointwise", lhs, format_type("float32", shape))
    assert merges.merge_lanes(pointwise, statistic) == math.prod(shape)
    assert merges.reader_merge_flops(pointwise, statistic) / roofline.get_device("h100").peak_fp32 \
        > 5 * merges.finalize_cost(statistic).seconds
    finished = roofline.finished_statistics([host, pointwise], {statistic: [host]})
    assert finished == {statistic}


def test_a_matmul_row_statistic_merges_in_the_pre_pass():
    """A LayerNorm-like row statistic read by a matmul's A prologue at its row (not moving with K)
    merges once per program row; one read at a K-dependent index merges per A element per N tile."""
    m, k, n = 256, 320, 960
    a = Term("Input", "a", format_type("float32", (m, k)))
    stat_ty = format_type("float32", (2, m))
    body = Term("Load", a, a.ty)
    statistic = Term("EpilogueReduce", a, "moments", body, "1", stat_ty)
    sums = Term("Reshape", Term("Slice", Term("Load", statistic, stat_ty), 0, 0, 1, 1, format_type("float32", (1, m))),
                format_type("float32", (m,)))
    by_row = Term("Broadcast", sums, "0", format_type("float32", (m, k)))
    w = Term("Input", "w", format_type("float32", (k, n)))
    out = format_type("float32", (m, n))
    lhs = Term("Binary", "sub", Term("Load", a, a.ty), by_row, a.ty)
    matmul = Term("Matmul", lhs, Term("Load", w, w.ty), "1;0;;", Term("Acc", out), out)
    shape = merges.matmul_shape(matmul)
    assert (shape.m, shape.n, shape.k) == (m, n, k)
    assert merges.merge_lanes(matmul, statistic) == shape.m_tiles * shape.block_m * shape.n_tiles
    square = format_type("float32", (k, k))
    by_k = Term("Broadcast", Term("Reshape", Term("Slice", sums, 0, 0, k, 1, format_type("float32", (k,))),
                                  format_type("float32", (k,))), "1", a.ty)
    inline = Term("Matmul", Term("Binary", "sub", Term("Load", a, a.ty), by_k, a.ty), Term("Load", w, w.ty), "1;0;;",
                  Term("Acc", out), out)
    assert square  # (a K-dependent read: the column's statistic)
    assert merges.merge_lanes(inline, statistic) == m * k * shape.n_tiles


def check_plan_merges(plan) -> None:
    """Every kernel's merge work is `merge_cost` of its term given the plan's finished statistics,
    every finalize follows its last host, and no statistic is both finished and merged in place."""
    finished = frozenset(k.term for k in plan.kernels if k.kind == "finalize")
    position: dict = {}
    for kernel in plan.kernels:
        if kernel.kind == "finalize":
            assert kernel.index > position[kernel.term]
            continue
        for tensor in kernel.outputs:
            position[tensor] = kernel.index
        assert kernel.merge_seconds == pytest.approx(roofline.merge_cost(kernel.term, plan.device, finished).seconds)
        for statistic in merges.statistics_read(kernel.term):
            if statistic in finished:
                assert roofline.merge_cost(kernel.term, plan.device).seconds >= kernel.merge_seconds


@pytest.mark.parametrize("component", ["unet", "vae"])
def test_sd15_tiny_plans_merge_as_the_templates_do(component):
    from sd15.workloads import workloads

    workload = workloads(batch=2, dtype="float16", config="tiny", components=(component,))[component]
    check_plan_merges(eqsat.optimize(workload.fn, **PLANNING).lower(*workload.args).plan)


def test_a_plan_with_a_finalize_kernel_compiles_for_an_h100_to_its_kernels_only(monkeypatch):
    """fp16 GroupNorm + SiLU (32 groups of 3 channels on 8x8 images) read by a pointwise kernel and
    a conv, every statistic finished once: the executable compiled for an H100 (Triton, deviceless)
    launches exactly the plan's kernels, the finalize among them, every one a Pallas kernel."""
    import extract.plan
    from measure.xla_target import compile_for_h100

    monkeypatch.setattr(extract.plan, "finished_statistics",
                        lambda *args: roofline.finished_statistics(*args, share_limit=0.0))
    shapes, dt = jax.ShapeDtypeStruct, jnp.float16

    def fn(x, w0, w1):
        y = lax.conv_general_dilated(x, w0, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        z = _group_norm_silu(y, 32).astype(dt)
        return z, lax.conv_general_dilated(z, w1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    args = (shapes((2, 8, 8, 16), dt), shapes((3, 3, 16, 96), dt), shapes((3, 3, 96, 32), dt))
    plan = eqsat.optimize(fn, **PLANNING).lower(*args).plan
    assert plan.kinds().get("finalize") == 1, plan.kinds()
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args)
    if report is None:
        pytest.skip("no H100 compile target here (the CUDA plugin): python -m measure.cuda_target install")
    names = [launch.name for launch in report.launches if launch.counted != "none"]
    assert report.by_category == {"Pallas (Triton)": len(plan.kernels)}, names
    assert report.kernels == len(plan.kernels) and report.copies == 0 and report.memsets == 0, names
