"""The expression compiler every template shares: an `Expr` term evaluated at an index tile.

An `Expr` (`eqsat.lang`) says what a kernel computes per element. A template does not evaluate it
on whole arrays; it asks for its value at a *point*: a tuple of indices, one per axis of the
expression's type, and a validity mask (MLKL's IExpr idea, composed in Python at trace time).

    fn = compile_expr(term)                       # once per kernel, at trace time
    value = fn(memory, index, mask)               # an array of the point's shape, the term's dtype

- `index`: one entry per axis of `term`'s type; each entry is a Python `int` (the same index for
  every lane) or an int32 array. Arrays have the same rank and broadcast together, e.g. `[BM, 1]`
  and `[1, BK]` for a matmul operand tile; the point's shape is their broadcast shape.
- `mask`: `True` or a bool array broadcasting with the index; lanes where it is False may hold
  out-of-range indices and their values are unspecified (never read past a tensor: `memory.load`
  clamps). Views narrow the mask further (a `Concat` side, a `Pad` border).
- `memory`: where `Load(T)` reads, any object with `load(tensor, index, mask) -> array` (the
  `Memory` protocol): `emit.pallas.triton.RefMemory` gathers from a tensor's flat Pallas ref at the
  linearized index; `ArrayMemory` here indexes whole jax arrays (tests, references).
- `acc`: what `Acc(ty)` means in an epilogue, a function `acc(ty, index, mask) -> array` the
  template provides (its accumulator at those output indices); `None` outside epilogues.

A view is index arithmetic, never a copy: `Transpose` permutes the index tuple, `Reshape`
linearizes and unravels (constant div/mod, only across the axes it really merges or splits),
`Broadcast` drops or zeroes axes, `Slice`/`DynamicSlice` offset and stride, `Concat` evaluates both
sides at clamped indices and selects, `Pad` masks its border. Elementwise ops have
`eqsat.lift.apply_unary`/`apply_binary` semantics; half-precision arithmetic runs in float32 and
rounds per op (as XLA does); ops the Triton lowering lacks are built from ones it has (`erf` is a
polynomial, `round` from `floor`, products by halving). `unsupported_ops(term)` names what this
compiler cannot emit, so a dispatcher can fall back before tracing.

`RowReduce(op, body, axis, epilogue, ty)` is a reduction inside the kernel: for each point it
walks `body`'s `axis` in power-of-two chunks (`lax.fori_loop`), in a fixed order: `sum`, `max`,
`min`, `prod`, `and`/`or`/`xor`, `argmax`/`argmin` (first index wins, NaN counts as largest) and
`moments` (`f32[2, ...]`: `[0]` the mean, `[1]` M2 = sum((x - mean)^2), from per-chunk count/mean/M2
merged with Chan's parallel formula). `reduce_at` is the same machinery for templates whose
accumulator is a reduction (the `Reduce` template's `Acc`).

Evaluation memoizes per point: a subterm read twice at the same index arrays (`x * sigmoid(x)`,
both rows of one `moments`) is computed once.

A statistic computed in its producers' epilogues (`Load(EpilogueReduce)`, a GroupNorm's or
LayerNorm's mean and M2) usually reaches a kernel as its hosts' per-tile partials
(`[tiles, fields, slots]`: each tile's sum, or count, mean and M2), not as finished values: the
memory reads it with `read_partials`, which merges the tiles of the slot the index names and
memoizes the merge by the kept index, so a reader's mean and M2 at one point merge once.
`merge_partials_at` loads TB tiles per step (a power of two, TB x the point's lanes <= 4096
elements) and reduces them with vector reductions (sums added; moments two-pass over the block's
tiles in a frame shifted by a tile's mean), then merges the ceil(tiles / TB) blocks in order
(sums added, moments by Chan's formula): a serial chain of blocks, not of tiles, in a fixed order.
`partials_layout` tells the two bindings apart by the buffer's size: a statistic the plan finishes
once (`emit.pallas.partials.finalize`, where `eqsat.cost.merges` prices that lower than its
readers' merges) is bound to its finished value and read like any tensor.
"""

from __future__ import annotations

import math
from collections import ChainMap
from typing import Callable, Iterator, Protocol, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eqsat.ops import CONVERT, apply_binary
from eqsat.term import Term
from eqsat.tiling.partials import MERGE_BLOCK_ELEMENTS, merge_block_tiles  # shared with the cost model
from eqsat.tiling.reshape import reshape_groups
from eqsat.types import ints, parse_type

IndexEntry = Union[int, jax.Array]
Index = tuple[IndexEntry, ...]
Mask = Union[bool, jax.Array]
AccFn = Callable[[str, Index, Mask], jax.Array]

# Elements of one reduction chunk (point lanes × chunk length), unless a memory says otherwise.
DEFAULT_CHUNK_ELEMENTS = 4096
REDUCE_OPS = ("sum", "max", "min", "prod", "and", "or", "xor", "argmax", "argmin", "moments")


class Memory(Protocol):
    """Where `Load(tensor)` reads: `load` returns `tensor`'s elements at `index` (one entry per
    axis of `tensor`), zero (or anything) where `mask` is False, never reading out of bounds.

    A memory that may bind a statistic (`EpilogueReduce`) to its hosts' per-tile partials also has
    `partials_source(statistic) -> (layout, load) | None` (`partials_layout`, and a function reading
    the flat buffer at offsets), so the compiler merges each point once (`read_partials`); its
    `load` must merge too, for wrappers that only forward `load`."""

    def load(self, tensor: Term, index: Index, mask: Mask) -> jax.Array: ...


# --- index arithmetic (ints stay ints, so static indices fold at trace time) ---------------------


def is_static(entry) -> bool:
    return isinstance(entry, (int, np.integer))


def shape_of(entries) -> tuple[int, ...]:
    """The broadcast shape of index entries / mask (ints and bools are scalars)."""
    shapes = [tuple(e.shape) for e in entries if not isinstance(e, (int, bool, np.integer, np.bool_))]
    return tuple(np.broadcast_shapes(*shapes)) if shapes else ()


def add(a: IndexEntry, b: IndexEntry) -> IndexEntry:
    if is_static(a) and is_static(b):
        return int(a) + int(b)
    if is_static(b) and b == 0:
        return a
    if is_static(a) and a == 0:
        return b
    return a + b


def mul(a: IndexEntry, k: int) -> IndexEntry:
    if is_static(a):
        return int(a) * k
    return a if k == 1 else a * k


