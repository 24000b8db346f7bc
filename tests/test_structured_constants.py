"""`eqsat.structured_constants`: a constant that is a formula of its index (a causal mask, a fill) is
lifted as that formula. The formula equals the array at every index (evaluated by the reference
interpreter); anything else stays a constant; and the CLIP encoder's causal mask is computed inside
its attention kernels instead of loaded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eqsat
from eqsat.interpret import evaluate
from eqsat.structured_constants import MIN_ELEMENTS, index_formula
from eqsat.term import Term


def formula_value(array):
    body = index_formula(array)
    assert body is not None
    return np.asarray(evaluate([Term("Pointwise", body, body.ty)], {})[0])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 90), columns=st.integers(1, 90), offset=st.integers(-95, 95), lead=st.integers(0, 2),
       kind=st.sampled_from(["triu", "tril"]),
       values=st.sampled_from([(0.0, -np.inf), (0.0, float(np.finfo(np.float32).min)), (1.0, 0.0), (True, False),
                               (-7, 3), (0.0, -1e9)]))
def test_a_triangle_or_fill_is_its_formula(rows, columns, offset, lead, kind, values):
    inside, outside = values
    dtype = np.bool_ if isinstance(inside, bool) else np.int32 if isinstance(inside, int) else np.float32
    full = np.full((rows, columns), inside, dtype)
    plane = np.where(np.triu(np.ones((rows, columns), bool), offset) if kind == "triu" else
                     np.tril(np.ones((rows, columns), bool), offset), full, np.asarray(outside, dtype))
    array = plane.reshape((1,) * lead + plane.shape)
    body = index_formula(array)
    if array.size < MIN_ELEMENTS:
        assert body is None
        return
    assert body is not None  # a triangle, or one value everywhere when the offset leaves no edge
    got = formula_value(array)
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("array", [
    np.random.default_rng(0).standard_normal((20, 20)).astype(np.float32),  # no formula
    np.where(np.eye(20, dtype=bool), 1.0, 0.0).astype(np.float32),  # a diagonal band, not a triangle
    np.triu(np.ones((3, 16, 16), np.float32)),  # a leading axis of 3
    np.where(np.triu(np.ones((20, 20), bool), 1), np.nan, 0.0).astype(np.float32),  # NaN
    np.array([0, 1, 2] * 100, np.float32).reshape(20, 15),  # three values
    np.triu(np.full((8, 8), -np.inf, np.float32), 1),  # small: a few loads
    np.full((400,), 2**60, np.int64),  # not exact as a float64 literal
], ids=["random", "diagonal", "leading-3", "nan", "three-values", "small", "huge-int"])
def test_other_constants_stay_constants(array):
    assert index_formula(array) is None


def test_the_clip_causal_mask_is_computed_in_its_attention():
    from sd15 import clip

    bias = clip.causal_bias(77)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 77, 40)) * 3 + 50, jnp.float32) for _ in range(3))

    def attend(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(40) + bias
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)

    low = eqsat.optimize(attend, progress=False).lower(q, k, v)
    assert [kernel.term.op for kernel in low.plan.kernels] == ["Attention"]
    program_constants = [key for key in low.program.constants if key.startswith("const:")]
    assert program_constants == []  # the mask is no array
    for backend in ("xla", "pallas"):
        got = eqsat.optimize(attend, backend=backend, progress=False)(q, k, v)
        # Scores near 1.6e4 (inputs offset by 50): fp32 rounding of a logit is ~2e-3, so is the output's.
        np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(attend)(q, k, v)), rtol=2e-3, atol=1e-3)
