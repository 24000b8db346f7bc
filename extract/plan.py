"""The `Plan`: the kernels an extraction chose, in order, with their buffers and modeled cost.

    plan = Plan.build(extraction.terms, program=program, class_of=extraction.class_of,
                      class_components=components, device="h100", extractor="greedy")
    plan.kernels[i].kind / .component / .inputs / .outputs / .term / .bytes / .flops / .seconds
    plan.peak_bytes; print(plan.summary(depth=1)); plan.to_json(); plan.evaluate(*args)

- `kernels`: every kernel term reachable from the outputs, producers first. `.term` is the kernel
  itself: its operand expressions (prologues), epilogue and views are its arguments.
- A loop (`scan`/`while`/`cond`) is one kernel of kind `loop` whatever number of its outputs the
  plan reads: `.outputs` lists them (`Loop` terms, by index), `.body` is the plan of its body (the
  body's kernels, built like the plan's own, nested loops included), launched per iteration.
  `loop_body_kernels` / `naive_loop_body_kernels` count body kernels (all loops, all depths); the
  loop's cost includes its body's (once, as `eqsat.cost.kernel_cost` prices a `Loop`).
- `.kind`: `Pointwise` -> pointwise, `Matmul` -> matmul, `Conv` -> conv, `Attention` -> attention,
  `Gather` -> gather, `Reduce` -> norm when its component's innermost module is a normalization
  (`norm1`, `final_layer_norm`, `conv_norm_out`, ...; these are the statistics passes), else
  reduce, `Opaque` -> opaque. The rest map to the closest template: `AssignStatic` and
  `AssignDynamic` write a box elementwise -> pointwise; `AssignScatter` is an indexed write ->
  gather; `Loop` -> loop.
- `.component`: the innermost named scope (`"up_blocks.1.attentions.2.transformer_blocks.0.attn1"`)
  of the lifted node whose e-class the kernel fills (`Ref` handles map a class to lifted terms);
  a kernel of a class no lifted node is in (a horizontal fusion, say) takes the component of its
  first reader, else of its first operand.
- Statistics a kernel computes in its epilogue (`EpilogueReduce`, see `eqsat.cost.hosting`) are
  extra outputs of that kernel, not kernels; `hosted_reductions` counts them. Each is a small fp32
  buffer of per-tile partials (every slot written once by its tile: no memset, no atomics) that
  its readers merge; its buffer's bytes are the partials' (`eqsat.cost.roofline.partials_bytes`).
- Buffers: one per materialized tensor, live from its producing kernel to its last reader;
  program outputs live to the end. `peak_bytes` is the largest sum of live activation buffers
  over the kernel order (inputs, weights and constants are not counted).
- `evaluate(*args)` runs the plan's terms through the reference interpreter (`eqsat.interpret`);
  emitting Pallas kernels from a plan is a later stage (`emit/`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

from eqsat.cost import Cost, get_device, hosted_cost, hosted_reductions, kernel_cost, kernel_reads, kernels as kernel_order
from eqsat.cost.merges import finalize_cost, partials_bytes
from eqsat.cost.roofline import finished_statistics, merge_cost
from extract.drawing import plan_to_dot, render
from extract.siblings import stack_sibling_reductions
from extract.small_kernels import inline_small_kernels

KINDS = ("pointwise", "reduce", "matmul", "conv", "norm", "attention", "gather", "loop", "opaque", "finalize")
_KIND = {
    "Pointwise": "pointwise", "Reduce": "reduce", "Matmul": "matmul", "Conv": "conv", "Attention": "attention",
    "Gather": "gather", "AssignStatic": "pointwise", "AssignDynamic": "pointwise", "AssignScatter": "gather",
    "Opaque": "opaque", "Loop": "loop", "EpilogueReduce": "reduce",
}


def module_path(component: str) -> str:
    """The innermost scope of a `/`-joined component path."""
    return component.rsplit("/", 1)[-1] if component else ""


def component_group(component: str, depth: int) -> str:
    """The first `depth` module levels of a dotted path, an index staying with its module:
    `component_group("down_blocks.0.resnets.1.conv1", 1)` -> `"down_blocks.0"`, depth 2 ->
    `"down_blocks.0.resnets.1"`. `""` stays `""`."""
    levels: list[str] = []
    for part in module_path(component).split("."):
        if not part:
            continue
        if part.isdigit() and levels:
            levels[-1] += "." + part
        else:
            levels.append(part)
    return ".".join(levels[:depth]) if depth > 0 else ".".join(levels)


def kernel_kind(term, component: str = "") -> str:
    kind = _KIND.get(term.op, "opaque")
    if kind == "reduce" and "norm" in component_group(component, 0).rsplit(".", 1)[-1]:
        return "norm"
    return kind


@dataclass
class Kernel:
    index: int
    term: object                 # the kernel's Tensor term (eqsat.term.Term), its fused expression tree
    kind: str
    component: str
    inputs: list                 # tensors it reads (kernel outputs, inputs, constants), each once
    outputs: list                # tensors it writes: [term, *the EpilogueReduce statistics it adds into]
    bytes: float                 # (a loop: [term, *its other outputs read by the plan])
    flops: float
    seconds: float
    eclass: int | None = None
    body: list = field(default_factory=list)  # a loop's body: its kernels (Kernel), producers first
    merge_seconds: float = 0.0   # of `seconds`: merging hosted statistics' partials where it reads them

    @property
    def op(self) -> str:
        return self.term.op

    @property
    def hosted(self) -> list:
        """The `EpilogueReduce` statistics this kernel computes in its epilogue."""
        return [] if self.op == "Loop" else self.outputs[1:]


@dataclass
class Buffer:
    term: object
    name: str
    bytes: int
    first: int                   # producing kernel index (-1: an input or constant)
    last: int                    # last kernel that reads it (the last kernel for outputs)
    kind: str                    # "activation" | "output" | "input" | "constant"


@dataclass
class Plan:
    kernels: list[Kernel]
    buffers: list[Buffer]
    outputs: list                # the root terms, in the program's output order
    device: str
    extractor: str = "naive"
    program: object = None       # the eqsat.program.Program it was extracted for, if any
    naive_kernels: int | None = None
    naive_by_component: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    hosted_reductions: int = 0   # EpilogueReduce outputs computed by their producers (partials, no memset)
    naive_loop_body_kernels: int | None = None  # kernels inside the lifted program's loop bodies

    # --- construction --------------------------------------------------------------------

    @classmethod
    def build(cls, outputs, *, program=None, class_of=None, class_components=None, device="h100",
              extractor: str = "naive", plan_passes: bool = False, _outside: frozenset | None = None) -> "Plan":
        """The plan of computing `outputs` (Tensor terms).

        `class_of` maps Tensor terms to e-classes and `class_components` e-classes to component
        paths (see `components_of_classes`); the program's own `components` serve lifted terms.
        `_outside` (a loop body's plan): the enclosing plans' kernels, computed before the loop.
        `plan_passes` (what extraction's plans get; the naive plan keeps one kernel per node): the
        passes on the extracted plan, which see dependencies across the whole program: independent
        sibling reductions run as one stacked kernel (`extract.siblings`), and small pointwise
        kernels are computed in their readers where the model prices that lower
        (`extract.small_kernels`).
        """
        device = get_device(device)
        options = dict(program=program, class_of=class_of or {}, class_components=class_components or {},
                       device=device, extractor=extractor)
        if not plan_passes or _outside is not None:
            return cls._build(outputs, **options, _outside=_outside)
        outputs, source_of = stack_sibling_reductions(outputs, hosted_reductions(outputs))
        plan = cls._build(outputs, **options, source_of=source_of)
        inlined, rebuilt = inline_small_kernels(plan)
        if rebuilt:
            source_of = {**source_of, **{new: source_of.get(old, old) for new, old in rebuilt.items()}}
            candidate = cls._build(inlined, **options, source_of=source_of)
            if candidate.seconds < plan.seconds:
                plan = candidate
        return plan

    @classmethod
    def _build(cls, outputs, *, program, class_of, class_components, device, extractor,
               source_of: dict | None = None, _outside: frozenset | None = None) -> "Plan":
        """`build` without the plan passes; `source_of` maps a term a pass rebuilt to the extracted
        term it stands for (its component and e-class)."""
        lifted = program.components if program is not None else {}
        source_of = source_of or {}
        hosting = hosted_reductions(outputs)
        if _outside:  # a loop body: a statistic whose host ran before the loop is read, or runs alone
            hosting = {reduction: None if hosts is not None and any(h in _outside for h in hosts) else hosts
                       for reduction, hosts in hosting.items()}
        order = kernel_order(outputs, hosting)
        if _outside:
            order = [term for term in order if term not in _outside]
        order, loop_outputs = _one_kernel_per_loop(order)
        finished = finished_statistics(order, hosting, device, outputs)
        order, finalizes = _with_finalizes(order, hosting, finished)
        index_of = {term: i for i, term in enumerate(order)}
        for term, others in loop_outputs.items():
            index_of.update((other, index_of[term]) for other in others)
        hosted: dict[int, list] = {}  # kernel index -> the EpilogueReduce outputs it adds into
        share: dict = {}              # reduction -> how many kernels host it
        for reduction, hosts in hosting.items():
            if hosts is not None:
                for host in hosts:
                    hosted.setdefault(index_of[host], []).append(reduction)
                index_of[reduction] = min(index_of[host] for host in hosts)
                share[reduction] = len(hosts)

        components: list[str | None] = []
        for term in order:
            source = source_of.get(term, term)
            component = lifted.get(source)
            if component is None and source in class_of:
                component = class_components.get(class_of[source])
            components.append(module_path(component) if component is not None else None)

        reads = [{term: partials_bytes(term)} if i in finalizes else kernel_reads(term) for i, term in enumerate(order)]
        readers: dict[int, list[int]] = {}
        for i, tensors in enumerate(reads):
            for tensor in tensors:
                if tensor in index_of:
                    readers.setdefault(index_of[tensor], []).append(i)
        # Kernels no lifted node stands for: their first reader's component, else an operand's.
        for i in range(len(order)):
            if components[i] is None:
                for reader in readers.get(i, []):
                    if components[reader]:
                        components[i] = components[reader]
                        break
        for i in range(len(order)):
            if components[i] is None:
                for tensor in reads[i]:
                    j = index_of.get(tensor)
                    if j is not None and components[j]:
                        components[i] = components[j]
                        break
        kernels = []
        outside = (_outside or frozenset()) | set(order) | set(share)
        for i, term in enumerate(order):
            if i in finalizes:  # the statistic finished once: a small merge kernel after its last host
                cost = finalize_cost(term, device)
                kernels.append(Kernel(i, term, "finalize", components[i] or "", list(reads[i]), [term], cost.bytes,
                                      cost.flops, cost.seconds, class_of.get(source_of.get(term, term))))
                continue
            cost = kernel_cost(term, device, finished)
            merge = merge_cost(term, device, finished).seconds
            body: list = []
            if term.op == "Loop":
                body = cls._build(list_items(term.args[2]), program=program, class_of=class_of,
                                 class_components=class_components, device=device, extractor=extractor,
                                 _outside=outside).kernels
                for other in loop_outputs[term]:  # its other outputs: their writes, not another body
                    written = _nbytes(other)
                    cost = cost + Cost(written, 0.0, device.memory_seconds(written))
            for reduction in hosted.get(i, ()):
                part = hosted_cost(reduction, device)
                n = share[reduction]
                cost = cost + type(part)(part.bytes / n, part.flops / n, part.seconds / n)
            component = components[i] or ""
            kernels.append(Kernel(i, term, kernel_kind(term, component), component, list(reads[i]),
                                  [term, *loop_outputs.get(term, ()), *hosted.get(i, ())], cost.bytes,
                                  cost.flops, cost.seconds, class_of.get(source_of.get(term, term)), body, merge))

        buffers = _buffers([k.outputs for k in kernels], reads, outputs)
        plan = cls(kernels, buffers, list(outputs), device.name, extractor, program)
        plan.peak_bytes = _peak(buffers, len(order))
        plan.hosted_reductions = len(share)
        if program is not None and _outside is None:
            naive = kernel_order(program.outputs)
            plan.naive_loop_body_kernels = _loop_body_kernel_count(naive)
            naive, _ = _one_kernel_per_loop(naive)
            plan.naive_kernels = len(naive)
            for term in naive:
                group = module_path(program.components.get(term, ""))
                plan.naive_by_component[group] = plan.naive_by_component.get(group, 0) + 1
        return plan

    # --- totals ---------------------------------------------------------------------------

    @property
    def bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kernels)

    def __len__(self) -> int:
        return len(self.kernels)

    @property
    def loop_body_kernels(self) -> int:
        """Kernels inside the plan's loop bodies (nested loops' bodies included)."""
        return _body_count(self.kernels)

    def kinds(self) -> dict[str, int]:
        counts = {kind: 0 for kind in KINDS}
        for kernel in self.kernels:
            counts[kernel.kind] = counts.get(kernel.kind, 0) + 1
        return {kind: n for kind, n in counts.items() if n}

    # --- reports --------------------------------------------------------------------------

    def rows(self, depth: int = 1) -> list[dict]:
        """Per component group (see `component_group`): naive and fused kernels, bytes, seconds."""
        rows: dict[str, dict] = {}

        def row(group: str) -> dict:
            return rows.setdefault(group, {"component": group, "naive": 0, "fused": 0, "bytes": 0.0,
                                           "seconds": 0.0, "kinds": {}, "loop_body": {}})

        for component, count in self.naive_by_component.items():
            row(component_group(component, depth))["naive"] += count
        for kernel in self.kernels:
            entry = row(component_group(kernel.component, depth))
            entry["fused"] += 1
            entry["bytes"] += kernel.bytes
            entry["seconds"] += kernel.seconds
            entry["kinds"][kernel.kind] = entry["kinds"].get(kernel.kind, 0) + 1
            for inner in _flatten(kernel.body):  # a loop's row counts its body's kernels by kind
                entry["loop_body"][inner.kind] = entry["loop_body"].get(inner.kind, 0) + 1
        order = {}
        for kernel in self.kernels:  # groups in the order the plan first reaches them
            order.setdefault(component_group(kernel.component, depth), len(order))
        return sorted(rows.values(), key=lambda r: (order.get(r["component"], len(order)), r["component"]))

    def summary(self, depth: int = 1, *, print_it: bool = False) -> str:
        """A per-component table (naive vs fused kernels, modeled traffic and time) with totals."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"plan on {self.device} ({self.extractor})", show_footer=True)
        rows = self.rows(depth)
        naive_total = self.naive_kernels if self.naive_kernels is not None else sum(r["naive"] for r in rows)
        table.add_column("component", footer="total")
        table.add_column("naive", justify="right", footer=str(naive_total))
        table.add_column("fused", justify="right", footer=str(len(self.kernels)))
        table.add_column("MiB moved", justify="right", footer=f"{self.bytes / 2**20:,.1f}")
        table.add_column("µs", justify="right", footer=f"{self.seconds * 1e6:,.1f}")
        table.add_column("kernels by kind")
        for r in rows:
            kinds = _kind_counts(r["kinds"])
            if r["loop_body"]:
                kinds += f" (bodies: {_kind_counts(r['loop_body'])})"
            table.add_row(r["component"] or "(no scope)", str(r["naive"]), str(r["fused"]),
                          f"{r['bytes'] / 2**20:,.1f}", f"{r['seconds'] * 1e6:,.1f}", kinds)
        console = Console(file=io.StringIO(), width=120, record=True, force_terminal=False)
        console.print(table)
        console.print(f"peak activation memory {self.peak_bytes / 2**20:,.1f} MiB")
        if self.loop_body_kernels:
            naive = f" ({self.naive_loop_body_kernels} naive)" if self.naive_loop_body_kernels is not None else ""
            noun = "kernel" if self.loop_body_kernels == 1 else "kernels"
            console.print(f"{self.loop_body_kernels} {noun} inside loop bodies{naive}, launched per iteration; "
                          f"their cost is in their loops' rows")
        if self.hosted_reductions:
            console.print(f"{self.hosted_reductions} reductions computed in their producers' epilogues "
                          f"(not kernels; per-tile partials merged by their readers, no memsets)")
        text = console.export_text()
        if print_it:
            Console().print(table)
        return text

    def __repr__(self) -> str:
        naive = f"{self.naive_kernels} naive -> " if self.naive_kernels is not None else ""
        return (f"Plan({naive}{len(self.kernels)} kernels, {self.bytes / 2**20:,.1f} MiB, "
                f"{self.seconds * 1e6:,.1f} µs on {self.device}, peak {self.peak_bytes / 2**20:,.1f} MiB, "
                f"{self.extractor})")

    def to_dict(self) -> dict:
        names = {b.term: b.name for b in self.buffers}
        return {
            "device": self.device,
            "extractor": self.extractor,
            "naive_kernels": self.naive_kernels,
            "fused_kernels": len(self.kernels),
            "bytes": self.bytes,
            "flops": self.flops,
            "seconds": self.seconds,
            "peak_bytes": self.peak_bytes,
            "hosted_reductions": self.hosted_reductions,
            "loop_body_kernels": self.loop_body_kernels,
            "naive_loop_body_kernels": self.naive_loop_body_kernels,
            "kinds": self.kinds(),
            "kernels": [_kernel_dict(k, names) for k in self.kernels],
            "buffers": [{"name": b.name, "kind": b.kind, "bytes": b.bytes, "first": b.first, "last": b.last}
                        for b in self.buffers],
            "outputs": [names.get(t, "?") for t in self.outputs],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_dot(self, **options) -> str:
        """The plan as a Graphviz digraph: kernels as boxes, tensors as edges (`extract.drawing.plan_to_dot`)."""
        return plan_to_dot(self, **options)

    # --- running ----------------------------------------------------------------------------

    def evaluate(self, *args, **kwargs):
        """Run the plan through the reference interpreter on the function's own arguments."""
        from eqsat.interpret import evaluate

        program = self.program
        if program is None:
            raise ValueError("this plan has no program: evaluate its terms with eqsat.interpret.evaluate")
        env = program.environment(*args, **kwargs)
        return program.results(evaluate(self.outputs, env, program.constants, program.payloads))


def _kernel_dict(kernel: Kernel, names: dict) -> dict:
    entry = {"index": kernel.index, "kind": kernel.kind, "op": kernel.op, "component": kernel.component,
             "inputs": [names.get(t, "?") for t in kernel.inputs],
             "outputs": [names.get(t, "?") for t in kernel.outputs],
             "bytes": kernel.bytes, "flops": kernel.flops, "seconds": kernel.seconds, "type": kernel.term.ty,
             "expression": render(kernel.term, names), "hosted": [render(t, names) for t in kernel.hosted]}
    if kernel.op == "Loop":
        # Body tensors are named inside their loop: `%3/%0` is the body's first kernel of kernel 3.
        inner = dict(names)
        prefix = names.get(kernel.term, f"%{kernel.index}")
        for k in kernel.body:
            inner.update((t, f"{prefix}/%{k.index}" + (f".{j}" if j else "")) for j, t in enumerate(k.outputs))
            inner.update((t, f"{prefix}/arg{t.args[1]}") for t in k.inputs if t.op == "LoopArg")
        entry["body"] = [_kernel_dict(k, inner) for k in kernel.body]
    return entry


def _one_kernel_per_loop(order: list) -> tuple[list, dict]:
    """`order` with the `Loop` output terms of one loop (same key, operands and body) as one kernel,
    at its first output's place and named by its lowest output index; and that term -> the
    loop's other outputs in `order`, by index."""
    groups: dict[tuple, list] = {}
    for term in order:
        if term.op == "Loop":
            groups.setdefault((term.args[0], id(term.args[1]), id(term.args[2])), []).append(term)
    if all(len(group) == 1 for group in groups.values()):
        return order, {group[0]: [] for group in groups.values()}
    merged, others, placed = [], {}, set()
    for term in order:
        if term.op != "Loop":
            merged.append(term)
            continue
        group = groups[(term.args[0], id(term.args[1]), id(term.args[2]))]
        if id(group[0]) in placed:
            continue
        placed.add(id(group[0]))
        first, *rest = sorted(group, key=lambda t: t.args[3])
        merged.append(first)
        others[first] = rest
    return merged, others


def list_items(lst) -> list:
    """The items of a `TCons`/`TNil` list term."""
    items = []
    while lst.op == "TCons":
        items.append(lst.args[0])
        lst = lst.args[1]
    return items


def _flatten(kernels: list) -> list:
    """`kernels` and, recursively, the kernels of their loop bodies."""
    out, stack = [], list(reversed(kernels))
    while stack:
        kernel = stack.pop()
        out.append(kernel)
        stack.extend(reversed(kernel.body))
    return out


def _body_count(kernels: list) -> int:
    return sum(len(_flatten(k.body)) for k in kernels)


def _kind_counts(kinds: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))


def _loop_body_kernel_count(order: list, outside: frozenset = frozenset()) -> int:
    """Kernels inside the bodies of the loops in `order` (a kernel order), nested loops included."""
    total, seen = 0, set()
    outside = outside | set(order)
    for term in order:
        if term.op != "Loop" or (term.args[0], id(term.args[2])) in seen:
            continue
        seen.add((term.args[0], id(term.args[2])))
        body = [t for t in kernel_order(list_items(term.args[2])) if t not in outside]
        groups = {(t.args[0], id(t.args[2])) for t in body if t.op == "Loop"}
        total += len(body) - sum(1 for t in body if t.op == "Loop") + len(groups)
        total += _loop_body_kernel_count(body, outside)
    return total


def _nbytes(term) -> int:
    from eqsat.cost.roofline import HOSTED_OPS, partials_bytes
    from eqsat.types import parse_type

    if term.op in HOSTED_OPS:
        return int(partials_bytes(term.args[1], term.args[2].ty, term.ty))
    return parse_type(term.ty).nbytes


def _with_finalizes(order: list, hosting: dict, finished: frozenset) -> tuple[list, set[int]]:
    """`order` with each statistic of `finished` right after its last host, and their positions."""
    after: dict[int, list] = {}
    position = {term: i for i, term in enumerate(order)}
    for statistic in hosting:  # in a fixed order
        if statistic not in finished:
            continue
        hosts = [position[h] for h in hosting.get(statistic) or () if h in position]
        if hosts:
            after.setdefault(max(hosts), []).append(statistic)
    result, finalizes = [], set()
    for i, term in enumerate(order):
        result.append(term)
        for statistic in after.get(i, ()):
            finalizes.add(len(result))
            result.append(statistic)
    return result, finalizes


def _buffers(written, reads, outputs) -> list[Buffer]:
    """Buffers of a plan whose kernel i writes the tensors `written[i]` and reads `reads[i]`."""
    index_of: dict = {}
    for i, terms in enumerate(written):
        for term in terms:
            index_of.setdefault(term, i)  # a reduction several kernels add into: the first one
    last_read: dict = {}
    external: dict = {}
    for i, tensors in enumerate(reads):
        for tensor in tensors:
            last_read[tensor] = i
            if tensor not in index_of:
                external.setdefault(tensor, None)
    end = len(written) - 1
    output_set = set(outputs)
    buffers = []
    for tensor in external:
        kind = "constant" if tensor.op == "Constant" else "input"
        name = tensor.args[0] if tensor.op in ("Input", "Constant", "LoopArg") else f"ext{len(buffers)}"
        if tensor.op == "Constant":
            name = f"const:{name}"
        buffers.append(Buffer(tensor, name, _nbytes(tensor), -1, last_read[tensor], kind))
    for i, terms in enumerate(written):
        for j, term in enumerate(terms):
            if index_of[term] != i:
                continue
            is_output = term in output_set
            last = end if is_output else last_read.get(term, i)
            name = f"%{i}" if j == 0 else f"%{i}.{j}"
            buffers.append(Buffer(term, name, _nbytes(term), i, last, "output" if is_output else "activation"))
    for term in outputs:  # outputs that are inputs or constants themselves
        if term not in index_of and term not in external:
            buffers.append(Buffer(term, term.args[0] if term.op in ("Input", "Constant") else "?", _nbytes(term),
                                  -1, end, "input"))
    return buffers


def _peak(buffers: list[Buffer], count: int) -> int:
    if count == 0:
        return 0
    delta = [0] * (count + 1)
    for b in buffers:
        if b.kind in ("activation", "output"):
            delta[b.first] += b.bytes
            delta[b.last + 1] -= b.bytes
    peak = live = 0
    for i in range(count):
        live += delta[i]
        peak = max(peak, live)
    return peak


def components_of_classes(graph, handle_components: dict[int, str], rounds: int = 8) -> dict[int, str]:
    """E-class -> component path, for every class of `graph` (an `extract.EGraphData`) it can tell.

    A class with builder handles takes the component of its lowest handle that has one
    (`handle_components`: handle -> component), `""` if none has (lifted outside any scope). An
    expression class `Load(T)` takes `T`'s. Any other class takes that of the first labelled class
    reading it (a horizontally fused matmul takes its slices' readers'), a few hops up, else of
    its first labelled operand.
    """
    label: dict[int, str] = {}
    for cls, handles in sorted(graph.class_handles.items()):
        scoped = [handle_components[h] for h in handles if handle_components.get(h)]
        label[cls] = scoped[0] if scoped else ""  # a lifted node outside any scope stays there
    for node, op in enumerate(graph.node_op):
        cls = graph.node_class[node]
        if op == "Load" and cls not in label:
            tensor = graph.node_children[node][0]
            if tensor in label:
                label[cls] = label[tensor]
    parents: dict[int, list[int]] = {}
    for node, cls in enumerate(graph.node_class):
        for child in graph.node_children[node]:
            if child >= 0:
                parents.setdefault(child, []).append(cls)
    for _ in range(rounds):
        changed = False
        for cls in range(graph.num_classes):
            if cls in label:
                continue
            for parent in parents.get(cls, ()):
                if parent in label:
                    label[cls] = label[parent]
                    changed = True
                    break
        if not changed:
            break
    for _ in range(rounds):
        changed = False
        for cls in range(graph.num_classes):
            if cls in label:
                continue
            for node in graph.class_nodes[cls]:
                found = next((label[c] for c in graph.node_children[node] if c >= 0 and c in label), None)
                if found:
                    label[cls] = found
                    changed = True
                    break
        if not changed:
            break
    return label


def plan_from_extraction(extraction, program=None, handles: dict | None = None, device="h100", *,
                         handle_components: dict[int, str] | None = None) -> Plan:
    """The `Plan` of an `extract.Extraction`; `handles` is `Builder.handles` (Term -> handle), or
    pass `handle_components` (handle -> component) directly."""
    if handle_components is None:
        handle_components = {}
        if program is not None and handles is not None:
            handle_components = {h: program.components.get(t, "") for t, h in handles.items()}
    class_components = components_of_classes(extraction.graph, handle_components)
    return Plan.build(extraction.terms, program=program, class_of=extraction.class_of,
                      class_components=class_components, device=device, extractor=extraction.extractor,
                      plan_passes=True)
