"""The Mosaic GPU matmul template (`emit/mosaic/matmul.py`) in GPU interpret mode (simulated SMEM,
warpgroups, barriers, TMA): the template against its plain-jnp reference, plans emitted with
`backend="mosaic"` against the XLA emitter and `jax.jit` on odd shapes (77 tokens, K = 40, N = 96:
no tile divides them) with adversarial values, the epilogue's host-side operand mapping, the Triton
fallback, and one compile for sm_90a without a GPU (PTX: wgmma pipelined, TMA).

GPU interpret mode is slow (~10 s per small kernel on this machine): shapes are tiny, one plan
serves many values, and the slowest cases are marked `slow`."""

from __future__ import annotations

import re
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
from emit.pallas.matmul import DotAxes
from eqsat.term import postorder
from tests.test_emit_matmul import assert_close

# --- the template on hand-written epilogues --------------------------------------------------------


def gelu_bias_scale_residual(acc, tiles):
    residual, bias, scale = tiles
    return jax.nn.gelu(acc * scale + bias, approximate=True) + residual.astype(jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,shape,compute_wgs", [
    (jnp.float16, (2, 77, 40, 96), 1),   # 8 CTAs: tails on M (77 of 128), N (96 of 128), K (40 of 64)
    (jnp.bfloat16, (1, 64, 40, 128), 1),  # one CTA
])
def test_template_matches_reference(dtype, shape, compute_wgs):
    """Every epilogue operand kind: a residual tile, a bias row shared by the batch, a per-row scale
    per batch entry."""
    rng = np.random.default_rng(0)
    batch, m, k, n = shape
    a = jnp.asarray(rng.standard_normal((batch, m, k)), dtype)
    w = jnp.asarray(0.3 * rng.standard_normal((batch, k, n)), dtype)
    residual = jnp.asarray(rng.standard_normal((batch, m, n)), jnp.float16)
    bias = jnp.asarray(rng.standard_normal((1, n)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((batch, m)), jnp.float32)
    operands = [mm.EpilogueOperand("tile", residual), mm.EpilogueOperand("col", bias),
                mm.EpilogueOperand("row", scale)]
    out = mm.build(a, w, epilogue=gelu_bias_scale_residual, operands=operands, out_dtype=jnp.float32,
                   blocks=mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=compute_wgs), interpret=True)
    expected = mm.reference(a, w, gelu_bias_scale_residual,
                            [residual, jnp.broadcast_to(bias[:, None, :], (batch, m, n)),
                             jnp.broadcast_to(scale[:, :, None], (batch, m, n))], jnp.float32)
    a32, w32 = np.abs(np.asarray(a, np.float32)), np.abs(np.asarray(w, np.float32))
    bound = np.abs(np.asarray(scale))[..., None] * np.einsum("bmk,bkn->bmn", a32, w32) + 4.0
    assert_close(out, expected, bound, dtype)


