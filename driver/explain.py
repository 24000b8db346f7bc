"""Why a heavy kernel was not fused: `lowered.explain()`.

For every matmul the plan still launches, the lifted program around it is read the way the
`attention` rule family reads it (`eqsat.rules.attention`): is it the QK product of a softmax whose
probabilities a second matmul reads? If it is, the chain from the scores to that softmax is walked
step by step and each step is checked against what the family accepts (the layouts its layout
helpers accept, constant scales, additive biases, where-masks whose fill masks in the scores'
dtype, a softmax over the key axis, a probabilities-times-V matmul). The first step the family
does not accept is the blocker: the pattern it needed and the term it found instead.

    lowered = eqsat.optimize(f).lower(*args)
    for missed in lowered.explain(): print(missed)
    # kernel 3 (matmul bhqk,...): attention: softmax input is select(mask, s, -10000.0): the attention
    #   rule wants a mask fill of -inf or in float32's lowest binade (at or below -1.7e+38), or an additive bias

A matmul that is no softmax's QK (a projection, an MLP) gets no attention entry, nor does attention
the plan already runs as one `attention` kernel (its matmuls are gone from the plan).

Around every heavy kernel (matmul, conv, attention), each elementwise kernel of the plan that
reads its output is an epilogue the `absorb` family did not make; the entry says what in the plan
stood in the way: the reader reads the output through a permute or a real broadcast (an epilogue
runs at the kernel's own output index), the output has other readers or is a program output (it
is written anyway; fused, the heavy op would run twice), the reader also reads a statistic of the
output (a norm's moments: complete only once every tile is written), the reader writes another
shape, or nothing found in the plan (the cost model's choice, or an op absorb does not move).
"""

from __future__ import annotations

from dataclasses import dataclass

from eqsat.term import Term, postorder

HEAVY = ("matmul", "conv", "attention")
_ELEMENTWISE_VIEWS = ("Broadcast", "Reshape", "Transpose")
_SEARCH_DEPTH = 12


@dataclass(frozen=True)
class Missed:
    """A fusion that did not happen around heavy kernel `kernel` of the plan."""

    kernel: int          # index in `plan.kernels`
    kind: str            # that kernel's kind
    component: str
    family: str          # the rule family that came closest
    needed: str          # the pattern the family needed
    found: str           # the term it found instead

    def __str__(self) -> str:
        where = f" ({self.component})" if self.component else ""
        return f"kernel {self.kernel} ({self.kind}{where}): {self.family}: {self.found}: {self.needed}"


def explain(lowered) -> list[Missed]:
    """The fusions that did not happen around the plan's heavy kernels, and why (see the module doc)."""
    program, plan = lowered.program, lowered.plan
    kernels = program.kernel_terms()
    readers = _readers(kernels)
    missed = []
    for index, kernel in enumerate(plan.kernels):
        if kernel.kind != "matmul":
            continue
        lifted = _lifted_matmul(kernel.term, kernels)
        if lifted is None:
            continue
        blocker = _attention_blocker(lifted, readers, program)
        if blocker is not None:
            found, needed = blocker
            missed.append(Missed(index, kernel.kind, kernel.component, "attention", needed, found))
    return missed + _epilogue_misses(plan)


# --- the absorb family's view: elementwise readers left outside a heavy kernel's epilogue ----------------


def _epilogue_misses(plan) -> list[Missed]:
    """For each elementwise kernel of the plan that reads a heavy kernel's output, why absorb's
    epilogue rules did not move it into that kernel (the first blocker found in the plan)."""
    plan_readers: dict[int, list] = {}
    for kernel in plan.kernels:
        for tensor in kernel.inputs:
            plan_readers.setdefault(id(tensor), []).append(kernel)
    outputs = {id(term) for term in plan.outputs}
    missed = []
    for kernel in plan.kernels:
        if kernel.kind not in HEAVY:
            continue
        for reader in plan_readers.get(id(kernel.term), []):
            if reader.op != "Pointwise":
                continue
            found, needed = _epilogue_blocker(kernel, reader, plan_readers.get(id(kernel.term), []),
                                              id(kernel.term) in outputs)
            missed.append(Missed(kernel.index, kernel.kind, kernel.component, "absorb", needed, found))
    return missed


