"""Compile once: cold against warm planning and compiles, ours against XLA's, distinct kernels against launched.

    python -m benchmarks.compile [--components text_encoder,vae,unet] [--batch 2] [--size 512] [--json out.json]
    python -m benchmarks.compile --duplicates 24       # N identical Triton kernels, named alike vs apart
    python -m benchmarks.compile --phases --components vae [--config tiny] [--xla-flags ...]  # where a cold compile goes
    python -m benchmarks.compile --fingerprint --components unet,vae   # the kernels launched: names and IR, hashed
    python -m benchmarks.compile --emitters --components unet   # one Mosaic plan, emitted by Mosaic and by Triton

Per SD 1.5 component (full size, fp16, abstract weights; `sd15.workloads.workloads`), deployed as
`sd15 plan` deploys it (`measure.compare.optimized`: the Pallas backend, weights marked as parameters):

- plan, cold and warm: `optimize(fn).lower(*args)` wall seconds in a fresh process with an empty
  plan cache (`driver.cache`), then in a second fresh process on the cache the first one wrote;
  each row says whether the plan came from the cache.
- kernels: the per-call executable traced and lowered for a GPU on this machine
  (`lowering_platforms=("cuda",)`, no compile): Triton custom calls launched, and distinct ones
  (distinct backend configs, name and Triton IR: what XLA compiles, once each), with the seconds
  the trace and lowering took.
- compile for an H100, cold and warm, ours and XLA's: `measure.xla_target`'s deviceless H100
  topology in a fresh process with JAX's persistent compilation cache on (a folder of its own, every
  entry kept: `jax_persistent_cache_min_compile_time_secs=0`), twice; the second process reads
  what the first wrote. `cache_hits` counts JAX's `/jax/compilation_cache/cache_hits` events
  (none: a deviceless compile cannot read JAX's entries back). Both processes also get XLA's kernel
  cache file as eqsat gives it on a GPU (`driver.xla_kernel_cache`; ours in the plan cache folder,
  XLA's in one of its own): `ptxas_cpu_seconds` (the compile's child processes) is zero where every
  kernel came from the file.
  Ours re-plans in those processes (an optimized function pickles without its plan) from the
  warm plan cache.

`--phases`: one cold compile per side (ours, XLA's), split into phases: Python emission (templates
building kernel jaxprs, Pallas lowering them to Triton IR), XLA's HLO passes, and per Triton kernel
the Triton pipeline, LLVM and ptxas, read from XLA's own log; wall, thread and CPU seconds
(`benchmarks.compile_phases`).

`--emitters`: one plan, made for the Mosaic GPU backend (`optimize(..., backend="mosaic")`), its per-call
stage emitted by the Mosaic templates and by the Triton templates (`Lowered.executable(backend)`),
each compiled cold for the H100 topology in a fresh process of its own (no JAX cache, no kernel
cache): trace + lowering seconds (the templates and, for Mosaic, its layout inference and lowering),
XLA's compile seconds (for Mosaic its PTX and cubins too), the process's CPU seconds (its children's
too: ptxas) over both and each, the CPU seconds of Mosaic GPU's lowering of its kernels by phase
(`mosaic_phase_seconds`: the kernel jaxpr to the Mosaic dialect, layout inference, the dialect's
lowering), and the Pallas kernels launched and distinct (custom calls and their distinct backend configs).

`--duplicates N` compiles N identical Pallas Triton kernels (one template, one shape) for an H100
twice: named apart (`site0`, `site1`, ...) and named alike, the case `emit.pallas.shared_names`
makes of identical plan kernels.

Compile seconds are wall seconds of a 2-core machine that others share: the report records the
load average before and after each component.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# --- Triton custom calls in a lowered module -------------------------------------------------------


def triton_calls(lowered) -> list[tuple[str, bytes]]:
    """(name, Triton IR) of every Pallas Triton kernel launch of a `jax.stages.Lowered` for a GPU:
    custom calls reached from `main`, through every `func.call` (a function called twice launches
    its kernels twice), in program order."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    functions = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            functions[ir.StringAttr(op.attributes["sym_name"]).value] = op
    found: list[tuple[str, bytes]] = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    name = op.operation.name
                    if name == "stablehlo.custom_call":
                        target = ir.StringAttr(op.attributes["call_target_name"]).value
                        if target == "__gpu$xla.gpu.triton":
                            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                            found.append((ir.StringAttr(config["name"]).value,
                                          bytes(ir.StringAttr(config["ir"]).value_bytes)))
                    elif name == "func.call":
                        walk(functions[ir.FlatSymbolRefAttr(op.attributes["callee"]).value].operation)
                    walk(op.operation)

    walk(functions["main"].operation)
    return found


