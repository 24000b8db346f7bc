"""The original (CompVis/ldm) single-file SD 1.5 checkpoint <-> diffusers parameter names.

    unet, vae, text = to_diffusers(state_dict)     # "v1-5-pruned-emaonly.safetensors" -> three dicts
    state_dict = from_diffusers(unet, vae, text)   # and back
    original_names("unet")["conv_in.weight"]       # "model.diffusion_model.input_blocks.0.0.weight"

One table of renaming rules per network maps a diffusers key to its original key; both directions
are lookups in the map those rules produce over `sd15.params.param_shapes` (the inverse is never
written by hand). The rules follow diffusers' `loaders/single_file_utils.py`
(`convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint`):

    UNet   input_blocks.0.0 = conv_in; input_blocks.{1 + i(L+1) + j} = down block i, layer j
           (.0 resnet, .1 attention), input_blocks.{1 + i(L+1) + L}.0.op = its downsampler;
           middle_block.{0,1,2} = resnet, attention, resnet; output_blocks.{i(L+1) + j} = up block i,
           layer j (.0 resnet, .1 attention), the upsampler after the last layer (.1 or, behind an
           attention, .2); resnets: in_layers.{0,2}, emb_layers.1, out_layers.{0,3}, skip_connection.
    VAE    decoder.up.{n-1-i} = decoder.up_blocks.i (the original counts up blocks from the
           output end); mid.block_{1,2} and mid.attn_1 (norm, q, k, v, proj_out as 1x1 convs
           [C, C, 1, 1], linears [C, C] in diffusers); norm_out; nin_shortcut.
    CLIP   cond_stage_model.transformer.text_model.* = text_model.* (transformers' own names).

Only what SD 1.5 inference reads is mapped: the VAE encoder, EMA copies and the DDPM schedule
buffers are `ignored`; any other key the rules do not produce is left under its original name, so
the loader can report it as unexpected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any


from sd15.config import CLIPConfig, UNetConfig, VAEConfig
from sd15.params import param_shapes

PREFIXES = {
    "unet": "model.diffusion_model.",
    "vae": "first_stage_model.",
    "text_encoder": "cond_stage_model.transformer.",
}

# Keys of an original checkpoint that SD 1.5 inference never reads.
IGNORED_PREFIXES = (
    "model_ema.",  # EMA copies of the UNet ("v1-5-pruned.safetensors"); the live weights are used
    "first_stage_model.encoder.",
    "first_stage_model.quant_conv.",
    "first_stage_model.loss.",  # the VAE's training discriminator, in some VAE checkpoints
)
IGNORED_KEYS = frozenset(
    {
        # ldm's DDPM buffers: the noise schedule is the scheduler's business
        "betas",
        "alphas_cumprod",
        "alphas_cumprod_prev",
        "sqrt_alphas_cumprod",
        "sqrt_one_minus_alphas_cumprod",
        "log_one_minus_alphas_cumprod",
        "sqrt_recip_alphas_cumprod",
        "sqrt_recipm1_alphas_cumprod",
        "posterior_variance",
        "posterior_log_variance_clipped",
        "posterior_mean_coef1",
        "posterior_mean_coef2",
        "logvar",
        "lvlb_weights",
        # transformers' integer buffer, not a weight
        "cond_stage_model.transformer.text_model.embeddings.position_ids",
        "cond_stage_model.transformer.embeddings.position_ids",
    }
)

# The VAE mid attention's q/k/v/proj_out: 1x1 convs [C, C, 1, 1] in the original, linears [C, C] here.
VAE_CONV_LINEARS = re.compile(r"^decoder\.mid_block\.attentions\.0\.(to_q|to_k|to_v|to_out\.0)\.weight$")

Rule = tuple[re.Pattern[str], Callable[[re.Match[str], Any], str]]


def _rule(pattern: str, rename: Callable[[re.Match[str], Any], str]) -> Rule:
    return re.compile(pattern), rename


# --- UNet --------------------------------------------------------------------------------------

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def _unet_resnet(layer: str, rest: str) -> str:
    """`norm1.weight` -> `in_layers.0.weight` inside an original resnet at `layer`."""
    module, tensor = rest.split(".", 1)
    return f"{layer}.{_UNET_RESNET[module]}.{tensor}"


def _down_index(c: UNetConfig, block: int, layer: int) -> int:
    return 1 + block * (c.layers_per_block + 1) + layer


def _up_index(c: UNetConfig, block: int, layer: int) -> int:
    return block * (c.layers_per_block + 1) + layer


def _upsampler_slot(c: UNetConfig, block: int) -> int:
    """The upsampler follows the resnet (.0) and, in a cross-attention up block, the attention (.1)."""
    return 2 if c.up_block_types[block] == "CrossAttnUpBlock2D" else 1


# diffusers key -> original key (under "model.diffusion_model."); first match wins.
UNET_RULES: list[Rule] = [
    _rule(r"^conv_in\.(.+)$", lambda m, c: f"input_blocks.0.0.{m[1]}"),
    _rule(r"^time_embedding\.linear_1\.(.+)$", lambda m, c: f"time_embed.0.{m[1]}"),
    _rule(r"^time_embedding\.linear_2\.(.+)$", lambda m, c: f"time_embed.2.{m[1]}"),
    _rule(r"^conv_norm_out\.(.+)$", lambda m, c: f"out.0.{m[1]}"),
    _rule(r"^conv_out\.(.+)$", lambda m, c: f"out.2.{m[1]}"),
    _rule(
        r"^down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$",
        lambda m, c: _unet_resnet(f"input_blocks.{_down_index(c, int(m[1]), int(m[2]))}.0", m[3]),
    ),
    _rule(
        r"^down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)$",
        lambda m, c: f"input_blocks.{_down_index(c, int(m[1]), int(m[2]))}.1.{m[3]}",
    ),
    _rule(
        r"^down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)$",
        lambda m, c: f"input_blocks.{_down_index(c, int(m[1]), c.layers_per_block)}.0.op.{m[2]}",
    ),
    _rule(r"^mid_block\.resnets\.0\.(.+)$", lambda m, c: _unet_resnet("middle_block.0", m[1])),
    _rule(r"^mid_block\.attentions\.0\.(.+)$", lambda m, c: f"middle_block.1.{m[1]}"),
    _rule(r"^mid_block\.resnets\.1\.(.+)$", lambda m, c: _unet_resnet("middle_block.2", m[1])),
    _rule(
        r"^up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$",
        lambda m, c: _unet_resnet(f"output_blocks.{_up_index(c, int(m[1]), int(m[2]))}.0", m[3]),
    ),
    _rule(
        r"^up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)$",
        lambda m, c: f"output_blocks.{_up_index(c, int(m[1]), int(m[2]))}.1.{m[3]}",
    ),
    _rule(
        r"^up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)$",
        lambda m, c: (
            f"output_blocks.{_up_index(c, int(m[1]), c.layers_per_block)}"
            f".{_upsampler_slot(c, int(m[1]))}.conv.{m[2]}"
        ),
    ),
]

# --- VAE decoder -------------------------------------------------------------------------------

_VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae_resnet(layer: str, rest: str) -> str:
    module, tensor = rest.split(".", 1)
    return f"{layer}.{_VAE_RESNET[module]}.{tensor}"


def _vae_attention(rest: str) -> str:
    module, tensor = rest.rsplit(".", 1)
    return f"decoder.mid.attn_1.{_VAE_ATTENTION[module]}.{tensor}"


# diffusers key -> original key (under "first_stage_model."); first match wins.
VAE_RULES: list[Rule] = [
    _rule(r"^post_quant_conv\.(.+)$", lambda m, c: f"post_quant_conv.{m[1]}"),
    _rule(r"^decoder\.conv_in\.(.+)$", lambda m, c: f"decoder.conv_in.{m[1]}"),
    _rule(
        r"^decoder\.mid_block\.resnets\.(\d+)\.(.+)$",
        lambda m, c: _vae_resnet(f"decoder.mid.block_{int(m[1]) + 1}", m[2]),
    ),
    _rule(r"^decoder\.mid_block\.attentions\.0\.(.+)$", lambda m, c: _vae_attention(m[1])),
    _rule(
        r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$",
        lambda m, c: _vae_resnet(f"decoder.up.{len(c.block_out_channels) - 1 - int(m[1])}.block.{m[2]}", m[3]),
    ),
    _rule(
        r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)$",
        lambda m, c: f"decoder.up.{len(c.block_out_channels) - 1 - int(m[1])}.upsample.conv.{m[2]}",
    ),
    _rule(r"^decoder\.conv_norm_out\.(.+)$", lambda m, c: f"decoder.norm_out.{m[1]}"),
    _rule(r"^decoder\.conv_out\.(.+)$", lambda m, c: f"decoder.conv_out.{m[1]}"),
]

# --- CLIP text encoder -------------------------------------------------------------------------

TEXT_RULES: list[Rule] = [
    _rule(r"^(text_model\..+)$", lambda m, c: m[1]),  # transformers' names, unchanged
]

RULES = {"unet": UNET_RULES, "vae": VAE_RULES, "text_encoder": TEXT_RULES}
DEFAULT_CONFIGS = {"unet": UNetConfig, "vae": VAEConfig, "text_encoder": CLIPConfig}


def original_name(component: str, key: str, config) -> str:
    """The original checkpoint's full key for diffusers `key` of `component`."""
    for pattern, rename in RULES[component]:
        match = pattern.match(key)
        if match:
            return PREFIXES[component] + rename(match, config)
    raise KeyError(f"no {component} rule maps {key!r}")


