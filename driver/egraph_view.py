"""`Lowered.egraph_view`: the e-classes around one component, tensor or class of a lowering's
saturated e-graph, the extracted e-nodes highlighted (drawn by `eqsat.viz`)."""

from __future__ import annotations

from collections.abc import Iterable

from eqsat.lang import KERNEL_OPS
from eqsat.viz import Drawing, chosen_nodes, egraph_drawing, language_classes, neighbourhood
from extract.plan import components_of_classes


def class_components(lowered) -> dict[int, str]:
    """E-class -> component path for a lowering's serialized e-graph (`extract.plan.components_of_classes`)."""
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
