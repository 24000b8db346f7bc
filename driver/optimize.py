"""`eqsat.optimize`: the user-facing driver, one named call per stage.

    fast = eqsat.optimize(fn, device="h100")          # or @eqsat.optimize / @eqsat.optimize(...)
    lowered = fast.lower(*args)                        # arrays or ShapeDtypeStructs
    lowered.plan, lowered.program, lowered.egraph, lowered.stats, print(lowered.report())
    fast(*args)                                        # runs the emitted plan (see "Running" below)

Stages, timed under these names in `stats["seconds"]`, logs and reports:

    lift       jaxpr -> naive program, one kernel per primitive       (eqsat.lift)
    build      program terms -> e-graph                                (eqsat.egraph.Builder)
    saturate   rule families until saturated or a limit               (eqsat.saturate)
    extract    serialized e-graph -> chosen DAG -> Plan                (extract)
    prepare    the plan split into the kernels reading only parameters (run once per set of
               parameters) and the per-call rest; only when parameters are marked (emit.prepare)

If saturation stops at a limit, the e-graph still holds every rewrite made so far, so the
extracted plan is the best found so far; a warning says which limit stopped it.
Lowerings are cached per argument signature (shapes, dtypes, pytree structure, static values).

Plan cache: after `lift`, the plan is looked up on disk (`driver.cache`: keyed by the lifted
program, the device profile, the rule schedule, the options that change the plan and the eqsat
source); a hit rebuilds the `Plan` from the stored terms and skips build, saturate and extract
(`stats["cache"]` is "hit", `report()` says so), a miss plans and stores it. On a hit
`lowered.egraph`, `.saturation`, `.extraction` and `.builder` are built on first use by running the
skipped stages then (the plan kept is the cached one). `optimize(..., cache=False)` skips it.

Shared e-graph: with the default rules, build and saturate run on one e-graph per thread whose
rules were registered once (`_SharedEGraph`: egglog push, build, saturate, serialize, pop); a
small program's planning was mostly that registration. `lowered.egraph` and `.builder` are then
built again on first use (a fresh e-graph, the same schedule).

Running: calling the optimized function runs its plan through `emit.emit(plan, backend)`, built
once per signature: `backend="pallas"` emits every kernel as a Pallas kernel (Triton on a GPU,
interpreted on a CPU; `interpret=` forces either), `"hybrid"` convs and matmuls through XLA's
libraries and the rest as Pallas kernels (`emit.library`: our conv and matmul templates are still
slower than cuDNN/cuBLAS, measured), `"mosaic"` matmuls through the Mosaic GPU template (Hopper;
GPU interpret mode on a CPU) and the rest as `"pallas"` (`emit.mosaic`), `"xla"` as jax.numpy (the fast path on a CPU), `"auto"`
(default) picks `hybrid` on a GPU and on a CPU the faster of `xla` and `jax.jit` of the original
function, timed on each signature's first call with concrete arguments and said in
`lowered.stats["auto"]` and `report()` (`driver.auto_choice`; calls under an outer trace run the
plan, untimed; `lowered(*args)` runs the plan), and `"interpret"` evaluates the
plan with the reference interpreter (`eqsat.interpret`, correct everywhere, fast nowhere). An
optimized function pickles without its lowerings (it re-plans where it is unpickled), so
`measure.xla_target.compile_for_h100(eqsat.optimize(f, backend="pallas"), *args)` compiles the
emitted kernels for an H100.

Parameters: `params_argnums`/`params_argnames` mark arguments that stay the same across calls
(weights). The kernels that read only them and constants (weight concatenations behind fused QKV
or K/V, the time projections of all ResNets, summed biases, relayouts), including the
parameter-only operands of the other kernels, run in a `prepare` stage once per set of parameters;
its tensors are cached by identity of the parameter leaves (the same objects: reused; a new params
pytree: recomputed) and the per-call executable takes them as inputs (`emit.prepare`).
`Lowered.split` holds both plans, `stats["prepared_kernels"]`/`["per_call_kernels"]` count them
and `report()` lists them apart. A parameter cannot also be static or donated.

Arguments are `jax.jit`'s: positional and keyword arguments (keywords are dynamic unless named in
`static_argnames`), `static_argnums`/`static_argnames` and `donate_argnums`/`donate_argnames`,
each completed from the other through the function's signature and validated as `jax.jit` does
(`jax._src.api_util.resolve_argnums`). Donated arguments are donated by the jit the emitted plan
runs under (backends `xla`, `pallas`); the `interpret` backend runs op by op outside any jit, so a
call passing a donated argument there says once that it is not donated (`DonationWarning`); inside
an outer `jax.jit` donation is that jit's.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass, field

from driver.differentiate import (
    PlannedVJP, any_tracer, differentiation_mode, flat_function, with_original_derivatives, with_planned_backward,
)

STAGES = ("lift", "build", "saturate", "extract")
PREPARE_STAGE = "prepare"  # after extract, when parameters are marked


class SaturationLimitWarning(UserWarning):
    """Saturation stopped at a limit: the plan is the best found in the e-graph so far."""


class ExtractionLimitWarning(UserWarning):
    """Extraction stopped at its time limit: the plan is the best it found so far."""


class DonationWarning(UserWarning):
    """Donated arguments were not donated (the plan ran through the interpreter, outside any jit)."""


@dataclass
class Lowered:
    """One lowering of an optimized function for one argument signature."""

    program: object                 # eqsat.program.Program
    _egraph: object                 # the saturated egglog EGraph (see `egraph`)
    plan: object                    # extract.plan.Plan
    stats: dict
    _saturation: object = None      # eqsat.saturate.SaturationReport
    _extraction: object = None      # extract.Extraction
    _builder: object = None         # eqsat.egraph.Builder (its `handles` map lifted terms to Refs)
    warnings: list = field(default_factory=list)
    split: object = None            # emit.prepare.Split: prepare and per-call plans, when parameters are marked
    backend: str = "auto"           # how calling it runs the plan (see `emit.emit`)
    interpret: bool | None = None   # pallas_call(interpret=...); None: by the platform it is lowered for
    _emitted: dict = field(default_factory=dict, repr=False)
    _replan: object = field(default=None, repr=False)  # a plan from the cache: builds the e-graph side on demand
    _rebuild: object = field(default=None, repr=False)  # planned on the shared e-graph: rebuilds builder + e-graph on demand
    progress: object = None         # `optimize`'s: also the bar of kernels emitted (`emit.pallas.emission_bar`)

    # A plan from the cache (`stats["cache"] == "hit"`) was not extracted from an e-graph in this
    # process: the first use of any of these runs the skipped stages (build, saturate, extract)
    # on the program, once; the plan kept is the cached one.
    @property
    def egraph(self):
        """The saturated egglog EGraph."""
        return self._rebuilt()._egraph

    @property
    def saturation(self):
        """The `eqsat.saturate.SaturationReport`."""
        return self._planned()._saturation

    @property
    def extraction(self):
        """The `extract.Extraction` (its e-graph data, selection and terms)."""
        return self._planned()._extraction

    @property
    def builder(self):
        """The `eqsat.egraph.Builder` (its `handles` map lifted terms to Refs)."""
        return self._rebuilt()._builder

    def _planned(self) -> "Lowered":
        if self._replan is not None:
            replan, self._replan = self._replan, None
            self._builder, self._egraph, self._saturation, self._extraction = replan()
        return self

    def _rebuilt(self) -> "Lowered":
        """Planned on the process's shared e-graph (`_SharedEGraph`), whose state was popped after
        the plan was serialized: the builder and e-graph are built again (a fresh e-graph, the same
        schedule) on first use; the saturation report and extraction are the planning run's."""
        self._planned()
        if self._rebuild is not None:
            rebuild, self._rebuild = self._rebuild, None
            self._builder, self._egraph = rebuild()
        return self

    def __call__(self, *args, **kwargs):
        return self.executable()(*args, **kwargs)

    def executable(self, backend: str | None = None, interpret: bool | None = None, donate=()):
        """The plan emitted for `backend` (default: this lowering's), built once and kept; `donate`
        names the program inputs whose buffers a call donates."""
        import emit

        backend = emit.resolve_backend(backend or self.backend)
        interpret = self.interpret if interpret is None else interpret
        key = (backend, interpret, tuple(donate))
        if key not in self._emitted:
            options = self._compiler_options()
            if self.split is not None:
                from emit.prepare import Prepared

                self._emitted[key] = Prepared(self.split, backend, interpret=interpret, donate=donate,
                                              progress=self.progress, compiler_options=options,
                                              exported=self._exported_stages(backend, interpret, options))
            else:
                self._emitted[key] = emit.emit(self.plan, backend, interpret=interpret, donate=donate,
                                               progress=self.progress, compiler_options=options)
        return self._emitted[key]

    def _plan_cache_on(self) -> bool:
        return bool(self.stats.get("cache_key")) and self.stats.get("cache") in ("hit", "miss")

    def _compiler_options(self) -> dict:
        """XLA's options for compiling the emitted plan: on a CUDA GPU with the plan cache on, XLA's
        kernel cache file (`driver.xla_kernel_cache`), so a new process compiles no kernel twice."""
        if not self._plan_cache_on():
            return {}
        from driver.xla_kernel_cache import compiler_options

        return compiler_options()

    def _exported_stages(self, backend: str, interpret, compiler_options=None):
        """The export cache of this plan's stages (`emit.exported`) when the plan cache is on: a plan
        from the plan cache then also skips tracing and lowering its kernels; and JAX's persistent
        compilation cache in the same folder (`driver.cache.use_jax_compilation_cache`), so the
        executable is loaded, not compiled."""
        if not self._plan_cache_on():
            return None
        from driver.cache import exported_dir, use_jax_compilation_cache
        from emit.exported import ExportedStages

        use_jax_compilation_cache()  # and their executables (`EQSAT_JAX_CACHE=0`: not)
        return ExportedStages(exported_dir(), self.stats["cache_key"], backend, interpret, compiler_options)

    def partitioning_lines(self) -> list[str]:
        """How calls on sharded inputs ran the plan: per mesh and input shardings, the per-device
        plan's modeled time and the collectives inserted (`emit.sharded`)."""
        return [line for emitted in self._emitted.values() if getattr(emitted, "_sharded", None) is not None
                for line in emitted._sharded.summary().splitlines()]

    def show(self, path=None, **options):
        """Draw the plan (`extract.drawing.plan_drawing`): into `path` when given (`.svg`, `.png`, `.pdf`,
        `.dot`, `.txt`), else in a notebook (text where Graphviz is missing, or outside a notebook)."""
        from eqsat import viz
        from extract.drawing import plan_drawing

        return viz.show(plan_drawing(self.plan, **options), path)

    def _repr_svg_(self):
        from extract.drawing import plan_drawing

        return plan_drawing(self.plan)._repr_svg_()

    def egraph_view(self, *, component: str | None = None, term=None, classes=(), depth: int = 2,
                    max_classes: int = 30, readers: bool = False, title: str | None = None):
        """The e-classes around one component, lifted tensor `term` or explicit `classes`, the
        extracted e-nodes highlighted (`driver.egraph_view`)."""
        from driver.egraph_view import egraph_view

        return egraph_view(self, component=component, term=term, classes=classes, depth=depth,
                           max_classes=max_classes, readers=readers, title=title)

    def explain(self) -> list:
        """The fusions that did not happen around the heavy kernels, and why (`driver.explain`)."""
        from driver.explain import explain

        return explain(self)

    def report(self, depth: int = 1) -> str:
        """The stats and the per-component table of the plan."""
        s = self.stats
        stages = ", ".join(f"{name} {sec:.2f}s" for name, sec in s["seconds"].items())
        stop = "saturated" if s["saturated"] else f"stopped by {s['limit_reached']}"
        lines = [
            f"{s['naive_kernels']} naive kernels -> {s['fused_kernels']} fused ({s['extractor']}) on {s['device']}"
            + (f"; loop bodies: {s['naive_loop_body_kernels']} naive -> {s['loop_body_kernels']} fused kernels"
               if s.get("loop_body_kernels") else ""),
            f"modeled {s['plan_seconds'] * 1e6:,.1f} µs, {s['plan_bytes'] / 2**20:,.1f} MiB moved, "
            f"peak activations {s['plan_peak_bytes'] / 2**20:,.1f} MiB",
            f"e-graph: {s['e_nodes']} e-nodes, {s['e_classes']} e-classes, {s['iterations']} iterations, {stop}",
            f"stages: {stages}",
        ]
        if s.get("cache") == "hit":
            planned = ", ".join(f"{name} {sec:.2f}s" for name, sec in s["planned_seconds"].items())
            lines.append(f"plan from the plan cache in {s['cache_seconds']:.2f}s (key {s['cache_key'][:12]}; driver.cache): "
                         f"build, saturate and extract skipped (they took: {planned}); e-graph figures are the "
                         f"planning run's")
        if s.get("kernel_routes"):
            counts: dict = {}
            for _name, route in s["kernel_routes"]:
                counts[route] = counts.get(route, 0) + 1
            lines.append(f"dense kernels priced as {s['cost_backend']}: "
                         + ", ".join(f"{n} {route}" for route, n in sorted(counts.items())))
        if s.get("auto") is not None:
            from driver.auto_choice import report_line

            lines.append(report_line(s["auto"]))
        from driver.explain import format_explanation

        lines.append("not fused: " + format_explanation(self.explain(), limit=12).replace("\n", "\n  "))
        lines += self.partitioning_lines()
        if self.split is None:
            return "\n".join(lines) + "\n" + self.plan.summary(depth)
        lines.append(f"{s['per_call_kernels']} kernels per call; {s['prepared_kernels']} prepared once per set of "
                     f"parameters ({s['hoisted_kernels']} hoisted from per-call operands, "
                     f"{s['prepared_bytes'] / 2**20:,.1f} MiB kept)")
        return "\n".join(lines) + "\n" + self.split.summary(depth)


