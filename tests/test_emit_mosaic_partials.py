"""Hosted statistics written by the Mosaic matmul's epilogue as per-tile partials
(`emit/mosaic/partials.py`): the template's partials against the two-pass statistics of its own
stored output (clamped M and N tiles, offsets far from the spread, constant rows, zeros, NaN), a
plan whose LayerNorm statistic the Mosaic matmul hosts against the XLA emitter and `jax.jit` with no
reduce kernel after it, the cost model's matching choice, and a deviceless sm_90a compile.

GPU interpret mode costs ~10 s per small kernel here: shapes are tiny."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import matmul as mm
from emit.mosaic.partials import RowStatistic
from eqsat.cost.mosaic import row_statistic_declined

OFFSET = 1e4


def _merge(op: str, partials: jax.Array) -> np.ndarray:
    """The readers' merge of `[tiles, fields, rows]` partials, in tile order (Chan's formula)."""
    from emit.pallas.conv import merge_partials

    return np.asarray(merge_partials(partials, op), np.float64)


@pytest.mark.slow
def test_template_partials_are_the_statistics_of_its_stored_output():
    """72 rows (a 64-row tile and one clamped to rows 8-71), N = 192 (a 128-column CTA of two
    warpgroups and one clamped to columns 64-191, whose first 64 are its neighbour's and must not
    count), K = 40; the output float32 at an offset of 1e4 against a spread of 1, a row of zeros in A
    (a constant row), a row holding a NaN. Each warpgroup's N tile is one tile of the partials: 4."""
    rng = np.random.default_rng(3)
    m, k, n = 72, 40, 192
    a = rng.standard_normal((1, m, k))
    a[0, 5] = 0.0  # its output row is the offset alone
    a[0, 70, 3] = np.nan
    a = jnp.asarray(a, jnp.float16)
    w = jnp.asarray(0.3 * rng.standard_normal((1, k, n)), jnp.float16)
    statistics = [RowStatistic("moments", lambda t: t.astype(jnp.float32)),
                  RowStatistic("sum", lambda t: t.astype(jnp.float32) * 0.5)]
    out, partials = mm.build(a, w, epilogue=lambda acc, _: acc + OFFSET, out_dtype=jnp.float32,
                             blocks=mm.MosaicBlocks(64, 64, 64, stages=2, compute_wgs=2), interpret=True,
                             statistics=statistics)
    assert [p.shape for p in partials] == [(4, 3, m), (4, 1, m)]
    counts = np.asarray(partials[0])[:, 0]
    np.testing.assert_array_equal(counts, np.array([64, 64, 0, 64])[:, None] * np.ones((1, m)))
    stored = np.asarray(out, np.float64)[0]
    ok = np.isfinite(stored).all(axis=1)
    assert ok.sum() == m - 1
    mean, m2 = _merge("moments", partials[0])
    total = _merge("sum", partials[1])
    assert np.isnan(mean[70]) and np.isnan(m2[70]) and np.isnan(total[70])
    want_mean = stored.mean(1)
    want_m2 = ((stored - want_mean[:, None]) ** 2).sum(1)
    ulp = np.spacing(np.float32(OFFSET))
    np.testing.assert_allclose(mean[ok], want_mean[ok], rtol=0, atol=2 * ulp)
    # fp32 at an offset of 1e4: the Triton matmul's row-statistics bound (`tests/test_emit_matmul.py`)
    scale = np.abs(stored[ok]).max() * np.abs(stored - want_mean[:, None])[ok].max() * n
    np.testing.assert_allclose(m2[ok], want_m2[ok], rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(total[ok], 0.5 * stored.sum(1)[ok], rtol=1e-6,
                               atol=1e-6 * np.abs(stored[ok]).sum(1).max())
    assert mean[5] == OFFSET and m2[5] == 0.0  # the constant row: exactly its value, no spread


def layernorm_of_dense(x, w, b, g, beta):
    y = x @ w + b
    mean = y.mean(-1, keepdims=True)
    var = jnp.square(y - mean).mean(-1, keepdims=True)
    return (y - mean) * jax.lax.rsqrt(var + 1e-5) * g + beta, y


def _pallas_launches(run, args) -> list[str]:
    closed = jax.make_jaxpr(run._run_leaves)(list(args))
    return [e.primitive.name for e in closed.jaxpr.eqns if e.primitive.name in ("io_callback", "jit", "pallas_call")]


def test_a_layernorm_statistic_hosted_on_the_mosaic_matmul_needs_no_reduce_kernel():
    """`y = x @ w + b` (2 x 36 tokens, 40 -> 128, fp16, outputs near 300 against a spread of ~2, a
    row of zeros in x) and the LayerNorm of y: the plan hosts the LayerNorm's statistic on the matmul;
    with `backend="mosaic"` the Mosaic kernel writes its partials (the plan's kernels are all that
    launch: no reduce kernel after it) and the results equal the XLA emitter's and jit's."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 36, 40))
    x[1, 7] = 0.0
    x = jnp.asarray(x, jnp.float16)
    w = jnp.asarray(0.3 * rng.standard_normal((40, 128)), jnp.float16)
    b = jnp.asarray(300 + rng.standard_normal(128), jnp.float16)
    g = jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.float16)
    beta = jnp.asarray(rng.standard_normal(128), jnp.float16)
    args = (x, w, b, g, beta)
    plan = eqsat.optimize(layernorm_of_dense, progress=False).lower(*args).plan
    (matmul,) = [k for k in plan.kernels if k.op == "Matmul"]
    (statistic,) = matmul.hosted
    assert row_statistic_declined(statistic, matmul.term) is None
    run = emit.emit(plan, "mosaic", interpret=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        assert len(_pallas_launches(run, args)) == len(plan.kernels)
        got = run(*args)
    xla = emit.emit(plan, "xla")(*args)
    want = jax.jit(layernorm_of_dense)(*args)
    for ours, theirs, jitted in zip(got, xla, want):
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(jitted, np.float32), rtol=2e-2, atol=8e-2)


def test_the_model_declines_what_the_template_does_not_write():
    """77 tokens (a padded output: its rows past M would be slots), a body reading another tensor
    (the output plus a residual) and a body over the output's columns (one slot per column, not per
    row) stay driver-reduced; 72 tokens in place do not."""
    from eqsat.term import Term

    S = jax.ShapeDtypeStruct
    for tokens, expected in ((72, None), (77, "a padded output")):
        args = (S((1, tokens, 40), jnp.float16), S((40, 128), jnp.float16), S((128,), jnp.float16),
                S((128,), jnp.float16), S((128,), jnp.float16))
        plan = eqsat.optimize(layernorm_of_dense, progress=False).lower(*args).plan
        (matmul,) = [k for k in plan.kernels if k.op == "Matmul"]
        (statistic,) = matmul.hosted
        reason = row_statistic_declined(statistic, matmul.term)
        assert reason == expected or (expected and expected in reason), reason
        if expected is None:
            host, op, body, _axes, ty = statistic.args
            residual = Term("Load", Term("Input", "residual", body.ty), body.ty)
            with_residual = Term("EpilogueReduce", host, op, Term("Binary", "add", body, residual, body.ty), "2", ty)
            assert "other tensors" in row_statistic_declined(with_residual, host)
            kept = "f32[128]" if op == "sum" else "f32[2,128]"
            by_column = Term("EpilogueReduce", host, op, body, "0,1", kept)
            assert "one output per row" in row_statistic_declined(by_column, host)


def test_row_partials_compile_for_sm90a_without_spills(tmp_path, monkeypatch):
    """SD 1.5's 64x64-latent transformer output (2 x 4096 tokens, 320 -> 320) with a LayerNorm's
    statistic in its epilogue, compiled for sm_90a with `backend="mosaic"`: the Mosaic kernel and the
    plan's other kernels are all that launch (no reduce kernel), and ptxas spills nothing."""
    from measure.xla_target import unavailable_reason
    from tests.test_emit_mosaic import compile_mosaic

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    S = jax.ShapeDtypeStruct
    args = (S((2, 4096, 320), jnp.float16), S((320, 320), jnp.float16), S((320,), jnp.float16),
            S((320,), jnp.float16), S((320,), jnp.float16))
    plan = eqsat.optimize(layernorm_of_dense, progress=False).lower(*args).plan
    (matmul,) = [k for k in plan.kernels if k.op == "Matmul"]
    assert [row_statistic_declined(s, matmul.term) for s in matmul.hosted] == [None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report, _ptx, counts, resources = compile_mosaic(plan, args, tmp_path, monkeypatch)
    assert report.by_category == {"Pallas (Mosaic GPU)": 1, "Pallas (Triton)": len(plan.kernels) - 1}, \
        report.by_category
    assert counts.tensor_core == "wgmma" and resources.spill_bytes == 0, (counts, resources)


def test_moments_partials_compile_for_sm90a_without_spills(tmp_path, monkeypatch):
    """The template with a moments statistic (count, mean, M2 per row: three reductions per
    sub-tile and Chan's merge across them) at 8192 x 320 -> 1280, compiled for sm_90a: one Mosaic
    kernel, wgmma, no spills."""
    from benchmarks import ptx
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))

    def run(a, w):
        return mm.build(a, w, interpret=False, statistics=[RowStatistic("moments", lambda t: t.astype(jnp.float32))])

    S = jax.ShapeDtypeStruct
    report = compile_for_h100(run, S((1, 8192, 320), jnp.float16), S((1, 320, 1280), jnp.float16))
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.by_category == {"Pallas (Mosaic GPU)": 1}, report.by_category
    (ptx_path,) = tmp_path.glob("*.ptx")
    (name, counts), = ptx.read_ptx(ptx_path.read_text()).items()
    resources = ptx.parse_ptxas_verbose(ptx_path.with_suffix(".ptxas").read_text())[name]
    assert counts.tensor_core == "wgmma" and resources.spill_bytes == 0, (counts, resources)