def test_several_k_steps_and_stages_two_warpgroups():
    """K = 136: three pipeline steps through a 2-deep ring, the wgmma of step t in flight while t+1
    loads, two compute warpgroups side by side along N."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((1, 64, 136)), jnp.float16)
    w = jnp.asarray(rng.standard_normal((1, 136, 128)), jnp.float16)
    out = mm.build(a, w, out_dtype=jnp.float32, blocks=mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=2),
                   interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(mm.reference(a, w, out_dtype=jnp.float32)),
                               rtol=1e-5, atol=1e-4)


def test_blocks_are_validated():
    with pytest.raises(ValueError, match="multiples of 64"):
        mm.MosaicBlocks(tile_m=48).validate()
    with pytest.raises(ValueError, match="stages"):
        mm.MosaicBlocks(stages=1).validate()
    with pytest.raises(NotImplementedError, match="fp16 or two bf16"):
        mm.build(jnp.zeros((1, 8, 8), jnp.float32), jnp.zeros((1, 8, 8), jnp.float32), interpret=True)


# --- the epilogue's operands, mapped on the host ---------------------------------------------------


def matmul_kernel(fn, args):
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    (kernel,) = [k for k in plan.kernels if k.term.op == "Matmul"]
    return plan, kernel.term


def test_epilogue_operands_are_sorted_by_what_they_depend_on():
    """A bias depends on columns only (a `col` vector), a residual on both (a `tile`, no copy when
    the view is a reshape), a transposed residual is gathered into the output layout once, a
    per-token scale is a `row`."""
    x, w = np.ones((77, 40), np.float16), np.ones((40, 96), np.float16)
    bias, residual, scale = np.arange(96, dtype=np.float16), np.ones((77, 96), np.float16), np.ones((77, 1), np.float16)
    transposed = np.arange(96 * 77, dtype=np.float32).reshape(96, 77)

    def fn(x, w, bias, residual, scale, transposed):
        return (x @ w + bias) * scale + residual + transposed.T.astype(jnp.float16)

    args = (x, w, bias, residual, scale, transposed)
    plan, term = matmul_kernel(fn, args)
    lhs, rhs, dims, epilogue, _ = term.args
    axes = DotAxes.of(dims, (77, 40), (40, 96))
    env = plan.program.environment(*args)
    names = {plan.program.inputs[i].args[0]: i for i in range(len(args))}
    tensors, operands = mm.epilogue_operands(epilogue, axes, lambda t: jnp.asarray(env[t.args[0]]))
    by_arg = {names[t.args[0]]: o for t, o in zip(tensors, operands)}
    assert {i: o.kind for i, o in by_arg.items()} == {2: "col", 3: "tile", 4: "row", 5: "tile"}
    np.testing.assert_array_equal(np.asarray(by_arg[5].array)[0], transposed.T)
    np.testing.assert_array_equal(np.asarray(by_arg[2].array)[0], bias)
    assert by_arg[4].array.shape == (1, 77)


def test_an_index_dependent_epilogue_goes_to_triton_with_a_warning():
    """An `Iota` in the epilogue (its value is the output index): left to the Triton template, said."""
    x, w = np.ones((16, 40), np.float16), np.full((40, 32), 0.5, np.float16)

    def fn(x, w):
        return x @ w + jax.lax.broadcasted_iota(jnp.float16, (16, 32), 1)

    plan = eqsat.optimize(fn, progress=False).lower(x, w).plan
    assert "Iota" in {n.op for k in plan.kernels for n in postorder([k.term])}
    with pytest.warns(TritonFallbackWarning, match="epilogue with Iota"):
        out = emit.emit(plan, "mosaic", interpret=True)(x, w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(x, w)))


def test_float32_matmul_runs_through_the_triton_template_with_a_warning():
    x, w = np.ones((16, 24), np.float32), np.full((24, 8), 0.5, np.float32)
    plan = eqsat.optimize(lambda x, w: x @ w, progress=False).lower(x, w).plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        with pytest.warns(TritonFallbackWarning, match="float32"):
            out = emit.emit(plan, "mosaic", interpret=True)(x, w)
    np.testing.assert_allclose(np.asarray(out), x @ w)


# --- plans of JAX functions through backend="mosaic" ------------------------------------------------


def dense_gelu_residual(x, w, b, r):
    return jax.nn.gelu(x @ w + b, approximate=False) + r


def emitted_runs(fn, args):
    """(mosaic run, xla run, plan): no kernel may fall back to Triton or XLA."""
    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    return emit.emit(plan, "mosaic", interpret=True), emit.emit(plan, "xla"), plan


def f16_adversarial(draw, shape, scales=(1.0, 1e-3, 1e-6, 3e3, 0.0), offsets=(0.0, 1.0, -300.0, 2e3)):
    """fp16 values: an offset large against the spread, tiny or huge scales (fp16 overflows at 65504),
    constant rows, zeros."""
    offset, scale = draw(st.sampled_from(offsets)), draw(st.sampled_from(scales))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = offset + scale * rng.standard_normal(shape)
    if draw(st.booleans()):
        x[..., rng.integers(0, shape[-2]), :] = offset
    return x.astype(np.float16)


_RUNS: dict = {}


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_dense_gelu_residual_matches_xla_and_jit_on_adversarial_values(data):
    """77 tokens x K 40 x N 96, fp16: the Mosaic kernel (bias, erf GELU and residual in its epilogue)
    differs from the XLA emitter only in summation order."""
    x = f16_adversarial(data.draw, (77, 40))
    w = f16_adversarial(data.draw, (40, 96), scales=(1.0, 1e-2, 0.0, 30.0), offsets=(0.0, 0.5, -4.0))
    b = f16_adversarial(data.draw, (1, 96))[0]
    r = f16_adversarial(data.draw, (77, 96))
    args = (x, w, b, r)
    if "plan" not in _RUNS:
        _RUNS["plan"] = emitted_runs(dense_gelu_residual, args)
    mosaic, xla, plan = _RUNS["plan"]
    assert [k.term.op for k in plan.kernels] == ["Matmul"]
    assert_dense_gelu_residual(mosaic, xla, args)


def assert_dense_gelu_residual(mosaic, xla, args):
    """The Mosaic run of `dense_gelu_residual` (no fallback to Triton or XLA) equals the XLA emitter's
    and jax.jit's within the fp16 bound of |x| @ |w| + |b| + |r|."""
    x, w, b, r = args
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        out = mosaic(*args)
    with np.errstate(all="ignore"):
        bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + np.abs(b) + np.abs(r)
    assert_close(out, xla(*args), bound, np.float16)
    assert_close(out, jax.jit(dense_gelu_residual)(*args), bound, np.float16)


