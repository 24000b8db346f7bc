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


# --- a shortcut fused into a conv's K range is one conv per part on XLA --------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


def _shortcut_conv(stride, padding, tap):
    """conv(concat(h, x), concat(w, pad(w_tap))): the form the Pallas conv template reads (a 1x1 or
    small shortcut zero-padded to the main kernel's size), written out by hand."""
    kh = 3

    def fn(h, x, w, w_tap):
        lo = (kh - tap) // 2
        padded = jnp.pad(w_tap, ((0, 0), (0, 0), (lo, kh - tap - lo), (lo, kh - tap - lo)))
        return lax.conv_general_dilated(jnp.concatenate([h, x], 1), jnp.concatenate([w, padded], 1),
                                        (stride, stride), [(padding, padding)] * 2)
    return fn


@settings(max_examples=12, deadline=None)
@given(stride=st.sampled_from([1, 2]), padding=st.sampled_from([0, 1, 2]), tap=st.sampled_from([1, 3]),
       c_h=st.sampled_from([1, 3, 5]), c_x=st.sampled_from([2, 3]), size=st.sampled_from([5, 7, 8]),
       scale=st.sampled_from([1.0, 1e-4, 3e3]), seed=st.integers(0, 2**16))
def test_a_concatenated_conv_splits_into_one_conv_per_part(stride, padding, tap, c_h, c_x, size, scale, seed):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((2, c_h, size, size)) * scale + 50 * scale).astype(np.float32)  # offset >> spread
    x = rng.standard_normal((2, c_x, size, size)).astype(np.float32)
    x[0] = 0.0
    w = rng.standard_normal((4, c_h, 3, 3)).astype(np.float32)
    w_tap = rng.standard_normal((4, c_x, tap, tap)).astype(np.float32)
    fn = _shortcut_conv(stride, padding, tap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = eqsat.optimize(fn, backend="xla")
        got = ours(h, x, w, w_tap)
    want = jax.jit(fn)(h, x, w, w_tap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(want))))


def test_the_split_costs_what_jit_costs():
    """A 1x1 shortcut padded to 3x3 is multiplied as a 1x1 (XLA's flop count), with no concatenated copy."""
    fn = _shortcut_conv(1, 1, 1)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(2, 16, 16, 16), (2, 8, 16, 16), (8, 16, 3, 3), (8, 8, 1, 1)]]

    def two_convs(h, x, w, w_tap):
        return (lax.conv_general_dilated(h, w, (1, 1), [(1, 1)] * 2)
                + lax.conv_general_dilated(x, w_tap, (1, 1), [(0, 0)] * 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = eqsat.optimize(fn, backend="xla")
        compiled = ours._dispatcher().lower(*args).compile()
    reference = jax.jit(two_convs).lower(*args).compile()

    def flops(c):
        analysis = c.cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    assert flops(compiled) == pytest.approx(flops(reference), rel=0.02)
    assert "concatenate(" not in compiled.as_text()


@settings(max_examples=8, deadline=None)
@given(stride=st.sampled_from([1, 2]), c_h=st.sampled_from([1, 3]), c_s=st.sampled_from([2, 5]),
       c_x=st.sampled_from([3, 4]), size=st.sampled_from([5, 8]), seed=st.integers(0, 2**16))
def test_parts_group_at_the_boundaries_both_sides_share(stride, c_h, c_s, c_x, size, seed):
    """The UNet's up-block ResNet: `concat(h, skip, x)` against `concat(pad(w1x1), w)`, where the
    shortcut's weights span h and skip: two convs, one over `concat(h, skip)`."""
    def fn(h, s, x, w_tap, w):
        padded = jnp.pad(w_tap, ((0, 0), (0, 0), (1, 1), (1, 1)))
        return lax.conv_general_dilated(jnp.concatenate([h, s, x], 1), jnp.concatenate([padded, w], 1),
                                        (stride, stride), [(1, 1)] * 2)

    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((2, c_h, size, size)) + 30).astype(np.float32)
    s = rng.standard_normal((2, c_s, size, size)).astype(np.float32) * 1e-3
    x = rng.standard_normal((2, c_x, size, size)).astype(np.float32)
    w_tap = rng.standard_normal((3, c_h + c_s, 1, 1)).astype(np.float32)
    w = rng.standard_normal((3, c_x, 3, 3)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = eqsat.optimize(fn, backend="xla")
        got = ours(h, s, x, w_tap, w)
        flops = ours._dispatcher().lower(h, s, x, w_tap, w).compile().cost_analysis()
    want = jax.jit(fn)(h, s, x, w_tap, w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(want))))
    padded_flops = 2 * 3 * 9 * (c_h + c_s + c_x) * want.shape[2] * want.shape[3] * 2
    assert (flops[0] if isinstance(flops, list) else flops)["flops"] < 0.9 * padded_flops  # not all 3x3
