"""Pallas templates and the dispatch from a kernel term to the template that emits it.

A template is a module (the layout of jax's `pallas/ops/gpu`) with three parts:

    emit(kernel: KernelCall, ctx: EmitContext) -> dict[Term, jax.Array]
        Emit `kernel.term` as Pallas kernel(s) named `kernel.name` and return its value under
        `kernel.term`, plus any of `kernel.hosted` (the `EpilogueReduce` statistics the plan asks
        this kernel to compute) that it computes itself, as `emit.pallas.partials.Partials` (the
        per-tile partials of every host so far; `ctx.pending` has the earlier hosts'). Hosted
        reductions it leaves out are computed by the driver as their own reduce kernel. Build
        closures with `emit.expr`, pass a kernel the tensors it reads as `ctx.operand(tensor)` (a
        statistic as its partials, merged where the kernel reads it: `emit.expr.read_partials`;
        `ctx.value(tensor)` is a finished value), launch with `emit.pallas.triton.pallas_call(...,
        name=kernel.name, interpret=ctx.interpret)`. Raise `NotImplementedError("why")` for a form
        the template does not cover: the dispatcher then runs that kernel with the XLA emitter
        and warns (`XlaFallbackWarning`, naming the kernel and the reason) — never silently.
    build(...)       the pallas_call: grid, block sizes and validation (`ValueError` with a clear message)
    reference(...)   the same computation in plain jax.numpy

`TEMPLATES` maps each kernel op to its module. `emit_kernel(kernel, ctx)` dispatches; a module
that does not exist yet, a `NotImplementedError`, or an op with no template (`AssignScatter`)
falls back to `emit.xla.emit_kernel` for that kernel with a warning; a kernel with a zero-size
output or operand launches nothing (the XLA emitter computes its empty or constant result). Any
other exception from a template is a broken contract and raises `TemplateError` naming the
kernel (an `EmitError`, as is a tensor read before the kernel computing it ran).
`run_kernels(calls, ctx)` emits a sequence into `ctx.values` (the driver's plan, a loop body),
each kernel under `jax.named_scope(kernel.name)`, through `ctx.backend`'s emitter (`"hybrid"`: the
kinds `emit.library` names through XLA's libraries, the rest through their templates; `"mosaic"`:
the kinds `emit.mosaic` has Mosaic GPU templates for through them, the rest as `"pallas"`).

Identical kernels compile once: XLA compiles a Triton custom call once per distinct backend
config (its name and its Triton IR), and the IR of two kernels of the same template, fused
expression, configuration and shapes differs only by the kernel's name. So kernels with the same
structure (`kernel_structure`: the kernel term with the tensors it reads abstracted to their
types, and the statistics it hosts) share one `pallas_call` name, `shared_names`: the first use's
`"<component>:<kind>"` plus `.x<uses>` (`"up_blocks.1.resnets.0.conv1:conv.x9"`); a kernel used
once keeps its own name. A statistic finished from its hosts' partials (`finalize`) is known by
its op and type alone (`finalize_structure`): its kernel reads nothing of what produced it. Each
launch still runs under its own `jax.named_scope(kernel.name)`, so
the HLO op of every launch names its site (what profiles and `sd15 plan` read).
Measured (`python -m benchmarks.compile --duplicates 24`, loaded machine): 24 identical Triton
kernels compile for an H100 in 296 s named apart and 22 s named alike. And the first kernel of a
structure is traced and lowered once for all its sites (`emit_shared`).
`loaded_tensors(*exprs)` lists a kernel's operands (the tensors its Exprs `Load`), the order a
template passes them in.

    ctx = EmitContext(values={...}, constants=program.constants, payloads=program.payloads, interpret=True)
    outputs = emit_kernel(KernelCall(term, "mid_block.resnets.0:pointwise"), ctx)
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import jax

# Shared with `emit.mosaic` through `emit.backends` (below both packages); importable from here as before.
from emit.backends import (EmitError, TemplateError, emit_on_mosaic, is_empty, kernel_exprs, loaded_tensors,
                           mosaic_prepared_layouts, mosaic_side_values, runs_on_mosaic)
from eqsat.term import Term

def remember_missing_triton_dialect_module() -> None:
    """MLIR's Python bindings look for a Python module of the Triton dialect (`tt`) for every Triton
    value whose type they hand back and, finding none, do not remember it: ~10,000 lookups for the
    UNet, each a failed import under every search prefix (~1.2 of the ~4 CPU-s of lowering its
    kernels to Triton IR). An empty module under the first name they try makes the miss a hit; ops
    and types stay generic, as without one, and the Triton IR is the same (issue 18). Left alone
    where some `tt` module exists."""
    import importlib.util
    import sys
    import types

    name = "jaxlib.mlir.dialects.tt"
    if name in sys.modules:
        return
    for candidate in (name, "jaxlib.mosaic.python.tt", "jax.jaxlib.tt"):
        try:
            if importlib.util.find_spec(candidate) is not None:
                return
        except (ImportError, ValueError):
            continue
    sys.modules[name] = types.ModuleType(name, "empty: no Python classes for the Triton dialect (emit.pallas)")


remember_missing_triton_dialect_module()

TEMPLATES: dict[str, str] = {
    "Pointwise": "emit.pallas.pointwise",
    "AssignStatic": "emit.pallas.pointwise",
    "AssignDynamic": "emit.pallas.pointwise",
    "Reduce": "emit.pallas.reduce",
    "EpilogueReduce": "emit.pallas.reduce",
    "Gather": "emit.pallas.gather",
    "Matmul": "emit.pallas.matmul",
    "Attention": "emit.pallas.attention",
    "Conv": "emit.pallas.conv",
    "Opaque": "emit.pallas.loops",
    "Loop": "emit.pallas.loops",
}


class XlaFallbackWarning(UserWarning):
    """A kernel ran through the XLA emitter because no Pallas template covers it (yet)."""


@dataclass(frozen=True)
class KernelCall:
    """One kernel to emit: its term, its `pallas_call` name, the statistics it should also produce."""

    term: Term                       # the kernel's Tensor term (its operand, epilogue and view Exprs inside)
    name: str                        # "<component>:<kind>", e.g. "mid_block.attentions.0.proj_in:matmul"
    hosted: tuple[Term, ...] = ()    # EpilogueReduce terms the plan computes in this kernel's epilogue


@dataclass
class EmitContext:
    """What a template sees: tensor values computed so far, the program's side tables, the mode."""

    values: dict = field(default_factory=dict)      # Tensor term -> jax array (inputs, constants, earlier kernels, loop args)
    constants: dict = field(default_factory=dict)   # Program.constants: Constant key -> array
    payloads: dict = field(default_factory=dict)    # Program.payloads: Opaque/Gather/Loop key -> what it needs
    interpret: bool | None = None                   # pallas_call(interpret=...); None: by the lowering platform
    backend: str = "pallas"                         # "pallas", "mosaic", "hybrid" or "xla": which emitter runs each kernel
    components: dict = field(default_factory=dict)  # Program.components: lifted kernel term -> scope path
    shared: dict = field(default_factory=dict)      # results of multi-output kernels (Opaque, Loop), per call site
    partials: dict = field(default_factory=dict)    # hosted statistic -> its hosts' per-tile partials (all hosts run)
    pending: dict = field(default_factory=dict)     # hosted statistic -> the partials of the hosts run so far
    progress: bool | str | None = None              # a bar of kernels emitted (`run_kernels`); None: on a terminal, past 2 s
    structures: dict = field(default_factory=dict)  # `kernel_structure`'s numbering of what kernels are made of
    shared_kernels: dict = field(default_factory=dict)  # structure and state -> its `_SharedKernel` (`emit_shared`)
    routes: dict = field(default_factory=dict)      # backend "routed": kernel term -> "triton" | "mosaic" | "library"
    table_requests: list = field(default_factory=list)  # Mosaic convs' vector tables to write (`emit.pallas.tables`)
    tables: dict = field(default_factory=dict)      # conv term -> the vector table a Triton kernel wrote for it
    finishing: frozenset = frozenset()              # hosted statistics their Mosaic host finishes (`emit.mosaic.finish`)
    counter: Any = None                             # the ticket counter those hosts pass on (`emit.mosaic.finish`)

    def value(self, tensor: Term) -> jax.Array:
        """The finished value of a Tensor term (already computed, or a leaf). A statistic known only
        by its partials is merged here in plain jax, for readers outside the Pallas templates."""
        value = self.values.get(tensor)
        if value is not None:
            return value
        if tensor in self.partials:
            from emit.pallas.partials import merged

            value = merged(tensor, self.partials[tensor])
            self.values[tensor] = value
            return value
        if tensor.op == "Constant":
            import jax.numpy as jnp

            value = jnp.asarray(self.constants[tensor.args[0]])
            self.values[tensor] = value
            return value
        raise EmitError(f"{tensor!r} has not been computed before the kernel that reads it")

    def operand(self, tensor: Term) -> jax.Array:
        """What a Pallas kernel reading `tensor` through `emit.expr` is passed: its value, or for a
        statistic its hosts computed, their per-tile partials (the kernel merges them where it reads)."""
        if tensor not in self.values and tensor in self.partials:
            return self.partials[tensor]
        return self.value(tensor)

    def child(self, bound: dict) -> "EmitContext":
        """A context for a loop body: `bound` (LoopArg terms -> values) plus everything known here."""
        return EmitContext({**self.values, **bound}, self.constants, self.payloads, self.interpret, self.backend,
                           self.components, dict(self.shared), dict(self.partials), progress=False,
                           routes=self.routes)

    def kernel_name(self, term: Term, default: str = "") -> str:
        """`"<component>:<kind>"` for a kernel term the program's lift named, else `default`."""
        from extract.plan import kernel_kind, module_path

        component = self.components.get(term)
        if component is None:
            return default or kernel_kind(term)
        component = module_path(component)
        return name_of(component, kernel_kind(term, component))


