"""Drawing plans and e-graphs: Graphviz DOT text, SVG where a `dot` program exists, matplotlib plots.

    plan.to_dot()                              kernels as boxes (kind, component, fused expression),
                                               tensors as edges labelled with their type and size
    lowered.show() / plan_drawing(plan)        the same, displayed inline in a notebook
    lowered.show("plan.svg")                   written to a file (.svg, .png, .pdf by Graphviz; .dot, .txt)
    plans_drawing({"naive": a, "fused": b})    plans side by side
    egraph_view(lowered, component="mid_block.attentions.0", depth=2)
                                               the e-classes around one component, tensor or class,
                                               the extracted e-nodes highlighted
    plot_memory(plan), plot_lifetimes(plan)    live activation bytes over the kernel order; buffer lifetimes
    plot_kernel_counts({"eqsat": ..., "XLA": ...})   kernels per component, side by side

A `Drawing` shows as SVG in Jupyter when Graphviz's `dot` is on the PATH (`apt-get install
graphviz`); without it, one line says so and the drawing shows as text.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eqsat.lang import KERNEL_OPS

NO_DOT = "Graphviz's `dot` program is not installed (apt-get install graphviz): showing text instead."

KIND_COLORS = {
    "matmul": "#cfe2f3", "conv": "#d9ead3", "attention": "#fce5cd", "pointwise": "#eeeeee",
    "reduce": "#fff2cc", "norm": "#fff2cc", "gather": "#ead1dc", "opaque": "#f4cccc", "loop": "#d0e0e3",
}


def dot_program() -> str | None:
    """The path of Graphviz's `dot`, or None."""
    return shutil.which("dot")


def to_svg(source: str, timeout: float = 60.0) -> str | None:
    """`source` (DOT) rendered as SVG text by `dot`, or None when there is no `dot`."""
    dot = dot_program()
    if dot is None:
        return None
    result = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"dot failed ({result.returncode}): {result.stderr.strip()[:500]}")
    return result.stdout


@dataclass
class Drawing:
    """DOT source and a text rendering of the same picture; Jupyter shows the SVG, or the text."""

    source: str
    text: str

    def svg(self) -> str | None:
        return to_svg(self.source)

    def _repr_svg_(self) -> str | None:
        return self.svg()

    def __repr__(self) -> str:
        return self.text if dot_program() else f"{NO_DOT}\n{self.text}"

    def save(self, path) -> Path:
        """Write the drawing to `path`, in the format its suffix names: `.svg`, `.png`, `.pdf` (by
        Graphviz's `dot`), `.dot`/`.gv` (the DOT source) or `.txt` (the text rendering)."""
        path = Path(path)
        suffix = path.suffix.lower().lstrip(".")
        if suffix in ("dot", "gv"):
            path.write_text(self.source)
        elif suffix == "txt":
            path.write_text(self.text + "\n")
        elif suffix in ("svg", "png", "pdf"):
            dot = dot_program()
            if dot is None:
                raise RuntimeError(f"writing {path.name} needs Graphviz's `dot` (apt install graphviz); "
                                   f"save as .dot or .txt instead")
            result = subprocess.run([dot, f"-T{suffix}", "-o", str(path)], input=self.source.encode(),
                                    capture_output=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"dot failed ({result.returncode}): {result.stderr.decode()[:500]}")
        else:
            raise ValueError(f"cannot tell the format of {path.name!r}: use .svg, .png, .pdf, .dot, .gv or .txt")
        return path


def show(drawing: Drawing, path=None) -> Path | None:
    """Write `drawing` to `path` when given (`Drawing.save`); else display it in a running notebook
    (SVG, or text without `dot`) and print its text elsewhere."""
    if path is not None:
        return drawing.save(path)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(drawing)
    else:
        print(repr(drawing))
    return None


def human_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\l") + '"'


