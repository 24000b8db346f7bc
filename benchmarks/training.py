"""A fine-tuning step of the SD 1.5 UNet, ours against XLA's, compiled for an H100 without a GPU.

    python -m benchmarks.training                     # full size: fp16, batch 2, 64x64 latents
    python -m benchmarks.training --json              # the report as JSON on stdout
    python -m benchmarks.training --tiny              # the test-sized UNet (UNetConfig.tiny(), 8x8 latents)

The step is `jax.value_and_grad` of the MSE between the UNet's predicted noise and the noise, with
respect to every parameter. Ours is `jax.value_and_grad(eqsat.optimize(loss, backend="pallas"))`:
the forward plan (primal loss and the residuals the backward reads) and the backward plan, both
emitted as Pallas kernels (driver/differentiate.py); XLA's is `jax.jit(jax.value_and_grad(loss))`.
Both are compiled for an H100 by `measure.xla_target` from abstract arguments (`jax.ShapeDtypeStruct`
parameters, `sd15.params.abstract_params`): nothing runs at full size, nothing needs a GPU.

Per side: kernels launched (the thunk sequence's device kernels; copies and memsets apart),
temporary memory, compile seconds. Ours adds the plans: kernels of the forward and backward plans,
the residuals kept between them and their bytes, and the planning seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from sd15 import params as sd15_params
from sd15 import unet
from sd15.config import UNetConfig

TEXT_LENGTH = 77
# As `sd15 plan`: a loaded machine must not cut extraction at a point the compile subprocess, which
# plans again (its plans come from the plan cache the parent filled), would not reach.
EXTRACT_TIME_LIMIT = 120.0


def noise_prediction_loss(unet_params, noisy_latents, timesteps, context, noise, *, config: UNetConfig):
    """The fine-tuning loss: mean squared error of the UNet's predicted noise, in float32."""
    predicted = unet.apply(unet_params, config, noisy_latents, timesteps, context).astype(jnp.float32)
    return jnp.mean(jnp.square(predicted - noise))


def step_arguments(config: UNetConfig, batch: int, latent: int, dtype) -> tuple:
    spec = jax.ShapeDtypeStruct
    latents = (batch, config.in_channels, latent, latent)
    return (sd15_params.abstract_params("unet", config, dtype=dtype), spec(latents, jnp.float32),
            spec((batch,), jnp.int32), spec((batch, TEXT_LENGTH, config.cross_attention_dim), dtype),
            spec(latents, jnp.float32))


def jax_step(loss, *args):
    return jax.value_and_grad(loss)(*args)


def our_step(optimized, *args):
    return jax.value_and_grad(optimized)(*args)


