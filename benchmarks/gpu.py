"""Ours against `jax.jit` on a real device: SD 1.5's UNet CFG step, VAE decode and text encoder.

    python -m benchmarks.gpu [--components unet,vae,text_encoder] [--iters 20] [--json out.json]

On a GPU it runs the full-size networks (fp16, random weights: the kernels' time does not depend on
the values) through `eqsat.optimize(fn, params_argnums=0)`, planned once and emitted with each of
`--backends` (`pallas`: every kernel a Pallas template; `hybrid`: convs and matmuls through XLA's
libraries, what `"auto"` picks on a GPU), and through `jax.jit(fn)`, and reports per component and
backend:

- `ours_ms` / `xla_ms`: the median wall time of one call, `--iters` calls after `--warmup` calls,
  each call waited for (`block_until_ready`); ours is the per-call stage on weights prepared once
  (`Prepared.per_call`), as a pipeline runs it once the weights are loaded. Measured.
- `ours_device_ms` / `xla_device_ms`: the summed duration of the device's kernels in one call,
  from a `jax.profiler` trace of `--profile-calls` calls; `ours_kernels` / `xla_kernels`: the
  launches per call seen in that trace, and the slowest kernels of each side. Measured.
- `max_abs_error` / `max_rel_error`: ours against `jax.jit`'s output on the same inputs.
- `compile_seconds`: planning + emission + XLA's compile of the first call, for both sides.
- `ours_modeled_ms`: the cost model's time for our per-call plan; `calibration`: each of our
  kernels' measured device time against its modeled time, per kernel and per kind
  (`benchmarks.calibration`): how far the model is from what the templates really take.

Without a GPU it says so in one line and runs the same harness on the tiny model with the Pallas
kernels in interpret mode (the path a test runs): the numbers then time an interpreter, not a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from typing import Any, Callable

import numpy as np

import eqsat  # noqa: F401 - first, so a CUDA plugin on a machine without a GPU stays quiet
from benchmarks import calibration

COMPONENTS = ("text_encoder", "unet", "vae")
SHOWN_KERNELS = 6  # slowest kernels printed per side (the JSON keeps every kernel)


@dataclasses.dataclass
class Side:
    """One way of running a component: a callable of no arguments and what it took to build."""

    name: str
    call: Callable[[], Any]
    build_seconds: float
    lowered: Any = None  # ours: the `optimize(...).lower(...)` result (its plan and modeled times)


def has_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def concrete_args(workload, seed: int = 0):
    """Concrete arguments for a workload's abstract ones: random weights (`sd15.params.init_random`
    with the workload's config), Gaussian latents/context, a mid-schedule timestep, guidance 7.5,
    token ids below the vocabulary size."""
    import jax
    import jax.numpy as jnp

    from sd15 import params as sd_params

    config = workload.fn.keywords["config"]
    param_specs = workload.args[0]
    dtype = next(iter(param_specs.values())).dtype
    weights = sd_params.init_random(workload.name, config, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    rest = []
    for spec in workload.args[1:]:
        if spec.shape == () and jnp.issubdtype(spec.dtype, jnp.integer):
            timesteps = workload.fn.keywords["ddim"].timesteps
            rest.append(jnp.asarray(int(timesteps[len(timesteps) // 2]), spec.dtype))
        elif spec.shape == ():
            rest.append(jnp.asarray(7.5, spec.dtype))
        elif jnp.issubdtype(spec.dtype, jnp.integer):
            rest.append(jnp.asarray(rng.integers(0, config.vocab_size, spec.shape), spec.dtype))
        else:
            rest.append(jnp.asarray(rng.standard_normal(spec.shape, np.float32), spec.dtype))
    return jax.device_put((weights, *rest))


def plan(workload, args):
    """Our plan of the workload (planned once; every backend emits it)."""
    from eqsat import optimize

    fast = optimize(workload.fn, params_argnums=0, progress=False, extract_time_limit=120.0)
    return fast.lower(*args)


def build_ours(lowered, args, backend: str) -> Side:
    import jax

    start = time.perf_counter()
    run = lowered.executable(backend)
    # Both sides are called through one `jax.jit` dispatch (the same C++ fast path as jit's own),
    # so wall times compare the executables, not Python argument handling.
    if hasattr(run, "prepare"):
        prepared = run.prepare(*args)
        call = functools.partial(jax.jit(run.per_call), prepared, *args)
    else:
        call = functools.partial(jax.jit(run), *args)
    jax.block_until_ready(call())
    return Side(backend, call, time.perf_counter() - start, lowered)


def build_xla(workload, args) -> Side:
    import jax

    start = time.perf_counter()
    jitted = jax.jit(workload.fn)
    call = functools.partial(jitted, *args)
    jax.block_until_ready(call())
    return Side("xla", call, time.perf_counter() - start)


def wall_times(call: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def device_kernels(call: Callable[[], Any], calls: int) -> dict[str, Any] | None:
    """Per-kernel device time of `calls` calls from a `jax.profiler` trace, per call: the total,
    the launch count and every kernel by name, slowest first. None where the trace has no device plane
    (no GPU, or a profiler that recorded nothing)."""
    import jax

    with tempfile.TemporaryDirectory() as log_dir:
        jax.block_until_ready(call())
        with jax.profiler.trace(log_dir):
            for _ in range(calls):
                jax.block_until_ready(call())
        files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None
        data = jax.profiler.ProfileData.from_file(files[0])
    by_name: dict[str, list[float]] = defaultdict(list)
    lines = [line for plane in data.planes if plane.name.startswith("/device:GPU") for line in plane.lines]
    # A device plane has one line per CUDA stream ("Stream #7(...)"), one event per launch or copy,
    # beside lines derived from them ("XLA Ops", "XLA Modules"), which would count launches twice.
    streams = [line for line in lines if line.name.startswith("Stream")] or [
        line for line in lines if "kernel" in line.name.lower()]
    for line in streams:
        for event in line.events:
            by_name[event.name].append(event.duration_ns * 1e-9)
    if not by_name:
        return None
    total = sum(sum(v) for v in by_name.values()) / calls
    launches = sum(len(v) for v in by_name.values()) / calls
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "lines": sorted({line.name for line in lines}),
        "device_seconds": total,
        "launches": launches,
        "top": [{"name": name, "seconds_per_call": sum(v) / calls, "launches_per_call": len(v) / calls}
                for name, v in top],
    }


def max_errors(ours, reference) -> tuple[float, float]:
    import jax

    worst_abs, worst_rel = 0.0, 0.0
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(reference)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale else diff)
    return worst_abs, worst_rel


def timed(side: Side, iters: int, warmup: int, profile_calls: int) -> dict[str, Any]:
    times = wall_times(side.call, iters, warmup)
    kernels = device_kernels(side.call, profile_calls) if profile_calls else None
    return {"ms": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3,
            "device_ms": None if kernels is None else kernels["device_seconds"] * 1e3,
            "kernels": None if kernels is None else kernels["launches"],
            "top_kernels": None if kernels is None else kernels["top"],
            "trace_lines": None if kernels is None else kernels["lines"]}


def measure_component(workload, *, backends, iters: int, warmup: int, profile_calls: int,
                      log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One row per backend of ours, each with `jax.jit`'s figures (measured once) beside it."""
    import jax

    start = time.perf_counter()
    args = concrete_args(workload)
    inputs_seconds = time.perf_counter() - start
    log(f"{workload.name}: inputs ready ({inputs_seconds:.1f} s); compiling jax.jit")
    xla = build_xla(workload, args)
    log(f"{workload.name}: jax.jit compiled in {xla.build_seconds:.1f} s; planning ours")
    start = time.perf_counter()
    lowered = plan(workload, args)
    plan_seconds = time.perf_counter() - start
    reference = jax.device_get(xla.call())
    jit = timed(xla, iters, warmup, profile_calls)
    log(f"{workload.name}: planned in {plan_seconds:.1f} s; jax.jit {jit['ms']:.3f} ms median of {iters}")
    planned = calibration.plan_kernels(lowered)
    rows = []
    for backend in backends:
        row: dict[str, Any] = {"component": workload.name, "description": workload.description,
                               "backend": backend, "inputs_seconds": inputs_seconds}
        try:
            ours = build_ours(lowered, args, backend)
            log(f"{workload.name}: {backend} built in {ours.build_seconds:.1f} s; timing")
            row["compile_seconds"] = {"ours": plan_seconds + ours.build_seconds, "xla": xla.build_seconds}
            row["max_abs_error"], row["max_rel_error"] = max_errors(jax.device_get(ours.call()), reference)
            mine = timed(ours, iters, warmup, profile_calls)
        except Exception as error:  # noqa: BLE001 - one backend's failure is reported, the others still run
            row.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
            log(row["traceback"])
            rows.append(row)
            continue
        row.update({f"ours_{key}": value for key, value in mine.items()})
        row.update({f"xla_{key}": value for key, value in jit.items()})
        row["speedup"] = row["xla_ms"] / row["ours_ms"] if row["ours_ms"] else None
        row["ours_modeled_ms"] = sum(k["seconds"] for k in planned) * 1e3
        if row["ours_top_kernels"]:
            kernels = calibration.join(planned, {k["name"]: k["seconds_per_call"] for k in row["ours_top_kernels"]})
            row["calibration"] = {"by_kind": calibration.by_kind(kernels), "kernels": kernels}
        log(f"{workload.name}: {backend} {row['ours_ms']:.3f} ms median of {iters} (jit/ours {row['speedup']:.2f}x)")
        rows.append(row)
    return rows


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"ours vs jax.jit on {report['device']} ({report['mode']})")
    for column in ("component", "backend", "ours ms", "jax.jit ms", "jit/ours", "ours device ms", "jit device ms",
                   "launches ours/jit", "max rel err", "compile s ours/jit"):
        table.add_column(column, justify="left" if column in ("component", "backend") else "right")

    def ms(value):
        return "—" if value is None else f"{value:,.3f}"

    for row in report["components"]:
        if "error" in row:
            table.add_row(row["component"], row.get("backend", "—"), f"[red]failed: {row['error'][:60]}[/red]",
                          *[""] * 7)
            continue
        launches = "—" if row["ours_kernels"] is None else f"{row['ours_kernels']:.0f} / {row['xla_kernels']:.0f}"
        table.add_row(row["component"], row["backend"], ms(row["ours_ms"]), ms(row["xla_ms"]), f"{row['speedup']:.2f}×",
                      ms(row["ours_device_ms"]), ms(row["xla_device_ms"]), launches, f"{row['max_rel_error']:.2e}",
                      f"{row['compile_seconds']['ours']:.0f} / {row['compile_seconds']['xla']:.0f}")
    console.print(table)
    console.print("Measured: wall ms = median of each call waited for; device ms = summed kernel durations per "
                  "call from a jax.profiler trace; error = max |ours - jit| / max |jit|.", soft_wrap=True)
    for row in report["components"]:
        kinds = (row.get("calibration") or {}).get("by_kind")
        if kinds:
            per_kind = Table(title=f"{row['component']} ({row['backend']}): our kernels measured against the "
                                   f"cost model, per kind")
            for column in ("kind", "kernels", "launches", "measured ms", "modeled ms", "measured/modeled"):
                per_kind.add_column(column, justify="left" if column == "kind" else "right")
            for k in kinds:
                per_kind.add_row(k["kind"], str(k["kernels"]), str(k["launches"]), ms(k["measured_seconds"] * 1e3),
                                 ms(k["modeled_seconds"] * 1e3), "—" if k["ratio"] is None else f"{k['ratio']:.1f}×")
            console.print(per_kind)
    for row in report["components"]:
        for side in ("ours", "xla"):
            top = row.get(f"{side}_top_kernels")
            if top:
                who = row["backend"] if side == "ours" else "jax.jit"
                console.print(f"[bold]{row['component']} {who}[/bold]: slowest kernels (ms per call): " + "; ".join(
                    f"{k['name'][:48]} {k['seconds_per_call'] * 1e3:.3f}" for k in top[:SHOWN_KERNELS]), soft_wrap=True)


