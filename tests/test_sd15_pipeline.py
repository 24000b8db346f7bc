"""The tokenizer and the whole text-to-image `Pipeline` against diffusers' `StableDiffusionPipeline`.

The oracle is diffusers with `DDIMScheduler`, run on the tiny random pipeline of conftest plus a
tiny CLIP vocabulary written here (byte symbols, a few merges; the text encoder's 49,408-token
vocabulary covers it), the same prompt and the same initial latents. Tolerance: 1e-3 on the float
image in [0, 1]; the PIL images may differ by one level where a value sits on a rounding edge.
"""

from __future__ import annotations

import gzip
import json
import shutil
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import sd15  # noqa: E402
from sd15 import tokenizer as tokenization  # noqa: E402
from sd15.config import CLIPConfig, UNetConfig, VAEConfig  # noqa: E402
from sd15.single_file import from_diffusers  # noqa: E402

MERGES = [("c", "a"), ("ca", "t</w>"), ("o", "n</w>"), ("a", "s"), ("as", "t"), ("ast", "r"), ("astr", "o")]
PROMPT = "an astronaut cat on the moon"
NEGATIVE = "blurry"
STEPS = 3
SIZE = 32  # pixels; the tiny VAE upsamples 2x, so 16x16 latents
IMAGE_TOLERANCE = 1e-3


def write_tokenizer(folder):
    """vocab.json + merges.txt in CLIP's order (bytes, word-end bytes, merges, specials) + model_max_length."""
    folder.mkdir(parents=True, exist_ok=True)
    symbols = tokenization.byte_symbols()
    vocab = [
        *symbols,
        *(s + "</w>" for s in symbols),
        *("".join(m) for m in MERGES),
        tokenization.START,
        tokenization.END,
    ]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    return folder


