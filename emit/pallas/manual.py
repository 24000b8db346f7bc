"""Pallas kernels inside a `shard_map` with `check_vma=True` (a user's, or a plan's own).

Inside a `shard_map` every value says over which manual mesh axes it varies. A `pallas_call`
declares its results as varying over the axes any operand varies over (`varying_out_shapes`),
its operands are made to vary alike first (`pcast`), and on a CPU its interpreted form (jax's
HLO interpreter, which builds the kernel's grid loop out of gathers and scatters of index arrays
that vary over nothing) is lowered with the check off: the kernel is one device's program, as it
is when compiled by Triton. `interpreted(fn, operands, out_avals)` runs `fn(*operands)` that way.
"""

from __future__ import annotations

import jax
from jax._src import config, core
from jax._src.interpreters import mlir

_unchecked_p = core.Primitive("eqsat_per_device_kernel")
_unchecked_p.multiple_results = True


def manual_type(operands):
    """The `ManualAxisType` the operands vary over together (over none: invariant, as weights
    replicated into a `shard_map`), or None outside a `shard_map`."""
    varying = frozenset().union(*(jax.typeof(x).mat.varying for x in operands))
    if not varying and not jax.sharding.get_abstract_mesh().manual_axes:
        return None
    return core.ManualAxisType(varying=varying)


def vary_alike(operands, mat) -> list:
    """The operands cast to vary over every axis of `mat` (no communication: a type cast)."""
    cast = []
    for x in operands:
        missing = tuple(sorted(a for a in mat.varying if a not in jax.typeof(x).mat.varying))
        cast.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return cast


def interpreted(fn, operands, out_avals):
    """`fn(*operands)` (an interpreted `pallas_call`) bound as one primitive whose lowering runs
    with the vma check off; its results are `out_avals`."""
    return _unchecked_p.bind(*operands, fn=fn, out_avals=tuple(out_avals))


def _impl(*operands, fn, out_avals):
    return fn(*operands)


def _abstract_eval(*avals, fn, out_avals):
    return list(out_avals)


def _lowering(ctx, *operands, fn, out_avals):
    def per_device(avals):
        return [a.update(manual_axis_type=core.empty_mat) if isinstance(a, core.ShapedArray) else a for a in avals]

    ctx = ctx.replace(avals_in=per_device(ctx.avals_in), avals_out=per_device(ctx.avals_out))
    with config._check_vma(False):
        return mlir.lower_fun(lambda *xs: list(fn(*xs)), multiple_results=True)(ctx, *operands)


_unchecked_p.def_impl(_impl)
_unchecked_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_unchecked_p, _lowering)
