"""A scatter-add that puts one value per index at one position along one axis of each batch row,
lifted as a per-element expression instead of an `AssignScatter` kernel.

`jnp.take_along_axis(x, idx, axis)` gathers with every other axis a batching axis; its VJP is the
scatter-add of the cotangent into zeros at the same places. Integer-label cross-entropy losses
(`-take_along_axis(log_softmax(logits), labels[:, None], 1)`, optax's spelling) therefore put a
scatter in every classifier's backward pass, and no Pallas template covers a scatter (it would need
atomics, or a sort, for repeated indices). Each output element of such a scatter only compares its
own position with the few indices of its batch row:

    out[b, c] = target[b, c] + Σ_j [idx[b, j] == c] · upd[b, j]

a pointwise expression over the output, which the rule families then fuse with its neighbours
(the softmax backward). `one_hot_scatter_body` returns it, or None for any other scatter.

Also `x.at[jnp.arange(n), labels].add(u)` (the VJP of `x[jnp.arange(n), labels]`): one index column
per operand axis, all but one of them free of inputs (the lifter evaluates them) and together
enumerating the other axes' positions once in row-major order; those axes are then batching axes.

Recognized: `scatter-add` with no update window, one scattered operand axis `d`
(`inserted_window_dims == scatter_dims_to_operand_dims == (d,)`), every other operand axis a
batching axis, an index vector of length 1 in the indices' last axis, and at most `MAX_INDICES`
indices per batch row (the indices' remaining axes), unrolled. Modes: `FILL_OR_DROP` and
`PROMISE_IN_BOUNDS` drop an out-of-range index (it equals no position); `CLIP` clamps it first.
A position hit by several indices adds them in index order; where nothing hits, the target is
returned unchanged (`-0.0` stays `-0.0`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from jax import lax

from eqsat.term import Term
from eqsat.types import format_type, ints_key

MAX_INDICES = 16  # indices per batch row unrolled into the expression


def _ty(dtype, shape) -> str:
    return format_type(np.dtype(dtype), tuple(shape))


def one_hot_scatter_body(eqn, target: Term, indices: Term, updates: Term, constant_column=None) -> Term | None:
    """The per-element expression of `eqn` (a `scatter-add` equation) over `target`, `indices` and
    `updates` (the operands as `Expr` loads), or None when it is not of the recognized form.
    `constant_column(i)`: column `i` of the indices as a NumPy array when it depends on no input
    (else None), for the `x.at[jnp.arange(n), labels]` spelling (`_enumerated_rows`)."""
    if eqn.primitive.name != "scatter-add" or len(eqn.invars) != 3:
        return None
    params = eqn.params
    numbers = params.get("dimension_numbers")
    operand, index_atom, update_atom = eqn.invars
    shape = tuple(operand.aval.shape)
    index_shape = tuple(index_atom.aval.shape)
    if numbers is not None and constant_column is not None and len(index_shape) == 2 and index_shape[-1] > 1:
        return _enumerated_rows(eqn, target, indices, updates, constant_column)
    if numbers is None or not index_shape or index_shape[-1] != 1:
        return None
    if tuple(numbers.update_window_dims) or len(numbers.inserted_window_dims) != 1:
        return None
    (axis,) = numbers.inserted_window_dims
    if tuple(numbers.scatter_dims_to_operand_dims) != (axis,):
        return None
    batching = tuple(numbers.operand_batching_dims)
    if batching != tuple(i for i in range(len(shape)) if i != axis):
        return None
    index_batching = tuple(numbers.scatter_indices_batching_dims)
    row_axes = [i for i in range(len(index_shape) - 1) if i not in index_batching]  # the indices of one row
    if tuple(update_atom.aval.shape) != index_shape[:-1] or not np.issubdtype(index_atom.aval.dtype, np.integer):
        return None
    if math.prod(index_shape[i] for i in row_axes) > MAX_INDICES or 0 in shape:
        return None
    mode = params.get("mode")
    if mode not in (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS,
                    lax.GatherScatterMode.CLIP):
        return None

    dtype, index_dtype = operand.aval.dtype, index_atom.aval.dtype
    out_ty = _ty(dtype, shape)
    batch_shape = tuple(shape[i] for i in batching)
    # Batch axes first (in the operand's order), the row's axes next, the index vector last.
    order = list(index_batching) + row_axes + [len(index_shape) - 1]
    position = Term("Iota", axis, _ty(index_dtype, shape))

    def row_value(x: Term, x_shape: tuple, x_dtype, at: tuple, vector: bool) -> Term:
        """`x` at row position `at`, broadcast over the output (its batch axes to the operand's)."""
        axes = order if vector else order[:-1]
        for row_axis, j in zip(row_axes, at):
            sliced = list(x_shape)
            sliced[row_axis] = 1
            x = Term("Slice", x, row_axis, j, j + 1, 1, _ty(x_dtype, sliced))
            x_shape = tuple(sliced)
        if list(axes) != list(range(len(x_shape))):
            x_shape = tuple(x_shape[i] for i in axes)
            x = Term("Transpose", x, ints_key(axes), _ty(x_dtype, x_shape))
        if x_shape != batch_shape:
            x = Term("Reshape", x, _ty(x_dtype, batch_shape))
        return Term("Broadcast", x, ints_key(batching), _ty(x_dtype, shape))

    result = target
    for at in itertools.product(*(range(index_shape[i]) for i in row_axes)):
        index = row_value(indices, index_shape, index_dtype, at, vector=True)
        if mode == lax.GatherScatterMode.CLIP:
            index_ty = _ty(index_dtype, shape)
            index = Term("Binary", "min", Term("Binary", "max", index, Term("Lit", 0.0, index_ty), index_ty),
                         Term("Lit", float(shape[axis] - 1), index_ty), index_ty)
        hit = Term("Binary", "eq", index, position, _ty(np.bool_, shape))
        update = row_value(updates, index_shape[:-1], dtype, at, vector=False)
        result = Term("Select", hit, result, Term("Binary", "add", result, update, out_ty), out_ty)
    return result


def _enumerated_rows(eqn, target: Term, indices: Term, updates: Term, constant_column) -> Term | None:
    """`x.at[i_0, ..., i_{n-1}].add(u)` with one index array per operand axis, all but one of them
    constant and together enumerating every position of the other axes once, in row-major order
    (`x.at[jnp.arange(b), labels].add(u)`, the VJP of `x[jnp.arange(b), labels]`): the batched form
    above, with those axes as batching axes."""
    numbers = eqn.params["dimension_numbers"]
    operand, index_atom, update_atom = eqn.invars
    shape = tuple(operand.aval.shape)
    count, rank = index_atom.aval.shape
    all_axes = tuple(range(len(shape)))
    if (tuple(numbers.update_window_dims) or tuple(numbers.operand_batching_dims) or rank != len(shape)
            or tuple(sorted(numbers.inserted_window_dims)) != all_axes
            or sorted(numbers.scatter_dims_to_operand_dims) != list(all_axes)
            or tuple(update_atom.aval.shape) != (count,) or 0 in shape):
        return None
    if not np.issubdtype(index_atom.aval.dtype, np.integer):
        return None
    mode = eqn.params.get("mode")
    if mode not in (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS,
                    lax.GatherScatterMode.CLIP):
        return None
    column_of_axis = {axis: column for column, axis in enumerate(numbers.scatter_dims_to_operand_dims)}
    columns = {axis: constant_column(column_of_axis[axis]) for axis in all_axes}
    data_axes = [axis for axis in all_axes if columns[axis] is None]
    if len(data_axes) != 1:
        return None
    (axis,) = data_axes
    batching = tuple(a for a in all_axes if a != axis)
    batch_shape = tuple(shape[a] for a in batching)
    if math.prod(batch_shape) != count:
        return None
    enumeration = np.indices(batch_shape).reshape(len(batch_shape), -1)
    if not all(np.array_equal(np.asarray(columns[a]).reshape(-1), enumeration[k]) for k, a in enumerate(batching)):
        return None

    dtype, index_dtype = operand.aval.dtype, index_atom.aval.dtype
    out_ty = _ty(dtype, shape)
    column = column_of_axis[axis]
    index = Term("Slice", indices, 1, column, column + 1, 1, _ty(index_dtype, (count, 1)))
    index = Term("Broadcast", Term("Reshape", index, _ty(index_dtype, batch_shape)), ints_key(batching),
                 _ty(index_dtype, shape))
    if mode == lax.GatherScatterMode.CLIP:
        index_ty = _ty(index_dtype, shape)
        index = Term("Binary", "min", Term("Binary", "max", index, Term("Lit", 0.0, index_ty), index_ty),
                     Term("Lit", float(shape[axis] - 1), index_ty), index_ty)
    update = Term("Broadcast", Term("Reshape", updates, _ty(dtype, batch_shape)), ints_key(batching), out_ty)
    hit = Term("Binary", "eq", index, Term("Iota", axis, _ty(index_dtype, shape)), _ty(np.bool_, shape))
    return Term("Select", hit, target, Term("Binary", "add", target, update, out_ty), out_ty)
