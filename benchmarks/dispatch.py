"""Host time per call: an optimized function with prepared parameters (`eqsat.optimize(fn,
params_argnums=0)`, as `sd15` runs its components) against `jax.jit(fn)`, on SD 1.5's components.

    python -m benchmarks.dispatch                          # tiny configs, the three components
    python -m benchmarks.dispatch --config full --components text_encoder --json dispatch.json

Measured here, on whatever runs JAX (the CPU without a GPU), float32 random weights, the plan cache in
a fresh temporary folder. Two figures per function, each the best of 5 rounds of 50 calls:
- `dispatch_us`: the seconds until a call returns its (not yet computed) result, per call: the host
  work of a call, which a GPU can hide only while it is busy with earlier calls;
- `call_us`: per call with the last result waited for (host and device time).
Since the leaf route (`emit.prepare.LeafRoute`), a signature that ran and is called again with the same
weight objects walks its leaves once; before it, the tiny text encoder's host time per call was 2-4×
jit's on this CPU (the user's path; `benchmarks.gpu` calls both sides through one `jax.jit`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def _concrete(spec, rng):
    if jnp.issubdtype(spec.dtype, jnp.integer):
        return jnp.ones(spec.shape, spec.dtype)
    return jnp.asarray(rng.standard_normal(spec.shape).astype(spec.dtype) * 0.05)


def _timed(fn, args, rounds: int = 5, calls: int = 50) -> tuple[float, float]:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    dispatch, call = [], []
    for _ in range(rounds):
        began = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        dispatch.append((time.perf_counter() - began) / calls)
        jax.block_until_ready(outs)
        began = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        call.append((time.perf_counter() - began) / calls)
    return min(dispatch) * 1e6, min(call) * 1e6


def measure(component: str, config: str, backend: str = "xla") -> dict:
    import eqsat
    from sd15 import workloads

    work = workloads.workloads(config=config, dtype="float32", components=[component])[component]
    rng = np.random.default_rng(0)
    args = jax.tree.map(lambda spec: _concrete(spec, rng), work.args)
    jit_dispatch, jit_call = _timed(jax.jit(work.fn), args)
    ours_dispatch, ours_call = _timed(eqsat.optimize(work.fn, backend=backend, params_argnums=0, progress=False), args)
    return {"component": component, "config": config, "backend": backend, "leaves": len(jax.tree.leaves(args)),
            "ours_dispatch_us": ours_dispatch, "jit_dispatch_us": jit_dispatch,
            "ours_call_us": ours_call, "jit_call_us": jit_call}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--components", default="text_encoder,vae,unet")
    parser.add_argument("--backend", default="xla", help="the emitted backend (xla on a CPU; hybrid on a GPU)")
    parser.add_argument("--json", help="write the rows to this path")
    options = parser.parse_args(argv)
    os.environ.setdefault("EQSAT_AUTO_CHOICE", "plan")
    os.environ["EQSAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqsat-dispatch-")
    rows = [measure(name, options.config, options.backend) for name in options.components.split(",")]
    print(f"host time per call on {jax.devices()[0].platform}, {options.config} config, float32, backend "
          f"{options.backend} (µs; best of 5 rounds of 50 calls)")
    print(f"{'component':14s} {'leaves':>6s} {'dispatch ours':>14s} {'dispatch jit':>13s} {'call ours':>10s} "
          f"{'call jit':>9s}")
    for row in rows:
        print(f"{row['component']:14s} {row['leaves']:6d} {row['ours_dispatch_us']:14.0f} {row['jit_dispatch_us']:13.0f} "
              f"{row['ours_call_us']:10.0f} {row['jit_call_us']:9.0f}")
    if options.json:
        with open(options.json, "w") as file:
            json.dump({"jax": jax.__version__, "platform": jax.devices()[0].platform, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
