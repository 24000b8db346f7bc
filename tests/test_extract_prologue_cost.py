"""Extraction charges a conv's input expression as the conv template computes it.

The template evaluates its input expression (a GroupNorm apply + SiLU, say) once per window tap
and per output-channel tile (`eqsat.cost.roofline.conv_prologue_evaluations`), and the plan's
roofline cost (`eqsat.cost.kernel_cost`) charges it so. Extraction must charge the same, so that it
stores the expression's value in a pointwise kernel and reads it when recomputing it costs more.

The e-graphs are built by hand: `conv(silu(x * scale + shift))`, one kernel per op, saturated with
"inline an elementwise producer", so the conv may compute its input itself, read it stored, or read
any stored intermediate and compute the rest; every selection of these small graphs is enumerated.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from egglog import StringLike, rewrite, ruleset
from jax import lax

from eqsat import lang as L
from eqsat.conv_params import ConvParams
from eqsat.cost import count_kernels, dag_cost, kernels
from eqsat.cost import roofline
from eqsat.egraph import Builder
from eqsat.term import Term
from eqsat.types import format_type
from extract import extract, load
from extract.greedy import extract_greedy, polish
from extract.ilp import extract_ilp
from extract.serialized import GLOBAL, Selection

inline = ruleset(name="test_prologue_inline")


@inline.register
def _inline(e: L.Expr, ty: StringLike):
    yield rewrite(L.Load(L.Pointwise(e, ty), ty)).to(e)  # inline an elementwise producer


def ld(t: Term) -> Term:
    return Term("Load", t, t.ty)


def conv_params(lhs_shape, rhs_shape, padding):
    numbers = lax.conv_dimension_numbers(lhs_shape, rhs_shape, ("NHWC", "OIHW", "NHWC"))
    return ConvParams.from_lax((1, 1), padding, (1, 1), (1, 1), numbers)


def conv(lhs: Term, rhs: Term, lhs_shape, rhs_shape, dtype="float16") -> Term:
    window = rhs_shape[2]
    params = conv_params(lhs_shape, rhs_shape, ((window // 2,) * 2,) * 2)
    out = format_type(dtype, (*lhs_shape[:3], rhs_shape[0]))
    return Term("Conv", lhs, rhs, params.key, Term("Acc", out), out)


def affine_silu_conv(batch: int, side: int, channels: int, out_channels: int, window: int = 3):
    """conv(silu(x * scale + shift)) (a GroupNorm's affine apply and SiLU), one kernel per op;
    returns (output, input expression of the conv with every op inlined)."""
    shape = (batch, side, side, channels)
    ty = format_type("float16", shape)
    x = Term("Input", "x", ty)
    scale, shift = Term("Input", "scale", f"f16[{channels}]"), Term("Input", "shift", f"f16[{channels}]")
    affine = Term("Binary", "add", Term("Binary", "mul", ld(x), Term("Broadcast", ld(scale), "3", ty), ty),
                  Term("Broadcast", ld(shift), "3", ty), ty)
    silu = Term("Binary", "mul", affine, Term("Unary", "logistic", affine, ty), ty)
    scaled = Term("Pointwise", Term("Binary", "mul", ld(x), Term("Broadcast", ld(scale), "3", ty), ty), ty)
    shifted = Term("Pointwise", Term("Binary", "add", ld(scaled), Term("Broadcast", ld(shift), "3", ty), ty), ty)
    sigmoid = Term("Pointwise", Term("Unary", "logistic", ld(shifted), ty), ty)
    stored = Term("Pointwise", Term("Binary", "mul", ld(shifted), ld(sigmoid), ty), ty)
    w = Term("Input", "w", format_type("float16", (out_channels, channels, window, window)))
    return conv(ld(stored), ld(w), shape, (out_channels, channels, window, window)), silu


def saturated(outputs):
    builder = Builder()
    handles = builder.add(outputs)
    builder.egraph.run(inline.saturate())
    graph = load(builder.egraph._serialize())
    return graph, graph.roots_of_handles(handles), handles


def every_selection(graph, roots):
    """Every complete, acyclic selection of the slots reached from `roots`."""
    stack = [({}, [(r, GLOBAL) for r in roots])]
    while stack:
        assigned, pending = stack.pop()
        pending = [slot for slot in pending if slot not in assigned]
        if not pending:
            selection = Selection(graph, dict(assigned), list(roots))
            try:
                selection.postorder()
            except ValueError:
                continue
            yield selection
            continue
        slot, rest = pending[-1], pending[:-1]
        for node in graph.class_nodes[slot[0]]:
            trial = dict(assigned)
            trial[slot] = node
            children = Selection(graph, trial, list(roots)).child_slots(slot)
            stack.append((trial, rest + [c for c in children if c not in trial]))


# Full SD 1.5 width: 320 channels in, 64x64 latents, batch 2. 1280 outputs are 10 channel tiles
# (60 evaluations per element of the four-op input, SiLU's logistic ~10 instructions): storing it
# wins; 128 outputs are 1 tile (6): recomputing wins (with 320 outputs, 3 tiles and 18 evaluations,
# it did while the cost model charged every op one flop; `roofline.ALU_INSTRUCTIONS` counts the
# logistic's instructions); a 1x1 conv with 128 outputs evaluates its input once: nothing to store.
SHAPES = {"store": (2, 64, 320, 1280, 3), "recompute": (2, 64, 320, 128, 3), "once": (2, 64, 320, 128, 1)}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_every_selection_costs_what_the_plan_reports(case):
    """`Selection.cost` (what every extractor optimizes) equals the roofline cost of the terms it
    builds, for every selection: the input expression computed, or read from either stored kernel."""
    out, _ = affine_silu_conv(*SHAPES[case])
    graph, roots, _ = saturated([out])
    costs = graph.node_costs()
    count = 0
    for selection in every_selection(graph, roots):
        terms, _ = selection.to_terms()
        assert selection.cost(costs) == pytest.approx(dag_cost(terms).seconds, rel=1e-9)
        count += 1
    assert count >= 16  # conv(silu(affine(x))), conv(Load(silu)), conv(silu(Load(affine))), ...


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_greedy_and_ilp_find_the_cheapest_plan(case):
    out, silu = affine_silu_conv(*SHAPES[case])
    graph, roots, handles = saturated([out])
    costs = graph.node_costs()
    best = min(every_selection(graph, roots), key=lambda s: s.cost(costs))
    optimum = best.cost(costs)
    ilp = extract_ilp(graph, roots, costs, node_limit=None, time_limit=60)
    assert ilp.optimal and ilp.selection.cost(costs) == pytest.approx(optimum, rel=1e-9)
    assert ilp.objective == pytest.approx(optimum, rel=1e-6)
    for method in ("greedy", "ilp"):
        result = extract(graph, handles, method=method)
        assert result.cost == pytest.approx(optimum, rel=1e-9), method
        chosen = kernels(result.terms)
        assert chosen[-1].op == "Conv"
        stored = [k for k in chosen if k.op == "Pointwise"]
        if case == "store":  # the whole input stored by one pointwise kernel, read by the conv
            assert len(stored) == 1 and stored[0].args[0] == silu, method
            assert chosen[-1].args[0] == ld(stored[0])
        else:
            assert stored == [], method


def test_the_recompute_is_what_the_template_evaluates():
    """The roofline counts the input's four ops as the template computes them: per 2-row x 64-column
    output tile, its 4 input rows at 3 column taps, for each of 10 128-channel output tiles (3 x 4/2
    x 10 = 60x here), so conv(silu(affine(x))) costs more than a kernel storing the input and
    conv(Load(it))."""
    out, silu = affine_silu_conv(*SHAPES["store"])
    shape, weight = (2, 64, 64, 320), out.args[1]
    assert roofline.conv_prologue_evaluations(silu.ty, weight.ty, out.args[2], out.ty) == 3 * 4 / 2 * 10
    inlined = conv(silu, weight, shape, (1280, 320, 3, 3))
    ops = 3 + roofline.ALU_INSTRUCTIONS["logistic"]  # mul, add, SiLU's mul and its logistic
    assert roofline.conv_prologue_flops(inlined)[0] == ops * math.prod(shape) * 3 * 4 / 2 * 10
    stored = conv(ld(Term("Pointwise", silu, silu.ty)), weight, shape, (1280, 320, 3, 3))
    assert dag_cost([inlined]).seconds > dag_cost([stored]).seconds


def test_polish_stores_an_input_expression_that_costs_more_to_recompute():
    """Starting from the plan that recomputes the input in the conv (what a per-node model that counts
    it once finds), the polish materializes a kernel storing it and reads that: the cheapest plan."""
    out, _ = affine_silu_conv(*SHAPES["store"])
    graph, roots, _ = saturated([out])
    costs = graph.node_costs()
    once = extract_greedy(graph, roots, list(costs))  # a plain list: every node charged once
    assert count_kernels(once.selection.to_terms()[0]) == 1
    polished, report = polish(once.selection, costs, fallback=once.selection.fallback)
    assert report.materializations == 1
    optimum = min(s.cost(costs) for s in every_selection(graph, roots))
    assert polished.cost(costs) == pytest.approx(optimum, rel=1e-9)
    assert count_kernels(polished.to_terms()[0]) == 2


def test_a_range_of_the_weight_runs_over_its_own_taps():
    """A merged 1x1 shortcut: the weight is concat(w3x3, pad(w1x1)) over the input channels, the
    input is not split. The template (one flat 64-pixel tile, the model's choice on an 8x8 image)
    evaluates the input's first 64 channels at the tile's 64 pixels x 9 taps, its last 32 at the
    centre tap only; extraction charges the same."""
    shape = (1, 8, 8, 96)
    ty = format_type("float32", shape)
    x = Term("Input", "x", ty)
    silu = Term("Pointwise", Term("Binary", "mul", ld(x), Term("Unary", "logistic", ld(x), ty), ty), ty)
    w3 = Term("Input", "w3", "f32[320,64,3,3]")
    w1 = Term("Input", "w1", "f32[320,32,1,1]")
    padded = Term("Pad", ld(w1), Term("Lit", 0.0, "f32[]"), "0,0,0;0,0,0;1,1,0;1,1,0", "f32[320,32,3,3]")
    rhs = Term("Concat", ld(w3), padded, 1, 64, "f32[320,96,3,3]")
    params = conv_params(shape, (320, 96, 3, 3), ((1, 1), (1, 1)))
    out = Term("Conv", ld(silu), rhs, params.key, Term("Acc", "f32[1,8,8,320]"), "f32[1,8,8,320]")
    tiles = 3
    ops = 1 + roofline.ALU_INSTRUCTIONS["logistic"]  # SiLU's mul and its logistic
    expected = ops * (64 * 9 + 32 * 1) * 64 * tiles  # per output-channel tile and channel: taps x 64 pixels
    inlined = Term("Conv", silu.args[0], *out.args[1:])
    assert roofline.conv_prologue_flops(inlined)[0] == expected
    graph, roots, handles = saturated([out])
    costs = graph.node_costs()
    (prologue,) = {p for n, p in costs.prologues.items()}
    assert prologue.ranges == ((0, 64, 27.0, 9), (64, 96, 3.0, 1))
    for selection in every_selection(graph, roots):
        terms, _ = selection.to_terms()
        assert selection.cost(costs) == pytest.approx(dag_cost(terms).seconds, rel=1e-9)


def test_a_concat_input_charges_each_part_over_its_own_range():
    """conv(concat(silu(h), s)) with a merged weight: the SiLU part runs 9 taps, the plain part 1."""
    h = Term("Input", "h", "f16[2,32,32,64]")
    s = Term("Input", "s", "f16[2,32,32,32]")
    silu = Term("Pointwise", Term("Binary", "mul", ld(h), Term("Unary", "logistic", ld(h), h.ty), h.ty), h.ty)
    lhs = Term("Concat", ld(silu), ld(s), 3, 64, "f16[2,32,32,96]")
    w3 = Term("Input", "w3", "f16[640,64,3,3]")
    w1 = Term("Input", "w1", "f16[640,32,1,1]")
    padded = Term("Pad", ld(w1), Term("Lit", 0.0, "f16[]"), "0,0,0;0,0,0;1,1,0;1,1,0", "f16[640,32,3,3]")
    rhs = Term("Concat", ld(w3), padded, 1, 64, "f16[640,96,3,3]")
    params = conv_params((2, 32, 32, 96), (640, 96, 3, 3), ((1, 1), (1, 1)))
    out = Term("Conv", lhs, rhs, params.key, Term("Acc", "f16[2,32,32,640]"), "f16[2,32,32,640]")
    graph, roots, handles = saturated([out])
    costs = graph.node_costs()
    optimum = math.inf
    for selection in every_selection(graph, roots):
        terms, _ = selection.to_terms()
        value = selection.cost(costs)
        assert value == pytest.approx(dag_cost(terms).seconds, rel=1e-9)
        optimum = min(optimum, value)
    for method in ("greedy", "ilp"):
        assert extract(graph, handles, method=method).cost == pytest.approx(optimum, rel=1e-9), method


def test_sd15_resnet_block_plan_cost_matches_its_extraction():
    """sd15's ResnetBlock2D at 320 channels on 32x32 latents (fp16): the extraction's objective is
    the plan's cost, GroupNorm + SiLU prologues and hosted statistics included."""
    import eqsat
    from sd15 import layers

    c, side = 320, 32
    shapes = {"r.norm1.weight": (c,), "r.norm1.bias": (c,), "r.conv1.weight": (c, c, 3, 3), "r.conv1.bias": (c,),
              "r.time_emb_proj.weight": (c, 64), "r.time_emb_proj.bias": (c,), "r.norm2.weight": (c,),
              "r.norm2.bias": (c,), "r.conv2.weight": (c, c, 3, 3), "r.conv2.bias": (c,)}
    args = ({k: jax.ShapeDtypeStruct(v, jnp.float16) for k, v in shapes.items()},
            jax.ShapeDtypeStruct((2, side, side, c), jnp.float16), jax.ShapeDtypeStruct((2, 64), jnp.float16))
    lowered = eqsat.optimize(lambda p, x, t: layers.resnet_block(p, "r", x, t, 32, 1e-5), progress=False,
                             extractor="greedy", extract_time_limit=120).lower(*args)
    extraction = lowered.extraction
    # Per node, a hosted statistic's cost is approximated (its partials' size from `PARTIAL_TILE`
    # where the plan has its hosts' real tiles, its merges at a conv reader as min(merge, finalize):
    # 0.04 us of 30 here); a prologue charged once instead of per tap and tile would be 8 us off.
    assert extraction.cost == pytest.approx(dag_cost(extraction.terms).seconds, rel=2e-3)
    assert extraction.cost == pytest.approx(sum(k.seconds for k in lowered.plan.kernels), rel=2e-3)
    convs = [k for k in lowered.plan.kernels if k.kind == "conv"]
    assert len(convs) == 2 and all(roofline.conv_prologue_flops(k.term)[0] > 0 for k in convs)


def test_a_plan_that_stores_conv_inputs_runs_like_the_function():
    """On a device where launching a kernel costs nothing and vector flops are dear, storing the
    GroupNorm + SiLU inputs of a tiny ResNet block's convs is the cheaper plan; it runs through the
    Pallas templates (interpret mode) and equals the plain function."""
    import eqsat
    import emit
    from eqsat.cost.devices import Device
    from sd15 import layers

    rng = np.random.default_rng(4)
    c = 6
    shapes = {"r.norm1.weight": (c,), "r.norm1.bias": (c,), "r.conv1.weight": (c, c, 3, 3), "r.conv1.bias": (c,),
              "r.time_emb_proj.weight": (c, 8), "r.time_emb_proj.bias": (c,), "r.norm2.weight": (c,),
              "r.norm2.bias": (c,), "r.conv2.weight": (c, c, 3, 3), "r.conv2.bias": (c,)}
    params = {k: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(2, 8, 8, c)) + 3.0, jnp.float32)  # an offset the statistics must not cancel
    temb = jnp.asarray(rng.normal(size=(2, 8)), jnp.float32)

    def block(p, x, t):
        return layers.resnet_block(p, "r", x, t, 2, 1e-5)

    slow_vector = Device("slow-vector", hbm_bandwidth=3.35e12, peak_fp16=989e12, peak_fp32=1e9, launch_overhead=0.0)
    plan = eqsat.optimize(block, device=slow_vector, extractor="greedy", progress=False).lower(params, x, temb).plan
    convs = [k for k in plan.kernels if k.kind == "conv"]
    assert len(convs) == 2 and all(k.term.args[0].op == "Load" for k in convs)
    assert all(k.term.args[0].args[0].op == "Pointwise" for k in convs)
    got = emit.emit(plan, "pallas", interpret=True)(params, x, temb)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(block)(params, x, temb)), rtol=2e-4, atol=2e-4)


