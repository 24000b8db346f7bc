"""Parameter names and shapes of the three SD 1.5 networks, without weights.

    param_shapes("unet", UNetConfig())   -> {"conv_in.weight": (320, 4, 3, 3), ...}   (686 keys)
    abstract_params("unet")              -> the same as jax.ShapeDtypeStructs (trace with no weights)
    init_random("unet", config, seed=0)  -> random weights of those shapes

The names and PyTorch layouts are diffusers'/transformers' own (checked against the torch models in
tests/test_sd15_abstract_params.py); the VAE covers `post_quant_conv.*` and `decoder.*` only, the text
encoder uses the `text_model.*` names of SD 1.5 checkpoints.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from sd15.config import CROSS_ATTN_DOWN, CROSS_ATTN_UP, CLIPConfig, UNetConfig, VAEConfig

Component = Literal["unet", "vae", "text_encoder"]
Shapes = dict[str, tuple[int, ...]]

DEFAULT_CONFIGS = {"unet": UNetConfig, "vae": VAEConfig, "text_encoder": CLIPConfig}


class _ShapeTable:
    """Collects {key: shape} in module order; one method per torch layer type."""

    def __init__(self):
        self.shapes: Shapes = {}

    def linear(self, path: str, fan_in: int, fan_out: int, bias: bool = True):
        self.shapes[f"{path}.weight"] = (fan_out, fan_in)
        if bias:
            self.shapes[f"{path}.bias"] = (fan_out,)

    def conv(self, path: str, fan_in: int, fan_out: int, kernel: int):
        self.shapes[f"{path}.weight"] = (fan_out, fan_in, kernel, kernel)
        self.shapes[f"{path}.bias"] = (fan_out,)

    def norm(self, path: str, channels: int):
        self.shapes[f"{path}.weight"] = (channels,)
        self.shapes[f"{path}.bias"] = (channels,)

    def resnet(self, path: str, fan_in: int, fan_out: int, temb: int | None):
        self.norm(f"{path}.norm1", fan_in)
        self.conv(f"{path}.conv1", fan_in, fan_out, 3)
        if temb is not None:
            self.linear(f"{path}.time_emb_proj", temb, fan_out)
        self.norm(f"{path}.norm2", fan_out)
        self.conv(f"{path}.conv2", fan_out, fan_out, 3)
        if fan_in != fan_out:
            self.conv(f"{path}.conv_shortcut", fan_in, fan_out, 1)

    def transformer_2d(self, path: str, channels: int, context: int, linear_projection: bool):
        self.norm(f"{path}.norm", channels)
        projection = self.linear if linear_projection else lambda p, i, o: self.conv(p, i, o, 1)
        projection(f"{path}.proj_in", channels, channels)
        self.transformer_block(f"{path}.transformer_blocks.0", channels, context)
        projection(f"{path}.proj_out", channels, channels)

    def transformer_block(self, block: str, channels: int, context: int):
        for attn, kv in (("attn1", channels), ("attn2", context)):
            self.linear(f"{block}.{attn}.to_q", channels, channels, bias=False)
            self.linear(f"{block}.{attn}.to_k", kv, channels, bias=False)
            self.linear(f"{block}.{attn}.to_v", kv, channels, bias=False)
            self.linear(f"{block}.{attn}.to_out.0", channels, channels)
        for norm in ("norm1", "norm2", "norm3"):
            self.norm(f"{block}.{norm}", channels)
        self.linear(f"{block}.ff.net.0.proj", channels, 8 * channels)
        self.linear(f"{block}.ff.net.2", 4 * channels, channels)


def _unet(c: UNetConfig) -> Shapes:
    table = _ShapeTable()
    channels, temb = c.block_out_channels, c.time_embed_dim
    last = len(channels) - 1
    table.conv("conv_in", c.in_channels, channels[0], 3)
    table.linear("time_embedding.linear_1", channels[0], temb)
    table.linear("time_embedding.linear_2", temb, temb)

    skip_channels = [channels[0]]
    fan_in = channels[0]
    for i, block_type in enumerate(c.down_block_types):
        for j in range(c.layers_per_block):
            table.resnet(f"down_blocks.{i}.resnets.{j}", fan_in, channels[i], temb)
            fan_in = channels[i]
            if block_type == CROSS_ATTN_DOWN:
                table.transformer_2d(
                    f"down_blocks.{i}.attentions.{j}", channels[i], c.cross_attention_dim, c.use_linear_projection
                )
            skip_channels.append(fan_in)
        if i != last:
            table.conv(f"down_blocks.{i}.downsamplers.0.conv", fan_in, fan_in, 3)
            skip_channels.append(fan_in)

    table.resnet("mid_block.resnets.0", fan_in, fan_in, temb)
    table.transformer_2d("mid_block.attentions.0", fan_in, c.cross_attention_dim, c.use_linear_projection)
    table.resnet("mid_block.resnets.1", fan_in, fan_in, temb)

    for i, block_type in enumerate(c.up_block_types):
        out = channels[last - i]
        for j in range(c.layers_per_block + 1):
            table.resnet(f"up_blocks.{i}.resnets.{j}", fan_in + skip_channels.pop(), out, temb)
            fan_in = out
            if block_type == CROSS_ATTN_UP:
                table.transformer_2d(
                    f"up_blocks.{i}.attentions.{j}", out, c.cross_attention_dim, c.use_linear_projection
                )
        if i != last:
            table.conv(f"up_blocks.{i}.upsamplers.0.conv", out, out, 3)

    table.norm("conv_norm_out", channels[0])
    table.conv("conv_out", channels[0], c.out_channels, 3)
    return table.shapes


def _vae_decoder(c: VAEConfig) -> Shapes:
    table = _ShapeTable()
    channels = tuple(reversed(c.block_out_channels))
    table.conv("post_quant_conv", c.latent_channels, c.latent_channels, 1)
    table.conv("decoder.conv_in", c.latent_channels, channels[0], 3)
    table.resnet("decoder.mid_block.resnets.0", channels[0], channels[0], None)
    attn = "decoder.mid_block.attentions.0"
    table.norm(f"{attn}.group_norm", channels[0])
    for name in ("to_q", "to_k", "to_v", "to_out.0"):
        table.linear(f"{attn}.{name}", channels[0], channels[0])
    table.resnet("decoder.mid_block.resnets.1", channels[0], channels[0], None)
    fan_in = channels[0]
    for i, out in enumerate(channels):
        for j in range(c.layers_per_block + 1):
            table.resnet(f"decoder.up_blocks.{i}.resnets.{j}", fan_in, out, None)
            fan_in = out
        if i != len(channels) - 1:
            table.conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", out, out, 3)
    table.norm("decoder.conv_norm_out", fan_in)
    table.conv("decoder.conv_out", fan_in, c.out_channels, 3)
    return table.shapes


def _text_encoder(c: CLIPConfig) -> Shapes:
    table = _ShapeTable()
    d = c.hidden_size
    table.shapes["text_model.embeddings.token_embedding.weight"] = (c.vocab_size, d)
    table.shapes["text_model.embeddings.position_embedding.weight"] = (c.max_position_embeddings, d)
    for i in range(c.num_hidden_layers):
        layer = f"text_model.encoder.layers.{i}"
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            table.linear(f"{layer}.self_attn.{name}", d, d)
        table.norm(f"{layer}.layer_norm1", d)
        table.linear(f"{layer}.mlp.fc1", d, c.intermediate_size)
        table.linear(f"{layer}.mlp.fc2", c.intermediate_size, d)
        table.norm(f"{layer}.layer_norm2", d)
    table.norm("text_model.final_layer_norm", d)
    return table.shapes


_SHAPES = {"unet": _unet, "vae": _vae_decoder, "text_encoder": _text_encoder}


def param_shapes(component: Component, config: UNetConfig | VAEConfig | CLIPConfig | None = None) -> Shapes:
    """{key: shape} of `component` ("unet", "vae" decoder, "text_encoder"); full-size SD 1.5 by default."""
    if component not in _SHAPES:
        raise ValueError(f"unknown {component=}; expected one of {sorted(_SHAPES)}")
    if config is None:
        config = DEFAULT_CONFIGS[component]()
    if not isinstance(config, DEFAULT_CONFIGS[component]):
        raise TypeError(f"{component} needs a {DEFAULT_CONFIGS[component].__name__}, got {type(config).__name__}")
    return _SHAPES[component](config)


def transformer_block_shapes(block: str, channels: int, context: int) -> Shapes:
    """The parameter shapes of one BasicTransformerBlock (`sd15.unet.transformer_block`) under the key
    prefix `block`: self- and cross-attention (keys and values of width `context`), three norms, GEGLU."""
    table = _ShapeTable()
    table.transformer_block(block, channels, context)
    return table.shapes


def abstract_params(
    component: Component, config: UNetConfig | VAEConfig | CLIPConfig | None = None, dtype=jnp.float32
) -> dict[str, jax.ShapeDtypeStruct]:
    """The parameter dict of `component` as `jax.ShapeDtypeStruct`s, for tracing without weights."""
    return {key: jax.ShapeDtypeStruct(shape, dtype) for key, shape in param_shapes(component, config).items()}


def init_random(
    component: Component, config: UNetConfig | VAEConfig | CLIPConfig | None = None, seed: int = 0, dtype=jnp.float32
) -> dict[str, jax.Array]:
    """Random weights: N(0, 1/fan_in) matrices, N(0, 0.02) embeddings, unit norm scales, zero biases.

    Deterministic in `seed` and the key name (the same key gets the same values in any config order).
    """
    params = {}
    for key, shape in param_shapes(component, config).items():
        if len(shape) == 1:
            params[key] = jnp.ones(shape, dtype) if key.endswith(".weight") else jnp.zeros(shape, dtype)
            continue
        rng = np.random.default_rng([seed, _stable_hash(key)])
        fan_in = math.prod(shape[1:])
        scale = 0.02 if key.endswith("_embedding.weight") else fan_in**-0.5
        params[key] = jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
    return params


def _stable_hash(text: str) -> int:
    """A 31-bit FNV-1a hash of `text` (Python's `hash` is salted per process)."""
    h = 0x811C9DC5
    for byte in text.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h & 0x7FFFFFFF
