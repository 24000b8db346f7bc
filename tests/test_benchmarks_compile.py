"""`python -m benchmarks.compile --phases`: XLA's log read into phases, the table's shape, the
CPU sampled per thread (issue 18)."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.compile_phases import (ThreadCpu, TritonKernelPhases, format_phase_table, kernel_totals,
                                       parse_xla_log, phase_rows)

MAIN, ONE, TWO = 100, 201, 202


def line(at: float, thread: int, source: str, message: str) -> str:
    minutes, seconds = divmod(at, 60.0)
    return f"I1128 14:{int(minutes):02d}:{seconds:09.6f} {thread:>7} {source}:123] {message}"


def timer(label: str, seconds: float) -> str:
    us = round(seconds * 1e6)
    return f"{label} time: {seconds:.3g} s ({us} us) (cumulative: 1 s, max: 1 s, #called: 1)"


# Two Triton kernels handed out at t=1.0 and 1.1 to two threads, a third taken by thread ONE
# when its first is done; XLA's own module compiled on the main thread at the end.
LOG = "\n".join([
    "some unrelated line",
    line(0.5, MAIN, "gpu_compiler.cc", timer("GpuCompiler::RunHloPasses for jit_f", 0.25)),
    line(1.0, MAIN, "thunk_emitter.cc", "Generating: a_conv"),
    line(1.1, MAIN, "thunk_emitter.cc", "Generating: b_matmul.x2"),
    line(1.2, MAIN, "thunk_emitter.cc", "Generating: c_finalize"),
    line(1.5, ONE, "xtile_compiler.cc", "Shared memory usage: 0 B"),
    line(1.9, ONE, "nvptx_backend.cc", timer("Compile module LLVMDialectModule", 0.3)),
    line(2.3, ONE, "nvptx_compiler.cc", timer("NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f", 0.4)),
    line(1.7, TWO, "xtile_compiler.cc", "Shared memory usage: 0 B"),
    line(2.0, TWO, "nvptx_backend.cc", timer("Compile module LLVMDialectModule", 0.2)),
    line(2.1, TWO, "nvptx_compiler.cc", timer("NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f", 0.1)),
    line(2.8, ONE, "xtile_compiler.cc", "Shared memory usage: 16 B"),
    line(3.0, ONE, "nvptx_backend.cc", timer("Compile module LLVMDialectModule", 0.1)),
    line(3.5, ONE, "nvptx_compiler.cc", timer("NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f", 0.5)),
    line(3.6, MAIN, "compile_module_to_llvm_ir.cc", timer("GpuCompiler::RunBackend - IR emission for jit_f", 2.6)),
    line(3.8, MAIN, "nvptx_backend.cc", timer("Compile module jit_f", 0.15)),
    line(4.0, MAIN, "nvptx_compiler.cc", timer("NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_f", 0.2)),
    line(4.1, MAIN, "gpu_compiler.cc", timer("GpuCompiler::RunBackend for jit_f", 3.1)),
])


def test_xla_log_is_read_into_phases_per_kernel():
    parsed = parse_xla_log(LOG)
    assert parsed["hlo_passes"] == pytest.approx(0.25)
    assert parsed["ir_emission"] == pytest.approx(2.6) and parsed["backend"] == pytest.approx(3.1)
    assert parsed["module_llvm"] == pytest.approx(0.15) and parsed["module_ptxas"] == pytest.approx(0.2)
    assert parsed["generated"] == 3 and parsed["threads"] == 2
    kernels = {k.name: k for k in parsed["kernels"]}
    assert set(kernels) == {"a_conv", "b_matmul.x2", "c_finalize"}
    first, second, third = kernels["a_conv"], kernels["b_matmul.x2"], kernels["c_finalize"]
    assert (first.thread, second.thread, third.thread) == (ONE, TWO, ONE)
    # Triton: from the kernel's hand-out (or its thread's previous kernel) to "Shared memory usage";
    # translate: from there to the start of the LLVM compile (its end less its timer).
    assert first.triton == pytest.approx(0.5) and first.translate == pytest.approx(0.1)
    assert first.llvm == pytest.approx(0.3) and first.ptxas == pytest.approx(0.4)
    assert second.triton == pytest.approx(0.6) and second.translate == pytest.approx(0.1)
    assert third.triton == pytest.approx(0.5) and third.translate == pytest.approx(0.1)
    assert third.total == pytest.approx(0.5 + 0.1 + 0.1 + 0.5)
    assert kernel_totals(parsed["kernels"]) == pytest.approx({"triton": 1.6, "translate": 0.3, "llvm": 0.6,
                                                              "ptxas": 1.0})


def test_a_kernel_whose_triton_line_is_lost_is_still_a_kernel():
    lost = "\n".join(l for l in LOG.splitlines() if not ("Shared memory usage: 16 B" in l))
    kernels = {k.name: k for k in parse_xla_log(lost)["kernels"]}
    assert len(kernels) == 3
    third = kernels["c_finalize"]
    assert third.translate == 0.0 and third.triton == pytest.approx(2.9 - 2.3)  # to the LLVM compile's start
    assert parse_xla_log(lost)["module_llvm"] == pytest.approx(0.15)


def test_an_empty_log_has_no_kernels():
    parsed = parse_xla_log("")
    assert parsed["kernels"] == [] and parsed["generated"] == 0 and parsed["hlo_passes"] == 0.0


def side(**extra):
    base = {"trace_s": 1.0, "lower_s": 2.0, "compile_s": 5.0, "python_cpu_s": 2.5, "compile_cpu_s": 4.0,
            "compile_children_cpu_s": 1.0, "compile_worker_cpu_s": 3.0, "compile_main_thread_cpu_s": 0.5,
            "template_emission_s": 0.6, "triton_lowering_s": 1.2,
            "kernels": {"launched": 9, "distinct": 3, "distinct_ir": 3, "lowered": 3},
            "xla": {**parse_xla_log(LOG)}}
    base.update(extra)
    return base


def test_phase_table_has_a_row_per_phase_for_both_sides():
    ours, xla = side(plan_s=0.7), side(template_emission_s=0.0, triton_lowering_s=0.0)
    rows = phase_rows(ours)
    values = dict(rows)
    assert values["plan (eqsat)"] == 0.7 and dict(phase_rows(xla))["plan (eqsat)"] is None
    assert values["Python: the rest of trace + lower (JAX, StableHLO)"] == pytest.approx(3.0 - 0.6 - 1.2)
    assert values["Triton: TTIR -> TTGIR -> LLVM dialect, thread-s"] == pytest.approx(1.6)
    assert values["XLA compile, CPU (process + ptxas children)"] == pytest.approx(5.0)
    assert values["trace + lower + compile, CPU"] == pytest.approx(7.5)
    table = format_phase_table("vae", ours, xla).splitlines()
    assert table[0] == "| vae: phase | ours s | XLA's s |" and table[1] == "|---|---:|---:|"
    assert len(table) == 2 + len(rows) + 2
    assert all(row.count("|") == 4 for row in table)
    assert "9 / 3 / 3 (2)" in table[-2]  # launched / distinct / compiled by XLA (its threads)


def test_thread_cpu_counts_a_busy_thread():
    def spin():
        while time.thread_time() < 0.5:
            pass

    with ThreadCpu(period=0.05) as threads:
        worker = threading.Thread(target=spin)
        worker.start()
        worker.join()
    # The thread's last ~period before it exits goes unsampled (more when a loaded machine delays the
    # sampler): 0.13 of 0.2 s was read at load 5.
    assert threads.others() >= 0.3
    assert threads.main_thread() < threads.others()


def test_kernel_phases_total():
    kernel = TritonKernelPhases("k", 1, 0.5, 0.25, 0.125, 1.0)
    assert kernel.total == 1.875


@pytest.mark.slow
def test_phases_of_the_tiny_text_encoder_compiled_for_an_h100():
    """Both sides compiled in fresh processes for the deviceless H100: XLA's log names every
    distinct Triton kernel it compiled, once each, with its phases."""
    from benchmarks.compile import measure_phases
    from measure import xla_target

    if xla_target.prepare_target() is not None:
        pytest.skip("the H100 compile target is not installed")
    row = measure_phases("text_encoder", 2, None, "tiny", log=lambda message: None)
    ours, xla = row["ours"], row["xla"]
    assert "error" not in ours and "error" not in xla, (ours.get("error"), xla.get("error"))
    counts, parsed = ours["kernels"], ours["xla"]
    assert counts["launched"] > counts["distinct"] == parsed["generated"] > 0
    # Two compile threads share stderr: under load a log line can come out garbled; nearly all parse.
    assert counts["distinct"] - 1 <= len(parsed["kernels"]) <= counts["distinct"]
    assert ours["kernels_emitted"] == ours["kernels_lowered"] == counts["lowered"] == counts["distinct"]
    assert all(k.total > 0 and k.name != "?" for k in parsed["kernels"])
    assert ours["compile_children_cpu_s"] > 0  # ptxas ran, as a process per kernel
    assert xla["kernels"]["launched"] == 0 and xla["template_emission_s"] == 0.0
    assert len(format_phase_table("text_encoder", ours, xla).splitlines()) == 2 + len(phase_rows(ours)) + 2


def _lowered(kernel, name="k"):
    import jax
    import jax.numpy as jnp

    from emit.pallas import triton

    def run(x):
        return triton.pallas_call(kernel, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], grid=(1,), name=name,
                                  interpret=False)[0]

    return jax.jit(run).trace(jax.ShapeDtypeStruct((64,), jnp.float32)).lower(lowering_platforms=("cuda",))


def test_kernel_fingerprint_ignores_source_lines_not_what_runs():
    """The same kernel written at two places hashes alike (debug locations dropped); another
    constant or another name does not."""
    import jax.numpy as jnp

    from benchmarks.compile import kernel_fingerprint, kernel_text, triton_calls
    from emit.pallas import triton

    def here(x_ref, o_ref):
        offsets = jnp.arange(64)
        triton.store(o_ref, offsets, jnp.exp(triton.gather_load(x_ref, offsets)) * 3.0)

    def there(x_ref, o_ref):

        offsets = jnp.arange(64)  # two lines further down

        triton.store(o_ref, offsets, jnp.exp(triton.gather_load(x_ref, offsets)) * 3.0)

    def other(x_ref, o_ref):
        offsets = jnp.arange(64)
        triton.store(o_ref, offsets, jnp.exp(triton.gather_load(x_ref, offsets)) * 4.0)

    first, moved = _lowered(here), _lowered(there)
    assert triton_calls(first)[0][1] != triton_calls(moved)[0][1]  # the serialized IR carries the lines
    assert kernel_fingerprint(first) == kernel_fingerprint(moved)
    assert kernel_fingerprint(first) != kernel_fingerprint(_lowered(other))
    assert kernel_fingerprint(first) != kernel_fingerprint(_lowered(here, name="renamed"))
    assert "loc(" not in kernel_text(triton_calls(first)[0][1]) and "tt.func" in kernel_text(triton_calls(first)[0][1])


@pytest.mark.slow
def test_a_warm_start_of_the_tiny_text_encoder_reads_everything_back():
    """Two fresh processes on one cache folder, deviceless: the second plans from the plan cache, reads
    the exported per-call stage instead of tracing it, and compiles with no ptxas (XLA's kernel cache)."""
    from benchmarks.compile import measure_ready, print_ready
    from measure import xla_target

    if xla_target.prepare_target() is not None:
        pytest.skip("the H100 compile target is not installed")
    row = measure_ready("text_encoder", 2, None, "tiny", log=lambda message: None)
    cold, warm = row["cold"], row["warm"]
    assert "error" not in cold and "error" not in warm, (cold.get("error"), warm.get("error"))
    assert (cold["cache"], warm["cache"]) == ("miss", "hit") and cold["kernel_cache"] and warm["kernel_cache"]
    assert "trace" in cold["seconds"] and "read" not in cold["seconds"]
    assert "read" in warm["seconds"] and "trace" not in warm["seconds"]
    assert cold["ptxas_cpu_seconds"] > 0 and warm["ptxas_cpu_seconds"] <= 0.1 * cold["ptxas_cpu_seconds"]
    print_ready([row])


@pytest.mark.slow
def test_one_mosaic_plan_of_the_tiny_text_encoder_compiled_by_both_emitters():
    """`--emitters`: the same plan's per-call stage, compiled cold deviceless by the Mosaic and by the
    Triton templates, launches Mosaic kernels only through the first; every run reports its seconds."""
    from benchmarks.compile import measure_emitters, print_emitters
    from measure import xla_target

    if xla_target.prepare_target() is not None:
        pytest.skip("the H100 compile target is not installed")
    row = measure_emitters("text_encoder", 2, None, "tiny", log=lambda message: None)
    runs = [row[key] for key in ("mosaic", "pallas", "mosaic_again")]
    assert all("error" not in run for run in runs), [run.get("error") for run in runs]
    mosaic, pallas, again = runs
    assert mosaic["planned_kernels"] == pallas["planned_kernels"] == again["planned_kernels"]
    assert mosaic["launched"].get("mosaic_gpu_v2", 0) > 0 and "mosaic_gpu_v2" not in pallas["launched"]
    assert mosaic["launched"] == again["launched"] and mosaic["distinct"] == again["distinct"]
    for run in runs:
        assert 0 < run["distinct"] <= sum(run["launched"].values())
        assert run["lower_seconds"] > 0 and run["compile_seconds"] > 0 and run["cpu_seconds"] > 0
        assert run["cpu_seconds"] == pytest.approx(run["lower_cpu_seconds"] + run["compile_cpu_seconds"], abs=0.05)
    assert pallas["mosaic_lowering"] == {"modules": 0}  # Mosaic lowers nothing for the Triton templates
    for run in (mosaic, again):  # a Mosaic kernel lowered at most once per launch, its phases inside its lowering
        phases = run["mosaic_lowering"]
        assert 0 < phases["modules"] <= run["launched"]["mosaic_gpu_v2"]
        assert 0 < phases["layout_inference"] + phases["dialect_lowering"] + phases["to_dialect"] <= phases["module"]
        assert phases["module"] <= run["lower_cpu_seconds"]
    print_emitters([row])