def _epilogue_blocker(kernel, reader, readers: list, is_output: bool) -> tuple[str, str]:
    view = _reading_view(reader.term.args[0], kernel.term)
    if view is not None:
        return (f"kernel {reader.index} (pointwise) reads its output through {view}",
                "absorb moves elementwise work into an epilogue, which runs at the kernel's own output index "
                "(a reshape or unit-axis broadcast in between is fine, a permute or a real broadcast is not)")
    others = [r.index for r in readers if r is not reader]
    if others or is_output:
        also = (f"kernels {', '.join(map(str, others))}" if others else "") + \
            (" and " if others and is_output else "") + ("the program's outputs" if is_output else "")
        return (f"kernel {reader.index} (pointwise) reads its output, which {also} also read",
                "absorb fuses an epilogue where the output has no other reader; here the output is written "
                "anyway, and the fused kernel would compute the heavy op a second time")
    statistic = _statistic_of(reader.term, kernel.term)
    if statistic is not None:
        return (f"kernel {reader.index} (pointwise) reads its output and {statistic}",
                "an epilogue sees one output tile; a statistic over the output (a norm's mean and variance) "
                "is complete only once every tile is written, so its reader stays a kernel of its own")
    if _shape(reader.term.ty) != _shape(kernel.term.ty):
        return (f"kernel {reader.index} (pointwise) writes {reader.term.ty} from the {kernel.term.ty} output",
                "an epilogue writes the kernel's output shape")
    return (f"kernel {reader.index} (pointwise) reads its output as is",
            "no blocker found in the plan: the extraction kept the kernels apart (the cost model's choice, "
            "or an op absorb does not move)")


def _statistic_of(reader: Term, tensor: Term) -> str | None:
    """A reduction over `tensor` that `reader` also reads: an `EpilogueReduce` hosted by it, or a
    `Reduce` whose body reads it."""
    for read in _loads(reader):
        if read.op == "EpilogueReduce" and read.args[0] is tensor:
            return f"a {read.args[1]} of it ({read.ty}, hosted in its epilogue)"
        if read.op == "Reduce" and _reads(read.args[1], tensor):
            return f"a {read.args[0]} of it ({read.ty})"
    return None


def _reading_view(body: Term, tensor: Term) -> str | None:
    """The first view on a path from `body` to `Load(tensor)` that an epilogue cannot take: a permute,
    a broadcast that adds real extent, a slice, pad or concat ("" none: a Load as is or reshaped)."""
    from eqsat.rules.absorb import _expand_only

    stack = [(body, None)]
    while stack:
        node, view = stack.pop()
        if node.op == "Load" and node.args[0] is tensor:
            if view is not None:
                return view
            continue
        if node.sort == "Tensor":
            continue
        blocking = view
        if blocking is None:
            if node.op == "Transpose" and node.args[1] != ",".join(map(str, range(len(_shape(node.ty))))):
                blocking = f"transpose({node.args[1]}) to {node.ty}"
            elif node.op == "Broadcast" and _expand_only(node.args[1], node.args[0].ty, node.ty) != "1":
                blocking = f"broadcast {node.args[0].ty} -> {node.ty}"
            elif node.op in ("Slice", "DynamicSlice", "Pad", "Concat"):
                blocking = f"{node.op.lower()} to {node.ty}"
        stack.extend((child, blocking) for child in node.children)
    return None


def format_explanation(missed: list[Missed], limit: int | None = None) -> str:
    """One line per entry (the first `limit` of them, then how many more)."""
    if not missed:
        return "every heavy kernel is fused as far as the rule families reach"
    shown = missed if limit is None else missed[:limit]
    more = len(missed) - len(shown)
    return "\n".join([str(m) for m in shown] + ([f"... and {more} more (lowered.explain())"] if more else []))


