"""A hosted statistic finished inside its Mosaic GPU producer by the CTA that completes last (the
"last block" reduction), so no kernel after the producer merges its partials.

Every CTA writes its partial row (`[fields, slots]` of the `[tiles, fields, slots]` partials output,
as `emit.mosaic.partials.write_group_partials` does), waits until that TMA store is complete, and
takes a ticket: one `atom.acq_rel.gpu.global.add.u32` on an int32 counter in GMEM (`take_ticket`).
The CTA that draws ticket `tiles - 1` knows every other partial is in GMEM: it resets the counter to
0 (`reset_counter`), reads all `tiles` rows back by TMA in blocks of `BLOCK_TILES` (`finish`),
reduces each block over its tiles at once and merges the blocks in order, and writes the finished
statistic (`[rows, slots]`: mean and M2 for `moments`, the sum for `sum`). No CTA ever waits for another (no spinning on a CTA that may not be
resident yet), and the finishing CTA is whichever completes last, so nothing idles.

Ordering: the writer's TMA store is waited (`cp.async.bulk.wait_group 0`), then
`fence.proxy.async.global` (the async proxy's writes ordered before the generic proxy's atomic) in
every thread, a warpgroup barrier, and the atomic (release); the finisher's atomic (acquire), a
barrier, `fence.proxy.async.global` in every thread, then its TMA loads. Mosaic GPU 0.10.2 has no
fetch-and-add that returns the old value (`plgpu.atomic_add` is a store-add without a result;
`plgpu.semaphore_signal` is `red.release` without one; `plgpu.semaphore_wait` spins), so the ticket
is inline Mosaic GPU (`plgpu.inline_mgpu`): one elected thread takes it and leaves it in a one-word
SMEM buffer the warpgroup reads after the barrier.

The counter: Pallas's own GMEM semaphores (`pl.get_global(plgpu.SemaphoreType.REGULAR)`, or a
semaphore in `scratch_shapes`) are zeroed by XLA before every call, one `kCopy` launch per kernel
(measured: a 4-byte copy beside the kernel, deviceless for sm_90a), which would trade each finishing
launch for a copy. Here the counter is an ordinary `int32[1]` operand aliased to an extra output
(`counter_kernel`): every finishing kernel leaves it at 0, so
one zeroed counter (`new_counter`, one copy) serves a chain of kernels that pass it on.
`plgpu.kernel` takes no aliases, and wraps its body in `custom_vmap`, which has no state discharge
rule for a mutable ref operand ("No state discharge rule implemented for primitive:
custom_vmap_call").

The merge: blocks of `BLOCK_TILES` (64, one WGMMA-layout tile) rows of partials, reduced over the
rows `MERGE_COLUMNS` (32) slots at a time (`block_merge`), so the slots must be whole 64-vectors
(`eqsat.cost.finish`). Compiled for sm_90a beside a 64-row haloed conv (176 registers) it needs 246
registers and spills nothing; beside a 128-row one (255 registers without it) it spills 28 bytes.
In the full UNet (deviceless, sm_90a) 3 of 19 finishing convs spilled: two stride-2 downsamplers
(152 bytes each) and the 1x1 `down_blocks.2.attentions.0:conv` (32 bytes); stride-2 and 1x1 convs no
longer finish (`eqsat.cost.finish`): 13 do, none spilling.
Its cost is a serial tail after the grid (`eqsat.cost.mosaic.finish_tail_seconds`), weighed against
the finalize launch it saves.

The vector tables (`emit.pallas.tables`) of the Mosaic convs reading the statistic are written by
the same CTA after the merge (`table_plan` on the host, `write_tables` in the kernel): per image and
64-channel chunk of a row, the statistic's entries as selects of SMEM scalars over the static runs
of channels that gather one entry (the group -> channel expansion without a per-lane gather), the
other rows (gamma, beta, a time-embedding row) brought by 1-D TMA from their tensors, zeros past a
row's channels; one 1-D TMA store per row chunk. In the full UNet 19 statistics finish so (13
driver finalizes and 6 plan finalizes gone); the others have several hosts, bodies reading other
tensors than the conv's output, or tails longer than the finalize (`eqsat.cost.finish`).

GPU interpret mode (jax 0.10.2) runs the grid's CTAs one after another in grid order
(`interpret_pallas_call`: a `fori_loop` over grid points), takes no mutable ref operand
("KeyError: None" for its memory space), has no GMEM atomics and cannot discharge `get_global`;
there the finishing CTA is the grid's last (`is_last_cta`), which runs after every other, and the
counter is not passed to the kernel. The ticket itself is checked compiled (deviceless, sm_90a),
not run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from emit import expr as ex

BLOCK_TILES = 64  # partial rows the finishing CTA brings to SMEM and reduces at once
MERGE_COLUMNS = 32  # slots merged at once (64 at once spilled beside a conv's registers)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A hosted statistic its producer finished (`[rows · slots]` flat: mean then M2, or the sum)."""

    value: jax.Array