def kernel_text(ir_bytes: bytes) -> str:
    """A Triton kernel's IR (a custom call's serialized module) as text without debug locations:
    what the kernel computes, the same when only the template's source lines moved (the PTX
    carries no line information either)."""
    from jax._src.lib.mlir import ir, passmanager
    from jax._src.pallas.triton import lowering as triton_lowering

    with triton_lowering._new_ir_context():
        module = ir.Module.parse(ir_bytes)
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
        return module.operation.get_asm(enable_debug_info=False)


def kernel_fingerprint(lowered) -> str:
    """sha256 over every Triton launch's name and `kernel_text`, in program order: equal before
    and after a change exactly when the program launches the same kernels, named alike."""
    import hashlib

    digest = hashlib.sha256()
    texts: dict[bytes, str] = {}
    for name, ir_bytes in triton_calls(lowered):
        if ir_bytes not in texts:
            texts[ir_bytes] = kernel_text(ir_bytes)
        digest.update(hashlib.sha256(f"{name}\0{texts[ir_bytes]}".encode()).digest())
    return digest.hexdigest()


def lowered_kernels(lowered) -> int:
    """Triton custom calls in the module's text: each distinct kernel lowered once where identical
    kernels share a function (`emit.pallas.emit_shared`)."""
    return lowered.as_text().count("@__gpu$xla.gpu.triton")


def kernel_counts(lowered) -> dict[str, int]:
    """Launched Triton kernels, distinct backend configs (what XLA compiles, once each), distinct
    IRs, and the kernels JAX lowered (Triton custom calls in the module)."""
    calls = triton_calls(lowered)
    return {"launched": len(calls), "distinct": len(set(calls)), "distinct_ir": len({ir for _, ir in calls}),
            "lowered": lowered_kernels(lowered)}


# --- subprocess children ---------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _workload(component: str, batch: int, size: int | None, config: str = "full"):
    from sd15 import workloads as sd15_workloads

    return sd15_workloads.workloads(batch=batch, size=size, config=config, components=(component,))[component]


def _optimized(workload):
    from measure import compare

    optimize, reason = compare._load_optimize()
    if optimize is None:
        raise RuntimeError(reason)
    return compare.optimized(workload, optimize, "h100")


def child_plan(component: str, batch: int, size: int | None, kernels: bool) -> dict[str, Any]:
    """Plan one component (and, with `kernels`, lower its per-call stage for a GPU): seconds and counts."""
    import jax

    workload = _workload(component, batch, size)
    start = time.perf_counter()
    fast = _optimized(workload)
    lowered = fast.lower(*workload.args)
    result: dict[str, Any] = {"plan_seconds": time.perf_counter() - start, "cache": lowered.stats.get("cache"),
                              "stages": lowered.stats["seconds"], "cache_seconds": lowered.stats.get("cache_seconds"),
                              "per_call_kernels": lowered.stats["per_call_kernels"]}
    if kernels:
        from measure import compare

        prepared = lowered.split.prepared_specs() if lowered.split is not None else []
        start = time.perf_counter()
        gpu = jax.jit(functools.partial(compare.emitted_per_call, fast)).trace(prepared, *workload.args).lower(
            lowering_platforms=("cuda",))
        result["trace_lower_seconds"] = time.perf_counter() - start
        result["kernels"] = kernel_counts(gpu)
        result["fingerprint"] = kernel_fingerprint(gpu)
    return result


