"""SD 1.5 components as `sd15 plan` compiles them for an H100 without a GPU: the per-call stage of
`eqsat.optimize(fn, backend="pallas", params_argnums=0)`, the prepared tensors as inputs, through
`measure.xla_target`. Its thunk sequence must launch exactly the planned kernels, every one a Pallas
kernel, with no copies and at most one memset (the full-size run is `benchmarks/sd15_plan.py`).
Beside them, in interpret mode, what those compiles needed from the conv template: GroupNorm
statistics whose tiles straddle images, and per-pixel LayerNorm statistics after a 1x1 conv."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from emit.pallas import conv
from measure import xla_target
from eqsat.conv_params import ConvParams
from eqsat.interpret import evaluate
from driver.optimize import ExtractionLimitWarning
from eqsat.term import Term
from eqsat.types import format_type
from measure import compare
from sd15 import workloads as sd15_workloads
from sd15.layers import resnet_block

needs_h100_target = pytest.mark.skipif(xla_target.unavailable_reason() is not None,
                                       reason=str(xla_target.unavailable_reason()))


def compiled(workload: compare.Workload) -> dict:
    fields, fast, lowered = compare.measure_plan(workload, eqsat.optimize, "h100")
    return {**fields, **compare.measure_emitted(workload, fast, lowered)}


def assert_exactly_the_planned_pallas_kernels(row: dict) -> None:
    assert row["emitted_non_pallas"] == [], row["emitted_non_pallas"]
    assert row["emitted_missing"] == [] and row["emitted_extra"] == [], (row["emitted_missing"], row["emitted_extra"])
    assert row["emitted_kernels"] == row["emitted_pallas_kernels"] == row["planned_kernels"], row
    assert row["emitted_kernels_by_category"] == {"Pallas (Triton)": row["planned_kernels"]}
    assert row["emitted_copies"] == 0 and row["emitted_memsets"] <= 1


@needs_h100_target
def test_tiny_text_encoder_launches_exactly_its_planned_pallas_kernels():
    """CLIP (2 layers, 4 heads of 8, 2x77 tokens, fp16): embedding gather, fused QKV on prepared
    weight concatenations, causal attention, LayerNorm statistics hosted in the matmuls."""
    row = compiled(sd15_workloads.workloads(config="tiny", components=("text_encoder",))["text_encoder"])
    assert row["prepared_kernels"] >= 2  # the QKV weight concatenations, once per set of weights
    assert_exactly_the_planned_pallas_kernels(row)


def resnet_shapes(fan_in: int, fan_out: int, temb: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of `resnet_step` (torch layouts, as `sd15.params` has them)."""
    shapes = {
        "norm1.weight": (fan_in,), "norm1.bias": (fan_in,), "conv1.weight": (fan_out, fan_in, 3, 3),
        "conv1.bias": (fan_out,), "time_emb_proj.weight": (fan_out, temb), "time_emb_proj.bias": (fan_out,),
        "norm2.weight": (fan_out,), "norm2.bias": (fan_out,), "conv2.weight": (fan_out, fan_out, 3, 3),
        "conv2.bias": (fan_out,), "conv_shortcut.weight": (fan_out, fan_in, 1, 1), "conv_shortcut.bias": (fan_out,),
    }
    return {f"resnets.0.{key}": shape for key, shape in shapes.items()}


def resnet_step(params, x, temb):
    """A UNet ResNet block (GroupNorm, SiLU, 3x3 conv, time embedding, GroupNorm, conv, 1x1 shortcut)."""
    return resnet_block(params, "resnets.0", x, temb, groups=32, eps=1e-5)


# optimize's default: the block's ILP runs ~30 s to optimality and loses to greedy (whose plan a cut
# ILP cannot change), so the test need not wait for it.
SMALL_EXTRACT_TIME_LIMIT = 5.0


@needs_h100_target
def test_resnet_block_with_3_channels_per_group_launches_exactly_its_planned_pallas_kernels(monkeypatch):
    """96 -> 192 channels in 32 groups (3 and 6 channels per group, groups straddling channel tiles),
    15x15 pixels, fp16: the second GroupNorm's statistics hosted by conv1, the shortcut merged into
    conv2 as a K range, the time projection prepared."""
    monkeypatch.setattr(compare, "EXTRACT_TIME_LIMIT", SMALL_EXTRACT_TIME_LIMIT)
    params = {key: jax.ShapeDtypeStruct(shape, jnp.float16) for key, shape in resnet_shapes(96, 192, 128).items()}
    workload = compare.Workload("resnet", "ResNet block 96 -> 192", resnet_step, (
        params, jax.ShapeDtypeStruct((2, 15, 15, 96), jnp.float16), jax.ShapeDtypeStruct((2, 128), jnp.float16)))
    row = compiled(workload)
    assert row["plan_kernels_by_kind"].get("conv", 0) >= 2 and row["plan_hosted_statistics"] >= 1, row
    assert_exactly_the_planned_pallas_kernels(row)


