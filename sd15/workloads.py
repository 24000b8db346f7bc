"""SD 1.5's components as abstract workloads: each network as the pipeline runs it, traced with
abstract parameters (`sd15.params.abstract_params`, no weights); what `sd15 plan` measures.

- unet: one denoising step as `sd15.pipeline` runs it: the UNet on the classifier-free-guidance
  batch `[latents, latents]` (`batch` counts this doubled batch, so 2 is one image), the guidance
  combine `uncond + scale * (cond - uncond)` and the DDIM update (float32 latents);
- vae: the decoder on `batch / 2` latents (scaled by 1 / scaling_factor, as the pipeline does);
- text_encoder: CLIP on `batch` prompts of 77 tokens (the unconditional and the conditional one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from measure.compare import Workload
from sd15 import clip, params, unet, vae
from sd15.config import CLIPConfig, UNetConfig, VAEConfig
from sd15.ddim import DDIM

COMPONENTS = ("unet", "vae", "text_encoder")
TEXT_LENGTH = 77
INFERENCE_STEPS = 50

COMPONENT_TITLES = {"unet": "UNet CFG step", "vae": "VAE decode", "text_encoder": "text encoder"}


# --- the traced functions (module level, so they pickle by reference into the compile subprocess)


def unet_cfg_step(unet_params, latents, timestep, context, guidance_scale, *, config: UNetConfig, ddim: DDIM):
    """One denoising step as `sd15.pipeline.Pipeline` runs it: float32 latents [n, 4, h, w], context
    [2n, 77, d] (unconditional prompts first), a traced guidance scale -> the next latents."""
    sample = jnp.concatenate([latents, latents], axis=0)
    noise = unet.apply(unet_params, config, sample, timestep, context).astype(jnp.float32)
    uncond, cond = jnp.split(noise, 2, axis=0)
    guided = uncond + guidance_scale * (cond - uncond)
    return ddim.step(guided, timestep, latents)


def vae_decode(vae_params, latents, *, config: VAEConfig):
    """The pipeline's latents -> image decode (latents divided by the VAE's scaling factor first)."""
    return vae.decode(vae_params, config, latents * (1.0 / config.scaling_factor))


def text_encode(text_params, input_ids, *, config: CLIPConfig):
    return clip.apply(text_params, config, input_ids)


def workloads(
    batch: int = 2, size: int | None = None, dtype="float16", config: str = "full", components=COMPONENTS
) -> dict[str, Workload]:
    """The abstract workloads of `components` ("full" SD 1.5 or the test-sized "tiny" config).

    `batch` is the UNet's classifier-free-guidance batch (even); `size` the image side in pixels
    (default: the VAE config's sample_size, 512 for SD 1.5).
    """
    if batch < 2 or batch % 2:
        raise ValueError(f"--batch {batch}: the UNet's guidance batch is [uncond, cond] per image, so it must be even")
    dtype = jnp.dtype(dtype)
    if config == "full":
        unet_config, vae_config, clip_config = UNetConfig(), VAEConfig(), CLIPConfig()
    elif config == "tiny":
        unet_config, vae_config, clip_config = UNetConfig.tiny(), VAEConfig.tiny(), CLIPConfig.tiny()
    else:
        raise ValueError(f"unknown config {config!r} (full or tiny)")
    size = vae_config.sample_size if size is None else size
    factor = 2 ** (len(vae_config.block_out_channels) - 1)
    if size % factor:
        raise ValueError(f"--size {size} must be a multiple of the VAE's {factor}x upsampling")
    latent = size // factor
    images = batch // 2
    ddim = DDIM()
    ddim.set_timesteps(INFERENCE_STEPS)

    def spec(shape, kind=dtype):
        return jax.ShapeDtypeStruct(tuple(shape), kind)

    out = {}
    for name in components:
        if name == "unet":
            out[name] = Workload(
                name,
                f"UNet step, CFG batch {batch}, {latent}x{latent} latents, {dtype.name}",
                functools.partial(unet_cfg_step, config=unet_config, ddim=ddim),
                (
                    params.abstract_params("unet", unet_config, dtype=dtype),
                    spec((images, unet_config.in_channels, latent, latent), jnp.float32),
                    spec((), jnp.int32),
                    spec((batch, TEXT_LENGTH, unet_config.cross_attention_dim)),
                    spec((), jnp.float32),
                ),
            )
        elif name == "vae":
            out[name] = Workload(
                name,
                f"VAE decoder, batch {images}, {latent}x{latent} -> {size}x{size}, {dtype.name}",
                functools.partial(vae_decode, config=vae_config),
                (
                    params.abstract_params("vae", vae_config, dtype=dtype),
                    spec((images, vae_config.latent_channels, latent, latent)),
                ),
            )
        elif name == "text_encoder":
            out[name] = Workload(
                name,
                f"CLIP text encoder, batch {batch} x {TEXT_LENGTH} tokens, {dtype.name}",
                functools.partial(text_encode, config=clip_config),
                (
                    params.abstract_params("text_encoder", clip_config, dtype=dtype),
                    spec((batch, TEXT_LENGTH), jnp.int32),
                ),
            )
        else:
            raise ValueError(f"unknown component {name!r}; expected some of {', '.join(COMPONENTS)}")
    return out
