"""The term language: two sorts, `Tensor` (a value in device memory, made by one kernel) and `Expr`
(what a kernel computes per output element).

Every constructor ends with `ty`, the value's type written as a string `"f32[2,320,64,64]"`
(`types.parse_type` reads it back). Types are arguments, not an analysis, so the serialized
e-graph is self-describing: the cost model and the extractor read shapes from the e-nodes.

Conventions shared by every stage:

- Strings that carry integer tuples (axes, permutations, dimension numbers) are comma lists:
  `"0,2,1,3"`; an empty tuple is `""`.
- `Acc(ty)` stands for the accumulator of the enclosing kernel inside its epilogue: for
  `Matmul`, `Conv`, `Reduce` and `Attention` the epilogue is an `Expr` over `Acc` (and any
  other `Load`s at the output index); the identity epilogue is `Acc(ty)` itself.
- Opaque, loop and constant payloads (jaxpr params, nested jaxprs, literal arrays) live in a
  side table of the `Program` and are referenced by a string `key`.
- `Ref(i)` is an unextractable handle used only while building the e-graph (see `egraph.py`).

The op table at the bottom (`OPS`) lists every constructor with its argument sorts; it is the
single source the builder, the serializer readers and the interpreter use.
"""

from __future__ import annotations

import egglog
from egglog import StringLike, f64Like, function, i64Like


class Tensor(egglog.Expr, egg_sort="Tensor"):
    """A value in device memory, produced by exactly one kernel term."""


class Expr(egglog.Expr, egg_sort="Expr"):
    """A per-output-element computation inside a kernel."""


class TensorList(egglog.Expr, egg_sort="TensorList"):
    """A cons list of tensors: the operands of an opaque op or a loop, or a loop body's results."""


# --- Tensor: kernels and leaves -------------------------------------------------------------


@function(egg_fn="Input")
def Input(name: StringLike, ty: StringLike) -> Tensor:
    """A function argument (weights included); not a kernel."""


@function(egg_fn="Constant")
def Constant(key: StringLike, ty: StringLike) -> Tensor:
    """A literal array captured by the jaxpr, stored in the program's side table under `key`."""


@function(egg_fn="Pointwise")
def Pointwise(body: Expr, ty: StringLike) -> Tensor:
    """A kernel writing `body` at every output index."""


@function(egg_fn="Reduce")
def Reduce(op: StringLike, body: Expr, axes: StringLike, epilogue: Expr, ty: StringLike) -> Tensor:
    """`op` in sum/max/min/prod/argmax/argmin over `axes` of `body`; `epilogue` maps `Acc` to the output.

    `op` "moments" (made by `norm_split`) is float32 `[2, *kept]`: `[0]` = mean = sum(body)/n,
    `[1]` = sum((body - mean)^2), both statistics of a norm in one stable reduction
    (`eqsat.moments`: two-pass in the interpreter, per-tile partials merged by Chan's formula in kernels).
    """


@function(egg_fn="Matmul")
def Matmul(lhs: Expr, rhs: Expr, dims: StringLike, epilogue: Expr, ty: StringLike) -> Tensor:
    """`dot_general(lhs, rhs)` with `dims` = "lhs_contract;rhs_contract;lhs_batch;rhs_batch", then `epilogue`."""


@function(egg_fn="Conv")
def Conv(lhs: Expr, rhs: Expr, params: StringLike, epilogue: Expr, ty: StringLike) -> Tensor:
    """`conv_general_dilated(lhs, rhs)` with its static params encoded by `eqsat.conv_params.ConvParams.key`, then `epilogue`."""


@function(egg_fn="Attention")
def Attention(q: Expr, k: Expr, v: Expr, bias: Expr, scale: f64Like, epilogue: Expr, ty: StringLike) -> Tensor:
    """softmax(q·kᵀ·scale + bias)·v over [batch, heads, seq, head_dim] operands, then `epilogue` (flash attention).

    `bias` is an additive score bias of the scores' shape [batch, heads, q_seq, kv_seq] (a causal
    mask, ALiBi, ...), read per score tile and never materialized by this kernel; no bias is
    `Lit(0.0, "f32[B,H,Sq,Sk]")`.
    """


@function(egg_fn="Gather")
def Gather(operand: Expr, indices: Expr, key: StringLike, ty: StringLike) -> Tensor:
    """`lax.gather` (embedding lookups); `key` names its dimension numbers in the side table."""


@function(egg_fn="AssignStatic")
def AssignStatic(target: Tensor, starts: StringLike, value: Expr, ty: StringLike) -> Tensor:
    """A new version of `target` with the box at `starts` (size of `value`) overwritten by `value`."""


@function(egg_fn="AssignDynamic")
def AssignDynamic(target: Tensor, starts: TensorList, value: Expr, ty: StringLike) -> Tensor:
    """`dynamic_update_slice(target, value, *starts)`; `starts` are scalar integer tensors."""


@function(egg_fn="AssignScatter")
def AssignScatter(target: Tensor, indices: Expr, updates: Expr, key: StringLike, ty: StringLike) -> Tensor:
    """`scatter`/`scatter-add` into `target` (`key`: mode and dimension numbers in the side table)."""


