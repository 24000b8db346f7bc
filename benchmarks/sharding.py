"""Optimized functions on several devices: values, output shardings and collectives against `jax.jit`.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.sharding [--backends xla,pallas]

For each case (a block of SD 1.5 on small, odd shapes, sharded over a 4-device mesh axis "data"),
backend (`xla`; `pallas` interpreted) and way of calling it:

- `direct`: `optimize(f)(*sharded_arrays)`;
- `jit`: `jax.jit(optimize(f), in_shardings=...)` on unsharded arrays; `jit_out`: with
  `out_shardings=` `jax.jit(f)`'s output sharding too;
- `shard_map`: `jax.shard_map(optimize(f), mesh, in_specs, out_specs)` (batch-sharded cases);

and mesh axis type (`explicit`, the default of `jax.make_mesh`; `auto`), one row: the output
sharding and `jax.jit`'s, the largest difference from `jax.jit`'s values, the all-gathers and
all-reduces in the compiled HLO, and the collectives the plan's partitioning inserted
(`emit.sharded`). A batch-sharded program must compile with no all-gather: no device sees more
than its shard of the activations.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    fn: object
    shapes: tuple            # argument shapes
    specs: tuple             # PartitionSpec entries per argument (tuples of mesh axis names or None)
    batch_sharded: bool      # every sharded axis is batch-like: no collective expected
    out_spec: tuple = ()     # shard_map's out_specs entries for batch-sharded cases
    meshes: tuple = ("explicit", "auto")
    params_argnums: tuple = ()  # marked parameters: the per-call stage of a prepared plan runs partitioned


def ln_matmul_gelu(x, w, g, b):
    import jax

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b
    return jax.nn.gelu(h @ w)


def attention_block(x, wq, wk, wv, wo):
    from sd15.layers import attention

    return attention(x @ wq, x @ wk, x @ wv, heads=2) @ wo + x


def conv_group_norm(x, w, bias, scale, shift):
    import jax
    from sd15.layers import conv2d, group_norm

    params = {"conv.weight": w, "conv.bias": bias, "norm.weight": scale, "norm.bias": shift}
    return jax.nn.silu(group_norm(params, "norm", conv2d(params, "conv", x), groups=2, eps=1e-5))


def contracted_matmul(x, w):
    return x @ w


CASES = (
    Case("ln_matmul_gelu", ln_matmul_gelu, ((8, 24), (24, 40), (24,), (24,)),
         (("data", None), (None, None), (None,), (None,)), True, ("data", None)),
    Case("attention", attention_block, ((4, 9, 80), (80, 80), (80, 80), (80, 80), (80, 80)),
         (("data", None, None),) + ((None, None),) * 4, True, ("data", None, None)),
    Case("attention_params", attention_block, ((4, 9, 80), (80, 80), (80, 80), (80, 80), (80, 80)),
         (("data", None, None),) + ((None, None),) * 4, True, ("data", None, None), params_argnums=(1, 2, 3, 4)),
    Case("conv_group_norm", conv_group_norm, ((4, 5, 5, 3), (6, 3, 3, 3), (6,), (6,), (6,)),
         (("data", None, None, None), (None,) * 4, (None,), (None,), (None,)), True, ("data", None, None, None),
         ("auto",)),  # jax.jit rejects group_norm's reshape of an Explicit-sharded batch (needs out_sharding)
    Case("contracted_matmul", contracted_matmul, ((8, 32), (32, 16)), ((None, "data"), ("data", None)), False,
         meshes=("auto",)),  # jax.jit asks for out_sharding when Explicit contracting axes are sharded
)


def arguments(case: Case, seed: int = 0) -> list:
    """Adversarial values: a large offset against the spread on the first argument."""
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal(shape).astype(np.float32) for shape in case.shapes]
    args[0] = args[0] * 0.5 + 30.0 if case.name != "contracted_matmul" else args[0]
    return args


def make_mesh(kind: str):
    import jax
    from jax.sharding import AxisType

    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((4,), ("data",), axis_types=(axis_type,))


def hlo_collectives(compiled_text: str) -> dict:
    """How many all-gathers and all-reduces a compiled HLO module runs."""
    return {name: len(re.findall(rf"= [^=]*\b{name}(-start)?\(", compiled_text))
            for name in ("all-gather", "all-reduce", "all-to-all", "collective-permute")}


@functools.lru_cache(maxsize=None)
def optimized(case: Case, backend: str):
    """One optimized function per case and backend: its plan is made once, every row reuses it."""
    import eqsat

    return eqsat.optimize(case.fn, backend=backend, interpret=True if backend == "pallas" else None, progress=False,
                          params_argnums=case.params_argnums or None)


def sharded_plans(fast) -> list:
    return [emitted._sharded for lowered in fast.lowerings for emitted in lowered._emitted.values()
            if getattr(emitted, "_sharded", None) is not None]


def run(case: Case, backend: str, mode: str, mesh_kind: str) -> dict:
    """One row (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = make_mesh(mesh_kind)
    args = arguments(case)
    shardings = [NamedSharding(mesh, P(*spec)) for spec in case.specs]
    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    reference = jax.jit(case.fn)(*sharded)
    fast = optimized(case, backend)
    for sharded_plan in sharded_plans(fast):
        sharded_plan.partitionings.clear()  # this row's own
    if mode == "direct":
        call, call_args = jax.jit(fast), sharded
        out = fast(*sharded)
    elif mode == "jit":
        call, call_args = jax.jit(fast, in_shardings=tuple(shardings)), args
        out = call(*args)
    elif mode == "jit_out":
        call = jax.jit(fast, in_shardings=tuple(shardings), out_shardings=reference.sharding)
        call_args = args
        out = call(*args)
    else:
        call = jax.jit(jax.shard_map(fast, mesh=mesh, in_specs=tuple(P(*s) for s in case.specs),
                                     out_specs=P(*case.out_spec)))
        call_args = sharded
        out = call(*sharded)
    text = call.lower(*call_args).compile().as_text()
    partitionings = [p for sharded_plan in sharded_plans(fast) for p in sharded_plan.partitionings.values()]
    return {
        "case": case.name, "backend": backend, "mode": mode, "mesh": mesh_kind,
        "out_sharding": str(out.sharding.spec), "jit_sharding": str(reference.sharding.spec),
        "same_sharding": bool(out.sharding.is_equivalent_to(reference.sharding, out.ndim)),
        "max_abs_diff": float(jnp.max(jnp.abs(out - reference))),
        "max_abs_ref": float(jnp.max(jnp.abs(reference))),
        "hlo": hlo_collectives(text),
        "plan_collectives": [str(c) for p in partitionings for c in p.collectives],
        "partitionings": [p.summary() for p in partitionings],
    }


def modes(case: Case) -> tuple[str, ...]:
    return ("direct", "jit", "jit_out", "shard_map") if case.batch_sharded else ("direct", "jit", "jit_out")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="xla,pallas")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    options = parser.parse_args(argv)
    import jax

    if jax.device_count() < 4:
        raise SystemExit(f"needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4), "
                         f"found {jax.device_count()}; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    jax.config.update("jax_default_matmul_precision", "highest")
    print("| case | backend | call | mesh | output sharding | jax.jit's | max abs diff | HLO all-gather / all-reduce | plan collectives |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if case.name not in options.cases.split(","):
            continue
        for backend in options.backends.split(","):
            for mode in modes(case):
                for mesh_kind in case.meshes:
                    row = run(case, backend, mode, mesh_kind)
                    print(f"| {row['case']} | {backend} | {mode} | {mesh_kind} | {row['out_sharding']} | "
                          f"{row['jit_sharding']} | {row['max_abs_diff']:.1e} of {row['max_abs_ref']:.1e} | {row['hlo']['all-gather']} / "
                          f"{row['hlo']['all-reduce']} | {'; '.join(row['plan_collectives']) or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
