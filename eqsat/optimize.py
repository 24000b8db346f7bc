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

Running: calling the optimized function runs its plan through `emit.emit(plan, backend)`, built
once per signature: `backend="pallas"` emits every kernel as a Pallas kernel (Triton on a GPU,
interpreted on a CPU; `interpret=` forces either), `"hybrid"` convs and matmuls through XLA's
libraries and the rest as Pallas kernels (`emit.library`: our conv and matmul templates are still
slower than cuDNN/cuBLAS, measured), `"mosaic"` matmuls through the Mosaic GPU template (Hopper;
GPU interpret mode on a CPU) and the rest as `"pallas"` (`emit.mosaic`), `"xla"` as jax.numpy (the fast path on a CPU), `"auto"`
(default) picks `hybrid` on a GPU and `xla` elsewhere, and `"interpret"` evaluates the
plan with the reference interpreter (`eqsat.interpret`, correct everywhere, fast nowhere). An
optimized function pickles without its lowerings (it re-plans where it is unpickled), so
`eqsat.xla_target.compile_for_h100(eqsat.optimize(f, backend="pallas"), *args)` compiles the
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

import functools
import sys
import time
import types
import warnings
from dataclasses import dataclass, field

from eqsat.differentiate import any_tracer, with_original_derivatives

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
    egraph: object                  # the saturated egglog EGraph
    plan: object                    # extract.plan.Plan
    stats: dict
    saturation: object = None       # eqsat.saturate.SaturationReport
    extraction: object = None       # extract.Extraction
    builder: object = None          # eqsat.egraph.Builder (its `handles` map lifted terms to Refs)
    warnings: list = field(default_factory=list)
    split: object = None            # emit.prepare.Split: prepare and per-call plans, when parameters are marked
    backend: str = "auto"           # how calling it runs the plan (see `emit.emit`)
    interpret: bool | None = None   # pallas_call(interpret=...); None: by the platform it is lowered for
    _emitted: dict = field(default_factory=dict, repr=False)

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
            if self.split is not None:
                from emit.prepare import Prepared

                self._emitted[key] = Prepared(self.split, backend, interpret=interpret, donate=donate)
            else:
                self._emitted[key] = emit.emit(self.plan, backend, interpret=interpret, donate=donate)
        return self._emitted[key]

    def show(self, **options) -> None:
        """Draw the plan in a notebook (`eqsat.viz.plan_drawing`; text where Graphviz is missing)."""
        from eqsat import viz

        viz.show(viz.plan_drawing(self.plan, **options))

    def _repr_svg_(self):
        from eqsat import viz

        return viz.plan_drawing(self.plan)._repr_svg_()

    def report(self, depth: int = 1) -> str:
        """The stats and the per-component table of the plan."""
        s = self.stats
        stages = ", ".join(f"{name} {sec:.2f}s" for name, sec in s["seconds"].items())
        stop = "saturated" if s["saturated"] else f"stopped by {s['limit_reached']}"
        lines = [
            f"{s['naive_kernels']} naive kernels -> {s['fused_kernels']} fused ({s['extractor']}) on {s['device']}"
            + (f"; loop bodies: {s['naive_loop_body_kernels']} naive -> {s['loop_body_kernels']} fused kernels"
               if s.get("loop_body_kernels") else ""),
            f"modeled {s['plan_seconds'] * 1e6:,.1f} µs, {s['plan_bytes'] / 1e6:,.1f} MB moved, "
            f"peak activations {s['plan_peak_bytes'] / 1e6:,.1f} MB",
            f"e-graph: {s['e_nodes']} e-nodes, {s['e_classes']} e-classes, {s['iterations']} iterations, {stop}",
            f"stages: {stages}",
        ]
        if self.split is None:
            return "\n".join(lines) + "\n" + self.plan.summary(depth)
        lines.append(f"{s['per_call_kernels']} kernels per call; {s['prepared_kernels']} prepared once per set of "
                     f"parameters ({s['hoisted_kernels']} hoisted from per-call operands, "
                     f"{s['prepared_bytes'] / 1e6:,.1f} MB kept)")
        return "\n".join(lines) + "\n" + self.split.summary(depth)


