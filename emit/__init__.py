"""`emit`: a `Plan` becomes a callable of the original function's arguments.

    run = emit.emit(plan, backend="auto")      # "auto" | "pallas" | "mosaic" | "hybrid" | "routed" | "xla" | "interpret"
    outputs = run(*args)                       # the function's own arguments and output structure

Backends:

- `pallas`: every kernel of the plan is a Pallas `pallas_call` named `"<component>:<kind>"`
  (identical kernels share the first one's name plus `.x<uses>`, so XLA compiles them once:
  `kernel_names(plan)`; `emit.pallas` dispatches each kernel op to its template), compiled by Triton where the function
  is lowered for a GPU and run with `interpret=True` where it is lowered for a CPU (the choice is
  made at lowering, so `measure.xla_target.compile_for_h100` compiles the Triton kernels from a CPU
  machine; force it with `interpret=True/False`). A kernel no template covers runs through the
  XLA emitter with an `emit.pallas.XlaFallbackWarning` naming it.
- `mosaic`: as `pallas`, but matmuls and convs through the Mosaic GPU templates (`emit.mosaic`:
  TMA-fed, warp-specialized wgmma; Hopper only), run in GPU interpret mode where lowered for a CPU;
  a kernel they do not cover goes to its Triton template with an `emit.mosaic.TritonFallbackWarning`.
- `xla`: every kernel in jax.numpy/lax (`emit.xla`), the reference for the templates and the fast
  path on a CPU.
- `hybrid`: convs and matmuls through the XLA emitter (cuDNN / cuBLAS with XLA's fusions around
  them), every other kernel through its Pallas template: on a GPU our conv and matmul templates
  are still many times slower than the libraries (measured; `emit.library` has the numbers).
- `routed`: per kernel, the emitter the cost model prices lowest on the plan's device (Triton,
  Mosaic GPU or the library call for convs and matmuls; Triton or Mosaic for attention; Triton for
  the rest: `emit.backends.plan_routes`, `eqsat.cost.backends`).
- `auto`: `hybrid` on a GPU, else `xla` (on a CPU, `eqsat.optimize` then also times `jax.jit` of
  the original function and runs the faster: `driver.auto_choice`). Not `routed` yet: on the
  data-sheet profile (`h100`) it routes 205 of the UNet's 216 dense kernels to Triton, the
  `pallas` emission measured at 40.3 ms per step on an H200 against hybrid's 11.2 (and jax.jit's
  12.8; benchmarks/results/gpu-h200-2ce0105.json), and the Mosaic templates have no factors fitted
  on a GPU; `auto` follows the model once its routes are measured faster.
- `interpret`: the reference interpreter (`Plan.evaluate`), not jitted.

On several devices (`jax.device_count() > 1`) the Pallas backends run the plan partitioned by the
inputs' shardings, each device its shard of the batch (`emit.sharded`); `xla` leaves that to XLA.
The callable jits the whole plan (one `jax.jit` over the flattened arguments; `donate` names the
inputs whose buffers that jit donates), can itself be called inside `jax.jit`, and each kernel is traced under `jax.named_scope(kernel name)`. It holds
the plan; it pickles when the plan's program does (opaque primitives do not survive pickling:
pickle the `eqsat.optimize` function instead, which re-plans where it is unpickled).
"""

from __future__ import annotations

import jax

from emit.backends import plan_routes
from emit.pallas import EmitContext, KernelCall, name_of, run_kernels
from emit.top_level_jit import TopLevelJit

BACKENDS = ("auto", "pallas", "mosaic", "hybrid", "routed", "xla", "interpret")


def resolve_backend(backend: str) -> str:
    """`auto` -> `hybrid` on a GPU, `xla` elsewhere (the module docstring says why not `routed`);
    other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "hybrid" if jax.default_backend() == "gpu" else "xla"
    return backend


def kernel_calls(plan) -> list[KernelCall]:
    """The plan's kernels, in order, as `KernelCall`s (hosted statistics attached to their host; a
    loop's outputs one call each, sharing one run)."""
    calls = []
    for k in plan.kernels:
        if k.op == "Loop":
            calls.extend(KernelCall(term, name_of(k.component, k.kind)) for term in k.outputs)
        else:
            calls.append(KernelCall(k.term, name_of(k.component, k.kind), tuple(k.hosted)))
    return calls


