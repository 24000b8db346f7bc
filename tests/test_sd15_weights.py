"""Checkpoint loading (`sd15.weights`, `sd15.single_file`) against the tiny diffusers pipeline of conftest.

The oracle is the torch models' own state dicts: every loaded tensor must equal them bit for bit
(after the requested dtype cast), whichever layout the weights came in.
"""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.numpy import save_file  # noqa: E402

import sd15  # noqa: E402
from sd15 import single_file  # noqa: E402
from sd15.config import CLIPConfig, UNetConfig, VAEConfig  # noqa: E402
from sd15.params import param_shapes  # noqa: E402
from sd15.weights import CheckpointError, load_all_params, load_params  # noqa: E402

TINY = {"unet": UNetConfig.tiny(), "vae": VAEConfig.tiny(), "text_encoder": CLIPConfig.tiny()}
WEIGHTS_FILE = {
    "unet": "diffusion_pytorch_model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
}


def torch_params(model, component: str) -> dict[str, np.ndarray]:
    """The torch model's state dict under `param_shapes` names (CLIP with `text_model.`, VAE decoder only)."""
    out = {}
    for key, value in model.state_dict().items():
        if component == "text_encoder" and not key.startswith("text_model."):
            key = f"text_model.{key}"
        out[key] = value.detach().numpy()
    return {key: out[key] for key in param_shapes(component, TINY[component])}


@pytest.fixture(scope="module")
def expected(tiny_sd15):
    """{component: {param name: float32 numpy}} straight from the torch models."""
    return {
        "unet": torch_params(tiny_sd15.unet, "unet"),
        "vae": torch_params(tiny_sd15.vae, "vae"),
        "text_encoder": torch_params(tiny_sd15.text_encoder, "text_encoder"),
    }


def assert_params_equal(params, reference, dtype=np.float32):
    assert sorted(params) == sorted(reference)
    for key, value in reference.items():
        assert params[key].dtype == jnp.dtype(dtype), key
        np.testing.assert_array_equal(np.asarray(params[key]), value.astype(dtype), err_msg=key)


def copy_component(tiny_sd15_dir, component, destination):
    """`destination` with the component's config.json only (the test writes the weights)."""
    destination.mkdir(parents=True)
    shutil.copy(tiny_sd15_dir / component / "config.json", destination / "config.json")
    return destination


# --- diffusers folders -----------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["unet", "vae", "text_encoder"])
def test_component_folder_and_pipeline_folder(tiny_sd15_dir, expected, component):
    alone, config = load_params(tiny_sd15_dir / component, component)
    assert config == TINY[component]
    assert_params_equal(alone, expected[component])
    from_pipeline, _ = load_params(tiny_sd15_dir, component)
    assert_params_equal(from_pipeline, expected[component])


def test_load_all_params_reads_the_whole_folder(tiny_sd15_dir, expected):
    loaded = load_all_params(tiny_sd15_dir)
    for component in ("unet", "vae", "text_encoder"):
        params, config = loaded[component]
        assert config == TINY[component]
        assert_params_equal(params, expected[component])


def test_loaded_networks_match_torch(tiny_sd15):
    """The public callables (jitted, diffusers layouts) against the torch modules."""
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    context = rng.standard_normal((2, 77, 32)).astype(np.float32)
    ids = rng.integers(0, 49408, (2, 77)).astype(np.int64)

    unet = sd15.load_unet(tiny_sd15.root)
    vae = sd15.load_vae(tiny_sd15.root)
    text_encoder = sd15.load_text_encoder(tiny_sd15.root)
    assert unet.config == TINY["unet"] and vae.config.scaling_factor == 0.18215
    with torch.no_grad():
        unet_ref = tiny_sd15.unet(torch.from_numpy(sample), 321, torch.from_numpy(context)).sample.numpy()
        vae_ref = tiny_sd15.vae.decode(torch.from_numpy(sample)).sample.numpy()
        text_ref = tiny_sd15.text_encoder(torch.from_numpy(ids)).last_hidden_state.numpy()
    for ours, reference in (
        (unet(sample, 321, context), unet_ref),
        (vae.decode(sample), vae_ref),
        (text_encoder(ids), text_ref),
    ):
        assert ours.shape == reference.shape
        assert np.max(np.abs(np.asarray(ours) - reference)) <= 1e-4 * np.max(np.abs(reference))


