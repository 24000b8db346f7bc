"""Random JAX programs from a small grammar, saturated with the default schedule: every extraction
(random acyclic plans, and one forcing each alternative e-node) computes what the program does.

The grammar keeps a pool of values and applies random steps: elementwise unary/binary ops,
reductions (broadcast back), views (transpose, reshape round trips, slices), matmuls with a
weight, concat-then-slice, writes through a JAX ref, and a normalization (jnp.var). Inputs are drawn
centred, offset far from zero against their spread, or constant along rows: the values real
normalizations see, and the ones a cancelling variance gets wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eqsat import rules
from eqsat.egraph import Builder
from eqsat.interpret import evaluate
from eqsat.lift import lift
from eqsat.saturate import saturate

STEPS = ("unary", "binary", "reduce", "transpose", "reshape", "slice", "matmul", "concat", "ref", "norm")
REGIMES = ("centred", "offset", "constant")


def _apply(step: str, choice: int, pool: list, weight):
    """One grammar step on the pool (all values [m, n] so that any two combine)."""
    x = pool[choice % len(pool)]
    y = pool[(choice // 7) % len(pool)]
    if step == "unary":
        return [jnp.exp(-jnp.abs(x)), jnp.tanh(x), jax.nn.sigmoid(x), x * 0.5 + 1.0][choice % 4]
    if step == "binary":
        return [x + y, x * y, x - y, jnp.maximum(x, y)][choice % 4]
    if step == "reduce":
        return [x - jnp.mean(x, axis=-1, keepdims=True), x / (1.0 + jnp.sum(x * x, axis=0, keepdims=True)),
                x - jnp.max(x, axis=-1, keepdims=True)][choice % 3]
    if step == "transpose":
        return x.T.T + y if x.shape[0] != x.shape[1] else x.T + y
    if step == "reshape":
        return x.reshape(-1).reshape(x.shape) * 2.0
    if step == "slice":
        m = x.shape[0]
        return jnp.concatenate([x[1:], x[:1]], axis=0) if m > 1 else -x
    if step == "matmul":
        return x @ weight
    if step == "concat":
        z = jnp.concatenate([x, y], axis=-1)
        n = x.shape[-1]
        return z[:, :n] * z[:, n:]
    if step == "ref":
        r = jax.new_ref(x)
        r[0] = y[0] * 2.0
        return jax.freeze(r) + 1.0
    if step == "norm":
        return (x - jnp.mean(x, axis=-1, keepdims=True)) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)
    raise AssertionError(step)


def _values(rng, regime: str, shape) -> np.ndarray:
    if regime == "offset":
        return (rng.choice([-1.0, 1.0]) * 300.0 + 0.05 * rng.uniform(-1, 1, shape)).astype(np.float32)
    if regime == "constant":
        return np.repeat(rng.uniform(-300, 300, (shape[0], 1)), shape[1], axis=1).astype(np.float32)
    return rng.uniform(-2, 2, shape).astype(np.float32)


@st.composite
def programs(draw):
    m, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    steps = draw(st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 10_000)), min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**32 - 1))
    regime = draw(st.sampled_from(REGIMES))
    rng = np.random.default_rng(seed)
    x = _values(rng, regime, (m, n))
    z = _values(rng, regime, (m, n))
    w = rng.uniform(-1, 1, (n, n)).astype(np.float32)

    def fn(x, z, w):
        pool = [x, z]
        for step, choice in steps:
            pool.append(_apply(step, choice, pool, w))
        return pool[-1], pool[len(pool) // 2]

    return fn, (x, z, w), (regime, steps)


@settings(max_examples=15, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(programs())
def test_random_programs_every_extraction_is_right(case):
    fn, args, (regime, steps) = case
    program = lift(fn, *args)
    builder = Builder()
    handles = builder.add(program.outputs)
    report = saturate(builder.egraph, program=program, time_limit=30.0)
    assert report.limit_reached in (None, "iteration_limit"), report.summary()
    graph = rules.SerializedGraph(builder.egraph._serialize().to_json())
    roots = [graph.handle_class[h] for h in handles]
    plans = rules.extractions(graph, roots, limit=10, seed=len(steps))
    assert plans, f"no extraction for {steps}"
    env = {f"arg{i}": a for i, a in enumerate(args)}
    # rounding at the inputs' magnitude is allowed (an offset of 300 carries ~3e-5 of it); a
    # cancelling statistic is off by orders more, or NaN
    atol = 2e-4 * max(1.0, max(float(np.max(np.abs(a))) for a in args))
    with jax.default_matmul_precision("highest"):
        expected = [np.asarray(v) for v in fn(*map(jnp.asarray, args))]
        for plan in plans:
            values = evaluate(plan, env, program.constants, program.payloads)
            for got, want in zip(values, expected):
                np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=atol,
                                           err_msg=f"{regime} inputs, steps {steps}\n{rules.format_terms(plan)}")
