"""`sd15 plan`: kernel plans for full-size SD 1.5 with no weights, ours against XLA's.

    sd15 plan                                  # UNet CFG step (batch 2), VAE decoder, text encoder
    sd15 plan --json --components unet
    python -m sd15.plan_cli plan --config tiny --json

The components are `sd15.workloads` (abstract parameters, no weights); what is measured for each,
and the table, are `measure.compare`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

import jax.numpy as jnp

from measure.compare import EMIT_BACKENDS, compare
from measure.compare import render as measure_render
from sd15.config import VAEConfig
from sd15.workloads import COMPONENT_TITLES, COMPONENTS, workloads


def run_plan(
    batch: int = 2,
    size: int | None = None,
    dtype: str = "float16",
    components=COMPONENTS,
    device: str = "h100",
    config: str = "full",
    xla: bool = True,
    optimize: bool = True,
    emit: bool = True,
    log: Callable[[str], None] | None = None,
    backend: str = "pallas",
) -> dict[str, Any]:
    """Measure every component; the result is what `--json` prints. A component whose emitted
    executable fails to compile keeps its row, with `emit_error` naming the kernel (also listed in
    the report's `errors`)."""
    log = log or (lambda message: None)
    report: dict[str, Any] = {"batch": batch, "size": size, "dtype": str(jnp.dtype(dtype)), "device": device,
                              "config": config, "backend": backend}
    work = workloads(batch, size, dtype, config, components)
    report["size"] = size if size is not None else (VAEConfig() if config == "full" else VAEConfig.tiny()).sample_size

    report["title"] = _title(report, work)
    return compare(work, device=device, xla=xla, optimize=optimize, emit=emit, log=log, report=report, backend=backend)


def render(report: dict[str, Any], console=None) -> None:
    """`measure.compare.render`, titled by the SD 1.5 components the report holds."""
    measure_render({**report, "title": report.get("title") or _title(report, report["components"])}, console)


def _title(report: dict[str, Any], work) -> str:
    parts = [COMPONENT_TITLES.get(name, name) for name in work]
    return (f"SD 1.5 kernel plans: {', '.join(parts)} ({report['config']} config, {report['dtype']}, "
            f"target {report['device']}, backend {report.get('backend', 'pallas')})")


# --- the command -------------------------------------------------------------------------------


def _components(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in COMPONENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"components must be some of {','.join(COMPONENTS)}; got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` options (shared with benchmarks/sd15_plan.py)."""
    parser.add_argument("--batch", type=int, default=2, help="UNet guidance batch [uncond, cond] (even; default 2)")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default 512)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--components", type=_components, default=COMPONENTS, help="comma list of unet,vae,text_encoder (default all)"
    )
    parser.add_argument("--device", default="h100", choices=("h100",), help="the device profile and XLA target")
    parser.add_argument("--backend", default="pallas", choices=EMIT_BACKENDS,
                        help="how our executable emits its kernels: pallas (Triton templates), mosaic (Mosaic GPU "
                             "templates for matmul, conv and attention where they cover the kernel, Triton for the "
                             "rest) or hybrid (convs and matmuls through cuDNN/cuBLAS)")
    parser.add_argument("--no-xla", dest="xla", action="store_false", help="skip XLA's H100 compile")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false", help="skip the eqsat optimizer")
    parser.add_argument("--no-emit", dest="emit", action="store_false",
                        help="skip compiling our emitted executable for the H100 (the slow part)")
    parser.add_argument("--config", default="full", choices=("full", "tiny"), help=argparse.SUPPRESS)


def plan_command(options: argparse.Namespace) -> int:
    """Run `sd15 plan` with parsed options; prints the table or the JSON. Exit status 1 when an
    emitted executable failed to compile (the report names the kernel)."""
    # Planning only traces: keep this process on the CPU backend (the H100 compile runs in a
    # subprocess of its own), so an installed CUDA plugin without a GPU stays quiet.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    def log(message):
        if not options.json:
            print(message, file=sys.stderr, flush=True)

    report = run_plan(
        batch=options.batch, size=options.size, dtype=options.dtype, components=options.components,
        device=options.device, config=options.config, xla=options.xla, optimize=options.optimize,
        emit=options.emit, log=log, backend=options.backend,
    )
    if options.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        render(report)
    return 1 if report["errors"] else 0


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on the `sd15` CLI's subparsers (`options.func(options)` runs it)."""
    parser = subparsers.add_parser(
        "plan",
        help="kernel plan of full-size SD 1.5 (no weights needed), against XLA for an H100",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(parser)
    parser.set_defaults(func=plan_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m sd15.plan_cli plan ...` (the same command without the rest of the sd15 CLI)."""
    parser = argparse.ArgumentParser(prog="sd15")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    options = parser.parse_args(argv)
    return options.func(options)


if __name__ == "__main__":
    sys.exit(main())
