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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.mosaic import finish
from emit.pallas.conv import ConvGeometry
from eqsat.tiling.mosaic import HaloGrid, MosaicBlocks
from tests.test_emit_mosaic_conv_partials import CPG, OFFSET, _merge, _params, _statistics, _weights


def _finished_conv(strips: int, chunk: int, monkeypatch):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 15, 15, 64)), jnp.float16)
    w = jnp.asarray(_weights(rng, 64, 24), jnp.float16)
    params = _params(x.shape, w.shape)
    out_shape = jax.eval_shape(lambda: mc.reference(x, w, params)).shape
    grid = HaloGrid(ConvGeometry(params, x.shape, w.shape, out_shape), 64, strips)
    blocks = MosaicBlocks(64, 64, 64, stages=3, compute_wgs=1)
    monkeypatch.setattr(finish, "CHUNK_TILES", chunk)

    @jax.jit
    def run(x, w):
        flat, partials, finished, counter = ch.build(
            [x], ch.layout_weight(w, params.rhs_spec, 64), grid, blocks, epilogue=lambda acc, _: acc + OFFSET,
            out_dtype=jnp.float32, interpret=True, statistics=_statistics(2, 24), counter=finish.new_counter())
        return ch.unflatten(flat, grid, 24), partials, finished, counter

    return grid, run(x, w)


@pytest.mark.parametrize("strips,chunk", [(1, 3), (3, 4)], ids=["rows-ragged-chunks", "strips"])
def test_the_last_cta_finishes_the_group_moments_of_the_stored_output(strips, chunk, monkeypatch):
    """8 tiles in chunks of 3 (the last chunk overlaps the one before: its first row merged once),
    or 3 strips (24 tiles, chunks of 4): mean within 2 ulps of the offset, M2 at fp32's bound, the
    sum; the constant group exactly (offset, 0), the NaN group NaN; and the readers' merge of the
    same partials to a few ulps of the spread."""
    grid, (out, partials, finished, counter) = _finished_conv(strips, chunk, monkeypatch)
    images, groups = 2, 24 // CPG
    tiles = images * grid.strips * grid.m_tiles
    assert [p.shape for p in partials] == [(tiles, 3, 16), (tiles, 1, 16)]
    assert [f.shape for f in finished] == [(2 * 16,), (16,)]
    assert np.asarray(counter).tolist() == [0]
    mean, m2 = np.asarray(finished[0], np.float64).reshape(2, -1)
    total = np.asarray(finished[1], np.float64)
    want = np.asarray(out).reshape(images, -1, groups, CPG).transpose(0, 2, 1, 3).reshape(images * groups, -1)
    want = want.astype(np.float64)
    nan = np.isnan(want).any(axis=1)
    assert nan.sum() == images and np.isnan(mean[nan]).all() and np.isnan(m2[nan]).all() and np.isnan(total[nan]).all()
    ok = ~nan
    want_mean = want.mean(axis=1)
    want_m2 = ((want - want_mean[:, None]) ** 2).sum(axis=1)
    ulp = np.spacing(np.float32(OFFSET))
    np.testing.assert_allclose(mean[ok], want_mean[ok], rtol=0, atol=2 * ulp)
    scale = np.abs(want[ok]).max() * np.abs(want[ok] - want_mean[ok, None]).max() * want.shape[1]
    np.testing.assert_allclose(m2[ok], want_m2[ok], rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(total[ok], 0.5 * want.sum(axis=1)[ok], rtol=1e-6,
                               atol=1e-6 * np.abs(want[ok]).sum(1).max())
    constant = np.arange(images) * groups + 1
    assert (mean[constant] == OFFSET).all() and (m2[constant] == 0.0).all()
    merged_mean, merged_m2 = _merge("moments", partials[0])
    np.testing.assert_allclose(mean[ok], merged_mean[ok], rtol=0, atol=ulp)
    np.testing.assert_allclose(m2[ok], merged_m2[ok], rtol=1e-5, atol=1e-6 * scale)


def _two_finishing_convs(x, w1, w2):
    """Two haloed 3x3 convs on 16x16 images, 64 channels in and out, each hosting a GroupNorm's
    moments (32 groups of 2 channels, 2 images: 64 slots) finished by its last CTA, the second
    taking the first's output and the counter the first returned."""
    from emit.mosaic.partials import GroupStatistic

    params = _params(x.shape, w1.shape)
    geometry = ConvGeometry(params, x.shape, w1.shape, x.shape)
    grid = HaloGrid(geometry, 128, 1)
    blocks = MosaicBlocks(128, 64, 64, stages=3, compute_wgs=1)
    statistic = [GroupStatistic("moments", lambda t: t.astype(jnp.float32), 2, 32, 2)]
    counter = finish.new_counter()
    results = []
    h = x
    for w in (w1, w2):
        flat, _partials, finished, counter = ch.build(
            [h], ch.layout_weight(w, params.rhs_spec, 64), grid, blocks, interpret=False, statistics=statistic,
            counter=counter)
        h = ch.unflatten(flat, grid, 64)
        results.append(finished[0])
    return h, *results


def test_two_finishing_convs_compile_for_sm90a_with_one_counter_copy(tmp_path):
    from benchmarks.mosaic_ptx import dumping
    from measure import xla_target

    S = jax.ShapeDtypeStruct
    args = (S((2, 16, 16, 64), jnp.float16), S((3, 3, 64, 64), jnp.float16), S((3, 3, 64, 64), jnp.float16))
    with dumping(tmp_path / "mosaic"):
        report = xla_target.compile_for_h100(_two_finishing_convs, *args)
        if report is None:
            pytest.skip(xla_target.unavailable_reason() or "the H100 compile target is unavailable")
        ptx = [p.read_text() for p in (tmp_path / "mosaic").glob("*.ptx")]
    assert report.by_category.get("Pallas (Mosaic GPU)") == 2, report.by_category
    counter_copies = [launch for launch in report.launches if launch.counted == "copy" and launch.bytes <= 8]
    assert len(counter_copies) == 1, report.launches  # one zeroed counter for both kernels
    assert ptx and all("atom.acq_rel.gpu.global.add.u32" in text for text in ptx)
    for text in ptx:  # the writer's TMA store waited and fenced before its ticket
        store_wait = text.index("cp.async.bulk.wait_group")
        ticket = text.index("atom.acq_rel.gpu.global.add.u32")
        assert store_wait < text.index("fence.proxy.async.global", store_wait) < ticket
