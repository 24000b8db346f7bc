"""Drawing plans: Graphviz DOT text of kernels and tensors, their fused expressions for people, and
matplotlib plots of activation memory.

    plan.to_dot() / plan_to_dot(plan)          kernels as boxes (kind, component, fused expression),
                                               tensors as edges labelled with their type and size
    plan_drawing(plan)                         the same as a `eqsat.viz.Drawing` (SVG in a notebook;
                                               `lowered.show("plan.svg")` writes it)
    plans_drawing({"naive": a, "fused": b})    plans side by side
    plot_memory(plan), plot_lifetimes(plan)    live activation bytes over the kernel order; buffer lifetimes

A plan is read through its attributes (kernels, buffers, program); this module imports nothing of
`extract.plan`, which imports it.
"""

from __future__ import annotations

import textwrap

from eqsat.viz import KIND_COLORS, Drawing, human_bytes, quote_dot, wrap_label

# --- the plan ----------------------------------------------------------------------------------------


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&", "or": "|"}


def _number(value) -> str:
    return f"{float(value):.6g}"


def _dims_text(text: str) -> str:
    """Matmul dims `"1;0;;"` -> `"1·0"`, `"2;1;0;0"` -> `"2·1, batch 0·0"`."""
    lc, rc, lb, rb = (text.split(";") + ["", "", "", ""])[:4]
    out = f"{lc or '-'}·{rc or '-'}"
    return out + (f", batch {lb}·{rb}" if lb or rb else "")


def _conv_text(key: str, weights) -> str:
    from eqsat.conv_params import ConvParams
    from eqsat.types import parse_type

    conv = ConvParams.parse(key)
    shape = parse_type(weights.ty).shape
    window = "x".join(str(shape[d]) for d in conv.rhs_spec[2:])
    parts = [window]
    if any(s != 1 for s in conv.strides):
        parts.append("stride " + ",".join(map(str, conv.strides)))
    if any(v for pair in conv.padding for v in pair):
        parts.append("pad " + ",".join(f"{lo}:{hi}" if lo != hi else str(lo) for lo, hi in conv.padding))
    if conv.feature_groups != 1:
        parts.append(f"groups {conv.feature_groups}")
    return " ".join(parts)


def expression_text(kernel, names: dict, limit: int = 4000) -> str:
    """A kernel's fused expression for people: arithmetic infix, literals as numbers, tensors by
    buffer (or argument) name, reshapes and broadcasts implicit, a library core named with its
    shape (`conv3x3 pad 1(x, w)`, `matmul 1·0(x, w)`) and its epilogue applied to `acc`."""
    return render(kernel, names, limit, node_text=_node_text)


def _node_text(node, args: list) -> str:
    op = node.op
    if op == "Lit":
        return _number(args[0])
    if op == "Acc":
        return "acc"
    if op in ("Load", "Pointwise", "Reshape", "Broadcast"):
        return str(args[0])
    if op == "Binary" and args[0] in _INFIX:
        return f"({args[1]} {_INFIX[args[0]]} {args[2]})"
    if op in ("Binary", "Unary"):
        name = str(args[0])
        if name.startswith("integer_pow:"):
            return f"{args[1]}^{name.split(':', 1)[1]}"
        if name == "convert":
            return f"{node.ty.split('[', 1)[0]}({args[1]})"
        return f"{name}({', '.join(map(str, args[1:-1]))})"
    if op == "Select":
        return f"({args[1]} if {args[0]} else {args[2]})"
    if op == "Transpose":
        return f"transpose({args[0]}, {args[1]})"
    if op == "Slice" and len(args) >= 5:
        return f"{args[0]}[axis {args[1]}: {args[2]}:{args[3]}]"
    if op == "Matmul":
        return f"{args[3]}  with acc = matmul {_dims_text(str(args[2]))}({args[0]}, {args[1]})"
    if op == "Conv":
        return f"{args[3]}  with acc = conv{_conv_text(str(args[2]), node.args[1])}({args[0]}, {args[1]})"
    if op == "Attention":
        return f"{args[5]}  with acc = attention({args[0]}, {args[1]}, {args[2]}, bias {args[3]}, scale {args[4]})"
    shown = [str(a) if not isinstance(a, float) else _number(a) for a in (args[:-1] if node.sort != "TensorList" else args)]
    return f"{op.lower()}({', '.join(shown)})"