def _wrap(text: str, width: int, limit: int) -> str:
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) + "\n"


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
    from extract.plan import render

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
    levels: list[str] = []
    for part in path.split("."):
        if part.isdigit() and levels:
            levels[-1] += "." + part
        else:
            levels.append(part)
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
        label = head + "\n" + (component + "\n" if component else "") + _wrap(expression, 60, expression_chars)
        label += "".join(_wrap(line, 60, 200) for line in statistics)
        color = KIND_COLORS.get(kernel.kind, "#ffffff")
        lines.append(f"  {prefix}k{kernel.index} [shape=box, style=filled, fillcolor={_quote(color)}, "
                     f"label={_quote(label)}];")
    if draw_inputs:
        paths = input_paths(plan.program)
        for buffer in external:
            label = f"{paths.get(buffer.name) or buffer.name}\n{buffer.term.ty}"
            lines.append(f"  {prefix}in_{_node_id(buffer.name)} [shape=ellipse, label={_quote(label)}];")
    elif external:
        label = f"{len(external)} inputs and constants, {human_bytes(sum(b.bytes for b in external))}"
        lines.append(f"  {prefix}inputs [shape=ellipse, label={_quote(label)}];")
    for source, target, label, statistics in edges:
        if source.startswith("in_"):
            if not draw_inputs:
                continue
            source = "in_" + _node_id(source[3:])
        style = ", style=dashed" if statistics else ""
        lines.append(f"  {prefix}{source} -> {prefix}{target} [label={_quote(label)}{style}];")
    lines.append(f"  {prefix}outputs [shape=doublecircle, label=out, fontsize=9];")
    for term in plan.outputs:
        buffer = buffers.get(term)
        if buffer is not None and (buffer.first >= 0 or draw_inputs):
            source = f"k{buffer.first}" if buffer.first >= 0 else f"in_{_node_id(buffer.name)}"
            label = f"{buffer.name} {term.ty} {human_bytes(buffer.bytes)}"
            lines.append(f"  {prefix}{source} -> {prefix}outputs [label={_quote(label)}];")
    return lines


_PLAN_HEADER = "  rankdir=TB; node [fontname=Helvetica, fontsize=10]; edge [fontname=Helvetica, fontsize=9];"


def plan_to_dot(plan, *, expression_chars: int = 240, inputs: bool | None = None, title: str | None = None) -> str:
    """The plan as a DOT digraph: a box per kernel (kind, modeled bytes and time, component, its fused
    expression with tensors by buffer name), an edge per tensor read (name, type, size; dashed for
    statistics computed in a producer's epilogue), program inputs as ellipses (`inputs=None`: only
    when there are at most 24 of them, else one node stands for all) and the outputs."""
    lines = ["digraph plan {", _PLAN_HEADER]
    if title:
        lines.append(f"  labelloc=t; label={_quote(title)};")
    lines += _plan_body(plan, "", expression_chars, inputs)
    lines.append("}")
    return "\n".join(lines)


def plans_to_dot(plans: dict, *, expression_chars: int = 160, inputs: bool | None = None) -> str:
    """Several plans side by side, one titled cluster each (`{"naive": plan_a, "fused": plan_b}`)."""
    lines = ["digraph plans {", _PLAN_HEADER]
    for i, (name, plan) in enumerate(plans.items()):
        title = f"{name}: {len(plan.kernels)} kernels, {human_bytes(plan.bytes)} moved, {plan.seconds * 1e6:.1f} µs"
        lines.append(f"  subgraph cluster_plan{i} {{ label={_quote(title)}; fontsize=12; color=grey60;")
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
        out.append(textwrap.indent(_wrap(expression, 100, expression_chars), "    ").rstrip())
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


# --- the e-graph -------------------------------------------------------------------------------------


def chosen_nodes(selection) -> set[int]:
    """The e-nodes an `extract.Selection` uses, in any kernel."""
    return {selection.node_of(slot) for slot in selection.postorder()}


LANGUAGE_SORTS = ("Tensor", "Expr", "TensorList")


def language_classes(graph) -> int:
    """How many e-classes of an `extract.EGraphData` hold terms (not strings, integers, floats)."""
    return sum(sort in LANGUAGE_SORTS for sort in graph.class_sort)


