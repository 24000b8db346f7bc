"""`eqsat.one_hot_scatter`: take_along_axis's VJP (a batched scatter-add of one value per index along
one axis) is lifted as a pointwise comparison, not an `AssignScatter` kernel. Checked against
`jax.jit` on random shapes, axes, modes and adversarial indices and values (negative and
out-of-range indices, repeated indices, NaN, inf, huge updates, a -0.0 target), on the interpreter,
the XLA emitter and Pallas; and what is not of that form still lifts as a scatter."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import eqsat


def batched_scatter(shape, axis, rows, mode):
    """`target.at[...]` scatter-add of `rows` values per batch row into `axis` of a `shape` operand,
    every other axis a batching axis (the form of take_along_axis's VJP)."""
    batch_dims = tuple(i for i in range(len(shape)) if i != axis)
    numbers = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(axis,),
                                          scatter_dims_to_operand_dims=(axis,), operand_batching_dims=batch_dims,
                                          scatter_indices_batching_dims=tuple(range(len(batch_dims))))

    def f(target, indices, updates):
        return lax.scatter_add(target, indices, updates, numbers, mode=mode)

    index_shape = tuple(shape[i] for i in batch_dims) + (rows, 1)
    return f, index_shape, index_shape[:-1]


def kernel_ops(fn, *args):
    low = eqsat.optimize(fn, progress=False).lower(*args)
    return [k.term.op for k in low.plan.kernels]


def cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1).mean()


@pytest.mark.parametrize("backend", ["interpret", "xla", "pallas"])
def test_cross_entropy_gradient_has_no_scatter_and_equals_jit(backend):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((77, 10)) * 30 + 1e4, jnp.float32)  # offset large against the spread
    labels = jnp.asarray(rng.integers(0, 10, 77), jnp.int32)
    grad = jax.grad(cross_entropy)
    assert "AssignScatter" not in kernel_ops(grad, logits, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no template falls back to XLA
        got = eqsat.optimize(grad, backend=backend, progress=False)(logits, labels)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(grad)(logits, labels)), rtol=1e-5, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_batched_scatter_add_equals_jit(data):
    rank = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.sampled_from([1, 2, 3, 5, 7]), min_size=rank, max_size=rank)))
    axis = data.draw(st.integers(0, rank - 1))
    rows = data.draw(st.integers(1, 4))
    mode = data.draw(st.sampled_from([lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.CLIP,
                                      lax.GatherScatterMode.PROMISE_IN_BOUNDS]))
    dtype = data.draw(st.sampled_from([np.float32, np.int32]))
    f, index_shape, update_shape = batched_scatter(shape, axis, rows, mode)
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    low, high = (0, shape[axis]) if mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS else (-3, shape[axis] + 3)
    indices = rng.integers(low, high, index_shape).astype(np.int32)  # out of range and repeated
    if dtype == np.int32:
        target = rng.integers(-5, 5, shape).astype(np.int32)
        updates = rng.integers(-1000, 1000, update_shape).astype(np.int32)
    else:
        target = rng.choice(np.array([0.0, -0.0, 1e4, -2.5], np.float32), shape)
        updates = rng.choice(np.array([1.0, -3.0, 1e30, -1e-30, np.nan, np.inf, 7.0], np.float32), update_shape)
    assert "AssignScatter" not in kernel_ops(f, target, indices, updates)
    want = np.asarray(jax.jit(f)(target, indices, updates))
    for backend in ("interpret", "xla"):
        got = np.asarray(eqsat.optimize(f, backend=backend, progress=False)(target, indices, updates))
        if dtype == np.int32:
            np.testing.assert_array_equal(got, want)
        else:  # repeated indices may add in another order; NaN and inf where jit has them
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
            np.testing.assert_array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]))


def indexed_cross_entropy(logits, labels):
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), labels])


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_arange_indexed_gradient_has_no_scatter_and_equals_jit(backend):
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((77, 10)) * 30 - 1e4, jnp.float32)
    labels = jnp.asarray(rng.integers(-10, 10, 77), jnp.int32)  # negative labels count from the end
    grad = jax.grad(indexed_cross_entropy)
    assert "AssignScatter" not in kernel_ops(grad, logits, labels)
    want = np.asarray(jax.jit(grad)(logits, labels))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = eqsat.optimize(grad, backend=backend, progress=False)
        np.testing.assert_allclose(np.asarray(fast(logits, labels)), want, rtol=1e-5, atol=1e-7)
    # Lifted under an outer jit (the enumeration is evaluated at lift time, not traced).
    np.testing.assert_allclose(np.asarray(jax.jit(eqsat.optimize(grad, progress=False))(logits, labels)), want,
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["clip", "drop", "promise_in_bounds"])
def test_arange_indexed_scatter_modes_equal_jit(mode):
    rows = jnp.arange(6)

    def f(target, cols, updates):
        return target.at[rows, cols].add(updates, mode=mode)

    target = jnp.asarray(np.random.default_rng(3).choice([0.0, -0.0, 5.0], (6, 5)), jnp.float32)
    cols = jnp.array([0, 4, 9, -7, 2, 2]) if mode != "promise_in_bounds" else jnp.array([0, 4, 1, 3, 2, 2])
    updates = jnp.array([1.0, np.nan, np.inf, 2.0, -1e30, 3.0], jnp.float32)
    assert "AssignScatter" not in kernel_ops(f, target, cols, updates)
    got = np.asarray(eqsat.optimize(f, backend="xla", progress=False)(target, cols, updates))
    want = np.asarray(jax.jit(f)(target, cols, updates))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_other_scatters_still_lift_as_scatters():
    def permuted(target, cols, updates):  # rows not an enumeration of the axis
        return target.at[jnp.array([1, 0, 2, 3]), cols].add(updates)

    def shorter(target, cols, updates):  # fewer rows than the axis has
        return target.at[jnp.arange(3), cols].add(updates)

    def replaced(target, indices, updates):  # scatter (not add): the last write wins
        return target.at[indices].set(updates)

    target = jnp.zeros((4, 6), jnp.float32)
    assert "AssignScatter" in kernel_ops(permuted, target, jnp.array([1, 2, 1, 5]), jnp.ones(4))
    assert "AssignScatter" in kernel_ops(shorter, target, jnp.array([1, 2, 1]), jnp.ones(3))
    assert "AssignScatter" in kernel_ops(replaced, jnp.zeros(6), jnp.array([1, 1, 3]), jnp.ones(3))
    f, index_shape, update_shape = batched_scatter((3, 4), 1, 17, lax.GatherScatterMode.FILL_OR_DROP)
    assert "AssignScatter" in kernel_ops(f, jnp.zeros((3, 4)), jnp.zeros(index_shape, jnp.int32),
                                         jnp.ones(update_shape))  # more indices per row than are unrolled
