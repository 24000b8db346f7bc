"""Where a cold compile for an H100 goes, by phase: Python emission, XLA's HLO passes, the Triton
pipeline per kernel inside XLA, LLVM, ptxas (`python -m benchmarks.compile --phases`).

One fresh process per side (ours: the per-call stage of `measure.compare.optimized`; XLA's:
`jax.jit` of the workload) on `measure.xla_target`'s deviceless H100 topology, stage by stage:
plan (ours only), `trace` (the jaxpr: for ours, every template emitting its kernels' jaxprs),
`lower` (StableHLO: for ours, Pallas lowering each kernel's jaxpr to Triton IR), `compile` (XLA).
Python's side is timed by wrapping two functions (`emit.pallas.emit_kernel`: a template emitting
one kernel; jax's `lower_jaxpr_to_triton_module`: one kernel's jaxpr to Triton IR). XLA's side is
read from its own log (`XLA_LOG_MODULES`, at VLOG 1-3: `parse_xla_log`): the HLO pass pipeline's
time, then per Triton kernel, on the compile thread that built it, the Triton MLIR pipeline (TTIR
to TTGIR to the LLVM dialect: from the thread taking the kernel to Triton's "Shared memory usage"
line), the translation to LLVM IR (up to the LLVM compile), LLVM to PTX and ptxas (XLA's own
timers). XLA compiles the Triton kernels on a pool of threads, one per core here, so those are
thread-seconds; the compile's wall and CPU seconds (ptxas runs as a subprocess: its CPU is the
children's) are measured too.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

# The XLA source files whose logs the phase table reads, at the VLOG levels that print them.
XLA_LOG_MODULES = ("gpu_compiler=1,compile_module_to_llvm_ir=1,thunk_emitter=3,xtile_compiler=3,"
                   "nvptx_backend=1,nvptx_compiler=1,llvm_command_line_options=1")

_LOG_LINE = re.compile(r"^[IWEF](?P<month>\d\d)(?P<day>\d\d) (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d\.\d+)\s+"
                       r"(?P<thread>\d+) (?P<file>[\w.]+):\d+\] (?P<message>.*)$")
_TIMER = re.compile(r" time: [\d.]+ \w+ \((?P<us>\d+) us\)")


@dataclasses.dataclass
class TritonKernelPhases:
    """One Triton kernel compiled inside XLA: thread-seconds per phase."""

    name: str        # the kernel's name (its `pallas_call` name, sanitized), matched in start order
    thread: int
    triton: float    # Triton's MLIR pipeline: the parsed TTIR to TTGIR to the LLVM dialect
    translate: float  # the LLVM dialect to LLVM IR (and libdevice linked)
    llvm: float      # LLVM's optimization and PTX code generation
    ptxas: float     # PTX to cubin

    @property
    def total(self) -> float:
        return self.triton + self.translate + self.llvm + self.ptxas


def _seconds(match) -> float:
    return (int(match["h"]) * 60 + int(match["m"])) * 60 + float(match["s"])


def parse_xla_log(text: str) -> dict[str, Any]:
    """XLA's compile phases from its log at `XLA_LOG_MODULES`: `hlo_passes`, `ir_emission` (the
    thunk emitter, waiting for the Triton kernels it hands to its threads), `backend` (IR emission
    and XLA's own LLVM module to cubin), `module_llvm`/`module_ptxas` (that module, XLA's fusions),
    and `kernels`: a `TritonKernelPhases` per Triton kernel compiled (each distinct kernel once).
    Kernel names are matched to the threads' work in the order the emitter handed them out (its
    queue is first in, first out)."""
    generated: list[tuple[float, str]] = []
    by_thread: dict[int, list[tuple[float, str, str]]] = {}
    main_thread = None
    phases: dict[str, float] = {"hlo_passes": 0.0, "ir_emission": 0.0, "backend": 0.0,
                                "module_llvm": 0.0, "module_ptxas": 0.0}
    for line in text.splitlines():
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        at, thread, message, source = _seconds(match), int(match["thread"]), match["message"], match["file"]
        timer = _TIMER.search(message)
        if message.startswith("Generating: "):
            main_thread = thread
            generated.append((at, message[len("Generating: "):].strip()))
        elif message.startswith("GpuCompiler::RunHloPasses") and timer:
            phases["hlo_passes"] += int(timer["us"]) / 1e6
        elif message.startswith("GpuCompiler::RunBackend - IR emission") and timer:
            phases["ir_emission"] += int(timer["us"]) / 1e6
        elif message.startswith("GpuCompiler::RunBackend for") and timer:
            phases["backend"] += int(timer["us"]) / 1e6
        elif source == "xtile_compiler.cc" and message.startswith("Shared memory usage"):
            by_thread.setdefault(thread, []).append((at, "triton", ""))
        elif source == "nvptx_backend.cc" and message.startswith("Compile module") and timer:
            by_thread.setdefault(thread, []).append((at, "llvm", message.split()[2], int(timer["us"]) / 1e6))
        elif source == "nvptx_compiler.cc" and "PtxToCubin" in message and timer:
            by_thread.setdefault(thread, []).append((at, "ptxas", "", int(timer["us"]) / 1e6))
    tasks = []  # (start candidate, thread, phases)
    for thread, events in by_thread.items():
        previous_end = None
        current: dict[str, Any] = {}
        for event in events:
            at, kind = event[0], event[1]
            if kind == "triton":
                current = {"thread": thread, "after": previous_end, "triton_end": at}
            elif kind == "llvm":
                if event[2] != "LLVMDialectModule":  # XLA's own module (its fusions), not a Triton kernel
                    phases["module_llvm"] += event[3]
                    current = {"module": True}
                    continue
                if "triton_end" not in current:  # its Triton line lost (interleaved output): Triton to LLVM start
                    current = {"thread": thread, "after": previous_end, "triton_end": at - event[3]}
                current["llvm"], current["llvm_end"] = event[3], at
            elif kind == "ptxas":
                if current.get("module") or "triton_end" not in current:
                    phases["module_ptxas"] += event[3]
                else:
                    current["ptxas"] = event[3]
                    tasks.append(current)
                previous_end = at
                current = {}
    # First in, first out: the i-th kernel a thread started is the next one handed out.
    tasks.sort(key=lambda task: (task["after"] if task["after"] is not None else -1.0, task["triton_end"]))
    kernels = []
    for i, task in enumerate(tasks):
        handed_at, name = generated[i] if i < len(generated) else (None, "?")
        starts = [t for t in (task["after"], handed_at) if t is not None]
        start = max(starts) if starts else task["triton_end"]
        llvm_start = task["llvm_end"] - task["llvm"]
        kernels.append(TritonKernelPhases(name, task["thread"], max(task["triton_end"] - start, 0.0),
                                          max(llvm_start - task["triton_end"], 0.0), task["llvm"], task["ptxas"]))
    threads = {k.thread for k in kernels} - ({main_thread} if main_thread is not None else set())
    return {**phases, "kernels": kernels, "generated": len(generated), "threads": len(threads)}


def kernel_totals(kernels: list[TritonKernelPhases]) -> dict[str, float]:
    """Thread-seconds per phase summed over the kernels."""
    return {phase: sum(getattr(k, phase) for k in kernels) for phase in ("triton", "translate", "llvm", "ptxas")}


# --- the child process -------------------------------------------------------------------------


class _Accumulator:
    """Wraps `owner.name` to add each call's seconds (outermost calls only) and count its calls."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.seconds, self.calls, self.depth = owner, name, 0.0, 0, 0
        self.original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.calls += 1
            self.depth += 1
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)