def neighbourhood(graph, around: Iterable[int], depth: int = 2, max_classes: int = 40, *,
                  readers: bool = False) -> list[int]:
    """Classes within `depth` hops of `around` through operands (and readers, with `readers=True`),
    nearest first, at most `max_classes`."""
    parents: dict[int, set[int]] = {}
    if readers:
        for node, cls in enumerate(graph.node_class):
            for child in graph.node_children[node]:
                if child >= 0:
                    parents.setdefault(child, set()).add(cls)
    order = list(dict.fromkeys(around))
    seen = set(order)
    frontier = list(order)
    for _ in range(depth):
        following = []
        for cls in frontier:
            neighbours = [c for node in graph.class_nodes[cls] for c in graph.node_children[node] if c >= 0]
            neighbours += sorted(parents.get(cls, ()))
            for other in neighbours:
                if other not in seen and graph.class_sort[other] in LANGUAGE_SORTS:
                    seen.add(other)
                    following.append(other)
        order.extend(following)
        frontier = following
    return order[:max_classes]


def _literal_text(literal) -> str:
    return f"{literal:g}" if isinstance(literal, float) else repr(literal) if isinstance(literal, str) else str(literal)


def _is_type(literal) -> bool:
    return isinstance(literal, str) and literal.endswith("]") and "[" in literal


def node_label(graph, node: int) -> str:
    """`op(args)` with operands as dots and type strings left out (the class label has the type)."""
    parts = ["·" if child >= 0 else _literal_text(literal)
             for child, literal in zip(graph.node_children[node], graph.node_literals[node])
             if child >= 0 or not _is_type(literal)]
    text = f"{graph.node_op[node]}({', '.join(parts)})"
    return text if len(text) <= 48 else text[:47] + "…"


def egraph_to_dot(graph, classes: Sequence[int], *, chosen: set[int] = frozenset(), focus: Iterable[int] = (),
                  title: str | None = None) -> str:
    """E-classes `classes` of an `extract.EGraphData` as dashed clusters of their e-nodes; an edge from
    an e-node to each operand class; operand classes outside `classes` as grey points; `chosen`
    e-nodes (the extracted plan) filled gold; `focus` classes outlined in red."""
    shown = set(classes)
    focus = set(focus)
    lines = ["digraph egraph {",
             "  compound=true; rankdir=TB; node [fontname=Helvetica, fontsize=9, shape=box, style=rounded];"]
    if title:
        lines.append(f"  labelloc=t; label={_quote(title)};")
    outside: set[int] = set()
    for cls in classes:
        color = "red" if cls in focus else "grey40"
        label = f"e{cls} {graph.class_type[cls] or graph.class_sort[cls]}"
        lines.append(f"  subgraph cluster_{cls} {{ style=dashed; color={color}; fontsize=9; label={_quote(label)};")
        for node in graph.class_nodes[cls]:
            style = "style=\"rounded,filled,bold\", fillcolor=gold" if node in chosen else ""
            lines.append(f"    n{node} [label={_quote(node_label(graph, node))} {style}];")
        if not graph.class_nodes[cls]:
            lines.append(f"    n_empty{cls} [label=\"\", shape=point];")
        lines.append("  }")
    for cls in classes:
        for node in graph.class_nodes[cls]:
            for child in dict.fromkeys(c for c in graph.node_children[node] if c >= 0):
                if child in shown and graph.class_nodes[child]:
                    target = f"n{graph.class_nodes[child][0]}"
                    lines.append(f"  n{node} -> {target} [lhead=cluster_{child}];")
                else:
                    outside.add(child)
                    lines.append(f"  n{node} -> out{child};")
    for child in sorted(outside):
        lines.append(f"  out{child} [shape=point, color=grey60, xlabel={_quote(f'e{child}')}, fontcolor=grey50];")
    lines.append("}")
    return "\n".join(lines)