@function(egg_fn="EpilogueReduce")
def EpilogueReduce(producer: Tensor, op: StringLike, body: Expr, axes: StringLike, ty: StringLike) -> Tensor:
    """`Reduce(op, body, axes, Acc(ty), ty)`, op sum or moments, computed by the kernel that writes `producer`.

    Not a launch: each output tile of `producer`'s kernel writes its partial reduction (a sum; count,
    mean and M2 for moments) into its own slot of a small fp32 partials buffer while the tile is
    still in registers, and every kernel reading the statistic merges the slots in tile order
    (Chan's formula for moments): no atomics, no memset, a deterministic result. Legal only where
    `body` reads `producer` at the element being written (`eqsat.cost.hosting` checks the extracted
    plan; an illegal one runs as its own reduction kernel writing the same partials).
    Made by the `epilogue_stats` family for normalization statistics.
    """


@function(egg_fn="Opaque")
def Opaque(key: StringLike, operands: TensorList, index: i64Like, ty: StringLike) -> Tensor:
    """Output `index` of a primitive no template covers; runs as the original primitive."""


@function(egg_fn="Loop")
def Loop(key: StringLike, operands: TensorList, body: TensorList, index: i64Like, ty: StringLike) -> Tensor:
    """Output `index` of a `scan`/`while`/`cond`; `body` holds the nested graph's results over `LoopArg`s."""


@function(egg_fn="LoopArg")
def LoopArg(key: StringLike, index: i64Like, ty: StringLike) -> Tensor:
    """Inside the body of loop `key`: its `index`-th argument (carry, constant or scanned slice)."""


@function(egg_fn="Ref", unextractable=True)
def Ref(node: i64Like) -> Tensor:
    """Builder handle for lifted node `node`; lets terms refer to each other without nesting."""


# --- TensorList -----------------------------------------------------------------------------


@function(egg_fn="TNil")
def TNil() -> TensorList:
    """The empty list."""


@function(egg_fn="TCons")
def TCons(head: Tensor, tail: TensorList) -> TensorList:
    """`head` followed by `tail`."""


# --- Expr: per-element computation ----------------------------------------------------------


@function(egg_fn="Load")
def Load(tensor: Tensor, ty: StringLike) -> Expr:
    """The element of `tensor` at the current index (a read from memory)."""


@function(egg_fn="Acc")
def Acc(ty: StringLike) -> Expr:
    """The enclosing kernel's accumulator at the current output index (epilogues only)."""


@function(egg_fn="Lit")
def Lit(value: f64Like, ty: StringLike) -> Expr:
    """A scalar constant splatted to `ty`."""


@function(egg_fn="Iota")
def Iota(dimension: i64Like, ty: StringLike) -> Expr:
    """The index along `dimension`."""


@function(egg_fn="Unary")
def Unary(op: StringLike, x: Expr, ty: StringLike) -> Expr:
    """An elementwise unary op (`exp`, `neg`, `rsqrt`, `convert`, `integer_pow:2`, ...)."""


@function(egg_fn="Binary")
def Binary(op: StringLike, x: Expr, y: Expr, ty: StringLike) -> Expr:
    """An elementwise binary op (`add`, `mul`, `max`, `lt`, ...) on operands of the output's shape."""


@function(egg_fn="Select")
def Select(pred: Expr, on_false: Expr, on_true: Expr, ty: StringLike) -> Expr:
    """`select_n(pred, on_false, on_true)`."""


@function(egg_fn="Reshape")
def Reshape(x: Expr, ty: StringLike) -> Expr:
    """Row-major reshape to `ty`'s shape (index arithmetic)."""


@function(egg_fn="Transpose")
def Transpose(x: Expr, permutation: StringLike, ty: StringLike) -> Expr:
    """`transpose(x, permutation)` (index arithmetic)."""


@function(egg_fn="Broadcast")
def Broadcast(x: Expr, dims: StringLike, ty: StringLike) -> Expr:
    """`broadcast_in_dim(x, ty.shape, dims)` (index arithmetic)."""


@function(egg_fn="Slice")
def Slice(x: Expr, axis: i64Like, start: i64Like, stop: i64Like, stride: i64Like, ty: StringLike) -> Expr:
    """`x[start:stop:stride]` along one `axis`: element i is `x[start + i * stride]`. A negative stride
    walks backwards (`rev` is `Slice(x, a, n - 1, -1, -1)`); rules that reason about `[start, stop)`
    as an interval only match `stride >= 1`."""


@function(egg_fn="DynamicSlice")
def DynamicSlice(x: Expr, axis: i64Like, start: Expr, size: i64Like, ty: StringLike) -> Expr:
    """`x[start:start+size]` along `axis` with a scalar integer `start` (clamped as lax does)."""


@function(egg_fn="Concat")
def Concat(x: Expr, y: Expr, axis: i64Like, split: i64Like, ty: StringLike) -> Expr:
    """`concatenate([x, y], axis)`; `split` is the extent of `x` along `axis`."""


