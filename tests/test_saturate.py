"""`eqsat.saturate`: limits, reports, user rulesets, the default schedule, and SD 1.5 at full size."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat import rules
from eqsat.egraph import Builder
from eqsat.interpret import evaluate
from eqsat.lift import lift
from eqsat.saturate import LIMITS, SaturationReport, count_nodes, saturate
from eqsat.schedule import DEFAULT_ORDER, Schedule, Stage, as_schedule, default_schedule


def _mlp(x, w1, b1, w2):
    h = x @ w1 + b1
    h = h * jax.nn.sigmoid(h)
    return jnp.tanh(h @ w2) + x.sum(axis=-1, keepdims=True)


def _arguments(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 8), np.float32), rng.standard_normal((8, 6), np.float32),
            rng.standard_normal((6,), np.float32), rng.standard_normal((6, 3), np.float32))


def _built(fn=_mlp, args=None):
    args = _arguments() if args is None else args
    program = lift(fn, *args)
    builder = Builder()
    handles = builder.add(program.outputs)
    return program, builder, handles, args


def _plans_are_right(program, builder, handles, args, fn=_mlp, limit=8):
    graph = rules.SerializedGraph(builder.egraph._serialize().to_json())
    roots = [graph.handle_class[h] for h in handles]
    plans = rules.extractions(graph, roots, limit=limit)
    assert plans
    env = {f"arg{i}": a for i, a in enumerate(jax.tree.leaves(args))}
    expected = jax.tree.leaves(fn(*map(jnp.asarray, args)))
    for plan in plans:
        for got, want in zip(evaluate(plan, env, program.constants, program.payloads), expected):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    return plans


def test_default_schedule_saturates_and_reports():
    program, builder, handles, args = _built()
    before = sum(count_nodes(builder.egraph).values())
    report = saturate(builder.egraph, program=program)
    assert isinstance(report, SaturationReport)
    assert report.saturated and report.limit_reached is None
    assert report.e_nodes > before and report.e_classes > 0
    assert set(report.seconds) == set(default_schedule().names)
    assert report.iterations == len(report.history) and report.rounds >= 1
    assert "saturated" in report.summary()
    _plans_are_right(program, builder, handles, args)


def test_default_schedule_orders_cleanup_before_fusion():
    names = default_schedule().names
    assert names == tuple(name for name in DEFAULT_ORDER if name in rules.registry())
    assert names.index("view_folding") < names.index("absorb")
    assert names.index("functionalize") < names.index("absorb")


@pytest.mark.parametrize(
    "limits, which",
    [(dict(node_limit=1), "node_limit"), (dict(iteration_limit=2), "iteration_limit"),
     (dict(time_limit=0.0), "time_limit")],
)
def test_each_limit_stops_saturation_and_keeps_the_graph(limits, which):
    program, builder, handles, args = _built()
    report = saturate(builder.egraph, **limits)
    assert not report.saturated and report.limit_reached == which and which in LIMITS
    # the graph is still whole: every extraction still computes the function
    _plans_are_right(program, builder, handles, args, limit=4)


def test_a_users_own_rulesets_and_stage_lists():
    program, builder, handles, args = _built()
    absorb = rules.family_ruleset("absorb")
    report = saturate(builder.egraph, absorb)
    assert report.saturated and list(report.seconds) == ["absorb"]
    report = saturate(builder.egraph, [rules.family_ruleset("view_folding"), absorb])
    assert list(report.seconds) == ["view_folding", "absorb"]
    assert report.saturated  # nothing left to do after the first call
    _plans_are_right(program, builder, handles, args)


def test_schedule_values():
    absorb = rules.family_ruleset("absorb")
    assert as_schedule(absorb).stages[0].name == "absorb"
    stage = Stage("mine", absorb, iterations=2)
    assert as_schedule(stage).stages == (stage,)
    both = as_schedule([stage, Schedule((Stage("again", absorb),))])
    assert both.names == ("mine", "again")
    with pytest.raises(TypeError):
        as_schedule(42)


def test_a_schedule_round_cap_is_reported():
    program, builder, handles, args = _built()
    report = saturate(builder.egraph, Schedule((Stage("absorb", rules.family_ruleset("absorb"), iterations=1),),
                                               rounds=1))
    assert report.limit_reached == "rounds" and report.rounds == 1 and report.iterations == 1


def test_seeding_facts_from_the_program():
    """Row scatters are stated from payloads; without `program` that rule has nothing to match."""
    def fn(x, row):
        return x.at[1].set(row) * 2.0

    args = (np.ones((3, 4), np.float32), np.arange(4, dtype=np.float32))
    program, builder, handles, _ = _built(fn, args)
    saturate(builder.egraph, default_schedule(["functionalize", "absorb"]), program=program)
    graph = rules.SerializedGraph(builder.egraph._serialize().to_json())
    plan = rules.min_kernel_plan(graph, [graph.handle_class[h] for h in handles])
    assert [k.op for k in rules.kernel_terms(plan)] == ["Pointwise"]
    _plans_are_right(program, builder, handles, args, fn=fn)


# --- SD 1.5 at full size -------------------------------------------------------------------------------


def test_sd15_unet_full_size_lifts_and_saturates_quickly():
    """The full UNet step (batch 2, 64x64 latents, fp16, ~3,600 primitives) with every default family.

    The budget is 10 s for lift + saturate on two cores; the assertion leaves room for a loaded CI
    machine. Prints seconds, e-nodes and e-classes per stage.
    """
    from sd15 import unet
    from sd15.config import UNetConfig
    from sd15.params import abstract_params

    config = UNetConfig()
    params = abstract_params("unet", config, dtype=jnp.float16)
    sample = jax.ShapeDtypeStruct((2, 4, 64, 64), jnp.float16)
    timestep = jax.ShapeDtypeStruct((), jnp.float32)
    context = jax.ShapeDtypeStruct((2, 77, 768), jnp.float16)
    started = time.perf_counter()
    program = lift(lambda p, s, t, c: unet.apply(p, config, s, t, c), params, sample, timestep, context)
    lifted = time.perf_counter()
    builder = Builder()
    builder.add(program.outputs)
    built = time.perf_counter()
    report = saturate(builder.egraph, program=program, time_limit=60.0)
    done = time.perf_counter()
    print(f"\nSD 1.5 UNet: {program.naive_kernel_count()} naive kernels; lift {lifted - started:.2f}s, "
          f"build {built - lifted:.2f}s, saturate {done - built:.2f}s; {report.summary()}")
    assert program.naive_kernel_count() > 3000
    assert report.saturated, report.summary()
    assert report.e_nodes < 200_000
    assert done - started < 30.0
