"""Mutation to functional (FuncTs; DESIGN.md, family 2).

The lifter already turns JAX's in-place writing (refs: `get`/`swap`/`addupdate`, `.at[].set/add`,
`dynamic_update_slice`) into versioned values: `AssignStatic`, `AssignDynamic`, `AssignScatter`
kernels, each a new version of its target. These rules make every write a pure elementwise kernel,
so it fuses like any other: a consumer's prologue reads the new version as an expression.

- A static write is a select: inside the box the padded value, outside the old version
  (`Pad` of an all-true box is the box's mask).
- Store-to-load forwarding: reading back exactly the written box gives the value; reading a box
  disjoint from the write (along the sliced axis) reads the old version.
- A dynamic write along one axis is a select on `start <= iota < start + size` (start clamped as
  `dynamic_update_slice` clamps) of the value placed by a dynamic slice of its padded self.
- A row scatter (`x.at[i].set(row)`, `.add(row)`: one index, the row's window) is a select on
  `iota == i`; an out-of-range index matches no row, as `FILL_OR_DROP` drops it. Which scatters
  are row scatters lives in the payloads, outside the e-graph: `seed(egraph, program)` states it.

Writes inside loop bodies (carried refs, `fori_loop` updates) are the same terms over `LoopArg`s,
so the same rules make the body's results pure kernels.
"""

from __future__ import annotations

from functools import lru_cache

from egglog import BigInt, BigRat, EGraph, String, function, i64, relation, rewrite, rule, ruleset, set_, union

from eqsat.lang import (
    AssignDynamic, AssignScatter, AssignStatic, Binary, Broadcast, DynamicSlice, Expr, Iota, Lit, Load, Pad,
    Pointwise, Reshape, Select, Slice, TCons, Tensor, TensorList, TNil,
)
from eqsat.rules import Example, dim, flag, py_int, py_string, py_true, tensor, typed_forms
from eqsat.types import format_type, ints, parse_type

functionalize = ruleset(name="functionalize")

# (scatter key, "set" | "add", the broadcast dims placing one row): `AssignScatter(.., key, ..)` writes one row.
RowScatter = relation("FunctionalizeRowScatter", String, String, String)

MAX_RANK = 4  # dynamic writes are matched per rank of the start list


@function(egg_fn="FunctionalizeValueType", merge=lambda old, new: old)
def value_type(v: Expr) -> String:
    """The type of an expression written by an `Assign*` (Expr variables carry no type)."""


def py_float(fn, *args):
    """`float(fn(*args))` as an egglog `f64` (integers below 2**53)."""
    return BigRat(BigInt.from_string(py_string(fn, *args)), BigInt(1)).to_f64()


# --- shapes of boxes ---------------------------------------------------------------------------------


def _shape(ty: str) -> tuple[int, ...]:
    return parse_type(ty).shape


@lru_cache(maxsize=None)
def _with_dtype(ty: str, dtype: str) -> str:
    return format_type(dtype, _shape(ty))


@lru_cache(maxsize=None)
def _scalar(ty: str) -> str:
    return format_type(parse_type(ty).dtype, ())


@lru_cache(maxsize=None)
def _box_padding(starts: str, box: str, ty: str) -> str:
    """The `Pad` config placing a `box`-shaped value at `starts` inside `ty`; "" if it does not fit."""
    begin, size, whole = ints(starts), _shape(box), _shape(ty)
    if not (len(begin) == len(size) == len(whole)):
        return ""
    if any(b < 0 or b + s > w for b, s, w in zip(begin, size, whole)):
        return ""
    return ";".join(f"{b},{w - b - s},0" for b, s, w in zip(begin, size, whole))


@lru_cache(maxsize=None)
def _exact_box(starts: str, box: str, ty: str, axis: str, start: str, stop: str) -> str:
    """Is `Slice(axis, start:stop)` of `ty` exactly the written box (full along every other axis)?"""
    begin, size, whole, a = ints(starts), _shape(box), _shape(ty), int(axis)
    if len(begin) != len(whole) or len(size) != len(whole):
        return "0"
    others_full = all(begin[k] == 0 and size[k] == whole[k] for k in range(len(whole)) if k != a)
    return flag(others_full and begin[a] == int(start) and begin[a] + size[a] == int(stop))


@lru_cache(maxsize=None)
def _disjoint(starts: str, box: str, axis: str, start: str, stop: str) -> str:
    """Does `[start, stop)` along `axis` miss the written box?"""
    begin, size, a = ints(starts), _shape(box), int(axis)
    if len(begin) != len(size) or a >= len(begin):
        return "0"
    return flag(int(stop) <= begin[a] or int(start) >= begin[a] + size[a])