def name_of(component: str, kind: str) -> str:
    """The `pallas_call` / named-scope name of a kernel: `"<component>:<kind>"` (`kind` alone at top level)."""
    return f"{component}:{kind}" if component else kind


def template_for(op: str):
    """The template module for kernel op `op`, or None when it has none (yet)."""
    name = TEMPLATES.get(op)
    if name is None:
        return None
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name == name:
            return None
        raise
    return module if hasattr(module, "emit") else None


def emit_kernel(kernel: KernelCall, ctx: EmitContext) -> dict:
    """The values of `kernel.term` (and the hosted statistics it computes), from its Pallas template,
    or from the XLA emitter with an `XlaFallbackWarning` when no template covers it."""
    from emit import xla

    module = template_for(kernel.term.op)
    if is_empty(kernel):  # nothing to launch: the reference computes the (empty or constant) result
        return xla.emit_kernel(kernel, ctx)
    if module is None:
        reason = f"no Pallas template for {kernel.term.op}"
    else:
        try:
            return module.emit(kernel, ctx)
        except NotImplementedError as error:
            reason = str(error) or f"{module.__name__} does not cover this {kernel.term.op}"
        except (EmitError, KeyError, AssertionError, IndexError, TypeError, ValueError, AttributeError) as error:
            detail = str(error) or type(error).__name__
            raise TemplateError(f"{kernel.name} ({kernel.term.op}): {module.__name__} failed on a kernel the "
                                f"plan gave it: {type(error).__name__}: {detail}") from error
    warnings.warn(f"{kernel.name} ({kernel.term.op}) runs through the XLA emitter: {reason}",
                  XlaFallbackWarning, stacklevel=2)
    return emit_with_xla(kernel, ctx)


