"""The cost model's Mosaic GPU work (`eqsat.cost.mosaic`) against what the Mosaic templates launch, the
per-kernel backend choice (`eqsat.cost.backends`, `emit.backends.plan_routes`) and the `routed` backend.

The templates' launches are read by tracing the emitted plan (`jax.eval_shape`, compiled mode) with
`plgpu.kernel` replaced by a recorder: the grid, the template config and the operand arrays each
Mosaic kernel is launched with; nothing runs."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from benchmarks.mosaic_ptx import AttentionShape, attention_fn
from emit.backends import TritonFallbackWarning, plan_routes
from eqsat.cost import get_device, kernel_cost
from eqsat.cost.backends import ROUTES, routes_for
from eqsat.cost.roofline import choose_route as choose
from eqsat.cost.roofline import route_cost
from eqsat.cost.devices import with_backend
from eqsat.cost.mosaic import mosaic_work
from eqsat.cost.terms import args_of
from tests.test_emit_mosaic_conv_ranges import _conv_and_shortcut, _gn_silu_concat_conv

S, F16 = jax.ShapeDtypeStruct, jnp.float16
DENSE = ("Matmul", "Conv", "Attention")


def _plan(fn, args, backend="mosaic"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(fn, progress=False, backend=backend, cache=False).lower(*args)


@pytest.fixture
def launches(monkeypatch):
    """The Mosaic kernels an emitted plan launches: body, grid and operand shapes (nothing runs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from emit.mosaic import finish

    recorded = []

    def kernel(body, out_type, grid, **options):
        def launch(*operands):
            recorded.append({"body": body, "grid": tuple(grid), "operands": [(x.shape, jnp.dtype(x.dtype)) for x in operands]})
            return jax.tree.map(lambda out: jnp.zeros(out.shape, out.dtype), out_type)  # a result and any partials

        return launch

    monkeypatch.setattr(plgpu, "kernel", kernel)
    # a conv finishing its statistics passes its ticket counter on: `emit.mosaic.finish.counter_kernel`
    monkeypatch.setattr(finish, "counter_kernel", lambda body, out_type, grid, *_a, **_k: (
        lambda *operands: (kernel(body, out_type, grid)(*operands[:-1]), operands[-1])))
    return recorded


def _implied(launch) -> dict:
    """CTAs, wgmma flops, TMA bytes and stages a recorded launch's template config implies."""
    from emit.mosaic import attention, conv_halo, matmul

    body, grid, operands = launch["body"], launch["grid"], launch["operands"]
    ctas = math.prod(grid)
    if body.func is conv_halo._kernel:  # the haloed conv: raw input rows, vectors and weights per chunk
        kw = body.keywords
        blocks, halo, n_vectors, parts = kw["blocks"], kw["grid"], kw["n_vectors"], kw["parts"]
        (_, _, width, _), item = operands[0][0], operands[0][1].itemsize
        tables = operands[len(parts) + 2:len(parts) + 2 + n_vectors]  # [B', rows, C] each
        steps = sum(part.chunks * len(part.tap_list) for part in parts)
        sub_tiles = (blocks.tile_m // blocks.epi_m) * (blocks.tile_n // blocks.epi_n)
        epilogue_operands = list(zip(kw["kinds"], operands[len(parts) + 2 + n_vectors:]))
        epilogue = sum(dtype.itemsize * {"tile": blocks.epi_m * blocks.epi_n, "col": blocks.epi_n,
                                         "phase col": blocks.epi_n, "row": blocks.epi_m}[kind]
                       for kind, (_shape, dtype) in epilogue_operands if kind != "pixel")
        # a residual read as it lies: each of its elements once, by the CTA storing that pixel
        pixels = sum(math.prod(shape) * dtype.itemsize for kind, (shape, dtype) in epilogue_operands if kind == "pixel")
        vectors = sum(part.chunks * sum(rows * 64 * tables[t][1].itemsize for t, _row, rows in part.vectors)
                      for part in parts)
        # a staged row copies its strip's columns inside the image: the whole row without strips
        columns = sum(halo.strip_columns(s)[1] for s in range(halo.strips))
        assert halo.strips > 1 or columns == width
        staged = (ctas // halo.strips) * sum(part.chunks for part in parts) * halo.row_copies * columns * 64 * item
        tma = staged + ctas * (vectors + steps * 64 * blocks.tile_n * item + halo.staging * 2 + sub_tiles * epilogue)
        tma += pixels
        return {"ctas": ctas, "wgmma_flops": 2.0 * ctas * blocks.tile_m * blocks.tile_n * steps * 64,
                "tma_bytes": tma, "stages": blocks.stages}
    if body.func is matmul._kernel:  # the matmul and the conv (an A window)
        blocks, kinds, kp = body.keywords["blocks"], body.keywords["kinds"], body.keywords["k_padded"]
        item = operands[1][1].itemsize  # B's
        prologue = body.keywords.get("prologue")
        if prologue is None:
            tma = ctas * kp * (blocks.tile_m + blocks.cta_tile_n) * item
        else:  # A's prologue sources: tiles and K vectors per step, row vectors re-read at each step
            steps = kp // blocks.tile_k
            tma = ctas * kp * blocks.cta_tile_n * item
            for source in prologue[1]:
                per_step = {"tile": blocks.tile_m * blocks.tile_k, "col": blocks.tile_k, "row": blocks.tile_m}
                tma += ctas * steps * per_step[source.kind] * source.dtype.itemsize
        for kind, (_shape, dtype) in zip(kinds, operands[2:]):
            tma += ctas * dtype.itemsize * {"tile": blocks.tile_m * blocks.cta_tile_n, "col": blocks.cta_tile_n,
                                             "row": blocks.tile_m}[kind]
        return {"ctas": ctas, "wgmma_flops": 2.0 * ctas * blocks.tile_m * blocks.cta_tile_n * kp, "tma_bytes": tma,
                "stages": blocks.stages}
    assert body.func is attention._kernel
    blocks = body.keywords["blocks"]
    k_shape, item = operands[1][0], operands[0][1].itemsize  # K [batch, kv, heads', head] or [batch, heads, kv, head]
    kv_padded, head = k_shape[1 if body.keywords["layouts"].k_seq_major else 2], k_shape[3]
    rows = blocks.block_q * blocks.compute_wgs
    tma = ctas * rows * head * item + ctas * kv_padded * 2 * head * item
    if body.keywords["has_bias"]:
        tma += ctas * kv_padded * rows * 4
    return {"ctas": ctas, "wgmma_flops": 4.0 * ctas * rows * kv_padded * head, "tma_bytes": tma,
            "stages": blocks.stages}


def _dense(x, w, b):
    return x @ w + b


def _gn_silu_conv(x, w, b, gamma, beta):
    from sd15 import layers

    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, 2, 1e-5)))


