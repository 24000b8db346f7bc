"""benchmarks.calibration: measured launches joined to plan kernels by name, per kernel and per kind."""

import pytest

from benchmarks import calibration


def test_trace_names_are_the_pallas_names_with_every_separator_an_underscore():
    assert calibration.trace_name("up_blocks.0.resnets.1.conv1:conv") == "up_blocks_0_resnets_1_conv1_conv"
    assert calibration.base_name("text_model_encoder_layers_6_matmul__1") == "text_model_encoder_layers_6_matmul"
    assert calibration.base_name("mid_block_conv") == "mid_block_conv"


def test_kernels_sharing_a_name_are_compared_as_one_row_and_unplanned_launches_are_kept():
    planned = [
        {"name": "a.attn1:matmul", "kind": "matmul", "seconds": 1e-5},
        {"name": "a.attn1:matmul", "kind": "matmul", "seconds": 3e-5},
        {"name": "a.attn1:attention", "kind": "attention", "seconds": 2e-5},
        {"name": "b:pointwise", "kind": "pointwise", "seconds": 1e-6},   # planned, never seen in the trace
    ]
    measured = {"a_attn1_matmul": 1e-4, "a_attn1_matmul__1": 3e-4, "a_attn1_attention": 2e-5,
                "loop_convert_fusion": 5e-6}
    rows = {row["name"]: row for row in calibration.join(planned, measured)}
    matmul = rows["a.attn1:matmul"]
    assert (matmul["kernels"], matmul["launches"]) == (2, 2)
    assert matmul["measured_seconds"] == pytest.approx(4e-4) and matmul["modeled_seconds"] == pytest.approx(4e-5)
    assert matmul["ratio"] == pytest.approx(10.0)
    assert rows["a.attn1:attention"]["ratio"] == pytest.approx(1.0)
    assert rows["b:pointwise"]["launches"] == 0 and rows["b:pointwise"]["ratio"] == 0.0
    unplanned = rows["loop_convert_fusion"]
    assert unplanned["kind"] == "not planned" and unplanned["modeled_seconds"] is None and unplanned["ratio"] is None

    kinds = {row["kind"]: row for row in calibration.by_kind(rows.values())}
    assert kinds["matmul"]["ratio"] == pytest.approx(10.0)
    assert kinds["not planned"]["measured_seconds"] == pytest.approx(5e-6) and kinds["not planned"]["ratio"] is None
    assert sum(k["launches"] for k in kinds.values()) == len(measured)


def test_the_plan_side_reads_the_per_call_plan_of_a_lowering():
    import jax
    import jax.numpy as jnp

    import eqsat

    def f(w, x):
        return jax.nn.relu(x @ w) * 2.0

    args = (jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((16, 64), jnp.float32))
    lowered = eqsat.optimize(f, params_argnums=0, progress=False).lower(*args)
    planned = calibration.plan_kernels(lowered)
    assert [k["kind"] for k in planned] == [k.kind for k in lowered.split.per_call.kernels]
    assert all(k["seconds"] > 0 for k in planned)


def test_fit_recovers_the_constants_that_made_the_times():
    """Times made by known constants (shared memory and ALU factors, per-template MMA factor and
    serial-step time) are fitted back to them; a resource the data says runs faster than its data
    sheet is held at 1."""
    import random

    truth = {"memory": 1.5, "alu": 3.0, "matmul": (6.0, 3e-7), "conv": (4.0, 6e-7)}
    rng = random.Random(0)
    samples = []
    for _ in range(60):
        template = rng.choice(["matmul", "conv"])
        features = {"memory": rng.uniform(1e-6, 5e-5), "alu": rng.uniform(0, 2e-5),
                    "mma": rng.uniform(1e-6, 1e-4), "serial": float(rng.randint(4, 400))}
        mma, serial = truth[template]
        seconds = 4e-6 + truth["memory"] * features["memory"] + truth["alu"] * features["alu"] \
            + mma * features["mma"] + serial * features["serial"]
        samples.append((template, features, 4e-6, seconds))
    fitted = calibration.fit(samples)
    assert fitted.memory == pytest.approx(1.5, rel=1e-6) and fitted.alu == pytest.approx(3.0, rel=1e-6)
    for template in ("matmul", "conv"):
        assert fitted.templates[template].mma == pytest.approx(truth[template][0], rel=1e-6)
        assert fitted.templates[template].serial == pytest.approx(truth[template][1], rel=1e-6)
    slow = [(t, f, launch, launch + 0.5 * f["memory"] + f["mma"]) for t, f, launch, _ in samples]
    assert calibration.fit(slow).memory == pytest.approx(1.0)  # never faster than the data sheet