def child_compile(request: dict) -> dict[str, Any]:
    """Compile `request["fn"]` for the H100 topology with JAX's persistent compilation cache in
    `request["jax_cache"]` and XLA's kernel cache file as eqsat gives it (`driver.xla_kernel_cache`,
    under `EQSAT_CACHE_DIR`): lower and compile seconds, cache hit and miss events, the CPU seconds of
    the compile's child processes (ptxas: zero when every kernel came from the kernel cache)."""
    import resource

    import jax
    import numpy as np
    from jax._src import monitoring

    from measure.xla_target import h100_topology

    jax.config.update("jax_compilation_cache_dir", request["jax_cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", True)
    events: dict[str, int] = {}
    monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
    topology = h100_topology()
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    args = jax.tree_util.tree_map(place, request["args"])
    from driver.xla_kernel_cache import compiler_options

    options = compiler_options(topology.devices) if request.get("kernel_cache", True) else {}
    start = time.perf_counter()
    lowered = jax.jit(request["fn"], compiler_options=options or None).lower(*args)
    lower_seconds = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    lowered.compile()
    compile_seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    kernel_file = options.get("xla_gpu_kernel_cache_file")
    return {"lower_seconds": lower_seconds, "compile_seconds": compile_seconds,
            "ptxas_cpu_seconds": after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime,
            "kernel_cache_bytes": Path(kernel_file).stat().st_size if kernel_file and Path(kernel_file).exists() else 0,
            "cache_hits": events.get("/jax/compilation_cache/cache_hits", 0),
            "cache_requests": events.get("/jax/compilation_cache/compile_requests_use_cache", 0),
            "cache_entries": len(list(Path(request["jax_cache"]).glob("*")))}


def child_ready(request: dict) -> dict[str, Any]:
    """One process of a start, deviceless on the H100 topology, as a deployment's first call on a GPU
    makes it: plan (from the plan cache when warm), the per-call stage exported to StableHLO for
    CUDA or read back (what `emit.exported` keeps), its call lowered and compiled with XLA's kernel
    cache file (`driver.xla_kernel_cache`). Seconds per step; ptxas CPU seconds."""
    import resource

    import jax
    import numpy as np

    from driver.xla_kernel_cache import compiler_options
    from emit.exported import UNSTABLE_CUSTOM_CALLS
    from measure import compare
    from measure.xla_target import h100_topology

    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name):
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = seconds.get(name, 0.0) + now - clock
        clock = now

    workload = _workload(request["component"], request["batch"], request["size"], request.get("config", "full"))
    fast = _optimized(workload)
    lowered = fast.lower(*workload.args)
    prepared = lowered.split.prepared_specs() if lowered.split is not None else []
    lap("plan")
    topology = h100_topology()
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topology.devices), ("x",)),
                                          jax.sharding.PartitionSpec())
    abstract = [prepared, *workload.args]
    placed = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)
    lap("topology")
    path = Path(request["exported"])
    if path.is_file():
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
        lap("read")
    else:
        checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in UNSTABLE_CUSTOM_CALLS]
        exported = jax.export.export(jax.jit(functools.partial(compare.emitted_per_call, fast)), platforms=("cuda",),
                                     disabled_checks=checks)(*abstract)
        lap("trace")
        path.write_bytes(exported.serialize())
        lap("write")
    options = compiler_options(topology.devices)
    compiled_lowering = jax.jit(exported.call, compiler_options=options or None).lower(*placed)
    lap("lower")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    compiled_lowering.compile()
    lap("compile")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": seconds, "cache": lowered.stats.get("cache"), "kernel_cache": bool(options),
            "ptxas_cpu_seconds": after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime}


# Mosaic GPU's lowering of one kernel, by phase (`lower_pipelined_jaxpr_to_module` in jax 0.10.2): the
# kernel's jaxpr to the Mosaic GPU dialect (`_lower_as_gpu_kernel`), layout inference (`infer_layout`),
# the dialect to LLVM-bound MLIR (`lower_mgpu_dialect`); `module` is the whole of one kernel's lowering.
MOSAIC_PHASES = (("module", "jax._src.pallas.mosaic_gpu.lowering", "lower_pipelined_jaxpr_to_module"),
                 ("to_dialect", "jax.experimental.mosaic.gpu.core", "_lower_as_gpu_kernel"),
                 ("layout_inference", "jax.experimental.mosaic.gpu", "infer_layout"),
                 ("dialect_lowering", "jax.experimental.mosaic.gpu", "lower_mgpu_dialect"))


