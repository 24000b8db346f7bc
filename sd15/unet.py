"""diffusers `UNet2DConditionModel` (SD 1.5 family) as a pure function of a flat parameter dict.

    apply(params, config, sample [B,4,H,W], timestep scalar|[B], encoder_hidden_states [B,S,D])
        -> noise prediction [B,4,H,W]

Dataflow, as in diffusers (module paths are the parameter prefixes and the named scopes):

    time_proj (sinusoid) -> time_embedding.{linear_1, SiLU, linear_2} = temb
    conv_in -> down_blocks.i: (resnets.j [-> attentions.j])* [-> downsamplers.0]   every output is a skip
            -> mid_block: resnets.0 -> attentions.0 -> resnets.1
            -> up_blocks.i: (concat skip -> resnets.j [-> attentions.j])* [-> upsamplers.0]
            -> conv_norm_out -> SiLU -> conv_out

Attention blocks are `Transformer2DModel`s: GroupNorm (eps 1e-6) -> proj_in (1x1 conv) -> tokens
-> BasicTransformerBlocks (LayerNorm eps 1e-5; self-attention; cross-attention on the text;
GEGLU feed-forward) -> proj_out -> + residual. NCHW at the boundary, NHWC inside.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sd15.config import CROSS_ATTN_DOWN, CROSS_ATTN_UP, UNetConfig
from sd15.layers import (
    Params,
    attention,
    conv2d,
    downsample,
    gelu,
    group_norm,
    layer_norm,
    linear,
    resnet_block,
    scope,
    silu,
    upsample,
)

TRANSFORMER_NORM_EPS = 1e-6  # Transformer2DModel's GroupNorm; the resnets use config.norm_eps.
TRANSFORMER_BLOCK_NORM_EPS = 1e-5  # BasicTransformerBlock's LayerNorms.


def timestep_embedding(timesteps: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float) -> jax.Array:
    """diffusers `get_timestep_embedding`: [B] -> [B, dim] sinusoids (cos first when flipped)."""
    half = dim // 2
    frequencies = np.exp(-math.log(10000.0) * np.arange(half, dtype=np.float32) / (half - freq_shift))
    angles = timesteps.astype(jnp.float32)[:, None] * frequencies.astype(np.float32)[None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    return jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)


def cross_attention(params: Params, path: str, x: jax.Array, context: jax.Array, heads: int) -> jax.Array:
    """diffusers `Attention` without biases on q/k/v (self-attention when context is x)."""
    with scope(path):
        q = linear(params, f"{path}.to_q", x, bias=False)
        k = linear(params, f"{path}.to_k", context, bias=False)
        v = linear(params, f"{path}.to_v", context, bias=False)
        return linear(params, f"{path}.to_out.0", attention(q, k, v, heads))


def feed_forward(params: Params, path: str, x: jax.Array) -> jax.Array:
    """diffusers `FeedForward` with GEGLU: net.0 = GEGLU(proj), net.2 = Linear."""
    with scope(path):
        with scope(f"{path}.net.0"):
            h = linear(params, f"{path}.net.0.proj", x)
            value, gate = jnp.split(h, 2, axis=-1)
            h = value * gelu(gate)
        return linear(params, f"{path}.net.2", h)


def transformer_block(params: Params, path: str, x: jax.Array, context: jax.Array, heads: int) -> jax.Array:
    """diffusers `BasicTransformerBlock` (norm_type "layer_norm") on tokens [B, S, C]."""
    with scope(path):
        eps = TRANSFORMER_BLOCK_NORM_EPS
        h = layer_norm(params, f"{path}.norm1", x, eps)
        x = x + cross_attention(params, f"{path}.attn1", h, h, heads)
        h = layer_norm(params, f"{path}.norm2", x, eps)
        x = x + cross_attention(params, f"{path}.attn2", h, context, heads)
        h = layer_norm(params, f"{path}.norm3", x, eps)
        return x + feed_forward(params, f"{path}.ff", h)


def transformer_2d(
    params: Params, config: UNetConfig, path: str, x: jax.Array, context: jax.Array, heads: int
) -> jax.Array:
    """diffusers `Transformer2DModel` (one transformer block) on NHWC input."""
    with scope(path):
        b, h, w, c = x.shape
        y = group_norm(params, f"{path}.norm", x, config.norm_num_groups, TRANSFORMER_NORM_EPS)
        if config.use_linear_projection:
            y = linear(params, f"{path}.proj_in", y.reshape(b, h * w, c))
        else:
            y = conv2d(params, f"{path}.proj_in", y).reshape(b, h * w, c)
        y = transformer_block(params, f"{path}.transformer_blocks.0", y, context, heads)
        if config.use_linear_projection:
            y = linear(params, f"{path}.proj_out", y).reshape(b, h, w, c)
        else:
            y = conv2d(params, f"{path}.proj_out", y.reshape(b, h, w, c))
        return x + y


def apply(
    params: Params,
    config: UNetConfig,
    sample: jax.Array,
    timestep: jax.Array | float | int,
    encoder_hidden_states: jax.Array,
) -> jax.Array:
    """The UNet's noise prediction, equal to diffusers `UNet2DConditionModel(...).sample`.

    Runs in the dtype of the parameters (inputs are cast to it); H and W must be multiples of
    2 ** (number of down blocks - 1).
    """
    dtype = params["conv_in.weight"].dtype
    batch, _, height, width = sample.shape
    factor = 2 ** (len(config.block_out_channels) - 1)
    if height % factor or width % factor:
        raise ValueError(f"sample size {height}x{width} must be a multiple of {factor}")
    groups, eps = config.norm_num_groups, config.norm_eps
    context = encoder_hidden_states.astype(dtype)

    with scope("time_proj"):
        timesteps = jnp.broadcast_to(jnp.reshape(jnp.asarray(timestep, jnp.float32), (-1,)), (batch,))
        t_emb = timestep_embedding(timesteps, config.block_out_channels[0], config.flip_sin_to_cos, config.freq_shift)
        t_emb = t_emb.astype(dtype)
    with scope("time_embedding"):
        temb = linear(params, "time_embedding.linear_1", t_emb)
        temb = linear(params, "time_embedding.linear_2", silu(temb))

    x = conv2d(params, "conv_in", sample.astype(dtype).transpose(0, 2, 3, 1))

    skips = [x]
    last = len(config.block_out_channels) - 1
    for i, block_type in enumerate(config.down_block_types):
        path = f"down_blocks.{i}"
        with scope(path):
            for j in range(config.layers_per_block):
                x = resnet_block(params, f"{path}.resnets.{j}", x, temb, groups, eps)
                if block_type == CROSS_ATTN_DOWN:
                    x = transformer_2d(params, config, f"{path}.attentions.{j}", x, context, config.heads(i))
                skips.append(x)
            if i != last:
                x = downsample(params, f"{path}.downsamplers.0", x)
                skips.append(x)

    with scope("mid_block"):
        x = resnet_block(params, "mid_block.resnets.0", x, temb, groups, eps)
        x = transformer_2d(params, config, "mid_block.attentions.0", x, context, config.heads(last))
        x = resnet_block(params, "mid_block.resnets.1", x, temb, groups, eps)

    for i, block_type in enumerate(config.up_block_types):
        path = f"up_blocks.{i}"
        with scope(path):
            for j in range(config.layers_per_block + 1):
                x = jnp.concatenate([x, skips.pop()], axis=-1)
                x = resnet_block(params, f"{path}.resnets.{j}", x, temb, groups, eps)
                if block_type == CROSS_ATTN_UP:
                    x = transformer_2d(params, config, f"{path}.attentions.{j}", x, context, config.heads(last - i))
            if i != last:
                x = upsample(params, f"{path}.upsamplers.0", x)

    x = group_norm(params, "conv_norm_out", x, groups, eps)
    with scope("conv_act"):
        x = silu(x)
    x = conv2d(params, "conv_out", x)
    return x.transpose(0, 3, 1, 2)
