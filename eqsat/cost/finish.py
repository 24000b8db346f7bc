"""Hosted statistics finished inside their producer: which ones (`producer_finished`, the rule the
emitter applies, `emit.pallas.run_kernels`, and the roofline prices, `eqsat.cost.roofline.dag_cost`)
and their cost (the host's serial tail, `eqsat.cost.mosaic.finish_tail_seconds`, instead of a
finalize launch). See `emit.mosaic.finish` for the template."""

from __future__ import annotations

from eqsat.conv_params import ConvParams
from eqsat.cost.backends import group_statistic_declined
from eqsat.cost.merges import finalize_cost, statistics_read
from eqsat.cost.mosaic import conv_work, finish_tail_seconds
from eqsat.cost.terms import Term, size_of
from eqsat.types import parse_type


# Which haloed convs finish their statistics: measured on the full UNet (`benchmarks.kernels --backend
# mosaic`, sm_90a PTX), the tail took the 3x3 stride-1 resnet convs to 171-211 registers and no spill, but
# the stride-2 downsamplers and the 1x1 proj_out convs to 253-255 registers, three of them spilling 32-184
# bytes (down_blocks.1/.2 downsamplers, down_blocks.2.attentions.0): those keep their finalize launch.


def producer_finish_declined(statistic: Term, host: Term, device) -> str | None:
    """Why the haloed Mosaic conv `host`, the statistic's only host, does not finish `statistic` in its
    last CTA (`emit.mosaic.conv_halo.finish_statistics`), or None when it does: it writes it as
    group partials (`eqsat.cost.backends.group_statistic_declined`), on the haloed template, a 3x3 (or
    wider) stride-1 conv (the others spill with the tail, above), whole 64-slot vectors (a WGMMA-layout block of tiles has 64 columns, merged 32 at a time), and a tail
    (`finish_tail_seconds`) shorter than the finalize it saves (`eqsat.cost.merges.finalize_cost`)."""
    if host.op != "Conv":
        return f"a {host.op} host (only the haloed conv finishes its statistics)"
    why = group_statistic_declined(statistic, host)
    if why is not None:
        return why
    work = conv_work(host)
    if not work.haloed:
        return "a flat-grid conv (only the haloed template finishes its statistics)"
    params = ConvParams.parse(host.args[2])
    weight, spec = parse_type(host.args[1].ty).shape, params.rhs_spec
    if tuple(params.strides) != (1, 1) or weight[spec[2]] * weight[spec[3]] == 1:  # measured: they spill with it
        return "a stride-2 or 1x1 conv (with the finishing tail at 255 registers: spills)"
    tail = producer_finish_tail(statistic, host)
    if tail is None:
        return f"{size_of(statistic.ty)} statistic outputs (the finishing CTA merges whole 64-slot vectors)"
    saved = finalize_cost(statistic, device).seconds
    if tail >= saved:
        return f"a tail of {tail * 1e6:.1f} us over {work.ctas} tiles (its finalize: {saved * 1e6:.1f} us)"
    return None


def producer_finish_tail(statistic: Term, host: Term) -> float | None:
    """`finish_tail_seconds` of `statistic` on the haloed conv `host`'s CTAs (None: not whole 64-slot
    vectors)."""
    op = statistic.args[1]
    fields = 3 if op == "moments" else 1
    slots = size_of(statistic.ty) // (2 if op == "moments" else 1)
    if slots % 64:
        return None
    return finish_tail_seconds(conv_work(host).ctas, fields, slots)


def producer_finished(kernels, host_count: dict, on_mosaic, device, finished: frozenset = frozenset()) -> frozenset:
    """The hosted statistics their only host finishes in its last CTA (`producer_finish_declined`):
    `kernels` `(kernel term, statistics it hosts)` in plan order, `host_count` statistic -> its
    hosts, `on_mosaic(term)` whether a kernel runs on Mosaic, `finished` the statistics the plan
    finishes once (a finalize kernel each). Only those a kernel of their own would finish otherwise
    (the plan's finalize, or the driver's before a Mosaic reader, which reads statistics finished).
    The finishing CTA also writes the vector tables of the Mosaic convs reading them
    (`emit.mosaic.finish.write_tables`; where it cannot, the emitter leaves them partials)."""
    kernels = list(kernels)
    mosaic_read = {s: term.op for term, _hosted in kernels if on_mosaic(term) for s in statistics_read(term)}
    found = set()
    for term, hosted in kernels:
        if not on_mosaic(term):
            continue
        for statistic in hosted:
            if host_count.get(statistic) != 1:
                continue
            if statistic not in finished and statistic not in mosaic_read:
                continue  # its readers merge its partials: no launch to save
            if producer_finish_declined(statistic, term, device) is None:
                found.add(statistic)
    return frozenset(found)
