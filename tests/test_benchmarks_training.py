"""`python -m benchmarks.training --tiny`: the fine-tuning step of the tiny UNet, ours (planned forward
and backward, emitted) against jax.jit's, both compiled for an H100 (the full-size run is the
benchmark's default)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import training
from measure import xla_target


def test_tiny_training_step_plans_a_fused_forward_and_backward(capsys):
    """`--no-compile`: the two plans only (the compiled comparison below takes ~10 minutes on 2 cores)."""
    assert training.main(["--tiny", "--json", "--no-compile"]) == 0
    report = json.loads(capsys.readouterr().out)
    plans = report["plans"]
    assert 0 < plans["forward_plan_kernels"] < plans["forward_naive_kernels"]
    assert 0 < plans["backward_plan_kernels"] < plans["backward_naive_kernels"]
    assert plans["residual_outputs"] > 0 and plans["residual_bytes"] > 0
    assert "conv" in plans["backward_kinds"] and "conv" in plans["forward_kinds"]
    assert report["ours"] is None and report["xla"] is None and "--no-compile" in report["unavailable"]
    assert "compiled columns empty: compiles skipped (--no-compile)" in training.table(report)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EQSAT_LONG_TESTS"),
                    reason="~10 min on 2 cores (a deviceless compile of ~800 Triton kernels): EQSAT_LONG_TESTS=1 runs it")
@pytest.mark.skipif(xla_target.unavailable_reason() is not None, reason=str(xla_target.unavailable_reason()))
def test_tiny_training_step_report(capsys):
    assert training.main(["--tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["config"], report["batch"], report["latent"], report["dtype"]) == ("tiny", 2, 8, "float16")
    assert report["ours_error"] is None and report["backend"] == "pallas"
    plans, ours, theirs = report["plans"], report["ours"], report["xla"]
    # The backward is planned from the forward's residuals, and both fuse.
    assert 0 < plans["forward_plan_kernels"] < plans["forward_naive_kernels"]
    assert 0 < plans["backward_plan_kernels"] < plans["backward_naive_kernels"]
    assert plans["residual_outputs"] > 0 and plans["residual_bytes"] > 0
    assert "conv" in plans["backward_kinds"] and "conv" in plans["forward_kinds"]
    for side in (ours, theirs):
        assert set(side) >= {"kernels", "copies", "memsets", "temp_bytes", "compile_seconds", "kernels_by_category"}
        assert side["kernels"] == sum(side["kernels_by_category"].values()) > 0
    # Each Pallas launch is one planned kernel (identical kernels share a compiled body, each
    # launches); the planned kernels no template covers (transposed and grouped convs of the
    # backward, opaque ops) run through XLA and are launched as cuDNN convs, gemms or fusions.
    pallas = ours["kernels_by_category"].get("Pallas (Triton)", 0)
    assert 0.5 * (plans["forward_plan_kernels"] + plans["backward_plan_kernels"]) < pallas
    assert pallas <= plans["forward_plan_kernels"] + plans["backward_plan_kernels"]
    assert ours["kernels"] > pallas  # the fallbacks
    assert report["fewer_kernels"] == (ours["kernels"] < theirs["kernels"])
    assert report["temp_no_larger"] == (ours["temp_bytes"] <= theirs["temp_bytes"])
    table = training.table(report)
    assert "ours" in table and "jax.jit" in table and f"{ours['kernels']}" in table


def test_the_step_traces_with_abstract_parameters():
    config = training.UNetConfig.tiny()
    args = training.step_arguments(config, batch=2, latent=8, dtype=training.jnp.float16)
    loss, grads = training.jax.eval_shape(training.jax.value_and_grad(
        training.functools.partial(training.noise_prediction_loss, config=config)), *args)
    assert loss.shape == () and loss.dtype == training.jnp.float32
    assert training.jax.tree_util.tree_structure(grads) == training.jax.tree_util.tree_structure(args[0])