def div(a: IndexEntry, k: int) -> IndexEntry:
    """`a // k` for a >= 0: truncating division, which equals floor division there and lowers to
    one `div` (jnp's floor division adds a sign fix-up that hides unit-stride runs from Triton's
    contiguity analysis, so the loads of a reshaped or transposed view stayed scalar). Lanes where
    a < 0 are masked lanes: their value is never used."""
    if is_static(a):
        return int(a) // k
    if k == 1:
        return a
    if isinstance(a, np.ndarray):  # host-side index tables
        return a // k
    return lax.div(a, jnp.asarray(k, a.dtype))


def mod(a: IndexEntry, k: int) -> IndexEntry:
    """`a % k` for a >= 0 (truncating remainder, as `div`)."""
    if is_static(a):
        return int(a) % k
    if k == 1:
        return 0
    if isinstance(a, np.ndarray):
        return a % k
    return lax.rem(a, jnp.asarray(k, a.dtype))


def clip(a: IndexEntry, lo: int, hi: int) -> IndexEntry:
    if is_static(a):
        return min(max(int(a), lo), hi)
    return jnp.clip(a, lo, hi)


def both(a: Mask, b: Mask) -> Mask:
    """The conjunction of two masks (`True` is "every lane")."""
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    return jnp.logical_and(a, b)


def compare(op: str, a: IndexEntry, k: int) -> Mask:
    """`a <op> k` as a mask ("lt", "ge", "eq")."""
    if is_static(a):
        return bool({"lt": int(a) < k, "ge": int(a) >= k, "eq": int(a) == k}[op])
    return {"lt": a < k, "ge": a >= k, "eq": a == k}[op]


def linearize(index: Index, shape: Sequence[int]) -> IndexEntry:
    """The row-major flat offset of `index` in an array of `shape`."""
    flat: IndexEntry = 0
    stride = 1
    for entry, size in zip(reversed(index), reversed(tuple(shape))):
        if size != 1:
            flat = add(flat, mul(entry, stride))
        stride *= size
    return flat


def unravel(flat: IndexEntry, shape: Sequence[int]) -> Index:
    """The row-major multi-index of flat offset `flat` (>= 0) in `shape` (constant div/mod)."""
    out: list[IndexEntry] = []
    stride = math.prod(shape)
    for size in shape:
        stride //= size
        out.append(0 if size == 1 else mod(div(flat, stride), size))
    return tuple(out)


def grid_index(shape: Sequence[int]) -> Index:
    """Every index of `shape` as broadcast iotas (a whole-array point, for tests and references)."""
    rank = len(shape)
    return tuple(
        lax.broadcasted_iota(jnp.int32, tuple(size if a == axis else 1 for a in range(rank)), axis)
        for axis, size in enumerate(shape))


_reshape_groups = reshape_groups


class IndexViews:
    """How the index entries of one evaluation were built by reshapes, so that a reshape and its
    inverse give back the entries they started from (GroupNorm reads `x` through
    `reshape(reshape(x, [N, HW, G, C/G]), [N, H, W, C])`: without this the channel index became
    `c // 4 * 4 + c % 4`, which Triton cannot prove unit-stride, and every lane loaded alone).

    `linearize(entries, sizes)` and `unravel(flat, sizes)` are the module's functions, with two
    shortcuts: a flat offset this object built from entries is unravelled back into them (regrouped
    where the new sizes merge runs of the old axes), and pieces this object cut from one offset are
    linearized back into it when they cover it whole. Entries of live lanes are in range, so both
    are exact there; masked lanes may hold other (unused) values. Holds the entries it names, so
    their ids stay unique while it lives (one evaluation)."""

    def __init__(self):
        self.composite: dict[int, tuple] = {}  # id(flat) -> (flat, entries, sizes): flat = linearize(entries, sizes)
        self.pieces: dict[int, tuple] = {}     # id(piece) -> (piece, source, stride, size, total)

    def linearize(self, entries: Sequence[IndexEntry], sizes: Sequence[int]) -> IndexEntry:
        kept = [(e, n) for e, n in zip(entries, sizes) if n != 1]
        whole = self._whole_source(kept)
        if whole is not None:
            return whole
        flat = linearize(tuple(entries), sizes)
        if not is_static(flat) and len(kept) > 1:
            self.composite[id(flat)] = (flat, tuple(e for e, _ in kept), tuple(n for _, n in kept))
        return flat

    def _whole_source(self, kept) -> IndexEntry | None:
        """The offset `kept` (entries, sizes) are the row-major pieces of, when they are all of it."""
        found = [self.pieces.get(id(e)) for e, _ in kept]
        if not kept or any(f is None or f[0] is not e for f, (e, _) in zip(found, kept)):
            return None
        source, total = found[0][1], found[0][4]
        stride = 1
        for (_, n), (_, src, piece_stride, piece_size, _) in zip(reversed(kept), reversed(found)):
            if src is not source or piece_stride != stride or piece_size != n:
                return None
            stride *= n
        return source if stride == total else None

    def unravel(self, flat: IndexEntry, sizes: Sequence[int]) -> Index:
        if is_static(flat):
            return unravel(flat, sizes)
        regrouped = self._regroup(flat, sizes)
        if regrouped is not None:
            return regrouped
        if sum(size != 1 for size in sizes) == 1:  # one axis holds it all: `flat` itself, in range
            return tuple(flat if size != 1 else 0 for size in sizes)
        out = unravel(flat, sizes)
        stride, total = math.prod(sizes), math.prod(sizes)
        for entry, size in zip(out, sizes):
            stride //= size
            if not is_static(entry):
                self.pieces[id(entry)] = (entry, flat, stride, size, total)
        return out

    def _regroup(self, flat, sizes: Sequence[int]) -> Index | None:
        """`flat`'s own entries, linearized in runs matching `sizes`, when `flat` is a composite
        whose axis boundaries include every boundary of `sizes`."""
        record = self.composite.get(id(flat))
        if record is None or record[0] is not flat:
            return None
        _, entries, entry_sizes = record
        out: list[IndexEntry] = []
        i = 0
        for size in sizes:
            if size == 1:
                out.append(0)
                continue
            run, product = [], 1
            while product < size and i < len(entries):
                run.append(i)
                product *= entry_sizes[i]
                i += 1
            if product != size:
                return None
            out.append(self.linearize([entries[j] for j in run], [entry_sizes[j] for j in run]))
        return tuple(out) if i == len(entries) else None


