"""The jits that compile an emitted plan: XLA `compiler_options` where JAX allows them, and a status
line while XLA compiles.

- Options (`driver.xla_kernel_cache`: XLA's kernel cache file): JAX takes `compiler_options` only
  on a jit called outside any trace, and raises where such a jit is staged into another (a user's
  `jax.jit` around an optimized function, or the dispatching jit around an emitted plan). Traced,
  this is the plain jit: the outer jit compiles it, with the outer jit's options.
- Compile status: a cold compile of a plan's Triton kernels takes XLA minutes (the UNet step: 160
  kernels, ~0.7 CPU-s each), after the emission bar (`emit.pallas.emission_bar`) has finished. The
  first call at the top level is therefore split into `lower` (the trace, with its emission bar) and
  `compile` under a status line with the elapsed seconds (`compile_status`; on a terminal, once the
  compile has taken 2 s, as the emission bar), then the call runs the executable that compile made
  (JAX keeps it for the jit). Later calls are the jit's own.

    run = TopLevelJit(stage, compiler_options, label="unet", kernels=309, progress=None, donate_argnums=0)
    run(*arrays)           # outside a trace: compiled with the options, the first time under a status line
"""

from __future__ import annotations

import threading

import jax
from jax._src import core as jax_core  # trace_state_clean: whether a call is outside every trace

STATUS_DELAY = 2.0  # seconds of compile before the status line shows (on a terminal; `progress=True`: at once)


class TopLevelJit:
    def __init__(self, fn, compiler_options=None, *, label: str = "", kernels: int | None = None, progress=None,
                 **jit_options):
        self.compiler_options = dict(compiler_options or {})
        self.plain = jax.jit(fn, **jit_options)
        self.optioned = jax.jit(fn, compiler_options=self.compiler_options, **jit_options) \
            if self.compiler_options else None
        self.label, self.kernels, self.progress = label, kernels, progress
        self._compiled_once = False

    def __call__(self, *args, **kwargs):
        if not jax_core.trace_state_clean():
            return self.plain(*args, **kwargs)
        jitted = self.optioned if self.optioned is not None else self.plain
        if not self._compiled_once and self.progress is not False:
            self._compiled_once = True
            lowered = jitted.lower(*args, **kwargs)
            with compile_status(self.label, self.kernels, self.progress):
                lowered.compile()
        return jitted(*args, **kwargs)

    def __getattr__(self, name):
        """The rest of a jit's interface (`lower`, `trace`, `eval_shape`, ...): the top level's jit."""
        if name in ("plain", "optioned"):
            raise AttributeError(name)
        return getattr(self.optioned if self.optioned is not None else self.plain, name)


class compile_status:
    """A tqdm status line, "eqsat compile <label> (<kernels> kernels): <elapsed>", refreshed twice a
    second while the block runs; `progress` as `optimize`'s (None: on a terminal, after
    `STATUS_DELAY` seconds; True: always, at once; False: never; a string labels it)."""

    def __init__(self, label: str = "", kernels: int | None = None, progress=None):
        self.label = progress if isinstance(progress, str) else label
        self.kernels, self.progress = kernels, progress

    def __enter__(self):
        from tqdm.auto import tqdm

        description = " ".join(part for part in ("eqsat compile", self.label) if part)
        if self.kernels:
            description += f" ({self.kernels} kernels)"
        self.bar = tqdm(total=None, desc=description, bar_format="{desc}: {elapsed}", leave=False,
                        delay=0.0 if self.progress is True else STATUS_DELAY,
                        disable=None if self.progress is None else self.progress is False)
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()
        return self

    def _tick(self):
        while not self._done.wait(0.5):
            self.bar.refresh()

    def __exit__(self, *exc):
        self._done.set()
        self._ticker.join()
        self.bar.close()
        return False

