"""Our plan and emitted executable against `jax.jit`'s, per workload, compiled for an H100 without
a GPU: the measuring side of `sd15 plan` (`sd15/plan_cli.py`), usable for any JAX function.

    from measure.compare import Workload, compare, render
    report = compare({"block": Workload("block", "my block, fp16", fn, abstract_args)})
    render(report)                              # the table; `report` is the JSON

For each workload it reports our plan (`eqsat.optimize(fn, params_argnums=0).lower(*args).stats`:
naive and fused kernel counts, the kernels prepared once per set of weights and those run per
call, modeled HBM bytes, peak activation memory, seconds per optimizer stage), our emitted
executable (the per-call stage of `eqsat.optimize(fn, backend="pallas", params_argnums=0)`, or the
`backend` given: `"mosaic"` for the Mosaic GPU templates,
compiled for an H100 without a GPU, the prepared tensors as its inputs: kernels in its thunk
sequence, memsets, copies, temporary memory, compile seconds) and XLA's (`jax.jit(fn)` compiled the
same way, `measure.xla_target`: kernel launches, modeled HBM bytes, temporary memory). A
workload's first argument holds its weights (`PARAMS_ARGNUM`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import jax


# The per-component JSON keys (always present; null when not measured).
KEYS = (
    "naive_kernels", "fused_kernels", "xla_kernels", "plan_bytes", "xla_bytes", "plan_peak_bytes",
    "xla_temp_bytes", "optimize_seconds", "xla_compile_seconds",
    "planned_kernels", "prepared_kernels", "emitted_kernels", "emitted_memsets", "emitted_copies",
    "emitted_temp_bytes", "emit_compile_seconds",
)
# The argument of every workload that holds the weights (marked `params_argnums` for the prepare stage).
PARAMS_ARGNUM = 0
# Extraction's time limit here (optimize's default is 5 s): on a loaded machine a 5 s limit cuts
# the search at a load-dependent point, and the compile subprocess, which plans again, could then
# compile another plan than the one reported.
EXTRACT_TIME_LIMIT = 120.0


class EmitCompileError(RuntimeError):
    """Our emitted executable did not compile for the H100; the message names the failing kernel."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One function to measure (a model component) and the abstract arguments it is traced with."""

    name: str
    description: str
    fn: Callable
    args: tuple