class Optimized:
    """A function wrapped by `optimize`: `.lower(*args)` plans it, calling it runs the plan."""

    def __init__(self, fn, *, static_argnums=None, static_argnames=None, donate_argnums=None,
                 donate_argnames=None, params_argnums=None, params_argnames=None, device="h100", rulesets=None,
                 node_limit=200_000, iteration_limit=400, time_limit=60.0, extractor="auto", extract_time_limit=5.0, progress=None, backend="auto",
                 interpret=None, cache=True):
        import emit

        from jax._src import api_util

        if not callable(fn):
            raise TypeError(f"Expected a callable value, got {fn!r}")
        static_argnums, static_argnames, donate_argnums, donate_argnames = _inherit_jit_options(
            fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
        (self.donate_argnums, self.donate_argnames, self.static_argnums,
         self.static_argnames) = api_util.resolve_argnums(fn, api_util.fun_signature(fn), donate_argnums,
                                                          donate_argnames, static_argnums, static_argnames)
        self.params_argnums, self.params_argnames = _params_argnums(fn, params_argnums, params_argnames)
        for kind, nums, names in (("static", self.static_argnums, self.static_argnames),
                                  ("donated", self.donate_argnums, self.donate_argnames)):
            both = sorted(set(self.params_argnums) & set(nums)) + sorted(set(self.params_argnames) & set(names))
            if both:
                raise ValueError(f"arguments {both} are marked as parameters and {kind}: a parameter is a traced "
                                 f"argument that stays the same across calls")
        self.fn = fn
        self.device = device
        self.rulesets = rulesets
        self.node_limit = node_limit
        self.iteration_limit = iteration_limit
        self.time_limit = time_limit
        self.extractor = extractor
        self.extract_time_limit = extract_time_limit
        self.progress = progress
        emit.resolve_backend(backend)  # validates the name now; "auto" is resolved where the plan runs
        self.backend = backend
        self.interpret = interpret
        self.cache = cache
        self._cache: dict = {}
        self._planned_vjps: dict = {}  # argument signature -> driver.differentiate.PlannedVJP
        self._jitted = None  # the jax.jit every call goes through (see _dispatches_through_jit)
        self._arguments = None  # backend "auto" on a CPU: a thread's concrete call arguments (see _auto_choice)
        self._original_jits: dict = {}  # donating or not -> jax.jit(fn): the other candidate of "auto" on a CPU
        self._said_not_donated = False
        self._leaf_routes: dict = {}  # argument tree -> emit.prepare.LeafRoute (prepared parameters, see _route)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._leaf_routes:  # prepared parameters: a signature that ran takes its route (emit.prepare.LeafRoute)
            key, leaves = self._route_key(args, kwargs)
            route = self._leaf_routes.get(key)
            values = None if route is None else route.prepared_values(leaves)
            if values is not None:
                return route(leaves, values)
        if differentiation_mode((args, kwargs)) == "reverse":
            return self._call_with_planned_backward(args, kwargs)
        jitted = self._jitted  # set once the first call chose to dispatch through jit
        if jitted is None:
            if not self._dispatches_through_jit():
                return self._call(*args, **kwargs)
            jitted = self._dispatcher()
        arguments = self._arguments
        if arguments is None:
            return jitted(*args, **kwargs)
        # backend "auto" on a CPU: a new signature's trace chooses between the plan and jax.jit with
        # these (see _auto_choice), or leaves the choice to be timed after this call.
        arguments.call, arguments.pending = (args, kwargs), None
        try:
            out = jitted(*args, **kwargs)
        finally:
            arguments.call, pending = None, arguments.pending
            arguments.pending = None
        if pending is not None:
            self._choose_after_first_call(jitted, pending, args, kwargs)
        return out

    def _dispatches_through_jit(self) -> bool:
        """Calls go through one `jax.jit` of the whole call (its C++ fast path checks the signature,
        as for a jitted function; a new signature traces, which plans and emits): every backend but
        the op-by-op interpreter, and without a prepare stage (which keeps concrete weights)."""
        import emit

        return emit.resolve_backend(self.backend) != "interpret" and not (self.params_argnums or self.params_argnames)

    def _dispatcher(self):
        if self._jitted is None:
            from driver.auto_choice import times_choice
            from emit.top_level_jit import TopLevelJit

            self._arguments = threading.local() if times_choice(self.backend) else None

            @functools.wraps(self.fn)
            def call(*args, **kwargs):
                return self._call(*args, **kwargs)

            self._jitted = TopLevelJit(call, self._dispatch_compiler_options(), progress=self.progress,
                                       static_argnums=self.static_argnums,
                                       static_argnames=self.static_argnames, donate_argnums=self.donate_argnums,
                                       donate_argnames=self.donate_argnames)
        return self._jitted

    def _dispatch_compiler_options(self) -> dict | None:
        """The dispatching jit compiles the emitted plan inline: with the plan cache on, on a CUDA GPU,
        it gets XLA's kernel cache file (`driver.xla_kernel_cache`), as `Lowered.executable`'s jits do."""
        if not getattr(self, "cache", True):
            return None
        from driver.xla_kernel_cache import compiler_options

        return compiler_options() or None

    def _call(self, *args, **kwargs):
        lowered = self.lower(*args, **kwargs)
        traced = any_tracer((args, kwargs))
        if self._auto_choice(lowered, args, kwargs, traced) == "jit":
            # Under this object's own jit the original function is traced into it: that jit is jax.jit(fn).
            return self.fn(*args, **kwargs) if traced else self._original_jit(donating=True)(*args, **kwargs)
        # Traced (under this object's own jit or the user's), donation is that jit's to do.
        donate = () if traced else self._donated_inputs(lowered.program, args, kwargs)
        run = lowered.executable(self.backend, self.interpret, donate=donate)
        if donate and run.backend == "interpret":
            self._say_not_donated(args, kwargs)
        if run.backend in ("pallas", "mosaic", "hybrid", "routed") and any_tracer((args, kwargs)):
            # Pallas kernels have no general derivative: differentiated, the call is fn's own JVP.
            return with_original_derivatives(run, self.fn, args, kwargs, lambda i: self._is_static(i, len(args)),
                                             self.static_argnames)
        out = run(*args, **kwargs)
        if not traced and not donate:
            self._route(run, args, kwargs)
        return out

    def _route(self, run, args, kwargs) -> None:
        """After a concrete call that ran a plan with prepared parameters, let the next calls of this
        signature with the same parameters skip the per-leaf work of the general path
        (`emit.prepare.LeafRoute`): the host time of a call is then about `jax.jit`'s dispatch."""
        if not hasattr(run, "leaf_route") or run.backend == "interpret" or run.donate:
            return
        try:
            key, leaves = self._route_key(args, kwargs)
            hash(key)
        except TypeError:  # an unhashable static argument: jax.jit refuses it too
            return
        if key[0] != run.program.in_tree:
            return
        route = self._leaf_routes.get(key)
        if route is None or route.prepared is not run:
            route = self._leaf_routes[key] = run.leaf_route(key[0])
        route.remember(leaves)

    def _route_key(self, args, kwargs) -> tuple[tuple, list]:
        """((the dynamic arguments' tree, the static arguments' values), the dynamic leaves)."""
        import jax

        static = ()
        if self.static_argnums or self.static_argnames:
            count = len(args)
            static = (tuple(arg for i, arg in enumerate(args) if self._is_static(i, count)),
                      tuple((name, kwargs[name]) for name in self.static_argnames if name in kwargs))
            args = tuple(arg for i, arg in enumerate(args) if not self._is_static(i, count))
            kwargs = {name: value for name, value in kwargs.items() if name not in self.static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
        return (tree, static), leaves

    def _auto_choice(self, lowered, args, kwargs, traced: bool) -> str:
        """"plan" or "jit": with backend "auto" on a CPU, the faster of the plan and jax.jit for this
        signature, timed on its first call with concrete arguments and kept in `lowered.stats["auto"]`
        (`driver.auto_choice`); otherwise, and under an outer trace, "plan"."""
        from driver.auto_choice import choose, not_timed, times_choice, untimeable

        if not times_choice(self.backend):
            return "plan"
        if traced:
            # Concrete arguments only when this trace is this object's own jit of a concrete call.
            stash = getattr(getattr(self, "_arguments", None), "call", None)
            if stash is None or any_tracer(stash):
                return "plan"
            args, kwargs = stash
        record = lowered.stats.get("auto")
        if record is None:
            why = untimeable(lowered.program, ([a for i, a in enumerate(args) if not self._is_static(i, len(args))],
                                                {k: v for k, v in kwargs.items() if k not in self.static_argnames}))
            if why is None and traced and not self._donated_inputs(lowered.program, args, kwargs):
                # Timed after this call, the dispatching jit (compiled for the plan now) as the plan.
                self._arguments.pending = lowered
                return "plan"
            if why is not None:
                record = not_timed(why)
            else:  # the arguments are donated by this call, or it runs outside a jit (prepared parameters)
                plan = lowered.executable(self.backend, self.interpret)
                record = choose(plan, self._original_jit(donating=False), args, kwargs, in_trace=traced)
            lowered.stats["auto"] = record
        return record["chose"]

    def _choose_after_first_call(self, jitted, lowered, args, kwargs) -> None:
        """Time the dispatching jit, which ran the plan for this signature, against jax.jit of the
        original function; if jax.jit wins, a fresh dispatching jit traces the original function for
        this signature on its next call (the others keep their recorded choices)."""
        from driver.auto_choice import choose

        record = choose(jitted, self._original_jit(donating=False), args, kwargs, plan_ran=True)
        lowered.stats["auto"] = record
        if record["chose"] == "jit" and self._jitted is jitted:
            self._jitted = None

    def _original_jit(self, donating: bool):
        """`jax.jit` of the original function with this object's static arguments (and donation)."""
        import jax

        jits = self.__dict__.setdefault("_original_jits", {})
        donating = donating and bool(self.donate_argnums or self.donate_argnames)
        if donating not in jits:
            donate = dict(donate_argnums=self.donate_argnums, donate_argnames=self.donate_argnames) if donating else {}
            jits[donating] = jax.jit(self.fn, static_argnums=self.static_argnums,
                                     static_argnames=self.static_argnames, **donate)
        return jits[donating]

    def _call_with_planned_backward(self, args, kwargs):
        """Under reverse-mode differentiation: a custom_vjp of the planned forward (with residuals) and
        the planned backward (`driver.differentiate`), one pair per argument signature."""
        self._check_static_hashable(args, kwargs)
        is_static = lambda i: self._is_static(i, len(args))
        key = self._signature(args, kwargs)
        planned_vjps = self.__dict__.setdefault("_planned_vjps", {})  # unpickled from before it existed
        if key not in planned_vjps:
            fn = flat_function(self.fn, args, kwargs, is_static, self.static_argnames)
            planned_vjps[key] = PlannedVJP.of(fn, lambda f: Optimized(f, **self._planning_options()))
        return with_planned_backward(planned_vjps[key], args, kwargs, is_static, self.static_argnames)

    def _planning_options(self) -> dict:
        """The options a derived function (the planned forward and backward) is optimized with: "auto"
        resolved here, since a derived function's calls are inside a differentiation of this one's
        (no timing against jax.jit, see `_auto_choice`)."""
        import emit

        backend = emit.resolve_backend(self.backend) if self.backend == "auto" else self.backend
        return dict(device=self.device, rulesets=self.rulesets, node_limit=self.node_limit,
                    iteration_limit=self.iteration_limit, time_limit=self.time_limit, extractor=self.extractor,
                    extract_time_limit=self.extract_time_limit, progress=self.progress, backend=backend,
                    interpret=self.interpret, cache=getattr(self, "cache", True))

    @property
    def planned_vjps(self) -> list:
        """The planned forward and backward pairs made so far (`driver.differentiate.PlannedVJP`), one
        per argument signature differentiated in reverse mode."""
        return list(self.__dict__.get("_planned_vjps", {}).values())

    @property
    def lowerings(self) -> list[Lowered]:
        """The lowerings made so far, one per argument signature (calls with a known signature reuse them)."""
        return list(self._cache.values())

    def __getstate__(self):
        """Pickled without its lowerings (e-graphs and opaque primitives do not pickle): it re-plans."""
        state = dict(self.__dict__)
        state["_cache"] = {}
        state["_planned_vjps"] = {}
        state["_jitted"] = None
        state["_arguments"] = None
        state["_original_jits"] = {}
        state["_leaf_routes"] = {}
        return state

    def _donated_inputs(self, program, args, kwargs) -> tuple[str, ...]:
        """The program's input names whose leaves come from donated arguments."""
        return marked_inputs(program, args, kwargs, self.donate_argnums, self.donate_argnames,
                             self.static_argnums, self.static_argnames)

    def _say_not_donated(self, args, kwargs) -> None:
        """Say once that donated buffers stay valid: the interpreter runs op by op. Under an outer
        jit (tracer arguments) donation is that jit's: nothing to say."""
        import jax

        if self._said_not_donated:
            return
        donated = [args[i] for i in self.donate_argnums if -len(args) <= i < len(args)]
        donated += [kwargs[name] for name in self.donate_argnames if name in kwargs]
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(donated)):
            return
        self._said_not_donated = True
        warnings.warn(f"eqsat.optimize({getattr(self.fn, '__qualname__', self.fn)!r}): "
                      f"donate_argnums={self.donate_argnums}, donate_argnames={self.donate_argnames}: the "
                      f"arguments are not donated (backend 'interpret' runs the plan op by op, outside any "
                      f"jit); their buffers stay valid", DonationWarning, stacklevel=3)

    def _check_static_hashable(self, args, kwargs) -> None:
        """Static arguments key the cache: like `jax.jit`, an unhashable one is a `ValueError`."""
        static = [arg for i, arg in enumerate(args) if self._is_static(i, len(args))]
        static += [value for name, value in kwargs.items() if name in self.static_argnames]
        for value in static:
            try:
                hash(value)
            except TypeError as error:
                raise ValueError(f"Non-hashable static arguments are not supported. An error occurred while "
                                 f"trying to hash an object of type {type(value)}, {value!r}. The error was:\n"
                                 f"TypeError: {error}") from None

    def _is_static(self, i: int, count: int) -> bool:
        return i in self.static_argnums or (i - count) in self.static_argnums

    def _signature(self, args, kwargs) -> tuple:
        import jax
        import numpy as np

        static = []
        dynamic = []
        for i, arg in enumerate(args):
            if self._is_static(i, len(args)):
                static.append((i, arg))
            else:
                dynamic.append(arg)
        static_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((dynamic, dynamic_kwargs))
        # dtype objects, not their names: str(dtype) costs ~10 µs a leaf, and a UNet has ~700 leaves.
        shapes = tuple((leaf.shape, leaf.dtype) if hasattr(leaf, "dtype") and hasattr(leaf, "shape")  # PRNG keys too
                       else (np.shape(leaf), type(leaf).__name__) for leaf in leaves)
        return tree, shapes, tuple(static), static_kwargs

    def lower(self, *args, **kwargs) -> Lowered:
        self._check_static_hashable(args, kwargs)
        try:
            key = self._signature(args, kwargs)
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._cache:
            return self._cache[key]
        static_argnums = tuple(i for i in range(len(args)) if self._is_static(i, len(args)))
        lowered = lower(self.fn, *args, static_argnums=static_argnums, static_argnames=self.static_argnames,
                        kwargs=kwargs, device=self.device, rulesets=self.rulesets, node_limit=self.node_limit,
                        iteration_limit=self.iteration_limit, time_limit=self.time_limit,
                        extractor=self.extractor, extract_time_limit=self.extract_time_limit,
                        progress=self.progress, backend=self.backend, interpret=self.interpret,
                        params_argnums=self.params_argnums, params_argnames=self.params_argnames,
                        cache=getattr(self, "cache", True))  # pickled before the plan cache: on
        if key is not None:
            self._cache[key] = lowered
        return lowered


def _inherit_jit_options(fn, static_argnums, static_argnames, donate_argnums, donate_argnames):
    """The static and donated arguments of a `jax.jit`-wrapped `fn`, for each option the caller left
    unset: `optimize(jax.jit(f, donate_argnums=0))` donates as the jitted function does."""
    info = getattr(fn, "_jit_info", None)
    if info is None:
        return static_argnums, static_argnames, donate_argnums, donate_argnames
    inherited = []
    for given, name in ((static_argnums, "static_argnums"), (static_argnames, "static_argnames"),
                        (donate_argnums, "donate_argnums"), (donate_argnames, "donate_argnames")):
        value = getattr(info, name, None)
        inherited.append(given if given is not None or not value else tuple(value))
    return tuple(inherited)


def optimize(fn=None, *, static_argnums=None, static_argnames=None, donate_argnums=None, donate_argnames=None,
             params_argnums=None, params_argnames=None, device="h100", rulesets=None, node_limit: int = 200_000, iteration_limit: int = 400,
             time_limit: float = 60.0, extractor: str = "auto", extract_time_limit: float = 5.0,
             progress: bool | None = None, backend: str = "auto", interpret: bool | None = None,
             cache: bool = True):
    """Optimize `fn` like `jax.jit` does: `optimize(fn, ...)`, `@optimize` or `@optimize(...)`.

    `static_argnums`/`static_argnames`/`donate_argnums`/`donate_argnames` as in `jax.jit` (see the
    module docstring); `params_argnums`/`params_argnames` mark the arguments that stay the same
    across calls, whose derived tensors are prepared once per set of them ("Parameters" there). `rulesets`: None for `eqsat.schedule.default_schedule()`, family names
    (`["absorb"]`), or anything `eqsat.saturate.saturate` takes (a `Schedule`, egglog rulesets).
    `node_limit`, `iteration_limit`, `time_limit` bound saturation; `extractor` is "auto", "greedy"
    or "ilp" (`extract.extract`), `extract_time_limit` bounds it in CPU seconds (a plan does not depend
    on the machine's load); `progress` shows progress bars of the stages and of the kernels emitted
    (None: on a terminal, once that is slow; False: never).
    `backend` ("auto", "pallas", "mosaic", "hybrid", "xla", "interpret") and `interpret` say how calls run the plan
    (`emit.emit`; see "Running" in the module docstring). `cache=False` neither reads nor writes the
    plan cache (`driver.cache`; "Plan cache" in the module docstring).
    """
    options = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                   donate_argnames=donate_argnames, params_argnums=params_argnums, params_argnames=params_argnames,
                   device=device, rulesets=rulesets, node_limit=node_limit,
                   iteration_limit=iteration_limit, time_limit=time_limit, extractor=extractor,
                   extract_time_limit=extract_time_limit, progress=progress, backend=backend, interpret=interpret,
                   cache=cache)
    if fn is None:
        return lambda f: Optimized(f, **options)
    return Optimized(fn, **options)


