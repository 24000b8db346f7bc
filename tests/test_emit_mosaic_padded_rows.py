"""A matmul's padded store read as it lies by the next Mosaic matmul (`emit.mosaic.matmul`,
`eqsat.cost.mosaic.reads_padded_rows`, `padded_residuals`): 77-token rows (2 x 77 = 154, not whole
8-row TMA tiles) are stored padded to the tile grid; the next matmul reads that store as its A and
as its residual instead of padding the slice again, computing rows past 154 into rows it drops.

A chain `h = x @ w1 + b1; y = h @ w2 + h; y @ w3 + y` (the text encoder's residual stream in
miniature) in GPU interpret mode against the XLA emitter on adversarial values, and compiled for
sm_90a without a GPU: one pad (x) and one slice (the program's output) around three Mosaic kernels,
as the model counts them. An A prologue (a LayerNorm's apply, its row pass) reads a tensor of 154
rows from its padded store as its `[rows, K]` source (`load_sources`)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.mosaic import TritonFallbackWarning

S, F16 = jax.ShapeDtypeStruct, jnp.float16
ARGS = (S((2, 77, 64), F16), S((64, 128), F16), S((128,), F16), S((128, 128), F16), S((128, 128), F16))


def _chain(x, w1, b1, w2, w3):
    h = x @ w1 + b1
    y = h @ w2 + h
    return y @ w3 + y


def _plan():
    return eqsat.optimize(_chain, progress=False, cache=False).lower(*ARGS).plan


def test_the_model_reads_the_padded_stores_down_the_chain():
    from eqsat.cost.mosaic import mosaic_work, padded_residuals, padded_store, reads_padded_rows

    matmuls = [k.term for k in _plan().kernels if k.op == "Matmul"]
    assert len(matmuls) == 3
    for term in matmuls:
        assert padded_store(term) is not None and padded_store(term)[1] % 8 == 0  # 154 rows stored padded
    first, second, third = matmuls
    assert reads_padded_rows(*second.args[:3]) is first and reads_padded_rows(*third.args[:3]) is second
    assert padded_residuals(second.args[3], 1, 154, 128) == [first]
    assert [g.what for g in mosaic_work(first).glue if g.launches] == ["A laid out"]  # x itself is padded
    assert all([g.what for g in mosaic_work(t).glue if g.launches] == [] for t in (second, third))


@pytest.mark.parametrize("offset,scale,constant_row", [(0.0, 1.0, False), (300.0, 1e-2, True)])
def test_the_chain_matches_the_xla_emitter(offset, scale, constant_row):
    """Offsets large against the spread and a constant row: the rows past 154 the kernels compute
    from the padded stores never reach the 154 rows returned."""
    rng = np.random.default_rng(7)
    x = offset + scale * rng.standard_normal(ARGS[0].shape)
    if constant_row:
        x[1, 76, :] = offset
    weights = [0.1 * rng.standard_normal(a.shape) for a in ARGS[1:]]
    values = [np.asarray(v, np.float16) for v in (x, *weights)]
    plan = _plan()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        ours = np.asarray(emit.emit(plan, "mosaic", interpret=True)(*values), np.float64)
    ref = np.asarray(emit.emit(plan, "xla")(*values), np.float64)
    assert ours.shape == (2, 77, 128) and np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, ref, rtol=2e-2, atol=2e-3 * max(1.0, float(np.abs(ref).max())))


def test_the_chain_compiles_with_one_pad_and_one_slice(tmp_path):
    from benchmarks.glue import glue_launches
    from eqsat.cost.backends import sliced_stores
    from eqsat.cost.mosaic import mosaic_work
    from measure.xla_target import compile_for_h100, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"no deviceless H100 compile here: {unavailable_reason()}")
    plan = _plan()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TritonFallbackWarning)
        report = compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *ARGS, keep_dump=tmp_path)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    launches = glue_launches(next(p.parent for p in tmp_path.rglob("*thunk_metadata.txt")))
    assert sorted(launch.family for launch in launches) == ["loop_pad_fusion", "wrapped_slice"], launches
    kernels = [(k.term, "mosaic", k.hosted) for k in plan.kernels]
    modeled = sum(mosaic_work(term).glue_launches for term, _r, _h in kernels)
    assert modeled + len(sliced_stores(kernels, [], list(plan.outputs))) == len(launches) == 2
    assert report.by_category.get("Pallas (Mosaic GPU)") == 3, report.by_category


def test_a_prologue_source_of_77_token_rows_is_read_from_its_padded_store():
    """`load_sources` maps a `[2, 77, 128]` tensor read at A's own index to a `[rows, K]` tile source:
    TMA cannot tile its 154 rows, so without a padded store it declines; with one (`[1, 192, 128]`,
    the same rows and more after them) the source is that store, at the same row and column."""
    from emit.mosaic.matmul import load_sources
    from eqsat.term import Term
    from eqsat.types import type_of

    tensor = Term("Opaque", "x", Term("TNil"), 0, type_of(ARGS[3].update(shape=(2, 77, 128))))
    index = (np.arange(154).reshape(1, 154, 1) // 77, np.arange(154).reshape(1, 154, 1) % 77,
             np.arange(128).reshape(1, 1, 128))
    value = jnp.zeros((2, 77, 128), F16)
    with pytest.raises(NotImplementedError, match="cannot tile"):
        load_sources([(tensor, index)], (1, 154, 128), lambda t: value, 64)
    store = jnp.ones((1, 192, 128), F16)
    (found,), (source,) = load_sources([(tensor, index)], (1, 154, 128), lambda t: value, 64,
                                       stores=lambda t: store if t is tensor else None)
    assert found is tensor and source.kind == "tile" and source.array.shape == (192, 128)
    assert (source.row0, source.col0, source.batch_rows) == (0, 0, 0)
