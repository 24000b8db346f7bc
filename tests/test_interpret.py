"""The reference interpreter on hand-built fused terms, against plain jax.numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat.conv_params import ConvParams
from eqsat.interpret import evaluate
from eqsat.term import Term, tensor_list
from eqsat.types import format_type

T = Term


def ty(shape, dtype="float32") -> str:
    return format_type(dtype, shape)


def inp(name, shape, dtype="float32"):
    return T("Input", name, ty(shape, dtype))


def load(tensor):
    return T("Load", tensor, tensor.ty)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def close(got, want, tol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


def test_matmul_with_bias_and_residual_epilogue():
    a, w, b, r = inp("a", (4, 8)), inp("w", (8, 16)), inp("b", (16,)), inp("r", (4, 16))
    out = ty((4, 16))
    epilogue = T("Binary", "add", T("Binary", "add", T("Acc", out), T("Broadcast", load(b), "1", out), out),
                 load(r), out)
    matmul = T("Matmul", load(a), load(w), "1;0;;", epilogue, out)
    env = {"a": rand(0, (4, 8)), "w": rand(1, (8, 16)), "b": rand(2, (16,)), "r": rand(3, (4, 16))}
    (got,) = evaluate([matmul], env)
    close(got, env["a"] @ env["w"] + env["b"] + env["r"])


def test_matmul_with_prologue_and_batch_dims():
    # silu(x) as the lhs prologue, a batched matmul against a transposed view of w.
    x, w = inp("x", (2, 3, 4)), inp("w", (2, 5, 4))
    silu = T("Binary", "mul", load(x), T("Unary", "logistic", load(x), x.ty), x.ty)
    w_t = T("Transpose", load(w), "0,2,1", ty((2, 4, 5)))
    out = ty((2, 3, 5))
    matmul = T("Matmul", silu, w_t, "2;1;0;0", T("Acc", out), out)
    env = {"x": rand(0, (2, 3, 4)), "w": rand(1, (2, 5, 4))}
    (got,) = evaluate([matmul], env)
    close(got, jnp.einsum("bij,bkj->bik", jax.nn.silu(env["x"]), env["w"]))


def test_shared_epilogue_binds_each_kernels_own_accumulator():
    a, b, r = inp("a", (3, 3)), inp("b", (3, 3)), inp("r", (3, 3))
    out = ty((3, 3))
    epilogue = T("Binary", "add", T("Acc", out), load(r), out)  # interned: one term, two kernels
    first = T("Matmul", load(a), load(b), "1;0;;", epilogue, out)
    second = T("Matmul", load(b), load(a), "1;0;;", epilogue, out)
    env = {"a": rand(0, (3, 3)), "b": rand(1, (3, 3)), "r": rand(2, (3, 3))}
    got_first, got_second = evaluate([first, second], env)
    close(got_first, env["a"] @ env["b"] + env["r"])
    close(got_second, env["b"] @ env["a"] + env["r"])


def test_attention_matches_explicit_softmax():
    q, k, v = inp("q", (2, 3, 5, 4)), inp("k", (2, 3, 7, 4)), inp("v", (2, 3, 7, 4))
    out = ty((2, 3, 5, 4))
    attention = T("Attention", load(q), load(k), load(v), T("Lit", 0.0, ty((2, 3, 5, 7))), 0.5, T("Acc", out), out)
    env = {"q": rand(0, (2, 3, 5, 4)), "k": rand(1, (2, 3, 7, 4)), "v": rand(2, (2, 3, 7, 4))}
    (got,) = evaluate([attention], env)
    scores = jnp.einsum("bhqd,bhkd->bhqk", env["q"], env["k"]) * 0.5
    close(got, jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1), env["v"]))


def test_attention_with_head_permutes_as_views_and_residual():
    # [B, S, H*D] -> [B, H, S, D] as Reshape + Transpose prologues; output permuted back in the epilogue
    # is not expressible, so the epilogue adds a residual at the kernel's own layout.
    b, s, h, d = 2, 6, 2, 4
    x, res = inp("x", (b, s, h * d)), inp("res", (b, h, s, d))
    heads = T("Transpose", T("Reshape", load(x), ty((b, s, h, d))), "0,2,1,3", ty((b, h, s, d)))
    out = ty((b, h, s, d))
    attention = T("Attention", heads, heads, heads, T("Lit", 0.0, ty((b, h, s, s))), 1 / np.sqrt(d), T("Binary", "add", T("Acc", out), load(res), out), out)
    env = {"x": rand(0, (b, s, h * d)), "res": rand(1, (b, h, s, d))}
    (got,) = evaluate([attention], env)
    qkv = env["x"].reshape(b, s, h, d).transpose(0, 2, 1, 3)
    scores = jnp.einsum("bhqd,bhkd->bhqk", qkv, qkv) / np.sqrt(d)
    close(got, jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1), qkv) + env["res"])


def test_attention_fp16_accumulates_in_float32():
    q = inp("q", (1, 1, 4, 8), "float16")
    out = ty((1, 1, 4, 8), "float16")
    attention = T("Attention", load(q), load(q), load(q), T("Lit", 0.0, ty((1, 1, 4, 4))), 0.25, T("Acc", out), out)
    x = rand(0, (1, 1, 4, 8), jnp.float16)
    (got,) = evaluate([attention], {"q": x})
    assert got.dtype == jnp.float16
    x32 = x.astype(jnp.float32)
    close(got, jax.nn.softmax(x32 @ x32.transpose(0, 1, 3, 2) * 0.25, -1) @ x32, tol=2e-3)


def test_reduce_with_prologue_and_epilogue():
    # mean of squares then rsqrt: the normalization statistics kernel.
    x = inp("x", (2, 8, 6))
    stats = ty((2, 6))
    square = T("Binary", "mul", load(x), load(x), x.ty)
    epilogue = T("Unary", "rsqrt", T("Binary", "add", T("Binary", "mul", T("Acc", stats), T("Lit", 1 / 8, stats), stats),
                                     T("Lit", 1e-5, stats), stats), stats)
    reduce = T("Reduce", "sum", square, "1", epilogue, stats)
    env = {"x": rand(0, (2, 8, 6))}
    (got,) = evaluate([reduce], env)
    close(got, jax.lax.rsqrt(jnp.mean(env["x"] ** 2, 1) + 1e-5))


def test_reduce_accumulates_in_the_acc_dtype():
    x = inp("x", (4, 1000), "float16")
    out16, out32 = ty((4,), "float16"), ty((4,), "float32")
    # f32 accumulator, converted to f16 in the epilogue
    reduce = T("Reduce", "sum", load(x), "1", T("Unary", "convert", T("Acc", out32), out16), out16)
    values = rand(0, (4, 1000), jnp.float16)
    (got,) = evaluate([reduce], {"x": values})
    assert got.dtype == jnp.float16
    close(got, values.astype(jnp.float32).sum(1).astype(jnp.float16), tol=1e-3)


def test_argmax_and_max_reductions():
    x = inp("x", (3, 5))
    arg, top = ty((3,), "int32"), ty((5,))
    terms = [T("Reduce", "argmax", load(x), "1", T("Acc", arg), arg), T("Reduce", "max", load(x), "0", T("Acc", top), top)]
    values = rand(0, (3, 5))
    got_arg, got_top = evaluate(terms, {"x": values})
    np.testing.assert_array_equal(got_arg, jnp.argmax(values, 1))
    close(got_top, values.max(0))


def test_conv_with_norm_prologue_and_bias_epilogue():
    x, w, bias = inp("x", (1, 6, 6, 3)), inp("w", (4, 3, 3, 3)), inp("bias", (4,))
    params = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), ((0, 3, 1, 2), (0, 1, 2, 3), (0, 3, 1, 2)))
    silu = T("Binary", "mul", load(x), T("Unary", "logistic", load(x), x.ty), x.ty)
    out = ty((1, 6, 6, 4))
    epilogue = T("Binary", "add", T("Acc", out), T("Broadcast", load(bias), "3", out), out)
    conv = T("Conv", silu, load(w), params.key, epilogue, out)
    env = {"x": rand(0, (1, 6, 6, 3)), "w": rand(1, (4, 3, 3, 3)), "bias": rand(2, (4,))}
    (got,) = evaluate([conv], env)
    want = jax.lax.conv_general_dilated(jax.nn.silu(env["x"]), env["w"], (1, 1), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "OIHW", "NHWC")) + env["bias"]
    close(got, want, tol=1e-4)


def test_views_in_one_pointwise_kernel():
    a, b = inp("a", (2, 3)), inp("b", (2, 5))
    cat = T("Concat", load(a), load(b), 1, 3, ty((2, 8)))
    sliced = T("Slice", cat, 1, 1, 8, 2, ty((2, 4)))
    padded = T("Pad", sliced, T("Lit", -1.0, ty(())), "1,0,0;0,2,1", ty((3, 9)))
    transposed = T("Transpose", padded, "1,0", ty((9, 3)))
    broadcast = T("Broadcast", transposed, "1,2", ty((2, 9, 3)))
    reshaped = T("Reshape", broadcast, ty((6, 9)))
    kernel = T("Pointwise", reshaped, reshaped.ty)
    env = {"a": rand(0, (2, 3)), "b": rand(1, (2, 5))}
    (got,) = evaluate([kernel], env)
    want = jnp.concatenate([env["a"], env["b"]], 1)[:, 1:8:2]
    want = jax.lax.pad(want, -1.0, ((1, 0, 0), (0, 2, 1))).T
    want = jnp.broadcast_to(want, (2, 9, 3)).reshape(6, 9)
    close(got, want)


def test_broadcast_of_size_one_axes():
    b = inp("b", (1, 4))
    kernel = T("Pointwise", T("Broadcast", load(b), "0,1", ty((3, 4))), ty((3, 4)))
    values = rand(0, (1, 4))
    (got,) = evaluate([kernel], {"b": values})
    close(got, jnp.broadcast_to(values, (3, 4)))


def test_select_iota_and_lit():
    x = inp("x", (3, 4))
    rows = T("Iota", 0, ty((3, 4), "int32"))
    cols = T("Iota", 1, ty((3, 4), "int32"))
    below = T("Binary", "lt", rows, cols, ty((3, 4), "bool"))
    select = T("Select", below, T("Lit", 7.0, x.ty), load(x), x.ty)
    values = rand(0, (3, 4))
    (got,) = evaluate([T("Pointwise", select, x.ty)], {"x": values})
    close(got, jnp.where(jnp.arange(3)[:, None] < jnp.arange(4)[None, :], values, 7.0))


def test_dynamic_slice_clamps_like_the_primitive():
    x, i = inp("x", (6, 2)), inp("i", (), "int32")
    sliced = T("DynamicSlice", load(x), 0, load(i), 3, ty((3, 2)))
    values = rand(0, (6, 2))
    for start in (0, 2, 5, -1):
        (got,) = evaluate([T("Pointwise", sliced, sliced.ty)], {"x": values, "i": jnp.int32(start)})
        begin = min(max(start, 0), 3)
        close(got, values[begin:begin + 3])


def test_assignments():
    target, value, i = inp("t", (5, 3)), inp("v", (2, 3)), inp("i", (), "int32")
    static = T("AssignStatic", target, "1,0", load(value), target.ty)
    dynamic = T("AssignDynamic", target, tensor_list([i, T("Constant", "zero", ty((), "int32"))]), load(value), target.ty)
    env = {"t": rand(0, (5, 3)), "v": rand(1, (2, 3)), "i": jnp.int32(4)}
    got_static, got_dynamic = evaluate([static, dynamic], env, constants={"zero": np.int32(0)})
    close(got_static, env["t"].at[1:3].set(env["v"]))
    close(got_dynamic, env["t"].at[3:5].set(env["v"]))  # start 4 clamps to 3


def test_opaque_and_gather_bind_their_primitives():
    table, ids = inp("table", (10, 3)), inp("ids", (4, 1), "int32")
    closed = jax.make_jaxpr(lambda t, i: t[i[:, 0]])(jnp.zeros((10, 3)), jnp.zeros((4, 1), jnp.int32))
    (gather_eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "gather"]
    gather = T("Gather", load(table), load(ids), "g", ty((4, 3)))
    cumsum = T("Opaque", "c", tensor_list([table]), 0, table.ty)
    payloads = {"g": (gather_eqn.primitive, gather_eqn.params), "c": (jax.lax.cumsum_p, {"axis": 0, "reverse": False})}
    env = {"table": rand(0, (10, 3)), "ids": jnp.array([[1], [9], [0], [1]], jnp.int32)}
    got_gather, got_cumsum = evaluate([gather, cumsum], env, payloads=payloads)
    close(got_gather, env["table"][env["ids"][:, 0]])
    close(got_cumsum, jnp.cumsum(env["table"], 0))


def test_type_mismatch_is_reported():
    x = inp("x", (2, 3))
    wrong = T("Pointwise", T("Unary", "exp", load(x), ty((3, 2))), ty((3, 2)))
    with pytest.raises(TypeError, match="its type says"):
        evaluate([wrong], {"x": jnp.ones((2, 3))})


def test_acc_outside_an_epilogue_is_an_error():
    out = ty((2,))
    with pytest.raises(ValueError, match="Acc"):
        evaluate([T("Pointwise", T("Acc", out), out)], {})


def test_evaluate_under_jit():
    x = inp("x", (4, 4))
    out = x.ty
    kernel = T("Matmul", load(x), load(x), "1;0;;", T("Unary", "tanh", T("Acc", out), out), out)
    values = rand(0, (4, 4))
    got = jax.jit(lambda v: evaluate([kernel], {"x": v})[0])(values)
    close(got, jnp.tanh(values @ values))