@contextlib.contextmanager
def waiting(what: str, every: float = 1.0):
    """On a terminal, a spinner with the seconds elapsed while `what` runs (a UNet compile says
    nothing for minutes); elsewhere nothing."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    start, stop = time.perf_counter(), threading.Event()
    with Console(stderr=True).status(what) as status:
        def tick():
            while not stop.wait(every):
                status.update(f"{what} ({time.perf_counter() - start:.0f} s)")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()


# --- measuring ---------------------------------------------------------------------------------


def _stat(stats, key: str, default=None):
    if stats is None:
        return default
    if isinstance(stats, dict):
        return stats.get(key, default)
    return getattr(stats, key, default)


def _load_optimize():
    """`eqsat.optimize` (the function), or None and the reason it cannot be had."""
    import importlib

    try:
        optimize = getattr(importlib.import_module("eqsat"), "optimize", None)
        if optimize is None or inspect.ismodule(optimize):
            optimize = importlib.import_module("eqsat.optimize").optimize
        return optimize, None
    except Exception as error:  # noqa: BLE001 - reported, never fatal
        return None, f"eqsat.optimize is not available ({type(error).__name__}: {error})"


EMIT_BACKENDS = ("pallas", "mosaic", "hybrid", "routed")  # what compiles for an H100 (`"xla"` is jax.jit's own column)


def optimized(workload: Workload, optimize, device: str, backend: str = "pallas"):
    """`optimize(workload.fn, ...)` as we deploy it: weights marked as parameters (prepared once),
    the Pallas backend (or `backend`), compiled for the GPU rather than interpreted (`interpret=False`:
    it is only ever compiled for an H100 here; left to the platform, a Mosaic GPU kernel's interpret
    branch carries ordered callback effects that JAX 0.10.2's `platform_dependent` cannot lower for
    CUDA), no progress bar (options the given `optimize` does not take are left out)."""
    accepted = inspect.signature(optimize).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())  # e.g. the callable module
    options = (("device", device), ("progress", False), ("backend", backend), ("interpret", False),
               ("params_argnums", PARAMS_ARGNUM),
               ("extract_time_limit", EXTRACT_TIME_LIMIT))
    return optimize(workload.fn, **{key: value for key, value in options if takes_any or key in accepted})


def _route_counts(kernel_routes) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for name, route in kernel_routes:
        kind = counts.setdefault(name.rsplit(":", 1)[-1], {})
        kind[route] = kind.get(route, 0) + 1
    return counts


def measure_plan(workload: Workload, optimize, device: str, backend: str = "pallas") -> tuple[dict[str, Any], Any, Any]:
    """Our plan: `optimize(fn).lower(*args).stats`, as the per-component JSON fields; and the
    optimized function and its lowering (for the emitted compile)."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = optimized(workload, optimize, device, backend)
        lowered = fast.lower(*workload.args)
    wall = time.perf_counter() - start
    stats = getattr(lowered, "stats", None)
    seconds = _stat(stats, "seconds")
    if isinstance(seconds, dict):
        seconds = {stage: float(value) for stage, value in seconds.items()}
    messages = list(dict.fromkeys(str(w.message) for w in caught))
    split = getattr(lowered, "split", None)
    fields = {
        "naive_kernels": _stat(stats, "naive_kernels"),
        "fused_kernels": _stat(stats, "fused_kernels"),
        # The kernels our executable runs per call, and those run once per set of weights (the
        # prepare stage, `emit.prepare`: parameter-only kernels of the plan and parameter-only
        # operands hoisted out of per-call kernels).
        "planned_kernels": _stat(stats, "per_call_kernels", _stat(stats, "fused_kernels")),
        "prepared_kernels": _stat(stats, "prepared_kernels") if split is not None else None,
        "prepared_hoisted_kernels": _stat(stats, "hoisted_kernels") if split is not None else None,
        "prepared_bytes": _stat(stats, "prepared_bytes") if split is not None else None,
        "plan_bytes": _stat(stats, "plan_bytes"),
        "plan_peak_bytes": _stat(stats, "plan_peak_bytes"),
        "plan_modeled_seconds": _stat(stats, "plan_seconds"),
        "plan_kernels_by_kind": _stat(stats, "kinds"),
        "plan_memsets": 0,  # epilogue statistics write per-tile partials: nothing to zero
        "plan_hosted_statistics": _stat(stats, "hosted_reductions"),
        # which emitter each dense kernel gets (`emit.backends.plan_routes`): per kind, route -> kernels
        "plan_routes": _route_counts(_stat(stats, "kernel_routes") or ()),
        "optimize_seconds": seconds,
        "optimize_wall_seconds": wall,
        "plan_cache": _stat(stats, "cache"),  # "hit": planned by an earlier process (`driver.cache`)
        "extractor": _stat(stats, "extractor"),
        "saturated": _stat(stats, "saturated"),
        "limit_reached": _stat(stats, "limit_reached"),
        "e_nodes": _stat(stats, "e_nodes"),
        "e_classes": _stat(stats, "e_classes"),
        "iterations": _stat(stats, "iterations"),
        "optimize_warnings": messages[:10],
    }
    return fields, fast, lowered


# --- our emitted executable, compiled for an H100 ----------------------------------------------


def emitted_per_call(fast, prepared, *args):
    """The per-call stage of `fast` (an `eqsat.optimize` function with parameters marked) on the
    prepared tensors `prepared`, as a deployment runs it once the weights are prepared: what
    `sd15 plan` compiles for an H100. Module level, so it pickles by reference into the compile
    subprocess, where `fast` plans again (its lowerings do not pickle)."""
    run = fast.lower(*args).executable()
    if hasattr(run, "per_call"):
        return run.per_call(prepared, *args)
    if prepared:
        raise ValueError(f"{len(prepared)} prepared tensors for a plan with no prepare stage")
    return run(*args)


def planned_kernel_names(lowered) -> list[str]:
    """The `pallas_call` names (`"<component>:<kind>"`) of the per-call plan's kernels, in order."""
    import emit

    split = getattr(lowered, "split", None)
    return [call.name for call in emit.kernel_calls(split.per_call if split is not None else lowered.plan)]