def egraph_text(graph, classes: Sequence[int], *, chosen: set[int] = frozenset()) -> str:
    """The same view as text: a line per class, its e-nodes with operands as class ids (* = chosen)."""
    out = []
    for cls in classes:
        members = []
        for node in graph.class_nodes[cls]:
            operands = zip(graph.node_children[node], graph.node_literals[node])
            args = [f"e{c}" if c >= 0 else _literal_text(lit) for c, lit in operands if c >= 0 or not _is_type(lit)]
            members.append(("*" if node in chosen else "") + f"{graph.node_op[node]}({', '.join(args)})")
        out.append(f"e{cls} {graph.class_type[cls] or graph.class_sort[cls]}: " + " | ".join(members))
    return "\n".join(out)


def egraph_drawing(graph, classes: Sequence[int], *, chosen: set[int] = frozenset(), focus: Iterable[int] = (),
                   title: str | None = None) -> Drawing:
    """`egraph_to_dot` and `egraph_text` of the same classes, for display."""
    text = egraph_text(graph, classes, chosen=chosen)
    return Drawing(egraph_to_dot(graph, classes, chosen=chosen, focus=focus, title=title),
                   f"{title}\n{text}" if title else text)


def class_components(lowered) -> dict[int, str]:
    """E-class -> component path for a lowering's serialized e-graph (`extract.plan.components_of_classes`)."""
    from extract.plan import components_of_classes

    program, handles = lowered.program, lowered.builder.handles
    by_handle = {handle: program.components.get(term, "") for term, handle in handles.items()}
    return components_of_classes(lowered.extraction.graph, by_handle)


def egraph_view(lowered, *, component: str | None = None, term=None, classes: Iterable[int] = (), depth: int = 2,
                max_classes: int = 30, readers: bool = False, title: str | None = None) -> Drawing:
    """The e-classes around one component (Tensor classes with a kernel e-node whose component path
    ends with `component`, extracted ones first), one lifted tensor `term`, or explicit `classes`:
    `depth` hops through their operands (and readers), the extracted e-nodes highlighted. A whole
    UNet (~12,700 e-classes) says nothing drawn; this does."""
    extraction = lowered.extraction
    graph = extraction.graph
    around = list(classes)
    if term is not None:
        around.append(graph.handles[lowered.builder.handles[term]])
    chosen = chosen_nodes(extraction.selection)
    if component is not None:
        labels = class_components(lowered)
        matching = [c for c in range(graph.num_classes) if graph.class_sort[c] == "Tensor"
                    and labels.get(c, "").split("/")[-1].endswith(component)
                    and any(graph.node_op[n] in KERNEL_OPS for n in graph.class_nodes[c])]
        if not matching:
            raise ValueError(f"no kernel e-class belongs to a component ending with {component!r}")
        matching.sort(key=lambda c: not chosen & set(graph.class_nodes[c]))  # the extracted ones first
        around.extend(matching[:max(1, max_classes // 4)])
    if not around:
        raise ValueError("say what to draw around: component=, term= or classes=")
    shown = neighbourhood(graph, around, depth, max_classes, readers=readers)
    where = component or (f"{term.op} {term.ty}" if term is not None else ", ".join(f"e{c}" for c in around))
    heading = title or f"{len(shown)} of {language_classes(graph)} e-classes around {where} (extracted e-nodes in gold)"
    return egraph_drawing(graph, shown, chosen=chosen, focus=around, title=heading)


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


def plot_kernel_counts(series: dict[str, dict[str, float]], ax=None, title: str | None = None,
                       ylabel: str = "kernels", fmt: str = "%g"):
    """Grouped bars: a value per component (kernels by default) for each named series
    (e.g. `{"eqsat": {"mid_block": 14, ...}, "XLA": {...}}`)."""
    import matplotlib.pyplot as plt
    import numpy as np

    groups = list(dict.fromkeys(g for counts in series.values() for g in counts))
    ax = ax or plt.subplots(figsize=(max(6.0, 0.6 * len(groups) * len(series)), 3.5))[1]
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, counts) in enumerate(series.items()):
        bars = ax.bar(x + i * width, [counts.get(g, 0) for g in groups], width, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(x + width * (len(series) - 1) / 2, [g or "(no scope)" for g in groups], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend()
    if title:
        ax.set_title(title)
    return ax
