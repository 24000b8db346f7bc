"""Stable Diffusion 1.5 in plain JAX: the networks, their weights, and the text-to-image pipeline.

    import sd15
    pipe = sd15.Pipeline.from_pretrained("stable-diffusion-v1-5")      # folder or single .safetensors
    pipe("a photo of a cat").save("cat.png")

    unet = sd15.load_unet("stable-diffusion-v1-5")                      # also load_vae, load_text_encoder
    unet(sample, timestep, encoder_hidden_states)                        # diffusers' layouts (NCHW)
    sd15.abstract_params("unet")                                         # shapes only, for tracing

Modules: `config`, `params`, `layers`, `clip`, `unet`, `vae`, `ddim` (the networks as pure functions of
flat diffusers-keyed parameters), `weights` and `single_file` (checkpoints), `tokenizer`, `pipeline`,
`cli` (the `sd15` command).
"""

import eqsat  # noqa: F401  first: keeps an installed CUDA plugin quiet on a machine without a GPU

from sd15.ddim import DDIM
from sd15.params import abstract_params
from sd15.pipeline import (
    VAE,
    Pipeline,
    TextEncoder,
    UNet,
    load_text_encoder,
    load_unet,
    load_vae,
)
from sd15.tokenizer import Tokenizer, load_tokenizer
from sd15.weights import CheckpointError

__all__ = [
    "DDIM",
    "VAE",
    "CheckpointError",
    "Pipeline",
    "TextEncoder",
    "Tokenizer",
    "UNet",
    "abstract_params",
    "load_text_encoder",
    "load_tokenizer",
    "load_unet",
    "load_vae",
]