def display_names(plan) -> dict:
    """Buffer term -> the name a drawing shows: the argument's own name (`x`, `params['…weight']`)
    for an input, the buffer's name (`%3`) for anything computed."""
    paths = input_paths(plan.program)
    return {buffer.term: paths.get(buffer.name) or buffer.name for buffer in plan.buffers}


def _plan_parts(plan, expression_chars: int):
    """Per kernel: (label lines, color); per edge: (source id, target id, label, hosted statistics?)."""
    names = display_names(plan)
    buffers = {buffer.term: buffer for buffer in plan.buffers}
    kernels = []
    for kernel in plan.kernels:
        head = f"%{kernel.index} {kernel.kind}  {human_bytes(kernel.bytes)} moved, {kernel.seconds * 1e6:.1f} µs"
        body = getattr(kernel, "body", None)
        if body:
            head += f"  (body: {len(body)} kernels per iteration)"
        component = kernel.component
        expression = expression_text(kernel.term, names, limit=expression_chars + 1)
        if len(expression) > expression_chars:
            expression = expression[: expression_chars - 1] + "…"
        statistics = [f"+ statistics {names[t]}: {expression_text(t, names, limit=80)}" for t in kernel.hosted]
        kernels.append((kernel, head, component, expression, statistics))
    edges = []
    for kernel in plan.kernels:
        for tensor in kernel.inputs:
            buffer = buffers.get(tensor)
            if buffer is None:
                continue
            source = f"k{buffer.first}" if buffer.first >= 0 else f"in_{buffer.name}"
            label = f"{names[buffer.term]} {tensor.ty} {human_bytes(buffer.bytes)}"
            edges.append((source, f"k{kernel.index}", label, tensor.op == "EpilogueReduce"))
    return kernels, edges, buffers


def _last_modules(path: str, count: int) -> str:
    """`"down_blocks.0.attentions.1.proj_in.weight"` -> `"…attentions.1.proj_in.weight"` (an index
    stays with its module)."""
    levels = _levels(path)
    return path if len(levels) <= count else "…" + ".".join(levels[-count:])


def input_paths(program) -> dict[str, str]:
    """Input name (`arg3`) -> where the leaf sits in the function's arguments, by the function's
    own names: `w` for its second parameter, `params['…attn1.to_q.weight']` for a leaf of a
    parameter dict, `scale` for a keyword argument (`[1]`, `[0]['…']` where the names are unknown)."""
    if program is None or program.in_tree is None:
        return {}
    import jax

    names = tuple(getattr(program, "argument_names", ()) or ())
    skeleton = jax.tree_util.tree_unflatten(program.in_tree, list(range(len(program.inputs))))
    out = {}
    for path, index in jax.tree_util.tree_flatten_with_path(skeleton)[0]:
        parts = []
        keys = list(path)
        if keys and getattr(keys[0], "idx", None) in (0, 1):
            positional = keys.pop(0).idx == 0  # (args, kwargs)[0] or [1]
            if keys:
                head = keys.pop(0)
                name = getattr(head, "idx", getattr(head, "key", None))
                if positional and isinstance(name, int) and name < len(names):
                    parts.append(names[name])
                elif not positional and isinstance(name, str):
                    parts.append(name)
                else:
                    parts.append(f"[{name!r}]" if isinstance(name, str) else f"[{name}]")
        for key in keys:
            name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
            if isinstance(name, str):
                name = _last_modules(name, 3)
            parts.append(f"[{name!r}]" if isinstance(name, str) else f"[{name}]")
        out[program.inputs[index].args[0]] = "".join(parts)
    return out


