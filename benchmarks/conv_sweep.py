"""The conv template's tile configurations, timed on a GPU against each other and against `jax.jit`.

    python -m benchmarks.conv_sweep [--shapes unet,vae] [--configs 8] [--json out.json]

Each shape is SD 1.5's ResNet conv as the plan fuses it: GroupNorm (32 groups) + SiLU of the input
computed in the conv's prologue, a 3×3 convolution, the bias in its epilogue; planned once by
`eqsat.optimize`, then emitted once per `ConvConfig` (`emit.pallas.conv`), each emission timed
(median of `--iters` calls, each waited for). `jax.jit` of the same function (cuDNN's conv with
XLA's fusions) is the reference. The configurations are the template's default and variants of
tile width, rows, output-channel and K blocks, warps and pipeline stages: which of them is fastest
per shape is measured here, not modeled, and is what `eqsat.cost.mma.conv_config` should choose.

Without a GPU the sweep runs one tiny shape in interpret mode (a test runs that path): the
times are an interpreter's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

import eqsat  # noqa: F401 - first, so a CUDA plugin on a machine without a GPU stays quiet

# (name, batch, in channels, out channels, height = width)
SHAPES = {
    "unet": [
        ("unet 64x64 320", 2, 320, 320, 64),
        ("unet 32x32 640", 2, 640, 640, 32),
        ("unet 16x16 1280", 2, 1280, 1280, 16),
        ("unet 8x8 2560->1280", 2, 2560, 1280, 8),
    ],
    "vae": [
        ("vae 128x128 512", 1, 512, 512, 128),
        ("vae 512x512 128", 1, 128, 128, 512),
    ],
    "tiny": [("tiny 12x12 96", 1, 96, 64, 12)],
}


def gn_silu_conv(x, gamma, beta, w, b):
    """SD 1.5's `conv(silu(group_norm(x)))` with bias, NCHW / OIHW, 32 groups, eps 1e-5."""
    import jax
    import jax.numpy as jnp

    n, c, h, wd = x.shape
    g = x.reshape(n, 32, -1).astype(jnp.float32)
    mean = g.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), -1, keepdims=True)
    y = ((g - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(x.shape)
    y = (y * gamma[None, :, None, None] + beta[None, :, None, None]).astype(x.dtype)
    y = jax.nn.silu(y)
    out = jax.lax.conv_general_dilated(y, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return out + b[None, :, None, None]


def candidate_configs(count: int) -> list[dict[str, int] | None]:
    """The default (None) and up to `count - 1` variants, most promising first."""
    variants = [
        dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, block_w=64),
        dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=2, block_w=64),
        dict(block_m=256, block_n=128, block_k=32, num_warps=8, num_stages=2, block_w=64),
        dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=2, block_w=64),
        dict(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=3, block_w=32),
        dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, block_w=16),
        dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=2, block_w=64),
        dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=2, block_w=64),
        dict(block_m=128, block_n=64, block_k=32, num_warps=4, num_stages=4, block_w=32),
    ]
    return [None, *variants][:max(1, count)]


@contextlib.contextmanager
def forced_conv_config(config):
    """Every conv emitted inside uses `config` (an `emit.pallas.conv.ConvConfig`; None: the default)."""
    from eqsat.cost import mma

    if config is None:
        yield
        return
    original = mma.conv_config
    mma.conv_config = lambda geometry, ranges=(), itemsize=2: config
    try:
        yield
    finally:
        mma.conv_config = original


def median_seconds(call: Callable[[], Any], iters: int, warmup: int) -> float:
    from benchmarks.gpu import wall_times

    return statistics.median(wall_times(call, iters, warmup))


