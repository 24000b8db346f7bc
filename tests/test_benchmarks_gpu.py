"""`python -m benchmarks.gpu` on a machine without a GPU: the tiny model through the same harness,
Pallas in interpret mode, against jax.jit."""

import json

import pytest

from benchmarks import gpu


@pytest.mark.skipif(gpu.has_gpu(), reason="this machine has a GPU: the harness would run the full-size model")
def test_without_a_gpu_the_harness_runs_the_tiny_text_encoder_in_interpret_mode(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    status = gpu.main(["--components", "text_encoder", "--iters", "2", "--warmup", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    assert printed.splitlines()[0].startswith("no GPU here: running the tiny model")
    report = json.loads(out.read_text())
    assert report["config"] == "tiny" and "interpret" in report["mode"]
    assert [(row["component"], row["backend"]) for row in report["components"]] == [
        ("text_encoder", "pallas"), ("text_encoder", "hybrid")]
    for row in report["components"]:
        assert row["ours_ms"] > 0 and row["xla_ms"] > 0
        assert row["speedup"] == pytest.approx(row["xla_ms"] / row["ours_ms"])
        # The emitted kernels compute what jax.jit computes (float32 tiny model).
        assert row["max_rel_error"] < 1e-4
        # No device trace on a CPU: the device columns say so instead of inventing numbers.
        assert row["ours_device_ms"] is None and row["xla_kernels"] is None
        assert row["ours_modeled_ms"] > 0


@pytest.mark.parametrize("argv", [["--components", "unet,decoder"], ["--backends", "pallas,triton"]])
def test_unknown_components_or_backends_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        gpu.main(argv)
