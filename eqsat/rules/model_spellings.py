"""How real models write normalization and attention, as the rule families' soundness examples use
them: the spellings of SD 1.5's own layers (`sd15/layers.py`, torch's GroupNorm/LayerNorm and
multi-head attention, float32 statistics), written here without parameter dicts so that the rules
know no model. `tests/test_spellings.py` checks that each equals the sd15 layer it mirrors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def _to_float32(x):
    return x.astype(jnp.float32) if x.dtype != jnp.float32 else x


def group_norm(x, weight, bias, groups: int, eps: float):
    """torch `nn.GroupNorm` on channels-last input [B, ..., C]: statistics per (batch, group)."""
    shape, dtype = x.shape, x.dtype
    channels = shape[-1]
    y = _to_float32(x).reshape(shape[0], -1, groups, channels // groups)
    count = y.shape[1] * y.shape[3]
    mean = jnp.sum(y, axis=(1, 3), keepdims=True) / count
    centered = y - mean
    var = jnp.sum(centered * centered, axis=(1, 3), keepdims=True) / count
    y = (centered * lax.rsqrt(var + eps)).reshape(shape).astype(dtype)
    return y * weight + bias


def layer_norm(x, weight, bias, eps: float):
    """torch `nn.LayerNorm` over the last axis."""
    dtype = x.dtype
    y = _to_float32(x)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    centered = y - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return (centered * lax.rsqrt(var + eps)).astype(dtype) * weight + bias


def multi_head_attention(q, k, v, heads: int, bias=None):
    """softmax(Q K^T / sqrt(d) + bias) V over [B, S, H*D] projections, scores in float32."""
    batch, q_len, width = q.shape
    kv_len = k.shape[1]
    head_dim = width // heads
    q = q.reshape(batch, q_len, heads, head_dim)
    k = k.reshape(batch, kv_len, heads, head_dim)
    v = v.reshape(batch, kv_len, heads, head_dim)
    scores = lax.dot_general(q, k, (((3,), (3,)), ((0, 2), (0, 2))))
    scores = _to_float32(scores) * (head_dim**-0.5)
    if bias is not None:
        scores = scores + bias
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(v.dtype)
    out = lax.dot_general(weights, v, (((3,), (1,)), ((0, 1), (0, 2))))
    return out.transpose(0, 2, 1, 3).reshape(batch, q_len, width)


def causal_bias(length: int) -> np.ndarray:
    """CLIP's [1, 1, S, S] additive mask: 0 on and below the diagonal, float32 min above it."""
    return np.triu(np.full((length, length), np.finfo(np.float32).min, np.float32), k=1)[None, None]
