"""`sd15 plan` end to end on the tiny configs (the full-size run lives in benchmarks/sd15_plan.py)."""

from __future__ import annotations

import argparse
import json
import types

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

from measure import compare, xla_target
from sd15 import plan_cli
from sd15 import workloads as sd15_workloads


def run_cli(argv, capsys) -> str:
    """`sd15 <argv>` through the sd15 CLI when it is there, else through plan_cli's own main."""
    try:
        from sd15.cli import main
    except ImportError:
        main = plan_cli.main
    assert main(argv) == 0
    return capsys.readouterr().out


def test_plan_json_on_the_tiny_config_has_every_key(capsys):
    report = json.loads(run_cli(["plan", "--json", "--config", "tiny", "--no-emit"], capsys))
    assert set(report["components"]) == {"unet", "vae", "text_encoder"}
    assert report["config"] == "tiny" and report["batch"] == 2 and report["dtype"] == "float16"
    xla_expected = xla_target.unavailable_reason() is None
    assert report["xla_available"] == xla_expected
    for name, row in report["components"].items():
        for key in compare.KEYS:
            assert key in row, (name, key)
        if xla_expected:
            assert isinstance(row["xla_kernels"], int) and row["xla_kernels"] > 0, (name, row)
            assert row["xla_temp_bytes"] >= 0 and row["xla_bytes"] > 0
            assert row["xla_bytes_source"]
        else:
            assert row["xla_kernels"] is None
        if row["fused_kernels"] is not None:  # the optimizer ran: our plan is no bigger than naive
            assert 0 < row["fused_kernels"] <= row["naive_kernels"], (name, row)
            # the weights are marked as parameters: every kernel is either per call or prepared
            assert row["planned_kernels"] + row["prepared_kernels"] >= row["fused_kernels"], (name, row)
            assert 0 < row["planned_kernels"] <= row["fused_kernels"], (name, row)
        assert row["emitted_kernels"] is None and row["emit_compile_seconds"] is None
    assert any("emitted columns are empty: emitted compile skipped (--no-emit)" in note for note in report["notes"])
    assert report["errors"] == []
    if not xla_expected:
        assert any("XLA columns are empty" in note for note in report["notes"])


@pytest.mark.skipif(xla_target.unavailable_reason() is not None, reason=str(xla_target.unavailable_reason()))
def test_emitted_columns_on_the_tiny_text_encoder(capsys):
    """Our per-call executable compiled for an H100: its launches are accounted for kernel by kernel."""
    report = json.loads(run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-xla"],
                                capsys))
    row = report["components"]["text_encoder"]
    assert report["errors"] == [] and "emit_error" not in row
    assert row["prepared_kernels"] >= 1  # the QKV weight concatenations
    non_pallas = [launch for launch in row["emitted_non_pallas"] if launch["category"] not in ("copy", "memset")]
    assert row["emitted_kernels"] == row["emitted_pallas_kernels"] + len(non_pallas)
    assert sum(row["emitted_kernels_by_category"].values()) == row["emitted_kernels"]
    assert row["emitted_missing"] == []  # every planned kernel is a Pallas launch
    assert row["emitted_pallas_kernels"] == row["planned_kernels"] + len(row["emitted_extra"])
    assert row["emitted_memsets"] >= 0 and row["emitted_copies"] >= 0 and row["emitted_temp_bytes"] > 0
    assert row["emit_compile_seconds"] > 0 and row["emit_cpu_seconds"] > 0
    assert row["winner_kernels"] is None  # no XLA column to compare with


@pytest.mark.slow
@pytest.mark.skipif(xla_target.unavailable_reason() is not None, reason=str(xla_target.unavailable_reason()))
def test_the_mosaic_backend_compiles_for_an_h100_and_counts_its_mosaic_kernels(capsys):
    """`--backend mosaic`: the tiny text encoder's matmuls as Mosaic GPU kernels, the rest Triton,
    every planned kernel launched; compiled for the GPU, not interpreted (the interpret branch would
    not lower for CUDA)."""
    report = json.loads(run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-xla",
                                 "--backend", "mosaic"], capsys))
    row = report["components"]["text_encoder"]
    assert report["backend"] == "mosaic" and "backend mosaic" in report["title"]
    assert report["errors"] == [] and "emit_error" not in row
    assert row["emitted_mosaic_kernels"] > 0 and row["emitted_triton_kernels"] > 0
    assert row["emitted_mosaic_kernels"] + row["emitted_triton_kernels"] == row["emitted_pallas_kernels"]
    assert row["emitted_missing"] == []


def _launch(name, scope, category="Pallas (Triton)", counted="kernel"):
    return xla_target.Launch(0, "kCustomKernel", name, category, counted, False, 0, scope, False)


