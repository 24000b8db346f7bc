"""`emit.axes`: which axes of a plan are batch-like, and the per-device plan they give.

Soundness is checked with the reference interpreter, no devices needed: the plan rewritten on a
shard's shapes (`local_terms`), run on that shard of the inputs, must give that shard of the
outputs, for every shard, on lifted programs (hypothesis: odd sizes, offsets large against the
spread) and on the fused plans the optimizer extracts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from benchmarks import sharding
from emit.axes import AxisClasses, local_terms
from eqsat.interpret import evaluate
from eqsat.lift import lift


def softmax_rows(x):
    return jax.nn.softmax(x * 3.0, axis=-1)


def reduce_over_batch(x):
    return x.sum(0)


def transpose_add(x):
    return x + x.T


def iota_along_batch(x):
    return x + jnp.arange(x.shape[0], dtype=x.dtype)[:, None]


def slice_batch(x):
    return x[1:] * 2.0


def merged_reshape(x):
    return jnp.tanh(x.reshape(-1))


def split_reshape(x):
    return x.reshape(x.shape[0], -1, 1).sum(-1) + 1.0


def batched_matmul(x):
    return jnp.einsum("bij,bjk->bik", x, jnp.swapaxes(x, 1, 2))


# fn -> whether input axis 0 is batch-like (axis 1 never is, except where listed)
EXPECTED = {
    softmax_rows: (True, False),
    reduce_over_batch: (False, True),
    transpose_add: (False, False),
    iota_along_batch: (False, True),
    slice_batch: (False, True),
    merged_reshape: (None, False),  # batch-like only when the merged axis is 1 wide
    split_reshape: (True, True),
    batched_matmul: (True, False),
}


def square(fn) -> bool:
    return fn is transpose_add


def three_d(fn) -> bool:
    return fn is batched_matmul


def batch_classes(program):
    classes = AxisClasses(program.outputs, leaves=program.inputs)
    return classes, [[classes.batch_class(term, axis) for axis in range(len(classes.shapes[term]))]
                     for term in program.inputs]


def check_shards(program, args, classes, split_input_axis, parts):
    """Every shard of the inputs through the rewritten terms equals that shard of the outputs."""
    x = program.inputs[0]
    cls = classes.batch_class(x, split_input_axis)
    local = local_terms([*program.outputs, *program.inputs], classes, {cls: parts})
    env = {t.args[0]: a for t, a in zip(program.inputs, args)}
    whole = evaluate(program.outputs, env, program.constants, program.payloads)
    for shard in range(parts):
        local_env = {}
        for term, value in zip(program.inputs, args):
            value = np.asarray(value)
            for axis in range(value.ndim):
                if classes.find((term, axis)) == classes.find((x, split_input_axis)):
                    size = value.shape[axis] // parts
                    value = np.take(value, range(shard * size, (shard + 1) * size), axis=axis)
            local_env[term.args[0]] = value
        got = evaluate([local[t] for t in program.outputs], local_env, program.constants, program.payloads)
        for term, value, expected in zip(program.outputs, got, whole):
            expected = np.asarray(expected)
            for axis in range(expected.ndim):
                if classes.find((term, axis)) == classes.find((x, split_input_axis)):
                    size = expected.shape[axis] // parts
                    expected = np.take(expected, range(shard * size, (shard + 1) * size), axis=axis)
            np.testing.assert_allclose(np.asarray(value), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(fn=st.sampled_from(sorted(EXPECTED, key=lambda f: f.__name__)), parts=st.sampled_from([2, 3]),
       per_shard=st.integers(1, 3), width=st.sampled_from([1, 3, 5, 77]), offset=st.sampled_from([0.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_batch_axes_of_lifted_programs(fn, parts, per_shard, width, offset, seed):
    rows = parts * per_shard
    shape = (rows, rows) if square(fn) else (rows, width, 3) if three_d(fn) else (rows, width)
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.1 + offset).astype(np.float32)
    program = lift(fn, x)
    classes, found = batch_classes(program)
    batch0, batch1 = EXPECTED[fn]
    batch0 = width == 1 if batch0 is None else batch0
    if batch0 and rows > 1:
        assert found[0][0] is not None, fn.__name__
        check_shards(program, [x], classes, 0, parts)
    elif not batch0:
        assert found[0][0] is None, fn.__name__
    if not batch1 and shape[1] > 1:
        assert found[0][1] is None, fn.__name__


@pytest.fixture(scope="module")
def fused_plans():
    import eqsat

    plans = {}
    for case in [c for c in sharding.CASES if c.name in FUSED]:
        args = sharding.arguments(case)
        plans[case.name] = (eqsat.optimize(case.fn, backend="xla", progress=False).lower(*args).plan, args)
    return plans


FUSED = ("ln_matmul_gelu", "attention", "conv_group_norm")


@pytest.mark.parametrize("name", FUSED)
def test_fused_plans_split_on_batch(fused_plans, name):
    plan, args = fused_plans[name]
    program = plan.program
    classes = AxisClasses(plan.outputs, leaves=program.inputs)
    assert classes.batch_class(program.inputs[0], 0) is not None
    assert all(classes.batch_class(t, 0) is None for t in program.inputs[1:])  # contracted, normalized over
    if name == "ln_matmul_gelu":  # the weight's output features are independent too (tensor parallel)
        assert classes.batch_class(program.inputs[1], 1) is not None
    kinds = {k.op for k in plan.kernels}
    assert kinds & {"Matmul", "Conv", "Attention", "Reduce"}, kinds
    fused = type(program)(program.inputs, plan.outputs, program.constants, program.payloads)
    check_shards(fused, args, classes, 0, 2)
    check_shards(fused, args, classes, 0, 4)