def plan_ours(optimized, args) -> dict[str, Any]:
    """Trace our step abstractly (plans the forward and the backward, fills the plan cache the
    compile subprocess reads) and report the two plans."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.eval_shape(functools.partial(our_step, optimized), *args)
    wall = time.perf_counter() - start
    (planned,) = optimized.planned_vjps
    forward, backward = planned.forward.lowerings[0], planned.backward.lowerings[0]
    kept = [a for a, (kind, _) in zip(_forward_outputs(planned, args), planned.residuals.sources) if kind == "output"]
    return {
        "forward_plan_kernels": forward.stats["fused_kernels"],
        "forward_naive_kernels": forward.stats["naive_kernels"],
        "backward_plan_kernels": backward.stats["fused_kernels"],
        "backward_naive_kernels": backward.stats["naive_kernels"],
        "forward_kinds": forward.stats["kinds"],
        "backward_kinds": backward.stats["kinds"],
        "residual_outputs": len(kept),
        "residual_inputs": sum(kind == "input" for kind, _ in planned.residuals.sources),
        "residual_bytes": sum(a.size * a.dtype.itemsize for a in kept),
        "forward_plan_peak_bytes": forward.stats["plan_peak_bytes"],
        "backward_plan_peak_bytes": backward.stats["plan_peak_bytes"],
        "plan_seconds": wall,
    }


def _forward_outputs(planned, args) -> list:
    """The abstract residual outputs of the forward plan, in `residuals.sources` order."""
    leaves = jax.tree_util.tree_leaves(args)
    _, kept = jax.eval_shape(planned.forward.fn, *leaves)
    kept = iter(kept)
    return [next(kept) if kind == "output" else leaves[i] for kind, i in planned.residuals.sources]


def compiled(report) -> dict[str, Any]:
    return {"kernels": report.kernels, "copies": report.copies, "memsets": report.memsets,
            "temp_bytes": report.temp_bytes, "compile_seconds": report.compile_seconds,
            "wall_seconds": report.wall_seconds, "kernels_by_category": report.by_category}


def run(tiny: bool = False, batch: int = 2, dtype: str = "float16", backend: str = "pallas",
        log=lambda message: None, compile: bool = True) -> dict[str, Any]:
    import eqsat
    from measure import xla_target

    config = UNetConfig.tiny() if tiny else UNetConfig()
    latent = config.sample_size if tiny else 64
    args = step_arguments(config, batch, latent, jnp.dtype(dtype))
    loss = functools.partial(noise_prediction_loss, config=config)
    report: dict[str, Any] = {"config": "tiny" if tiny else "full", "batch": batch, "latent": latent, "dtype": dtype,
                              "device": "h100", "backend": backend, "parameters": len(jax.tree_util.tree_leaves(args[0])),
                              "parameter_bytes": sum(a.size * a.dtype.itemsize
                                                     for a in jax.tree_util.tree_leaves(args[0]))}
    optimized = eqsat.optimize(loss, backend=backend, device="h100", progress=False,
                               extract_time_limit=EXTRACT_TIME_LIMIT)
    log("planning our forward and backward ...")
    report["plans"] = plan_ours(optimized, args)
    report["ours"] = report["xla"] = report["ours_error"] = None
    if not compile:
        report["unavailable"] = "compiles skipped (--no-compile)"
        return report
    log(f"planned in {report['plans']['plan_seconds']:.1f} s; compiling ours for an H100 ...")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", xla_target.XlaTargetWarning)
        try:
            ours = xla_target.compile_for_h100(functools.partial(our_step, optimized), *args)
        except RuntimeError as error:  # our executable did not compile: said, XLA's side still measured
            ours, report["ours_error"] = None, str(error).strip().splitlines()[-1]
            log(f"ours failed to compile: {report['ours_error']}")
        if ours is not None or report["ours_error"]:
            log(f"ours: {ours.summary() if ours else 'failed'}; compiling XLA's ...")
            theirs = xla_target.compile_for_h100(functools.partial(jax_step, loss), *args)
            report["xla"] = compiled(theirs) if theirs is not None else None
    if report["xla"] is None:
        report["unavailable"] = "; ".join(str(w.message) for w in caught) or "the H100 target is unavailable"
        return report
    if ours is not None:
        report["ours"] = compiled(ours)
        report["fewer_kernels"] = ours.kernels < theirs.kernels
        report["temp_no_larger"] = ours.temp_bytes <= theirs.temp_bytes
    return report


def table(report: dict[str, Any]) -> str:
    plans = report["plans"]
    lines = [f"SD 1.5 UNet fine-tuning step ({report['config']}, {report['dtype']}, batch {report['batch']}, "
             f"{report['latent']}x{report['latent']} latents, grads of {report['parameters']} parameters) on an H100",
             f"our plans: forward {plans['forward_naive_kernels']} -> {plans['forward_plan_kernels']} kernels, "
             f"backward {plans['backward_naive_kernels']} -> {plans['backward_plan_kernels']} kernels; "
             f"{plans['residual_outputs']} residuals kept ({plans['residual_bytes'] / 2**20:,.1f} MiB) + "
             f"{plans['residual_inputs']} inputs; planned in {plans['plan_seconds']:.1f} s"]
    if report["xla"] is None:
        return "\n".join(lines + [f"compiled columns empty: {report['unavailable']}"])
    if report["ours"] is None:
        lines.append(f"ours did not compile for the H100: {report['ours_error']}")
    ours = report["ours"] or {}
    rows = [("", f"ours ({report['backend']})", "jax.jit"), *(
        (name, fmt(ours[key]) if key in ours else "-", fmt(report["xla"][key])) for name, key, fmt in (
            ("kernels", "kernels", str), ("copies", "copies", str), ("memsets", "memsets", str),
            ("temp memory", "temp_bytes", lambda b: f"{b / 2**20:,.1f} MiB"),
            ("compile", "compile_seconds", lambda s: f"{s:.1f} s")))]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines += ["  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the test-sized UNet (UNetConfig.tiny(), 8x8 latents)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--backend", default="pallas", help="our backend: pallas (every kernel emitted) or hybrid "
                        "(matmuls and convs through XLA's libraries)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="plan both sides' passes only (no H100 compile: minutes saved, no launch counts)")
    options = parser.parse_args(argv)
    start = time.perf_counter()
    report = run(tiny=options.tiny, batch=options.batch, dtype=options.dtype, backend=options.backend,
                 log=lambda message: print(message, file=sys.stderr, flush=True), compile=options.compile)
    report["benchmark_seconds"] = time.perf_counter() - start
    print(json.dumps(report, indent=2) if options.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
