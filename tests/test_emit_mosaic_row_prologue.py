"""The Mosaic matmul's row pass (`emit/mosaic/row_statistics.py`): a LayerNorm (or an RMS norm) whose
A operand computes its own row statistics (a `RowReduce` in A) runs in the matmul kernel, the
statistics reduced over each CTA's rows before the pipeline, no XLA fusion before it. In GPU
interpret mode against the XLA emitter and `jax.jit` on adversarial rows; the model's charge for
the pass; compiled for sm_90a without a GPU at SD 1.5's shape.

GPU interpret mode costs ~10 s per small kernel here: shapes are tiny, one call covers every case."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.pallas import XlaFallbackWarning


def layer_norm_dense(x, gamma, beta, w):
    """SD 1.5's LayerNorm (statistics in float32) then a projection."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return (((xf - mean) * jax.lax.rsqrt(var + 1e-5)).astype(jnp.float16) * gamma + beta) @ w


def rms_norm_dense(x, w):
    """An RMS norm (a sum of squares, divided by K in the reduction's own epilogue) then a projection."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(jnp.float16) @ w


def adversarial_rows(rng, tokens: int, k: int) -> np.ndarray:
    """fp16 rows, each a case: offsets large against the spread, constant rows (at an offset and at
    zero), huge and tiny magnitudes, ordinary ones."""
    x = rng.standard_normal((2, tokens, k))
    x[0, 0::6] = 2000.0 + 0.5 * x[0, 0::6]      # offset >> spread (fp16's ulp at 2000 is 1)
    x[0, 1::6] = -300.0                          # constant rows at an offset: M2 exactly 0
    x[0, 2::6] = 0.0                             # zero rows
    x[0, 3::6] *= 3e3                            # near fp16's range once squared in float32
    x[0, 4::6] *= 1e-6                           # subnormal halves: variance far below eps
    x[1, 5] = 7.0                                # one constant row in the second image
    return x.astype(np.float16)


def row_pass_plan(fn, args):
    """The plan of `fn` (one `Matmul`) and that matmul's prologue reads (`eqsat.cost.mosaic`)."""
    from eqsat.cost.mosaic import prologue_reads

    plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    assert [k.term.op for k in plan.kernels] == ["Matmul"]
    lhs, rhs, dims, _, ty = plan.kernels[0].term.args
    return plan, prologue_reads(lhs, rhs, dims, ty)


