"""Text-to-image with SD 1.5 in JAX: the loaded networks as callables, and diffusers' txt2img loop.

    pipe = Pipeline.from_pretrained("stable-diffusion-v1-5", dtype=jnp.bfloat16)
    image = pipe("a photo of an astronaut riding a horse", num_inference_steps=50, seed=0)   # PIL.Image

`Pipeline` follows diffusers' `StableDiffusionPipeline.__call__` with a `DDIMScheduler` (eta 0):
encode [negative, prompt] as one batch of 2 -> latents N(0, 1) [1, 4, H/8, W/8] -> per timestep
one jitted step (UNet on the doubled batch, classifier-free guidance
uncond + g * (cond - uncond), DDIM update) -> VAE decode of latents / scaling_factor ->
(image / 2 + 0.5) clipped to [0, 1]. With guidance_scale <= 1 the batch is the prompt alone, as in
diffusers. Latents are float32 throughout; the networks run in the dtype they were loaded in.

Compilation: with `optimize=True` (the default) the text encoder, the UNet step (UNet, guidance and
DDIM update in one function) and the VAE decoder each run through `eqsat.optimize` with their
parameters marked (`params_argnums=0`), so the kernels that read only weights (fused QKV and K/V
weight concatenations, the time projections, merged shortcut biases) run once per set of weights;
`backend` is `eqsat.optimize`'s ("auto": "hybrid" on a GPU, XLA elsewhere; "pallas"; "hybrid";
"xla"; "interpret"). `generate_batch` makes one image per prompt; with `devices=N` the prompts
are split over N devices (`jax.shard_map` over a mesh axis "data"), data parallel. The first call of each component shows the optimizer's stages on a progress bar
(`progress=False` in `generate` hides them); later calls hit its cache. `optimize=False` runs
plain `jax.jit`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sd15 import clip, unet, vae
from sd15.config import CLIPConfig, UNetConfig, VAEConfig
from sd15.ddim import DDIM
from sd15.params import init_random
from sd15.tokenizer import Tokenizer, load_tokenizer, tiny_tokenizer
from sd15.weights import check_exists, is_single_file, load_all_params, load_params


BACKENDS = ("auto", "pallas", "hybrid", "xla", "interpret")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return backend


def compile_network(fn, *, optimize: bool = True, backend: str = "auto", label: str = "", **options):
    """`fn(params, ...)` through `eqsat.optimize` with its parameters marked (`params_argnums=0`),
    its stages shown on a progress bar labelled `label` when it is first lowered; or plain
    `jax.jit` when not `optimize`. `options`: `static_argnames` and the like, for either."""
    check_backend(backend)
    if not optimize:
        return jax.jit(fn, **options)
    import eqsat

    return eqsat.optimize(fn, params_argnums=0, backend=backend, progress=label or True, **options)


class _Network:
    """A network's parameters, config and how it is compiled (`compile_network`)."""

    def __init__(self, params: dict[str, jax.Array], config, optimize: bool, backend: str):
        self.params, self.config = params, config
        self.optimize, self.backend = optimize, backend

    def _compile(self, fn, label: str, **options):
        return compile_network(fn, optimize=self.optimize, backend=self.backend, label=label, **options)


class UNet(_Network):
    """`unet(sample [B,4,h,w], timestep, encoder_hidden_states [B,77,D]) -> [B,4,h,w]`, compiled."""

    def __init__(self, params: dict[str, jax.Array], config: UNetConfig, *, optimize: bool = True,
                 backend: str = "auto"):
        super().__init__(params, config, optimize, backend)
        self._apply = self._compile(functools.partial(_unet_apply, config), "unet")

    def __call__(self, sample, timestep, encoder_hidden_states) -> jax.Array:
        return self._apply(self.params, sample, timestep, encoder_hidden_states)


class VAE(_Network):
    """`vae.decode(latents [B,4,h,w]) -> image [B,3,8h,8w]`, diffusers' `vae.decode(latents).sample` (no scaling)."""

    def __init__(self, params: dict[str, jax.Array], config: VAEConfig, *, optimize: bool = True,
                 backend: str = "auto"):
        super().__init__(params, config, optimize, backend)
        self._decode = self._compile(functools.partial(_vae_decode, config), "vae decoder")

    @property
    def scale_factor(self) -> int:
        """Pixels per latent along each side (8 for SD 1.5)."""
        return 2 ** (len(self.config.block_out_channels) - 1)

    def decode(self, latents) -> jax.Array:
        return self._decode(self.params, latents)


class TextEncoder(_Network):
    """`text_encoder(input_ids [B,77]) -> last_hidden_state [B,77,D]`, compiled."""

    def __init__(self, params: dict[str, jax.Array], config: CLIPConfig, *, optimize: bool = True,
                 backend: str = "auto"):
        super().__init__(params, config, optimize, backend)
        self._apply = self._compile(functools.partial(_clip_apply, config), "text encoder")

    def __call__(self, input_ids) -> jax.Array:
        return self._apply(self.params, jnp.asarray(input_ids, jnp.int32))


