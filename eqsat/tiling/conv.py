"""The conv template's tiling (`emit.pallas.conv`): its geometry, K ranges, tiles and grid.

A program owns `block_n` output channels and the output pixels of one spatial tile of one image,
in one of two shapes (`ConvConfig.flat`):

- a row tile: `rows × columns` pixels (`ConvConfig.tile`: `block_w` columns, the dots' M, and up
  to `block_m // block_w` rows), one dot per row; each input row is computed once per column tap
  and reused by every row tap (3 · (rows + 2) / rows evaluations per element of a 3×3 conv);
- a flat tile: `block_m` consecutive pixels of the image in row-major order (several rows of a
  narrow image), one dot of M = block_m; its input is computed once per tap (9 for a 3×3 conv).

The grid is (batch · spatial tiles, output-channel tiles) (`grid`). K runs over each `KRange`'s
channels in `block_k` chunks and its window taps. The cost model chooses the shape per conv
(`eqsat.cost.mma.conv_config`, by `conv_tile_seconds`): row tiles where the image is
wide enough for a 64-pixel dot, flat ones where row tiles would multiply with mma.sync on few SMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from eqsat.conv_params import ConvParams
from eqsat.tiling import MIN_DOT_BLOCK, cdiv, next_pow2

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 128
DEFAULT_BLOCK_K = 64
DEFAULT_BLOCK_W = 64
MAX_TILE_ROWS = 4  # each row of a tile is unrolled: more rows, fewer recomputes, longer compiles
MIN_BLOCK = MIN_DOT_BLOCK  # Triton's dot needs every dimension >= 16


MAX_WINDOW_TAPS = 49  # 7x7: a model's widest filter; wider windows are weight gradients


class UncoveredConv(NotImplementedError, ValueError):
    """A conv form the template does not cover (a transposed or grouped conv: the input and weight
    gradients of a strided conv; a window wider than `MAX_WINDOW_TAPS` taps: a weight gradient,
    which correlates two activations over the whole image): the dispatcher runs it with the XLA
    emitter (cuDNN's backward-filter kernel on a GPU) and warns."""


@dataclass(frozen=True)
class ConvGeometry:
    """The static shape of one 2-D convolution, read through its dimension numbers."""

    params: ConvParams
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def __post_init__(self):
        p = self.params
        if len(p.strides) != 2 or len(self.lhs_shape) != 4:
            raise ValueError(f"the conv template handles 2-D convolutions; got {len(p.strides)} spatial dims")
        if any(d != 1 for d in p.lhs_dilation):
            raise UncoveredConv(f"lhs_dilation={p.lhs_dilation} (a transposed conv) is not supported")
        if p.feature_groups != 1 or p.batch_groups != 1:
            raise UncoveredConv(f"grouped convs are not supported ({p.feature_groups=}, {p.batch_groups=})")
        window = tuple(self.rhs_shape[a] for a in p.rhs_spec[2:])
        if window[0] * window[1] > MAX_WINDOW_TAPS:
            # The SD 1.5 fine-tuning step's 1x1 weight gradients (a 64x64 window over 2 features)
            # asked for 266,752-528,896 B of shared memory and failed the H100 compile.
            raise UncoveredConv(f"a {window[0]}x{window[1]} window ({window[0] * window[1]} taps, over "
                                f"{MAX_WINDOW_TAPS}: a weight gradient) is not the template's")
        if self.rhs_shape[p.rhs_spec[1]] != self.in_features:
            raise ValueError(f"weight in-features {self.rhs_shape[p.rhs_spec[1]]} != input features {self.in_features}")
        expected = [0] * 4
        expected[p.out_spec[0]], expected[p.out_spec[1]] = self.batch, self.out_features
        for axis, size in zip(p.out_spec[2:], self._spatial_out()):
            expected[axis] = size
        if tuple(expected) != tuple(self.out_shape):
            raise ValueError(f"output shape {self.out_shape} does not match the conv's {tuple(expected)}")

    def _spatial_out(self) -> tuple[int, int]:
        p = self.params
        sizes = []
        for i in range(2):
            span = (self.window[i] - 1) * p.rhs_dilation[i] + 1
            padded = self.in_size[i] + p.padding[i][0] + p.padding[i][1]
            sizes.append(max((padded - span) // p.strides[i] + 1, 0))
        return tuple(sizes)

    @property
    def batch(self) -> int:
        return self.lhs_shape[self.params.lhs_spec[0]]

    @property
    def in_features(self) -> int:
        return self.lhs_shape[self.params.lhs_spec[1]]

    @property
    def out_features(self) -> int:
        return self.rhs_shape[self.params.rhs_spec[0]]

    @property
    def in_size(self) -> tuple[int, int]:
        return tuple(self.lhs_shape[a] for a in self.params.lhs_spec[2:])

    @property
    def window(self) -> tuple[int, int]:
        return tuple(self.rhs_shape[a] for a in self.params.rhs_spec[2:])

    @property
    def out_size(self) -> tuple[int, int]:
        return tuple(self.out_shape[a] for a in self.params.out_spec[2:])

    @property
    def pixels(self) -> int:
        """Output pixels: the GEMM's M."""
        return self.batch * self.out_size[0] * self.out_size[1]

    @property
    def image_pixels(self) -> int:
        """Output pixels of one image (an M tile never spans two images)."""
        return math.prod(self.out_size)

    @property
    def taps(self) -> int:
        return self.window[0] * self.window[1]


@dataclass(frozen=True)
class KRange:
    """Consecutive input channels with their own operand closures.

    `lhs` is evaluated at an index of the conv's lhs axes whose feature entry counts from the
    range's first channel (0..channels-1); `rhs` at an index of the weight's axes with the same
    local in-feature and window taps counted from `taps`' first row/column. `taps` is the part of
    the window with nonzero weights, `((ky0, ky1), (kx0, kx1))` half-open; None is all of it.
    """

    channels: int
    lhs: Callable | None  # `emit.pallas.conv.OperandFn`s (None where only the tiling is asked)
    rhs: Callable | None
    taps: tuple[tuple[int, int], tuple[int, int]] | None = None
    # (refs, index, mask) -> what `lhs` computes per (batch, channel), evaluated once per channel
    # chunk at pixel (0, 0) and passed to `lhs(..., hoisted=)` at every tap; None: nothing hoisted.
    hoist: Callable | None = None
    # Whether `lhs` / `rhs` already read 0 wherever their mask is False (a masked load through
    # views): the template then feeds them to the dot as loaded, not through a select, so Triton
    # can stage them in shared memory and keep the MMA asynchronous.
    lhs_zero_masked: bool = False
    rhs_zero_masked: bool = False

    @property
    def direct(self) -> bool:
        """Input and weight are plain loads: the template feeds both to the dot as loaded."""
        return self.lhs_zero_masked and self.rhs_zero_masked

    def window(self, geometry: ConvGeometry) -> tuple[tuple[int, int], tuple[int, int]]:
        (kh, kw) = geometry.window
        taps = self.taps if self.taps is not None else ((0, kh), (0, kw))
        (y0, y1), (x0, x1) = taps
        if not (0 <= y0 < y1 <= kh and 0 <= x0 < x1 <= kw):
            raise ValueError(f"K range taps {taps} outside the {kh}x{kw} window")
        return taps


@dataclass(frozen=True)
class ConvConfig:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters."""

    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    block_k: int = DEFAULT_BLOCK_K
    num_warps: int = 4
    num_stages: int = 3
    block_w: int = DEFAULT_BLOCK_W
    flat: bool = False  # a flat tile of block_m pixels (several rows) instead of rows of block_w

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "block_w"):
            value = getattr(self, name)
            if value < MIN_BLOCK or value != next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_BLOCK}")

    def tile(self, geometry: ConvGeometry) -> tuple[int, int]:
        """(dots, dot M) of a program's output tile. A row tile: `block_w` columns (a power of two
        >= 16) and up to block_m // block_w rows (at most `MAX_TILE_ROWS`) of one image, each its
        own accumulator. A flat tile: one dot over `block_m` pixels."""
        if self.flat:
            return 1, self.block_m
        return output_tile(*geometry.out_size, self.block_m, self.block_w)

    def spatial_tiles(self, geometry: ConvGeometry) -> int:
        """Programs per image and output-channel tile."""
        out_h, out_w = geometry.out_size
        if self.flat:
            return cdiv(out_h * out_w, self.block_m)
        rows, cols = self.tile(geometry)
        return cdiv(out_h, rows) * cdiv(out_w, cols)

    @classmethod
    def for_tile(cls, tile: "ConvConfig", geometry: ConvGeometry, ranges: Sequence[KRange] = (),
                 itemsize: int = 2) -> "ConvConfig":
        """The template's config for the tile shape `tile` (one of `candidates`; the cost model
        picks which: `eqsat.cost.mma.conv_config`): 64-channel K chunks shrunk to the widest K
        range, and halved for 4-byte operands (`itemsize`: a 128-pixel x 128-channel fp32 tile with
        64-channel chunks asked for 249,856 B of shared memory, over an H100's 232,448; fp16:
        126,976). Software pipelining over 2 stages where at most one K range runs a window of
        several taps, none otherwise: each column tap loads every input row of the tile and the
        weights of every row tap, and a kernel with a skip concat or a merged shortcut has a loop
        per K range (with 3 stages everywhere, one of the UNet step's convs asked for 300 KB of
        shared memory). Measured in ptxas for sm_90a and XLA's launches: a 3×3 range with 1×1
        shortcut or skip ranges at 2 stages asks 48-124 KB, as a lone 3×3 range does, and stages
        its loads in shared memory instead of registers (168-248 registers against 230-255; the
        VAE's 512² shortcut conv spilled 48 B at 1 stage, none at 2); two 3×3 ranges at 2 stages
        asked 225,280 B and spilled 1.2 KB. A direct range (input and weight plain loads: one dot
        per output row and tap, `KRange.direct`) stages one row per dot and does not count: the
        stages only change where loads wait, not the work the cost model counts, so the model,
        which knows a range by its channels and taps, reads the windowed ranges as computed."""
        widest = max((r.channels for r in ranges), default=geometry.in_features)
        block_k = min(DEFAULT_BLOCK_K if itemsize <= 2 else DEFAULT_BLOCK_K // 2, max(MIN_BLOCK, next_pow2(widest)))
        windowed = sum(1 for r in ranges if _tap_count(r.window(geometry)) > 1 and not r.direct)
        return replace(tile, block_k=block_k, num_stages=2 if windowed <= 1 else 1)

    @classmethod
    def candidates(cls, geometry: ConvGeometry) -> list["ConvConfig"]:
        """The tile shapes the cost model chooses from for `geometry`: the row tile (128 pixels,
        `block_w` = 64 columns or the image's width) and flat tiles of 64 and 128 pixels (or
        the image's pixels rounded up, where fewer), all of 128 output channels (shrunk to fit)."""
        block_n = min(DEFAULT_BLOCK_N, max(MIN_BLOCK, next_pow2(geometry.out_features)))
        shapes = [cls(DEFAULT_BLOCK_M, block_n, DEFAULT_BLOCK_K, _warps(DEFAULT_BLOCK_M, block_n))]
        image = max(MIN_BLOCK, next_pow2(geometry.image_pixels))
        for block_m in sorted({min(64, image), min(DEFAULT_BLOCK_M, image)}):
            shapes.append(cls(block_m, block_n, DEFAULT_BLOCK_K, _warps(block_m, block_n), flat=True))
        return shapes


def _tap_count(window: tuple[tuple[int, int], tuple[int, int]]) -> int:
    (y0, y1), (x0, x1) = window
    return (y1 - y0) * (x1 - x0)


def single_tap(geometry: ConvGeometry) -> tuple[tuple[int, int], tuple[int, int]]:
    """A K range's `taps` of one tap of `geometry`'s window (the centre): what a cost model that
    knows only a range's tap count passes for a 1×1 range (`ConvConfig.for_tile` counts taps)."""
    (kh, kw) = geometry.window
    return ((kh // 2, kh // 2 + 1), (kw // 2, kw // 2 + 1))


def _warps(block_m: int, block_n: int) -> int:
    return 8 if block_m * block_n >= 128 * 128 else 4


def output_channel_tiles(out_features: int, block_n: int = DEFAULT_BLOCK_N) -> int:
    """Output-channel tiles of the default config for `out_features` channels (the template
    evaluates its input once more per tile: `eqsat.cost.tiles.conv_output_tiles`)."""
    return -(-out_features // min(block_n, max(MIN_BLOCK, next_pow2(out_features))))


def output_tile(out_h: int, out_w: int, block_m: int = DEFAULT_BLOCK_M, block_w: int = DEFAULT_BLOCK_W) -> tuple[int, int]:
    """(rows, columns) of a program's output tile on an `out_h × out_w` image: `block_w` columns
    (a power of two >= 16, the dots' M, no wider than the image rounded up) and up to
    block_m // columns rows (at most `MAX_TILE_ROWS`) of one image, each its own accumulator."""
    width = min(block_m, block_w, max(MIN_BLOCK, next_pow2(out_w)))
    return max(1, min(block_m // width, MAX_TILE_ROWS, out_h)), width


def grid(geometry: ConvGeometry, config: ConvConfig) -> tuple[int, int]:
    """The template's grid: (batch · spatial tiles, output-channel tiles)."""
    return (geometry.batch * config.spatial_tiles(geometry), cdiv(geometry.out_features, config.block_n))


def prologue_evaluations(geometry: ConvGeometry, config: ConvConfig, taps: tuple[int, int] | None = None,
                         direct: bool = False) -> float:
    """How many times the template computes each element of a K range's input expression (per
    input pixel and channel, over all programs), `taps` = (rows, columns) of the range's window
    (default: the whole window; a merged 1×1 shortcut's range runs over one tap). A row tile
    computes, per column tap, each input row its output rows read through the row taps, at its
    columns; a flat tile computes its pixels' input at every tap. A `direct` range (input and
    weight plain loads: `KRange.lhs_zero_masked` and `rhs_zero_masked`) is loaded, not computed,
    so a row tile reads it per output row at every tap (one pipelined dot per row and tap,
    `emit.pallas.conv._direct_row_sums`); its loads cost bytes from L2, no prologue flops:

        row:         spatial tiles · used input rows · column taps · columns · Cout tiles / input pixels
        row, direct: spatial tiles · rows · row taps · column taps · columns · Cout tiles / input pixels
        flat:        spatial tiles · block_m · row taps · column taps · Cout tiles / input pixels
    """
    kh, kw = geometry.window if taps is None else taps
    in_h, in_w = geometry.in_size
    cout_tiles = cdiv(geometry.out_features, config.block_n)
    tiles = config.spatial_tiles(geometry)
    if config.flat:
        return tiles * config.block_m * kh * kw * cout_tiles / max(in_h * in_w, 1)
    rows, cols = config.tile(geometry)
    if direct:
        return tiles * rows * kh * kw * cols * cout_tiles / max(in_h * in_w, 1)
    stride_y, dil_y = geometry.params.strides[0], geometry.params.rhs_dilation[0]
    input_rows = len({r * stride_y + ky * dil_y for r in range(rows) for ky in range(kh)})
    return tiles * input_rows * kw * cols * cout_tiles / max(in_h * in_w, 1)
