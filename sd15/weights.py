"""Reading SD 1.5 weights from safetensors into the flat parameter dicts the JAX networks take.

    params, config = load_params("sd15-dir", "unet", dtype=jnp.bfloat16)
    everything = load_all_params("v1-5-pruned-emaonly.safetensors")   # {"unet": (params, config), ...}

Where a network's weights can be (`locate`):

    pipeline folder    model_index.json, unet/, vae/, text_encoder/  (diffusers `save_pretrained`)
    component folder   config.json + diffusion_pytorch_model[.fp16].safetensors | model[.fp16].safetensors
    single file        *.safetensors with model.diffusion_model.*, first_stage_model.*,
                       cond_stage_model.transformer.* (the original CompVis layout, `sd15.single_file`)

Names are normalized to `sd15.params.param_shapes` (text encoders saved without the `text_model.`
level get it back, the old diffusers VAE attention names `query/key/value/proj_attn` become
`to_q/to_k/to_v/to_out.0`), known-irrelevant tensors are dropped unread, and the rest is checked
against the expected names and shapes BEFORE any tensor is read: a bad checkpoint raises one
`CheckpointError` naming every missing, unexpected and mis-shaped tensor, and returns nothing.
Tensors are cast to the requested dtype (float32, float16 or bfloat16 files alike).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sd15 import single_file
from sd15.config import CLIPConfig, UNetConfig, VAEConfig
from sd15.params import param_shapes

COMPONENTS = ("unet", "vae", "text_encoder")
CONFIG_CLASSES = {"unet": UNetConfig, "vae": VAEConfig, "text_encoder": CLIPConfig}
WEIGHT_NAMES = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' file stems

Config = UNetConfig | VAEConfig | CLIPConfig
Params = dict[str, jax.Array]


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match SD 1.5: lists every problem at once.

    `missing`, `unexpected` and `mismatched` hold (component, name[, expected, found]) entries.
    """

    def __init__(self, source: str, missing=(), unexpected=(), mismatched=()):
        self.source = source
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        lines = [f"{component}: missing {name} (expected shape {shape})" for component, name, shape in self.missing]
        lines += [f"{component}: unexpected {name} (shape {shape})" for component, name, shape in self.unexpected]
        lines += [
            f"{component}: wrong shape {name}: expected {expected}, found {found}"
            for component, name, expected, found in self.mismatched
        ]
        count = len(lines)
        super().__init__(
            f"{source} does not match SD 1.5 ({count} problem{'s' * (count != 1)}):\n  " + "\n  ".join(lines)
        )


# --- reading safetensors lazily ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file, by name and shape; `read_tensors` reads the values."""

    file: Path
    key: str
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int) -> Tensor:
        """The same values under another shape (applied when read), as `single_file` reshapes arrays."""
        return dataclasses.replace(self, shape=tuple(shape))


def read_index(path: Path) -> dict[str, Tensor]:
    """{key: Tensor} of a safetensors file, reading only its header."""
    from safetensors import safe_open

    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: only .safetensors checkpoints are supported (convert .ckpt/.bin files first)")
    with safe_open(path, framework="np") as f:
        return {key: Tensor(path, key, tuple(f.get_slice(key).get_shape())) for key in f.keys()}


def read_tensors(tensors: dict[str, Tensor], dtype) -> Params:
    """Read and cast every tensor, one file open per file; floating tensors become `dtype`."""
    from safetensors import safe_open

    dtype = jnp.dtype(dtype)
    out: Params = {}
    by_file: dict[Path, list[tuple[str, Tensor]]] = {}
    for name, tensor in tensors.items():
        by_file.setdefault(tensor.file, []).append((name, tensor))
    for file, entries in by_file.items():
        with safe_open(file, framework="np") as f:
            for name, tensor in entries:
                array = f.get_tensor(tensor.key).reshape(tensor.shape)
                if np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16":
                    array = array.astype(dtype, copy=False)
                out[name] = jnp.asarray(array)
    return out


# --- where the weights are -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Location:
    """Where one network's weights live: a component folder / bare weights file, or a single file."""

    kind: str  # "component" or "single_file"
    weights: Path
    config_file: Path | None  # config.json of a component; None for single files or when absent