def _unet_apply(config, params, sample, timestep, encoder_hidden_states):
    return unet.apply(params, config, sample, timestep, encoder_hidden_states)


def _vae_decode(config, params, latents):
    return vae.decode(params, config, latents)


def _clip_apply(config, params, input_ids):
    return clip.apply(params, config, input_ids)


def load_unet(path: str | os.PathLike, dtype=jnp.float32, config: UNetConfig | None = None, *,
              optimize: bool = True, backend: str = "auto") -> UNet:
    """The UNet of a pipeline folder, `unet/` folder or single-file checkpoint (see `sd15.weights`)."""
    return UNet(*load_params(path, "unet", dtype, config), optimize=optimize, backend=backend)


def load_vae(path: str | os.PathLike, dtype=jnp.float32, config: VAEConfig | None = None, *,
             optimize: bool = True, backend: str = "auto") -> VAE:
    """The VAE decoder of a pipeline folder, `vae/` folder or single-file checkpoint."""
    return VAE(*load_params(path, "vae", dtype, config), optimize=optimize, backend=backend)


def load_text_encoder(path: str | os.PathLike, dtype=jnp.float32, config: CLIPConfig | None = None, *,
                      optimize: bool = True, backend: str = "auto") -> TextEncoder:
    """The CLIP text encoder of a pipeline folder, `text_encoder/` folder or single-file checkpoint."""
    return TextEncoder(*load_params(path, "text_encoder", dtype, config), optimize=optimize, backend=backend)


def load_scheduler(path: str | os.PathLike) -> DDIM:
    """DDIM from `path/scheduler/scheduler_config.json` when present, else SD 1.5's schedule."""
    folder = os.path.join(path, "scheduler")
    if os.path.isfile(os.path.join(folder, "scheduler_config.json")):
        return DDIM.from_config(folder)
    return DDIM()


