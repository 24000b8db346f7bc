"""The JAX SD 1.5 networks and DDIM against diffusers/transformers in PyTorch (CPU, float32).

The oracle is the tiny random pipeline of `tests/conftest.py`; weights are read straight from the
saved safetensors (the real loader, `sd15/weights.py`, has its own tests). Tolerance: 1e-4 of the
output's scale (max |ours - torch| / max |torch|) for the networks, 1e-5 for a DDIM step.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from sd15 import clip, ddim, unet, vae  # noqa: E402
from sd15.config import CLIPConfig, UNetConfig, VAEConfig  # noqa: E402

MODEL_TOLERANCE = 1e-4
DDIM_TOLERANCE = 1e-5


def load_component(folder, config_class, weights_file):
    """(flat params, config) from a saved component folder; CLIP keys get their `text_model.` prefix."""
    from safetensors.numpy import load_file

    config = config_class.from_dict(json.loads((folder / "config.json").read_text()))
    weights = load_file(folder / weights_file)
    if config_class is CLIPConfig:
        weights = {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in weights.items()}
    if config_class is VAEConfig:
        weights = {k: v for k, v in weights.items() if k.startswith(("post_quant_conv.", "decoder."))}
    return {k: jnp.asarray(v) for k, v in weights.items()}, config


def relative_error(ours, reference) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert ours.shape == reference.shape
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def unet_params(tiny_sd15):
    return load_component(tiny_sd15.root / "unet", UNetConfig, "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def vae_params(tiny_sd15):
    return load_component(tiny_sd15.root / "vae", VAEConfig, "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def clip_params(tiny_sd15):
    return load_component(tiny_sd15.root / "text_encoder", CLIPConfig, "model.safetensors")


def test_saved_configs_are_the_tiny_configs(unet_params, vae_params, clip_params):
    assert unet_params[1] == UNetConfig.tiny()
    assert vae_params[1] == VAEConfig.tiny()
    assert clip_params[1] == CLIPConfig.tiny()


@pytest.mark.parametrize("timestep", [np.array([3, 981]), 500], ids=["per-sample", "scalar"])
def test_unet_matches_diffusers(tiny_sd15, unet_params, timestep):
    params, config = unet_params
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 16), np.float32)  # non-square: catches H/W mix-ups
    context = rng.standard_normal((2, 77, config.cross_attention_dim), np.float32)
    with torch.no_grad():
        reference = tiny_sd15.unet(torch.from_numpy(sample), torch.tensor(timestep), torch.from_numpy(context)).sample
    ours = jax.jit(unet.apply, static_argnums=1)(params, config, sample, timestep, context)
    assert ours.shape == (2, 4, 8, 16)
    error = relative_error(ours, reference.numpy())
    print(f"unet relative error {error:.2e}")
    assert error < MODEL_TOLERANCE


def test_vae_decoder_matches_diffusers(tiny_sd15, vae_params):
    params, config = vae_params
    latents = np.random.default_rng(1).standard_normal((2, 4, 8, 12), np.float32)
    with torch.no_grad():
        reference = tiny_sd15.vae.decode(torch.from_numpy(latents)).sample
    ours = jax.jit(vae.decode, static_argnums=1)(params, config, latents)
    assert ours.shape == (2, 3, 16, 24)
    error = relative_error(ours, reference.numpy())
    print(f"vae relative error {error:.2e}")
    assert error < MODEL_TOLERANCE


@pytest.mark.parametrize("length", [77, 9])
def test_text_encoder_matches_transformers(tiny_sd15, clip_params, length):
    params, config = clip_params
    input_ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, length)).astype(np.int32)
    with torch.no_grad():
        reference = tiny_sd15.text_encoder(torch.from_numpy(input_ids).long()).last_hidden_state
    ours = jax.jit(clip.apply, static_argnums=1)(params, config, input_ids)
    assert ours.shape == (2, length, config.hidden_size)
    error = relative_error(ours, reference.numpy())
    print(f"text encoder relative error {error:.2e}")
    assert error < MODEL_TOLERANCE


def torch_params(model, prefix: str = "") -> dict[str, jax.Array]:
    return {prefix + k: jnp.asarray(v.numpy()) for k, v in model.state_dict().items() if "position_ids" not in k}


def test_unet_linear_projection_matches_diffusers():
    """The SD 2.x variant: proj_in/proj_out as Linear layers; also a single int head count."""
    config = dataclasses.replace(UNetConfig.tiny(), use_linear_projection=True, attention_head_dim=4)
    torch.manual_seed(1)
    model = diffusers.UNet2DConditionModel(
        sample_size=8,
        down_block_types=config.down_block_types,
        up_block_types=config.up_block_types,
        block_out_channels=config.block_out_channels,
        layers_per_block=config.layers_per_block,
        attention_head_dim=config.attention_head_dim,
        cross_attention_dim=config.cross_attention_dim,
        norm_num_groups=config.norm_num_groups,
        use_linear_projection=True,
    ).eval()
    rng = np.random.default_rng(4)
    sample = rng.standard_normal((1, 4, 8, 8), np.float32)
    context = rng.standard_normal((1, 7, config.cross_attention_dim), np.float32)
    with torch.no_grad():
        reference = model(torch.from_numpy(sample), 321, torch.from_numpy(context)).sample.numpy()
    ours = jax.jit(unet.apply, static_argnums=1)(torch_params(model), config, sample, 321, context)
    assert relative_error(ours, reference) < MODEL_TOLERANCE


def test_text_encoder_exact_gelu_matches_transformers():
    """The SD 2.x variant of the text encoder uses exact GELU instead of quick GELU."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = dataclasses.replace(CLIPConfig.tiny(), vocab_size=1000, hidden_act="gelu")
    torch.manual_seed(2)
    model = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=1000,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            hidden_act="gelu",
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        )
    ).eval()
    input_ids = np.random.default_rng(5).integers(0, 1000, (1, 77)).astype(np.int32)
    with torch.no_grad():
        reference = model(torch.from_numpy(input_ids).long()).last_hidden_state.numpy()
    params = torch_params(model, prefix="text_model.")
    assert relative_error(clip.apply(params, config, input_ids), reference) < MODEL_TOLERANCE