def lower(fn, *args, static_argnums=(), static_argnames=(), kwargs=None, device="h100", rulesets=None,
          node_limit=200_000, iteration_limit=400, time_limit=60.0, extractor="auto", extract_time_limit=5.0,
          progress=None, backend="auto", interpret=None, params_argnums=(), params_argnames=(),
          cache: bool = True) -> Lowered:
    """Run the stages on `fn(*args, **kwargs)` and return the `Lowered` result (see the module docstring).
    `params_argnums`/`params_argnames` (resolved, as `Optimized` holds them) add the `prepare` stage.
    `cache`: look the plan up in the plan cache after lifting and store it there (`driver.cache`)."""
    from tqdm.auto import tqdm

    import emit
    from emit.backends import cost_backend
    from eqsat.cost import get_device
    from eqsat.cost.devices import with_backend

    device = get_device(device)
    if device.backend == "triton":  # the plan is priced as the backend that runs it will emit it
        device = with_backend(device, cost_backend(emit.resolve_backend(backend)))
    seconds: dict[str, float] = {}
    prepare = bool(params_argnums or params_argnames)
    stages = STAGES + ((PREPARE_STAGE,) if prepare else ())
    label = f"eqsat {progress}" if isinstance(progress, str) else "eqsat"
    bar = tqdm(total=len(stages), desc=label, unit="stage", delay=0.0 if progress else 5.0,
               disable=progress is False or (progress is None and not _on_a_terminal()), leave=False)
    split = None
    caught: list = []
    cached = None
    cache_state, cache_key, cache_seconds = "off", None, 0.0

    def stage(name):
        bar.set_postfix_str(name, refresh=False)
        return _Timer(name, seconds, bar)

    try:
        with stage("lift"):
            from eqsat.lift import lift

            with warnings.catch_warnings(record=True) as lift_warnings:
                warnings.simplefilter("always")
                program = lift(fn, *args, static_argnums=static_argnums, static_argnames=static_argnames,
                               kwargs=kwargs)
            for w in lift_warnings:
                caught.append(str(w.message))
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        plan_options = dict(node_limit=node_limit, iteration_limit=iteration_limit, time_limit=time_limit,
                            extractor=extractor, extract_time_limit=extract_time_limit)
        if cache:
            began = time.perf_counter()
            cache_key, cache_state, cached = _look_up(program, args, kwargs, device, rulesets, plan_options)
            if cached is not None:
                plan, cached_stats = cached
                bar.total = 1 + prepare  # build, saturate and extract skipped
                bar.refresh()
            cache_seconds = time.perf_counter() - began
        if cached is None:
            builder, handles, report, extraction, plan = _plan(program, device, rulesets, plan_options, stage,
                                                               caught, shared=True)
        else:
            for category, message in cached_stats.get("warnings", ()):
                caught.append(message)
                warnings.warn(message, _LIMIT_WARNINGS.get(category, UserWarning), stacklevel=3)
        if prepare:
            with stage(PREPARE_STAGE):
                from emit.prepare import split_plan

                parameters = marked_inputs(program, args, kwargs or {}, params_argnums, params_argnames,
                                           static_argnums, static_argnames)
                split = split_plan(plan, parameters)
    finally:
        bar.close()

    if cached is None:
        search = {"extractor": extraction.extractor, "saturated": report.saturated,
                  "limit_reached": report.limit_reached, "extract_limit_reached": extraction.limit_reached,
                  "e_nodes": report.e_nodes, "e_classes": report.e_classes, "iterations": report.iterations}
    else:
        search = {name: cached_stats["stats"][name] for name in _SEARCH_STATS}
    stats = {
        "naive_kernels": plan.naive_kernels,  # a loop counts once, whatever number of outputs
        "fused_kernels": len(plan.kernels),
        "plan_bytes": plan.bytes,
        "plan_peak_bytes": plan.peak_bytes,
        "plan_seconds": plan.seconds,
        "plan_flops": plan.flops,
        "seconds": seconds,
        **search,
        "device": device.name,
        "cost_backend": device.backend,
        "kinds": plan.kinds(),
        "hosted_reductions": plan.hosted_reductions,
        "loop_body_kernels": plan.loop_body_kernels,
        "naive_loop_body_kernels": plan.naive_loop_body_kernels,
        "parameters": len(split.parameters) if split is not None else 0,
        "prepared_kernels": len(split.prepared.kernels) if split is not None else 0,
        "per_call_kernels": len(split.per_call.kernels) if split is not None else len(plan.kernels),
        "hoisted_kernels": split.hoisted if split is not None else 0,
        "prepared_bytes": split.prepared_bytes if split is not None else 0,
        "cache": cache_state,   # "hit", "miss", "off" or "uncacheable: <why>"
        "cache_key": cache_key,
        "cache_seconds": cache_seconds,  # the key, the look-up and, on a hit, rebuilding the plan
    }
    stats["kernel_routes"] = _kernel_routes(split.per_call if split is not None else plan, device)
    if cached is not None:
        stats["planned_seconds"] = cached_stats["stats"]["seconds"]  # the stages of the run that planned it

        def replan():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # said when the plan was made; the plan kept is the cached one
                builder, _, report, extraction, _ = _plan(program, device, rulesets, plan_options,
                                                          lambda name: _Timer(name, {}, None), [])
            return builder, builder.egraph, report, extraction

        lowered = Lowered(program, None, plan, stats, None, None, None, caught, split, backend, interpret)
        lowered._replan = replan
        lowered.progress = progress
        return lowered
    if cache_state == "miss":
        _store(cache_key, program, extraction, builder, handles, stats, caught)
    lowered = Lowered(program, builder.egraph if builder is not None else None, plan, stats, report, extraction,
                      builder, caught, split, backend, interpret)
    if builder is None:  # planned on the shared e-graph, popped since: built again on first use

        def rebuild():
            from eqsat.egraph import Builder

            fresh = Builder()
            fresh.add(program.outputs)
            _saturate(fresh, program, rulesets, plan_options)
            return fresh, fresh.egraph

        lowered._rebuild = rebuild
    lowered.progress = progress
    return lowered


