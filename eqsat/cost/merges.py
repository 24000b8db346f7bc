"""Where a hosted statistic's partials are merged, and what that costs.

A statistic computed in its producers' epilogues (`EpilogueReduce`, `eqsat.cost.hosting`) exists
as per-tile partials, an fp32 buffer `[tiles, fields, slots]`: `tiles` the partial rows its hosts
write (`statistic_tiles`: every program of a conv host for a GroupNorm statistic, the N tiles of
the host for a row statistic), `fields` 1 (sum) or 3 (count, mean, M2), `slots` its outputs (one
per (batch, group) of a GroupNorm). Its readers need the merged value. It is merged one of two
ways, and the model charges each exactly as the templates execute it:

- **In the reader** (`emit.expr.read_partials`): every lane of a point where the reader's template
  reads the statistic merges all `tiles` rows of its slot, `MERGE_INSTRUCTIONS[op]` instructions
  per (lane, tile) (27 for moments: measured in the PTX of the compiled UNet, three loads, the
  two-pass block reduction and Chan's step). How many lanes merge is the template's
  (`merge_lanes`):

  | reader | lanes that merge |
  |---|---|
  | `Pointwise`, `AssignStatic`/`AssignDynamic`, `Reduce` | every point the expression is evaluated at: per element (a `RowReduce` body: per reduced element) |
  | `Matmul` A prologue, index not moving with K (a row statistic) | the pre-pass: once per program row, `batch · M rounded up to block_m · N tiles` |
  | `Matmul` A prologue, index moving with K (a GroupNorm over K) | every A element per N tile |
  | `Matmul` B prologue / epilogue | every B element per M tile / every output element |
  | `Conv` input | once per program and channel chunk (`ConvPrograms.hoisted`), or per evaluation where it varies over the pixels |
  | `Attention` | q per element, k and v per element per query block, bias per score |
  | `Gather`, `Opaque`, `Loop`, `AssignScatter`, a plan output | none: they read the finished value |

- **Finished once** (`finalize_cost`): a small kernel (`emit.pallas.partials.finalize`, a plan
  kernel of kind `finalize` right after the last host) merges each slot once (one program per
  slot, its tiles in blocks of 1024 with the readers' blocked Chan merge) and writes the
  statistic (`slots × 2` or `slots` floats); readers then load it like any small tensor: one
  value per (batch, group), no merge. It costs a launch, the partials' read, `slots · tiles`
  merges and, on a calibrated device, its serial loads (`eqsat.cost.work.finalize_work`):
  independent of how many elements read the statistic.

Why not only the first: a per-element merge is `tiles × MERGE_INSTRUCTIONS` instructions per
element, against the ~20 of a GroupNorm + SiLU apply; at the UNet's T = 40..512 or the VAE's
512..4096 it costs 100× to 1000× the reader. Even merged once per program and channel chunk (the
conv template's hoist), a GroupNorm statistic costs its conv reader 5-30 % of the conv. Why not
only the second: a launch (4 µs on an H100) is more than merging a row statistic of a few N tiles
in a matmul's pre-pass (0.1 µs) or a GroupNorm statistic in a small conv's hoist (1-3 µs). So the
plan chooses per statistic (`eqsat.cost.roofline.finished_statistics`, which prices the readers
with this module): it is finished once when that costs less than its readers' merges, or when a reader cannot merge (it reads finished values, or the
statistic is a plan output). At full size a pointwise or attention reader's merge always prices
above a finalize. With `share_limit=MERGE_SHARE_GOAL` it is also finished when a reader would spend
more than 2 % of its modeled time merging it (the issue's bound on merge work; measured on the
SD 1.5 UNet: 285 kernels and 4.426 ms modeled against 259 and 4.384 ms by price alone, whose
largest merge share is a conv's 29 %). Extraction charges a conv reader's merge as min(merge in
place, one finalize) (`extract.prologue`), the plan's choice for a statistic with one reader.
"""

