"""The flash-attention template: `softmax(q kᵀ · scale + bias) v` over `[batch, heads, seq, head_dim]`
operands as one Pallas Triton kernel; the scores never reach memory.

    kernel     one (batch, head, query block) program: the online-softmax loop over key blocks
               (FlashAttention-2, Dao 2023, §3.1: running max m, running sum l, unnormalized
               output o rescaled by 2^(m_old - m_new); one reciprocal per row at the end)
    build      grid, validation, tile sizes, the `pallas_call`
    reference  the same computation in plain `jax.numpy`

The operands are closures over the kernel's input refs and an index tile (so q, k and v can be
slices of a fused QKV output read through views, in place):

    q(refs, (b, h, rows, ds), mask)       -> [block_q, width]    rows [bq, 1], ds [1, width]
    k(refs, (b, h, cols, ds), mask)       -> [keys, width]       cols [keys, 1]
    v(refs, (b, h, cols, ds), mask)       -> [keys, width]
    bias(refs, (b, h, rows, cols), mask)  -> [block_q, keys]     cols [1, keys]; None: no bias
    epilogue(refs, acc, (b, h, rows, ds), mask) -> [block_q, width]

called once per head-dim piece (`ds` its lanes) and key block. `b` and `h` are program ids
(scalars). What the kernel does per score, read from its sm_90a PTX (`benchmarks/attention_ptx.py`):

- Base 2: without a bias, the scores go straight to base 2, `p = 2^(s · scale·log2 e - m)` with
  the running max m kept in base 2: one `fma` and one `ex2.approx` per score (the natural `exp`
  was libdevice's range-reduced expf, ~10 instructions). With a bias the scores stay natural and
  only their difference to the max goes to base 2, so a bias of -3e38 (finfo.min) stays finite as
  in `jax.nn.softmax`; without one and with a scale above ln 2 they stay unscaled and the scale
  goes into the exponent, `2^((s - m) · scale·log2 e)` (`scales_in_exponent`: exact at the max key).
- Masks only where a block crosses an edge: the loop runs the full key blocks unmasked; the keys
  past the last full block run once after it in a tail block of their own power-of-two width
  (>= 16: 77 keys in blocks of 64 are 64 + 16 slots, not 128), the only one that masks keys.
- Head dims need not be powers of two (heads of 40, 80, 160): the head dim is split into
  power-of-two pieces >= 16 (`head_pieces`: 40 = 32+16, 80 = 64+16, 160 = 128+32), each with its
  own dot and accumulator, so only the last piece has padded lanes (read as zero for k; v's
  padded lanes reach only padded output lanes, which are not stored). Padded query rows are not
  stored.
- Heads wider than `MAX_VALUE_LANES` (the VAE's 512) split their output lanes over
  `AttentionBlocks.value_splits` programs per query block: each computes the scores over the
  whole head and accumulates its share of v's lanes (a [64, 512] fp32 accumulator alone held 128
  of a thread's 255 registers, and the kernel spilled).
- The row statistics are `[block_q]` vectors, so each thread holds one per row it owns rather
  than one per score.

The softmax statistics are float32; `p` is cast to v's dtype for the second dot, as FlashAttention
does. A row whose scores are all -inf yields NaN, as `jax.nn.softmax` does. The template has no
causal mode: CLIP's causal mask is the plan's bias, read per score in every block.
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
from emit.pallas.contiguous import ContiguousMemory
from emit.pallas.matmul import MIN_DOT_BLOCK, check_dot_dtypes, store  # noqa: F401 (importable from here)
from eqsat.tiling.attention import (  # the tiling, shared with the cost model
    AttentionBlocks, dot_itemsize, fits_shared_memory, head_pieces, key_loop_trips, tail_width, value_lanes)
from eqsat.types import parse_type

Index = tuple[Any, Any, Any, Any]
OperandFn = Callable[[Sequence[Any], Index, Any], jax.Array]
EpilogueFn = Callable[[Sequence[Any], jax.Array, Index, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Attention over `[batch, heads, q_len | kv_len, head_dim]` operands given as closures."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    q: OperandFn
    k: OperandFn
    v: OperandFn
    bias: OperandFn | None
    scale: float
    epilogue: EpilogueFn
    out_dtype: Any
    dot_itemsize: int = 2  # bytes of the dots' operands (q·k in their promoted type, p·v in v's)

    def validate(self) -> None:
        for name in ("batch", "heads", "q_len", "kv_len", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"attention {name}={getattr(self, name)} must be >= 1")


# --- kernel -------------------------------------------------------------------------------------


LOG2_E = math.log2(math.e)


def folds_scale_into_exp2(problem: AttentionProblem) -> bool:
    """Whether scores go straight to base 2 (`s · scale·log2 e`, one FMA with the max) rather than
    through natural-base scores: without a bias, and when the base-2 scale is at most 1 so that no
    finite `s · scale` overflows (a bias of -3e38 times log2 e would be -inf: those stay natural)."""
    return problem.bias is None and 0.0 < problem.scale * LOG2_E <= 1.0


def scales_in_exponent(problem: AttentionProblem) -> bool:
    """Whether natural scores (not `folds_scale_into_exp2`) stay unscaled and the scale goes into
    the exponent, `2^((s - m) · scale·log2 e)`: without a bias and with a positive scale whose
    base-2 unit is a normal float32. The difference is taken before any rounding product, so the
    max key's exponent is exactly 0 (`s · scale` rounded for the max but contracted with `- m` into
    one FMA for the exponent gave the max key p ~ 8e5 at scores ~3e8: fp16 P overflowed; issue 17)."""
    unit = problem.scale * LOG2_E
    return problem.bias is None and not folds_scale_into_exp2(problem) and \
        float(jnp.finfo(jnp.float32).tiny) <= unit <= float(jnp.finfo(jnp.float32).max)


def attention_kernel(*refs, problem: AttentionProblem, blocks: AttentionBlocks, num_inputs: int):
    inputs, (out_ref,) = refs[:num_inputs], refs[num_inputs:]
    bq, bk = blocks.block_q, blocks.block_k
    b, h = pl.program_id(0), pl.program_id(1)
    # Program (i, part): query block i, and of the output lanes the part-th of `value_splits`.
    i, part = lax.div(pl.program_id(2), blocks.value_splits), lax.rem(pl.program_id(2), blocks.value_splits)
    rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    row_ok = rows < problem.q_len

    def lanes(offset, width, end):  # a head-dim piece: its lanes, which are inside the head (True: all)
        ds = offset + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        return ds, True if end <= problem.head_dim else ds < problem.head_dim

    pieces = [lanes(offset, width, offset + width) for offset, width in head_pieces(problem.head_dim)]
    if blocks.value_splits == 1:
        value_pieces = pieces
    else:  # q·k over the whole head, v and the output over this program's share of the lanes
        share = value_lanes(problem.head_dim, blocks.value_splits)
        value_pieces = [lanes(part * share, share, share * blocks.value_splits)]
    q_masks = [jnp.broadcast_to(ex.both(row_ok, d_ok), (bq, ds.shape[1])) for ds, d_ok in pieces]
    out_masks = [jnp.broadcast_to(ex.both(row_ok, d_ok), (bq, ds.shape[1])) for ds, d_ok in value_pieces]
    qs = [jnp.where(mask, problem.q(inputs, (b, h, rows, ds), mask), 0)
          for (ds, _), mask in zip(pieces, q_masks)]
    base2 = folds_scale_into_exp2(problem)
    unscaled = scales_in_exponent(problem)
    natural_unit = problem.scale * LOG2_E if unscaled else LOG2_E

    def kv_step(start, carry, *, width: int, tail: bool):
        """Keys `start ..< start + width`; only the `tail` block (past the last full one) masks keys."""
        os, m, l = carry  # m: the running row max of the scores (base 2 if `base2`), l: the running sum
        cols = start + lax.broadcasted_iota(jnp.int32, (width, 1), 0)
        key_ok = cols < problem.kv_len if tail else True
        s = None
        for q, (ds, d_ok) in zip(qs, pieces):
            kv_mask = ex.both(key_ok, d_ok)
            k = problem.k(inputs, (b, h, cols, ds), kv_mask)
            if kv_mask is not True:  # masked lanes of a prologue may be inf; 0 * inf in the dot is NaN
                k = jnp.where(kv_mask, k, jnp.zeros((), k.dtype))
            dtype = jnp.promote_types(q.dtype, k.dtype)
            part = lax.dot_general(q.astype(dtype), k.astype(dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
            s = part if s is None else s + part
        score_cols = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        col_ok = score_cols < problem.kv_len
        if problem.bias is not None:
            bias_mask = jnp.broadcast_to(row_ok & col_ok, (bq, width)) if tail else True
            s = tr.fma(s, problem.scale, problem.bias(inputs, (b, h, rows, score_cols), bias_mask).astype(jnp.float32))
        elif not (base2 or unscaled):
            s = s * problem.scale
        if tail:
            s = jnp.where(col_ok, s, -jnp.inf)
        block_max = jnp.max(s, axis=1)
        m_next = jnp.maximum(m, block_max * (problem.scale * LOG2_E) if base2 else block_max)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with no finite score so far
        if base2:  # s · scale·log2 e - m, one FMA
            p = jnp.exp2(tr.fma(s, problem.scale * LOG2_E, -m_safe[:, None]))
            correction = jnp.exp2(m - m_safe)
        else:  # natural scores: the difference first (exact at the max, finite for a bias of -3e38), then base 2
            p = jnp.exp2((s - m_safe[:, None]) * natural_unit)
            correction = jnp.exp2((m - m_safe) * natural_unit)
        l = l * correction + jnp.sum(p, axis=1)
        new_os = []
        for o, (ds, d_ok) in zip(os, value_pieces):
            v = problem.v(inputs, (b, h, cols, ds), ex.both(key_ok, d_ok))
            if key_ok is not True:  # p is 0 at padded keys, but 0 * inf is NaN; padded lanes only reach
                v = jnp.where(key_ok, v, jnp.zeros((), v.dtype))  # padded (never stored) output lanes
            new_os.append(o * correction[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32))
        return new_os, m_next, l

    carry = ([jnp.zeros((bq, ds.shape[1]), jnp.float32) for ds, _ in value_pieces],
             jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    full_blocks = key_loop_trips(problem.kv_len, bk)
    if full_blocks:
        step = functools.partial(kv_step, width=bk, tail=False)
        carry = lax.fori_loop(0, full_blocks, lambda t, carry: step(t * bk, carry), carry)
    if problem.kv_len % bk:
        carry = kv_step(full_blocks * bk, carry, width=tail_width(problem.kv_len, bk), tail=True)
    os, _, l = carry
    inverse = (1.0 / l)[:, None]  # one division per row, not per output lane (0 * inf: NaN, as 0 / 0)
    for o, (ds, _), mask in zip(os, value_pieces, out_masks):
        out = problem.epilogue(inputs, o * inverse, (b, h, rows, ds), mask)
        store(out_ref, ((b * problem.heads + h) * problem.q_len + rows) * problem.head_dim + ds, out, mask)


# --- build --------------------------------------------------------------------------------------


def build(problem: AttentionProblem, inputs: Sequence[jax.Array], *, blocks: AttentionBlocks | None = None,
          interpret: bool = False, name: str = "attention") -> jax.Array:
    """Run `problem` as one `pallas_call` reading `inputs` (flat refs, in this order); returns
    `[batch, heads, q_len, head_dim]`."""
    problem.validate()
    blocks = blocks or AttentionBlocks.get_default(problem.q_len, problem.kv_len, problem.head_dim,
                                                   problem.dot_itemsize)
    blocks.validate()
    width = sum(w for _, w in head_pieces(problem.head_dim))
    if blocks.value_splits > 1 and (len(head_pieces(problem.head_dim)) > 1
                                    or value_lanes(problem.head_dim, blocks.value_splits) < MIN_DOT_BLOCK):
        raise ValueError(f"{blocks.value_splits} value splits of a head of {problem.head_dim} lanes: the head "
                         f"must be one power-of-two piece of at least {MIN_DOT_BLOCK} lanes per split")
    if not fits_shared_memory(blocks.block_q, blocks.block_k, width, problem.dot_itemsize):
        raise NotImplementedError(f"a head of {problem.head_dim} lanes at {problem.dot_itemsize}-byte operands "
                                  f"does not fit an H100's shared memory even in {blocks.block_q} x "
                                  f"{blocks.block_k} blocks")
    kernel = functools.partial(attention_kernel, problem=problem, blocks=blocks, num_inputs=len(inputs))
    shape = (problem.batch, problem.heads, problem.q_len, problem.head_dim)
    (out,) = tr.pallas_call(kernel, inputs, [jax.ShapeDtypeStruct(shape, problem.out_dtype)],
                            grid=(problem.batch, problem.heads,
                                  pl.cdiv(problem.q_len, blocks.block_q) * blocks.value_splits),
                            name=name, interpret=interpret, num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return out


# --- reference ----------------------------------------------------------------------------------


def reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, bias: jax.Array | None = None,
              epilogue: Callable[[jax.Array], jax.Array] = lambda acc: acc, out_dtype=None) -> jax.Array:
    """`epilogue(softmax(q kᵀ scale + bias) v)` over `[batch, heads, seq, head_dim]`, in float32."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        scores = scores + jnp.asarray(bias, jnp.float32)
    weights = jax.nn.softmax(scores, axis=-1)
    out = epilogue(jnp.einsum("bhqk,bhkd->bhqd", weights, v.astype(jnp.float32)))
    return out.astype(out_dtype or q.dtype)