_SEARCH_STATS = ("extractor", "saturated", "limit_reached", "extract_limit_reached", "e_nodes", "e_classes",
                 "iterations")
_LIMIT_WARNINGS = {"SaturationLimitWarning": SaturationLimitWarning,
                   "ExtractionLimitWarning": ExtractionLimitWarning}


class _SharedEGraph:
    """One e-graph per thread (egglog's e-graphs stay on the thread that made them) with the default
    schedule's rules registered (saturated while empty): a plan pushes its state, builds and
    saturates the program, serializes it and pops it again. Registering the ~400 rules into a new
    e-graph was most of a small program's planning (a LayerNorm+GELU MLP: build + saturate 0.239 s
    fresh, 0.055 s pushed; the same e-nodes and iterations). A plan made while the thread's shared
    e-graph is in use (planning inside planning) gets a fresh e-graph."""

    _local = threading.local()

    @classmethod
    @contextlib.contextmanager
    def pushed(cls):
        local = cls._local
        if getattr(local, "busy", False):
            yield None
            return
        local.busy = True
        try:
            builder = getattr(local, "builder", None)
            if builder is None:
                from eqsat.egraph import Builder
                from eqsat.saturate import saturate
                from eqsat.schedule import schedule_of

                builder = Builder()
                saturate(builder.egraph, schedule_of(None), classes=False)
                local.builder = builder
            builder.egraph.push()
            builder.handles = {}
            try:
                yield builder
            finally:
                builder.egraph.pop()
                builder.handles = {}
        finally:
            local.busy = False