@lru_cache(maxsize=None)
def _one_partial_axis(box: str, ty: str, axis: str) -> str:
    """Is `axis` the one axis along which `box` is smaller than `ty`?"""
    size, whole = _shape(box), _shape(ty)
    if len(size) != len(whole):
        return "0"
    partial = [k for k in range(len(whole)) if size[k] != whole[k]]
    return flag(partial == [int(axis)])


@lru_cache(maxsize=None)
def _extent(ty: str, axis: str) -> str:
    return str(_shape(ty)[int(axis)])


@lru_cache(maxsize=None)
def _slack(box: str, ty: str, axis: str) -> str:
    """n - m along `axis`: how far the box can move."""
    return str(_shape(ty)[int(axis)] - _shape(box)[int(axis)])


@lru_cache(maxsize=None)
def _slack_padding(box: str, ty: str, axis: str) -> str:
    """Pad the box by its slack on both sides of `axis`."""
    a, slack = int(axis), _shape(ty)[int(axis)] - _shape(box)[int(axis)]
    return ";".join(f"{slack},{slack},0" if k == a else "0,0,0" for k in range(len(_shape(box))))


@lru_cache(maxsize=None)
def _slack_padded(box: str, ty: str, axis: str) -> str:
    a = int(axis)
    shape = list(_shape(box))
    shape[a] += 2 * (_shape(ty)[a] - _shape(box)[a])
    return format_type(parse_type(box).dtype, shape)


# --- static writes -----------------------------------------------------------------------------------


@functionalize.register
def _value_type(a: Tensor, t: Tensor, starts: String, dynamic: TensorList, v: Expr, ty: String, tv: String):
    """Bookkeeping: the type of every written value (one rule per Expr constructor)."""
    for form in typed_forms(tv):
        yield rule(a == AssignStatic(t, starts, v, ty), v == form).then(set_(value_type(v)).to(tv))
        yield rule(a == AssignDynamic(t, dynamic, v, ty), v == form).then(set_(value_type(v)).to(tv))


@functionalize.register
def _assign_static(a: Tensor, t: Tensor, starts: String, v: Expr, ty: String, tv: String):
    """AssignStatic(t, starts, v) = Pointwise(Select(Pad(true[box], false), Load(t), Pad(v, 0))): a write is a select."""
    padding = py_string(_box_padding, starts, tv, ty)
    mask = Pad(Lit(1.0, py_string(_with_dtype, tv, String("bool"))), Lit(0.0, String("bool[]")), padding,
               py_string(_with_dtype, ty, String("bool")))
    placed = Pad(v, Lit(0.0, py_string(_scalar, ty)), padding, ty)
    yield rule(a == AssignStatic(t, starts, v, ty), value_type(v) == tv, py_true(_box_fits, starts, tv, ty)).then(
        union(a).with_(Pointwise(Select(mask, Load(t, ty), placed, ty), ty)))


@lru_cache(maxsize=None)
def _box_fits(starts: str, box: str, ty: str) -> str:
    return flag(bool(_box_padding(starts, box, ty)))


@functionalize.register
def _forward_store(t: Tensor, starts: String, v: Expr, ty: String, ts: String, axis: i64, start: i64, stop: i64):
    """Load(AssignStatic(t, starts, v))[the written box] = v: store-to-load forwarding."""
    exact = py_true(_exact_box, starts, ts, ty, axis.to_string(), start.to_string(), stop.to_string())
    yield rewrite(Slice(Load(AssignStatic(t, starts, v, ty), ty), axis, start, stop, 1, ts)).to(
        v, value_type(v) == ts, exact)


@functionalize.register
def _disjoint_read(t: Tensor, starts: String, v: Expr, ty: String, tv: String, ts: String, axis: i64,
                   start: i64, stop: i64, stride: i64):
    """Load(AssignStatic(t, starts, v))[s:e] = Load(t)[s:e] when [s, e) misses the box along that axis
    (a forward stride: a reversed slice reads (e, s])."""
    disjoint = py_true(_disjoint, starts, tv, axis.to_string(), start.to_string(), stop.to_string())
    yield rewrite(Slice(Load(AssignStatic(t, starts, v, ty), ty), axis, start, stop, stride, ts)).to(
        Slice(Load(t, ty), axis, start, stop, stride, ts), value_type(v) == tv, disjoint, stride >= 1)


# --- dynamic writes ----------------------------------------------------------------------------------