def sweep_shape(name, batch, cin, cout, size, *, configs, iters, warmup, dtype, log) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import emit
    from emit.pallas.conv import ConvConfig

    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(3.0 + rng.standard_normal((batch, cin, size, size)), dtype),
        jnp.asarray(1.0 + 0.1 * rng.standard_normal(cin), dtype),
        jnp.asarray(0.1 * rng.standard_normal(cin), dtype),
        jnp.asarray(rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(9 * cin), dtype),
        jnp.asarray(0.1 * rng.standard_normal(cout), dtype),
    )
    flops = 2 * batch * size * size * cout * cin * 9
    reference = jax.jit(gn_silu_conv)
    expected = np.asarray(reference(*args), np.float32)
    row: dict[str, Any] = {"shape": name, "batch": batch, "in_channels": cin, "out_channels": cout, "size": size,
                           "flops": flops, "xla_seconds": median_seconds(lambda: reference(*args), iters, warmup)}
    lowered = eqsat.optimize(gn_silu_conv, backend="pallas", progress=False).lower(*args)
    row["plan"] = [k.kind for k in lowered.plan.kernels]
    results = []
    for overrides in configs:
        config = None if overrides is None else ConvConfig(**overrides)
        label = "default" if overrides is None else ",".join(f"{k}={v}" for k, v in overrides.items())
        try:
            with forced_conv_config(config):
                start = time.perf_counter()
                run = jax.jit(emit.emit(lowered.plan, "pallas"))
                got = np.asarray(run(*args), np.float32)
                compile_seconds = time.perf_counter() - start
            seconds = median_seconds(lambda: run(*args), iters, warmup)
            error = float(np.max(np.abs(got - expected)) / max(1e-30, float(np.max(np.abs(expected)))))
            results.append({"config": label, "seconds": seconds, "tflops": flops / seconds / 1e12,
                            "compile_seconds": compile_seconds, "max_rel_error": error})
            log(f"{name}: {label}: {seconds * 1e3:.3f} ms ({flops / seconds / 1e12:.1f} TFLOP/s, err {error:.1e})")
        except Exception as exc:  # noqa: BLE001 - a config the template rejects is a result too
            results.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            log(f"{name}: {label}: failed: {type(exc).__name__}: {str(exc)[:200]}")
    row["configs"] = results
    timed = [r for r in results if "seconds" in r]
    if timed:
        best = min(timed, key=lambda r: r["seconds"])
        row["best"] = best["config"]
        row["best_seconds"] = best["seconds"]
        row["default_seconds"] = next((r["seconds"] for r in timed if r["config"] == "default"), None)
    return row


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GroupNorm+SiLU -> 3x3 conv on {report['device']}: ours per config against jax.jit")
    for column in ("shape", "jit ms", "default ms", "best ms", "best/jit", "best config"):
        table.add_column(column, justify="left" if column in ("shape", "best config") else "right")
    for row in report["shapes"]:
        if "best_seconds" not in row:
            table.add_row(row["shape"], f"{row['xla_seconds'] * 1e3:.3f}", "—", "—", "—", "every config failed")
            continue
        default = row.get("default_seconds")
        table.add_row(row["shape"], f"{row['xla_seconds'] * 1e3:.3f}",
                      "—" if default is None else f"{default * 1e3:.3f}", f"{row['best_seconds'] * 1e3:.3f}",
                      f"{row['best_seconds'] / row['xla_seconds']:.1f}×", row["best"])
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    import jax

    parser = argparse.ArgumentParser(prog="python -m benchmarks.conv_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="unet,vae", help="comma-separated groups: " + ", ".join(SHAPES))
    parser.add_argument("--configs", type=int, default=8, help="configurations per shape, the default first")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per config (default 20 on a GPU, 1 without)")
    parser.add_argument("--deadline", type=float, default=None, help="skip shapes started after this many seconds")
    parser.add_argument("--json", dest="json_path", default=None)
    options = parser.parse_args(argv)
    try:
        gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        gpu = False
    groups = [g.strip() for g in options.shapes.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shape groups {unknown}; choose from {', '.join(SHAPES)}")
    if not gpu:
        print("no GPU here: sweeping the tiny shape in interpret mode (times an interpreter, not a GPU)", flush=True)
        groups = ["tiny"]
    iters = options.iters if options.iters is not None else (20 if gpu else 1)
    device = jax.devices()[0]
    report = {"device": getattr(device, "device_kind", str(device)), "jax": jax.__version__, "shapes": []}
    start = time.perf_counter()
    for group in groups:
        for shape in SHAPES[group]:
            if options.deadline is not None and time.perf_counter() - start > options.deadline:
                report["shapes"].append({"shape": shape[0], "skipped": "past the deadline", "xla_seconds": float("nan")})
                continue
            row = sweep_shape(*shape, configs=candidate_configs(options.configs), iters=iters, warmup=2 if gpu else 0,
                              dtype="float16" if gpu else "float32", log=lambda m: print(m, flush=True))
            report["shapes"].append(row)
            if options.json_path:
                with open(options.json_path, "w") as f:
                    json.dump(report, f, indent=2)
    render(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
