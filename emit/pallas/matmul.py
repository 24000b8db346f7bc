"""The matmul template: `out[b, m, n] = epilogue(sum_k lhs[b, m, k] * rhs[b, k, n])` as one Pallas
Triton kernel, with the operands and the epilogue given as closures evaluated on index tiles.

    kernel     one (batch, M tile, N tile) program: a K pre-pass for row statistics, the K loop
               (fp32 accumulation on tensor cores), the epilogue, masked stores
    build      grid, validation, tile sizes, the `pallas_call`
    reference  the same problem in plain `jax.numpy`

Every operand is a closure over the kernel's input refs and an index tile (MLKL's IExpr idea), so a
LayerNorm apply, a GEGLU gate, casts and views are computed while the A tile is loaded, and several
weights side by side (fused QKV: a concat along N) are read in place. Indices are canonical:

    lhs(refs, (b, rows, ks), mask, stats) -> [bm, bk]    rows [bm, 1], ks [1, bk]
    rhs(refs, (b, ks, cols), mask)        -> [bk, bn]    ks [bk, 1], cols [1, bn]
    epilogue(refs, acc, (b, rows, cols), mask) -> [bm, bn]   acc: the fp32 accumulator tile

`b` is the batch program id (a scalar). Tails are masked: M, N and K need not be multiples of the
tile (77 tokens, head dims of 40, 320 channels); an A or B element outside the mask is zero whatever
its closure computes there (a prologue such as LayerNorm apply is not zero at a padded column).

Row statistics (`RowStatistic`: a LayerNorm's sum or moments over K) are computed before the K
loop by a pre-pass over the row block's K strips, in order, and handed to `lhs` as `stats`: each a
`[bm, 1]` sum, or a `(sum, M2)` pair for moments, per-strip moments merged with Chan et al.'s
parallel formula (stable: no E[x^2] - E[x]^2). A statistic's body may read earlier ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

Index = tuple[Any, Any, Any]
LhsFn = Callable[[Sequence[Any], Index, Any, Sequence[Any]], jax.Array]
RhsFn = Callable[[Sequence[Any], Index, Any], jax.Array]
EpilogueFn = Callable[[Sequence[Any], jax.Array, Index, Any], jax.Array]
MIN_DOT_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


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
        block_m = min(128 if large else 64, max(MIN_DOT_BLOCK, next_power_of_2(m)))
        block_n = min(128 if large else 64, max(MIN_DOT_BLOCK, next_power_of_2(n)))
        block_k = min(32, max(MIN_DOT_BLOCK, next_power_of_2(k)))
        return cls(block_m, block_n, block_k, num_warps=8 if large else 4, num_stages=3 if large else 2)

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_BLOCK or value != next_power_of_2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")


@dataclasses.dataclass(frozen=True)
class RowStatistic:
    """A reduction over K of `body(refs, (b, rows, ks), mask, stats) -> [bm, bk]` for each row:
    `op` "sum" gives `[bm, 1]`, "moments" gives `(sum, M2)` (M2 = sum of squared deviations)."""

    op: str
    body: LhsFn

    def __post_init__(self):
        if self.op not in ("sum", "moments"):
            raise ValueError(f"row statistic op {self.op!r} is not 'sum' or 'moments'")


@dataclasses.dataclass(frozen=True)
class MatmulProblem:
    """A matmul in canonical coordinates (see the module docstring) and its output dtype."""

    batch: int
    m: int
    n: int
    k: int
    lhs: LhsFn
    rhs: RhsFn
    epilogue: EpilogueFn
    out_dtype: Any
    row_statistics: tuple[RowStatistic, ...] = ()
    dot_dtype: Any = None  # the dtype both operands are cast to before the dot (None: promote theirs)

    def validate(self) -> None:
        for name in ("batch", "m", "n", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"matmul {name}={getattr(self, name)} must be >= 1")


# --- kernel -------------------------------------------------------------------------------------


def _row_statistics(problem: MatmulProblem, refs, b, rows, row_ok, block_k: int) -> list:
    """The pre-pass: each statistic over the row block's K strips, in statistic order."""
    stats: list = []
    strips = pl.cdiv(problem.k, block_k)
    for statistic in problem.row_statistics:
        def strip(t, carry, statistic=statistic):
            ks = t * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            mask = row_ok & (ks < problem.k)
            x = jnp.where(mask, statistic.body(refs, (b, rows, ks), mask, stats).astype(jnp.float32), 0.0)
            strip_sum = jnp.sum(x, axis=1, keepdims=True)
            if statistic.op == "sum":
                return carry + strip_sum
            # Chan et al.: merge (n_a, sum_a, M2_a) with this strip's (n_b, sum_b, M2_b).
            total, m2 = carry
            n_a = (t * block_k).astype(jnp.float32)
            n_b = jnp.minimum(block_k, problem.k - t * block_k).astype(jnp.float32)
            strip_mean = strip_sum / n_b
            strip_m2 = jnp.sum(jnp.where(mask, (x - strip_mean) ** 2, 0.0), axis=1, keepdims=True)
            delta = strip_mean - total / jnp.maximum(n_a, 1.0)
            m2 = m2 + strip_m2 + delta * delta * (n_a * n_b / (n_a + n_b))
            return total + strip_sum, m2

        zeros = jnp.zeros(rows.shape, jnp.float32)
        init = zeros if statistic.op == "sum" else (zeros, zeros)
        stats.append(lax.fori_loop(0, strips, strip, init))
    return stats


