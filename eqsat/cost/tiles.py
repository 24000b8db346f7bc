"""How the templates tile a kernel term, read from their own configurations (`eqsat.tiling`): a
matmul's M and N tiles, a conv's programs, K ranges and prologue evaluations per input element."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from eqsat.conv_params import ConvParams
from eqsat.cost import mma as conv_choice  # the tile the model chooses (a module: tests may force one)
from eqsat.cost.terms import Term, is_zero_literal
from eqsat.tiling import conv as conv_tiling
from eqsat.tiling.matmul import MatmulBlocks
from eqsat.types import ints, parse_type


class MatmulShape:
    """batch, M, N, K of a `Matmul` term and the template's tiles (`eqsat.tiling.matmul.MatmulBlocks`)."""

    def __init__(self, lhs_ty: str, rhs_ty: str, dims: str):
        lhs_shape, rhs_shape = parse_type(lhs_ty).shape, parse_type(rhs_ty).shape
        lhs_contract, _rhs_contract, lhs_batch, _rhs_batch = (
            ints(part) if part else () for part in (dims.split(";") + ["", "", "", ""])[:4])
        self.lhs_contract = lhs_contract
        self.batch = math.prod(lhs_shape[a] for a in lhs_batch)
        self.k = math.prod(lhs_shape[a] for a in lhs_contract)
        self.m = math.prod(lhs_shape) // max(self.batch * self.k, 1)
        self.n = math.prod(rhs_shape) // max(self.batch * self.k, 1)
        blocks = MatmulBlocks.get_default(max(self.m, 1), max(self.n, 1), max(self.k, 1))
        self.block_m, self.block_n = blocks.block_m, blocks.block_n
        self.m_tiles = -(-self.m // self.block_m)
        self.n_tiles = -(-self.n // self.block_n)


_MATMUL_SHAPES: dict[int, tuple] = {}


def matmul_shape(term) -> MatmulShape:
    cached = _MATMUL_SHAPES.get(id(term))
    if cached is None or cached[0] is not term:
        lhs, rhs, dims, _epilogue, _ty = term.args
        cached = _MATMUL_SHAPES[id(term)] = (term, MatmulShape(lhs.ty, rhs.ty, dims))
    return cached[1]


# The conv template's default blocks (`eqsat.tiling.conv`; `ConvConfig.candidates` are built of them).
CONV_BLOCK_N = conv_tiling.DEFAULT_BLOCK_N
CONV_BLOCK_M = conv_tiling.DEFAULT_BLOCK_M
CONV_BLOCK_W = conv_tiling.DEFAULT_BLOCK_W
CONV_MAX_TILE_ROWS = conv_tiling.MAX_TILE_ROWS


@functools.lru_cache(maxsize=4096)
def _geometry(lhs_ty: str, rhs_ty: str, params: str, out_ty: str) -> conv_tiling.ConvGeometry:
    return conv_tiling.ConvGeometry(ConvParams.parse(params), tuple(parse_type(lhs_ty).shape),
                                    tuple(parse_type(rhs_ty).shape), tuple(parse_type(out_ty).shape))


def conv_default_config(lhs_ty: str, rhs_ty: str, params: str, out_ty: str) -> conv_tiling.ConvConfig:
    """The conv template's tile for a conv of these types (`eqsat.cost.mma.conv_config`: the shape
    the cost model prices lowest; block_k and stages aside, which do not change the tiling)."""
    return conv_choice.conv_config(_geometry(lhs_ty, rhs_ty, params, out_ty))


def conv_output_tiles(out_features: int, block_n: int = CONV_BLOCK_N) -> int:
    """Output-channel tiles of `block_n` (shrunk to fit) for `out_features` channels; a conv's
    own: `conv_default_config(...).block_n`."""
    return conv_tiling.output_channel_tiles(out_features, block_n)


def conv_tile(lhs_ty: str, rhs_ty: str, params: str, out_ty: str) -> tuple[int, int]:
    """(dots, dot M) of the conv template's default output tile (`ConvConfig.tile`)."""
    geometry = _geometry(lhs_ty, rhs_ty, params, out_ty)
    return conv_choice.conv_config(geometry).tile(geometry)


@dataclass(frozen=True)
class ConvPrograms:
    """How the conv template tiles a conv (`emit.pallas.conv`): `tiles` programs per image and
    output-channel tile. What its input expression computes per (batch, channel) (GroupNorm's
    scale and shift, a statistic's merge) runs once per program and channel chunk on a
    [1, block_k] tile: `hoisted` evaluations per input element."""

    tiles: int                  # programs per image and output-channel tile
    hoisted: float              # evaluations per input element of a per-(batch, channel) node
    batch_channels: int         # batch × input channels
    in_rows: int                # the input's spatial size
    in_cols: int

    @classmethod
    def of(cls, lhs_ty: str, rhs_ty: str, params: str, out_ty: str) -> "ConvPrograms":
        geometry = _geometry(lhs_ty, rhs_ty, params, out_ty)
        config = conv_choice.conv_config(geometry)
        tiles = config.spatial_tiles(geometry)
        in_h, in_w = geometry.in_size
        return cls(tiles, tiles * conv_output_tiles(geometry.out_features, config.block_n) / max(in_h * in_w, 1),
                   geometry.batch * geometry.in_features, in_h, in_w)

    def per_pixel(self, node_ty: str) -> bool:
        """Whether a node of this type is computed at every pixel: bigger than batch × channels, or
        a spatial map (an axis of rows·columns, or axes of both rows and columns). A guess from the
        type: the template decides from the node's index (`emit.expr.CompiledExpr.hoist`)."""
        shape = list(parse_type(node_ty).shape if node_ty else ())
        if math.prod(shape) > self.batch_channels:
            return True
        pixels = self.in_rows * self.in_cols
        if pixels > 1 and pixels in shape and pixels not in (self.in_rows, self.in_cols):
            return True
        if self.in_rows > 1 and self.in_cols > 1 and self.in_rows in shape:
            shape.remove(self.in_rows)
            return self.in_cols in shape
        return False

    def evaluations(self, node_ty: str, per_pixel: float) -> float:
        """Evaluations per input element of a node of this type: `per_pixel` (the K range's
        `conv_prologue_evaluations`), or `hoisted` for a per-(batch, channel) node."""
        return per_pixel if self.per_pixel(node_ty) else self.hoisted


def conv_prologue_evaluations(lhs_ty: str, rhs_ty: str, params: str, out_ty: str, taps: int | None = None) -> float:
    """How many times the conv template computes each element of its input expression per pixel
    (`eqsat.tiling.conv.prologue_evaluations` of its default config: 4.5 × 3 = 13.5 for a 3×3
    same conv with 320 output channels on 4 × 32 row tiles; 9 × 3 = 27 on flat tiles). `taps`
    (default: the whole window) is a K range's: all of it, or one tap (a merged 1×1 shortcut)."""
    geometry = _geometry(lhs_ty, rhs_ty, params, out_ty)
    kh, kw = geometry.window
    window = None if taps is None or taps == kh * kw else (1, taps)
    return conv_tiling.prologue_evaluations(geometry, conv_choice.conv_config(geometry), window)


def zero_pad_taps(pad_config: str, inner_shape: Sequence[int], rhs_spec: Sequence[int]) -> int | None:
    """The window taps a conv runs over a weight `pad(inner, 0)` with `pad_config`
    (`lo,hi,interior` per axis, `;`-separated) when the pad adds zero taps on the window axes only:
    the taps of `inner`, the rest multiply zeros and the template skips them. None otherwise."""
    config = [ints(part) for part in pad_config.split(";")]
    if len(config) != len(inner_shape):
        return None
    for axis, (lo, hi, interior) in enumerate(config):
        if interior != 0 or lo < 0 or hi < 0 or (axis not in rhs_spec[2:] and (lo, hi) != (0, 0)):
            return None
    return math.prod(inner_shape[a] for a in rhs_spec[2:])


def conv_parts(lhs: Term, rhs: Term, lhs_axis: int, rhs_spec: Sequence[int],
               window: tuple[int, ...], split_input: bool = True) -> list[tuple[Term, int, float]]:
    """The conv template's K ranges: (input expression of the range, taps it runs over, the part
    of that expression's channels the range covers). An input expression wider than its range
    (the weight is a concat there, the input is not) is evaluated at the range's channels only.
    `split_input=False`: the ranges the weight alone splits (the input's own concats ignored)."""
    rhs_axis = rhs_spec[1]
    bounds = {0, parse_type(lhs.ty).shape[lhs_axis]}
    sides_split = ((lhs, lhs_axis), (rhs, rhs_axis)) if split_input else ((rhs, rhs_axis),)
    for expr, axis in sides_split:
        stack, base = [(expr, 0)], 0
        while stack:
            node, base = stack.pop()
            if node.op == "Concat" and node.args[2] == axis:
                bounds.add(base + node.args[3])
                stack += [(node.args[0], base), (node.args[1], base + node.args[3])]
    edges = sorted(bounds)
    parts = []
    for start, stop in zip(edges, edges[1:]):
        sides = []
        for expr, axis, split in ((lhs, lhs_axis, split_input), (rhs, rhs_axis, True)):
            lo, hi = start, stop
            while split and expr.op == "Concat" and expr.args[2] == axis and (hi <= expr.args[3] or lo >= expr.args[3]):
                if hi <= expr.args[3]:
                    expr = expr.args[0]
                else:
                    expr, lo, hi = expr.args[1], lo - expr.args[3], hi - expr.args[3]
            sides.append(expr)
        weight = sides[1]
        taps = math.prod(window)
        if weight.op == "Pad" and is_zero_literal(weight.args[1]):  # zero taps are skipped
            inner = zero_pad_taps(weight.args[2], parse_type(weight.args[0].ty).shape, rhs_spec)
            taps = taps if inner is None else inner
        width = parse_type(sides[0].ty).shape[lhs_axis]
        parts.append((sides[0], max(taps, 1), (stop - start) / max(width, 1)))
    return parts