class Pipeline:
    """SD 1.5 text-to-image: tokenizer, text encoder, UNet, VAE decoder and DDIM (see the module docstring)."""

    def __init__(self, unet: UNet, vae: VAE, text_encoder: TextEncoder, tokenizer: Tokenizer, scheduler: DDIM,
                 devices: int = 1):
        """The UNet step (UNet, guidance, DDIM update) is compiled as `unet` is (`unet.optimize`, `unet.backend`).
        `devices`: how many of `jax.devices()` a batch of prompts is split over (see `generate_batch`)."""
        self.unet, self.vae, self.text_encoder = unet, vae, text_encoder
        self.tokenizer, self.scheduler = tokenizer, scheduler
        if tokenizer.vocab_size > text_encoder.config.vocab_size:
            raise ValueError(f"{tokenizer.vocab_size=} exceeds the text encoder's {text_encoder.config.vocab_size=}")
        self._step = unet._compile(self._denoise_step, "unet step", static_argnames=("num_inference_steps", "guided"))
        self.mesh = data_mesh(devices)
        if self.mesh is not None:  # the weights, once on every device
            replicated = NamedSharding(self.mesh, P())
            for network in (unet, vae):
                network.params = jax.device_put(network.params, replicated)
        self._per_device: dict = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype=jnp.float32,
        tokenizer: str | os.PathLike | Tokenizer | None = None,
        unet_config: UNetConfig | None = None,
        vae_config: VAEConfig | None = None,
        text_encoder_config: CLIPConfig | None = None,
        optimize: bool = True,
        backend: str = "auto",
        devices: int = 1,
    ) -> Pipeline:
        """A pipeline folder or single-file checkpoint; every network is checked before any is read.

        `tokenizer` (a folder or a `Tokenizer`) defaults to `path/tokenizer/`, else CLIP's vocabulary
        from an installed package. Configs override the folders' config.json; a single file has none,
        so it is full-size SD 1.5 unless given. `optimize`, `backend`: how the networks are compiled
        (see the module docstring); `devices`: data parallelism for `generate_batch`.
        """
        configs = {"unet": unet_config, "vae": vae_config, "text_encoder": text_encoder_config}
        check_exists(Path(path).expanduser())
        single = is_single_file(path)
        if not isinstance(tokenizer, Tokenizer):  # first: it is the cheap thing to get wrong
            tokenizer = load_tokenizer(tokenizer if tokenizer is not None else (None if single else path))
        compiled = {"optimize": optimize, "backend": check_backend(backend)}  # checked before loading
        loaded = load_all_params(path, dtype, configs)
        return cls(
            UNet(*loaded["unet"], **compiled),
            VAE(*loaded["vae"], **compiled),
            TextEncoder(*loaded["text_encoder"], **compiled),
            tokenizer,
            DDIM() if single else load_scheduler(path),
            devices=devices,
        )

    @classmethod
    def tiny(cls, seed: int = 0, dtype=jnp.float32, *, optimize: bool = True, backend: str = "auto",
             devices: int = 1) -> Pipeline:
        """Random weights in the `tiny()` configs and `tiny_tokenizer()`: a no-files pipeline for trying
        things out; `optimize`, `backend`, `devices` as in `from_pretrained`."""
        configs = {"unet": UNetConfig.tiny(), "vae": VAEConfig.tiny(), "text_encoder": CLIPConfig.tiny()}
        params = {name: init_random(name, config, seed, dtype) for name, config in configs.items()}
        compiled = {"optimize": optimize, "backend": backend}
        return cls(
            UNet(params["unet"], configs["unet"], **compiled),
            VAE(params["vae"], configs["vae"], **compiled),
            TextEncoder(params["text_encoder"], configs["text_encoder"], **compiled),
            tiny_tokenizer(),
            DDIM(),
            devices=devices,
        )

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this: the VAE factor times the UNet's downsampling."""
        return self.vae.scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)

    def encode_prompt(self, prompt: str, negative_prompt: str = "", guided: bool = True) -> jax.Array:
        """[negative, prompt] embeddings [2, 77, D] (just the prompt's, [1, 77, D], when not guided)."""
        ids = self.tokenizer([negative_prompt, prompt] if guided else [prompt])
        return self.text_encoder(ids)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.unet.config.in_channels, height // self.vae.scale_factor, width // self.vae.scale_factor)

    def initial_latents(self, height: int, width: int, seed: int, latents=None) -> jax.Array:
        """`latents` (checked) or N(0, 1) from `seed`, times the scheduler's initial sigma (1 for DDIM)."""
        shape = self.latent_shape(height, width)
        if latents is None:
            latents = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
        latents = jnp.asarray(latents, jnp.float32)
        if latents.shape != shape:
            raise ValueError(f"latents of shape {latents.shape}; {height}x{width} needs {shape}")
        return latents * self.scheduler.init_noise_sigma

    def _denoise_step(self, unet_params, latents, timestep, context, guidance_scale, *, num_inference_steps, guided):
        """One DDIM step with classifier-free guidance (jitted once per step count)."""
        model_input = jnp.concatenate([latents, latents]) if guided else latents
        noise = unet.apply(unet_params, self.unet.config, model_input, timestep, context).astype(jnp.float32)
        if guided:  # [negative x n, prompts]: the n images' two halves
            n = latents.shape[0]
            uncond, cond = noise[:n], noise[n:]
            noise = uncond + guidance_scale * (cond - uncond)
        scheduler = copy.copy(self.scheduler)
        scheduler.num_inference_steps = num_inference_steps
        return scheduler.step(noise, timestep, latents)

    def generate(
        self,
        prompt: str,
        negative_prompt: str = "",
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        height: int = 512,
        width: int = 512,
        seed: int = 0,
        latents=None,
        progress: bool | Callable = True,
    ) -> np.ndarray:
        """The image as float32 [height, width, 3] in [0, 1] (diffusers' `output_type="np"`, first image).

        `latents`: the initial noise [1, 4, height/8, width/8] (NCHW, as diffusers); drawn from
        `jax.random.key(seed)` when None.
        """
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"{height=} and {width=} must be multiples of {multiple}")
        guided = guidance_scale > 1.0
        latents = self.initial_latents(height, width, seed, latents)
        with self._optimizer_stages(shown=progress is not False):
            context = self.encode_prompt(prompt, negative_prompt, guided)
            timesteps = self.scheduler.set_timesteps(num_inference_steps)
            for t in _progress(timesteps, progress):
                latents = self._step(
                    self.unet.params,
                    latents,
                    jnp.asarray(t, jnp.int32),
                    context,
                    jnp.float32(guidance_scale),
                    num_inference_steps=num_inference_steps,
                    guided=guided,
                )
            image = self.vae.decode(latents / self.vae.config.scaling_factor).astype(jnp.float32)
        image = jnp.clip(image / 2 + 0.5, 0.0, 1.0)
        return np.asarray(image[0].transpose(1, 2, 0))

    def generate_batch(
        self,
        prompts,
        negative_prompt: str = "",
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        height: int = 512,
        width: int = 512,
        seed: int = 0,
        latents=None,
        progress: bool | Callable = True,
    ) -> np.ndarray:
        """One image per prompt, float32 [B, height, width, 3] in [0, 1]; `latents` [B, 4, h, w] or
        N(0, 1) from `jax.random.key(seed)`. On `devices` > 1 the prompts are split over the devices
        (data parallel: B must be a multiple of them): each device denoises and decodes its prompts
        with its own copy of the weights, their classifier-free guidance pair on the same device;
        the images are those of one device (`tests/test_sharding.py`, the tiny pipeline on four devices)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        count, devices = len(prompts), self.devices
        if count == 0 or count % devices:
            raise ValueError(f"{count} prompts do not split over {devices} devices: give a multiple of {devices}")
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"{height=} and {width=} must be multiples of {multiple}")
        guided = guidance_scale > 1.0
        shape = (count, *self.latent_shape(height, width)[1:])
        if latents is None:
            latents = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
        latents = jnp.asarray(latents, jnp.float32)
        if latents.shape != shape:
            raise ValueError(f"latents of shape {latents.shape}; {count} images of {height}x{width} need {shape}")
        latents = latents * self.scheduler.init_noise_sigma
        with self._optimizer_stages(shown=progress is not False):
            embeddings = self.text_encoder(self.tokenizer([negative_prompt, *prompts] if guided else prompts))
            context = _guidance_batches(embeddings, count, devices, guided)
            step = self._per_device_step(num_inference_steps, guided)
            for t in _progress(self.scheduler.set_timesteps(num_inference_steps), progress):
                latents = step(self.unet.params, latents, jnp.asarray(t, jnp.int32), context,
                               jnp.float32(guidance_scale))
            image = self._per_device_decode()(self.vae.params, latents / self.vae.config.scaling_factor)
        image = jnp.clip(image.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
        return np.asarray(image.transpose(0, 2, 3, 1))

    @property
    def devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def _per_device_step(self, num_inference_steps: int, guided: bool):
        """The UNet step on each device's share of the batch (the whole batch on one device)."""
        def step(params, latents, timestep, context, guidance_scale):
            return self._step(params, latents, timestep, context, guidance_scale,
                              num_inference_steps=num_inference_steps, guided=guided)

        return self._data_parallel(("step", num_inference_steps, guided), step, (P(), P("data"), P(), P("data"), P()))

    def _per_device_decode(self):
        return self._data_parallel(("decode",), lambda params, latents: self.vae._decode(params, latents),
                                   (P(), P("data")))

    def _data_parallel(self, key, fn, in_specs):
        if self.mesh is None:
            return fn
        if key not in self._per_device:
            self._per_device[key] = jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=P("data")))
        return self._per_device[key]

    @contextlib.contextmanager
    def _optimizer_stages(self, shown: bool):
        """Within: the optimizer's stage bars (a component's first call) shown or not, as `generate`'s progress."""
        from driver.optimize import Optimized

        compiled = [self.text_encoder._apply, self._step, self.vae._decode]
        optimized = [(f, f.progress) for f in compiled if isinstance(f, Optimized)]
        if shown:
            yield
            return
        for f, _ in optimized:
            f.progress = False
        try:
            yield
        finally:
            for f, label in optimized:
                f.progress = label

    def __call__(
        self,
        prompt: str,
        negative_prompt: str = "",
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        height: int = 512,
        width: int = 512,
        seed: int = 0,
        latents=None,
        progress: bool | Callable = True,
    ):
        """The image as a `PIL.Image` (see `generate`)."""
        image = self.generate(
            prompt, negative_prompt, num_inference_steps, guidance_scale, height, width, seed, latents, progress
        )
        return to_pil(image)


