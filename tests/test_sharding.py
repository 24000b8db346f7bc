"""Optimized functions on 4 forced host CPU devices give `jax.jit`'s values and output shardings.

The cases, the ways of calling them and what is measured are `benchmarks.sharding`'s. JAX fixes
its device count when its backend starts, so on the usual single-device session the one test here
runs this file again in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=4`;
there, every (case, backend, call, mesh) is its own test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FOUR_DEVICES = "--xla_force_host_platform_device_count=4"

if FOUR_DEVICES not in os.environ.get("XLA_FLAGS", ""):

    def test_on_four_host_devices():
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FOUR_DEVICES}".strip()}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                                cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                                timeout=1800)
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]

else:
    import jax
    import pytest

    from benchmarks import sharding

    ROWS = [(case, backend, mode, mesh) for case in sharding.CASES for backend in ("xla", "pallas")
            for mode in sharding.modes(case) for mesh in case.meshes]

    def test_four_devices():
        assert jax.device_count() == 4

    @pytest.mark.parametrize("case, backend, mode, mesh", ROWS,
                             ids=[f"{c.name}-{b}-{m}-{k}" for c, b, m, k in ROWS])
    def test_matches_jit(case, backend, mode, mesh):
        row = sharding.run(case, backend, mode, mesh)
        assert row["max_abs_diff"] <= 2e-5 * max(1.0, row["max_abs_ref"]), row
        assert row["same_sharding"], row
        if case.batch_sharded:  # each device computed its shard only: no activation gathered, nothing added
            assert row["hlo"]["all-gather"] == 0, row
            assert row["plan_collectives"] == [], row
        elif backend == "pallas":  # the contracted axis is gathered before the kernel, once per operand
            assert [c.split()[0] for c in row["plan_collectives"]] == ["all-gather", "all-gather"], row
            assert row["hlo"]["all-gather"] >= 1, row
        if backend == "pallas":
            assert len(row["partitionings"]) == (0 if mode == "shard_map" else 1), row

    def test_tiny_pipeline_on_four_devices_equals_one_device():
        import numpy as np

        from sd15.pipeline import Pipeline

        prompts = ["a red cube", "a blue ball", "", "a green cone"]
        options = dict(num_inference_steps=2, height=16, width=16, seed=3, progress=False)
        one = Pipeline.tiny()
        expected = one.generate_batch(prompts, **options)
        four = Pipeline(one.unet, one.vae, one.text_encoder, one.tokenizer, one.scheduler, devices=4)
        images = four.generate_batch(prompts, **options)
        assert images.shape == (4, 16, 16, 3)
        assert np.abs(images - expected).max() <= 1e-5  # plans for batch 4 and batch 1 round alike
        assert min(np.abs(images[i] - images[j]).max() for i in range(4) for j in range(i)) > 1e-2
        assert all(len(leaf.sharding.device_set) == 4 for leaf in jax.tree_util.tree_leaves(four.unet.params))
        with pytest.raises(ValueError, match="do not split over 4 devices"):
            four.generate_batch(prompts[:3], **options)

    def test_cli_batch_over_devices(tmp_path, capsys):
        from sd15 import cli

        out = tmp_path / "tiny.png"
        argv = ["generate", "--tiny", "--prompt", "a red cube", "--steps", "1", "--size", "16", "--batch", "4",
                "--devices", "4", "--no-optimize", "--out", str(out)]
        assert cli.main(argv) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"tiny-{i}.png" for i in range(4)]