def emit_with_xla(kernel: KernelCall, ctx: EmitContext) -> dict:
    """`kernel` through the XLA emitter inside a Pallas program: the statistics it reads finished
    (merged from their partials once, here), the ones it hosts computed finished."""
    from emit import xla

    for tensor in loaded_tensors(*kernel_exprs(kernel.term)):
        if tensor in ctx.partials:
            ctx.value(tensor)  # the XLA emitter reads finished statistics
    return xla.emit_kernel(kernel, ctx)


def kernel_structure(call: KernelCall, table: dict, reads: list | None = None) -> tuple:
    """What identifies `call`'s kernel up to the tensors it reads: its term and hosted statistics
    with every tensor read replaced by (op kind, type, first-read position), numbered through
    `table` (shared by the calls compared) so equal structures get equal tuples. `reads`, when
    given, receives the tensors read, in that position order."""
    from eqsat.term import postorder

    hosted = set(call.hosted)
    roots = [call.term, *call.hosted]

    def read(node) -> bool:
        return node.sort == "Tensor" and node is not call.term and node not in hosted

    ids: dict[int, int] = {}
    leaves: dict[int, int] = {}
    for node in postorder(roots, children=lambda n: () if read(n) else n.children):
        if read(node):
            constant = node.args[0] if node.op == "Constant" else None
            if id(node) not in leaves:
                leaves[id(node)] = len(leaves)
                if reads is not None:
                    reads.append(node)
            key = ("read", node.op == "EpilogueReduce", constant, node.ty, leaves[id(node)])
        else:
            key = (node.op, tuple(ids[id(a)] if isinstance(a, Term) else (type(a).__name__, a) for a in node.args))
        ids[id(node)] = table.setdefault(key, len(table))
    return tuple(ids[id(root)] for root in roots)


