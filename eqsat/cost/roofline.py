"""The roofline cost of kernel terms.

A kernel costs

    seconds = launch + bytes / hbm_bandwidth + flops / peak          (the SUM form of the roofline)

with `bytes` = every distinct tensor it `Load`s (at full size, or the part it reads through a
`Slice`/`DynamicSlice`/`Gather`) plus its output, and `flops` from shapes:

| kernel | flops |
|---|---|
| `Matmul` | 2·M·N·K = 2 · size(out) · prod(lhs contracting dims) |
| `Conv` | 2 · size(out) · K·kh·kw·Cin/groups = 2 · size(out) · size(weight) / Cout (zero-padded taps of a merged weight excluded); its input expression once per tap and output-channel tile, its per-(batch, channel) nodes once per program and channel chunk (`conv_prologue_flops`, `ConvPrograms`; extraction charges the same: `extract.prologue`) |
| `Matmul` prologues | the A expression once per N tile, the B expression once per M tile (`matmul_prologue_flops`) |
| a hosted statistic's merge | at each reader, as its template runs it: `lanes × tiles × MERGE_INSTRUCTIONS × 2` (`merge_cost`, `eqsat.cost.merges`), or nothing for a statistic the plan finishes once (a `finalize` kernel: `merges.finalize_cost`) |
| `Attention` | 4·B·H·S·Sk·D = 4 · size(q) · Sk |
| `Reduce` | size(body) for a sum/max/...; 3 · size(body) for `moments` (add, centre, FMA the square) |
| `AssignScatter` | size(updates) |
| `Opaque` | size(out) (unknown work: one op per element) |
| `Unary`/`Binary`/`Select` (Expr) | size(type) × the op's instructions (`ALU_INSTRUCTIONS`, 1 for an add) |
| `RowReduce` (Expr) | as `Reduce`, no bytes, no launch (see below) |
| `EpilogueReduce` (Tensor, hosted) | as `Reduce` + its body's ops, its partials' bytes, no launch (`hosted_cost`) |
| views, `Load`, `Acc`, `Lit`, `Iota` | 0 |

`RowReduce` is a reduction recomputed inside the kernel that reads it (row statistics in a
matmul's lhs prologue): its body's loads are the kernel's own reads (shared `Load` e-nodes), so
it owns only its flops (`node_cost`). A `Matmul` kernel's A prologue (a LayerNorm apply and its
row statistics, GEGLU's `value * gelu(gate)`) is charged once per N tile, as each (batch, M tile,
N tile) program computes it (`matmul_prologue_flops`; N tiles of the template's own
`emit.pallas.matmul.MatmulBlocks`), its B prologue once per M tile. Extraction still charges a
matmul's prologue once (`extract.prologue` models the conv's recompute only).

`EpilogueReduce` is a reduction computed by the kernels that write its body (`eqsat.cost.hosting`):
each of their output tiles writes its own partial (a sum, or count/mean/M2 for `moments`) into a
slot of an fp32 partials buffer, and the slots are merged in tile order, either by every kernel
reading the statistic or once by a `finalize` kernel the plan adds after the last host
(`eqsat.cost.merges`: whichever prices lower). Nothing is zeroed (no memset) and nothing is added
atomically. Its bytes are the partials' (`merges.partials_bytes`: every partial row its hosts'
templates write, `merges.statistic_tiles`, times its slots and `PARTIAL_FIELDS` floats; per node,
without the hosts, estimated as one row per `PARTIAL_TILE` reduced elements: `partials_bytes`),
written once by the hosts and read by each reader (`kernel_reads`), or by the finalize, whose
readers then read the finished statistic. One that cannot be hosted runs as its own reduction
kernel.

On a calibrated device (`h100-calibrated`, `h200-calibrated`: `eqsat.cost.devices`) the same counts are priced as our
templates run them (`eqsat.cost.work`): bytes and vector flops at fitted factors of the data sheet,
a `Matmul`/`Conv`/`Attention` kernel's dense work as its template's padded MMA at its instruction's
rate (wgmma or mma.sync) over the SMs its grid fills, plus its serial K steps and (attention) its
softmax's instructions. A compute node's flops count its instructions (`ALU_INSTRUCTIONS`: erf's
polynomial is 22, an add 1). `h100` (the default) is the data sheet alone.

We use the sum rather than `max(bytes/bw, flops/peak)`: it is additive, so a DAG's cost is a sum
over its e-nodes (what an ILP objective needs), and it never calls a kernel free because the
other resource dominates. Matmul/conv/attention on 16-bit operands run at the tensor-core peak,
everything else at the fp32 vector peak.

Two views of the same model:

- `node_cost(op, args, device)`: the cost of ONE e-node's own work, for extractors that add
  costs over a DAG. A kernel node owns launch + output write + its dense flops; a `Load` owns the
  read of its tensor; an Expr op owns its flops; a `TCons` owns the read of its head (operands of
  `Opaque`/`Loop`). Summed over the distinct nodes of an extraction, a tensor read by several
  kernels through the same `Load` e-node is paid once (shared), like the tensor itself.
- `kernel_cost(term, device, finished)`: the cost of one kernel `Term` of a chosen DAG, as the plan
  reports it: each distinct tensor it reads is paid once per kernel, each distinct Expr node's flops
  as often as its template computes it, the merges of the hosted statistics it reads unfinished
  (`merge_cost`; `merge_fraction` is their share). `dag_cost(roots)` sums it over the distinct
  kernels reachable from `roots`, with the finalize kernels the plan adds.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence

from eqsat.cost.backends import DENSE as ROUTED_OPS
from eqsat.cost.backends import (hosted_extra, library_cost, mosaic_cost, node_route_cost, routes_for,
                                 writes_partials)
from eqsat.cost.devices import Device, get_device, with_backend
from eqsat.cost.finish import producer_finish_tail, producer_finished
from eqsat.cost.hosting import hosted_reductions, hosts_of, side_inputs
from eqsat.cost.merges import (FINISHED_READERS, MERGE_SHARE_GOAL, finalize_cost, reader_merge_flops,  # noqa: F401
                               statistics_read)
from eqsat.cost.partials import partials_bytes as hosted_partials_bytes
from eqsat.cost.prologues import (conv_prologue_flops, conv_prologue_work, matmul_prologue_flops,  # noqa: F401
                                  prologue_node_flops)
from eqsat.cost.terms import (  # noqa: F401 (the model's vocabulary, importable from here as before)
    ALU_INSTRUCTIONS, COMPUTE_OPS, DENSE_OPS, EXPR_OPS, HOSTED_OPS, KERNEL_OPS, KNOWN_OPS, LEAF_OPS,
    PARTIAL_FIELDS, PARTIAL_TILE, REDUCTION_FLOPS, VIEW_OPS, ZERO, Cost, Term, args_of, compute_flops,
    dense_dtype, dtype_of, expr_nodes, itemsize_of, kernel_body, list_items, nbytes_of, node_vector_flops,
    nonzero_weight_elements,
    own_bytes, own_flops, partial_tiles, partials_bytes, reduction_flops, size_of)
from eqsat.cost.tiles import (  # noqa: F401
    CONV_BLOCK_M, CONV_BLOCK_N, CONV_BLOCK_W, CONV_MAX_TILE_ROWS, ConvPrograms, conv_output_tiles, conv_parts,
    conv_prologue_evaluations, conv_tile, zero_pad_taps)
from eqsat.cost.work import mma_seconds, node_work, priced_work

# Former private names, used by tests and tools.
_args_of, _kernel_body, _expr_nodes, _conv_parts, _nbytes = args_of, kernel_body, expr_nodes, conv_parts, nbytes_of


def node_cost(op: str, args: Sequence, device: "str | Device" = "h100", weight_elements: int | None = None,
              conv_ranges: Sequence[tuple[int, int]] | None = None) -> Cost:
    """The cost of one e-node's own work (see the module docstring).

    `args` is aligned with `lang.OPS[op][1]`: literal values at String/i64/f64 positions, the child's
    type string at Tensor/Expr positions, anything (ignored) at TensorList positions.

    >>> node_cost("Binary", ("add", "f32[4]", "f32[4]", "f32[4]"), "h100").flops
    4.0
    """
    device = get_device(device)
    if op not in KNOWN_OPS:
        return ZERO
    if device.backend != "triton" and op in ROUTED_OPS:  # priced as the backend emits it (`eqsat.cost.backends`)
        triton = node_cost(op, args, with_backend(device, "triton"), weight_elements, conv_ranges)
        return min((node_route_cost(op, args, route, device, triton, conv_ranges)
                    for route in routes_for(op, args, device)), key=lambda cost: cost.seconds)
    flops = own_flops(op, args, weight_elements)
    nbytes = own_bytes(op, args)
    if op in HOSTED_OPS:
        # Its readers' `Load`s are charged the statistic's size; they read its partials (once here).
        nbytes += max(0.0, nbytes - nbytes_of(args[-1]))
    seconds = device.memory_seconds(nbytes)
    if flops:
        seconds += _flop_seconds(op, args, flops, device, weight_elements, conv_ranges=conv_ranges)
    if op in KERNEL_OPS:
        seconds += device.launch_overhead
    return Cost(nbytes, flops, seconds)


def _flop_seconds(op: str, args: Sequence, flops: float, device: Device, weight_elements: int | None = None,
                  kernel: Term | None = None, conv_ranges=None) -> float:
    """Seconds of a node's own flops: a dense kernel's as its template runs them
    (`eqsat.cost.work.mma_seconds`: on a calibrated device the padded MMA at its instruction's rate,
    the serial steps; from `kernel`'s term when given, else from the types), the rest at the vector
    rate."""
    if op not in DENSE_OPS:
        return device.vector_seconds(flops)
    dtype = dense_dtype(op, args)
    if not device.calibrated:
        return flops / device.peak(dtype, True)
    try:
        template = priced_work(kernel) if kernel is not None else node_work(op, args, weight_elements, conv_ranges)
    except ValueError:  # a conv the template does not take (grouped, transposed): the roofline's rate
        return flops / device.peak(dtype, True)
    return mma_seconds(template, device, dtype)


_kernel_reads_memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # terms are interned


def kernel_reads(kernel: Term) -> dict[Term, float]:
    """The tensors `kernel` reads and how many bytes of each (each distinct tensor once).

    A tensor reached only through `Slice`/`DynamicSlice` is charged the slices it reads; the table
    of a `Gather` is charged at most the gathered size; otherwise a tensor is read in full. An
    `EpilogueReduce` is read as its whole partials buffer (`partials_bytes`), which the reader merges.
    Memoized per kernel term (extraction prices the same kernels many times); the caller gets its
    own dict.
    """
    try:
        return dict(_kernel_reads_memo[kernel])
    except KeyError:
        reads = _kernel_reads_memo[kernel] = _kernel_reads(kernel)
        return dict(reads)


def _kernel_reads(kernel: Term) -> dict[Term, float]:
    full: dict[Term, float] = {}
    partial: dict[Term, float] = {}
    whole: set[Term] = set()
    for node, parent in kernel_body(kernel):
        if node.sort == "Tensor":
            if node is not kernel and parent is not None and parent.op == "TCons":
                full[node] = nbytes_of(node.ty)
                whole.add(node)  # operands of Opaque/Loop/AssignDynamic starts
            continue  # an Assign target is updated in place, not read
        if node.op != "Load":
            continue
        tensor = node.args[0]
        full[tensor] = _stored_bytes(tensor)
        if tensor.op in HOSTED_OPS:
            whole.add(tensor)
        elif parent is not None and parent.op in ("Slice", "DynamicSlice"):
            itemsize = itemsize_of(dtype_of(tensor.ty))
            partial[tensor] = partial.get(tensor, 0.0) + size_of(parent.ty) * itemsize
        elif parent is not None and parent.op == "Gather" and parent.args[0] is node:
            partial[tensor] = partial.get(tensor, 0.0) + nbytes_of(parent.ty)
        else:
            whole.add(tensor)
    full.pop(kernel, None)
    reads = {}
    for tensor, size in full.items():
        if tensor in whole or tensor not in partial:
            reads[tensor] = float(size)
        else:
            reads[tensor] = float(min(size, partial[tensor]))
    return reads


def _stored_bytes(tensor: Term) -> float:
    """Bytes of `tensor` in memory: its type's, or its partials' for an `EpilogueReduce`."""
    if tensor.op in HOSTED_OPS:
        if hosts_of(tensor) is not None:
            return hosted_partials_bytes(tensor)
        return own_bytes(tensor.op, args_of(tensor))
    return float(nbytes_of(tensor.ty))


def kernel_cost(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> Cost:
    """The roofline cost of one kernel term as planned: launch + reads + write + flops.

    Operand expressions are charged as often as the template computes them (a conv's input per
    tap and output-channel tile, `conv_prologue_flops`; a matmul's A prologue per N tile,
    `matmul_prologue_flops`), and each hosted statistic it reads either merged where it reads it
    (`merge_cost`) or, for a statistic in `finished` (the plan finishes it once:
    `finished_statistics`), read as the finished statistic.

    An `EpilogueReduce` passed here is priced as its own Reduce kernel (what it is when it cannot
    be hosted); `hosted_cost` prices it inside its host.
    """
    device = get_device(device)
    if kernel.op not in KERNEL_OPS and kernel.op not in HOSTED_OPS:
        return ZERO
    if device.backend != "triton" and kernel.op in ROUTED_OPS:  # priced as the backend emits it
        return choose_route(kernel, device, finished)[1]
    reads = kernel_reads(kernel)
    for tensor in reads:
        if tensor in finished:
            reads[tensor] = float(nbytes_of(tensor.ty))
    nbytes = sum(reads.values()) + own_bytes(kernel.op, args_of(kernel))
    weights = nonzero_weight_elements(kernel.args[1]) if kernel.op == "Conv" else None
    dense_flops = own_flops(kernel.op, args_of(kernel), weights)
    vector_flops = 0.0
    seen: set[int] = set()
    if kernel.op == "Conv":  # its input prologue, as often as the conv template computes it
        vector_flops, covered = conv_prologue_flops(kernel)
        seen |= covered
    elif kernel.op == "Matmul":  # its operand prologues, once per N (A) or M (B) tile
        vector_flops, covered = matmul_prologue_flops(kernel)
        seen |= covered
    for node, _ in kernel_body(kernel):
        if id(node) in seen or node is kernel:
            continue
        seen.add(id(node))
        vector_flops += node_vector_flops(node)
    seconds = device.launch_overhead + device.memory_seconds(nbytes) + device.vector_seconds(vector_flops)
    if dense_flops:
        seconds += _flop_seconds(kernel.op, args_of(kernel), dense_flops, device, weights, kernel)
    body = Cost()
    if kernel.op == "Loop":
        # The body's kernels, once per launch of the loop (trip counts live in the payload).
        body = dag_cost(list_items(kernel.args[2]), device)
    return Cost(nbytes, dense_flops + vector_flops, seconds) + body + merge_cost(kernel, device, finished)


def route_cost(kernel: Term, route: str, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> Cost:
    """A `Matmul`, `Conv` or `Attention` kernel priced as `route` ("triton", "mosaic", "library")
    emits it on `device`, whatever its backend field (`eqsat.cost.backends`)."""
    triton = with_backend(device, "triton")
    if route == "triton":
        return kernel_cost(kernel, triton, finished)
    if route == "mosaic":
        return mosaic_cost(kernel, triton, kernel_reads(kernel), finished)
    if route == "library":
        return library_cost(kernel, triton, kernel_reads(kernel), finished)
    raise ValueError(f"unknown route {route!r}")


def choose_route(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset(),
                 hosted: Sequence[Term] = ()) -> tuple[str, Cost]:
    """(route, cost) of a dense kernel on `device`: its backend's route, or under `auto` the one it
    prices lowest (ties: Triton, then Mosaic), counting the reduce kernels of the statistics the
    plan hosts on it (`hosted`) that a route other than Triton runs (`eqsat.cost.backends.hosted_extra`)."""
    best = None
    for route in routes_for(kernel.op, args_of(kernel), device, kernel):
        cost = route_cost(kernel, route, device, finished)
        total = cost.seconds + sum(hosted_extra(r, route, device, kernel).seconds for r in hosted)
        if best is None or total < best[0]:
            best = (total, route, cost)
    return best[1], best[2]


def merge_cost(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> Cost:
    """The work `kernel` spends merging the partials of the hosted statistics it reads unfinished
    (not in `finished`), as its template does (`eqsat.cost.merges.reader_merge_flops`)."""
    device = get_device(device)
    if kernel.op not in KERNEL_OPS:
        return ZERO
    flops = 0.0
    for statistic in statistics_read(kernel):
        if statistic in finished or hosts_of(statistic) is None:
            continue
        flops += reader_merge_flops(kernel, statistic) or 0.0
    return Cost(0.0, flops, device.vector_seconds(flops)) if flops else ZERO


def merge_fraction(kernel: Term, device: "str | Device" = "h100", finished: frozenset = frozenset()) -> float:
    """The share of `kernel`'s modeled time spent merging hosted statistics' partials."""
    total = kernel_cost(kernel, device, finished).seconds
    return merge_cost(kernel, device, finished).seconds / total if total else 0.0


def hosted_cost(reduction: Term, device: "str | Device" = "h100") -> Cost:
    """What an `EpilogueReduce` adds to the kernels hosting it, all together: its side inputs'
    reads, the write of its partials (one slot per tile, `partials_bytes`) and its body's flops;
    no launch, no memset (every slot is written) and no read of the hosts (their values are the
    tiles being written). Its readers pay for reading the partials (`kernel_reads`)."""
    device = get_device(device)
    hosts = {id(h) for h in hosts_of(reduction) or (reduction.args[0],)}
    reads = {t: b for t, b in kernel_reads(reduction).items() if id(t) not in hosts}
    nbytes = sum(reads.values()) + _stored_bytes(reduction)
    flops = own_flops(reduction.op, args_of(reduction))
    seen: set[int] = set()
    for node, _ in kernel_body(reduction):
        if id(node) not in seen and node is not reduction and node.op in COMPUTE_OPS:
            seen.add(id(node))
            flops += compute_flops(node.op, node.args[0], size_of(node.ty))
    seconds = device.memory_seconds(nbytes) + device.vector_seconds(flops)
    return Cost(nbytes, flops, seconds)


def kernels(roots: Iterable[Term], hosting: dict | None = None) -> list[Term]:
    """The distinct kernel terms reachable from `roots`, producers first (no recursion).

    A `Loop`'s body belongs to the loop: its kernels are not listed (the `Loop` is one kernel).
    An `EpilogueReduce` is not listed when its producer's kernel hosts it (`eqsat.cost.hosting`);
    that kernel then comes after the reduction's side inputs. One that cannot be hosted is listed.
    `hosting`: `eqsat.cost.hosted_reductions(roots)` when the caller has it already.
    """
    roots = list(roots)
    if hosting is None:
        hosting = hosted_reductions(roots)
    extra: dict[int, list[Term]] = {}
    for reduction, hosts in hosting.items():
        for host in hosts or ():
            extra.setdefault(id(host), []).extend(side_inputs(reduction))
    order: list[Term] = []
    done: set[int] = set()
    stack: list[tuple[Term, bool]] = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        if ready:
            done.add(id(node))
            if node.op in KERNEL_OPS or (node.op in HOSTED_OPS and hosting.get(node) is None):
                order.append(node)
            continue
        stack.append((node, True))
        children = node.children
        if node.op == "Loop":
            children = (node.args[1],)
        if id(node) in extra:
            children = (*children, *extra[id(node)])
        for child in reversed(children):
            if id(child) not in done:
                stack.append((child, False))
    return order


def count_kernels(roots: Iterable[Term], device: "str | Device" = "h100") -> int:
    """How many kernels launch to compute `roots`: the kernels, and a finalize per statistic the
    plan finishes once (`finished_statistics`)."""
    roots = list(roots)
    hosting = hosted_reductions(roots)
    order = kernels(roots, hosting)
    return len(order) + len(finished_statistics(order, hosting, device, roots))


def dag_cost(roots: Iterable[Term], device: "str | Device" = "h100") -> Cost:
    """The cost of computing `roots`: each distinct kernel once (shared tensors are paid once),
    hosted statistics in their hosts, and the finalize of each statistic the plan finishes once.
    On a device whose backend routes dense kernels (`eqsat.cost.backends`), a statistic with a host
    on a route that writes no partials (Mosaic, the library) is reduced by its own kernel after its
    last host (`driver_reduced`), and read finished."""
    device = get_device(device)
    roots = list(roots)
    hosting = hosted_reductions(roots)
    order = kernels(roots, hosting)
    finished = finished_statistics(order, hosting, device, roots)
    routes, reduced = driver_reduced(order, hosting, device, finished)
    in_producer = producer_finished_of(order, hosting, routes, device, finished)
    readers_see = finished | reduced | in_producer
    total = Cost()
    for kernel in order:
        if id(kernel) in routes:
            total = total + route_cost(kernel, routes[id(kernel)], device, readers_see)
        else:
            total = total + kernel_cost(kernel, device, readers_see)
    for reduction, hosts in hosting.items():
        if reduction in reduced:
            total = total + hosted_extra(reduction, "mosaic", device)
        elif hosts is not None:
            total = total + hosted_cost(reduction, device)
    for statistic in finished - reduced - in_producer:
        total = total + finalize_cost(statistic, device)
    for statistic in in_producer:  # the host's last CTA merges the partials: its serial tail, no launch
        (host,) = hosting[statistic]
        total = total + Cost(seconds=producer_finish_tail(statistic, host))
    return total


def producer_finished_of(order: Sequence, hosting: dict, routes: dict, device: "str | Device",
                         finished: frozenset = frozenset()) -> frozenset:
    """The hosted statistics their only host, a haloed Mosaic conv, finishes in its last CTA
    (`eqsat.cost.mosaic.producer_finished`, the emitter's rule): no driver reduce or finalize
    kernel, readers read them finished."""
    device = get_device(device)
    if device.backend == "triton":
        return frozenset()
    hosted_on: dict[int, list] = {}
    for reduction, hosts in hosting.items():
        for host in hosts or ():
            hosted_on.setdefault(id(host), []).append(reduction)
    count = {reduction: len(hosts) for reduction, hosts in hosting.items() if hosts}
    return producer_finished([(kernel, tuple(hosted_on.get(id(kernel), ()))) for kernel in order], count,
                             lambda term: routes.get(id(term)) == "mosaic", device, finished)


def driver_reduced(order: Sequence, hosting: dict, device: "str | Device", finished: frozenset = frozenset()
                   ) -> tuple[dict[int, str], frozenset]:
    """(id of each dense kernel -> its route, the hosted statistics reduced by their own kernel):
    on a device whose backend is not `triton`, each dense kernel's `choose_route` (with the
    statistics it hosts), and the statistics with a host that writes no partials for them (the
    library; Mosaic but for its matmuls' row statistics, `eqsat.cost.backends.writes_partials`):
    `emit.pallas.run_kernels` then reduces the statistic after its last host; and those written as
    partials that a Mosaic kernel reads unfinished (it finishes them first, one kernel each)."""
    device = get_device(device)
    if device.backend == "triton":
        return {}, frozenset()
    hosted_on: dict[int, list] = {}
    for reduction, hosts in hosting.items():
        for host in hosts or ():
            hosted_on.setdefault(id(host), []).append(reduction)
    routes: dict[int, str] = {}
    reduced = set()
    for kernel in order:
        if kernel.op in ROUTED_OPS:
            hosted = hosted_on.get(id(kernel), ())
            routes[id(kernel)] = route = choose_route(kernel, device, finished, hosted)[0]
            reduced.update(r for r in hosted if not writes_partials(r, route, kernel))
    # A Mosaic kernel reads statistics finished: one its hosts left as partials, and the plan does not
    # finish, is finished by a kernel of its own before that reader (`emit.mosaic.matmul.emit`), unless
    # its host finishes it in its last CTA (`producer_finished_of`).
    in_producer = producer_finished_of(order, hosting, routes, device, finished)
    for kernel in order:
        if routes.get(id(kernel)) == "mosaic":
            reduced.update(s for s in statistics_read(kernel)
                           if hosting.get(s) and s not in finished and s not in in_producer)
    return routes, frozenset(reduced)


def finished_statistics(kernels: Sequence, hosting: dict, device="h100", outputs: Iterable = (),
                        share_limit: float | None = None) -> frozenset:
    """The hosted statistics (of `hosting`: statistic -> hosts or None) the plan finishes once,
    `kernels` being the plan's kernel terms: those read by a kernel that cannot merge or by the
    plan's outputs, and those whose finalize costs less than their readers' merges; with a
    `share_limit` (e.g. `MERGE_SHARE_GOAL`), also those a reader would spend more than that share
    of its modeled time merging (`eqsat.cost.merges`: the module docstring)."""
    device = get_device(device)
    readers: dict = {}
    for kernel in kernels:
        for statistic in statistics_read(kernel):
            readers.setdefault(statistic, []).append(kernel)
    outputs = set(outputs)
    finished = set()
    for statistic, hosts in hosting.items():
        if hosts is None:
            continue
        if statistic in outputs:
            finished.add(statistic)
            continue
        merges, over_limit = 0.0, False
        for reader in readers.get(statistic, ()):
            flops = reader_merge_flops(reader, statistic)
            if flops is None:
                over_limit = True
                break
            seconds = device.vector_seconds(flops)
            merges += seconds
            if share_limit is not None and seconds > share_limit * kernel_cost(reader, device).seconds:
                over_limit = True
                break
        if over_limit or finalize_cost(statistic, device).seconds < merges:
            finished.add(statistic)
    return frozenset(finished)