@function(egg_fn="Pad")
def Pad(x: Expr, value: Expr, config: StringLike, ty: StringLike) -> Expr:
    """`lax.pad(x, value, config)` with config "lo,hi,interior;..." per axis."""


@function(egg_fn="RowReduce")
def RowReduce(op: StringLike, body: Expr, axis: i64Like, epilogue: Expr, ty: StringLike) -> Expr:
    """`Reduce(op, body, axis, epilogue, ty)` computed inside the kernel that reads it (not a kernel).

    Same value as `Load(Reduce(op, body, str(axis), epilogue, ty), ty)`; `Acc` in `epilogue` is bound
    to this reduction (not to the enclosing kernel). Legal wherever the reading kernel walks full
    rows of `body` along `axis`: the `row_stats` family only makes it for the row statistics a
    Matmul's lhs prologue reads (LayerNorm moments over the contraction axis K), which the matmul
    computes in a pre-pass over its row block's K strips (moments: the strips' partial moments
    merged by Chan's formula, `eqsat.moments`).
    """


ConstructorArgs = tuple[str, ...]

# name -> (result sort, argument sorts). "String", "i64", "f64" are egglog primitives.
OPS: dict[str, tuple[str, ConstructorArgs]] = {
    "Input": ("Tensor", ("String", "String")),
    "Constant": ("Tensor", ("String", "String")),
    "Pointwise": ("Tensor", ("Expr", "String")),
    "Reduce": ("Tensor", ("String", "Expr", "String", "Expr", "String")),
    "Matmul": ("Tensor", ("Expr", "Expr", "String", "Expr", "String")),
    "Conv": ("Tensor", ("Expr", "Expr", "String", "Expr", "String")),
    "Attention": ("Tensor", ("Expr", "Expr", "Expr", "Expr", "f64", "Expr", "String")),
    "Gather": ("Tensor", ("Expr", "Expr", "String", "String")),
    "AssignStatic": ("Tensor", ("Tensor", "String", "Expr", "String")),
    "AssignDynamic": ("Tensor", ("Tensor", "TensorList", "Expr", "String")),
    "AssignScatter": ("Tensor", ("Tensor", "Expr", "Expr", "String", "String")),
    "EpilogueReduce": ("Tensor", ("Tensor", "String", "Expr", "String", "String")),
    "Opaque": ("Tensor", ("String", "TensorList", "i64", "String")),
    "Loop": ("Tensor", ("String", "TensorList", "TensorList", "i64", "String")),
    "LoopArg": ("Tensor", ("String", "i64", "String")),
    "TNil": ("TensorList", ()),
    "TCons": ("TensorList", ("Tensor", "TensorList")),
    "Load": ("Expr", ("Tensor", "String")),
    "Acc": ("Expr", ("String",)),
    "Lit": ("Expr", ("f64", "String")),
    "Iota": ("Expr", ("i64", "String")),
    "Unary": ("Expr", ("String", "Expr", "String")),
    "Binary": ("Expr", ("String", "Expr", "Expr", "String")),
    "Select": ("Expr", ("Expr", "Expr", "Expr", "String")),
    "Reshape": ("Expr", ("Expr", "String")),
    "Transpose": ("Expr", ("Expr", "String", "String")),
    "Broadcast": ("Expr", ("Expr", "String", "String")),
    "Slice": ("Expr", ("Expr", "i64", "i64", "i64", "i64", "String")),
    "DynamicSlice": ("Expr", ("Expr", "i64", "Expr", "i64", "String")),
    "Concat": ("Expr", ("Expr", "Expr", "i64", "i64", "String")),
    "Pad": ("Expr", ("Expr", "Expr", "String", "String")),
    "RowReduce": ("Expr", ("String", "Expr", "i64", "Expr", "String")),
}

# Kernels: the Tensor constructors that launch. Input/Constant/LoopArg are leaves, not launches.
KERNEL_OPS = frozenset(
    {"Pointwise", "Reduce", "Matmul", "Conv", "Attention", "Gather", "AssignStatic", "AssignDynamic",
     "AssignScatter", "Opaque", "Loop"}
)
LEAF_TENSOR_OPS = frozenset({"Input", "Constant", "LoopArg"})

CONSTRUCTORS = {
    "Input": Input, "Constant": Constant, "Pointwise": Pointwise, "Reduce": Reduce, "Matmul": Matmul,
    "Conv": Conv, "Attention": Attention, "Gather": Gather, "AssignStatic": AssignStatic,
    "AssignDynamic": AssignDynamic, "AssignScatter": AssignScatter, "EpilogueReduce": EpilogueReduce,
    "Opaque": Opaque, "Loop": Loop,
    "LoopArg": LoopArg, "Ref": Ref, "TNil": TNil, "TCons": TCons, "Load": Load, "Acc": Acc, "Lit": Lit,
    "Iota": Iota, "Unary": Unary, "Binary": Binary, "Select": Select, "Reshape": Reshape,
    "Transpose": Transpose, "Broadcast": Broadcast, "Slice": Slice, "DynamicSlice": DynamicSlice,
    "Concat": Concat, "Pad": Pad, "RowReduce": RowReduce,
}
assert set(CONSTRUCTORS) == set(OPS) | {"Ref"}