def _start_lists(start: Tensor, rank: int, axis: int, prefix: str) -> TensorList:
    """A `TCons` list of `rank` starts with `start` at `axis` (the others fresh variables)."""
    from egglog import var

    items = [start if k == axis else var(f"{prefix}_{k}", Tensor) for k in range(rank)]
    result = TNil()
    for item in reversed(items):
        result = TCons(item, result)
    return result


@functionalize.register
def _assign_dynamic(a: Tensor, t: Tensor, s: Tensor, v: Expr, ty: String, tv: String):
    """AssignDynamic(t, starts, v) = Pointwise(Select(c <= iota < c + m, Load(t), DynamicSlice(Pad(v), n - m - c)))
    for a write that is partial along one axis, c = clamp(start, 0, n - m)."""
    i32 = String("i32[]")
    for rank in range(1, MAX_RANK + 1):
        for axis in range(rank):
            ax = String(str(axis))
            slack = py_float(_slack, tv, ty, ax)
            size = py_float(_extent, tv, ax)
            index_ty = py_string(_with_dtype, ty, String("int32"))
            bool_ty = py_string(_with_dtype, ty, String("bool"))
            clamped = Binary("min", Binary("max", Load(s, i32), Lit(0.0, i32), i32), Lit(slack, i32), i32)
            iota = Iota(axis, index_ty)
            inside = Binary(
                "and",
                Binary("ge", iota, Broadcast(clamped, "", index_ty), bool_ty),
                Binary("lt", iota, Broadcast(Binary("add", clamped, Lit(size, i32), i32), "", index_ty), bool_ty),
                bool_ty,
            )
            padded = Pad(v, Lit(0.0, py_string(_scalar, ty)), py_string(_slack_padding, tv, ty, ax),
                         py_string(_slack_padded, tv, ty, ax))
            placed = DynamicSlice(padded, axis, Binary("sub", Lit(slack, i32), clamped, i32),
                                  py_int(_extent, ty, ax), ty)
            starts = _start_lists(s, rank, axis, f"_dyn{rank}_{axis}")
            yield rule(a == AssignDynamic(t, starts, v, ty), value_type(v) == tv,
                       py_true(_one_partial_axis, tv, ty, ax)).then(
                union(a).with_(Pointwise(Select(inside, Load(t, ty), placed, ty), ty)))


# --- row scatters ------------------------------------------------------------------------------------


@functionalize.register
def _row_scatter(a: Tensor, t: Tensor, indices: Expr, updates: Expr, key: String, dims: String, ty: String):
    """AssignScatter(t, [i], row) = Pointwise(Select(iota_0 == i, Load(t), row)) (`.at[i].set`; `.add` adds)."""
    index_ty = py_string(_with_dtype, ty, String("int32"))
    row = Broadcast(updates, dims, ty)
    hit = Binary("eq", Iota(0, index_ty), Broadcast(Reshape(indices, String("i32[]")), "", index_ty),
                 py_string(_with_dtype, ty, String("bool")))
    yield rule(a == AssignScatter(t, indices, updates, key, ty), RowScatter(key, String("set"), dims)).then(
        union(a).with_(Pointwise(Select(hit, Load(t, ty), row, ty), ty)))
    yield rule(a == AssignScatter(t, indices, updates, key, ty), RowScatter(key, String("add"), dims)).then(
        union(a).with_(Pointwise(Select(hit, Load(t, ty), Binary("add", Load(t, ty), row, ty), ty), ty)))


def row_scatter_kind(term, payload) -> tuple[str, str] | None:
    """("set" | "add", row broadcast dims) if the AssignScatter `term` writes one whole row; else None."""
    from jax import lax

    if not isinstance(payload, tuple) or len(payload) != 2:
        return None
    primitive, params = payload
    kind = {"scatter": "set", "scatter-add": "add"}.get(getattr(primitive, "name", ""))
    numbers = params.get("dimension_numbers") if isinstance(params, dict) else None
    if kind is None or numbers is None:
        return None
    target, indices, updates = term.args[0], term.args[1], term.args[2]
    shape = _shape(target.ty)
    rank = len(shape)
    if rank == 0 or _shape(indices.ty) != (1,) or parse_type(indices.ty).dtype != "int32":
        return None
    if _shape(updates.ty) != shape[1:] or parse_type(updates.ty).dtype != parse_type(target.ty).dtype:
        return None
    if (tuple(numbers.update_window_dims) != tuple(range(rank - 1)) or tuple(numbers.inserted_window_dims) != (0,)
            or tuple(numbers.scatter_dims_to_operand_dims) != (0,)
            or tuple(getattr(numbers, "operand_batching_dims", ())) != ()
            or tuple(getattr(numbers, "scatter_indices_batching_dims", ())) != ()):
        return None
    if params.get("mode") not in (lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS):
        return None
    return kind, ",".join(str(axis) for axis in range(1, rank))