def reshape_index(index: Index, out_shape: Sequence[int], in_shape: Sequence[int],
                  views: IndexViews | None = None) -> Index:
    """The index into a tensor of `in_shape` that a row-major reshape to `out_shape` reads at `index`
    (`views`: undo the reshapes it recorded, `IndexViews`)."""
    result: list[IndexEntry] = [0] * len(in_shape)
    if math.prod(in_shape) == 0:
        return tuple(result)
    flatten = linearize if views is None else views.linearize
    split = unravel if views is None else views.unravel
    for out_axes, in_axes in _reshape_groups(tuple(out_shape), tuple(in_shape)):
        if len(out_axes) == 1 and len(in_axes) == 1:
            result[in_axes[0]] = index[out_axes[0]]
            continue
        flat = flatten(tuple(index[a] for a in out_axes), [out_shape[a] for a in out_axes])
        for axis, entry in zip(in_axes, split(flat, [in_shape[a] for a in in_axes])):
            result[axis] = entry
    return tuple(result)


# --- elementwise ops, Triton-lowerable ------------------------------------------------------------

_HALF = ("float16", "bfloat16")
# Ops whose lax primitive the Pallas Triton lowering has (jax 0.10.2, `jax/_src/pallas/triton/lowering.py`).
_DIRECT_UNARY = {
    "neg": lax.neg, "sign": lax.sign, "floor": lax.floor, "ceil": lax.ceil, "is_finite": lax.is_finite,
    "exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1,
    "tanh": lax.tanh, "logistic": lax.logistic, "sin": lax.sin, "cos": lax.cos, "tan": lax.tan,
    "asin": lax.asin, "acos": lax.acos, "atan": lax.atan, "sinh": lax.sinh, "cosh": lax.cosh,
    "asinh": lax.asinh, "acosh": lax.acosh, "atanh": lax.atanh, "abs": lax.abs, "sqrt": lax.sqrt,
    "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "square": lax.square, "not": lax.bitwise_not,
    "population_count": lax.population_count, "clz": lax.clz, "erf_inv": lax.erf_inv,
}
# Ops whose result does not depend on rounding intermediate values: run in the operand dtype.
_EXACT_UNARY = frozenset({"neg", "sign", "floor", "ceil", "is_finite", "abs", "not", "population_count", "clz"})
_BUILT_UNARY = frozenset({"erf", "erfc"})
_PARAMETRIC_UNARY = frozenset({"integer_pow", "round"})
_DIRECT_BINARY = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical", "shift_right_arithmetic",
})
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


def erf(x: jax.Array) -> jax.Array:
    """erf in float32 from a rational polynomial (|error| < 1e-6); Triton has no erf lowering.

    The odd/even minimax pair Eigen and XLA use for float32 (`generic_fast_erf_float`): x clamped
    to [-4, 4] (erf is ±1 in float32 beyond), erf(x) = x·p(x²)/q(x²).
    """
    x = jnp.clip(x.astype(jnp.float32), -4.0, 4.0)
    x2 = x * x
    p = jnp.float32(-2.72614225801306e-10)
    for c in (2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
              -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02):
        p = p * x2 + jnp.float32(c)
    q = jnp.float32(-1.45660718464996e-05)
    for c in (-2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02):
        q = q * x2 + jnp.float32(c)
    return x * p / q


