"""Hosted GroupNorm statistics finished inside the haloed Mosaic conv by the CTA that completes last
(`emit.mosaic.finish`, `emit.mosaic.conv_halo.finish_statistics`): the finished statistic against
the two-pass moments of the conv's own stored output and against the readers' merge of its partials
(15x15 images, 3 channels per group, an offset of 1e4 against a spread of 1, a constant group, a
NaN group, column strips, chunks that do not divide the tiles), and a deviceless sm_90a compile of
two finishing convs sharing one ticket counter: one zeroing copy for both, the ticket an acquire-
release atomic after the TMA stores and a proxy fence.

GPU interpret mode runs the grid's CTAs in order, so there the grid's last CTA finishes; the ticket
itself is checked compiled."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.mosaic import finish
from emit.pallas.conv import ConvGeometry
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks
from tests.test_emit_mosaic_conv_partials import (CPG, OFFSET, _merge, _params, _statistics, _weights,
                                                  assert_moments_and_sum)


def _finished_conv(strips: int, block: int, monkeypatch):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16)
    w = jnp.asarray(_weights(rng, 64, 24), jnp.float16)
    params = _params(x.shape, w.shape)
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    grid = HaloGrid(ConvGeometry(params, x.shape, w.shape, out_shape), 64, strips)
    blocks = MosaicBlocks(64, 64, 64, stages=3, compute_wgs=1)
    monkeypatch.setattr(finish, "BLOCK_TILES", block)

    @jax.jit
    def run(x, w):
        flat, partials, finished, counter, _tables = ch.build(
            [x], ch.layout_weight(w, params.rhs_spec, 64), grid, blocks, epilogue=lambda acc, _: acc + OFFSET,
            out_dtype=jnp.float32, interpret=True, statistics=_statistics(2, 24), counter=finish.new_counter())
        return ch.unflatten(flat, grid, 24), partials, finished, counter

    return grid, run(x, w)


@pytest.mark.parametrize("strips,block", [(1, 3), (3, 64)], ids=["rows-ragged-blocks", "strips-one-block"])
def test_the_last_cta_finishes_the_group_moments_of_the_stored_output(strips, block, monkeypatch):
    """8 tiles in blocks of 3 (the last block overlaps the one before: its first row merged once),
    or 3 strips (24 tiles, fewer than a block of 64): mean within 2 ulps of the offset, M2 at fp32's bound, the
    sum; the constant group exactly (offset, 0), the NaN group NaN; and the readers' merge of the
    same partials to a few ulps of the spread."""
    grid, (out, partials, finished, counter) = _finished_conv(strips, block, monkeypatch)
    images, groups = 2, 24 // CPG
    tiles = images * grid.strips * grid.m_tiles
    assert [p.shape for p in partials] == [(tiles, 3, 16), (tiles, 1, 16)]
    assert [f.shape for f in finished] == [(2 * 16,), (16,)]
    assert np.asarray(counter).tolist() == [0]
    mean, m2 = np.asarray(finished[0], np.float64).reshape(2, -1)
    total = np.asarray(finished[1], np.float64)
    want = np.asarray(out).reshape(images, -1, groups, CPG).transpose(0, 2, 1, 3).reshape(images * groups, -1)
    want = want.astype(np.float64)
    assert_moments_and_sum(mean, m2, total, want, images)
    ok, want_mean = ~np.isnan(want).any(axis=1), want.mean(axis=1)
    ulp = np.spacing(np.float32(OFFSET))
    scale = np.abs(want[ok]).max() * np.abs(want[ok] - want_mean[ok, None]).max() * want.shape[1]
    constant = np.arange(images) * groups + 1
    assert (mean[constant] == OFFSET).all() and (m2[constant] == 0.0).all()
    merged_mean, merged_m2 = _merge("moments", partials[0])
    np.testing.assert_allclose(mean[ok], merged_mean[ok], rtol=0, atol=ulp)
    np.testing.assert_allclose(m2[ok], merged_m2[ok], rtol=1e-5, atol=1e-6 * scale)


def _record_finishing(patch) -> list:
    """The statistic kernels and finalizes the driver launches while `patch` holds, by name."""
    import emit.pallas
    import emit.pallas.partials

    finishing = []
    original_reduce, original_finalize = emit.pallas.emit_kernel, emit.pallas.partials.finalize
    patch.setattr(emit.pallas, "emit_kernel", lambda call, ctx: (
        finishing.append(call.name) if call.term.op == "EpilogueReduce" else None) or original_reduce(call, ctx))
    patch.setattr(emit.pallas.partials, "finalize", lambda *a, **k: finishing.append("finalize") or
                  original_finalize(*a, **k))
    return finishing


def _two_finishing_convs(x, w1, w2):
    """Two haloed 3x3 convs on 64x64 images, 64 channels in and out, each hosting a GroupNorm's
    moments (32 groups of 2 channels, 2 images: 64 slots) finished by its last CTA, the second
    taking the first's output and the counter the first returned: 66 tiles of 128 rows (a block of
    64 and a ragged last one), then 132 of 64 rows (a loop over two blocks, then a ragged one)."""
    from emit.mosaic.partials import GroupStatistic

    params = _params(x.shape, w1.shape)
    geometry = ConvGeometry(params, x.shape, w1.shape, x.shape)
    statistic = [GroupStatistic("moments", lambda t: t.astype(jnp.float32), 2, 32, 2)]
    counter = finish.new_counter()
    results = []
    h = x
    for w, tile_m in ((w1, 128), (w2, 64)):
        grid = HaloGrid(geometry, tile_m, 1)
        flat, _partials, finished, counter, _tables = ch.build(
            [h], ch.layout_weight(w, params.rhs_spec, 64), grid, MosaicBlocks(tile_m, 64, 64, stages=3, compute_wgs=1),
            interpret=False, statistics=statistic, counter=counter)
        h = ch.unflatten(flat, grid, 64)
        results.append(finished[0])
    return h, *results


def test_two_finishing_convs_compile_for_sm90a_with_one_counter_copy(tmp_path):
    from benchmarks.mosaic_ptx import dumping
    from measure import xla_target

    S = jax.ShapeDtypeStruct
    args = (S((2, 64, 64, 64), jnp.float16), S((3, 3, 64, 64), jnp.float16), S((3, 3, 64, 64), jnp.float16))
    with dumping(tmp_path / "mosaic"):
        report = xla_target.compile_for_h100(_two_finishing_convs, *args)
        if report is None:
            pytest.skip(xla_target.unavailable_reason() or "the H100 compile target is unavailable")
        ptx = [p.read_text() for p in (tmp_path / "mosaic").glob("*.ptx")]
        ptxas = {p.stem: p.read_text() for p in (tmp_path / "mosaic").glob("*.ptxas")}
    assert report.by_category.get("Pallas (Mosaic GPU)") == 2, report.by_category
    counter_copies = [launch for launch in report.launches if launch.counted == "copy" and launch.bytes <= 8]
    assert len(counter_copies) == 1, report.launches  # one zeroed counter for both kernels
    assert len(ptx) == 2 and all("atom.acq_rel.gpu.global.add.u32" in text for text in ptx)
    # the 64-row conv (176 registers without the tail) finishes without spilling; the 128-row one uses
    # all 255 registers without it, and its tail spills a few words (28 bytes when this was written)
    spills = sorted(int(re.search(r"(\d+) bytes spill stores", text).group(1)) for text in ptxas.values())
    assert len(spills) == 2 and spills[0] == 0 and spills[1] <= 32, spills
    for text in ptx:  # the writer's TMA store waited and fenced before its ticket
        store_wait = text.index("cp.async.bulk.wait_group")
        ticket = text.index("atom.acq_rel.gpu.global.add.u32")
        assert store_wait < text.index("fence.proxy.async.global", store_wait) < ticket


# --- in a plan ------------------------------------------------------------------------------------


def _conv_groupnorm_linear(x, w1, b1, gamma, beta, w2, b2):
    """A 3x3 conv (64 -> 96 channels) whose output's GroupNorm (32 groups of 3) feeds a projection
    over the channels (an attention block's `proj_in`): the statistic's reader is a Mosaic matmul."""
    from sd15 import layers

    p = {"a.weight": w1, "a.bias": b1, "n.weight": gamma, "n.bias": beta, "l.weight": w2, "l.bias": b2}
    h = layers.conv2d(p, "a", x)
    h = layers.group_norm(p, "n", h, 32, 1e-5)
    return layers.linear(p, "l", h.reshape(h.shape[0], -1, h.shape[-1]))


def _plan_args(offset: float = 300.0):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 15, 15, 64))
    x[:, 4] = 0.0
    w1 = 0.1 * rng.standard_normal((96, 64, 3, 3))
    w1[CPG:2 * CPG] = 0.0  # group 1: the bias alone, a constant group
    args = [x, w1, offset + rng.standard_normal(96), 1 + 0.2 * rng.standard_normal(96), rng.standard_normal(96),
            0.1 * rng.standard_normal((64, 96)), rng.standard_normal(64)]
    return tuple(jnp.asarray(a, jnp.float16) for a in args)


def _finished_statistic(plan):
    from eqsat.cost.finish import producer_finished

    (conv,) = [k for k in plan.kernels if k.op == "Conv"]
    (statistic,) = conv.hosted
    kernels = [(k.term, tuple(k.hosted)) for k in plan.kernels]
    assert producer_finished(kernels, {statistic: 1}, lambda t: t.op in ("Conv", "Matmul"), get_h100()) == {statistic}
    return statistic


def get_h100():
    from eqsat.cost.devices import get_device

    return get_device("h100")


def test_a_conv_finishing_a_groupnorm_read_by_a_matmul_launches_no_finalize():
    """The conv's last CTA finishes the GroupNorm (an offset of 300 against a spread of ~1, a
    constant group, 2 images x 32 groups = 64 slots): no driver reduce or finalize kernel runs, the
    Mosaic matmul reads the finished statistic; equal to XLA's emission and `jax.jit`."""
    import warnings

    import emit
    import emit.pallas
    import emit.pallas.partials
    import eqsat
    from emit.mosaic import TritonFallbackWarning
    from emit.pallas import XlaFallbackWarning

    args = _plan_args()
    plan = eqsat.optimize(_conv_groupnorm_linear, extractor="greedy", progress=False).lower(*args).plan
    _finished_statistic(plan)
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        finishing = _record_finishing(patch)
        got = emit.emit(plan, "mosaic", interpret=True)(*args)
    assert finishing == [], finishing
    for want in (emit.emit(plan, "xla")(*args), jax.jit(_conv_groupnorm_linear)(*args)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=5e-2)