def _plan_body(plan, prefix: str, expression_chars: int, inputs: bool | None) -> list[str]:
    """The node and edge lines of one plan, every id prefixed by `prefix`."""
    kernels, edges, buffers = _plan_parts(plan, expression_chars)
    order = {term.args[0]: i for i, term in enumerate(plan.program.inputs)} if plan.program is not None else {}
    external = sorted((b for b in plan.buffers if b.first < 0), key=lambda b: order.get(b.name, len(order)))
    draw_inputs = inputs if inputs is not None else len(external) <= 24
    lines = []
    for kernel, head, component, expression, statistics in kernels:
        label = head + "\n" + (component + "\n" if component else "") + wrap_label(expression, 60, expression_chars)
        label += "".join(wrap_label(line, 60, 200) for line in statistics)
        color = KIND_COLORS.get(kernel.kind, "#ffffff")
        lines.append(f"  {prefix}k{kernel.index} [shape=box, style=filled, fillcolor={quote_dot(color)}, "
                     f"label={quote_dot(label)}];")
    if draw_inputs:
        paths = input_paths(plan.program)
        for buffer in external:
            label = f"{paths.get(buffer.name) or buffer.name}\n{buffer.term.ty}"
            lines.append(f"  {prefix}in_{_node_id(buffer.name)} [shape=ellipse, label={quote_dot(label)}];")
    elif external:
        label = f"{len(external)} inputs and constants, {human_bytes(sum(b.bytes for b in external))}"
        lines.append(f"  {prefix}inputs [shape=ellipse, label={quote_dot(label)}];")
    for source, target, label, statistics in edges:
        if source.startswith("in_"):
            if not draw_inputs:
                continue
            source = "in_" + _node_id(source[3:])
        style = ", style=dashed" if statistics else ""
        lines.append(f"  {prefix}{source} -> {prefix}{target} [label={quote_dot(label)}{style}];")
    lines.append(f"  {prefix}outputs [shape=doublecircle, label=out, fontsize=9];")
    for term in plan.outputs:
        buffer = buffers.get(term)
        if buffer is not None and (buffer.first >= 0 or draw_inputs):
            source = f"k{buffer.first}" if buffer.first >= 0 else f"in_{_node_id(buffer.name)}"
            label = f"{buffer.name} {term.ty} {human_bytes(buffer.bytes)}"
            lines.append(f"  {prefix}{source} -> {prefix}outputs [label={quote_dot(label)}];")
    return lines


_PLAN_HEADER = "  rankdir=TB; node [fontname=Helvetica, fontsize=10]; edge [fontname=Helvetica, fontsize=9];"


FOLD_ABOVE = 80    # kernels: a larger plan is drawn folded by component unless `fold=0`
FOLDED_BOXES = 60  # the deepest component level whose boxes are at most this many


def plan_to_dot(plan, *, expression_chars: int = 240, inputs: bool | None = None, title: str | None = None,
                fold: int | str | None = "auto") -> str:
    """The plan as a DOT digraph: a box per kernel (kind, modeled bytes and time, component, its fused
    expression with tensors by buffer name), an edge per tensor read (name, type, size; dashed for
    statistics computed in a producer's epilogue), program inputs as ellipses (`inputs=None`: only
    when there are at most 24 of them, else one node stands for all) and the outputs.

    `fold=N` draws one box per component N levels deep (`down_blocks.1.attentions.0` is 2 levels:
    an index stays with its module) with its kernel count by kind, bytes and time, and one edge per
    pair of components a tensor crosses between; `"auto"` folds plans of more than `FOLD_ABOVE`
    kernels at the deepest level with at most `FOLDED_BOXES` boxes; 0 or None never folds."""
    depth = fold_depth(plan) if fold == "auto" else (fold or 0)
    lines = ["digraph plan {", _PLAN_HEADER]
    if title:
        lines.append(f"  labelloc=t; label={quote_dot(title)};")
    lines += _folded_body(plan, depth) if depth else _plan_body(plan, "", expression_chars, inputs)
    lines.append("}")
    return "\n".join(lines)


def _levels(path: str) -> list[str]:
    levels: list[str] = []
    for part in path.split(".") if path else ():
        if part.isdigit() and levels:
            levels[-1] += "." + part
        else:
            levels.append(part)
    return levels


def component_at(path: str, depth: int) -> str:
    """The first `depth` levels of a component path (`"up_blocks.1.attentions.2.proj"`, 2 ->
    `"up_blocks.1.attentions.2"`); "(no scope)" for a kernel outside any named scope."""
    return ".".join(_levels(path)[:depth]) or "(no scope)"


