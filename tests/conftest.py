"""Shared test fixtures: a tiny random Stable Diffusion 1.5 pipeline, as diffusers saves one.

`tiny_sd15` (session-scoped) builds, seeded with `torch.manual_seed(0)`:

    root/                                  (a tmp_path_factory folder, shared by the whole session)
      model_index.json                     StableDiffusionPipeline layout (no tokenizer, no safety checker)
      unet/config.json, unet/diffusion_pytorch_model.safetensors        UNet2DConditionModel
      vae/config.json, vae/diffusion_pytorch_model.safetensors          AutoencoderKL (encoder too)
      text_encoder/config.json, text_encoder/model.safetensors          transformers CLIPTextModel
      scheduler/scheduler_config.json      DDIMScheduler with SD 1.5's values

and returns a `TinySD15` holding `root` and the torch models (float32, eval mode) as the oracle.
Each component's config equals `UNetConfig.tiny()`, `VAEConfig.tiny()`, `CLIPConfig.tiny()`:
UNet (32, 64) channels with CrossAttnDownBlock2D + DownBlock2D / UpBlock2D + CrossAttnUpBlock2D,
heads (2, 4), cross_attention_dim 32, 8 groups, 8x8 latents; VAE (32, 64) channels, 8 groups,
8x8 latents -> 16x16 images; CLIP hidden 32, 2 layers, 4 heads, the full 49,408-token vocabulary.
Every 1-D parameter (biases, norm scales and shifts, which torch initializes to 0 or 1) is
randomized, so a comparison against these models catches a missing bias or a swapped norm.

Files are written by each library's own `save_pretrained(..., safe_serialization=True)`. Note that
transformers 5 writes the CLIP text encoder's keys WITHOUT the `text_model.` prefix that SD 1.5
checkpoints on the Hub carry (`embeddings.token_embedding.weight`, not
`text_model.embeddings.token_embedding.weight`): a loader must accept both.

Every test session also runs JAX's float32 matmuls and convolutions at "highest" precision, so
comparisons against torch measure the model code, not TF32/bf16 passes.

The plan cache (`driver.cache`) never touches `~/.cache` from tests: `EQSAT_CACHE_DIR` points at a
temporary folder for the session (what session fixtures and subprocesses see) and at a fresh one
for each test (`fresh_plan_cache`), so no test sees another's plans, except in a file that opts into
`module_plan_cache` (one folder per file: the same programs planned once across backends). `EQSAT_AUTO_CHOICE=plan`:
`backend="auto"` runs the plan on a CPU instead of timing it against `jax.jit` (`driver.auto_choice`).
`EQSAT_JAX_CACHE=0`: JAX's persistent compilation cache stays off unless a test turns it on.
"""

from __future__ import annotations

import os

# Tests run on the CPU backend; an installed CUDA plugin (the H100 compile target) stays quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile

os.environ["EQSAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqsat-test-cache-")
# backend="auto" runs the plan on a CPU, untimed: a test of the plan never runs jax.jit instead
# (tests/test_auto_choice.py turns the timed choice back on; EQSAT_AUTO_CHOICE=timed runs a suite with it).
os.environ.setdefault("EQSAT_AUTO_CHOICE", "plan")
# JAX's persistent compilation cache, which eqsat turns on for cached plans (`driver.cache`), is a
# process-wide setting: left off for the suite, so no test's compiles land in another test's temporary
# cache folder (tests/test_export_cache.py turns it on where it tests it).
os.environ.setdefault("EQSAT_JAX_CACHE", "0")

import eqsat  # noqa: F401  before jax: no CUDA plugin noise on a machine without a GPU (eqsat.quiet_cuda)

import dataclasses
import json
from pathlib import Path

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@dataclasses.dataclass(frozen=True)
class TinySD15:
    """The saved folder and the torch models it was saved from."""

    root: Path
    unet: object  # diffusers.UNet2DConditionModel
    vae: object  # diffusers.AutoencoderKL
    text_encoder: object  # transformers.CLIPTextModel
    scheduler: object  # diffusers.DDIMScheduler


