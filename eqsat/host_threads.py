"""Enough XLA CPU worker threads for Pallas' GPU interpret mode.

jax 0.10.2's GPU interpret mode (how `backend="mosaic"` kernels run on a CPU) runs every simulated
GPU thread of a kernel as its own XLA CPU computation, and those computations block in host
callbacks (barrier waits) on the XLA CPU client's worker pool. A pool no larger than the callbacks
that wait at once deadlocks: a warp-specialized matmul (a producer and a consumer warpgroup) run
inside an emitted program hung every time with `PJRT_NPROC=1` and about one run in two with 2
worker threads (this machine's 2 cores), and never in 12 runs with 16.

JAX sizes that pool once, when it creates its CPU client (the first computation), from
`PJRT_NPROC` (else the schedulable CPUs). `reserve()` (run by `import eqsat`) sets `PJRT_NPROC`
when JAX has not started yet and the variable is unset; threads beyond the cores only wait, they do
not compete for them. `check()` (run before a kernel is interpreted) warns once when JAX started
with fewer: the fix is then `PJRT_NPROC=16` in the environment, or `import eqsat` before the first
JAX computation.
"""

from __future__ import annotations

import os
import warnings

INTERPRET_THREADS = 16
_ENVIRONMENT = ("PJRT_NPROC", "NPROC")  # the order XLA's CPU client reads them in
_warned = False


def _jax_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def worker_threads() -> int:
    """The XLA CPU worker pool's size as JAX's CPU client reads it when it starts."""
    for name in _ENVIRONMENT:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def reserve() -> bool:
    """Ask for `INTERPRET_THREADS` worker threads (at least the CPU count) if JAX has not started
    and nobody chose a number; True when this set it."""
    if any(name in os.environ for name in _ENVIRONMENT) or _jax_started():
        return False
    os.environ["PJRT_NPROC"] = str(max(INTERPRET_THREADS, os.cpu_count() or 1))
    return True


def check() -> None:
    """Warn once when JAX's CPU client started with too few worker threads to interpret GPU kernels."""
    global _warned
    if _warned or worker_threads() >= INTERPRET_THREADS:
        return
    _warned = True
    warnings.warn(
        f"JAX's CPU client has {worker_threads()} worker threads; GPU interpret mode (Mosaic kernels "
        f"on a CPU) can deadlock with fewer than {INTERPRET_THREADS}: set PJRT_NPROC={INTERPRET_THREADS} "
        f"in the environment, or import eqsat before the first JAX computation", RuntimeWarning, stacklevel=3)
