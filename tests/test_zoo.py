"""The model zoo (`tests/zoo.py`: flax-, haiku- and equinox-style models, losses, gradients and
training steps in plain JAX) through `eqsat.optimize(fn, backend=...)` against `jax.jit(fn)`, one
test per (model, backend); Pallas runs in interpret mode on a CPU.

Every output leaf must match jit's in structure, shape and dtype, and in value within
`np.testing.assert_allclose(rtol=tol, atol=tol * max|jit|)`, `tol` keyed by the output's dtype,
everything under `jax.default_matmul_precision("highest")`, plus a float64 allowance: twice jit's
own largest distance from the same function run in float64 (jit's float32 result is not exact
either: offset rows through a norm lose ~log10(mean / spread) digits in any summation order, and an
optimized plan that sums in another order may be as far from the exact result as jit, on the other
side). On well-conditioned models the allowance is ~1e-7 of the output's scale; it is 0 for a
model marked `f64_reference=False` (random draws that change with the dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from zoo import BY_NAME, ZOO

BACKENDS = ("xla", "pallas")
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


def _leaves(tree):
    return jax.tree_util.tree_flatten(tree)


@functools.cache
def _args(name):
    return BY_NAME[name].make_args()


@functools.cache
def _jit_reference(name):
    model = BY_NAME[name]
    with jax.default_matmul_precision("highest"):
        return jax.jit(model.fn)(*_args(name))


@functools.cache
def _allowances(name):
    """Per output leaf: twice jit's largest distance from the function run in float64 (0 for a
    model marked `f64_reference=False`)."""
    model = BY_NAME[name]
    want, _ = _leaves(_jit_reference(name))
    if not model.f64_reference:
        return [0.0] * len(want)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        wide = jax.tree_util.tree_map(
            lambda a: np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating) else a, _args(name))
        exact, _ = _leaves(jax.jit(model.fn)(*wide))
        return [2.0 * float(np.max(np.abs(np.asarray(w, np.float64) - np.asarray(e, np.float64)), initial=0.0))
                for w, e in zip(want, exact)]


def _assert_matches_jit(name, got):
    want, want_tree = _leaves(_jit_reference(name))
    got, got_tree = _leaves(got)
    assert got_tree == want_tree, (got_tree, want_tree)
    for i, (g, w, allowance) in enumerate(zip(got, want, _allowances(name))):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if not jnp.issubdtype(want[i].dtype, jnp.floating):
            np.testing.assert_array_equal(g, w, err_msg=f"output leaf {i}")
            continue
        tol = TOLERANCE[jnp.dtype(want[i].dtype).name]
        scale = float(np.max(np.abs(w), initial=0.0)) or 1.0
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale + allowance,
                                   err_msg=f"output leaf {i} (scale {scale:.3g}, allowance {allowance:.3g})")


CASES = [pytest.param(model.name, backend, id=f"{model.name}-{backend}") for model in ZOO for backend in BACKENDS]


@pytest.mark.parametrize("name, backend", CASES)
def test_model_matches_jit(name, backend):
    model = BY_NAME[name]
    args = _args(name)
    with jax.default_matmul_precision("highest"):
        got = eqsat.optimize(model.fn, backend=backend)(*args)
    _assert_matches_jit(name, got)


def test_the_zoo_covers_each_style_and_dtype():
    names = [m.name for m in ZOO]
    assert len(set(names)) == len(names)
    for prefix in ("flax_", "hk_", "eqx_"):
        assert sum(n.startswith(prefix) for n in names) >= 3, prefix
    assert {m.dtype for m in ZOO} == {"float32", "float16"}
