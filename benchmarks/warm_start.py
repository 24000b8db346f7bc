"""Cold and warm starts of an optimized SD 1.5 component on this machine: the same program run in
fresh processes one after the other on one cache folder, each timing its plan and its first call.

    python -m benchmarks.warm_start --component unet               # tiny config, Pallas (interpret on a CPU)
    python -m benchmarks.warm_start --component text_encoder --jax-cache --json out.json

Per process (`eqsat.optimize(fn, backend=..., params_argnums=0)` on concrete random weights): where
the plan came from (`lowered.stats["cache"]`), seconds to plan, seconds of the first call (emission
or the exported stages, XLA's compile, the run), the exported stages read and written
(`emit.exported`), the whole process's wall seconds, and the largest difference from `jax.jit`.

Runs, in order: `cold` (empty folder), `plan cached` (the exported stages removed: the plan cache
alone), `warm` (plan and exported stages). `--jax-cache` also turns JAX's persistent compilation
cache on in a folder of its own (eqsat never turns it on for you), so the warm run reads XLA's
executable too (its cold run fills it; `plan cached` then already hits it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def child(component: str, config: str, backend: str) -> dict:
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqsat
    from sd15.workloads import workloads

    if os.environ.get("WARM_START_JAX_CACHE"):
        jax.config.update("jax_compilation_cache_dir", os.environ["WARM_START_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    workload = workloads(config=config, components=(component,))[component]
    rng = np.random.default_rng(0)

    def concrete(spec):
        if jnp.issubdtype(spec.dtype, jnp.integer):
            return jnp.zeros(spec.shape, spec.dtype)
        return jnp.asarray(rng.standard_normal(spec.shape) * 0.05, spec.dtype)

    args = jax.tree_util.tree_map(concrete, workload.args)
    optimized = eqsat.optimize(workload.fn, backend=backend, params_argnums=0)
    began = time.perf_counter()
    lowered = optimized.lower(*args)
    plan_seconds = time.perf_counter() - began
    began = time.perf_counter()
    out = jax.block_until_ready(optimized(*args))
    call_seconds = time.perf_counter() - began
    stages = lowered.executable(backend, None).exported
    expected = jax.jit(workload.fn)(*args)
    error = max(float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
                for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)))
    return {"plan": lowered.stats["cache"], "plan_seconds": plan_seconds, "first_call_seconds": call_seconds,
            "exported_read": stages.hits if stages else None, "exported_written": stages.exports if stages else None,
            "export_failures": stages.failures if stages else None, "max_error_vs_jit": error,
            "process_seconds": time.perf_counter() - start}


def run(component: str, config: str, backend: str, label: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.warm_start", "--child", component, config, backend],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {label} process failed:\n{done.stderr[-3000:]}")
    return {"run": label, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--component", default="unet", choices=("unet", "vae", "text_encoder"))
    parser.add_argument("--config", default="tiny", choices=("tiny", "full"))
    parser.add_argument("--backend", default="pallas")
    parser.add_argument("--jax-cache", action="store_true", help="also JAX's persistent compilation cache")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    folder = tempfile.mkdtemp(prefix="eqsat-warm-start-")
    env = {**os.environ, "EQSAT_CACHE_DIR": os.path.join(folder, "eqsat")}
    if args.jax_cache:
        env["WARM_START_JAX_CACHE"] = os.path.join(folder, "jax")
    rows = []
    try:
        rows.append(run(args.component, args.config, args.backend, "cold", env))
        shutil.rmtree(os.path.join(folder, "eqsat", "exported"), ignore_errors=True)
        rows.append(run(args.component, args.config, args.backend, "plan cached", env))
        rows.append(run(args.component, args.config, args.backend, "warm", env))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load = os.getloadavg()
    print(f"{args.component} ({args.config}), backend {args.backend}, JAX compilation cache "
          f"{'on' if args.jax_cache else 'off'}; load {load[0]:.1f}")
    print(f"{'run':<12} {'plan':>6} {'plan s':>7} {'1st call s':>10} {'exported r/w':>12} {'process s':>9} {'max err':>9}")
    for row in rows:
        print(f"{row['run']:<12} {row['plan']:>6} {row['plan_seconds']:>7.2f} {row['first_call_seconds']:>10.2f} "
              f"{str(row['exported_read']) + '/' + str(row['exported_written']):>12} {row['process_seconds']:>9.1f} "
              f"{row['max_error_vs_jit']:>9.2g}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"component": args.component, "config": args.config, "backend": args.backend,
                       "jax_cache": args.jax_cache, "load": load, "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