def launch_kernel_name(launch) -> str:
    """The plan kernel a launch belongs to: the outermost named scope of its HLO op (the emitter
    traces each plan kernel under `jax.named_scope("<component>:<kind>")`)."""
    return launch.scope.split("/", 1)[0]


def triton_kernel_names(dump: Path) -> dict[str, str]:
    """HLO instruction -> the Triton kernel name of each `pallas_call` in an XLA dump's optimized
    HLO (its `backend_config` carries `name = "..."`: the `pallas_call`'s name, `:` made `_`)."""
    pattern = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*custom_call_target="__gpu\$xla\.gpu\.triton".*?'
                         r'\bname = "([^"]*)"', re.MULTILINE)
    names: dict[str, str] = {}
    for path in sorted(dump.glob("*after_optimizations.txt")):
        names.update(pattern.findall(path.read_text(errors="replace")))
    return names


def is_shared_kernel_name(name: str) -> bool:
    """Whether a Triton kernel name is one that identical kernels share (`emit.pallas.shared_names`:
    the first use's name plus `.x<uses>`); such a launch is known by its named scope instead."""
    return re.search(r"\.x\d+$", name) is not None


def _triton_name(name: str) -> str:
    """A `pallas_call` name as Triton spells its kernel: characters outside [A-Za-z0-9_.] become `_`."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


def emitted_against_plan(report, names: list[str], triton_names: dict[str, str] | None = None) -> dict[str, Any]:
    """Our executable's launches against the plan's kernels (`names`, `"<component>:<kind>"`):
    launches that are not Pallas kernels (an XLA fusion, a transpose, a convert around a
    `pallas_call`; `kernel` says which plan kernel's emission made it), planned kernels with no
    Pallas launch, and Pallas launches beyond the plan (e.g. a statistic its host left to the
    driver: `"<component>_reduce"`). A Pallas launch is known by its Triton kernel name
    (`triton_names`, HLO instruction -> name), else (no name, or a name identical kernels share)
    by its plan kernel's named scope."""
    import collections

    triton_names = triton_names or {}
    kernels = [launch for launch in report.launches if launch.counted == "kernel"]
    pallas = [launch for launch in kernels if launch.category.startswith("Pallas")]
    pallas_ids = {id(launch) for launch in pallas}
    spelled = {_triton_name(name): name for name in names}
    launched = collections.Counter(
        spelled.get(triton_names[launch.name], triton_names[launch.name])
        if launch.name in triton_names and not is_shared_kernel_name(triton_names[launch.name])
        else launch_kernel_name(launch) for launch in pallas)
    planned = collections.Counter(names)
    return {
        "emitted_pallas_kernels": len(pallas),
        "emitted_mosaic_kernels": sum(launch.category == "Pallas (Mosaic GPU)" for launch in pallas),
        "emitted_triton_kernels": sum(launch.category == "Pallas (Triton)" for launch in pallas),
        "emitted_kernels_by_category": report.by_category,
        "emitted_non_pallas": [
            {"name": launch.name, "category": launch.category, "kind": launch.kind,
             "kernel": launch_kernel_name(launch) or None}
            for launch in report.launches if launch.counted != "none" and id(launch) not in pallas_ids
        ],
        "emitted_missing": sorted((planned - launched).elements()),
        "emitted_extra": sorted((launched - planned).elements()),
    }


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished subprocesses (the H100 compiles run in
    one each): on a shared machine, what a compile cost apart from the wait for a core."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _failing_kernel(message: str, names: list[str]) -> str | None:
    """The plan kernel a compile error is about: its name (or the name Triton sanitizes it to)
    appearing in the error. The longest match wins (`a.b:conv` over `a:conv`)."""
    import re

    found = [name for name in names if name in message or re.sub(r"[^A-Za-z0-9_]", "_", name) in message]
    return max(found, key=len) if found else None


def measure_emitted(workload: Workload, fast, lowered) -> dict[str, Any]:
    """Our per-call executable compiled for an H100 (`measure.xla_target`, as XLA's is): kernels in its
    thunk sequence and how they compare with the plan. A compile that fails raises
    `EmitCompileError` naming the failing kernel."""
    import functools as ft

    from measure import xla_target

    split = getattr(lowered, "split", None)
    prepared = split.prepared_specs() if split is not None else []
    names = planned_kernel_names(lowered)
    cpu = _children_cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="sd15_plan_") as scratch:
        dump = Path(scratch) / "dump"
        try:
            with waiting(f"{workload.name}: compiling our executable for an H100"):
                report = xla_target.compile_for_h100(ft.partial(emitted_per_call, fast), prepared, *workload.args,
                                                     keep_dump=dump)
        except RuntimeError as error:
            message = str(error)
            kernel = _failing_kernel(message, names)
            where = f"kernel {kernel}" if kernel else "a kernel the error does not name (no plan kernel name in it)"
            tail = "\n".join(message.strip().splitlines()[-12:])
            raise EmitCompileError(f"{workload.name}: {where} failed to compile for sm_90:\n{tail}") from None
        if report is None:
            return {}
        triton_names = triton_kernel_names(dump)
    return {
        "emitted_kernels": report.kernels,
        "emitted_memsets": report.memsets,
        "emitted_copies": report.copies,
        "emitted_temp_bytes": report.temp_bytes,
        "emit_compile_seconds": report.compile_seconds,
        "emit_lower_seconds": report.lower_seconds,
        "emit_wall_seconds": report.wall_seconds,
        "emit_cpu_seconds": _children_cpu_seconds() - cpu,
        **emitted_against_plan(report, names, triton_names),
    }


