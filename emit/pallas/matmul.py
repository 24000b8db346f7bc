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
once per K step; a statistic whose index depends on K stays inline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from emit import expr as ex
from emit.pallas import triton as tr
from eqsat.term import Term, postorder
from eqsat.types import ints, parse_type

Index = tuple[Any, Any, Any]
PrepassFn = Callable[[Sequence[Any], Any, jax.Array, jax.Array], Any]
LhsFn = Callable[[Sequence[Any], Index, Any, Any], jax.Array]
RhsFn = Callable[[Sequence[Any], Index, Any], jax.Array]
EpilogueFn = Callable[[Sequence[Any], jax.Array, Index, Any], jax.Array]
MIN_DOT_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """Tile sizes (powers of two, >= 16) and launch parameters of one matmul kernel."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, m: int, n: int, k: int) -> "MatmulBlocks":
        """64x64x32 tiles (128x128 for large problems), shrunk to small dimensions."""
        large = m >= 1024 and n >= 256
        block_m = min(128 if large else 64, max(MIN_DOT_BLOCK, tr.next_pow2(m)))
        block_n = min(128 if large else 64, max(MIN_DOT_BLOCK, tr.next_pow2(n)))
        block_k = min(32, max(MIN_DOT_BLOCK, tr.next_pow2(k)))
        return cls(block_m, block_n, block_k, num_warps=8 if large else 4, num_stages=3 if large else 2)

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_BLOCK or value != tr.next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")


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


def matmul_kernel(*refs, problem: MatmulProblem, blocks: MatmulBlocks, num_inputs: int):
    inputs, (out_ref,) = refs[:num_inputs], refs[num_inputs:]
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
        a = jnp.where(mask_a, a.astype(dtype), jnp.zeros((), dtype))
        w = jnp.where(mask_b, w.astype(dtype), jnp.zeros((), dtype))
        return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(problem.k, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    mask = row_ok & col_ok
    out = jnp.broadcast_to(problem.epilogue(inputs, acc, (b, rows, cols), mask), (bm, bn))
    store(out_ref, (b * problem.m + rows) * problem.n + cols, out, mask)


# --- build --------------------------------------------------------------------------------------


def build(problem: MatmulProblem, inputs: Sequence[jax.Array], *, blocks: MatmulBlocks | None = None,
          interpret: bool = False, name: str = "matmul") -> jax.Array:
    """Run `problem` as one `pallas_call` reading `inputs` (flat refs, in this order); returns the
    output as `[batch, m, n]`."""
    problem.validate()
    blocks = blocks or MatmulBlocks.get_default(problem.m, problem.n, problem.k)
    blocks.validate()
    kernel = functools.partial(matmul_kernel, problem=problem, blocks=blocks, num_inputs=len(inputs))
    grid = (problem.batch, pl.cdiv(problem.m, blocks.block_m), pl.cdiv(problem.n, blocks.block_n))
    (out,) = tr.pallas_call(kernel, inputs, [jax.ShapeDtypeStruct((problem.batch, problem.m, problem.n),
                                                                  problem.out_dtype)],
                            grid=grid, name=name, interpret=interpret, num_warps=blocks.num_warps,
                            num_stages=blocks.num_stages)
    return out


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
        return self.place(rank, [(self.lhs_batch, ex.unravel(b, self.batch_shape)),
                                 (self.lhs_free, ex.unravel(rows, self.m_shape)),
                                 (self.lhs_contract, ex.unravel(ks, self.k_shape))])

    def rhs_index(self, rank: int, b, ks, cols) -> tuple:
        return self.place(rank, [(self.rhs_batch, ex.unravel(b, self.batch_shape)),
                                 (self.rhs_free, ex.unravel(cols, self.n_shape)),
                                 (self.rhs_contract, ex.unravel(ks, self.k_shape))])

    def out_index(self, b, rows, cols) -> tuple:
        """`dot_general`'s output axes: batch, lhs free, rhs free."""
        return (*ex.unravel(b, self.batch_shape), *ex.unravel(rows, self.m_shape), *ex.unravel(cols, self.n_shape))


def _outer_row_reduces(term: Term) -> list[Term]:
    """The `RowReduce`s `term` reads directly, not only inside another one's body or epilogue."""
    found: dict[int, Term] = {}
    seen: set[int] = set()
    stack = [term]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "RowReduce":
            found[id(node)] = node
            continue
        stack.extend(child for child in node.children if child.sort == "Expr")
    return list(found.values())


def _substitute(term: Term, replace: dict[Term, Term]) -> Term:
    """`term` with the subterms in `replace` replaced (terms are interned: rebuilt bottom-up)."""
    built: dict[int, Term] = {}
    for node in postorder([term]):
        if node in replace:
            built[id(node)] = replace[node]
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


def _hoist_row_statistics(lhs: Term) -> tuple[Term, dict[Term, Term]]:
    """`lhs` with its outermost `RowReduce`s replaced by placeholder tensors, and placeholder -> RowReduce."""
    placeholders = {Term("Input", f"__row_statistic_{n}", r.ty): r for n, r in enumerate(_outer_row_reduces(lhs))}
    return _substitute(lhs, {r: Term("Load", p, r.ty) for p, r in placeholders.items()}), placeholders


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Matmul` kernel (`emit.pallas.KernelCall`) in `ctx`."""
    term = kernel.term
    lhs, rhs, dims, epilogue, ty = term.args
    lhs_shape, rhs_shape, out_type = parse_type(lhs.ty).shape, parse_type(rhs.ty).shape, parse_type(ty)
    axes = DotAxes.of(dims, lhs_shape, rhs_shape)
    batch, m, n, k = (math.prod(s) for s in (axes.batch_shape, axes.m_shape, axes.n_shape, axes.k_shape))
    if min(batch, m, n, k) == 0:
        raise NotImplementedError("an empty matmul")
    for expression in (lhs, rhs, epilogue):
        missing = ex.unsupported_ops(expression)
        if missing:
            raise NotImplementedError(f"no Triton form for {', '.join(missing)}")
    blocks = MatmulBlocks.get_default(m, n, k)
    lhs_term, placeholders = _hoist_row_statistics(lhs)
    lhs_fn = ex.compile_expr(lhs_term)
    rhs_fn, epilogue_fn = ex.compile_expr(rhs), ex.compile_expr(epilogue)
    statistic_fns = {p: ex.compile_expr(r) for p, r in placeholders.items()}
    from emit.pallas import loaded_tensors

    tensors = loaded_tensors(lhs, rhs, epilogue)
    lhs_rank, rhs_rank = len(lhs_shape), len(rhs_shape)

    def memory(refs):
        return tr.RefMemory(dict(zip(tensors, refs)))

    def prepass(refs, b, rows, row_ok):
        """Each hoisted statistic at the index the prologue reads it (found by a probe at K strip 0)."""
        ks = lax.broadcasted_iota(jnp.int32, (1, blocks.block_k), 1)
        probe = _HoistedMemory(memory(refs), placeholders, statistic_fns)
        lhs_fn(probe, axes.lhs_index(lhs_rank, b, rows, ks), row_ok & (ks < k))
        return {placeholder: [statistic_fns[placeholder](memory(refs), index, row_ok) if _k_independent(index) else None
                              for index in indices]
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

    problem = MatmulProblem(batch, m, n, k, lhs_tile, rhs_tile, epilogue_tile, jnp.dtype(out_type.dtype),
                            prepass=prepass if placeholders else None)
    out = build(problem, [ctx.value(t) for t in tensors], blocks=blocks, interpret=ctx.interpret, name=kernel.name)
    return {term: out.reshape(out_type.shape)}
