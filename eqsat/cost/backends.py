"""A kernel priced by the backend that will emit it, and `auto`'s choice among them.

A device profile says which templates emit the dense kernels (`Device.backend`,
`eqsat.cost.devices.with_backend`); `eqsat.cost.roofline` prices every `Matmul`, `Conv` and
`Attention` through the routes this module prices when that is not `"triton"`
(`roofline.route_cost`, `roofline.choose_route`: under `auto` the cheapest; `kernel_cost`,
`node_cost` and `dag_cost` use them):

| device backend | Matmul, Conv | Attention | everything else |
|---|---|---|---|
| `triton` (default) | Pallas Triton template (`eqsat.cost.work`) | Triton | Triton |
| `mosaic` | Mosaic GPU template (`eqsat.cost.mosaic`) where it covers the kernel, else Triton | Mosaic / Triton | Triton |
| `hybrid` | XLA's library call (cuBLAS / cuDNN, `emit.library`) | Triton | Triton |
| `auto` | the lowest priced of Triton, Mosaic and the library | the lower of Triton and Mosaic | Triton |

Routes (what one kernel runs as): `"triton"`, `"mosaic"`, `"library"`.

- triton: `roofline.kernel_cost` as before (the roofline passes it in: this module sits below it).
- mosaic: the roofline's distinct bytes and writes, plus its `MosaicWork`: a launch per glue fusion,
  their HBM bytes, TMA re-reads beyond the distinct bytes at `mosaic.L2_BANDWIDTH` overlapped with
  the MMA (`pipelined`), the operand
  expressions once per element (in their fusion), the epilogue on the padded tile, the dense work
  (data sheet: useful flops at the peak; calibrated: `work.mma_seconds` of the padded wgmma at the
  SMs the CTAs fill), the attention's softmax instructions; hosted statistics it reads are merged
  once before it (a finalize each, unless the plan finishes them anyway).
- library: launch + the roofline's bytes + a fusion writing each computed operand (and its read by
  the library) + one epilogue fusion when the epilogue is more than a bias and a cast (output read
  and written again) + the operand expressions once per element + the dense flops at
  `LIBRARY_EFFICIENCY` of the peak (the share `benchmarks.kernels` prices XLA's own library calls at).

A statistic hosted on a kernel the route does not write partials from (the library; a Mosaic
host for any statistic but the row statistics its matmul writes, `eqsat.cost.mosaic.
row_statistic_declined`, and the per-(image, channel group) statistics its convs write,
`group_statistic_declined`) is reduced by its own kernel after the host (`emit.pallas.run_kernels`):
`hosted_extra` prices that.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from eqsat.conv_params import ConvParams
from eqsat.cost.devices import Device, get_device, with_backend
from eqsat.cost.hosting import hosts_of
from eqsat.cost.merges import finalize_cost, statistics_read
from eqsat.cost.mosaic import (L2_BANDWIDTH, EpilogueReads, covers, covers_term, epilogue_body_declined, is_view,
                               loaded_tensors, mosaic_work_cached, node_mosaic_work, once_flops, padded_store,
                               row_statistic_declined)
from eqsat.cost.terms import (COMPUTE_OPS, ZERO, Cost, Term, args_of, dense_dtype, expr_nodes, nbytes_of, own_bytes,
                              own_flops, size_of)
from eqsat.cost.work import mma_seconds
from eqsat.types import ints, parse_type

ROUTES = ("triton", "mosaic", "library")
DENSE = frozenset({"Matmul", "Conv", "Attention"})
LIBRARY_OPS = frozenset({"Matmul", "Conv"})  # emit.library.LIBRARY_OPS (no jax import here)
# The share of the tensor-core peak at which XLA's library and Triton GEMM kernels are priced.
LIBRARY_EFFICIENCY = 0.7
# Epilogue ops a library call fuses (cuBLAS / cuDNN: a bias add and the output cast).
_LIBRARY_EPILOGUE = frozenset({"Acc", "Load", "Lit", "Reshape", "Broadcast", "Transpose", "Slice"})


def routes_for(kernel_op: str, args, device: "str | Device", term: Term | None = None) -> tuple[str, ...]:
    """The routes `device.backend` may run a kernel of `kernel_op` (argument types `args`; its
    `term` when known: the Mosaic templates also decline some epilogues) on."""
    backend = get_device(device).backend
    if kernel_op not in DENSE or backend == "triton":
        return ("triton",)
    mosaic = covers(kernel_op, args) if term is None else covers_term(term)
    if backend == "mosaic":
        return ("mosaic",) if mosaic else ("triton",)
    if backend == "hybrid":
        return ("library",) if kernel_op in LIBRARY_OPS else ("triton",)
    return ("triton",) + (("mosaic",) if mosaic else ()) + (("library",) if kernel_op in LIBRARY_OPS else ())


def writes_partials(reduction: Term, route: str, host: Term | None) -> bool:
    """Whether `host`, run on `route`, writes `reduction`'s partials: every Triton host; a Mosaic
    matmul its row statistics (`row_statistic_declined`), a Mosaic conv its per-(image, channel
    group) statistics (`group_statistic_declined`); nothing on the library."""
    if route == "triton":
        return True
    if route != "mosaic" or host is None:
        return False
    if host.op == "Conv":
        return group_statistic_declined(reduction, host) is None
    return row_statistic_declined(reduction, host) is None


# Slots a Mosaic conv's epilogue keeps per statistic (registers: `emit.mosaic.partials.GroupStatistic`).
MAX_GROUP_SLOTS = 256


def group_statistic_declined(reduction: Term, host: Term) -> str | None:
    """Why the Mosaic conv `host` (either template) does not write the hosted statistic `reduction`
    as per-tile partials (`emit.mosaic.partials.GroupStatistic`; the driver then reduces it after
    the host), or None when it does: its only host, a body reading nothing but the conv's output
    through ops the epilogue lowers, and one statistic output per (image, group of `cpg`
    consecutive output channels): slot = image · groups + channel // cpg (a GroupNorm's), at most
    `MAX_GROUP_SLOTS` slots, a multiple of 4 (16-byte TMA rows)."""
    return _group_statistic_declined(reduction, host)


@functools.lru_cache(maxsize=4096)
def _group_statistic_declined(reduction: Term, host: Term) -> str | None:
    why, ids = epilogue_body_declined(reduction, host, "Conv", "per-group statistics")
    if why is not None:
        return why
    axes = reduction.args[3]
    return group_form(ids, ints(axes), ConvParams.parse(host.args[2]).out_spec,
                      tuple(parse_type(host.ty).shape))[0]


def group_form(ids: np.ndarray, reduced: Sequence[int], out_spec: Sequence[int], out_shape: tuple
               ) -> tuple[str | None, int, int]:
    """(why not, groups per image, channels per group): whether the statistic whose body reads the
    conv output's flat element `ids` (one per body element) and reduces `reduced` axes of the body
    has slot = image · groups + channel // cpg at every element."""
    kept = [a for a in range(ids.ndim) if a not in set(reduced)]
    grids = np.indices(ids.shape, sparse=True)
    slot = np.zeros((), np.int64)
    for a in kept:
        slot = slot * ids.shape[a] + grids[a]
    slot = np.broadcast_to(slot, ids.shape).reshape(-1)
    index = np.unravel_index(ids.reshape(-1), out_shape)
    image, channel = index[out_spec[0]], index[out_spec[1]]
    batch, channels = out_shape[out_spec[0]], out_shape[out_spec[1]]
    slots = int(slot.max()) + 1 if slot.size else 0
    if slots % batch or slots // batch == 0 or channels % (slots // batch):
        return "a statistic that is not one output per (image, channel group)", 0, 0
    groups = slots // batch
    cpg = channels // groups
    if not np.array_equal(slot, image * groups + channel // cpg):
        return "a statistic that is not one output per (image, channel group)", 0, 0
    if slots > MAX_GROUP_SLOTS or slots % 4:
        return f"{slots} slots (the conv epilogue keeps at most {MAX_GROUP_SLOTS}, a multiple of 4)", 0, 0
    return None, groups, cpg


def hosted_extra(reduction: Term, route: str, device: "str | Device", host: Term | None = None) -> Cost:
    """What a statistic hosted on a kernel of `route` (`host`, where known) costs beyond
    `roofline.hosted_cost`: nothing where the host writes its partials (`writes_partials`);
    otherwise its own reduce kernel after the host (a launch and a read of what it reduces)."""
    if writes_partials(reduction, route, host):
        return ZERO
    device = with_backend(device, "triton")
    nbytes = float(nbytes_of(reduction.args[0].ty))
    return Cost(nbytes, 0.0, device.launch_overhead + device.memory_seconds(nbytes))


# --- the parts the routes share with the roofline ----------------------------------------------------


def _distinct_bytes(kernel: Term, reads: dict, finished: frozenset) -> tuple[float, list[Term]]:
    """The roofline's distinct bytes of `kernel` (its `kernel_reads` + its output) with every hosted
    statistic read finished, and the statistics that the plan does not finish (merged once before
    the kernel)."""
    reads = dict(reads)
    merged = []
    for statistic in statistics_read(kernel):
        if statistic in reads:
            reads[statistic] = float(nbytes_of(statistic.ty))
        if statistic not in finished:
            merged.append(statistic)
    return sum(reads.values()) + own_bytes(kernel.op, args_of(kernel)), merged


def _operands(kernel: Term) -> list[Term]:
    if kernel.op == "Attention":
        return [kernel.args[0], kernel.args[1], kernel.args[2], kernel.args[3]]
    return [kernel.args[0], kernel.args[1]]


def _epilogue(kernel: Term) -> Term:
    return kernel.args[5] if kernel.op == "Attention" else kernel.args[3]


def _flops(expr: Term, scale: float = 1.0, seen: set | None = None) -> float:
    """Vector flops of `expr`'s nodes not in `seen`, each once per element (× `scale`)."""
    return once_flops(expr, seen=seen) * scale


def _finalize_seconds(statistics, device) -> float:
    return sum(finalize_cost(s, device).seconds for s in statistics if hosts_of(s) is not None)


def _dense_seconds(kernel: Term, device: Device, efficiency: float = 1.0) -> tuple[float, float]:
    """(useful dense flops, seconds at `efficiency` of the peak)."""
    args = args_of(kernel)
    flops = own_flops(kernel.op, args)
    return flops, flops / (efficiency * device.peak(dense_dtype(kernel.op, args), True))


def pipelined(mma: float, loads: float, stages: int) -> float:
    """A TMA -> wgmma loop's seconds from its MMA's and its loads': the longer with >= 2 stages in
    flight (each step's loads overlap an earlier step's MMA), their sum with one."""
    return max(mma, loads) if stages >= 2 else mma + loads


def mosaic_cost(kernel: Term, device: "str | Device", reads: dict, finished: frozenset = frozenset()) -> Cost:
    """`kernel` as its Mosaic template runs it (the module docstring); `reads`: its
    `roofline.kernel_reads`."""
    device = with_backend(device, "triton")
    work = mosaic_work_cached(kernel)
    nbytes, merged = _distinct_bytes(kernel, reads, finished)
    nbytes += work.glue_bytes
    seen: set = set()
    vector = sum(_flops(e, seen=seen) for e in _operands(kernel))
    vector += _flops(_epilogue(kernel), work.padded_outputs / max(size_of(kernel.ty), 1), seen)
    dense = own_flops(kernel.op, args_of(kernel))
    seconds = (device.launch_overhead * (1 + work.glue_launches) + device.memory_seconds(nbytes)
               + device.vector_seconds(vector) + mosaic_dense_seconds(work, device, dense_dtype(kernel.op, args_of(kernel)))
               + _finalize_seconds(merged, device))
    return Cost(nbytes, dense + vector, seconds)


def mosaic_dense_seconds(work, device: Device, dtype: str) -> float:
    """The Mosaic template's dense work: on the data sheet its useful flops at the peak (as the Triton
    templates'); calibrated, `work.mma_seconds` of its padded wgmma (and the attention's softmax)
    overlapped with its TMA re-reads through L2 (`pipelined`)."""
    seconds = mma_seconds(work.work, device, dtype)
    if not device.calibrated:
        return seconds
    return pipelined(seconds, work.l2_bytes / L2_BANDWIDTH, work.stages)


def library_cost(kernel: Term, device: "str | Device", reads: dict, finished: frozenset = frozenset()) -> Cost:
    """`kernel` as the `hybrid` backend's library call runs it (the module docstring); `reads`: its
    `roofline.kernel_reads`."""
    device = with_backend(device, "triton")
    nbytes, merged = _distinct_bytes(kernel, reads, finished)
    launches = 1
    seen: set = set()
    vector = 0.0
    for operand in _operands(kernel):
        if not is_view(operand):
            launches += 1
            nbytes += 2 * nbytes_of(operand.ty)  # written by its fusion, read by the library call
        vector += _flops(operand, seen=seen)
    epilogue = _epilogue(kernel)
    vector += _flops(epilogue, seen=seen)
    fused = all(n.op in _LIBRARY_EPILOGUE or (n.op in COMPUTE_OPS and n.args[0] in ("add", "convert"))
                for n in expr_nodes(epilogue)) and not EpilogueReads.of(epilogue, size_of(kernel.ty), 0).tiles
    if not fused:
        launches += 1
        nbytes += 2 * nbytes_of(kernel.ty)  # the library's result written, read by the epilogue fusion
    dense, dense_seconds = _dense_seconds(kernel, device, LIBRARY_EFFICIENCY)
    seconds = (device.launch_overhead * launches + device.memory_seconds(nbytes) + device.vector_seconds(vector)
               + dense_seconds + _finalize_seconds(merged, device))
    return Cost(nbytes, dense + vector, seconds)


# --- e-nodes (extraction) -----------------------------------------------------------------------------


def node_route_cost(op: str, args: Sequence, route: str, device: "str | Device", triton: Cost,
                    conv_ranges=None) -> Cost:
    """An e-node's own cost (launch, output write, dense work; `roofline.node_cost`) as `route`
    emits it, `triton` its Triton price: mosaic adds its glue fusions (operands taken as read in
    place) and their bytes, and prices its dense work as `mosaic_dense_seconds`; the library runs its
    dense flops at `LIBRARY_EFFICIENCY`."""
    if route == "triton":
        return triton
    device = with_backend(device, "triton")
    flops = triton.flops
    nbytes = own_bytes(op, args)
    dtype = dense_dtype(op, args)
    if route == "library":
        seconds = device.launch_overhead + device.memory_seconds(nbytes) + flops / (
            LIBRARY_EFFICIENCY * device.peak(dtype, True))
        return Cost(nbytes, flops, seconds)
    work = node_mosaic_work(op, args, conv_ranges)
    nbytes += work.glue_bytes
    seconds = (device.launch_overhead * (1 + work.glue_launches) + device.memory_seconds(nbytes)
               + mosaic_dense_seconds(work, device, dtype))
    return Cost(nbytes, flops, seconds)


def sliced_stores(kernels: Sequence[tuple[Term, str, Sequence[Term]]], reduced: Sequence[Term],
                  outputs: Sequence[Term]) -> list[Term]:
    """The Mosaic matmuls' padded stores (`eqsat.cost.mosaic.padded_store`) and attentions' padded
    outputs that XLA slices in a launch of their own, for a plan of `(kernel term, route, hosted statistics)`: those read by a kernel a
    Mosaic template does not run (a Triton kernel or a statistic it hosts; a statistic the driver
    reduces after its host, `reduced`, whose body reads one) or returned by the program (`outputs`). A Mosaic reader takes the store as it lies
    (`reads_padded_rows`, `padded_residuals`) or slices it inside the fusion that lays its operand out,
    so the matmul's own "output sliced" glue launches nothing: these launches are the plan's, not a
    kernel's price."""
    stores = {id(term): term for term, route, _hosted in kernels if route == "mosaic" and (
        padded_store(term) is not None if term.op == "Matmul" else
        term.op == "Attention" and "output sliced" in {g.what for g in mosaic_work_cached(term).glue})}
    readers = [reader for term, route, hosted in kernels if route != "mosaic" for reader in (term, *hosted)]
    sliced: dict[int, Term] = {}
    for reader in [*readers, *reduced]:
        exprs = [reader.args[2]] if reader.op == "EpilogueReduce" else [a for a in reader.args
                                                                         if getattr(a, "sort", None) == "Expr"]
        for expr in exprs:
            for tensor in loaded_tensors(expr):
                if id(tensor) in stores:
                    sliced[id(tensor)] = tensor
    for tensor in outputs:
        if id(tensor) in stores:
            sliced[id(tensor)] = tensor
    return list(sliced.values())
