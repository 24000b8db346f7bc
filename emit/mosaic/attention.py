"""The Mosaic GPU flash-attention template (FA3-style): `epilogue(softmax(q kᵀ · scale + bias) v)` on
Hopper tensor cores, K/V fed by TMA into an SMEM ring, warp-specialized, the online softmax in
registers; the scores never reach memory.

    build      the kernel: grid, SMEM, the memory warpgroup's TMA ring, the compute warpgroups' loop
    reference  the same problem in plain `jax.numpy` (the Triton template's, `emit.pallas.attention.reference`)
    emit       a plan's `Attention(q, k, v, bias, scale, epilogue, ty)` kernel as this template

One CTA computes `compute_wgs x block_q` query rows of one (batch, head). Learnt from jax's
`pallas/ops/gpu/attention_mgpu.py`:

- a memory warpgroup (40 registers) copies `[block_kv, head]` K and V tiles (and the bias tiles of
  both compute warpgroups' rows) by TMA into a ring of `stages` SMEM slots,
  and refills a slot once both compute warpgroups have arrived on its "consumed" barriers;
- each compute warpgroup (232 registers) TMA-loads its `[block_q, head]` Q tile once and per key
  block issues `wgmma` Q·Kᵀ from SMEM (K through a transposed SMEM operand, `plgpu.transpose_ref`,
  as `attention_mgpu.py` does) into an fp32 accumulator, runs the online softmax on it in
  registers (running max m of the unscaled scores, `p = 2^((s - m)·scale·log2 e)`: a subtraction,
  a multiply and one `ex2` per score, exact at the max key for any magnitude (`exponent_unit`);
  FlashAttention-2's rescaling of the output by `2^((m_old - m_new)·scale·log2 e)`), stores P (fp16/bf16)
  to SMEM and issues `wgmma` P·V into a fresh accumulator that is added to the rescaled output.
  With two compute warpgroups a shared "schedule" barrier alternates their Q·Kᵀ and softmax phases
  (FA3's ping-pong) so that one's MMAs overlap the other's exponentials;
- at the end one reciprocal per row, the plan's epilogue (`emit.expr`) on the `[block_q, head]`
  output tile in registers, and a TMA store (through the Q tile's SMEM slot, or a slot of its own
  when the result's dtype differs).

FA3 proper keeps P in registers as wgmma's A operand and accumulates P·V into the live output
(`pl.run_state`); jax 0.10.2's GPU interpret mode has neither (`NotImplementedError: Higher-order
primitive run_state`; a register A operand fails in its wgmma callback, "Expected shape (5,) but
got (64, 64)": it reads A as an SMEM allocation key), so this template takes the forms it can
check there: P through SMEM, a second accumulator. Its wgmma callback had no transposed SMEM
operand either ("'TransposeTransform' object has no attribute 'indices'"): `emit.mosaic.interpreter`
adds one (the same callback, the operand transposed as read), so K is multiplied where it lies in
both modes (no XLA transpose). Layouts (`layout_cast`, layout-typed iota and loads) apply only
when compiled; the interpreter has no rule for them.

Head dims are padded only to what wgmma needs: a multiple of 16 halves (40 -> 48, 80 and 160 as
they are), all SMEM tiles of an MMA swizzled alike, as far as the padded head allows (48 and 80
halves: 32 bytes; 160: 64; 64 and 128: 128); heads wider than 192 lanes go to Triton
(`MAX_HEAD`). Keys are masked on the last block only: the loop runs the full `block_kv` blocks
unmasked and a key count that `block_kv` does not divide runs one more step whose scores past the
last key are -inf; a short context (<= 128 keys) is that one
step alone, its length rounded up to the key quantum (77 keys: 80 slots at heads of 40 or 80). A
bias (CLIP's causal mask, or any additive bias) is materialized as a float32
`[batch', heads', q, kv]` array (`'`: 1 when the bias expression does not read that index) and
arrives with the K tiles, `[block_q, block_kv]` per compute warpgroup and step; with a bias the
scores are `q kᵀ·scale + bias` and only their difference to the max goes to base 2 (a bias of
finfo.min stays finite, as in `jax.nn.softmax`).

`build` takes `[batch, heads, seq, head]` operands and reads q (and writes the output), k and v in
the order `Layouts` says: `[B, S, H, D]` when the plan's view comes from a `[B, S, H·D]`
projection (the transposes cancel against the view), else `[B, H, S, D]`. An operand that is heads
of one tensor stored `[B, S, heads·D]` (a fused QKV's q, k or v; `Stored`, found by
`eqsat.cost.mosaic.stored_heads`, which the cost model shares) is read there at its first head,
no copy, when its head needs no padding and its sequence is whole tiles. Otherwise heads are
zero-padded to the wgmma width (40 -> 48) and sequences to the tiles (77 keys -> 80) by XLA around
the kernel, one multi-output fusion per source tensor (padded keys are masked, padded query rows
dropped, the padded output sliced). Operands are fp16 or bf16 (the same dtype); anything else
raises `NotImplementedError` and `emit.mosaic` runs the kernel through the Pallas Triton template.
Attentions whose kernels are equal up to their names launch one jitted function
(`emit.mosaic.kernel_cache`): one Mosaic module for them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from emit import expr as ex
from emit.mosaic import interpreter, kernel_cache
from emit.mosaic.matmul import MMA_DTYPES, _kernel_name, interpret_params, pad_to
from emit.pallas.attention import reference  # noqa: F401  one reference for both templates
from eqsat.term import Term
from eqsat.tiling import mosaic as tiling
from eqsat.tiling.mosaic import (HEAD_QUANTUM, MAX_HEAD, SMEM_BYTES, AttentionBlocks,  # noqa: F401 (shared with
                                 key_quantum, padded_head)                               # the cost model)
from eqsat.types import parse_type

LOG2_E = math.log2(math.e)


def swizzle_bytes(minor: int, dtype) -> int:
    """The widest swizzle (128, 64 or 32 bytes) that divides a tile row of `minor` elements."""
    swizzle = tiling.swizzle_for(minor, jnp.dtype(dtype).itemsize)
    if swizzle is None:
        raise NotImplementedError(f"a tile row of {minor * jnp.dtype(dtype).itemsize} bytes (swizzles need a "
                                  "multiple of 32)")
    return swizzle


def _swizzled(swizzle: int, dtype) -> tuple:
    """SMEM transforms for an MMA tile swizzled by `swizzle` bytes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def smem_bytes(blocks: AttentionBlocks, ring: int, head: int, dtype, out_dtype, has_bias: bool) -> int:
    """Shared memory of one CTA (`eqsat.tiling.mosaic.attention_smem_bytes`) for operands of `dtype`."""
    return tiling.attention_smem_bytes(blocks, ring, head, jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize,
                                       jnp.dtype(out_dtype) != jnp.dtype(dtype), has_bias)


