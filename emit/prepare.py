"""Weights prepared once: a plan split into a `prepare` stage, the kernels that read only parameters
and constants, and the per-call rest; and the callable that caches the prepared tensors.

    split = split_plan(plan, parameters=("arg0", "arg1"))    # program inputs that stay the same across calls
    split.prepared.kernels, split.per_call.kernels           # two `Plan`s, each in kernel order
    run = Prepared(split, backend="xla")                     # or "pallas", "interpret"
    run(*args)                                               # what emit.emit(plan)(*args) returns

What is prepared:

- every kernel of the plan whose inputs are all parameters, constants or prepared tensors (a
  relayout or concatenation of weights the extraction chose as a kernel of its own); never one an
  effect depends on (a `jax.debug.print` runs at every call), and a statistic computed in the
  epilogues of several kernels only when all of them are prepared;
- the parameter-only operand expressions of the per-call kernels, hoisted out into prepared
  `Pointwise` kernels of their own: the weight concatenation behind a fused QKV, the 22 time
  projections or the 32 text K/V (a `Concat` along N of the weights), the summed biases of a
  merged shortcut, a transposed or converted weight. An expression is hoisted when it computes
  something (more than loads, reshapes, slices and broadcasts) and stores no more bytes than it
  reads. So a bias broadcast to the output stays a broadcast row in the epilogue, and the
  zero-padded 1x1 weight of a merged shortcut stays a K range of its conv (materialized, its zero
  taps would be multiplied): what a template reads in place at no extra cost is left in place.
- weights in the layout the tensor cores read: a per-call matmul's parameter-only operand stored
  `[batch, K, N]` row-major (`[batch, M, K]` on the left; a torch `nn.Linear` weight is `[N, K]`),
  a conv's weight `[window..., in, out]` (OIHW becomes HWIO; each weight under the concats and
  zero pads of a merged shortcut separately, so its K ranges stay). The prepared copy (as many
  bytes as the weight) is read through a `Transpose` view, so a tile of `[K chunk, N chunk]` is
  unit-stride along N: 16-byte loads a warp coalesces, not one 2-byte load per element `K`
  elements apart.

- weights in the layout a Mosaic template reads (`emit.mosaic.layouts`), when the plan's device
  emits its dense kernels on Mosaic GPU: the haloed conv's `[window · C, N↑]` weight where the
  kernel would concatenate (a merged shortcut) or pad it per call, and the phase form's sums of
  taps (a conv over a nearest-2x upsample); a projection's weight with zero columns after each
  head of 40 (to_q/k/v read only by Mosaic attentions, which then read the heads padded to 48 as
  the projection writes them) and to_out's with zero rows (it reads the padded output). The
  template finds the prepared tensor among its context's values by the same interned term; without
  it, it lays the weight out per call (the attention's heads padded by XLA).

The per-call kernels read the prepared tensors they need (`Split.prepared_tensors`, also any
program output the prepare stage computes) as inputs.

Caching (`Prepared`): the prepare stage runs once per set of parameter leaves, cached by identity.
The last set's leaves are held by weak reference (by strong reference when a leaf cannot be weakly
referenced, e.g. a Python or NumPy scalar) with the prepared tensors; a call whose parameter leaves
are the same objects reuses the tensors, any other set (a new params pytree, even an equal one)
recomputes them and replaces the entry, and the entry is dropped as soon as one of its leaves is
garbage collected. jax arrays are immutable, so the same object means the same values; a NumPy
parameter changed in place is not noticed (pass a new array). Under a jax transformation (an outer
`jax.jit`, `grad`, `vmap`: tracer leaves) nothing is cached: the prepare stage is traced with the call.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import jax

from emit.top_level_jit import TopLevelJit
from eqsat.term import Term, postorder
from eqsat.types import ints_key, parse_type, with_shape

# Expression nodes that only read: an operand made of these alone is not worth a prepared kernel.
READING_OPS = frozenset({"Load", "Lit", "Iota", "Reshape", "Slice", "Broadcast"})
# Kernels whose operand expressions are never hoisted: statistics (their bodies decide whether
# they run in a producer's epilogue) and kernels whose operands are tensors, not expressions.
NOT_HOISTED_FROM = frozenset({"EpilogueReduce", "Opaque", "Loop", "AssignScatter"})


@dataclass
class Split:
    """A plan split into its prepare stage and its per-call stage (see the module docstring)."""

    plan: object                    # extract.plan.Plan after hoisting: every kernel of both stages, in order
    prepared: object                # Plan of the kernels run once per set of parameters
    per_call: object                # Plan of the kernels run at every call
    parameters: tuple[str, ...]     # program inputs marked as parameters
    prepared_tensors: list          # what the per-call stage (kernels and outputs) reads from the prepare stage
    hoisted: int                    # prepared kernels made from operand expressions of per-call kernels
    prepare_inputs: tuple[str, ...] = ()   # the parameters the prepare stage reads
    per_call_inputs: tuple[str, ...] = ()  # the program inputs the per-call stage reads

    @property
    def prepared_bytes(self) -> int:
        """Bytes of prepared tensors kept between calls."""
        return sum(_nbytes(t) for t in self.prepared_tensors)

    def prepared_specs(self) -> list[jax.ShapeDtypeStruct]:
        """Abstract values of `prepared_tensors` (to lower or compile the per-call stage alone)."""
        return [_spec(t) for t in self.prepared_tensors]

    def summary(self, depth: int = 1) -> str:
        """The per-call plan's table, then the prepare stage's."""
        return (f"per call:\n{self.per_call.summary(depth)}"
                f"prepared once per set of parameters ({len(self.prepared.kernels)} kernels, {self.hoisted} "
                f"hoisted from per-call operands; {self.prepared_bytes / 1e6:,.1f} MB kept):\n"
                f"{self.prepared.summary(depth)}")


def split_plan(plan, parameters) -> Split:
    """`plan` split into the kernels reading only `parameters` (program input names) and constants,
    run once per set of parameters, and the per-call rest (see the module docstring)."""
    parameters = tuple(dict.fromkeys(parameters))
    names = {t.args[0] for t in plan.program.inputs} if plan.program is not None else set(parameters)
    unknown = [name for name in parameters if name not in names]
    if unknown:
        raise ValueError(f"parameters {unknown} are not inputs of the plan's program ({sorted(names)})")
    marked = frozenset(parameters)
    staged, hoisted = _hoist(plan, marked)
    prepared = _prepared_kernels(staged, marked)
    layouts = _template_layouts(staged, marked, prepared)
    per_call = [k for i, k in enumerate(staged.kernels) if i not in prepared]
    produced = {t for i, k in enumerate(staged.kernels) if i in prepared for t in k.outputs}
    outputs_read, inputs_read = _stage_reads(staged, per_call)
    prepared_tensors = list(dict.fromkeys([t for t in outputs_read if t in produced]
                                          + [t for t in staged.outputs if t in produced]
                                          + [k.term for k in layouts]))
    prepare_kernels = [k for i, k in enumerate(staged.kernels) if i in prepared] + layouts
    _, prepare_inputs = _stage_reads(staged, prepare_kernels)
    program_inputs = [t.args[0] for t in staged.program.inputs] if staged.program is not None else []
    per_call_inputs = [n for n in program_inputs
                       if n not in marked or n in inputs_read or any(o.op == "Input" and o.args[0] == n
                                                                     for o in staged.outputs)]
    return Split(staged, _part(staged, prepare_kernels, prepared_tensors, naive=False),
                 _part(staged, per_call, staged.outputs, naive=True), parameters, prepared_tensors,
                 hoisted + len(layouts),
                 tuple(n for n in program_inputs if n in prepare_inputs), tuple(per_call_inputs))


# --- which kernels are prepared ------------------------------------------------------------------


def _prepared_kernels(plan, parameters: frozenset) -> set[int]:
    """Indices of the kernels of `plan` that read only parameters, constants and prepared tensors,
    none an effect depends on, and no statistic shared with a per-call kernel."""
    producers: dict = {}
    for i, kernel in enumerate(plan.kernels):
        for term in kernel.outputs:
            producers.setdefault(term, []).append(i)
    effect_outputs = plan.program.effect_outputs if plan.program is not None else 0
    effects = plan.outputs[len(plan.outputs) - effect_outputs:] if effect_outputs else []
    effectful = {id(t) for t in postorder(effects)}
    reads = [list(_tensors_read([k.term, *k.outputs], producers)) for k in plan.kernels]
    banned = {i for i, k in enumerate(plan.kernels) if id(k.term) in effectful}
    while True:
        prepared: set[int] = set()

        def available(tensor: Term) -> bool:
            if tensor.op == "Input":
                return tensor.args[0] in parameters
            if tensor.op == "Constant":
                return True
            return tensor in producers and all(j in prepared for j in producers[tensor])

        for i in range(len(plan.kernels)):
            if i not in banned and all(available(t) for t in reads[i]):
                prepared.add(i)
        mixed = {j for hosts in producers.values() if len(hosts) > 1 and any(h in prepared for h in hosts)
                 and not all(h in prepared for h in hosts) for j in hosts}
        if not mixed:
            return prepared
        banned |= mixed


def _tensors_read(roots, producers) -> dict[Term, None]:
    """The inputs, constants and kernel outputs (`producers`' keys) the terms `roots` read, in the
    order first met: kernels' operand expressions, statistics' bodies (their side inputs) and loop
    bodies included, other kernels not entered."""
    roots = list(roots)
    own = {id(root) for root in roots}
    found: dict[Term, None] = {}
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) not in own and (node.op in ("Input", "Constant") or node in producers):
            found[node] = None
            continue
        stack.extend(reversed(node.children))
    return found


def _stage_reads(plan, kernels) -> tuple[list[Term], set[str]]:
    """(tensors of other kernels, program input names) that `kernels` read."""
    producers = {t: None for k in plan.kernels for t in k.outputs}
    own = {t for k in kernels for t in k.outputs}
    found = _tensors_read([t for k in kernels for t in k.outputs], producers)
    return ([t for t in found if t in producers and t not in own],
            {t.args[0] for t in found if t.op == "Input"})


# --- weight layouts a Mosaic template reads ------------------------------------------------------


def _template_layouts(plan, parameters: frozenset, prepared: set[int]) -> list:
    """Prepared `Pointwise` kernels (`extract.plan.Kernel`s, after the plan's own) for the weight
    layouts the Mosaic templates of the per-call kernels read (`emit.mosaic.layouts`: the haloed
    conv's weight concatenated, padded or summed into its phase form), each from parameters and
    prepared tensors only; none unless the plan's device emits its dense kernels on Mosaic GPU
    (`mosaic`, or `auto` where the model routes the kernel there)."""
    from emit.backends import plan_routes, runs_on_mosaic
    from emit.mosaic.layouts import halo_weight_layout
    from eqsat.cost import get_device
    from extract.plan import Plan

    backend = get_device(plan.device).backend
    if backend not in ("mosaic", "auto"):
        return []
    routes = plan_routes(plan) if backend == "auto" else {}
    producers = {t: i for i, k in enumerate(plan.kernels) for t in k.outputs}

    def available(tensor: Term) -> bool:
        if tensor.op == "Input":
            return tensor.args[0] in parameters
        return tensor.op == "Constant" or producers.get(tensor) in prepared

    layouts, host_of = {}, {}
    for i, kernel in enumerate(plan.kernels):
        if i in prepared or not runs_on_mosaic(kernel.term) or routes.get(kernel.term, "mosaic") != "mosaic":
            continue
        layout = halo_weight_layout(kernel.term) if kernel.op == "Conv" else None
        if layout is None or layout in layouts or not all(
                available(node.args[0]) for node in _expr_postorder([layout.args[0]]) if node.op == "Load"):
            continue
        layouts[layout], host_of[layout] = kernel, i
    mosaic = {i for i, k in enumerate(plan.kernels) if i not in prepared and runs_on_mosaic(k.term)
              and routes.get(k.term, "mosaic") == "mosaic"}
    for layout, i in _projection_layouts(plan, mosaic).items():
        if layout not in layouts and all(available(node.args[0]) for node in _expr_postorder([layout.args[0]])
                                         if node.op == "Load"):
            layouts[layout], host_of[layout] = plan.kernels[i], i
    if not layouts:
        return []
    class_of = {t: plan.kernels[host_of[t]].eclass for t in layouts if plan.kernels[host_of[t]].eclass is not None}
    components = {k.eclass: k.component for k in layouts.values() if k.eclass is not None}
    built = Plan.build(list(layouts), program=plan.program, class_of=class_of, class_components=components,
                       device=plan.device, extractor=plan.extractor)
    return [k for k in built.kernels if k.term in layouts]


def _projection_layouts(plan, mosaic: set[int]) -> dict:
    """`emit.mosaic.layouts.head_padded_weight` of each per-call Mosaic `Matmul` whose output only
    Mosaic attentions read, each as heads of D that wgmma pads (40 -> 48) and that the attention
    then reads as the projection writes them (`eqsat.cost.mosaic.padded_by_projection`: a prepared
    weight, an epilogue keeping 0 at 0), and, rows padded, of each one reading a Mosaic attention's
    padded output (`reads_padded_heads`: to_out): layout -> the matmul's index. The projection
    writes its heads padded (zero columns), to_out reads them so (zero rows): no XLA fusion pads q,
    k or v or slices the output."""
    from emit.mosaic.layouts import head_padded_weight
    from eqsat.cost.mosaic import padded_by_projection, reads_padded_heads
    from eqsat.tiling.mosaic import AttentionBlocks

    producers = {t: i for i, k in enumerate(plan.kernels) for t in k.outputs}
    readers: dict[Term, set[int]] = {}
    for i, kernel in enumerate(plan.kernels):
        for tensor in _tensors_read([kernel.term, *kernel.outputs], producers):
            readers.setdefault(tensor, set()).add(i)
    heads: dict[Term, set] = {}   # projection -> the head widths its attention readers read it at
    refused: set[Term] = set(plan.outputs)
    for i in sorted(mosaic):
        kernel = plan.kernels[i]
        if kernel.op != "Attention":
            continue
        q, k, v = kernel.term.args[:3]
        _, _, q_len, head_dim = parse_type(q.ty).shape
        blocks = AttentionBlocks.get_default(q_len, parse_type(k.ty).shape[2], head_dim)
        tiles = (blocks.block_q * blocks.compute_wgs, blocks.block_kv, blocks.block_kv)
        for operand, tile in zip((q, k, v), tiles):
            found = padded_by_projection(operand, tile)
            loads = {node.args[0] for node in _expr_postorder([operand]) if node.op == "Load"}
            if found is None:
                refused |= loads
            else:
                heads.setdefault(found.tensor, set()).add(head_dim)
    out = {}
    for i in sorted(mosaic):  # to_out reading an attention's padded output: its weight's rows padded
        kernel = plan.kernels[i]
        if kernel.op != "Matmul":
            continue
        lhs, rhs, dims = kernel.term.args[:3]
        found = reads_padded_heads(lhs, rhs, dims)
        if found is not None and producers.get(found[0]) in mosaic:
            layout = head_padded_weight(kernel.term, found[1], rows=True)
            if layout is not None:
                out[layout] = i
    for projection, widths in heads.items():
        host = producers.get(projection)
        if projection in refused or len(widths) != 1 or host not in mosaic or plan.kernels[host].hosted:
            continue
        if not all(plan.kernels[r].op == "Attention" and r in mosaic for r in readers.get(projection, ())):
            continue
        layout = head_padded_weight(plan.kernels[host].term, next(iter(widths)))
        if layout is not None:
            out[layout] = host
    return out


# --- hoisting parameter-only operands ------------------------------------------------------------


def _hoist(plan, parameters: frozenset):
    """(`plan` with the parameter-only operand expressions of its per-call kernels computed by
    prepared `Pointwise` kernels, how many such kernels)."""
    from extract.plan import Plan, _flatten

    prepared = _prepared_kernels(plan, parameters)
    produced = {t for i, k in enumerate(plan.kernels) if i in prepared for t in k.outputs}

    def available(tensor: Term) -> bool:
        if tensor.op == "Input":
            return tensor.args[0] in parameters
        return tensor.op == "Constant" or tensor in produced

    targets = {}  # kernel term -> {expr node: replacement}
    for i, kernel in enumerate(plan.kernels):
        if i in prepared or kernel.op in NOT_HOISTED_FROM:
            continue
        hoisted = _hoistable(kernel.term, available)
        if kernel.op == "Matmul":
            hoisted = _mma_layouts(kernel.term, available, hoisted)
        elif kernel.op == "Conv":
            hoisted = _conv_weight_layouts(kernel.term, available, hoisted)
        if hoisted:
            targets[kernel.term] = hoisted
    if not targets:
        return plan, 0
    mapping: dict[Term, Term] = {}
    for node in postorder(plan.outputs):
        if node in targets:
            mapping[node] = _rebuild_kernel(node, targets[node], mapping)
        else:
            mapping[node] = _rebuilt(node, lambda child: mapping[child])
    kernels = _flatten(plan.kernels)
    class_of, class_components = {}, {}
    for n, kernel in enumerate(kernels):
        key = kernel.eclass if kernel.eclass is not None else -1 - n
        class_components[key] = kernel.component
        for term in kernel.outputs[:1] if kernel.op != "Loop" else kernel.outputs:
            class_of[mapping.get(term, term)] = key
    staged = Plan.build([mapping[t] for t in plan.outputs], program=plan.program, class_of=class_of,
                        class_components=class_components, device=plan.device, extractor=plan.extractor)
    new = {node for replacements in targets.values() for node in replacements.values()}
    return staged, len(new)


def _hoistable(kernel: Term, available) -> dict[Term, Term]:
    """The topmost expressions of `kernel`'s operands worth a prepared kernel -> `Load` of it."""
    from emit.pallas import kernel_exprs

    ok: dict[int, bool] = {}       # reads only available tensors, and not the kernel's Acc
    free_acc: dict[int, bool] = {}
    roots = kernel_exprs(kernel)
    for node in _expr_postorder(roots):
        if node.op == "Load":
            ok[id(node)], free_acc[id(node)] = available(node.args[0]), False
            continue
        exprs = [c for c in node.children if c.sort == "Expr"]
        bound = exprs[:1] if node.op == "RowReduce" else exprs  # a RowReduce binds its epilogue's Acc
        free_acc[id(node)] = node.op == "Acc" or any(free_acc[id(c)] for c in bound)
        ok[id(node)] = not free_acc[id(node)] and all(ok[id(c)] for c in exprs)
    found: dict[Term, Term] = {}
    stack = list(roots)
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if ok[id(node)]:
            if _worth_preparing(node):
                found[node] = Term("Load", Term("Pointwise", node, node.ty), node.ty)
                continue
            inner = _unbroadcast(node)  # b1 + b2 broadcast to the output: prepare b1 + b2, broadcast it
            if inner is not None and _worth_preparing(inner[0]):
                value, dims = inner
                found[node] = Term("Broadcast", Term("Load", Term("Pointwise", value, value.ty), value.ty), dims,
                                   node.ty)
                continue
        stack.extend(c for c in node.children if c.sort == "Expr")
    return found


def _mma_layouts(kernel: Term, available, hoisted: dict[Term, Term]) -> dict[Term, Term]:
    """`hoisted` (a Matmul's operand expressions -> their replacements) with each operand that reads
    only parameters stored the way the tensor cores read it: the weight `[batch, K, N]` row-major
    (a B tile's rows are unit-stride runs along N), the left operand `[batch, M, K]`. An operand
    laid out otherwise (a torch `nn.Linear` weight `[N, K]`, contracted on its last axis) is
    prepared transposed, and the kernel reads it through a `Transpose` view (index arithmetic)."""
    from emit.pallas.matmul import DotAxes

    lhs, rhs, dims, _epilogue, _ty = kernel.args
    axes = DotAxes.of(dims, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape)
    wanted = ((lhs, axes.lhs_batch + axes.lhs_free + axes.lhs_contract),
              (rhs, axes.rhs_batch + axes.rhs_contract + axes.rhs_free))
    out = dict(hoisted)
    for operand, order in wanted:
        shape = parse_type(operand.ty).shape
        if _in_order(order, shape):
            continue
        replaced = hoisted.get(operand)
        if replaced is not None and replaced.op != "Load":
            continue  # an elementwise sum of broadcast parameters: prepared unbroadcast, read as a broadcast
        if replaced is None and not _reads_parameters_only(operand, available):
            continue
        inside = {id(node) for node in _expr_postorder([operand])}
        out = {node: value for node, value in out.items() if id(node) not in inside}
        out[operand] = _relaid(operand, order)
    return out


def _conv_weight_layouts(kernel: Term, available, hoisted: dict[Term, Term]) -> dict[Term, Term]:
    """`hoisted` with each weight a Conv reads (its rhs, and the parts of the rhs under concats
    along in-features and zero pads of the window: a merged shortcut's K ranges) stored
    `[window..., in, out]` row-major (OIHW prepared as HWIO): a weight tile `[in chunk, out
    chunk]` of one tap reads unit-stride runs along the output channels."""
    from eqsat.conv_params import ConvParams

    rhs, params = kernel.args[1], ConvParams.parse(kernel.args[2])
    order = (*params.rhs_spec[2:], params.rhs_spec[1], params.rhs_spec[0])
    out = dict(hoisted)
    stack = [rhs]
    while stack:
        node = stack.pop()
        replaced = out.get(node)
        if replaced is None and node.op in ("Concat", "Pad"):  # same axes as the weight: K ranges, zero taps
            stack.extend(node.args[:2] if node.op == "Concat" else node.args[:1])
            continue
        if _in_order(order, parse_type(node.ty).shape):
            continue
        if replaced is not None and replaced.op == "Load" or \
                replaced is None and node.op == "Load" and _reads_parameters_only(node, available):
            out[node] = _relaid(node, order)
    return out


def _relaid(operand: Term, order) -> Term:
    """`operand` read through a `Transpose` view of a prepared copy stored with axes `order`."""
    shape = parse_type(operand.ty).shape
    stored = Term("Transpose", operand, ints_key(order), with_shape(operand.ty, [shape[a] for a in order]))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return Term("Transpose", Term("Load", Term("Pointwise", stored, stored.ty), stored.ty), ints_key(inverse),
                operand.ty)


def _in_order(order, shape) -> bool:
    """Whether axes `order` of a row-major tensor of `shape` are stored in that order (size-1 axes
    aside): a tile along the last of them reads unit-stride runs."""
    kept = [axis for axis in order if shape[axis] != 1]
    return kept == sorted(kept)


def _reads_parameters_only(expr: Term, available) -> bool:
    """It loads something, only available tensors (parameters, constants, prepared), no `Acc`, and
    stores no more bytes than it reads (a weight, a slice or reshape of one; not a broadcast)."""
    loads: dict[int, Term] = {}
    for node in _expr_postorder([expr]):
        if node.op == "Acc":
            return False
        if node.op == "Load":
            if not available(node.args[0]):
                return False
            loads[id(node.args[0])] = node.args[0]
    return bool(loads) and _nbytes(expr) <= sum(_nbytes(t) for t in loads.values())


def _worth_preparing(expr: Term) -> bool:
    """It computes something and stores no more bytes than the tensors it reads."""
    loads: dict[int, Term] = {}
    computes = False
    for node in _expr_postorder([expr]):
        computes = computes or node.op not in READING_OPS
        if node.op == "Load":
            loads[id(node.args[0])] = node.args[0]
    return computes and bool(loads) and _nbytes(expr) <= sum(_nbytes(t) for t in loads.values())


def _unbroadcast(expr: Term):
    """`(value, dims)` with `expr == Broadcast(value, dims)` when `expr` is elementwise work on
    operands broadcast the same way (and literals), else None."""
    if expr.op == "Broadcast":
        return expr.args[0], expr.args[1]
    if expr.op == "Unary":
        inner = _unbroadcast(expr.args[1])
        if inner is None:
            return None
        value, dims = inner
        return Term("Unary", expr.args[0], value, with_shape(expr.ty, parse_type(value.ty).shape)), dims
    if expr.op == "Binary":
        sides = [None if side.op == "Lit" else _unbroadcast(side) for side in expr.args[1:3]]
        known = [side for side in sides if side is not None]
        if not known or len(known) + sum(side.op == "Lit" for side in expr.args[1:3]) != 2:
            return None
        value, dims = known[0]
        shape = parse_type(value.ty).shape
        if any(d != dims or parse_type(v.ty).shape != shape for v, d in known):
            return None
        operands = [side[0] if side is not None else Term("Lit", lit.args[0], with_shape(lit.ty, shape))
                    for side, lit in zip(sides, expr.args[1:3])]
        return Term("Binary", expr.args[0], *operands, with_shape(expr.ty, shape)), dims
    return None


def _expr_postorder(roots):
    """The Expr nodes under `roots`, children first, not entering the tensors they load."""
    seen: set[int] = set()
    stack = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            yield node
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in node.children if c.sort == "Expr" and id(c) not in seen)


def _rebuilt(node: Term, new) -> Term:
    """`node` with each child `c` replaced by `new(c)` (the same object when none changed)."""
    args = [new(a) if isinstance(a, Term) else a for a in node.args]
    if all(arg is old for arg, old in zip(args, node.args)):
        return node
    return Term(node.op, *args)


def _rebuild_kernel(kernel: Term, replacements: dict, mapping: dict) -> Term:
    """`kernel` with the operand expressions in `replacements` replaced by theirs and the tensors
    it reads by their `mapping`."""
    local: dict[Term, Term] = {}

    def new(child: Term) -> Term:
        return local[child] if child.sort == "Expr" else mapping.get(child, child)

    from emit.pallas import kernel_exprs

    for node in _expr_postorder(kernel_exprs(kernel)):
        local[node] = replacements[node] if node in replacements else _rebuilt(node, new)
    return _rebuilt(kernel, new)


# --- the two stages as plans ---------------------------------------------------------------------


def _part(plan, kernels, outputs, *, naive: bool):
    """A `Plan` of some of `plan`'s kernels computing `outputs`; what they read from the others is
    an input. `naive`: keep the naive counts (the per-call part stands for the whole program)."""
    from extract.plan import Plan, _buffers, _peak

    kernels = [dataclasses.replace(k, index=i) for i, k in enumerate(kernels)]
    buffers = _buffers([k.outputs for k in kernels], [k.inputs for k in kernels], outputs)
    part = Plan(kernels, buffers, list(outputs), plan.device, plan.extractor, plan.program)
    part.peak_bytes = _peak(buffers, len(kernels))
    part.hosted_reductions = len({t for k in kernels for t in k.hosted})
    if naive:
        part.naive_kernels = plan.naive_kernels
        part.naive_by_component = dict(plan.naive_by_component)
        part.naive_loop_body_kernels = plan.naive_loop_body_kernels
    return part


def _nbytes(term: Term) -> int:
    from extract.plan import _nbytes as stored_bytes

    return int(stored_bytes(term))


def _spec(term: Term) -> jax.ShapeDtypeStruct:
    ty = parse_type(term.ty)
    return jax.ShapeDtypeStruct(tuple(ty.shape), ty.dtype)


# --- running: the prepare stage cached by identity, the per-call stage at every call -------------


class Prepared:
    """A split plan as a callable of the original function's arguments: the prepare stage runs once
    per set of parameter leaves (cached by identity, see the module docstring), the per-call stage
    at every call. `prepare_runs` counts the prepare stage's runs, `cache_hits` the calls that
    reused its tensors. On several devices the per-call stage of a Pallas backend runs partitioned
    by the shardings of its inputs and prepared tensors (`emit.sharded`)."""

    def __init__(self, split: Split, backend: str = "auto", *, interpret: bool | None = None, donate=(),
                 progress=None, exported=None, compiler_options=None):
        from emit import resolve_backend

        if split.plan.program is None:
            raise ValueError("this plan has no program: emit needs Program.environment/results to bind arguments")
        donated = set(donate) & set(split.parameters)
        if donated:
            raise ValueError(f"inputs {sorted(donated)} are both donated and parameters: a parameter stays "
                             f"the same across calls, a donated buffer is consumed by one")
        self.split = split
        self.backend = resolve_backend(backend)
        self.interpret = None if interpret is None else bool(interpret)
        self.donate = tuple(name for name in split.per_call_inputs if name in set(donate))
        self.progress = progress  # the bar of kernels emitted while tracing (`emit.pallas.emission_bar`)
        self.prepare_runs = 0
        self.cache_hits = 0
        # `emit.exported.ExportedStages`: the stages as stored StableHLO, for concrete calls on one device
        self.exported = exported if self.backend != "interpret" else None
        self._entry: _Entry | None = None
        # XLA's options for compiling the stages (`driver.xla_kernel_cache`: its kernel cache file)
        self.compiler_options = dict(compiler_options or {})
        prepare = dict(label="prepare", kernels=len(split.prepared.kernels), progress=progress)  # compile status
        per_call = dict(kernels=len(split.per_call.kernels), progress=progress)
        self._prepare_jitted = TopLevelJit(self._prepare_stage, self.compiler_options, **prepare)
        self._per_call_jitted = TopLevelJit(self._per_call_stage, self.compiler_options, **per_call)
        self._per_call_donating = TopLevelJit(self._per_call_donating_stage, self.compiler_options, donate_argnums=0,
                                              **per_call)

    @property
    def program(self):
        return self.split.plan.program

    @property
    def plan(self):
        return self.split.plan

    def __call__(self, *args, **kwargs):
        env = self.program.environment(*args, **kwargs)
        prepared = self.prepared_for([env[name] for name in self.split.prepare_inputs])
        return self.program.results(self._per_call(env, prepared))

    def leaf_route(self, tree) -> "LeafRoute":
        """This plan called on the flat argument leaves of `tree` (`jax.tree_util.tree_flatten((args,
        kwargs))`, no static arguments): what `optimize` calls once a signature has run (see
        `LeafRoute`)."""
        return LeafRoute(self, tree)

    def prepare(self, *args, **kwargs) -> list:
        """The prepared tensors for these arguments (from the cache when their parameters are the
        same objects as last time)."""
        env = self.program.environment(*args, **kwargs)
        return self.prepared_for([env[name] for name in self.split.prepare_inputs])

    def per_call(self, prepared, *args, **kwargs):
        """The per-call stage alone on `prepared` (values or `Split.prepared_specs()` under a trace)."""
        return self.program.results(self._per_call(self.program.environment(*args, **kwargs), list(prepared)))

    def prepared_for(self, parameters: list) -> list:
        """The prepare stage's outputs for the parameter leaves `parameters` (`split.prepare_inputs`)."""
        if not self.split.prepared_tensors:
            return []  # nothing is prepared: nothing to run or cache
        if any(isinstance(leaf, jax.core.Tracer) for leaf in parameters):
            return self._prepare(parameters)  # traced with the call: nothing to cache
        entry = self._entry
        if entry is not None and entry.holds(parameters):
            self.cache_hits += 1
            return entry.values
        self._entry = None  # the old tensors are freed before the new ones are computed
        values = self._prepare(parameters)
        self.prepare_runs += 1
        if any(isinstance(value, jax.core.Tracer) for value in values):
            return values  # concrete parameters inside a trace (a differentiated call's jit): not kept past it
        self._entry = _Entry(parameters, values, self)
        return values

    def _forget(self, entry) -> None:
        if self._entry is entry:
            self._entry = None

    def _prepare(self, parameters: list) -> list:
        if self.backend == "interpret":
            return self._interpret(dict(zip(self.split.prepare_inputs, parameters)), {}, self.split.prepared_tensors)
        if self.exported is not None:
            out = self.exported.call("prepare", self._prepare_stage, list(parameters))
            if out is not None:
                return out
        return self._prepare_jitted(list(parameters))

    def _per_call(self, env: dict, prepared: list):
        if self.backend == "interpret":
            leaves = {name: env[name] for name in self.split.per_call_inputs}
            return self._interpret(leaves, dict(zip(self.split.prepared_tensors, prepared)), self.split.plan.outputs)
        if self.donate:
            donated = [env[name] for name in self.donate]
            kept = [env[name] for name in self.split.per_call_inputs if name not in self.donate]
            return self._per_call_donating(donated, kept, prepared)
        leaves = [env[name] for name in self.split.per_call_inputs]
        if self.exported is not None:
            out = self.exported.call("per_call", self._per_call_stage, leaves, list(prepared))
            if out is not None:
                return out
        return self._per_call_jitted(leaves, prepared)

    def per_call_callable(self, leaves: list, prepared: list):
        """What `_per_call` calls for concrete `leaves` and `prepared` of this signature, as one
        callable `(leaves, prepared) -> values` (the exported stage's jitted call, else the jitted
        stage)."""
        if self.exported is not None:
            stage = self.exported.callable("per_call", self._per_call_stage, leaves, list(prepared))
            if stage is not None:
                return lambda leaves, prepared: stage(leaves, list(prepared))
        return self._per_call_jitted

    def _interpret(self, env: dict, known: dict, terms: list) -> list:
        from eqsat.interpret import _Evaluator

        program = self.program
        evaluator = _Evaluator(env, program.constants, program.payloads)
        evaluator.values.update(known)
        return evaluator.run(list(terms))

    def _run(self, plan, inputs: dict, known: dict, terms: list) -> list:
        from emit import kernel_calls
        from emit.backends import plan_routes
        from emit.pallas import EmitContext, run_kernels

        program = self.program
        values = {term: inputs[term.args[0]] for term in program.inputs if term.args[0] in inputs}
        values.update(known)
        ctx = EmitContext(values, program.constants, program.payloads, interpret=self.interpret,
                          backend=self.backend, components=program.components, progress=self.progress,
                          routes=plan_routes(plan) if self.backend == "routed" else {})
        run_kernels(kernel_calls(plan), ctx)
        return [ctx.value(term) for term in terms]

    def _prepare_stage(self, parameters):
        return self._run(self.split.prepared, dict(zip(self.split.prepare_inputs, parameters)), {},
                         self.split.prepared_tensors)

    def _per_call_stage(self, leaves, prepared):
        if self.backend in ("pallas", "hybrid") and jax.device_count() > 1:  # partitioned by the shardings
            return list(self.sharded.run([*leaves, *prepared], self.backend, self.interpret))
        return self._run(self.split.per_call, dict(zip(self.split.per_call_inputs, leaves)),
                         dict(zip(self.split.prepared_tensors, prepared)), self.split.plan.outputs)

    def _per_call_donating_stage(self, donated, kept, prepared):
        kept = iter(kept)
        by_name = dict(zip(self.donate, donated))
        leaves = [by_name[name] if name in by_name else next(kept) for name in self.split.per_call_inputs]
        return self._per_call_stage(leaves, prepared)

    @property
    def sharded(self):
        """The per-call stage's batch axes and partitionings over device meshes (`emit.sharded`):
        it takes the per-call inputs and the prepared tensors."""
        if getattr(self, "_sharded", None) is None:
            from emit.sharded import ShardedPlan

            inputs = {term.args[0]: term for term in self.program.inputs}
            leaves = [inputs[name] for name in self.split.per_call_inputs] + list(self.split.prepared_tensors)
            self._sharded = ShardedPlan(self.split.per_call, device=self.split.plan.device, leaves=leaves,
                                        outputs=self.split.plan.outputs)
        return self._sharded

    def __getstate__(self):
        return {"split": self.split, "backend": self.backend, "interpret": self.interpret, "donate": self.donate,
                "progress": self.progress}

    def __setstate__(self, state):
        self.__init__(state["split"], state["backend"], interpret=state["interpret"], donate=state["donate"],
                      progress=state.get("progress"))

    def __repr__(self) -> str:
        split = self.split
        return (f"Prepared({len(split.prepared.kernels)} prepared + {len(split.per_call.kernels)} per-call "
                f"kernels, backend={self.backend})")


class LeafRoute:
    """One signature's calls on flat argument leaves, with the per-leaf Python work of a call done
    once: a call of an optimized function with prepared parameters walks its ~700 UNet leaves once
    (flatten, then an identity check of the parameters against the prepared ones), where the general
    path walks them six times (signature, tracers, environment, export key) and cost ~1 ms of host
    time per call, more than `jax.jit`'s whole dispatch.

    `prepared_values(leaves)` says whether a call may take this route: the parameter leaves are the very
    objects the prepared tensors were made from (so their shapes and dtypes are the signature's),
    and the few per-call leaves are concrete arrays of the signature's shapes and dtypes. Anything
    else (new weights, a tracer, another shape) goes the general way, which re-prepares or re-plans.
    """

    def __init__(self, prepared: Prepared, tree):
        names = [term.args[0] for term in prepared.program.inputs]
        index = {name: i for i, name in enumerate(names)}
        self.prepared = prepared
        self.tree = tree
        self.parameter_positions = [index[name] for name in prepared.split.prepare_inputs]
        self.per_call_positions = [index[name] for name in prepared.split.per_call_inputs]
        self.per_call_avals = None  # (shape, dtype) per per-call leaf, set by the first routed call
        self._stage = None  # the per-call stage's jitted callable, resolved by the first routed call
        self.calls = 0

    def prepared_values(self, leaves: list) -> list | None:
        """The prepared tensors a call on `leaves` may take this route with, or None (see the class
        docstring). The entry is read once: another thread preparing other weights meanwhile cannot
        hand this call theirs."""
        prepared = self.prepared
        values: list = []
        if prepared.split.prepared_tensors:
            entry = prepared._entry
            if entry is None or not entry.holds([leaves[i] for i in self.parameter_positions]):
                return None
            values = entry.values
        avals = self.per_call_avals
        if avals is None or not all(_leaf_aval(leaves[i]) == aval for i, aval in zip(self.per_call_positions, avals)):
            return None
        return values

    def remember(self, leaves: list) -> None:
        """Record the per-call leaves' shapes and dtypes (types, for Python scalars) after a general
        call of this signature; a traced call records nothing."""
        avals = [_leaf_aval(leaves[i]) for i in self.per_call_positions]
        self.per_call_avals = None if None in avals else avals

    def __call__(self, leaves: list, values: list):
        """The call on `leaves` with the prepared tensors `values` (`prepared_values(leaves)`)."""
        prepared = self.prepared
        self.calls += 1
        prepared.cache_hits += bool(prepared.split.prepared_tensors)
        per_call = [leaves[i] for i in self.per_call_positions]
        if self._stage is None:
            self._stage = prepared.per_call_callable(per_call, values)
        return prepared.program.results(self._stage(per_call, values))


def _leaf_aval(leaf):
    """What a call's signature records of a concrete leaf (`optimize`'s signature does the same):
    shape and dtype of an array, the type of a Python scalar; None for a tracer."""
    if isinstance(leaf, jax.core.Tracer):
        return None
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return leaf.shape, leaf.dtype
    return type(leaf)


class _Entry:
    """The last parameter leaves (weakly held where possible) and their prepared tensors."""

    def __init__(self, leaves: list, values: list, owner: Prepared):
        owner_ref = weakref.ref(owner)

        def collected(_, entry_ref=weakref.ref(self)):
            owner, entry = owner_ref(), entry_ref()
            if owner is not None and entry is not None:
                owner._forget(entry)

        self.refs = []
        for leaf in leaves:
            try:
                self.refs.append(weakref.ref(leaf, collected))
            except TypeError:  # Python and NumPy scalars
                self.refs.append(lambda leaf=leaf: leaf)
        self.values = values

    def holds(self, leaves: list) -> bool:
        return len(leaves) == len(self.refs) and all(ref() is leaf for ref, leaf in zip(self.refs, leaves))