def original_names(component: str, config=None) -> dict[str, str]:
    """{diffusers key: original key} for every parameter of `component` under `config` (SD 1.5 by default)."""
    config = DEFAULT_CONFIGS[component]() if config is None else config
    names = {key: original_name(component, key, config) for key in param_shapes(component, config)}
    assert len(set(names.values())) == len(names), f"{component} rules map two keys to one name"
    return names


def is_ignored(key: str) -> bool:
    """Whether an original-checkpoint key is known to be irrelevant to inference (EMA, encoder, buffers)."""
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


def component_of(key: str) -> str | None:
    """The network an original-checkpoint key belongs to, by its prefix; None for anything else."""
    for component, prefix in PREFIXES.items():
        if key.startswith(prefix):
            return component
    return None


def is_original_checkpoint(keys: Iterable[str]) -> bool:
    """Whether `keys` look like an original single-file checkpoint (any UNet/VAE/CLIP prefix)."""
    return any(component_of(key) is not None for key in keys)


def _legacy_text_key(key: str) -> str:
    """Checkpoints saved with transformers < 4.? have no `text_model.` level under the CLIP prefix."""
    prefix = PREFIXES["text_encoder"]
    if key.startswith(prefix) and not key.startswith(prefix + "text_model."):
        return prefix + "text_model." + key[len(prefix) :]
    return key