def measure_xla(workload: Workload) -> tuple[dict[str, Any], str | None]:
    """XLA's executable for an H100 (`measure.xla_target`), or nulls and the reason."""
    from measure import xla_target

    cpu = _children_cpu_seconds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", xla_target.XlaTargetWarning)
        with waiting(f"{workload.name}: compiling jax.jit for an H100"):
            report = xla_target.compile_for_h100(workload.fn, *workload.args)
    if report is None:
        reasons = [str(w.message) for w in caught if issubclass(w.category, xla_target.XlaTargetWarning)]
        return {}, "; ".join(reasons) or "XLA H100 target unavailable"
    exact = report.bytes_accessed is not None
    return {
        "xla_kernels": report.kernels,
        "xla_copies": report.copies,
        "xla_memsets": report.memsets,
        "xla_input_only_kernels": report.input_only_kernels,
        "xla_kernels_by_category": report.by_category,
        "xla_kernels_by_block": report.by_scope(depth=1),
        "xla_bytes": report.bytes_accessed if exact else report.modeled_bytes,
        "xla_bytes_source": "cost_analysis" if exact else "modeled: operand + result bytes per kernel",
        "xla_temp_bytes": report.temp_bytes,
        "xla_compile_seconds": report.compile_seconds,
        "xla_wall_seconds": report.wall_seconds,
        "xla_cpu_seconds": _children_cpu_seconds() - cpu,
    }, None