# --- the lifted program's data flow ------------------------------------------------------------------


def _loads(kernel: Term) -> list[Term]:
    """The tensors a kernel term reads (its `Load`s, not descending into other kernels)."""
    out, seen = [], set()
    for node in postorder([kernel], children=lambda n: [] if (n is not kernel and n.sort == "Tensor") else n.children):
        if node.op == "Load" and id(node.args[0]) not in seen:
            seen.add(id(node.args[0]))
            out.append(node.args[0])
    return out


def _readers(kernels: list[Term]) -> dict[int, list[Term]]:
    readers: dict[int, list[Term]] = {}
    for kernel in kernels:
        for tensor in _loads(kernel):
            readers.setdefault(id(tensor), []).append(kernel)
    return readers


def _lifted_matmul(term: Term, kernels: list[Term]) -> Term | None:
    """The lifted Matmul the plan's matmul kernel computes (same dims and type; prologues and
    epilogues may have been fused into the plan's)."""
    if term.op != "Matmul":
        return None
    dims, ty = term.args[2], term.ty
    candidates = [k for k in kernels if k.op == "Matmul" and k.args[2] == dims and k.ty == ty]
    return candidates[0] if candidates else None


def _downstream(tensor: Term, readers, depth: int = _SEARCH_DEPTH) -> list[Term]:
    """Kernels reachable from `tensor` through at most `depth` readers, nearest first."""
    order, frontier, seen = [], [tensor], {id(tensor)}
    for _ in range(depth):
        following = []
        for node in frontier:
            for reader in readers.get(id(node), []):
                if id(reader) not in seen:
                    seen.add(id(reader))
                    order.append(reader)
                    following.append(reader)
        frontier = following
    return order


# --- the attention family's view ----------------------------------------------------------------------


def _is_softmax_max(kernel: Term) -> bool:
    return kernel.op == "Reduce" and kernel.args[0] == "max"


def _is_exp(kernel: Term) -> bool:
    return kernel.op == "Pointwise" and kernel.args[0].op == "Unary" and kernel.args[0].args[0] == "exp"


def _attention_blocker(qk: Term, readers, program) -> tuple[str, str] | None:
    """(found, needed) for the first step of qk -> softmax -> PV the attention family does not accept,
    or None when qk is no softmax's QK (or every step is accepted)."""
    from eqsat.rules.attention import _score_layout

    softmax_max = _softmax_reading(qk, readers)
    if softmax_max is None:
        return None
    after = _downstream(softmax_max, readers)
    if not any(_is_exp(k) for k in after):
        return None
    pv = next((k for k in after if k.op == "Matmul"), None)
    if pv is None:
        return None
    q, k = _matmul_operand(qk, 0), _matmul_operand(qk, 1)
    if q is None or k is None or not _score_layout(qk.args[2], q.ty, k.ty, qk.ty):
        return (f"QK matmul is {_render_matmul(qk)}",
                "the attention rule wants one contracting axis (D) per side and one free axis (the keys) on "
                "k's side, any batch axes and free axes of q (scores [batch..., q free..., Sk])")
    scores, problem = _walk_scores(qk, readers, program)
    if problem is not None:
        return problem
    row_max = next(r for r in readers.get(id(scores), []) if _is_softmax_max(r))
    last = str(len(_shape(scores.ty)) - 1)
    if row_max.args[2] != last:
        return (f"softmax over axes ({row_max.args[2]}) of {scores.ty}",
                f"the attention rule wants the softmax over the key axis ({last})")
    return _value_blocker(pv)