def test_text_encoder_keys_with_and_without_text_model_prefix(tiny_sd15_dir, expected, tmp_path):
    """SD 1.5 on the Hub saves `text_model.*` (plus an int64 position_ids buffer); transformers 5 drops the level."""
    folder = copy_component(tiny_sd15_dir, "text_encoder", tmp_path / "text_encoder")
    tensors = dict(expected["text_encoder"])
    tensors["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    save_file(tensors, folder / "model.safetensors")
    params, _ = load_params(folder, "text_encoder")
    assert_params_equal(params, expected["text_encoder"])


# --- dtypes and fp16 variants ----------------------------------------------------------------------


@pytest.mark.parametrize("file_dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_half_precision_files_and_dtype_option(tiny_sd15_dir, expected, tmp_path, file_dtype, dtype):
    folder = copy_component(tiny_sd15_dir, "vae", tmp_path / "vae")
    stored = {key: value.astype(file_dtype) for key, value in expected["vae"].items()}
    save_file(stored, folder / "diffusion_pytorch_model.fp16.safetensors")
    vae = sd15.load_vae(folder, dtype=dtype)
    assert_params_equal(vae.params, stored, dtype)


def test_fp16_variant_preferred_only_for_16_bit_loads(tiny_sd15_dir, expected, tmp_path):
    folder = copy_component(tiny_sd15_dir, "unet", tmp_path / "unet")
    save_file(expected["unet"], folder / "diffusion_pytorch_model.safetensors")
    marked = {key: (value + 1).astype(np.float16) for key, value in expected["unet"].items()}
    save_file(marked, folder / "diffusion_pytorch_model.fp16.safetensors")
    assert_params_equal(load_params(folder, "unet")[0], expected["unet"])
    assert_params_equal(load_params(folder, "unet", jnp.float16)[0], marked, np.float16)


def test_only_safetensors_are_read(tiny_sd15_dir, tmp_path):
    folder = copy_component(tiny_sd15_dir, "unet", tmp_path / "unet")
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        sd15.load_unet(folder)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sd15.load_unet(tmp_path / "nothing-here")


# --- old diffusers VAE attention names ---------------------------------------------------------------

OLD_VAE_NAMES = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


@pytest.mark.parametrize("conv_shaped", [False, True])
def test_old_vae_attention_names(tiny_sd15_dir, expected, tmp_path, conv_shaped):
    """The published SD 1.5 VAE uses query/key/value/proj_attn (and encoder tensors, which are dropped)."""
    folder = copy_component(tiny_sd15_dir, "vae", tmp_path / "vae")
    attention = "decoder.mid_block.attentions.0"
    stored = {}
    for key, value in expected["vae"].items():
        for new, old in OLD_VAE_NAMES.items():
            if key.startswith(f"{attention}.{new}."):
                key = key.replace(f"{attention}.{new}.", f"{attention}.{old}.")
                if conv_shaped and value.ndim == 2:
                    value = value[:, :, None, None]
        stored[key] = value
    stored["encoder.mid_block.attentions.0.query.weight"] = np.zeros((64, 64), np.float32)
    stored["quant_conv.weight"] = np.zeros((8, 8, 1, 1), np.float32)
    assert f"{attention}.query.weight" in stored
    save_file(stored, folder / "diffusion_pytorch_model.safetensors")
    assert_params_equal(sd15.load_vae(folder).params, expected["vae"])


# --- single-file checkpoints ---------------------------------------------------------------------

# Tensors real single files carry that inference ignores.
IGNORED_EXTRAS = {
    "model_ema.decay": np.array(0.9999, np.float32),
    "model_ema.input_blocks00weight": np.zeros((32, 4, 3, 3), np.float32),
    "betas": np.zeros(1000, np.float32),
    "alphas_cumprod": np.zeros(1000, np.float32),
    "first_stage_model.encoder.conv_in.weight": np.zeros((32, 3, 3, 3), np.float32),
    "first_stage_model.quant_conv.weight": np.zeros((8, 8, 1, 1), np.float32),
    "cond_stage_model.transformer.text_model.embeddings.position_ids": np.arange(77, dtype=np.int64)[None],
}


def original_checkpoint(expected) -> dict[str, np.ndarray]:
    return single_file.from_diffusers(
        expected["unet"], expected["vae"], expected["text_encoder"], TINY["unet"], TINY["vae"], TINY["text_encoder"]
    )


@pytest.fixture(scope="module")
def single_file_path(expected, tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "tiny-sd15.safetensors"
    save_file({**original_checkpoint(expected), **IGNORED_EXTRAS}, path)
    return path


def test_single_file_layout(expected):
    state_dict = original_checkpoint(expected)
    assert state_dict["first_stage_model.decoder.mid.attn_1.q.weight"].shape == (64, 64, 1, 1)
    # the tiny VAE has 2 levels: decoder.up.1 is diffusers' up_blocks.0 (the one with the upsampler)
    assert "first_stage_model.decoder.up.1.upsample.conv.weight" in state_dict
    assert "model.diffusion_model.output_blocks.1.1.conv.weight" in state_dict  # UpBlock2D: upsampler at .1
    assert "cond_stage_model.transformer.text_model.final_layer_norm.weight" in state_dict


def test_single_file_round_trip(expected):
    unet, vae, text = single_file.to_diffusers(
        original_checkpoint(expected), TINY["unet"], TINY["vae"], TINY["text_encoder"]
    )
    for ours, reference in ((unet, expected["unet"]), (vae, expected["vae"]), (text, expected["text_encoder"])):
        assert sorted(ours) == sorted(reference)
        for key in reference:
            np.testing.assert_array_equal(ours[key], reference[key], err_msg=key)


def test_single_file_loads_like_the_folder(single_file_path, expected):
    loaded = load_all_params(single_file_path, configs=TINY)
    for component in ("unet", "vae", "text_encoder"):
        assert_params_equal(loaded[component][0], expected[component])
    assert_params_equal(sd15.load_unet(single_file_path, config=TINY["unet"]).params, expected["unet"])
    assert_params_equal(sd15.load_vae(single_file_path, config=TINY["vae"]).params, expected["vae"])


def test_legacy_single_file_clip_names(expected, tmp_path):
    """Old single files have `cond_stage_model.transformer.embeddings...` without `text_model.`."""
    prefix = single_file.PREFIXES["text_encoder"]
    state_dict = {
        key.replace(f"{prefix}text_model.", prefix): value for key, value in original_checkpoint(expected).items()
    }
    path = tmp_path / "legacy.safetensors"
    save_file(state_dict, path)
    assert_params_equal(sd15.load_text_encoder(path, config=TINY["text_encoder"]).params, expected["text_encoder"])


def test_single_file_matches_diffusers_conversion(expected):
    """Our mapping against diffusers' own `convert_ldm_*_checkpoint` on the tiny weights."""
    from diffusers.loaders import single_file_utils as reference

    state_dict = original_checkpoint(expected)
    unet = reference.convert_ldm_unet_checkpoint(state_dict, {"layers_per_block": TINY["unet"].layers_per_block})
    levels = len(TINY["vae"].block_out_channels)
    vae = reference.convert_ldm_vae_checkpoint(
        state_dict, {"down_block_types": [0] * levels, "up_block_types": [0] * levels}
    )
    text = reference.convert_ldm_clip_checkpoint(state_dict)
    ours = single_file.to_diffusers(state_dict, TINY["unet"], TINY["vae"], TINY["text_encoder"])
    for mine, theirs in zip(ours, (unet, vae, text)):
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            np.testing.assert_array_equal(mine[key], np.asarray(theirs[key]), err_msg=key)


def test_full_size_key_map_matches_diffusers_conversion():
    """Full-size SD 1.5 names and shapes, with zero-stride arrays (no memory), through both converters."""
    from diffusers.loaders import single_file_utils as reference

    shapes = {component: param_shapes(component) for component in ("unet", "vae", "text_encoder")}
    fake = {c: {k: np.broadcast_to(np.float32(0), s) for k, s in table.items()} for c, table in shapes.items()}
    state_dict = single_file.from_diffusers(fake["unet"], fake["vae"], fake["text_encoder"])
    assert len(state_dict) == sum(len(table) for table in shapes.values())
    assert state_dict["model.diffusion_model.output_blocks.2.1.conv.weight"].shape == (1280, 1280, 3, 3)
    assert state_dict["model.diffusion_model.output_blocks.5.2.conv.weight"].shape == (1280, 1280, 3, 3)
    assert state_dict["first_stage_model.decoder.up.3.block.0.conv1.weight"].shape == (512, 512, 3, 3)
    assert state_dict["first_stage_model.decoder.up.0.block.0.nin_shortcut.weight"].shape == (128, 256, 1, 1)
    theirs = (
        reference.convert_ldm_unet_checkpoint(state_dict, {"layers_per_block": 2}),
        reference.convert_ldm_vae_checkpoint(state_dict, {"down_block_types": [0] * 4, "up_block_types": [0] * 4}),
        reference.convert_ldm_clip_checkpoint(state_dict),
    )
    for component, converted in zip(("unet", "vae", "text_encoder"), theirs):
        assert {key: value.shape for key, value in converted.items()} == shapes[component]
    for component, mine in zip(("unet", "vae", "text_encoder"), single_file.to_diffusers(state_dict)):
        assert {key: value.shape for key, value in mine.items()} == shapes[component]


# --- one error listing every problem -----------------------------------------------------------------


def test_bad_component_lists_every_problem(tiny_sd15_dir, expected, tmp_path):
    folder = copy_component(tiny_sd15_dir, "unet", tmp_path / "unet")
    tensors = dict(expected["unet"])
    del tensors["conv_in.bias"], tensors["up_blocks.1.attentions.0.proj_out.weight"]
    tensors["conv_out.weight"] = tensors["conv_out.weight"][:, :, :1, :1].copy()
    tensors["down_blocks.0.attentions.0.extra.weight"] = np.zeros((3,), np.float32)
    tensors["lora.up.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")

    with pytest.raises(CheckpointError) as caught:
        sd15.load_unet(folder)
    error = caught.value
    assert isinstance(error, ValueError)
    assert sorted(name for _, name, _ in error.missing) == [
        "conv_in.bias",
        "up_blocks.1.attentions.0.proj_out.weight",
    ]
    assert sorted(name for _, name, _ in error.unexpected) == [
        "down_blocks.0.attentions.0.extra.weight",
        "lora.up.weight",
    ]
    assert error.mismatched == [("unet", "conv_out.weight", (4, 32, 3, 3), (4, 32, 1, 1))]
    message = str(error)
    assert "5 problems" in message
    for name in ("conv_in.bias", "proj_out.weight", "extra.weight", "lora.up.weight", "(4, 32, 3, 3)", "(4, 32, 1, 1)"):
        assert name in message


def test_bad_pipeline_folder_is_one_error(tiny_sd15_dir, expected, tmp_path):
    """Problems in two networks of one folder come back together."""
    root = tmp_path / "pipeline"
    shutil.copytree(tiny_sd15_dir, root)
    unet = dict(expected["unet"])
    del unet["conv_in.weight"]
    save_file(unet, root / "unet" / WEIGHTS_FILE["unet"])
    text = dict(expected["text_encoder"])
    text["text_model.final_layer_norm.weight"] = np.zeros((33,), np.float32)
    save_file(text, root / "text_encoder" / WEIGHTS_FILE["text_encoder"])
    with pytest.raises(CheckpointError) as caught:
        sd15.Pipeline.from_pretrained(root, tokenizer=sd15.tokenizer.tiny_tokenizer())
    assert caught.value.missing == [("unet", "conv_in.weight", (32, 4, 3, 3))]
    assert caught.value.mismatched == [("text_encoder", "text_model.final_layer_norm.weight", (32,), (33,))]


def test_bad_single_file_names_original_keys(expected, tmp_path):
    state_dict = {**original_checkpoint(expected), **IGNORED_EXTRAS}
    del state_dict["model.diffusion_model.input_blocks.0.0.weight"]
    del state_dict["first_stage_model.decoder.up.1.upsample.conv.bias"]
    state_dict["model.diffusion_model.output_blocks.9.0.in_layers.0.weight"] = np.zeros((8,), np.float32)
    state_dict["cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight"] = np.zeros(
        (64, 31), np.float32
    )
    state_dict["control_model.zero_convs.0.0.weight"] = np.zeros((1,), np.float32)
    path = tmp_path / "bad.safetensors"
    save_file(state_dict, path)

    with pytest.raises(CheckpointError) as caught:
        load_all_params(path, configs=TINY)
    error = caught.value
    assert sorted(name for _, name, _ in error.missing) == [
        "first_stage_model.decoder.up.1.upsample.conv.bias (decoder.up_blocks.0.upsamplers.0.conv.bias)",
        "model.diffusion_model.input_blocks.0.0.weight (conv_in.weight)",
    ]
    assert sorted(name for _, name, _ in error.unexpected) == [
        "control_model.zero_convs.0.0.weight",
        "model.diffusion_model.output_blocks.9.0.in_layers.0.weight",
    ]
    assert [(c, shapes) for c, _, *shapes in error.mismatched] == [("text_encoder", [(64, 32), (64, 31)])]
    assert "5 problems" in str(error)


def test_full_size_default_config_rejects_tiny_single_file(single_file_path):
    """A single file carries no config: without one it is checked against full-size SD 1.5."""
    with pytest.raises(CheckpointError, match="problems"):
        sd15.load_vae(single_file_path)