def compare(
    work: dict[str, Workload],
    device: str = "h100",
    xla: bool = True,
    optimize: bool = True,
    emit: bool = True,
    log: Callable[[str], None] | None = None,
    report: dict[str, Any] | None = None,
    backend: str = "pallas",
) -> dict[str, Any]:
    """Measure every workload; the result is what `--json` prints (`report`'s fields kept, the rows
    under "components"). A workload whose emitted executable fails to compile keeps its row, with
    `emit_error` naming the kernel (also listed in the report's `errors`)."""
    log = log or (lambda message: None)
    if backend not in EMIT_BACKENDS:
        raise ValueError(f"backend {backend!r}: the emitted executable compiles for an H100 with one of {EMIT_BACKENDS}")
    report = {"device": device, "backend": backend, "jax_version": jax.__version__, **(report or {})}
    report.setdefault("notes", [])
    report.setdefault("errors", [])
    report.setdefault("components", {})

    optimize_fn, optimize_reason = (None, "optimizer skipped (--no-optimize)") if not optimize else _load_optimize()
    if optimize_reason:
        report["notes"].append(f"fused/naive columns are empty: {optimize_reason}")
    from measure import xla_target

    target_reason = xla_target.prepare_target() if (xla or emit) else xla_target.unavailable_reason()
    xla_reason = "XLA skipped (--no-xla)" if not xla else target_reason
    if xla_reason:
        report["notes"].append(f"XLA columns are empty: {xla_reason}")
    report["xla_available"] = xla_reason is None
    emit_reason = "emitted compile skipped (--no-emit)" if not emit else optimize_reason or target_reason
    if emit_reason:
        report["notes"].append(f"emitted columns are empty: {emit_reason}")

    for name, workload in work.items():
        row: dict[str, Any] = {key: None for key in KEYS}
        row["description"] = workload.description
        lowering = None
        if optimize_fn is not None:
            log(f"{name}: optimizing ({workload.description})")
            try:
                fields, *lowering = measure_plan(workload, optimize_fn, device, backend)
                row.update(fields)
                log(f"{name}: {row['naive_kernels']} naive -> {row['fused_kernels']} fused kernels "
                    f"({row['planned_kernels']} per call, {row['prepared_kernels']} prepared) "
                    f"in {row['optimize_wall_seconds']:.1f} s")
            except Exception as error:  # noqa: BLE001 - one component failing must not hide the others
                row["optimize_error"] = f"{type(error).__name__}: {error}"
                row["optimize_traceback"] = traceback.format_exc()
                report["notes"].append(f"{name}: optimize failed: {row['optimize_error']}")
        if lowering and emit_reason is None:
            log(f"{name}: compiling our emitted per-call executable (backend={backend}) for H100")
            try:
                row.update(measure_emitted(workload, *lowering))
                log(f"{name}: emitted {row['emitted_kernels']} kernels ({row['emitted_pallas_kernels']} Pallas, "
                    f"{row['emitted_memsets']} memsets, {row['emitted_copies']} copies) for "
                    f"{row['planned_kernels']} planned, compiled in {row['emit_compile_seconds']:.1f} s")
            except Exception as error:  # noqa: BLE001 - reported in the row and the errors, never skipped
                row["emit_error"] = (str(error) if isinstance(error, EmitCompileError)
                                     else f"{name}: emitted compile failed: {type(error).__name__}: {error}")
                report["errors"].append(row["emit_error"])
        if xla_reason is None:
            log(f"{name}: compiling jax.jit for H100")
            try:
                fields, reason = measure_xla(workload)
                row.update(fields)
                if not reason:
                    log(f"{name}: XLA {row['xla_kernels']} kernels, compiled in {row['xla_compile_seconds']:.1f} s")
                if reason:
                    report["notes"].append(f"{name}: XLA columns are empty: {reason}")
            except Exception as error:  # noqa: BLE001
                row["xla_error"] = f"{type(error).__name__}: {error}"
                report["notes"].append(f"{name}: XLA compile failed: {row['xla_error']}")
        row["winner_kernels"] = _winner(our_kernels(row), row.get("xla_kernels"))
        row["winner_bytes"] = _winner(row["plan_bytes"], row.get("xla_bytes"))
        row["winner_memory"] = _winner(our_memory(row), row.get("xla_temp_bytes"))
        report["components"][name] = row
    return report


def our_kernels(row: dict[str, Any]):
    """Our kernel count to set against XLA's: the emitted executable's when it was compiled, else
    the plan's per-call kernels."""
    return row.get("emitted_kernels") if row.get("emitted_kernels") is not None else row.get("planned_kernels")


def our_memory(row: dict[str, Any]):
    """Our memory to set against XLA's temporary memory: the emitted executable's temporary memory
    when it was compiled (like for like), else the plan's peak of live activations."""
    return row.get("emitted_temp_bytes") if row.get("emitted_temp_bytes") is not None else row.get("plan_peak_bytes")


def _winner(ours, theirs) -> str | None:
    if ours is None or theirs is None:
        return None
    return "eqsat" if ours < theirs else "xla" if theirs < ours else "tie"


# --- rendering ---------------------------------------------------------------------------------


def _count(value) -> str:
    return "n/a" if value is None else f"{value:,}"


def _size(value) -> str:
    if value is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _seconds(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, dict):
        value = sum(map(float, value.values()))
    return f"{float(value):.1f} s"