@contextlib.contextmanager
def mosaic_phase_seconds():
    """While this holds, the dict it yields sums the CPU seconds (this process's) of each of
    `MOSAIC_PHASES` and counts the kernels lowered (`modules`); phases this jax does not have are left out."""
    import importlib

    seconds: dict[str, float] = {"modules": 0}
    patched = []
    for phase, module_name, attribute in MOSAIC_PHASES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, attribute, None)
        if original is None:
            continue

        def timed(*args, _original=original, _phase=phase, **kwargs):
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_phase] = seconds.get(_phase, 0.0) + time.process_time() - start
                if _phase == "module":
                    seconds["modules"] += 1

        setattr(module, attribute, timed)
        patched.append((module, attribute, original))
    try:
        yield seconds
    finally:
        for module, attribute, original in patched:
            setattr(module, attribute, original)


def child_emitter(request: dict) -> dict[str, Any]:
    """The per-call stage of `request["component"]`'s Mosaic plan emitted by `request["emitter"]`,
    traced, lowered and compiled for the H100 topology (planning first, not timed): seconds per step,
    this process's CPU seconds over both (its children's too: ptxas), Pallas kernels launched and
    distinct."""
    import re
    import resource

    import jax
    import numpy as np

    from measure import compare
    from measure.xla_target import h100_topology

    workload = _workload(request["component"], request["batch"], request["size"], request["config"])
    optimize, reason = compare._load_optimize()
    if optimize is None:
        raise RuntimeError(reason)
    fast = compare.optimized(workload, optimize, "h100", "mosaic")
    lowered = fast.lower(*workload.args)
    prepared = lowered.split.prepared_specs() if lowered.split is not None else []
    run = lowered.executable(request["emitter"])
    topology = h100_topology()
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    args = jax.tree_util.tree_map(place, [prepared, *workload.args])

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    per_call = run.per_call if hasattr(run, "per_call") else (lambda _prepared, *xs: run(*xs))
    cpu0, start = cpu(), time.perf_counter()
    with mosaic_phase_seconds() as mosaic_lowering:
        gpu = jax.jit(per_call).lower(*args)
    lower_seconds = time.perf_counter() - start
    cpu1, start = cpu(), time.perf_counter()
    compiled = gpu.compile()
    compile_seconds = time.perf_counter() - start
    text = compiled.as_text()
    calls = re.findall(r'custom_call_target="([^"]*)"[^\n]*?backend_config=(\{[^\n]*\}|"[^"\n]*")', text)
    pallas = [(target, config) for target, config in calls if "mosaic" in target or "triton" in target]
    return {"planned_kernels": lowered.stats["per_call_kernels"], "lower_seconds": lower_seconds,
            "compile_seconds": compile_seconds, "cpu_seconds": cpu() - cpu0, "lower_cpu_seconds": cpu1 - cpu0,
            "compile_cpu_seconds": cpu() - cpu1, "mosaic_lowering": mosaic_lowering,
            "launched": {t: sum(1 for target, _ in pallas if target == t) for t in {t for t, _ in pallas}},
            "distinct": len(set(pallas))}


def _run_child(kind: str, payload, env: dict | None = None, timeout: float = 7200,
               keep_stderr: bool = False) -> dict[str, Any]:
    """Run a child of this module in a fresh process; its JSON result (or its error), with the
    child's stderr under "stderr" when `keep_stderr`."""
    import cloudpickle

    from measure.xla_target import _child_env

    with tempfile.TemporaryDirectory(prefix="eqsat_compile_") as scratch:
        request, report = Path(scratch) / "request.pkl", Path(scratch) / "report.json"
        request.write_bytes(cloudpickle.dumps(payload))
        compiles = kind in ("compile", "phases", "ready", "emitter")
        child_env = _child_env(Path(scratch) / "dump") if compiles else dict(os.environ)
        if compiles:  # no XLA dump: it is not read here, and it costs disk and time
            child_env["XLA_FLAGS"] = " ".join(f for f in child_env["XLA_FLAGS"].split() if "xla_dump_to" not in f)
        child_env.update(env or {})
        child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), child_env.get("PYTHONPATH", "")])
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "benchmarks.compile", "--child", kind, str(request), str(report)],
                              env=child_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if not report.is_file():
            return {"error": f"exit {done.returncode}: {done.stderr[-3000:]}", "wall_seconds": wall}
        result = json.loads(report.read_text())
        result["wall_seconds"] = wall
        if keep_stderr:
            result["stderr"] = done.stderr
        return result