def assert_matches_xla_and_jit(plan, fn, args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        out = np.asarray(emit.emit(plan, "mosaic", interpret=True)(*args), np.float64)
    assert np.isfinite(out).all()
    for expected in (emit.emit(plan, "xla")(*args), jax.jit(fn)(*args)):
        expected = np.asarray(expected, np.float64)
        np.testing.assert_allclose(out, expected, rtol=2e-2, atol=4e-3 * np.abs(expected).max())


def test_layer_norm_statistics_are_computed_in_the_matmul():
    """2 x 72 tokens (an M tail), K = 192 (three chunks: the Chan merge of equal counts runs twice),
    N = 64: the moments `RowReduce` becomes a row pass (`stat` fields, `pass_tile` reads), no
    fusion lays A out, and the kernel equals the XLA emitter and `jax.jit` on adversarial rows."""
    from eqsat.cost.mosaic import mosaic_work

    rng = np.random.default_rng(5)
    k = 192
    args = (adversarial_rows(rng, 72, k), rng.standard_normal(k).astype(np.float16),
            rng.standard_normal(k).astype(np.float16), (0.2 * rng.standard_normal((k, 64))).astype(np.float16))
    plan, reads = row_pass_plan(layer_norm_dense, args)
    assert not isinstance(reads, str), reads
    assert ("pass_tile", 2) in reads and reads.count(("stat", 4)) == 2, reads
    assert "A laid out" not in {g.what for g in mosaic_work(plan.kernels[0].term).glue}
    assert_matches_xla_and_jit(plan, layer_norm_dense, args)


def test_a_sum_with_its_own_epilogue_is_a_row_pass():
    """An RMS norm: a `sum` reduction of x² whose epilogue divides by K; one chunk (K = 64)."""
    rng = np.random.default_rng(6)
    args = (adversarial_rows(rng, 72, 64), (0.2 * rng.standard_normal((64, 64))).astype(np.float16))
    plan, reads = row_pass_plan(rms_norm_dense, args)
    assert not isinstance(reads, str), reads
    assert reads.count(("stat", 4)) == 1, reads
    assert_matches_xla_and_jit(plan, rms_norm_dense, args)


def test_the_model_charges_the_pass_and_bounds_the_row():
    """Every CTA reads its rows over the whole row once more (TMA bytes: A's tile twice, gamma and
    beta once per CTA, B's K x N tile); past `ROW_PASS_MAX_LENGTH` the `RowReduce` stays a fusion."""
    from eqsat.cost.mosaic import (ROW_PASS_MAX_LENGTH, matmul_blocks, matmul_work, prologue_blocks,
                                   row_reduce_declined)

    S = jax.ShapeDtypeStruct
    m, k, n = 4096, 320, 320
    args = (S((2, m, k), jnp.float16), S((k,), jnp.float16), S((k,), jnp.float16), S((k, n), jnp.float16))
    plan, reads = row_pass_plan(layer_norm_dense, args)
    assert sorted(reads) == sorted([("tile", 2), ("col", 2), ("col", 2), ("stat", 4), ("stat", 4),
                                    ("pass_tile", 2)]), reads
    work = matmul_work(plan.kernels[0].term)
    blocks = prologue_blocks(matmul_blocks(2 * m, n, k))
    ctas = (2 * m // blocks.tile_m) * (n // blocks.cta_tile_n)
    assert work.ctas == ctas
    per_cta = 2 * blocks.tile_m * k * 2 + 2 * k * 2 + k * blocks.cta_tile_n * 2
    assert work.tma_bytes == ctas * per_cta
    assert work.glue == ()

    # a row past the bound, or not a multiple of the K step: the pass declines it
    for length, declined in ((ROW_PASS_MAX_LENGTH, False), (2 * ROW_PASS_MAX_LENGTH, True), (320 + 32, True)):
        assert (row_reduce_declined(_moments_of_a_row(length), blocks.tile_k) is not None) == declined


def _moments_of_a_row(length: int):
    """`RowReduce(moments)` of a float32 cast of `[2, 8, length]` halves over its last axis."""
    from eqsat.term import Term

    x = Term("Input", "x", f"f16[2,8,{length}]")
    body = Term("Unary", "convert", Term("Load", x, x.ty), f"f32[2,8,{length}]")
    return Term("RowReduce", "moments", body, 2, Term("Acc", "f32[2,2,8]"), "f32[2,2,8]")


def test_the_row_pass_compiles_for_sm90a(tmp_path, monkeypatch):
    """SD 1.5's 64x64-latent LayerNorm + to_q (2 x 4096 tokens, 320 -> 320), compiled for sm_90a:
    the Mosaic kernel is the only launch, its PTX issues wgmma and TMA loads (the pass's and the
    pipeline's), and ptxas spills nothing."""
    from measure.xla_target import unavailable_reason
    from tests.test_emit_mosaic_matmul import assert_one_mosaic_kernel

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    S = jax.ShapeDtypeStruct
    args = (S((2, 4096, 320), jnp.float16), S((320,), jnp.float16), S((320,), jnp.float16),
            S((320, 320), jnp.float16))
    plan, reads = row_pass_plan(layer_norm_dense, args)
    assert ("pass_tile", 2) in reads, reads
    assert_one_mosaic_kernel(plan, args, tmp_path, monkeypatch, tma_loads=3)


def test_a_sum_beside_moments_of_its_body_is_read_off_the_mean():
    """The UNet's 1280-channel LayerNorms take their mean as `sum / K` beside the moments of the same
    body: the kernel reads the sum off the moments pass (`RowPass.derived`, no second pass). Built
    directly (`build` with a `Prologue` of both passes), 144 rows (an M tail), K = 192, against NumPy."""
    from emit.mosaic import matmul as mm
    from emit.mosaic.row_statistics import RowPass

    rng = np.random.default_rng(7)
    k = 192
    x = adversarial_rows(rng, 72, k).reshape(144, k)
    w = (0.2 * rng.standard_normal((k, 64))).astype(np.float16)

    def normalized(values):
        x_tile, mean, m2, total = values
        centered = x_tile.astype(jnp.float32) - total / k
        return (centered + (x_tile.astype(jnp.float32) - mean)) * 0.5 * jax.lax.rsqrt(m2 / k + 1e-5)

    tile = mm.PrologueSource("tile", jnp.asarray(x))
    prologue = mm.Prologue(normalized, (tile, mm.PrologueSource("stat", None, 0, 0, 0),
                                        mm.PrologueSource("stat", None, 1, 0, 0),
                                        mm.PrologueSource("stat", None, 0, 0, 1)),
                           (RowPass("moments", lambda values: values[0].astype(jnp.float32), (tile,), k),
                            RowPass("sum", None, (), k, derived=0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        out = mm.build(jax.ShapeDtypeStruct((1, 144, k), jnp.float16), jnp.asarray(w)[None], prologue=prologue,
                       interpret=True)
    xf = x.astype(np.float64)
    a = ((xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)).astype(np.float16)
    expected = a.astype(np.float64) @ w.astype(np.float64)
    bound = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out[0], np.float64), expected, atol=float(4e-3 * bound.max()), rtol=2e-2)
