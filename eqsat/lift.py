"""Lifting jaxprs to terms: the naive plan, one kernel per primitive.

`lift(fn, *args)` traces `fn` with `jax.make_jaxpr` (arguments may be `ShapeDtypeStruct`s) and
`lift_jaxpr(closed_jaxpr)` turns the jaxpr into a `Program` (`eqsat.program`). Equations are
visited in order, iteratively; only nested jaxprs (calls, loop bodies) recurse, one level per
nesting. Every primitive becomes one kernel Tensor term reading its operands through `Load`:

| primitive(s)                                  | term                                                  |
|-----------------------------------------------|-------------------------------------------------------|
| elementwise unary (`UNARY_OPS`), `convert_element_type`, `integer_pow`, `round`, `reduce_precision` | `Pointwise(Unary(op, x, ty), ty)` |
| elementwise binary (`BINARY_OPS`, `add_any`)  | `Pointwise(Binary(op, x, y, ty), ty)`                 |
| `select_n`                                    | `Pointwise(Select(...))`; n > 2 cases nest on `lt`   |
| `clamp`                                       | `Pointwise(Binary("min", Binary("max", x, lo), hi))`  |
| `broadcast_in_dim` / `reshape`, `squeeze`, `expand_dims` / `transpose` | `Pointwise(Broadcast / Reshape / Transpose(...))` |
| `slice`, `dynamic_slice`                      | `Pointwise(...)` over a chain of one-axis `Slice` / `DynamicSlice` |
| `rev`                                         | `Pointwise(...)` over one-axis `Slice(x, a, n-1, -1, -1)` (stride -1) |
| `concatenate`, `stack`, `tile`                | `Pointwise(...)` over left-nested binary `Concat`     |
| `pad` / `iota` / `split`, `unstack`           | `Pointwise(Pad / Iota / Slice(...))`                  |
| `copy`, `copy_p`                              | `Pointwise(Load(x))` (a copy kernel)                  |
| `reduce_sum/max/min/prod/and/or/xor`, `argmax/argmin` | `Reduce(op, Load(x), axes, Acc(ty), ty)`      |
| `dot_general`                                 | `Matmul(Load(a), Load(b), "lc;rc;lb;rb", Acc(ty), ty)` |
| `conv_general_dilated`                        | `Conv(Load(x), Load(w), ConvParams.key, Acc(ty), ty)` |
| `gather` / `scatter*`                         | `Gather` / `AssignScatter`; payload `(primitive, params)`; a batched one-hot `scatter-add` (take_along_axis's VJP) is `Pointwise` (`eqsat.one_hot_scatter`) |
| `dynamic_update_slice`                        | `AssignStatic` (literal starts) / `AssignDynamic`     |
| `jit`, `pjit`, `closed_call`, `core_call`, `custom_jvp_call`, `custom_vjp_call`, `remat2`/`checkpoint` | inlined |
| `scan`, `while`, `cond`                       | one `Loop(key, operands, body, i, ty)` per output     |
| `new_ref`, `get`, `swap`, `addupdate`, `freeze` | versioned values (see below)                        |
| `optimization_barrier`, `pvary`, `sharding_constraint`, ... | the operands themselves (no kernel)       |
| anything else                                 | `Opaque(key, operands, i, ty)`, payload `(primitive, params)`, one warning per primitive |

Types: JAX PRNG key arrays keep their key type (`key<fry>[4]`, `eqsat.types`); they flow through
views, loops and calls like any array, and the `random_*` primitives (and `threefry2x32`) are
`Opaque`, so results equal `jax.jit`'s bit for bit. Equations on complex values are `Opaque` (with
a warning) unless they only route values (calls, loops, refs): terms and rules assume real
arithmetic.

Operands: a jaxpr scalar literal is `Lit(value, ty)` splatted to the shape the op needs. Elementwise
primitives broadcast implicitly (since jax 0.10): a rank-0 operand is `Broadcast(Load(x), "", ty)`
and an equal-rank operand with size-1 axes is `Broadcast(Load(x), "0,1,..", ty)` (`broadcast_in_dim`
semantics: size-1 operand axes expand). Array constants are
`Constant(key, ty)` (`Program.constants`); where an op needs a Tensor (loop operands, assignment
starts, opaque operands) a scalar literal is a `Constant` too.

Loops (`Program.payloads[key]` is a dict; `LoopArg(key, i, ty)` is the loop's i-th operand, a
scanned operand's per-step slice for `xs`):

- scan: operands = consts + carries + xs; body = carries out + ys (refs: see below);
  payload `{"kind": "scan", "length", "reverse", "unroll", "num_consts", "num_carry", "num_xs"}`;
  outputs = final carries then stacked ys.
- while: operands = consts (cond's then body's) + carries; body = [predicate] + carries out, the
  predicate (a `bool[]` Tensor) evaluated on the same LoopArgs before each step;
  payload `{"kind": "while", "num_consts", "num_carry"}`; outputs = final carries.
- cond: operands = [index] + ops; body = branch 0's results, then branch 1's, ...;
  payload `{"kind": "cond", "num_branches", "num_outputs"}`; outputs = the taken branch's results.

JAX refs are functionalized: a ref is a cell holding its current version (a Tensor). A write makes a
new version (`AssignStatic` for static boxes, `AssignDynamic` for dynamic starts, the value itself
for a full overwrite; `addupdate` writes `old + value`); a read is a `Pointwise` of a `Slice` /
`DynamicSlice` chain over the current version (a full read is the version itself). Indices follow
the lowering's semantics: negative integer indices wrap once, then starts clamp. Refs a loop body
touches become extra carries appended after the loop's own carries (scan/while: in operands, body and
outputs, before any xs/ys; counted in `num_carry`) or extra operands and results after each
branch's own (cond; counted in `num_outputs`), and the final version flows out. Ref accesses with array or strided dynamic
indexers become `Opaque` with a `RefDischarge` stand-in primitive that runs JAX's discharge rule.

Effects (`jax.debug.print`, `jax.debug.callback`, `io_callback`, any equation whose effects are
not ref effects) are never dropped and run in program order: the program threads a "world" token
(a `bool[]` Tensor, starting as a constant) through them like a ref. An effectful equation is
`Opaque(key, operands + [token], i, ty)` whose payload primitive is `EffectCall(primitive)`; its
last result is the next token. Loops and branches with effects in their bodies carry the token as
one more ref (a `while` whose predicate has effects stays one effectful `Opaque`). The last token
is one more program output (`Program.effect_outputs`), so extraction always computes it.

Component paths: `Program.components[kernel]` is the `/`-joined `jax.named_scope` names of the
equation that made it (enclosing call equations included, transforms such as `jvp()` and jit
wrappers dropped), e.g. `"down_blocks.0/down_blocks.0.resnets.1"`; `""` outside any scope.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import warnings
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

import jax
from jax._src import core
from jax._src import source_info_util

from eqsat.conv_params import conv_params_key
from eqsat.one_hot_scatter import one_hot_scatter_body
from eqsat.ops import (BINARY_OPS, CONVERT, PARAMETRIC_UNARY_OPS, REDUCE_OPS, UNARY_OPS,  # noqa: F401 (the
                       apply_binary, apply_reduce, apply_unary)                          # vocabulary, from here as before)
from eqsat.program import Program
from eqsat.structured_constants import index_formula
from eqsat.term import Term, tensor_list
from eqsat.types import dtype_name, format_type, ints_key, is_key

_REDUCE_PRIMITIVES = {
    "reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
    "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor", "argmax": "argmax", "argmin": "argmin",
}
_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                      "custom_vjp_call_jaxpr", "remat2", "checkpoint", "remat"})
_IDENTITIES = frozenset({"stop_gradient", "optimization_barrier", "pvary", "sharding_constraint", "mesh_cast", "reshard",
                         "pbroadcast", "name"})


class LiftError(NotImplementedError):
    """A jaxpr this lifter cannot represent at all (not even as `Opaque`)."""


class OpaqueWarning(UserWarning):
    """A primitive was lifted as an `Opaque` kernel: it runs, but nothing fuses with it."""


class RefDischarge:
    """Stand-in primitive for ref accesses no Slice/Assign term covers (array or strided dynamic
    indexers): `bind` runs JAX's discharge rule on the current version.

    get: `bind(x, *idx, tree) -> value`; swap: `bind(x, value, *idx, tree) -> [old, new x]`;
    addupdate: `bind(x, value, *idx, tree) -> new x`.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"{kind}_discharged"
        self.multiple_results = kind == "swap"

    def bind(self, x, *args, tree):
        from jax._src.state import discharge

        if self.kind == "get":
            return discharge._get_discharge(x, args, tree)
        value, *idx = args
        if self.kind == "swap":
            old, new = discharge._swap_discharge(x, value, idx, tree)
            return [old, new]
        return discharge._addupdate_discharge(x, value, idx, tree)

    def __repr__(self) -> str:
        return f"RefDischarge({self.kind!r})"