def counter_of(ctx) -> jax.Array:
    """The emission's ticket counter (`ctx.counter`, one zeroed counter for the whole emission)."""
    if getattr(ctx, "counter", None) is None:
        ctx.counter = new_counter()
    return ctx.counter


def new_counter() -> jax.Array:
    """A zeroed ticket counter for a chain of finishing kernels (each leaves it at 0)."""
    return jnp.zeros((1,), jnp.int32)


def counter_kernel(body, out_type, grid: tuple, grid_names: tuple, compiler_params, name: str):
    """`body` as a Mosaic GPU kernel over `grid` whose last operand is the ticket counter, aliased to
    an extra output (each finishing kernel passes it on): a callable `(*operands, counter) ->
    (outputs, counter)`. `plgpu.kernel` takes no aliases, and a counter passed as a mutable ref
    (`jax.new_ref`: `pl.kernel` discharges it into an alias) names the kernel `new_body` (the
    discharged body's), which the PTX reports cannot match to the plan's kernel: so jax's own
    `mpmd_map` with the alias (`jax._src.pallas.mpmd._mpmd_map`, what `pl.kernel` calls)."""
    from jax._src.pallas import mpmd
    from jax.experimental.pallas import mosaic_gpu as plgpu

    outs = tuple(out_type) if isinstance(out_type, (tuple, list)) else (out_type,)

    def call(*operands):
        counter_index = len(operands) - 1
        kernel = mpmd._mpmd_map([(plgpu.Mesh(grid=grid, grid_names=grid_names), lambda *refs: body(*refs[:-1]))],
                                (*outs, jax.ShapeDtypeStruct((1,), jnp.int32)),
                                input_output_aliases={counter_index: len(outs)}, compiler_params=compiler_params,
                                name=name)
        *results, counter = kernel(*operands)
        return (tuple(results) if isinstance(out_type, (tuple, list)) else results[0]), counter

    return call


def _asm(text: str) -> None:
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], text, "", has_side_effects=True)


def take_ticket(counter, ticket_smem) -> jax.Array:
    """This CTA's ticket (how many CTAs took one before it), after its GMEM writes are complete
    (`plgpu.wait_smem_to_gmem(0)` before this): an int32 scalar, the same in every thread."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def _ticket(_ctx, counter_ref, slot_ref):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, memref
        from jax.experimental.mosaic.gpu import utils as mu

        i32 = ir.IntegerType.get_signless(32)
        _asm("fence.proxy.async.global;")
        mu.warpgroup_barrier()
        with mu.single_thread(mu.ThreadSubset.WARPGROUP):
            old = llvm.inline_asm(i32, [mu.memref_ptr(counter_ref)],
                                  "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", "=r,l", has_side_effects=True)
            memref.store(old, slot_ref, [arith.constant(ir.IndexType.get(), 0)])
        mu.warpgroup_barrier()
        _asm("fence.proxy.async.global;")

    _ticket(counter, ticket_smem)
    return ticket_smem[0]


def reset_counter(counter) -> None:
    """Set the counter back to 0 (by the finishing CTA: every other CTA has taken its ticket)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _reset(_ctx, counter_ref):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm
        from jax.experimental.mosaic.gpu import utils as mu

        zero = arith.constant(ir.IntegerType.get_signless(32), 0)
        with mu.single_thread(mu.ThreadSubset.WARPGROUP):
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [mu.memref_ptr(counter_ref), zero],
                            "st.relaxed.gpu.global.u32 [$0], $1;", "l,r", has_side_effects=True)

    _reset(counter)