def shared_names(calls: list[KernelCall]) -> list[str]:
    """The `pallas_call` name of each call: calls of one structure (`kernel_structure`) share the
    first one's name plus `.x<uses>`; a structure used once keeps its call's name. Loops and
    opaque primitives keep theirs (they launch what their bodies do). A statistic finished from its
    hosts' partials (`finalize`) is known by `finalize_structure` alone."""
    table: dict = {}
    hosted = {reduction for call in calls for reduction in call.hosted}
    keys = [None if call.term.op in ("Loop", "Opaque")
            else finalize_structure(call.term) if is_finalize(call, hosted)
            else kernel_structure(call, table) for call in calls]
    first: dict[tuple, str] = {}
    uses: dict[tuple, int] = {}
    for call, key in zip(calls, keys):
        if key is not None:
            first.setdefault(key, call.name)
            uses[key] = uses.get(key, 0) + 1
    return [call.name if key is None or uses[key] == 1 else f"{first[key]}.x{uses[key]}"
            for call, key in zip(calls, keys)]


def is_finalize(call: KernelCall, finished) -> bool:
    """Whether `call` finishes a statistic from its hosts' partials (`emit.pallas.partials.finalize`):
    an `EpilogueReduce` that hosts nothing, in `finished` (the statistics hosted, or with partials)."""
    return call.term.op == "EpilogueReduce" and not call.hosted and call.term in finished


def finalize_structure(statistic: Term) -> tuple:
    """What a finalize kernel is made of: the statistic's op and type (its slots follow); its
    partials' shape is the rest (`emit_shared` keys on it). Not what its hosts computed: two
    statistics of one type over different producers finish with the same kernel."""
    return ("finalize", statistic.args[1], statistic.ty)


# Kernel ops whose emission is not shared: loops and opaque primitives run their own bodies, and
# a gather's or scatter's payload key (part of its term) differs at every site anyway.
NOT_SHARED = frozenset({"Loop", "Opaque", "Gather", "AssignScatter"})
FINISH_DEVICE = "h100"  # the device whose launch a producer-finished statistic's tail is weighed against


