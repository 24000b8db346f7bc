"""SD 1.5 through `eqsat.optimize`: the tiny pipeline gives the same image with `backend="pallas"`
(interpreted on a CPU), `backend="xla"` and plain `jax.jit` (`optimize=False`); the UNet step
(UNet, guidance, DDIM update), the VAE decoder and the text encoder through the Pallas templates
equal the plain jitted functions; weights are prepared once; the optimizer's stages show on the
progress display at a component's first call only. (The image against diffusers is
tests/test_sd15_pipeline.py, which runs the default, optimized pipeline.)
"""

from __future__ import annotations

import contextlib
import io
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from emit.pallas import XlaFallbackWarning
from sd15 import Pipeline

PROMPT = "a red cube"
SIZE = 32   # pixels: 16x16 latents for the tiny VAE (one 2x upsample)
STEPS = 2
MODES = {"jit": {"optimize": False}, "xla": {"backend": "xla"}, "pallas": {"backend": "pallas"}}


def generate(pipe: Pipeline, progress=False) -> np.ndarray:
    return pipe.generate(PROMPT, num_inference_steps=STEPS, height=SIZE, width=SIZE, seed=0, progress=progress)


@pytest.fixture(scope="module")
def runs():
    """mode -> (pipeline, image, stderr of its first and second generate)."""
    out = {}
    for mode, options in MODES.items():
        pipe = Pipeline.tiny(seed=0, **options)
        printed = []
        for _ in range(2):
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), warnings.catch_warnings():
                warnings.simplefilter("error", XlaFallbackWarning)  # every kernel has its template
                image = generate(pipe, progress=True)
            printed.append(stderr.getvalue())
        out[mode] = (pipe, image, printed)
    return out


@pytest.mark.parametrize("mode", ["xla", "pallas"])
def test_optimized_pipeline_gives_the_jit_image(runs, mode):
    image, reference = runs[mode][1], runs["jit"][1]
    assert image.shape == reference.shape == (SIZE, SIZE, 3)
    assert 0.5 < np.mean((reference > 0) & (reference < 1))  # mostly unclipped: the comparison sees values
    assert np.max(np.abs(image - reference)) <= 1 / 255
    levels = np.abs((image * 255).round().astype(np.int16) - (reference * 255).round().astype(np.int16))
    assert levels.max() <= 1


def test_the_networks_run_through_optimize_or_jit(runs):
    from driver.optimize import Optimized

    for mode, (pipe, _, _) in runs.items():
        compiled = [pipe.text_encoder._apply, pipe._step, pipe.vae._decode]
        assert all(isinstance(f, Optimized) for f in compiled) == (mode != "jit")
        assert not any(isinstance(f, Optimized) for f in compiled) == (mode == "jit")


@pytest.mark.parametrize("mode", ["xla", "pallas"])
def test_weights_are_prepared_once_and_calls_hit_the_cache(runs, mode):
    pipe = runs[mode][0]
    step, = pipe._step.lowerings  # one signature: every step of both generates reused it
    run = step.executable()
    assert run.backend == mode
    assert run.prepare_runs == 1 and run.cache_hits == 2 * STEPS - 1
    kinds = {k.component.rsplit(".", 1)[-1] for k in step.split.prepared.kernels}
    # fused QKV weights, the cross-attention K/V weights of all blocks, the ResNets' time
    # projections, the summed biases of the merged shortcuts
    assert {"to_q", "to_k", "time_emb_proj"} <= kinds, kinds
    assert any(k.term.ty == "f32[64]" or k.term.ty == "f32[32]" for k in step.split.prepared.kernels)
    assert step.stats["per_call_kernels"] == step.stats["fused_kernels"]
    for compiled in (pipe.text_encoder._apply, pipe.vae._decode):
        lowered, = compiled.lowerings
        assert lowered.executable().prepare_runs == 1


@pytest.mark.parametrize("mode", ["xla", "pallas"])
def test_optimizer_stages_show_at_first_calls_only(runs, mode):
    first, second = runs[mode][2]
    for label in ("eqsat text encoder", "eqsat unet step", "eqsat vae decoder"):
        assert label in first and label not in second
    assert "denoising" in first and "denoising" in second


def test_pallas_networks_equal_the_plain_functions(runs):
    """The UNet step, the VAE decoder and the text encoder through the Pallas templates (the
    pipeline's own signatures, so their lowerings are reused) against the same functions jitted."""
    pallas, plain = runs["pallas"][0], runs["jit"][0]
    rng = np.random.default_rng(0)
    latents = jnp.asarray(rng.standard_normal(pallas.latent_shape(SIZE, SIZE)), jnp.float32)
    context = plain.encode_prompt(PROMPT)
    np.testing.assert_allclose(np.asarray(pallas.encode_prompt(PROMPT)), np.asarray(context), rtol=1e-4, atol=1e-4)
    t = jnp.asarray(pallas.scheduler.set_timesteps(STEPS)[0], jnp.int32)
    args = (latents, t, context, jnp.float32(7.5))
    options = {"num_inference_steps": STEPS, "guided": True}
    got = pallas._step(pallas.unet.params, *args, **options)
    want = plain._step(plain.unet.params, *args, **options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    got, want = pallas.vae.decode(latents), plain.vae.decode(latents)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
