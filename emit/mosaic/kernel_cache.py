"""One jitted function per distinct Mosaic GPU kernel, so that equal kernels are lowered and compiled once.

`emit.pallas.emit_shared` shares a template's emission between plan kernels of one structure; kernels
of different structures can still make the same Mosaic kernel (the UNet's conv2 of a block with a
1x1 shortcut and of one without: the residual comes from another op, the kernel is the same), and
each would be traced, laid out, lowered to its own module and compiled by jaxlib, because its name
differs. `launch(run, operands, name)` traces `run(*operands)` (the template's kernel call) under
`jax.jit`, and keys it by its jaxpr's text with the kernel's name taken out, its constants and its
operands' types: a site whose kernel equals an earlier site's calls that site's jitted function, so
the outer trace holds one jaxpr for both and JAX lowers one Mosaic module for them, which carries
the first site's name (as `emit.pallas.shared_names` names shared Triton kernels).

A key is the whole traced kernel, not a summary of what built it: two kernels share a function only
where their programs are the same text with the same constants.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import jax
import numpy as np

CACHE_SIZE = 256  # kernels kept (a UNet's per-call stage has ~80 distinct ones); then it starts over
_functions: dict = {}
_first_names: dict = {}  # key -> the kernel name of the site that made its function
_served: dict[str, str] = {}  # kernel name -> the name of the kernel (module) it runs as


def served_name(name: str) -> str:
    """The kernel name whose module a site named `name` runs (its PTX entry's name): the first site
    with an equal kernel, `name` itself when it was the first (or never launched here)."""
    return _served.get(name, name)


def _constant(value) -> tuple:
    array = np.asarray(value)
    return array.dtype.str, array.shape, array.tobytes()


def launch(run: Callable, operands: Sequence, name: str, interpreted: bool = False):
    """`run(*operands)` through the jitted function of the first site with an equal kernel (its jaxpr
    equal up to the kernel `name`, the same constants and operand types). `interpreted` (GPU
    interpret mode only): run it as it is, unshared: the interpreted kernel is a host callback
    whose jaxpr does not show the kernel, so two different kernels would look equal."""
    if interpreted:
        return run(*operands)
    jitted = jax.jit(run)
    traced = jitted.trace(*operands)
    try:
        constants = tuple(_constant(c) for c in traced.jaxpr.consts)
    except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return jitted(*operands)  # a constant of an outer trace: no key for it, this site alone
    text = str(traced.jaxpr)
    key = (text.replace(name, "\0") if name else text, constants,
           tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(traced.in_avals)))
    if key not in _functions and len(_functions) >= CACHE_SIZE:
        _functions.clear()
        _first_names.clear()
    if name:
        _served[name] = _first_names.setdefault(key, name)
        _record(name, _served[name])
    return _functions.setdefault(key, jitted)(*operands)


def _record(name: str, served: str) -> None:
    """Where Mosaic GPU dumps its kernels' PTX (`MOSAIC_GPU_DUMP_TO`, `benchmarks.mosaic_ptx.dumping`,
    perhaps in a compile subprocess), note beside them which module each kernel name runs as."""
    directory = os.environ.get("MOSAIC_GPU_DUMP_TO")
    if directory and name != served:
        with open(os.path.join(directory, SERVED_FILE), "a") as out:
            out.write(f"{name}\t{served}\n")


SERVED_FILE = "eqsat-served-kernels.tsv"  # kernel name <tab> the kernel name whose module it runs
