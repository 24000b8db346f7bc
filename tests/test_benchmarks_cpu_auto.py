"""`benchmarks.cpu_auto`: its programs have the shapes they say, and a row prints any record."""

from __future__ import annotations

import jax
import pytest

from benchmarks import cpu_auto

SHAPES = {"resnet_block": (2, 32, 32, 128), "mlp_layernorm": (2, 256, 320), "resnet18": (1, 1000),
          "unet_tiny": (2, 4, 32, 32), "vae_tiny": (1, 3, 64, 64)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_program_traces_to_its_output_shape(name):
    case = next(case for case in cpu_auto.cases() if case.name == name)
    assert jax.eval_shape(case.fn, *case.args).shape == SHAPES[name]


def test_a_row_says_what_auto_chose_or_why_it_did_not_time():
    assert cpu_auto._chose(None) == "-"
    assert cpu_auto._chose({"chose": "jit", "plan_s": 2e-3, "jit_s": 1e-3, "calls": 10}) == "jit (plan 2.00 ms, jit 1.00 ms)"
    assert "effects" in cpu_auto._chose({"chose": "plan", "plan_s": None, "jit_s": None, "calls": 0,
                                         "why": "the function has effects"})
