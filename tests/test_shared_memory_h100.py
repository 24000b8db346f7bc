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
from eqsat.tiling import SHARED_MEMORY_BYTES
from eqsat.tiling.attention import AttentionBlocks, fits_shared_memory, head_pieces
from eqsat.tiling.matmul import MatmulBlocks
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
    assert AttentionBlocks.get_default(4096, 4096, 512) == AttentionBlocks(64, 32, num_warps=8, value_splits=2)


def test_fp32_attention_blocks_shrink():
    assert AttentionBlocks.get_default(4096, 4096, 512, 4) == AttentionBlocks(32, 16, num_warps=4, value_splits=2)
    assert AttentionBlocks.get_default(1024, 1024, 256, 4) == AttentionBlocks(32, 64, num_warps=4)


def test_fp32_matmul_blocks_keep_the_fp16_operand_bytes():
    assert MatmulBlocks.get_default(4096, 512, 512) == MatmulBlocks(128, 128, 32, num_warps=8, num_stages=3)
    assert MatmulBlocks.get_default(4096, 512, 512, 4) == MatmulBlocks(128, 128, 16, num_warps=8, num_stages=3)


def attention(q, k, v):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def groupnorm_matmul_residual(x, w, b, scale, shift):
    """The VAE mid-block's attention input: GroupNorm(32) of NCHW x, as [B, HW, C] rows, @ w + b + rows."""
    batch, channels, height, width = x.shape
    groups = x.reshape(batch, 32, channels // 32, height * width).astype(jnp.float32)
    mean = groups.mean((2, 3), keepdims=True)
    var = ((groups - mean) ** 2).mean((2, 3), keepdims=True)
    h = ((groups - mean) * jax.lax.rsqrt(var + 1e-6)).reshape(x.shape).astype(x.dtype)
    h = h * scale[None, :, None, None] + shift[None, :, None, None]
    rows = h.reshape(batch, channels, height * width).transpose(0, 2, 1)
    return rows @ w + b + rows


def vae_mid_block_pieces(x, w, b, scale, shift, q, k, v, kernel):
    conv = jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)),
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return groupnorm_matmul_residual(x, w, b, scale, shift), attention(q, k, v), conv


@needs_h100_target
def test_fp32_vae_mid_block_kernels_fit_shared_memory_on_h100():
    """The SD 1.5 VAE's mid-block attention pieces in fp32, compiled for sm_90 without a GPU: the
    attention over one 512-lane head asked for 327,680 B of shared memory before its tiles had a budget
    (XLA's compile failed) and 133,120 B after; the GroupNorm -> matmul + residual asked for
    229,376 B (3 KB under the limit) and 114,688 B with fp32 K blocks of 16 (its fp16 form: 131,072);
    the 3x3 conv (128-pixel x 128-channel tiles) 249,856 B with 64-channel K chunks (the compile
    failed; fp16: 126,976) and about as much as fp16 with 32-channel chunks."""
    c, s = 512, 64
    specs = [jax.ShapeDtypeStruct(shape, jnp.float32)
             for shape in [(1, c, s, s), (c, c), (c,), (c,), (c,)] + [(1, 1, s * s, c)] * 3 + [(c, c, 3, 3)]]
    optimized = eqsat.optimize(vae_mid_block_pieces, backend="pallas")
    lowered = optimized.lower(*[jnp.zeros(spec.shape, spec.dtype) for spec in specs])
    assert sorted(k.kind for k in lowered.plan.kernels if k.kind in ("matmul", "attention", "conv")) == \
        ["attention", "conv", "matmul"]

    def run(*args):
        return optimized(*args)

    with tempfile.TemporaryDirectory() as dump:
        report = xla_target.compile_for_h100(run, *specs, keep_dump=dump)
        thunks = read_thunk_kernels(open(glob.glob(f"{dump}/*thunk_sequence.txt")[0]).read())
    assert report is not None
    shared = {t.kernel: t.shared_bytes for t in thunks.values()}
    assert max(shared.values()) <= SHARED_MEMORY_BYTES, shared
    for kind in ("matmul", "conv"):
        launches = [b for name, b in shared.items() if kind in name]
        assert launches and max(launches) <= 131_072, shared


def test_a_weight_gradient_conv_is_not_the_templates():
    """A weight gradient is a conv whose window is the whole image (the SD 1.5 fine-tuning step's
    1x1 shortcut: a 64x64 window over 2 features asked for 266,752-528,896 B of shared memory and
    failed the H100 compile of the whole step): the template declines it."""
    from eqsat.conv_params import ConvParams
    from eqsat.tiling.conv import MAX_WINDOW_TAPS, ConvGeometry, UncoveredConv

    params = ConvParams.parse("strides=1,1;padding=0,0,0,0;lhs_dilation=1,1;rhs_dilation=1,1;lhs_spec=3,0,1,2;"
                              "rhs_spec=3,0,1,2;out_spec=1,0,2,3;feature_groups=1;batch_groups=1")
    with pytest.raises(UncoveredConv, match="weight gradient"):
        ConvGeometry(params, (2, 64, 64, 320), (2, 64, 64, 640), (640, 320, 1, 1))
    seven = ConvParams.parse("strides=1,1;padding=3,3,3,3;lhs_dilation=1,1;rhs_dilation=1,1;lhs_spec=0,3,1,2;"
                             "rhs_spec=0,1,2,3;out_spec=0,3,1,2;feature_groups=1;batch_groups=1")
    assert ConvGeometry(seven, (1, 15, 15, 3), (8, 3, 7, 7), (1, 15, 15, 8)).taps == MAX_WINDOW_TAPS


def test_grad_through_pallas_runs_weight_gradients_in_xla():
    """jax.grad through backend="pallas" of a 1x1 conv net: the weight gradient (a 9x9 window) runs
    through the XLA emitter with a warning naming it, and the gradients equal jax.grad's."""
    from emit.pallas import XlaFallbackWarning

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)

    w = jax.random.normal(jax.random.key(0), (1, 1, 3, 5), jnp.float32)
    x = 1e3 + jax.random.normal(jax.random.key(1), (2, 9, 9, 3), jnp.float32)
    with pytest.warns(XlaFallbackWarning, match="weight gradient"):
        got = jax.grad(eqsat.optimize(loss, backend="pallas", cache=False, progress=False))(w, x * 1e-3)
    want = jax.grad(loss)(w, x * 1e-3)
    assert jnp.allclose(got, want, rtol=1e-4, atol=1e-4)