from __future__ import annotations

import math
import weakref

from eqsat.cost.devices import get_device
from eqsat.cost.partials import (  # noqa: F401 (the partials' geometry, importable from here as before)
    INSTRUCTION_FLOPS, MERGE_INSTRUCTIONS, conv_host_tiles, fields, host_tiles, merge_flops_per_lane,
    partials_bytes, statistic_slots, statistic_tiles)
from eqsat.cost.prologues import conv_prologue_work
from eqsat.cost.terms import PARTIAL_FIELDS, Cost, kernel_body, nbytes_of, size_of
from eqsat.cost.tiles import MatmulShape, matmul_shape  # noqa: F401
from eqsat.cost.work import finalize_work_of, mma_seconds
from eqsat.tiling.reshape import reshape_groups
from eqsat.types import ints, parse_type

# The bound on merge work: 2 % of a reader's modeled time. `finished_statistics` enforces it
# when asked (`share_limit`); by default the model finishes a statistic only where that prices lower.
MERGE_SHARE_GOAL = 0.02
# The attention template's query block (`emit.pallas.attention.AttentionBlocks`): k and v are
# evaluated once per query block.
ATTENTION_BLOCK_Q = 64
# Readers that read a statistic's finished value (plain jax: `emit.pallas.EmitContext.value`).
FINISHED_READERS = frozenset({"Gather", "Opaque", "Loop", "AssignScatter", "EpilogueReduce"})


def finalize_seconds(op: str, statistic_ty: str, tiles: int, device="h100") -> float:
    """`finalize_cost(...).seconds` from types: a statistic of type `statistic_ty` with `tiles` rows."""
    device = get_device(device)
    shape = parse_type(statistic_ty).shape
    slots = max(1, math.prod(shape[1:] if op == "moments" else shape))
    nbytes = tiles * PARTIAL_FIELDS.get(op, 1) * slots * 4 + math.prod(shape) * 4
    flops = slots * merge_flops_per_lane(op, tiles)
    return device.launch_overhead + device.memory_seconds(nbytes) + device.vector_seconds(flops) \
        + _finalize_serial_seconds(tiles, PARTIAL_FIELDS.get(op, 1), slots, device)


def _finalize_serial_seconds(tiles: int, fields: int, slots: int, device) -> float:
    """The finalize template's serial steps on a calibrated device (`eqsat.cost.work`)."""
    return mma_seconds(finalize_work_of(tiles, fields, slots), device)


# --- how many lanes a reader's template merges ---------------------------------------------------


def _loaded_lanes(expr, points: float, found: dict) -> None:
    """The lanes each `Load(statistic)` of `expr` (a hosted `EpilogueReduce`) is read at when `expr`
    is evaluated at `points` lanes, into `found` (statistic -> lanes, the max over its loads: a
    moments reader's sum and M2 at one point merge once, `emit.expr.read_partials`' memo). A
    `RowReduce` body runs at every reduced element. One walk finds every statistic."""
    stack = [(expr, points)]
    seen: set[tuple[int, float]] = set()
    while stack:
        node, lanes = stack.pop()
        if (id(node), lanes) in seen or node.sort != "Expr":
            continue
        seen.add((id(node), lanes))
        if node.op == "Load":
            tensor = node.args[0]
            if tensor.op == "EpilogueReduce" and lanes > found.get(tensor, 0.0):
                found[tensor] = lanes
            continue
        if node.op == "RowReduce":
            _op, body, axis, epilogue, _ty = node.args
            stack.append((body, lanes * parse_type(body.ty).shape[axis]))
            stack.append((epilogue, lanes))
            continue
        stack.extend((child, lanes) for child in node.children)


def _expr_lanes(expr, points: float) -> dict:
    """statistic -> the lanes `expr` evaluated at `points` lanes merges it at (`_loaded_lanes`)."""
    found: dict = {}
    _loaded_lanes(expr, points, found)
    return found