def environment() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {"jax": jax.__version__, "device": getattr(device, "device_kind", str(device)),
            "platform": device.platform, "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run(components=COMPONENTS, *, backends=("pallas",), iters: int = 20, warmup: int = 3, profile_calls: int = 3,
        deadline: float | None = None, json_path: str | None = None, config: str | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `components` with each of our `backends`; on a machine without a GPU, the tiny config in
    interpret mode."""
    from sd15.workloads import workloads

    gpu = has_gpu()
    if not gpu:
        log("no GPU here: running the tiny model with Pallas in interpret mode (times an interpreter, not a GPU)")
    config = config or ("full" if gpu else "tiny")
    report = {**environment(), "mode": f"{config} config, " + ("Pallas on the GPU" if gpu else "Pallas interpret mode"),
              "config": config, "backends": list(backends), "iters": iters, "warmup": warmup, "components": []}
    start = time.perf_counter()
    batch, size = (2, None) if config == "full" else (2, 64)
    chosen = workloads(batch=batch, size=size, dtype="float16" if gpu else "float32", config=config,
                       components=tuple(components))
    for name in components:
        if deadline is not None and time.perf_counter() - start > deadline:
            report["components"].append({"component": name, "error": f"skipped: past the {deadline:.0f} s deadline"})
            continue
        try:
            rows = measure_component(chosen[name], backends=backends, iters=iters, warmup=warmup,
                                     profile_calls=profile_calls if gpu else 0, log=log)
        except Exception as error:  # noqa: BLE001 - one component's failure is reported, the rest still run
            rows = [{"component": name, "error": f"{type(error).__name__}: {error}",
                     "traceback": traceback.format_exc()}]
            log(rows[0]["traceback"])
        report["components"].extend(rows)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2, default=str)
    report["wall_seconds"] = time.perf_counter() - start
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--components", default=",".join(COMPONENTS),
                        help="comma-separated, of " + ", ".join(COMPONENTS) + " (run in this order)")
    parser.add_argument("--backends", default="pallas,hybrid",
                        help="our backends to time, comma-separated: pallas (every kernel a Pallas template), "
                             "hybrid (convs and matmuls through XLA's libraries; auto's choice on a GPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per side (default 20 on a GPU, 2 without)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3 on a GPU, 1 without)")
    parser.add_argument("--profile-calls", type=int, default=3, help="calls traced for per-kernel times (0: none)")
    parser.add_argument("--config", choices=("full", "tiny"), default=None,
                        help="SD 1.5 size (default: full on a GPU, tiny without)")
    parser.add_argument("--deadline", type=float, default=None, help="skip components started after this many seconds")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report (per component, as it goes)")
    options = parser.parse_args(argv)
    components = [c.strip() for c in options.components.split(",") if c.strip()]
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown:
        parser.error(f"unknown components {unknown}; choose from {', '.join(COMPONENTS)}")
    backends = [b.strip() for b in options.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"pallas", "hybrid"}:
        parser.error(f"--backends {options.backends!r}: choose from pallas, hybrid")
    gpu = has_gpu()
    iters = options.iters if options.iters is not None else (20 if gpu else 2)
    warmup = options.warmup if options.warmup is not None else (3 if gpu else 1)
    report = run(components, backends=tuple(backends), iters=iters, warmup=warmup, profile_calls=options.profile_calls,
                 deadline=options.deadline, json_path=options.json_path, config=options.config,
                 log=lambda message: print(message, flush=True))
    render(report)
    return 1 if any("error" in row for row in report["components"]) else 0


if __name__ == "__main__":
    sys.exit(main())