def test_the_model_charges_the_blocks_the_last_cta_reads():
    """`eqsat.cost.mosaic.finish_tail_seconds`: whole blocks of the template's size (a ragged last
    block read whole), each `[fields, BLOCK_TILES, slots]` fp32, at one SM's share of L2; and the rule
    declines a tail longer than the finalize it saves."""
    from eqsat.cost.mosaic import FINISH_BLOCK_TILES, L2_BANDWIDTH, finish_tail_seconds
    from eqsat.tiling.mosaic import SM_COUNT

    assert FINISH_BLOCK_TILES == finish.BLOCK_TILES
    per_byte = SM_COUNT / L2_BANDWIDTH
    assert finish_tail_seconds(6, 3, 64) == pytest.approx(4 * 64 * (3 * 64 + 2) * per_byte)
    assert finish_tail_seconds(64, 3, 64) == finish_tail_seconds(6, 3, 64)
    assert finish_tail_seconds(65, 3, 64) == pytest.approx(4 * 64 * (2 * 3 * 64 + 2) * per_byte)
    assert finish_tail_seconds(132, 1, 64) == pytest.approx(4 * 64 * (3 * 64 + 1) * per_byte)


def test_only_statistics_a_kernel_of_their_own_would_finish_are_finished_in_the_producer():
    """A GroupNorm + SiLU read by a Triton pointwise kernel (it merges the partials where it reads
    them): nothing to save, not finished in the producer, unless the plan finishes it once (a
    finalize kernel); read by a Mosaic conv (which reads statistics finished), finished there."""
    import eqsat
    from eqsat.cost.finish import producer_finished
    from tests.test_emit_mosaic_conv_partials import _conv_groupnorm, _conv_groupnorm_conv

    S, F16 = jax.ShapeDtypeStruct, jnp.float16
    args = (S((2, 16, 16, 64), F16), S((96, 64, 3, 3), F16), S((96,), F16), S((96,), F16), S((96,), F16))
    on_mosaic = lambda t: t.op in ("Conv", "Matmul")  # noqa: E731
    for fn, extra, read_by_mosaic in ((_conv_groupnorm, (), False),
                                      (_conv_groupnorm_conv, (S((64, 96, 3, 3), F16), S((64,), F16)), True)):
        plan = eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args, *extra).plan
        (host,) = [k for k in plan.kernels if k.op == "Conv" and k.hosted]
        (statistic,) = host.hosted
        kernels = [(k.term, tuple(k.hosted)) for k in plan.kernels]
        want = {statistic} if read_by_mosaic else set()
        assert producer_finished(kernels, {statistic: 1}, on_mosaic, get_h100()) == want
        assert producer_finished(kernels, {statistic: 1}, on_mosaic, get_h100(), frozenset({statistic})) == {statistic}