def _moving_with(expr, axes: frozenset) -> set:
    """The statistics a `Load` in `expr` reads at an index that depends on `expr`'s axes `axes` (a
    matmul's K axes: then the template merges it inline, per A element). Index dependencies follow
    the views; a `RowReduce` body depends on everything (conservative)."""
    rank = len(parse_type(expr.ty).shape)
    stack = [(expr, tuple(frozenset({a}) for a in range(rank)))]
    seen: set = set()
    moving: set = set()
    while stack:
        node, deps = stack.pop()
        if (id(node), deps) in seen or node.sort != "Expr":
            continue
        seen.add((id(node), deps))
        op = node.op
        if op == "Load":
            statistic = node.args[0]
            if statistic.op == "EpilogueReduce" and statistic not in moving:
                kept = deps[1:] if statistic.args[1] == "moments" else deps
                if any(d & axes for d in kept):
                    moving.add(statistic)
            continue
        if op == "Broadcast":
            x, dims, ty = node.args
            in_shape, out_shape = parse_type(x.ty).shape, parse_type(ty).shape
            stack.append((x, tuple(deps[d] if in_shape[j] == out_shape[d] else frozenset()
                                   for j, d in enumerate(ints(dims)))))
        elif op == "Transpose":
            x, permutation, _ty = node.args
            inner = [frozenset()] * len(deps)
            for out_axis, in_axis in enumerate(ints(permutation)):
                inner[in_axis] = deps[out_axis]
            stack.append((x, tuple(inner)))
        elif op == "Reshape":
            x, ty = node.args
            in_shape = parse_type(x.ty).shape
            inner = [frozenset()] * len(in_shape)
            for out_axes, in_axes in reshape_groups(tuple(parse_type(ty).shape), tuple(in_shape)):
                union = frozenset().union(*(deps[a] for a in out_axes))
                for a in in_axes:
                    inner[a] = union
            stack.append((x, tuple(inner)))
        elif op == "RowReduce":
            every = frozenset().union(*deps) if deps else frozenset()
            _op, body, _axis, epilogue, _ty = node.args
            stack.append((body, tuple(every for _ in parse_type(body.ty).shape)))
            stack.append((epilogue, deps))
        elif op in ("DynamicSlice", "Pad"):
            stack.append((node.args[0], deps))
            stack.extend((c, tuple(frozenset() for _ in parse_type(c.ty).shape)) for c in node.children[1:])
        else:
            for c in node.children:
                if c.sort != "Expr":
                    continue
                rank = len(parse_type(c.ty).shape)
                stack.append((c, deps if rank == len(deps) else tuple(frozenset() for _ in range(rank))))
    return moving


def _add(total: dict, part: dict) -> None:
    for statistic, lanes in part.items():
        total[statistic] = total.get(statistic, 0.0) + lanes


