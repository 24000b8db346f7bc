"""`sd15 plan` end to end on the tiny configs (the full-size run lives in benchmarks/sd15_plan.py)."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

from eqsat import xla_target
from sd15 import plan_cli


def run_cli(argv, capsys) -> str:
    """`sd15 <argv>` through the sd15 CLI when it is there, else through plan_cli's own main."""
    try:
        from sd15.cli import main
    except ImportError:
        main = plan_cli.main
    assert main(argv) == 0
    return capsys.readouterr().out


def test_plan_json_on_the_tiny_config_has_every_key(capsys):
    report = json.loads(run_cli(["plan", "--json", "--config", "tiny"], capsys))
    assert set(report["components"]) == {"unet", "vae", "text_encoder"}
    assert report["config"] == "tiny" and report["batch"] == 2 and report["dtype"] == "float16"
    xla_expected = xla_target.unavailable_reason() is None
    assert report["xla_available"] == xla_expected
    for name, row in report["components"].items():
        for key in plan_cli.KEYS:
            assert key in row, (name, key)
        if xla_expected:
            assert isinstance(row["xla_kernels"], int) and row["xla_kernels"] > 0, (name, row)
            assert row["xla_temp_bytes"] >= 0 and row["xla_bytes"] > 0
            assert row["xla_bytes_source"]
        else:
            assert row["xla_kernels"] is None
        if row["fused_kernels"] is not None:  # the optimizer ran: our plan is no bigger than naive
            assert 0 < row["fused_kernels"] <= row["naive_kernels"], (name, row)
    if not xla_expected:
        assert any("XLA columns are empty" in note for note in report["notes"])


def test_missing_cuda_plugin_leaves_xla_fields_null_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(xla_target, "PLUGIN_MODULES", ("jax_plugins.no_such_cuda_plugin",))
    report = json.loads(
        run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-optimize"], capsys)
    )
    row = report["components"]["text_encoder"]
    assert report["xla_available"] is False
    assert row["xla_kernels"] is None and row["xla_temp_bytes"] is None
    assert any("not installed" in note and "cuda-target" in note for note in report["notes"])


def test_workloads_trace_with_abstract_parameters():
    work = plan_cli.workloads(batch=4, config="tiny")
    unet = work["unet"]
    latents = unet.args[1]
    assert latents.shape == (2, 4, 8, 8) and latents.dtype == jnp.float32  # 4 = [uncond, cond] x 2 images
    assert unet.args[3].shape[0] == 4
    out = jax.eval_shape(unet.fn, *unet.args)
    assert out.shape == latents.shape
    assert jax.eval_shape(work["vae"].fn, *work["vae"].args).shape == (2, 3, 16, 16)
    assert jax.eval_shape(work["text_encoder"].fn, *work["text_encoder"].args).shape == (4, 77, 32)
    with pytest.raises(ValueError, match="even"):
        plan_cli.workloads(batch=3, config="tiny")


def test_table_shows_where_xla_is_better():
    row = {key: None for key in plan_cli.KEYS}
    row.update(
        description="a component", naive_kernels=100, fused_kernels=40, xla_kernels=30,
        plan_bytes=2**30, xla_bytes=2**31, plan_peak_bytes=2**20, xla_temp_bytes=2**21,
        optimize_seconds={"lift": 1.0, "saturate": 2.0}, xla_compile_seconds=1.5,
    )
    row["winner_kernels"] = plan_cli._winner(row["fused_kernels"], row["xla_kernels"])
    row["winner_bytes"] = plan_cli._winner(row["plan_bytes"], row["xla_bytes"])
    row["winner_memory"] = plan_cli._winner(row["plan_peak_bytes"], row["xla_temp_bytes"])
    report = {
        "config": "full", "size": 512, "dtype": "float16", "batch": 2, "device": "h100", "notes": [],
        "components": {"unet": row},
    }
    console = Console(record=True, width=200)
    plan_cli.render(report, console)
    text = console.export_text()
    assert "XLA better by 10" in text
    assert "eqsat better by 1.00 GiB" in text
    assert "3.0 s" in text and "optimizer stages: lift 1.0 s, saturate 2.0 s" in text


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

    monkeypatch.setattr(plan_cli, "_load_optimize", lambda: (optimize, None))
    report = json.loads(
        run_cli(["plan", "--json", "--config", "tiny", "--components", "text_encoder", "--no-xla"], capsys)
    )
    row = report["components"]["text_encoder"]
    assert seen == ["h100", (2, 77, 32)]
    assert row["naive_kernels"] == 50 and row["fused_kernels"] == 7
    assert row["plan_bytes"] == 1000 and row["plan_peak_bytes"] == 100
    assert row["optimize_seconds"] == {"lift": 0.5, "saturate": 1.0, "extract": 0.25}
    assert row["extractor"] == "greedy" and row["limit_reached"] == "node_limit"
    assert row["xla_kernels"] is None and row["winner_kernels"] is None
