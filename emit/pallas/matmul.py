"""The matmul template: `out[b, m, n] = epilogue(sum_k lhs[b, m, k] * rhs[b, k, n])` as one Pallas
Triton kernel, operands and epilogue given as closures evaluated on index tiles.

    kernel     one (batch, M tile, N tile) program: a pre-pass for row statistics, the K loop
               (fp32 accumulation on tensor cores), the epilogue, masked stores
    build      grid, validation, tile sizes, the `pallas_call`
    reference  the same problem in plain `jax.numpy`
    emit       a plan's `Matmul(lhs, rhs, dims, epilogue, ty)` kernel as this template

Every operand is a closure over the kernel's flat input refs and an index tile (MLKL's IExpr idea),
so a LayerNorm apply, a GEGLU gate, casts and views are computed while the A tile is loaded, and
several weights side by side (a fused QKV: a `Concat` along N) are read in place. The template
works in canonical coordinates:

    prepass(refs, b, rows, row_ok)          -> stats (any pytree)     rows [bm, 1]
    lhs(refs, (b, rows, ks), mask, stats)   -> [bm, bk]               ks [1, bk]
    rhs(refs, (b, ks, cols), mask)          -> [bk, bn]               ks [bk, 1], cols [1, bn]
    epilogue(refs, acc, (b, rows, cols), mask) -> [bm, bn]            acc: the fp32 accumulator

`b` is the batch program id (a scalar). Tails are masked: M, N and K need not be multiples of the
tile (77 tokens, head dims of 40, 320 channels); an A or B element outside the mask is zero
whatever its closure computes there (LayerNorm apply is not zero at a padded column).

`emit` maps a `dot_general`'s axes onto that form: batch = the batch dims, M = lhs's free dims,
N = rhs's free dims, K = the contracting dims, each flattened row-major and unravelled back into
the operand's own axes inside the closures (`emit.expr.unravel`). Row statistics the A prologue
reads (`RowReduce`, a LayerNorm's moments over K) are hoisted into the pre-pass: computed once per
row block (the shared `emit.expr` reduction: K strips in order, Chan's merge for moments), not
once per K step; a statistic read inside another one's body at its row (a two-pass variance
reading its mean) comes from the pre-pass as well; a statistic whose index depends on K stays
inline.

Statistics of the output (`RowStatistic`: an `EpilogueReduce` the plan hosts on this matmul, the
next LayerNorm's sum or moments over the output's last axes) are computed while the tile is in
registers: each tile writes, per row, the partial over its own columns (a sum, or count, mean and
M2 two-pass over the tile) into its slot of a small fp32 partials buffer, a second output of the
kernel; no atomics, no zeroing. The kernels reading the statistic merge the N tiles in order with
Chan's formula where they read it (`emit.expr.read_partials`): no merge kernel. A statistic of
another shape is left to the driver (its own kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from emit import expr as ex
from emit.pallas import triton as tr
from emit.pallas.contiguous import ContiguousMemory, masked_store
from emit.pallas.partials import Partials, copy_prefix
from eqsat.ops import CONVERT
from eqsat.term import Term, postorder
from eqsat.tiling import MIN_DOT_BLOCK, dot_itemsize  # noqa: F401 (MIN_DOT_BLOCK importable from here)
from eqsat.tiling.matmul import MatmulBlocks  # the tiles, shared with the cost model
from eqsat.types import ints, parse_type

Index = tuple[Any, Any, Any]
PrepassFn = Callable[[Sequence[Any], Any, jax.Array, jax.Array], Any]
LhsFn = Callable[[Sequence[Any], Index, Any, Any], jax.Array]
RhsFn = Callable[[Sequence[Any], Index, Any], jax.Array]
EpilogueFn = Callable[[Sequence[Any], jax.Array, Index, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class RowStatistic:
    """A reduction along N of the output, computed by the output tiles (an `EpilogueReduce` the
    plan hosts on this matmul: the next LayerNorm's moments).

    `value(refs, out_tile, (b, rows, cols), mask) -> (body [bm, bn] fp32, ok)` is the reduction's
    body at each output element (`out_tile` as stored; `ok` where the body reads it) and
    `slot(b, rows) -> [bm, 1]` the statistic output each row belongs to (`0 <= slot < slots`; a
    row's elements all belong to one output, and no two rows share one). Each tile writes, for
    each of its rows, its partial over its own columns into its slot of N tile `j`: partials
    `[N tiles, fields, slots]`, fields the sum (op "sum") or count, mean and M2 (op "moments",
    two-pass over the tile's columns). Every entry is written exactly once: no atomics, no zeroing;
    readers merge the N tiles in order (`emit.expr.read_partials`, Chan's formula for moments).
    """

    op: str
    value: Callable
    slot: Callable
    slots: int

    def __post_init__(self):
        if self.op not in ("sum", "moments"):
            raise NotImplementedError(f"a matmul epilogue computes sum or moments statistics, not {self.op!r}")

    @property
    def fields(self) -> int:
        return 3 if self.op == "moments" else 1


@dataclasses.dataclass(frozen=True)
class MatmulProblem:
    """A matmul in canonical coordinates (see the module docstring)."""

    batch: int
    m: int
    n: int
    k: int
    lhs: LhsFn
    rhs: RhsFn
    epilogue: EpilogueFn
    out_dtype: Any
    prepass: PrepassFn | None = None
    statistics: tuple["RowStatistic", ...] = ()
    lhs_zero_masked: bool = False  # `lhs` is 0 wherever its mask is False (a view of a masked load)
    rhs_zero_masked: bool = False

    def validate(self) -> None:
        for name in ("batch", "m", "n", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"matmul {name}={getattr(self, name)} must be >= 1")
        if self.batch * self.m * self.n > tr.MAX_ELEMENTS:
            raise ValueError(f"a [{self.batch}, {self.m}, {self.n}] result exceeds the int32 index range")


# --- kernel -------------------------------------------------------------------------------------


def store(ref, flat, value, mask) -> None:
    """A masked scatter store into a flat ref. Masked lanes point past the end (interpret mode's
    scatter drops them), where an in-range index would race with the lane that owns it."""
    tr.store(ref, jnp.where(mask, flat, ref.shape[0]), value, mask)


def _write_row_partials(statistic: RowStatistic, partial_ref, inputs, out, index, mask, first_tile: int) -> None:
    """This tile's partial of `statistic` for each of its rows, into N tile `j`'s slots (tile rows
    `first_tile` on: the earlier hosts' partials come first)."""
    b, rows, cols = index
    body, ok = statistic.value(inputs, out, index, mask)
    valid = jnp.broadcast_to(mask & ok if ok is not True else mask, body.shape)
    body = jnp.where(valid, body, 0.0)
    if statistic.op == "sum":
        count = jnp.sum(jnp.where(valid, 1.0, 0.0), axis=1, keepdims=True)
        fields = (jnp.sum(body, axis=1, keepdims=True),)
    else:  # two-pass over the tile's columns, the mean corrected once
        fields = ex.piece_moments(body, valid, 1)
        count = fields[0]
    slot = jnp.broadcast_to(statistic.slot(b, rows), count.shape)
    written = count > 0  # rows past M have no valid element
    tile = first_tile + pl.program_id(2)
    for f, value in enumerate(fields):
        store(partial_ref, (tile * statistic.fields + f) * statistic.slots + slot, value, written)


def matmul_kernel(*refs, problem: MatmulProblem, blocks: MatmulBlocks, num_inputs: int,
                  prefix_sizes: tuple[int, ...] = ()):
    # Flat refs: the operands, the earlier hosts' partials of each statistic that has some, the
    # output, each statistic's partials.
    n_prefixes = sum(size > 0 for size in prefix_sizes)
    inputs, prefixes = refs[:num_inputs], iter(refs[num_inputs:num_inputs + n_prefixes])
    out_ref, *partial_refs = refs[num_inputs + n_prefixes:]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    row_ok, col_ok = rows < problem.m, cols < problem.n
    stats = problem.prepass(inputs, b, rows, row_ok) if problem.prepass is not None else None

    def k_step(t, acc):
        ks_a = t * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ks_b = t * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        mask_a, mask_b = row_ok & (ks_a < problem.k), (ks_b < problem.k) & col_ok
        a = jnp.broadcast_to(problem.lhs(inputs, (b, rows, ks_a), mask_a, stats), (bm, bk))
        w = jnp.broadcast_to(problem.rhs(inputs, (b, ks_b, cols), mask_b), (bk, bn))
        dtype = jnp.promote_types(a.dtype, w.dtype)
        # A tile read straight from memory is zero where masked already: selecting again would keep
        # it in registers, where the MMA cannot read it from the pipelined shared-memory buffer.
        a = a.astype(dtype) if problem.lhs_zero_masked else jnp.where(mask_a, a.astype(dtype), jnp.zeros((), dtype))
        w = w.astype(dtype) if problem.rhs_zero_masked else jnp.where(mask_b, w.astype(dtype), jnp.zeros((), dtype))
        return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(problem.k, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    mask = row_ok & col_ok
    out = jnp.broadcast_to(problem.epilogue(inputs, acc, (b, rows, cols), mask), (bm, bn)).astype(problem.out_dtype)
    # Offsets of the padded tile's lanes stay below the last tile's end: (batch·M + M tiles·bm)·N + N tiles·bn.
    bound = (problem.batch * problem.m + pl.cdiv(problem.m, bm) * bm) * problem.n + pl.cdiv(problem.n, bn) * bn
    masked_store(out_ref, (b * problem.m + rows) * problem.n + cols, out, mask, bound=bound)
    program = (b * pl.num_programs(1) + i) * pl.num_programs(2) + j
    programs = problem.batch * pl.cdiv(problem.m, bm) * pl.cdiv(problem.n, bn)
    for statistic, partial_ref, prefix_size in zip(problem.statistics, partial_refs,
                                                   prefix_sizes or (0,) * len(problem.statistics)):
        if prefix_size:
            copy_prefix(next(prefixes), partial_ref, prefix_size, program, programs)
        _write_row_partials(statistic, partial_ref, inputs, out, (b, rows, cols), mask,
                            prefix_size // (statistic.fields * statistic.slots))


# --- build --------------------------------------------------------------------------------------


def build(problem: MatmulProblem, inputs: Sequence[jax.Array], *, blocks: MatmulBlocks | None = None,
          interpret: bool = False, name: str = "matmul", prefixes: Sequence[jax.Array | None] = ()):
    """Run `problem` as one `pallas_call` reading `inputs` (flat refs, in this order); returns the
    output as `[batch, m, n]`, and with `problem.statistics` also their partials (`RowStatistic`),
    each after its `prefixes` entry (None, or the earlier hosts' partials `[tiles, fields, slots]`
    of a statistic several kernels compute, copied in front)."""
    problem.validate()
    blocks = blocks or MatmulBlocks.get_default(problem.m, problem.n, problem.k)
    blocks.validate()
    prefixes = tuple(prefixes) or (None,) * len(problem.statistics)
    if len(prefixes) != len(problem.statistics):
        raise ValueError(f"{len(prefixes)} partials prefixes for {len(problem.statistics)} statistics")
    prefix_tiles = []
    for statistic, prefix in zip(problem.statistics, prefixes):
        row = statistic.fields * statistic.slots
        if prefix is not None and (prefix.dtype != jnp.float32 or prefix.size % row):
            raise ValueError(f"earlier hosts' partials {prefix.shape} {prefix.dtype} are not fp32 [tiles, "
                             f"{statistic.fields}, {statistic.slots}]")
        prefix_tiles.append(0 if prefix is None else prefix.size // row)
    kernel = functools.partial(matmul_kernel, problem=problem, blocks=blocks, num_inputs=len(inputs),
                               prefix_sizes=tuple(t * s.fields * s.slots for t, s in zip(prefix_tiles, problem.statistics)))
    grid = (problem.batch, pl.cdiv(problem.m, blocks.block_m), pl.cdiv(problem.n, blocks.block_n))
    shapes = [jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n), problem.out_dtype)]
    shapes += [jax.ShapeDtypeStruct((t + grid[2], s.fields, s.slots), jnp.float32)
               for t, s in zip(prefix_tiles, problem.statistics)]
    operands = [*inputs, *(prefix for prefix in prefixes if prefix is not None)]
    out, *partials = tr.pallas_call(kernel, operands, shapes, grid=grid, name=name, interpret=interpret,
                                    num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return (out, partials) if problem.statistics else out


# --- reference ----------------------------------------------------------------------------------


def reference(lhs: jax.Array, rhs: jax.Array, epilogue: Callable[[jax.Array], jax.Array] = lambda acc: acc,
              out_dtype=None) -> jax.Array:
    """`epilogue(lhs @ rhs)` for `[batch, m, k] x [batch, k, n]` with fp32 accumulation."""
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    acc = jnp.einsum("bmk,bkn->bmn", lhs.astype(dtype), rhs.astype(dtype), preferred_element_type=jnp.float32)
    return epilogue(acc).astype(out_dtype or lhs.dtype)


# --- emit: a plan's Matmul term -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DotAxes:
    """Which axes of a `dot_general`'s operands are batch, free (M or N) and contracting (K)."""

    lhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    rhs_free: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    batch_shape: tuple[int, ...]
    m_shape: tuple[int, ...]
    n_shape: tuple[int, ...]
    k_shape: tuple[int, ...]

    @classmethod
    def of(cls, dims: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> "DotAxes":
        parts = dims.split(";")
        if len(parts) != 4:
            raise ValueError(f"not matmul dims: {dims!r}")
        lc, rc, lb, rb = (ints(part) for part in parts)
        lf = tuple(a for a in range(len(lhs_shape)) if a not in lc and a not in lb)
        rf = tuple(a for a in range(len(rhs_shape)) if a not in rc and a not in rb)
        if [lhs_shape[a] for a in lc] != [rhs_shape[a] for a in rc] or \
                [lhs_shape[a] for a in lb] != [rhs_shape[a] for a in rb]:
            raise ValueError(f"dims {dims!r} do not match operand shapes {lhs_shape} and {rhs_shape}")
        return cls(lb, lf, lc, rb, rf, rc, tuple(lhs_shape[a] for a in lb), tuple(lhs_shape[a] for a in lf),
                   tuple(rhs_shape[a] for a in rf), tuple(lhs_shape[a] for a in lc))

    @staticmethod
    def place(rank: int, parts) -> tuple:
        """An operand index from (axes, entries) pairs."""
        index: list = [0] * rank
        for axes, entries in parts:
            for axis, entry in zip(axes, entries):
                index[axis] = entry
        return tuple(index)

    def lhs_index(self, rank: int, b, rows, ks) -> tuple:
        return self.place(rank, [(self.lhs_batch, unravel_tile(b, self.batch_shape)),
                                 (self.lhs_free, unravel_tile(rows, self.m_shape)),
                                 (self.lhs_contract, unravel_tile(ks, self.k_shape))])

    def rhs_index(self, rank: int, b, ks, cols) -> tuple:
        return self.place(rank, [(self.rhs_batch, unravel_tile(b, self.batch_shape)),
                                 (self.rhs_free, unravel_tile(cols, self.n_shape)),
                                 (self.rhs_contract, unravel_tile(ks, self.k_shape))])

    def out_index(self, b, rows, cols) -> tuple:
        """`dot_general`'s output axes: batch, lhs free, rhs free."""
        return (*unravel_tile(b, self.batch_shape), *unravel_tile(rows, self.m_shape),
                *unravel_tile(cols, self.n_shape))


def unravel_tile(flat, shape: Sequence[int]) -> tuple:
    """`emit.expr.unravel` of a tile's rows, columns or K lanes into `shape`, without the wrap of the
    outermost axis: a lane past the end (masked) gets an index past its axis, which loads clamp or
    mask, and a single axis is the lanes themselves (`ks`, not `ks % K`: Triton sees a unit-stride
    run)."""
    inner = ex.unravel(flat, shape)
    first = next((axis for axis, size in enumerate(shape) if size != 1), None)
    if first is None:
        return inner
    stride = math.prod(shape[first + 1:])
    return tuple(ex.div(flat, stride) if axis == first else entry for axis, entry in enumerate(inner))


def _outer_row_reduces(term: Term) -> list[Term]:
    """The `RowReduce`s `term` reads directly, not only inside another one's body or epilogue, and
    its reads of statistics other kernels computed (`Load(EpilogueReduce)`, merged from partials)."""
    found: dict[int, Term] = {}
    seen: set[int] = set()
    stack = [term]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "RowReduce" or (node.op == "Load" and node.args[0].op == "EpilogueReduce"):
            found[id(node)] = node
            continue
        stack.extend(child for child in node.children if child.sort == "Expr")
    return list(found.values())


def _expr_children(node: Term) -> tuple:
    """The Expr children of `node`; none for a `Load` (its tensor is another kernel's)."""
    return () if node.op == "Load" else tuple(c for c in node.children if c.sort == "Expr")


def _substitute(term: Term, replace: dict[Term, Term]) -> Term:
    """`term` with the subterms in `replace` replaced (terms are interned: rebuilt bottom-up)."""
    built: dict[int, Term] = {}
    for node in postorder([term], _expr_children):  # a Load's tensor (another kernel) is kept
        if node in replace:
            built[id(node)] = replace[node]
            continue
        if node.op == "Load":
            built[id(node)] = node
            continue
        args = tuple(built[id(a)] if isinstance(a, Term) else a for a in node.args)
        built[id(node)] = node if all(x is y for x, y in zip(args, node.args)) else Term(node.op, *args)
    return built[id(term)]


class _HoistedMemory:
    """Operands from `base`; each hoisted statistic (a placeholder tensor) from the pre-pass.

    Probing (`values is None`): records the index each placeholder is read at and returns zeros
    without touching memory (the probe's arithmetic is dead code). Afterwards, the n-th read of a
    placeholder returns the n-th pre-computed value: a prologue reads its statistics in the same
    order at every K step. A value of None (a statistic read at an index that moves with K) is
    computed where it is read.
    """

    def __init__(self, base, placeholders: dict[Term, Term], statistics: dict, values: dict | None = None):
        self.base = base
        self.placeholders = placeholders
        self.statistics = statistics  # placeholder -> its compiled RowReduce
        self.values = values
        self.recorded: dict[Term, list] = {p: [] for p in placeholders}
        self.cursor = {p: 0 for p in placeholders}
        self.chunk_elements = getattr(base, "chunk_elements", ex.DEFAULT_CHUNK_ELEMENTS)

    def load(self, tensor: Term, index, mask):
        dtype = parse_type(tensor.ty).dtype
        if tensor in self.placeholders:
            if self.values is None:
                self.recorded[tensor].append(index)
                return jnp.zeros(ex.shape_of(index), dtype)
            position = self.cursor[tensor]
            self.cursor[tensor] += 1
            value = self.values[tensor][position]
            return value if value is not None else self.statistics[tensor](self.base, index, mask)
        if self.values is None:
            return jnp.zeros(ex.shape_of(tuple(index) + ((mask,) if not isinstance(mask, bool) else ())), dtype)
        return self.base.load(tensor, index, mask)


def _k_independent(index) -> bool:
    """Whether every entry of an A-tile index is constant along the tile's K axis."""
    return all(ex.is_static(e) or e.ndim < 2 or e.shape[-1] == 1 for e in index)


def _reads_at_kept_index(statistic: Term, inner: Term) -> bool:
    """Whether `statistic` (a RowReduce) reads the RowReduce `inner` only in its body, and there only
    at its own kept index (through elementwise ops and Broadcasts that add the reduced axis): a
    LayerNorm's variance reading its mean. Then `inner` computed at the statistic's index serves
    every one of those reads, and the pre-pass need not recompute it per chunk."""
    _op, body, axis, epilogue, _ty = statistic.args
    body_shape = parse_type(body.ty).shape
    kept = tuple(a for a in range(len(body_shape)) if a != axis)
    if parse_type(inner.ty).shape != tuple(body_shape[a] for a in kept) or inner in postorder([epilogue]):
        return False
    holders = set()  # ids of the subterms of body that contain `inner`
    for node in postorder([body]):
        if node is inner or any(id(child) in holders for child in node.children):
            holders.add(id(node))
    stack, found = [(body, tuple(range(len(body_shape))))], False
    while stack:
        node, to_body = stack.pop()  # to_body[a]: the body axis that node's axis a is
        if node is inner:
            if to_body != kept:
                return False
            found = True
        elif id(node) not in holders:
            continue
        elif node.op in ("Unary", "Binary", "Select"):
            stack.extend((child, to_body) for child in node.children if child.sort == "Expr")
        elif node.op == "Broadcast":
            x, dims, ty = node.args
            in_shape, out_shape = parse_type(x.ty).shape, parse_type(ty).shape
            if any(in_shape[j] != out_shape[d] for j, d in enumerate(ints(dims))):
                return False
            stack.append((x, tuple(to_body[d] for d in ints(dims))))
        else:
            return False
    return found


class _BoundMemory:
    """Operands from `base`; each of `values` (placeholder -> a statistic computed at the reading
    statistic's kept index) answered for a read inside that statistic's body, whose index is the
    kept index with the body's reduced axis appended."""

    def __init__(self, base, values: dict):
        self.base, self.values = base, values
        self.chunk_elements = getattr(base, "chunk_elements", ex.DEFAULT_CHUNK_ELEMENTS)

    def load(self, tensor: Term, index, mask):
        if tensor not in self.values:
            return self.base.load(tensor, index, mask)
        value = self.values[tensor]
        target = ex.shape_of(index)
        expanded = jnp.reshape(value, value.shape + (1,) * (len(target) - value.ndim))
        if tuple(np.broadcast_shapes(expanded.shape, target)) != tuple(target):
            raise AssertionError(f"a row statistic of shape {value.shape} read at an index of shape {target}")
        return expanded


def _hoist_row_statistics(lhs: Term) -> tuple[Term, dict[Term, Term]]:
    """`lhs` with its outermost `RowReduce`s (and loads of hosted statistics: their merge is hoisted
    too) replaced by placeholder tensors, and placeholder -> what it replaces."""
    placeholders = {Term("Input", f"__row_statistic_{n}", r.ty): r for n, r in enumerate(_outer_row_reduces(lhs))}
    return _substitute(lhs, {r: Term("Load", p, r.ty) for p, r in placeholders.items()}), placeholders


VIEW_OPS = frozenset({"Reshape", "Transpose", "Broadcast", "Slice", "DynamicSlice", "Concat"})


def zero_where_masked(operand: Term) -> bool:
    """Whether `operand` evaluates to 0 wherever its mask is False: views (index arithmetic that
    narrows the mask, never widens it) and float conversions of masked loads, which read 0 there."""
    if operand.op == "Load":
        return operand.args[0].op != "EpilogueReduce"  # a statistic is merged from partials, not loaded
    if operand.op == "Unary" and operand.args[0] == CONVERT:
        return parse_type(operand.ty).dtype != "bool" and zero_where_masked(operand.args[1])
    if operand.op in VIEW_OPS:
        inputs = operand.args[:2] if operand.op == "Concat" else operand.args[:1]
        return all(zero_where_masked(x) for x in inputs)
    return False


DOT_DTYPES = ("float16", "bfloat16", "float32")  # the template accumulates in fp32 on tensor cores


def check_dot_dtypes(*operands: Term) -> None:
    """Raise `NotImplementedError` (the dispatcher then runs the kernel through XLA) for an operand
    the fp32-accumulating template would compute wrongly: integers, float64."""
    for operand in operands:
        dtype = parse_type(operand.ty).dtype
        if dtype not in DOT_DTYPES:
            raise NotImplementedError(f"a {dtype} operand (the template multiplies {', '.join(DOT_DTYPES)})")


def _row_statistic(reduction: Term, term: Term, axes: DotAxes, tensors: Sequence[Term]) -> RowStatistic:
    """The part of `reduction` (an `EpilogueReduce`) the matmul `term` computes: the elements it
    writes, when each output row belongs to one statistic output of its own (a LayerNorm over the
    output's last axes). Raises `NotImplementedError` otherwise (the driver computes it)."""
    from emit.pallas.conv import _body_index, _spine_path, _TileMemory

    _producer, op, body, axes_key, ty = reduction.args
    path = _spine_path(body, term)
    if path is None:
        raise NotImplementedError(f"{reduction!r} does not read this matmul's output at the element it writes")
    body_shape = parse_type(body.ty).shape
    reduced = set(ints(axes_key))
    kept_axes = [a for a in range(len(body_shape)) if a not in reduced]
    kept_shape = [body_shape[a] for a in kept_axes]
    slots = max(1, math.prod(kept_shape))
    m = math.prod(axes.m_shape)

    def slot_of(index):
        return ex.linearize(tuple(index[a] for a in kept_axes), kept_shape)

    # Every output element's statistic output, on the host: one per row, no two rows alike.
    rows = np.arange(math.prod(axes.batch_shape) * m)[:, None]
    index, ok = _body_index(path, axes.out_index(rows // m, rows % m, np.arange(math.prod(axes.n_shape))[None, :]))
    if ok is not True and not np.all(ok):
        raise NotImplementedError(f"{reduction!r} reads only part of this matmul's output")
    table = np.broadcast_to(slot_of(index), (rows.shape[0], math.prod(axes.n_shape)))
    if not np.array_equal(table, table[:, :1] + np.zeros_like(table)) or \
            len(np.unique(table[:, 0])) != rows.shape[0] or rows.shape[0] != slots:
        raise NotImplementedError(f"{reduction!r} is not one statistic per output row")
    compiled = ex.compile_expr(path[0])  # the body as this host computes it (`_spine_path`)

    def value(refs, out_tile, index, mask):
        body_index, body_ok = _body_index(path, axes.out_index(*index))
        memory = _TileMemory(ContiguousMemory(dict(zip(tensors, refs))), term, out_tile)
        body_mask = mask if body_ok is True else mask & body_ok
        return compiled(memory, body_index, body_mask).astype(jnp.float32), body_ok

    def slot(b, rows):
        index, _ = _body_index(path, axes.out_index(b, rows, 0))
        return slot_of(index)

    return RowStatistic(op, value, slot, slots)


def _statistic_reads(hosted: Sequence[Term], term: Term) -> list[Term]:
    """The part of each hosted statistic's body this matmul evaluates (what it reads besides its output)."""
    from emit.pallas.conv import _spine_path

    parts = []
    for reduction in hosted:
        try:
            path = _spine_path(reduction.args[2], term) if reduction.args[1] in ("sum", "moments") else None
        except NotImplementedError:
            continue  # `_row_statistic` refuses it too: the driver computes it
        if path is not None:
            parts.append(path[0])
    return parts


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Matmul` kernel (`emit.pallas.KernelCall`) in `ctx`, plus
    the partials (`emit.pallas.partials.Partials`) of each hosted statistic (`EpilogueReduce`) it
    computes: the earlier hosts' (`ctx.pending`), then its own tiles; readers merge them. A
    statistic this template cannot compute is left to the driver (its own kernel)."""
    from emit.pallas import loaded_tensors

    term = kernel.term
    lhs, rhs, dims, epilogue, ty = term.args
    lhs_shape, rhs_shape, out_type = parse_type(lhs.ty).shape, parse_type(rhs.ty).shape, parse_type(ty)
    axes = DotAxes.of(dims, lhs_shape, rhs_shape)
    batch, m, n, k = (math.prod(s) for s in (axes.batch_shape, axes.m_shape, axes.n_shape, axes.k_shape))
    if min(batch, m, n, k) == 0:
        raise NotImplementedError("an empty matmul")
    check_dot_dtypes(lhs, rhs)
    hosted_parts = _statistic_reads(kernel.hosted, term)
    for expression in (lhs, rhs, epilogue, *hosted_parts):
        missing = ex.unsupported_ops(expression)
        if missing:
            raise NotImplementedError(f"no Triton form for {', '.join(missing)}")
    blocks = MatmulBlocks.get_default(m, n, k, dot_itemsize(lhs.ty, rhs.ty))
    lhs_term, placeholders = _hoist_row_statistics(lhs)
    lhs_fn = ex.compile_expr(lhs_term)
    rhs_fn, epilogue_fn = ex.compile_expr(rhs), ex.compile_expr(epilogue)
    statistic_fns = {p: ex.compile_expr(r) for p, r in placeholders.items()}  # inline, where K moves the index
    # In the pre-pass, a statistic read inside another one's body at its kept index comes from the
    # pre-pass too (the LayerNorm variance's mean), not from a reduction per chunk.
    inners = {p: [q for q, inner in placeholders.items()
                  if q is not p and r.op == inner.op == "RowReduce" and _reads_at_kept_index(r, inner)]
              for p, r in placeholders.items()}
    prepass_fns = {p: ex.compile_expr(_substitute(r, {placeholders[q]: Term("Load", q, placeholders[q].ty)
                                                      for q in inners[p]}))
                   for p, r in placeholders.items()}
    tensors = [t for t in loaded_tensors(lhs, rhs, epilogue, *hosted_parts) if t is not term]
    lhs_rank, rhs_rank = len(lhs_shape), len(rhs_shape)

    def memory(refs):
        return ContiguousMemory(dict(zip(tensors, refs)))

    def prepass(refs, b, rows, row_ok):
        """Each hoisted statistic at the index the prologue reads it (found by a probe at K strip 0)."""
        ks = lax.broadcasted_iota(jnp.int32, (1, blocks.block_k), 1)
        probe = _HoistedMemory(memory(refs), placeholders, statistic_fns)
        lhs_fn(probe, axes.lhs_index(lhs_rank, b, rows, ks), row_ok & (ks < k))
        computed: dict = {}

        def statistic_mask(index):
            """`row_ok` where the statistic's index has the rows axis; with no M axes, or M axes of
            size 1 (the index is static), a rows-shaped mask would give the value an axis its readers'
            index lacks. Loads clamp, so unmasked rows compute values nobody reads."""
            shape = ex.shape_of(tuple(index))
            return row_ok if tuple(np.broadcast_shapes(shape, row_ok.shape)) == tuple(shape) else True

        def value_at(placeholder, index):
            key = (placeholder, tuple(("i", int(e)) if ex.is_static(e) else ("a", id(e)) for e in index))
            if key not in computed:
                kept = index[1:] if placeholders[placeholder].args[0] == "moments" else index  # [mean, M2] rows
                bound = {q: value_at(q, kept) for q in inners[placeholder]}
                source = _BoundMemory(memory(refs), bound) if bound else memory(refs)
                computed[key] = prepass_fns[placeholder](source, index, statistic_mask(index))
            return computed[key]

        return {placeholder: [value_at(placeholder, index) if _k_independent(index) else None for index in indices]
                for placeholder, indices in probe.recorded.items()}

    def lhs_tile(refs, index, mask, stats):
        b, rows, ks = index
        source = _HoistedMemory(memory(refs), placeholders, statistic_fns, stats) if placeholders else memory(refs)
        return lhs_fn(source, axes.lhs_index(lhs_rank, b, rows, ks), mask)

    def rhs_tile(refs, index, mask):
        b, ks, cols = index
        return rhs_fn(memory(refs), axes.rhs_index(rhs_rank, b, ks, cols), mask)

    def epilogue_tile(refs, acc, index, mask):
        out_index = axes.out_index(*index)

        def accumulator(acc_ty, at, acc_mask):
            if len(at) != len(out_index) or any(a is not o and not (ex.is_static(a) and ex.is_static(o) and a == o)
                                                for a, o in zip(at, out_index)):
                raise NotImplementedError("the epilogue reads the accumulator through a view")
            return acc

        return epilogue_fn(memory(refs), out_index, mask, accumulator)

    statistics, computed = [], []
    for reduction in kernel.hosted:
        try:
            statistics.append(_row_statistic(reduction, term, axes, tensors))
        except NotImplementedError:
            continue
        computed.append(reduction)
    problem = MatmulProblem(batch, m, n, k, lhs_tile, rhs_tile, epilogue_tile, jnp.dtype(out_type.dtype),
                            prepass=prepass if placeholders else None, statistics=tuple(statistics),
                            lhs_zero_masked=zero_where_masked(lhs), rhs_zero_masked=zero_where_masked(rhs))
    result = build(problem, [ctx.operand(t) for t in tensors], blocks=blocks, interpret=ctx.interpret,
                   name=kernel.name, prefixes=[ctx.pending.get(r) for r in computed])
    out, partials = result if statistics else (result, [])
    return {term: out.reshape(out_type.shape), **{r: Partials(p) for r, p in zip(computed, partials)}}