def _softmax_reading(qk: Term, readers) -> Term | None:
    """The row max of a softmax that reads qk's output through elementwise kernels only (no other
    matmul, conv or reduction in between), or None: then qk is no softmax's QK."""
    frontier, seen = [qk], {id(qk)}
    for _ in range(_SEARCH_DEPTH):
        following = []
        for node in frontier:
            for reader in readers.get(id(node), []):
                if _is_softmax_max(reader):
                    return reader
                if reader.op == "Pointwise" and id(reader) not in seen:
                    seen.add(id(reader))
                    following.append(reader)
        frontier = following
    return None


def _matmul_operand(matmul: Term, side: int) -> Term | None:
    operand = matmul.args[side]
    return operand.args[0] if operand.op == "Load" else None


def _walk_scores(qk: Term, readers, program) -> tuple[Term, tuple[str, str] | None]:
    """Follow qk's scores through the steps the family accepts (converts, constant scales, additive
    biases, where-masks) to the tensor the softmax's row max reads; the first other step is the blocker."""
    from eqsat.rules.attention import _mask_fill

    current, biased = qk, False
    while True:
        following = readers.get(id(current), [])
        if any(_is_softmax_max(r) for r in following):
            return current, None
        if len(following) != 1:
            return current, (f"the scores {current.ty} are read by {len(following)} kernels "
                             f"({', '.join(_kernel_name(r) for r in following)}) before any softmax",
                             "the attention rule wants the scores read only on their way to the softmax")
        step = following[0]
        body = step.args[0] if step.op == "Pointwise" else None
        if body is None:
            return current, (f"the scores go into {_kernel_name(step)}",
                             "the attention rule wants elementwise steps (scale, bias, mask) before the softmax")
        inner = _through_views(body)
        if inner.op == "Load" or (inner.op == "Unary" and inner.args[0] == "convert"):  # a view, a convert
            current = step
            continue
        if inner.op == "Binary" and inner.args[0] in ("mul", "div", "add", "sub"):
            op, x, y = inner.args[0], inner.args[1], inner.args[2]
            other = y if _reads(x, current) else x
            value = _constant_value(other, program)
            if op in ("mul", "div") and value is not None:
                if biased:
                    return current, (f"the biased scores are scaled: {_render(body, current, program)}",
                                     "the attention rule wants the scale before the bias (scale · q·kᵀ + bias)")
                current = step
                continue
            if op == "add":
                biased, current = True, step
                continue
            return current, (f"softmax input is {_render(body, current, program)}",
                             "the attention rule wants the scores times a constant, plus an additive bias")
        if inner.op == "Select":
            pred, on_false, on_true = inner.args[:3]
            fill = on_false if _reads(on_true, current) else on_true
            value = _constant_value(fill, program)
            if value is not None and _mask_fill(repr(value), inner.ty):
                current = step
                continue
            import jax.numpy as jnp

            from eqsat.types import parse_type

            dtype = parse_type(inner.ty).dtype
            binade = -(2.0 ** (jnp.finfo(dtype).maxexp - 1))
            return current, (f"softmax input is {_render(body, current, program)}",
                             f"the attention rule wants a mask fill of -inf or in {dtype}'s lowest binade "
                             f"(at or below {binade:.3g}: finfo.min, jax's 0.7·finfo.min), or an additive bias")
        return current, (f"softmax input is {_render(body, current, program)}",
                         "the attention rule wants converts, a constant scale, an additive bias or a where-mask "
                         "between the QK matmul and the softmax")


def _value_blocker(pv: Term) -> tuple[str, str] | None:
    from eqsat.rules.attention import _grouped_value_layout, _value_layout, _value_lhs_layout

    lhs, rhs = _matmul_operand(pv, 0), _matmul_operand(pv, 1)
    if lhs is None or rhs is None:
        return (f"PV matmul is {_render_matmul(pv)}", "the attention rule wants the probabilities and V as its operands")
    dims = pv.args[2]
    if _value_layout(dims, lhs.ty, rhs.ty, pv.ty) or _value_lhs_layout(dims, lhs.ty, rhs.ty, pv.ty):
        return None
    if (_grouped_value_layout(dims, lhs.ty, rhs.ty, pv.ty, "", "", "0")
            or _grouped_value_layout(dims, rhs.ty, lhs.ty, pv.ty, "", "", "1")):
        return None
    return (f"PV matmul is {_render_matmul(pv)}",
            "the attention rule wants the probabilities contracted on their last (key) axis, their batch axes "
            "before their query axes, and V with one contracted and one free axis")


