"""The haloed Mosaic conv's vector table, written by the Triton kernel that finishes a statistic it
gathers, so no XLA fusion builds it.

A haloed conv whose input expression reads a GroupNorm's statistics per channel reads its vectors
from one float32 table `[B', R, W]` (`emit.mosaic.conv_halo.table_rows`: per row a tensor and the
flat index of each (image, channel) in it: the statistics gathered per channel, gamma, beta, a
time-embedding row). The statistic itself is finished by a Triton kernel in the same plan: the
driver's `reduce` after its last host, a `finalize` (the plan's, or the Mosaic conv's own before it
reads), or a plan `Reduce` kernel. That kernel writes the table too, as extra outputs:

- each program scatters the statistic values it computes to the table entries that gather them
  (`scatter`: a host-computed `[size, fanout↑]` map from the statistic's flat index to table
  offsets, -1 padded to a power of two);
- every other entry (the other tensors' rows, zeros past a row's channels) is copied by the
  programs in shares (`copy`: per source, host-computed destination and source offsets);
- the maps and offsets of a table are one int32 constant led by (-1, -1), so XLA keeps it a literal
  (a constant that is an iota, a time-embedding row's offsets, it would compute in a launch);

so each entry is written once, by one program, and the conv reads the table as it lies.

`plan_requests(calls, ctx)` (the driver, before emitting) lists the tables of the plan's Mosaic
convs (`emit.mosaic.conv.halo_table`, from types alone); a kernel finishing tensor `T` takes those
that gather `T` and whose other rows' tensors are computed by then:

    with tables.writing(T, ctx) as writes:        # None when no table waits for T
        value = finalize(T, partials, ..., tables=writes)
    # ctx.tables[conv term] = its table; `emit.mosaic.conv_halo.emit` reads it in place

A haloed Mosaic conv that finishes a statistic it hosts in its last CTA (`emit.mosaic.finish`) takes
the requests waiting on it the same way and writes those tables in that CTA (`write_tables`). A
table no finishing kernel could write (its other tensors not computed yet, the statistic finished
by a Mosaic matmul or in one piece) is built by the XLA fusion as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from emit.backends import mosaic_halo_table
from emit.pallas import triton
from eqsat.term import Term
from eqsat.types import parse_type

COPY_BLOCK = 1024  # entries a program copies per step


@dataclasses.dataclass(frozen=True)
class TableRequest:
    """The table conv `reader` reads: `shape` `[B', R, W]`, per row `(tensor, [B'_r, C_r] index)`."""

    reader: Term
    shape: tuple
    rows: tuple

    @property
    def tensors(self) -> list:
        seen: dict[int, Term] = {}
        for tensor, _index in self.rows:
            seen.setdefault(id(tensor), tensor)
        return list(seen.values())


FINISHED_BY_TRITON = frozenset({"EpilogueReduce", "Reduce"})  # tensors whose finishing kernel can write tables


def plan_requests(calls, ctx) -> list[TableRequest]:
    """The vector tables of the Mosaic convs among `calls` that gather a tensor a Triton reduce or
    finalize computes (`FINISHED_BY_TRITON`)."""
    requests = []
    for call in calls:
        if call.term.op != "Conv" or not (ctx.backend == "mosaic" or ctx.routes.get(call.term) == "mosaic"):
            continue
        table = mosaic_halo_table(call.term)
        if table is None:
            continue
        shape, rows = table
        request = TableRequest(call.term, shape, tuple(rows))
        if any(t.op in FINISHED_BY_TRITON for t in request.tensors):
            requests.append(request)
    return requests


def _available(tensor: Term, ctx) -> bool:
    return tensor in ctx.values or tensor.op == "Constant"


def ready(tensor: Term, ctx) -> list[TableRequest]:
    """The waiting requests that gather `tensor` and whose other tensors are computed."""
    return [r for r in ctx.table_requests
            if any(t is tensor for t in r.tensors) and all(t is tensor or _available(t, ctx) for t in r.tensors)]


@contextlib.contextmanager
def writing(tensor: Term, ctx):
    """`TableWrites` for the tables waiting on `tensor` (taken off the waiting list), or None; on exit
    the tables the kernel wrote are `ctx.tables[reader]`."""
    requests = ready(tensor, ctx)
    if not requests:
        yield None
        return
    taken = {id(r) for r in requests}
    ctx.table_requests[:] = [r for r in ctx.table_requests if id(r) not in taken]
    writes = TableWrites(tensor, requests, ctx)
    yield writes
    if writes.results is not None:
        for request, table in zip(requests, writes.results):
            ctx.tables[request.reader] = jnp.reshape(table, request.shape)


class TableWrites:
    """What a Triton kernel finishing `tensor` passes and does to also write `requests`' tables:
    `operands` after its own, `out_shapes` after its own outputs; in the kernel `scatter` where it
    has values of `tensor` and `copy` once per program; then `results` are the tables."""

    def __init__(self, tensor: Term, requests, ctx):
        self.tensor, self.requests = tensor, list(requests)
        self.dtype = jnp.dtype(parse_type(tensor.ty).dtype)
        size = max(1, math.prod(parse_type(tensor.ty).shape))
        self.operands, self.out_shapes, self.plans, self.results = [], [], [], None
        for request in self.requests:
            images, rows, width = request.shape
            own_src, own_dst, groups = [], [], {}
            covered = np.zeros(images * rows * width, np.int32)
            for r, (source, index) in enumerate(request.rows):
                channels = index.shape[1]
                index = np.broadcast_to(index, (images, channels))
                b, c = np.meshgrid(np.arange(images), np.arange(width), indexing="ij")
                dst = ((b * rows + r) * width + c).astype(np.int64)
                inside = c < channels
                src = np.where(inside, index[b, np.minimum(c, channels - 1)], -1)
                if source is tensor:
                    own_src.append(src[inside]), own_dst.append(dst[inside])
                else:
                    key = id(source)
                    groups.setdefault(key, (source, [], []))
                    groups[key][1].append(dst[inside]), groups[key][2].append(src[inside])
                groups.setdefault(None, (None, [], []))[1].append(dst[~inside])  # zeros past the row's channels
                covered[dst.reshape(-1)] += 1
            if not (covered == 1).all():
                raise AssertionError("a vector table's entries are not each written once")
            own_src, own_dst = np.concatenate(own_src), np.concatenate(own_dst)
            counts = np.bincount(own_src, minlength=size)
            fanout = triton.next_pow2(max(1, int(counts.max())))
            scatter = np.full((size, fanout), -1, np.int32)
            order = np.argsort(own_src, kind="stable")
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            ranks = np.arange(len(order)) - starts[own_src[order]]
            scatter[own_src[order], ranks] = own_dst[order]
            # one int32 array per table (its scatter map, then each copy's destinations and sources), led
            # by (-1, -1): XLA keeps it a literal (an array that is an iota or one value it would compute)
            pieces, at, copies, sources = [np.full(2, -1, np.int32), scatter.reshape(-1)], 2 + scatter.size, [], []
            for key, (source, dsts, srcs) in groups.items():
                dst = np.concatenate(dsts).astype(np.int32)
                if not dst.size:
                    continue
                src = None if source is None else np.concatenate(srcs).astype(np.int32)
                copies.append((source is not None, at, dst.size))
                pieces += [dst] if src is None else [dst, src]
                at += dst.size * (1 if src is None else 2)
                if source is not None:
                    sources.append(ctx.value(source))
            self.operands += [jnp.asarray(np.concatenate(pieces)), *sources]
            self.plans.append((fanout, tuple(copies)))
            self.out_shapes.append(jax.ShapeDtypeStruct((images * rows * width,), jnp.float32))

    def _split(self, in_refs):
        """Per table: its fanout, index ref and `(source ref or None, first dst offset, entries)` per copy
        (the sources follow the destinations in the index ref)."""
        at, out = 0, []
        for fanout, copies in self.plans:
            index, at = in_refs[at], at + 1
            groups = []
            for has_source, first, entries in copies:
                groups.append((in_refs[at] if has_source else None, first, entries))
                at += has_source
            out.append((fanout, index, groups))
        return out

    def scatter(self, in_refs, out_refs, flat, value, mask=True) -> None:
        """Write `value` (`tensor`'s values at flat indices `flat`, a vector; lanes where `mask`) to
        every table entry that gathers them."""
        value = jnp.asarray(value).astype(self.dtype).astype(jnp.float32)  # as the tensor stores it
        for (fanout, index, _groups), out in zip(self._split(in_refs), out_refs):
            lanes = lax.broadcasted_iota(jnp.int32, (1, fanout), 1)
            live = jnp.ones(flat.shape, jnp.bool_) if isinstance(mask, bool) else mask
            offsets = triton.gather_load(index, 2 + flat[:, None] * fanout + lanes, live[:, None])
            triton.store(out, offsets, jnp.broadcast_to(value[:, None], offsets.shape), live[:, None] & (offsets >= 0))

    def copy(self, in_refs, out_refs, program, programs: int) -> None:
        """This program's share of the entries that are not `tensor`'s (`programs` share them)."""
        for (_fanout, index, groups), out in zip(self._split(in_refs), out_refs):
            for source, first, entries in groups:
                share = -(-entries // programs)
                block = min(triton.next_pow2(share), COPY_BLOCK)
                lane = lax.broadcasted_iota(jnp.int32, (block,), 0)

                def step(i, carry, source=source, first=first, entries=entries, share=share, block=block,
                         lane=lane, index=index, out=out):
                    within = i * block + lane
                    at = program * share + within
                    ok = (within < share) & (at < entries)
                    dst = triton.gather_load(index, first + at, ok)
                    if source is None:
                        value = jnp.zeros((block,), jnp.float32)
                    else:
                        src = triton.gather_load(index, first + entries + at, ok)
                        value = triton.gather_load(source, src, ok).astype(jnp.float32)
                    triton.store(out, dst, value, ok)
                    return carry

                steps = -(-share // block)
                if steps == 1:
                    step(0, 0)
                else:
                    lax.fori_loop(0, steps, step, 0)
