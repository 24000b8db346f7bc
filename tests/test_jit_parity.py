"""`eqsat.optimize` takes what `jax.jit` takes: keyword arguments, `static_argnames`,
`donate_argnums`/`donate_argnames`, and rejects what it rejects, at once."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from eqsat.lift import lift
from eqsat.interpret import evaluate_program
from driver.optimize import DonationWarning


def affine(x, w, b=None, *, scale=1.0):
    y = x @ w
    if b is not None:
        y = y + b
    return jnp.tanh(y) * scale


def args(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32),
            rng.standard_normal((3,)).astype(np.float32))


def close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_keyword_arguments_are_dynamic_arguments_like_jit():
    x, w, b = args()
    fast, jitted = eqsat.optimize(affine), jax.jit(affine)
    close(fast(x=x, w=w), jitted(x=x, w=w))
    close(fast(x, w=w, b=b), jitted(x, w=w, b=b))
    close(fast(x, w, b, scale=np.float32(2.0)), jitted(x, w, b, scale=np.float32(2.0)))
    close(fast(w=w, x=x, scale=3.0), jitted(w=w, x=x, scale=3.0))
    lowered = fast.lower(x=x, w=w)
    assert fast.lower(w=w * 2, x=x + 1) is lowered              # same signature, order of keywords aside
    assert fast.lower(x, w) is not lowered                      # positional: another pytree, as in jit
    assert len(lowered.program.inputs) == 2
    close(lowered(x=x, w=w), affine(x, w))
    close(lowered.plan.evaluate(x=x, w=w), affine(x, w))


def test_lift_and_the_interpreter_take_keyword_arguments():
    x, w, b = args()
    program = lift(affine, x, kwargs={"w": w, "b": b, "scale": 0.5}, static_argnames=("scale",))
    assert len(program.inputs) == 3
    close(evaluate_program(program, x, w=w, b=b, scale=0.5), affine(x, w, b, scale=0.5))
    close(evaluate_program(program, x, w=w, b=b), affine(x, w, b, scale=0.5))   # statics may be left out
    with pytest.raises(TypeError, match="do not match"):
        evaluate_program(program, x, w, b)


def test_static_argnames_and_static_argnums_name_each_other():
    calls = []

    def power(x, n, *, times=1):
        calls.append((n, times))
        for _ in range(n * times):
            x = jnp.sin(x)
        return x

    x = np.linspace(-1, 1, 8, dtype=np.float32)
    by_name = eqsat.optimize(power, static_argnames=("n", "times"))
    close(by_name(x, 2), jax.jit(power, static_argnames=("n", "times"))(x, 2))
    close(by_name(x, n=2), power(x, 2))
    close(by_name(x, n=1, times=3), power(x, 3))
    assert by_name.lower(x, n=2) is by_name.lower(x, n=2)
    assert by_name.lower(x, n=2) is not by_name.lower(x, n=3)
    by_number = eqsat.optimize(power, static_argnums=1)
    close(by_number(x, n=2), power(x, 2))                       # n inferred static from its position
    close(by_number(x, 2), power(x, 2))
    with pytest.raises(ValueError, match="static_argnums"):
        eqsat.optimize(power, static_argnums=5)
    with pytest.raises(ValueError, match="static_argnames"):
        eqsat.optimize(power, static_argnames="missing")


def test_optimize_of_a_non_callable_fails_at_once_like_jit():
    with pytest.raises(TypeError, match="callable"):
        jax.jit(42)
    with pytest.raises(TypeError, match="callable"):
        eqsat.optimize(42)
    with pytest.raises(TypeError, match="callable"):
        eqsat.optimize(static_argnums=0)("not a function")


def sgd(params, grads, *, lr=0.1):
    return jax.tree_util.tree_map(lambda p, g: p - lr * jnp.tanh(g), params, grads)


def test_donated_buffers_are_donated_by_the_jitted_plan():
    def fresh():
        x, w, _ = args()
        return {"x": jnp.asarray(x), "w": jnp.asarray(w)}, {"x": jnp.asarray(x * 2), "w": jnp.asarray(w * 2)}

    params, grads = fresh()
    want = sgd(params, grads)
    fast = eqsat.optimize(sgd, donate_argnums=0, backend="xla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(fast(params, grads), want)
    assert all(p.is_deleted() for p in params.values()) and not any(g.is_deleted() for g in grads.values())
    jitted_params, _ = fresh()
    jax.jit(sgd, donate_argnums=0)(jitted_params, grads)          # jit does the same
    assert all(p.is_deleted() for p in jitted_params.values())
    params, grads = fresh()
    by_name = eqsat.optimize(sgd, donate_argnames="grads", backend="xla")
    assert by_name.donate_argnums == (1,) and by_name.donate_argnames == ("grads",)
    close(by_name(params, grads=grads), want)
    assert all(g.is_deleted() for g in grads.values()) and not any(p.is_deleted() for p in params.values())
    with pytest.raises(ValueError):
        eqsat.optimize(affine, donate_argnums=0, static_argnums=0)


def test_the_interpreter_says_once_that_it_cannot_donate():
    x, w, b = args()
    fast = eqsat.optimize(affine, donate_argnums=0, backend="interpret")
    with pytest.warns(DonationWarning, match=r"donate_argnums=\(0,\).*not donated"):
        close(fast(x, w), affine(x, w))
    np.testing.assert_array_equal(x, args()[0])                # the buffer is still valid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(x, w)                                              # said once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqsat.optimize(affine, donate_argnums=2, backend="interpret")(x, w)  # nothing donated: nothing to say


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_an_optimized_function_runs_inside_jit_which_decides_donation(backend):
    x, w, b = args()
    fast = eqsat.optimize(affine, donate_argnums=0, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DonationWarning)  # the outer jit decides
        outer = jax.jit(lambda x, w: fast(x, w) * 2)
        close(outer(x, w), affine(x, w) * 2)


def test_an_unhashable_static_argument_is_refused_like_jit():
    def scale(x, factors):
        return x * len(factors)

    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        jax.jit(scale, static_argnums=1)(x, [1, 2])
    with pytest.raises(ValueError, match="Non-hashable static arguments.*list"):
        eqsat.optimize(scale, static_argnums=1)(x, [1, 2])
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        eqsat.optimize(scale, static_argnames="factors")(x, factors={"a": 1})
    close(eqsat.optimize(scale, static_argnums=1, backend="xla")(x, (1, 2)), x * 2)


def test_a_wrapped_jit_keeps_its_static_and_donated_arguments():
    jitted = jax.jit(sgd, donate_argnums=0)
    fast = eqsat.optimize(jitted, backend="xla")
    assert fast.donate_argnums == (0,) and fast.donate_argnames == ("params",)
    x, w, _ = args()
    params, grads = {"x": jnp.asarray(x), "w": jnp.asarray(w)}, {"x": jnp.asarray(x * 2), "w": jnp.asarray(w * 2)}
    want = sgd(params, grads)
    close(fast(params, grads), want)
    assert all(p.is_deleted() for p in params.values()) and not any(g.is_deleted() for g in grads.values())
    assert eqsat.optimize(jitted, donate_argnums=()).donate_argnums == ()   # the caller's choice wins

    def power(x, n):
        for _ in range(n):
            x = jnp.sin(x)
        return x

    static = eqsat.optimize(jax.jit(power, static_argnums=1), backend="xla")
    assert static.static_argnums == (1,)
    close(static(x, 2), power(x, 2))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_known_signature_is_dispatched_by_jit_without_python_planning(backend, monkeypatch):
    """Like a jitted function, a call with a signature seen before goes straight to the compiled
    executable (jax.jit's C++ dispatch): no signature hashing, lowering or emission in Python."""
    fast = eqsat.optimize(affine, backend=backend)
    x, w = np.ones((4, 3), np.float32), np.full((3, 2), 0.5, np.float32)
    entered = []
    original = type(fast)._call
    monkeypatch.setattr(type(fast), "_call", lambda self, *a, **k: entered.append(1) or original(self, *a, **k))
    first = fast(x, w)
    again = fast(x + 1, w)
    np.testing.assert_allclose(again, jax.jit(affine)(x + 1, w), rtol=1e-6)
    np.testing.assert_allclose(first, jax.jit(affine)(x, w), rtol=1e-6)
    assert len(entered) == 1 and len(fast.lowerings) == 1
    fast(np.ones((5, 3), np.float32), w)  # a new shape: traced, planned again
    assert len(entered) == 2 and len(fast.lowerings) == 2
