"""transformers `CLIPTextModel` (SD 1.5's text encoder) as a pure function.

    apply(params, config, input_ids [B, S<=77]) -> last_hidden_state [B, S, hidden_size]

Keys are the `text_model.*` names of SD 1.5 checkpoints. Dataflow: token + position embeddings ->
encoder.layers.i (pre-LayerNorm causal self-attention, pre-LayerNorm MLP with quick GELU, both
residual) -> final_layer_norm. No padding mask: SD 1.5 attends to padding tokens causally.
"""

from __future__ import annotations

import jax
from jax import lax
import numpy as np

from sd15.config import CLIPConfig
from sd15.layers import Params, attention, gelu, layer_norm, linear, quick_gelu, scope

PREFIX = "text_model"


def causal_bias(length: int) -> np.ndarray:
    """[1, 1, S, S] additive mask: 0 on and below the diagonal, float32 min above it."""
    return np.triu(np.full((length, length), np.finfo(np.float32).min, np.float32), k=1)[None, None]


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] as one gather (out-of-range ids clamp); [V, D], [B, S] -> [B, S, D]."""
    dimensions = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return lax.gather(
        table, ids[..., None], dimensions, slice_sizes=(1, table.shape[1]), mode=lax.GatherScatterMode.CLIP
    )


def encoder_layer(params: Params, config: CLIPConfig, path: str, x: jax.Array) -> jax.Array:
    """transformers `CLIPEncoderLayer`."""
    eps = config.layer_norm_eps
    activation = quick_gelu if config.hidden_act == "quick_gelu" else gelu
    with scope(path):
        h = layer_norm(params, f"{path}.layer_norm1", x, eps)
        with scope(f"{path}.self_attn"):
            q = linear(params, f"{path}.self_attn.q_proj", h)
            k = linear(params, f"{path}.self_attn.k_proj", h)
            v = linear(params, f"{path}.self_attn.v_proj", h)
            h = attention(q, k, v, config.num_attention_heads, bias=causal_bias(x.shape[1]))
            h = linear(params, f"{path}.self_attn.out_proj", h)
        x = x + h
        h = layer_norm(params, f"{path}.layer_norm2", x, eps)
        with scope(f"{path}.mlp"):
            h = linear(params, f"{path}.mlp.fc2", activation(linear(params, f"{path}.mlp.fc1", h)))
        return x + h


def apply(params: Params, config: CLIPConfig, input_ids: jax.Array) -> jax.Array:
    """`CLIPTextModel(input_ids).last_hidden_state`; runs in the dtype of the parameters."""
    length = input_ids.shape[1]
    if length > config.max_position_embeddings:
        raise ValueError(f"{length=} exceeds {config.max_position_embeddings=}")
    with scope(PREFIX):
        path = f"{PREFIX}.embeddings"
        with scope(path):
            with scope(f"{path}.token_embedding"):
                x = embedding_lookup(params[f"{path}.token_embedding.weight"], input_ids)
            with scope(f"{path}.position_embedding"):
                positions = params[f"{path}.position_embedding.weight"]
                if length != positions.shape[0]:
                    positions = positions[:length]
                x = x + positions[None]
        with scope(f"{PREFIX}.encoder"):
            for i in range(config.num_hidden_layers):
                x = encoder_layer(params, config, f"{PREFIX}.encoder.layers.{i}", x)
        return layer_norm(params, f"{PREFIX}.final_layer_norm", x, config.layer_norm_eps)