def exponent_unit(scale: float, has_bias: bool) -> tuple[float, float]:
    """`(sign, unit)`: the online softmax keeps the scores `sign · q kᵀ` unscaled (sign ±1, exact)
    and takes `p = 2^((s - m) · unit)` with m their running max. Without a bias and with a nonzero
    scale the scale goes into `unit` (`|scale|·log2 e`): the difference `s - m` is taken before any
    rounding product, so the max key's is exactly 0 and every other key's at most 0, whatever the
    compiler contracts (`s · scale - m` as one FMA rounds once where the max rounded `s · scale`
    first: at scores ~3e8 the max key's p was ~8e5 and its fp16 P overflowed, issue 17). With
    a bias (or a zero scale) the scores are `q kᵀ · scale + bias`, one value the max and the
    exponent share, and `unit` is log2 e (sign 0: no raw scores); so too for a scale whose `unit`
    is no normal float32 (0 · -inf would be NaN at a masked key)."""
    unit = abs(scale) * LOG2_E
    if has_bias or not float(np.finfo(np.float32).tiny) <= unit <= float(np.finfo(np.float32).max):
        return 0.0, LOG2_E
    return math.copysign(1.0, scale), unit


# (o [block_q, head] f32, already divided by the row sums) -> [block_q, head] values to store
EpilogueFn = Callable[[jax.Array], jax.Array]


