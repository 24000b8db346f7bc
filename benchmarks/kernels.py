"""`python -m benchmarks.kernels`: every kernel of an SD 1.5 component's H100 program, read from the
compiled program itself (no GPU), with the cost model's time beside it and XLA's program priced by
the same device model.

    python -m benchmarks.kernels --component unet --json unet.json      # full size, fp16 (minutes)
    python -m benchmarks.kernels --component text_encoder --config tiny --dump /tmp/te
    python -m benchmarks.kernels --component unet --summary --backend mosaic   # or auto (default triton)

For each component (`sd15.workloads.workloads`), as `sd15 plan` does: our plan
(`eqsat.optimize(fn, backend="pallas", params_argnums=0)`, `measure.compare.measure_plan`), its per-call
executable (`measure.compare.emitted_per_call`) compiled for an H100 by `measure.xla_target.compile_for_h100`
with XLA's dump kept (the Triton kernels' PTX, the thunk sequence, the optimized HLO), then
`ptxas -arch=sm_90a -v` (the pip package nvidia-cuda-nvcc-cu12's, `benchmarks.ptx`) on each
kernel's PTX. And `jax.jit(fn)` compiled the same way, for XLA's launches.

Per kernel (a row per planned kernel; a Pallas launch is matched to its plan kernel by its Triton
name, `measure.compare.triton_kernel_names`, or by its named scope where identical kernels share a name,
then by output size and order among same-named kernels):

- counted (read from the compiled program): grid, threads (num_warps * 32), registers, spill bytes
  (ptxas's spill stores + loads), shared memory (the launch's dynamic shared memory, from the thunk
  sequence, plus ptxas's static), CTAs per SM (`benchmarks.ptx.ctas_per_sm`: H100 limits of 65536
  registers, 228 KB shared memory, 2048 threads, 32 CTAs), tensor-core instruction (wgmma /
  mma.sync / none in the PTX), the vector-load share (static PTX global-load instructions
  weighted by their width: the share of those bytes moved by loads >= 64 bits or TMA — a static
  count of instructions, not dynamic bytes), MMA pipelining depth (the largest N of
  `wgmma.wait_group.sync.aligned N`);
- modeled: the plan kernel's seconds (`extract.plan.Kernel.seconds`: `eqsat.cost.roofline.kernel_cost`
  plus its share of the statistics it hosts), and the share of it spent merging hosted-statistic
  partials when the cost model reports that (`merge_seconds`, below).

`--backend` picks the templates of the dense kernels: `triton` (the Pallas Triton templates, as
`backend="pallas"`), `mosaic` (the Mosaic GPU templates where they cover a kernel) or `auto` (per
kernel the route the cost model prices lowest: `backend="routed"`, what `auto` is on a Hopper GPU;
a library route runs through XLA and has only the model's columns). Each row has a `backend`
(triton, mosaic, library) and `by_backend` totals; a Mosaic kernel is read from Mosaic's own PTX
and ptxas report (`benchmarks.mosaic_ptx.dumping`, `read_dump`), its grid and threads from its
template's configuration (the thunk sequence shows no launch shape for a Mosaic custom call).
`glue_launches` counts the other launches (the XLA fusions around the Mosaic kernels: layouts, pads,
slices, statistic merges), `modeled_glue_launches` the fusions the model charges them
(`eqsat.cost.mosaic`); a statistic hosted on a Mosaic or library kernel is reduced by its own
kernel after its last host (an `extra` row; `driver_reduce_modeled_seconds`) and the plan's
finalize of it launches nothing (`finalize_replaced_by_reduce`).

XLA's launches (every kernel and copy of its thunk sequence, as `measure.xla_target` counts them)
are priced by the same device model (`eqsat.cost.devices`): launch overhead + the launch's bytes
(operands + result in XLA's optimized HLO, `Launch.bytes`, what `sd15 plan` sums to `xla_bytes`)
over HBM bandwidth + the dense flops of its dots and convolutions (cuBLAS, cuDNN and XLA's Triton
GEMM fusions) at `XLA_LIBRARY_EFFICIENCY` of the tensor-core peak. XLA's fusions are charged no ALU
work (ours are: the roofline prices every elementwise node), so that side is a lower bound.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from benchmarks import ptx
from measure.xla_target import split_instruction, split_shape

COMPONENTS = ("unet", "vae", "text_encoder")
# The share of the tensor-core peak at which XLA's library and Triton GEMM kernels are priced (the
# cost model prices the `hybrid` backend's library calls the same way: `eqsat.cost.backends`).
from eqsat.cost.backends import LIBRARY_EFFICIENCY as XLA_LIBRARY_EFFICIENCY  # noqa: E402
DEVICE = "h100"
# `--backend` -> the emission backend: the Pallas Triton templates, the Mosaic GPU ones, or per kernel
# the one the cost model prices lowest (`routed`, what `auto` is on a Hopper GPU).
BACKENDS = {"triton": "pallas", "mosaic": "mosaic", "auto": "routed"}

# What each figure is: read from the compiled program, or computed by the cost model.
LABELS = {
    "grid": "counted", "ctas": "counted", "threads": "counted", "registers": "counted",
    "spill_bytes": "counted", "shared_bytes": "counted", "ctas_per_sm": "counted", "waves": "counted",
    "tensor_core": "counted", "vector_load_fraction": "counted (static PTX instructions)",
    "global_load_bytes": "counted (static PTX instructions)", "wgmma_wait_depth": "counted",
    "modeled_seconds": "modeled (eqsat.cost.roofline)", "merge_seconds": "modeled (eqsat.cost.roofline)",
    "xla_modeled_seconds": f"modeled (launch + HBM bytes + dense flops at {XLA_LIBRARY_EFFICIENCY:.0%} of peak)",
}


# --- the thunk sequence and the optimized HLO ---------------------------------------------------

_THUNK_KERNEL = re.compile(
    r"^\s*(?P<id>\d+):\s+(?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<name>[\w.$\-]+)\s+grid:\s*\[(?P<grid>[\d,\s]+)\]\s+"
    r"threads:\s*\[(?P<threads>[\d,\s]+)\]\s+shared_memory:\s*(?P<shared>\d+)"
)


@dataclasses.dataclass(frozen=True)
class ThunkKernel:
    """One kernel launch of a thunk sequence: the device function it runs and its launch shape."""

    index: int
    kernel: str  # the device function (the PTX `.entry`; XLA uniquifies repeats with `__1`, ...)
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory the launch asks for


def read_thunk_kernels(text: str) -> dict[int, ThunkKernel]:
    """thunk id -> its launch, for every line of a `*.thunk_sequence.txt` that launches a kernel."""
    out = {}
    for line in text.splitlines():
        match = _THUNK_KERNEL.match(line)
        if match is not None:
            grid = tuple(int(v) for v in match["grid"].split(","))
            threads = tuple(int(v) for v in match["threads"].split(","))
            out[int(match["id"])] = ThunkKernel(int(match["id"]), match["name"], grid, threads, int(match["shared"]))
    return out


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_HLO_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "uint8"}


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",")) if dims else ()) for dtype, dims in _HLO_ARRAY.findall(shape)]


def read_hlo(text: str) -> tuple[dict[str, HloInstruction], dict[str, list[str]]]:
    """Every instruction of an HLO module's text by name, and each computation's instruction names."""
    instructions: dict[str, HloInstruction] = {}
    computations: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header is not None:
            current = computations.setdefault(header["name"], [])
            continue
        match = _HLO_INSTRUCTION.match(line)
        if match is None:
            continue
        shape, after = split_shape(match["rest"])
        opcode, operands, attributes = split_instruction(after)
        instructions[match["name"]] = HloInstruction(match["name"], shape, opcode, tuple(operands), attributes)
        if current is not None:
            current.append(match["name"])
    return instructions, computations


def _conv_flops(out_shape: str, kernel_shape: str, attributes: str) -> float:
    """2 * output elements * (kernel elements / output features): kh*kw*Cin/groups MACs per output."""
    outs, kernels = _arrays(out_shape), _arrays(kernel_shape)
    labels = re.search(r"dim_labels=\w+_(\w+)->", attributes)
    if not outs or not kernels or labels is None or "o" not in labels[1]:
        return 0.0
    kernel_dims = kernels[0][1]
    features = kernel_dims[labels[1].index("o")]
    return 2.0 * math.prod(outs[0][1]) * math.prod(kernel_dims) / max(features, 1)


def _dot_flops(out_shape: str, lhs_shape: str, contracting: Iterable[int]) -> float:
    outs, lhs = _arrays(out_shape), _arrays(lhs_shape)
    if not outs or not lhs:
        return 0.0
    return 2.0 * math.prod(outs[0][1]) * math.prod(lhs[0][1][d] for d in contracting)


def dense_flops(name: str, instructions: dict[str, HloInstruction], computations: dict[str, list[str]]) -> tuple[float, str]:
    """The dot and convolution flops an HLO instruction launches (through the computations it
    calls, for a fusion), and the dtype of its first such operand ("" when it has none)."""
    instruction = instructions.get(name)
    if instruction is None:
        return 0.0, ""

    def shape_of(operand_index: int) -> str:
        operands = instruction.operands
        return instructions[operands[operand_index]].shape if len(operands) > operand_index and operands[operand_index] in instructions else ""

    def dtype_of(shape: str) -> str:
        arrays = _arrays(shape)
        return _DTYPES.get(arrays[0][0], arrays[0][0]) if arrays else ""

    opcode, attributes = instruction.opcode, instruction.attributes
    if opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
        dims = [int(d) for d in contracting[1].split(",") if d] if contracting else []
        return _dot_flops(instruction.shape, shape_of(0), dims), dtype_of(shape_of(0))
    if opcode == "convolution":
        return _conv_flops(instruction.shape, shape_of(1), attributes), dtype_of(shape_of(0))
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', attributes)
        target = target[1] if target else ""
        if target.startswith("__cudnn$conv"):
            return _conv_flops(instruction.shape, shape_of(1), attributes), dtype_of(shape_of(0))
        if target.startswith("__cublas"):
            contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
            dims = [int(d) for d in re.findall(r"\d+", contracting[1])] if contracting else []
            return _dot_flops(instruction.shape, shape_of(0), dims), dtype_of(shape_of(0))
        return 0.0, ""
    called = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", attributes)
    total, dtype = 0.0, ""
    for computation in called:
        for inner in computations.get(computation, ()):
            flops, inner_dtype = dense_flops(inner, instructions, computations)
            total += flops
            dtype = dtype or inner_dtype
    return total, dtype


# --- XLA's program priced by the device model ---------------------------------------------------


def price_launches(report, hlo_text: str, device=DEVICE) -> dict[str, Any]:
    """Every kernel and copy of an `XlaReport` priced as launch + bytes / HBM bandwidth + dense
    flops / (XLA_LIBRARY_EFFICIENCY * peak); memsets at their launch overhead."""
    from eqsat.cost.devices import get_device

    device = get_device(device)
    instructions, computations = read_hlo(hlo_text)
    seconds = bytes_seconds = flops_seconds = flops = 0.0
    launches = 0
    by_category: dict[str, float] = collections.Counter()
    for launch in report.launches:
        if launch.counted == "none":
            continue
        launches += 1
        own_flops, dtype = dense_flops(launch.name, instructions, computations) if launch.counted == "kernel" else (0.0, "")
        moved = launch.bytes / device.hbm_bandwidth
        dense = own_flops / (XLA_LIBRARY_EFFICIENCY * device.peak(dtype or "float16", True)) if own_flops else 0.0
        cost = device.launch_overhead + moved + dense
        seconds += cost
        bytes_seconds += moved
        flops_seconds += dense
        flops += own_flops
        by_category[launch.category] += cost
    return {
        "xla_modeled_seconds": seconds,
        "xla_launches": launches,
        "xla_launch_seconds": launches * device.launch_overhead,
        "xla_bytes": sum(launch.bytes for launch in report.launches if launch.counted != "none"),
        "xla_bytes_seconds": bytes_seconds,
        "xla_dense_flops": flops,
        "xla_dense_seconds": flops_seconds,
        "xla_seconds_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
    }


# --- our plan's kernels -------------------------------------------------------------------------


@dataclasses.dataclass
class PlannedKernel:
    """One `pallas_call` of the per-call plan (a loop's outputs one each, its cost on the first)."""

    name: str  # "<component>:<kind>"
    kind: str
    elements: int  # elements of its (first) output
    seconds: float  # modeled
    merge_seconds: float | None  # modeled, when the cost model reports merges
    route: str = "triton"  # the emitter the plan's backend gives it: triton, mosaic or library
    term: Any = None  # its kernel term


def merge_seconds(kernel, device=DEVICE) -> float | None:
    """Of a plan kernel's modeled seconds, those spent merging hosted-statistic partials where it
    reads them, when the cost model reports that: the plan's `Kernel.merge_seconds`, else
    `eqsat.cost.roofline.merge_cost(term, device)`; None when the cost model gives no merge breakdown."""
    from eqsat.cost import roofline

    value = getattr(kernel, "merge_seconds", None)
    if value is None and callable(getattr(roofline, "merge_cost", None)):
        merged = roofline.merge_cost(kernel.term, device)
        value = getattr(merged, "seconds", merged)
    return None if value is None else float(value)


def planned_kernels(lowered, device=DEVICE) -> list[PlannedKernel]:
    """The per-call plan's kernels in order, named as the emitter names their `pallas_call`s, with the
    route the plan's backend gives each (`stats["kernel_routes"]`, dense kernels in plan order)."""
    from emit.pallas import name_of
    from eqsat.types import parse_type

    split = getattr(lowered, "split", None)
    plan = split.per_call if split is not None else lowered.plan
    routes = iter(route for _name, route in (getattr(lowered, "stats", None) or {}).get("kernel_routes", ()))
    out = []
    for kernel in plan.kernels:
        route = next(routes, "triton") if kernel.op in ("Matmul", "Conv", "Attention") and \
            (getattr(lowered, "stats", None) or {}).get("kernel_routes") else "triton"
        name = name_of(kernel.component, kernel.kind)
        terms = kernel.outputs if kernel.op == "Loop" else [kernel.term]
        merge = merge_seconds(kernel, device)
        for i, term in enumerate(terms):
            out.append(PlannedKernel(name, kernel.kind, parse_type(term.ty).size, kernel.seconds if i == 0 else 0.0,
                                     merge if i == 0 else None, route, term))
    return out


def _first_elements(shape: str) -> int | None:
    arrays = _arrays(shape)
    return math.prod(arrays[0][1]) if arrays else None


def kernel_symbol(name: str) -> str:
    """A kernel name as its PTX `.entry` spells it: characters outside [A-Za-z0-9_] become `_`
    (`"a.b:matmul"`, Triton's `"a.b_matmul"` -> `"a_b_matmul"`)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def match_launches(planned: list[PlannedKernel], launches: list[tuple[str, int | None]]) -> list[int | None]:
    """For each launch (its Triton base name, its first output's elements), the index of its plan
    kernel or None: same Triton name, then the first unmatched one of equal output size, else the
    first unmatched one (XLA keeps the order of same-named kernels that depend on each other).
    Names are compared as PTX spells them (`kernel_symbol`)."""
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for i, kernel in enumerate(planned):
        by_name[kernel_symbol(kernel.name)].append(i)
    taken: set[int] = set()
    out: list[int | None] = []
    for name, elements in launches:
        free = [i for i in by_name.get(kernel_symbol(name), ()) if i not in taken]
        same = [i for i in free if planned[i].elements == elements]
        choice = (same or free or [None])[0]
        if choice is not None:
            taken.add(choice)
        out.append(choice)
    return out


def _launch_name(launch, triton_names: dict[str, str], thunk_kernel: str) -> str:
    """The plan kernel name a Pallas launch is matched by: its Triton name, or where identical
    kernels share one (`measure.compare.is_shared_kernel_name`) the named scope of its launch."""
    from measure import compare

    name = triton_names.get(launch.name, re.sub(r"__\d+$", "", thunk_kernel))
    return compare.launch_kernel_name(launch) if compare.is_shared_kernel_name(name) else name


# --- one component ------------------------------------------------------------------------------


def _module_prefix(dump: Path, module: str) -> str:
    return str(dump / module) + "."


def _ptx_of(dump: Path, module: str) -> dict[str, tuple[Path, ptx.PtxKernel]]:
    """Every `.entry` in the module's PTX files -> (its file, its static counts)."""
    out = {}
    for path in sorted(dump.glob(f"{module}.*.ptx")):
        for name, counts in ptx.read_ptx(path.read_text(errors="replace")).items():
            out[name] = (path, counts)
    return out


def _run_ptxas_all(paths: Iterable[Path], ptxas: Path, workers: int) -> dict[str, ptx.PtxasResources]:
    out: dict[str, ptx.PtxasResources] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for resources in pool.map(functools.partial(ptx.run_ptxas, ptxas=ptxas), sorted(set(paths))):
            out.update(resources)
    return out


def kernel_row(planned: PlannedKernel | None, thunk: ThunkKernel | None, counts: ptx.PtxKernel | None,
               resources: ptx.PtxasResources | None, triton_name: str, backend: str = "triton") -> dict[str, Any]:
    """One table row: what the compiled program says about a launch (`backend`: the template that
    emitted it, triton or mosaic), and what the model says. A kernel the library runs (`thunk`
    None) has only the model's columns."""
    if thunk is None:
        thunk = ThunkKernel(-1, "", (0, 0, 0), (0, 0, 0), 0)
    threads = math.prod(thunk.threads)
    registers = resources.registers if resources else None
    shared = thunk.shared_bytes + (resources.shared_bytes if resources else 0)
    seconds = planned.seconds if planned else None
    merge = planned.merge_seconds if planned else None
    per_sm = ptx.ctas_per_sm(registers, threads, shared) if registers is not None else None
    return {
        "name": planned.name if planned else triton_name,
        "kind": planned.kind if planned else "extra",
        "backend": backend,
        "kernel": thunk.kernel,
        "grid": list(thunk.grid),
        "ctas": math.prod(thunk.grid),
        "threads": threads,
        "registers": registers,
        "spill_bytes": resources.spill_bytes if resources else None,
        "shared_bytes": shared,
        "ctas_per_sm": per_sm,
        "waves": ptx.waves(math.prod(thunk.grid), per_sm) if per_sm is not None else None,
        "tensor_core": counts.tensor_core if counts else None,
        "wgmma": counts.wgmma if counts else None,
        "mma_sync": counts.mma_sync if counts else None,
        "global_loads": counts.global_loads if counts else None,
        "global_load_bytes": counts.global_load_bytes if counts else None,
        "vector_load_bytes": counts.vector_load_bytes if counts else None,
        "vector_load_fraction": counts.vector_load_fraction if counts else None,
        "tma_loads": counts.tma_loads if counts else None,
        "wgmma_wait_depth": counts.wgmma_wait_depth if counts else None,
        "modeled_seconds": seconds,
        "merge_seconds": merge,
        "merge_fraction": merge / seconds if merge is not None and seconds else None,
        "modeled_glue": modeled_glue(planned) if planned else [],
    }


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over rows: kernels, modeled seconds, spills, tensor-core use, vector-load share, ..."""
    loads = sum(r["global_load_bytes"] or 0 for r in rows)
    merges = [r["merge_fraction"] for r in rows if r["merge_fraction"] is not None]
    return {
        "count": len(rows),
        "modeled_seconds": sum(r["modeled_seconds"] or 0.0 for r in rows),
        "spill_bytes": sum(r["spill_bytes"] or 0 for r in rows),
        "spilling_kernels": sum(bool(r["spill_bytes"]) for r in rows),
        "one_cta_per_sm_kernels": sum(r["ctas_per_sm"] == 1 for r in rows),
        "wgmma_kernels": sum(bool(r["wgmma"]) for r in rows),
        "mma_sync_kernels": sum(bool(r["mma_sync"]) for r in rows),
        "pipelined_kernels": sum((r["wgmma_wait_depth"] or 0) >= 1 for r in rows),
        "global_load_bytes": loads,
        "vector_load_fraction": sum(r["vector_load_bytes"] or 0 for r in rows) / loads if loads else None,
        "max_merge_fraction": max(merges) if merges else None,
    }


def measure_component(workload, *, dump: Path, ptxas: Path, workers: int = 2, xla: bool = True,
                      log=lambda message: None, backend: str = "triton", device: str = DEVICE) -> dict[str, Any]:
    """Plan, compile and read one component (see the module docstring); `dump` keeps both programs
    (`dump/eqsat`, `dump/xla`, the Mosaic kernels' PTX in `dump/eqsat/mosaic`). `backend`: triton,
    mosaic or auto (`BACKENDS`); `device`: the profile the plan is made and priced on."""
    from benchmarks import mosaic_ptx
    from measure import compare, xla_target

    optimize, reason = compare._load_optimize()
    if optimize is None:
        raise RuntimeError(reason)
    start = time.perf_counter()
    log(f"{workload.name}: optimizing ({workload.description}; backend {backend})")
    _, fast, lowered = compare.measure_plan(workload, optimize, device, BACKENDS[backend])
    planned = planned_kernels(lowered, device)
    log(f"{workload.name}: {len(planned)} per-call kernels planned in {time.perf_counter() - start:.0f} s; "
        "compiling our executable for H100")
    split = getattr(lowered, "split", None)
    prepared = split.prepared_specs() if split is not None else []
    ours = dump / "eqsat"
    try:
        with mosaic_ptx.dumping(dump / "mosaic"):
            report = xla_target.compile_for_h100(functools.partial(compare.emitted_per_call, fast), prepared,
                                                 *workload.args, keep_dump=ours)
    except RuntimeError as error:
        kernel = compare._failing_kernel(str(error), [k.name for k in planned])
        tail = "\n".join(str(error).strip().splitlines()[-12:])
        raise RuntimeError(f"{workload.name}: {'kernel ' + kernel if kernel else 'our executable'} failed to "
                           f"compile for sm_90:\n{tail}") from None
    if report is None:
        raise RuntimeError(xla_target.unavailable_reason() or "the H100 compile target is unavailable")
    log(f"{workload.name}: compiled {report.kernels} kernels in {report.compile_seconds:.0f} s; running ptxas")
    prefix = _module_prefix(ours, report.module)
    thunks = read_thunk_kernels(Path(prefix + "thunk_sequence.txt").read_text())
    hlo_path = next(iter(sorted(ours.glob(f"{report.module}.*gpu_after_optimizations.txt"))), None)
    hlo_text = hlo_path.read_text(errors="replace") if hlo_path else ""
    instructions, _ = read_hlo(hlo_text)
    triton_names = compare.triton_kernel_names(ours)
    entries = _ptx_of(ours, report.module)
    mosaic_entries = mosaic_ptx.read_dump(dump / "mosaic")

    pallas, others = [], []
    for launch in report.launches:
        if launch.counted == "none":
            continue
        (pallas if launch.category.startswith("Pallas") else others).append(launch)
    thunk_of = {launch.index: thunks.get(launch.index) for launch in pallas}
    # A Mosaic GPU kernel is a custom call whose line in the thunk sequence has no launch shape: its
    # grid and threads are its template's (`eqsat.cost.mosaic`), filled in once it is matched.
    missing_launch = [launch.name for launch in pallas if thunk_of[launch.index] is None and not _is_mosaic(launch)]
    if missing_launch:
        raise RuntimeError(f"{workload.name}: no launch shape in the thunk sequence for {missing_launch[:5]}")
    resources = _run_ptxas_all((entries[t.kernel][0] for t in thunk_of.values() if t is not None and t.kernel in entries),
                               ptxas, workers)
    keys = [(compare.launch_kernel_name(launch) if _is_mosaic(launch) else
             _launch_name(launch, triton_names, thunk_of[launch.index].kernel),
             _first_elements(instructions[launch.name].shape) if launch.name in instructions else None)
            for launch in pallas]
    matched = match_launches(planned, keys)
    shared_name = pallas_names(lowered)
    rows: list[dict[str, Any] | None] = [None] * len(planned)
    extra = []
    for launch, (triton_name, _), index in zip(pallas, keys, matched):
        thunk = thunk_of[launch.index]
        if _is_mosaic(launch):
            if thunk is None:
                thunk = mosaic_thunk(launch, planned[index] if index is not None else None)
            _path, counts, resource = mosaic_entry(mosaic_entries, shared_name.get(triton_name, triton_name),
                                                   thunk.kernel)
            row_backend = "mosaic"
        else:
            counts, resource, row_backend = entries.get(thunk.kernel, (None, None))[1], resources.get(thunk.kernel), "triton"
        row = kernel_row(planned[index] if index is not None else None, thunk, counts, resource, triton_name,
                         row_backend)
        if index is None:
            extra.append(row)
        else:
            rows[index] = row
    for i, kernel in enumerate(planned):  # kernels the library runs: no Pallas launch, the model's row
        if rows[i] is None and kernel.route == "library":
            rows[i] = kernel_row(kernel, None, None, None, kernel.name, "library")
    reduced, reduce_seconds = driver_reductions(lowered)
    in_producer = producer_finished(lowered)
    # a statistic hosted on a Mosaic or library kernel is reduced by its own kernel after its last
    # host (an extra launch), or finished by its haloed conv's last CTA (`eqsat.cost.finish`): the
    # plan's finalize of it launches nothing
    replaced = [planned[i].name for i, row in enumerate(rows)
                if row is None and planned[i].kind == "finalize" and planned[i].term in reduced | in_producer]
    missing = [planned[i].name for i, row in enumerate(rows)
               if row is None and not (planned[i].kind == "finalize" and planned[i].term in reduced | in_producer)]
    kernels = [row for row in rows if row is not None] + extra
    other = price_launches(_only(report, others), hlo_text, device) if others else None

    result: dict[str, Any] = {
        "description": workload.description,
        **totals(kernels),
        "planned_kernels": len(planned),
        "plan_modeled_seconds": sum(k.seconds for k in planned),
        "emitted_kernels": report.kernels,
        "missing_kernels": missing,
        "extra_kernels": [row["name"] for row in extra],
        "finalize_replaced_by_reduce": replaced,
        "driver_reduced_statistics": len(reduced),
        "driver_reduce_modeled_seconds": reduce_seconds,
        "non_pallas_launches": [{"name": l.name, "category": l.category, "kind": l.kind} for l in others],
        "non_pallas_modeled_seconds": other["xla_modeled_seconds"] if other else 0.0,
        "by_kind": {kind: totals([r for r in kernels if r["kind"] == kind])
                    for kind in dict.fromkeys(r["kind"] for r in kernels)},
        "backend": backend,
        "by_backend": {name: totals([r for r in kernels if r["backend"] == name])
                       for name in dict.fromkeys(r["backend"] for r in kernels)},
        "glue_launches": sum(launch.category != "memset" for launch in others),
        "modeled_glue_launches": modeled_glue_launches(planned) + len(plan_sliced_stores(lowered, planned, reduced)),
        "emit_compile_seconds": report.compile_seconds,
        "kernels": kernels,
    }
    # Under mosaic and auto the non-Pallas launches include the templates' XLA layout fusions and the
    # library calls, which the plan's kernels are priced with already (`eqsat.cost.backends`).
    if backend == "triton":
        result["modeled_seconds"] = result["plan_modeled_seconds"] + result["non_pallas_modeled_seconds"]
    else:  # the launched plan kernels (glue priced in them) and the statistics' own reduce kernels
        result["modeled_seconds"] = sum(r["modeled_seconds"] or 0.0 for r in kernels) + reduce_seconds
    result["xla_modeled_seconds"] = None
    if xla:
        log(f"{workload.name}: compiling jax.jit for H100")
        xla_dump = dump / "xla"
        xla_report = xla_target.compile_for_h100(workload.fn, *workload.args, keep_dump=xla_dump)
        if xla_report is not None:
            hlo = next(iter(sorted(xla_dump.glob(f"{xla_report.module}.*gpu_after_optimizations.txt"))), None)
            result.update(price_launches(xla_report, hlo.read_text(errors="replace") if hlo else "", device))
            result["xla_kernels"] = xla_report.kernels
    log(f"{workload.name}: done in {time.perf_counter() - start:.0f} s")
    return result


def driver_reductions(lowered, device=None) -> tuple[frozenset, float]:
    """The hosted statistics of the per-call plan that a host on Mosaic or the library leaves to
    their own reduce kernel (`eqsat.cost.roofline.driver_reduced`), and those kernels' modeled seconds
    (`eqsat.cost.backends.hosted_extra`)."""
    from eqsat.cost.backends import hosted_extra
    from eqsat.cost.roofline import driver_reduced

    order, hosting, device, finished = _statistics_of(lowered, device)
    _routes, reduced = driver_reduced(order, hosting, device, finished)
    return reduced, sum(hosted_extra(r, "mosaic", device).seconds for r in reduced)


def _statistics_of(lowered, device=None) -> tuple:
    """`(kernels in order, hosting, device, statistics the plan finishes once)` of the per-call plan."""
    from eqsat.cost import get_device, hosted_reductions
    from eqsat.cost import kernels as kernel_order
    from eqsat.cost.roofline import finished_statistics

    split = getattr(lowered, "split", None)
    plan = split.per_call if split is not None else lowered.plan
    device = get_device(device or plan.device)
    outputs = list(plan.outputs)
    hosting = hosted_reductions(outputs)
    order = kernel_order(outputs, hosting)
    return order, hosting, device, finished_statistics(order, hosting, device, outputs)


def producer_finished(lowered, device=None) -> frozenset:
    """The hosted statistics of the per-call plan their haloed Mosaic conv finishes in its last CTA
    (`eqsat.cost.roofline.producer_finished_of`)."""
    from eqsat.cost.roofline import driver_reduced, producer_finished_of

    order, hosting, device, finished = _statistics_of(lowered, device)
    routes, _reduced = driver_reduced(order, hosting, device, finished)
    return producer_finished_of(order, hosting, routes, device, finished)


def modeled_glue_launches(planned: list[PlannedKernel]) -> int:
    """The XLA fusions the model says the Mosaic-routed kernels launch around them
    (`eqsat.cost.mosaic.MosaicWork.glue`), to read beside the counted non-Pallas launches."""
    from eqsat.cost.mosaic import mosaic_work

    return sum(mosaic_work(k.term).glue_launches for k in planned if k.route == "mosaic" and k.term is not None)


def plan_sliced_stores(lowered, planned: list[PlannedKernel], reduced) -> list:
    """The padded stores of Mosaic matmuls sliced by a launch of their own before a Triton reader or
    as a program output (`eqsat.cost.backends.sliced_stores`): glue of the plan, not of a kernel."""
    from eqsat.cost.backends import sliced_stores

    split = getattr(lowered, "split", None)
    plan = split.per_call if split is not None else lowered.plan
    routes = {id(k.term): k.route for k in planned if k.term is not None}
    kernels = [(k.term, routes.get(id(k.term), "triton"), k.hosted) for k in plan.kernels if k.op != "Loop"]
    return sliced_stores(kernels, list(reduced), list(plan.outputs))


def modeled_glue(kernel: PlannedKernel) -> list[str]:
    """The fusions the model says a Mosaic-routed kernel launches around it, by what they do."""
    from eqsat.cost.mosaic import mosaic_work

    if kernel.route != "mosaic" or kernel.term is None:
        return []
    return [g.what for g in mosaic_work(kernel.term).glue if g.launches]


def _is_mosaic(launch) -> bool:
    return launch.category == "Pallas (Mosaic GPU)"


def mosaic_thunk(launch, planned: "PlannedKernel | None") -> ThunkKernel:
    """A Mosaic launch's shape from its template's configuration (`eqsat.cost.mosaic.mosaic_work`:
    CTAs, warpgroups of 128 threads; dynamic shared memory left to ptxas's report)."""
    from eqsat.cost.mosaic import mosaic_work

    if planned is None or planned.term is None or planned.term.op not in ("Matmul", "Conv", "Attention"):
        return ThunkKernel(launch.index, "", (0, 0, 0), (0, 0, 0), 0)
    work = mosaic_work(planned.term)
    return ThunkKernel(launch.index, "", (work.ctas, 1, 1), (128 * work.warpgroups, 1, 1), 0)


def pallas_names(lowered) -> dict[str, str]:
    """Plan kernel name -> the name of its `pallas_call` (`emit.kernel_names`): kernels of one structure
    share the first one's (Mosaic compiles that kernel once; its PTX entry is named after it)."""
    from emit import kernel_names
    from emit.pallas import name_of

    split = getattr(lowered, "split", None)
    plan = split.per_call if split is not None else lowered.plan
    return dict(zip((name_of(k.component, k.kind) for k in plan.kernels), kernel_names(plan)))


def mosaic_entry(entries: dict, name: str, thunk_kernel: str):
    """(PTX path, counts, ptxas resources) of the Mosaic kernel named `name` (its `pallas_call`'s name,
    `pallas_names`; `read_dump`'s entries): the entry the launch names, else the one spelled as the
    kernel (`kernel_symbol`: Mosaic names the entry after the name it is given; `read_dump` maps a
    kernel that ran an equal kernel's module to that entry), else (None, None, None)."""
    if thunk_kernel in entries:
        return entries[thunk_kernel]
    symbol = kernel_symbol(name)
    found = [entries[e] for e in entries if e == symbol] or [entries[e] for e in entries if e.startswith(symbol)]
    return found[0] if found else (None, None, None)


def _only(report, launches):
    """`report` with only `launches` (for pricing a subset the same way)."""
    return dataclasses.replace(report, launches=tuple(launches))


# --- the command --------------------------------------------------------------------------------


def commit_label() -> str:
    """The measured commit: `git rev-parse --short HEAD` of this checkout, `+dirty` when changed."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(components=COMPONENTS, config: str = "full", batch: int = 2, size: int | None = None,
        dtype: str = "float16", dump: str | os.PathLike | None = None, xla: bool = True,
        workers: int = 2, log=lambda message: None, backend: str = "triton", device: str = DEVICE) -> dict[str, Any]:
    """Measure `components`; the result is what `--json` writes."""
    from measure import xla_target
    from sd15 import workloads as sd15_workloads

    ptxas = ptx.ptxas_path()  # fails first, in one line, when ptxas is missing
    reason = xla_target.unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from eqsat.cost.devices import get_device

    profile = get_device(device)
    report: dict[str, Any] = {
        "commit": commit_label(), "config": config, "batch": batch, "dtype": dtype, "device": device,
        "backend": backend,
        "ptxas": str(ptxas), "xla_library_efficiency": XLA_LIBRARY_EFFICIENCY,
        "device_model": dataclasses.asdict(profile), "labels": LABELS, "components": {},
    }
    work = sd15_workloads.workloads(batch, size, dtype, config, components)
    scratch = None if dump is not None else tempfile.mkdtemp(prefix="benchmarks_kernels_")
    root = Path(dump if dump is not None else scratch)
    try:
        for name, workload in work.items():
            report["components"][name] = measure_component(workload, dump=root / name, ptxas=ptxas,
                                                           workers=workers, xla=xla, log=log, backend=backend,
                                                           device=device)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return report


def _us(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:,.1f}"


def _share(value) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _n(value) -> str:
    return "n/a" if value is None else f"{value:,}"


def render(report: dict[str, Any], console=None, per_kernel: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)
    for name, row in report["components"].items():
        if per_kernel:
            table = Table(title=f"{name}: kernels of our H100 program ({report['config']}, {report['dtype']}, "
                          f"commit {report['commit']})")
            for column, justify in (("kernel", "left"), ("backend", "left"), ("grid", "right"), ("threads", "right"), ("regs", "right"),
                                    ("spill B", "right"), ("smem KB", "right"), ("CTA/SM", "right"), ("waves", "right"),
                                    ("tensor core", "left"), ("vector ld", "right"), ("wgmma wait", "right"),
                                    ("modeled µs", "right")):
                table.add_column(column, justify=justify)
            for kernel in row["kernels"]:
                spill = kernel["spill_bytes"]
                table.add_row(
                    kernel["name"], kernel.get("backend", "triton"), "x".join(map(str, kernel["grid"])), _n(kernel["threads"]), _n(kernel["registers"]),
                    f"[red]{spill:,}[/]" if spill else _n(spill), f"{kernel['shared_bytes'] / 1024:.1f}",
                    _n(kernel["ctas_per_sm"]), "n/a" if kernel["waves"] is None else f"{kernel['waves']:.2f}",
                    kernel["tensor_core"] or "n/a", _share(kernel["vector_load_fraction"]),
                    _n(kernel["wgmma_wait_depth"]) if kernel["wgmma"] else "-", _us(kernel["modeled_seconds"]))
            console.print(table)
        console.print(kinds_table(name, row, report))
        if row.get("by_backend"):
            console.print(kinds_table(name, row, report, by="backend"))
    console.print(components_table(report))
    for name, row in report["components"].items():
        if row.get("xla_seconds_by_category"):
            parts = ", ".join(f"{category} {_us(seconds)}" for category, seconds in row["xla_seconds_by_category"].items())
            console.print(f"  {name}: XLA's modeled µs by category: {parts}", soft_wrap=True)
    console.print(
        f"  counted: read from the compiled program (thunk sequence, PTX, ptxas -arch=sm_90a -v); 'vector ld' is the "
        f"share of static PTX global-load instruction bytes (each instruction weighted by its width, not dynamic "
        f"bytes) moved by >= 64-bit loads or TMA. modeled: eqsat.cost.roofline for ours; XLA's launches as launch "
        f"+ HBM bytes + dots/convolutions (cuBLAS, cuDNN, Triton GEMM) at {XLA_LIBRARY_EFFICIENCY:.0%} of the "
        f"tensor-core peak, no ALU work for its fusions. CTA/SM: H100 limits of 65536 registers, 228 KB shared "
        f"memory (1 KB reserved per CTA), 2048 threads, 32 CTAs.", soft_wrap=True)


def kinds_table(name: str, row: dict[str, Any], report: dict[str, Any], by: str = "kind"):
    from rich.table import Table

    groups = row["by_kind"] if by == "kind" else row["by_backend"]
    table = Table(title=f"{name}: totals per {by} (backend {row.get('backend', 'triton')}; {row['emitted_kernels']} "
                        f"launches, {row.get('glue_launches', 'n/a')} of them not Pallas, the model's glue "
                        f"{row.get('modeled_glue_launches', 'n/a')}; commit {report['commit']})")
    for column in (by, "kernels", "modeled µs", "share", "spilling (bytes)", "1 CTA/SM", "wgmma", "mma.sync",
                   "pipelined", "vector ld", "max merge"):
        table.add_column(column, justify="left" if column == by else "right")
    total = row["modeled_seconds"] or 0.0
    for kind, sums in [*groups.items(), ("all", totals(row["kernels"]))]:
        table.add_row(kind, _n(sums["count"]), _us(sums["modeled_seconds"]),
                      _share(sums["modeled_seconds"] / total if total else None),
                      f"{sums['spilling_kernels']} ({sums['spill_bytes']:,})", _n(sums["one_cta_per_sm_kernels"]),
                      _n(sums["wgmma_kernels"]), _n(sums["mma_sync_kernels"]), _n(sums["pipelined_kernels"]),
                      _share(sums["vector_load_fraction"]), _share(sums["max_merge_fraction"]))
    return table


def components_table(report: dict[str, Any]):
    from rich.table import Table

    table = Table(title=f"modeled step time, ours against XLA's (same device model, commit {report['commit']})")
    for column in ("component", "our kernels", "ours modeled µs", "XLA launches", "XLA modeled µs",
                   "XLA: launch / bytes / dense µs", "ours / XLA"):
        table.add_column(column, justify="left" if column == "component" else "right")
    for name, row in report["components"].items():
        xla = row.get("xla_modeled_seconds")
        parts = (" / ".join(_us(row.get(key)) for key in ("xla_launch_seconds", "xla_bytes_seconds", "xla_dense_seconds"))
                 if xla is not None else "n/a")
        table.add_row(name, _n(row["count"]), _us(row["modeled_seconds"]), _n(row.get("xla_launches")), _us(xla),
                      parts, f"{row['modeled_seconds'] / xla:.2f}x" if xla else "n/a")
    return table


def _components(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or any(name not in COMPONENTS for name in names):
        raise argparse.ArgumentTypeError(f"--component must be some of {','.join(COMPONENTS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--component", type=_components, default=COMPONENTS,
                        help="unet, vae, text_encoder or a comma list (default all three)")
    parser.add_argument("--config", default="full", choices=("full", "tiny"))
    parser.add_argument("--batch", type=int, default=2, help="UNet guidance batch (even; default 2)")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default 512)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON to PATH")
    parser.add_argument("--dump", default=None, metavar="DIR",
                        help="keep both compiled programs (PTX, thunk sequence, HLO) in DIR/<component>/{eqsat,xla}")
    parser.add_argument("--no-xla", dest="xla", action="store_false", help="skip XLA's compile and price")
    parser.add_argument("--summary", action="store_true", help="print the totals only, not a row per kernel")
    parser.add_argument("--workers", type=int, default=2, help="ptxas processes at once (default 2)")
    parser.add_argument("--device", default=DEVICE, help="the device profile the plan is made and priced on "
                        "(eqsat.cost.DEVICES: h100, h100-calibrated, ...; default h100)")
    parser.add_argument("--backend", default="triton", choices=tuple(BACKENDS),
                        help="the templates that emit convs, matmuls and attention: triton (default), mosaic, "
                             "or auto (per kernel, the one the cost model prices lowest)")
    options = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning only traces; the H100 compile has its own process
    try:
        report = run(options.component, options.config, options.batch, options.size, options.dtype,
                     options.dump, options.xla, options.workers,
                     log=lambda message: print(message, file=sys.stderr, flush=True), backend=options.backend,
                     device=options.device)
    except ptx.PtxasMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2))
    render(report, per_kernel=not options.summary)
    problems = [f"{name}: planned kernels with no launch: {row['missing_kernels']}"
                for name, row in report["components"].items() if row["missing_kernels"]]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
