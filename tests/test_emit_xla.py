"""The XLA emitter (`emit.xla`, `backend="xla"`): the plan as one jitted function, each kernel the
reference interpreter's value, named after its component and kind; the reference for templates."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import emit
import eqsat
from eqsat.interpret import evaluate
from eqsat.program import Program
from eqsat.term import Term
from extract.plan import Plan


def _lowered(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(fn).lower(*args)


def _block(x, w, b, scale, shift):
    with jax.named_scope("down_blocks.0.attentions.0.proj_in"):
        h = x @ w + b
    with jax.named_scope("down_blocks.0.attentions.0.norm"):
        m = h.mean(-1, keepdims=True)
        v = jnp.square(h - m).mean(-1, keepdims=True)
        h = (h - m) * lax.rsqrt(v + 1e-5) * scale + shift
    with jax.named_scope("down_blocks.0.attentions.0.ff"):
        return jax.nn.gelu(h, approximate=False), jnp.argmax(h, axis=0)


def _args(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = [(77, 40), (40, 24), (24,), (24,), (24,)]
    return [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]


def test_xla_backend_equals_the_interpreter_and_jit():
    args = _args()
    lowered = _lowered(_block, *args)
    plan = lowered.plan
    got = emit.emit(plan, "xla")(*args)
    reference = plan.evaluate(*args)
    want = jax.jit(_block)(*args)
    for g, r, w in zip(got, reference, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_every_kernel_is_traced_under_its_component_and_kind():
    args = _args()
    plan = _lowered(_block, *args).plan
    emitted = emit.emit(plan, "xla")
    leaves = [np.asarray(a) for a in args]
    hlo = jax.jit(emitted._run_leaves).lower(leaves).as_text(debug_info=True)
    names = {call.name for call in emit.kernel_calls(plan)}
    assert all(":" in name for name in names), names
    for name in names:
        assert name in hlo, f"{name} not in the lowered module's locations"


def test_hosted_statistics_are_computed_with_their_host():
    """A row sum hosted by the pointwise kernel that writes its operand (`EpilogueReduce`): an extra
    output of that kernel, equal to the interpreter's reduction on both backends."""
    x, y = Term("Input", "arg0", "f32[6,77]"), Term("Input", "arg1", "f32[6,77]")
    producer = Term("Pointwise", Term("Binary", "add", Term("Unary", "tanh", Term("Load", x, x.ty), x.ty),
                                      Term("Load", y, y.ty), x.ty), x.ty)
    row_sum = Term("EpilogueReduce", producer, "sum", Term("Load", producer, x.ty), "1", "f32[6]")
    out = Term("Pointwise", Term("Binary", "sub", Term("Load", producer, x.ty),
                                 Term("Broadcast", Term("Load", row_sum, "f32[6]"), "0", x.ty), x.ty), x.ty)
    program = Program(inputs=[x, y], outputs=[out, row_sum])
    plan = Plan.build(program.outputs, program=program)
    calls = emit.kernel_calls(plan)
    assert [len(call.hosted) for call in calls] == [1, 0, 0], "the plan must host the sum in the producer"
    # a statistic the plan returns is finished once, right after its host (`eqsat.cost.merges`)
    assert calls[1].term is row_sum and calls[1].name.endswith("finalize")
    rng = np.random.default_rng(3)
    args = [jnp.asarray(rng.normal(size=(6, 77)), jnp.float32) for _ in range(2)]
    want = evaluate(program.outputs, {"arg0": args[0], "arg1": args[1]})
    for backend in ("xla", "pallas"):
        for got, expected in zip(emit.emit(plan, backend)(*args), want):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_plans(dtype):
    args = _args(1, dtype)
    lowered = _lowered(_block, *args)
    got = emit.emit(lowered.plan, "xla")(*args)
    want = lowered.plan.evaluate(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_the_emitted_function_runs_inside_an_outer_jit_and_grad():
    args = _args(2)
    lowered = _lowered(_block, *args)
    run = emit.emit(lowered.plan, "xla")

    def loss(x):
        return run(x, *args[1:])[0].sum()

    np.testing.assert_allclose(jax.jit(loss)(args[0]), _block(*args)[0].sum(), rtol=1e-5)
    grad = jax.grad(loss)(args[0])
    np.testing.assert_allclose(grad, jax.grad(lambda x: _block(x, *args[1:])[0].sum())(args[0]), rtol=1e-4,
                               atol=1e-5)
