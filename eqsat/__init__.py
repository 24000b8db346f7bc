"""eqsat: a fusion optimizer for JAX built on equality saturation.

    import eqsat
    fast = eqsat.optimize(fn)                 # like jax.jit: decorator or call
    lowered = fast.lower(*example_args)       # ShapeDtypeStructs are fine
    lowered.plan.summary(); lowered.stats; lowered.egraph

This module is the public face: it hands on names from every floor of the house (`optimize` and
`Lowered` from `driver`, `Plan` from `extract`, the stages from `eqsat`), imported on first use, so
`import eqsat.cost` (or `eqsat.types`) stays free of egglog and jax tracing machinery and nothing
on the ground floor imports the driver. Modules that moved in 0.2 keep their old paths for a
release (`eqsat.moved`). On a machine without a GPU, an installed CUDA plugin is kept
from loading, so JAX prints no CUDA errors (`eqsat.quiet_cuda`; a GPU machine is untouched), and
JAX's CPU client is asked for enough worker threads to interpret GPU kernels (`eqsat.host_threads`).
"""

from __future__ import annotations

import importlib

from eqsat import moved
from eqsat import host_threads
from eqsat.quiet_cuda import hide_plugin_without_gpu

hide_plugin_without_gpu()
host_threads.reserve()
moved.install()

_EXPORTS = {
    "optimize": ("driver.optimize", "optimize"),
    "Optimized": ("driver.optimize", "Optimized"),
    "Lowered": ("driver.optimize", "Lowered"),
    "Plan": ("extract.plan", "Plan"),
    "Kernel": ("extract.plan", "Kernel"),
    "lift": ("eqsat.lift", "lift"),
    "lift_jaxpr": ("eqsat.lift", "lift_jaxpr"),
    "Program": ("eqsat.program", "Program"),
    "evaluate": ("eqsat.interpret", "evaluate"),
    "saturate": ("eqsat.saturate", "saturate"),
    "Term": ("eqsat.term", "Term"),
    "get_device": ("eqsat.cost.devices", "get_device"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'eqsat' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