def _weights_file(folder: Path, prefer_half: bool) -> Path:
    """The safetensors file of a component folder; the `.fp16` variant first when loading 16-bit."""
    full = [folder / f"{stem}.safetensors" for stem in WEIGHT_NAMES]
    half = [folder / f"{stem}.fp16.safetensors" for stem in WEIGHT_NAMES]
    for candidate in (half + full) if prefer_half else (full + half):
        if candidate.is_file():
            return candidate
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".ckpt", ".pt", ".safetensors"))
    hint = f" (found {others}; only safetensors are read)" if others else ""
    raise FileNotFoundError(f"{folder}: no weights file; expected one of {[p.name for p in full + half]}{hint}")


def _is_half(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 2


def check_exists(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")


def locate(path: str | os.PathLike, component: str, prefer_half: bool = False) -> Location:
    """Find `component`'s weights under `path` (a pipeline folder, component folder or file)."""
    path = Path(path).expanduser()
    check_exists(path)
    if path.is_file():
        if single_file.is_original_checkpoint(read_index(path)):
            return Location("single_file", path, None)
        config_file = path.parent / "config.json"
        return Location("component", path, config_file if config_file.is_file() else None)
    folder = path / component if (path / component).is_dir() else path
    if folder is path and (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path} is a pipeline folder without a {component}/ folder")
    config_file = folder / "config.json"
    return Location("component", _weights_file(folder, prefer_half), config_file if config_file.is_file() else None)


def is_single_file(path: str | os.PathLike) -> bool:
    """Whether `path` is an original-format single-file checkpoint."""
    path = Path(path)
    return path.is_file() and single_file.is_original_checkpoint(read_index(path))


def read_config(component: str, location: Location, config: Config | None) -> Config:
    """The given config, else the component's config.json, else full-size SD 1.5."""
    if config is not None:
        return config
    if location.config_file is not None:
        return CONFIG_CLASSES[component].from_dict(json.loads(location.config_file.read_text()))
    return CONFIG_CLASSES[component]()


# --- diffusers/transformers names -> param_shapes names --------------------------------------------

# Tensors a diffusers/transformers component folder holds that SD 1.5 inference never reads.
_IGNORED = {
    "unet": re.compile(r"(?!)"),  # nothing
    "vae": re.compile(r"^(encoder\.|quant_conv\.)"),
    "text_encoder": re.compile(r"^(text_model\.)?embeddings\.position_ids$"),
}
_TEXT_MODEL_ROOTS = ("embeddings.", "encoder.", "final_layer_norm.")
_OLD_VAE_ATTENTION = re.compile(r"^(decoder\.mid_block\.attentions\.0)\.(query|key|value|proj_attn)\.(weight|bias)$")
_NEW_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def normalize_name(component: str, key: str) -> str:
    """A diffusers/transformers component key as `param_shapes` names it."""
    if component == "text_encoder" and key.startswith(_TEXT_MODEL_ROOTS):
        return "text_model." + key  # transformers 5 saves CLIPTextModel without its `text_model.` level
    if component == "vae":
        match = _OLD_VAE_ATTENTION.match(key)
        if match:  # diffusers < 0.14 names, still in the published SD 1.5 VAE
            return f"{match[1]}.{_NEW_VAE_ATTENTION[match[2]]}.{match[3]}"
    return key


def _as_linear(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """VAE attention weights stored as 1x1 convs [C, C, 1, 1] are linears [C, C]."""
    if single_file.VAE_CONV_LINEARS.match(name) and len(shape) == 4 and shape[2:] == (1, 1):
        return shape[:2]
    return shape


def component_tensors(component: str, index: dict[str, Tensor]) -> dict[str, Tensor]:
    """{param name: Tensor} of a diffusers/transformers component file (ignored tensors dropped)."""
    out = {}
    for key, tensor in index.items():
        if _IGNORED[component].match(key):
            continue
        name = normalize_name(component, key)
        out[name] = dataclasses.replace(tensor, shape=_as_linear(name, tensor.shape))
    return out


def single_file_tensors(
    index: dict[str, Tensor], configs: dict[str, Config]
) -> tuple[dict[str, dict[str, Tensor]], dict[str, dict[str, str]], list[str]]:
    """Split a single-file index by network: ({component: {param name: Tensor}}, display names, strays).

    Display names are "original name (diffusers name)" for the error message; strays are keys of
    no network.
    """
    unet, vae, text = single_file.to_diffusers(index, configs["unet"], configs["vae"], configs["text_encoder"])
    split = {"unet": unet, "vae": vae, "text_encoder": text}
    names = {}
    for component in split:
        names[component] = {
            key: f"{original} ({key})"
            for key, original in single_file.original_names(component, configs[component]).items()
        }
    return split, names, single_file.stray_keys(index)


# --- validation ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problems:
    """Missing/unexpected/mis-shaped tensors gathered over every network of a checkpoint."""

    missing: list = dataclasses.field(default_factory=list)
    unexpected: list = dataclasses.field(default_factory=list)
    mismatched: list = dataclasses.field(default_factory=list)

    def check(self, component: str, tensors: dict[str, Tensor], config: Config, names: dict[str, str] | None = None):
        names = names or {}
        expected = param_shapes(component, config)
        for key, shape in expected.items():
            if key not in tensors:
                self.missing.append((component, names.get(key, key), shape))
            elif tensors[key].shape != shape:
                self.mismatched.append((component, names.get(key, key), shape, tensors[key].shape))
        for key in tensors:
            if key not in expected:
                self.unexpected.append((component, key, tensors[key].shape))

    def raise_if_any(self, source: Path) -> None:
        if self.missing or self.unexpected or self.mismatched:
            raise CheckpointError(str(source), self.missing, self.unexpected, self.mismatched)


# --- loading ---------------------------------------------------------------------------------------


def load_params(
    path: str | os.PathLike, component: str, dtype=jnp.float32, config: Config | None = None
) -> tuple[Params, Config]:
    """(params, config) of one network from a pipeline folder, component folder or single file.

    `config` overrides the folder's config.json (and is required for non-SD-1.5 single files, which
    carry no config). Raises `CheckpointError` listing every bad tensor; nothing is read before
    the whole checkpoint has passed the check.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown {component=}; expected one of {COMPONENTS}")
    location = locate(path, component, prefer_half=_is_half(dtype))
    resolved = read_config(component, location, config)
    problems = Problems()
    if location.kind == "single_file":
        configs = {c: (resolved if c == component else None) for c in COMPONENTS}
        configs = {c: conf or CONFIG_CLASSES[c]() for c, conf in configs.items()}
        split, names, _ = single_file_tensors(read_index(location.weights), configs)
        tensors = split[component]
        problems.check(component, tensors, resolved, names[component])
    else:
        tensors = component_tensors(component, read_index(location.weights))
        problems.check(component, tensors, resolved)
    problems.raise_if_any(location.weights)
    return read_tensors(tensors, dtype), resolved


def load_all_params(
    path: str | os.PathLike, dtype=jnp.float32, configs: dict[str, Config | None] | None = None
) -> dict[str, tuple[Params, Config]]:
    """{component: (params, config)} for the UNet, VAE decoder and text encoder of one checkpoint.

    All three networks (and, for a single file, its keys outside them) are checked first; the one
    `CheckpointError` lists every problem across them.
    """
    configs = dict(configs or {})
    path = Path(path).expanduser()
    check_exists(path)
    problems = Problems()
    loaded: dict[str, tuple[dict[str, Tensor], Config]] = {}
    if is_single_file(path):
        resolved = {c: configs.get(c) or CONFIG_CLASSES[c]() for c in COMPONENTS}
        index = read_index(path)
        split, names, strays = single_file_tensors(index, resolved)
        for component in COMPONENTS:
            problems.check(component, split[component], resolved[component], names[component])
            loaded[component] = (split[component], resolved[component])
        problems.unexpected += [("checkpoint", key, index[key].shape) for key in strays]
        problems.raise_if_any(path)
    else:
        for component in COMPONENTS:
            location = locate(path, component, prefer_half=_is_half(dtype))
            config = read_config(component, location, configs.get(component))
            tensors = component_tensors(component, read_index(location.weights))
            problems.check(component, tensors, config)
            loaded[component] = (tensors, config)
        problems.raise_if_any(path)
    return {component: (read_tensors(tensors, dtype), config) for component, (tensors, config) in loaded.items()}