def _stages(value) -> str:
    return ", ".join(f"{stage} {float(v):.1f} s" for stage, v in value.items())


def _pair(ours, theirs) -> str:
    return f"{_count(ours)} / {_count(theirs)}"


def _compile_cell(row: dict[str, Any], prefix: str) -> str:
    """`compile seconds (CPU seconds of the whole compile subprocess)`."""
    cell = _seconds(row.get(f"{prefix}_compile_seconds"))
    cpu = row.get(f"{prefix}_cpu_seconds")
    return cell if cpu is None else f"{cell} ({cpu:.0f} s)"


def _emitted_cell(row: dict[str, Any]) -> str:
    if row.get("emit_error"):
        return "[bold red]compile failed[/]"
    return _count(row.get("emitted_kernels"))


def _verdict(winner, ours, theirs, fmt) -> str:
    """Who does better, plainly, with both sides' factor; XLA's wins are marked in bold red."""
    if winner is None:
        return "n/a"
    if winner == "tie":
        return "tie"
    difference = fmt(abs(ours - theirs))
    if winner == "xla":
        ratio = f" ({ours / theirs:.1f}x)" if theirs else ""
        return f"[bold red]XLA better by {difference}{ratio}[/]"
    ratio = f" ({theirs / ours:.1f}x)" if ours else ""
    return f"[green]eqsat better by {difference}{ratio}[/]"


# What kind of figure each row is: counted (from the plan or the compiled program), modeled (the
# roofline cost model, eqsat.cost), measured (a clock on this machine).
COUNTED, MODELED, MEASURED, COMPARED = "counted", "modeled", "measured", ""
FOOTNOTES = (
    "prepared: kernels that read only the weights (and operands hoisted out of per-call kernels), run once "
    "per set of weights by the prepare stage (`optimize(..., params_argnums=0)`), not on every call.",
    "statistics in epilogues: normalization statistics (GroupNorm/LayerNorm sums) computed in the epilogue of "
    "the kernel that writes the normalized tensor, as per-tile partials its readers merge: no kernel of their "
    "own, no memset.",
    "compile: wall seconds of the deviceless H100 compile in a subprocess (its CPU seconds in parentheses); "
    "optimize: wall seconds of lift, e-graph build, saturation, extraction and the prepare split.",
)


def _rows(rows: dict[str, Any]):
    """(label, kind, cell) per table row."""
    compile_winner = lambda r: _winner(r.get("emit_compile_seconds"), r.get("xla_compile_seconds"))  # noqa: E731
    return [
        ("naive kernels (1 per primitive)", COUNTED, lambda r: _count(r["naive_kernels"])),
        ("eqsat planned kernels: per call / prepared", COUNTED,
         lambda r: f"{_count(r.get('planned_kernels'))} / {_count(r.get('prepared_kernels'))}"),
        ("eqsat emitted kernels (H100 executable)", COUNTED, _emitted_cell),
        ("  of which Pallas kernels", COUNTED, lambda r: _count(r.get("emitted_pallas_kernels"))),
        ("  of those on Mosaic GPU / Triton", COUNTED,
         lambda r: _pair(r.get("emitted_mosaic_kernels"), r.get("emitted_triton_kernels"))),
        ("XLA kernels (jax.jit, H100)", COUNTED, lambda r: _count(r["xla_kernels"])),
        ("  of which read only weights/inputs", COUNTED, lambda r: _count(r.get("xla_input_only_kernels"))),
        ("memsets (not kernels): eqsat / XLA", COUNTED, lambda r: _pair(r.get("emitted_memsets"), r.get("xla_memsets"))),
        ("copies (not kernels): eqsat / XLA", COUNTED, lambda r: _pair(r.get("emitted_copies"), r.get("xla_copies"))),
        ("eqsat statistics in epilogues", COUNTED, lambda r: _count(r.get("plan_hosted_statistics"))),
        ("kernels", COMPARED, lambda r: _verdict(r["winner_kernels"], our_kernels(r), r["xla_kernels"], _count)),
        ("eqsat HBM bytes", MODELED, lambda r: _size(r["plan_bytes"])),
        ("XLA HBM bytes", MODELED, lambda r: _size(r["xla_bytes"])),
        ("HBM traffic", COMPARED, lambda r: _verdict(r["winner_bytes"], r["plan_bytes"], r["xla_bytes"], _size)),
        ("eqsat step time (roofline, H100)", MODELED, lambda r: _microseconds(r.get("plan_modeled_seconds"))),
        ("eqsat peak activations (plan)", MODELED, lambda r: _size(r["plan_peak_bytes"])),
        ("eqsat temporary memory (H100 executable)", COUNTED, lambda r: _size(r.get("emitted_temp_bytes"))),
        ("XLA temporary memory (H100 executable)", COUNTED, lambda r: _size(r["xla_temp_bytes"])),
        ("memory", COMPARED, lambda r: _verdict(r["winner_memory"], our_memory(r), r["xla_temp_bytes"], _size)),
        ("eqsat optimize", MEASURED, lambda r: _seconds(r.get("optimize_wall_seconds") or r["optimize_seconds"])),
        ("eqsat emitted H100 compile (subprocess CPU)", MEASURED, lambda r: _compile_cell(r, "emit")),
        ("XLA H100 compile (subprocess CPU)", MEASURED, lambda r: _compile_cell(r, "xla")),
        ("compile time", COMPARED, lambda r: _verdict(compile_winner(r), r.get("emit_compile_seconds"),
                                                      r.get("xla_compile_seconds"), _seconds)),
        ("extractor", "", lambda r: str(r.get("extractor") or "n/a")),
        ("saturated", "", lambda r: "n/a" if r.get("saturated") is None else
         ("yes" if r["saturated"] else f"no ({r.get('limit_reached') or 'limit'})")),
    ]