class ThreadCpu:
    """CPU seconds of this process's threads while it runs (sampled from /proc, Linux): the
    compile's worker threads exit or idle when it ends, so they are read as it goes."""

    def __init__(self, period: float = 0.2):
        import threading

        self.period, self.seen, self.main = period, {}, threading.get_native_id()
        self.start = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> dict[int, float]:
        import os

        tick, out = os.sysconf("SC_CLK_TCK"), {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                continue
        return out

    def _run(self):
        while not self._stop.wait(self.period):
            self.seen.update(self._read())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.seen.update(self._read())

    def others(self) -> float:
        """CPU seconds of every thread but the main one and the sampler, since the start."""
        import threading

        skip = {self.main, self._thread.native_id or threading.get_native_id()}
        return sum(cpu - self.start.get(tid, 0.0) for tid, cpu in self.seen.items() if tid not in skip)

    def main_thread(self) -> float:
        return self.seen.get(self.main, 0.0) - self.start.get(self.main, 0.0)


def _cpu() -> tuple[float, float]:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


# --- the table -----------------------------------------------------------------------------------


def phase_rows(side: dict[str, Any]) -> list[tuple[str, float | None]]:
    """(phase, seconds) rows of one side's measurement (`benchmarks.compile.child_phases`, plus `xla`:
    `parse_xla_log`)."""
    xla = side.get("xla", {})
    totals = kernel_totals(xla.get("kernels", []))
    python_rest = side["trace_s"] + side["lower_s"] - side["template_emission_s"] - side["triton_lowering_s"]
    accounted = xla.get("hlo_passes", 0.0) + xla.get("backend", 0.0)
    return [
        ("plan (eqsat)", side.get("plan_s")),
        ("Python: templates emitting kernel jaxprs", side["template_emission_s"]),
        ("Python: Pallas lowering kernel jaxprs to Triton IR", side["triton_lowering_s"]),
        ("Python: the rest of trace + lower (JAX, StableHLO)", python_rest),
        ("XLA: HLO passes", xla.get("hlo_passes")),
        ("XLA: IR emission, wall (waits for the Triton threads)", xla.get("ir_emission")),
        ("Triton: TTIR -> TTGIR -> LLVM dialect, thread-s", totals["triton"]),
        ("Triton: LLVM dialect -> LLVM IR, thread-s", totals["translate"]),
        ("Triton kernels: LLVM -> PTX, thread-s", totals["llvm"]),
        ("Triton kernels: ptxas, thread-s", totals["ptxas"]),
        ("XLA's fusions: LLVM -> PTX", xla.get("module_llvm")),
        ("XLA's fusions: ptxas", xla.get("module_ptxas")),
        ("XLA: compile, other (wall)", side["compile_s"] - accounted if xla else None),
        ("compile: worker threads' CPU (Triton, LLVM; ptxas waits)", side.get("compile_worker_cpu_s")),
        ("compile: main thread's CPU (HLO passes, IR emission)", side.get("compile_main_thread_cpu_s")),
        ("compile: ptxas processes' CPU", side["compile_children_cpu_s"]),
        ("XLA compile, wall", side["compile_s"]),
        ("XLA compile, CPU (process + ptxas children)", side["compile_cpu_s"] + side["compile_children_cpu_s"]),
        ("trace + lower + compile, wall", side["trace_s"] + side["lower_s"] + side["compile_s"]),
        ("trace + lower + compile, CPU", side["python_cpu_s"] + side["compile_cpu_s"] + side["compile_children_cpu_s"]),
    ]


def format_phase_table(component: str, ours: dict[str, Any], xla: dict[str, Any]) -> str:
    """A markdown table of both sides' phases, and the Triton kernels compiled against launched."""
    def cell(value):
        return "-" if value is None else f"{value:.2f}"

    lines = [f"| {component}: phase | ours s | XLA's s |", "|---|---:|---:|"]
    for (phase, mine), (_, theirs) in zip(phase_rows(ours), phase_rows(xla)):
        lines.append(f"| {phase} | {cell(mine)} | {cell(theirs)} |")
    for side, label in ((ours, "ours"), (xla, "XLA's")):
        counts, parsed = side.get("kernels", {}), side.get("xla", {})
        compiled = parsed.get("kernels", [])
        mean = sum(k.total for k in compiled) / len(compiled) if compiled else 0.0
        lines.append(f"| {label}: Triton kernels launched / distinct / compiled by XLA (threads); "
                     f"thread-s per compiled kernel | {counts.get('launched', '?')} / {counts.get('distinct', '?')} / "
                     f"{parsed.get('generated', '?')} ({parsed.get('threads', '?')}); {mean:.2f} | |")
    return "\n".join(lines)


def slowest_kernels(side: dict[str, Any], count: int = 10) -> list[dict[str, Any]]:
    """The Triton kernels that took XLA longest to compile, with their phases (thread-seconds)."""
    kernels = sorted(side.get("xla", {}).get("kernels", []), key=lambda k: -k.total)[:count]
    return [{**dataclasses.asdict(k), "total": k.total} for k in kernels]