# --- DDIM --------------------------------------------------------------------------------------

SD15_SCHEDULER_CONFIG = {  # runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json (a PNDM one)
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}


def test_ddim_defaults_are_sd15(tiny_sd15):
    saved = ddim.DDIM.from_config(tiny_sd15.root / "scheduler")
    assert saved == ddim.DDIM.from_config(SD15_SCHEDULER_CONFIG) == ddim.DDIM()


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear"])
def test_ddim_alphas_are_bit_equal(beta_schedule):
    config = dict(SD15_SCHEDULER_CONFIG, beta_schedule=beta_schedule)
    reference = diffusers.DDIMScheduler.from_config(config)
    ours = ddim.DDIM.from_config(config)
    np.testing.assert_array_equal(ours.alphas_cumprod, reference.alphas_cumprod.numpy())
    assert ours.final_alpha_cumprod == reference.final_alpha_cumprod.item()


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("steps", [1, 7, 50, 1000])
def test_ddim_timesteps_equal_diffusers(spacing, steps):
    config = dict(SD15_SCHEDULER_CONFIG, timestep_spacing=spacing)
    reference = diffusers.DDIMScheduler.from_config(config)
    reference.set_timesteps(steps)
    ours = ddim.DDIM.from_config(config).set_timesteps(steps)
    assert ours.dtype == np.int64
    np.testing.assert_array_equal(ours, reference.timesteps.numpy())