def child_phases(request: dict) -> dict[str, Any]:
    """In a process on XLA's log (`XLA_LOG_MODULES`): plan (ours), trace, lower and compile
    `request["component"]` for the H100 topology; seconds per stage and the Python phases inside.
    XLA's phases are parsed by the parent from this process's log."""
    import functools

    import jax
    import numpy as np
    from jax._src.pallas.triton import lowering as triton_lowering

    import emit.pallas
    from benchmarks.compile_phases import ThreadCpu, _Accumulator, _cpu
    from measure import compare
    from measure.xla_target import h100_topology
    from sd15 import workloads as sd15_workloads

    jax.config.update("jax_enable_compilation_cache", False)  # cold: nothing read back
    workload = sd15_workloads.workloads(batch=request["batch"], size=request["size"], config=request["config"],
                                        components=(request["component"],))[request["component"]]
    topology = h100_topology()
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    result: dict[str, Any] = {"side": request["side"]}
    if request["side"] == "ours":
        start = time.perf_counter()
        fast = _optimized(workload)
        lowered = fast.lower(*workload.args)
        result["plan_s"] = time.perf_counter() - start
        result["plan_cache"] = lowered.stats.get("cache")
        prepared = lowered.split.prepared_specs() if lowered.split is not None else []
        fn, args = functools.partial(compare.emitted_per_call, fast), [prepared, *workload.args]
    else:
        fn, args = workload.fn, list(workload.args)
    args = jax.tree_util.tree_map(place, args)
    emission = _Accumulator(emit.pallas, "emit_kernel")
    triton = _Accumulator(triton_lowering, "lower_jaxpr_to_triton_module")
    try:
        stages = {}
        cpu, children = _cpu()
        start = time.perf_counter()
        traced = jax.jit(fn).trace(*args)
        stages["trace"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered_gpu = traced.lower()
        stages["lower"] = time.perf_counter() - start
        python_cpu = _cpu()[0] - cpu
        start = time.perf_counter()
        with ThreadCpu() as threads:
            lowered_gpu.compile()
        stages["compile"] = time.perf_counter() - start
        own, kids = _cpu()
    finally:
        emission.restore()
        triton.restore()
    result.update(
        trace_s=stages["trace"], lower_s=stages["lower"], compile_s=stages["compile"],
        python_cpu_s=python_cpu, compile_cpu_s=own - cpu - python_cpu, compile_children_cpu_s=kids - children,
        compile_main_thread_cpu_s=threads.main_thread(), compile_worker_cpu_s=threads.others(),
        template_emission_s=emission.seconds, kernels_emitted=emission.calls,
        triton_lowering_s=triton.seconds, kernels_lowered=triton.calls,
        kernels=kernel_counts(lowered_gpu))
    return result


def _child_main(kind: str, request_path: str, report_path: str) -> int:
    try:
        request = pickle.loads(Path(request_path).read_bytes())
        if kind == "plan":
            result = child_plan(**request)
        elif kind == "phases":
            result = child_phases(request)
        elif kind == "ready":
            result = child_ready(request)
        elif kind == "emitter":
            result = child_emitter(request)
        else:
            result = child_compile(request)
    except Exception:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()[-4000:]}
    Path(report_path).write_text(json.dumps(result))
    return 0


# --- the measurements --------------------------------------------------------------------------------


