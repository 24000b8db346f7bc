"""Configurations of the three SD 1.5 networks.

Each dataclass mirrors the `config.json` that diffusers (UNet, VAE) or transformers (CLIP text
encoder) writes next to the weights. Defaults are Stable Diffusion 1.5's full-size values, so
`UNetConfig()` describes `runwayml/stable-diffusion-v1-5/unet` with no file at hand; `tiny()` is
a small random-test configuration (the one the test fixtures in `tests/conftest.py` build).

`from_dict` takes a loaded `config.json`, ignores keys these models do not read (`_class_name`,
`act_fn`, ...), and refuses options SD 1.5 never uses rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CROSS_ATTN_DOWN = "CrossAttnDownBlock2D"
DOWN = "DownBlock2D"
CROSS_ATTN_UP = "CrossAttnUpBlock2D"
UP = "UpBlock2D"
UP_DECODER = "UpDecoderBlock2D"


def _known_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in d.items():
        if key in names:
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


def _refuse_unsupported(d: dict[str, Any], supported: dict[str, tuple[Any, ...]], what: str) -> None:
    """Raise if `d` sets an option to a value outside `supported[key]` (absent keys are fine)."""
    for key, allowed in supported.items():
        if key in d and d[key] not in allowed:
            raise ValueError(f"{what}: {key}={d[key]!r} is not supported (supported: {allowed})")


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """diffusers `UNet2DConditionModel` restricted to the SD 1.x/2.x family.

    `attention_head_dim` is, as in diffusers' SD 1.5 configs, the NUMBER OF HEADS (one int, or one
    per down block; up blocks use the list reversed, the mid block the last entry).
    """

    sample_size: int = 64
    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple[str, ...] = (CROSS_ATTN_DOWN, CROSS_ATTN_DOWN, CROSS_ATTN_DOWN, DOWN)
    up_block_types: tuple[str, ...] = (UP, CROSS_ATTN_UP, CROSS_ATTN_UP, CROSS_ATTN_UP)
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    attention_head_dim: int | tuple[int, ...] = 8
    cross_attention_dim: int = 768
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    use_linear_projection: bool = False

    def __post_init__(self):
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError(f"{self.down_block_types=} and {self.up_block_types=} need {n} entries each")
        if any(t not in (CROSS_ATTN_DOWN, DOWN) for t in self.down_block_types):
            raise ValueError(f"unsupported {self.down_block_types=}")
        if any(t not in (CROSS_ATTN_UP, UP) for t in self.up_block_types):
            raise ValueError(f"unsupported {self.up_block_types=}")
        if not isinstance(self.attention_head_dim, int) and len(self.attention_head_dim) != n:
            raise ValueError(f"{self.attention_head_dim=} needs one entry per down block ({n})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UNetConfig:
        _refuse_unsupported(
            d,
            {
                "act_fn": ("silu",),
                "center_input_sample": (False,),
                "downsample_padding": (1,),
                "mid_block_scale_factor": (1, 1.0),
                "mid_block_type": ("UNetMidBlock2DCrossAttn",),
                "num_attention_heads": (None,),
                "class_embed_type": (None,),
                "addition_embed_type": (None,),
                "time_embedding_type": ("positional",),
                "time_cond_proj_dim": (None,),
                "transformer_layers_per_block": (1,),
                "resnet_time_scale_shift": ("default",),
                "only_cross_attention": (False,),
                "dual_cross_attention": (False,),
                "conv_in_kernel": (3,),
                "conv_out_kernel": (3,),
                "encoder_hid_dim": (None,),
            },
            "UNetConfig",
        )
        return cls(**_known_fields(cls, d))

    @classmethod
    def tiny(cls) -> UNetConfig:
        """Two levels (cross-attention + plain), per-block heads (2, 4): every block type, small."""
        return cls(
            sample_size=8,
            down_block_types=(CROSS_ATTN_DOWN, DOWN),
            up_block_types=(UP, CROSS_ATTN_UP),
            block_out_channels=(32, 64),
            layers_per_block=1,
            attention_head_dim=(2, 4),
            cross_attention_dim=32,
            norm_num_groups=8,
        )

    def heads(self, block: int) -> int:
        """Number of attention heads of down block `block` (the diffusers `attention_head_dim[block]`)."""
        if isinstance(self.attention_head_dim, int):
            return self.attention_head_dim
        return self.attention_head_dim[block]

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """diffusers `AutoencoderKL`; only the decoder half (`post_quant_conv`, `decoder`) is modelled."""

    sample_size: int = 512
    latent_channels: int = 4
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VAEConfig:
        _refuse_unsupported(
            d,
            {
                "act_fn": ("silu",),
                "use_post_quant_conv": (True,),
                "mid_block_add_attention": (True,),
                "shift_factor": (None, 0, 0.0),
            },
            "VAEConfig",
        )
        if any(t != UP_DECODER for t in d.get("up_block_types", ())):
            raise ValueError(f"VAEConfig: unsupported up_block_types={d['up_block_types']!r}")
        return cls(**_known_fields(cls, d))

    @classmethod
    def tiny(cls) -> VAEConfig:
        """Two levels (one 2x upsample): 8x8 latents decode to 16x16 images."""
        return cls(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8)


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """transformers `CLIPTextConfig` (CLIP ViT-L/14's text tower for SD 1.5).

    The token ids are copied from SD 1.5's `text_encoder/config.json` (bos 0, eos 2, pad 1), which
    are stale values: the SD 1.5 tokenizer's real ids are bos 49406 and eos = pad 49407. Nothing in
    `sd15.clip.apply` reads them; pad prompts with the tokenizer's ids, not these.
    """

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    bos_token_id: int = 0
    eos_token_id: int = 2
    pad_token_id: int = 1

    def __post_init__(self):
        if self.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(f"unsupported {self.hidden_act=}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{self.hidden_size=} must be a multiple of {self.num_attention_heads=}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CLIPConfig:
        return cls(**_known_fields(cls, d))

    @classmethod
    def tiny(cls) -> CLIPConfig:
        """Hidden size 32 (the tiny UNet's cross_attention_dim); full vocabulary so real token ids fit."""
        return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
