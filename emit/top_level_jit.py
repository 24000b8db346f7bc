"""A jit that compiles with XLA `compiler_options` (`driver.xla_kernel_cache`: XLA's kernel cache
file) wherever JAX allows them: JAX takes `compiler_options` only on a jit called outside any trace,
and raises where such a jit is staged into another (a user's `jax.jit` around an optimized function,
or the dispatching jit around an emitted plan). Traced, this is the plain jit: the outer jit compiles
it, with the outer jit's options.

    run = TopLevelJit(stage, compiler_options, donate_argnums=0)
    run(*arrays)           # outside a trace: compiled with the options
"""

from __future__ import annotations

import jax
from jax._src import core as jax_core  # trace_state_clean: whether a call is outside every trace


class TopLevelJit:
    def __init__(self, fn, compiler_options=None, **jit_options):
        self.compiler_options = dict(compiler_options or {})
        self.plain = jax.jit(fn, **jit_options)
        self.optioned = jax.jit(fn, compiler_options=self.compiler_options, **jit_options) \
            if self.compiler_options else None

    def __call__(self, *args, **kwargs):
        if self.optioned is not None and jax_core.trace_state_clean():
            return self.optioned(*args, **kwargs)
        return self.plain(*args, **kwargs)