def measure_component(component: str, batch: int, size: int | None, log=print) -> dict[str, Any]:
    from measure import compare

    row: dict[str, Any] = {"component": component, "load_before": _load()}
    plan_cache = tempfile.mkdtemp(prefix="eqsat_plan_cache_")
    env = {"EQSAT_CACHE_DIR": plan_cache}
    plan_request = {"component": component, "batch": batch, "size": size, "kernels": False}
    row["plan_cold"] = _run_child("plan", plan_request, env)
    log(f"{component}: plan cold {row['plan_cold']}")
    row["plan_warm"] = _run_child("plan", {**plan_request, "kernels": True}, env)
    log(f"{component}: plan warm + GPU lowering {row['plan_warm']}")

    workload = _workload(component, batch, size)
    os.environ["EQSAT_CACHE_DIR"] = plan_cache
    fast = _optimized(workload)
    lowered = fast.lower(*workload.args)
    prepared = lowered.split.prepared_specs() if lowered.split is not None else []
    ours = {"fn": functools.partial(compare.emitted_per_call, fast), "args": [prepared, *workload.args]}
    xla = {"fn": workload.fn, "args": list(workload.args)}
    for name, request in (("ours", ours), ("xla", xla)):
        jax_cache = tempfile.mkdtemp(prefix=f"eqsat_jax_cache_{name}_")
        # XLA's kernel cache file lives in the eqsat cache folder: ours in the plan's, XLA's in its own
        # (so that neither compiles the other's kernels warm)
        side_env = env if name == "ours" else {"EQSAT_CACHE_DIR": tempfile.mkdtemp(prefix="eqsat_xla_kernels_")}
        for attempt in ("cold", "warm"):
            result = _run_child("compile", {**request, "jax_cache": jax_cache}, side_env)
            row[f"compile_{name}_{attempt}"] = result
            log(f"{component}: compile {name} {attempt} {result}")
    row["load_after"] = _load()
    return row


def measure_phases(component: str, batch: int, size: int | None, config: str = "full", log=print,
                   xla_flags: str = "") -> dict[str, Any]:
    """Where a cold compile goes, ours and XLA's (`benchmarks.compile_phases`): one fresh process
    per side, XLA logging its phases (`XLA_LOG_MODULES`); `xla_flags` added to `XLA_FLAGS`."""
    from benchmarks.compile_phases import XLA_LOG_MODULES, parse_xla_log

    row: dict[str, Any] = {"component": component, "config": config, "load_before": _load(), "xla_flags": xla_flags}
    env = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": XLA_LOG_MODULES}
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), xla_flags]).strip()
    for side in ("ours", "xla"):
        request = {"component": component, "batch": batch, "size": size, "config": config, "side": side}
        result = _run_child("phases", request, env, keep_stderr=True)
        parsed = parse_xla_log(result.pop("stderr", ""))
        if "error" not in result:
            result["xla"] = parsed
        row[side] = result
        log(f"{component}: phases {side}: {'error' if 'error' in result else 'done'} in {result['wall_seconds']:.0f} s")
    row["load_after"] = _load()
    return row


def phases_json(row: dict[str, Any]) -> dict[str, Any]:
    """`measure_phases`' row with its kernels as plain dicts."""
    import dataclasses

    out = dict(row)
    for side in ("ours", "xla"):
        entry = dict(row[side])
        if "xla" in entry:
            entry["xla"] = {**entry["xla"], "kernels": [dataclasses.asdict(k) for k in entry["xla"]["kernels"]]}
        out[side] = entry
    return out


def measure_duplicates(count: int, log=print) -> dict[str, Any]:
    """`count` identical Triton kernels compiled for an H100, named apart and named alike."""
    import jax
    import jax.numpy as jnp

    args = [[jax.ShapeDtypeStruct((4096,), jnp.float32)] * count]
    row: dict[str, Any] = {"kernels": count, "load_before": _load()}
    for alike in (False, True):
        jax_cache = tempfile.mkdtemp(prefix="eqsat_jax_cache_dup_")
        result = _run_child("compile", {"fn": functools.partial(_duplicated, alike=alike), "args": args,
                                        "jax_cache": jax_cache})
        row["named_alike" if alike else "named_apart"] = result
        log(f"{count} identical kernels, {'named alike' if alike else 'named apart'}: {result}")
    row["load_after"] = _load()
    return row


