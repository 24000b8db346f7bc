"""Where the Mosaic attention reads its operands (`emit/mosaic/attention.py`, issue 17): K as it lies
through a transposed SMEM operand (no Kᵀ), q, k and v of a fused QKV projection at their heads of
its `[B, S, 3·H·D]` output (`Stored`, `eqsat.cost.mosaic.stored_heads`: no slice copies), heads of
40 padded to 48 by the projections' prepared weights (zero columns per head; to_out's weight zero
rows per head, reading the padded output), in GPU interpret mode against the XLA emitter and
`jax.jit` on adversarial values (offsets large against the spread, constant rows, a key of large
magnitude), and the compiled program's launches: no pad, transpose or slice fusion around a
self-attention (tests/test_cost_mosaic_glue.py); the cost model charges what launches.

Interpreted kernels are slow here: tiny shapes (2 heads of 16 or 40, 128 tokens, 77 keys)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning
from emit.mosaic import attention as ma
from emit.pallas import XlaFallbackWarning
from eqsat.cost.mosaic import mosaic_work, stored_heads
from tests import test_cost_mosaic_glue as glue_cases


def _self_attention(x, wqkv, wo):
    return glue_cases._self_attention(x, wqkv, wo, heads=2)


def _cross_attention(x, context, wq, wkv, wo):
    return glue_cases._cross_attention(x, context, wq, wkv, wo, heads=2)


def _adversarial(rng, tokens, width, heads):
    """Inputs whose q, k and v carry offsets large against their spread, constant token rows, and one
    key of large magnitude (finite: ~3e3 logits)."""
    x = (rng.standard_normal((2, tokens, width)) + 8.0).astype(np.float32)
    x[:, 3] = 1.5                      # a constant row
    x[1, 5:9] = x[1, 4]                # equal tokens
    x[0, 7] *= 40.0                    # a key of large magnitude
    return x.astype(np.float16)


def _weights(rng, *shape):
    return (0.3 * rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float16)


def _emitted(fn, args):
    lowered = eqsat.optimize(fn, progress=False).lower(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("error", XlaFallbackWarning)
        mosaic = emit.emit(lowered.plan, "mosaic", interpret=True)(*args)
    return lowered.plan, mosaic, emit.emit(lowered.plan, "xla")(*args), jax.jit(fn)(*args)


def _assert_close(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.all(np.isfinite(actual))
    atol = 2e-2 + 8 * np.finfo(np.float16).eps * float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=atol)


def _attention_term(plan):
    (term,) = [k.term for k in plan.kernels if k.op == "Attention"]
    return term


@pytest.mark.slow
def test_fused_qkv_heads_of_16_read_in_place():
    """A self-attention over one `x @ [wq wk wv]` projection, 2 heads of 16, 128 tokens (one CTA of
    two compute warpgroups), 2 batches: q, k and v are heads 0-1, 2-3 and 4-5 of the projection's
    output stored `[B, S, 6, 16]`, read there; the kernel matches the XLA emitter and jit."""
    rng = np.random.default_rng(0)
    args = (_adversarial(rng, 128, 32, 2), _weights(rng, 32, 96), _weights(rng, 32, 32))
    plan, mosaic, xla, jit = _emitted(_self_attention, args)
    q, k, v = _attention_term(plan).args[:3]
    found = [stored_heads(x, tile) for x, tile in ((q, 128), (k, 64), (v, 64))]
    assert [(f.heads, f.head0) for f in found] == [(6, 0), (6, 2), (6, 4)], found
    assert found[0].tensor is found[1].tensor is found[2].tensor
    assert "q and v laid out" not in {g.what for g in mosaic_work(_attention_term(plan)).glue}
    _assert_close(mosaic, xla)
    _assert_close(mosaic, jit)


@pytest.mark.slow
def test_heads_of_40_over_77_keys_match_xla_and_jit():
    """A cross-attention with heads of 40 (padded to 48 by XLA: not read in place) over 77 context
    tokens (keys masked in their one 80-key step), K read through the transposed operand."""
    rng = np.random.default_rng(1)
    args = (_adversarial(rng, 64, 80, 2), _adversarial(rng, 77, 32, 2)[:, :, :32], _weights(rng, 80, 80),
            _weights(rng, 32, 160), _weights(rng, 80, 80))
    plan, mosaic, xla, jit = _emitted(_cross_attention, args)
    q, k, v = _attention_term(plan).args[:3]
    assert stored_heads(q, 64) is None and stored_heads(k, 80) is None  # heads padded to 48
    _assert_close(mosaic, xla)
    _assert_close(mosaic, jit)


def test_stored_heads_refuses_what_needs_padding_or_a_copy():
    """Heads of 40 (wgmma pads them), 77 rows (not whole tiles), a head-major tensor read per head
    (heads do not lie side by side in a row): not read in place."""
    from eqsat.term import Term
    from eqsat.types import ints_key, with_shape

    def viewed(shape, heads, order=(0, 2, 1, 3)):
        batch, seq, width = shape
        tensor = Term("Input", "x", f"f16[{batch},{seq},{width}]")
        load = Term("Load", tensor, tensor.ty)
        split = Term("Reshape", load, with_shape(load.ty, (batch, seq, heads, width // heads)))
        out_shape = [(batch, seq, heads, width // heads)[a] for a in order]
        return Term("Transpose", split, ints_key(order), with_shape(load.ty, out_shape))

    assert stored_heads(viewed((2, 128, 64), 4), 128) is not None
    assert stored_heads(viewed((2, 128, 80), 2), 128) is None   # heads of 40
    assert stored_heads(viewed((2, 77, 64), 4), 64) is None     # 77 rows


def _sd_block(params, x, context):
    """SD 1.5's transformer block attentions: self-attention (fused to_q/k/v), then cross-attention
    over the context (its K/V projection apart), each to_out with a bias, residuals between."""
    from sd15.unet import cross_attention

    x = x + cross_attention(params, "attn1", x, x, 2)
    return x + cross_attention(params, "attn2", x, context, 2)


@pytest.mark.slow
def test_heads_of_40_padded_by_the_prepared_weights():
    """2 heads of 40 (80 channels), 128 tokens, a 77-token context of 32, weights prepared
    (`params_argnums=0`): the self-attention's fused projection writes heads of 48 (zero columns its
    weight gained per head), the attention reads q, k and v there and its to_out reads the padded
    output (zero rows per head); the cross-attention's q likewise, its K and V (77 keys) padded by
    XLA. In GPU interpret mode against the XLA emitter and jit on adversarial values."""
    from emit.mosaic.layouts import head_padded_weight
    from emit.prepare import Prepared

    rng = np.random.default_rng(3)
    params = {}
    for name, context_width in (("attn1", 80), ("attn2", 32)):
        params |= {f"{name}.to_q.weight": _weights(rng, 80, 80).T,
                   f"{name}.to_k.weight": _weights(rng, context_width, 80).T,
                   f"{name}.to_v.weight": _weights(rng, context_width, 80).T,
                   f"{name}.to_out.0.weight": _weights(rng, 80, 80).T,
                   f"{name}.to_out.0.bias": (rng.standard_normal(80) * 0.1).astype(np.float16)}
    x, context = _adversarial(rng, 128, 80, 2), _adversarial(rng, 77, 32, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        lowered = eqsat.optimize(_sd_block, backend="mosaic", params_argnums=0, progress=False,
                                 cache=False).lower(params, x, context)
        split = lowered.split
        matmuls = [k.term for k in split.per_call.kernels if k.op == "Matmul"]
        laid_out = {(rows, k.args[1].ty) for k in matmuls for rows in (False, True)
                    if head_padded_weight(k, 40, rows) in split.prepared_tensors}
        # attn1's fused q/k/v and attn2's to_q by columns, both to_outs by rows; not attn2's K/V (77 keys)
        assert sorted(laid_out) == [(False, "f16[240,80]"), (False, "f16[80,80]"), (True, "f16[80,80]")], laid_out
        assert sum(head_padded_weight(k, 40, True) in split.prepared_tensors for k in matmuls) == 2
        calls = []
        original = ma.build

        def spy(q, k, v, **kwargs):
            calls.append([type(x).__name__ for x in (q, k, v)])
            return original(q, k, v, **kwargs)

        ma.build = spy
        try:
            mosaic = Prepared(split, "mosaic", interpret=True)(params, x, context)
        finally:
            ma.build = original
    assert calls[0] == ["Stored"] * 3 and calls[1][0] == "Stored" and "Stored" not in calls[1][1:], calls
    xla = Prepared(split, "xla")(params, x, context)
    _assert_close(mosaic, xla)
    _assert_close(mosaic, jax.jit(_sd_block)(params, x, context))


def test_interpret_mode_multiplies_a_transposed_smem_operand():
    """`emit.mosaic.interpreter.install`: GPU interpret mode's wgmma reads a B operand through
    `plgpu.transpose_ref` (what the attention passes K as) transposed, as the compiled wgmma does:
    one warpgroup, a [64, 48] A times the transpose of a [64, 48] B, against NumPy."""
    import functools

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from emit.mosaic import interpreter
    from emit.mosaic.matmul import interpret_params

    interpreter.install()
    transforms = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))

    def kernel(a_ref, b_ref, out_ref):
        @functools.partial(pl.run_scoped, a_smem=plgpu.SMEM((64, 48), jnp.float16, transforms=transforms),
                           b_smem=plgpu.SMEM((64, 48), jnp.float16, transforms=transforms),
                           barrier=plgpu.Barrier(num_barriers=2))
        def _(a_smem, b_smem, barrier):
            plgpu.copy_gmem_to_smem(a_ref, a_smem, barrier.at[0])
            plgpu.copy_gmem_to_smem(b_ref, b_smem, barrier.at[1])
            plgpu.barrier_wait(barrier.at[0])
            plgpu.barrier_wait(barrier.at[1])

            def product(acc_ref):
                plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
                return acc_ref[...]

            out_ref[...] = pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))

    rng = np.random.default_rng(5)
    a, b = (jnp.asarray(rng.standard_normal((64, 48)) * 8 + 100, jnp.float16) for _ in range(2))
    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                       interpret=interpret_params())(a, b)
    expected = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)
