"""The Pallas templates of the emitter core, run in interpret mode, against the XLA emitter and jax.jit.

Plans come from `eqsat.optimize(...).lower(...)` of small functions (odd sizes: 77 tokens, head
dim 40, 3 channels per group), so every template sees the fused terms the optimizer really
produces: pointwise with views, static and dynamic box writes, reductions over rows, columns and
several axes (argmax, GroupNorm moments), embedding gathers, loops with Pallas bodies, opaque
primitives. fp32 and fp16, tolerances keyed by dtype. Also: the dispatch's named kernels and its
XLA fallback warning, picklability, and the sm_90 compile of a small plan (launches = kernels).
"""

from __future__ import annotations

import warnings

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import emit
import eqsat
from emit.pallas import XlaFallbackWarning, template_for
from measure.xla_target import unavailable_reason

TOLERANCE = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2, "int32": 0}


def _random(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(0, 7, shape), dtype)
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _plan(fn, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(fn, **options).lower(*args).plan


def _assert_backends_agree(fn, *args, ops=None):
    """backend="pallas" (interpreted here) and backend="xla" both equal jax.jit of `fn`."""
    plan = _plan(fn, *args)
    if ops is not None:
        assert ops <= {k.op for k in plan.kernels}, [k.op for k in plan.kernels]
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    for backend in ("pallas", "xla"):
        got = jax.tree_util.tree_leaves(emit.emit(plan, backend)(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, (backend, g.shape, w.shape, g.dtype, w.dtype)
            tol = TOLERANCE[jnp.dtype(w.dtype).name] if jnp.issubdtype(w.dtype, jnp.floating) else 0
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=tol, atol=tol,
                                       err_msg=f"backend={backend}")
    return plan


# --- pointwise ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pointwise_with_views_and_erf_gelu(dtype):
    def f(x, y):
        h = jnp.transpose(x.reshape(7, 11, 40), (1, 0, 2)) * 0.5 + y[None, :1, :]
        return jax.nn.gelu(h, approximate=False), jnp.concatenate([x[:, ::2], -x[:, 1::2]], axis=1)

    _assert_backends_agree(f, _random((77, 40), dtype, 0), _random((77, 40), dtype, 1), ops={"Pointwise"})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reversals_fuse_into_one_pointwise_kernel(dtype):
    """`jnp.flip` and negative-step slices are index maps (stride -1 slices), not opaque kernels."""
    def f(x, y):
        return jnp.flip(x, 0) * 2.0 + y[:, ::-1], x[::-3, 1::-1] - 1.0

    plan = _assert_backends_agree(f, _random((77, 40), dtype, 5), _random((77, 40), dtype, 6))
    assert [k.op for k in plan.kernels] == ["Pointwise", "Pointwise"]


def test_pointwise_pad_select_iota_and_integer_outputs():
    def f(x, k):
        padded = lax.pad(x, jnp.float32(-1.0), [(1, 2, 1), (-1, 3, 0)])
        ramp = jnp.arange(padded.shape[1], dtype=jnp.int32)[None, :] * k
        return jnp.where(padded > 0, padded, ramp.astype(jnp.float32)), (x > 0).astype(jnp.int32).T + k

    _assert_backends_agree(f, _random((5, 6), "float32", 2), jnp.int32(3))


def test_static_and_dynamic_box_writes():
    def f(x, y, i):
        a = x.at[1:3, 4:9].set(y * 2)
        b = lax.dynamic_update_slice(x, jnp.tanh(y), (i, 75))  # the column start clamps to 72
        return a, b

    _assert_backends_agree(f, _random((6, 77), "float32", 3), _random((2, 5), "float32", 4), jnp.int32(-4),
                           ops={"AssignDynamic"})


# --- reductions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reductions_rows_columns_several_axes_and_argmax(dtype):
    def f(x):
        return (x.sum(axis=-1), jnp.max(x, axis=0), jnp.argmax(x, axis=1), x.astype(jnp.float32).sum(axis=(0, 2)),
                jnp.min(x.transpose(2, 0, 1), axis=(0, 2)))

    _assert_backends_agree(f, _random((3, 77, 40), dtype, 5), ops={"Reduce"})


def test_reductions_prod_and_boolean():
    def f(x):
        return jnp.prod(1.0 + 0.01 * x, axis=1), jnp.all(x > -2, axis=0), jnp.any(x > 2, axis=1)

    _assert_backends_agree(f, _random((9, 37), "float32", 6))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_group_norm_with_three_channels_per_group(dtype):
    """SD's GroupNorm: fp32 statistics over (H, W, channels of the group), 3 channels per group."""

    def f(x, scale, shift):
        n, h, w, c = x.shape
        g = x.astype(jnp.float32).reshape(n, h, w, c // 3, 3)
        mean = g.mean(axis=(1, 2, 4), keepdims=True)
        var = jnp.square(g - mean).mean(axis=(1, 2, 4), keepdims=True)
        y = ((g - mean) * lax.rsqrt(var + 1e-5)).reshape(n, h, w, c)
        return (y * scale + shift).astype(x.dtype)

    x = _random((2, 5, 7, 6), dtype, 7, scale=3.0) + jnp.asarray(100.0, dtype)
    _assert_backends_agree(f, x, _random((6,), "float32", 8), _random((6,), "float32", 9))


def test_layer_norm_statistics_are_stable_at_a_large_offset():
    """77 tokens of 40 at offset 1e3, spread 0.1: E[x²]−E[x]² would lose every digit; both backends
    stay within float32's conditioning of the float64 truth."""

    def f(x):
        m = x.mean(-1, keepdims=True)
        v = jnp.square(x - m).mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(v + 1e-5)

    x = _random((77, 40), "float32", 10, scale=0.1) + 1e3
    plan = _plan(f, x)
    exact = np.asarray(x, np.float64)
    centred = exact - exact.mean(-1, keepdims=True)
    truth = centred / np.sqrt(np.square(centred).mean(-1, keepdims=True) + 1e-5)
    for backend in ("pallas", "xla"):
        np.testing.assert_allclose(np.asarray(emit.emit(plan, backend)(x)), truth, atol=5e-3)


# --- gather, loops, opaque -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_embedding_lookup_and_fill_mode_gather(dtype):
    def f(table, ids):
        return table[ids], jnp.take(table, ids - 3, axis=0, mode="fill", fill_value=-7.0)

    ids = jnp.asarray([[3, 0, 76, 76, 1], [2, 9, 40, 0, 5]], jnp.int32)
    _assert_backends_agree(f, _random((77, 40), dtype, 11), ids, ops={"Gather"})


def test_scan_while_and_cond_bodies_run_pallas_kernels():
    def f(x, flag):
        def step(carry, row):
            carry = carry * 0.5 + jnp.tanh(row)
            return carry, carry.sum()

        final, sums = lax.scan(step, x[0], x)
        counted = lax.fori_loop(0, 3, lambda i, c: c * 1.5 + i, final)
        return lax.cond(flag, lambda v: v.max(), lambda v: -v.min(), counted), sums

    plan = _assert_backends_agree(f, _random((6, 40), "float32", 12), jnp.bool_(True), ops={"Loop"})
    jaxpr = str(jax.make_jaxpr(emit.emit(plan, "pallas", interpret=True))(_random((6, 40), "float32", 12),
                                                                           jnp.bool_(False)))
    assert "scan[" in jaxpr and "cond[" in jaxpr  # the fori_loop has static bounds: a scan
    assert jaxpr.count("pallas_call[") >= 4  # the bodies' kernels are Pallas kernels


def test_opaque_primitive_runs_as_itself():
    def f(x):
        return jnp.sort(x, axis=-1) * 2.0, jnp.cumsum(x, axis=0)

    _assert_backends_agree(f, _random((5, 77), "float32", 13), ops={"Opaque"})


# --- the dispatch -----------------------------------------------------------------------------------


def test_kernels_are_named_after_component_and_kind():
    def f(x):
        with jax.named_scope("encoder.layers.0.mlp"):
            return jnp.tanh(x).sum(axis=1)

    x = _random((4, 77), "float32", 14)
    plan = _plan(f, x)
    names = [emit.kernel_calls(plan)[i].name for i in range(len(plan.kernels))]
    assert names == [f"encoder.layers.0.mlp:{k.kind}" for k in plan.kernels]
    jaxpr = str(jax.make_jaxpr(emit.emit(plan, "pallas", interpret=True))(x))
    assert all(f"name={name}" in jaxpr or name in jaxpr for name in names)


def test_a_kernel_without_template_falls_back_with_a_warning_naming_it():
    def f(x, i):
        return x.at[i].add(1.0)

    x, i = _random((6, 4), "float32", 15), jnp.asarray([1, 1, 4], jnp.int32)
    plan = _plan(f, x, i)
    assert template_for("AssignScatter") is None
    with pytest.warns(XlaFallbackWarning, match=r"AssignScatter.*runs through the XLA emitter"):
        got = emit.emit(plan, "pallas")(x, i)
    np.testing.assert_allclose(got, f(x, i))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        emit.resolve_backend("cuda")


def test_optimize_backends_are_traceable_and_picklable():
    def f(x, w):
        return jax.nn.relu(x.T) * w

    x, w = _random((40, 77), "float32", 16), _random((77, 40), "float32", 17)
    for backend in ("pallas", "xla", "auto", "interpret"):
        fast = eqsat.optimize(f, backend=backend)
        np.testing.assert_allclose(jax.jit(fast)(x, w), f(x, w), rtol=1e-6)
        again = cloudpickle.loads(cloudpickle.dumps(fast))
        np.testing.assert_allclose(again(x, w), f(x, w), rtol=1e-6)


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_small_plan_compiles_for_sm90_with_one_launch_per_kernel():
    from measure.xla_target import compile_for_h100

    def f(x, table, ids):
        h = table[ids] + x
        m = h.mean(-1, keepdims=True)
        return (h - m) * lax.rsqrt(jnp.square(h - m).mean(-1, keepdims=True) + 1e-5), jnp.argmax(h, axis=-1)

    args = (jax.ShapeDtypeStruct((2, 77, 40), jnp.float32), jax.ShapeDtypeStruct((99, 40), jnp.float32),
            jax.ShapeDtypeStruct((2, 77), jnp.int32))
    fast = eqsat.optimize(f, backend="pallas")
    plan = fast.lower(*args).plan
    report = compile_for_h100(fast, *args)
    assert report.kernels == len(plan.kernels), report.summary()
    assert set(report.by_category) == {"Pallas (Triton)"}, report.summary()
    assert report.memsets <= 1 and report.copies == 0, report.summary()


def test_tiny_clip_text_encoder_through_pallas_equals_the_plain_function():
    """Every kernel of the tiny CLIP text encoder (2×77 tokens) is a Pallas template; none falls back."""
    from sd15 import clip
    from sd15.config import CLIPConfig
    from sd15.params import init_random

    config = CLIPConfig.tiny()
    params = init_random("text_encoder", config, seed=0)
    rng = np.random.default_rng(1)
    params = {k: jnp.asarray(rng.normal(size=v.shape) * 0.5 + (1.0 if k.endswith("weight") else 0.0), v.dtype)
              if v.ndim == 1 else v for k, v in params.items()}  # biases and norm scales must matter
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (2, 77)), jnp.int32)
    fast = eqsat.optimize(clip.apply, static_argnums=1, backend="pallas")
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        got = fast(params, config, ids)
    want = jax.jit(clip.apply, static_argnums=1)(params, config, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert {k.kind for k in fast.lower(params, config, ids).plan.kernels} >= {"matmul", "attention", "gather"}