def is_last_cta(axes) -> jax.Array:
    """Whether this CTA is the grid's last (`axes`: `(axis name, size)`, row-major): in GPU interpret
    mode, which runs the grid in that order, the one that runs after every other."""
    last = True
    for name, size in axes:
        last = last & (lax.axis_index(name) == size - 1)
    return last


def block_merge(op: str, acc, field, valid, layout):
    """`acc` merged with a block of tiles: `field(f)` loads field f `[block, slots]` (tiles along the
    rows), `valid` `[block, slots]` marks the rows that are tiles to merge. `acc` is `(sum,)`, or
    `(count, shifted mean, M2, shift)`: the block reduced two-pass over its tiles in the frame of
    `shift` (the merge's while it has elements, else the largest mean among the block's tiles of
    nonzero count: some tile's mean, so tiles of one mean merge to exactly it and M2 0),
    n = sum(n_t), d = sum(n_t (mean_t - s)) / n, M2 = sum(M2_t + n_t (mean_t - s - d)^2), then Chan's
    formula with the merge so far (`emit.expr.merge_partials_at`'s frame and order). A tile of count
    0 contributes nothing. Each field is loaded where it is first used, so few `[block, slots]`
    arrays are live at once (all three held at once spilled next to a conv's registers)."""
    rows = lambda v: layout(lax.broadcast_in_dim(v, valid.shape, (1,)))  # noqa: E731
    if op == "sum":
        return (acc[0] + jnp.sum(jnp.where(valid, field(0), 0.0), axis=0),)
    count, shifted, m2, shift = acc
    n_t = jnp.where(valid, field(0), 0.0)
    live = n_t > 0
    mean_t = field(1)
    block_shift = jnp.max(jnp.where(live, mean_t, -jnp.inf), axis=0)
    shift = jnp.where(count > 0, shift, jnp.where(block_shift == -jnp.inf, 0.0, block_shift))
    offset = jnp.where(live, mean_t - rows(shift), 0.0)
    n = jnp.sum(n_t, axis=0)
    d = jnp.sum(n_t * offset, axis=0) / jnp.maximum(n, 1.0)
    deviation = offset - rows(d)
    block_m2 = jnp.sum(jnp.where(live, field(2) + n_t * deviation * deviation, 0.0), axis=0)
    count, shifted, m2 = ex.chan_merge((count, shifted, m2), (n, d, block_m2))
    return count, shifted, m2, shift


def merge_start(op: str, zeros: jax.Array):
    return (zeros,) if op == "sum" else (zeros, zeros, zeros, zeros)


def merge_result(op: str, acc) -> tuple[jax.Array, ...]:
    if op == "sum":
        return acc
    _count, shifted, m2, shift = acc
    return shift + shifted, m2


