"""Random programs (the grammar of tests/test_fuzz.py) optimized and run through `backend="pallas"`
(interpret mode) and `backend="xla"`: both equal `jax.jit` of the program within the fuzz campaign's
tolerance (`benchmarks.fuzz.compare`: rtol * max|want| + k * max|inputs| per dtype, a float64 run
arbitrating the rest), as `python -m benchmarks.fuzz` judges them."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eqsat
from benchmarks.fuzz import _float64_run, compare
from test_fuzz import programs


@settings(max_examples=10, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(programs())
def test_random_programs_run_the_same_on_every_backend(case):
    fn, args, steps = case
    with jax.default_matmul_precision("highest"):
        want = [np.asarray(v) for v in jax.jit(fn)(*args)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # saturation limits, kernels without a template
            lowered = eqsat.optimize(fn, time_limit=20.0).lower(*args)
            outputs = {backend: lowered.executable(backend)(*args) for backend in ("pallas", "xla")}
        for backend, got in outputs.items():
            problem = compare([np.asarray(g) for g in got], want, args, reference=_float64_run(fn, args))
            assert problem is None or problem[0] == "arbitrated", f"backend={backend} steps={steps}: {problem}"


def test_constant_rows_normalize_to_zero_beside_another_output():
    x = np.array([[141.8948] * 3, [-288.94873] * 3], np.float32)

    def normalized_and_exp(x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6), jnp.exp(-jnp.abs(x))

    lowered = eqsat.optimize(normalized_and_exp, progress=False, cache=False).lower(x)
    for backend in ("xla", "pallas"):
        np.testing.assert_array_equal(np.asarray(lowered.executable(backend)(x)[0]), np.zeros_like(x), err_msg=backend)


# --- constant rows through whole plans ---------------------------------------------------------------

CONSTANTS = st.one_of(st.sampled_from([141.8948, -288.94873, 1e6 + 0.5, 0.0]),
                      st.floats(-1e6, 1e6, width=32, allow_subnormal=False))


def _layer_norm(x, weight, bias):
    mean, var = jnp.mean(x, axis=-1, keepdims=True), jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * weight + bias


def _group_norm(x, weight, bias):
    """GroupNorm of channels-last x in groups of 3 channels."""
    b, h, w, c = x.shape
    g = x.reshape(b, h * w, c // 3, 3)
    mean, var = jnp.mean(g, axis=(1, 3), keepdims=True), jnp.var(g, axis=(1, 3), keepdims=True)
    return ((g - mean) * jax.lax.rsqrt(var + 1e-6)).reshape(x.shape) * weight + bias


def _constant_input(norm, width, values):
    """x whose every normalized row (LayerNorm) or group (GroupNorm) is one of `values`."""
    if norm == "layer":
        return np.repeat(np.asarray(values[:3], np.float32)[:, None], width, axis=1)
    per_group = np.asarray(values[:8], np.float32).reshape(2, 1, 4, 1)
    return np.broadcast_to(per_group, (2, 4, 4, 3)).reshape(2, 2, 2, 12).copy()


NORM_CASES = [("layer", 40, False), ("layer", 77, True), ("group", 12, False), ("group", 12, True)]
_lowered_norms: dict = {}


def _lowered_norm(norm, width, beside):
    """The plan of a LayerNorm over `width` or a GroupNorm (3 channels per group), alone or beside a
    second output (exp(-|x|)), lowered once per case."""
    key = (norm, width, beside)
    if key not in _lowered_norms:
        apply = _layer_norm if norm == "layer" else _group_norm

        def fn(x, weight, bias):
            out = apply(x, weight, bias)
            return (out, jnp.exp(-jnp.abs(x))) if beside else (out,)

        rng = np.random.default_rng(width)
        weight, bias = 1 + 0.1 * rng.normal(size=width), 0.1 * rng.normal(size=width)
        params = (weight.astype(np.float32), bias.astype(np.float32))
        x = _constant_input(norm, width, [141.8948] * 8)
        _lowered_norms[key] = fn, params, eqsat.optimize(fn, progress=False, cache=False).lower(x, *params)
    return _lowered_norms[key]


@pytest.mark.parametrize("norm,width,beside", NORM_CASES)
@settings(max_examples=6, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(CONSTANTS, min_size=8, max_size=8))
def test_constant_rows_normalize_to_their_bias(norm, width, beside, values):
    """Rows (LayerNorm over 40 or 77) or groups of 3 channels (GroupNorm) each holding one value far
    from zero: the Pallas plan's mean is exactly that value, so x - mean is 0 and the output is the
    bias exactly, alone or beside a second output; the XLA plan (whose mean is sum / n, as jnp.mean's,
    which may round) agrees with jax.jit."""
    fn, (weight, bias), lowered = _lowered_norm(norm, width, beside)
    x = _constant_input(norm, width, values)
    pallas = lowered.executable("pallas")(x, weight, bias)
    np.testing.assert_array_equal(np.asarray(pallas[0]), np.broadcast_to(bias, x.shape))
    want = [np.asarray(v) for v in jax.jit(fn)(x, weight, bias)]
    for backend, got in (("pallas", pallas), ("xla", lowered.executable("xla")(x, weight, bias))):
        problem = compare([np.asarray(g) for g in got], want, (x, weight, bias),
                          reference=_float64_run(fn, (x, weight, bias)))
        assert problem is None or problem[0] == "arbitrated", f"backend={backend}: {problem}"