def test_resnet_block_with_tiles_straddling_images_computes_the_block():
    """The same block through the Pallas templates in interpret mode (fp32) equals the function, its
    inputs offset by 300 (GroupNorm statistics that cancel if computed naively): conv1's M tiles
    straddle the two 15x15 images, its N tiles the groups of 6 channels."""
    rng = np.random.default_rng(0)
    shapes = resnet_shapes(96, 192, 128)
    params = {key: jnp.asarray(rng.normal(size=shape) * (0.1 if len(shape) > 1 else 1.0), jnp.float32)
              for key, shape in shapes.items()}
    x = jnp.asarray(300.0 + rng.normal(size=(2, 15, 15, 96)), jnp.float32)
    temb = jnp.asarray(rng.normal(size=(2, 128)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtractionLimitWarning)
        fast = eqsat.optimize(resnet_step, params_argnums=0, backend="pallas", interpret=True, progress=False,
                              extract_time_limit=SMALL_EXTRACT_TIME_LIMIT)
        plan = fast.lower(params, x, temb).plan
    assert any(k.op == "Conv" and k.hosted for k in plan.kernels), plan.summary()
    want = jax.jit(resnet_step)(params, x, temb)  # values up to ~500: fp32 sums in another order differ by ~1e-4
    np.testing.assert_allclose(fast(params, x, temb), want, rtol=1e-4, atol=5e-6 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("values", ["offset", "constant", "huge"])
def test_layernorm_statistics_of_each_pixel_are_per_row_partials_of_the_1x1_conv(values):
    """Transformer2D's first LayerNorm reads statistics of each pixel over proj_in's channels: one
    slot per row of a tile (far more than the 8 pixel parts a GroupNorm tile may touch). The conv
    writes per-row partials over each N tile's columns; merged, they equal the two-pass moments
    (2 images of 5x7 pixels straddling 16-pixel tiles, 40 channels over three 16-channel tiles),
    at an offset far from the spread, on constant pixels (M2 exactly 0) and at huge magnitudes."""
    rng = np.random.default_rng(3)
    x = {"offset": 1e3 + rng.normal(size=(2, 5, 7, 40)),
         "constant": np.repeat(rng.normal(size=(2, 5, 7, 1)) * 50, 40, axis=3),
         "huge": 1e18 * (3 + rng.normal(size=(2, 5, 7, 40)))}[values].astype(np.float32)
    x_in = Term("Input", "x", format_type("float32", x.shape))
    w_in = Term("Input", "w", format_type("float32", (40, 40, 1, 1)))
    numbers = jax.lax.conv_dimension_numbers(x.shape, (40, 40, 1, 1), ("NHWC", "OIHW", "NHWC"))
    params = ConvParams.from_lax((1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), numbers)
    out_ty = format_type("float32", x.shape)
    term = Term("Conv", Term("Load", x_in, x_in.ty), Term("Load", w_in, w_in.ty), params.key,
                Term("Acc", out_ty), out_ty)
    tokens = Term("Reshape", Term("Load", term, term.ty), format_type("float32", (2, 35, 40)))
    stats = Term("EpilogueReduce", term, "moments", tokens, "2", format_type("float32", (2, 2, 35)))
    identity = np.eye(40, dtype=np.float32).reshape(40, 40, 1, 1)  # the output is the drawn values
    config = conv.ConvConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
    out, partials = conv.run(term, {x_in: x, w_in: identity}, hosted=[stats], config=config, interpret=True)
    assert partials[stats].shape == (3, 3, 70)  # [N tiles, (count, mean, M2), pixels]
    merged = np.asarray(conv.merge_partials(partials[stats], "moments")).reshape(2, 2, 35)
    (expected,) = evaluate([stats], {"x": x, "w": identity})
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(out), x, rtol=1e-6)
    np.testing.assert_allclose(merged[0], expected[0], rtol=1e-5, atol=1e-6 * 40 * float(np.abs(x).max()))
    noise = 40 * (4 * np.finfo(np.float32).eps * float(np.abs(x).max())) ** 2
    np.testing.assert_allclose(merged[1], expected[1], rtol=2e-3 if values == "offset" else 1e-4,
                               atol=max(noise, 1e-6 * float(np.abs(expected[1]).max())))
    assert (merged[1] >= 0).all()
