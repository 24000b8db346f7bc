"""Random programs (the grammar of tests/test_fuzz.py) optimized and run through `backend="pallas"`
(interpret mode) and `backend="xla"`: both equal `jax.jit` of the program."""

from __future__ import annotations

import warnings

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings

import eqsat
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
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4,
                                           err_msg=f"backend={backend} steps={steps}")
