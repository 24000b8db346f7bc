"""Cold and warm starts of an optimized SD 1.5 component on this machine: the same program run in
fresh processes one after the other on one cache folder, each timing where its seconds went until
its first call returned.

    python -m benchmarks.warm_start --component unet                   # tiny config, Pallas (interpret on a CPU)
    python -m benchmarks.warm_start --component unet --config full --backend xla --json out.json
    python -m benchmarks.warm_start --component text_encoder --jax-cache

Per process (`eqsat.optimize(fn, backend=..., params_argnums=0, progress=False)` on concrete random
weights, `sd15.params.init_random`), in seconds:

- import: `jax`, `eqsat` and `sd15` imported; the weights' generation after it is not counted;
- plan: `optimize(fn).lower(*args)`: lift, then the plan cache look-up (`driver.cache`; on a hit the
  plan rebuilt from the entry) or build + saturate + extract on a miss, then the prepare split;
- first call, split by JAX's monitoring events and `emit.exported.ExportedStages.seconds`: the
  exported stages read (deserialized), jaxprs traced (the emission of every kernel, or only the call
  of an exported stage), StableHLO lowered, XLA's compile (a hit of JAX's persistent compilation
  cache is its read: `cache_read` in the JSON), the exported stages written;
- ready: import + plan + those, until the executable is loaded and runs (the goal of issue 18: a
  warm UNet ready in 10 s); rest: the first call's run (the prepare stage's too) and Python;
- the second call (the steady run), where the plan came from, the exported stages read and written,
  the persistent cache's hits, and the largest difference from `jax.jit` (the cold run; the others
  from the cold run's output, which the same program should reproduce exactly).

Runs, in order, on one cache folder: `cold` (empty folders), `plan cached` (the exported stages
removed: the plan cache alone), `warm` (plan and exported stages), with JAX's persistent
compilation cache off (`EQSAT_JAX_CACHE=0`). `--jax-cache` runs them with eqsat's default instead
(`driver.cache.use_jax_compilation_cache`: JAX's cache on in `<EQSAT_CACHE_DIR>/jax`, so `cold`
fills it); `--both` runs the three with it off, then `warm, JAX cache filled` and `warm + JAX
cache` with it on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}
COLUMNS = ("import", "plan", "read", "trace", "lower", "compile", "write", "ready", "rest", "second")
READY = ("import", "plan", "read", "trace", "lower", "compile", "write")  # until the executable is loaded


class JaxEvents:
    """Sums of JAX's duration events by `EVENTS`' names, and the persistent cache's hits and misses."""

    def __init__(self):
        import jax

        self.seconds = dict.fromkeys(EVENTS.values(), 0.0)
        self.counts = {"cache_hits": 0, "cache_misses": 0}
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event in EVENTS:
            self.seconds[EVENTS[event]] += seconds

    def _event(self, event: str, **_) -> None:
        name = event.rsplit("/", 1)[-1]
        if name in self.counts:
            self.counts[name] += 1

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.counts = dict.fromkeys(self.counts, 0)