def kernel_names(plan) -> list[str]:
    """The `pallas_call` name of each of the plan's kernels (a loop: its own name): identical kernels
    share the first one's name plus `.x<uses>` (`emit.pallas.shared_names`), the name their Triton
    kernel has in PTX, profiles and XLA dumps."""
    from emit.pallas import shared_names

    calls = [KernelCall(k.term, name_of(k.component, k.kind), () if k.op == "Loop" else tuple(k.hosted))
             for k in plan.kernels]
    return shared_names(calls)


class Emitted:
    """A plan as a callable of the original function's arguments (see the module docstring)."""

    def __init__(self, plan, backend: str = "auto", *, interpret: bool | None = None, donate=(), progress=None,
                 compiler_options=None):
        if plan.program is None:
            raise ValueError("this plan has no program: emit needs Program.environment/results to bind arguments")
        self.plan = plan
        self.backend = resolve_backend(backend)
        self.interpret = None if interpret is None else bool(interpret)
        self.progress = progress  # the bar of kernels emitted while tracing (`emit.pallas.emission_bar`)
        # XLA's options for compiling the program (`driver.xla_kernel_cache`: its kernel cache file)
        self.compiler_options = dict(compiler_options or {})
        status = dict(kernels=len(plan.kernels), progress=progress)  # the compile's status line
        self._jitted = TopLevelJit(self._run_leaves, self.compiler_options, **status)
        self.donate = tuple(t.args[0] for t in plan.program.inputs if t.args[0] in set(donate))  # input names
        self._jitted_donating = TopLevelJit(self._run_donating, self.compiler_options, donate_argnums=0, **status)

    @property
    def program(self):
        return self.plan.program

    def __call__(self, *args, **kwargs):
        if self.backend == "interpret":
            return self.plan.evaluate(*args, **kwargs)
        env = self.program.environment(*args, **kwargs)
        leaves = [env[term.args[0]] for term in self.program.inputs]
        if self.donate:
            donated = [env[name] for name in self.donate]
            kept = [env[term.args[0]] for term in self.program.inputs if term.args[0] not in self.donate]
            return self.program.results(self._jitted_donating(donated, kept))
        return self.program.results(self._jitted(leaves))

    def _run_donating(self, donated, kept):
        by_name = dict(zip(self.donate, donated))
        kept = iter(kept)
        return self._run_leaves([by_name[t.args[0]] if t.args[0] in by_name else next(kept)
                                 for t in self.program.inputs])

    def _run_leaves(self, leaves):
        if self.backend in ("pallas", "hybrid") and jax.device_count() > 1:
            return list(self.sharded.run(leaves, self.backend, self.interpret))
        program = self.program
        ctx = EmitContext(dict(zip(program.inputs, leaves)), program.constants, program.payloads,
                          interpret=self.interpret, backend=self.backend, components=program.components,
                          progress=self.progress, routes=plan_routes(self.plan) if self.backend == "routed" else {})
        run_kernels(kernel_calls(self.plan), ctx)
        return [ctx.value(term) for term in self.plan.outputs]

    @property
    def sharded(self):
        """The plan's batch axes and its partitionings over device meshes (`emit.sharded`)."""
        if getattr(self, "_sharded", None) is None:
            from emit.sharded import ShardedPlan

            self._sharded = ShardedPlan(self.plan)
        return self._sharded

    def __getstate__(self):
        return {"plan": self.plan, "backend": self.backend, "interpret": self.interpret, "donate": self.donate,
                "progress": self.progress}

    def __setstate__(self, state):
        self.__init__(state["plan"], state["backend"], interpret=state["interpret"], donate=state.get("donate", ()),
                      progress=state.get("progress"))

    def __repr__(self) -> str:
        mode = f", interpret={self.interpret}" if self.backend in ("pallas", "mosaic", "hybrid", "routed") and self.interpret is not None else ""
        return f"Emitted({len(self.plan.kernels)} kernels, backend={self.backend}{mode})"


def emit(plan, backend: str = "auto", *, interpret: bool | None = None, donate=(), progress=None,
         compiler_options=None) -> Emitted:
    """The callable running `plan` with `backend` (see the module docstring); `progress` as
    `eqsat.optimize`'s: a bar of kernels emitted while the plan is traced (None: on a terminal,
    once that takes 2 s); `compiler_options` XLA's, for compiling it (as `jax.jit`'s)."""
    return Emitted(plan, backend, interpret=interpret, donate=donate, progress=progress,
                   compiler_options=compiler_options)