# --- emit: a plan's Attention term --------------------------------------------------------------


def _is_zero(bias) -> bool:
    """Whether a bias expression is the literal 0 (no bias: the template skips it)."""
    return bias.op == "Lit" and bias.args[0] == 0.0


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Attention` kernel (`emit.pallas.KernelCall`) in `ctx`."""
    from emit.pallas import loaded_tensors

    term = kernel.term
    q, k, v, bias, scale, epilogue, ty = term.args
    q_shape, k_shape, v_shape = (parse_type(x.ty).shape for x in (q, k, v))
    out_type = parse_type(ty)
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4):
        raise NotImplementedError(f"attention over operands of rank {len(q_shape)}, {len(k_shape)}, {len(v_shape)}")
    batch, heads, q_len, head_dim = q_shape
    if k_shape != v_shape or k_shape[:2] != (batch, heads) or k_shape[3] != head_dim:
        raise NotImplementedError(f"attention with q {q_shape}, k {k_shape}, v {v_shape}")
    if min(batch, heads, q_len, head_dim, k_shape[2]) == 0:
        raise NotImplementedError("an empty attention")
    check_dot_dtypes(q, k, v)
    bias = None if _is_zero(bias) else bias
    expressions = [e for e in (q, k, v, bias, epilogue) if e is not None]
    for expression in expressions:
        missing = ex.unsupported_ops(expression)
        if missing:
            raise NotImplementedError(f"no Triton form for {', '.join(missing)}")
    q_fn, k_fn, v_fn, epilogue_fn = (ex.compile_expr(e) for e in (q, k, v, epilogue))
    bias_fn = ex.compile_expr(bias) if bias is not None else None
    tensors = loaded_tensors(*expressions)

    def operand(fn, memory=ContiguousMemory):  # masked, not clamped, along the contiguous axis: vector loads
        return lambda refs, index, mask: fn(memory(dict(zip(tensors, refs))), index, mask)

    def epilogue_tile(refs, acc, index, mask):
        def accumulator(acc_ty, at, acc_mask):
            if any(a is not o and not (ex.is_static(a) and ex.is_static(o) and a == o) for a, o in zip(at, index)):
                raise NotImplementedError("the epilogue reads the accumulator through a view")
            return acc

        return epilogue_fn(ContiguousMemory(dict(zip(tensors, refs))), index, mask, accumulator)

    problem = AttentionProblem(batch, heads, q_len, k_shape[2], head_dim, operand(q_fn), operand(k_fn),
                               operand(v_fn), operand(bias_fn) if bias_fn is not None else None, float(scale),
                               epilogue_tile, jnp.dtype(out_type.dtype), dot_itemsize(q.ty, k.ty, v.ty))
    out = build(problem, [ctx.operand(t) for t in tensors], interpret=ctx.interpret, name=kernel.name)
    return {term: out.reshape(out_type.shape)}
