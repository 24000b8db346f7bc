"""Derivatives through optimized functions on every backend: `grad`, `value_and_grad`, `vjp`,
`jvp` and `hessian` equal jax's own on the original program (eqsat/differentiate.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat

BACKENDS = ["xla", "pallas", "hybrid"]


def layer_norm_mlp(w1, w2, x):
    mean = x.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5)
    return jnp.sum(jax.nn.gelu(h @ w1) @ w2 + x)


def causal_attention(q, k, v):
    scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.sum(jax.nn.softmax(scores, axis=-1) @ v)


def conv_group_norm_silu(x, w):
    n, c, h, wd = x.shape
    g = x.reshape(n, 3, -1)
    mean = g.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), -1, keepdims=True)
    y = jax.nn.silu(((g - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(x.shape))
    out = jax.lax.conv_general_dilated(y, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return jnp.mean(out * out)


def scan_rnn(w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()
    _, ys = jax.lax.scan(step, jnp.zeros(xs.shape[1:]), xs)
    return ys.sum()


def _cases():
    rng = np.random.default_rng(0)
    f32 = lambda *shape, scale=1.0, offset=0.0: jnp.asarray(offset + scale * rng.standard_normal(shape), jnp.float32)
    return {
        "layer_norm_mlp": (layer_norm_mlp, (f32(40, 24, scale=0.2), f32(24, 40, scale=0.2), f32(7, 40, offset=300.0))),
        "causal_attention": (causal_attention, (f32(2, 77, 40), f32(2, 77, 40), f32(2, 77, 40))),
        "conv_group_norm_silu": (conv_group_norm_silu, (f32(2, 9, 7, 7, offset=5.0), f32(6, 9, 3, 3, scale=0.2))),
        "scan_rnn": (scan_rnn, (f32(8, 8, scale=0.3), f32(5, 3, 8))),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(_cases()))
def test_grad_equals_jax_grad_of_the_original(case, backend):
    fn, args = _cases()[case]
    argnums = tuple(range(len(args)))
    value, grads = jax.value_and_grad(eqsat.optimize(fn, backend=backend, progress=False), argnums=argnums)(*args)
    expected_value, expected = jax.value_and_grad(fn, argnums=argnums)(*args)
    np.testing.assert_allclose(value, expected_value, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(want))) + 1e-6)


@pytest.mark.parametrize("backend", ["pallas", "hybrid"])
def test_jvp_vjp_and_hessian_through_pallas_kernels(backend):
    fn, (w1, w2, x) = _cases()["layer_norm_mlp"]
    optimized = eqsat.optimize(fn, backend=backend, progress=False)
    tangents = (jnp.ones_like(w1), jnp.zeros_like(w2), 0.5 * jnp.ones_like(x))
    out, out_t = jax.jvp(optimized, (w1, w2, x), tangents)
    ref, ref_t = jax.jvp(fn, (w1, w2, x), tangents)
    np.testing.assert_allclose(out, ref, rtol=1e-4)
    np.testing.assert_allclose(out_t, ref_t, rtol=1e-3)

    out, pullback = jax.vjp(optimized, w1, w2, x)
    np.testing.assert_allclose(pullback(jnp.float32(2.0))[2], 2.0 * jax.grad(fn, argnums=2)(w1, w2, x), rtol=1e-3,
                               atol=1e-5)

    small = lambda v: optimized(w1, w2, jnp.broadcast_to(v, x.shape))
    v = x[0, :5].sum() * jnp.ones(40) / 40.0
    np.testing.assert_allclose(jax.hessian(small)(v), jax.hessian(lambda v: fn(w1, w2, jnp.broadcast_to(v, x.shape)))(v),
                               rtol=1e-2, atol=1e-4)


def scaled_projection(w, b, x):
    return jax.nn.relu(x @ (0.5 * w) + (b * b))  # the scaled weight and squared bias: prepared once


def test_an_evaluated_call_still_runs_the_plan_and_reuses_prepared_weights():
    _, (w, _, x) = _cases()["layer_norm_mlp"]
    b = jnp.linspace(-1.0, 1.0, w.shape[1])
    optimized = eqsat.optimize(scaled_projection, backend="pallas", params_argnums=(0, 1), progress=False)
    first = optimized(w, b, x)
    second = optimized(w, b, x + 1.0)
    run = optimized.lower(w, b, x).executable("pallas")
    assert run.split.prepared_tensors and run.prepare_runs == 1 and run.cache_hits == 1
    np.testing.assert_allclose(second, scaled_projection(w, b, x + 1.0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(first, scaled_projection(w, b, x), rtol=1e-4, atol=1e-4)
    # Differentiated, the same function gives jax's gradient of the original.
    grad = jax.grad(lambda w: optimized(w, b, x).sum())(w)
    np.testing.assert_allclose(grad, jax.grad(lambda w: scaled_projection(w, b, x).sum())(w), rtol=1e-4, atol=1e-4)