def emit_shared(kernel: KernelCall, ctx: EmitContext, mosaic: bool = False) -> dict:
    """`emit_kernel(kernel, ctx)`, traced and lowered once per kernel structure: the first kernel
    of a structure is emitted inside a `jax.jit` of the values it reads (and the partials of its
    statistics' earlier hosts); every later kernel of that structure, in the same state (which
    reads are partials, which prefixes exist, their shapes), calls the same jitted function on its
    own values, so JAX traces the template and lowers its Triton kernel once and XLA sees one
    function called at every site. Its results are rebound to the calling kernel's terms. A
    statistic finished from its partials is keyed by `finalize_structure` and its partials' shape.

    `mosaic`: the kernel's Mosaic GPU template first (`emit_on_mosaic`; its Triton template where
    that declines), shared the same way. The weight layouts the prepare stage made for it
    (`emit.mosaic.layouts.prepared_layouts`) are among its reads, so every site passes its own.
    Identical Mosaic kernels then lower to one module, which jaxlib compiles once per process
    (its kernel cache is keyed by the module). Other forms of its reads a Mosaic template left in the
    context (`emit.mosaic.layouts.side_values`: heads padded for the attention) go in as operands,
    and those it leaves of its own result come back under the calling kernel's keys; so does the
    vector table a Triton kernel wrote for a Mosaic conv (`ctx.tables`). The statistics
    it reads that are still partials are finished first, here (`finish_read_statistics`): finished
    inside the shared function they would be lost to the statistic's later readers."""
    from emit.pallas.partials import Partials

    if mosaic and not runs_on_mosaic(kernel.term):
        mosaic = False
    if kernel.term.op in NOT_SHARED or is_empty(kernel):
        return emit_unshared(kernel, ctx, mosaic)
    if ctx.table_requests and kernel.term.op in ("Reduce", "EpilogueReduce"):
        from emit.pallas import tables

        if tables.ready(kernel.term, ctx):  # it writes Mosaic convs' vector tables too: emitted here, not shared
            return emit_kernel(kernel, ctx)
    if mosaic and any(any(t is r for t in request.tensors) for request in ctx.table_requests
                      for r in kernel.hosted if r in ctx.finishing):
        return emit_unshared(kernel, ctx, mosaic)  # it writes Mosaic convs' vector tables (`emit.mosaic.finish`)
    reads: list = []
    if is_finalize(kernel, ctx.partials):  # only its partials are read: shared across producers
        structure = finalize_structure(kernel.term)
    else:
        structure = kernel_structure(kernel, ctx.structures, reads)
    sides: list = []  # (read position, key) of the other forms of what it reads (`side_values`)
    table = None
    if mosaic:
        finish_read_statistics(kernel, ctx)  # once, kept for the statistic's later readers
        layouts = [t for t in mosaic_prepared_layouts(kernel.term) if t in ctx.values]
        sides = [(i, key) for i, t in enumerate(reads) for key in mosaic_side_values(t) if key in ctx.values]
        reads = [*reads, *layouts]
        table = ctx.tables.get(kernel.term)  # the vector table a Triton kernel wrote for it (`emit.pallas.tables`)
        structure = ("mosaic", structure, tuple(ctx.structures.setdefault(("layout", t.ty), len(ctx.structures))
                                                for t in layouts), tuple((i, key[0]) for i, key in sides),
                     table is not None)
    states = []
    for tensor in reads:
        if tensor in ctx.values or tensor.op == "Constant":
            states.append("value")
        elif tensor in ctx.partials:
            states.append("partials")
        else:  # not computed yet: the template raises the error that says so
            return emit_unshared(kernel, ctx, mosaic)
    if kernel.term in ctx.partials:  # a statistic finished once from its hosts' partials (`finalize`)
        reads, states = [*reads, kernel.term], [*states, "partials"]
    operands = [ctx.partials[t] if state == "partials" else ctx.value(t) for t, state in zip(reads, states)]
    operands += [ctx.values[key] for _i, key in sides]
    if table is not None:  # taken here: left in `ctx.tables` above, where the kernel is emitted unshared
        operands.append(ctx.tables.pop(kernel.term))
    prefixes = [ctx.pending.get(r) for r in kernel.hosted]
    finishing = tuple(r in ctx.finishing for r in kernel.hosted)  # its last CTA finishes these (`emit.mosaic.finish`)
    import jax.numpy as jnp

    if any(finishing) and ctx.counter is None:  # zeroed once per emission (`emit.mosaic.finish.new_counter`)
        ctx.counter = jnp.zeros((1,), jnp.int32)
    counter = ctx.counter if any(finishing) else None
    key = (structure, tuple(states), tuple(_aval(a) for a in operands), tuple(_aval(p) for p in prefixes), finishing,
           _aval(counter))
    shared = ctx.shared_kernels.get(key)
    if shared is None:
        shared = ctx.shared_kernels[key] = _SharedKernel(kernel, reads, states, ctx, mosaic, sides, table is not None)
    results = shared.jitted(operands, prefixes, counter)
    if any(finishing):  # the counter the kernel passed on, last
        *results, ctx.counter = results
    order = [kernel.term, *kernel.hosted]
    produced = {order[i]: Partials(value) if partial else value for (i, partial), value in zip(shared.layout, results)}
    if shared.sides_out:  # the other forms of its result its template left (`side_values`), under this site's keys
        keys = {key[0]: key for key in mosaic_side_values(kernel.term)}
        for tag, value in zip(shared.sides_out, results[len(shared.layout):]):
            ctx.values[keys[tag]] = value
    return produced