def test_torch_layout_weight_through_optimize():
    """`einsum("bsk,nk->bsn")` (a torch `[out, in]` weight, K on its axis 1) through
    `eqsat.optimize(fn, backend="mosaic")`: the operands are laid out `[batch, rows, K]` /
    `[batch, K, N]` for TMA."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 77, 40)).astype(np.float16)
    w = (0.3 * rng.standard_normal((24, 40))).astype(np.float16)

    def fn(x, w):
        return jnp.einsum("bsk,nk->bsn", x, w) * 0.5

    _, xla, _ = emitted_runs(fn, (x, w))
    fast = eqsat.optimize(fn, backend="mosaic", progress=False)  # interpret: decided where lowered (a CPU here)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        out = fast(x, w)
    bound = np.abs(x.astype(np.float32)) @ np.abs(w.astype(np.float32)).T
    assert_close(out, xla(x, w), bound, np.float16)
    assert_close(out, jax.jit(fn)(x, w), bound, np.float16)


# --- compiled for an H100 without a GPU ----------------------------------------------------------


def _dense_bias(x, w, b):
    return x @ w + b


@pytest.mark.slow
def compile_mosaic(plan, args, tmp_path, monkeypatch):
    """`plan` emitted with `backend="mosaic"` and compiled for an H100, its one Mosaic kernel's PTX
    dumped into `tmp_path`: (the thunk report, the PTX path, its counts, ptxas's resources)."""
    from benchmarks import ptx
    from measure.xla_target import compile_for_h100

    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    (ptx_path,) = tmp_path.glob("*.ptx")
    (name, counts), = ptx.read_ptx(ptx_path.read_text()).items()
    return report, ptx_path, counts, ptx.parse_ptxas_verbose(ptx_path.with_suffix(".ptxas").read_text())[name]


def test_compiles_for_sm90a_with_pipelined_wgmma_and_tma(tmp_path, monkeypatch):
    """The plan of `x @ w + b` at SD 1.5's cross-attention K/V shape (154 x 768 -> 320, fp16) with
    `backend="mosaic"` compiles for an H100: one Mosaic GPU kernel whose PTX issues wgmma with a
    wait depth of 1, TMA copies in and out, and ptxas reports no spills."""
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")
    args = (jax.ShapeDtypeStruct((154, 768), jnp.float16), jax.ShapeDtypeStruct((768, 320), jnp.float16),
            jax.ShapeDtypeStruct((320,), jnp.float16))
    plan = eqsat.optimize(_dense_bias, progress=False).lower(*args).plan
    report, ptx_path, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    assert report.by_category.get("Pallas (Mosaic GPU)") == 1, report.by_category
    assert counts.tensor_core == "wgmma" and counts.wgmma_wait_depth >= 1, counts
    assert counts.tma_loads >= 2, counts
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx_path.read_text()), "no TMA store"
    assert resources.spill_bytes == 0, resources