def seed(egraph: EGraph, program) -> int:
    """State which scatters of `program` are row scatters (`RowScatter` facts); returns how many."""
    from eqsat.term import postorder

    facts = []
    for term in postorder(program.outputs):
        if term.op != "AssignScatter":
            continue
        found = row_scatter_kind(term, program.payloads.get(term.args[3]))
        if found is not None:
            facts.append(RowScatter(String(term.args[3]), String(found[0]), String(found[1])))
    facts = list(dict.fromkeys(facts))
    if facts:
        egraph.register(*facts)
    return len(facts)


# --- soundness examples ------------------------------------------------------------------------------


def _rows(draw):
    n, c = dim(draw, 3, 5), dim(draw)
    return tensor(draw, (n, c)), tensor(draw, (c,))


def _rows_index(draw):
    n, c = dim(draw, 2, 4), dim(draw)
    return tensor(draw, (n, c)), tensor(draw, (c,)), tensor(draw, (), "int32", low=-1, high=n)


def _block_index(draw):
    n, c = dim(draw, 3, 5), dim(draw, 2, 4)
    return tensor(draw, (n, c)), tensor(draw, (2, c)), tensor(draw, (), "int32", low=-1, high=n)


def _block(draw):
    n, c = dim(draw, 3, 5), dim(draw, 2, 4)
    return tensor(draw, (n, c)), tensor(draw, (2, c))


def _static_update(x, y):
    from jax import lax

    return lax.dynamic_update_slice(x, y, (1, 0)) * 2.0


def _ref_swap(x, row):
    """FuncTs' first example in miniature: writes through a ref, then reads."""
    import jax

    r = jax.new_ref(x)
    first = r[0]
    r[0] = r[2]
    r[2] = first
    return jax.freeze(r) + 1.0


def _ref_forward(x, row):
    import jax

    r = jax.new_ref(x)
    r[1] = row
    return r[1] * 2.0, r[0] + 1.0


def _ref_overlap(x, block):
    """Write rows 0:2, read rows 1:3: neither the written box nor disjoint from it."""
    import jax

    r = jax.new_ref(x)
    r[0:2] = block
    return r[1:3] * 2.0


def _ref_reversed_read(x, block):
    """Write rows 1:3, read all rows reversed (start n-1, stop -1): not disjoint from the box."""
    import jax
    import jax.numpy as jnp

    r = jax.new_ref(x)
    r[1:3] = block
    return jnp.flip(jax.freeze(r), 0) * 2.0


def _dynamic_corner(x, block, i):
    """A write partial along two axes: not the one-axis dynamic form."""
    from jax import lax

    return lax.dynamic_update_slice(x, block[:, :1], (i, i)) * 2.0


def _dynamic_update(x, row, i):
    from jax import lax

    return lax.dynamic_update_slice(x, row[None, :], (i, 0)) * 2.0


def _at_set(x, row, i):
    return x.at[i].set(row) * 2.0


def _at_add(x, row, i):
    return x.at[i].add(row) - 1.0


def _loop_increment(x, row, i):
    """b[i] = b[i] + 1 in a fori_loop (the scatter is in the loop body)."""
    from jax import lax

    return lax.fori_loop(0, x.shape[0], lambda k, b: b.at[k].set(b[k] + row), x)


EXAMPLES = [
    Example(_static_update, _block, ("assign_static",), support=("absorb",)),
    Example(_ref_swap, _rows, ("assign_static",), support=("absorb",)),
    Example(_ref_forward, _rows, ("forward_store", "disjoint_read"), support=("absorb",)),
    Example(_ref_overlap, _block, ("forward_store", "disjoint_read"), fires=False, support=("absorb",),
            name="a read overlapping the written box"),
    Example(_ref_reversed_read, _block, ("disjoint_read",), fires=False, support=("absorb",),
            name="a reversed read of the written rows"),
    Example(_dynamic_update, _rows_index, ("assign_dynamic",), support=("absorb",)),
    Example(_dynamic_corner, _block_index, ("assign_dynamic",), fires=False, support=("absorb",),
            name="a dynamic write partial along two axes"),
    Example(_at_set, _rows_index, ("row_scatter",), support=("absorb",)),
    Example(_at_add, _rows_index, ("row_scatter",), support=("absorb",)),
    Example(_loop_increment, _rows_index, ("row_scatter",), support=("absorb",)),
]