def data_mesh(devices: int):
    """A one-axis mesh `"data"` over the first `devices` devices (None for one device)."""
    available = jax.device_count()
    if not 1 <= devices <= available:
        raise ValueError(f"devices={devices}: {available} available (jax.devices(): {jax.devices()})")
    return None if devices == 1 else Mesh(np.array(jax.devices()[:devices]), ("data",))


def _guidance_batches(embeddings, count: int, devices: int, guided: bool):
    """The UNet's context, device by device: each device's prompts after as many copies of the
    negative prompt (`embeddings`: [negative, *prompts] when guided), so a device's guidance pair
    never crosses devices."""
    if not guided:
        return embeddings
    share = count // devices
    negative, prompts = embeddings[:1], embeddings[1:]
    chunks = []
    for device in range(devices):
        chunks += [jnp.repeat(negative, share, axis=0), prompts[device * share:(device + 1) * share]]
    return jnp.concatenate(chunks)


def to_pil(image: np.ndarray):
    """[H, W, 3] floats in [0, 1] -> PIL RGB image, rounded as diffusers' `numpy_to_pil`."""
    from PIL import Image

    return Image.fromarray((image * 255).round().astype(np.uint8))


def _progress(timesteps, progress):
    if callable(progress):
        return progress(timesteps)
    if not progress:
        return timesteps
    from tqdm.auto import tqdm

    return tqdm(timesteps, desc="denoising", unit="step")