class Optimized:
    """A function wrapped by `optimize`: `.lower(*args)` plans it, calling it runs the plan."""

    def __init__(self, fn, *, static_argnums=None, static_argnames=None, donate_argnums=None,
                 donate_argnames=None, params_argnums=None, params_argnames=None, device="h100", rulesets=None,
                 node_limit=200_000, iteration_limit=400, time_limit=60.0, extractor="auto", extract_time_limit=5.0, progress=None, backend="auto",
                 interpret=None):
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
        self._cache: dict = {}
        self._said_not_donated = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        lowered = self.lower(*args, **kwargs)
        donate = self._donated_inputs(lowered.program, args, kwargs)
        run = lowered.executable(self.backend, self.interpret, donate=donate)
        if donate and run.backend == "interpret":
            self._say_not_donated(args, kwargs)
        if run.backend in ("pallas", "mosaic", "hybrid") and any_tracer((args, kwargs)):
            # Pallas kernels have no general derivative: differentiated, the call is fn's own JVP.
            return with_original_derivatives(run, self.fn, args, kwargs, lambda i: self._is_static(i, len(args)),
                                             self.static_argnames)
        return run(*args, **kwargs)

    @property
    def lowerings(self) -> list[Lowered]:
        """The lowerings made so far, one per argument signature (calls with a known signature reuse them)."""
        return list(self._cache.values())

    def __getstate__(self):
        """Pickled without its lowerings (e-graphs and opaque primitives do not pickle): it re-plans."""
        state = dict(self.__dict__)
        state["_cache"] = {}
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
        shapes = tuple((tuple(leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)),  # PRNG keys: no np.shape
                        str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves)
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
                        params_argnums=self.params_argnums, params_argnames=self.params_argnames)
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
             progress: bool | None = None, backend: str = "auto", interpret: bool | None = None):
    """Optimize `fn` like `jax.jit` does: `optimize(fn, ...)`, `@optimize` or `@optimize(...)`.

    `static_argnums`/`static_argnames`/`donate_argnums`/`donate_argnames` as in `jax.jit` (see the
    module docstring); `params_argnums`/`params_argnames` mark the arguments that stay the same
    across calls, whose derived tensors are prepared once per set of them ("Parameters" there). `rulesets`: None for `eqsat.schedule.default_schedule()`, family names
    (`["absorb"]`), or anything `eqsat.saturate.saturate` takes (a `Schedule`, egglog rulesets).
    `node_limit`, `iteration_limit`, `time_limit` bound saturation; `extractor` is "auto", "greedy"
    or "ilp" (`extract.extract`); `progress` shows a progress bar (None: only when a lowering is slow).
    `backend` ("auto", "pallas", "mosaic", "hybrid", "xla", "interpret") and `interpret` say how calls run the plan
    (`emit.emit`; see "Running" in the module docstring).
    """
    options = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                   donate_argnames=donate_argnames, params_argnums=params_argnums, params_argnames=params_argnames,
                   device=device, rulesets=rulesets, node_limit=node_limit,
                   iteration_limit=iteration_limit, time_limit=time_limit, extractor=extractor,
                   extract_time_limit=extract_time_limit, progress=progress, backend=backend, interpret=interpret)
    if fn is None:
        return lambda f: Optimized(f, **options)
    return Optimized(fn, **options)


def _schedule(rulesets):
    from eqsat.schedule import default_schedule

    if rulesets is None:
        return default_schedule()
    if isinstance(rulesets, str):
        return default_schedule([rulesets])
    if isinstance(rulesets, (list, tuple)) and rulesets and all(isinstance(r, str) for r in rulesets):
        return default_schedule(rulesets)
    return rulesets