# --- reading terms --------------------------------------------------------------------------------------


def _shape(ty: str) -> tuple[int, ...]:
    from eqsat.types import parse_type

    return parse_type(ty).shape


def _through_views(expr: Term) -> Term:
    while expr.op in _ELEMENTWISE_VIEWS:
        expr = expr.args[0]
    return expr


def _reads(expr: Term, tensor: Term) -> bool:
    return any(node.op == "Load" and node.args[0] is tensor
               for node in postorder([expr], children=lambda n: [] if n.sort == "Tensor" else n.children))


def _constant_value(expr: Term, program) -> float | None:
    """The value of a splatted scalar: a literal, a lifted scalar constant, or a sqrt/rsqrt/convert of
    one computed by its own kernel, through views."""
    import math

    import numpy as np

    expr = _through_views(expr)
    if expr.op == "Lit":
        return expr.args[0]
    if expr.op == "Unary" and expr.args[0] in ("convert", "sqrt", "rsqrt"):
        inner = _constant_value(expr.args[1], program)
        if inner is None:
            return None
        if expr.args[0] == "sqrt":
            return math.sqrt(inner) if inner >= 0 else None
        return 1 / math.sqrt(inner) if expr.args[0] == "rsqrt" and inner > 0 else inner
    if expr.op == "Load":
        tensor = expr.args[0]
        if tensor.op == "Constant":
            value = np.asarray(program.constants.get(tensor.args[0]))
            return float(value) if value.size == 1 else None
        if tensor.op == "Pointwise":
            return _constant_value(tensor.args[0], program)
    return None


def _render(expr: Term, scores: Term, program, depth: int = 4) -> str:
    """`expr` as a short formula: the scores are `s`, constants their value, other tensors `op[shape]`."""
    if depth == 0:
        return "…"
    value = _constant_value(expr, program)
    if value is not None:
        return f"{value:.3g}"
    if expr.op == "Load":
        return "s" if expr.args[0] is scores else _tensor_name(expr.args[0])
    if expr.op in _ELEMENTWISE_VIEWS:
        return _render(expr.args[0], scores, program, depth)
    parts = [_render(a, scores, program, depth - 1) for a in expr.children]
    if expr.op == "Select":
        pred, on_false, on_true = parts
        return f"select({pred}, {on_true}, {on_false})"
    name = expr.args[0] if expr.op in ("Unary", "Binary") else expr.op.lower()
    return f"{name}({', '.join(parts)})"


def _tensor_name(tensor: Term) -> str:
    if tensor.op == "Input":
        return tensor.args[0]
    if tensor.op == "Pointwise":
        inner = _through_views(tensor.args[0])
        if inner.ty.startswith("bool"):
            return "mask"
        label = inner.args[0] if inner.op in ("Unary", "Binary") else inner.op.lower()
        return f"{label}[{tensor.ty}]"
    return f"{tensor.op.lower()}[{tensor.ty}]"


def _kernel_name(kernel: Term) -> str:
    if kernel.op == "Pointwise":
        return _tensor_name(kernel)
    if kernel.op == "Reduce":
        return f"reduce_{kernel.args[0]} over ({kernel.args[2]})"
    return kernel.op.lower()


def _render_matmul(matmul: Term) -> str:
    lhs, rhs = _matmul_operand(matmul, 0), _matmul_operand(matmul, 1)
    operands = ", ".join(t.ty if t is not None else "?" for t in (lhs, rhs))
    return f"dot_general({operands}; dims {matmul.args[2]!r}) -> {matmul.ty}"
