"""Full-size SD 1.5 without weights: parameter names/shapes against the torch models, and tracing.

The torch models are built on the meta device from SD 1.5's own config.json files (copied below),
so nothing is allocated or downloaded.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sd15 import clip, params, unet, vae
from sd15.config import CLIPConfig, UNetConfig, VAEConfig

# runwayml/stable-diffusion-v1-5: unet/config.json, vae/config.json, text_encoder/config.json
SD15_UNET_CONFIG = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
SD15_VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SD15_TEXT_ENCODER_CONFIG = {
    "_name_or_path": "openai/clip-vit-large-patch14",
    "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "torch_dtype": "float32",
    "transformers_version": "4.22.0.dev0",
    "vocab_size": 49408,
}

PARAMETER_COUNTS = {"unet": 859_520_964, "vae": 49_490_199, "text_encoder": 123_060_480}


def _torch_config(d):
    return {k: v for k, v in d.items() if not k.startswith("_")}


def torch_shapes(component: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes (buffers excluded) of the full-size torch model, on the meta device."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if component == "unet":
            model = diffusers.UNet2DConditionModel(**_torch_config(SD15_UNET_CONFIG))
        elif component == "vae":
            model = diffusers.AutoencoderKL(**_torch_config(SD15_VAE_CONFIG))
        else:
            text_config = transformers.CLIPTextConfig(**_torch_config(SD15_TEXT_ENCODER_CONFIG))
            model = transformers.CLIPTextModel(text_config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if component == "vae":
        shapes = {k: v for k, v in shapes.items() if k.startswith(("post_quant_conv.", "decoder."))}
    if component == "text_encoder":  # transformers 5 drops the checkpoints' `text_model.` prefix
        shapes = {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in shapes.items()}
    return shapes


def test_sd15_configs_parse_to_the_defaults():
    assert UNetConfig.from_dict(SD15_UNET_CONFIG) == UNetConfig()
    assert VAEConfig.from_dict(SD15_VAE_CONFIG) == VAEConfig()
    assert CLIPConfig.from_dict(SD15_TEXT_ENCODER_CONFIG) == CLIPConfig()


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="class_embed_type"):
        UNetConfig.from_dict(dict(SD15_UNET_CONFIG, class_embed_type="timestep"))
    with pytest.raises(ValueError, match="down_block_types"):
        UNetConfig.from_dict(dict(SD15_UNET_CONFIG, down_block_types=["SimpleCrossAttnDownBlock2D"] * 4))
    with pytest.raises(ValueError, match="use_post_quant_conv"):
        VAEConfig.from_dict(dict(SD15_VAE_CONFIG, use_post_quant_conv=False))


@pytest.mark.parametrize("component", ["unet", "vae", "text_encoder"])
def test_abstract_params_match_torch(component):
    expected = torch_shapes(component)
    ours = params.abstract_params(component)
    assert set(ours) == set(expected), (set(ours) ^ set(expected))
    assert {k: v.shape for k, v in ours.items()} == expected
    assert all(v.dtype == jnp.float32 for v in ours.values())
    assert sum(math.prod(shape) for shape in expected.values()) == PARAMETER_COUNTS[component]
    assert sum(math.prod(v.shape) for v in ours.values()) == PARAMETER_COUNTS[component]


@pytest.mark.parametrize(
    "component, config", [("unet", UNetConfig.tiny()), ("vae", VAEConfig.tiny()), ("text_encoder", CLIPConfig.tiny())]
)
def test_init_random_has_the_declared_shapes(component, config):
    weights = params.init_random(component, config, seed=0, dtype=jnp.bfloat16)
    shapes = params.param_shapes(component, config)
    assert {k: v.shape for k, v in weights.items()} == shapes
    assert all(v.dtype == jnp.bfloat16 for v in weights.values())
    again = params.init_random(component, config, seed=0, dtype=jnp.bfloat16)
    assert all(np.array_equal(weights[k], again[k]) for k in weights)


def test_random_tiny_pipeline_is_finite():
    """What `sd15 generate --tiny` runs: random weights through text encoder, UNet and VAE decoder."""
    text_config, unet_config, vae_config = CLIPConfig.tiny(), UNetConfig.tiny(), VAEConfig.tiny()
    ids = jnp.array([[49406, 320, 2368, 49407] + [49407] * 73])
    context = clip.apply(params.init_random("text_encoder", text_config, seed=0), text_config, ids)
    latents = jax.random.normal(jax.random.key(0), (1, 4, 8, 8))
    noise = jax.jit(unet.apply, static_argnums=1)(
        params.init_random("unet", unet_config, seed=0), unet_config, latents, 981, context
    )
    image = jax.jit(vae.decode, static_argnums=1)(
        params.init_random("vae", vae_config, seed=0), vae_config, noise / vae_config.scaling_factor
    )
    assert image.shape == (1, 3, 16, 16)
    assert bool(jnp.isfinite(image).all())


def test_full_size_traces_without_weights():
    struct = jax.ShapeDtypeStruct
    unet_params = params.abstract_params("unet")
    args = (struct((2, 4, 64, 64), jnp.float32), struct((), jnp.int32), struct((2, 77, 768), jnp.float32))
    out = jax.eval_shape(lambda p, *a: unet.apply(p, UNetConfig(), *a), unet_params, *args)
    assert (out.shape, out.dtype) == ((2, 4, 64, 64), jnp.float32)

    # The optimizer lifts this jaxpr: keep it at one primitive per obvious op.
    jaxpr = jax.make_jaxpr(lambda p, *a: unet.apply(p, UNetConfig(), *a))(
        unet_params, struct((1, 4, 64, 64), jnp.float32), struct((), jnp.int32), struct((1, 77, 768), jnp.float32)
    )
    assert 2_500 <= len(jaxpr.eqns) <= 4_500, len(jaxpr.eqns)
    assert sum(eqn.primitive.name == "conv_general_dilated" for eqn in jaxpr.eqns) == 98
    assert not any(eqn.primitive.name in ("pjit", "jit", "custom_jvp_call", "custom_vjp_call") for eqn in jaxpr.eqns)

    out = jax.eval_shape(lambda p, z: vae.decode(p, VAEConfig(), z), params.abstract_params("vae"), args[0])
    assert out.shape == (2, 3, 512, 512)

    ids = struct((2, 77), jnp.int32)
    out = jax.eval_shape(lambda p, i: clip.apply(p, CLIPConfig(), i), params.abstract_params("text_encoder"), ids)
    assert out.shape == (2, 77, 768)


def test_half_precision_params_run_in_half_precision():
    struct = jax.ShapeDtypeStruct
    unet_params = params.abstract_params("unet", UNetConfig.tiny(), dtype=jnp.bfloat16)
    out = jax.eval_shape(
        lambda p, *a: unet.apply(p, UNetConfig.tiny(), *a),
        unet_params,
        struct((1, 4, 8, 8), jnp.float32),
        struct((1,), jnp.int32),
        struct((1, 77, 32), jnp.float32),
    )
    assert out.dtype == jnp.bfloat16
