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
