"""How the Mosaic GPU templates (`emit/mosaic/`) tile their work: pure arithmetic on shapes, read by
the templates and by the cost model (`eqsat.cost.mosaic`) alike.

    MosaicBlocks, matmul_smem_bytes, fit_smem        the matmul's CTA tile and pipeline (emit.mosaic.matmul)
    reads_in_place, matmul_blocks                    whether it reads and writes unpadded arrays; its tiles
    FlatGrid, RangeTaps, plan_taps, default_blocks   the conv's flat padded grid and steps (emit.mosaic.conv)
    upsample_source, phase_geometry, PHASE_OFFSET,   a conv over a nearest-2x upsample as 4 phases of one
    phase_blocks
                                                     over its source (emit.mosaic.conv_halo)
    HaloGrid, halo_parts, halo_uncovered,            the haloed conv's grid, its K ranges (cut per tensor:
    halo_input_loads, halo_blocks, halo_smem_bytes,  `eqsat.tiling.channel_parts`), what it takes, its tiles
    strip_counts, halo_tiling                        and SMEM, its strips of wide rows (emit.mosaic.conv_halo)
    PixelView, pixel_view, row_pieces, stores_pixels, its output stored (and a residual read) per pixel row
    segment_geometry, segment_lengths                segment by static-size TMA copies (no flat output)
    AttentionBlocks, padded_head, key_quantum,       the attention's tiles and SMEM (emit.mosaic.attention)
    swizzle_for, attention_smem_bytes, fit_ring

Itemsizes are plain byte counts here; the templates pass their dtypes' (`jnp.dtype(d).itemsize`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from eqsat.tiling.channel_parts import NotRestrictable, channel_parts
from eqsat.tiling.conv import ConvGeometry
from eqsat.types import ints, parse_type

# An H100 CTA's dynamic shared memory (Mosaic's limit, 232,448 bytes), less room for barriers.
SMEM_BYTES = 232448 - 1024
MMA_DTYPES = ("float16", "bfloat16")  # what the templates' wgmma multiplies (two of one of these)
# Epilogue ops the templates map onto the output tile (views and elementwise ops; the matmul's and
# the conv's also read operand tiles): an epilogue with any other goes to the Triton template.
EPILOGUE_OPS = frozenset({"Acc", "Load", "Lit", "Unary", "Binary", "Select", "Reshape", "Transpose", "Broadcast",
                          "Slice"})
ATTENTION_EPILOGUE_OPS = frozenset({"Acc", "Lit", "Unary", "Binary", "Select"})


# --- matmul -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Tiles and pipeline depth of one Mosaic matmul kernel.

    `tile_m` rows and `tile_n` columns per compute warpgroup (`compute_wgs` of them side by side
    along N), `tile_k` per pipeline step (64 halves = one 128-byte swizzle row), `stages` SMEM
    buffers in flight, `epi_m x epi_n` epilogue sub-tiles."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    compute_wgs: int = 2
    epi_m: int = 64
    epi_n: int = 64

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * self.compute_wgs

    @classmethod
    def get_default(cls, m: int, n: int, k: int) -> "MosaicBlocks":
        """The CTA tile (`tile_m` 64 or 128; `compute_wgs` x `tile_n` of 64 or 128 columns) that pads
        M and N least, the larger tile among equals: 4096 x 1280 gets 128 x 256 (two 128 x 128
        warpgroups), N = 320 one 128 x 64 warpgroup (320 = 5 x 64: no padded column), 154 rows
        64-row tiles (192 rows, not 256)."""
        def padded(size, tile):
            return -(-size // tile) * tile

        tile_m = min((128, 64), key=lambda t: (padded(m, t), -t))
        tile_n, compute_wgs = min(((128, 2), (64, 2), (128, 1), (64, 1)),
                                  key=lambda c: (padded(n, c[0] * c[1]), -c[0] * c[1]))
        k_steps = -(-k // 64)
        return cls(tile_m, tile_n, 64, stages=max(2, min(4, k_steps)), compute_wgs=compute_wgs)

    def validate(self) -> None:
        if self.tile_m % 64 or self.tile_k not in (32, 64) or self.tile_n % self.tile_k or self.tile_n > 256:
            raise ValueError(f"tiles {self.tile_m}x{self.tile_n}x{self.tile_k}: tile_m must be multiples of 64 "
                             "(wgmma rows per warpgroup), tile_k 64 or 32 (one 128- or 64-byte swizzle row of "
                             "halves) and tile_n a multiple of tile_k up to 256 (B's minor SMEM tile, wgmma's N)")
        if self.tile_m % self.epi_m or self.tile_n % self.epi_n:
            raise ValueError(f"epilogue tile {self.epi_m}x{self.epi_n} must divide {self.tile_m}x{self.tile_n}")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: the pipeline releases buffers one step late, it needs >= 2")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")


def matmul_smem_bytes(blocks: MosaicBlocks, itemsize: int, out_itemsize: int,
                      operands: Sequence[tuple[str, int]] = (),
                      prologue: Sequence[tuple[str, int]] | None = None) -> int:
    """Shared memory of one CTA: the ring of `stages` A `[tile_m, tile_k]` and B `[tile_k, cta_tile_n]`
    tiles, two output sub-tiles per compute warpgroup, and per warpgroup one sub-tile (`tile`) or
    vector (`row`, `col`) of each epilogue operand `(kind, itemsize)`. With an A `prologue` (its
    sources' `(kind, itemsize)`), the ring holds the sources' blocks in place of A's, and A has a
    2-slot stage of its own; a row pass (`pass_tile`, `pass_col` reads) two slots of its blocks."""
    wgs, em, en = blocks.compute_wgs, blocks.epi_m, blocks.epi_n
    ring = blocks.stages * (blocks.tile_m * blocks.tile_k + blocks.tile_k * blocks.cta_tile_n) * itemsize
    if prologue is not None:  # the ring holds the prologue's source blocks instead of A; A's two stage slots
        tm, tk = blocks.tile_m, blocks.tile_k
        sources = sum(size * {"tile": tm * tk, "col": tk, "row": tm}.get(kind, 0) for kind, size in prologue)
        ring = blocks.stages * (sources + tk * blocks.cta_tile_n * itemsize) + 2 * tm * tk * itemsize
        # the row pass's two slots of its blocks (`emit.mosaic.row_statistics`; its statistics: registers)
        ring += 2 * sum(size * {"pass_tile": tm * tk, "pass_col": tk}.get(kind, 0) for kind, size in prologue)
    epilogue = wgs * 2 * em * en * out_itemsize
    for kind, size in operands:
        epilogue += wgs * size * {"tile": em * en, "row": em, "col": en}[kind]
    return ring + epilogue


def fit_smem(blocks: MosaicBlocks, itemsize: int, out_itemsize: int,
             operands: Sequence[tuple[str, int]] = (),
             prologue: Sequence[tuple[str, int]] | None = None) -> MosaicBlocks:
    """`blocks` with as many pipeline stages (down to 2) as fit `SMEM_BYTES` beside the epilogue's
    buffers: a 128 x 256 tile with a residual read in the epilogue keeps 3 of its 4 (4 need 246,880
    bytes, over the 232,448 Mosaic allows)."""
    while blocks.stages > 2 and matmul_smem_bytes(blocks, itemsize, out_itemsize, operands, prologue) > SMEM_BYTES:
        blocks = dataclasses.replace(blocks, stages=blocks.stages - 1)
    return blocks


ROW_TILE = 8  # rows of the SMEM tiles a TMA copy fills (wgmma's 8 x 128-byte core matrices)
SWIZZLE_BYTES = 128  # the widest swizzle: a minor tile dimension spans at most 128 bytes


def minor_tile(width: int, itemsize: int) -> int:
    """Elements along the minor axis of the SMEM tiles of a `width`-element tile row: the TMA
    copy's tiling (8, swizzle / itemsize), the swizzle the widest of 128, 64, 32 bytes the row
    holds (`plgpu.find_swizzle`)."""
    swizzle = next(s for s in (128, 64, 32, 16) if (width * itemsize) % s == 0)
    return swizzle // itemsize


def fits_tiles(rows: int, cols: int, minor: int) -> bool:
    """Whether Mosaic GPU 0.10.2 TMA-copies tiles of a `[rows, cols]` array as it lies: it tiles the
    global array itself (`launch_context.TileTransform.transform_gmem_shape`), so a dimension larger
    than its tile must be a multiple of it ("When no rounding mode is specified, dimension 1 must
    have size smaller or a multiple of its tiling 8, but got 77"), and every stride but the last
    must be a multiple of 16 bytes (`cols` a multiple of 8 for 16-bit elements)."""
    return (rows % ROW_TILE == 0 or rows < ROW_TILE) and (cols % minor == 0 or cols < minor) and cols % 8 == 0


@dataclasses.dataclass(frozen=True)
class InPlace:
    """Which arrays the matmul template uses as they lie (no padded copy before the kernel, no slice
    after it): A `[batch, M, K]`, B `[batch, K, N]`, the output `[batch, M, N]` and a residual read
    in the epilogue. A box past the end of an array is read as zeros by TMA (the K tail adds
    nothing; rows and columns past M and N are computed and never stored). The output is written
    in place only with tiles that stay inside it: the last M and N tiles start early, so they end
    at the array's edge (recomputing some of their neighbour's rows or columns, the same values,
    written twice); GPU interpret mode drops a partially out-of-bounds store whole
    (`Buffer.__setitem__` raises, `store_buffer_content` ignores it) where TMA clips it, so M and N
    must hold one tile. An output written padded keeps the tiles on the grid, and then a residual
    that fits the tiles is read past its end (zeros, on rows and columns dropped)."""

    a: bool
    b: bool
    out: bool
    residual: bool

    @property
    def all(self) -> bool:
        return self.a and self.b and self.out


def vector_fits(length: int, itemsize: int) -> bool:
    """Whether a `[batch', length]` row or column vector of the epilogue is TMA-copied as it lies:
    its batch stride a multiple of 16 bytes (a bias of 96 halves is, a per-token float32 scale of
    77 rows is not: "async_copy requires all GMEM strides except the last one to be a multiple of
    16 bytes"), else it is padded to the tiles."""
    return (length * itemsize) % 16 == 0


def tile_fits(m: int, n: int, blocks: "MosaicBlocks", itemsize: int) -> bool:
    """Whether an `[M, N]` array of `itemsize`-byte elements read (or written) in `epi_m x epi_n`
    epilogue tiles can be TMA-copied as it lies (`fits_tiles`)."""
    return m % ROW_TILE == 0 and fits_tiles(m, n, minor_tile(blocks.epi_n, itemsize))


def matmul_in_place(m: int, n: int, k: int, blocks: "MosaicBlocks", out_itemsize: int = 2,
                    residual_itemsize: int = 2) -> InPlace:
    """`InPlace` of an `m x k @ k x n` matmul (16-bit operands) at `blocks`."""
    q = blocks.tile_k  # the operands' minor tile (`validate`: tile_k is one swizzle row)
    k_fits = k % q == 0 or k < q
    return InPlace(
        a=m % ROW_TILE == 0 and k_fits and fits_tiles(m, k, q),
        b=k_fits and fits_tiles(k, n, q),
        out=m >= blocks.tile_m and n >= blocks.cta_tile_n and tile_fits(m, n, blocks, out_itemsize),
        residual=tile_fits(m, n, blocks, residual_itemsize),
    )


def reads_in_place(m: int, n: int, k: int, blocks: "MosaicBlocks") -> bool:
    """Whether A, B and the output are all used as they lie (`matmul_in_place`)."""
    return matmul_in_place(m, n, k, blocks).all


def prologue_blocks(blocks: MosaicBlocks) -> MosaicBlocks:
    """`blocks` for a matmul whose A prologue runs in the kernel: one compute warpgroup (it computes
    each A tile once into SMEM; two would each compute it for their own columns)."""
    return dataclasses.replace(blocks, compute_wgs=1)


def matmul_blocks(m: int, n: int, k: int) -> MosaicBlocks:
    """The matmul template's tiles for `m x k @ k x n`: `MosaicBlocks.get_default`, or where that
    cannot use the operands in place (`matmul_in_place`) and other tiles can, the widest such: a
    64-row tile for 64-127 rows, one 64-column warpgroup for N = 64, and for N a multiple of 32 but
    not of 64 (96, 160) or below 64, 32-element K steps (a 64-byte swizzle: every operand's minor
    tile 32 elements) with warpgroups of N up to 128 columns (96: one, 32: one of 32)."""
    blocks = MosaicBlocks.get_default(max(m, 1), max(n, 1), max(k, 1))

    def score(candidate):
        place = matmul_in_place(m, n, k, candidate)
        return place.out + place.a + place.b + place.residual

    best = blocks
    for tile_k in (64, 32):
        widths = [(w, g) for g in (2, 1) for w in (128, 96, 64, 32) if w % tile_k == 0]
        for tile_m in (blocks.tile_m, 64):
            for tile_n, wgs in [(blocks.tile_n, blocks.compute_wgs)] + sorted(widths, key=lambda c: -c[0] * c[1]):
                candidate = dataclasses.replace(blocks, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, compute_wgs=wgs,
                                                epi_n=64 if tile_n % 64 == 0 else 32)
                if score(candidate) > score(best):
                    best = candidate
    return best


# --- conv ---------------------------------------------------------------------------------------

CHUNK = 64  # input channels per pipeline step: one 128-byte swizzle row of halves


def tap_list(taps) -> list[tuple[int, int]]:
    """The (ky, kx) taps of `taps` = ((y0, y1), (x0, x1)), row by row."""
    (y0, y1), (x0, x1) = taps
    return [(ky, kx) for ky in range(y0, y1) for kx in range(x0, x1)]


@dataclasses.dataclass(frozen=True)
class RangeTaps:
    """One K range as pipeline steps: `channels` input channels (their `chunks` of 64 side by side
    in each of the input's stride phases, from column block `column_block`), the window taps
    `((ky0, ky1), (kx0, kx1))` it runs, `first_step` its first pipeline step."""

    channels: int
    taps: tuple[tuple[int, int], tuple[int, int]]
    column_block: int
    first_step: int
    shifts: tuple[int, int] = (0, 1)  # the column shifts [j0, j1) its taps read (`FlatGrid.tap_shift`)

    @property
    def chunks(self) -> int:
        return -(-self.channels // CHUNK)

    @property
    def tap_list(self) -> list[tuple[int, int]]:
        return tap_list(self.taps)

    @property
    def steps(self) -> int:
        return len(self.tap_list) * self.chunks

    def column_blocks(self, phases: int) -> int:
        return (self.shifts[1] - self.shifts[0]) * phases * self.chunks


@dataclasses.dataclass(frozen=True)
class FlatGrid:
    """The flat padded grid of one conv (`emit.mosaic.conv`): phase images `Hi x Wq`,
    `phases = sy * sx`, the output `Ho x Wo` in its top-left corner."""

    geometry: ConvGeometry

    @property
    def strides(self) -> tuple[int, int]:
        return tuple(self.geometry.params.strides)

    @property
    def phase_size(self) -> tuple[int, int]:
        """(rows, row pitch) of a phase image: the pitch rounded up to 8 pixels, so a row shift is
        a whole number of the SMEM tiles (8 rows) a TMA copy fills."""
        (pad_y, pad_y1), (pad_x, pad_x1) = self.geometry.params.padding
        (h, w), (sy, sx) = self.geometry.in_size, self.strides
        width = -(-(w + pad_x + pad_x1) // sx)
        return -(-(h + pad_y + pad_y1) // sy), -(-width // 8) * 8

    @property
    def phases(self) -> int:
        return self.strides[0] * self.strides[1]

    @property
    def rows(self) -> int:
        hi, wq = self.phase_size
        return self.geometry.batch * hi * wq

    def tap_shift(self, ky: int, kx: int) -> tuple[int, int, int]:
        """(phase, column shift j, row offset on the flat grid: a multiple of 8) of tap (ky, kx): it
        reads the phase's copy shifted by j pixels at that row offset."""
        (dy, dx), (sy, sx) = self.geometry.params.rhs_dilation, self.strides
        ry, rx = ky * dy, kx * dx
        return (ry % sy) * sx + rx % sx, rx // sx, (ry // sy) * self.phase_size[1]

    @property
    def halo(self) -> int:
        (kh, kw) = self.geometry.window
        return max(self.tap_shift(ky, kx)[2] for ky in range(kh) for kx in range(kw))


def plan_taps(grid: FlatGrid, ranges: Sequence[tuple[int, tuple]]) -> list[RangeTaps]:
    """The pipeline steps of K ranges `(channels, taps)`: each range's taps × its channel chunks, and
    the column shifts its taps read."""
    out, step, block = [], 0, 0
    for channels, taps in ranges:
        (y0, y1), (x0, x1) = taps
        shifts = [grid.tap_shift(ky, kx)[1] for ky in range(y0, y1) for kx in range(x0, x1)]
        r = RangeTaps(channels, taps, block, step, (min(shifts), max(shifts) + 1))
        out.append(r)
        step += r.steps
        block += r.column_blocks(grid.phases)
    return out


def default_blocks(grid: FlatGrid, out_features: int, steps: int) -> MosaicBlocks:
    """The matmul template's default tiles for the flat grid (M = its rows, K = the steps), with
    128-row tiles from 2048 rows on (the grid's rows are many; a 64-row tile halves the MMA work per
    B tile loaded to save < 3 % of padded rows)."""
    blocks = MosaicBlocks.get_default(grid.rows, out_features, steps * CHUNK)
    return dataclasses.replace(blocks, tile_m=128) if grid.rows >= 2048 else blocks


MAX_BOX = 256  # a TMA box side: a staged row is copied in pieces of at most this many pixels


@dataclasses.dataclass(frozen=True)
class HaloGrid:
    """The haloed conv template's grid (`emit.mosaic.conv_halo`): per image, the input zero-padded by
    the conv's padding as a flat `[Hp * Wp, C]` grid of pitch `Wp = px0 + W + px1` (no rounding: A
    tiles are loaded from SMEM into registers at any row); output pixel `(oy, ox)` is flat row
    `q = oy * Wp + ox` (columns `ox >= Wo` computed and dropped) and tap `(ky, kx)` reads padded row
    `q + ky * Wp + kx`. A CTA owns `tile_m` flat rows `[q0, q0 + tile_m)` of one image and stages the
    padded rows `[q0 // Wp, q0 // Wp + staged_rows)` of the input in SMEM: `staged_rows` is the
    most any CTA needs for its rows and the halo.

    Rows too wide to stage (the VAE's 256 and 512 pixels) are cut into `strips` column strips of
    `strip_width` output columns each: strip s is a grid of its own, pitch `strip_width + kw - 1`,
    over the padded columns `[s · strip_width, + pitch)` (its halo columns are its neighbours'
    pixels, zero padding only at the image's edges), `m_tiles` CTAs of rows each; the flat output
    holds the strips one after the other (`m_padded` rows per image).

    Stride 2: the staged rows are the padded input's (pitch `Wp` rounded up to even), in two row
    phases (padded rows `2j` and `2j + 1`, `phase_rows` SMEM rows apart); output pixel `(oy, ox)` is
    flat row `q = oy · Wp/2 + ox` (`out_pitch`), and tap `(ky, kx)` reads the staged row
    `(ky % 2) · phase_rows + (2 · oy + ky // 2 · 2 - 2 · oy0) / 2 · Wp + 2 · ox + kx`: `tile_m` rows
    at a stride of 2 from an offset whose parity is kx's."""

    geometry: ConvGeometry
    tile_m: int
    strips: int = 1

    @property
    def stride(self) -> int:
        """1, or 2 along both axes (`halo_conv_uncovered`)."""
        return self.geometry.params.strides[0]

    @property
    def strip_width(self) -> int:
        return self.geometry.out_size[1] // self.strips

    @property
    def pitch(self) -> int:
        """Staged pixels per padded input row."""
        if self.strips == 1:
            (px0, px1) = self.geometry.params.padding[1]
            wp = px0 + self.geometry.in_size[1] + px1
            return wp + wp % self.stride
        return self.strip_width + self.geometry.window[1] - 1

    @property
    def out_pitch(self) -> int:
        """Flat rows per output row."""
        return self.pitch // self.stride

    @property
    def out_rows(self) -> int:
        """Flat rows per image and strip that hold outputs (`Ho` rows of the pitch)."""
        return self.geometry.out_size[0] * self.out_pitch

    @property
    def m_tiles(self) -> int:
        """CTAs along the rows of one strip."""
        return -(-self.out_rows // self.tile_m)

    @property
    def m_padded(self) -> int:
        """Flat output rows per image: every strip's `m_tiles` tiles."""
        return self.strips * self.m_tiles * self.tile_m

    @property
    def halo(self) -> int:
        kh, kw = self.geometry.window
        return (kh - 1) * self.pitch + (kw - 1)

    @property
    def staged_rows(self) -> int:
        """Padded rows a CTA stages (per row phase at stride 2: its output rows and those below)."""
        wp = self.pitch
        if self.stride == 1:
            return max(-(-(m * self.tile_m % wp + self.tile_m + self.halo) // wp) for m in range(self.m_tiles))
        wo, kh = self.out_pitch, self.geometry.window[0]
        return max((m * self.tile_m % wo + self.tile_m - 1) // wo + 1 + (kh - 1) // 2 for m in range(self.m_tiles))

    @property
    def row_copies(self) -> int:
        """TMA copies of one staged chunk: one per staged row (and row phase)."""
        return self.staged_rows * self.stride

    @property
    def phase_rows(self) -> int:
        """SMEM rows between the row phases of the staging (stride 2)."""
        return self.staged_rows * self.pitch

    @property
    def staging(self) -> int:
        """SMEM rows of one staged chunk: the staged padded rows, rounded up to 64 (prologue slabs);
        at stride 2 both row phases, and as far as a tap's strided rows reach."""
        if self.stride == 1:
            return -(-self.staged_rows * self.pitch // 64) * 64
        kh, kw = self.geometry.window
        reach = max(((kh > 1) * self.phase_rows + 2 * (m * self.tile_m % self.out_pitch)
                     + (kh - 1) // 2 * self.pitch + kw - 1) // 2 * 2 + 2 * self.tile_m for m in range(self.m_tiles))
        return -(-max(2 * self.phase_rows, reach) // 64) * 64

    def strip_columns(self, strip: int) -> tuple[int, int, int]:
        """`(first input column, columns, SMEM column)` of the input a staged row of `strip` copies:
        the strip's padded columns that lie in the image."""
        (px0, _px1), width = self.geometry.params.padding[1], self.geometry.in_size[1]
        if self.strips == 1:
            return 0, width, px0
        first = strip * self.strip_width - px0
        start, stop = max(first, 0), min(first + self.pitch, width)
        return start, stop - start, start - first

    @property
    def copied_columns(self) -> int:
        """Input columns one staged row copies, summed over the strips (the image's width, plus the
        halo columns two strips both copy)."""
        return sum(self.strip_columns(s)[1] for s in range(self.strips))


@dataclasses.dataclass(frozen=True)
class PixelView:
    """The haloed conv's output (and a residual read at its index) as the kernel addresses it by TMA:
    `[batch · rows, py, width, px · channels]` (a view of the NHWC array): output row `oy` of image
    b is `b · rows + oy`; the phase form's phase `(py, px)` (pixel `(2i + py, 2j + px)`) is an index
    of the second axis and a `channels` block of the last (py = px = 2; 1 otherwise). A grid whose
    flat rows are whole pixel rows (pitch = width, one strip, no phases) is one row per image of
    `Ho · Wo` pixels, so a sub-tile's rows are one segment."""

    rows: int
    py: int
    width: int
    px: int
    channels: int

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch * self.rows, self.py, self.width, self.px * self.channels)


def pixel_view(grid: HaloGrid, channels: int, phases: bool = False) -> PixelView:
    """The output's `PixelView` on `grid` (`channels` per phase in the phase form)."""
    (ho, wo) = grid.geometry.out_size
    if not phases and grid.strips == 1 and grid.out_pitch == wo:
        return PixelView(1, 1, ho * wo, 1, channels)
    return PixelView(ho, 2 if phases else 1, wo, 2 if phases else 1, channels)


def stores_pixels(conv: ConvGeometry, n_padded: int, tile_n: int, phases: bool) -> bool:
    """Whether the haloed kernel stores the conv's output itself (in its `PixelView`): an NHWC output
    whose channels the N tiles divide (the phase form's always do). Otherwise it writes flat rows
    and `emit.mosaic.conv_halo.unflatten` slices them (one XLA fusion)."""
    return (tuple(conv.params.out_spec) == (0, 3, 1, 2) and (phases or n_padded == conv.out_features)
            and conv.out_features % tile_n == 0)


def segment_geometry(grid: HaloGrid, view: PixelView) -> tuple[int, int, int]:
    """`(pitch, width, rows)` of the flat rows as pixel segments: flat row `q` of a strip is pixel
    `q % pitch` of view row `q // pitch`, a pixel where that is below `width` and the row below `rows`."""
    if view.rows == 1 and view.py == 1:
        return view.width, view.width, 1
    return grid.out_pitch, grid.strip_width, view.rows


@dataclasses.dataclass(frozen=True)
class RowPieces:
    """How the `r`-th view row an `epi_m`-row window of flat rows touches is copied: `sizes` rows per
    TMA copy (static box sizes), each copy `conditional` on its bit of the segment's length (which
    varies with where the window starts: any length is a sum of distinct powers of two), or one
    copy of the length every window has."""

    sizes: tuple[int, ...]
    conditional: bool


def segment_lengths(grid: HaloGrid, view: PixelView, epi_m: int) -> list[list[int]]:
    """Per window (every CTA's `epi_m`-row sub-tiles, one strip: the strips are alike) the pixels of
    each view row it touches, in order."""
    pitch, width, rows = segment_geometry(grid, view)
    out = []
    for start in (m * grid.tile_m + e * epi_m for m in range(grid.m_tiles) for e in range(grid.tile_m // epi_m)):
        lengths = []
        for oy in range(start // pitch, (start + epi_m - 1) // pitch + 1):
            first, stop = max(start, oy * pitch), min(start + epi_m, oy * pitch + width)
            lengths.append(max(stop - first, 0) if oy < rows else 0)
        out.append(lengths)
    return out


def row_pieces(grid: HaloGrid, view: PixelView, epi_m: int) -> tuple[RowPieces, ...]:
    """The TMA copies (`RowPieces`) of each view row an `epi_m`-row window touches (the most any
    window touches): one copy where every window's segment there has the same length, else one per
    bit of the longest (1, 2, 4, ... rows), taken where the segment's length has it."""
    lengths = segment_lengths(grid, view, epi_m)
    out = []
    for r in range(max(len(row) for row in lengths)):
        at = {row[r] if r < len(row) else 0 for row in lengths}
        if len(at) == 1:
            (length,) = at
            out.append(RowPieces((length,) if length else (), False))
        else:
            top = max(at).bit_length()
            out.append(RowPieces(tuple(1 << k for k in reversed(range(top))), True))
    while out and not out[-1].sizes:
        out.pop()
    return tuple(out)


def strip_counts(geometry: ConvGeometry) -> list[int]:
    """The strip counts the haloed template may cut a conv's rows into (`HaloGrid.strips`), fewest
    first: 1 where a row is one TMA box, then each count that divides the output row into strips
    whose staged rows (`strip_width + kw - 1` pixels) are one TMA box (stride 1 only)."""
    wo, kw = geometry.out_size[1], geometry.window[1]
    out = [1] if geometry.in_size[1] <= MAX_BOX else []
    if tuple(geometry.params.strides) != (1, 1):  # strips of a strided conv: not done
        return out
    return out + [s for s in range(2, wo + 1) if wo % s == 0 and wo // s + kw - 1 <= MAX_BOX and wo // s >= 8]


def halo_conv_uncovered(geometry: ConvGeometry, itemsize: int, part_channels: Sequence[int] | None = None) -> str | None:
    """Why the haloed template does not take this conv (None when it does): it reads the input by
    per-row TMA copies of `[W, 64]` channel chunks, so it needs strides of 1 or 2 (both axes alike),
    unit dilations, at most a 3x3 window, each K range's channels (`part_channels`, default all the
    input's) a multiple of 64 of a 16-bit dtype, and rows of at most 256 pixels (a TMA box side) or
    strips of them (`strip_counts`; stride 1 only)."""
    p = geometry.params
    if tuple(p.strides) not in ((1, 1), (2, 2)) or tuple(p.rhs_dilation) != (1, 1):
        return f"strides {tuple(p.strides)}, dilation {tuple(p.rhs_dilation)}"
    if any(k > 3 for k in geometry.window):
        return f"a {geometry.window} window"
    for channels in part_channels if part_channels is not None else [geometry.in_features]:
        if channels % CHUNK or itemsize != 2:
            return f"{channels} input channels of {itemsize} bytes (TMA reads 64-channel chunks of halves)"
    if not strip_counts(geometry):
        return f"rows of {geometry.in_size[1]} pixels in no strips of at most {MAX_BOX} (a TMA box side)"
    return None


NHWC = (0, 3, 1, 2)
# What the haloed conv's input expression may hold: loads, literals, elementwise ops and views.
PROLOGUE_OPS = frozenset({"Load", "Lit", "Unary", "Binary", "Select", "Reshape", "Transpose", "Broadcast", "Slice"})


def _loads_by_parent(expr):
    """The expression's nodes (each once) and its loads once per distinct parent: a tensor read
    through two views (a statistic's mean and variance, two slices of one load) is two reads, as
    the expression compiler evaluates it at two indices."""
    nodes, loads, seen, stack = [], [], set(), [(expr, None)]
    while stack:
        node, parent = stack.pop()
        if node.op == "Load" and (id(node), id(parent)) not in seen:
            seen.add((id(node), id(parent)))
            loads.append(node)
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        if node.op != "Load":  # a Load's tensor is another kernel's, not part of the expression
            stack.extend((a, node) for a in node.args if hasattr(a, "op"))
    return nodes, loads


def halo_input_loads(expr, lhs_ty: str) -> tuple[list, list] | None:
    """The input expression's loads as the haloed conv reads them: `(input loads, vector loads)`,
    the first those of a tensor staged by TMA: of the expression's dtype and at least its size (the
    input itself, a `[B, H·W, C]` matmul output viewed as NHWC, a tensor some of whose channels a K
    range reads: `channel_parts.restrict`); the others the per-channel vectors (one per distinct read:
    `_loads_by_parent`); None when it holds an op the kernel does not evaluate, reads no such tensor
    or two (a residual added before the norm: the kernel stages one tensor per K range, "an input
    expression that reads two tensors at its own index"). (The template checks the index of each
    load itself: `emit.mosaic.conv_halo.prologue_loads`.)"""
    nodes, loads = _loads_by_parent(expr)
    if any(node.op not in PROLOGUE_OPS for node in nodes):
        return None
    lhs_shape, lhs_dtype = parse_type(lhs_ty).shape, parse_type(lhs_ty).dtype
    size = math.prod(lhs_shape)
    is_input = [parse_type(n.args[0].ty).dtype == lhs_dtype and math.prod(parse_type(n.args[0].ty).shape) >= size
                for n in loads]
    if not any(is_input) or len({id(n.args[0]) for n, i in zip(loads, is_input) if i}) > 1:
        return None
    return ([n for n, i in zip(loads, is_input) if i], [n for n, i in zip(loads, is_input) if not i])


def halo_parts(ranges: Sequence[tuple]) -> list[tuple] | str:
    """The haloed conv's K ranges: each of the conv's `(input expression, first channel, channels,
    taps)` cut where a concat inside its expression switches tensors (`channel_parts`; a GroupNorm +
    SiLU over `concat(h, skip)`: h's channels and skip's), as `(expression of the part's channels,
    the conv range's index, the part's first channel in that range, channels, taps)`; or why not."""
    out = []
    for index, (expr, offset, channels, taps) in enumerate(ranges):
        try:
            pieces = channel_parts(expr, 3, offset, offset + channels)
        except NotRestrictable as error:
            return f"an input expression it cannot cut per tensor: {error}"
        out += [(piece, index, start - offset, stop - start, taps) for piece, start, stop in pieces]
    return out


def halo_uncovered(geometry: ConvGeometry, ranges: Sequence[tuple[int, tuple]], itemsize: int,
                   exprs: Sequence | None = None) -> str | None:
    """Why the haloed template does not take a conv (None when it does): `halo_conv_uncovered` on
    its K ranges `(channels, taps)` (each its own staged input: `halo_parts`), an input other than
    NHWC, a range's taps outside the window, and, when the ranges' input expressions `exprs` are
    known, one `halo_input_loads` refuses."""
    reason = halo_conv_uncovered(geometry, itemsize, [channels for channels, _taps in ranges])
    if reason is not None:
        return reason
    if tuple(geometry.params.lhs_spec) != NHWC:
        return f"an input of layout {geometry.params.lhs_spec} (the template stages NHWC rows)"
    kh, kw = geometry.window
    for _channels, ((y0, y1), (x0, x1)) in ranges:
        if not (0 <= y0 < y1 <= kh and 0 <= x0 < x1 <= kw):
            return f"K ranges {list(ranges)}"
    for expr in exprs or ():
        if halo_input_loads(expr, expr.ty) is None:
            return "an input expression the kernel does not evaluate"
    return None


def upsample_source(expr, geometry: ConvGeometry):
    """`X` when the conv's input expression `expr` is `X` upsampled nearest-2x (`Reshape(Broadcast(X,
    [B, h, 2, w, 2, C]), [B, 2h, 2w, C])`) and the conv a 3x3 of stride 1 and padding 1 over NHWC:
    then `phase_geometry` runs it over `X` itself; None otherwise."""
    p = geometry.params
    if (tuple(p.lhs_spec) != NHWC or tuple(p.strides) != (1, 1) or tuple(p.rhs_dilation) != (1, 1)
            or tuple(geometry.window) != (3, 3) or tuple(map(tuple, p.padding)) != ((1, 1), (1, 1))):
        return None
    if expr.op != "Reshape" or expr.args[0].op != "Broadcast":
        return None
    broadcast = expr.args[0]
    source = broadcast.args[0]
    b, h2, w2, c = parse_type(expr.ty).shape
    if h2 % 2 or w2 % 2 or ints(broadcast.args[1]) != (0, 1, 3, 5):
        return None
    if (parse_type(broadcast.ty).shape != (b, h2 // 2, 2, w2 // 2, 2, c)
            or parse_type(source.ty).shape != (b, h2 // 2, w2 // 2, c)):
        return None
    return source


# The source offset (-1, 0, +1 -> index 0, 1, 2) a 3x3 tap k reads for output phase p of a nearest-2x
# upsampled input: padded row 2i + p + k - 1 of the upsampled image is source row i + (p + k - 1) // 2.
PHASE_OFFSET = {(p, k): (p + k - 1) // 2 + 1 for p in (0, 1) for k in range(3)}


def phase_geometry(geometry: ConvGeometry) -> ConvGeometry:
    """A 3x3 conv over a nearest-2x upsampled `[B, 2h, 2w, C]` input (`upsample_source`) as a conv over
    the `[B, h, w, C]` source: the same window and padding, output features `4 · Cout`, one block per
    output phase `(py, px)` (phase-major), whose CTAs run a 2x2 window of weights that sum the taps
    reading one source pixel (`PHASE_OFFSET`): 4/9 of the upsampled conv's wgmma work, a quarter of
    its staged input, no upsampled copy."""
    p = geometry.params
    b, h2, w2, c = geometry.lhs_shape
    rhs = list(geometry.rhs_shape)
    rhs[p.rhs_spec[0]] *= 4
    out = [0] * 4
    out[p.out_spec[0]], out[p.out_spec[1]] = b, 4 * geometry.out_features
    out[p.out_spec[2]], out[p.out_spec[3]] = h2 // 2, w2 // 2
    return ConvGeometry(p, (b, h2 // 2, w2 // 2, c), tuple(rhs), tuple(out))


def phase_blocks(blocks: MosaicBlocks, phase_outputs: int) -> MosaicBlocks | None:
    """The phase form's tiles: an output-channel tile inside one phase's `phase_outputs` columns (a CTA
    runs its phase's taps), 64 columns where 128 do not divide them; None where 64 do not either."""
    if phase_outputs % blocks.tile_n == 0:
        return blocks
    return dataclasses.replace(blocks, tile_n=64) if phase_outputs % 64 == 0 else None


SM_COUNT = 132  # H100 SXM5


def halo_blocks(grid_of, out_rows: int, out_features: int, vectors: Sequence[int] = (),
                operands: Sequence[tuple[str, int]] = (), out_itemsize: int = 2, batch: int = 1) -> MosaicBlocks | None:
    """The haloed template's tiles: one compute warpgroup, `tile_m` 64 or 128 (whichever pads an
    image's output rows least, 128 among equals), `tile_n` 128 or 64 (whichever pads N least), at
    most 128 x 64 (a 128 x 128 fp32 accumulator beside a GroupNorm prologue spilled: 216 bytes at
    the VAE's 64 x 64 x 512); then, while the CTAs do not fill the SMs (an 8x8 image of 1280
    channels: 40 CTAs of 128 x 64), 64 rows; a 3-slot weight ring, 2 slots where SMEM asks. None when even 64 columns and
    2 slots do not fit SMEM (`halo_smem_bytes`: rows too wide to stage; 128 x 128 images fit, 256 x
    256 do not). `grid_of(tile_m)` is the conv's `HaloGrid`; `vectors` the itemsizes of the input
    expression's per-channel vectors, `operands` the epilogue's `(kind, itemsize)`."""
    def padded(size, tile):
        return -(-size // tile) * tile

    tile_m = min((128, 64), key=lambda t: (padded(out_rows, t), -t))
    tile_n = min((128, 64), key=lambda t: (padded(out_features, t), -t))
    if tile_m * tile_n > 128 * 64:  # one warpgroup's 128 x 128 fp32 accumulator and the prologue spill
        tile_n = 64

    def ctas(tm, tn):
        return batch * (padded(out_rows, tm) // tm) * (padded(out_features, tn) // tn)

    if ctas(tile_m, tile_n) < SM_COUNT and tile_m == 128:
        tile_m = 64
    grid = grid_of(tile_m)
    for blocks in (MosaicBlocks(tile_m, tile_n, CHUNK, stages=3, compute_wgs=1),
                   MosaicBlocks(tile_m, 64, CHUNK, stages=3, compute_wgs=1),
                   MosaicBlocks(tile_m, 64, CHUNK, stages=2, compute_wgs=1)):
        if halo_smem_bytes(grid, blocks, vectors, operands, out_itemsize) <= SMEM_BYTES:
            return blocks
    return None


def halo_tiling(geometry: ConvGeometry, out_features: int, vectors: Sequence[int] = (),
                operands: Sequence[tuple[str, int]] = (), out_itemsize: int = 2,
                batch: int = 1) -> tuple[MosaicBlocks, "functools.partial"] | None:
    """`(blocks, grid_of)`: the haloed template's tiles (`halo_blocks`) and its grid for a `tile_m`
    (`grid_of(tile_m)`: a `HaloGrid`) with the fewest strips (`strip_counts`) whose staged rows fit
    SMEM; None when none do."""
    for strips in strip_counts(geometry):
        grid_of = functools.partial(HaloGrid, geometry, strips=strips)
        blocks = halo_blocks(grid_of, grid_of(128).out_rows, out_features, vectors, operands, out_itemsize,
                             batch * strips)
        if blocks is not None:
            return blocks, grid_of
    return None


def halo_smem_bytes(grid: HaloGrid, blocks: MosaicBlocks, vectors: Sequence[int], operands: Sequence[tuple[str, int]],
                    out_itemsize: int) -> int:
    """Shared memory of one haloed-conv CTA: two staged chunks, two A tiles, the weight ring, the row
    mask, the input expression's per-channel vectors (two slots each), the epilogue's two output
    sub-tiles and one sub-tile (or vector) of each operand."""
    staged = 2 * grid.staging * CHUNK * 2
    a_tiles = 2 * blocks.tile_m * CHUNK * 2
    ring = blocks.stages * CHUNK * blocks.tile_n * 2
    epilogue = 2 * blocks.epi_m * blocks.epi_n * out_itemsize
    for kind, size in operands:
        epilogue += size * {"tile": blocks.epi_m * blocks.epi_n, "row": blocks.epi_m, "col": blocks.epi_n}[kind]
    return staged + a_tiles + ring + grid.staging * 2 + sum(2 * CHUNK * v for v in vectors) + epilogue


# --- attention ----------------------------------------------------------------------------------

HEAD_QUANTUM = 16  # wgmma's K step for 16-bit operands: head dims pad to a multiple of it
MAX_HEAD = 192  # padded head lanes whose two fp32 accumulators fit a compute warpgroup's registers


def padded_head(head_dim: int) -> int:
    """The head dim rounded up to wgmma's 16-element K step: 40 -> 48, 80 -> 80, 160 -> 160."""
    return -(-head_dim // HEAD_QUANTUM) * HEAD_QUANTUM


def swizzle_for(minor: int, itemsize: int) -> int | None:
    """The widest swizzle (128, 64 or 32 bytes) that divides a tile row of `minor` elements of
    `itemsize` bytes, or None."""
    row_bytes = minor * itemsize
    return next((s for s in (128, 64, 32) if row_bytes % s == 0), None)


def key_quantum(head: int) -> int:
    """What `block_kv` must be a multiple of for a padded head of `head` fp16/bf16 lanes: P tiles
    (keys along their rows, the A operand of P·V) are swizzled like the head's tiles, so a row holds whole swizzle
    groups (16 keys at a 32-byte swizzle, 32 at 64, 64 at 128)."""
    swizzle = swizzle_for(head, 2)
    if swizzle is None:
        raise NotImplementedError(f"a tile row of {head * 2} bytes (swizzles need a multiple of 32)")
    return swizzle // 2


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tiles of one Mosaic attention kernel: `block_q` query rows per compute warpgroup (64: one
    wgmma M), `compute_wgs` of them per CTA, `block_kv` keys per step, `stages` K/V slots in the ring."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2
    compute_wgs: int = 2

    @classmethod
    def get_default(cls, q_len: int, kv_len: int, head_dim: int) -> "AttentionBlocks":
        """64-row query tiles (the wgmma M of one warpgroup), two compute warpgroups when the queries
        fill 128-row CTAs (one for 64 or fewer); 64 keys per step, or a short context (<= 128 keys)
        in one step of its length rounded up to the key quantum (77 keys: 80 slots at heads of 40
        or 80, 96 at 160, 128 at 64; not 128 everywhere); a ring as deep as the key blocks, at most
        3 (2 when the padded head exceeds 128 lanes: SMEM)."""
        head = padded_head(head_dim)
        quantum = key_quantum(head)
        block_kv = -(-kv_len // quantum) * quantum if kv_len <= 128 else 64
        steps = -(-kv_len // block_kv)
        return cls(64, block_kv, stages=max(2, min(3 if head <= 128 else 2, steps)),
                   compute_wgs=1 if q_len <= 64 else 2)

    def validate(self) -> None:
        if self.block_q != 64:
            raise ValueError(f"block_q={self.block_q}: one warpgroup's wgmma covers 64 rows")
        if self.block_kv % HEAD_QUANTUM or self.block_kv > 256:
            raise ValueError(f"block_kv={self.block_kv} must be a multiple of {HEAD_QUANTUM} up to 256 (wgmma's K "
                             "step for P·V, its N limit for Q·Kᵀ)")
        if self.stages < 1:
            raise ValueError(f"stages={self.stages} must be >= 1 (one slot: loads and MMAs take turns)")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"compute_wgs={self.compute_wgs} must be 1 or 2")


def attention_smem_bytes(blocks: AttentionBlocks, ring: int, head: int, itemsize: int, out_itemsize: int,
                         own_out_slot: bool, has_bias: bool) -> int:
    """Shared memory of one CTA: Q tiles (also the output's, unless `own_out_slot`: a result dtype
    other than Q's), the ring's Kᵀ, V (and float32 bias) slots, P tiles."""
    wgs, bq, bk = blocks.compute_wgs, blocks.block_q, blocks.block_kv
    total = wgs * bq * head * itemsize + 2 * ring * bk * head * itemsize + wgs * bq * bk * itemsize
    if own_out_slot:
        total += wgs * bq * head * out_itemsize
    if has_bias:
        total += ring * wgs * bq * bk * 4
    return total


def fit_ring(blocks: AttentionBlocks, kv_len: int, head: int, itemsize: int, out_itemsize: int,
             own_out_slot: bool, has_bias: bool) -> int:
    """The K/V ring the attention kernel runs: as deep as `blocks.stages` and its key blocks allow,
    shallower while it exceeds `SMEM_BYTES` (heads of 160 with a bias and a float32 result)."""
    ring = min(blocks.stages, -(-kv_len // blocks.block_kv))
    while ring > 1 and attention_smem_bytes(blocks, ring, head, itemsize, out_itemsize, own_out_slot,
                                            has_bias) > SMEM_BYTES:
        ring -= 1
    return ring