def _conv_groupnorm_conv(x, w1, b1, gamma, beta, w2, b2):
    """A 3x3 conv (64 -> 128 channels) whose output's GroupNorm (32 groups of 4) + SiLU feeds a second
    haloed 3x3 conv (128 -> 64: whole 64-channel K ranges), which reads it through a vector table."""
    from sd15 import layers

    p = {"a.weight": w1, "a.bias": b1, "n.weight": gamma, "n.bias": beta, "c.weight": w2, "c.bias": b2}
    h = layers.conv2d(p, "a", x)
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", h, 32, 1e-5)))


def _chain_args(offset: float = 300.0):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 15, 15, 64))
    x[:, 4] = 0.0
    w1 = 0.1 * rng.standard_normal((128, 64, 3, 3))
    w1[4:8] = 0.0  # group 1: the bias alone, a constant group
    args = [x, w1, offset + rng.standard_normal(128), 1 + 0.2 * rng.standard_normal(128), rng.standard_normal(128),
            0.1 * rng.standard_normal((64, 128, 3, 3)), rng.standard_normal(64)]
    return tuple(jnp.asarray(a, jnp.float16) for a in args)


def test_a_conv_finishing_a_groupnorm_writes_the_next_convs_vector_table():
    """conv -> GroupNorm + SiLU -> conv, both haloed: the first conv's last CTA finishes the
    statistic and writes the second conv's vector table (statistics gathered per channel, gamma,
    beta): no reduce or finalize kernel, no table fusion; equal to XLA's emission and `jax.jit`."""
    import warnings

    import emit
    import emit.pallas
    import emit.pallas.partials
    import eqsat
    from emit.mosaic import TritonFallbackWarning
    from emit.pallas import XlaFallbackWarning

    args = _chain_args()
    plan = eqsat.optimize(_conv_groupnorm_conv, extractor="greedy", progress=False).lower(*args).plan
    built = []
    original_tables = ch.vector_tables
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        finishing = _record_finishing(patch)
        pairs = []

        def spy_tables(parts, table=None):
            if any(p.vectors for p in parts):
                built.append(table is not None)
                if table is not None:  # against the XLA fusion's gather of the same vectors
                    (gathered,), _ = original_tables(parts)
                    jax.debug.callback(lambda a, b: pairs.append((np.asarray(a), np.asarray(b))), table, gathered)
            return original_tables(parts, table)

        patch.setattr(ch, "vector_tables", spy_tables)
        got = jax.block_until_ready(emit.emit(plan, "mosaic", interpret=True)(*args))
        jax.effects_barrier()
    assert finishing == [], finishing
    assert built == [True], built  # the second conv's table was written, not built by a fusion
    assert len(pairs) == 1
    np.testing.assert_allclose(pairs[0][0], pairs[0][1], rtol=2e-7, atol=0)  # the finished statistic, per channel
    for want in (emit.emit(plan, "xla")(*args), jax.jit(_conv_groupnorm_conv)(*args)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=0.1)


