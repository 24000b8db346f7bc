"""Kernel terms as the cost model reads them: op classes, sizes, own flops and bytes, `Cost`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from eqsat.types import ints, itemsize, parse_type

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
# per kernel; the calibrated device (`eqsat.cost.devices.ALU_FACTOR`) scales them all.
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


def size_of(ty: str | None) -> int:
    return parse_type(ty).size if ty else 0


def nbytes_of(ty: str | None) -> int:
    if not ty:
        return 0
    parsed = parse_type(ty)
    return parsed.size * itemsize_of(parsed.dtype)


ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2,
             "float32": 4, "int32": 4, "uint32": 4, "float64": 8, "int64": 8, "uint64": 8}


def itemsize_of(dtype: str) -> int:
    if dtype in ITEMSIZE:
        return ITEMSIZE[dtype]
    return itemsize(dtype)


def dtype_of(ty: str | None) -> str:
    return parse_type(ty).dtype if ty else "float32"


def conv_out_features(out_ty: str, rhs_ty: str, params: str) -> int:
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
    if rhs.op == "Pad" and is_zero_literal(rhs.args[1]):
        return nonzero_weight_elements(rhs.args[0])
    return size_of(rhs.ty)


def is_zero_literal(value: Term) -> bool:
    return value.op == "Lit" and float(value.args[0]) == 0.0


def own_flops(op: str, args: Sequence, weight_elements: int | None = None) -> float:
    """Flops of one node's own work; `args` aligned with `lang.OPS[op]` (child positions hold types).

    `weight_elements`: a `Conv`'s weight elements that are not zero padding (default: all of them,
    see `nonzero_weight_elements`)."""
    if op in COMPUTE_OPS:
        return compute_flops(op, args[0], size_of(args[-1]))
    if op == "Matmul":
        lhs_ty, dims, out_ty = args[0], args[2], args[4]
        contracting = ints(dims.split(";")[0]) if dims else ()
        lhs_shape = parse_type(lhs_ty).shape
        k = math.prod(lhs_shape[i] for i in contracting) if contracting else 1
        return 2.0 * size_of(out_ty) * k
    if op == "Conv":
        lhs_ty, rhs_ty, params, out_ty = args[0], args[1], args[2], args[4]
        cout = conv_out_features(out_ty, rhs_ty, params)
        weights = size_of(rhs_ty) if weight_elements is None else weight_elements
        return 2.0 * size_of(out_ty) * (weights / max(cout, 1))
    if op == "Attention":
        q_ty, k_ty = args[0], args[1]
        k_shape = parse_type(k_ty).shape
        kv_len = k_shape[-2] if len(k_shape) >= 2 else 1
        return 4.0 * size_of(q_ty) * kv_len
    if op in ("Reduce", "RowReduce"):
        return reduction_flops(args[0], size_of(args[1]))
    if op == "EpilogueReduce":
        return reduction_flops(args[1], size_of(args[2]))
    if op == "AssignScatter":
        return float(size_of(args[2]))
    if op == "Opaque":
        return float(size_of(args[-1]))
    return 0.0


def reduction_flops(op: str, elements: int) -> float:
    """Flops of reducing `elements` values with reduction `op` (see `REDUCTION_FLOPS`)."""
    return float(REDUCTION_FLOPS.get(op, 1) * elements)


def partials_bytes(op: str, body_ty: str, ty: str) -> float:
    """Bytes of the partials buffer of an `EpilogueReduce(_, op, body, _, ty)` (module docstring):
    `outputs × ceil(reduced / PARTIAL_TILE) × fields × 4`, `outputs` the statistics it computes
    (a `moments` value holds two rows per output), `reduced` the elements each one reduces."""
    outputs = size_of(ty) // (2 if op == "moments" else 1)
    if outputs == 0:
        return 0.0
    reduced = size_of(body_ty) // outputs
    return float(outputs * max(1, math.ceil(reduced / PARTIAL_TILE)) * PARTIAL_FIELDS.get(op, 1) * 4)


def partial_tiles(body_ty: str) -> int:
    """Tiles of the hosts that write a hosted statistic's partials: one per `PARTIAL_TILE`
    elements of its body (every host tile writes a row, whatever slots it touches)."""
    return max(1, math.ceil(size_of(body_ty) / PARTIAL_TILE))


def own_bytes(op: str, args: Sequence) -> float:
    """Bytes of one node's own memory traffic (kernel output write, a Load's read, a TCons read)."""
    if op == "Load":
        return float(nbytes_of(args[1]))
    if op == "TCons":
        return float(nbytes_of(args[0]))
    if op in ("AssignStatic", "AssignDynamic"):
        return float(nbytes_of(args[2]))  # written in place: only the box
    if op == "AssignScatter":
        return float(nbytes_of(args[2]))
    if op in HOSTED_OPS:
        return partials_bytes(args[1], args[2], args[4])
    if op in KERNEL_OPS:
        return float(nbytes_of(args[-1]))
    return 0.0


def dense_dtype(op: str, args: Sequence) -> str:
    return dtype_of(args[0]) if op in DENSE_OPS else "float32"


def args_of(term: Term) -> tuple:
    """A term's args with children replaced by their types (TensorLists by None)."""
    return tuple(
        (None if a.sort == "TensorList" else a.ty) if not isinstance(a, (str, int, float)) else a
        for a in term.args
    )


def kernel_body(kernel: Term) -> Iterator[tuple[Term, Term | None]]:
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


def expr_nodes(expr: Term) -> Iterator[Term]:
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


def list_items(lst) -> list:
    items = []
    while lst.op == "TCons":
        items.append(lst.args[0])
        lst = lst.args[1]
    return items


def node_vector_flops(node) -> float:
    """The vector flops of one evaluation of an expression node over its whole type: a compute op's
    (`compute_flops`), a `RowReduce`'s (`reduction_flops`); views, literals and loads compute none."""
    if node.op in COMPUTE_OPS:
        return compute_flops(node.op, node.args[0], size_of(node.ty))
    if node.op == "RowReduce":
        return reduction_flops(node.args[0], size_of(node.args[1].ty))
    return 0.0