def _microseconds(value) -> str:
    return "n/a" if value is None else f"{float(value) * 1e6:,.0f} µs"


def render(report: dict[str, Any], console=None) -> None:
    """The rich table (titled by `report["title"]`): one column per workload, one row per measure, each row saying whether its
    figure is counted, modeled or measured; then the footnotes, wrapped to the console's width."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped to a file: do not squeeze the table into 80 columns
            console = Console(width=160)
    rows = report["components"]
    names = list(rows)
    table = Table(title=report.get("title") or "eqsat against XLA", show_lines=False)
    table.add_column("measure", style="bold")
    table.add_column("figure", style="dim")
    for name in names:
        table.add_column(name, justify="right")
    for label, kind, cell in _rows(rows):
        table.add_row(label, kind, *(cell(rows[name]) for name in names))
    console.print(table)

    def note(text: str, style: str = "") -> None:
        console.print(Padding(text, (0, 0, 0, 2), style=style))

    for name in names:
        row = rows[name]
        stages = row["optimize_seconds"]
        stages = f"; optimizer stages: {_stages(stages)}" if isinstance(stages, dict) else ""
        note(f"{name}: {row['description']}{stages}")
    for footnote in FOOTNOTES:
        note(footnote)
    if any(rows[name].get("xla_bytes_source", "").startswith("modeled") for name in names):
        note("XLA bytes: XLA gives no cost analysis for a compile-only H100 executable; modeled as operand + result "
             "bytes of every kernel in its optimized HLO (the same model as eqsat's).")
    for name in names:
        row = rows[name]
        if row.get("emitted_non_pallas"):
            launches = ", ".join(f"{launch['name']} ({launch['category']}"
                                 + (f", in {launch['kernel']})" if launch["kernel"] else ")")
                                 for launch in row["emitted_non_pallas"][:8])
            more = len(row["emitted_non_pallas"]) - 8
            note(f"{name}: {len(row['emitted_non_pallas'])} launches that are not Pallas kernels: {launches}"
                 + (f" and {more} more" if more > 0 else ""))
        for key, what in (("emitted_missing", "planned kernels with no Pallas launch"),
                          ("emitted_extra", "Pallas launches beyond the plan")):
            if row.get(key):
                note(f"{name}: {len(row[key])} {what}: {', '.join(row[key][:8])}" + (" ..." if len(row[key]) > 8 else ""))
    for text in report["notes"]:
        console.print(Padding(f"[yellow]note:[/] {text}", (0, 0, 0, 0)))
    for error in report.get("errors", []):
        console.print(f"[bold red]error:[/] {error}")