def fold_depth(plan) -> int:
    """The component depth `fold="auto"` draws `plan` at: 0 (no folding) for a plan of at most
    `FOLD_ABOVE` kernels, else the deepest level with at most `FOLDED_BOXES` components (at least 1)."""
    if len(plan.kernels) <= FOLD_ABOVE:
        return 0
    deepest = max((len(_levels(k.component)) for k in plan.kernels), default=1)
    fitting = [d for d in range(1, deepest + 1)
               if len({component_at(k.component, d) for k in plan.kernels}) <= FOLDED_BOXES]
    return max(fitting, default=1)


def _folded_body(plan, depth: int) -> list[str]:
    """One box per component `depth` levels deep, in plan order; edges aggregate the tensors read
    across components (count and bytes)."""
    group_of = {k.index: component_at(k.component, depth) for k in plan.kernels}
    groups: dict[str, list] = {}
    for kernel in plan.kernels:
        groups.setdefault(group_of[kernel.index], []).append(kernel)
    ids = {name: f"c{i}" for i, name in enumerate(groups)}
    lines = []
    for name, kernels in groups.items():
        kinds: dict[str, int] = {}
        for kernel in kernels:
            kinds[kernel.kind] = kinds.get(kernel.kind, 0) + 1
        main = max(kinds, key=lambda kind: (kinds[kind], kind))
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        label = (f"{name}\n{len(kernels)} kernels: {counts}\n"
                 f"{human_bytes(sum(k.bytes for k in kernels))} moved, {sum(k.seconds for k in kernels) * 1e6:,.1f} µs")
        lines.append(f"  {ids[name]} [shape=box, style=filled, fillcolor={quote_dot(KIND_COLORS.get(main, '#ffffff'))}, "
                     f"label={quote_dot(label)}];")
    buffers = {buffer.term: buffer for buffer in plan.buffers}
    crossing: dict[tuple[str, str], list] = {}
    for kernel in plan.kernels:
        for tensor in kernel.inputs:
            buffer = buffers.get(tensor)
            if buffer is None or buffer.first < 0:
                continue
            source, target = group_of[buffer.first], group_of[kernel.index]
            if source != target:
                seen = crossing.setdefault((source, target), [])
                if buffer not in seen:
                    seen.append(buffer)
    for (source, target), read in crossing.items():
        label = f"{len(read)} tensor{'s' if len(read) > 1 else ''}, {human_bytes(sum(b.bytes for b in read))}"
        lines.append(f"  {ids[source]} -> {ids[target]} [label={quote_dot(label)}];")
    return lines


def plans_to_dot(plans: dict, *, expression_chars: int = 160, inputs: bool | None = None) -> str:
    """Several plans side by side, one titled cluster each (`{"naive": plan_a, "fused": plan_b}`)."""
    lines = ["digraph plans {", _PLAN_HEADER]
    for i, (name, plan) in enumerate(plans.items()):
        title = f"{name}: {len(plan.kernels)} kernels, {human_bytes(plan.bytes)} moved, {plan.seconds * 1e6:.1f} µs"
        lines.append(f"  subgraph cluster_plan{i} {{ label={quote_dot(title)}; fontsize=12; color=grey60;")
        lines += ["  " + line for line in _plan_body(plan, f"p{i}_", expression_chars, inputs)]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


