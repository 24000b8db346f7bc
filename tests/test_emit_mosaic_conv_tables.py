"""The haloed Mosaic conv's vector table written by the Triton kernel that finishes the statistic it
gathers (`emit/pallas/tables.py`), not by an XLA fusion: the table itself against the one
`conv_halo.vector_tables` gathers, plans in GPU / Pallas interpret mode against the XLA emitter and
`jax.jit` (a GroupNorm+SiLU conv whose statistic the driver's reduce finishes, with the time
embedding's row; one a Mosaic conv finishes from its host's partials; a plan `Reduce`; one statistic
read by two convs) on 15x15 images with 3 channels per group, offsets of 1e4 against a spread of 1,
a constant group, a zero row and a NaN; and the compiled program (deviceless H100) with no table
fusion left."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import emit
import eqsat
from emit.backends import TritonFallbackWarning
from emit.mosaic import conv_halo as ch
from emit.pallas import XlaFallbackWarning, tables
from sd15 import layers
from tests.test_emit_mosaic_conv_halo import _bound

C, GROUPS, T = 192, 64, 32  # 3 channels per group


def _block(x, temb, p):
    """A resnet's conv1 and conv2 without the residual: GroupNorm+SiLU -> 3x3 conv, plus the time
    embedding's row when `temb` is given, GroupNorm+SiLU -> 3x3 conv."""
    h = layers.conv2d(p, "conv1", layers.silu(layers.group_norm(p, "norm1", x, GROUPS, 1e-5)))
    if temb is not None:
        h = h + layers.linear(p, "time_emb_proj", layers.silu(temb))[:, None, None, :]
    return layers.conv2d(p, "conv2", layers.silu(layers.group_norm(p, "norm2", h, GROUPS, 1e-5)))


def _two_readers(x, gamma, beta, wa, wb):
    """One GroupNorm statistic read by two convs: SiLU then a 3x3 conv, and twice it then a stride-2 conv."""
    n = layers.group_norm({"n.weight": gamma, "n.bias": beta}, "n", x, GROUPS, 1e-5)
    dims = ("NHWC", "OIHW", "NHWC")
    a = lax.conv_general_dilated(layers.silu(n), wa, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dims)
    b = lax.conv_general_dilated(n * 2.0, wb, (2, 2), ((1, 1), (1, 1)), dimension_numbers=dims)
    return a, b


def _adversarial(rng, shape, nan: bool) -> np.ndarray:
    """An offset of 1e4 against a spread of 1, group 0 (channels 0..2) constant, a zero row, a NaN."""
    x = 1e4 + rng.standard_normal(shape)
    x[..., :3] = 1e4
    x[:, 4] = 0.0
    if nan:
        x[-1, 7, 7, 100] = np.nan
    return x.astype(np.float16)


def _params(rng, temb: bool) -> dict:
    f16 = lambda a: jnp.asarray(a, jnp.float16)  # noqa: E731
    p = {f"{n}.{k}": f16(rng.standard_normal(C) + (1.0 if k == "weight" else 0.0))
         for n in ("norm1", "norm2") for k in ("weight", "bias")}
    p.update({"conv1.weight": f16(0.1 * rng.standard_normal((C, C, 3, 3))), "conv1.bias": f16(rng.standard_normal(C)),
              "conv2.weight": f16(0.1 * rng.standard_normal((64, C, 3, 3))),
              "conv2.bias": f16(rng.standard_normal(64))})
    if temb:
        p["time_emb_proj.weight"] = f16(0.1 * rng.standard_normal((C, T)))
        p["time_emb_proj.bias"] = f16(rng.standard_normal(C))
    return p


def _run_recording_tables(plan, args):
    """(the plan on the Mosaic backend in interpret mode, per haloed conv whether a Triton kernel
    wrote its table, the finishing kernels that wrote tables: `(tensor op, tables)`); each written
    table equals `vector_tables`' gather of the same vectors, exactly (NaN where it has NaN)."""
    written, writers, pairs = [], [], []
    vector_tables, writes_init = ch.vector_tables, tables.TableWrites.__init__

    def spy_tables(parts, table=None):
        if any(p.vectors for p in parts) and not (len(parts) == 1 and all(parts[0].in_place)):
            written.append(table is not None)
            if table is not None:  # against the XLA fusion's gather of the same vectors, when it runs
                (gathered,), _ = vector_tables(parts)
                jax.debug.callback(lambda a, b: pairs.append((np.asarray(a), np.asarray(b))), table, gathered)
        return vector_tables(parts, table)

    def spy_writes(self, tensor, requests, ctx):
        writers.append((tensor.op, len(requests)))
        writes_init(self, tensor, requests, ctx)

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error", TritonFallbackWarning)
        warnings.simplefilter("ignore", XlaFallbackWarning)
        patch.setattr(ch, "vector_tables", spy_tables)
        patch.setattr(tables.TableWrites, "__init__", spy_writes)
        out = jax.block_until_ready(emit.emit(plan, "mosaic", interpret=True)(*args))
    jax.effects_barrier()
    assert len(pairs) == sum(written), (len(pairs), written)
    for table, gathered in pairs:
        np.testing.assert_array_equal(table, gathered)
    return out, written, writers