def test_the_compiled_chain_launches_no_finalize_and_no_table_fusion(tmp_path):
    """conv -> GroupNorm + SiLU -> conv compiled for an H100 without a GPU: with the statistic
    finished by the first conv's last CTA, one Triton kernel fewer (the finalize that also wrote the
    table) and one 4-byte counter copy; the Mosaic kernels alone do the work."""
    import emit
    import eqsat
    from measure import xla_target

    S = jax.ShapeDtypeStruct
    concrete = _chain_args()
    args = tuple(S(a.shape, a.dtype) for a in concrete)
    plan = eqsat.optimize(_conv_groupnorm_conv, extractor="greedy", progress=False).lower(*concrete).plan
    finishing = xla_target.compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if finishing is None:
        pytest.skip(xla_target.unavailable_reason() or "the H100 compile target is unavailable")
    emitted = emit.emit(plan, "mosaic", interpret=False)

    def without_producer_finishing(*args):  # as before producer finishing (traced in the compile subprocess)
        import eqsat.cost.finish

        eqsat.cost.finish.producer_finished = lambda *a, **k: frozenset()
        return emitted(*args)

    before = xla_target.compile_for_h100(without_producer_finishing, *args)
    pallas = lambda report: {k: v for k, v in report.by_category.items() if k.startswith("Pallas")}  # noqa: E731
    assert pallas(finishing) == {"Pallas (Mosaic GPU)": 2}, finishing.by_category
    assert pallas(before) == {"Pallas (Mosaic GPU)": 2, "Pallas (Triton)": 1}, before.by_category
    assert finishing.copies == before.copies + 1  # the ticket counter, zeroed once
    assert finishing.kernels == before.kernels - 1, (finishing.launches, before.launches)