def _duplicated(xs, *, alike: bool):
    """One Pallas Triton kernel (a long elementwise chain) launched on each of `xs`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from emit.pallas import triton

    def kernel(x_ref, o_ref):
        offsets = pl.program_id(0) * 256 + jnp.arange(256)
        y = triton.gather_load(x_ref, offsets)
        for _ in range(40):
            y = jnp.tanh(y * 1.01 + 0.5) * jnp.exp(-y * y) + jnp.sin(y)
        triton.store(o_ref, offsets, y)

    outs = []
    for i, x in enumerate(xs):
        with jax.named_scope(f"site{i}"):
            (out,) = triton.pallas_call(kernel, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                                        grid=(x.shape[0] // 256,), name="shared" if alike else f"site{i}",
                                        interpret=False)
            outs.append(out)
    return outs


def measure_ready(component: str, batch: int, size: int | None, config: str = "full", log=print) -> dict[str, Any]:
    """A cold then a warm start of `component` in fresh processes on one eqsat cache folder, deviceless
    on the H100 topology (`child_ready`): what a second process pays before its first launch."""
    row: dict[str, Any] = {"component": component, "config": config, "load_before": _load()}
    folder = tempfile.mkdtemp(prefix="eqsat_ready_")
    env = {"EQSAT_CACHE_DIR": folder}
    request = {"component": component, "batch": batch, "size": size, "config": config,
               "exported": str(Path(folder) / "per_call.bin")}
    for attempt in ("cold", "warm"):
        row[attempt] = _run_child("ready", request, env)
        log(f"{component}: {attempt} start {row[attempt]}")
    row["load_after"] = _load()
    return row


def measure_emitters(component: str, batch: int, size: int | None, config: str = "full", log=print) -> dict[str, Any]:
    """One Mosaic plan of `component`, its per-call stage compiled cold by each emitter (`child_emitter`),
    in fresh processes on one warm plan cache (the plan is made once, before either)."""
    row: dict[str, Any] = {"component": component, "config": config, "load_before": _load()}
    env = {"EQSAT_CACHE_DIR": tempfile.mkdtemp(prefix="eqsat_emitters_")}
    for emitter in ("mosaic", "pallas", "mosaic"):  # the first plans (and fills the plan cache); the last is timed
        key = emitter if emitter not in row else f"{emitter}_again"
        row[key] = _run_child("emitter", {"component": component, "batch": batch, "size": size, "config": config,
                                          "emitter": emitter}, env)
        log(f"{component}: {emitter} emitter {row[key]}")
    row["load_after"] = _load()
    return row


def print_emitters(rows: list[dict[str, Any]]) -> None:
    print("| component | emitter | planned kernels | Pallas launched (distinct) | trace+lower s | compile s | CPU s "
          "(trace+lower + compile) | Mosaic lowering CPU s: kernels, to dialect, layout inference, dialect lowering | "
          "load before / after |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        for key in ("mosaic", "pallas", "mosaic_again"):
            run = row[key]
            if "error" in run:
                print(f"| {row['component']} | {key} | error: {run['error'][-200:]} |")
                continue
            phases = run.get("mosaic_lowering", {})
            mosaic = (f"{phases.get('module', 0):.1f} ({phases.get('modules', 0)} kernels): "
                      + ", ".join(f"{phases.get(name, 0):.1f}" for name in ("to_dialect", "layout_inference",
                                                                            "dialect_lowering")))
            print(f"| {row['component']} | {key} | {run['planned_kernels']} | {sum(run['launched'].values())} "
                  f"({run['distinct']}) | {run['lower_seconds']:.1f} | {run['compile_seconds']:.1f} | "
                  f"{run['cpu_seconds']:.1f} ({run.get('lower_cpu_seconds', 0):.1f} + "
                  f"{run.get('compile_cpu_seconds', 0):.1f}) | {mosaic} | {row['load_before']} / {row['load_after']} |")


def print_ready(rows: list[dict[str, Any]]) -> None:
    steps = ("plan", "topology", "trace", "write", "read", "lower", "compile")
    print(f"| component | start | plan from | {' | '.join(steps)} | ptxas CPU s | process wall s | load before / after |")
    print("|---|---|---|" + "---:|" * (len(steps) + 2) + "---|")
    for row in rows:
        for attempt in ("cold", "warm"):
            run = row[attempt]
            if "error" in run:
                print(f"| {row['component']} | {attempt} | error: {run['error'][-200:]} |")
                continue
            cells = " | ".join(f"{run['seconds'][step]:.2f}" if step in run["seconds"] else "-" for step in steps)
            print(f"| {row['component']} | {attempt} | {run['cache']} | {cells} | {run['ptxas_cpu_seconds']:.1f} | "
                  f"{run['wall_seconds']:.1f} | {row['load_before']} / {row['load_after']} |")


def print_table(rows: list[dict[str, Any]]) -> None:
    def sec(entry, key="compile_seconds"):
        return f"{entry[key]:.1f}" if isinstance(entry, dict) and key in entry else "error"

    def ptxas(entry):
        return f"{entry['ptxas_cpu_seconds']:.1f}" if isinstance(entry, dict) and "ptxas_cpu_seconds" in entry else "?"

    print("| component | plan cold s | plan warm s (cache) | kernels launched / distinct / lowered | trace+lower s | "
          "ours compile cold / warm s (JAX hits; ptxas CPU s cold / warm) | XLA compile cold / warm s (JAX hits) | "
          "load before / after |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        warm = r["plan_warm"]
        kernels = warm.get("kernels", {})
        hits = lambda e: e.get("cache_hits", "?") if isinstance(e, dict) else "?"  # noqa: E731
        print(f"| {r['component']} | {sec(r['plan_cold'], 'plan_seconds')} | {sec(warm, 'plan_seconds')} "
              f"({warm.get('cache')}) | {kernels.get('launched', '?')} / {kernels.get('distinct', '?')} / "
              f"{kernels.get('lowered', '?')} | "
              f"{sec(warm, 'trace_lower_seconds')} | {sec(r['compile_ours_cold'])} / {sec(r['compile_ours_warm'])} "
              f"({hits(r['compile_ours_warm'])}; {ptxas(r['compile_ours_cold'])} / {ptxas(r['compile_ours_warm'])}) | "
              f"{sec(r['compile_xla_cold'])} / {sec(r['compile_xla_warm'])} "
              f"({hits(r['compile_xla_warm'])}) | {r['load_before']} / {r['load_after']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--components", default="unet,vae,text_encoder")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=None)
    parser.add_argument("--duplicates", type=int, default=0, help="only the N identical kernels experiment")
    parser.add_argument("--phases", action="store_true", help="only where the cold compile goes, by phase")
    parser.add_argument("--config", default="full", choices=("full", "tiny"),
                        help="with --phases, --ready and --emitters")
    parser.add_argument("--xla-flags", default="", help="with --phases: added to XLA_FLAGS in both children")
    parser.add_argument("--ready", action="store_true",
                        help="only a cold and a warm start, deviceless: plan, exported stage, compile with XLA's kernel cache")
    parser.add_argument("--fingerprint", action="store_true",
                        help="only the Triton kernels' fingerprint (names and IR, no debug locations) per component")
    parser.add_argument("--emitters", action="store_true",
                        help="only one Mosaic plan per component compiled by the Mosaic and by the Triton templates")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "REQUEST", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child_main(*args.child)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.duplicates:
        results: Any = measure_duplicates(args.duplicates, log)
        print(json.dumps(results, indent=2))
    elif args.emitters:
        results = [measure_emitters(c.strip(), args.batch, args.size, args.config, log)
                   for c in args.components.split(",")]
        print_emitters(results)
    elif args.ready:
        results = [measure_ready(c.strip(), args.batch, args.size, args.config, log) for c in args.components.split(",")]
        print_ready(results)
    elif args.fingerprint:
        results = {}
        for component in (c.strip() for c in args.components.split(",")):
            row = _run_child("plan", {"component": component, "batch": args.batch, "size": args.size, "kernels": True})
            results[component] = {key: row.get(key) for key in ("kernels", "fingerprint", "error")}
            print(f"{component}: {row.get('kernels')} {row.get('fingerprint') or row.get('error')}")
    elif args.phases:
        from benchmarks.compile_phases import format_phase_table, slowest_kernels

        rows = [measure_phases(c.strip(), args.batch, args.size, args.config, log, args.xla_flags)
                for c in args.components.split(",")]
        for row in rows:
            if "error" in row["ours"] or "error" in row["xla"]:
                print(f"{row['component']}: {row['ours'].get('error') or row['xla'].get('error')}")
                continue
            print(format_phase_table(row["component"], row["ours"], row["xla"]))
            print(f"load {row['load_before']} -> {row['load_after']}; slowest kernels (thread-s):")
            for kernel in slowest_kernels(row["ours"], 5):
                print(f"  {kernel['name']}: {kernel['total']:.2f} (Triton {kernel['triton']:.2f}, translate "
                      f"{kernel['translate']:.2f}, LLVM {kernel['llvm']:.2f}, ptxas {kernel['ptxas']:.2f})")
        results = [phases_json(row) for row in rows]
    else:
        results = [measure_component(c.strip(), args.batch, args.size, log) for c in args.components.split(",")]
        print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