def _assert_matches_xla_and_jit(out, plan, fn, args, scale):
    expected = emit.emit(plan, "xla")(*args)
    jitted = jax.jit(fn)(*args)
    for got, xla, jit in zip(jax.tree.leaves(out), jax.tree.leaves(expected), jax.tree.leaves(jitted)):
        got, xla, jit = (np.asarray(a, np.float32) for a in (got, xla, jit))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(jit))
        finite = ~np.isnan(jit)
        for reference in (xla, jit):
            np.testing.assert_allclose(np.where(finite, got, 0) / scale, np.where(finite, reference, 0) / scale,
                                       atol=4e-3, rtol=0)


def _plan(fn, args):
    return eqsat.optimize(fn, extractor="greedy", progress=False).lower(*args).plan


@pytest.mark.slow
@pytest.mark.parametrize("temb", [True, False], ids=["time embedding, driver reduce", "conv finalizes partials"])
def test_a_block_whose_tables_the_statistics_kernels_write(temb):
    """Both convs' tables written, not built by XLA fusions: conv1's by the norm's `Reduce` over the
    input, conv2's by the kernel finishing norm2's statistic (hosted on conv1): the driver's reduce
    when the body reads the time embedding's row (which conv2's table holds too), else conv1's last
    CTA, which finishes it (`emit.mosaic.finish`). Against the XLA emitter and jit; the NaN's image is NaN, the other finite."""
    rng = np.random.default_rng(5)
    p = _params(rng, temb)
    x = jnp.asarray(_adversarial(rng, (2, 15, 15, C), nan=True))
    t = jnp.asarray(rng.standard_normal((2, T)), jnp.float16) if temb else None
    args = (x, t, p)
    plan = _plan(_block, args)
    out, written, writers = _run_recording_tables(plan, args)
    assert written == [True, True], written
    # without the time embedding conv1 is norm2's only host and finishes it, writing conv2's table in
    # its last CTA (`emit.mosaic.finish`): no Triton kernel writes that one
    assert [op for op, _n in writers] == (["Reduce", "EpilogueReduce"] if temb else ["Reduce"]), writers
    assert np.isnan(np.asarray(out[1], np.float32)).all() and np.isfinite(np.asarray(out[0], np.float32)).all()
    _assert_matches_xla_and_jit(out, plan, _block, args,
                                _bound(p["norm2.weight"], p["norm2.bias"], p["conv2.weight"], p["conv2.bias"]))


@pytest.mark.slow
def test_one_statistic_read_by_two_convs():
    """A GroupNorm statistic two haloed convs read (stride 1 and stride 2): its reduce kernel writes a
    table for each; both outputs against the XLA emitter and jit."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(_adversarial(rng, (2, 15, 15, C), nan=False))
    gamma, beta = (jnp.asarray(rng.standard_normal(C), jnp.float16) for _ in range(2))
    wa, wb = (jnp.asarray(0.1 * rng.standard_normal((64, C, 3, 3)), jnp.float16) for _ in range(2))
    args = (x, gamma, beta, wa, wb)
    plan = _plan(_two_readers, args)
    out, written, writers = _run_recording_tables(plan, args)
    assert written == [True, True], written
    assert writers == [("Reduce", 2)], writers
    _assert_matches_xla_and_jit(out, plan, _two_readers, args, 2 * _bound(gamma, beta, wa, jnp.zeros(64)))


@pytest.mark.slow
def test_the_compiled_block_has_no_table_fusion(tmp_path):
    """The block (its per-call stage, weights prepared) compiled for an H100 without a GPU: no XLA
    fusion builds a vector table (no `stack` among its glue launches, `benchmarks.glue`), and its
    non-Pallas launches are the glue the cost model charges: none around the convs (they store their
    pixels themselves, `eqsat.tiling.mosaic.stores_pixels`)."""
    from benchmarks.glue import glue_launches
    from tests.test_cost_mosaic_glue import CASES, _counted_and_modeled, _skip_without_target

    _skip_without_target()
    fn, args, params_argnums = CASES["two GroupNorm convs and a time embedding, tables written by the statistics' "
                                     "kernels"]
    counted, modeled, report = _counted_and_modeled(fn, args, params_argnums, tmp_path)
    launches = glue_launches(next(p.parent for p in tmp_path.rglob("*thunk_metadata.txt")))
    assert [l.name for l in launches if l.jax_op == "stack"] == []
    assert counted == sum(len(glue) for glue in modeled.values()), (counted, modeled, report.by_category)
    assert [glue for key, glue in modeled.items() if key[1] == "conv"] == [[]] * 2, modeled  # pixels stored too
