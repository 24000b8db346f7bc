"""Lifting jaxprs to terms: every primitive family round-trips through the reference interpreter.

The check for each function `f`: `evaluate_program(lift(f, *args), *args) == f(*args)` (exact for
integers and booleans, 1e-5 for floats).
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from eqsat.interpret import evaluate_program
from eqsat.lift import BINARY_OPS, UNARY_OPS, OpaqueWarning, lift, lift_jaxpr
from eqsat.program import module_path
from eqsat.term import Term, list_items, postorder


def assert_same(got, want):
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, w)


def roundtrip(f, *args, **lift_kwargs):
    program = lift(f, *args, **lift_kwargs)
    assert_same(evaluate_program(program, *args), f(*args))
    return program


X = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
POSITIVE = jnp.linspace(0.1, 3.0, 12, dtype=jnp.float32).reshape(3, 4)
INTS = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) - 5


# --- elementwise -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exp", "log", "neg", "rsqrt", "sqrt", "logistic", "erf", "erfc", "tanh", "exp2",
                                  "log1p", "expm1", "sin", "cos", "abs", "sign", "floor", "ceil", "cbrt", "square",
                                  "is_finite", "erf_inv", "lgamma", "atan", "sinh"])
def test_unary(name):
    program = roundtrip(getattr(lax, name), POSITIVE / 4 if name == "erf_inv" else POSITIVE)
    (kernel,) = program.kernel_terms()
    assert kernel.op == "Pointwise" and kernel.args[0].op == "Unary" and kernel.args[0].args[0] == name


def test_parametric_unary_and_convert():
    program = roundtrip(lambda x: (x ** 3, lax.round(x * 3), jnp.round(x * 3),
                                   x.astype(jnp.float16), x.astype(jnp.int32), lax.reduce_precision(x, 5, 10)), X)
    ops = {k.args[0].args[0] for k in program.kernel_terms() if k.args[0].op == "Unary"}
    assert {"integer_pow:3", "round:0", "round:1", "convert", "reduce_precision:5,10"} <= ops


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "max", "min", "pow", "rem", "atan2", "nextafter",
                                  "eq", "ne", "lt", "le", "gt", "ge"])
def test_binary(name):
    program = roundtrip(getattr(lax, name), POSITIVE, POSITIVE[::-1])
    (kernel,) = program.kernel_terms()
    assert kernel.args[0].op == "Binary" and kernel.args[0].args[0] == name


def test_integer_and_boolean_ops():
    def f(a, b):
        return (a & b, a | b, a ^ b, ~a, a << 2, a >> 1, lax.shift_right_logical(a, 1), a // 3, a % 3,
                lax.population_count(a), lax.clz(a), (a > 0) & (b < 3), jnp.logical_not(a > 0), -a, abs(a))
    roundtrip(f, INTS, INTS[::-1])


def test_op_vocabulary_covers_the_lax_names():
    assert {"exp", "log", "neg", "rsqrt", "logistic", "erf", "tanh"} <= set(UNARY_OPS)
    assert {"add", "sub", "mul", "div", "max", "min", "pow", "lt", "eq", "and"} <= set(BINARY_OPS)


def test_scalars_literals_and_implicit_broadcast():
    def f(x, s):
        return x * 2.0 + s, jnp.maximum(x, 0.5), x[:, :1] * x[:1, :], s * 3
    program = roundtrip(f, X, jnp.float32(0.25))
    lits = [t for t in postorder(program.outputs) if t.op == "Lit"]
    assert lits and all(t.ty.startswith("f32[") for t in lits)


def test_select_n_and_clamp():
    def f(x, i):
        which = jnp.clip(jnp.arange(12).reshape(3, 4) % 3, 0, 2)
        return jnp.where(x > 0, x, 0.5 * x), lax.select_n(which, x, x + 1, x * 3), jnp.clip(x, -1, 1), \
            lax.clamp(-0.5, x, 0.5), lax.select_n(i, x, -x)
    roundtrip(f, X, jnp.bool_(True))


def test_activations_under_custom_jvp_and_vjp():
    @jax.custom_vjp
    def clipped(x):
        return jnp.clip(x, -1, 1)

    clipped.defvjp(lambda x: (clipped(x), x), lambda x, g: (g,))
    program = roundtrip(lambda x: (jax.nn.gelu(x), jax.nn.gelu(x, approximate=False), jax.nn.relu(x),
                                   jax.nn.softplus(x), jax.nn.silu(x), jax.nn.softmax(x), clipped(x)), X)
    assert all(k.op in ("Pointwise", "Reduce") for k in program.kernel_terms())


# --- views ---------------------------------------------------------------------------------------


def test_views():
    def f(x):
        return (x.T, x.reshape(4, 3), x.reshape(2, 6, order="F"), x[1:, ::2], x[None], jnp.squeeze(x[:1]),
                jnp.expand_dims(x, 1), jnp.broadcast_to(x[:, None, :], (3, 2, 4)), jnp.pad(x, ((1, 2), (0, 1))),
                lax.pad(x, -1.0, ((0, 0, 1), (-1, 1, 0))), jnp.concatenate([x, x * 2, x], 1), jnp.split(x, 2, 1),
                jnp.stack([x, x], 1), jnp.tile(x, (2, 3)), jnp.unstack(x), jnp.arange(5), lax.iota(jnp.int32, 7),
                lax.broadcasted_iota(jnp.float32, (2, 3), 1))
    program = roundtrip(f, X)
    ops = {t.op for t in postorder(program.outputs)}
    assert {"Transpose", "Reshape", "Slice", "Broadcast", "Pad", "Concat", "Iota"} <= ops


def test_multi_axis_slice_is_a_chain_and_concat_is_left_nested():
    program = lift(lambda x: (x[1:3, 1:], jnp.concatenate([x, x, x], 0)), X)
    sliced, concat = (k.args[0] for k in program.outputs)
    assert sliced.op == "Slice" and sliced.args[0].op == "Slice" and sliced.args[0].args[0].op == "Load"
    assert {sliced.args[1], sliced.args[0].args[1]} == {0, 1}
    assert concat.op == "Concat" and concat.args[0].op == "Concat" and concat.args[1].op == "Load"
    assert concat.args[3] == 6 and concat.args[0].args[3] == 3


def test_rev_is_a_reversed_slice_not_an_opaque_kernel():
    def f(x):
        return jnp.flip(x, 0), x[::-2, ::-1], lax.rev(x, (0, 1)) * 2.0, jnp.flip(x[:1], 0), jnp.flip(x, 1)[1:, 2:]

    with warnings.catch_warnings():
        warnings.simplefilter("error", OpaqueWarning)
        program = roundtrip(f, X)
    flipped, _, _, single_row, _ = program.outputs
    assert flipped.op == "Pointwise" and flipped.args[0].op == "Slice"
    assert flipped.args[0].args[1:5] == (0, X.shape[0] - 1, -1, -1)
    assert single_row.op == "Pointwise" and single_row.args[0].op == "Slice"  # x[:1]; its reversal is no kernel
    assert not any(k.op == "Opaque" for k in program.kernel_terms())


def test_conv_input_gradient_reads_its_weights_reversed():
    """The input VJP of a conv is a conv with spatially reversed weights (`rev` over H and W)."""
    def input_grad(x, w, g):
        conv = lambda x: lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)),
                                                  dimension_numbers=("NHWC", "OIHW", "NHWC"))
        return jax.vjp(conv, x)[1](g)[0]

    rng = np.random.default_rng(0)
    x, w, g = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 5, 7, 3), (4, 3, 3, 3), (2, 5, 7, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpaqueWarning)
        program = roundtrip(input_grad, x, w, g)
    reversed_axes = {t.args[1] for t in postorder(program.outputs) if t.op == "Slice" and t.args[4] == -1}
    assert reversed_axes == {2, 3}


def test_dynamic_slice_and_update():
    def f(x, i):
        return (lax.dynamic_slice(x, (i, 1), (2, 2)), lax.dynamic_slice(x, (i, 5), (2, 2)),
                lax.dynamic_update_slice(x, jnp.ones((1, 2)), (i, 1)),
                lax.dynamic_update_slice(x, jnp.ones((2, 2)), (1, 9)), x[i], x[i, 1:])
    for i in (0, 1, 2, 7, -1, -8):
        roundtrip(f, X, jnp.int32(i))


def test_at_set_and_add():
    roundtrip(lambda x, i: (x.at[i].set(5.0), x.at[1:3].add(2.0), x.at[:, i].mul(3.0), x.at[i, 2].max(9.0)), X, 1)


# --- reductions and heavy kernels --------------------------------------------------------------


def test_reductions():
    def f(x, b):
        return (x.sum(0), x.sum(), x.max(1), x.min(), x.prod(1), jnp.argmax(x, 1), jnp.argmin(x, 0),
                jnp.all(b), jnp.any(b, 0), x.mean(1), jnp.var(x), lax.reduce_xor(INTS, (1,)), INTS.max(0))
    program = roundtrip(f, X, X > 0)
    reduce_ops = {k.args[0] for k in program.kernel_terms() if k.op == "Reduce"}
    assert {"sum", "max", "min", "prod", "argmax", "argmin", "and", "or", "xor"} <= reduce_ops


def test_dot_general():
    a = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4) / 10
    b = jnp.arange(40, dtype=jnp.float32).reshape(2, 4, 5) / 10
    program = roundtrip(lambda a, b, w: (a @ b, jnp.einsum("bij,kj->bik", a, w), a.reshape(6, 4) @ w.T), a, b,
                        jnp.ones((7, 4)))
    matmuls = [k for k in program.kernel_terms() if k.op == "Matmul"]
    assert matmuls[0].args[2] == "2;1;0;0"
    assert all(k.args[3] == Term("Acc", k.ty) for k in matmuls)


def test_conv():
    image = jax.random.normal(jax.random.key(0), (2, 3, 8, 8))
    weight = jax.random.normal(jax.random.key(1), (4, 3, 3, 3))
    nhwc = image.transpose(0, 2, 3, 1)

    def f(x, w, y):
        return (lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1))),
                lax.conv_general_dilated(y, w, (2, 2), "SAME", dimension_numbers=("NHWC", "OIHW", "NHWC")),
                lax.conv_general_dilated(y, w, (1, 1), "VALID", rhs_dilation=(2, 2),
                                         dimension_numbers=("NHWC", "OIHW", "NHWC")),
                lax.conv_general_dilated(x, w[:3, :1], (1, 1), "SAME", feature_group_count=3))

    program = roundtrip(f, image, weight, nhwc)
    assert [k.op for k in program.kernel_terms()].count("Conv") == 4


def test_embedding_gather_and_scatter_add():
    table = jnp.arange(30, dtype=jnp.float32).reshape(10, 3)
    ids = jnp.array([[1, 2], [9, 0]])
    program = roundtrip(lambda e, i: (e[i], jnp.take(e, i, axis=0)), table, ids)
    assert any(k.op == "Gather" for k in program.kernel_terms())
    # An embedding's gradient (rows scattered whole) is a scatter kernel ...
    program = roundtrip(lambda g, i: jnp.zeros((10, 3)).at[i].add(g), jnp.ones((2, 2, 3)), ids)
    assert any(k.op == "AssignScatter" for k in program.kernel_terms())
    # ... a few single values added into a vector compare positions (eqsat.one_hot_scatter).
    program = roundtrip(lambda v, i: jnp.zeros(5).at[i].add(v), jnp.array([1.0, 2.0, 3.0]), jnp.array([1, 1, 4]))
    assert all(k.op == "Pointwise" for k in program.kernel_terms())


# --- calls, loops, refs ------------------------------------------------------------------------


def test_nested_jit_and_remat_are_inlined():
    inner = jax.jit(lambda y: jnp.sin(y) * 2)
    program = roundtrip(jax.jit(lambda x: jax.jit(lambda z: inner(z) + 1)(x) + jax.checkpoint(jnp.cos)(x)), X)
    assert program.naive_kernel_count() == 5
    assert all(k.op == "Pointwise" for k in program.kernel_terms())


def test_scan():
    def f(x):
        def step(carry, row):
            return carry * 0.5 + row, (carry.sum(), row * carry)
        return lax.scan(step, jnp.zeros(4), x), lax.scan(step, jnp.ones(4), x, reverse=True)
    program = roundtrip(f, X)
    loops = [k for k in program.kernel_terms() if k.op == "Loop"]
    assert loops and program.payloads[loops[0].args[0]]["kind"] == "scan"
    assert {a.op for a in postorder([loops[0].args[2]]) if a.sort == "Tensor"} >= {"LoopArg", "Pointwise", "Reduce"}


def test_fori_loop_while_and_cond():
    def f(x, i):
        a = lax.fori_loop(0, 3, lambda k, c: c + jnp.sum(x[k]), 0.0)
        b = lax.while_loop(lambda c: c[0] < i, lambda c: (c[0] + 1, c[1] * 2), (0, x))
        c = lax.fori_loop(0, i, lambda k, c: c * 1.5, x)  # dynamic trip count: a while loop
        d = lax.cond(i > 1, lambda: x + 1, lambda: x - 1)
        e = lax.switch(i, [lambda: x + 1, lambda: x - 1, lambda: x * 3])
        return a, b, c, d, e
    for i in (0, 1, 2, 5):
        program = roundtrip(f, X, jnp.int32(i))
    kinds = {program.payloads[k.args[0]]["kind"] for k in program.kernel_terms() if k.op == "Loop"}
    assert kinds == {"scan", "while", "cond"}


def test_refs_in_straight_line_code():
    def f(x, i):
        r = jax.new_ref(x)
        r[1] = jnp.full(4, 5.0)
        r[i] += 2.0
        r[:, 0] = x[:, 1]
        r[-1] = jnp.zeros(4)
        a, b, c, d = r[...], r[i], r[1:3], r[i, 1:]
        r[0, 1] = 7.0
        return a, b, c, d, r[:, ::2], jax.freeze(r)
    for i in (0, 1, 2, -1, -3):
        program = roundtrip(f, X, jnp.int32(i))
    ops = {k.op for k in program.kernel_terms()}
    assert {"AssignStatic", "AssignDynamic"} <= ops and "Opaque" not in ops


def test_ref_fori_loop_and_at_set():
    def f(x):
        r = jax.new_ref(x)

        def body(k, c):
            r[k] = r[k] * 2 + x[k].at[k].set(-1.0)
            return c + r[k, 0]

        total = lax.fori_loop(0, 3, body, 0.0)
        return total, jax.freeze(r)
    program = roundtrip(f, X)
    (loop,) = {k.args[0] for k in program.kernel_terms() if k.op == "Loop"}
    assert program.payloads[loop]["num_carry"] == 3  # the counter, the sum and the ref


def test_refs_carried_through_while_and_cond():
    def f(x, i):
        r = jax.new_ref(x)

        def body(k):
            r[k % 3] = r[k % 3] + 1.0
            return k + 1

        lax.while_loop(lambda k: k < i, body, 0)

        def yes():
            r[0] = r[1] * 3

        def no():
            r[2] = jnp.ones(4)

        lax.cond(i > 2, yes, no)
        return jax.freeze(r)
    for i in (0, 2, 5):
        roundtrip(f, X, jnp.int32(i))


def test_refs_in_scan_bodies_jitted_helpers_and_nested_loops():
    def scanned(x):
        r = jax.new_ref(jnp.zeros(4))

        def step(c, row):
            r[...] += row
            return c + r[1], r[2] * row

        return lax.scan(step, 0.0, x), jax.freeze(r)

    def helper(x):
        r = jax.new_ref(x)

        @jax.jit
        def write(ref, v):
            ref[0] = v
            return ref[1] * 2

        return write(r, x[2]), jax.freeze(r)

    def nested(x):
        return lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 2, lambda j, d: d + x[i, j], c), 0.0)

    for f in (scanned, helper, nested):
        roundtrip(f, X)


def test_autodiff_and_vmap_outputs():
    roundtrip(lambda x: (jax.grad(lambda y: jnp.sum(jnp.tanh(y) ** 2 * y))(x),
                         jax.vmap(lambda r: jnp.dot(r, r))(x), jax.jacfwd(jnp.sin)(x[0])), X)


def test_fancy_ref_indexing_falls_back_to_discharge():
    def f(x, idx):
        r = jax.new_ref(x)
        r[idx] = jnp.zeros((2, 4))
        got = r[jnp.array([2, 1])]
        r[idx] += 1.0
        return got, jax.freeze(r)
    roundtrip(f, X, jnp.array([0, 2]))


# --- opaque ------------------------------------------------------------------------------------


def test_unsupported_primitives_become_opaque_with_one_warning_at_the_users_line():
    def f(x):
        return jnp.cumsum(x, 1), jnp.cumsum(x, 0), jnp.sort(x, 1), lax.top_k(x, 2)
    with pytest.warns(OpaqueWarning) as record:
        program = roundtrip(f, X)
    (warning,) = [w for w in record if issubclass(w.category, OpaqueWarning)]
    for name in ("cumsum", "sort", "top_k"):
        assert str(warning.message).count(f"'{name}'") == 1, warning.message
    assert "3 primitive(s) in f() stay opaque" in str(warning.message)
    assert warning.filename == __file__, warning.filename  # roundtrip's lift call, not eqsat's code
    assert len(program.warnings) == 3
    opaque = [k for k in program.kernel_terms() if k.op == "Opaque"]
    assert len(opaque) == 5  # cumsum twice, sort, top_k's two outputs
    key = opaque[0].args[0]
    primitive, params = program.payloads[key]
    assert primitive.name == "cumsum" and params["axis"] == 1


# --- program structure -------------------------------------------------------------------------


def test_kernel_counts():
    program = lift(lambda x: jnp.sin(x) * 2 + jnp.exp(x), X)
    assert program.naive_kernel_count() == 4  # sin, mul, exp, add
    program = lift(lambda x, w, b: jax.nn.relu(x @ w + b), X, jnp.ones((4, 5)), jnp.ones(5))
    assert [k.op for k in program.kernel_terms()] == ["Matmul", "Pointwise", "Pointwise", "Pointwise"]
    # matmul; broadcast_in_dim of b; add; max
    program = lift(lambda x: x, X)
    assert program.naive_kernel_count() == 0 and program.outputs == program.inputs


def test_pytrees_static_args_and_abstract_inputs():
    def f(params, x, n):
        return {"y": params["w"] @ x * n, "z": [x.sum(), params["b"]]}
    params = {"w": jnp.ones((2, 3)), "b": jnp.arange(2.0)}
    x = jnp.arange(3.0)
    program = lift(f, params, x, 3, static_argnums=2)
    assert [t.args[0] for t in program.inputs] == ["arg0", "arg1", "arg2"]
    assert_same(evaluate_program(program, params, x, 3), f(params, x, 3))
    assert_same(evaluate_program(program, params, x), f(params, x, 3))
    abstract = lift(f, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
                    jax.ShapeDtypeStruct((3,), jnp.float32), 3, static_argnums=(2,))
    assert abstract.outputs == program.outputs


def test_lift_jaxpr_with_consts():
    table = np.arange(6, dtype=np.float32).reshape(2, 3)
    closed = jax.make_jaxpr(lambda x: x + jnp.asarray(table) * 2)(jnp.ones((2, 3)))
    program = lift_jaxpr(closed)
    assert program.constants
    assert_same(evaluate_program(program, jnp.ones((2, 3)))[0], jnp.ones((2, 3)) + table * 2)


def test_components_from_named_scopes():
    def f(x):
        with jax.named_scope("down_blocks.0"):
            with jax.named_scope("down_blocks.0.resnets.1"):
                y = jnp.sin(x)
                y = jax.jit(lambda z: z * 2)(y)
                y = jax.vmap(jnp.cos)(y)
                with jax.named_scope("down_blocks.0.resnets.1.conv1"):
                    y = y + 1
        return jnp.exp(y)
    program = lift(f, X)
    by_op = {k.args[0].args[0]: program.components[k] for k in program.kernel_terms()}
    assert by_op["sin"] == "down_blocks.0/down_blocks.0.resnets.1"
    assert by_op["mul"] == "down_blocks.0/down_blocks.0.resnets.1"  # inside a jit: no wrapper name
    assert by_op["cos"] == "down_blocks.0/down_blocks.0.resnets.1"  # vmap() is a transform, dropped
    assert module_path(by_op["add"]) == "down_blocks.0.resnets.1.conv1"
    assert by_op["exp"] == ""


def test_deep_chain_needs_no_recursion():
    depth = 20_000

    def f(x):
        for step in range(depth):
            x = x * 1.0001 if step % 2 else x + 0.001
        return x

    assert sys.getrecursionlimit() < depth
    program = lift(f, jnp.ones(3))
    assert program.naive_kernel_count() == depth
    assert_same(evaluate_program(program, jnp.ones(3)), f(jnp.ones(3)))


def test_interpreter_can_be_jitted():
    def f(x, i):
        return lax.fori_loop(0, i, lambda k, c: c * 1.5 + x, x).sum(), jnp.tanh(x) @ x.T
    program = lift(f, X, 3)
    got = jax.jit(lambda x, i: evaluate_program(program, x, i))(X, 3)
    assert_same(got, f(X, 3))


def test_tiny_unet_roundtrip():
    from sd15 import unet
    from sd15.config import UNetConfig
    from sd15.params import init_random

    config = UNetConfig.tiny()
    params = init_random("unet", config, seed=0)
    sample = jax.random.normal(jax.random.key(0), (2, config.in_channels, 8, 8))
    context = jax.random.normal(jax.random.key(1), (2, 5, config.cross_attention_dim))
    f = lambda p, s, t, c: unet.apply(p, config, s, t, c)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpaqueWarning)
        program = lift(f, params, sample, jnp.float32(10.0), context)
    assert not program.warnings
    args = (params, sample, jnp.float32(10.0), context)
    got = jax.jit(lambda *a: evaluate_program(program, *a))(*args)  # jitted: eager dispatch of ~1,000 ops is slow
    np.testing.assert_allclose(got, jax.jit(f)(*args), rtol=1e-4, atol=1e-4)
    named = [k for k in program.kernel_terms() if program.components.get(k)]
    assert len(named) > 0.95 * program.naive_kernel_count()


def test_loop_bodies_use_their_own_loop_args():
    program = lift(lambda x: lax.scan(lambda c, r: (c + r, c), jnp.zeros(4), x), X)
    (key,) = {k.args[0] for k in program.kernel_terms() if k.op == "Loop"}
    loop = next(k for k in program.kernel_terms() if k.op == "Loop")
    args = {t for t in postorder(list_items(loop.args[2])) if t.op == "LoopArg"}
    assert args and all(t.args[0] == key for t in args)


# --- random programs -----------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_UNARY_FNS = [jnp.exp, jnp.tanh, jax.nn.sigmoid, jnp.abs, jnp.sin, lambda x: x * x, jax.nn.silu, jax.nn.gelu,
              lambda x: x.astype(jnp.float16).astype(jnp.float32)]
_BINARY_FNS = [jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, lambda a, b: jnp.where(a > b, a, b * 0.5)]
_VIEW_FNS = [lambda x: x.T.reshape(x.shape), lambda x: jnp.concatenate([x[:, 1:], x[:, :1]], 1),
             lambda x: jnp.pad(x, 1)[1:-1, 1:-1], lambda x: x.sum(0, keepdims=True) + x,
             lambda x: (x[:, :, None] * x[:, None, :]).sum(1), lambda x: jnp.tile(x, (1, 2))[:, 1:1 + x.shape[1]]]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(2, 4), st.integers(2, 4), st.integers(0, 2**16))
def test_random_elementwise_and_view_programs(steps, rows, cols, seed):
    def f(x, y):
        values = [x, y]
        for kind, which, pick in steps:
            a = values[pick % len(values)]
            if kind == 0:
                values.append(_UNARY_FNS[which % len(_UNARY_FNS)](a))
            elif kind == 1:
                values.append(_BINARY_FNS[which % len(_BINARY_FNS)](a, values[-1]))
            else:
                values.append(_VIEW_FNS[which % len(_VIEW_FNS)](a))
        return values[2:]

    x = jax.random.uniform(jax.random.key(seed), (rows, cols), minval=-1.0, maxval=1.0)
    roundtrip(f, x, x[::-1] * 0.5)


def test_complex_values_and_ffts_are_opaque_with_a_warning_and_correct():
    def spectrum(x, z):
        y = jnp.fft.fft(x)                                  # complex64 from float32
        mixed = y * (1 + 2j) + jnp.conj(z) * z              # complex arithmetic
        power = jnp.abs(mixed) ** 2                          # back to float32
        rows = jnp.fft.irfft(jnp.fft.rfft(x), n=x.shape[-1])
        return power * 2.0 + 1.0, mixed.reshape(2, -1).T, jnp.angle(z), rows

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    z = (np.arange(24).reshape(3, 8) + 1j * np.ones((3, 8))).astype(np.complex64)
    with pytest.warns(OpaqueWarning) as caught:
        program = roundtrip(spectrum, x, z)
    messages = [str(w.message) for w in caught]
    assert any("'fft'" in m for m in messages) and any("complex" in m for m in messages)
    kernels = program.kernel_terms()
    for kernel in kernels:                                  # nothing but an Opaque computes on complex values
        if kernel.ty.startswith("c64") and kernel.op != "Opaque":
            raise AssertionError(f"{kernel.op} of type {kernel.ty} is not opaque")
    assert any(k.op == "Pointwise" and k.ty.startswith("f32") for k in kernels)  # real parts stay terms


def test_an_optimized_function_warns_once_at_the_call_site():
    def sampler(key, x):
        noise = jax.random.normal(key, x.shape)
        return jnp.cumsum(x + noise, 0)

    fast = eqsat.optimize(sampler, backend="xla")
    key = jax.random.key(0)
    with pytest.warns(OpaqueWarning) as record:
        fast(key, X)  # the user's line
    warned = [w for w in record if issubclass(w.category, OpaqueWarning)]
    assert len(warned) == 1 and warned[0].filename == __file__, [(w.filename, str(w.message)) for w in warned]
    assert "'cumsum'" in str(warned[0].message) and "in sampler()" in str(warned[0].message)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        fast(key, np.ones((5, 3), np.float32))  # a new signature: lowered again, not warned again
    assert not [w for w in again if issubclass(w.category, OpaqueWarning)]


def test_complex_values_through_optimize_and_loops():
    import eqsat

    def rotate(z, steps):
        def body(carry, angle):
            carry = carry * jnp.exp(1j * angle)
            return carry, carry.real.sum()
        return lax.scan(body, z, steps)

    z = (np.arange(4) + 1j).astype(np.complex64)
    steps = np.linspace(0, 1, 5, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpaqueWarning)
        got = eqsat.optimize(rotate)(z, steps)
    want = jax.jit(rotate)(z, steps)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