REF_DISCHARGE = {kind: RefDischarge(kind) for kind in ("get", "swap", "addupdate")}


class EffectCall:
    """Stand-in primitive for an effectful equation: `bind(*operands, token, **params)` runs the
    original primitive on the operands and returns its results followed by the token, so that an
    effect runs after the effects its token comes from (program order)."""

    multiple_results = True

    def __init__(self, primitive):
        self.primitive = primitive
        self.name = primitive.name

    def bind(self, *args, **params):
        *operands, token = args
        out = self.primitive.bind(*operands, **params)
        return [*(out if self.primitive.multiple_results else [out]), token]

    def __repr__(self) -> str:
        return f"EffectCall({self.name!r})"


def world_effects(effects) -> list:
    """The effects of an equation that must run in program order: all but those of refs (which the
    lift functionalizes) and of named axes."""
    from jax._src import effects as jax_effects

    ignored = (jax_effects.JaxprInputEffect, core.InternalMutableArrayEffect, core.NamedAxisEffect)
    return [effect for effect in effects if not isinstance(effect, ignored)]


WORLD_TYPE = "bool[]"


@lru_cache(maxsize=None)
def _type_text(dtype_name: str, shape: tuple[int, ...]) -> str:
    return format_type(dtype_name, shape)


def _ty(aval) -> str:
    try:
        return _type_text(dtype_name(aval.dtype), tuple(int(d) for d in aval.shape))
    except (TypeError, ValueError) as error:
        raise LiftError(f"unsupported value type {aval}: {error}") from None


def _ty_of(dtype, shape) -> str:
    return _type_text(dtype_name(dtype), tuple(int(d) for d in shape))


def _inner_aval(aval):
    return getattr(aval, "inner_aval", aval)


class _RefCell:
    """A JAX ref during lifting: its current version."""

    __slots__ = ("version",)

    def __init__(self, version: Term):
        self.version = version


_HANDLERS: dict[str, Callable] = {}
_KEYS = itertools.count()


def _handles(*names: str):
    def register(function):
        for name in names:
            _HANDLERS[name] = function
        return function
    return register