def _kernel(q_ref, k_ref, v_ref, *refs, blocks: AttentionBlocks, kv_len: int, scale: float,
            has_bias: bool, bias_shared: tuple[bool, bool], epilogue: EpilogueFn, layouts: "Layouts",
            interpreted: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bias_ref = refs[0] if has_bias else None
    out_ref = refs[-1]
    bq, bk, wgs, stages = blocks.block_q, blocks.block_kv, blocks.compute_wgs, blocks.stages
    head = q_ref.shape[-1]
    dtype = q_ref.dtype
    full_steps, tail = divmod(kv_len, bk)
    kv_steps = full_steps + (1 if tail else 0)
    ring = min(stages, kv_steps)  # `build` fitted it to SMEM
    sign, unit = exponent_unit(scale, has_bias)
    # wgmma wants both operands of an MMA swizzled alike: the head's rows set the swizzle of all four
    operand_transforms = _swizzled(swizzle_bytes(head, dtype), dtype)
    bias_transforms = _swizzled(swizzle_bytes(bk, jnp.float32), jnp.float32)

    scratch = dict(
        qo_smem=plgpu.SMEM((wgs, bq, head), dtype, transforms=operand_transforms),
        # the output leaves through the Q tile's slot when it has Q's dtype, else through its own
        o_smem=None if out_ref.dtype == dtype else plgpu.SMEM(
            (wgs, bq, head), out_ref.dtype, transforms=_swizzled(swizzle_bytes(head, out_ref.dtype), out_ref.dtype)),
        k_smem=plgpu.SMEM((ring, bk, head), dtype, transforms=operand_transforms),
        p_smem=plgpu.SMEM((wgs, bq, bk), dtype, transforms=operand_transforms),
        v_smem=plgpu.SMEM((ring, bk, head), dtype, transforms=operand_transforms),
        bias_smem=plgpu.SMEM((ring, wgs * bq, bk), jnp.float32, transforms=bias_transforms) if has_bias else None,
        k_barriers=plgpu.Barrier(num_barriers=ring),
        v_barriers=plgpu.Barrier(num_barriers=ring),
        bias_barriers=plgpu.Barrier(num_barriers=ring) if has_bias else None,
        q_barriers=plgpu.Barrier(num_barriers=wgs),
        k_consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=ring),
        v_consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=ring),
        schedule=plgpu.Barrier(num_arrivals=wgs) if wgs > 1 else None,
    )

    @functools.partial(pl.run_scoped, **{k: v for k, v in scratch.items() if v is not None}, collective_axes="wg")
    def _scope(qo_smem, k_smem, p_smem, v_smem, k_barriers, v_barriers, q_barriers, k_consumed, v_consumed,
               o_smem=None, bias_smem=None, bias_barriers=None, schedule=None):
        b_idx, h_idx, q_idx = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        wg = lax.axis_index("wg")
        bias_b = 0 if bias_shared[0] else b_idx
        bias_h = 0 if bias_shared[1] else h_idx

        def in_layout(x, layout):
            # GPU interpret mode has no layout_cast (nor layout-typed iota and loads): layouts are the
            # compiler's business, the values are the same.
            return x if interpreted else plgpu.layout_cast(x, layout)

        def schedule_barrier():
            if schedule is not None:
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(schedule)

        @pl.when(wg < wgs)
        def _compute():
            if not interpreted:
                plgpu.set_max_registers(232 if wgs > 1 else 240, action="increase")
            q_smem = qo_smem.at[wg]
            row0 = q_idx * (wgs * bq) + wg * bq
            rows = pl.ds(row0, bq)

            def q_rows(head):
                return (b_idx, rows, head) if layouts.q_seq_major else (b_idx, head, rows)

            plgpu.copy_gmem_to_smem(q_ref.at[q_rows(layouts.q_head0 + h_idx)], q_smem, q_barriers.at[wg])
            plgpu.barrier_wait(q_barriers.at[wg])
            m = in_layout(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = in_layout(jnp.full((bq,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = in_layout(jnp.full((bq, head), 0, jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_barriers.at[0])
            if wgs > 1:
                pl.when(wg == 1)(schedule_barrier)

            def step(t, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(t, jnp.array(ring, t.dtype))

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                if has_bias:  # read before the slot is released: the memory warpgroup refills K and bias together
                    plgpu.barrier_wait(bias_barriers.at[slot])
                    bias = plgpu.load(bias_smem.at[slot], (pl.ds(wg * bq, bq), slice(None)),
                                      layout=plgpu.Layout.WGMMA) if not interpreted else \
                        bias_smem[slot, pl.ds(wg * bq, bq), :]
                plgpu.barrier_arrive(k_consumed.at[slot])
                if has_bias:
                    s = s * scale + bias
                elif sign == 0.0:
                    s = s * scale
                elif sign < 0:
                    s = -s
                if masked:
                    cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1) if interpreted else \
                        plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(cols + t * bk < kv_len, s, -jnp.inf)
                m_next = jnp.maximum(m, s.max(axis=1))
                m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with no finite score so far
                # the difference first (exact at the max, finite for a bias of -3e38), then to base 2
                p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [0])) * unit)
                alpha = jnp.exp2((m - m_safe) * unit)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                if schedule is not None:
                    acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
                    plgpu.barrier_arrive(schedule)  # done with the softmax
                plgpu.barrier_wait(v_barriers.at[slot])
                if schedule is not None:
                    plgpu.barrier_wait(schedule)  # the other warpgroup's MMAs are issued

                p_smem.at[wg][...] = p16
                plgpu.commit_smem()  # P's stores become visible to the async proxy wgmma reads through

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot])
                    following = t + 1

                    @pl.when(following < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_barriers.at[lax.rem(following, jnp.array(ring, t.dtype))])

                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, head), jnp.float32))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_next, l

            carry = (acc, m, l)
            if full_steps:
                carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), carry)
            if tail:
                carry = step(jnp.int32(full_steps), carry, masked=True)
            acc, _, l = carry
            if wgs > 1:
                pl.when(wg == 0)(schedule_barrier)
            out = epilogue(acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0]))  # 0 * inf: NaN, as 0 / 0
            out_smem = q_smem if o_smem is None else o_smem.at[wg]
            out_smem[...] = out.astype(out_ref.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[q_rows(h_idx)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            if not interpreted:
                plgpu.set_max_registers(40, action="decrease")
            q_rows = pl.ds(q_idx * (wgs * bq), wgs * bq)

            def keys(t, seq_major, head0):
                head = head0 + h_idx
                return (b_idx, pl.ds(t * bk, bk), head) if seq_major else (b_idx, head, pl.ds(t * bk, bk))

            def issue_k(t, slot):  # K and the bias tiles: free once Q·Kᵀ and the bias are read
                plgpu.copy_gmem_to_smem(k_ref.at[keys(t, layouts.k_seq_major, layouts.k_head0)], k_smem.at[slot],
                                        k_barriers.at[slot])
                if has_bias:
                    plgpu.copy_gmem_to_smem(bias_ref.at[bias_b, bias_h, q_rows, pl.ds(t * bk, bk)],
                                            bias_smem.at[slot], bias_barriers.at[slot])

            def issue_v(t, slot):  # free once P·V is read
                plgpu.copy_gmem_to_smem(v_ref.at[keys(t, layouts.v_seq_major, layouts.v_head0)], v_smem.at[slot],
                                        v_barriers.at[slot])

            for t in range(ring):
                issue_k(t, t)
                issue_v(t, t)

            @pl.loop(0, kv_steps - ring)
            def _refill(t):
                # K's slot refills as soon as it is consumed, before V's: with a one-slot ring the
                # compute warpgroups wait for the next K before they release V
                slot = lax.rem(t, jnp.array(ring, t.dtype))
                plgpu.barrier_wait(k_consumed.at[slot])
                issue_k(t + ring, slot)
                plgpu.barrier_wait(v_consumed.at[slot])
                issue_v(t + ring, slot)

            for t in range(max(0, kv_steps - ring), kv_steps):  # the last use of each slot: every phase of a
                plgpu.barrier_wait(k_consumed.at[t % ring])      # barrier is observed (the interpreter checks it)
                plgpu.barrier_wait(v_consumed.at[t % ring])

    del scratch


@dataclasses.dataclass(frozen=True)
class Layouts:
    """How the kernel reads q (and writes the output), k and v in global memory: `seq_major` as
    `[batch, seq, heads, head]` (a projection's `[B, S, H·D]` output viewed per head: read in place),
    else `[batch, heads, seq, head]`; `head0`: the operand's first head in that array (a fused
    QKV's k starts at head H: `Stored`). K arrives as `[block_kv, head]` tiles, multiplied through a
    transposed SMEM operand (no Kᵀ)."""

    q_seq_major: bool = True
    v_seq_major: bool = True
    k_seq_major: bool = True
    q_head0: int = 0
    k_head0: int = 0
    v_head0: int = 0


@dataclasses.dataclass(frozen=True)
class Stored:
    """An operand read where it lies: heads `head0 .. head0 + heads` of `array`, stored
    `[batch, seq, heads', head]` (`eqsat.cost.mosaic.StoredHeads`: a projection's output, a fused
    QKV's slice), with no copy; its sequence a multiple of the tiles, its head of wgmma's width."""

    array: jax.Array
    head0: int
    heads: int
    head_dim: int  # the operand's; the array's heads may be padded to wgmma's width (40 -> 48)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        batch, seq, _, _ = self.array.shape
        return batch, self.heads, seq, self.head_dim

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return 4


def _seq_major(x: jax.Array, yes: bool) -> jax.Array:
    return jnp.transpose(x, (0, 2, 1, 3)) if yes else x


def _laid_out(x, seq_major: bool, shape_seq_major, shape_head_major):
    """`(array, seq_major, head0)` the kernel reads for operand `x`: a `Stored` as it lies, else `x`
    in the order asked, zero-padded to the tiles."""
    if isinstance(x, Stored):
        if tuple(x.array.shape[:2]) != shape_seq_major[:2] or x.array.shape[3] != shape_seq_major[3]:
            raise ValueError(f"a stored operand {x.array.shape} read as {shape_seq_major} needs padding")
        return x.array, True, x.head0
    return pad_to(_seq_major(x, seq_major), shape_seq_major if seq_major else shape_head_major), seq_major, 0


def build(q: "jax.Array | Stored", k: "jax.Array | Stored", v: "jax.Array | Stored", *, scale: float,
          bias: jax.Array | None = None, epilogue: EpilogueFn = lambda o: o, out_dtype=None,
          blocks: AttentionBlocks | None = None, layouts: Layouts = Layouts(), interpret: Any = None,
          name: str = "attention", with_padded: bool = False) -> jax.Array:
    """`epilogue(softmax(q kᵀ scale + bias) v)` for `q [batch, heads, q_len, head_dim]`,
    `k, v [batch, heads, kv_len, head_dim]` (fp16 or bf16, the same) and a float `bias`
    broadcasting against `[batch, heads, q_len, kv_len]` (or None), as one Mosaic GPU kernel;
    returns `[batch, heads, q_len, head_dim]` of `out_dtype` (default q's). `layouts`: the order the
    kernel reads q, k and v in (the transposes here cancel against a view of that order; a `Stored`
    operand is read where it lies, seq-major, whatever `layouts` says). `interpret`: True runs GPU
    interpret mode, False compiles for the GPU, None decides by the platform (a CPU interprets).
    `with_padded`: `(out, the kernel's output as written)`, padded heads and rows included."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (q.shape[0], q.shape[1], q.shape[3]) != \
            (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} are not [batch, heads, seq, head_dim]")
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype).name not in MMA_DTYPES:
        raise NotImplementedError(f"wgmma operands {q.dtype}, {k.dtype}, {v.dtype} (the template multiplies "
                                  "fp16 or bf16 operands of one dtype)")
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if min(batch, q_len, heads, head_dim, kv_len) == 0:
        raise NotImplementedError("an empty attention")
    blocks = blocks or AttentionBlocks.get_default(q_len, kv_len, head_dim)
    blocks.validate()
    if blocks.block_kv % key_quantum(padded_head(head_dim)):
        raise ValueError(f"block_kv={blocks.block_kv} at a head of {padded_head(head_dim)} lanes must be a multiple "
                         f"of {key_quantum(padded_head(head_dim))} (P rows swizzled like the head's)")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if out_dtype.itemsize not in (2, 4) or not jnp.issubdtype(out_dtype, jnp.floating):
        raise NotImplementedError(f"a {out_dtype} result")
    head = padded_head(head_dim)
    if head > MAX_HEAD:
        raise NotImplementedError(f"a head of {head_dim} lanes (up to {MAX_HEAD}: the output and P·V accumulators "
                                  "of 256 lanes spill, 772 bytes at sm_90a; the VAE's 512 exceed wgmma's N of 256)")
    rows_per_cta = blocks.block_q * blocks.compute_wgs
    q_padded = -(-q_len // rows_per_cta) * rows_per_cta
    kv_padded = -(-kv_len // blocks.block_kv) * blocks.block_kv
    qp, q_seq, q_head0 = _laid_out(q, layouts.q_seq_major, (batch, q_padded, heads, head),
                                   (batch, heads, q_padded, head))
    kp, k_seq, k_head0 = _laid_out(k, layouts.k_seq_major, (batch, kv_padded, heads, head),
                                   (batch, heads, kv_padded, head))
    vp, v_seq, v_head0 = _laid_out(v, layouts.v_seq_major, (batch, kv_padded, heads, head),
                                   (batch, heads, kv_padded, head))
    # the output in q's order (the transposes below cancel against the reader's view)
    layouts = Layouts(q_seq, v_seq, k_seq, q_head0, k_head0, v_head0)
    q_shape = (batch, q_padded, heads, head) if q_seq else (batch, heads, q_padded, head)
    inputs = [qp, kp, vp]
    shared = (True, True)
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32)
        bias = jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)
        shared = (bias.shape[0] == 1, bias.shape[1] == 1)
        target = (bias.shape[0], bias.shape[1], q_padded, kv_padded)
        bias = pad_to(jnp.broadcast_to(bias, (bias.shape[0], bias.shape[1], q_len, kv_len)), target)
        inputs.append(bias)
    # a shallower ring before no kernel (heads of 160 with a bias and a float32 result)
    ring = tiling.fit_ring(blocks, kv_len, head, jnp.dtype(q.dtype).itemsize, out_dtype.itemsize,
                           out_dtype != jnp.dtype(q.dtype), bias is not None)
    if smem_bytes(blocks, ring, head, q.dtype, out_dtype, bias is not None) > SMEM_BYTES:
        raise NotImplementedError(f"{smem_bytes(blocks, ring, head, q.dtype, out_dtype, bias is not None)} bytes "
                                  f"of SMEM at {blocks} and a head of {head} lanes")
    blocks = dataclasses.replace(blocks, stages=ring)
    grid = (batch, heads, q_padded // rows_per_cta)

    def call(interpret_here):
        if interpret_here:
            interpreter.install()  # K is read through a transposed SMEM operand
        return plgpu.kernel(
            functools.partial(_kernel, blocks=blocks, kv_len=kv_len, scale=float(scale), has_bias=bias is not None,
                              bias_shared=shared, epilogue=epilogue, layouts=layouts, interpreted=interpret_here),
            out_type=jax.ShapeDtypeStruct(q_shape, out_dtype),
            grid=grid,
            grid_names=("batch", "heads", "q_seq"),
            num_threads=blocks.compute_wgs + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            kernel_name=_kernel_name(name),
            interpret=interpret_params() if interpret_here else None,
        )

    def run(*xs):
        if interpret is None:
            return lax.platform_dependent(*xs, cpu=lambda *xs: call(True)(*xs), default=lambda *xs: call(False)(*xs))
        return call(bool(interpret))(*xs)

    out = kernel_cache.launch(run, tuple(inputs), _kernel_name(name), interpreted=interpret is True)
    sliced = _seq_major(out, layouts.q_seq_major)[:, :, :q_len, :head_dim]
    return (sliced, out) if with_padded else sliced


# --- emit: a plan's Attention term --------------------------------------------------------------

EPILOGUE_OPS = tiling.ATTENTION_EPILOGUE_OPS  # elementwise on the output tile


def _is_zero(bias: Term) -> bool:
    return bias.op == "Lit" and bias.args[0] == 0.0


def _reads_accumulator_at(index):
    def check(at):
        if len(at) != len(index) or any(a is not o for a, o in zip(at, index)):
            raise NotImplementedError("the epilogue reads the accumulator through a view")

    return check


class _IndexRecorder:
    """A memory that records where an expression reads (NumPy index tables), returning zeros."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self):
        self.loads: list[tuple[Term, tuple]] = []

    def load(self, tensor: Term, index, mask):
        self.loads.append((tensor, tuple(index)))
        return jnp.zeros((), parse_type(tensor.ty).dtype)


def reads_seq_major(operand: Term) -> bool:
    """Whether an operand expression `[batch, heads, seq, head]` is a view of one tensor in which
    consecutive sequence positions lie further apart than consecutive heads (a `[B, S, H·D]`
    projection read per head, a fused QKV slice): the kernel then reads it `[B, S, H, D]` and the
    transpose XLA sees cancels against the view. Anything else (a computed operand, a head-major
    tensor) is read `[B, H, S, D]`, the term's own order."""
    _, heads, seq, _ = parse_type(operand.ty).shape
    if heads == 1 or seq == 1:
        return False  # both orders are the same bytes
    memory = _IndexRecorder()
    ex.compile_expr(operand)(memory, (0, np.array([[0], [1]]), np.array([[0, 1]]), 0), True)
    if len(memory.loads) != 1 or not all(ex.is_static(e) or isinstance(e, np.ndarray) for e in memory.loads[0][1]):
        return False
    tensor, index = memory.loads[0]
    flat = np.broadcast_to(np.asarray(ex.linearize(index, parse_type(tensor.ty).shape)), (2, 2))
    return abs(int(flat[0, 1] - flat[0, 0])) > abs(int(flat[1, 0] - flat[0, 0]))


def stored_operand(operand: Term, rows_tile: int, values: Callable[[Term], jax.Array],
                   ctx_values: dict | None = None) -> Stored | None:
    """The operand as a `Stored` view of the tensor it reads, when the kernel reads it there
    (`eqsat.cost.mosaic.stored_heads`, the cost model's test), or the padded heads its projection
    wrote (`padded_by_projection`: found in `ctx_values` by `padded_heads_key`), else None. The test's probes are
    checked at every element here: a view it took for heads of one stored tensor that reads anything
    else is a bug (AssertionError), not a fallback."""
    from emit.mosaic.layouts import padded_heads_key
    from eqsat.cost.mosaic import padded_by_projection, stored_heads

    batch, heads, seq, head = parse_type(operand.ty).shape
    found, padded = stored_heads(operand, rows_tile), None
    if found is None:
        found = padded_by_projection(operand, rows_tile)
        padded = None if found is None else (ctx_values or {}).get(padded_heads_key(found.tensor))
        if padded is None:
            return None
    memory = _IndexRecorder()
    index = tuple(np.arange(n).reshape([n if i == axis else 1 for i in range(4)])
                  for axis, n in enumerate((batch, heads, seq, head)))
    ex.compile_expr(operand)(memory, index, True)
    ((tensor, at),) = memory.loads
    flat = np.asarray(ex.linearize(at, parse_type(tensor.ty).shape))
    pitch = found.heads * head
    b, h, s, d = index
    expected = b * seq * pitch + s * pitch + (found.head0 + h) * head + d
    if tensor is not found.tensor or not np.array_equal(np.broadcast_to(flat, expected.shape), expected):
        raise AssertionError(f"stored_heads took {operand!r} for heads {found.head0}.. of {found.tensor!r}")
    if padded is not None:  # the projection wrote each head zero-padded to wgmma's width
        return Stored(jnp.reshape(padded, (batch, seq, found.heads, padded_head(head))), found.head0, heads, head)
    return Stored(jnp.reshape(values(tensor), (batch, seq, found.heads, head)), found.head0, heads, head)


def bias_value(bias: Term, shape: tuple[int, int, int, int], values: Callable[[Term], jax.Array]) -> jax.Array:
    """The bias expression as a float32 `[batch', heads', q_len, kv_len]` array, `batch'`/`heads'` 1
    where it does not depend on that index (CLIP's causal mask: `[1, 1, S, S]`), found by which index
    entries its traced evaluation uses."""
    from jax._src.interpreters import partial_eval as pe

    from emit.pallas import loaded_tensors

    batch, heads, q_len, kv_len = shape
    compiled = ex.compile_expr(bias)
    tensors = loaded_tensors(bias)
    arrays = [values(t) for t in tensors]
    rows, cols = np.arange(q_len).reshape(q_len, 1), np.arange(kv_len).reshape(1, kv_len)

    def at(b, h, *arrays):
        return compiled(ex.ArrayMemory(dict(zip(tensors, arrays))), (b, h, rows, cols), True)

    closed = jax.make_jaxpr(at)(jnp.int32(0), jnp.int32(0), *arrays)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True])
    b = np.arange(batch).reshape(batch, 1, 1, 1) if used[0] else 0
    h = np.arange(heads).reshape(1, heads, 1, 1) if used[1] else 0
    value = compiled(ex.ArrayMemory(dict(zip(tensors, arrays))), (b, h, rows[None, None], cols[None, None]), True)
    kept = (batch if used[0] else 1, heads if used[1] else 1, q_len, kv_len)
    return jnp.broadcast_to(value.astype(jnp.float32), kept)


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Attention` kernel (`emit.pallas.KernelCall`) in `ctx`, as
    one Mosaic GPU kernel. q, k and v (views of a projection's `[B, S, H·D]` output, slices of a fused
    QKV) are read where they lie when `stored_operand` finds them so, else evaluated as XLA fusions
    into the kernel's layouts; the bias as a float32 array broadcast
    over what it does not depend on; the epilogue in registers. Forms not covered raise
    `NotImplementedError` (`emit.mosaic` then runs the Triton template)."""
    from emit.mosaic.layouts import padded_heads_key
    from eqsat.cost.mosaic import padded_attention_output
    from eqsat.interpret import _Evaluator

    term = kernel.term
    q, k, v, bias, scale, epilogue, ty = term.args
    q_type, k_type, v_type, out_type = (parse_type(x) for x in (q.ty, k.ty, v.ty, ty))
    if not (len(q_type.shape) == len(k_type.shape) == len(v_type.shape) == 4):
        raise NotImplementedError(f"attention over operands of rank {len(q_type.shape)}, {len(k_type.shape)}, "
                                  f"{len(v_type.shape)}")
    batch, heads, q_len, head_dim = q_type.shape
    if k_type.shape != v_type.shape or k_type.shape[:2] != (batch, heads) or k_type.shape[3] != head_dim:
        raise NotImplementedError(f"attention with q {q_type.shape}, k {k_type.shape}, v {v_type.shape}")
    kv_len = k_type.shape[2]
    if min(batch, heads, q_len, head_dim, kv_len) == 0:
        raise NotImplementedError("an empty attention")
    if not (q_type.dtype == k_type.dtype == v_type.dtype) or q_type.dtype not in MMA_DTYPES:
        raise NotImplementedError(f"{q_type.dtype}, {k_type.dtype}, {v_type.dtype} operands (wgmma here multiplies "
                                  "fp16 or bf16 operands of one dtype)")
    if jnp.dtype(out_type.dtype).itemsize not in (2, 4) or not jnp.issubdtype(out_type.dtype, jnp.floating):
        raise NotImplementedError(f"a {out_type.dtype} result")
    missing = sorted({node.op for node in ex.expr_nodes(epilogue)} - EPILOGUE_OPS)
    if missing:
        raise NotImplementedError(f"an epilogue with {', '.join(missing)} (the Mosaic attention epilogue is "
                                  "elementwise on the output tile)")
    compiled_epilogue = ex.compile_expr(epilogue)

    def tile_epilogue(o):
        rows, width = o.shape
        index = (0, 0, np.arange(rows).reshape(rows, 1), np.arange(width).reshape(1, width))
        check = _reads_accumulator_at(index)

        def accumulator(acc_ty, at, mask):
            check(at)
            return o

        return jnp.broadcast_to(compiled_epilogue(None, index, True, accumulator), o.shape)

    blocks = AttentionBlocks.get_default(q_len, kv_len, head_dim)
    rows_tile = {0: blocks.block_q * blocks.compute_wgs, 1: blocks.block_kv, 2: blocks.block_kv}
    stored = [stored_operand(x, rows_tile[i], ctx.value, ctx.values) for i, x in enumerate((q, k, v))]
    known = _Evaluator({}, ctx.constants, ctx.payloads)
    known.values = ctx.values
    computed = iter(_Evaluator({}, ctx.constants, ctx.payloads, parent=known).run(
        [x for x, s in zip((q, k, v), stored) if s is None]))
    q_value, k_value, v_value = (s if s is not None else next(computed) for s in stored)
    bias_array = None if _is_zero(bias) else bias_value(bias, (batch, heads, q_len, kv_len), ctx.value)
    out, written = build(q_value, k_value, v_value, scale=float(scale), bias=bias_array, epilogue=tile_epilogue,
                         out_dtype=out_type.dtype,
                         layouts=Layouts(reads_seq_major(q), reads_seq_major(v), reads_seq_major(k)),
                         interpret=ctx.interpret, name=kernel.name, with_padded=True)
    q_seq_major = isinstance(q_value, Stored) or reads_seq_major(q)
    if padded_attention_output(term) is not None and q_seq_major and written.shape[1] == q_len:
        # `[B, S, H, padded]` for a reader that takes the padded heads (to_out,
        # `eqsat.cost.mosaic.reads_padded_heads`); the slice below XLA drops when no one else reads it
        ctx.values[padded_heads_key(term)] = written
    return {term: out.reshape(out_type.shape)}