def conv_chain(layers: int, out_channels: int = 1280):
    """`layers` convs, each reading silu(x * scale + shift) of the previous one, one kernel per op."""
    shape = (2, 32, 32, out_channels)
    ty = format_type("float16", shape)
    h = Term("Input", "x", ty)
    for i in range(layers):
        scale, shift = Term("Input", f"scale{i}", f"f16[{out_channels}]"), Term("Input", f"shift{i}", f"f16[{out_channels}]")
        scaled = Term("Pointwise", Term("Binary", "mul", ld(h), Term("Broadcast", ld(scale), "3", ty), ty), ty)
        shifted = Term("Pointwise", Term("Binary", "add", ld(scaled), Term("Broadcast", ld(shift), "3", ty), ty), ty)
        sigmoid = Term("Pointwise", Term("Unary", "logistic", ld(shifted), ty), ty)
        silu = Term("Pointwise", Term("Binary", "mul", ld(shifted), ld(sigmoid), ty), ty)
        w = Term("Input", f"w{i}", format_type("float16", (out_channels, out_channels, 3, 3)))
        h = conv(ld(silu), ld(w), shape, (out_channels, out_channels, 3, 3))
    return h


def test_extraction_work_stays_linear_with_conv_inputs():
    """Twice the convs, about twice the work: the greedy's input choices walk each conv's input tree
    a bounded number of times, and the polish's walks (materializations included) grow linearly."""
    work = {}
    for layers in (8, 16):
        graph, roots, _ = saturated([conv_chain(layers, 2560)])  # 20 output tiles: storing is cheaper
        result = extract_greedy(graph, roots, graph.node_costs())
        assert count_kernels(result.selection.to_terms()[0]) == 2 * layers  # each input stored
        work[layers] = (result.sweeps, result.polish.walks, result.polish.slots_visited)
    (sweeps_8, walks_8, slots_8), (sweeps_16, walks_16, slots_16) = work[8], work[16]
    assert sweeps_16 <= 1.15 * sweeps_8 and walks_16 <= 2.3 * walks_8 and slots_16 <= 2.3 * slots_8, work