def matmul_kernel(*refs, problem: MatmulProblem, blocks: MatmulBlocks, num_inputs: int):
    inputs, (out_ref,) = refs[:num_inputs], refs[num_inputs:]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    row_ok, col_ok = rows < problem.m, cols < problem.n
    stats = _row_statistics(problem, inputs, b, rows, row_ok, bk)

    def k_step(t, acc):
        ks_a = t * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ks_b = t * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        mask_a, mask_b = row_ok & (ks_a < problem.k), (ks_b < problem.k) & col_ok
        a = problem.lhs(inputs, (b, rows, ks_a), mask_a, stats)
        w = problem.rhs(inputs, (b, ks_b, cols), mask_b)
        dtype = problem.dot_dtype or jnp.promote_types(a.dtype, w.dtype)
        a = jnp.where(mask_a, a.astype(dtype), jnp.zeros((), dtype))
        w = jnp.where(mask_b, w.astype(dtype), jnp.zeros((), dtype))
        return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(problem.k, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    mask = row_ok & col_ok
    out = problem.epilogue(inputs, acc, (b, rows, cols), mask)
    flat = (b * problem.m + rows) * problem.n + cols
    store(out_ref, flat, out, mask)


def store(ref, flat, value, mask) -> None:
    """A masked scatter store into a flat ref. Masked lanes point past the end: interpret mode's
    scatter drops them, where an in-range index would race with the lane that owns it."""
    index = jnp.where(mask, flat, ref.shape[0])
    pltriton.store(ref.at[index], value.astype(ref.dtype), mask=mask)


# --- build --------------------------------------------------------------------------------------


def build(problem: MatmulProblem, inputs: Sequence[jax.Array], *, blocks: MatmulBlocks | None = None,
          interpret: bool = False, name: str = "matmul") -> jax.Array:
    """Run `problem` on `inputs` (each passed flat: closures index them by flat offset) as one
    `pallas_call`; returns the output as `[batch, m, n]`."""
    problem.validate()
    blocks = blocks or MatmulBlocks.get_default(problem.m, problem.n, problem.k)
    blocks.validate()
    flat_inputs = [jnp.reshape(x, (-1,)) if jnp.ndim(x) != 1 else x for x in inputs]
    kernel = functools.partial(matmul_kernel, problem=problem, blocks=blocks, num_inputs=len(flat_inputs))
    out = pl.pallas_call(
        kernel,
        grid=(problem.batch, pl.cdiv(problem.m, blocks.block_m), pl.cdiv(problem.n, blocks.block_n)),
        out_shape=jax.ShapeDtypeStruct((problem.batch * problem.m * problem.n,), problem.out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*flat_inputs)
    return out.reshape(problem.batch, problem.m, problem.n)


# --- reference ----------------------------------------------------------------------------------


def reference(lhs: jax.Array, rhs: jax.Array, epilogue: Callable[[jax.Array], jax.Array] = lambda acc: acc,
              out_dtype=None) -> jax.Array:
    """`epilogue(lhs @ rhs)` for `[batch, m, k] x [batch, k, n]` with fp32 accumulation."""
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    acc = jnp.einsum("bmk,bkn->bmn", lhs.astype(dtype), rhs.astype(dtype), preferred_element_type=jnp.float32)
    out = epilogue(acc)
    return out.astype(out_dtype or lhs.dtype)
