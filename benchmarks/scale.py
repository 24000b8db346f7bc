"""How lowering scales with the program: a residual MLP of 100, 200 and 400 layers, seconds per stage.

    python -m benchmarks.scale                              # 100, 200, 400 layers, float32
    python -m benchmarks.scale --layers 50,100 --out scale.json
    python -m benchmarks.scale --extract-time-limit 1       # see the time limit stop the extraction
    python -m benchmarks.scale --chain --layers 75,150,300  # issue 18's chain: x = x + silu(layernorm(x @ w + b))

Each layer is pre-LayerNorm -> Linear -> exact GELU -> Linear -> residual add, as plain jnp: 25
jaxpr equations, about 29 naive kernels. `--chain` lowers issue 18's deep residual chain instead
(`residual_chain`: `x = x + silu(layernorm(x @ w + b))`, x [8, 24], no LayerNorm affine, default
depths 75, 150, 300, 600), whose plan recomputes the residual stream in every layer's matmul
prologue: the "reads" column (most tensors one kernel reads) shows how big its kernels grow. The table gives the optimizer's seconds per stage (lift,
build, saturate, extract: `Lowered.stats["seconds"]`), the extraction's own steps (loading the
serialized e-graph, the greedy rounds, the polish, building terms; the rest of the extract stage is
building the `Plan`), the work the polish did (expression slots its kernel walks visited), and whether
a limit stopped saturation or extraction; `extract_time_limit` bounds the whole extract stage in CPU
seconds, so a stopped row also gives the stage's CPU time against it. Stage seconds per layer show
whether a stage grows linearly with the program. The JSON (`--out`) holds every row and the
environment.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

DEFAULT_LAYERS = (100, 200, 400)
CHAIN_LAYERS = (75, 150, 300, 600)


def layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def residual_mlp(x, layers):
    """`x` [..., width] through every layer of `layers` (dicts of norm scale/bias, w1/b1, w2/b2)."""
    for p in layers:
        h = layer_norm(x, p["norm_scale"], p["norm_bias"])
        h = jax.nn.gelu(h @ p["w1"] + p["b1"], approximate=False)
        x = x + h @ p["w2"] + p["b2"]
    return x


def mlp_arguments(layers: int, *, batch: int = 4, tokens: int = 128, width: int = 256, hidden: int = 1024,
                  dtype=jnp.float32):
    """Abstract arguments of `residual_mlp` with `layers` layers (no weights needed to lower it)."""
    spec = jax.ShapeDtypeStruct
    layer = dict(norm_scale=spec((width,), dtype), norm_bias=spec((width,), dtype),
                 w1=spec((width, hidden), dtype), b1=spec((hidden,), dtype),
                 w2=spec((hidden, width), dtype), b2=spec((width,), dtype))
    return spec((batch, tokens, width), dtype), [dict(layer) for _ in range(layers)]


def plain_layer_norm(x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps)


def residual_chain(x, weights, biases):
    """Issue 18's deep residual chain: `x = x + silu(layernorm(x @ w + b))` per (w, b)."""
    for w, b in zip(weights, biases):
        x = x + jax.nn.silu(plain_layer_norm(x @ w + b))
    return x


def chain_arguments(layers: int, *, rows: int = 8, width: int = 24, dtype=jnp.float32):
    """Abstract arguments of `residual_chain` with `layers` layers, `width` wide."""
    spec = jax.ShapeDtypeStruct
    return (spec((rows, width), dtype), [spec((width, width), dtype) for _ in range(layers)],
            [spec((width,), dtype) for _ in range(layers)])


@contextlib.contextmanager
def stage_cpu_seconds():
    """Also read this process's CPU seconds per optimizer stage, into the dict yielded: on a shared
    machine wall time includes waiting for a core. (Wraps `eqsat.optimize`'s stage timer; yields
    an empty dict if that timer is not there.)"""
    driver = importlib.import_module("eqsat.optimize")  # the module (`eqsat.optimize` is also the function)
    cpu: dict[str, float] = {}
    timer = getattr(driver, "_Timer", None)
    if timer is None:
        yield cpu
        return

    class CpuTimer(timer):
        def __enter__(self):
            self.cpu_started = time.process_time()
            return super().__enter__()

        def __exit__(self, *exc):
            cpu[self.name] = time.process_time() - self.cpu_started
            return super().__exit__(*exc)

    driver._Timer = CpuTimer
    try:
        yield cpu
    finally:
        driver._Timer = timer


def measure(layers: int, *, device: str = "h100", extract_time_limit: float = 5.0, chain: bool = False,
            **shape) -> dict:
    """Lower `residual_mlp` (`residual_chain` with `chain`) with `layers` layers; the row of the report."""
    import eqsat

    function, arguments = (residual_chain, chain_arguments) if chain else (residual_mlp, mlp_arguments)
    optimized = eqsat.optimize(function, device=device, progress=False, extract_time_limit=extract_time_limit,
                               cache=False)  # measures planning: never a plan from the cache
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, stage_cpu_seconds() as cpu:
        warnings.simplefilter("always")
        lowered = optimized.lower(*arguments(layers, **shape))
    total = time.perf_counter() - started
    stats, extraction = lowered.stats, lowered.extraction
    steps = dict(extraction.details.get("seconds", {}))
    greedy = extraction.details.get("greedy", {})
    phases = greedy.get("phases", {})
    steps["rounds"] = sum(v for k, v in phases.items() if k not in ("prepare", "polish"))
    steps["polish"] = phases.get("polish", 0.0)
    steps["plan"] = stats["seconds"]["extract"] - extraction.seconds
    return {
        "layers": layers,
        "naive_kernels": stats["naive_kernels"],
        "most_reads": max((len(kernel.inputs) for kernel in lowered.plan.kernels), default=0),
        "searched_seconds": steps.get("greedy", 0.0) + steps.get("ilp", 0.0),
        "extract_time_limit": extract_time_limit,
        "fused_kernels": stats["fused_kernels"],
        "e_nodes": stats["e_nodes"],
        "seconds": dict(stats["seconds"]),
        "cpu_seconds": dict(cpu),
        "total_seconds": total,
        "extract_steps": steps,
        "polish": greedy.get("polish") or {},
        "greedy_rounds": greedy.get("rounds"),
        "plan_seconds": stats["plan_seconds"],
        "extractor": stats["extractor"],
        "saturation_limit": stats["limit_reached"],
        "extract_limit": stats.get("extract_limit_reached"),
        "warnings": sorted({str(w.message) for w in caught if "limit" in str(w.message)}),
    }