def finish(op: str, slots: int, tiles: int, partials_gmem, finished_gmem, block_smem, out_smem, barrier,
           load, zeros, layout) -> None:
    """Merge `partials_gmem` `[tiles, fields, slots]` (every CTA's row written and visible) into
    `finished_gmem` `[rows · slots]` (`rows` 2 for `moments`: mean then M2; 1 for `sum`), by the one
    CTA that runs this: blocks of `BLOCK_TILES` tiles come by TMA into `block_smem` `[fields,
    BLOCK_TILES, slots]` (one copy per field) and merge in order (`block_merge`, `MERGE_COLUMNS`
    slots at a time; the last block ends at the last tile, its rows merged before masked off; fewer
    tiles than a block fill its first rows); `out_smem` `[rows, slots]` stages the result.
    `load(ref)` reads a `[BLOCK_TILES, columns]` field in the layout `layout` casts to; `zeros(n)` a
    `[n]` vector in its column layout."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    fields = ex.PARTIAL_FIELDS[op]
    size = min(BLOCK_TILES, tiles)
    width = min(MERGE_COLUMNS, slots)
    ranges = [pl.ds(c, min(width, slots - c)) for c in range(0, slots, width)]

    def block(start, first_row, acc):
        for f in range(fields):
            plgpu.copy_gmem_to_smem(partials_gmem.at[pl.ds(start, size), f], block_smem.at[f, pl.ds(0, size)], barrier)
        plgpu.barrier_wait(barrier)
        merged = []
        for columns, part in zip(ranges, acc):
            row = layout(lax.broadcasted_iota(jnp.int32, (BLOCK_TILES, columns.size), 0))
            field = lambda f, columns=columns: load(block_smem.at[f, :, columns])  # noqa: E731
            merged.append(block_merge(op, part, field, (row >= first_row) & (row < size), layout))
        return tuple(merged)

    whole = tiles // size
    acc = tuple(merge_start(op, zeros(columns.size)) for columns in ranges)
    step = lambda i, acc: block(i * BLOCK_TILES, 0, acc)  # noqa: E731
    acc = lax.fori_loop(0, whole, step, acc) if whole > 1 else step(0, acc)
    left = tiles - whole * size
    if left:  # the last block ends at the last tile; its first rows were merged already
        acc = block(tiles - size, size - left, acc)
    for columns, part in zip(ranges, acc):
        for r, value in enumerate(merge_result(op, part)):
            out_smem[r, columns] = value
    plgpu.commit_smem()
    for r in range(2 if op == "moments" else 1):
        plgpu.copy_smem_to_gmem(out_smem.at[r], finished_gmem.at[pl.ds(r * slots, slots)])
    plgpu.wait_smem_to_gmem(0)


# --- the vector tables of the Mosaic convs reading the statistic -----------------------------------


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """How the finishing CTA writes one reader's vector table `[images, rows, width]` float32
    (`emit.pallas.tables.TableRequest`): per row either `("statistic", runs)` with, per image, the
    runs `(chunk, first, end, flat index)` of channels gathering one entry of the finished statistic
    (`[rows · slots]` flat), or `("copy", source, starts, channels)`: `channels` consecutive values of
    operand `source` (flat) from `starts[image]`; zeros past a row's channels."""

    shape: tuple
    rows: tuple


