"""A hosted statistic's partials buffer `[tiles, fields, slots]` as its hosts' templates write it
(`eqsat.cost.merges` describes the buffer and where it is merged), and the work of one merge."""

from __future__ import annotations

import math

from eqsat.conv_params import ConvParams
from eqsat.cost.hosting import hosts_of
from eqsat.cost.terms import PARTIAL_FIELDS, partial_tiles
from eqsat.cost.tiles import ConvPrograms, conv_default_config, conv_output_tiles, matmul_shape
from eqsat.types import parse_type
from eqsat.tiling.conv import UncoveredConv

# Instructions per (lane, tile) of a reader's merge (`emit.expr.merge_partials_at`): moments load
# three fields and run the shifted two-pass block reduction and Chan's step (27 in the PTX of the
# compiled UNet); a sum loads one field and adds it.
MERGE_INSTRUCTIONS = {"sum": 4, "moments": 27}

# Flops one instruction costs at the fp32 vector peak (which counts an FMA as two flops).
INSTRUCTION_FLOPS = 2


def statistic_slots(statistic) -> int:
    """Outputs (slots) of an `EpilogueReduce`: its kept elements (`moments`: per row pair)."""
    shape = parse_type(statistic.ty).shape
    return max(1, math.prod(shape[1:] if statistic.args[1] == "moments" else shape))


def fields(statistic) -> int:
    return PARTIAL_FIELDS.get(statistic.args[1], 1)


def host_tiles(host, statistic) -> int:
    """The partial rows `host` writes for `statistic`, as its template tiles it: a conv writes one
    row per program (batch · spatial tiles · output-channel tiles), or per output-channel tile when
    every pixel is its own slot (a row statistic: `emit.pallas.conv._Layout.per_row`); a matmul one
    per N tile (`emit.pallas.matmul.MatmulBlocks`); other hosts one per `PARTIAL_TILE` elements."""
    if host.op == "Conv":
        lhs, rhs, params, _epilogue, ty = host.args
        try:
            return conv_host_tiles(lhs.ty, rhs.ty, params, ty, statistic_slots(statistic))
        except UncoveredConv:  # a transposed or grouped conv (a backward's): not tiled by the template
            return partial_tiles(statistic.args[2].ty)
    if host.op == "Matmul":
        return matmul_shape(host).n_tiles
    return partial_tiles(statistic.args[2].ty)


def conv_host_tiles(lhs_ty: str, rhs_ty: str, params: str, out_ty: str, slots: int) -> int:
    """The partial rows a conv host writes for a statistic of `slots` outputs (`host_tiles`)."""
    p = ConvParams.parse(params)
    out = parse_type(out_ty).shape
    cout = out[p.out_spec[1]]
    n_tiles = conv_output_tiles(cout, conv_default_config(lhs_ty, rhs_ty, params, out_ty).block_n)
    if slots == math.prod(out) // max(cout, 1):  # every pixel its own slot
        return n_tiles
    return out[p.out_spec[0]] * ConvPrograms.of(lhs_ty, rhs_ty, params, out_ty).tiles * n_tiles


def statistic_tiles(statistic) -> int:
    """`tiles` of a statistic's partials: the rows all its hosts write (`host_tiles`), or the
    `PARTIAL_TILE` estimate when it is not hosted."""
    hosts = hosts_of(statistic)
    if not hosts:
        return partial_tiles(statistic.args[2].ty)
    return max(1, sum(host_tiles(h, statistic) for h in hosts))


def partials_bytes(statistic) -> float:
    """Bytes of the partials buffer its hosts write: `tiles × fields × slots × 4`."""
    return float(statistic_tiles(statistic) * fields(statistic) * statistic_slots(statistic) * 4)


def merge_flops_per_lane(op: str, tiles: int) -> float:
    """Flops of one lane merging `tiles` partial rows."""
    return float(MERGE_INSTRUCTIONS.get(op, MERGE_INSTRUCTIONS["sum"]) * INSTRUCTION_FLOPS * tiles)