def to_diffusers(
    state_dict: Mapping[str, Any],
    unet_config: UNetConfig | None = None,
    vae_config: VAEConfig | None = None,
    text_config: CLIPConfig | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split an original checkpoint into diffusers-named (unet, vae, text_encoder) dicts.

    Ignored keys (`is_ignored`) are dropped. A key under a network's prefix that the rules do not
    produce stays in that network's dict under its full original name (so a shape check reports it
    as unexpected); keys under no prefix are not returned (`stray_keys` lists them).
    Configs default to full-size SD 1.5.
    """
    configs = {"unet": unet_config, "vae": vae_config, "text_encoder": text_config}
    inverse = {
        component: {original: key for key, original in original_names(component, config).items()}
        for component, config in configs.items()
    }
    out: dict[str, dict[str, Any]] = {component: {} for component in PREFIXES}
    for key, value in state_dict.items():
        if is_ignored(key):
            continue
        original = _legacy_text_key(key)
        component = component_of(original)
        if component is None:
            continue
        name = inverse[component].get(original, key)
        if component == "vae" and VAE_CONV_LINEARS.match(name) and value.ndim == 4 and value.shape[2:] == (1, 1):
            value = value.reshape(*value.shape[:2])
        out[component][name] = value
    return out["unet"], out["vae"], out["text_encoder"]


def stray_keys(keys: Iterable[str]) -> list[str]:
    """Keys of an original checkpoint that belong to no SD 1.5 network and are not known to be irrelevant."""
    return [key for key in keys if component_of(key) is None and not is_ignored(key)]


def from_diffusers(
    unet: Mapping[str, Any],
    vae: Mapping[str, Any],
    text_encoder: Mapping[str, Any],
    unet_config: UNetConfig | None = None,
    vae_config: VAEConfig | None = None,
    text_config: CLIPConfig | None = None,
) -> dict[str, Any]:
    """One original-format state dict from diffusers-named parameters (the inverse of `to_diffusers`).

    Every key must be a parameter of its network under the given config (SD 1.5 by default).
    """
    out: dict[str, Any] = {}
    for component, params, config in (
        ("unet", unet, unet_config),
        ("vae", vae, vae_config),
        ("text_encoder", text_encoder, text_config),
    ):
        names = original_names(component, config)
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise KeyError(f"{component}: not SD 1.5 parameters: {unknown}")
        for key, value in params.items():
            if component == "vae" and VAE_CONV_LINEARS.match(key):
                value = value.reshape(*value.shape, 1, 1)
            out[names[key]] = value
    return out