def _saturate(builder, program, rulesets, options):
    """Saturate the builder's e-graph with the schedule of `rulesets` under the options' limits."""
    from eqsat.saturate import saturate
    from eqsat.schedule import schedule_of

    return saturate(builder.egraph, schedule_of(rulesets), node_limit=options["node_limit"],
                    iteration_limit=options["iteration_limit"], time_limit=options["time_limit"],
                    program=program, classes=False)  # e-classes are counted on the extraction's copy


def _kernel_routes(plan, device) -> list[tuple[str, str]]:
    """(kernel name, the route that emits it: "triton", "mosaic", "library") for each dense kernel of
    a plan priced by a backend other than the default (`emit.backends.plan_routes` under `auto`)."""
    if device.backend == "triton":
        return []
    from emit.backends import plan_routes
    from eqsat.cost.backends import routes_for
    from eqsat.cost.terms import args_of
    from emit.pallas import name_of

    if device.backend == "auto":
        chosen = plan_routes(plan, device)
    else:
        chosen = {k.term: routes_for(k.op, args_of(k.term), device, k.term)[0] for k in plan.kernels
                  if k.op in ("Matmul", "Conv", "Attention")}
    return [(name_of(k.component, k.kind), chosen[k.term]) for k in plan.kernels if k.term in chosen]


