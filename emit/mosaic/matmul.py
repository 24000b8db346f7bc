"""The Mosaic GPU matmul template: `out[b, m, n] = epilogue(sum_k a[b, m, k] * w[b, k, n])` on Hopper
tensor cores, fed by TMA, warp-specialized, with the plan's epilogue applied in registers.

    build      the kernel: grid, tiles, SMEM, the warp-specialized TMA -> wgmma pipeline, the epilogue
    reference  the same problem in plain `jax.numpy`
    emit       a plan's `Matmul(lhs, rhs, dims, epilogue, ty)` kernel as this template

One CTA computes a `tile_m x (compute_wgs * tile_n)` output tile of one batch entry. Its
warpgroups (learnt from jax's `pallas/ops/gpu/hopper_matmul_mgpu.py`):

- a memory warpgroup (40 registers) issues the TMA copies of `[tile_m, tile_k]` A and
  `[tile_k, cta_tile_n]` B tiles into a ring of `stages` 128-byte-swizzled SMEM buffers;
- `compute_wgs` compute warpgroups, each owning `tile_n` of the CTA's columns, issue `wgmma` from
  SMEM into an fp32 register accumulator. Each step waits for all but the newest wgmma group
  (`wgmma_wait(1)`) and releases a buffer one step late (`delay_release=1`), so the tensor cores
  always have the next MMA queued while the previous one drains;
- the epilogue, per `epi_m x epi_n` sub-tile: the operands it reads (a residual tile, a bias
  row, a per-row scale) arrive by TMA into SMEM, the epilogue `Expr` is evaluated on the
  accumulator in registers (`emit.expr`, as every template does), the result is cast and stored
  to SMEM and written back by TMA (two slots, so the next sub-tile overlaps the store).

A, B, the epilogue's operands and the output are used as they lie when Mosaic's tiled TMA can
address them (`reads_in_place`: M a multiple of 8, N of 64, K of 64 or below 64; SD 1.5's UNet and
VAE matmuls): the K tail is TMA's zero fill, and the last M and N tiles start early so they end at
the array's edge (recomputing some of their neighbour's rows or columns, the same values) — no
store leaves the array, which GPU interpret mode could not check (it drops a partially
out-of-bounds store whole). Other shapes (77 tokens: Mosaic GPU 0.10.2 raises "dimension 1 must
have size smaller or a multiple of its tiling 8, but got 77" for the unpadded array; N = 96; K = 72)
are zero-padded by the wrapper to the tile grid (`pad_to`) and the output is sliced back: zeros in
K add nothing, padded rows and columns are computed and dropped. Operands are fp16 or bf16 (both the same), accumulation
is fp32; anything else raises `NotImplementedError`, and `emit.mosaic` runs that kernel through
the Pallas Triton template instead.

Heads padded for the Mosaic attention (`prepared_head_padding`, `prepared_padded_input`): where the
prepare stage laid a projection's weight out with zero columns after each head of 40
(`emit.mosaic.layouts.head_padded_weight`), the matmul writes `[.., G·48]` and leaves it in the
context under `padded_heads_key` for the attention (its own value, the heads sliced back, is an XLA
slice only another reader would keep); to_out, its weight given zero rows after each head, reads the
attention's `[B, S, H, 48]` output as its A (K = H·48).

The epilogue's operands are mapped on the host: `epilogue_operands` evaluates the epilogue's index
arithmetic with NumPy index tables over the whole output and sorts each `Load` it meets into a
`tile` (reads depend on rows and columns: a residual), a `col` vector (columns only: a bias) or a
`row` vector (rows only), gathered once into that layout (a reshape when the view is one already).
In the kernel the same `Expr` is evaluated on tile-local NumPy indices (index arithmetic stays on
the host) with a memory that answers each `Load`, in the order the host met them, with the SMEM
tile of its operand. Epilogue nodes whose value depends on the index itself (`Iota`) or that select
by index (`Concat`, `Pad`, `DynamicSlice`) are left to the Triton template.

In GPU interpret mode every warpgroup is a thread of the interpreter, blocked in barrier waits on
XLA's CPU worker pool; `import eqsat` sizes that pool (`eqsat.host_threads`; too small a pool
deadlocked one run in two on 2 cores), so the interpreted kernel is the compiled one, two compute
warpgroups and all.

The A prologue (`Prologue`, `in_kernel_prologue`): an elementwise A expression over `[rows, K]`
tiles of tensors as they lie (a column window of one: GEGLU's value and gate halves), vectors along
the rows (a mean and a second moment, each a row of a stacked tensor) and along K (gamma, beta) is
computed in the kernel: the memory warpgroup TMA-loads the sources' blocks for each step, the
compute warpgroup (one: it computes each A tile once, where two would each compute it for their own
columns) evaluates the expression on them in registers, stores the A tile to a 2-slot SMEM stage
(the MMA of two steps ago, which read that slot, is done after `wgmma_wait(1)`) and issues wgmma
from there. A `RowReduce` in A (a LayerNorm computing its own statistics: the whole row is needed
before the first step) is a row pass (`emit.mosaic.row_statistics`, `row_passes`): the compute
warpgroup reduces its CTA's rows over the whole row (a sum or moments, chunk by chunk, Chan-merged)
before the pipeline, and the expression reads the reduction's fields from registers (`stat`
sources; `eqsat.cost.mosaic.split_row_reduces` puts a stand-in tensor where the reduction was).
Not in the kernel (XLA computes A whole, one fusion, before it): a reduction other than a sum or
moments or over more than `ROW_PASS_MAX_LENGTH` elements, a permuted source (NCHW read as tokens),
K not a multiple of the step, any load that is not such a window.
Statistics of the output (`EpilogueReduce` hosted on this kernel: a LayerNorm's sum or moments per
row) are computed from the stored output sub-tiles in registers and written as per-tile partials
(`emit.mosaic.partials`); those it does not take (several hosts, a body reading other tensors, a
padded output) are left to the driver.
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

from emit import expr as ex
from emit.mosaic import kernel_cache
from emit.mosaic.partials import (RowStatistic, group_partials, merge_partials, tile_partials,
                                  write_group_partials)
from emit.mosaic.row_statistics import RowPass, compute_row_statistics, pass_smem
from eqsat import host_threads
from eqsat.term import Term
from eqsat.tiling.mosaic import (EPILOGUE_OPS, MMA_DTYPES, SMEM_BYTES, MosaicBlocks,  # noqa: F401 (the tiling, shared
                                 fit_smem)                                            # with the cost model)
from eqsat.tiling.mosaic import (fits_tiles, matmul_blocks, matmul_in_place, prologue_blocks,  # noqa: F401
                                 reads_in_place, tile_fits, vector_fits)
from eqsat.tiling.mosaic import matmul_smem_bytes as smem_bytes  # noqa: F401
from eqsat.types import parse_type

SM_COUNT = 132  # H100 SXM5


def interpret_params(tma_zero_fill: bool = False):
    """GPU interpret mode (simulated SMEM, threads, barriers; race detection) for a CPU.
    `tma_zero_fill`: a read past the end of an array gives zeros, as TMA's does (the interpreter
    raises by default); its only way there also starts SMEM and outputs at zero, not NaN, so the
    kernels that read past no end keep the NaN fill that shows a value never written."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    host_threads.check()
    if tma_zero_fill:
        return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    return InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class EpilogueOperand:
    """An array the epilogue reads, laid out for TMA: `tile` `[batch', M, N]`, `col` `[batch', N]`,
    `row` `[batch', M]` (batch' is 1 when it does not depend on the batch index); `pixel` (the
    haloed conv's) the conv output's pixel view of a tensor read at the output's own index
    (`eqsat.tiling.mosaic.PixelView`)."""

    kind: str
    array: jax.Array

    def __post_init__(self):
        if self.kind not in ("tile", "col", "row", "pixel"):
            raise ValueError(f"epilogue operand kind {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class AWindow:
    """A-side blocks at element offsets (the conv template's taps): the CTA reads `tile_m + halo`
    rows of A from its first row, and pipeline step `k` TMA-copies the `[tile_m, tile_k]` block
    `offset(k) -> (first row within that window, column block)`. Without one, step k reads column
    block k of the CTA's own `tile_m` rows (a plain matmul)."""

    halo: int
    offset: Callable[[jax.Array], tuple[jax.Array, jax.Array]]


# (acc [em, en] f32, each operand's values at the sub-tile, broadcast to [em, en]) -> out [em, en]
EpilogueFn = Callable[[jax.Array, Sequence[jax.Array]], jax.Array]


@dataclasses.dataclass(frozen=True)
class PrologueSource:
    """An array the A prologue reads. `tile`: a 2-D `[rows, pitch]` array whose `[tile_m, tile_k]`
    blocks are read at row `row0 + batch · batch_rows + m` and column `col0 + k` (a tensor laid out
    `[rows, K]`, or a column window of a wider one: GEGLU's halves); `col`: `[rows, K]`, its row
    `row0 + batch · batch_rows` a vector along K (a LayerNorm's gamma and beta); `row`: `[rows, M]`,
    likewise one value per row of A (a mean, a second moment: hosted statistics stacked); `stat`
    (no array): field `row0` of the row pass `col0` (`Prologue.passes`), computed in the kernel."""

    kind: str
    array: jax.Array
    row0: int = 0
    batch_rows: int = 0
    col0: int = 0


@dataclasses.dataclass(frozen=True)
class _SourceLayout:
    """What the kernel needs of a `PrologueSource` (static: no array)."""

    kind: str
    row0: int
    batch_rows: int
    col0: int
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Prologue:
    """A computed from its sources in the kernel: `fn(values)` maps each source's values at a
    `[tile_m, tile_k]` A tile (vectors broadcast to it), in `sources`' order, to the tile (any
    float dtype; cast to the operands'). `passes`: the row statistics the kernel computes first
    (`emit.mosaic.row_statistics`), read by the `stat` sources."""

    fn: Callable[[Sequence[jax.Array]], jax.Array]
    sources: tuple[PrologueSource, ...]
    passes: tuple[RowPass, ...] = ()


def pad_to(x: jax.Array, shape: Sequence[int]) -> jax.Array:
    """`x` zero-padded at the end of each axis to `shape` (no copy when it has it already)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def _swizzled(tile_minor: int, dtype) -> tuple:
    """SMEM transforms for a tile whose minor dimension has `tile_minor` elements of `dtype`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(tile_minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(a_gmem, b_gmem, *refs, blocks: MosaicBlocks, kinds: tuple[str, ...], epilogue: EpilogueFn,
            m_padded: int, k_padded: int, batch_shared: tuple[bool, ...], interpreted: bool,
            a_window: AWindow | None = None, in_place: tuple[int, int] | None = None, batched: bool = False,
            prologue: tuple | None = None, statistics: tuple = (), n_valid: int = 0,
            group_statistics: tuple = (), rows_per_image: int = 0, n_ctas: int = 1):
    """`batched`: A, B and the output are `[batch, ., .]` arrays (each padded to the tiles or not,
    `InPlace`); `in_place`: `(M, N)` when the output is written unpadded, its last tiles clamped to
    end there. Otherwise (the conv's A window) A and the output are flat `[batch * M↑, .]` views
    (`m_padded` rows per batch entry) and B `[batch * K↑, N↑]`. `prologue`: `(fn, sources)` (a
    `Prologue`'s, the arrays dropped): A is computed per pipeline step from the sources' blocks
    (`a_gmem` the first source, the others after the epilogue's operands) by the compute warpgroup
    (one), stored to a 2-slot SMEM stage and fed to wgmma from there. `statistics`: the hosted
    statistics the epilogue writes as partials (`emit.mosaic.partials.RowStatistic`, batched only),
    each a `[tiles, fields, batch, rows]` output after the result, over the first `n_valid` columns.
    `group_statistics` (the conv's A window only): per-(image, channel group) statistics
    (`emit.mosaic.partials.GroupStatistic`), each a `[tiles, fields, slots]` output after those, one
    row per CTA and compute warpgroup (`n_ctas` CTAs along N); the last epilogue operand is then the
    image of each flat row (-1 off the output), `rows_per_image` rows per image."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    outputs = len(statistics) + len(group_statistics) + 1
    operand_gmems, (out_gmem, *partial_gmems) = refs[:len(kinds)], refs[len(refs) - outputs:]
    partial_gmems, group_gmems = partial_gmems[:len(statistics)], partial_gmems[len(statistics):]
    prologue_fn, sources, passes = prologue if prologue is not None else (None, (), ())
    fetched = [source for source in sources if source.kind != "stat"]  # the others: the row passes' fields
    extra = refs[len(kinds):len(refs) - outputs]
    pass_count = sum(len(row_pass.sources) for row_pass in passes)
    source_gmems = (a_gmem, *extra[:len(extra) - pass_count]) if prologue is not None else ()
    pass_gmems = extra[len(extra) - pass_count:]
    tile_m, tile_n, tile_k, cta_n = blocks.tile_m, blocks.tile_n, blocks.tile_k, blocks.cta_tile_n
    epi_m, epi_n, wgs = blocks.epi_m, blocks.epi_n, blocks.compute_wgs
    out_dtype = out_gmem.dtype
    mma_dtype = b_gmem.dtype
    transforms = _swizzled(tile_k, mma_dtype)
    k_steps = k_padded // tile_k

    def source_spec(source):
        if source.kind == "tile":
            return plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=_swizzled(tile_k, source.dtype),
                                   memory_space=plgpu.SMEM, delay_release=1)
        if source.kind == "col":
            return plgpu.BlockSpec((tile_k,), lambda k: (k,), memory_space=plgpu.SMEM, delay_release=1)
        # the same block at every step (the pipeline takes only blocks indexed by the step): re-read, tile_m values
        return plgpu.BlockSpec((tile_m,), lambda k: (k * 0,), memory_space=plgpu.SMEM, delay_release=1)

    if prologue is not None:
        a_specs = [source_spec(source) for source in fetched]
    elif a_window is None:
        a_specs = [plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=transforms,
                                   memory_space=plgpu.SMEM, delay_release=1)]
    else:
        a_specs = [plgpu.BlockSpec((pl.Element(tile_m), tile_k), a_window.offset, transforms=transforms,
                                   memory_space=plgpu.SMEM, delay_release=1)]

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                *a_specs,
                plgpu.BlockSpec((tile_k, cta_n), lambda k: (k, 0), transforms=transforms,
                                memory_space=plgpu.SMEM, delay_release=1),
            ],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=blocks.stages,
            compute_context=compute_context,
        )

    def operand_smem(kind, dtype):
        if kind == "tile":
            return plgpu.SMEM((wgs, epi_m, epi_n), dtype, transforms=_swizzled(epi_n, dtype))
        return plgpu.SMEM((wgs, epi_m if kind == "row" else epi_n), dtype)

    ignore = lambda *_, **__: None  # noqa: E731 (the allocations do not depend on the bodies)

    stage_alloc = {} if prologue is None else {"a_stage": plgpu.SMEM((2, tile_m, tile_k), mma_dtype,
                                                                      transforms=transforms)}
    if passes:  # the row passes' two-slot blocks and their barriers (`emit.mosaic.row_statistics`)
        stage_alloc["pass_smems"] = pass_smem(passes, tile_m, tile_k, _swizzled)
        stage_alloc["pass_barriers"] = [plgpu.Barrier(num_arrivals=len(row_pass.sources), num_barriers=2)
                                        for row_pass in passes if row_pass.derived is None]
    fields = sum(statistic.fields for statistic in statistics)
    if fields:  # each row block's partial vectors, per warpgroup: written once, no slot reuse
        stage_alloc["stat_smem"] = plgpu.SMEM((wgs, tile_m // epi_m, fields, epi_m), jnp.float32)
    if group_statistics:  # each warpgroup's slot vectors, written once at its tile's end
        stage_alloc["group_smems"] = [plgpu.SMEM((wgs, s.fields, s.padded_slots), jnp.float32)
                                      for s in group_statistics]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(*(source_gmems or (a_gmem,)), b_gmem),
        out_smem=plgpu.SMEM((wgs, 2, epi_m, epi_n), out_dtype, transforms=_swizzled(epi_n, out_dtype)),
        operand_smems=[operand_smem(kind, ref.dtype) for kind, ref in zip(kinds, operand_gmems)],
        barriers=plgpu.Barrier(num_barriers=max(1, wgs * len(kinds))),
        collective_axes="wg",
        **stage_alloc,
    )
    def _scope(pipeline_allocs, out_smem, operand_smems, barriers, a_stage=None, stat_smem=None, group_smems=None,
               pass_smems=None, pass_barriers=None):
        wg = lax.axis_index("wg")
        n_idx, m_idx, b_idx = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("b")
        if in_place is None:
            m0, n0 = m_idx * tile_m, n_idx * cta_n
            rows0 = b_idx * m_padded + m0  # first row of the CTA tile in the flat [B*M, ...] views (a window)
        else:  # the last tiles end at M and N (their first rows and columns are their neighbour's too)
            m0 = jnp.minimum(m_idx * tile_m, in_place[0] - tile_m)
            n0 = jnp.minimum(n_idx * cta_n, in_place[1] - cta_n)
        cols0 = n0 + wg * tile_n
        row_statistics = []  # the row passes' fields over the CTA's rows, computed before the pipeline

        def first_row(source):
            row = source.row0 + b_idx * source.batch_rows
            return row + m0 if source.kind == "tile" else row

        def compute_context(run_pipeline):
            if passes:
                row_statistics[:] = compute_row_statistics(passes, pass_gmems, pass_smems, pass_barriers,
                                                           first_row=first_row, tile_m=tile_m, tile_k=tile_k,
                                                           interpreted=interpreted)
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
            def _acc_scope(acc_ref):
                run_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                acc = acc_ref[...]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                groups = [None] * len(group_statistics)
                for em in range(tile_m // epi_m):
                    partials = [None] * len(statistics)
                    for en in range(tile_n // epi_n):
                        slot = (em * (tile_n // epi_n) + en) % 2
                        row_slice = pl.ds(m0 + em * epi_m, epi_m)
                        col_slice = pl.ds(cols0 + en * epi_n, epi_n)
                        tiles = []
                        for o, (kind, gmem, smem) in enumerate(zip(kinds, operand_gmems, operand_smems)):
                            batch = 0 if batch_shared[o] else b_idx
                            if kind == "tile":
                                src = gmem.at[batch, row_slice, col_slice]
                            elif kind == "row":
                                src = gmem.at[batch, row_slice]
                            else:
                                src = gmem.at[batch, col_slice]
                            barrier = barriers.at[wg * len(kinds) + o]
                            plgpu.copy_gmem_to_smem(src, smem.at[wg], barrier)
                            plgpu.barrier_wait(barrier)
                            if kind == "tile":
                                tiles.append(smem[wg])
                            else:  # a vector along one axis of the WGMMA layout, broadcast along the other
                                axis = 1 if kind == "col" else 0
                                # GPU interpret mode has no `plgpu.load` of a sliced ref; layouts are
                                # the compiler's business, the values are the same.
                                vector = smem[wg] if interpreted else \
                                    plgpu.load(smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1 - axis))
                                if group_statistics and o == len(kinds) - 1:  # the row images: kept a vector
                                    tiles.append(vector)
                                    continue
                                tiles.append(lax.broadcast_in_dim(vector, (epi_m, epi_n), (axis,)))
                        if group_statistics:  # the last operand: the image of each flat row
                            tiles, row_image = tiles[:-1], tiles[-1]
                        value = epilogue(acc[em * epi_m:(em + 1) * epi_m, en * epi_n:(en + 1) * epi_n], tiles)
                        stored = value.astype(out_dtype)
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's previous store has read it
                        out_smem[wg, slot] = stored
                        plgpu.commit_smem()
                        out_tile = out_gmem.at[b_idx, row_slice, col_slice] if batched else \
                            out_gmem.at[pl.ds(rows0 + em * epi_m, epi_m), col_slice]
                        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile)
                        if statistics:
                            cols = (cols0 + en * epi_n) + lax.broadcasted_iota(jnp.int32, (epi_m, epi_n), 1)
                            # a clamped last CTA's first columns are its neighbour's: they count there
                            valid = (cols >= n_idx * cta_n) & (cols < n_valid)
                            for s, statistic in enumerate(statistics):
                                part = tile_partials(statistic.op, statistic.body(stored), valid)
                                partials[s] = part if partials[s] is None else \
                                    merge_partials(statistic.op, partials[s], part)
                        if group_statistics:
                            first_row = m0 + em * epi_m  # the window's rows: batch 1, images along M
                            first_image = lax.div(first_row, rows_per_image)
                            span = -(-(epi_m - 1) // rows_per_image) + 1
                            for s, statistic in enumerate(group_statistics):
                                part = group_partials(statistic, stored, row_image, first_image, cols0 + en * epi_n,
                                                      min(span, statistic.images), interpreted)
                                groups[s] = part if groups[s] is None else \
                                    merge_partials(statistic.op, groups[s], part)
                    if statistics:
                        _write_partials(statistics, partials, stat_smem.at[wg, em], partial_gmems,
                                        n_idx * wgs + wg, b_idx, pl.ds(m0 + em * epi_m, epi_m))
                if group_statistics:
                    write_group_partials(group_statistics, groups, [smem.at[wg] for smem in group_smems],
                                         group_gmems, (m_idx * n_ctas + n_idx) * wgs + wg)

        def mma(_, a_smem, b_smem, acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, pl.ds(wg * tile_n, tile_n)])
            plgpu.wgmma_wait(1)  # the newest MMA stays in flight; its buffers are released next step
            return acc_ref

        def source_values(smems):
            values, smems = [], iter(smems)
            for source in sources:
                if source.kind == "stat":  # field row0 of pass col0, in registers
                    vector = row_statistics[source.col0][source.row0]
                    values.append(lax.broadcast_in_dim(vector, (tile_m, tile_k), (0,)))
                    continue
                smem = next(smems)
                if source.kind == "tile":
                    values.append(smem[...])
                    continue
                axis = 1 if source.kind == "col" else 0
                vector = smem[...] if interpreted else \
                    plgpu.load(smem, (), layout=plgpu.Layout.WGMMA.reduce(1 - axis))
                values.append(lax.broadcast_in_dim(vector, (tile_m, tile_k), (axis,)))
            return values

        def mma_with_prologue(indices, *refs):
            *smems, b_smem, acc_ref = refs
            # the stage the MMA of two steps ago read: `wgmma_wait(1)` below let it finish
            stage = a_stage.at[lax.rem(indices[0], 2)]
            stage[...] = prologue_fn(source_values(smems)).astype(mma_dtype)
            plgpu.commit_smem()  # the stores become visible to the async proxy wgmma reads through
            plgpu.wgmma(acc_ref, stage, b_smem)
            plgpu.wgmma_wait(1)
            return acc_ref

        if prologue is not None:
            views = []
            for source, gmem in zip(fetched, source_gmems):
                batch_at = source.row0 + b_idx * source.batch_rows  # a vector's row in its [rows, length] view
                if source.kind == "tile":
                    views.append(gmem.at[pl.ds(source.row0 + b_idx * source.batch_rows + m0, tile_m),
                                         pl.ds(source.col0, k_padded)])
                elif source.kind == "col":
                    views.append(gmem.at[batch_at])
                else:
                    views.append(gmem.at[batch_at, pl.ds(m0, tile_m)])
            pipeline(mma_with_prologue, compute_context)(*views, b_gmem.at[b_idx, :, pl.ds(n0, cta_n)],
                                                         allocations=pipeline_allocs)
            return
        if batched:
            a_tiles, b_tiles = a_gmem.at[b_idx, pl.ds(m0, tile_m), :], b_gmem.at[b_idx, :, pl.ds(n0, cta_n)]
        else:
            a_rows = tile_m if a_window is None else tile_m + a_window.halo
            a_tiles = a_gmem.at[pl.ds(rows0, a_rows), :]
            b_tiles = b_gmem.at[pl.ds(b_idx * k_padded, k_padded), pl.ds(n0, cta_n)]
        pipeline(mma, compute_context)(a_tiles, b_tiles, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _write_partials(statistics, partials, smem, gmems, tile, b_idx, rows) -> None:
    """A row block's partial vectors (per statistic, per field) through SMEM to row `tile` of each
    statistic's `[tiles, fields, batch, rows]` output, by TMA."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f = 0
    for part in partials:
        for value in part:
            smem[f] = value
            f += 1
    plgpu.commit_smem()
    f = 0
    for statistic, gmem in zip(statistics, gmems):
        for field in range(statistic.fields):
            plgpu.copy_smem_to_gmem(smem.at[f], gmem.at[tile, field, b_idx, rows])
            f += 1


def build(a: jax.Array, b: jax.Array, *, epilogue: EpilogueFn = lambda acc, _: acc,
          operands: Sequence[EpilogueOperand] = (), out_dtype=None, blocks: MosaicBlocks | None = None,
          interpret: Any = None, name: str = "matmul", a_window: AWindow | None = None,
          prologue: Prologue | None = None, statistics: Sequence[RowStatistic] = (),
          group_statistics: Sequence = (), row_image: jax.Array | None = None, rows_per_image: int = 0,
          padded_out: Callable[[jax.Array], None] | None = None, rows: int | None = None):
    """`epilogue(a @ b, operand tiles)` for `a [batch, m, k]`, `b [batch, k, n]` (fp16 or bf16, the
    same) as one Mosaic GPU kernel; returns `[batch, m, n]` of `out_dtype` (default `a.dtype`).
    `interpret`: True runs GPU interpret mode, False compiles for the GPU, None decides by the platform
    the call is lowered for (a CPU interprets).

    With `a_window` (batch 1), `a` is `[1, m + halo, columns]` laid out by the caller (`m` a multiple
    of `blocks.tile_m`, `columns` of `tile_k`) and read through the window's offsets; `b`'s K is the
    steps times `tile_k`.

    With `statistics` (no `a_window`): `(out, partials)`, partials each statistic's
    `[tiles, fields, batch · m]` (`emit.mosaic.partials`), or None when the output is not written
    in place (padded rows: the driver reduces the statistics then).

    With `group_statistics` (an A window: the flat-grid conv; `emit.mosaic.partials.GroupStatistic`):
    `(out, partials)`, partials each statistic's `[tiles, fields, slots]`, one tile per CTA and
    compute warpgroup; `row_image` `[m]` int32 is the image of each output row (-1 for a row that is
    not an output pixel), `rows_per_image` the rows from one image's first to the next's.

    `padded_out` (no `a_window`) is called with the padded `[batch, rows, cols]` output when the
    kernel cannot store it as it lies (the result is its slice). `rows` (no `a_window`): the
    problem's M when `a` has more rows (a padded store read as it lies; the rows past M are
    computed and dropped)."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or (a_window is None and a.shape[2] != b.shape[1]):
        raise ValueError(f"operands {a.shape} x {b.shape} are not [batch, m, k] x [batch, k, n]")
    if a.dtype != b.dtype or jnp.dtype(a.dtype).name not in MMA_DTYPES:
        raise NotImplementedError(f"wgmma operands {a.dtype} x {b.dtype} (the template multiplies two fp16 or "
                                  "two bf16 operands)")
    batch, m, k = a.shape
    n = b.shape[2]
    if a_window is not None:
        m, k = m - a_window.halo, b.shape[1]
    elif rows is not None:
        m = rows
    blocks = blocks or (matmul_blocks(m, n, k) if a_window is None else MosaicBlocks.get_default(m, n, k))
    if prologue is not None:
        blocks = prologue_blocks(blocks)
    blocks.validate()
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    mp = -(-m // blocks.tile_m) * blocks.tile_m
    np_ = -(-n // blocks.cta_tile_n) * blocks.cta_tile_n
    kp = -(-k // blocks.tile_k) * blocks.tile_k
    if a_window is None:
        return _build_batched(a, b, epilogue, operands, out_dtype, blocks, interpret, name, prologue,
                              tuple(statistics), padded_out, m)
    if statistics:
        raise ValueError("row statistics are written by the batched matmul only (no A window)")
    if group_statistics:  # rows past the table (the tile grid's padding) hold no image
        table = jnp.asarray(row_image, jnp.int32).reshape(-1)
        table = jnp.pad(table, (0, mp - table.shape[0]), constant_values=-1)
        operands = (*operands, EpilogueOperand("row", table.reshape(1, mp)))
    if batch != 1 or mp != m or kp != k or a.shape[2] % blocks.tile_k:
        raise ValueError(f"a windowed A {a.shape} (halo {a_window.halo}) and B {b.shape} must be laid out for "
                         f"{blocks.tile_m}-row tiles and {blocks.tile_k}-column blocks, batch 1")
    a_flat = a[0]
    b_flat = pad_to(b, (batch, kp, np_)).reshape(batch * kp, np_)
    arrays, kinds, shared = [], [], []
    for operand in operands:
        array = operand.array
        target = {"tile": (array.shape[0], mp, np_), "col": (array.shape[0], np_),
                  "row": (array.shape[0], mp)}[operand.kind]
        if array.shape[0] not in (1, batch):
            raise ValueError(f"epilogue operand {array.shape} for batch {batch}")
        arrays.append(pad_to(array, target))
        kinds.append(operand.kind)
        shared.append(array.shape[0] == 1)
    group_statistics = tuple(group_statistics)
    # the slot vectors in SMEM, per warpgroup: `fields` vectors of `padded_slots` floats each
    slot_rows = [("row", 4 * s.fields * s.padded_slots // blocks.epi_m) for s in group_statistics]
    blocks = fit_smem(blocks, jnp.dtype(a.dtype).itemsize, out_dtype.itemsize,
                      [(kind, jnp.dtype(array.dtype).itemsize) for kind, array in zip(kinds, arrays)] + slot_rows)
    grid = (np_ // blocks.cta_tile_n, mp // blocks.tile_m, batch)
    tiles = grid[0] * grid[1] * blocks.compute_wgs
    out_type = (jax.ShapeDtypeStruct((batch * mp, np_), out_dtype),
                *(jax.ShapeDtypeStruct((tiles, s.fields, s.slots), jnp.float32) for s in group_statistics))
    out_type = out_type if group_statistics else out_type[0]

    def call(interpret_here):
        body = functools.partial(_kernel, blocks=blocks, kinds=tuple(kinds), epilogue=epilogue, m_padded=mp,
                                 k_padded=kp, batch_shared=tuple(shared), interpreted=interpret_here,
                                 a_window=a_window, group_statistics=group_statistics,
                                 rows_per_image=rows_per_image, n_ctas=grid[0])
        return _warp_specialized(body, out_type, grid, blocks, name, interpret_params() if interpret_here else None)

    out = _launch(call, out_type, (a_flat, b_flat, *arrays), interpret, name)
    if group_statistics:
        out, *partials = out
        return out.reshape(batch, mp, np_)[:, :m, :n], partials
    return out.reshape(batch, mp, np_)[:, :m, :n]


def _launch(call: Callable[[bool], Callable], out_type, operands, interpret, name: str):
    """The kernel `call(interpreted)` on `operands`: interpreted on a CPU (one at a time), compiled
    for the GPU; `interpret=None` decides where it is lowered. Through `emit.mosaic.kernel_cache`:
    a kernel equal to an earlier one up to its name is lowered and compiled once."""

    def run(*xs):
        if interpret is None:
            return lax.platform_dependent(*xs, cpu=lambda *ys: one_at_a_time(call(True), out_type, ys),
                                          default=lambda *ys: call(False)(*ys))
        if interpret:
            return one_at_a_time(call(True), out_type, xs)
        return call(False)(*xs)

    return kernel_cache.launch(run, tuple(operands), _kernel_name(name or "matmul"), interpreted=interpret is True)


def _build_batched(a, b, epilogue, operands, out_dtype, blocks, interpret, name, prologue=None, statistics=(),
                   padded_out=None, problem_rows=None):
    """`build` without an A window: each of A, B, the output and a residual used as it lies where
    `matmul_in_place` says Mosaic's TMA can (its tails read as zeros, the output's last tiles
    clamped), padded to the tile grid where not (a row or column vector only when its stride is not
    16-byte aligned, `vector_fits`); with a `prologue`, A is computed in the kernel from its sources.
    An A of more rows than `m` (a matmul's padded store, `emit` below) is read as it lies: its rows
    are multiples of 8, those past `m` computed into rows that are dropped."""
    batch, m, k = a.shape
    m = problem_rows if problem_rows is not None else m
    n = b.shape[2]
    mp = -(-m // blocks.tile_m) * blocks.tile_m
    np_ = -(-n // blocks.cta_tile_n) * blocks.cta_tile_n
    kp = -(-k // blocks.tile_k) * blocks.tile_k
    place = matmul_in_place(m, n, k, blocks, out_dtype.itemsize)
    if prologue is not None and kp != k:
        raise NotImplementedError(f"an A prologue at K = {k}, not a multiple of {blocks.tile_k} (its last step would "
                                  "read the columns after K of its sources, not TMA's zeros)")
    q = blocks.tile_k
    if prologue is not None:
        a3 = None
    elif a.shape[1] > m and (k % q == 0 or k < q) and fits_tiles(a.shape[1], k, q):
        a3 = a  # a padded store (`emit` below): its rows past m computed into rows that are dropped
    else:
        a3 = a if place.a else pad_to(a[:, :m], (batch, mp, kp))
    b3 = b if place.b else pad_to(b, (batch, kp, np_))
    rows, cols = (m, n) if place.out else (mp, np_)
    arrays, kinds, shared = [], [], []
    for operand in operands:
        array = operand.array
        if array.shape[0] not in (1, batch):
            raise ValueError(f"epilogue operand {array.shape} for batch {batch}")
        itemsize = jnp.dtype(array.dtype).itemsize
        if operand.kind == "tile" and array.shape[1] > m and tile_fits(*array.shape[1:], blocks, itemsize):
            pass  # a padded store (`emit` below): rows past m are read into rows that are dropped
        elif operand.kind == "tile" and not tile_fits(m, n, blocks, itemsize):
            array = pad_to(array[:, :m, :n], (array.shape[0], rows, cols))
        elif operand.kind != "tile" and not vector_fits(array.shape[1], itemsize):
            array = pad_to(array, (array.shape[0], rows if operand.kind == "row" else cols))
        arrays.append(array)
        kinds.append(operand.kind)
        shared.append(array.shape[0] == 1)
    # a box past the end of an array: TMA's zero fill (the interpreter's, asked for); a prologue's
    # sources are read past their last row at an M tail
    extents = {"tile": (mp, np_), "col": (np_,), "row": (mp,)}
    past_end = (prologue is not None or a3.shape[1:] != (mp, kp) or b3.shape[1:] != (kp, np_) or
                any(x.shape[1:] != extents[kind] for kind, x in zip(kinds, arrays)))
    sources = () if prologue is None else prologue.sources
    fetched = [source for source in sources if source.kind != "stat"]
    passes = () if prologue is None else prologue.passes
    pass_sources = [source for row_pass in passes for source in row_pass.sources]
    # the statistics' partial vectors: per warpgroup, `fields` fp32 vectors of each row block
    stat_rows = [("row", 4 * s.fields * (blocks.tile_m // blocks.epi_m)) for s in statistics if place.out]
    blocks = fit_smem(blocks, jnp.dtype(b.dtype).itemsize, out_dtype.itemsize,
                      [(kind, jnp.dtype(array.dtype).itemsize) for kind, array in zip(kinds, arrays)] + stat_rows,
                      prologue=None if prologue is None else
                      [(source.kind, 4 if source.array is None else jnp.dtype(source.array.dtype).itemsize)
                       for source in sources] +
                      [(f"pass_{source.kind}", jnp.dtype(source.array.dtype).itemsize) for source in pass_sources])

    def layout(source):
        return _SourceLayout(source.kind, source.row0, source.batch_rows, source.col0,
                             jnp.dtype(jnp.float32 if source.array is None else source.array.dtype))

    layouts = tuple(layout(source) for source in sources)
    static_passes = tuple(dataclasses.replace(row_pass, sources=tuple(layout(s) for s in row_pass.sources))
                          for row_pass in passes)
    grid = (np_ // blocks.cta_tile_n, mp // blocks.tile_m, batch)
    written = statistics if place.out else ()  # padded rows: no partials (the driver reduces them)
    tiles = grid[0] * blocks.compute_wgs
    out_type = (jax.ShapeDtypeStruct((batch, rows, cols), out_dtype),
                *(jax.ShapeDtypeStruct((tiles, s.fields, batch, m), jnp.float32) for s in written))
    out_type = out_type if written else out_type[0]

    def call(interpret_here):
        body = functools.partial(_kernel, blocks=blocks, kinds=tuple(kinds), epilogue=epilogue, m_padded=rows,
                                 k_padded=kp, batch_shared=tuple(shared), interpreted=interpret_here,
                                 in_place=(m, n) if place.out else None, batched=True,
                                 prologue=None if prologue is None else (prologue.fn, layouts, static_passes),
                                 statistics=written, n_valid=n)
        return _warp_specialized(body, out_type, grid, blocks, name,
                                 interpret_params(tma_zero_fill=past_end) if interpret_here else None)

    if prologue is None:
        inputs = (a3, b3, *arrays)
    else:
        inputs = (fetched[0].array, b3, *arrays, *(source.array for source in fetched[1:]),
                  *(source.array for source in pass_sources))
    out = _launch(call, out_type, inputs, interpret, name)
    if padded_out is not None and not place.out:
        padded_out(out[0] if written else out)
    if statistics and not written:
        return out[:, :m, :n], None
    if written:
        out, *partials = out
        return out, [jnp.reshape(p, (tiles, s.fields, batch * m)) for p, s in zip(partials, written)]
    return out if place.out else out[:, :m, :n]


def one_at_a_time(interpreted: Callable, out_type, operands: Sequence[jax.Array]) -> jax.Array:
    """An interpreted kernel run as an ordered host callback: it starts once its operands exist and no
    other interpreted kernel runs beside it. jax 0.10.2's GPU interpret mode keeps one global
    simulated GPU, created by the first kernel that starts and cleared by the first that ends; XLA
    runs the part of a kernel that reads no operand (that creation) as soon as it can, so in one
    program two kernels overlapped and the later one waited forever in a barrier (a 3x3 conv feeding
    a stride-2 conv; the matmul stalls noted above may be the same)."""
    from jax.experimental import io_callback

    jitted = jax.jit(interpreted)
    return io_callback(lambda *xs: jax.tree.map(np.asarray, jitted(*xs)), out_type, *operands, ordered=True)


def _warp_specialized(body, out_type, grid, blocks: MosaicBlocks, name: str | None, interpret):
    """`body` as a warp-specialized Mosaic GPU kernel over grid (n, m, b): the compute warpgroups
    and one memory warpgroup (`interpret`: GPU interpret mode's parameters, or None)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=("n", "m", "b"),
                        num_threads=blocks.compute_wgs + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        kernel_name=_kernel_name(name), interpret=interpret)


def _kernel_name(name: str) -> str:
    """A PTX-safe symbol for `<component>:<kind>` (Mosaic names the entry after it)."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "matmul"


def reference(a: jax.Array, b: jax.Array, epilogue: EpilogueFn = lambda acc, _: acc,
              operands: Sequence[jax.Array] = (), out_dtype=None) -> jax.Array:
    """`epilogue(a @ b, operands)` in `jax.numpy`, fp32 accumulation (operands as full arrays that
    broadcast against `[batch, m, n]`)."""
    acc = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
    return epilogue(acc, list(operands)).astype(out_dtype or a.dtype)


# --- emit: a plan's Matmul term -----------------------------------------------------------------


class _RecordingMemory:
    """The host-side pass over the epilogue: records each `Load` (tensor, NumPy index) in the order
    the expression compiler meets them; values are scalars (only the index arithmetic matters)."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self):
        self.loads: list[tuple[Term, tuple]] = []

    def load(self, tensor: Term, index, mask):
        if any(not (ex.is_static(e) or isinstance(e, np.ndarray)) for e in index):
            raise NotImplementedError(f"the epilogue reads {tensor!r} at an index computed on the device")
        self.loads.append((tensor, tuple(index)))
        return jnp.zeros((), parse_type(tensor.ty).dtype)


class _TileMemory:
    """The in-kernel pass: the n-th `Load` is answered with the n-th operand's values at the
    `[epi_m, epi_n]` output sub-tile (read from SMEM, vectors broadcast)."""

    chunk_elements = ex.DEFAULT_CHUNK_ELEMENTS

    def __init__(self, tensors: Sequence[Term], tiles: Sequence[jax.Array]):
        self.tensors, self.tiles = tensors, tiles
        self.cursor = 0

    def load(self, tensor: Term, index, mask):
        if self.cursor >= len(self.tensors) or self.tensors[self.cursor] is not tensor:
            raise AssertionError(f"the epilogue's loads in the kernel differ from the host's at {tensor!r}")
        tile = self.tiles[self.cursor]
        self.cursor += 1
        return tile


def _reads_accumulator_at(out_index):
    """`Acc` callback checking the epilogue reads the accumulator at the output element itself."""

    def check(at):
        if len(at) != len(out_index) or any(a is not o and not (ex.is_static(a) and ex.is_static(o) and a == o)
                                            for a, o in zip(at, out_index)):
            raise NotImplementedError("the epilogue reads the accumulator through a view")

    return check


def epilogue_operands(epilogue: Term, axes, values: Callable[[Term], jax.Array], tables: list | None = None):
    """The epilogue's loads mapped onto the output tile (see the module docstring): `(tensors, operands)`,
    one `EpilogueOperand` per `Load` the expression compiler meets, in its order (`tables`: as
    `mapped_operands`)."""
    batch, m, n = (math.prod(s) for s in (axes.batch_shape, axes.m_shape, axes.n_shape))
    b = np.arange(batch).reshape(batch, 1, 1) if axes.batch_shape else 0
    rows, cols = np.arange(m).reshape(1, m, 1), np.arange(n).reshape(1, 1, n)
    return mapped_operands(epilogue, axes.out_index(b, rows, cols), (batch, m, n), values, tables)


def mapped_operands(epilogue: Term, out_index: tuple, shape: tuple[int, int, int], values: Callable[[Term], jax.Array],
                    tables: list | None = None):
    """`epilogue_operands` for any output layout: `out_index` is the epilogue's index (NumPy arrays
    broadcasting to `shape` `[batch, m, n]`) at each element of the kernel's output. `tables`: a list
    each operand's flat element indices are appended to (`[batch', m, n]`, or a row or column's)."""
    batch, m, n = shape
    memory = _RecordingMemory()
    check = _reads_accumulator_at(out_index)

    def accumulator(acc_ty, at, mask):
        check(at)
        return jnp.zeros((), jnp.float32)

    ex.compile_expr(epilogue)(memory, out_index, True, accumulator)
    tensors, operands = [], []
    for tensor, index in memory.loads:
        shape = parse_type(tensor.ty).shape
        flat = np.broadcast_to(np.asarray(ex.linearize(index, shape), np.int64), (batch, m, n))
        size = math.prod(shape)
        if flat.size and (flat.min() < 0 or flat.max() >= max(size, 1)):
            raise NotImplementedError(f"the epilogue reads {tensor!r} outside its bounds")
        by_batch = batch > 1 and not np.array_equal(flat, np.broadcast_to(flat[:1], flat.shape))
        by_row = m > 1 and not np.array_equal(flat, np.broadcast_to(flat[:, :1], flat.shape))
        by_col = n > 1 and not np.array_equal(flat, np.broadcast_to(flat[:, :, :1], flat.shape))
        flat = flat if by_batch else flat[:1]
        if by_row and by_col:
            kind, table = "tile", flat
        elif by_row:
            kind, table = "row", flat[:, :, 0]
        else:
            kind, table = "col", flat[:, 0, :]
        dtype = jnp.dtype(parse_type(tensor.ty).dtype)
        if dtype.itemsize not in (2, 4) or (dtype.kind not in "fiu" and dtype != jnp.bfloat16):
            raise NotImplementedError(f"an epilogue operand of dtype {dtype} (TMA tiles of 2- or 4-byte numbers)")
        value = jnp.reshape(values(tensor), (-1,))
        if table.size == value.size and np.array_equal(table.reshape(-1), np.arange(value.size)):
            array = value.reshape(table.shape)  # the view is a reshape: no copy
        else:
            array = value[table]  # a static gather, once per call
        tensors.append(tensor)
        operands.append(EpilogueOperand(kind, array))
        if tables is not None:
            tables.append(table)
    return tensors, operands


def in_kernel_prologue(lhs: Term, rhs: Term, dims: str, ty: str, axes,
                       values: Callable[[Term], jax.Array], stores: Callable | None = None) -> Prologue | None:
    """The A operand expression as a `Prologue` the kernel computes per A tile in SMEM, or None when
    A is read as it lies or the expression is not a form the kernel takes
    (`eqsat.cost.mosaic.prologue_declined`, or a load `prologue_sources` cannot map without a
    gather): then XLA computes A whole, one fusion, before the kernel. Each `RowReduce` in it (a
    LayerNorm's own statistics) becomes a row pass (`row_passes`) whose fields the expression reads.
    `stores(tensor)`: a matmul's padded store of the tensor, or None (`load_sources`)."""
    from eqsat.cost.mosaic import prologue_declined, split_row_reduces

    if prologue_declined(lhs, rhs, dims, ty) is not None:
        return None
    shape = tuple(math.prod(s) for s in (axes.batch_shape, axes.m_shape, axes.k_shape))
    tile_k = prologue_blocks(matmul_blocks(shape[1], math.prod(axes.n_shape), shape[2])).tile_k
    applied, pairs = split_row_reduces(lhs)
    slots: dict = {}  # each pass's slot of the statistic at each [batch, m] (`statistic_source`)
    try:
        tensors, sources = prologue_sources(applied, axes, shape, values, tile_k,
                                            functools.partial(statistic_source, pairs, slots), stores)
        passes = row_passes(pairs, slots, shape, values, tile_k, stores)
    except NotImplementedError:
        return None
    # one source per distinct window (a tensor loaded twice at the same place is read once)
    unique, of_load = {}, []
    for tensor, source in zip(tensors, sources):
        key = (id(tensor), source.kind, source.row0, source.batch_rows, source.col0)
        of_load.append(unique.setdefault(key, (len(unique), source))[0])
    distinct = [source for _, source in sorted(unique.values(), key=lambda pair: pair[0])]
    compiled = ex.compile_expr(applied)
    rank = len(parse_type(lhs.ty).shape)
    with_batch = bool(axes.batch_shape)

    def tile(values_at):
        tm, tk = values_at[0].shape
        b = np.zeros((1, 1), np.int64) if with_batch else 0
        index = axes.lhs_index(rank, b, np.arange(tm).reshape(tm, 1), np.arange(tk).reshape(1, tk))
        memory = _TileMemory(tensors, [values_at[i] for i in of_load])
        value = compiled(memory, index, True)
        if memory.cursor != len(tensors):
            raise AssertionError("the prologue's loads in the kernel differ from the host's")
        return jnp.broadcast_to(value, (tm, tk))

    return Prologue(tile, tuple(distinct), tuple(passes))


def statistic_source(pairs, slots: dict, tensor: Term, flat: np.ndarray) -> PrologueSource | None:
    """The `stat` source of a load of a row pass's stand-in (`eqsat.cost.mosaic.split_row_reduces`):
    `flat` `[batch, m, k]` the element it reads; it must read one field of the reduction per row
    (not along K), every load of that pass at the same slots (kept in `slots`). None for another tensor."""
    found = [i for i, (stand_in, _node) in enumerate(pairs) if stand_in is tensor]
    if not found:
        return None
    (p,) = found
    accumulator = parse_type(tensor.ty).shape  # the reduction's accumulator: `[2, ...kept]` for moments
    kept = accumulator[1:] if pairs[p][1].args[0] == "moments" else accumulator
    per_field = max(1, math.prod(kept))
    if flat.shape[2] > 1 and not np.array_equal(flat, np.broadcast_to(flat[:, :, :1], flat.shape)):
        raise NotImplementedError("a row statistic read along K")
    field, slot = np.divmod(flat[:, :, 0], per_field)
    if not np.all(field == field.flat[0]):
        raise NotImplementedError("a row statistic read at several fields along the rows")
    if p in slots and not np.array_equal(slots[p], slot):
        raise NotImplementedError("a row statistic read at different slots by its loads")
    slots[p] = slot
    return PrologueSource("stat", None, int(field.flat[0]), 0, p)


def row_passes(pairs, slots: dict, shape: tuple[int, int, int], values: Callable[[Term], jax.Array],
               tile_k: int, stores: Callable | None = None) -> list[RowPass]:
    """Each `RowReduce` of the A expression (`pairs`: `(stand-in, node)`) as the kernel's `RowPass`:
    its body's loads at the slots the expression reads (`slots[p]` `[batch, m]`, the flat kept index)
    over the whole reduced axis, mapped to `[rows, length]` tiles and vectors along the row
    (`load_sources`; raises `NotImplementedError` for any other read)."""
    from emit.pallas.matmul import unravel_tile
    from eqsat.cost.mosaic import derived_sum

    batch, m, _k = shape
    passes = []
    for p, (_stand_in, node) in enumerate(pairs):
        if p not in slots:
            raise NotImplementedError("a row statistic the expression does not read")
        op, body, axis, _epilogue, _ty = node.args
        body_shape = parse_type(body.ty).shape
        kept_shape, length = body_shape[:axis] + body_shape[axis + 1:], body_shape[axis]
        moments = derived_sum(node, [n for _, n in pairs])
        if moments is not None and np.array_equal(slots[p], slots.get(moments)):
            passes.append(RowPass(op, None, (), length, moments))
            continue
        kept = ex.unravel(slots[p].reshape(batch, m, 1), kept_shape)
        point = (*kept[:axis], np.arange(length).reshape(1, 1, length), *kept[axis:])
        memory = _RecordingMemory()
        ex.compile_expr(body)(memory, point, True)
        tensors, sources = load_sources(memory.loads, (batch, m, length), values, tile_k, stores=stores)
        if any(source.kind != "tile" and source.kind != "col" for source in sources):
            raise NotImplementedError("a row statistic whose body reads a vector along the rows")
        compiled = ex.compile_expr(body)

        def fn(values_at, compiled=compiled, tensors=tensors, kept_shape=kept_shape, axis=axis):
            tm, tk = values_at[0].shape
            local = unravel_tile(np.arange(tm).reshape(tm, 1), kept_shape)
            memory = _TileMemory(tensors, values_at)
            value = compiled(memory, (*local[:axis], np.arange(tk).reshape(1, tk), *local[axis:]), True)
            if memory.cursor != len(tensors):
                raise AssertionError("the row pass's loads in the kernel differ from the host's")
            return value

        passes.append(RowPass(op, fn, tuple(sources), length))
    return passes


def prologue_sources(lhs: Term, axes, shape: tuple[int, int, int], values: Callable[[Term], jax.Array],
                     tile_k: int = 64, statistic: Callable | None = None, stores: Callable | None = None):
    """`(tensors, sources)`: each `Load` of the A expression, in the order the expression compiler
    meets them, as the `PrologueSource` the kernel reads it through (no copy: a reshape of the
    tensor as it lies; `statistic(tensor, flat)`: a row pass's field, or None). Raises
    `NotImplementedError` for a load that would need a gather."""
    batch, m, k = shape
    rank = len(parse_type(lhs.ty).shape)
    b = np.arange(batch).reshape(batch, 1, 1) if axes.batch_shape else 0
    index = axes.lhs_index(rank, b, np.arange(m).reshape(1, m, 1), np.arange(k).reshape(1, 1, k))
    memory = _RecordingMemory()
    ex.compile_expr(lhs)(memory, index, True)
    tensors, sources = load_sources(memory.loads, shape, values, tile_k, statistic, stores)
    if not any(source.kind == "tile" for source in sources):
        raise NotImplementedError("a prologue that reads no [rows, K] tile")
    return tensors, sources


def load_sources(recorded, shape: tuple[int, int, int], values: Callable[[Term], jax.Array], tile_k: int,
                 statistic: Callable | None = None, stores: Callable | None = None):
    """`(tensors, sources)` of recorded `(tensor, index)` loads over `shape` `[batch, m, k]`: `[rows, K]`
    windows of tensors as they lie (`tile`) and vectors along the rows or K (`row`, `col`). A tensor
    whose rows TMA cannot tile (77-token rows) is read from the padded store a Mosaic matmul left of
    it (`stores(tensor)`: `[1, rows↑, pitch]`, its rows where they were, more after them)."""
    from eqsat.tiling.mosaic import minor_tile
    from eqsat.tiling.mosaic import fits_tiles as tiles_fit

    batch, m, k = shape
    loads = []
    for tensor, at in recorded:
        tensor_shape = parse_type(tensor.ty).shape
        flat = np.broadcast_to(np.asarray(ex.linearize(at, tensor_shape), np.int64), shape)
        stat = statistic(tensor, flat) if statistic is not None else None
        if stat is not None:
            loads.append((tensor, stat))
            continue
        dtype = jnp.dtype(parse_type(tensor.ty).dtype)
        if dtype.itemsize not in (2, 4) or not jnp.issubdtype(dtype, jnp.floating):
            raise NotImplementedError(f"a prologue source of dtype {dtype}")
        size = max(math.prod(tensor_shape), 1)
        value = jnp.reshape(values(tensor), (-1,))
        by_batch = batch > 1 and not np.array_equal(flat, np.broadcast_to(flat[:1], flat.shape))
        by_row = m > 1 and not np.array_equal(flat, np.broadcast_to(flat[:, :1], flat.shape))
        by_col = k > 1 and not np.array_equal(flat, np.broadcast_to(flat[:, :, :1], flat.shape))
        if by_col and (by_row or by_batch):
            first = flat[:, :, :1]
            pitch = int(flat[0, 1, 0] - flat[0, 0, 0]) if m > 1 else k
            batch_step = int(flat[1, 0, 0] - flat[0, 0, 0]) if batch > 1 else 0
            expected = (flat[0, 0, 0] + np.arange(batch).reshape(batch, 1, 1) * batch_step
                        + np.arange(m).reshape(1, m, 1) * pitch + np.arange(k).reshape(1, 1, k))
            row0, col0 = divmod(int(flat[0, 0, 0]), max(pitch, 1))
            if (not np.array_equal(flat, expected) or pitch < k or col0 + k > pitch or size % pitch
                    or batch_step % max(pitch, 1) or first.min() < 0):
                raise NotImplementedError(f"the prologue reads {tensor!r} other than in [rows, K] tiles")
            rows = size // pitch
            store = stores(tensor) if stores is not None else None
            if not tiles_fit(rows, pitch, minor_tile(tile_k, dtype.itemsize)) and store is not None and \
                    store.shape[0] == 1 and store.shape[2] == pitch and \
                    tiles_fit(store.shape[1], pitch, minor_tile(tile_k, dtype.itemsize)):
                rows, value = store.shape[1], store  # the padded store: the same rows, and more after them
            if not tiles_fit(rows, pitch, minor_tile(tile_k, dtype.itemsize)):
                raise NotImplementedError(f"a prologue source [{rows}, {pitch}] Mosaic's TMA cannot tile")
            loads.append((tensor, PrologueSource("tile", value.reshape(rows, pitch), row0, batch_step // pitch, col0)))
            continue
        kind, table = ("row", flat[:, :, 0]) if by_row or by_batch else ("col", flat[:, 0, :])
        table = table if by_batch else table[:1]
        length, start = table.shape[1], int(table[0, 0])
        batch_step = int(table[1, 0] - table[0, 0]) if by_batch else 0
        expected = start + np.arange(table.shape[0]).reshape(-1, 1) * batch_step + np.arange(length).reshape(1, -1)
        # a window of `length` values at a row of the tensor viewed [size / length, length]: a vector
        # as it lies, or one slot of stacked ones (a mean and a second moment, a statistic per batch entry)
        if (not np.array_equal(table, expected) or start % length or batch_step % length or size % length
                or start < 0):
            raise NotImplementedError(f"the prologue reads {tensor!r} other than as a vector as it lies")
        if not vector_fits(length, dtype.itemsize):
            raise NotImplementedError(f"a prologue vector of {length} {dtype} (a stride TMA cannot take)")
        loads.append((tensor, PrologueSource(kind, value.reshape(size // length, length), start // length,
                                             batch_step // length)))
    return [t for t, _ in loads], [source for _, source in loads]


def _operand_matrix(value: jax.Array, batch_axes, first_axes, second_axes, shape: tuple[int, int, int]):
    """`value` with its axes ordered batch, first, second and flattened to `shape` `[batch, ., .]`."""
    order = (*batch_axes, *first_axes, *second_axes)
    if order != tuple(range(value.ndim)):
        value = jnp.transpose(value, order)
    return jnp.reshape(value, shape)


def padded_stores(ctx) -> Callable[[Term], jax.Array | None]:
    """`tensor -> ` the padded `[1, rows↑, columns]` store a Mosaic matmul left of it in `ctx`, or None."""
    from emit.mosaic.layouts import padded_rows_key

    return lambda tensor: ctx.values.get(padded_rows_key(tensor))


def padded_rows_input(lhs: Term, rhs: Term, dims: str, ctx) -> jax.Array | None:
    """A `[1, rows, K]` when A is a view of a matmul's output that its Mosaic template stored padded
    (`eqsat.cost.mosaic.reads_padded_rows`) and left in the context (`padded_rows_key`); else None."""
    from emit.mosaic.layouts import padded_rows_key
    from eqsat.cost.mosaic import reads_padded_rows

    producer = reads_padded_rows(lhs, rhs, dims)
    return None if producer is None else ctx.values.get(padded_rows_key(producer))


def padded_residual_operands(epilogue: Term, tensors: Sequence[Term], operands: Sequence[EpilogueOperand],
                             tables: Sequence[np.ndarray], shape: tuple[int, int, int], ctx) -> list:
    """`operands` with each residual a matmul stored padded (`eqsat.cost.mosaic.padded_residuals`),
    read at the output's own element, replaced by that padded store as it lies."""
    from emit.mosaic.layouts import padded_rows_key
    from eqsat.cost.mosaic import padded_residuals

    batch, m, n = shape
    stored = {id(t) for t in padded_residuals(epilogue, batch, m, n)}
    out = list(operands)
    for i, (tensor, operand, table) in enumerate(zip(tensors, operands, tables)):
        padded = ctx.values.get(padded_rows_key(tensor)) if id(tensor) in stored else None
        if padded is None or operand.kind != "tile" or table.shape != (1, m, n) or \
                not np.array_equal(table.reshape(-1), np.arange(m * n)):
            continue
        out[i] = EpilogueOperand("tile", padded)
    return out


def prepared_padded_input(term: Term, ctx):
    """`(a [1, M, H·padded], weight [1, H·padded, N])` when A is an attention's output its Mosaic
    template left with padded heads in the context and the prepare stage laid the weight out with
    zero rows after each head (`eqsat.cost.mosaic.reads_padded_heads`); else None."""
    from emit.mosaic.layouts import head_padded_weight, padded_heads_key
    from eqsat.cost.mosaic import reads_padded_heads

    lhs, rhs, dims = term.args[:3]
    found = reads_padded_heads(lhs, rhs, dims)
    if found is None:
        return None
    attention, head_dim = found
    layout = head_padded_weight(term, head_dim, rows=True)
    weight = ctx.values.get(layout) if layout is not None else None
    padded = ctx.values.get(padded_heads_key(attention))
    if weight is None or padded is None:
        return None
    return jnp.reshape(padded, (1, -1, weight.shape[0])), weight[None]


def prepared_head_padding(term: Term, ctx):
    """`(weight [K, N'], head, padded)` when the prepare stage laid this matmul's weight out with
    each head of its output zero-padded (`emit.mosaic.layouts.head_padded_weight`, chosen by
    `emit.prepare` for projections only padded-head Mosaic attentions read); else None."""
    from emit.mosaic.layouts import head_padded_weight, padded_head_widths
    from eqsat.cost.mosaic import prepared_weight, zero_preserving
    from eqsat.tiling.mosaic import padded_head

    _lhs, rhs, _dims, epilogue, ty = term.args
    n = parse_type(ty).shape[-1]
    if not zero_preserving(epilogue) or not prepared_weight(rhs):
        return None
    for head in padded_head_widths(n):
        layout = head_padded_weight(term, head)
        value = ctx.values.get(layout) if layout is not None else None
        if value is not None:
            return value, head, padded_head(head)
    return None


def emit(kernel, ctx) -> dict:
    """`{kernel.term: value}` for a plan's `Matmul` kernel (`emit.pallas.KernelCall`) in `ctx`, as a
    Mosaic GPU kernel, plus the partials (`emit.pallas.partials.Partials`) of each hosted statistic
    it writes (`emit.mosaic.partials`; the others the driver reduces after it); forms the template
    does not cover raise `NotImplementedError` (`emit.mosaic` then uses the Triton template)."""
    from emit.pallas.partials import Partials
    from emit.pallas.matmul import DotAxes
    from eqsat.interpret import _Evaluator

    term = kernel.term
    lhs, rhs, dims, epilogue, ty = term.args
    lhs_type, rhs_type, out_type = parse_type(lhs.ty), parse_type(rhs.ty), parse_type(ty)
    if lhs_type.dtype != rhs_type.dtype or lhs_type.dtype not in MMA_DTYPES:
        raise NotImplementedError(f"{lhs_type.dtype} x {rhs_type.dtype} operands (wgmma here multiplies two "
                                  f"fp16 or two bf16 operands)")
    if jnp.dtype(out_type.dtype).itemsize not in (2, 4) or not jnp.issubdtype(out_type.dtype, jnp.floating):
        raise NotImplementedError(f"a {out_type.dtype} result")
    missing = sorted({node.op for node in ex.expr_nodes(epilogue)} - EPILOGUE_OPS)
    if missing:
        raise NotImplementedError(f"an epilogue with {', '.join(missing)} (the Mosaic epilogue maps views and "
                                  "elementwise ops onto the output tile)")
    axes = DotAxes.of(dims, lhs_type.shape, rhs_type.shape)
    batch, m, n, k = (math.prod(s) for s in (axes.batch_shape, axes.m_shape, axes.n_shape, axes.k_shape))
    if min(batch, m, n, k) == 0:
        raise NotImplementedError("an empty matmul")
    tables: list = []
    tensors, operands = epilogue_operands(epilogue, axes, ctx.value, tables)
    operands = padded_residual_operands(epilogue, tensors, operands, tables, (batch, m, n), ctx)
    # Operand expressions (views, casts, a LayerNorm apply) computed whole by the interpreter: XLA
    # fuses them into one pass writing each operand in the [batch, rows, K] layout TMA reads.
    known = _Evaluator({}, ctx.constants, ctx.payloads)
    known.values = ctx.values
    prologue = in_kernel_prologue(lhs, rhs, dims, ty, axes, ctx.value, padded_stores(ctx))
    evaluator = _Evaluator({}, ctx.constants, ctx.payloads, parent=known)
    padded_a = padded_rows_input(lhs, rhs, dims, ctx) if prologue is None else None
    if padded_a is not None:  # another matmul's padded store, read as it lies
        (rhs_value,) = evaluator.run([rhs])
        a = padded_a
    elif prologue is None:  # A read as it lies, or computed whole by XLA (one fusion) into [batch, rows, K]
        lhs_value, rhs_value = evaluator.run([lhs, rhs])
        a = _operand_matrix(lhs_value, axes.lhs_batch, axes.lhs_free, axes.lhs_contract, (batch, m, k))
    else:
        (rhs_value,) = evaluator.run([rhs])
        a = jax.ShapeDtypeStruct((batch, m, k), jnp.dtype(lhs_type.dtype))
    w = _operand_matrix(rhs_value, axes.rhs_batch, axes.rhs_contract, axes.rhs_free, (batch, k, n))
    padded_heads = prepared_head_padding(term, ctx) if not kernel.hosted else None
    if padded_heads is not None:  # heads written zero-padded to wgmma's width, for the attention to read
        w = padded_heads[0][None]
    padded_input = prepared_padded_input(term, ctx)
    if padded_input is not None:  # an attention's output read with its padded heads, the weight's rows padded
        a, w = padded_input
        prologue = None
    compiled = ex.compile_expr(epilogue)
    with_batch = bool(axes.batch_shape)

    def tile_epilogue(acc, tiles):
        em, en = acc.shape
        b = np.zeros((1, 1), np.int64) if with_batch else 0
        out_index = axes.out_index(b, np.arange(em).reshape(em, 1), np.arange(en).reshape(1, en))
        check = _reads_accumulator_at(out_index)

        def accumulator(acc_ty, at, mask):
            check(at)
            return acc

        memory = _TileMemory(tensors, tiles)
        value = compiled(memory, out_index, True, accumulator)
        if memory.cursor != len(tensors):
            raise AssertionError("the epilogue's loads in the kernel differ from the host's")
        return jnp.reshape(value, (em, en))

    statistics, computed = [], []
    for reduction in kernel.hosted:
        if ctx.pending.get(reduction) is not None:
            continue  # an earlier host wrote partials: not a statistic this template writes alone
        try:
            statistics.append(RowStatistic.of(reduction, term, axes))
        except NotImplementedError:
            continue  # the driver reduces it after this kernel
        computed.append(reduction)
    stores: list = []
    out = build(a, w, epilogue=tile_epilogue, operands=operands, out_dtype=out_type.dtype,
                interpret=ctx.interpret, name=kernel.name, prologue=prologue, statistics=statistics,
                padded_out=stores.append if padded_heads is None and not with_batch else None, rows=m)
    out, partials = out if statistics else (out, None)
    if stores:  # the padded store, for the matmuls that read it as it lies (`padded_rows_input`)
        from emit.mosaic.layouts import padded_rows_key

        ctx.values[padded_rows_key(term)] = stores[0]
    if padded_heads is not None:
        from emit.mosaic.layouts import padded_heads_key

        _, head, padded = padded_heads
        ctx.values[padded_heads_key(term)] = out
        # the unpadded value for any other reader: a slice XLA drops when only the attention reads `out`
        out = out.reshape(m, n // head, padded)[:, :, :head]
    return {term: out.reshape(out_type.shape), **{r: Partials(p) for r, p in zip(computed, partials or ())}}
