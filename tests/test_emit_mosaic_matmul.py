"""The Mosaic GPU matmul without XLA glue (`emit/mosaic/matmul.py`, `reads_in_place`): A, B, the
epilogue's operands and the output used as they lie, the K tail filled with zeros by TMA, the last M
and N tiles clamped to end at the array's edge. In GPU interpret mode against the plain-jnp
reference and, through `backend="mosaic"`, against the XLA emitter and `jax.jit` on adversarial
values; compiled for sm_90a without a GPU, the plan launches the Mosaic kernel and nothing else.

GPU interpret mode costs ~10 s per small kernel here: shapes are tiny, one plan serves every value."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import matmul as mm
from emit.pallas import XlaFallbackWarning
from tests.test_emit_mosaic import assert_dense_gelu_residual, f16_adversarial


def test_which_shapes_are_read_in_place():
    """Rows a multiple of 8, N and K of the minor tile (64, or 32 with a 64-byte swizzle; K may be
    below it): in place; 77 rows or K = 72 are not (Mosaic's tiled TMA), nor 32 rows (below one
    64-row tile: its store would leave the array). A 64-row tile is taken when 128 would exceed M."""
    for m, n, k in ((136, 192, 40), (8192, 1280, 320), (128, 32, 32), (128, 96, 64), (96, 64, 64)):
        assert mm.reads_in_place(m, n, k, mm.matmul_blocks(m, n, k)), (m, n, k)
    for m, n, k in ((77, 64, 64), (154, 320, 768), (128, 64, 72), (128, 64, 36), (32, 64, 64)):
        assert not mm.reads_in_place(m, n, k, mm.matmul_blocks(m, n, k)), (m, n, k)
    blocks = mm.matmul_blocks(96, 64, 64)
    assert blocks.tile_m == 64 and blocks.cta_tile_n == 64
    assert mm.matmul_blocks(128, 96, 64).tile_k == 32  # N = 96: whole 32-element tiles, a 64-byte swizzle
    place = mm.matmul_in_place(154, 96, 32, mm.matmul_blocks(154, 96, 32))
    assert place.b and not place.a and not place.out  # B is used as it lies even where A and the output are not


def scale_bias_residual(acc, tiles):
    residual, bias, scale = tiles
    return acc * scale + bias + residual.astype(jnp.float32)


def test_template_in_place_matches_reference():
    """72 rows (a tile and one clamped to rows 8-71), K = 40 (one step: 24 columns of
    TMA's zero fill), N = 192 (a 128-column CTA and one clamped to columns 64-191), every epilogue
    operand kind, a float32 result: no copy of any operand and the result unsliced."""
    rng = np.random.default_rng(0)
    m, k, n = 72, 40, 192
    a = jnp.asarray(rng.standard_normal((1, m, k)), jnp.float16)
    w = jnp.asarray(0.3 * rng.standard_normal((1, k, n)), jnp.float16)
    residual = jnp.asarray(rng.standard_normal((1, m, n)), jnp.float16)
    bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((1, m)), jnp.float32)
    blocks = mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=2)
    assert mm.reads_in_place(m, n, k, blocks)
    operands = [mm.EpilogueOperand("tile", residual), mm.EpilogueOperand("col", bias),
                mm.EpilogueOperand("row", scale)]
    out = mm.build(a, w, epilogue=scale_bias_residual, operands=operands, out_dtype=jnp.float32, blocks=blocks,
                   interpret=True)
    expected = mm.reference(a, w, scale_bias_residual, [residual, bias[:, None, :], scale[:, :, None]], jnp.float32)
    assert out.shape == (1, m, n)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 77, 32, 96), (1, 128, 32, 32), (1, 72, 96, 40)])
def test_partly_in_place_matches_reference(shape):
    """Each array on its own: 77 rows (A, the residual, the per-row scale and the output padded; B
    [32, 96] as it lies, in 32-element tiles), N = 32 (all in place: 32-wide warpgroup, 64-byte
    swizzle), K = 96 with N = 40 (A and the residual as they lie, read past their end; B and the
    output padded)."""
    batch, m, k, n = shape
    rng = np.random.default_rng(m + n)
    a = jnp.asarray(rng.standard_normal((batch, m, k)), jnp.float16)
    w = jnp.asarray(0.3 * rng.standard_normal((batch, k, n)), jnp.float16)
    residual = jnp.asarray(rng.standard_normal((batch, m, n)), jnp.float16)
    bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((batch, m)), jnp.float32)
    operands = [mm.EpilogueOperand("tile", residual), mm.EpilogueOperand("col", bias),
                mm.EpilogueOperand("row", scale)]
    out = mm.build(a, w, epilogue=scale_bias_residual, operands=operands, out_dtype=jnp.float32, interpret=True)
    expected = mm.reference(a, w, scale_bias_residual, [residual, bias[:, None, :], scale[:, :, None]], jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-4)


def dense_gelu_residual(x, w, b, r):
    return jax.nn.gelu(x @ w + b, approximate=False) + r


_RUNS: dict = {}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_in_place_plan_matches_xla_and_jit_on_adversarial_values(data):
    """Batch 2 x 72 tokens (144 rows: a clamped last tile), K = 40, N = 128, fp16, through
    `backend="mosaic"`: bias, erf GELU and residual in the epilogue, offsets large against the
    spread, constant rows, zeros, huge and tiny scales."""
    x = f16_adversarial(data.draw, (2, 72, 40))
    w = f16_adversarial(data.draw, (40, 128), scales=(1.0, 1e-2, 0.0, 30.0), offsets=(0.0, 0.5, -4.0))
    b = f16_adversarial(data.draw, (1, 128))[0]
    r = f16_adversarial(data.draw, (2, 72, 128))
    args = (x, w, b, r)
    if "plan" not in _RUNS:
        plan = eqsat.optimize(dense_gelu_residual, progress=False).lower(*args).plan
        (term,) = [k.term for k in plan.kernels if k.term.op == "Matmul"]
        from eqsat.cost.mosaic import mosaic_work

        assert mosaic_work(term).glue == ()
        _RUNS["plan"] = emit.emit(plan, "mosaic", interpret=True), emit.emit(plan, "xla")
    mosaic, xla = _RUNS["plan"]
    assert_dense_gelu_residual(mosaic, xla, args)


@pytest.mark.parametrize("shape", [(2, 72, 40, 128), (1, 4096, 320, 1280)])
def test_in_place_plan_compiles_to_the_mosaic_kernel_alone(shape):
    """Compiled for sm_90a without a GPU, a dense layer with bias and residual read in place is one
    launch: the Mosaic GPU kernel, no pad, transpose or slice fusion around it (SD 1.5's 64x64
    latent's to_out: 4096 tokens, 320 -> 1280 is the second shape)."""
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    batch, tokens, k, n = shape
    args = (jax.ShapeDtypeStruct((batch, tokens, k), jnp.float16), jax.ShapeDtypeStruct((k, n), jnp.float16),
            jax.ShapeDtypeStruct((n,), jnp.float16), jax.ShapeDtypeStruct((batch, tokens, n), jnp.float16))
    plan = eqsat.optimize(lambda x, w, b, r: x @ w + b + r, progress=False).lower(*args).plan
    assert [k.term.op for k in plan.kernels] == ["Matmul"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category == {"Pallas (Mosaic GPU)": 1}, report.by_category


@pytest.mark.parametrize("tokens,k,n,expected", [
    (72, 40, 128, ()),                                                         # all in place
    (128, 32, 32, ()),                                                         # N = 32: 32-element K steps
    (154, 32, 96, ("A laid out", "residual padded", "output sliced")),         # 154 rows: not whole 8-row tiles
    (77, 40, 96, ("A laid out", "B laid out", "residual padded", "output sliced")),  # K = 40 with N = 96
    (128, 72, 64, ("A laid out", "B laid out")),                               # K = 72: no whole 64 or 32 tile
])
def test_the_model_counts_the_launches_compiled_around_the_kernel(tokens, k, n, expected):
    """`x @ w + b + r` compiled for sm_90a: the XLA launches beside the Mosaic kernel are the glue
    `eqsat.cost.mosaic` charges, one for one."""
    from eqsat.cost.mosaic import mosaic_work
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    args = (jax.ShapeDtypeStruct((tokens, k), jnp.float16), jax.ShapeDtypeStruct((k, n), jnp.float16),
            jax.ShapeDtypeStruct((n,), jnp.float16), jax.ShapeDtypeStruct((tokens, n), jnp.float16))
    plan = eqsat.optimize(lambda x, w, b, r: x @ w + b + r, progress=False).lower(*args).plan
    (term,) = [kernel.term for kernel in plan.kernels]
    assert tuple(g.what for g in mosaic_work(term).glue) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category == {"Pallas (Mosaic GPU)": 1, **({"loop fusion": len(expected)} if expected else {})}


def test_a_prepared_torch_layout_weight_is_read_in_place_per_call():
    """A torch `[out, in]` weight (`einsum("bsk,nk->bsn")`) marked as a parameter: the prepare stage
    stores it `[K, N]` and the per-call kernel reads it through a `Transpose` view; the model charges
    that no glue (the transposes cancel) and the per-call executable, compiled for sm_90a, is the
    Mosaic kernel alone. The plan before the split still charges the weight's layout (prepared once)."""
    import functools

    from eqsat.cost.mosaic import mosaic_work, stored_axes
    from measure.compare import emitted_per_call
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    S = jax.ShapeDtypeStruct

    def linear(params, x, r):
        return jnp.einsum("bsk,nk->bsn", x, params["w"]) + params["b"] + r

    args = ({"w": S((320, 640), jnp.float16), "b": S((320,), jnp.float16)}, S((2, 64, 640), jnp.float16),
            S((2, 64, 320), jnp.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = eqsat.optimize(linear, progress=False, backend="mosaic", params_argnums=0, cache=False,
                              interpret=False)
        lowered = fast.lower(*args)
    (planned,) = [k.term for k in lowered.plan.kernels if k.term.op == "Matmul"]
    (per_call,) = [k.term for k in lowered.split.per_call.kernels if k.term.op == "Matmul"]
    assert per_call.args[1].op == "Transpose" and stored_axes(per_call.args[1]) == (1, 0)
    assert [g.what for g in mosaic_work(planned).glue] == ["B laid out"]
    assert mosaic_work(per_call).glue == ()
    report = compile_for_h100(functools.partial(emitted_per_call, fast), lowered.split.prepared_specs(), *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category == {"Pallas (Mosaic GPU)": 1}, report.by_category


# --- the A prologue in the kernel ------------------------------------------------------------------


def geglu_out(h, w):
    """SD 1.5's GEGLU feed-forward out: value * gelu(gate) from the two halves of one projection."""
    k = h.shape[-1] // 2
    return (h[..., :k] * jax.nn.gelu(h[..., k:], approximate=False)) @ w


def norm_apply(x, stats, gamma, beta, w):
    """A normalization applied from row statistics computed elsewhere (stacked `[2, ..., rows]`: the
    mean and the reciprocal deviation, as a hosted statistic's finished moments), then the projection."""
    return ((x - stats[0][..., None]) * stats[1][..., None] * gamma + beta).astype(jnp.float16) @ w


def prologue_case(name, rng):
    """Adversarial fp16 inputs: offsets large against the spread with the statistics that cancel
    them, constant rows, zero rows, magnitudes near fp16's range in the GEGLU's value half."""
    if name == "geglu":
        h = rng.standard_normal((2, 72, 128)) * np.where(rng.random((2, 72, 1)) < 0.2, 0.0, 3.0)
        h[:, :, :64] *= 300.0  # value half ~1e3: products near fp16's 65504 after the matmul's bound
        h[0, 5] = 7.0          # a constant row (gelu's gate constant too)
        return geglu_out, (h.astype(np.float16), (0.05 * rng.standard_normal((64, 96))).astype(np.float16))
    x = 2000.0 + rng.standard_normal((2, 72, 64)) * 0.5
    x[1, 3] = 2000.0                                   # a constant row: rstd huge, (x - mean) zero
    mean, std = x.mean(-1), x.std(-1)
    stats = np.stack([mean, 1.0 / np.sqrt(std**2 + 1e-5)]).astype(np.float32)
    args = (x, stats, rng.standard_normal(64), rng.standard_normal(64), 0.2 * rng.standard_normal((64, 64)))
    return norm_apply, tuple(a if i == 1 else np.asarray(a, np.float16) for i, a in enumerate(args))


@pytest.mark.parametrize("name", ["geglu", "norm"])
def test_prologue_in_the_kernel_matches_xla_and_jit(name):
    """The A expression computed per A tile in SMEM by the compute warpgroup (no XLA fusion before
    the kernel: the model charges none), through `backend="mosaic"` against the XLA emitter and
    `jax.jit`: GEGLU's halves read as two column windows of one tensor; a normalization from row
    statistics (two float32 row vectors stacked in one tensor, each read at its row) and gamma,
    beta (K vectors) on 2 x 72 tokens (an M tail)."""
    from eqsat.cost.mosaic import mosaic_work, prologue_reads

    fn, args = prologue_case(name, np.random.default_rng(3))
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    (term,) = [k.term for k in plan.kernels if k.term.op == "Matmul"]
    assert [k.term.op for k in plan.kernels] == ["Matmul"]
    lhs, rhs, dims, _, ty = term.args
    assert not isinstance(prologue_reads(lhs, rhs, dims, ty), str)
    assert "A laid out" not in {g.what for g in mosaic_work(term).glue}
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        out = np.asarray(emit.emit(plan, "mosaic", interpret=True)(*args), np.float64)
    for expected in (emit.emit(plan, "xla")(*args), jax.jit(fn)(*args)):
        expected = np.asarray(expected, np.float64)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(out, expected, rtol=2e-2, atol=4e-3 * scale)


@pytest.mark.parametrize("name", ["geglu", "norm"])
def test_prologue_plans_compile_to_the_mosaic_kernel_alone(name, tmp_path, monkeypatch):
    """SD 1.5's 64x64-latent GEGLU out (2 x 4096 tokens, [., 2560] -> 320) and a normalization
    applied to 320 channels, compiled for sm_90a: the Mosaic kernel is the only launch, its PTX
    issues wgmma and TMA loads, and ptxas spills nothing."""
    from measure.xla_target import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    S = jax.ShapeDtypeStruct
    if name == "geglu":
        fn, args = geglu_out, (S((2, 4096, 2560), jnp.float16), S((1280, 320), jnp.float16))
    else:
        fn, args = norm_apply, (S((2, 4096, 320), jnp.float16), S((2, 2, 4096), jnp.float32), S((320,), jnp.float16),
                                S((320,), jnp.float16), S((320, 640), jnp.float16))
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    assert_one_mosaic_kernel(plan, args, tmp_path, monkeypatch, tma_loads=2)


def assert_one_mosaic_kernel(plan, args, tmp_path, monkeypatch, tma_loads: int) -> None:
    """`plan` compiled for sm_90a is one Mosaic launch: wgmma, at least `tma_loads` TMA loads, no spill."""
    from tests.test_emit_mosaic import compile_mosaic

    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report, _ptx, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    assert report.by_category == {"Pallas (Mosaic GPU)": 1}, report.by_category
    assert counts.tensor_core == "wgmma" and counts.tma_loads >= tma_loads, counts
    assert resources.spill_bytes == 0, resources


def test_bfloat16_epilogue_operands_stay_on_mosaic():
    """A bf16 matmul whose epilogue reads a bf16 bias and residual (found by `benchmarks.fuzz --backend
    mosaic`: bfloat16's NumPy kind is 'V', and the template declined it) runs on the Mosaic kernel and
    equals the XLA emitter and jit, at an offset of 100 against a spread of 3."""
    rng = np.random.default_rng(0)

    def f(x, w, r, b):
        return jax.nn.gelu(x @ w + b) + r

    x = jnp.asarray(rng.standard_normal((64, 64)) * 3 + 100, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(64), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        got = eqsat.optimize(f, backend="mosaic", progress=False)(x, w, r, b)
    want = eqsat.optimize(f, backend="xla", progress=False)(x, w, r, b)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(jax.jit(f)(x, w, r, b), np.float32),
                               rtol=1e-2, atol=1.0)