def table_plan(request, statistic, sources: list) -> TablePlan | None:
    """The `TablePlan` of `request`'s table, whose statistic rows gather `statistic`; the other rows'
    tensors appended to `sources` (each once). None where a row is not one of those forms or a copy
    is not whole 16-byte TMA pieces."""
    import numpy as np

    from eqsat.types import parse_type

    images, _rows, _width = request.shape
    rows = []
    for tensor, index in request.rows:
        channels = index.shape[1]
        index = np.broadcast_to(index, (images, channels))
        if tensor is statistic:
            per_image = []
            for b in range(images):
                runs, c = [], 0
                while c < channels:
                    end = c + 1
                    while end < channels and index[b, end] == index[b, c] and end // CHUNK == c // CHUNK:
                        end += 1
                    runs.append((c // CHUNK, c % CHUNK, end - (c // CHUNK) * CHUNK, int(index[b, c])))
                    c = end
                per_image.append(tuple(runs))
            rows.append(("statistic", tuple(per_image)))
            continue
        if tensor.op == "EpilogueReduce":
            return None  # another statistic: finished elsewhere
        itemsize = np.dtype(parse_type(tensor.ty).dtype).itemsize
        starts = index[:, 0]
        if not (index == starts[:, None] + np.arange(channels)).all():
            return None
        if (starts * itemsize % 16).any() or channels * itemsize % 16:
            return None
        position = next((i for i, t in enumerate(sources) if t is tensor), None)
        if position is None:
            sources.append(tensor)
            position = len(sources) - 1
        rows.append(("copy", position, tuple(int(s) for s in starts), channels))
    return TablePlan(tuple(request.shape), tuple(rows))


CHUNK = 64  # table channels a vector holds
TMA_PIECE = 256  # elements of one 1-D TMA copy (a box side)


def write_tables(plans, finished_smem, source_gmems, table_gmems, table_smem, stage_smems, barrier, load_vector,
                 interpreted: bool) -> None:
    """Write each `TablePlan`'s table from the finished statistic in `finished_smem` `[rows, slots]`
    (committed) and the source operands (flat GMEM refs, brought whole to `stage_smems` by TMA):
    per image the table's rows assembled in `table_smem` `[rows, width↑64]`, stored by 1-D TMA
    copies. `load_vector(ref)` reads a `[CHUNK]` SMEM vector as float32 in a column layout."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    pieces = []
    for plan in plans:
        for row in plan.rows:
            if row[0] == "copy":
                _kind, source, starts, channels = row
                for b, start in enumerate(starts):
                    for p in range(0, channels, TMA_PIECE):
                        pieces.append((source, b, start + p, p, min(TMA_PIECE, channels - p)))
    staged, counts = {}, {}  # (source, row start) -> its row in the source's staging
    for source, b, start, p, n in pieces:
        if (source, start - p) not in staged:
            staged[(source, start - p)] = counts.get(source, 0)
            counts[source] = staged[(source, start - p)] + 1
        slot = staged[(source, start - p)]
        plgpu.copy_gmem_to_smem(source_gmems[source].at[pl.ds(start, n)], stage_smems[source].at[slot, pl.ds(p, n)],
                                barrier)
    if pieces:
        plgpu.barrier_wait(barrier)
    slots = finished_smem.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    if not interpreted:
        lane = plgpu.layout_cast(lane, plgpu.Layout.WGMMA.reduce(0))
    zeros = jnp.zeros((CHUNK,), jnp.float32) * lane.astype(jnp.float32)  # in the lanes' layout, not a splat
    for plan, table_gmem in zip(plans, table_gmems):
        images, _rows, width = plan.shape
        for b in range(images):
            for r, row in enumerate(plan.rows):
                for j in range(-(-width // CHUNK)):
                    if row[0] == "statistic":
                        vector = zeros
                        for chunk, first, end, flat in row[1][b]:
                            if chunk == j:
                                value = finished_smem[flat // slots, flat % slots]
                                vector = jnp.where((lane >= first) & (lane < end), value, vector)
                    else:
                        _kind, source, starts, channels = row
                        if j * CHUNK >= channels:
                            vector = zeros
                        else:
                            slot = staged[(source, starts[b])]
                            vector = load_vector(stage_smems[source].at[slot, pl.ds(j * CHUNK, CHUNK)])
                            vector = jnp.where(lane < channels - j * CHUNK, vector, 0.0)
                    table_smem[r, pl.ds(j * CHUNK, CHUNK)] = vector
            plgpu.commit_smem()
            for r in range(len(plan.rows)):
                for j in range(-(-width // CHUNK)):
                    n = min(CHUNK, width - j * CHUNK)
                    plgpu.copy_smem_to_gmem(table_smem.at[r, pl.ds(j * CHUNK, n)], table_gmem.at[b, r, pl.ds(j * CHUNK, n)])
            plgpu.wait_smem_to_gmem(0)  # the staging is reused by the next image


def copy_pieces(plans) -> int:
    """The 1-D TMA copies `write_tables` issues to stage the plans' source rows."""
    return sum(-(-row[3] // TMA_PIECE) * len(row[2]) for plan in plans for row in plan.rows if row[0] == "copy")


def stage_shapes(plans, dtypes) -> list[tuple[int, int]]:
    """Per source operand, its staging `[rows staged, channels↑64]` in SMEM (`write_tables`)."""
    shapes = []
    for source in range(len(dtypes)):
        starts, width = set(), CHUNK
        for plan in plans:
            for row in plan.rows:
                if row[0] == "copy" and row[1] == source:
                    starts.update(row[2])
                    width = max(width, -(-row[3] // CHUNK) * CHUNK)
        shapes.append((max(1, len(starts)), width))
    return shapes