@pytest.fixture(scope="module")
def pipeline_dir(tiny_sd15_dir, tmp_path_factory):
    """A copy of the conftest pipeline folder with a tokenizer/ folder, as a real pipeline has."""
    root = tmp_path_factory.mktemp("with_tokenizer") / "pipeline"
    shutil.copytree(tiny_sd15_dir, root)
    write_tokenizer(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def tokenizer_dir(pipeline_dir):
    return pipeline_dir / "tokenizer"


@pytest.fixture(scope="module")
def pipe(pipeline_dir):
    return sd15.Pipeline.from_pretrained(pipeline_dir)


@pytest.fixture(scope="module")
def reference_pipe(tiny_sd15, tokenizer_dir):
    pipeline = diffusers.StableDiffusionPipeline(
        vae=tiny_sd15.vae,
        text_encoder=tiny_sd15.text_encoder,
        tokenizer=transformers.CLIPTokenizer.from_pretrained(tokenizer_dir),
        unet=tiny_sd15.unet,
        scheduler=diffusers.DDIMScheduler.from_pretrained(tiny_sd15.root / "scheduler"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal((1, 4, SIZE // 2, SIZE // 2)).astype(np.float32)


def reference_image(reference_pipe, latents, guidance_scale=7.5, output_type="np"):
    with torch.no_grad():
        result = reference_pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_inference_steps=STEPS,
            guidance_scale=guidance_scale,
            height=SIZE,
            width=SIZE,
            latents=torch.from_numpy(latents),
            output_type=output_type,
        )
    return result.images[0]


# --- tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_matches_diffusers_padding(pipe, reference_pipe):
    ids = pipe.tokenizer([PROMPT, ""])
    reference = reference_pipe.tokenizer(
        [PROMPT, ""], padding="max_length", max_length=77, truncation=True, return_tensors="np"
    ).input_ids
    assert ids.shape == (2, 77) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, reference)
    end = pipe.tokenizer.clip_tokenizer.convert_tokens_to_ids(tokenization.END)
    assert ids[1, 0] == pipe.tokenizer.clip_tokenizer.convert_tokens_to_ids(tokenization.START)
    assert (ids[1, 1:] == end).all()  # padded with <|endoftext|>


def test_tokenizer_truncation_warns_with_count(pipe):
    prompt = "x " * 80  # 80 tokens + start + end = 82
    with pytest.warns(UserWarning, match="the last 5 were dropped"):
        ids = pipe.tokenizer(prompt)
    end = pipe.tokenizer.clip_tokenizer.convert_tokens_to_ids(tokenization.END)
    assert ids.shape == (1, 77) and ids[0, -1] == end
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.tokenizer("x " * 75)  # exactly 77 with start and end: nothing dropped


def test_tokenizer_from_bundled_clip_vocabulary(tmp_path, monkeypatch):
    """A package that ships CLIP's bpe_simple_vocab_16e6.txt.gz (e.g. open_clip) is found and used."""
    package = tmp_path / "fake_open_clip"
    package.mkdir()
    (package / "__init__.py").write_text("")
    with gzip.open(package / tokenization.BPE_VOCABULARY, "wt", encoding="utf-8") as f:
        f.write('"bpe_simple_vocab_16e6.txt#version: 0.2\n' + "".join(f"{a} {b}\n" for a, b in MERGES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tokenization, "BUNDLING_PACKAGES", ("fake_open_clip",))

    bundled = sd15.load_tokenizer(None)
    reference = sd15.load_tokenizer(write_tokenizer(tmp_path / "tokenizer"))
    np.testing.assert_array_equal(bundled([PROMPT]), reference([PROMPT]))
    assert bundled.vocab_size == reference.vocab_size == 512 + len(MERGES) + 2


def test_no_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenization, "BUNDLING_PACKAGES", ("surely_not_an_installed_package",))
    with pytest.raises(FileNotFoundError, match="--tokenizer PATH"):
        sd15.load_tokenizer(tmp_path)


# --- the pipeline ------------------------------------------------------------------------------------


def test_pipeline_matches_diffusers(pipe, reference_pipe, latents):
    ours = pipe.generate(
        PROMPT, NEGATIVE, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=latents, progress=False
    )
    reference = reference_image(reference_pipe, latents)
    assert ours.shape == reference.shape == (SIZE, SIZE, 3)
    assert 0.5 < np.mean((reference > 0) & (reference < 1))  # mostly unclipped: the comparison sees values
    assert np.max(np.abs(ours - reference)) < IMAGE_TOLERANCE

    image = pipe(PROMPT, NEGATIVE, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=latents, progress=False)
    reference_pil = reference_image(reference_pipe, latents, output_type="pil")
    assert image.size == reference_pil.size == (SIZE, SIZE) and image.mode == "RGB"
    difference = np.abs(np.asarray(image, np.int16) - np.asarray(reference_pil, np.int16))
    assert difference.max() <= 1 and np.mean(difference > 0) < 0.01


def test_pipeline_without_guidance_matches_diffusers(pipe, reference_pipe, latents):
    """guidance_scale <= 1: diffusers runs the prompt alone (batch 1), so do we."""
    ours = pipe.generate(
        PROMPT, NEGATIVE, STEPS, guidance_scale=1.0, height=SIZE, width=SIZE, latents=latents, progress=False
    )
    reference = reference_image(reference_pipe, latents, guidance_scale=1.0)
    assert np.max(np.abs(ours - reference)) < IMAGE_TOLERANCE


def test_seeded_latents_are_deterministic(pipe):
    first = pipe.generate(PROMPT, num_inference_steps=STEPS, height=SIZE, width=SIZE, seed=3, progress=False)
    again = pipe.generate(PROMPT, num_inference_steps=STEPS, height=SIZE, width=SIZE, seed=3, progress=False)
    other = pipe.generate(PROMPT, num_inference_steps=STEPS, height=SIZE, width=SIZE, seed=4, progress=False)
    np.testing.assert_array_equal(first, again)
    assert np.max(np.abs(first - other)) > 0.01


def test_single_file_pipeline_gives_the_same_image(pipe, tiny_sd15, tokenizer_dir, latents, tmp_path):
    from safetensors.numpy import save_file

    unet, vae, text = (pipe.unet.params, pipe.vae.params, pipe.text_encoder.params)
    configs = {
        "unet_config": UNetConfig.tiny(),
        "vae_config": VAEConfig.tiny(),
        "text_encoder_config": CLIPConfig.tiny(),
    }
    state_dict = from_diffusers(
        *({k: np.asarray(v) for k, v in p.items()} for p in (unet, vae, text)), *configs.values()
    )
    path = tmp_path / "tiny.safetensors"
    save_file(state_dict, path)

    single = sd15.Pipeline.from_pretrained(path, tokenizer=tokenizer_dir, **configs)
    kwargs = dict(num_inference_steps=2, height=SIZE, width=SIZE, latents=latents, progress=False)
    np.testing.assert_array_equal(single.generate(PROMPT, **kwargs), pipe.generate(PROMPT, **kwargs))


def test_bad_sizes_and_latents(pipe, latents):
    with pytest.raises(ValueError, match="multiples of 4"):
        pipe.generate(PROMPT, height=30, width=32, progress=False)
    with pytest.raises(ValueError, match="latents of shape"):
        pipe.generate(PROMPT, height=64, width=64, latents=latents, progress=False)