def _plan(program, device, rulesets, options, stage, caught, shared: bool = False):
    """build, saturate and extract: the builder (None when planned on the shared e-graph, whose
    state is gone after the plan: `Lowered._rebuilt`), its root handles, the saturation report,
    the extraction and its plan. Limit warnings are raised and appended to `caught`."""
    with contextlib.ExitStack() as scope:
        builder = scope.enter_context(_SharedEGraph.pushed()) if shared and rulesets is None else None
        if builder is None:
            shared = False
        with stage("build"):
            from eqsat.egraph import Builder

            builder = builder or Builder()
            handles = builder.add(program.outputs)
        with stage("saturate"):
            from eqsat.saturate import classes_in, serialized_data

            report = _saturate(builder, program, rulesets, options)
            # Serialized once, for the class count and extraction, before a shared e-graph pops.
            serialized = serialized_data(builder.egraph)
        term_handles = dict(builder.handles)
    if shared:
        builder = None
    if not report.saturated:
        message = (f"saturation stopped by {report.limit_reached} after {report.iterations} iterations "
                   f"({report.e_nodes} e-nodes): the plan is the best found so far")
        caught.append(message)
        warnings.warn(message, SaturationLimitWarning, stacklevel=4)
    with stage("extract"):
        import extract as extraction_stage
        from extract.plan import Plan, components_of_classes

        report.e_classes = classes_in(serialized)
        extraction = extraction_stage.extract(serialized, handles, device=device, method=options["extractor"],
                                              time_limit=options["extract_time_limit"])
        # What `extract.plan.plan_from_extraction` does, keeping the class components for the cache.
        handle_components = {h: program.components.get(t, "") for t, h in term_handles.items()}
        extraction.class_components = components_of_classes(extraction.graph, handle_components)
        plan = Plan.build(extraction.terms, program=program, class_of=extraction.class_of,
                          class_components=extraction.class_components, device=device,
                          extractor=extraction.extractor, plan_passes=True)
    if extraction.limit_reached:
        message = (f"extraction stopped by its time limit ({options['extract_time_limit']:g} s): the plan is "
                   f"the best found so far")
        caught.append(message)
        warnings.warn(message, ExtractionLimitWarning, stacklevel=4)
    return builder, handles, report, extraction, plan


