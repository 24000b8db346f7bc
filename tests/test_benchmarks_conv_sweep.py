"""`python -m benchmarks.conv_sweep` without a GPU: the tiny shape, each config emitted and checked."""

import json

import pytest

from benchmarks import conv_sweep


def test_without_a_gpu_the_sweep_times_each_config_of_the_tiny_conv(tmp_path, capsys):
    import jax

    try:
        if jax.devices("gpu"):
            pytest.skip("this machine has a GPU: the sweep would run the full-size shapes")
    except RuntimeError:
        pass
    out = tmp_path / "sweep.json"
    assert conv_sweep.main(["--configs", "3", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("no GPU here")
    (row,) = json.loads(out.read_text())["shapes"]
    assert row["plan"] == ["reduce", "conv"]  # GroupNorm's statistics, then the conv with GN+SiLU in its prologue
    assert [r["config"] for r in row["configs"]][0] == "default" and len(row["configs"]) == 3
    for result in row["configs"]:
        assert result["max_rel_error"] < 1e-5, result
    assert row["best_seconds"] == min(r["seconds"] for r in row["configs"])


def test_a_forced_config_reaches_the_template_and_is_undone():
    from emit.pallas.conv import ConvConfig
    from eqsat.cost import mma

    original = mma.conv_config
    forced = ConvConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2, block_w=16)
    with conv_sweep.forced_conv_config(forced):
        assert mma.conv_config(None) is forced
    assert mma.conv_config is original