def _randomize_vectors(model, generator) -> None:
    """Give every 1-D parameter (bias, norm weight/bias) random values instead of torch's 0/1."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim != 1:
                continue
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(".weight"):  # a norm scale: around 1
                parameter.copy_(1.0 + 0.2 * noise)
            else:
                parameter.copy_(0.1 * noise)


def build_tiny_sd15(root: Path) -> TinySD15:
    """Build, randomize and save the tiny pipeline under `root` (see the module docstring)."""
    import diffusers
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    from sd15.config import CLIPConfig, UNetConfig, VAEConfig

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)

    unet_config = UNetConfig.tiny()
    unet = diffusers.UNet2DConditionModel(
        sample_size=unet_config.sample_size,
        in_channels=unet_config.in_channels,
        out_channels=unet_config.out_channels,
        down_block_types=unet_config.down_block_types,
        up_block_types=unet_config.up_block_types,
        block_out_channels=unet_config.block_out_channels,
        layers_per_block=unet_config.layers_per_block,
        attention_head_dim=unet_config.attention_head_dim,
        cross_attention_dim=unet_config.cross_attention_dim,
        norm_num_groups=unet_config.norm_num_groups,
    )

    vae_config = VAEConfig.tiny()
    levels = len(vae_config.block_out_channels)
    vae = diffusers.AutoencoderKL(
        in_channels=vae_config.out_channels,
        out_channels=vae_config.out_channels,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=vae_config.block_out_channels,
        layers_per_block=vae_config.layers_per_block,
        latent_channels=vae_config.latent_channels,
        norm_num_groups=vae_config.norm_num_groups,
        sample_size=vae_config.sample_size,
    )

    clip_config = CLIPConfig.tiny()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=clip_config.vocab_size,
            hidden_size=clip_config.hidden_size,
            intermediate_size=clip_config.intermediate_size,
            num_hidden_layers=clip_config.num_hidden_layers,
            num_attention_heads=clip_config.num_attention_heads,
            max_position_embeddings=clip_config.max_position_embeddings,
            hidden_act=clip_config.hidden_act,
            layer_norm_eps=clip_config.layer_norm_eps,
            bos_token_id=clip_config.bos_token_id,
            eos_token_id=clip_config.eos_token_id,
            pad_token_id=clip_config.pad_token_id,
        )
    )

    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )

    for name, model in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder)):
        _randomize_vectors(model, generator)
        model.eval()
        model.save_pretrained(root / name, safe_serialization=True)
    scheduler.save_pretrained(root / "scheduler")
    model_index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(model_index, indent=2))
    return TinySD15(root=root, unet=unet, vae=vae, text_encoder=text_encoder, scheduler=scheduler)


@pytest.fixture(autouse=True)
def fresh_plan_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test plans into its own empty plan cache folder (see the module docstring)."""
    folder = tmp_path_factory.mktemp("plan_cache")
    monkeypatch.setenv("EQSAT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def _module_plan_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("module_plan_cache")


@pytest.fixture
def module_plan_cache(_module_plan_folder, monkeypatch) -> Path:
    """One plan cache for a whole test file, instead of `fresh_plan_cache`'s one per test; a file opts
    in with `pytestmark = pytest.mark.usefixtures("module_plan_cache")` where its tests plan the same
    function at the same shapes on several backends (the plan key holds no backend): the first test
    that meets a program plans it, the others emit that plan from the cache. What a cache hit keeps
    or skips is tests/test_cache.py's."""
    monkeypatch.setenv("EQSAT_CACHE_DIR", str(_module_plan_folder))
    return _module_plan_folder


@pytest.fixture(scope="session")
def tiny_sd15(tmp_path_factory) -> TinySD15:
    """A tiny random SD 1.5 pipeline folder plus its torch models (see the module docstring)."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    return build_tiny_sd15(tmp_path_factory.mktemp("tiny_sd15"))


@pytest.fixture(scope="session")
def tiny_sd15_dir(tiny_sd15) -> Path:
    """Just the folder of `tiny_sd15`."""
    return tiny_sd15.root


@pytest.fixture
def no_cuda_target(monkeypatch, tmp_path):
    """No CUDA plugin in the environment, an empty target dir, and no package index to install it from."""
    from measure import cuda_target

    def offline(quiet=False):
        raise cuda_target.TargetInstallError("pip could not install jax-cuda12-plugin: no index reachable")

    monkeypatch.setenv("EQSAT_TARGET_DIR", str(tmp_path / "cuda-target"))
    monkeypatch.setattr(cuda_target, "plugin_in_environment", lambda: False)
    monkeypatch.setattr(cuda_target, "install", offline)