def test_emitted_launches_are_matched_to_plan_kernels(tmp_path):
    """Pallas launches by their Triton kernel name (from the optimized HLO), else by named scope."""
    launches = (
        _launch("pallas_call.1", "down.0:conv/cond/branch_0_fun/down.0:conv"),
        _launch("pallas_call.2", "down.0:conv"),  # a second conv of the same component
        _launch("loop_pad_fusion", "down.0:conv", category="loop fusion"),  # XLA work around it
        _launch("pallas_call.3", "down.0:conv/cond/branch_0_fun"),  # a statistic left to the driver
        _launch("while", "", counted="none", category="none"),
        _launch("memset", "", counted="memset", category="memset"),
    )
    (tmp_path / "module.sm_9.0a_gpu_after_optimizations.txt").write_text(
        '  %pallas_call.3 = f32[128]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={debug = false, grid_x = 64 : i32, name = "down.0_reduce", num_stages = 2 : i32}\n'
        '  ROOT %pallas_call.2 = f16[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={name = "down.0_conv"}\n'
        '  %gemm = f16[8]{0} custom-call(%p), custom_call_target="__cublas$gemm", backend_config={name = "x"}\n')
    names = compare.triton_kernel_names(tmp_path)
    assert names == {"pallas_call.3": "down.0_reduce", "pallas_call.2": "down.0_conv"}
    report = types.SimpleNamespace(launches=launches, by_category={"Pallas (Triton)": 3, "loop fusion": 1})
    found = compare.emitted_against_plan(report, ["down.0:conv", "down.0:conv", "mid:matmul"], names)
    assert found["emitted_pallas_kernels"] == 3
    assert found["emitted_missing"] == ["mid:matmul"]
    assert found["emitted_extra"] == ["down.0_reduce"]
    assert [(launch["name"], launch["kernel"]) for launch in found["emitted_non_pallas"]] == [
        ("loop_pad_fusion", "down.0:conv"), ("memset", None)]


def test_failing_kernel_is_named_by_its_longest_match():
    names = ["up.1:conv", "up.1.resnets.0:conv", "mid:matmul"]
    assert compare._failing_kernel("triton failed in up_1_resnets_0_conv: out of shared memory", names) == \
        "up.1.resnets.0:conv"
    assert compare._failing_kernel("error at up.1:conv (pallas_call.7)", names) == "up.1:conv"
    assert compare._failing_kernel("segfault", names) is None


def test_a_kernel_that_fails_to_compile_is_an_error_naming_it(monkeypatch, capsys):
    """The row stays, with `emit_error` naming the kernel; the report lists it and the command exits 1."""
    class Lowered:
        stats = {"naive_kernels": 50, "fused_kernels": 7, "per_call_kernels": 6, "prepared_kernels": 1}
        split = None

    class Optimized:
        def lower(self, *args):
            return Lowered()

    def compile_for_h100(fn, *args, **options):
        raise RuntimeError("compiling for H100 failed:\nTraceback ...\nValueError: Triton compile of "
                           "text_model_encoder_layers_0_mlp_fc1_matmul: shared memory 300000 > 232448")

    def optimize(fn, device="h100", progress=None):
        return Optimized()

    monkeypatch.setattr(compare, "_load_optimize", lambda: (optimize, None))
    monkeypatch.setattr(compare, "planned_kernel_names",
                        lambda lowered: ["text_model.encoder.layers.0.mlp.fc1:matmul", "text_model:gather"])
    monkeypatch.setattr(xla_target, "unavailable_reason", lambda: None)
    monkeypatch.setattr(xla_target, "compile_for_h100", compile_for_h100)
    try:
        from sd15.cli import main
    except ImportError:
        main = plan_cli.main
    argv = ["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-xla"]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    row = report["components"]["text_encoder"]
    assert row["fused_kernels"] == 7 and row["planned_kernels"] == 6 and row["emitted_kernels"] is None
    assert "kernel text_model.encoder.layers.0.mlp.fc1:matmul failed to compile for sm_90" in row["emit_error"]
    assert "shared memory 300000" in row["emit_error"]
    assert row["emit_error"].startswith("text_encoder: ") and report["errors"] == [row["emit_error"]]


def test_missing_cuda_plugin_leaves_xla_fields_null_and_says_so(no_cuda_target, capsys):
    report = json.loads(
        run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-optimize"], capsys)
    )
    row = report["components"]["text_encoder"]
    assert report["xla_available"] is False
    assert row["xla_kernels"] is None and row["xla_temp_bytes"] is None
    assert any("could not install" in note and "no index reachable" in note for note in report["notes"])


def test_workloads_trace_with_abstract_parameters():
    work = sd15_workloads.workloads(batch=4, config="tiny")
    unet = work["unet"]
    latents = unet.args[1]
    assert latents.shape == (2, 4, 8, 8) and latents.dtype == jnp.float32  # 4 = [uncond, cond] x 2 images
    assert unet.args[3].shape[0] == 4
    out = jax.eval_shape(unet.fn, *unet.args)
    assert out.shape == latents.shape
    assert jax.eval_shape(work["vae"].fn, *work["vae"].args).shape == (2, 3, 16, 16)
    assert jax.eval_shape(work["text_encoder"].fn, *work["text_encoder"].args).shape == (4, 77, 32)
    with pytest.raises(ValueError, match="even"):
        sd15_workloads.workloads(batch=3, config="tiny")


