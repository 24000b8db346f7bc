"""The roofline cost of kernel terms.

A kernel costs

    seconds = launch + bytes / hbm_bandwidth + flops / peak          (the SUM form of the roofline)

with `bytes` = every distinct tensor it `Load`s (at full size, or the part it reads through a
`Slice`/`DynamicSlice`/`Gather`) plus its output, and `flops` from shapes:

| kernel | flops |
|---|---|
| `Matmul` | 2·M·N·K = 2 · size(out) · prod(lhs contracting dims) |
| `Conv` | 2 · size(out) · K·kh·kw·Cin/groups = 2 · size(out) · size(weight) / Cout (zero-padded taps of a merged weight excluded); its input expression once per tap and output-channel tile, its per-(batch, channel) nodes once per program and channel chunk (`conv_prologue_flops`, `ConvPrograms`; extraction charges the same: `extract.prologue`) |
| `Matmul` prologues | the A expression once per N tile, the B expression once per M tile (`matmul_prologue_flops`) |
| a hosted statistic's merge | at each reader, as its template runs it: `lanes × tiles × MERGE_INSTRUCTIONS × 2` (`merge_cost`, `eqsat.cost.merges`), or nothing for a statistic the plan finishes once (a `finalize` kernel: `merges.finalize_cost`) |
| `Attention` | 4·B·H·S·Sk·D = 4 · size(q) · Sk |
| `Reduce` | size(body) for a sum/max/...; 3 · size(body) for `moments` (add, centre, FMA the square) |
| `AssignScatter` | size(updates) |
| `Opaque` | size(out) (unknown work: one op per element) |
| `Unary`/`Binary`/`Select` (Expr) | size(type) × the op's instructions (`ALU_INSTRUCTIONS`, 1 for an add) |
| `RowReduce` (Expr) | as `Reduce`, no bytes, no launch (see below) |
| `EpilogueReduce` (Tensor, hosted) | as `Reduce` + its body's ops, its partials' bytes, no launch (`hosted_cost`) |
| views, `Load`, `Acc`, `Lit`, `Iota` | 0 |

`RowReduce` is a reduction recomputed inside the kernel that reads it (row statistics in a
matmul's lhs prologue): its body's loads are the kernel's own reads (shared `Load` e-nodes), so
it owns only its flops (`node_cost`). A `Matmul` kernel's A prologue (a LayerNorm apply and its
row statistics, GEGLU's `value * gelu(gate)`) is charged once per N tile, as each (batch, M tile,
N tile) program computes it (`matmul_prologue_flops`; N tiles of the template's own
`emit.pallas.matmul.MatmulBlocks`), its B prologue once per M tile. Extraction still charges a
matmul's prologue once (`extract.prologue` models the conv's recompute only).

`EpilogueReduce` is a reduction computed by the kernels that write its body (`eqsat.cost.hosting`):
each of their output tiles writes its own partial (a sum, or count/mean/M2 for `moments`) into a
slot of an fp32 partials buffer, and the slots are merged in tile order, either by every kernel
reading the statistic or once by a `finalize` kernel the plan adds after the last host
(`eqsat.cost.merges`: whichever prices lower). Nothing is zeroed (no memset) and nothing is added
atomically. Its bytes are the partials' (`merges.partials_bytes`: every partial row its hosts'
templates write, `merges.statistic_tiles`, times its slots and `PARTIAL_FIELDS` floats; per node,
without the hosts, estimated as one row per `PARTIAL_TILE` reduced elements: `partials_bytes`),
written once by the hosts and read by each reader (`kernel_reads`), or by the finalize, whose
readers then read the finished statistic. One that cannot be hosted runs as its own reduction
kernel.

On a calibrated device (`h100-calibrated`, `h200-calibrated`: `eqsat.cost.devices`) the same counts are priced as our
templates run them (`eqsat.cost.work`): bytes and vector flops at fitted factors of the data sheet,
a `Matmul`/`Conv`/`Attention` kernel's dense work as its template's padded MMA at its instruction's
rate (wgmma or mma.sync) over the SMs its grid fills, plus its serial K steps and (attention) its
softmax's instructions. A compute node's flops count its instructions (`ALU_INSTRUCTIONS`: erf's
polynomial is 22, an add 1). `h100` (the default) is the data sheet alone.

We use the sum rather than `max(bytes/bw, flops/peak)`: it is additive, so a DAG's cost is a sum
over its e-nodes (what an ILP objective needs), and it never calls a kernel free because the
other resource dominates. Matmul/conv/attention on 16-bit operands run at the tensor-core peak,
everything else at the fp32 vector peak.

Two views of the same model:

- `node_cost(op, args, device)`: the cost of ONE e-node's own work, for extractors that add
  costs over a DAG. A kernel node owns launch + output write + its dense flops; a `Load` owns the
  read of its tensor; an Expr op owns its flops; a `TCons` owns the read of its head (operands of
  `Opaque`/`Loop`). Summed over the distinct nodes of an extraction, a tensor read by several
  kernels through the same `Load` e-node is paid once (shared), like the tensor itself.
- `kernel_cost(term, device, finished)`: the cost of one kernel `Term` of a chosen DAG, as the plan
  reports it: each distinct tensor it reads is paid once per kernel, each distinct Expr node's flops
  as often as its template computes it, the merges of the hosted statistics it reads unfinished
  (`merge_cost`; `merge_fraction` is their share). `dag_cost(roots)` sums it over the distinct
  kernels reachable from `roots`, with the finalize kernels the plan adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from eqsat.cost.devices import Device, get_device
from eqsat.types import ints, parse_type

# The cost model must not import the e-graph library, so it does not import `eqsat.lang` (which
# defines the egglog sorts); these mirror `lang.KERNEL_OPS` / `lang.OPS` (a test checks they agree).
# Terms are used by duck typing: `.op`, `.args`, `.children`, `.sort`, `.ty` of `eqsat.term.Term`.
KERNEL_OPS = frozenset(
    {"Pointwise", "Reduce", "Matmul", "Conv", "Attention", "Gather", "AssignStatic", "AssignDynamic",
     "AssignScatter", "Opaque", "Loop"}
)
LEAF_OPS = frozenset({"Input", "Constant", "LoopArg"})
EXPR_OPS = frozenset({"Load", "Acc", "Lit", "Iota", "Unary", "Binary", "Select", "Reshape", "Transpose",
                      "Broadcast", "Slice", "DynamicSlice", "Concat", "Pad", "RowReduce"})
# Tensors computed inside another kernel (its epilogue): no launch of their own when hosted.
HOSTED_OPS = frozenset({"EpilogueReduce"})
KNOWN_OPS = KERNEL_OPS | LEAF_OPS | EXPR_OPS | HOSTED_OPS | {"TNil", "TCons", "Ref"}
Term = object  # eqsat.term.Term, by duck typing

# Expr ops that are index arithmetic: free.
VIEW_OPS = frozenset({"Reshape", "Transpose", "Broadcast", "Slice", "DynamicSlice", "Concat", "Pad"})
# Expr ops that compute one value per element.
COMPUTE_OPS = frozenset({"Unary", "Binary", "Select"})
# Kernels whose flops run on tensor cores (for 16-bit operands).
DENSE_OPS = frozenset({"Matmul", "Conv", "Attention"})

# Reduced elements one partial of an `EpilogueReduce` covers: a producer's output tile (128 x 128).
PARTIAL_TILE = 128 * 128
# fp32 values per partial: a partial sum; count, mean and M2 for moments (`eqsat.moments`).
PARTIAL_FIELDS = {"sum": 1, "moments": 3}
# Flops per reduced element: moments add the element, centre it, and add its square (one FMA).
REDUCTION_FLOPS = {"moments": 3}
# Flops per element of a compute node whose fp32 code is more than one instruction, as `emit.expr`
# lowers it for Triton (an add, a multiply, a compare, a select: 1): erf is its rational polynomial
# (11 FMAs, a clamp, a divide), the transcendental ones libdevice's accurate sequences, a divide and
# a square root the IEEE-rounded iterations. Estimates from the PTX of these sequences, not counted
# per kernel; the calibrated device (`eqsat.cost.work.ALU_FACTOR`) scales them all.
ALU_INSTRUCTIONS = {
    "erf": 22, "erfc": 23, "erf_inv": 30, "exp": 8, "exp2": 2, "expm1": 12, "log": 8, "log1p": 12,
    "tanh": 12, "logistic": 10, "sin": 16, "cos": 16, "tan": 24, "asin": 20, "acos": 20, "atan": 20,
    "sinh": 12, "cosh": 12, "asinh": 16, "acosh": 16, "atanh": 16, "cbrt": 12, "sqrt": 8, "rsqrt": 2,
    "integer_pow": 2, "round": 6, "div": 8, "rem": 10, "pow": 24, "atan2": 30, "nextafter": 4,
}


def compute_flops(op: str, name: str, elements: float) -> float:
    """Flops of a compute node (`Unary`/`Binary` named `name`, or a `Select`) over `elements`."""
    if op == "Select":
        return float(elements)
    return float(elements) * ALU_INSTRUCTIONS.get(str(name).partition(":")[0], 1)


@dataclass(frozen=True)
class Cost:
    """Bytes moved, flops and the roofline seconds of some work."""

    bytes: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.flops + other.flops, self.seconds + other.seconds)


ZERO = Cost()


def _size(ty: str | None) -> int:
    return parse_type(ty).size if ty else 0


def _nbytes(ty: str | None) -> int:
    if not ty:
        return 0
    parsed = parse_type(ty)
    return parsed.size * _itemsize(parsed.dtype)


_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2,
             "float32": 4, "int32": 4, "uint32": 4, "float64": 8, "int64": 8, "uint64": 8}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    from eqsat.types import itemsize  # PRNG keys, complex

    return itemsize(dtype)


def _dtype(ty: str | None) -> str:
    return parse_type(ty).dtype if ty else "float32"


def _conv_out_features(out_ty: str, rhs_ty: str, params: str) -> int:
    """Cout of a conv: the weight's out-feature axis (`rhs_spec`'s first entry, see
    `eqsat.conv_params`), else guessed from the shapes (NHWC or NCHW output)."""
    out_shape, rhs_shape = parse_type(out_ty).shape, parse_type(rhs_ty).shape
    for field in params.split(";"):
        name, _, value = field.partition("=")
        if name == "rhs_spec" and value:
            axis = ints(value)[0]
            if 0 <= axis < len(rhs_shape):
                return rhs_shape[axis]
    for candidate in (out_shape[-1], out_shape[1] if len(out_shape) > 1 else out_shape[-1]):
        if candidate in rhs_shape:
            return candidate
    return max(rhs_shape) if rhs_shape else 1


def nonzero_weight_elements(rhs: Term) -> int:
    """Elements of a conv weight expression that are not zero padding: a merged shortcut's weight
    `concat(pad(w3x3), pad(w1x1))` has size(w3x3) + size(w1x1), not 9 taps of both. The conv template
    runs one K range per concatenated input part, each over its own taps, so zero taps cost nothing."""
    if rhs.op == "Concat":
        return nonzero_weight_elements(rhs.args[0]) + nonzero_weight_elements(rhs.args[1])
    if rhs.op == "Pad" and _is_zero(rhs.args[1]):
        return nonzero_weight_elements(rhs.args[0])
    return _size(rhs.ty)


def _is_zero(value: Term) -> bool:
    return value.op == "Lit" and float(value.args[0]) == 0.0


def own_flops(op: str, args: Sequence, weight_elements: int | None = None) -> float:
    """Flops of one node's own work; `args` aligned with `lang.OPS[op]` (child positions hold types).

    `weight_elements`: a `Conv`'s weight elements that are not zero padding (default: all of them,
    see `nonzero_weight_elements`)."""
    if op in COMPUTE_OPS:
        return compute_flops(op, args[0], _size(args[-1]))
    if op == "Matmul":
        lhs_ty, dims, out_ty = args[0], args[2], args[4]
        contracting = ints(dims.split(";")[0]) if dims else ()
        lhs_shape = parse_type(lhs_ty).shape
        k = math.prod(lhs_shape[i] for i in contracting) if contracting else 1
        return 2.0 * _size(out_ty) * k
    if op == "Conv":
        lhs_ty, rhs_ty, params, out_ty = args[0], args[1], args[2], args[4]
        cout = _conv_out_features(out_ty, rhs_ty, params)
        weights = _size(rhs_ty) if weight_elements is None else weight_elements
        return 2.0 * _size(out_ty) * (weights / max(cout, 1))
    if op == "Attention":
        q_ty, k_ty = args[0], args[1]
        k_shape = parse_type(k_ty).shape
        kv_len = k_shape[-2] if len(k_shape) >= 2 else 1
        return 4.0 * _size(q_ty) * kv_len
    if op in ("Reduce", "RowReduce"):
        return reduction_flops(args[0], _size(args[1]))
    if op == "EpilogueReduce":
        return reduction_flops(args[1], _size(args[2]))
    if op == "AssignScatter":
        return float(_size(args[2]))
    if op == "Opaque":
        return float(_size(args[-1]))
    return 0.0


def reduction_flops(op: str, elements: int) -> float:
    """Flops of reducing `elements` values with reduction `op` (see `REDUCTION_FLOPS`)."""
    return float(REDUCTION_FLOPS.get(op, 1) * elements)


def partials_bytes(op: str, body_ty: str, ty: str) -> float:
    """Bytes of the partials buffer of an `EpilogueReduce(_, op, body, _, ty)` (module docstring):
    `outputs × ceil(reduced / PARTIAL_TILE) × fields × 4`, `outputs` the statistics it computes
    (a `moments` value holds two rows per output), `reduced` the elements each one reduces."""
    outputs = _size(ty) // (2 if op == "moments" else 1)
    if outputs == 0:
        return 0.0
    reduced = _size(body_ty) // outputs
    return float(outputs * max(1, math.ceil(reduced / PARTIAL_TILE)) * PARTIAL_FIELDS.get(op, 1) * 4)


def _own_bytes(op: str, args: Sequence) -> float:
    """Bytes of one node's own memory traffic (kernel output write, a Load's read, a TCons read)."""
    if op == "Load":
        return float(_nbytes(args[1]))
    if op == "TCons":
        return float(_nbytes(args[0]))
    if op in ("AssignStatic", "AssignDynamic"):
        return float(_nbytes(args[2]))  # written in place: only the box
    if op == "AssignScatter":
        return float(_nbytes(args[2]))
    if op in HOSTED_OPS:
        return partials_bytes(args[1], args[2], args[4])
    if op in KERNEL_OPS:
        return float(_nbytes(args[-1]))
    return 0.0


def _dense_dtype(op: str, args: Sequence) -> str:
    return _dtype(args[0]) if op in DENSE_OPS else "float32"


def node_cost(op: str, args: Sequence, device: "str | Device" = "h100", weight_elements: int | None = None,
              conv_ranges: Sequence[tuple[int, int]] | None = None) -> Cost:
    """The cost of one e-node's own work (see the module docstring).

    `args` is aligned with `lang.OPS[op][1]`: literal values at String/i64/f64 positions, the child's
    type string at Tensor/Expr positions, anything (ignored) at TensorList positions.

    >>> node_cost("Binary", ("add", "f32[4]", "f32[4]", "f32[4]"), "h100").flops
    4.0
    """
    device = get_device(device)
    if op not in KNOWN_OPS:
        return ZERO
    flops = own_flops(op, args, weight_elements)
    nbytes = _own_bytes(op, args)
    if op in HOSTED_OPS:
        # Its readers' `Load`s are charged the statistic's size; they read its partials (once here).
        nbytes += max(0.0, nbytes - _nbytes(args[-1]))
    seconds = device.memory_seconds(nbytes)
    if flops:
        seconds += _flop_seconds(op, args, flops, device, weight_elements, conv_ranges=conv_ranges)
    if op in KERNEL_OPS:
        seconds += device.launch_overhead
    return Cost(nbytes, flops, seconds)


def _flop_seconds(op: str, args: Sequence, flops: float, device: Device, weight_elements: int | None = None,
                  kernel: Term | None = None, conv_ranges=None) -> float:
    """Seconds of a node's own flops: a dense kernel's as its template runs them
    (`eqsat.cost.work.mma_seconds`: on a calibrated device the padded MMA at its instruction's rate,
    the serial steps; from `kernel`'s term when given, else from the types), the rest at the vector
    rate."""
    if op not in DENSE_OPS:
        return device.vector_seconds(flops)
    from eqsat.cost import work

    dtype = _dense_dtype(op, args)
    if not device.calibrated:
        return flops / device.peak(dtype, True)
    try:
        template = work.priced_work(kernel) if kernel is not None else \
            work.node_work(op, args, weight_elements, conv_ranges)
    except ValueError:  # a conv the template does not take (grouped, transposed): the roofline's rate
        return flops / device.peak(dtype, True)
    return work.mma_seconds(template, device, dtype)


def _args_of(term: Term) -> tuple:
    """A term's args with children replaced by their types (TensorLists by None)."""
    return tuple(
        (None if a.sort == "TensorList" else a.ty) if not isinstance(a, (str, int, float)) else a
        for a in term.args
    )


def kernel_reads(kernel: Term) -> dict[Term, float]:
    """The tensors `kernel` reads and how many bytes of each (each distinct tensor once).

    A tensor reached only through `Slice`/`DynamicSlice` is charged the slices it reads; the table
    of a `Gather` is charged at most the gathered size; otherwise a tensor is read in full. An
    `EpilogueReduce` is read as its whole partials buffer (`partials_bytes`), which the reader merges.
    """
    full: dict[Term, float] = {}
    partial: dict[Term, float] = {}
    whole: set[Term] = set()
    for node, parent in _kernel_body(kernel):
        if node.sort == "Tensor":
            if node is not kernel and parent is not None and parent.op == "TCons":
                full[node] = _nbytes(node.ty)
                whole.add(node)  # operands of Opaque/Loop/AssignDynamic starts
            continue  # an Assign target is updated in place, not read
        if node.op != "Load":
            continue
        tensor = node.args[0]
        full[tensor] = _stored_bytes(tensor)
        if tensor.op in HOSTED_OPS:
            whole.add(tensor)
        elif parent is not None and parent.op in ("Slice", "DynamicSlice"):
            itemsize = _itemsize(_dtype(tensor.ty))
            partial[tensor] = partial.get(tensor, 0.0) + _size(parent.ty) * itemsize
        elif parent is not None and parent.op == "Gather" and parent.args[0] is node:
            partial[tensor] = partial.get(tensor, 0.0) + _nbytes(parent.ty)
        else:
            whole.add(tensor)
    full.pop(kernel, None)
    reads = {}
    for tensor, size in full.items():
        if tensor in whole or tensor not in partial:
            reads[tensor] = float(size)
        else:
            reads[tensor] = float(min(size, partial[tensor]))
    return reads


def _stored_bytes(tensor: Term) -> float:
    """Bytes of `tensor` in memory: its type's, or its partials' for an `EpilogueReduce`."""
    if tensor.op in HOSTED_OPS:
        from eqsat.cost.hosting import hosts_of
        from eqsat.cost.merges import partials_bytes as hosted_partials_bytes

        if hosts_of(tensor) is not None:
            return hosted_partials_bytes(tensor)
        return _own_bytes(tensor.op, _args_of(tensor))
    return float(_nbytes(tensor.ty))


def _kernel_body(kernel: Term) -> Iterator[tuple[Term, Term | None]]:
    """(node, one parent) for each distinct node of `kernel`'s own expression trees.

    Stops at tensors (yielded with their parent, not descended), skips a `Loop`'s body, and yields
    every (node, parent) pair once so a `Load` used both whole and sliced is seen both ways.
    """
    seen_pairs: set[tuple[int, int]] = set()
    expanded: set[int] = set()
    stack: list[tuple[Term, Term | None]] = [(kernel, None)]
    while stack:
        node, parent = stack.pop()
        pair = (id(node), id(parent))
        if pair in seen_pairs:
            continue
        seen_pairs.add(pair)
        yield node, parent
        if id(node) in expanded or (node is not kernel and node.sort == "Tensor"):
            continue
        expanded.add(id(node))
        children = node.children
        if node.op == "Loop":
            children = (node.args[1],)  # operands only; the body runs inside the loop
        for child in children:
            stack.append((child, node))


def kernel_cost(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> Cost:
    """The roofline cost of one kernel term as planned: launch + reads + write + flops.

    Operand expressions are charged as often as the template computes them (a conv's input per
    tap and output-channel tile, `conv_prologue_flops`; a matmul's A prologue per N tile,
    `matmul_prologue_flops`), and each hosted statistic it reads either merged where it reads it
    (`merge_cost`) or, for a statistic in `finished` (the plan finishes it once:
    `eqsat.cost.merges.finished_statistics`), read as the finished statistic.

    An `EpilogueReduce` passed here is priced as its own Reduce kernel (what it is when it cannot
    be hosted); `hosted_cost` prices it inside its host.
    """
    device = get_device(device)
    if kernel.op not in KERNEL_OPS and kernel.op not in HOSTED_OPS:
        return ZERO
    reads = kernel_reads(kernel)
    for tensor in reads:
        if tensor in finished:
            reads[tensor] = float(_nbytes(tensor.ty))
    nbytes = sum(reads.values()) + _own_bytes(kernel.op, _args_of(kernel))
    weights = nonzero_weight_elements(kernel.args[1]) if kernel.op == "Conv" else None
    dense_flops = own_flops(kernel.op, _args_of(kernel), weights)
    vector_flops = 0.0
    seen: set[int] = set()
    if kernel.op == "Conv":  # its input prologue, as often as the conv template computes it
        vector_flops, covered = conv_prologue_flops(kernel)
        seen |= covered
    elif kernel.op == "Matmul":  # its operand prologues, once per N (A) or M (B) tile
        vector_flops, covered = matmul_prologue_flops(kernel)
        seen |= covered
    for node, _ in _kernel_body(kernel):
        if id(node) in seen or node is kernel:
            continue
        seen.add(id(node))
        if node.op in COMPUTE_OPS:
            vector_flops += compute_flops(node.op, node.args[0], _size(node.ty))
        elif node.op == "RowReduce":
            vector_flops += reduction_flops(node.args[0], _size(node.args[1].ty))
    seconds = device.launch_overhead + device.memory_seconds(nbytes) + device.vector_seconds(vector_flops)
    if dense_flops:
        seconds += _flop_seconds(kernel.op, _args_of(kernel), dense_flops, device, weights, kernel)
    body = Cost()
    if kernel.op == "Loop":
        # The body's kernels, once per launch of the loop (trip counts live in the payload).
        body = dag_cost(_list_items(kernel.args[2]), device)
    return Cost(nbytes, dense_flops + vector_flops, seconds) + body + merge_cost(kernel, device, finished)


def merge_cost(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> Cost:
    """The work `kernel` spends merging the partials of the hosted statistics it reads unfinished
    (not in `finished`), as its template does (`eqsat.cost.merges.reader_merge_flops`)."""
    from eqsat.cost.hosting import hosts_of
    from eqsat.cost.merges import reader_merge_flops, statistics_read

    device = get_device(device)
    if kernel.op not in KERNEL_OPS:
        return ZERO
    flops = 0.0
    for statistic in statistics_read(kernel):
        if statistic in finished or hosts_of(statistic) is None:
            continue
        flops += reader_merge_flops(kernel, statistic) or 0.0
    return Cost(0.0, flops, device.vector_seconds(flops)) if flops else ZERO


def merge_fraction(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> float:
    """The share of `kernel`'s modeled time spent merging hosted statistics' partials."""
    total = kernel_cost(kernel, device, finished).seconds
    return merge_cost(kernel, device, finished).seconds / total if total else 0.0


# --- a conv's input prologue -------------------------------------------------------------------
#
# The conv template (`emit/pallas/conv.py`, an implicit GEMM) computes its input expression at an
# index tile for every window tap and every output-channel tile: each input element once per tap
# that reads it and per `ceil(Cout / block_n)` tiles, at every node of the expression (views and
# broadcasts are index arithmetic: a statistic broadcast over the tile is computed per element).
# Channel ranges split by a concat (`concat(h, skip)`, a merged shortcut) run over their own taps.

# The output-channel tile of the conv template's default config (`emit.pallas.conv.DEFAULT_BLOCK_N`;
# tests/test_emit_conv.py checks they agree).
CONV_BLOCK_N = 128
CONV_BLOCK_M = 128
_MIN_DOT_BLOCK = 16


def conv_output_tiles(out_features: int) -> int:
    """Output-channel tiles of the conv template's default config for `out_features` channels."""
    block = min(CONV_BLOCK_N, max(_MIN_DOT_BLOCK, 1 << max(out_features - 1, 0).bit_length()))
    return -(-out_features // block)


def partial_tiles(body_ty: str) -> int:
    """Tiles of the hosts that write a hosted statistic's partials: one per `PARTIAL_TILE`
    elements of its body (every host tile writes a row, whatever slots it touches)."""
    return max(1, math.ceil(_size(body_ty) / PARTIAL_TILE))


# The conv template's output tile (`emit.pallas.conv.ConvConfig.tile`): up to CONV_BLOCK_W columns
# (a power of two >= 16) by CONV_BLOCK_M // columns rows (at most CONV_MAX_TILE_ROWS) of one image.
CONV_BLOCK_W = 64
CONV_MAX_TILE_ROWS = 4


def conv_tile(out_h: int, out_w: int) -> tuple[int, int]:
    """(rows, columns) of the conv template's default output tile for an `out_h × out_w` image."""
    width = min(CONV_BLOCK_M, CONV_BLOCK_W, max(_MIN_DOT_BLOCK, 1 << max(out_w - 1, 0).bit_length()))
    return max(1, min(CONV_BLOCK_M // width, CONV_MAX_TILE_ROWS, out_h)), width


@dataclass(frozen=True)
class ConvPrograms:
    """How the conv template tiles a conv (`emit.pallas.conv`): a program holds `rows × cols`
    output pixels of one image and one output-channel tile. What its input expression computes per
    (batch, channel) (GroupNorm's scale and shift, a statistic's merge) runs once per program and
    channel chunk on a [1, block_k] tile: `hoisted` evaluations per input element."""

    rows: int                   # the output tile
    cols: int
    tiles: int                  # programs per image and output-channel tile
    hoisted: float              # evaluations per input element of a per-(batch, channel) node
    batch_channels: int         # batch × input channels
    in_rows: int                # the input's spatial size
    in_cols: int

    @classmethod
    def of(cls, lhs_ty: str, params: str, out_ty: str, out_features: int | None = None) -> "ConvPrograms":
        from eqsat.conv_params import ConvParams

        p = ConvParams.parse(params)
        lhs, out = parse_type(lhs_ty).shape, parse_type(out_ty).shape
        out_h, out_w = (out[a] for a in p.out_spec[2:])
        in_h, in_w = (lhs[a] for a in p.lhs_spec[2:])
        rows, cols = conv_tile(out_h, out_w)
        tiles = math.ceil(out_h / rows) * math.ceil(out_w / cols)
        cout = out[p.out_spec[1]] if out_features is None else out_features
        return cls(rows, cols, tiles, tiles * conv_output_tiles(cout) / max(in_h * in_w, 1),
                   lhs[p.lhs_spec[0]] * lhs[p.lhs_spec[1]], in_h, in_w)

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
    """How many times the conv template computes each element of its input expression per pixel:
    each program (`conv_tile`: rows × columns of one image, one output-channel tile) computes, per
    column tap, every input row its output rows read through the row taps, at its columns:
    `tiles × used input rows × column taps × columns × output-channel tiles / input pixels` (4.5 ×
    3 = 13.5 for a 3×3 same conv with 320 output channels on 4 × 32 tiles). `taps` (default: the
    whole window) is a K range's: all of it, or one tap (a merged 1×1 shortcut)."""
    from eqsat.conv_params import ConvParams

    p = ConvParams.parse(params)
    lhs, rhs, out = parse_type(lhs_ty).shape, parse_type(rhs_ty).shape, parse_type(out_ty).shape
    cout = rhs[p.rhs_spec[0]]
    kh, kw = (rhs[a] for a in p.rhs_spec[2:])
    if taps is not None and taps != kh * kw:
        kh, kw = 1, taps
    out_h, out_w = (out[a] for a in p.out_spec[2:])
    in_h, in_w = (lhs[a] for a in p.lhs_spec[2:])
    rows, cols = conv_tile(out_h, out_w)
    (stride_y, _), (dil_y, _) = p.strides, p.rhs_dilation
    input_rows = len({r * stride_y + ky * dil_y for r in range(rows) for ky in range(kh)})
    tiles = math.ceil(out_h / rows) * math.ceil(out_w / cols)
    return tiles * input_rows * kw * cols * conv_output_tiles(cout) / max(in_h * in_w, 1)


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


def _conv_parts(lhs: Term, rhs: Term, lhs_axis: int, rhs_spec: Sequence[int],
                window: tuple[int, ...]) -> list[tuple[Term, int, float]]:
    """The conv template's K ranges: (input expression of the range, taps it runs over, the part
    of that expression's channels the range covers). An input expression wider than its range
    (the weight is a concat there, the input is not) is evaluated at the range's channels only."""
    rhs_axis = rhs_spec[1]
    bounds = {0, parse_type(lhs.ty).shape[lhs_axis]}
    for expr, axis in ((lhs, lhs_axis), (rhs, rhs_axis)):
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
        for expr, axis in ((lhs, lhs_axis), (rhs, rhs_axis)):
            lo, hi = start, stop
            while expr.op == "Concat" and expr.args[2] == axis and (hi <= expr.args[3] or lo >= expr.args[3]):
                if hi <= expr.args[3]:
                    expr = expr.args[0]
                else:
                    expr, lo, hi = expr.args[1], lo - expr.args[3], hi - expr.args[3]
            sides.append(expr)
        weight = sides[1]
        taps = math.prod(window)
        if weight.op == "Pad" and _is_zero(weight.args[1]):  # zero taps are skipped
            inner = zero_pad_taps(weight.args[2], parse_type(weight.args[0].ty).shape, rhs_spec)
            taps = taps if inner is None else inner
        width = parse_type(sides[0].ty).shape[lhs_axis]
        parts.append((sides[0], max(taps, 1), (stop - start) / max(width, 1)))
    return parts


def prologue_node_flops(op: str, points: float, evaluations: float, reduced: int = 0, reduction: str = "",
                        name: str = "") -> float:
    """Flops of one node of a conv's input expression as the template runs it: a compute node once
    per point of its K range's index tile (`points` elements of the range's expression; a statistic
    broadcast over the tile is computed per element), `evaluations` times
    (`conv_prologue_evaluations`); a `RowReduce` reduces its `reduced` elements `evaluations` times;
    views, literals and loads compute nothing (a load's bytes are read once per kernel). `name`:
    a compute node's op name (`compute_flops`)."""
    if op in COMPUTE_OPS:
        return compute_flops(op, name, points) * evaluations
    if op == "RowReduce":
        return reduction_flops(reduction, reduced) * evaluations
    return 0.0


def conv_prologue_flops(conv: Term) -> tuple[float, set[int]]:
    """The flops a `Conv` kernel spends on its input expression as the template runs it, and the
    ids of the expression nodes they cover: each node `prologue_node_flops` per K range it is in.
    A hosted statistic's merge is not included (`conv_prologue_work`, `eqsat.cost.merges`)."""
    flops, covered, _lanes = conv_prologue_work(conv)
    return flops, covered


def conv_prologue_work(conv: Term) -> tuple[float, set[int], dict]:
    """`conv_prologue_flops`, and per hosted statistic the input expression loads, the lanes that
    merge its partials when it is read unfinished: once per program and channel chunk (the
    template hoists what does not vary over the pixels), at every evaluation where it does."""
    from eqsat.conv_params import ConvParams

    lhs, rhs, params, _epilogue, ty = conv.args
    p = ConvParams.parse(params)
    window = tuple(parse_type(rhs.ty).shape[a] for a in p.rhs_spec[2:])
    programs = ConvPrograms.of(lhs.ty, params, ty, parse_type(rhs.ty).shape[p.rhs_spec[0]])
    flops, covered, lanes = 0.0, set(), {}
    for part, taps, fraction in _conv_parts(lhs, rhs, p.lhs_spec[1], p.rhs_spec, window):
        per_point = conv_prologue_evaluations(lhs.ty, rhs.ty, params, ty, taps)
        points = _size(part.ty) * fraction
        stack, seen = [part], set()
        while stack:
            node = stack.pop()
            if id(node) in seen or node.sort != "Expr":
                continue
            seen.add(id(node))
            evaluations = programs.evaluations(node.ty, per_point)
            if node.op == "RowReduce":
                flops += prologue_node_flops(node.op, points, evaluations, _size(node.args[1].ty), node.args[0])
            elif node.op == "Load" and node.args[0].op in HOSTED_OPS:
                statistic = node.args[0]
                lanes[statistic] = lanes.get(statistic, 0.0) + points * programs.evaluations(statistic.ty, per_point)
            else:
                flops += prologue_node_flops(node.op, points, evaluations,
                                             name=node.args[0] if node.op in COMPUTE_OPS else "")
            covered.add(id(node))
            stack.extend(node.children)
    return flops, covered, lanes


def matmul_prologue_flops(matmul: Term) -> tuple[float, set[int]]:
    """The flops a `Matmul` kernel spends on its operand expressions as the template runs them,
    and the ids of the nodes they cover: each program (batch, M tile, N tile) computes its A tile's
    expression (a LayerNorm apply, GEGLU's `value * gelu(gate)`) and its pre-pass row statistics
    over its rows, so the A prologue runs once per N tile (`n_tiles = N / block_n`, the template's
    `MatmulBlocks`), the B prologue once per M tile; the epilogue once per output element."""
    from eqsat.cost.merges import matmul_shape

    lhs, rhs, _dims, _epilogue, _ty = matmul.args
    shape = matmul_shape(matmul)
    flops, covered = 0.0, set()
    for operand, repeats in ((lhs, shape.n_tiles), (rhs, shape.m_tiles)):
        for node in _expr_nodes(operand):
            if id(node) in covered:
                continue
            covered.add(id(node))
            if node.op in COMPUTE_OPS:
                flops += compute_flops(node.op, node.args[0], _size(node.ty)) * repeats
            elif node.op == "RowReduce":
                flops += reduction_flops(node.args[0], _size(node.args[1].ty)) * repeats
    return flops, covered


def _expr_nodes(expr: Term) -> Iterator[Term]:
    """The distinct Expr nodes of `expr`, not entering the tensors it loads."""
    seen: set[int] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen or node.sort != "Expr":
            continue
        seen.add(id(node))
        yield node
        if node.op != "Load":
            stack.extend(node.children)


def hosted_cost(reduction: Term, device: "str | Device" = "h100") -> Cost:
    """What an `EpilogueReduce` adds to the kernels hosting it, all together: its side inputs'
    reads, the write of its partials (one slot per tile, `partials_bytes`) and its body's flops;
    no launch, no memset (every slot is written) and no read of the hosts (their values are the
    tiles being written). Its readers pay for reading the partials (`kernel_reads`)."""
    from eqsat.cost.hosting import hosts_of

    device = get_device(device)
    hosts = {id(h) for h in hosts_of(reduction) or (reduction.args[0],)}
    reads = {t: b for t, b in kernel_reads(reduction).items() if id(t) not in hosts}
    nbytes = sum(reads.values()) + _stored_bytes(reduction)
    flops = own_flops(reduction.op, _args_of(reduction))
    seen: set[int] = set()
    for node, _ in _kernel_body(reduction):
        if id(node) not in seen and node is not reduction and node.op in COMPUTE_OPS:
            seen.add(id(node))
            flops += compute_flops(node.op, node.args[0], _size(node.ty))
    seconds = device.memory_seconds(nbytes) + device.vector_seconds(flops)
    return Cost(nbytes, flops, seconds)


def _list_items(lst) -> list:
    items = []
    while lst.op == "TCons":
        items.append(lst.args[0])
        lst = lst.args[1]
    return items


def kernels(roots: Iterable[Term], hosting: dict | None = None) -> list[Term]:
    """The distinct kernel terms reachable from `roots`, producers first (no recursion).

    A `Loop`'s body belongs to the loop: its kernels are not listed (the `Loop` is one kernel).
    An `EpilogueReduce` is not listed when its producer's kernel hosts it (`eqsat.cost.hosting`);
    that kernel then comes after the reduction's side inputs. One that cannot be hosted is listed.
    `hosting`: `eqsat.cost.hosted_reductions(roots)` when the caller has it already.
    """
    from eqsat.cost.hosting import hosted_reductions, side_inputs

    roots = list(roots)
    if hosting is None:
        hosting = hosted_reductions(roots)
    extra: dict[int, list[Term]] = {}
    for reduction, hosts in hosting.items():
        for host in hosts or ():
            extra.setdefault(id(host), []).extend(side_inputs(reduction))
    order: list[Term] = []
    done: set[int] = set()
    stack: list[tuple[Term, bool]] = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        if ready:
            done.add(id(node))
            if node.op in KERNEL_OPS or (node.op in HOSTED_OPS and hosting.get(node) is None):
                order.append(node)
            continue
        stack.append((node, True))
        children = node.children
        if node.op == "Loop":
            children = (node.args[1],)
        if id(node) in extra:
            children = (*children, *extra[id(node)])
        for child in reversed(children):
            if id(child) not in done:
                stack.append((child, False))
    return order


def count_kernels(roots: Iterable[Term], device: "str | Device" = "h100") -> int:
    """How many kernels launch to compute `roots`: the kernels, and a finalize per statistic the
    plan finishes once (`eqsat.cost.merges.finished_statistics`)."""
    from eqsat.cost.hosting import hosted_reductions
    from eqsat.cost.merges import finished_statistics

    roots = list(roots)
    hosting = hosted_reductions(roots)
    order = kernels(roots, hosting)
    return len(order) + len(finished_statistics(order, hosting, device, roots))


def dag_cost(roots: Iterable[Term], device: "str | Device" = "h100") -> Cost:
    """The cost of computing `roots`: each distinct kernel once (shared tensors are paid once),
    hosted statistics in their hosts, and the finalize of each statistic the plan finishes once."""
    from eqsat.cost.hosting import hosted_reductions
    from eqsat.cost.merges import finalize_cost, finished_statistics

    roots = list(roots)
    hosting = hosted_reductions(roots)
    order = kernels(roots, hosting)
    finished = finished_statistics(order, hosting, device, roots)
    total = Cost()
    for kernel in order:
        total = total + kernel_cost(kernel, device, finished)
    for reduction, hosts in hosting.items():
        if hosts is not None:
            total = total + hosted_cost(reduction, device)
    for statistic in finished:
        total = total + finalize_cost(statistic, device)
    return total
