"""The host-side fast path of an optimized function with prepared parameters (`emit.prepare.LeafRoute`,
`driver.optimize`): once a signature has run, a call with the same parameter objects walks its leaves
once instead of six times. It must give the general path's values and fall back to it on anything
else: new weights, another shape or dtype, a Python scalar's type, a tracer, a gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat

D = 24


def block(params, x, scale):
    """Two matmuls over the same input: their weights are concatenated once, in the prepare stage."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    g = jax.nn.sigmoid(x @ params["wg"])
    return ((h * g) @ params["w2"]) * scale + x


def make_params(seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.standard_normal((D, 40)) / np.sqrt(D), jnp.float32),
            "b1": jnp.asarray(rng.standard_normal(40) + offset, jnp.float32),
            "wg": jnp.asarray(rng.standard_normal((D, 40)) / np.sqrt(D), jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((40, D)) / np.sqrt(40), jnp.float32)}


def make_x(rows=9, seed=1, offset=0.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, D)) + offset, jnp.float32)


@pytest.fixture(autouse=True)
def count_routes(monkeypatch):
    """Counts every routed call in `TAKEN` (a route replaced by another signature's keeps its count)."""
    from emit.prepare import LeafRoute

    original = LeafRoute.__call__
    TAKEN.clear()

    def counted(self, leaves, values):
        TAKEN.append(self)
        return original(self, leaves, values)

    monkeypatch.setattr(LeafRoute, "__call__", counted)


TAKEN: list = []


def routes_taken(fast) -> int:
    return len(TAKEN)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_repeated_call_takes_the_route_and_gives_the_same_values(backend):
    fast = eqsat.optimize(block, params_argnums=0, backend=backend, progress=False)
    params = make_params()
    for i, offset in enumerate([0.0, 1e4, -3.0]):  # a large offset against a spread of 1
        x = make_x(seed=i, offset=offset)
        want = jax.jit(block)(params, x, 0.5)
        np.testing.assert_allclose(np.asarray(fast(params, x, 0.5)), np.asarray(want), rtol=2e-5, atol=2e-3)
    assert routes_taken(fast) == 2  # the first call ran the general path
    run = fast.lowerings[0].executable(backend)
    assert run.prepare_runs == 1


def test_new_weights_another_shape_or_scalar_type_leave_the_route():
    fast = eqsat.optimize(block, params_argnums=0, backend="xla", progress=False)
    params, x = make_params(), make_x()
    fast(params, x, 0.5)
    fast(params, x, 0.5)
    assert routes_taken(fast) == 1

    changed = make_params(seed=3, offset=2.0)  # same shapes, other objects: prepared again
    np.testing.assert_allclose(np.asarray(fast(changed, x, 0.5)), np.asarray(jax.jit(block)(changed, x, 0.5)),
                               rtol=2e-5, atol=2e-5)
    assert routes_taken(fast) == 1
    assert fast.lowerings[0].executable("xla").prepare_runs == 2

    wide = make_x(rows=77)  # another signature: planned anew, then routed too
    np.testing.assert_allclose(np.asarray(fast(changed, wide, 0.5)), np.asarray(jax.jit(block)(changed, wide, 0.5)),
                               rtol=2e-5, atol=2e-5)
    fast(changed, wide, 0.5)
    assert len(fast.lowerings) == 2 and routes_taken(fast) == 2

    # An int scale is another signature (its own lowering), never the float route.
    np.testing.assert_allclose(np.asarray(fast(changed, wide, 2)), np.asarray(jax.jit(block)(changed, wide, 2)),
                               rtol=2e-5, atol=2e-5)
    assert len(fast.lowerings) == 3

    x16 = wide.astype(jnp.float16)  # another dtype: never the float32 route
    got = fast(changed, x16, 0.5)
    assert got.dtype == jax.jit(block)(changed, x16, 0.5).dtype
    assert len(fast.lowerings) == 4


def test_traced_calls_and_gradients_go_the_general_way():
    fast = eqsat.optimize(block, params_argnums=0, backend="xla", progress=False)
    params, x = make_params(), make_x()
    fast(params, x, 0.5)
    fast(params, x, 0.5)
    taken = routes_taken(fast)

    np.testing.assert_allclose(np.asarray(jax.jit(fast)(params, x, 0.5)), np.asarray(jax.jit(block)(params, x, 0.5)),
                               rtol=2e-5, atol=2e-5)
    grad_x = jax.grad(lambda x: jnp.sum(fast(params, x, 0.5) ** 2))(x)
    want_x = jax.grad(lambda x: jnp.sum(block(params, x, 0.5) ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad_x), np.asarray(want_x), rtol=1e-4, atol=1e-4)
    grad_p = jax.grad(lambda p: jnp.sum(fast(p, x, 0.5) ** 2))(params)
    want_p = jax.grad(lambda p: jnp.sum(block(p, x, 0.5) ** 2))(params)
    for name in params:
        np.testing.assert_allclose(np.asarray(grad_p[name]), np.asarray(want_p[name]), rtol=1e-4, atol=1e-4)
    assert routes_taken(fast) == taken


def test_nan_and_inf_inputs_pass_through_the_route():
    fast = eqsat.optimize(block, params_argnums=0, backend="xla", progress=False)
    params = make_params()
    fast(params, make_x(), 0.5)
    x = make_x().at[0, 0].set(jnp.nan).at[1, :].set(jnp.inf).at[2, :].set(0.0)
    got, want = fast(params, x, 0.5), jax.jit(block)(params, x, 0.5)
    assert routes_taken(fast) == 1
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=2e-5, atol=2e-5)


def test_pickled_functions_start_without_routes():
    import pickle

    fast = eqsat.optimize(block, params_argnums=0, backend="xla", progress=False)
    params, x = make_params(), make_x()
    fast(params, x, 0.5)
    copy = pickle.loads(pickle.dumps(fast))
    assert copy._leaf_routes == {}
    np.testing.assert_allclose(np.asarray(copy(params, x, 0.5)), np.asarray(fast(params, x, 0.5)), rtol=1e-6)


def test_static_arguments_are_part_of_the_route():
    def step(params, x, scale, *, steps, guided):
        out = block(params, x, scale)
        return out * steps if guided else out - steps

    fast = eqsat.optimize(step, params_argnums=0, backend="xla", static_argnames=("steps", "guided"), progress=False)
    params, x = make_params(), make_x()
    for steps, guided in [(3, True), (3, True), (5, True), (5, True), (3, False), (3, True)]:
        got = fast(params, x, 0.5, steps=steps, guided=guided)
        want = jax.jit(step, static_argnames=("steps", "guided"))(params, x, 0.5, steps=steps, guided=guided)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4)
    assert len(fast.lowerings) == 3
    assert routes_taken(fast) == 3  # the second (3, True), the second (5, True) and the last (3, True)


def test_a_route_keeps_the_weights_it_matched_while_another_call_prepares_others():
    """Between a route's match and its call another thread may prepare other weights; the call still
    runs with the prepared tensors of the weights it matched."""
    fast = eqsat.optimize(block, params_argnums=0, backend="xla", progress=False)
    params, other, x = make_params(), make_params(seed=4, offset=3.0), make_x()
    fast(params, x, 0.5)
    (route,) = fast._leaf_routes.values()
    leaves = jax.tree_util.tree_leaves(((params, x, 0.5), {}))
    values = route.prepared_values(leaves)
    assert values is not None
    fast(other, x, 0.5)  # the general path prepares the other weights
    assert route.prepared_values(leaves) is None
    got = route(leaves, values)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(block)(params, x, 0.5)), rtol=2e-5, atol=2e-5)