STAGES = ("lift", "build", "saturate", "extract")


def _stage_cpu(row: dict) -> float:
    """The extract stage's CPU seconds (its wall seconds where CPU time was not read)."""
    return row["cpu_seconds"].get("extract", row["seconds"]["extract"])


def render(rows: list[dict], title: str = "residual MLP: LayerNorm, Linear, GELU, Linear, residual") -> str:
    head = (f"{'layers':>6} {'naive':>6} {'fused':>5} | " + " ".join(f"{s:>8}" for s in STAGES)
            + f" {'total':>7} | {'cpu:':>4} " + " ".join(f"{s:>8}" for s in STAGES)
            + f" | {'load':>5} {'rounds':>6} {'polish':>6} {'slots walked':>12} {'reads':>5} | limit")
    lines = [f"lowering seconds per stage, wall clock then this process's CPU ({title})", head, "-" * len(head)]
    for row in rows:
        wall, cpu, steps = row["seconds"], row["cpu_seconds"], row["extract_steps"]
        limit = ", ".join(f"{stage} stopped by {why}" for stage, why in
                          (("saturation", row["saturation_limit"]), ("extraction", row["extract_limit"])) if why)
        lines.append(
            f"{row['layers']:>6} {row['naive_kernels']:>6} {row['fused_kernels']:>5} | "
            + " ".join(f"{wall[name]:>8.2f}" for name in STAGES) + f" {row['total_seconds']:>7.2f} | {'':>4} "
            + " ".join(f"{cpu[name]:>8.2f}" if name in cpu else f"{'-':>8}" for name in STAGES)
            + f" | {steps.get('load', 0.0):>5.2f} {steps['rounds']:>6.2f} {steps['polish']:>6.2f}"
            f" {row['polish'].get('slots_visited', 0):>12,} {row['most_reads']:>5} | {limit or '-'}"
            + (f" (the stage took {_stage_cpu(row):.2f} CPU-s against its limit of {row['extract_time_limit']:g})"
               if limit else ""))
    lines.append("extract = load (reading the serialized e-graph) + greedy rounds + polish + building the terms "
                 "and the Plan, what extract_time_limit bounds (load, rounds, polish: wall seconds); "
                 "reads: most tensors one kernel reads")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        growth = last["layers"] / first["layers"]
        source = "cpu_seconds" if all(name in first["cpu_seconds"] for name in STAGES) else "seconds"
        ratios = ", ".join(f"{name} x{last[source][name] / max(first[source][name], 1e-9):.1f}" for name in STAGES)
        lines.append(f"{first['layers']} -> {last['layers']} layers (x{growth:g}): {ratios} "
                     f"({'CPU' if source == 'cpu_seconds' else 'wall'} seconds)")
    return "\n".join(lines)


def environment(argv: list[str]) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": {name: version(name) for name in ("jax", "jaxlib", "egglog", "eqsat")},
        "command": " ".join(["python -m benchmarks.scale", *argv]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", help="comma list of depths (default 100,200,400; with --chain 75,150,300,600)")
    parser.add_argument("--chain", action="store_true",
                        help="lower issue 18's residual chain x = x + silu(layernorm(x @ w + b)) instead of the MLP")
    parser.add_argument("--rows", type=int, default=8, help="--chain: rows of x (default 8)")
    parser.add_argument("--out", type=Path, help="also write the rows and the environment as JSON here")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--width", type=int, help="default 256 (--chain: 24)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--extract-time-limit", type=float, default=5.0,
                        help="eqsat.optimize's extract_time_limit in seconds (default 5, as optimize)")
    options = parser.parse_args(argv)
    layers_option = options.layers or ",".join(map(str, CHAIN_LAYERS if options.chain else DEFAULT_LAYERS))
    depths = [int(n) for n in layers_option.split(",") if n.strip()]
    if options.chain:
        shape = dict(rows=options.rows, width=options.width or 24, dtype=jnp.dtype(options.dtype))
    else:
        shape = dict(batch=options.batch, tokens=options.tokens, width=options.width or 256, hidden=options.hidden,
                     dtype=jnp.dtype(options.dtype))
    # warm-up: imports and first compilations are not the program's
    measure(2, device=options.device, chain=options.chain, **shape)
    rows = []
    for layers in depths:
        rows.append(measure(layers, device=options.device, extract_time_limit=options.extract_time_limit,
                            chain=options.chain, **shape))
        print(f"{layers} layers: {rows[-1]['total_seconds']:.1f} s", file=sys.stderr, flush=True)
    print(render(rows, "residual chain: x = x + silu(layernorm(x @ w + b))") if options.chain else render(rows))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"program": "residual_chain" if options.chain else "residual_mlp", "rows": rows,
                  "shape": {**shape, "dtype": options.dtype}, "environment": environment(argv)}
        options.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
