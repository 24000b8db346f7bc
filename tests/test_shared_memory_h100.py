"""Templates stay inside an H100's shared memory at every dtype: fp32 operands need about twice the
bytes of fp16 ones, and a Triton kernel that asks for more than 232,448 B fails XLA's whole compile
(`RESOURCE_EXHAUSTED: Shared memory size limit exceeded`, naming no kernel). Checked on the tile
choice itself and, for the shapes that used to fail, on the deviceless sm_90 compile's launches."""

from __future__ import annotations

import glob
import tempfile

import jax
import jax.numpy as jnp
import pytest

import eqsat
from benchmarks.kernels import read_thunk_kernels
from eqsat.tiling.attention import (SHARED_MEMORY_BYTES, AttentionBlocks, fits_shared_memory, head_pieces)
from measure import xla_target

needs_h100_target = pytest.mark.skipif(xla_target.unavailable_reason() is not None,
                                       reason=str(xla_target.unavailable_reason()))


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 80, 128, 160, 256, 512])
@pytest.mark.parametrize("q_len", [1, 77, 1024, 4096])
def test_attention_blocks_fit_shared_memory(q_len, head_dim, itemsize):
    blocks = AttentionBlocks.get_default(q_len, q_len, head_dim, itemsize)
    blocks.validate()
    width = sum(w for _, w in head_pieces(head_dim))
    assert fits_shared_memory(blocks.block_q, blocks.block_k, width, itemsize), blocks
    assert blocks.num_warps >= 4


def test_a_head_too_wide_for_shared_memory_runs_through_xla_with_a_warning():
    """fp32 heads of 1024 lanes fit no tile: the template declines (the kernel runs through the XLA
    emitter, with a warning naming it) instead of failing the whole program's compile."""
    from emit.pallas import XlaFallbackWarning

    q = jnp.linspace(-3.0, 3.0, 2 * 20 * 1024, dtype=jnp.float32).reshape(1, 2, 20, 1024)
    optimized = eqsat.optimize(attention, backend="pallas")
    with pytest.warns(XlaFallbackWarning, match="shared memory"):
        out = optimized(q, q[..., ::-1], q * 0.5)
    expected = jax.jit(attention)(q, q[..., ::-1], q * 0.5)
    assert jnp.allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_fp16_attention_blocks_are_the_measured_ones():
    """The budget changes nothing at fp16: SD 1.5's heads keep the tiles read from their PTX."""
    assert AttentionBlocks.get_default(4096, 4096, 40) == AttentionBlocks(256, 64, num_warps=16)
    assert AttentionBlocks.get_default(4096, 77, 40) == AttentionBlocks(256, 64, num_warps=16)
    assert AttentionBlocks.get_default(1024, 1024, 80) == AttentionBlocks(128, 64, num_warps=8)
    assert AttentionBlocks.get_default(256, 256, 160) == AttentionBlocks(64, 64, num_warps=4)
    assert AttentionBlocks.get_default(4096, 4096, 512) == AttentionBlocks(64, 32, num_warps=8)


def test_fp32_attention_blocks_shrink():
    assert AttentionBlocks.get_default(4096, 4096, 512, 4) == AttentionBlocks(32, 16, num_warps=4)
    assert AttentionBlocks.get_default(1024, 1024, 256, 4) == AttentionBlocks(32, 64, num_warps=4)


def attention(q, k, v):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


@needs_h100_target
def test_fp32_attention_over_wide_heads_compiles_for_h100():
    """The SD 1.5 VAE's mid-block attention (one head of 512 over 64x64 latents) in fp32: 327,680 B of
    shared memory asked before the budget (the compile failed), 133,120 B after."""
    optimized = eqsat.optimize(attention, backend="pallas")
    lowered = optimized.lower(*[jnp.zeros((1, 1, 4096, 512), jnp.float32)] * 3)
    assert [k.kind for k in lowered.plan.kernels] == ["attention"]

    def run(q, k, v):
        return optimized(q, k, v)

    with tempfile.TemporaryDirectory() as dump:
        report = xla_target.compile_for_h100(run, *[jax.ShapeDtypeStruct((1, 1, 4096, 512), jnp.float32)] * 3,
                                             keep_dump=dump)
        thunks = read_thunk_kernels(open(glob.glob(f"{dump}/*thunk_sequence.txt")[0]).read())
    assert report is not None and report.kernels >= 1
    assert thunks and max(t.shared_bytes for t in thunks.values()) <= SHARED_MEMORY_BYTES