@pytest.mark.parametrize(
    "prediction_type, eta", [("epsilon", 0.0), ("v_prediction", 0.0), ("sample", 0.0), ("epsilon", 0.7)]
)
def test_ddim_step_equals_diffusers(prediction_type, eta):
    config = dict(SD15_SCHEDULER_CONFIG, prediction_type=prediction_type)
    reference = diffusers.DDIMScheduler.from_config(config)
    ours = ddim.DDIM.from_config(config)
    timesteps = ours.set_timesteps(50)
    reference.set_timesteps(50)
    step = jax.jit(lambda out, t, x, noise: ours.step(out, t, x, eta=eta, variance_noise=noise))
    rng = np.random.default_rng(3)
    for t in timesteps[[0, 1, 25, 48, 49]]:  # 49: the last step, whose previous alpha is final_alpha_cumprod
        model_output, sample, noise = rng.standard_normal((3, 1, 4, 8, 8), np.float32)
        expected = reference.step(
            torch.from_numpy(model_output),
            int(t),
            torch.from_numpy(sample),
            eta=eta,
            variance_noise=torch.from_numpy(noise) if eta else None,
        ).prev_sample.numpy()
        got = step(model_output, jnp.int32(t), sample, noise)
        assert relative_error(got, expected) < DDIM_TOLERANCE, int(t)


# --- named scopes ------------------------------------------------------------------------------

PARAMETER_FREE_MODULES = {"time_proj", "conv_act", "decoder.conv_act"}


def scope_segments(closed_jaxpr) -> list[list[str]]:
    """Each equation's name stack, split into its scopes."""
    return [[s for s in str(eqn.source_info.name_stack).split("/") if s] for eqn in closed_jaxpr.eqns]


def check_scopes(closed_jaxpr, params, expected: set[str], unscoped_budget: int):
    stacks = scope_segments(closed_jaxpr)
    seen = {segment for stack in stacks for segment in stack}
    assert expected <= seen, expected - seen
    for segment in seen:  # every scope is a real module path: a parameter prefix or a known param-free module
        assert segment in PARAMETER_FREE_MODULES or any(k.startswith(segment + ".") for k in params), segment
    for stack in stacks:  # nested scopes extend their parent's path
        for parent, child in zip(stack, stack[1:]):
            assert child.startswith(parent + "."), stack
    assert sum(not stack for stack in stacks) <= unscoped_budget  # only boundary layout changes


def test_unet_named_scopes(unet_params):
    params, config = unet_params
    jaxpr = jax.make_jaxpr(unet.apply, static_argnums=1)(
        params, config, jnp.zeros((1, 4, 8, 8)), jnp.int32(1), jnp.zeros((1, 77, 32))
    )
    expected = {
        "conv_in",
        "time_embedding.linear_1",
        "down_blocks.0.resnets.0",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k",
        "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj",
        "down_blocks.0.downsamplers.0.conv",
        "down_blocks.1.resnets.0.conv_shortcut",
        "mid_block.resnets.0",
        "mid_block.attentions.0.proj_in",
        "up_blocks.0.resnets.1",
        "up_blocks.0.upsamplers.0.conv",
        "up_blocks.1.attentions.1.transformer_blocks.0.norm3",
        "conv_norm_out",
        "conv_out",
    }
    check_scopes(jaxpr, params, expected, unscoped_budget=4)


def test_vae_and_text_encoder_named_scopes(vae_params, clip_params):
    params, config = vae_params
    jaxpr = jax.make_jaxpr(vae.decode, static_argnums=1)(params, config, jnp.zeros((1, 4, 8, 8)))
    expected = {"post_quant_conv", "decoder.mid_block.attentions.0.to_q", "decoder.up_blocks.0.upsamplers.0.conv"}
    check_scopes(jaxpr, params, expected, unscoped_budget=3)

    params, config = clip_params
    jaxpr = jax.make_jaxpr(clip.apply, static_argnums=1)(params, config, jnp.zeros((1, 77), jnp.int32))
    expected = {"text_model.embeddings.token_embedding", "text_model.encoder.layers.1.self_attn.q_proj"}
    check_scopes(jaxpr, params, expected, unscoped_budget=0)