def _gn_silu_conv_residual(x, w, b, gamma, beta, r):
    from sd15 import layers

    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    groups = x.shape[-1] // 3  # 3 channels per group
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, groups, 1e-5))) + r


def _upsample_conv(x, w, b):
    from sd15 import layers

    return layers.upsample({"u.conv.weight": w, "u.conv.bias": b}, "u", x)


def _stride2_conv(x, w, b):
    from sd15 import layers

    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x, stride=2)


def _attention(causal):
    from sd15.layers import attention

    mask = np.where(np.arange(77)[:, None] >= np.arange(77)[None, :], 0.0, np.finfo(np.float32).min).astype(np.float32)
    return lambda q, k, v: attention(q, k, v, 2, bias=mask if causal else None)


def _cross_attention(heads):
    from sd15.layers import attention

    return lambda q, k, v: attention(q, k, v, heads)


CASES = {
    # 77 tokens, K = 40, N = 96: every side padded to the tiles
    "matmul 77x40x96": (_dense, (S((77, 40), F16), S((40, 96), F16), S((96,), F16))),
    # 136 rows (a multiple of 8), K = 40 (below one 64-wide step), N = 192: read and written in place
    "matmul 136x40x192 in place": (_dense, (S((136, 40), F16), S((40, 192), F16), S((192,), F16))),
    # GEGLU's value * gelu(gate) computed in the kernel from the two halves of a [136, 128] tensor
    "matmul geglu prologue": (lambda h, w: (h[:, :64] * jax.nn.gelu(h[:, 64:], approximate=True)) @ w,
                              (S((136, 128), F16), S((64, 96), F16))),
    # a normalization applied from row statistics in the kernel: (x - mean) * rstd * gamma + beta
    "matmul norm prologue": (lambda x, st, g, b, w: ((x - st[0][:, None]) * st[1][:, None] * g + b) @ w,
                             (S((136, 64), F16), S((2, 136), F16), S((64,), F16), S((64,), F16), S((64, 64), F16))),
    # 15x15 image, GroupNorm with 3 channels per group + SiLU, 3x3 conv to 16 channels
    "conv 15x15 gn": (_gn_silu_conv, (S((1, 15, 15, 6), F16), S((16, 6, 3, 3), F16), S((16,), F16),
                                      S((6,), F16), S((6,), F16))),
    # 192 channels (3 per group) on a 15x15 image, 2 images: the haloed template (raw input staged by
    # TMA, the prologue in SMEM), a residual and per-image statistics
    "conv 15x15 gn haloed": (_gn_silu_conv_residual, (S((2, 15, 15, 192), F16), S((80, 192, 3, 3), F16), S((80,), F16),
                                                      S((192,), F16), S((192,), F16), S((2, 15, 15, 80), F16))),
    # 64 outputs on 15x15 and 17x9 images: the output stored as pixels, the residual read as it lies
    "conv 15x15 gn residual as pixels": (_gn_silu_conv_residual, (S((2, 15, 15, 192), F16), S((64, 192, 3, 3), F16),
                                                                  S((64,), F16), S((192,), F16), S((192,), F16),
                                                                  S((2, 15, 15, 64), F16))),
    "conv 17x9 gn residual as pixels": (_gn_silu_conv_residual, (S((1, 17, 9, 192), F16), S((128, 192, 3, 3), F16),
                                                                 S((128,), F16), S((192,), F16), S((192,), F16),
                                                                 S((1, 17, 9, 128), F16))),
    # concat(h, skip) under the GroupNorm: two K ranges, each its own staged tensor and prologue
    "conv concat gn haloed": (_gn_silu_concat_conv, (S((1, 15, 15, 192), F16), S((1, 15, 15, 192), F16),
                                                     S((384,), F16), S((384,), F16), S((16, 384, 3, 3), F16),
                                                     S((16,), F16))),
    # 300-pixel rows (over a TMA box): two strips of 150 outputs, each staging 151 of the input's columns
    "conv wide rows haloed": (_gn_silu_conv_residual, (S((1, 3, 300, 192), F16), S((80, 192, 3, 3), F16),
                                                       S((80,), F16), S((192,), F16), S((192,), F16),
                                                       S((1, 3, 300, 80), F16))),
    # concat(64, 128) in groups of 3: group 21 spans both tensors (the cut made in the distributed form)
    "conv concat inside a group haloed": (_gn_silu_concat_conv, (S((1, 15, 15, 64), F16), S((1, 15, 15, 128), F16),
                                                                 S((192,), F16), S((192,), F16),
                                                                 S((16, 192, 3, 3), F16), S((16,), F16))),
    # the 1x1 shortcut merged with the 3x3 conv2: a 64-channel range over the centre tap, then 192 x 9 taps
    "conv merged shortcut haloed": (_conv_and_shortcut, (S((2, 15, 15, 64), F16), S((2, 15, 15, 192), F16),
                                                         S((192,), F16), S((192,), F16), S((64, 192, 3, 3), F16),
                                                         S((64,), F16), S((64, 64, 1, 1), F16), S((64,), F16))),
    # a 3x3 conv over a nearest-2x upsample of a 15x15 image: four phases of a conv over the source
    "conv upsample haloed": (_upsample_conv, (S((2, 15, 15, 64), F16), S((128, 64, 3, 3), F16), S((128,), F16))),
    "conv stride 2": (_stride2_conv, (S((2, 15, 15, 8), F16), S((24, 8, 3, 3), F16), S((24,), F16))),
    # a downsampler over 64 channels: the haloed template, two row phases staged, every other row per tap
    "conv stride 2 haloed": (_stride2_conv, (S((2, 15, 15, 64), F16), S((80, 64, 3, 3), F16), S((80,), F16))),
    # 77 tokens, 2 heads of 40
    "attention 77 head 40": (_attention(False), (S((1, 77, 80), F16),) * 3),
    "attention causal": (_attention(True), (S((2, 77, 80), F16),) * 3),
    # heads of 80 (as they are) over 200 keys: three full key blocks through the ring, then a tail of 8
    "attention 200 keys head 80": (_cross_attention(2), (S((1, 20, 160), F16), S((1, 200, 160), F16),
                                                          S((1, 200, 160), F16))),
    # one head of 160 (64-byte swizzle), 130 queries in two 128-row CTAs, 130 keys: 2 full blocks + a tail
    "attention 130 head 160": (_cross_attention(1), (S((1, 130, 160), F16),) * 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_matches_what_the_template_launches(case, launches):
    """CTAs, wgmma flops (padded), TMA bytes and pipeline stages of every Mosaic kernel of the plan:
    the model's (`mosaic_work`) equal what the template's launch implies."""
    fn, args = CASES[case]
    lowered = _plan(fn, args)
    dense = [k.term for k in lowered.plan.kernels if k.op in DENSE]
    assert dense, [k.kind for k in lowered.plan.kernels]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)  # every dense kernel on its Mosaic template
        jax.eval_shape(emit.emit(lowered.plan, "mosaic", interpret=False), *args)
    assert len(launches) == len(dense)
    for term, launch in zip(dense, launches):
        work = mosaic_work(term)
        implied = _implied(launch)
        modeled = {"ctas": work.ctas, "wgmma_flops": work.wgmma_flops, "tma_bytes": work.tma_bytes,
                   "stages": work.stages}
        assert modeled == implied, (term.op, modeled, implied)
        assert work.wgmma_flops >= work.work.useful_mma_flops > 0


def test_the_layout_fusions_the_model_counts():
    """A 77-row matmul pads A and slices the output (two fusions); the conv lays its input and weights
    out and unflattens its output; attention pads q, k and v (heads of 40, 77 tokens), each its own tensor."""
    for case, expected in (("matmul 77x40x96", {"A laid out", "B laid out", "output sliced"}),
                           ("conv 15x15 gn", {"input laid out", "weights laid out", "output unflattened"}),
                           ("attention 77 head 40", {"q laid out", "k laid out", "v laid out", "output sliced"}),
                           ("attention causal", {"k laid out", "bias materialized"})):
        fn, args = CASES[case]
        term = next(k.term for k in _plan(fn, args).plan.kernels if k.op in DENSE)
        glue = {g.what for g in mosaic_work(term).glue}
        assert expected <= glue, (case, glue)


def test_an_in_place_matmul_launches_on_the_unpadded_arrays_and_the_model_counts_no_glue(launches):
    """M a multiple of 8, N of 64, K below 64: the kernel is launched on the arrays as they are (no
    pad before it, its output not sliced after it) and the model charges no fusion around it; a
    77-row matmul still pads (Mosaic's tiled TMA needs whole 8-row tiles) and the model says so."""
    fn, args = CASES["matmul 136x40x192 in place"]
    lowered = _plan(fn, args)
    (term,) = [k.term for k in lowered.plan.kernels if k.op in DENSE]
    assert mosaic_work(term).glue == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        out = jax.eval_shape(emit.emit(lowered.plan, "mosaic", interpret=False), *args)
    (launch,) = launches
    assert launch["body"].keywords["in_place"] == (136, 192)
    assert [shape for shape, _ in launch["operands"][:2]] == [(1, 136, 40), (1, 40, 192)]
    assert out.shape == (136, 192)
    fn, args = CASES["matmul 77x40x96"]
    (term,) = [k.term for k in _plan(fn, args).plan.kernels if k.op in DENSE]
    assert {g.what for g in mosaic_work(term).glue} == {"A laid out", "B laid out", "output sliced"}


def test_the_haloed_conv_reads_its_input_as_it_lies(launches):
    """A GroupNorm+SiLU conv over 192 channels runs on the haloed template: the kernel's first operand
    is the plan's NHWC input itself, and the model charges no fusion for it (only the weights' layout
    and the output's slice; the statistics gathered per channel are written by the statistic's own
    reduce kernel, no launch)."""
    from emit.mosaic import conv_halo
    from eqsat.cost.mosaic import TABLE_BY_STATISTIC

    fn, args = CASES["conv 15x15 gn haloed"]
    lowered = _plan(fn, args)
    (term,) = [k.term for k in lowered.plan.kernels if k.op == "Conv"]
    glue = [g.what for g in mosaic_work(term).glue]
    assert glue == ["weights laid out", TABLE_BY_STATISTIC, "output unflattened"], glue
    assert mosaic_work(term).glue_launches == 2
    assert mosaic_work(term).work.alu_flops > 0  # the prologue again on halo rows and per output-channel tile
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        jax.eval_shape(emit.emit(lowered.plan, "mosaic", interpret=False), *args)
    (launch,) = [rec for rec in launches if rec["body"].func is conv_halo._kernel]
    assert launch["operands"][0] == ((2, 15, 15, 192), jnp.dtype(jnp.float16))


def test_smem_fit_keeps_the_stages_a_residual_leaves_room_for():
    """A 128 x 256 tile with a residual in its epilogue fits 3 of its 4 stages in SMEM (4 overflowed
    the H100's 232,448 bytes: 246,880 measured at compile); the model reads the same config."""
    from emit.mosaic.matmul import SMEM_BYTES, MosaicBlocks, fit_smem, smem_bytes

    blocks = MosaicBlocks.get_default(4096, 1280, 320)
    assert (blocks.tile_m, blocks.cta_tile_n, blocks.stages) == (128, 256, 4)
    assert smem_bytes(blocks, 2, 2, [("tile", 2)]) > SMEM_BYTES >= smem_bytes(blocks, 2, 2, [("col", 2)])
    assert fit_smem(blocks, 2, 2, [("tile", 2)]).stages == 3
    assert fit_smem(blocks, 2, 2, [("col", 2)]).stages == 4


def test_auto_picks_what_the_model_prices_lowest():
    """Under `auto` each dense kernel gets the route the model prices lowest, and each route wins
    somewhere: Triton a short masked attention (Mosaic pays its layout fusions), Mosaic a long
    attention on the calibrated profile (Triton's softmax costs its measured instructions), the
    library a GroupNorm+SiLU conv on the calibrated profile."""
    cases = (
        (attention_fn(AttentionShape("clip", 1, 2, 77, 77, 40, causal=True)), (S((1, 77, 80), F16),) * 3,
         "h100", "triton"),
        (attention_fn(AttentionShape("unet32", 2, 8, 1024, 1024, 80)), (S((2, 1024, 640), F16),) * 3,
         "h100-calibrated", "mosaic"),
        (_gn_silu_conv, (S((2, 16, 16, 640), F16), S((640, 640, 3, 3), F16), S((640,), F16), S((640,), F16),
                         S((640,), F16)), "h100-calibrated", "library"),
    )
    for fn, args, profile, winner in cases:
        term = next(k.term for k in _plan(fn, args, backend="pallas").plan.kernels if k.op in DENSE)
        device = with_backend(profile, "auto")
        prices = {route: route_cost(term, route, device).seconds for route in routes_for(term.op, args_of(term), device)}
        route, cost = choose(term, device)
        assert route == min(prices, key=prices.get) == winner, prices
        assert cost.seconds == prices[winner] == kernel_cost(term, device).seconds
        assert kernel_cost(term, with_backend(profile, "triton")).seconds == prices["triton"]


def test_backend_named_devices_round_trip():
    device = with_backend("h100", "mosaic")
    assert device.name == "h100+mosaic" and get_device("h100+mosaic") == device
    assert with_backend(device, "triton") == get_device("h100")
    assert get_device("h100-calibrated+auto").calibrated
    with pytest.raises(ValueError):
        with_backend("h100", "cuda")
    assert set(ROUTES) == {"triton", "mosaic", "library"}


def test_routed_backend_emits_each_kernel_by_its_route(launches):
    """`routed` (what `auto` is on a Hopper GPU) emits the kernels the model routes to Mosaic through
    the Mosaic templates, the library ones through XLA, the rest through Triton; `report()` says how many."""
    fn = attention_fn(AttentionShape("unet32", 2, 8, 1024, 1024, 80))
    args = (S((2, 1024, 640), F16),) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = eqsat.optimize(fn, progress=False, backend="routed", device="h100-calibrated", cache=False).lower(*args)
    assert lowered.stats["cost_backend"] == "auto" and lowered.stats["device"] == "h100-calibrated+auto"
    routes = plan_routes(lowered.plan)
    assert list(routes.values()) == ["mosaic"]
    assert [route for _name, route in lowered.stats["kernel_routes"]] == ["mosaic"]
    assert "1 mosaic" in lowered.report()
    jax.eval_shape(emit.emit(lowered.plan, "routed", interpret=False), *args)
    assert len(launches) == 1


def test_default_pricing_is_unchanged_on_a_cpu():
    """Without a GPU `auto` stays `xla` and the plan is priced by the Triton templates, as before."""
    lowered = _plan(_dense, CASES["matmul 77x40x96"][1], backend="auto")
    assert emit.resolve_backend("auto") == "xla"
    assert lowered.stats["cost_backend"] == "triton" and lowered.stats["kernel_routes"] == []
    assert lowered.stats["device"] == "h100"


def test_an_epilogue_the_template_declines_is_not_priced_on_mosaic():
    """An epilogue that depends on the index itself (an `Iota`) is not a form the Mosaic matmul maps
    onto its tile: the model gives that kernel no Mosaic route, as emission runs it through Triton."""
    from eqsat.cost.mosaic import covers_term
    from eqsat.term import Term

    fn, args = CASES["matmul 77x40x96"]
    term = next(k.term for k in _plan(fn, args).plan.kernels if k.op == "Matmul")
    lhs, rhs, dims, epilogue, ty = term.args
    iota = Term("Iota", 1, epilogue.ty)
    index_dependent = Term("Matmul", lhs, rhs, dims, Term("Binary", "add", epilogue, iota, epilogue.ty), ty)
    auto = with_backend("h100", "auto")
    assert covers_term(term) and not covers_term(index_dependent)
    assert routes_for("Matmul", args_of(term), auto, term) == ("triton", "mosaic", "library")
    assert routes_for("Matmul", args_of(index_dependent), auto, index_dependent) == ("triton", "library")


def _layernorm_of_dense(x, w, b):
    y = x @ w + b
    mean = y.mean(-1, keepdims=True)
    return (y - mean) * jax.lax.rsqrt(jnp.square(y - mean).mean(-1, keepdims=True) + 1e-5), y


@pytest.mark.parametrize("fn,shape,written", [(_layernorm_of_dense, (72, 40, 128), True),
                                              (_layernorm_of_dense, (77, 40, 128), False)])
def test_the_reduce_kernels_the_model_charges_are_the_ones_emitted(fn, shape, written, launches):
    """A LayerNorm statistic hosted on a Mosaic matmul: written as partials by the kernel when its
    output lies in place (72 tokens; the model charges no reduce kernel, `driver_reduced` leaves it
    out), reduced by its own kernel after it when the output is padded (77 tokens). The launches of
    the emitted plan are the planned kernels plus the model's driver-reduced statistics."""
    from eqsat.cost import hosted_reductions
    from eqsat.cost import kernels as kernel_order
    from eqsat.cost.roofline import driver_reduced, finished_statistics
    from tests.test_emit_matmul import pallas_calls

    tokens, k, n = shape
    args = (S((1, tokens, k), F16), S((k, n), F16), S((n,), F16))
    lowered = _plan(fn, args)
    plan = lowered.plan
    (matmul,) = [k for k in plan.kernels if k.op == "Matmul" and k.hosted]
    assert len(matmul.hosted) == 1
    outputs = list(plan.outputs)
    hosting = hosted_reductions(outputs)
    order = kernel_order(outputs, hosting)
    device = get_device(plan.device)
    routes, reduced = driver_reduced(order, hosting, device, finished_statistics(order, hosting, device, outputs))
    assert routes[id(matmul.term)] == "mosaic"
    assert (matmul.hosted[0] not in reduced) is written
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        closed = jax.make_jaxpr(emit.emit(plan, "mosaic", interpret=False)._run_leaves)(list(args))
    assert len(launches) + len(pallas_calls(closed.jaxpr)) == len(plan.kernels) + len(reduced)


def _conv_groupnorm(x, w, b, gamma, beta):
    """A 3x3 conv and its output's GroupNorm (32 groups) + SiLU: a pointwise reader."""
    from sd15 import layers

    p = {"a.weight": w, "a.bias": b, "n.weight": gamma, "n.bias": beta}
    return layers.silu(layers.group_norm(p, "n", layers.conv2d(p, "a", x), 32, 1e-5))


def _conv_groupnorm_conv(x, w, b, gamma, beta, w2, b2):
    """The same, read by a second 3x3 conv (a Mosaic reader: it reads the statistic finished)."""
    from sd15 import layers

    p = {"c.weight": w2, "c.bias": b2}
    return layers.conv2d(p, "c", _conv_groupnorm(x, w, b, gamma, beta))


@pytest.mark.parametrize("fn,cin,extra,finalized", [
    (_conv_groupnorm, 192, (), False),                         # haloed host, Triton pointwise reader: merged there
    (_conv_groupnorm, 4, (), False),                           # flat-grid host (4 channels in)
    # a Mosaic conv reads it: finished by its host's last CTA (`eqsat.cost.finish`), no finalize
    (_conv_groupnorm_conv, 192, (S((128, 320, 3, 3), F16), S((128,), F16)), False),
])
def test_a_groupnorm_a_mosaic_conv_writes_needs_no_reduce_kernel(fn, cin, extra, finalized, launches):
    """A GroupNorm statistic (2 images x 32 groups of 10) hosted on a Mosaic conv: the conv writes
    its partials (`writes_partials`; the model charges no reduce kernel for it), and the emitted
    launches are the planned kernels: a Triton kernel merges it where it reads it, and where a Mosaic
    conv reads it finished, the host's last CTA finishes it (`eqsat.cost.finish`; a finalize kernel
    before, `driver_reduced`'s count)."""
    from eqsat.cost import hosted_reductions
    from eqsat.cost import kernels as kernel_order
    from eqsat.cost.backends import hosted_extra, writes_partials
    from eqsat.cost.roofline import driver_reduced, finished_statistics
    from tests.test_emit_matmul import pallas_calls

    args = (S((2, 16, 16, cin), F16), S((320, cin, 3, 3), F16), S((320,), F16), S((320,), F16), S((320,), F16),
            *extra)
    plan = _plan(fn, args).plan
    (host,) = [k for k in plan.kernels if k.op == "Conv" and k.hosted]
    (statistic,) = host.hosted
    assert writes_partials(statistic, "mosaic", host.term)
    assert hosted_extra(statistic, "mosaic", "h100", host.term).seconds == 0
    outputs = list(plan.outputs)
    hosting = hosted_reductions(outputs)
    order = kernel_order(outputs, hosting)
    device = get_device(plan.device)
    routes, reduced = driver_reduced(order, hosting, device, finished_statistics(order, hosting, device, outputs))
    assert routes[id(host.term)] == "mosaic"
    assert (statistic in reduced) is finalized
    from eqsat.cost.roofline import producer_finished_of

    in_producer = producer_finished_of(order, hosting, routes, device, finished_statistics(order, hosting, device,
                                                                                          outputs))
    assert (statistic in in_producer) is (fn is _conv_groupnorm_conv and cin == 192)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        closed = jax.make_jaxpr(emit.emit(plan, "mosaic", interpret=False)._run_leaves)(list(args))
    assert len(launches) + len(pallas_calls(closed.jaxpr)) == len(plan.kernels) + len(reduced)


@pytest.mark.parametrize("case", ["conv 15x15 gn residual as pixels", "conv 17x9 gn residual as pixels",
                                  "conv upsample haloed"])
def test_a_conv_storing_pixels_is_charged_no_slice_and_no_residual_gather(case, launches):
    """Where the haloed conv stores its output's pixels itself (`stores_pixels`: NHWC, whole N tiles)
    the model charges no unflatten and no residual on the flat grid, and stores only the pixels; the
    template launched so: its output the NHWC elements, its residual a `pixel` operand."""
    from emit.mosaic import conv_halo

    fn, args = CASES[case]
    lowered = _plan(fn, args)
    (term,) = [k.term for k in lowered.plan.kernels if k.op == "Conv"]
    work = mosaic_work(term)
    glue = {g.what for g in work.glue}
    assert not glue & {"output unflattened", "residual on the flat grid"}, glue
    out = jax.eval_shape(emit.emit(lowered.plan, "mosaic", interpret=False), *args)
    assert work.store_bytes == math.prod(out.shape) * 2
    (launch,) = [rec for rec in launches if rec["body"].func is conv_halo._kernel]
    assert launch["body"].keywords["view"] is not None
    assert ("pixel" in launch["body"].keywords["kinds"]) == ("residual" in case)