def _reader_lanes(reader) -> dict | None:
    """statistic -> lanes for every hosted statistic `reader` loads (see `merge_lanes`), or None
    when its template reads finished values."""
    op = reader.op
    if op in FINISHED_READERS:
        return None
    if op == "Pointwise":
        return _expr_lanes(reader.args[0], size_of(reader.ty))
    if op in ("AssignStatic", "AssignDynamic"):
        value = reader.args[2]
        return _expr_lanes(value, size_of(value.ty))
    if op == "Reduce":
        _op, body, _axes, epilogue, ty = reader.args
        lanes = _expr_lanes(body, size_of(body.ty))
        _add(lanes, _expr_lanes(epilogue, size_of(ty)))
        return lanes
    if op == "Matmul":
        lhs, rhs, _dims, epilogue, ty = reader.args
        shape = matmul_shape(reader)
        lanes = _expr_lanes(rhs, size_of(rhs.ty) * shape.m_tiles)
        _add(lanes, _expr_lanes(epilogue, size_of(ty)))
        in_lhs = _expr_lanes(lhs, 1.0)
        if in_lhs:
            moving = _moving_with(lhs, frozenset(shape.lhs_contract))
            inline = _expr_lanes(lhs, size_of(lhs.ty) * shape.n_tiles) if moving else {}
            pre_pass = shape.batch * shape.m_tiles * shape.block_m * shape.n_tiles  # once per program row
            _add(lanes, {s: inline[s] if s in moving else pre_pass for s in in_lhs})
        return lanes
    if op == "Conv":
        lanes = dict(conv_prologue_work(reader)[2])
        _add(lanes, _expr_lanes(reader.args[3], size_of(reader.ty)))
        return lanes
    if op == "Attention":
        q, k, v, bias, _scale, epilogue, ty = reader.args
        q_len = parse_type(q.ty).shape[-2] if len(parse_type(q.ty).shape) >= 2 else 1
        q_blocks = -(-q_len // ATTENTION_BLOCK_Q)
        lanes = _expr_lanes(q, size_of(q.ty))
        for part, points in ((k, size_of(k.ty) * q_blocks), (v, size_of(v.ty) * q_blocks), (bias, size_of(bias.ty)),
                             (epilogue, size_of(ty))):
            _add(lanes, _expr_lanes(part, points))
        return lanes
    return None


# Kernel term -> `_reader_lanes` (terms are interned and immutable: a kernel's lanes never change).
_READER_LANES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NOT_MERGING = object()


def reader_lanes(reader) -> dict | None:
    """statistic -> lanes of every hosted statistic `reader` merges in place (`merge_lanes`, all at
    once: one walk of each operand expression, cached per kernel term), None when it reads
    finished values."""
    cached = _READER_LANES.get(reader)
    if cached is None:
        lanes = _reader_lanes(reader)
        cached = _READER_LANES[reader] = _NOT_MERGING if lanes is None else lanes
    return None if cached is _NOT_MERGING else cached


def merge_lanes(reader, statistic) -> float | None:
    """Lanes the template of kernel `reader` merges `statistic`'s partials at (each merging all
    its tiles; see the module docstring), or None when it reads the finished value."""
    lanes = reader_lanes(reader)
    return None if lanes is None else lanes.get(statistic, 0.0)


def reader_merge_flops(reader, statistic) -> float | None:
    """Flops `reader` spends merging `statistic` in place (None: it reads the finished value)."""
    lanes = merge_lanes(reader, statistic)
    if lanes is None:
        return None
    return lanes * merge_flops_per_lane(statistic.args[1], statistic_tiles(statistic))


def finalize_cost(statistic, device="h100"):
    """The cost of finishing `statistic` once (`emit.pallas.partials.finalize`): a launch, the
    partials' read, one merge per slot, the finished statistic's write."""
    device = get_device(device)
    nbytes = partials_bytes(statistic) + nbytes_of(statistic.ty)
    tiles = statistic_tiles(statistic)
    flops = statistic_slots(statistic) * merge_flops_per_lane(statistic.args[1], tiles)
    serial = _finalize_serial_seconds(tiles, fields(statistic), statistic_slots(statistic), device)
    return Cost(nbytes, flops, device.launch_overhead + device.memory_seconds(nbytes) + device.vector_seconds(flops)
                + serial)


_statistics_read_memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # terms are interned


def statistics_read(kernel) -> list:
    """The hosted-statistic candidates (`EpilogueReduce` terms) `kernel`'s expressions load."""
    try:
        return list(_statistics_read_memo[kernel])
    except KeyError:
        pass
    found = {}
    for node, _parent in kernel_body(kernel):
        if node.op == "Load" and node.args[0].op == "EpilogueReduce":
            found[id(node.args[0])] = node.args[0]
    _statistics_read_memo[kernel] = tuple(found.values())
    return list(found.values())