def lower(fn, *args, static_argnums=(), static_argnames=(), kwargs=None, device="h100", rulesets=None,
          node_limit=200_000, iteration_limit=400, time_limit=60.0, extractor="auto", extract_time_limit=5.0,
          progress=None, backend="auto", interpret=None, params_argnums=(), params_argnames=()) -> Lowered:
    """Run the stages on `fn(*args, **kwargs)` and return the `Lowered` result (see the module docstring).
    `params_argnums`/`params_argnames` (resolved, as `Optimized` holds them) add the `prepare` stage."""
    from tqdm.auto import tqdm

    from eqsat.cost import get_device

    device = get_device(device)
    seconds: dict[str, float] = {}
    stages = STAGES + ((PREPARE_STAGE,) if params_argnums or params_argnames else ())
    label = f"eqsat {progress}" if isinstance(progress, str) else "eqsat"
    bar = tqdm(total=len(stages), desc=label, unit="stage", delay=0.0 if progress else 2.0,
               disable=progress is False, leave=False)
    split = None
    caught: list = []

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
        with stage("build"):
            from eqsat.egraph import Builder

            builder = Builder()
            handles = builder.add(program.outputs)
        with stage("saturate"):
            from eqsat.saturate import classes_in, saturate, serialized_data

            report = saturate(builder.egraph, _schedule(rulesets), node_limit=node_limit, iteration_limit=iteration_limit,
                              time_limit=time_limit, program=program, classes=False)  # counted on the extraction's copy
        if not report.saturated:
            message = (f"saturation stopped by {report.limit_reached} after {report.iterations} iterations "
                       f"({report.e_nodes} e-nodes): the plan is the best found so far")
            caught.append(message)
            warnings.warn(message, SaturationLimitWarning, stacklevel=3)
        with stage("extract"):
            import extract as extraction_stage
            from extract.plan import plan_from_extraction

            serialized = serialized_data(builder.egraph)  # serialized once: for the class count and extraction
            report.e_classes = classes_in(serialized)
            extraction = extraction_stage.extract(serialized, handles, device=device,
                                                  method=extractor, time_limit=extract_time_limit)
            plan = plan_from_extraction(extraction, program, builder.handles, device)
        if extraction.limit_reached:
            message = (f"extraction stopped by its time limit ({extract_time_limit:g} s): the plan is the best "
                       f"found so far")
            caught.append(message)
            warnings.warn(message, ExtractionLimitWarning, stacklevel=3)
        if PREPARE_STAGE in stages:
            with stage(PREPARE_STAGE):
                from emit.prepare import split_plan

                parameters = marked_inputs(program, args, kwargs or {}, params_argnums, params_argnames,
                                           static_argnums, static_argnames)
                split = split_plan(plan, parameters)
    finally:
        bar.close()

    stats = {
        "naive_kernels": plan.naive_kernels,  # a loop counts once, whatever number of outputs
        "fused_kernels": len(plan.kernels),
        "plan_bytes": plan.bytes,
        "plan_peak_bytes": plan.peak_bytes,
        "plan_seconds": plan.seconds,
        "plan_flops": plan.flops,
        "seconds": seconds,
        "extractor": extraction.extractor,
        "saturated": report.saturated,
        "limit_reached": report.limit_reached,
        "extract_limit_reached": extraction.limit_reached,
        "e_nodes": report.e_nodes,
        "e_classes": report.e_classes,
        "iterations": report.iterations,
        "device": device.name,
        "kinds": plan.kinds(),
        "hosted_reductions": plan.hosted_reductions,
        "loop_body_kernels": plan.loop_body_kernels,
        "naive_loop_body_kernels": plan.naive_loop_body_kernels,
        "parameters": len(split.parameters) if split is not None else 0,
        "prepared_kernels": len(split.prepared.kernels) if split is not None else 0,
        "per_call_kernels": len(split.per_call.kernels) if split is not None else len(plan.kernels),
        "hoisted_kernels": split.hoisted if split is not None else 0,
        "prepared_bytes": split.prepared_bytes if split is not None else 0,
    }
    return Lowered(program, builder.egraph, plan, stats, report, extraction, builder, caught, split, backend,
                   interpret)


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


class _Timer:
    def __init__(self, name: str, seconds: dict, bar):
        self.name, self.seconds, self.bar = name, seconds, bar

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds[self.name] = time.perf_counter() - self.start
        self.bar.update(1)
        return False


class _CallableModule(types.ModuleType):
    """`import eqsat.optimize` binds the module where `eqsat.optimize` means the function; calling the
    module calls the function, so `eqsat.optimize(fn)` works whichever one the attribute holds."""

    def __call__(self, *args, **kwargs):
        return optimize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
