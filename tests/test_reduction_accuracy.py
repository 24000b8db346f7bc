"""Pallas reductions are no less accurate than `jax.jit`'s on data at an offset large against its
spread (what normalizations see): sums, means of squares and variances over long rows, long
columns and odd sizes, against a float64 reference."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import eqsat

ULP = float(np.finfo(np.float32).eps)

REDUCTIONS = {
    "sum": (lambda axis: lambda x: x.sum(axis), lambda x, axis: x.sum(axis)),
    "mean_of_squares": (lambda axis: lambda x: (x * x).mean(axis), lambda x, axis: (x * x).mean(axis)),
    "variance": (lambda axis: lambda x: x.var(axis), lambda x, axis: x.var(axis)),
}
SHAPES = [((2, 70_000), -1), ((70_000, 3), 0), ((8, 77, 40), (1, 2))]


@pytest.mark.parametrize("shape, axis", SHAPES)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_pallas_reductions_are_as_accurate_as_jit_at_an_offset(name, shape, axis):
    make, reference = REDUCTIONS[name]
    fn = make(axis)
    x = (300 + 0.05 * np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
    want = reference(x.astype(np.float64), axis)
    scale = np.abs(want).max()
    jit_error = np.abs(np.asarray(jax.jit(fn)(x), np.float64) - want).max() / scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = eqsat.optimize(fn, backend="pallas")(x)
    error = np.abs(np.asarray(got, np.float64) - want).max() / scale
    assert error <= jit_error + 2 * ULP, f"pallas {error:.2e} vs jit {jit_error:.2e}"