def _look_up(program, args, kwargs, device, rulesets, options):
    """(key, "hit" | "miss" | "uncacheable: why", (plan, entry data) on a hit)."""
    import jax

    from driver import cache

    try:
        shardings = cache.multi_device_shardings(jax.tree_util.tree_leaves((args, kwargs or {})))
        key = cache.plan_key(program, device=device, rulesets=rulesets, options=options, shardings=shardings)
    except cache.Uncacheable as why:
        return None, f"uncacheable: {why}", None
    entry = cache.load(key)
    if entry is None:
        return key, "miss", None
    plan = cache.plan_from_entry(entry, program, device)
    if plan is None:
        return key, "miss", None
    return key, "hit", (plan, {"stats": entry.stats, "warnings": entry.warnings})


def _store(key, program, extraction, builder, handles, stats, caught) -> None:
    """Store the plan under `key`; a cache that cannot be written is said once and skipped."""
    from driver import cache

    class_components = extraction.class_components
    limits = [[type_name, message] for type_name, message in _limit_messages(caught)]
    kept = {name: stats[name] for name in _SEARCH_STATS}
    kept["seconds"] = dict(stats["seconds"])
    try:
        cache.store(cache.entry_of(key, program, extraction, class_components, kept, limits))
    except OSError as error:
        warnings.warn(f"eqsat plan cache: cannot write to {cache.plans_dir()} ({error}); not cached",
                      cache.PlanCacheWarning, stacklevel=4)