class _Lifter:
    def __init__(self):
        self.constants: dict[str, np.ndarray] = {}
        self.payloads: dict[str, object] = {}
        self.components: dict[Term, str] = {}
        self.warnings: list[str] = []
        self.unfused: dict[str, list[str]] = {}  # why -> primitives, for the one OpaqueWarning of a lift
        self._constant_keys: dict[int, str] = {}
        self._constant_arrays: list[object] = []  # keeps ids stable
        self._warned: set[str] = set()
        self._paths: dict[tuple, tuple[tuple[str, ...], str]] = {}
        self.env: dict = {}
        self.scopes: tuple[str, ...] = ()
        self.path = ""
        self.world = _RefCell(None)  # the effect token, threaded like a ref; None until an effect

    # --- running a jaxpr ----------------------------------------------------------------------

    def run(self, jaxpr: core.Jaxpr, consts, in_values, scopes: tuple[str, ...]) -> list:
        """Lift `jaxpr`'s equations with `in_values` bound to its invars; returns its outputs."""
        saved = (self.env, self.scopes, self.path)
        env: dict = {}
        self.env = env
        for var, const in zip(jaxpr.constvars, consts):
            formula = index_formula(const)  # a causal mask, a fill: computed where it is read
            env[var] = self.constant(const) if formula is None else self.pointwise(formula)
        if len(jaxpr.invars) != len(in_values):
            raise LiftError(f"{len(jaxpr.invars)} invars, {len(in_values)} values")
        for var, value in zip(jaxpr.invars, in_values):
            env[var] = value
        for eqn in jaxpr.eqns:
            self.scopes, self.path = self._scopes(scopes, eqn.source_info.name_stack)
            name = eqn.primitive.name
            handler = _HANDLERS.get(name)
            if handler is None:
                handler = _Lifter._scatter if name.startswith("scatter") else _Lifter._opaque
            if eqn.effects and handler not in _EFFECT_AWARE and world_effects(eqn.effects):
                handler = _Lifter._effectful
            elif handler not in _ANY_DTYPE and _touches_complex(eqn):
                handler = _Lifter._opaque
            outs = handler(self, eqn)
            for var, out in zip(eqn.outvars, outs):
                if not isinstance(var, core.DropVar):
                    env[var] = out
        results = [self.value(var) for var in jaxpr.outvars]
        self.env, self.scopes, self.path = saved
        return results

    def run_inside(self, jaxpr: core.Jaxpr, consts, in_values, inner_cells: dict) -> list:
        """`run` for a loop body or branch: the world token is its inner cell if it has one."""
        outer = self.world
        self.world = inner_cells.get(id(outer), outer)
        try:
            return self.run(jaxpr, consts, in_values, self.scopes)
        finally:
            self.world = outer

    def world_cells(self, eqn) -> list[_RefCell]:
        """`[self.world]` when `eqn` (a loop or branch) has effects to run in order, else `[]`."""
        if not world_effects(eqn.effects):
            return []
        self._start_world()
        return [self.world]

    def _start_world(self) -> None:
        if self.world.version is None:
            self.world.version = self.scalar_constant(np.zeros((), np.bool_))

    def _scopes(self, outer: tuple[str, ...], name_stack) -> tuple[tuple[str, ...], str]:
        key = (outer, name_stack)
        found = self._paths.get(key)
        if found is None:
            inner = tuple(s.name for s in name_stack.stack if isinstance(s, source_info_util.Scope))
            scopes = outer + inner
            found = self._paths[key] = (scopes, "/".join(scopes))
        return found

    # --- operands -----------------------------------------------------------------------------

    def value(self, atom):
        """A Tensor term (or a ref cell) for `atom`."""
        if isinstance(atom, core.Literal):
            return self.literal_tensor(atom)
        return self.env[atom]

    def tensor(self, atom) -> Term:
        value = self.value(atom)
        if isinstance(value, _RefCell):
            raise LiftError(f"a ref used as an array operand: {atom}")
        return value

    def expr(self, atom, shape=None) -> Term:
        """`atom` read at the current index, broadcast from rank 0 to `shape` if given."""
        aval = atom.aval
        target = aval.shape if shape is None else tuple(shape)
        if isinstance(atom, core.Literal) and np.ndim(atom.val) == 0:
            return Term("Lit", float(np.asarray(atom.val)), _ty_of(aval.dtype, target))
        tensor = self.tensor(atom)
        load = Term("Load", tensor, tensor.ty)
        if tuple(target) != tuple(aval.shape):
            # Elementwise primitives broadcast rank-0 operands and, since jax 0.10, size-1 axes
            # of equal-rank operands: both are a `broadcast_in_dim`.
            if aval.shape == ():
                dims = ""
            elif len(aval.shape) == len(target) and all(d in (1, t) for d, t in zip(aval.shape, target)):
                dims = ints_key(range(len(target)))
            else:
                raise LiftError(f"operand of shape {aval.shape} used at shape {target}")
            load = Term("Broadcast", load, dims, _ty_of(aval.dtype, target))
        return load

    def constant(self, array) -> Term:
        """`Constant` keyed by content (equal arrays share a key, in any program)."""
        key = self._constant_keys.get(id(array))
        if key is None:
            if is_key(dtype_name(array.dtype)):  # a PRNG key array stays a key array (its data hashed)
                host, data = array, np.asarray(jax.random.key_data(array))
            else:
                host = data = np.asarray(array)
            digest = hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()
            key = f"const:{_ty_of(host.dtype, host.shape)}:{digest}"
            self._constant_keys[id(array)] = key
            self._constant_arrays.append(array)
            self.constants[key] = host
        return Term("Constant", key, _ty_of(self.constants[key].dtype, self.constants[key].shape))

    def literal_tensor(self, atom) -> Term:
        value = np.asarray(atom.val, dtype=atom.aval.dtype)
        return self.scalar_constant(value)

    def scalar_constant(self, value: np.ndarray) -> Term:
        if value.ndim:
            return self.constant(value)
        key = f"scalar:{value.dtype.name}:{value.item()!r}"
        self.constants.setdefault(key, value)
        return Term("Constant", key, _ty_of(value.dtype, ()))

    # --- kernels ------------------------------------------------------------------------------

    def kernel(self, term: Term) -> Term:
        self.components.setdefault(term, self.path)
        return term

    def pointwise(self, body: Term) -> Term:
        return self.kernel(Term("Pointwise", body, body.ty))

    def fresh_key(self, kind: str) -> str:
        """A payload key unique in the process: terms are interned globally, so two programs must
        never share a `Loop`/`LoopArg`/`Gather`/`Opaque` key with different meanings."""
        return f"{kind}{next(_KEYS)}"

    # --- elementwise --------------------------------------------------------------------------

    @_handles(*UNARY_OPS)
    def _unary(self, eqn):
        out = eqn.outvars[0].aval
        ty = _ty(out)
        return [self.pointwise(Term("Unary", eqn.primitive.name, self.expr(eqn.invars[0], out.shape), ty))]

    @_handles("convert_element_type", "integer_pow", "round", "reduce_precision")
    def _parametric_unary(self, eqn):
        out = eqn.outvars[0].aval
        ty = _ty(out)
        name, params = eqn.primitive.name, eqn.params
        if name == "convert_element_type":
            op = CONVERT
        elif name == "integer_pow":
            op = f"integer_pow:{int(params['y'])}"
        elif name == "round":
            op = f"round:{int(params['rounding_method'])}"
        else:
            op = f"reduce_precision:{int(params['exponent_bits'])},{int(params['mantissa_bits'])}"
        return [self.pointwise(Term("Unary", op, self.expr(eqn.invars[0], out.shape), ty))]

    @_handles(*BINARY_OPS, "add_any")
    def _binary(self, eqn):
        out = eqn.outvars[0].aval
        ty = _ty(out)
        x, y = (self.expr(atom, out.shape) for atom in eqn.invars)
        op = "add" if eqn.primitive.name == "add_any" else eqn.primitive.name  # add_any: autodiff's add
        return [self.pointwise(Term("Binary", op, x, y, ty))]

    @_handles("select_n")
    def _select_n(self, eqn):
        out = eqn.outvars[0].aval
        ty = _ty(out)
        pred_atom, *case_atoms = eqn.invars
        pred = self.expr(pred_atom, out.shape)
        cases = [self.expr(atom, out.shape) for atom in case_atoms]
        if len(cases) == 1:
            return [self.pointwise(cases[0])]
        if len(cases) == 2:
            return [self.pointwise(Term("Select", pred, cases[0], cases[1], ty))]
        pred_ty = _ty_of(pred_atom.aval.dtype, out.shape)
        bool_ty = _ty_of(np.bool_, out.shape)
        result = cases[-1]
        for k in range(len(cases) - 2, -1, -1):  # select_n(p, c0..cn) = p < k+1 ? c_k : (...)
            below = Term("Binary", "lt", pred, Term("Lit", float(k + 1), pred_ty), bool_ty)
            result = Term("Select", below, result, cases[k], ty)
        return [self.pointwise(result)]

    @_handles("clamp")
    def _clamp(self, eqn):
        out = eqn.outvars[0].aval
        ty = _ty(out)
        lo, x, hi = (self.expr(atom, out.shape) for atom in eqn.invars)
        return [self.pointwise(Term("Binary", "min", Term("Binary", "max", x, lo, ty), hi, ty))]

    @_handles("copy", "copy_p")
    def _copy(self, eqn):
        return [self.pointwise(self.expr(eqn.invars[0]))]

    @_handles(*_IDENTITIES)
    def _identity(self, eqn):
        return [self.value(atom) for atom in eqn.invars]

    # --- views --------------------------------------------------------------------------------

    @_handles("broadcast_in_dim")
    def _broadcast_in_dim(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        x = self.expr(eqn.invars[0])
        return [self.pointwise(Term("Broadcast", x, ints_key(eqn.params["broadcast_dimensions"]), ty))]

    @_handles("reshape")
    def _reshape(self, eqn):
        atom = eqn.invars[0]
        x = self.expr(atom)
        dimensions = eqn.params.get("dimensions")
        if dimensions is not None and tuple(dimensions) != tuple(range(len(atom.aval.shape))):
            shape = tuple(atom.aval.shape[d] for d in dimensions)
            x = Term("Transpose", x, ints_key(dimensions), _ty_of(atom.aval.dtype, shape))
        return [self.pointwise(Term("Reshape", x, _ty(eqn.outvars[0].aval)))]

    @_handles("squeeze", "expand_dims")
    def _squeeze(self, eqn):
        return [self.pointwise(Term("Reshape", self.expr(eqn.invars[0]), _ty(eqn.outvars[0].aval)))]

    @_handles("transpose")
    def _transpose(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        return [self.pointwise(Term("Transpose", self.expr(eqn.invars[0]), ints_key(eqn.params["permutation"]), ty))]

    @_handles("slice")
    def _slice(self, eqn):
        atom = eqn.invars[0]
        params = eqn.params
        strides = params["strides"] or (1,) * len(atom.aval.shape)
        x = self.expr(atom)
        shape = list(atom.aval.shape)
        for axis, (start, stop, stride) in enumerate(zip(params["start_indices"], params["limit_indices"], strides)):
            x, shape = _slice_axis(x, shape, atom.aval.dtype, axis, int(start), int(stop), int(stride))
        return [self.pointwise(x)]

    @_handles("rev")
    def _rev(self, eqn):
        atom = eqn.invars[0]
        shape = atom.aval.shape
        axes = [int(axis) for axis in eqn.params["dimensions"] if shape[axis] > 1]  # one element: the identity
        if not axes:
            return [self.tensor(atom)]
        x = self.expr(atom)
        for axis in axes:
            x = Term("Slice", x, axis, shape[axis] - 1, -1, -1, x.ty)
        return [self.pointwise(x)]

    @_handles("dynamic_slice")
    def _dynamic_slice(self, eqn):
        atom, *start_atoms = eqn.invars
        sizes = eqn.params["slice_sizes"]
        dtype = atom.aval.dtype
        x = self.expr(atom)
        shape = list(atom.aval.shape)
        for axis, (start_atom, size) in enumerate(zip(start_atoms, sizes)):
            size = int(size)
            if size == shape[axis]:
                continue  # the start clamps to 0
            if isinstance(start_atom, core.Literal):
                start = min(max(int(start_atom.val), 0), shape[axis] - size)
                x, shape = _slice_axis(x, shape, dtype, axis, start, start + size, 1)
            else:
                shape[axis] = size
                x = Term("DynamicSlice", x, axis, self.expr(start_atom), size, _ty_of(dtype, shape))
        return [self.pointwise(x)]

    @_handles("dynamic_update_slice")
    def _dynamic_update_slice(self, eqn):
        operand, update, *start_atoms = eqn.invars
        ty = _ty(eqn.outvars[0].aval)
        target = self.tensor(operand)
        value = self.expr(update)
        if all(isinstance(atom, core.Literal) for atom in start_atoms):
            starts = [min(max(int(atom.val), 0), dim - size)
                      for atom, dim, size in zip(start_atoms, operand.aval.shape, update.aval.shape)]
            return [self.kernel(Term("AssignStatic", target, ints_key(starts), value, ty))]
        starts = tensor_list([self.tensor(atom) for atom in start_atoms])
        return [self.kernel(Term("AssignDynamic", target, starts, value, ty))]

    @_handles("concatenate")
    def _concatenate(self, eqn):
        axis = int(eqn.params["dimension"])
        return [self.pointwise(self._concat([self.expr(atom) for atom in eqn.invars], axis))]

    def _concat(self, parts: list[Term], axis: int) -> Term:
        result = parts[0]
        for part in parts[1:]:
            left, right = _shape(result), _shape(part)
            shape = list(left)
            shape[axis] += right[axis]
            result = Term("Concat", result, part, axis, left[axis], _ty_of(_dtype(result), shape))
        return result

    @_handles("stack")
    def _stack(self, eqn):
        axis = int(eqn.params["axis"])
        parts = []
        for atom in eqn.invars:
            shape = list(atom.aval.shape)
            shape.insert(axis, 1)
            parts.append(Term("Reshape", self.expr(atom), _ty_of(atom.aval.dtype, shape)))
        return [self.pointwise(self._concat(parts, axis))]

    @_handles("tile")
    def _tile(self, eqn):
        x = self.expr(eqn.invars[0])
        for axis, reps in enumerate(eqn.params["reps"]):
            if int(reps) != 1:
                x = self._concat([x] * int(reps), axis)
        return [self.pointwise(x)]

    @_handles("unstack")
    def _unstack(self, eqn):
        atom = eqn.invars[0]
        axis = int(eqn.params["axis"])
        x = self.expr(atom)
        outs = []
        for index, var in enumerate(eqn.outvars):
            part, _ = _slice_axis(x, list(atom.aval.shape), atom.aval.dtype, axis, index, index + 1, 1)
            outs.append(self.pointwise(Term("Reshape", part, _ty(var.aval))))
        return outs

    @_handles("split")
    def _split(self, eqn):
        atom = eqn.invars[0]
        axis = int(eqn.params["axis"])
        x = self.expr(atom)
        outs, start = [], 0
        for size in eqn.params["sizes"]:
            part, _ = _slice_axis(x, list(atom.aval.shape), atom.aval.dtype, axis, start, start + int(size), 1)
            outs.append(self.pointwise(part))
            start += int(size)
        return outs

    @_handles("pad")
    def _pad(self, eqn):
        operand, padding_value = eqn.invars
        ty = _ty(eqn.outvars[0].aval)
        config = ";".join(f"{int(lo)},{int(hi)},{int(interior)}" for lo, hi, interior in eqn.params["padding_config"])
        return [self.pointwise(Term("Pad", self.expr(operand), self.expr(padding_value), config, ty))]

    @_handles("iota")
    def _iota(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        return [self.pointwise(Term("Iota", int(eqn.params["dimension"]), ty))]

    # --- heavy kernels ------------------------------------------------------------------------

    @_handles(*_REDUCE_PRIMITIVES)
    def _reduce(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        op = _REDUCE_PRIMITIVES[eqn.primitive.name]
        axes = ints_key(eqn.params["axes"])
        return [self.kernel(Term("Reduce", op, self.expr(eqn.invars[0]), axes, Term("Acc", ty), ty))]

    @_handles("dot_general")
    def _dot_general(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        dims = ";".join(ints_key(d) for d in (lc, rc, lb, rb))
        lhs, rhs = (self.expr(atom) for atom in eqn.invars)
        return [self.kernel(Term("Matmul", lhs, rhs, dims, Term("Acc", ty), ty))]

    @_handles("conv_general_dilated")
    def _conv(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        lhs, rhs = (self.expr(atom) for atom in eqn.invars)
        return [self.kernel(Term("Conv", lhs, rhs, conv_params_key(eqn.params), Term("Acc", ty), ty))]

    @_handles("gather")
    def _gather(self, eqn):
        ty = _ty(eqn.outvars[0].aval)
        key = self.fresh_key("gather")
        self.payloads[key] = (eqn.primitive, dict(eqn.params))
        operand, indices = (self.expr(atom) for atom in eqn.invars)
        return [self.kernel(Term("Gather", operand, indices, key, ty))]

    def _scatter(self, eqn):
        if len(eqn.invars) != 3 or "dimension_numbers" not in eqn.params:
            return self._opaque(eqn)
        body = one_hot_scatter_body(eqn, *(self.expr(atom) for atom in eqn.invars),
                                    constant_column=lambda i: self._constant_column(eqn.invars[1], i))
        if body is not None:  # take_along_axis's VJP: a comparison per output element, no scatter kernel
            return [self.pointwise(body)]
        ty = _ty(eqn.outvars[0].aval)
        key = self.fresh_key("scatter")
        self.payloads[key] = (eqn.primitive, dict(eqn.params))
        operand, indices, updates = eqn.invars
        term = Term("AssignScatter", self.tensor(operand), self.expr(indices), self.expr(updates), key, ty)
        return [self.kernel(term)]

    def _constant_column(self, atom, column: int):
        """Column `column` of the 2-D integer array `atom` as a NumPy array when no input flows into
        it (it is made of iotas, literals and constants), else None."""
        if isinstance(atom, core.Literal) or atom.aval.size > 1 << 20:
            return None
        count = atom.aval.shape[0]

        def inlined(expr: Term) -> Term:  # a pointwise tensor read at the same index is its body
            while expr.op == "Load" and expr.args[0].op == "Pointwise":
                expr = expr.args[0].args[0]
            return expr

        part = inlined(Term("Load", self.tensor(atom), self.tensor(atom).ty))
        while part.op == "Concat" and part.args[2] == 1:  # the columns' own parts (x.at[arange, y]: two)
            left, right, _, width, _ = part.args
            part, column = (inlined(left), column) if column < width else (inlined(right), column - width)
        if _shape(part)[1] != 1:
            part = Term("Slice", part, 1, column, column + 1, 1, _ty_of(atom.aval.dtype, (count, 1)))
        stack, seen = [part], set()
        while stack:
            node = stack.pop()
            if node in seen or not isinstance(node, Term):
                continue
            seen.add(node)
            if node.op == "Load":
                tensor = node.args[0]
                if tensor.op == "Pointwise":
                    stack.append(tensor.args[0])
                elif tensor.op != "Constant":
                    return None  # an input, or a kernel's result
            else:
                stack.extend(child for child in node.args if isinstance(child, Term))
        from eqsat.interpret import evaluate

        with jax.ensure_compile_time_eval():
            return np.asarray(evaluate([Term("Pointwise", part, part.ty)], {}, self.constants, self.payloads)[0])

    # --- calls and loops ----------------------------------------------------------------------

    @_handles(*_INLINED)
    def _inline(self, eqn):
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if inner is None:
            return self._effectful(eqn) if world_effects(eqn.effects) else self._opaque(eqn)
        jaxpr, consts = _open(inner)
        return self.run(jaxpr, consts, [self.value(atom) for atom in eqn.invars], self.scopes)

    def _loop_outputs(self, key: str, operands: list[Term], body: list[Term], types: list[str]) -> list[Term]:
        operand_list, body_list = tensor_list(operands), tensor_list(body)
        return [self.kernel(Term("Loop", key, operand_list, body_list, index, ty)) for index, ty in enumerate(types)]

    @_handles("scan")
    def _scan(self, eqn):
        params = eqn.params
        jaxpr, consts = _open(params["jaxpr"])
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        values = [self.value(atom) for atom in eqn.invars]
        const_values = values[:num_consts]
        carries, xs = values[num_consts:num_consts + num_carry], values[num_consts + num_carry:]
        if any(isinstance(v, _RefCell) for v in carries + xs):
            raise LiftError("a ref carried or scanned over by scan")
        cells = _unique_cells(const_values) + self.world_cells(eqn)
        plain = [v for v in const_values if not isinstance(v, _RefCell)]
        n_plain, n_carry, n_refs = len(plain), len(carries), len(cells)
        key = self.fresh_key("loop")
        ref_base = n_plain + n_carry
        inner_cells = {id(cell): _RefCell(Term("LoopArg", key, ref_base + r, cell.version.ty)) for r, cell in enumerate(cells)}
        in_values, plain_index = [], 0
        for var, value in zip(jaxpr.invars[:num_consts], const_values):
            if isinstance(value, _RefCell):
                in_values.append(inner_cells[id(value)])
            else:
                in_values.append(Term("LoopArg", key, plain_index, _ty(var.aval)))
                plain_index += 1
        for k, var in enumerate(jaxpr.invars[num_consts:num_consts + num_carry]):
            in_values.append(Term("LoopArg", key, n_plain + k, _ty(var.aval)))
        for x, var in enumerate(jaxpr.invars[num_consts + num_carry:]):
            in_values.append(Term("LoopArg", key, ref_base + n_refs + x, _ty(var.aval)))
        outs = self.run_inside(jaxpr, consts, in_values, inner_cells)
        finals = [inner_cells[id(cell)].version for cell in cells]
        body = outs[:num_carry] + finals + outs[num_carry:]
        self.payloads[key] = {
            "kind": "scan", "length": int(params["length"]), "reverse": bool(params["reverse"]),
            "unroll": params.get("unroll", 1), "num_consts": n_plain, "num_carry": n_carry + n_refs,
            "num_xs": len(xs),
        }
        out_types = [_ty(v.aval) for v in eqn.outvars]
        types = out_types[:num_carry] + [cell.version.ty for cell in cells] + out_types[num_carry:]
        loops = self._loop_outputs(key, plain + carries + [cell.version for cell in cells] + xs, body, types)
        for r, cell in enumerate(cells):
            cell.version = loops[num_carry + r]
        return loops[:num_carry] + loops[num_carry + n_refs:]

    @_handles("while")
    def _while(self, eqn):
        params = eqn.params
        cond_jaxpr, cond_consts = _open(params["cond_jaxpr"])
        body_jaxpr, body_consts = _open(params["body_jaxpr"])
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        values = [self.value(atom) for atom in eqn.invars]
        const_values, carries = values[:n_cond + n_body], values[n_cond + n_body:]
        if any(isinstance(v, _RefCell) for v in carries):
            raise LiftError("a ref carried by while")
        if world_effects(params["cond_jaxpr"].effects):
            return self._effectful(eqn)  # a predicate with effects: the loop stays one primitive
        cells = _unique_cells(const_values) + self.world_cells(eqn)
        plain = [v for v in const_values if not isinstance(v, _RefCell)]
        n_plain, n_carry = len(plain), len(carries)
        key = self.fresh_key("loop")

        def inputs(jaxpr, const_slice, plain_offset):
            # Every lifted jaxpr gets its own cells, all starting at the loop's ref arguments.
            inner_cells = {id(cell): _RefCell(Term("LoopArg", key, n_plain + n_carry + r, cell.version.ty))
                           for r, cell in enumerate(cells)}
            in_values, plain_index = [], plain_offset
            n_consts = len(const_slice)
            for var, value in zip(jaxpr.invars[:n_consts], const_slice):
                if isinstance(value, _RefCell):
                    in_values.append(inner_cells[id(value)])
                else:
                    in_values.append(Term("LoopArg", key, plain_index, _ty(var.aval)))
                    plain_index += 1
            for k, var in enumerate(jaxpr.invars[n_consts:]):
                in_values.append(Term("LoopArg", key, n_plain + k, _ty(var.aval)))
            return in_values, inner_cells

        cond_in, cond_cells = inputs(cond_jaxpr, const_values[:n_cond], 0)
        plain_cond = sum(not isinstance(v, _RefCell) for v in const_values[:n_cond])
        body_in, body_cells = inputs(body_jaxpr, const_values[n_cond:], plain_cond)
        (predicate,) = self.run_inside(cond_jaxpr, cond_consts, cond_in, cond_cells)
        outs = self.run_inside(body_jaxpr, body_consts, body_in, body_cells)
        finals = [body_cells[id(cell)].version for cell in cells]
        self.payloads[key] = {"kind": "while", "num_consts": n_plain, "num_carry": n_carry + len(cells)}
        types = [_ty(v.aval) for v in eqn.outvars] + [cell.version.ty for cell in cells]
        loops = self._loop_outputs(key, plain + carries + [cell.version for cell in cells],
                                   [predicate] + outs + finals, types)
        for r, cell in enumerate(cells):
            cell.version = loops[n_carry + r]
        return loops[:n_carry]

    @_handles("cond")
    def _cond(self, eqn):
        branches = eqn.params["branches"]
        index = self.tensor(eqn.invars[0])
        values = [self.value(atom) for atom in eqn.invars[1:]]
        cells = _unique_cells(values) + self.world_cells(eqn)
        plain = [v for v in values if not isinstance(v, _RefCell)]
        key = self.fresh_key("loop")
        body = []
        for branch in branches:
            jaxpr, consts = _open(branch)
            inner_cells = {id(cell): _RefCell(Term("LoopArg", key, 1 + len(plain) + r, cell.version.ty))
                           for r, cell in enumerate(cells)}
            in_values, plain_index = [], 1
            for var, value in zip(jaxpr.invars, values):
                if isinstance(value, _RefCell):
                    in_values.append(inner_cells[id(value)])
                else:
                    in_values.append(Term("LoopArg", key, plain_index, _ty(var.aval)))
                    plain_index += 1
            outs = self.run_inside(jaxpr, consts, in_values, inner_cells)
            body.extend(outs + [inner_cells[id(cell)].version for cell in cells])
        n_out = len(eqn.outvars)
        self.payloads[key] = {"kind": "cond", "num_branches": len(branches), "num_outputs": n_out + len(cells)}
        types = [_ty(v.aval) for v in eqn.outvars] + [cell.version.ty for cell in cells]
        loops = self._loop_outputs(key, [index] + plain + [cell.version for cell in cells], body, types)
        for r, cell in enumerate(cells):
            cell.version = loops[n_out + r]
        return loops[:n_out]

    # --- refs ---------------------------------------------------------------------------------

    @_handles("new_ref", "mutable_array")
    def _new_ref(self, eqn):
        return [_RefCell(self.tensor(eqn.invars[0]))]

    @_handles("empty_ref")
    def _empty_ref(self, eqn):
        aval = _inner_aval(eqn.outvars[0].aval)
        ty = _ty(aval)
        return [_RefCell(self.pointwise(Term("Lit", 0.0, ty)))]

    @_handles("freeze")
    def _freeze(self, eqn):
        return [self._cell(eqn.invars[0]).version]

    def _cell(self, atom) -> _RefCell:
        cell = self.value(atom)
        if not isinstance(cell, _RefCell):
            raise LiftError(f"{atom} is not a ref")
        return cell

    @_handles("get")
    def _get(self, eqn):
        ref_atom, *index_atoms = eqn.invars
        cell = self._cell(ref_atom)
        tree = eqn.params["tree"]
        plan = self._index_plan(tree, index_atoms, cell.version, for_write=False)
        if plan is None:
            return self._ref_fallback(eqn, "get", cell, None, index_atoms)
        box, squeeze = self._box(cell.version, plan)
        return [self._read(cell.version, box, squeeze, _ty(eqn.outvars[0].aval))]

    @_handles("swap", "addupdate")
    def _write(self, eqn):
        kind = eqn.primitive.name
        ref_atom, value_atom, *index_atoms = eqn.invars
        cell = self._cell(ref_atom)
        plan = self._index_plan(eqn.params["tree"], index_atoms, cell.version, for_write=True)
        if plan is None:
            return self._ref_fallback(eqn, kind, cell, value_atom, index_atoms)
        old = cell.version
        box, squeeze = self._box(old, plan)
        box_ty = box.ty
        value = self.expr(value_atom)
        if squeeze or value.ty != box_ty:
            value = Term("Reshape", value, box_ty)
        if kind == "addupdate":
            value = Term("Binary", "add", box, value, box_ty)
        if box_ty == old.ty and all(isinstance(start, int) for start, _, _ in plan):
            new = value.args[0] if value.op == "Load" and value.args[0].ty == old.ty else self.pointwise(value)
        elif all(isinstance(start, int) for start, _, _ in plan):
            new = self.kernel(Term("AssignStatic", old, ints_key(start for start, _, _ in plan), value, old.ty))
        else:
            starts = [self.scalar_constant(np.asarray(start, np.int32)) if isinstance(start, int) else start
                      for start, _, _ in plan]
            new = self.kernel(Term("AssignDynamic", old, tensor_list(starts), value, old.ty))
        cell.version = new
        if kind == "addupdate":
            return []
        return [self._read(old, box, squeeze, _ty(eqn.outvars[0].aval))]

    def _read(self, version: Term, box: Term, squeeze: bool, ty: str) -> Term:
        if box.op == "Load" and not squeeze:
            return version
        if squeeze:
            box = Term("Reshape", box, ty)
        return self.pointwise(box)

    def _box(self, version: Term, plan) -> tuple[Term, bool]:
        """The box `plan` selects from `version` (int-indexed dims kept with size 1)."""
        dtype = _dtype(version)
        x = Term("Load", version, version.ty)
        shape = list(_shape(version))
        squeeze = False
        for axis, (start, size, stride) in enumerate(plan):
            squeeze |= size is None
            size = 1 if size is None else size
            if isinstance(start, int):
                x, shape = _slice_axis(x, shape, dtype, axis, start, start + (size - 1) * stride + 1, stride)
            elif size != shape[axis]:
                shape[axis] = size
                start_expr = Term("Load", start, start.ty) if start.sort == "Tensor" else start
                x = Term("DynamicSlice", x, axis, start_expr, size, _ty_of(dtype, shape))
        return x, squeeze

    def _index_plan(self, tree, index_atoms, version: Term, for_write: bool):
        """Per axis `(start, size, stride)` of a ref access, `size=None` for an integer index (a
        squeezed axis); `start` an int, or for dynamic starts an Expr (reads) / a Tensor (writes).
        None when the access needs the discharge fallback.

        Follows the lowering (JAX's discharge rules): a read whose indexers are all static slices is
        `lax.slice`; otherwise starts go through `lax.dynamic_slice`: negative indices wrap once
        (`i < 0 ? i + dim : i`), then clamp to `[0, dim - size]`.
        """
        from jax._src.state import indexing

        transforms = jax.tree_util.tree_unflatten(tree, index_atoms)
        shape = _shape(version)
        if not transforms:
            return [(0, dim, 1) for dim in shape]
        if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
            return None
        indexer = transforms[0]
        if tuple(indexer.int_indexer_shape) != ():
            return None
        entries = []
        for index in indexer.indices:
            if isinstance(index, indexing.Slice):
                if not isinstance(index.size, (int, np.integer)):
                    return None
                entries.append((index.start, int(index.size), int(index.stride)))
            elif (index.aval.shape if hasattr(index, "aval") else np.shape(index)) != ():
                return None
            else:
                entries.append((index, None, 1))
        static_slices = all(size is not None and isinstance(start, (int, np.integer)) for start, size, _ in entries)
        if static_slices and not for_write:
            return [(int(start), size, stride) for start, size, stride in entries]
        if any(stride != 1 for _, _, stride in entries):
            return None
        plan = []
        for (start, size, _), dim in zip(entries, shape):
            extent = 1 if size is None else size
            if isinstance(start, (int, np.integer)) or isinstance(start, core.Literal):
                value = int(start.val if isinstance(start, core.Literal) else start)
                value = value + dim if value < 0 else value
                plan.append((min(max(value, 0), dim - extent), size, 1))
            else:
                plan.append((self._wrapped_index(start, dim, for_write), size, 1))
        return plan

    def _wrapped_index(self, atom, dim: int, as_tensor: bool) -> Term:
        """`i < 0 ? i + dim : i` for a scalar integer variable `atom` (as int32, like the lowering)."""
        index = self.expr(atom)
        if np.dtype(atom.aval.dtype) != np.int32:
            index = Term("Unary", CONVERT, index, "i32[]")
        negative = Term("Binary", "lt", index, Term("Lit", 0.0, "i32[]"), "bool[]")
        wrapped = Term("Select", negative, index, Term("Binary", "add", index, Term("Lit", float(dim), "i32[]"), "i32[]"), "i32[]")
        return self.pointwise(wrapped) if as_tensor else wrapped

    def _ref_fallback(self, eqn, kind, cell, value_atom, index_atoms):
        key = self.fresh_key("ref")
        self.payloads[key] = (REF_DISCHARGE[kind], {"tree": eqn.params["tree"]})
        operands = [cell.version] + ([self.tensor(value_atom)] if value_atom is not None else [])
        operands += [self.tensor(atom) for atom in index_atoms]
        operand_list = tensor_list(operands)
        if kind == "get":
            return [self.kernel(Term("Opaque", key, operand_list, 0, _ty(eqn.outvars[0].aval)))]
        if kind == "swap":
            old = self.kernel(Term("Opaque", key, operand_list, 0, _ty(eqn.outvars[0].aval)))
            cell.version = self.kernel(Term("Opaque", key, operand_list, 1, cell.version.ty))
            return [old]
        cell.version = self.kernel(Term("Opaque", key, operand_list, 0, cell.version.ty))
        return []

    # --- effects ------------------------------------------------------------------------------

    def _effectful(self, eqn):
        """An effectful equation as an `Opaque` of `EffectCall(primitive)` reading and writing the
        world token: it runs, in program order, and is never dropped."""
        name = eqn.primitive.name
        if name not in self._warned:
            self._warned.add(name)
            kinds = ", ".join(sorted({type(effect).__name__ for effect in world_effects(eqn.effects)}))
            message = (f"eqsat.lift: {name!r} has side effects ({kinds}); it runs as the original primitive, "
                       f"in program order as under jax.jit, and nothing fuses with it")
            self.warnings.append(message)
            self.unfused.setdefault("side effects (run in program order)", []).append(name)
        self._start_world()
        key = self.fresh_key(f"{name}#")
        self.payloads[key] = (EffectCall(eqn.primitive), dict(eqn.params))
        operands = tensor_list([self.tensor(atom) for atom in eqn.invars] + [self.world.version])
        outs = [self.kernel(Term("Opaque", key, operands, index, _ty(var.aval)))
                for index, var in enumerate(eqn.outvars)]
        self.world.version = self.kernel(Term("Opaque", key, operands, len(outs), WORLD_TYPE))
        return outs

    # --- everything else ----------------------------------------------------------------------

    def _opaque(self, eqn):
        name = eqn.primitive.name
        complex_values = _touches_complex(eqn)
        warn_key = f"{name} (complex)" if complex_values else name
        if warn_key not in self._warned:
            self._warned.add(warn_key)
            message = (f"eqsat.lift: no term for primitive {name!r} on complex values; it stays an opaque XLA op"
                       if complex_values else f"eqsat.lift: no term for primitive {name!r}; it stays an opaque XLA op")
            self.warnings.append(message)
            reason = "no term on complex values" if complex_values else "no term"
            self.unfused.setdefault(reason, []).append(name)
        key = self.fresh_key(f"{name}#")
        self.payloads[key] = (eqn.primitive, dict(eqn.params))
        operands = tensor_list([self.tensor(atom) for atom in eqn.invars])
        return [self.kernel(Term("Opaque", key, operands, index, _ty(var.aval)))
                for index, var in enumerate(eqn.outvars)]


# Handlers that thread effects themselves (loops, branches and inlined calls lift their bodies).
_EFFECT_AWARE = frozenset({_Lifter._scan, _Lifter._while, _Lifter._cond, _Lifter._inline})
# Handlers that only route values (calls, loops, refs, identities): any dtype, complex included.
# Every other equation on complex values is `Opaque`: terms and rules assume real arithmetic.
_ANY_DTYPE = _EFFECT_AWARE | frozenset({_Lifter._identity, _Lifter._new_ref, _Lifter._empty_ref, _Lifter._freeze,
                                        _Lifter._get, _Lifter._write})


def _touches_complex(eqn) -> bool:
    for var in (*eqn.invars, *eqn.outvars):
        dtype = getattr(_inner_aval(var.aval), "dtype", None)
        if dtype is not None and _is_complex(dtype):
            return True
    return False


@lru_cache(maxsize=None)
def _is_complex(dtype) -> bool:
    return not is_key(dtype_name(dtype)) and np.issubdtype(dtype, np.complexfloating)


# Frames a warning never points at: eqsat's own packages and JAX's (a call under `jax.jit`).
_OWN_PACKAGES = tuple(str(Path(module.__file__).resolve().parent) + os.sep for module in (jax,)) + tuple(
    str(Path(__file__).resolve().parent.parent / package) + os.sep for package in ("eqsat", "extract", "emit", "driver", "measure"))


def user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the user's line: the first frame, walking out of
    the caller of this function, outside eqsat's packages and JAX's."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(_OWN_PACKAGES)
                                 or frame.f_code.co_filename.startswith("<frozen ")):
        frame, level = frame.f_back, level + 1
    return level


def _warn_unfused(unfused: dict[str, list[str]], fn=None) -> None:
    """One `OpaqueWarning` per lift (and per function, across its lowerings) listing every primitive
    that stays opaque, pointed at the user's line."""
    if not unfused:
        return
    parts = [f"{why}: {', '.join(repr(name) for name in names)}" for why, names in unfused.items()]
    where = f" in {getattr(fn, '__name__', None) or type(fn).__name__}()" if fn is not None else ""
    message = (f"eqsat.lift: {sum(map(len, unfused.values()))} primitive(s){where} stay opaque XLA ops, "
               f"nothing fuses with them ({'; '.join(parts)})")
    if fn is not None:
        try:
            seen = _WARNED.setdefault(fn, set())
        except TypeError:  # not weakly referenceable: warn each time
            seen = set()
        if message in seen:
            return
        seen.add(message)
    warnings.warn(message, OpaqueWarning, stacklevel=user_stacklevel())


_WARNED: "weakref.WeakKeyDictionary[Callable, set[str]]" = weakref.WeakKeyDictionary()


def _open(jaxpr) -> tuple[core.Jaxpr, list]:
    if isinstance(jaxpr, core.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def _unique_cells(values) -> list[_RefCell]:
    cells, seen = [], set()
    for value in values:
        if isinstance(value, _RefCell) and id(value) not in seen:
            seen.add(id(value))
            cells.append(value)
    return cells


def _shape(term: Term) -> tuple[int, ...]:
    from eqsat.types import parse_type

    return parse_type(term.ty).shape


def _dtype(term: Term) -> str:
    from eqsat.types import parse_type

    return parse_type(term.ty).dtype


def _slice_axis(x: Term, shape: list[int], dtype, axis: int, start: int, stop: int, stride: int):
    """`x[start:stop:stride]` along `axis` (nothing if that is the whole axis)."""
    stop = min(stop, shape[axis])
    if start == 0 and stop == shape[axis] and stride == 1:
        return x, shape
    shape = list(shape)
    shape[axis] = max(0, -(-(stop - start) // stride))
    return Term("Slice", x, axis, start, stop, stride, _ty_of(dtype, shape)), shape


def lift_jaxpr(closed_jaxpr: core.ClosedJaxpr, _lifting_function=None) -> Program:
    """The naive program of `closed_jaxpr` (inputs `arg0..`, outputs in order). Primitives that stay
    opaque are named in one `OpaqueWarning` (once per `_lifting_function`, the user's function)."""
    jaxpr, consts = _open(closed_jaxpr)
    lifter = _Lifter()
    inputs = []
    for index, var in enumerate(jaxpr.invars):
        if hasattr(var.aval, "inner_aval"):
            raise LiftError("a jaxpr taking a ref as an argument")
        inputs.append(Term("Input", f"arg{index}", _ty(var.aval)))
    outputs = lifter.run(jaxpr, consts, inputs, ())
    _warn_unfused(lifter.unfused, _lifting_function)
    for output in outputs:
        if isinstance(output, _RefCell):
            raise LiftError("a jaxpr returning a ref")
    n_results = len(outputs)
    if lifter.world.version is not None:
        outputs = outputs + [lifter.world.version]
    return Program(
        inputs=inputs,
        outputs=outputs,
        constants=lifter.constants,
        payloads=lifter.payloads,
        components=lifter.components,
        in_tree=jax.tree_util.tree_structure((tuple(range(len(inputs))), {})),
        out_tree=jax.tree_util.tree_structure(list(range(n_results))),
        warnings=lifter.warnings,
        effect_outputs=len(outputs) - n_results,
    )


def lift(fn, *args, static_argnums=(), static_argnames=(), kwargs=None) -> Program:
    """Trace `fn(*args, **kwargs)` (arrays or `ShapeDtypeStruct`s) and lift its jaxpr.

    Positional arguments at `static_argnums` and keyword arguments named in `static_argnames` are
    static (closed over, as `jax.jit` treats them); the program's inputs are the flattened leaves of
    the other `(args, kwargs)`. `eqsat.interpret.evaluate_program` takes the same arguments as `fn`.
    """
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    static_argnums = tuple(sorted({i % len(args) for i in static_argnums})) if args else ()
    kwargs = dict(kwargs or {})
    static_kwargs = {name: value for name, value in kwargs.items() if name in static_argnames}
    dynamic_kwargs = {name: value for name, value in kwargs.items() if name not in static_argnames}
    dynamic = tuple(arg for i, arg in enumerate(args) if i not in static_argnums)

    def with_statics(dynamic_args, keyword_args):
        positional, rest = [], iter(dynamic_args)
        for i in range(len(args)):
            positional.append(args[i] if i in static_argnums else next(rest))
        return fn(*positional, **static_kwargs, **keyword_args)

    closed, out_shape = jax.make_jaxpr(with_statics, return_shape=True)(dynamic, dynamic_kwargs)
    program = lift_jaxpr(closed, _lifting_function=fn)
    program.in_tree = jax.tree_util.tree_structure((dynamic, dynamic_kwargs))
    program.out_tree = jax.tree_util.tree_structure(out_shape)
    program.static_argnums = static_argnums
    program.static_argnames = tuple(static_kwargs)
    program.argument_names = _argument_names(fn, len(args), static_argnums)
    return program


def _argument_names(fn, count: int, static_argnums: tuple[int, ...]) -> tuple[str, ...]:
    """The parameter names of `fn`'s dynamic positional arguments (`args[i]` past its named ones)."""
    import inspect

    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(named[i] if i < len(named) else f"args[{i}]" for i in range(count) if i not in static_argnums)
