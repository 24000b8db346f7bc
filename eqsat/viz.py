"""Drawing, the ground floor: a `Drawing` (DOT text, SVG where Graphviz's `dot` exists, a text
rendering), writing it to a file, and drawing the e-graph.

    show(drawing, "plan.svg")                  written to a file (.svg, .png, .pdf by Graphviz; .dot, .txt)
    egraph_drawing(graph, neighbourhood(graph, [root], depth=2), chosen=chosen_nodes(selection))
                                               e-classes as dashed boxes, e-nodes inside, the extracted
                                               e-nodes in gold
    plot_kernel_counts({"eqsat": ..., "XLA": ...})   kernels per component, side by side

Plans are drawn by `extract.drawing` (`plan.to_dot()`, `plan_drawing`, `plot_memory`) and a
lowering's e-graph around one component by `lowered.egraph_view(component=...)`
(`driver.egraph_view`); their old names here still work until eqsat 0.3, with a
`DeprecationWarning`.

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

from eqsat import moved

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


def quote_dot(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\l") + '"'


def wrap_label(text: str, width: int, limit: int) -> str:
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) + "\n"


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
        lines.append(f"  labelloc=t; label={quote_dot(title)};")
    outside: set[int] = set()
    for cls in classes:
        color = "red" if cls in focus else "grey40"
        label = f"e{cls} {graph.class_type[cls] or graph.class_sort[cls]}"
        lines.append(f"  subgraph cluster_{cls} {{ style=dashed; color={color}; fontsize=9; label={quote_dot(label)};")
        for node in graph.class_nodes[cls]:
            style = "style=\"rounded,filled,bold\", fillcolor=gold" if node in chosen else ""
            lines.append(f"    n{node} [label={quote_dot(node_label(graph, node))} {style}];")
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
        lines.append(f"  out{child} [shape=point, color=grey60, xlabel={quote_dot(f'e{child}')}, fontcolor=grey50];")
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


_MOVED_NAMES = dict.fromkeys(
    ("expression_text", "display_names", "input_paths", "plan_to_dot", "plans_to_dot", "plan_text", "plan_drawing",
     "plans_drawing", "live_bytes", "plot_memory", "plot_lifetimes"), "extract.drawing") | dict.fromkeys(
    ("egraph_view", "class_components"), "driver.egraph_view")


def __getattr__(name: str):
    return moved.moved_attribute(__name__, name, _MOVED_NAMES)