def test_table_shows_where_xla_is_better():
    row = {key: None for key in compare.KEYS}
    row.update(
        description="a component", naive_kernels=100, fused_kernels=40, planned_kernels=40, xla_kernels=30,
        plan_bytes=2**30, xla_bytes=2**31, plan_peak_bytes=2**20, xla_temp_bytes=2**21,
        optimize_seconds={"lift": 1.0, "saturate": 2.0}, optimize_wall_seconds=3.04, xla_compile_seconds=1.5,
        emit_compile_seconds=15.0,
    )
    row["winner_kernels"] = compare._winner(compare.our_kernels(row), row["xla_kernels"])
    row["winner_bytes"] = compare._winner(row["plan_bytes"], row["xla_bytes"])
    row["winner_memory"] = compare._winner(compare.our_memory(row), row["xla_temp_bytes"])
    report = {
        "config": "full", "size": 512, "dtype": "float16", "batch": 2, "device": "h100", "notes": [],
        "components": {"unet": row},
    }
    console = Console(record=True, width=200)
    plan_cli.render(report, console)
    text = console.export_text()
    assert "XLA better by 10 (1.3x)" in text
    assert "eqsat better by 1.00 GiB (2.0x)" in text
    assert "XLA better by 13.5 s (10.0x)" in text  # compile time: our losses are rows too
    assert "3.0 s" in text and "optimizer stages: lift 1.0 s, saturate 2.0 s" in text
    assert "SD 1.5 kernel plans: UNet CFG step (full config" in text and "VAE" not in text.splitlines()[0]
    lines = text.splitlines()
    assert any("naive kernels" in line and "counted" in line for line in lines)
    assert any("HBM bytes" in line and "modeled" in line for line in lines)
    assert any("eqsat optimize" in line and "measured" in line for line in lines)
    assert "prepared: kernels that read only the weights" in text and "statistics in epilogues:" in text


def test_footnotes_wrap_to_the_console_with_their_indent():
    row = {key: None for key in compare.KEYS}
    row.update(description="a component " * 12, winner_kernels=None, winner_bytes=None, winner_memory=None)
    report = {"config": "tiny", "size": 16, "dtype": "float16", "batch": 2, "device": "h100", "notes": [],
              "components": {"text_encoder": row}}
    console = Console(record=True, width=72)
    plan_cli.render(report, console)
    text = console.export_text()
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "text_encoder: a component" in line)
    footnote_lines = lines[first:]
    assert all(len(line) <= 72 for line in footnote_lines)
    assert all(line.startswith("  ") for line in footnote_lines if line.strip())


def test_plan_command_is_registered_with_its_options():
    parser = argparse.ArgumentParser()
    plan_cli.add_plan_command(parser.add_subparsers(dest="command"))
    options = parser.parse_args(["plan", "--components", "unet,vae", "--batch", "4", "--size", "256"])
    assert options.components == ("unet", "vae") and options.batch == 4 and options.size == 256
    assert options.func is plan_cli.plan_command and options.xla and options.optimize
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--components", "unet,clip"])


def test_optimizer_stats_reach_the_report(monkeypatch, capsys):
    """The plumbing from `eqsat.optimize(fn).lower(*args).stats` to the JSON, with a stand-in optimizer."""
    seen = []

    class Lowered:
        stats = {
            "naive_kernels": 50, "fused_kernels": 7, "plan_bytes": 1000, "plan_peak_bytes": 100,
            "seconds": {"lift": 0.5, "saturate": 1.0, "extract": 0.25}, "extractor": "greedy",
            "saturated": False, "limit_reached": "node_limit",
        }

    def optimize(fn, device="h100", progress=None):
        seen.append(device)

        class Optimized:
            def lower(self, *args):
                seen.append(jax.eval_shape(fn, *args).shape)
                return Lowered()

        return Optimized()

    monkeypatch.setattr(compare, "_load_optimize", lambda: (optimize, None))
    report = json.loads(
        run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-xla", "--no-emit"], capsys)
    )
    row = report["components"]["text_encoder"]
    assert seen == ["h100", (2, 77, 32)]
    assert row["naive_kernels"] == 50 and row["fused_kernels"] == 7
    assert row["plan_bytes"] == 1000 and row["plan_peak_bytes"] == 100
    assert row["optimize_seconds"] == {"lift": 0.5, "saturate": 1.0, "extract": 0.25}
    assert row["extractor"] == "greedy" and row["limit_reached"] == "node_limit"
    assert row["xla_kernels"] is None and row["winner_kernels"] is None


def test_long_compiles_show_a_ticking_status_on_a_terminal_only(monkeypatch, capsys):
    import sys
    import time

    with compare.waiting("compiling", every=0.01):  # not a terminal: nothing printed
        time.sleep(0.05)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    updates = []
    monkeypatch.setattr("rich.status.Status.update", lambda self, text: updates.append(text))
    with compare.waiting("compiling", every=0.01):
        time.sleep(0.1)
    assert updates and all(text.startswith("compiling (") and text.endswith(" s)") for text in updates)
