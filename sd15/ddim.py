"""The DDIM sampler (Song et al. 2020, eq. 12), equal to diffusers `DDIMScheduler`.

    ddim = DDIM.from_config("model/scheduler")      # or a dict, or the json path
    for t in ddim.set_timesteps(50):                  # [981, 961, ..., 1] for SD 1.5
        latents = ddim.step(unet(latents, t), t, latents)

`step` is jittable with a traced `t`: the alpha tables are indexed with jnp, and the only Python
state it reads, `num_inference_steps`, is fixed by `set_timesteps` before tracing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _linspace_float32(start: float, end: float, count: int) -> np.ndarray:
    """`torch.linspace(start, end, count, dtype=torch.float32)` bit for bit.

    torch steps by a float32 `step` from the nearer end, one fused multiply-add (one rounding) per
    point; np.linspace rounds differently, which moves SD 1.5's alphas_cumprod by up to 1e-6.
    """
    if count == 1:
        return np.array([start], np.float32)
    step = np.float64(np.float32((end - start) / (count - 1)))
    index = np.arange(count, dtype=np.float64)
    from_start = np.float64(np.float32(start)) + step * index
    from_end = np.float64(np.float32(end)) - step * (count - 1 - index)
    return np.where(index < count // 2, from_start, from_end).astype(np.float32)


@dataclasses.dataclass
class DDIM:
    """diffusers `DDIMScheduler` config fields; defaults are SD 1.5's scheduler config."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    set_alpha_to_one: bool = False
    steps_offset: int = 1
    timestep_spacing: str = "leading"
    prediction_type: str = "epsilon"
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    num_inference_steps: int | None = dataclasses.field(default=None, init=False)

    init_noise_sigma = 1.0  # DDIM starts from unit-variance noise.

    def __post_init__(self):
        if self.beta_schedule == "scaled_linear":
            betas = _linspace_float32(self.beta_start**0.5, self.beta_end**0.5, self.num_train_timesteps) ** 2
        elif self.beta_schedule == "linear":
            betas = _linspace_float32(self.beta_start, self.beta_end, self.num_train_timesteps)
        else:
            raise ValueError(f"unsupported {self.beta_schedule=}")
        if self.timestep_spacing not in ("leading", "trailing", "linspace"):
            raise ValueError(f"unsupported {self.timestep_spacing=}")
        if self.prediction_type not in ("epsilon", "v_prediction", "sample"):
            raise ValueError(f"unsupported {self.prediction_type=}")
        # torch's float32 cumprod matches a float64 running product rounded once at the end.
        self.alphas_cumprod = np.cumprod((np.float32(1.0) - betas).astype(np.float64)).astype(np.float32)
        self.final_alpha_cumprod = np.float32(1.0) if self.set_alpha_to_one else self.alphas_cumprod[0]

    @classmethod
    def from_config(cls, config: dict[str, Any] | str | os.PathLike) -> DDIM:
        """From a scheduler config dict, its json file, or the folder holding `scheduler_config.json`.

        Any diffusers scheduler's config works (SD 1.5 ships a PNDM one); unknown keys are ignored,
        options DDIM would honour differently are refused.
        """
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "scheduler_config.json")
            with open(path) as f:
                config = json.load(f)
        for key in ("thresholding", "rescale_betas_zero_snr"):
            if config.get(key):
                raise ValueError(f"DDIM: {key}=True is not supported")
        if config.get("trained_betas") is not None:
            raise ValueError("DDIM: trained_betas are not supported")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in config.items() if k in names})

    def set_timesteps(self, num_inference_steps: int) -> np.ndarray:
        """Choose the sampling timesteps (descending int64, as diffusers) and remember their count."""
        n, total = num_inference_steps, self.num_train_timesteps
        if not 0 < n <= total:
            raise ValueError(f"num_inference_steps={n} must be in [1, {total}]")
        self.num_inference_steps = n
        if self.timestep_spacing == "leading":
            timesteps = (np.arange(0, n) * (total // n)).round()[::-1].astype(np.int64) + self.steps_offset
        elif self.timestep_spacing == "trailing":
            timesteps = np.round(np.arange(total, 0, -total / n)).astype(np.int64) - 1
        else:
            timesteps = np.linspace(0, total - 1, n).round()[::-1].astype(np.int64)
        self.timesteps = timesteps
        return timesteps

    def scale_model_input(self, sample: jax.Array, timestep: jax.Array | int | None = None) -> jax.Array:
        """DDIM does not rescale the UNet input (kept for the diffusers scheduler interface)."""
        return sample

    def step(
        self,
        model_output: jax.Array,
        timestep: jax.Array | int,
        sample: jax.Array,
        eta: float = 0.0,
        variance_noise: jax.Array | None = None,
    ) -> jax.Array:
        """x_t -> x_{t - T/n}: diffusers `DDIMScheduler.step(...).prev_sample` for a scalar timestep.

        With eta > 0 pass `variance_noise` (standard normal, shaped like `sample`).
        """
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if eta > 0 and variance_noise is None:
            raise ValueError("eta > 0 needs variance_noise")
        alphas_cumprod = jnp.asarray(self.alphas_cumprod)
        t = jnp.asarray(timestep, jnp.int32)
        prev_t = t - self.num_train_timesteps // self.num_inference_steps
        alpha_t = alphas_cumprod[t]
        alpha_prev = jnp.where(prev_t >= 0, alphas_cumprod[jnp.maximum(prev_t, 0)], self.final_alpha_cumprod)
        beta_t = 1.0 - alpha_t

        eps = model_output.astype(jnp.float32)
        x = sample.astype(jnp.float32)
        if self.prediction_type == "epsilon":
            x0 = (x - jnp.sqrt(beta_t) * eps) / jnp.sqrt(alpha_t)
        elif self.prediction_type == "v_prediction":
            x0 = jnp.sqrt(alpha_t) * x - jnp.sqrt(beta_t) * eps
            eps = jnp.sqrt(alpha_t) * eps + jnp.sqrt(beta_t) * x
        else:  # "sample"
            x0 = eps
            eps = (x - jnp.sqrt(alpha_t) * x0) / jnp.sqrt(beta_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)

        # sigma_t = eta * sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))   (DDIM eq. 16)
        variance = (1.0 - alpha_prev) / beta_t * (1.0 - alpha_t / alpha_prev)
        std = eta * jnp.sqrt(variance)
        prev = jnp.sqrt(alpha_prev) * x0 + jnp.sqrt(1.0 - alpha_prev - std**2) * eps
        if eta > 0:
            prev = prev + std * variance_noise.astype(jnp.float32)
        return prev.astype(sample.dtype)