def _round(x: jax.Array, method: int) -> jax.Array:
    """lax.round: method 0 rounds half away from zero, 1 half to even (from floor; no round lowering)."""
    if method == 0:
        return jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)
    down = jnp.floor(x)
    frac = x - down
    odd = (down - 2.0 * jnp.floor(down * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return jnp.where(up, down + 1.0, down)


def unary(op: str, x: jax.Array, dtype) -> jax.Array:
    """`Unary(op, x, ty)` (`eqsat.lift.apply_unary` semantics) from Triton-lowerable primitives."""
    dtype = jnp.dtype(dtype)
    if op == CONVERT:
        if dtype == jnp.bool_:
            return x != 0
        return x.astype(dtype)
    name, _, param = op.partition(":")
    half = jnp.dtype(x.dtype).name in _HALF
    if name in _EXACT_UNARY:
        return _DIRECT_UNARY[name](x)
    xf = x.astype(jnp.float32) if half else x
    if name in _DIRECT_UNARY:
        out = _DIRECT_UNARY[name](xf)
    elif name == "erf":
        out = erf(xf)
    elif name == "erfc":
        out = 1.0 - erf(xf)
    elif name == "integer_pow":
        out = lax.integer_pow(xf, int(param))
    elif name == "round":
        out = _round(xf, int(param))
    else:
        raise NotImplementedError(f"unary op {op!r} has no Triton-lowerable form")
    return out.astype(dtype)


def binary(op: str, x: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """`Binary(op, x, y, ty)` (`eqsat.lift.apply_binary` semantics); operands broadcast."""
    if op not in _DIRECT_BINARY:
        raise NotImplementedError(f"binary op {op!r} has no Triton-lowerable form")
    dtype = jnp.dtype(dtype)
    if jnp.dtype(x.dtype).name in _HALF and op not in ("and", "or", "xor"):
        out = apply_binary(op, x.astype(jnp.float32), y.astype(jnp.float32))
        return out if op in _COMPARISONS else out.astype(dtype)
    return apply_binary(op, x, y)


def expr_nodes(*exprs: Term) -> Iterator[Term]:
    """Every Expr node of `exprs`, each once, not entering the tensors they `Load` (other kernels)."""
    seen: set[int] = set()
    stack = [e for e in exprs if e is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(child for child in node.children if child.sort == "Expr")


def unsupported_ops(term: Term) -> list[str]:
    """The ops of the Expr `term` this compiler cannot emit (tensors it loads are not looked into)."""
    bad: set[str] = set()
    for node in expr_nodes(term):
        if node.op == "Unary":
            name = node.args[0].partition(":")[0]
            if node.args[0] != CONVERT and name not in _DIRECT_UNARY and name not in _BUILT_UNARY \
                    and name not in _PARAMETRIC_UNARY:
                bad.add(f"Unary {node.args[0]}")
        elif node.op == "Binary" and node.args[0] not in _DIRECT_BINARY:
            bad.add(f"Binary {node.args[0]}")
        elif node.op == "RowReduce" and node.args[0] not in REDUCE_OPS:
            bad.add(f"RowReduce {node.args[0]}")
    return sorted(bad)


# --- reductions at a point -------------------------------------------------------------------------


def _identity(op: str, dtype):
    dtype = jnp.dtype(dtype)
    if op in ("sum", "or", "xor"):
        return jnp.zeros((), dtype)
    if op in ("prod", "and"):
        return jnp.ones((), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(op in ("min", "argmin"))
    big = jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max
    return jnp.asarray(-big if op in ("max", "argmax") else big, dtype)


def _tree_prod(values: jax.Array) -> jax.Array:
    """Product over the last (power-of-two) axis by halving (Triton has no reduce_prod)."""
    while values.shape[-1] > 1:
        left, right = jnp.split(values, 2, axis=-1)
        values = left * right
    return values[..., 0]


def _chunk_size(length: int, lanes: int, budget: int) -> int:
    """A power-of-two chunk of the reduced axis: as long as `budget` allows, no longer than needed."""
    chunk = 1 << max(0, (length - 1).bit_length())
    cap = max(1, budget // max(1, lanes))
    cap = 1 << (cap.bit_length() - 1)
    return max(1, min(chunk, cap))


def reduce_at(op: str, body: Callable[[Index, Mask], jax.Array], kept: Index, mask: Mask,
              reduced: Sequence[int], *, value_dtype, out_dtype, budget: int = DEFAULT_CHUNK_ELEMENTS):
    """Reduce `body` over axes of sizes `reduced` at the point `kept` (the kept axes' index).

    `body(index, mask)` evaluates the reduced values: `index` is `kept` with one trailing array
    axis added, followed by the reduced axes' indices (a chunk of the reduced axes' row-major
    offsets, unravelled). Chunks are powers of two walked in order by `lax.fori_loop`; a lane
    holds at most `budget` // lanes elements at once. Sums and products accumulate in `out_dtype`
    (the `Acc` dtype); `value_dtype` is the dtype `body` returns. Returns an array of `kept`'s
    point shape, or for `moments` the pair `(mean, m2)` in float32 (Chan's merge of per-chunk
    count/mean/M2, in a frame shifted by each lane's first element, so data at an offset large
    against its spread loses nothing to cancellation, and a constant row's mean is exactly its
    value: the shift plus a mean of zeros). Float sums add their chunks with Neumaier's
    compensation (a chunk itself is a tree sum): no less accurate than XLA's own reductions.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; expected one of {REDUCE_OPS}")
    if op in ("argmax", "argmin") and len(reduced) != 1:
        raise ValueError(f"{op} reduces exactly one axis, got {len(reduced)}")
    length = math.prod(reduced)
    lane_shape = shape_of(kept)
    if length == 0:  # an empty reduction is its identity (a sum over x[..., :0])
        if op == "moments":
            zeros = jnp.zeros(lane_shape, jnp.float32)
            return zeros, zeros
        value_type = jnp.int32 if op in ("argmax", "argmin") else (value_dtype if op in ("max", "min") else out_dtype)
        return jnp.full(lane_shape, _identity(op, value_type), value_type).astype(out_dtype)
    if not isinstance(mask, bool) and tuple(np.broadcast_shapes(lane_shape, mask.shape)) != lane_shape:
        mask = True  # a mask wider than the kept index only guards lanes; loads clamp, so drop it
    rank = len(lane_shape)
    expanded = tuple(e if is_static(e) else e[..., None] for e in kept)
    lane_mask = mask if isinstance(mask, bool) else mask[..., None]
    chunk = _chunk_size(length, math.prod(lane_shape), budget)
    steps = -(-length // chunk)
    ragged = steps * chunk != length
    iota = lax.broadcasted_iota(jnp.int32, (1,) * rank + (chunk,), rank)
    value_dtype = jnp.dtype(value_dtype)
    acc_type = jnp.float32 if op == "moments" else jnp.dtype(out_dtype)
    if value_dtype == jnp.bool_ and op in ("max", "min", "argmax", "argmin", "sum", "prod"):
        boolean_body = body  # bools compare and add as int32 (Triton has no ordered bool reductions)
        body = lambda index, mask: boolean_body(index, mask).astype(jnp.int32)  # noqa: E731
        value_dtype = jnp.dtype(jnp.int32)
        acc_type = jnp.dtype(jnp.int32) if acc_type == jnp.bool_ else acc_type

    def chunk_values(start):
        offset = iota + start
        in_range = offset < length if ragged else True
        values = body(expanded + unravel(offset, tuple(reduced)), both(lane_mask, in_range))
        values = jnp.broadcast_to(values, np.broadcast_shapes(values.shape, lane_shape + (chunk,)))
        return values, in_range

    def neutral(values, in_range, fill):
        return values if in_range is True else jnp.where(in_range, values, fill)

    def fold(carry, start):
        values, in_range = chunk_values(start)
        if op == "moments":  # in a frame shifted by each lane's first element: no cancellation at an offset
            x = values.astype(jnp.float32)
            if in_range is True:
                n_c = jnp.full(lane_shape, float(chunk), jnp.float32)
            else:
                n_c = jnp.sum(jnp.where(in_range, 1.0, 0.0), axis=-1) + jnp.zeros(lane_shape, jnp.float32)
            n, d, m2, shift = carry
            first = jnp.sum(jnp.where(iota == 0, x, 0.0), axis=-1)  # x[..., 0] (Triton has no slice)
            shift = jnp.where(n > 0, shift, first)
            y = neutral(x - shift[..., None], in_range, 0.0)
            s_c = jnp.sum(y, axis=-1)
            d_c = s_c / jnp.maximum(n_c, 1.0)
            m2_c = jnp.sum(neutral(jnp.square(y - d_c[..., None]), in_range, 0.0), axis=-1)
            merged = n + n_c
            delta = d_c - d
            weight = n_c / jnp.maximum(merged, 1.0)
            return merged, d + delta * weight, m2 + m2_c + jnp.square(delta) * n * weight, shift
        if op == "sum" and jnp.issubdtype(acc_type, jnp.floating):  # chunks added with Neumaier's compensation
            total, compensation = carry
            part = jnp.sum(neutral(values.astype(acc_type), in_range, 0), axis=-1).astype(acc_type)
            added = total + part
            compensation = compensation + jnp.where(jnp.abs(total) >= jnp.abs(part),
                                                    (total - added) + part, (part - added) + total)
            return added, compensation
        if op in ("argmax", "argmin"):
            best, best_at = carry
            values = neutral(values, in_range, _identity(op, value_dtype))
            if op == "argmax":
                at, value = jnp.argmax(values, axis=-1), jnp.max(values, axis=-1)
                better = value > best
            else:
                at, value = jnp.argmin(values, axis=-1), jnp.min(values, axis=-1)
                better = value < best
            if jnp.issubdtype(value_dtype, jnp.floating):  # the first NaN wins, as in lax.argmax
                better = better | (jnp.isnan(value) & ~jnp.isnan(best))
            return jnp.where(better, value, best), jnp.where(better, at.astype(jnp.int32) + start, best_at)
        if op in ("and", "or", "xor"):
            bits = neutral(values, in_range, op == "and").astype(jnp.int32)
            if op == "and":
                return carry & (jnp.min(bits, axis=-1) != 0)
            if op == "or":
                return carry | (jnp.max(bits, axis=-1) != 0)
            return carry ^ (jnp.sum(bits, axis=-1) % 2 != 0)
        values = neutral(values.astype(acc_type), in_range, _identity(op, acc_type))
        if op == "sum":
            return carry + jnp.sum(values, axis=-1).astype(acc_type)
        if op == "max":
            return jnp.maximum(carry, jnp.max(values, axis=-1))
        if op == "min":
            return jnp.minimum(carry, jnp.min(values, axis=-1))
        return carry * _tree_prod(values)

    if op == "moments":
        zeros = jnp.zeros(lane_shape, jnp.float32)
        init = (zeros, zeros, zeros, zeros)
    elif op == "sum" and jnp.issubdtype(acc_type, jnp.floating):
        init = (jnp.zeros(lane_shape, acc_type), jnp.zeros(lane_shape, acc_type))
    elif op in ("argmax", "argmin"):
        init = (jnp.full(lane_shape, _identity(op, value_dtype), value_dtype), jnp.zeros(lane_shape, jnp.int32))
    elif op in ("and", "or", "xor"):
        init = jnp.full(lane_shape, op == "and", jnp.bool_)
    else:
        init = jnp.full(lane_shape, _identity(op, acc_type), acc_type)
    if steps == 1:
        result = fold(init, 0)
    else:
        result = lax.fori_loop(0, steps, lambda step, carry: fold(carry, step * chunk), init)
    if op == "moments":
        count, d_mean, m2, shift = result
        return jnp.where(count > 0, shift + d_mean, 0.0), m2
    if op == "sum" and jnp.issubdtype(acc_type, jnp.floating):
        total, compensation = result
        return jnp.where(jnp.abs(compensation) < jnp.inf, total + compensation, total).astype(out_dtype)
    if op in ("argmax", "argmin"):
        return result[1].astype(out_dtype)
    return result.astype(out_dtype)


def select_moment(row: IndexEntry, moments) -> jax.Array:
    """Row `row` (0: the mean, 1: M2) of a `(mean, m2)` pair, for a static or an array index."""
    mean, m2 = moments
    if is_static(row):
        return mean if row == 0 else m2
    return jnp.where(row == 0, mean, m2)


# --- statistics read from their hosts' per-tile partials ---------------------------------------------

# What each tile of a host writes per statistic output (slot): its sum, or its count, mean and M2.
PARTIAL_FIELDS = {"sum": 1, "moments": 3}


def statistic_slots(statistic: Term) -> int:
    """How many outputs (slots) an `EpilogueReduce` has: its kept elements (`moments`: per row pair)."""
    shape = parse_type(statistic.ty).shape
    return max(1, math.prod(shape[1:] if statistic.args[1] == "moments" else shape))


def partials_layout(statistic: Term, size: int) -> tuple[int, int, int] | None:
    """`(tiles, fields, slots)` when a buffer of `size` elements bound to the `EpilogueReduce`
    `statistic` holds its hosts' per-tile partials (`[tiles, fields, slots]`, row-major), None when
    it holds the finished statistic (its own size). The two never clash: moments partials hold 3
    fields per slot and tile where the statistic holds 2, and sum partials of one tile are the sum."""
    op = statistic.args[1]
    shape = parse_type(statistic.ty).shape
    if size == max(1, math.prod(shape)):
        return None
    fields, slots = PARTIAL_FIELDS.get(op), statistic_slots(statistic)
    if fields is None or size % (fields * slots):
        raise ValueError(f"a buffer of {size} elements is neither {statistic.ty} nor per-tile partials "
                         f"of that {op} statistic ([tiles, {fields}, {slots}])")
    return size // (fields * slots), fields, slots


def chan_merge(a, b):
    """Chan's merge of two (count, mean, M2) triples, `a` first; a part of count 0 changes nothing
    (its mean and M2 are never multiplied in, so no inf * 0)."""
    n, mean, m2 = a
    n_b, mean_b, m2_b = b
    merged = n + n_b
    has = n_b > 0
    weight = n_b / jnp.maximum(merged, 1.0)
    delta = jnp.where(has, mean_b - mean, 0.0)
    spread = jnp.where(has & (n > 0), delta * (n * weight) * delta, 0.0)
    return merged, mean + delta * weight, m2 + jnp.where(has, m2_b, 0.0) + spread


def piece_moments(values, valid, axis: int):
    """(count, mean, M2) of `values` where `valid`, over `axis` (kept, size 1): what a host's tile
    writes as its partial. Two-pass about a rough mean (sum / count), corrected once by the mean of
    the deviations (Chan, Golub and LeVeque's corrected two-pass): the deviations from the rough
    mean are exact, so a piece of one value has exactly that value as its mean (where sum / count
    may be an ulp off) and M2 exactly 0."""
    live = lambda v: jnp.where(valid, v, 0.0)  # noqa: E731
    count = jnp.sum(live(1.0), axis=axis, keepdims=True)
    safe = jnp.maximum(count, 1.0)
    rough = jnp.sum(live(values), axis=axis, keepdims=True) / safe
    deviation = live(values - rough)
    drift = jnp.sum(deviation, axis=axis, keepdims=True)
    correction = drift / safe
    m2 = jnp.sum(deviation * deviation, axis=axis, keepdims=True) - drift * correction
    return count, rough + correction, jnp.maximum(m2, 0.0)


def merge_partials_at(op: str, load: Callable[[IndexEntry], jax.Array], tiles: int, slots: int,
                      slot: IndexEntry, *, budget: int = MERGE_BLOCK_ELEMENTS):
    """A statistic at flat output `slot` (an int or int32 array) from `tiles` per-tile partials:
    `load(offsets)` reads the partials buffer (`[tiles, fields, slots]`) at flat int32 offsets of
    any shape and returns values of that shape. Returns the sum, or `(mean, M2)`, of `slot`'s shape.

    The tiles merge in blocks of TB (`merge_block_tiles`: a power of two, TB x the point's lanes
    <= `budget` elements, no more than the tiles need). A step loads a block's fields at once (a
    leading axis of TB in front of the lanes; in the last, partial block the tile index is clamped
    and the tiles past the end count as empty) and reduces over that axis; the blocks then merge
    in order, serially (`lax.fori_loop` when there are several, straight-line code for one).

    - `sum`: a block's sums added (`jnp.sum`), then the blocks' in order.
    - `moments`: a block is reduced two-pass over its tiles, in a frame shifted by `s`, the mean
      of the first tile of nonzero count (of the block, until the merge has elements; then the
      merge's `s`): n = sum(n_t), d = sum(n_t (mean_t - s)) / n,
      M2 = sum(M2_t + n_t (mean_t - s - d)^2); blocks merge with Chan's formula
      (`eqsat.moments.merge_partials`) on (n, d, M2), and mean = s + d. Nothing is rounded at the
      offset before the end, so the result is the exact merge of the partials to a few ulps of
      the spread, and tiles of one mean merge to exactly that mean and M2 0. A tile of count 0
      (or past the end) contributes nothing, whatever its mean and M2 hold (no inf * 0).

    A fixed order of fixed-shape reductions: deterministic. Only ops the Pallas Triton lowering
    has (elementwise, `where`, `sum`/`min` over an axis, `broadcasted_iota`); TB = 1 (lanes of
    `budget` elements or more) is the tile-by-tile Chan merge."""
    point = shape_of((slot,))
    if point == ():  # one slot for every lane: load it as a one-element vector (Triton loads blocks)
        slot = jnp.full((1,), slot, jnp.int32) if is_static(slot) else jnp.reshape(slot, (1,))
    lanes = shape_of((slot,))
    fields = PARTIAL_FIELDS[op]
    block = merge_block_tiles(tiles, math.prod(lanes), budget)
    steps = -(-tiles // block)
    ragged = steps * block != tiles
    zeros = jnp.zeros(lanes, jnp.float32)
    if block > 1:
        within = lax.broadcasted_iota(jnp.int32, (block,) + (1,) * len(lanes), 0)
        shape = (block,) + lanes

    def loaded(start):
        """The block of tiles from `start` (a python or traced int): each field's values
        (`[TB, *lanes]`, or `lanes` when TB is 1) and which tiles exist (True when all do)."""
        if block == 1:
            tile, valid = start, True
        else:
            tile = within + start
            valid = tile < tiles if ragged else True
            if ragged:
                tile = jnp.minimum(tile, tiles - 1)
        values = [load(add(slot, (tile * fields + f) * slots)).astype(jnp.float32) for f in range(fields)]
        return [jnp.broadcast_to(v, shape if block > 1 else lanes) for v in values], valid

    if op == "sum":
        def add_block(step, total):
            (values,), valid = loaded(step * block)
            if block == 1:
                return total + values
            return total + jnp.sum(values if valid is True else jnp.where(valid, values, 0.0), axis=0)

        total = add_block(0, zeros) if steps == 1 else lax.fori_loop(0, steps, add_block, zeros)
        return jnp.reshape(total, point)

    def block_moments(start, anchor=None):
        """The block from `start`: (count, shift, mean - shift, M2), shifted by the running merge's
        shift (`anchor`: its count and shift) once it has elements, else by the block's first tile
        of nonzero count (0 where none has)."""
        (n_t, mean_t, m2_t), valid = loaded(start)
        has = n_t > 0 if valid is True else valid & (n_t > 0)
        n_t = jnp.where(has, n_t, 0.0)
        if block == 1:
            own = jnp.where(has, mean_t, 0.0)
        else:
            first = jnp.min(jnp.where(has, within, block), axis=0)  # `block` where no tile has elements
            own = jnp.sum(jnp.where(within == first, mean_t, 0.0), axis=0)
        shift = own if anchor is None else jnp.where(anchor[0] > 0, anchor[1], own)
        d_t = jnp.where(has, mean_t - shift, 0.0)
        if block == 1:
            return n_t, shift, d_t, jnp.where(has, m2_t, 0.0)
        n = jnp.sum(n_t, axis=0)
        d_mean = jnp.sum(n_t * d_t, axis=0) / jnp.maximum(n, 1.0)
        e_t = d_t - d_mean
        return n, shift, d_mean, jnp.sum(jnp.where(has, m2_t + n_t * e_t * e_t, 0.0), axis=0)

    def merge_block(step, carry):
        n, shift, d_mean, m2 = carry
        n_b, shift, d_b, m2_b = block_moments(step * block, (n, shift))
        n, d_mean, m2 = chan_merge((n, d_mean, m2), (n_b, d_b, m2_b))  # in the shifted frame: no rounding at the offset
        return n, shift, d_mean, m2

    if steps == 1:
        n, shift, d_mean, m2 = block_moments(0)
    else:
        n, shift, d_mean, m2 = lax.fori_loop(0, steps, merge_block, (zeros, zeros, zeros, zeros))
    return jnp.reshape(shift + d_mean, point), jnp.reshape(m2, point)


def read_partials(statistic: Term, index: Index, layout: tuple[int, int, int],
                  load: Callable[[IndexEntry], jax.Array], memo=None) -> jax.Array:
    """`Load(statistic)` at `index` from its per-tile partials (`partials_layout`): the slot the
    index names merged over every tile (`merge_partials_at`). With a `memo` (a mapping the caller
    scopes to one trace) the merge is kept by the kept index, so a moments reader's mean and M2 at
    the same point merge once. Every lane is computed (indices clamped, loads unmasked): masked
    lanes hold some slot's value, never an out-of-range read."""
    op = statistic.args[1]
    tiles, _fields, slots = layout
    shape = parse_type(statistic.ty).shape
    kept_shape = shape[1:] if op == "moments" else shape
    kept = tuple(index[1:] if op == "moments" else index)
    key = ("partials", id(statistic)) + tuple(_key(e) for e in kept)
    if memo is not None and key in memo:
        merged = memo[key][0]
    else:
        clamped = tuple(clip(e, 0, size - 1) for e, size in zip(kept, kept_shape))
        merged = merge_partials_at(op, load, tiles, slots, linearize(clamped, kept_shape))
        if memo is not None:
            memo[key] = (merged, kept)  # the kept arrays stay alive, so their ids stay unique
    value = select_moment(index[0], merged) if op == "moments" else merged
    return jnp.broadcast_to(value, shape_of(tuple(index)))


# --- the compiler ------------------------------------------------------------------------------------


class CompiledExpr:
    """`compile_expr(term)`: call it as `fn(memory, index, mask=True, acc=None)`."""

    def __init__(self, term: Term, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
        if term.sort != "Expr":
            raise TypeError(f"compile_expr takes an Expr term, got {term!r}")
        missing = unsupported_ops(term)
        if missing:
            raise NotImplementedError(f"no Triton-lowerable form for {', '.join(missing)} in {term!r}")
        self.term = term
        self.ty = parse_type(term.ty)
        self.chunk_elements = chunk_elements

    def __call__(self, memory: Memory, index: Index, mask: Mask = True, acc: AccFn | None = None, *,
                 hoisted: "Hoisted | None" = None) -> jax.Array:
        if len(index) != len(self.ty.shape):
            raise ValueError(f"{self.term.op} of type {self.term.ty} evaluated at a {len(index)}-axis index")
        evaluator = _Evaluator(memory, self.chunk_elements, hoisted=hoisted)
        value = evaluator.at(self.term, tuple(index), mask, acc)
        shape = shape_of(tuple(index) + ((mask,) if not isinstance(mask, bool) else ()))
        return jnp.broadcast_to(value, np.broadcast_shapes(value.shape, shape))


    def hoist(self, memory: Memory, index: Index, mask: Mask = True, *, free_axis: int = 0) -> "Hoisted":
        """Evaluate at `index`, an index tile of length 1 on `free_axis` (a conv's pixel (0, 0) of
        one image), and keep each node's value for later calls `fn(..., hoisted=)`: there a node
        whose index entries all have length 1 on `free_axis` reads it instead of computing it again
        (so a conv's GroupNorm scale and shift, or the merge of a statistic's partials, run once
        per channel chunk rather than at every tap). A node this evaluation met at more than one
        index is not kept."""
        evaluator = _Evaluator(memory, self.chunk_elements)
        evaluator.at(self.term, tuple(index), mask, None)
        nodes = [key for key in evaluator.memo if isinstance(key[0], int)]  # not the partials merges' keys
        seen: dict[int, int] = {}
        for key in nodes:
            seen[key[0]] = seen.get(key[0], 0) + 1
        values = {key[0]: evaluator.memo[key] for key in nodes if seen[key[0]] == 1 and key[3] == id(None)}
        return Hoisted(values, free_axis, evaluator)


class Hoisted:
    """Node values from `CompiledExpr.hoist`, by node id, for index tiles free along `free_axis`."""

    def __init__(self, values: dict, free_axis: int, keep):
        self.values, self.free_axis, self._keep = values, free_axis, keep  # `keep` holds the nodes' ids

    def get(self, term: Term, index: Index):
        value = self.values.get(id(term))
        if value is None:
            return None
        for entry in index:
            shape = () if is_static(entry) else tuple(jnp.shape(entry))
            if len(shape) > self.free_axis and shape[self.free_axis] != 1:
                return None
        return value


def compile_expr(term: Term, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> CompiledExpr:
    """The closure computing `term` at an index tile (see the module docstring)."""
    return CompiledExpr(term, chunk_elements=chunk_elements)


def _key(entry):
    return ("i", int(entry)) if is_static(entry) else ("a", id(entry))


class _Evaluator:
    """One evaluation: memo of (term, point, acc binding) -> value, alive only while tracing it."""

    def __init__(self, memory: Memory, chunk_elements: int, parent: "_Evaluator | None" = None,
                 hoisted: "Hoisted | None" = None):
        self.memory = memory
        self.chunk_elements = chunk_elements
        self.memo: dict = {}
        self.keep: list = []  # hold the index arrays a key names, so their ids stay unique
        self.parent = parent
        self.hoisted = hoisted
        self.views = parent.views if parent is not None else IndexViews()

    def at(self, term: Term, index: Index, mask: Mask, acc: AccFn | None) -> jax.Array:
        key = (id(term), tuple(_key(e) for e in index), _key(mask) if not isinstance(mask, bool) else mask,
               id(acc))
        evaluator = self
        while evaluator is not None:
            if key in evaluator.memo:
                return evaluator.memo[key]
            evaluator = evaluator.parent
        value = self.hoisted.get(term, index) if self.hoisted is not None and acc is None else None
        if value is None:
            value = getattr(self, "_" + term.op)(term, index, mask, acc)
        dtype = jnp.dtype(parse_type(term.ty).dtype)
        if value.dtype != dtype:
            value = value.astype(dtype)
        self.memo[key] = value
        self.keep.append((term, index, mask, acc))
        return value

    # leaves

    def _Load(self, term, index, mask, acc):
        tensor = term.args[0]
        if tensor.op == "EpilogueReduce":  # bound to its hosts' per-tile partials: merged here, once per point
            source = getattr(self.memory, "partials_source", None)
            found = source(tensor) if source is not None else None
            if found is not None:
                memo = ChainMap(*(evaluator.memo for evaluator in self._chain()))
                return read_partials(tensor, index, *found, memo=memo)
        return jnp.asarray(self.memory.load(tensor, index, mask))

    def _chain(self):
        evaluator = self
        while evaluator is not None:
            yield evaluator
            evaluator = evaluator.parent

    def _Acc(self, term, index, mask, acc):
        if acc is None:
            raise ValueError(f"{term!r} outside an epilogue: the template bound no accumulator")
        return jnp.asarray(acc(term.args[0], index, mask))

    def _Lit(self, term, index, mask, acc):
        value, ty = term.args
        return jnp.asarray(value, parse_type(ty).dtype)

    def _Iota(self, term, index, mask, acc):
        entry = index[term.args[0]]
        return jnp.asarray(entry, parse_type(term.ty).dtype) if is_static(entry) else \
            entry.astype(parse_type(term.ty).dtype)

    # elementwise

    def _Unary(self, term, index, mask, acc):
        op, x, ty = term.args
        return unary(op, self.at(x, index, mask, acc), parse_type(ty).dtype)

    def _Binary(self, term, index, mask, acc):
        op, x, y, ty = term.args
        return binary(op, self.at(x, index, mask, acc), self.at(y, index, mask, acc), parse_type(ty).dtype)

    def _Select(self, term, index, mask, acc):
        pred, on_false, on_true, ty = term.args
        p = self.at(pred, index, mask, acc)
        if p.dtype != jnp.bool_:
            p = p != 0
        return jnp.where(p, self.at(on_true, index, mask, acc), self.at(on_false, index, mask, acc))

    # views: index arithmetic

    def _Reshape(self, term, index, mask, acc):
        x, ty = term.args
        inner = reshape_index(index, parse_type(ty).shape, parse_type(x.ty).shape, self.views)
        return self.at(x, inner, mask, acc)

    def _Transpose(self, term, index, mask, acc):
        x, permutation, ty = term.args
        inner: list[IndexEntry] = [0] * len(index)
        for out_axis, in_axis in enumerate(ints(permutation)):
            inner[in_axis] = index[out_axis]
        return self.at(x, tuple(inner), mask, acc)

    def _Broadcast(self, term, index, mask, acc):
        x, dims, ty = term.args
        in_shape, out_shape = parse_type(x.ty).shape, parse_type(ty).shape
        inner = tuple(0 if in_shape[j] == 1 and out_shape[d] != 1 else index[d]
                      for j, d in enumerate(ints(dims)))
        return self.at(x, inner, mask, acc)

    def _Slice(self, term, index, mask, acc):
        x, axis, start, stop, stride, ty = term.args
        inner = list(index)
        inner[axis] = add(mul(index[axis], stride), start)
        return self.at(x, tuple(inner), mask, acc)

    def _DynamicSlice(self, term, index, mask, acc):
        x, axis, start, size, ty = term.args
        extent = parse_type(x.ty).shape[axis]
        offset = self.at(start, tuple(0 for _ in parse_type(start.ty).shape), True, acc)
        offset = jnp.clip(jnp.reshape(offset, ()).astype(jnp.int32), 0, extent - size)
        inner = list(index)
        inner[axis] = index[axis] + offset
        return self.at(x, tuple(inner), mask, acc)

    def _Concat(self, term, index, mask, acc):
        x, y, axis, split, ty = term.args
        i = index[axis]
        if is_static(i):  # a static index picks its side at trace time
            inner = list(index)
            if i < split:
                return self.at(x, index, mask, acc)
            inner[axis] = i - split
            return self.at(y, tuple(inner), mask, acc)
        extent = parse_type(ty).shape[axis]
        left, right = list(index), list(index)
        left[axis] = jnp.minimum(i, split - 1)
        right[axis] = jnp.clip(i - split, 0, extent - split - 1)
        in_left = i < split
        a = self.at(x, tuple(left), both(mask, in_left), acc)
        b = self.at(y, tuple(right), both(mask, jnp.logical_not(in_left)), acc)
        return jnp.where(in_left, a, b)

    def _Pad(self, term, index, mask, acc):
        x, value, config, ty = term.args
        in_shape = parse_type(x.ty).shape
        inner, inside = [], True
        for entry, size, part in zip(index, in_shape, config.split(";")):
            lo, _hi, interior = ints(part)
            step = interior + 1
            shifted = add(entry, -lo)
            if is_static(shifted):
                ok = shifted >= 0 and shifted % step == 0 and shifted // step < size
                inner.append(min(max(shifted, 0) // step, size - 1))
                inside = both(inside, bool(ok))
                continue
            nonneg = jnp.maximum(shifted, 0)
            position = div(nonneg, step)
            ok = (shifted >= 0) & (position < size)
            if step > 1:
                ok = ok & (mod(nonneg, step) == 0)
            inner.append(jnp.minimum(position, size - 1))
            inside = both(inside, ok)
        fill = self.at(value, tuple(0 for _ in parse_type(value.ty).shape), True, acc)
        fill = jnp.reshape(fill, ())
        if inside is False:
            return fill
        inner_value = self.at(x, tuple(inner), both(mask, inside), acc)
        return inner_value if inside is True else jnp.where(inside, inner_value, fill)

    # a reduction inside the kernel

    def _RowReduce(self, term, index, mask, acc):
        op, body, axis, epilogue, ty = term.args
        body_shape = parse_type(body.ty).shape
        acc_dtype = _acc_dtype(epilogue, ty)
        body_dtype = parse_type(body.ty).dtype
        outer_acc = acc
        budget = getattr(self.memory, "chunk_elements", self.chunk_elements)
        cache: dict = {}

        def row_acc(acc_ty, acc_index, acc_mask):
            kept = tuple(acc_index[1:]) if op == "moments" else tuple(acc_index)
            if len(kept) != len(body_shape) - 1:
                raise TypeError(f"{term!r}: Acc({acc_ty}) does not fit a reduction of {body.ty} over axis {axis}")
            key = tuple(_key(e) for e in kept)
            if key not in cache:
                child = _Evaluator(self.memory, self.chunk_elements, parent=self)

                def at_body(body_index, body_mask):
                    full = body_index[:-1]
                    reduced = body_index[-1]
                    point = full[:axis] + (reduced,) + full[axis:]
                    return child.at(body, point, body_mask, outer_acc)

                cache[key] = (reduce_at(op, at_body, kept, acc_mask, (body_shape[axis],), value_dtype=body_dtype,
                                        out_dtype=acc_dtype, budget=budget), kept)
            result, _ = cache[key]
            return select_moment(acc_index[0], result) if op == "moments" else result

        return self.at(epilogue, index, mask, row_acc)


def _acc_dtype(epilogue: Term, default_ty: str):
    """The dtype of the `Acc` an epilogue reads (a nested RowReduce's own epilogue aside), else `default_ty`'s."""
    stack, seen = [epilogue], set()
    while stack:
        node = stack.pop()
        if node.op == "Acc":
            return parse_type(node.args[0]).dtype
        children = (node.args[1],) if node.op == "RowReduce" else node.children
        for child in children:
            if child.sort == "Expr" and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return parse_type(default_ty).dtype


def acc_dtype(epilogue: Term, default_ty: str):
    """The accumulator dtype a kernel with this epilogue computes its core in."""
    return _acc_dtype(epilogue, default_ty)


# --- whole arrays as memory (tests, references) ------------------------------------------------------


class ArrayMemory:
    """`Memory` over whole jax arrays: `load` gathers `values[tensor]` at the (clamped) index. An
    `EpilogueReduce` bound to its per-tile partials is merged where it is read (`read_partials`)."""

    chunk_elements = 1 << 16

    def __init__(self, values):
        self.values = values

    def partials_source(self, statistic: Term):
        """`(layout, load)` when `statistic` is bound to its per-tile partials, else None."""
        array = jnp.asarray(self.values[statistic])
        layout = partials_layout(statistic, array.size)
        if layout is None:
            return None
        flat_partials = jnp.reshape(array, (-1,))
        return layout, lambda offsets: flat_partials[offsets]

    def load(self, tensor: Term, index: Index, mask: Mask) -> jax.Array:
        found = self.partials_source(tensor) if tensor.op == "EpilogueReduce" else None
        if found is not None:
            return read_partials(tensor, index, *found)
        array = jnp.asarray(self.values[tensor])
        typed = parse_type(tensor.ty).shape
        if array.shape != typed and array.size == math.prod(typed):  # one tile's partials are the statistic
            array = jnp.reshape(array, typed)
        shape = array.shape
        if not shape:
            return array
        clamped = tuple(clip(e, 0, size - 1) for e, size in zip(index, shape))
        if all(is_static(e) for e in clamped):
            return array[clamped]
        flat = linearize(clamped, shape)
        value = jnp.reshape(array, (-1,))[flat]
        return value if mask is True else jnp.where(mask, value, jnp.zeros((), array.dtype))


def evaluate_whole(term: Term, values, acc: AccFn | None = None) -> jax.Array:
    """`term` at every index of its type, reading `values[tensor]` (the reference path in tests)."""
    shape = parse_type(term.ty).shape
    return compile_expr(term)(ArrayMemory(values), grid_index(shape), True, acc)