def child(component: str, config: str, backend: str, dtype: str, size: int, reference: str) -> dict:
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqsat
    from sd15 import params
    from sd15.workloads import workloads

    imported = time.perf_counter() - start
    events = JaxEvents()
    workload = workloads(config=config, components=(component,), dtype=dtype, size=size or None)[component]
    began = time.perf_counter()
    rng = np.random.default_rng(0)

    def concrete(spec):
        if jnp.issubdtype(spec.dtype, jnp.integer):
            return jnp.full(spec.shape, 7, spec.dtype)
        return jnp.asarray(rng.standard_normal(spec.shape, np.float32), spec.dtype)

    weights = params.init_random(component, workload.fn.keywords["config"], dtype=jnp.dtype(dtype))
    args = (weights, *jax.tree_util.tree_map(concrete, workload.args[1:]))
    if component == "unet":  # a timestep and a guidance scale as the pipeline passes them
        args = (*args[:2], jnp.asarray(981, jnp.int32), args[3], jnp.asarray(7.5, jnp.float32))
    weights_seconds = time.perf_counter() - began
    say(f"imported in {imported:.1f} s, weights made in {weights_seconds:.1f} s")

    optimized = eqsat.optimize(workload.fn, backend=backend, params_argnums=0, progress=False)
    began = time.perf_counter()
    lowered = optimized.lower(*args)
    plan_seconds = time.perf_counter() - began
    say(f"planned ({lowered.stats['cache']}) in {plan_seconds:.1f} s")
    events.reset()
    began = time.perf_counter()
    out = jax.block_until_ready(optimized(*args))
    call_seconds = time.perf_counter() - began
    say(f"first call in {call_seconds:.1f} s")
    first = dict(events.seconds)
    counts = dict(events.counts)
    began = time.perf_counter()
    jax.block_until_ready(optimized(*args))
    second_seconds = time.perf_counter() - began
    say(f"second call in {second_seconds:.1f} s")

    stages = lowered.executable(backend, None).exported
    exported = stages.seconds if stages else {"read": 0.0, "export": 0.0, "write": 0.0}
    breakdown = {"import": imported, "plan": plan_seconds, "read": exported["read"], "trace": first["trace"],
                 "lower": first["lower"], "compile": first["compile"], "write": exported["write"]}
    breakdown["ready"] = sum(breakdown[k] for k in READY)
    breakdown["rest"] = imported + plan_seconds + call_seconds - breakdown["ready"]
    breakdown["second"] = second_seconds
    breakdown["cache_read"] = first["cache_read"]
    stage_seconds = lowered.stats["seconds"]

    leaves = [np.asarray(leaf, np.float32) for leaf in jax.tree_util.tree_leaves(out)]
    if os.path.exists(reference):
        with np.load(reference) as stored:
            expected = [stored[f"out{i}"] for i in range(len(leaves))]
        compared = "the cold run"
    else:
        expected = [np.asarray(leaf, np.float32) for leaf in jax.tree_util.tree_leaves(jax.jit(workload.fn)(*args))]
        np.savez(reference, **{f"out{i}": leaf for i, leaf in enumerate(leaves)})
        compared = "jax.jit"
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves, expected))
    return {"plan_source": lowered.stats["cache"], "seconds": breakdown, "first_call_seconds": call_seconds,
            "weights_seconds": weights_seconds,
            "plan_stages": {"lift": stage_seconds.get("lift", 0.0), "cache": lowered.stats["cache_seconds"],
                            **{k: v for k, v in stage_seconds.items() if k != "lift"}},
            "exported_read": stages.hits if stages else None, "exported_written": stages.exports if stages else None,
            "export_failures": stages.failures if stages else None, "export_trace_lower": exported["export"],
            "jax_cache": counts, "max_error": error, "compared_with": compared,
            "process_seconds": time.perf_counter() - start, "load": os.getloadavg()[0],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def say(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(options, label: str, env: dict, reference: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.warm_start", "--child", options.component, options.config,
               options.backend, options.dtype, str(options.size or 0), reference]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=None if options.verbose else subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {label} process failed" + (f":\n{done.stderr[-3000:]}" if done.stderr else ""))
    row = {"run": label, "jax_cache_on": "EQSAT_JAX_CACHE" not in env, **json.loads(done.stdout.strip().splitlines()[-1])}
    print(format_row(row), flush=True)
    return row


def header() -> str:
    return (f"{'run':<24} {'plan':>5} {'exp r/w':>7} {'jax hit':>7} "
            + " ".join(f"{c:>7}" for c in COLUMNS) + f" {'max err':>8} {'GiB':>5} {'load':>5}")


def format_row(row: dict) -> str:
    hits = f"{row['jax_cache']['cache_hits']}/{row['jax_cache']['cache_hits'] + row['jax_cache']['cache_misses']}" \
        if row["jax_cache_on"] else "off"
    return (f"{row['run']:<24} {row['plan_source']:>5} {str(row['exported_read']) + '/' + str(row['exported_written']):>7} "
            f"{hits:>7} " + " ".join(f"{row['seconds'][c]:>7.2f}" for c in COLUMNS) + f" {row['max_error']:>8.2g} {row['peak_rss_gib']:>5.1f} {row['load']:>5.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--component", default="unet", choices=("unet", "vae", "text_encoder"))
    parser.add_argument("--config", default="tiny", choices=("tiny", "full"))
    parser.add_argument("--backend", default="pallas")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default: float16 full, float32 tiny)")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default: the config's)")
    parser.add_argument("--jax-cache", action="store_true", help="eqsat's default, JAX's persistent compilation cache on, in every run")
    parser.add_argument("--both", action="store_true", help="the three runs without JAX's cache, then two warm with it")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--verbose", action="store_true", help="the processes' progress and warnings on stderr")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        component, config, backend, dtype, size, reference = args.child
        print(json.dumps(child(component, config, backend, dtype, int(size), reference)))
        return 0
    args.dtype = args.dtype or ("float16" if args.config == "full" else "float32")
    folder = tempfile.mkdtemp(prefix="eqsat-warm-start-")
    with_jax = {**os.environ, "EQSAT_CACHE_DIR": os.path.join(folder, "eqsat")}
    with_jax.pop("EQSAT_JAX_CACHE", None)  # eqsat's default: JAX's cache on, in <EQSAT_CACHE_DIR>/jax
    env = {**with_jax, "EQSAT_JAX_CACHE": "0"}
    reference = os.path.join(folder, "cold.npz")
    load = os.getloadavg()
    print(f"{args.component} ({args.config}, {args.dtype}), backend {args.backend}; load {load[0]:.1f}; seconds")
    print(header(), flush=True)
    rows = []
    try:
        first = with_jax if args.jax_cache else env
        rows.append(run(args, "cold", first, reference))
        shutil.rmtree(os.path.join(folder, "eqsat", "exported"), ignore_errors=True)
        rows.append(run(args, "plan cached", first, reference))
        rows.append(run(args, "warm", first, reference))
        if args.both and not args.jax_cache:
            rows.append(run(args, "warm, JAX cache filled", with_jax, reference))
            rows.append(run(args, "warm + JAX cache", with_jax, reference))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    after = os.getloadavg()
    print(f"load after {after[0]:.1f}; 'ready': import to executable loaded; 'rest': the first call's run (the prepare "
          f"stage's too) and Python; weights generated in {rows[0]['weights_seconds']:.1f} s (not counted)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"component": args.component, "config": args.config, "backend": args.backend,
                       "dtype": args.dtype, "size": args.size, "jax_cache": args.jax_cache, "load": [load, after],
                       "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
