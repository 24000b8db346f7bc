"""SD 1.5's prompt tokenizer: CLIP's byte-level BPE, padded and truncated to 77 tokens.

    tokenizer = load_tokenizer("stable-diffusion-v1-5")     # or its tokenizer/ folder
    ids = tokenizer(["a photo of a cat", ""])              # int32 [2, 77]: <|startoftext|> ... <|endoftext|> pad...

The BPE itself is transformers' `CLIPTokenizer` (the one diffusers' pipeline calls), built from
`vocab.json` + `merges.txt` (or `tokenizer.json`). Prompts are padded with the tokenizer's pad token
(`<|endoftext|>` for SD 1.5) to `model_max_length` from `tokenizer_config.json`, or 77 when that is
absent; longer prompts are truncated, keeping the end token, with a warning saying how many tokens
were dropped.

Single-file checkpoints carry no tokenizer. `load_tokenizer(None)` then looks for CLIP's own
`bpe_simple_vocab_16e6.txt.gz` in an installed package that ships it (open_clip, OpenAI's clip) and
builds the same 49,408-token vocabulary from it; otherwise it says how to point at one.

`tiny_tokenizer()` is a vocabulary for random test models: the 256 byte symbols, each also as a
word end (`a</w>`), and the two special tokens, no merges (so every character is one token).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np

MAX_LENGTH = 77  # CLIP ViT-L/14's max_position_embeddings
START, END = "<|startoftext|>", "<|endoftext|>"
BPE_VOCABULARY = "bpe_simple_vocab_16e6.txt.gz"
BUNDLING_PACKAGES = ("open_clip", "clip")  # packages known to ship BPE_VOCABULARY next to their code
CLIP_MERGES = 49152 - 256 - 2  # the merges CLIP uses from its vocabulary file (simple_tokenizer.py)

HOW_TO_PROVIDE = (
    "pass tokenizer=PATH (CLI: --tokenizer PATH) pointing at a folder with vocab.json and merges.txt, "
    "e.g. the tokenizer/ folder of stable-diffusion-v1-5 or of openai/clip-vit-large-patch14, "
    f"or install open_clip_torch, which ships CLIP's {BPE_VOCABULARY}"
)


class Tokenizer:
    """Prompts -> int32 token ids [B, max_length], as diffusers' StableDiffusionPipeline tokenizes them."""

    def __init__(self, clip_tokenizer, max_length: int | None = None):
        self.clip_tokenizer = clip_tokenizer  # a transformers CLIPTokenizer
        configured = clip_tokenizer.model_max_length
        self.max_length = max_length or (configured if configured <= 1_000_000 else MAX_LENGTH)

    @property
    def vocab_size(self) -> int:
        return len(self.clip_tokenizer)

    def __call__(self, prompts: str | list[str]) -> np.ndarray:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        for prompt in prompts:
            length = len(self.clip_tokenizer(prompt).input_ids)
            if length > self.max_length:
                warnings.warn(
                    f"prompt is {length} tokens long with its start and end tokens; the last "
                    f"{length - self.max_length} were dropped (CLIP reads {self.max_length}): {prompt[:60]!r}...",
                    stacklevel=2,
                )
        ids = self.clip_tokenizer(prompts, padding="max_length", max_length=self.max_length, truncation=True).input_ids
        return np.asarray(ids, np.int32)


def _clip_tokenizer_class():
    try:
        from transformers import CLIPTokenizer
    except ImportError as error:
        raise ImportError("the SD 1.5 tokenizer needs transformers: pip install 'eqsat[tokenizer]'") from error
    return CLIPTokenizer


def has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    )


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer in `path` (a tokenizer folder, or a pipeline folder holding `tokenizer/`).

    With no tokenizer files there (a single-file checkpoint, or `path=None`), CLIP's vocabulary from
    an installed package (see `find_bundled_vocabulary`); failing that, a FileNotFoundError that
    says how to provide one.
    """
    if path is not None:
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path {path} does not exist")
        for folder in (path, path / "tokenizer"):
            if folder.is_dir() and has_tokenizer_files(folder):
                return Tokenizer(_clip_tokenizer_class().from_pretrained(folder, local_files_only=True))
    bundled = find_bundled_vocabulary()
    if bundled is not None:
        return from_bpe_vocabulary(bundled)
    where = f"in {path} " if path is not None else ""
    raise FileNotFoundError(f"no CLIP tokenizer {where}and none installed: {HOW_TO_PROVIDE}")


def find_bundled_vocabulary() -> Path | None:
    """CLIP's `bpe_simple_vocab_16e6.txt.gz` from an installed package, found without importing it."""
    for name in BUNDLING_PACKAGES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(folder) / BPE_VOCABULARY
            if candidate.is_file():
                return candidate
    return None


@functools.cache
def byte_symbols() -> tuple[str, ...]:
    """GPT-2/CLIP `bytes_to_unicode`: a printable character per byte, in CLIP's vocabulary order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    return tuple(chr(code) for code in codes)


def from_bpe_vocabulary(path: str | os.PathLike) -> Tokenizer:
    """CLIP's tokenizer from its `bpe_simple_vocab_16e6.txt.gz`, as OpenAI's simple_tokenizer builds it.

    vocab = byte symbols, the same as word ends (`</w>`), one token per merge, then the two special
    tokens: 49,408 entries, the same ids as SD 1.5's vocab.json.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : CLIP_MERGES + 1] if line.strip()]
    return _from_merges(merges)


def _from_merges(merges: list[tuple[str, str]]) -> Tokenizer:
    symbols = byte_symbols()
    vocab = [*symbols, *(symbol + "</w>" for symbol in symbols), *("".join(merge) for merge in merges), START, END]
    tokenizer = _clip_tokenizer_class()(
        vocab={token: i for i, token in enumerate(vocab)}, merges=merges, model_max_length=MAX_LENGTH
    )
    return Tokenizer(tokenizer)


def tiny_tokenizer() -> Tokenizer:
    """A 514-token byte-level vocabulary with no merges, for random test models (any vocab_size >= 514)."""
    return _from_merges([])