def emit_unshared(kernel: KernelCall, ctx: EmitContext, mosaic: bool = False) -> dict:
    """The kernel's values from its Mosaic GPU template when `mosaic` and the template takes it (the
    statistics it reads finished first, `finish_read_statistics`), else from its Triton template
    (`emit_kernel`)."""
    if mosaic:
        finish_read_statistics(kernel, ctx)
    produced = emit_on_mosaic(kernel, ctx) if mosaic else None
    return produced if produced is not None else emit_kernel(kernel, ctx)


def finish_read_statistics(kernel: KernelCall, ctx: EmitContext) -> None:
    """Finish the statistics a Mosaic kernel reads that are only partials so far (`ctx.partials`; the
    Mosaic templates read statistics finished): each merged once by the Pallas finalize kernel (one
    launch, `<component>:finalize`, `eqsat.cost.roofline.driver_reduced` counts it; it also writes
    the vector tables of the Mosaic convs gathering it, `emit.pallas.tables`) and kept in
    `ctx.values`, so the statistic's later readers read that value rather than finish it again."""
    from emit.pallas import tables
    from emit.pallas.partials import finalize

    for tensor in loaded_tensors(*kernel_exprs(kernel.term)):
        if tensor in ctx.partials and tensor not in ctx.values:
            component = kernel.name.rsplit(":", 1)[0] if ":" in kernel.name else ""
            with tables.writing(tensor, ctx) as writes:
                ctx.values[tensor] = finalize(tensor, ctx.partials[tensor], interpret=ctx.interpret,
                                              name=f"{component}:finalize" if component else "finalize",
                                              tables=writes)


def _aval(value):
    return None if value is None else (tuple(value.shape), str(value.dtype))


class _SharedKernel:
    """The jitted emission of the first kernel of a structure (see `emit_shared`)."""

    def __init__(self, kernel: KernelCall, reads: list, states: list, ctx: EmitContext, mosaic: bool = False,
                 sides: list = (), table: bool = False):
        self.layout: list[tuple[int, bool]] = []  # (position in [term, *hosted], is partials) of each result
        self.sides_out: list = []  # tags of the other forms of its result the template left (`side_values`)

        def run(operands, prefixes, counter):
            from emit.pallas.partials import Partials

            inner = EmitContext({}, ctx.constants, ctx.payloads, ctx.interpret, ctx.backend, ctx.components)
            inner.finishing = frozenset(r for r in kernel.hosted if r in ctx.finishing)
            inner.counter = counter
            for tensor, state, value in zip(reads, states, operands):
                (inner.partials if state == "partials" else inner.values)[tensor] = value
            for (_i, key), value in zip(sides, operands[len(reads):]):
                inner.values[key] = value
            if table:  # the conv's vector table, last (`emit.pallas.tables`)
                inner.tables[kernel.term] = operands[-1]
            for reduction, prefix in zip(kernel.hosted, prefixes):
                if prefix is not None:
                    inner.pending[reduction] = prefix
            produced = emit_unshared(kernel, inner, mosaic)
            layout, results = [], []
            for i, term in enumerate([kernel.term, *kernel.hosted]):
                if term in produced:
                    value = produced[term]
                    layout.append((i, isinstance(value, Partials)))
                    results.append(value.buffer if isinstance(value, Partials) else value)
            self.layout, self.sides_out = layout, []
            if mosaic:
                for key in mosaic_side_values(kernel.term):
                    if key in inner.values:
                        self.sides_out.append(key[0])
                        results.append(inner.values[key])
            if inner.finishing:  # the ticket counter, passed on
                results.append(inner.counter)
            return results

        run.__name__ = run.__qualname__ = kernel.name
        self.jitted = jax.jit(run)


