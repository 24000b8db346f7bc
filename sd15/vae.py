"""The decoder half of diffusers `AutoencoderKL` (SD 1.5's VAE) as a pure function.

    decode(params, config, latents [B,4,h,w]) -> image [B,3,8h,8w] (for 4 levels), in about [-1, 1]

equal to diffusers `AutoencoderKL.decode(latents).sample`: `post_quant_conv`, then `decoder`
(conv_in -> mid_block: resnets.0, attentions.0, resnets.1 -> up_blocks.i: resnets.j [-> upsamplers.0]
-> conv_norm_out -> SiLU -> conv_out). No scaling inside: divide by `config.scaling_factor` first.
Every norm has eps 1e-6; the mid attention is single-head with biases and a `group_norm`.
"""

from __future__ import annotations

import jax

from sd15.config import VAEConfig
from sd15.layers import Params, attention, conv2d, group_norm, linear, resnet_block, scope, silu, upsample

NORM_EPS = 1e-6


def mid_attention(params: Params, path: str, x: jax.Array, groups: int) -> jax.Array:
    """diffusers `Attention` as the VAE uses it: GroupNorm, one head, biased q/k/v/out, residual."""
    with scope(path):
        b, h, w, c = x.shape
        y = group_norm(params, f"{path}.group_norm", x, groups, NORM_EPS).reshape(b, h * w, c)
        q = linear(params, f"{path}.to_q", y)
        k = linear(params, f"{path}.to_k", y)
        v = linear(params, f"{path}.to_v", y)
        y = linear(params, f"{path}.to_out.0", attention(q, k, v, heads=1))
        return x + y.reshape(b, h, w, c)


def decode(params: Params, config: VAEConfig, latents: jax.Array) -> jax.Array:
    """Latents [B, C, h, w] -> image [B, out_channels, h * 2**(levels-1), ...]; runs in the params' dtype."""
    dtype = params["post_quant_conv.weight"].dtype
    groups = config.norm_num_groups
    x = conv2d(params, "post_quant_conv", latents.astype(dtype).transpose(0, 2, 3, 1))
    with scope("decoder"):
        x = conv2d(params, "decoder.conv_in", x)
        with scope("decoder.mid_block"):
            x = resnet_block(params, "decoder.mid_block.resnets.0", x, None, groups, NORM_EPS)
            x = mid_attention(params, "decoder.mid_block.attentions.0", x, groups)
            x = resnet_block(params, "decoder.mid_block.resnets.1", x, None, groups, NORM_EPS)
        last = len(config.block_out_channels) - 1
        for i in range(len(config.block_out_channels)):
            path = f"decoder.up_blocks.{i}"
            with scope(path):
                for j in range(config.layers_per_block + 1):
                    x = resnet_block(params, f"{path}.resnets.{j}", x, None, groups, NORM_EPS)
                if i != last:
                    x = upsample(params, f"{path}.upsamplers.0", x)
        x = group_norm(params, "decoder.conv_norm_out", x, groups, NORM_EPS)
        with scope("decoder.conv_act"):
            x = silu(x)
        x = conv2d(params, "decoder.conv_out", x)
    return x.transpose(0, 3, 1, 2)
