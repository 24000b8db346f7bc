"""Constant arrays that are a formula of their index, lifted as that formula instead of an array the
kernels load.

A causal attention mask written with NumPy (`np.triu(np.full((S, S), -inf), 1)`, as SD 1.5's CLIP
and transformers' CLIP build it) is captured by the trace as a constant: the attention kernel then
loads an `[S, S]` array per score tile, and with S = 77 its rows are 77 elements apart, so those
loads cannot be vector loads. As `select(j - i >= k, upper, lower)` over the index it costs one
comparison per score, reads nothing, and lets the template skip whole blocks below the diagonal.

`index_formula(array)` recognizes, over the last two axes (every leading axis of size 1):
- a triangle: `upper` where `j - i >= k`, `lower` elsewhere, for one offset `k` (`np.triu(full,
  k)`, `np.tril`, boolean masks, additive masks with `-inf` or `finfo.min`);
- a fill: one value everywhere (rank >= 1).
It returns the per-element `Expr` (built from `Iota`, `Lit` and `Select`), or None. Arrays under
`MIN_ELEMENTS` stay constants (a few loads), as do NaN-holding ones (a formula could not say which
NaN), complex and PRNG key arrays.
"""

from __future__ import annotations

import numpy as np

from eqsat.term import Term
from eqsat.types import format_type

MIN_ELEMENTS = 256
MAX_ELEMENTS = 1 << 26


def _ty(dtype, shape) -> str:
    return format_type(np.dtype(dtype), tuple(shape))


def _lit(value, dtype, shape) -> Term:
    return Term("Lit", float(value), _ty(dtype, shape))


def index_formula(array) -> Term | None:
    """The `Expr` equal to `array` at every index, or None (see the module docstring)."""
    if not isinstance(array, np.ndarray) or array.ndim == 0 or not MIN_ELEMENTS <= array.size <= MAX_ELEMENTS:
        return None
    if array.dtype.kind not in "biuf":
        return None
    if array.dtype.kind == "f" and np.isnan(array).any():
        return None
    if array.dtype.kind in "iu" and np.abs(array.astype(np.float64)).max() >= 2**53:
        return None  # a `Lit` holds a float64
    shape, dtype = array.shape, array.dtype
    first = array.flat[0]
    if (array == first).all():
        return _lit(first, dtype, shape)
    if array.ndim < 2 or any(n != 1 for n in shape[:-2]):
        return None
    plane = array.reshape(shape[-2:])
    values = np.unique(plane)
    if len(values) != 2:
        return None
    rows, columns = plane.shape
    for lower, upper in ((values[0], values[1]), (values[1], values[0])):
        is_upper = plane == upper
        starts = np.where(is_upper.any(axis=1), is_upper.argmax(axis=1), columns)
        inside = [(i, int(j)) for i, j in enumerate(starts) if 0 < j < columns]
        if not inside:
            continue
        i, j = inside[0]
        offset = j - i
        column, row = np.arange(columns)[None, :], np.arange(rows)[:, None]
        if not np.array_equal(is_upper, column - row >= offset):
            continue
        index_ty = _ty(np.int32, shape)
        distance = Term("Binary", "sub", Term("Iota", array.ndim - 1, index_ty), Term("Iota", array.ndim - 2, index_ty),
                        index_ty)
        above = Term("Binary", "ge", distance, _lit(offset, np.int32, shape), _ty(np.bool_, shape))
        return Term("Select", above, _lit(lower, dtype, shape), _lit(upper, dtype, shape), _ty(dtype, shape))
    return None