def run_kernels(calls: Iterable[KernelCall], ctx: EmitContext) -> None:
    """Emit `calls` in order into `ctx.values`, each under `jax.named_scope(call.name)`, with the
    emitter `ctx.backend` names. A hosted statistic is complete after its last host: as partials
    (`ctx.partials`, what the readers merge) when every host wrote its tiles, else the driver emits
    it right after its last host as its own reduce kernel. With Mosaic convs, the vector tables
    their haloed prologues gather from a statistic are asked of the Triton kernel finishing it
    (`emit.pallas.tables`: `ctx.table_requests`, written into `ctx.tables`); a statistic whose only
    host is a haloed Mosaic conv, which a finalize would finish otherwise, is finished by that
    conv's last CTA, with the tables waiting on it (`ctx.finishing`,
    `eqsat.cost.finish.producer_finished`; one ticket counter, `ctx.counter`, passes from each such
    conv to the next: `emit.mosaic.finish`) and kept as a value."""
    from emit import xla
    from emit.pallas.partials import Partials

    from emit.library import runs_in_library

    calls = list(calls)
    names = shared_names(calls)
    if ctx.backend in ("mosaic", "routed"):
        from emit.pallas import tables

        ctx.table_requests.extend(tables.plan_requests(calls, ctx))
    bar = emission_bar(len(calls), ctx.progress)
    last_host = {reduction: i for i, call in enumerate(calls) for reduction in call.hosted}
    host_count = {reduction: sum(reduction in call.hosted for call in calls) for reduction in last_host}
    if ctx.backend in ("mosaic", "routed"):  # statistics their only host finishes in its last CTA
        from eqsat.cost.devices import get_device
        from eqsat.cost.finish import producer_finished

        on_mosaic = lambda t: (ctx.backend == "mosaic" and runs_on_mosaic(t)) or ctx.routes.get(t) == "mosaic"  # noqa: E731
        finalized = frozenset(c.term for c in calls if c.term.op == "EpilogueReduce" and not c.hosted)
        ctx.finishing = producer_finished([(c.term, c.hosted) for c in calls], host_count, on_mosaic,
                                          get_device(FINISH_DEVICE), finalized)
    wrote: dict = {}  # hosted statistic -> how many of its hosts wrote their partials
    try:
        for i, call in enumerate(calls):
            if call.term.op == "EpilogueReduce" and call.term in ctx.values:
                bar.update(1)
                continue  # a statistic to finish that is already finished (the XLA emitter's hosts compute it)
            route = ctx.routes.get(call.term)  # backend "routed": the cost model's choice (`emit.backends.plan_routes`)
            with jax.named_scope(call.name):
                if ctx.backend == "xla":
                    produced = xla.emit_kernel(call, ctx)
                elif (ctx.backend == "hybrid" and runs_in_library(call.term)) or route == "library":
                    # A library kernel finishes only the statistics it alone hosts; shared ones are
                    # reduced by the driver after their last host (its partials are not written here).
                    own = tuple(r for r in call.hosted if host_count[r] == 1)
                    produced = emit_with_xla(KernelCall(call.term, call.name, own), ctx)
                else:
                    produced = emit_shared(KernelCall(call.term, names[i], call.hosted), ctx,
                                           mosaic=ctx.backend == "mosaic" or route == "mosaic")
                for term, value in produced.items():
                    if isinstance(value, Partials):
                        ctx.pending[term] = value.buffer
                        wrote[term] = wrote.get(term, 0) + 1
                    else:
                        ctx.values[term] = value
                for reduction in call.hosted:
                    if last_host[reduction] != i:
                        continue
                    buffer = ctx.pending.pop(reduction, None)
                    if reduction in ctx.values:
                        continue
                    if buffer is not None and wrote.get(reduction) == host_count[reduction]:
                        ctx.partials[reduction] = buffer
                        continue
                    name = call.name.rsplit(":", 1)[0] + ":reduce" if ":" in call.name else "reduce"
                    ctx.values.update(emit_kernel(KernelCall(reduction, name), ctx))
            bar.update(1)
    finally:
        bar.close()


def emission_bar(total: int, progress: bool | str | None):
    """A tqdm bar of kernels emitted (traced) out of `total`: `progress=None` shows it on a terminal
    only, once emission has taken 2 s; True always; False never; a string labels it."""
    from tqdm.auto import tqdm

    label = f"eqsat emit {progress}" if isinstance(progress, str) else "eqsat emit"
    return tqdm(total=total, desc=label, unit="kernel", leave=False, delay=0.0 if progress is True else 2.0,
                disable=None if progress is None else progress is False)