def _node_id(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def plan_text(plan, *, expression_chars: int = 240) -> str:
    """The plan as text: one paragraph per kernel with what it reads."""
    kernels, edges, _ = _plan_parts(plan, expression_chars)
    reads: dict[str, list[str]] = {}
    for _, target, label, statistics in edges:
        reads.setdefault(target, []).append(label + (" (epilogue statistics)" if statistics else ""))
    out = [repr(plan)]
    for kernel, head, component, expression, statistics in kernels:
        out.append(f"{head}  [{component}]" if component else head)
        out.append(textwrap.indent(wrap_label(expression, 100, expression_chars), "    ").rstrip())
        out.extend(f"    {line}" for line in statistics)
        out.extend(f"    reads {label}" for label in reads.get(f"k{kernel.index}", []))
    return "\n".join(out)


def plan_drawing(plan, **options) -> Drawing:
    """`plan_to_dot` and `plan_text` of `plan`, for display."""
    return Drawing(plan_to_dot(plan, **options), plan_text(plan))


def plans_drawing(plans: dict, **options) -> Drawing:
    """`plans_to_dot` and the plans' texts one after the other, for display."""
    text = "\n\n".join(f"{name}:\n{plan_text(plan)}" for name, plan in plans.items())
    return Drawing(plans_to_dot(plans, **options), text)


def render(kernel, names: dict, limit: int = 4000, node_text=None) -> str:
    """A kernel's expression as an s-expression; tensors it reads appear by buffer name.
    `node_text(node, args)` writes one node from its arguments already written (default: the
    constructor and its arguments, `Binary('add', …)`)."""
    out: dict[int, str] = {}
    stack = [(kernel, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in out:
            continue
        if node is not kernel and node.sort == "Tensor":
            out[id(node)] = names.get(node, node.op)
            continue
        if not ready:
            stack.append((node, True))
            stack.extend((c, False) for c in node.children if id(c) not in out)
            continue
        if node_text is not None:
            text = node_text(node, [out.get(id(a), a) for a in node.args])
        else:
            parts = []
            for arg in node.args[:-1] if node.sort != "TensorList" else node.args:
                parts.append(out[id(arg)] if not isinstance(arg, (str, int, float)) else repr(arg))
            text = f"{node.op}({', '.join(parts)})"
        out[id(node)] = text if len(text) <= limit else text[: limit - 1] + "…"
    return out[id(kernel)]


# --- plots (matplotlib) ------------------------------------------------------------------------------


def live_bytes(plan) -> list[int]:
    """Bytes of live activation and output buffers while each kernel of the plan runs."""
    live = [0] * len(plan.kernels)
    for buffer in plan.buffers:
        if buffer.kind in ("activation", "output"):
            for i in range(buffer.first, buffer.last + 1):
                live[i] += buffer.bytes
    return live


def plot_memory(plan, ax=None, label: str | None = None):
    """Live activation memory over the kernel order, its peak marked."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3))[1]
    live = [b / 2**20 for b in live_bytes(plan)]
    ax.step(range(len(live)), live, where="post", label=label)
    if live:
        peak = max(range(len(live)), key=live.__getitem__)
        ax.annotate(f"peak {live[peak]:.1f} MiB", (peak, live[peak]), textcoords="offset points", xytext=(5, -2))
        ax.set_ylim(0, live[peak] * 1.1 or 1.0)
    ax.set_xlabel("kernel (plan order)")
    ax.set_ylabel("live activations (MiB)")
    return ax


def plot_lifetimes(plan, ax=None, largest: int = 40):
    """The `largest` activation/output buffers by memory held over time (bytes × kernels alive), each
    a bar from its producer to its last reader, coloured by size."""
    import matplotlib.pyplot as plt

    buffers = [b for b in plan.buffers if b.kind in ("activation", "output")]
    held = sorted(buffers, key=lambda b: -b.bytes * (b.last - b.first + 1))[:largest]
    buffers = sorted(held, key=lambda b: (b.first, b.last))
    ax = ax or plt.subplots(figsize=(8, max(2.0, 0.18 * len(buffers))))[1]
    sizes = [b.bytes / 2**20 for b in buffers]
    top = max(sizes, default=1.0) or 1.0
    colors = plt.cm.viridis([s / top for s in sizes])
    ax.barh(range(len(buffers)), [b.last - b.first + 1 for b in buffers], left=[b.first for b in buffers],
            color=colors, height=0.8)
    ax.set_yticks(range(len(buffers)), [_buffer_label(plan, b) for b in buffers], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("kernel (plan order): a bar runs from the kernel writing the buffer to its last reader")
    mappable = plt.cm.ScalarMappable(norm=plt.Normalize(0, top), cmap=plt.cm.viridis)
    ax.figure.colorbar(mappable, ax=ax, label="buffer size (MiB)", fraction=0.03, pad=0.01)
    return ax


def _buffer_label(plan, buffer) -> str:
    """`%14 down_blocks.0.resnets.0 conv · 40.0 MiB`: the buffer, who writes it, its size."""
    writer = plan.kernels[buffer.first] if 0 <= buffer.first < len(plan.kernels) else None
    who = f" {_last_modules(writer.component, 2) or '(no scope)'} {writer.kind}" if writer is not None else ""
    return f"{buffer.name}{who} · {human_bytes(buffer.bytes)}"