def _limit_messages(caught):
    for message in caught:
        if message.startswith("saturation stopped by"):
            yield "SaturationLimitWarning", message
        elif message.startswith("extraction stopped by"):
            yield "ExtractionLimitWarning", message


def marked_inputs(program, args, kwargs, argnums, argnames, static_argnums=(), static_argnames=()) -> tuple[str, ...]:
    """The program's input names whose leaves come from the arguments `argnums` (negative ones
    count from the end) or keyword arguments `argnames` of a call with `args` and `kwargs`."""
    import jax

    if not argnums and not argnames:
        return ()
    count = len(args)
    marked = []
    for i, arg in enumerate(args):
        chosen = i in argnums or (i - count) in argnums
        static = i in static_argnums or (i - count) in static_argnums
        marked.append(arg if static else jax.tree_util.tree_map(lambda _, chosen=chosen: chosen, arg))
    marked_kwargs = {}
    for name, value in kwargs.items():
        chosen = name in argnames
        marked_kwargs[name] = value if name in static_argnames else jax.tree_util.tree_map(
            lambda _, chosen=chosen: chosen, value)
    return tuple(name for name, chosen in program.environment(*marked, **marked_kwargs).items() if chosen)


def _params_argnums(fn, params_argnums, params_argnames) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`params_argnums`/`params_argnames` completed from each other through `fn`'s signature and
    validated, as `jax.jit` does for `donate_argnums`/`donate_argnames`."""
    from jax._src import api_util

    signature = api_util.fun_signature(fn)
    if signature is None:
        nums = () if params_argnums is None else api_util._ensure_index_tuple(params_argnums)
        names = () if params_argnames is None else api_util._ensure_str_tuple(params_argnames)
        return nums, names
    nums, names = api_util.infer_argnums_and_argnames(signature, params_argnums, params_argnames)
    api_util._validate_argnums(signature, nums, "params_argnums")
    api_util._validate_argnames(signature, names, "params_argnames")
    return nums, names


def _on_a_terminal() -> bool:
    """Progress by default only where someone watches: stderr is a terminal (not a log, not a pipe)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Timer:
    def __init__(self, name: str, seconds: dict, bar):
        self.name, self.seconds, self.bar = name, seconds, bar

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds[self.name] = time.perf_counter() - self.start
        if self.bar is not None:
            self.bar.update(1)
        return False


class _CallableModule(types.ModuleType):
    """`import eqsat.optimize` binds the module where `eqsat.optimize` means the function; calling the
    module calls the function, so `eqsat.optimize(fn)` works whichever one the attribute holds."""

    def __call__(self, *args, **kwargs):
        return optimize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
