"""The layers the SD 1.5 networks are built from, as plain jnp/lax over a flat parameter dict.

Conventions shared by `clip`, `unet` and `vae`:

* `params` is flat and keyed exactly like the PyTorch state dict, in PyTorch layouts (conv weight
  OIHW, linear weight [out, in]); a layer reads `params[f"{path}.weight"]`.
* Images are channels-last (NHWC) inside the networks; token sequences are [B, S, C]. Conv weights
  stay OIHW: `conv_general_dilated` takes the layout as `dimension_numbers`, so no weight transpose.
* Every layer runs under `jax.named_scope(path)`, `path` being its full dotted module path. Scopes
  nest, so an equation's `source_info.name_stack` reads e.g.
  `down_blocks.0/down_blocks.0.resnets.1/down_blocks.0.resnets.1.conv1`: every segment is a
  globally unique diffusers module path, and the last one is the innermost module.
* One primitive per obvious op: attention is an explicit softmax(Q K^T * scale) V, norms are
  mean/variance reductions, activations are `logistic`/`erf` expressions (no `jax.nn` wrappers).
* 16-bit inputs are normalized and soft-maxed in float32, then cast back; float32 adds no converts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

Params = dict[str, jax.Array]


def scope(path: str):
    """The named scope of the module at dotted `path` (see the module docstring)."""
    return jax.named_scope(path)


def _to_float32(x: jax.Array) -> jax.Array:
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


# --- activations -------------------------------------------------------------------------------


def silu(x: jax.Array) -> jax.Array:
    return x * lax.logistic(x)


def quick_gelu(x: jax.Array) -> jax.Array:
    """CLIP's sigmoid approximation of GELU: x * sigmoid(1.702 x)."""
    return x * lax.logistic(1.702 * x)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as torch's `F.gelu(x, approximate="none")`."""
    return 0.5 * x * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


# --- parameterized layers ----------------------------------------------------------------------


def linear(params: Params, path: str, x: jax.Array, bias: bool = True) -> jax.Array:
    """torch `nn.Linear`: x @ W^T + b over the last axis, W stored [out, in]."""
    with scope(path):
        y = lax.dot_general(x, params[f"{path}.weight"], (((x.ndim - 1,), (1,)), ((), ())))
        if bias:
            y = y + params[f"{path}.bias"]
        return y


def conv2d(params: Params, path: str, x: jax.Array, stride: int = 1) -> jax.Array:
    """torch `nn.Conv2d` with 'same' padding k // 2 (as every conv in SD 1.5), on NHWC input."""
    with scope(path):
        w = params[f"{path}.weight"]
        pad = w.shape[2] // 2
        y = lax.conv_general_dilated(
            x, w, (stride, stride), ((pad, pad), (pad, pad)), dimension_numbers=("NHWC", "OIHW", "NHWC")
        )
        return y + params[f"{path}.bias"]


def group_norm(params: Params, path: str, x: jax.Array, groups: int, eps: float) -> jax.Array:
    """torch `nn.GroupNorm` on channels-last input [B, ..., C]: statistics per (batch, group)."""
    with scope(path):
        shape, dtype = x.shape, x.dtype
        channels = shape[-1]
        y = _to_float32(x).reshape(shape[0], -1, groups, channels // groups)
        count = y.shape[1] * y.shape[3]
        mean = jnp.sum(y, axis=(1, 3), keepdims=True) / count
        centered = y - mean
        var = jnp.sum(centered * centered, axis=(1, 3), keepdims=True) / count
        y = (centered * lax.rsqrt(var + eps)).reshape(shape).astype(dtype)
        return y * params[f"{path}.weight"] + params[f"{path}.bias"]


def layer_norm(params: Params, path: str, x: jax.Array, eps: float) -> jax.Array:
    """torch `nn.LayerNorm` over the last axis."""
    with scope(path):
        dtype = x.dtype
        y = _to_float32(x)
        mean = jnp.mean(y, axis=-1, keepdims=True)
        centered = y - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        y = (centered * lax.rsqrt(var + eps)).astype(dtype)
        return y * params[f"{path}.weight"] + params[f"{path}.bias"]


# --- attention ---------------------------------------------------------------------------------


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, bias: jax.Array | None = None) -> jax.Array:
    """Multi-head softmax(Q K^T / sqrt(d) + bias) V.

    q: [B, Sq, H*D], k and v: [B, Sk, H*D], bias broadcastable to [B, H, Sq, Sk] -> [B, Sq, H*D].
    """
    batch, q_len, width = q.shape
    kv_len = k.shape[1]
    head_dim = width // heads
    q = q.reshape(batch, q_len, heads, head_dim)
    k = k.reshape(batch, kv_len, heads, head_dim)
    v = v.reshape(batch, kv_len, heads, head_dim)
    # [B, H, Sq, Sk]: batch dims (B, H) first, then q's free axis, then k's.
    scores = lax.dot_general(q, k, (((3,), (3,)), ((0, 2), (0, 2))))
    scores = _to_float32(scores) * (head_dim**-0.5)
    if bias is not None:
        scores = scores + bias
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(v.dtype)
    # [B, H, Sq, D]
    out = lax.dot_general(weights, v, (((3,), (1,)), ((0, 1), (0, 2))))
    return out.transpose(0, 2, 1, 3).reshape(batch, q_len, width)


# --- resampling --------------------------------------------------------------------------------


def upsample_nearest_2x(x: jax.Array) -> jax.Array:
    """Nearest-neighbour 2x upsampling of NHWC input (torch `F.interpolate(scale_factor=2.0)`)."""
    b, h, w, c = x.shape
    x = lax.broadcast_in_dim(x, (b, h, 2, w, 2, c), (0, 1, 3, 5))
    return x.reshape(b, 2 * h, 2 * w, c)


# --- blocks shared by the UNet and the VAE decoder ----------------------------------------------


def resnet_block(
    params: Params, path: str, x: jax.Array, temb: jax.Array | None, groups: int, eps: float
) -> jax.Array:
    """diffusers `ResnetBlock2D` (time-scale-shift "default", output scale 1) on NHWC input.

    temb: [B, T] time embedding (None in the VAE); a 1x1 `conv_shortcut` exists iff channels change.
    """
    with scope(path):
        h = conv2d(params, f"{path}.conv1", silu(group_norm(params, f"{path}.norm1", x, groups, eps)))
        if temb is not None:
            t = linear(params, f"{path}.time_emb_proj", silu(temb))
            h = h + t[:, None, None, :]
        h = conv2d(params, f"{path}.conv2", silu(group_norm(params, f"{path}.norm2", h, groups, eps)))
        if x.shape[-1] != h.shape[-1]:
            x = conv2d(params, f"{path}.conv_shortcut", x)
        return x + h


def upsample(params: Params, path: str, x: jax.Array) -> jax.Array:
    """diffusers `Upsample2D`: nearest 2x, then a 3x3 `conv`."""
    with scope(path):
        return conv2d(params, f"{path}.conv", upsample_nearest_2x(x))


def downsample(params: Params, path: str, x: jax.Array) -> jax.Array:
    """diffusers `Downsample2D` (padding 1): a stride-2 3x3 `conv`."""
    with scope(path):
        return conv2d(params, f"{path}.conv", x, stride=2)
