"""Hosted statistics read from their per-tile partials (`emit.expr.read_partials`, `emit.pallas.partials`).

A statistic computed in its producers' epilogues (`EpilogueReduce`, op sum or moments) reaches its
readers as the hosts' per-tile partials `[tiles, fields, slots]`; each reading kernel merges the
slot it reads where it reads it, TB tiles per step (`merge_partials_at`: vector reductions over a
block, Chan's formula across blocks for moments). Checked here:

- the merge against the two-pass moments on adversarial values (offsets large against the spread,
  constant rows, tiny and huge magnitudes, empty tiles holding garbage), in plain jax and inside a
  Pallas kernel (interpret mode), and that a reader's mean and M2 at one point merge once;
- the blocked merge at 1, 3, 7, 64 and 300 tiles, TB from 1 to all of them (the last block
  partial), empty tiles interleaved, mean 1e4 and spread 1e-2: the float64 merge of the partials
  to a few ulps of the spread, constant slots exactly (M2 0), in jax and in a Pallas kernel;
- the conv template's partials: no index-table operands, earlier hosts' partials copied in front;
- plans through `backend="pallas"` against `backend="xla"` and `jax.jit`: a statistic read by a
  pointwise kernel and returned, a host that cannot compute its statistic (the driver's own reduce
  kernel), GroupNorm over `concat(h, skip)` with groups of 3 channels straddling tiles;
- a small fp16 ResNet block compiled for an H100: exactly the plan's kernels, all Pallas (no merge
  or concatenate fusion, no iota from index tables).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import emit
import eqsat
from emit.expr import compile_expr, evaluate_whole, grid_index, merge_block_tiles, merge_partials_at, partials_layout
from emit.pallas import EmitContext, XlaFallbackWarning, conv, pointwise, run_kernels
from emit.pallas.partials import merged
from eqsat.conv_params import ConvParams
from eqsat.moments import merge_partials as reference_merge
from eqsat.moments import partial_moments, two_pass
from eqsat.term import Term
from eqsat.types import format_type
from sd15 import layers

SETTINGS = settings(max_examples=20, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
EPS = float(np.finfo(np.float32).eps)
# The greedy extractor, never stopped by the clock: the same plan on a loaded machine.
PLANNING = dict(extractor="greedy", extract_time_limit=120.0)


def _input(name, shape, dtype="float32"):
    return Term("Input", name, format_type(dtype, shape))


def _load(tensor):
    return Term("Load", tensor, tensor.ty)


def _row_moments(x_term, rows):
    """`moments` of a [rows, n] tensor over its last axis: f32[2, rows]."""
    return Term("EpilogueReduce", x_term, "moments", _load(x_term), "1", format_type("float32", (2, rows)))


def _with_empty_tiles(parts, rng, garbage):
    """`parts` ([tiles, 3, rows]) with empty tiles (count 0) inserted, holding `garbage` as mean and M2."""
    tiles = list(np.asarray(parts))
    for _ in range(int(rng.integers(1, 4))):
        empty = np.full_like(tiles[0], garbage)
        empty[0] = 0.0
        tiles.insert(int(rng.integers(0, len(tiles) + 1)), empty)
    return np.stack(tiles).astype(np.float32)


def _assert_moments_close(got, x):
    """`got` ([2, rows]) against the two-pass moments of x over its last axis: means to a few ulps of
    the magnitudes, M2 to each piece's mean rounding (eps * offset, squared, per element) and
    eps * offset / spread relative."""
    expected = np.asarray(two_pass(x, (1,)), np.float64)
    got = np.asarray(got, np.float64)
    n, magnitude = x.shape[1], np.abs(x.astype(np.float64)).max(initial=0.0)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=4 * EPS * magnitude + 1e-37)
    spread = np.abs(x - x.mean(axis=1, keepdims=True)).max(initial=0.0)
    rtol = 1e-4 + 8 * EPS * magnitude / max(spread, np.finfo(np.float32).tiny)
    noise = n * (8 * EPS * magnitude) ** 2
    np.testing.assert_allclose(got[1], expected[1], rtol=min(rtol, 1.0), atol=noise + 1e-37)
    assert (got[1] >= 0).all()


# --- the merge ----------------------------------------------------------------------------------------


@st.composite
def adversarial_rows(draw):
    rows, n = draw(st.integers(1, 4)), draw(st.integers(1, 90))
    offset = draw(st.sampled_from([0.0, 1e4, -3e5, 7e15]))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = offset + scale * rng.normal(size=(rows, n))
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = offset + scale  # a constant row: M2 exactly 0 in exact arithmetic
    return x.astype(np.float32), draw(st.integers(1, 17)), rng


@settings(SETTINGS, max_examples=10)  # a compile per example; the blocked-merge test below is exhaustive
@given(adversarial_rows(), st.sampled_from([np.inf, -np.inf, np.nan, 3e38]))
def test_the_merge_equals_two_pass_and_skips_empty_tiles(case, garbage):
    x, piece, rng = case
    rows = x.shape[0]
    stats = _row_moments(_input("x", x.shape), rows)
    parts = np.asarray(partial_moments(x, (1,), piece))
    # Empty tiles (a host's tile that touches no element of a slot) change nothing, whatever they hold.
    holey = _with_empty_tiles(parts, rng, garbage)
    read = jax.jit(lambda *buffers: [evaluate_whole(_load(stats), {stats: b}) for b in buffers])
    got, got_holey = read(parts, holey)
    _assert_moments_close(got, x)
    _assert_moments_close(reference_merge(parts), x)  # the design's reference merge, to the same bound
    np.testing.assert_array_equal(np.asarray(got_holey), np.asarray(got))


def test_sums_add_in_tile_order_and_one_tile_is_the_sum():
    x = np.arange(24, dtype=np.float32).reshape(4, 6) - 7.5
    xt = _input("x", (4, 6))
    stats = Term("EpilogueReduce", xt, "sum", _load(xt), "1", "f32[4]")
    tiles = np.stack([x[:, :2].sum(1), x[:, 2:5].sum(1), x[:, 5:].sum(1)])[:, None, :]  # [3, 1, 4]
    np.testing.assert_array_equal(np.asarray(evaluate_whole(_load(stats), {stats: tiles})),
                                  (tiles[0, 0] + tiles[1, 0]) + tiles[2, 0])
    assert partials_layout(stats, tiles.size) == (3, 1, 4)
    assert partials_layout(stats, 4) is None  # one tile of sums is the finished sum
    assert partials_layout(_row_moments(xt, 4), 8) is None and partials_layout(_row_moments(xt, 4), 12) == (1, 3, 4)
    with pytest.raises(ValueError, match="neither"):
        partials_layout(_row_moments(xt, 4), 10)


def test_a_readers_mean_and_m2_at_one_point_merge_once():
    """GroupNorm apply reads mean ([0]) and M2 ([1]) at the same (batch, group): one merge (its tile
    loop traced once, 3 loads), not two."""
    rng = np.random.default_rng(1)
    x = (50.0 + rng.normal(size=(2, 6))).astype(np.float32)
    xt = _input("x", (2, 6))
    stats = _row_moments(xt, 2)
    parts = np.asarray(partial_moments(x, (1,), 2))  # 3 tiles
    row = lambda r: Term("Reshape", Term("Slice", _load(stats), 0, r, r + 1, 1, "f32[1,2]"), "f32[2]")
    per_row = lambda t: Term("Broadcast", t, "0", "f32[2,6]")
    mean = per_row(row(0))
    var = Term("Binary", "div", per_row(row(1)), Term("Lit", 6.0, "f32[2,6]"), "f32[2,6]")
    normalized = Term("Binary", "mul", Term("Binary", "sub", _load(xt), mean, "f32[2,6]"),
                      Term("Unary", "rsqrt", Term("Binary", "add", var, Term("Lit", 1e-5, "f32[2,6]"), "f32[2,6]"),
                           "f32[2,6]"), "f32[2,6]")

    class CountingMemory:
        loads = 0

        def partials_source(self, statistic):
            flat = jnp.reshape(jnp.asarray(parts), (-1,))

            def load(offsets):
                CountingMemory.loads += 1
                return flat[offsets]

            return (3, 3, 2), load

        def load(self, tensor, index, mask):
            assert tensor is xt
            return jnp.asarray(x)[index]

    got = compile_expr(normalized)(CountingMemory(), grid_index((2, 6)))
    assert CountingMemory.loads == 3  # count, mean, M2 in the tile loop's body, traced once: one merge
    ref = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_a_scalar_statistic_read_inside_and_outside_a_row_reduction():
    """A one-slot statistic read in a RowReduce's body (inside its loop) and outside it: the merge
    made inside the loop is not reused outside (no leaked tracer), and both values are right."""
    rng = np.random.default_rng(2)
    x = (3.0 + rng.normal(size=(3, 5))).astype(np.float32)
    xt = _input("x", (3, 5))
    stats = Term("EpilogueReduce", xt, "sum", _load(xt), "0,1", "f32[]")
    total = Term("Broadcast", _load(stats), "", "f32[3,5]")
    body = Term("Binary", "sub", _load(xt), total, "f32[3,5]")
    reduce = Term("RowReduce", "sum", body, 1, Term("Acc", "f32[3]"), "f32[3]")
    outer = Term("Binary", "add", reduce, Term("Broadcast", _load(stats), "", "f32[3]"), "f32[3]")
    tiles = np.stack([x[:, :2].sum(), x[:, 2:].sum()]).reshape(2, 1, 1).astype(np.float32)
    got = jax.jit(lambda parts: evaluate_whole(outer, {xt: jnp.asarray(x), stats: parts}))(tiles)
    s = x.sum()
    np.testing.assert_allclose(np.asarray(got), (x - s).sum(1) + s, rtol=1e-5)


def test_a_pallas_kernel_merges_the_partials_it_reads():
    """A pointwise kernel (interpret mode) applying a GroupNorm whose statistic is bound to per-tile
    partials (offset 1e4, one constant group) equals the same kernel reading the two-pass statistic."""
    rng = np.random.default_rng(3)
    x = (1e4 + rng.normal(size=(4, 9))).astype(np.float32)
    x[2] = 1e4 + 0.5  # a constant group: M2 = 0
    xt = _input("x", (4, 9))
    stats = _row_moments(xt, 4)
    parts = np.asarray(partial_moments(x, (1,), 4))  # 3 tiles, the last one short

    def row(r):
        picked = Term("Broadcast", Term("Reshape", Term("Slice", _load(stats), 0, r, r + 1, 1, "f32[1,4]"), "f32[4]"),
                      "0", "f32[4,9]")
        return picked if r == 0 else Term("Binary", "div", picked, lit(9.0), "f32[4,9]")  # the mean; M2 / n

    lit = lambda v: Term("Lit", v, "f32[4,9]")
    scale = Term("Unary", "rsqrt", Term("Binary", "add", row(1), lit(1e-5), "f32[4,9]"), "f32[4,9]")
    apply = Term("Binary", "mul", Term("Binary", "sub", _load(xt), row(0), "f32[4,9]"), scale, "f32[4,9]")
    compiled = compile_expr(apply)

    def kernel(statistic):
        return pointwise.build(lambda memory, index, mask: compiled(memory, index, mask), [xt, stats],
                               [jnp.asarray(x), jnp.asarray(statistic)], jax.ShapeDtypeStruct((4, 9), jnp.float32),
                               name="test:pointwise", interpret=True)

    from_partials, from_finished = kernel(parts), kernel(two_pass(x, (1,)))
    # The merged mean may differ from the two-pass one by an ulp of 1e4.
    np.testing.assert_allclose(np.asarray(from_partials), np.asarray(from_finished), rtol=1e-5, atol=4e-3)
    np.testing.assert_array_equal(np.asarray(from_partials)[2], np.asarray(from_finished)[2])
    expected = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(from_partials)[[0, 1, 3]], expected[[0, 1, 3]], rtol=1e-3, atol=4e-3)


# --- the blocked merge (TB tiles per step) ------------------------------------------------------------

OFFSET, SPREAD = np.float32(1e4), 1e-2
CONSTANT = np.float32(1e4 + 1 / 3)  # not a short binary fraction: an unshifted mean would round


def _random_partials(tiles, slots, rng, garbage=0.0):
    """Moments partials `[tiles, 3, slots]` of float32 samples (mean 1e4, spread 1e-2; 1..5 per tile
    and slot, or none: about a third of the tiles are empty, count 0 holding `garbage`), each tile
    two-pass in float32 as a host writes it, slot 0 constant (every tile's mean exactly CONSTANT, M2
    0); and each slot's samples in float64."""
    counts = rng.integers(1, 6, size=(tiles, slots))
    counts[rng.random((tiles, slots)) < 1 / 3] = 0
    full = rng.integers(tiles)
    counts[full] = np.maximum(counts[full], 1)  # no slot left empty
    parts = np.zeros((tiles, 3, slots), np.float32)
    samples = [[] for _ in range(slots)]
    for t in range(tiles):
        for s in range(slots):
            k = int(counts[t, s])
            if k == 0:
                parts[t, :, s] = (0.0, garbage, garbage)
                continue
            x = np.full(k, CONSTANT) if s == 0 else (OFFSET + SPREAD * rng.normal(size=k)).astype(np.float32)
            mean = CONSTANT if s == 0 else np.float32(x.sum(dtype=np.float32) / np.float32(k))
            parts[t, :, s] = (k, mean, np.square(x - mean, dtype=np.float32).sum(dtype=np.float32))
            samples[s].append(x.astype(np.float64))
    return parts, [np.concatenate(x) for x in samples]


def _exact_merge(parts):
    """The merge of float32 partials `[tiles, 3, slots]` in float64, ignoring empty tiles: `[2, slots]`
    (mean, M2)."""
    p = np.asarray(parts, np.float64)
    n, mean, m2 = p[:, 0], np.where(p[:, 0] > 0, p[:, 1], 0.0), np.where(p[:, 0] > 0, p[:, 2], 0.0)
    total = n.sum(0)
    merged_mean = (n * mean).sum(0) / np.maximum(total, 1.0)
    return np.stack([merged_mean, (m2 + n * (mean - merged_mean) ** 2).sum(0)])


@pytest.mark.parametrize("tiles", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("budget,garbage", [(1, np.nan), (64, np.inf), (4096, 0.0)])
def test_the_blocked_merge_is_the_exact_merge_of_the_partials(tiles, budget, garbage):
    """TB tiles per step (TB = 1, a few, all of them), tile counts that are no power of two (the last
    block partial), empty tiles interleaved: moments equal the float64 merge of the partials to a
    few ulps of the spread (nothing rounds at the offset 1e4), a constant slot has M2 exactly 0 and
    its mean exactly its value, and the samples' float64 moments hold to the partials' own rounding. Sums
    likewise. Slots read as a vector, a 2-d block of lanes and one scalar slot."""
    rng = np.random.default_rng(tiles * 7 + budget)
    parts, samples = _random_partials(tiles, 4, rng, garbage)
    live_means = np.where(parts[:, 0] > 0, parts[:, 1], 0.0).astype(np.float64)
    sums = (parts[:, 0] * live_means)[:, None, :].astype(np.float32)  # sum partials [tiles, 1, 4]
    lanes = [jnp.arange(4, dtype=jnp.int32), jnp.arange(4, dtype=jnp.int32)[::-1].reshape(2, 2), 0]

    @jax.jit
    def merge(parts, sums):
        flat_parts, flat_sums = jnp.reshape(parts, (-1,)), jnp.reshape(sums, (-1,))
        return [(merge_partials_at("moments", lambda at: flat_parts[at], tiles, 4, slot, budget=budget),
                 merge_partials_at("sum", lambda at: flat_sums[at], tiles, 4, slot, budget=budget)) for slot in lanes]

    (moments, total), (moments_2d, total_2d), (moments_0, total_0) = merge(parts, sums)
    block = merge_block_tiles(tiles, 4, budget)
    assert block == min(1 << (tiles - 1).bit_length(), budget // 4 or 1)
    got = np.asarray(jnp.stack(moments), np.float64)
    np.testing.assert_array_equal(np.asarray(jnp.stack(moments_2d)).reshape(2, 4)[:, ::-1], got)
    np.testing.assert_array_equal(np.asarray(jnp.stack(moments_0)), got[:, 0])  # constant: exact for any TB
    exact = _exact_merge(parts)
    np.testing.assert_allclose(got[0], exact[0], rtol=4 * EPS)
    np.testing.assert_allclose(got[1], exact[1], rtol=1e-5, atol=1e-37)
    assert got[1, 0] == 0.0 and np.float32(got[0, 0]) == CONSTANT
    for s, x in enumerate(samples):  # the samples' moments: the partials' means rounded at 1e4, no worse
        n, scale = len(x), np.abs(x).max()
        spread = np.abs(x - x.mean()).max()
        assert abs(got[0, s] - x.mean()) <= 4 * EPS * scale
        assert abs(got[1, s] - ((x - x.mean()) ** 2).sum()) <= 1e-5 * ((x - x.mean()) ** 2).sum() \
            + 2 * EPS * n * scale * spread + n * (4 * EPS * scale) ** 2
    exact_sums = sums[:, 0].astype(np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(total), exact_sums, rtol=tiles * EPS)
    np.testing.assert_array_equal(np.asarray(total_2d).reshape(4)[::-1], np.asarray(total))
    np.testing.assert_allclose(np.asarray(total_0), exact_sums[0], rtol=tiles * EPS)  # 1 lane: another TB
    again = merge(parts, sums)  # deterministic: the same bits
    np.testing.assert_array_equal(np.asarray(jnp.stack(again[0][0])), np.asarray(jnp.stack(moments)))


def test_a_pallas_kernel_merges_many_tiles_in_blocks():
    """A pointwise kernel (interpret mode) reading a statistic bound to 300 tiles of 2 samples and 1
    to 3 empty ones holding NaN, with 8 lanes (TB = 512: one block) and 256 lanes (TB = 16: 19 blocks,
    the last partial): both give the float64 merge of the partials, a constant row's M2 exactly 0."""
    rng = np.random.default_rng(11)
    x = (OFFSET + SPREAD * rng.normal(size=(4, 600))).astype(np.float32)
    x[1] = CONSTANT
    xt = _input("x", x.shape)
    stats = _row_moments(xt, 4)
    parts = _with_empty_tiles(partial_moments(x, (1,), 2), np.random.default_rng(3), np.nan)
    assert parts.shape[0] > 300 and (parts[parts[:, 0, 1] > 0, 1:, 1] == [CONSTANT, 0.0]).all()
    read = compile_expr(_load(stats))

    def kernel(block):
        return pointwise.build(lambda memory, index, mask: read(memory, index, mask), [stats], [jnp.asarray(parts)],
                               jax.ShapeDtypeStruct((2, 4), jnp.float32), name="test:read", interpret=True,
                               config=pointwise.PointwiseConfig(block=block))

    exact = _exact_merge(parts)
    assert merge_block_tiles(parts.shape[0], 8) == 512 and merge_block_tiles(parts.shape[0], 256) == 16
    for block in (8, 256):
        got = np.asarray(kernel(block), np.float64)
        np.testing.assert_allclose(got[0], exact[0], rtol=4 * EPS)
        np.testing.assert_allclose(got[1], exact[1], rtol=1e-5)
        assert got[1, 1] == 0.0
    _assert_moments_close(got, x)


# --- the conv template's partials -------------------------------------------------------------------

NHWC_HWIO = ("NHWC", "HWIO", "NHWC")
SMALL_TILES = conv.ConvConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def _identity_conv(batch, side, channels):
    """A 1x1 NHWC conv term (its output is x when w is the identity) and GroupNorm moments of its
    output in groups of 3 channels: f32[2, batch, channels // 3]."""
    x_shape = (batch, side, side, channels)
    xt, wt = _input("x", x_shape), _input("w", (1, 1, channels, channels))
    numbers = lax.conv_dimension_numbers(x_shape, (1, 1, channels, channels), NHWC_HWIO)
    params = ConvParams.from_lax((1, 1), ((0, 0), (0, 0)), (1, 1), (1, 1), numbers)
    term = Term("Conv", _load(xt), _load(wt), params.key, Term("Acc", format_type("float32", x_shape)),
                format_type("float32", x_shape))
    groups = channels // 3
    body = Term("Reshape", _load(term), format_type("float32", (batch, side * side, groups, 3)))
    stats = Term("EpilogueReduce", term, "moments", body, "1,3", format_type("float32", (2, batch, groups)))
    return xt, wt, term, stats


def test_conv_partials_need_no_index_tables_and_follow_earlier_hosts():
    """48 channels in 16 groups of 3 over 16-channel tiles (groups straddle tiles), 2 images of 4x4
    in one-row tiles (16 columns, 4 valid): the pallas_call reads only x and w (each element's slot is index arithmetic,
    no table operands); an earlier host's partials are copied in front, bit for bit."""
    rng = np.random.default_rng(4)
    x = (1e4 + rng.normal(size=(2, 4, 4, 48))).astype(np.float32)
    w = np.eye(48, dtype=np.float32).reshape(1, 1, 48, 48)
    xt, wt, term, stats = _identity_conv(2, 4, 48)

    def run(x, w, prefix=None):
        return conv.run(term, {xt: x, wt: w}, hosted=[stats], prefixes={stats: prefix} if prefix is not None else None,
                        config=SMALL_TILES, interpret=True)

    jaxpr = jax.make_jaxpr(run)(x, w)
    calls = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1 and len(calls[0].invars) == 2, jaxpr
    out, partials = run(x, w)
    own = np.asarray(partials[stats])
    assert own.shape == (8 * 3, 3, 32)  # 2 x 4 row tiles x 3 channel tiles, (count, mean, M2), 2 x 16 slots
    np.testing.assert_array_equal(np.asarray(out), x)
    grouped = x.reshape(2, 16, 16, 3).transpose(0, 2, 1, 3).reshape(32, 48)  # row b * 16 + g
    _assert_moments_close(np.asarray(merged(stats, own)).reshape(2, 32), grouped)
    prefix = rng.normal(size=(5, 3, 32)).astype(np.float32)
    _, with_prefix = run(x, w, prefix)
    np.testing.assert_array_equal(np.asarray(with_prefix[stats])[:5], prefix)
    np.testing.assert_array_equal(np.asarray(with_prefix[stats])[5:], own)


# --- plans through backend="pallas" ---------------------------------------------------------------------


def _normal(rng, *shape, scale=1.0, offset=0.0, dtype=jnp.float32):
    return jnp.asarray(offset + rng.normal(size=shape) * scale, dtype)


def _close(got, want, tol=2e-4):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = max(1.0, float(jnp.max(jnp.abs(w.astype(jnp.float32)))))
        np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w, np.float32) / scale,
                                   rtol=tol, atol=tol)


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC_HWIO)


def _group_norm(h, groups):
    b, hh, ww, c = h.shape
    g = h.reshape(b, hh, ww, groups, c // groups)
    g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) * lax.rsqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-5)
    return g.reshape(h.shape)


def _run_backends(fn, args, *, tol=2e-4):
    """`fn`'s plan through backend="pallas" (interpret mode, no XLA fallback) and "xla", both against
    jax.jit. Returns the plan."""
    plan = eqsat.optimize(fn, **PLANNING).lower(*args).plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = emit.emit(plan, "pallas", interpret=True)(*args)
    want = jax.jit(fn)(*args)
    _close(pallas, want, tol)
    _close(emit.emit(plan, "xla")(*args), want, tol)
    return plan


def _hosting_convs(plan):
    return [k for k in plan.kernels if k.kind == "conv" and len(k.outputs) > 1]


def test_a_statistic_read_by_a_pointwise_kernel_and_returned():
    """GroupNorm moments hosted by a conv (offset 1e3 against a spread of 1), read by the pointwise
    kernel computing the variance that the function returns."""
    rng = np.random.default_rng(5)
    args = (_normal(rng, 2, 4, 4, 3, offset=1e3), _normal(rng, 3, 3, 3, 6, scale=0.3))

    def fn(x, w):
        y = _conv(x, w)
        return y, y.reshape(2, 16, 2, 3).var(axis=(1, 3))

    plan = _run_backends(fn, args)
    assert len(_hosting_convs(plan)) == 1, [(k.kind, len(k.outputs)) for k in plan.kernels]


def test_constant_groups_hosted_by_their_conv_normalize_to_exactly_the_bias():
    """GroupNorm (3 channels per group, 8 x 8 pixels: 2 x 4 pixel tiles straddle groups) of a conv
    whose output is its bias, one value per group far from zero (141.8948, -288.94873, 1e6 + 0.5,
    -3.3: their float32 sum / n rounds): the conv hosts the moments, each tile's mean is exactly the
    group's value (`emit.expr.piece_moments`), the merge keeps it, and the normalized output is
    exactly the GroupNorm's bias through backend="pallas"."""
    values = np.array([141.8948, -288.94873, 1e6 + 0.5, -3.3], np.float32)
    args = (_normal(np.random.default_rng(9), 1, 8, 8, 3), jnp.zeros((1, 1, 3, 12), jnp.float32),
            jnp.asarray(np.repeat(values, 3)))
    gn_bias = np.float32(0.1) * np.arange(12, dtype=np.float32) - np.float32(0.5)

    def fn(x, w, bias):
        h = _conv(x, w) + bias
        return _group_norm(h, 4) * 1.5 + gn_bias

    plan = eqsat.optimize(fn, **PLANNING).lower(*args).plan
    assert len(_hosting_convs(plan)) == 1, [(k.kind, len(k.outputs)) for k in plan.kernels]
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        got = emit.emit(plan, "pallas", interpret=True)(*args)
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(got)[0]), np.broadcast_to(gn_bias, (1, 8, 8, 12)))


def test_a_host_that_cannot_compute_its_statistic_leaves_it_to_the_driver(monkeypatch):
    """GroupNorm over concat(h, skip) (4 + 5 channels in groups of 3: one group straddles the
    boundary) where the first conv cannot compute its part: the second host's partials alone are
    incomplete, so the driver runs the statistic as its own reduce kernel, and the result is right."""
    rng = np.random.default_rng(6)
    args = (_normal(rng, 1, 4, 4, 3, offset=2.0), _normal(rng, 1, 1, 3, 4), _normal(rng, 1, 1, 3, 5),
            _normal(rng, 3, 3, 9, 2, scale=0.3))

    def fn(x, wa, wb, w):
        return _conv(jax.nn.silu(_group_norm(jnp.concatenate([_conv(x, wa), _conv(x, wb)], -1), 3)), w)

    plan = eqsat.optimize(fn, **PLANNING).lower(*args).plan
    hosts = _hosting_convs(plan)
    assert len(hosts) == 2, [(k.kind, len(k.outputs)) for k in plan.kernels]
    first, statistic = hosts[0].term, hosts[0].outputs[1]
    original, reduced = conv._statistic, []

    def refuse_first(reduction, term, *rest):
        if term is first:
            raise NotImplementedError("test: this host cannot")
        return original(reduction, term, *rest)

    from emit.pallas import reduce as reduce_template

    template = reduce_template.emit

    def spy(kernel, ctx):
        reduced.append(kernel.term)
        return template(kernel, ctx)

    monkeypatch.setattr(conv, "_statistic", refuse_first)
    monkeypatch.setattr(reduce_template, "emit", spy)
    got = emit.emit(plan, "pallas", interpret=True)(*args)
    _close(got, jax.jit(fn)(*args))
    assert reduced == [statistic]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_groupnorm_over_a_skip_concat_merges_both_convs_partials(dtype):
    """Up-block GroupNorm over concat(h, skip): 20 + 16 channels in 12 groups of 3 (group 6 straddles
    the two convs), 2 images of 12x12 in 4-row x 16-column tiles (3 per image), offset
    1e3 (fp32) or 30 (fp16, where the statistic reads convert(concat(h, skip)): an elementwise op
    over the concat): one partials buffer (the second conv copies the first's rows in front),
    merged by the reading conv."""
    rng = np.random.default_rng(7)
    offset = 1e3 if dtype == jnp.float32 else 30.0
    args = (_normal(rng, 2, 12, 12, 3, offset=offset, dtype=dtype), _normal(rng, 1, 1, 3, 20, scale=0.5, dtype=dtype),
            _normal(rng, 1, 1, 3, 16, scale=0.5, dtype=dtype), _normal(rng, 3, 3, 36, 4, scale=0.2, dtype=dtype))

    def fn(x, wa, wb, w):
        h = jnp.concatenate([_conv(x, wa), _conv(x, wb)], -1)
        normed = _group_norm(h.astype(jnp.float32), 12).astype(dtype)
        return _conv(jax.nn.silu(normed), w)

    plan = _run_backends(fn, args, tol=2e-4 if dtype == jnp.float32 else 2e-2)
    assert len(_hosting_convs(plan)) == 2
    calls = emit.kernel_calls(plan)
    ctx = EmitContext({t: a for t, a in zip(plan.program.inputs, args)}, plan.program.constants,
                      plan.program.payloads, interpret=True)
    jax.eval_shape(lambda: run_kernels(calls, ctx))  # the buffers' shapes; the values were checked above
    (statistic,) = ctx.partials
    # 2 images x 3 pixel tiles x 1 channel tile per conv, (count, mean, M2), 2 images x 12 groups
    assert ctx.partials[statistic].shape == (12, 3, 24) and not ctx.pending
    assert statistic not in ctx.values  # no reader needed it finished


def test_a_per_pixel_statistic_over_a_concat_along_rows_is_not_left_half_written():
    """LayerNorm over channels of concat(conv_a, conv_b) along H: each conv holds only its half of
    the per-pixel slots, so neither may write per-row partials (the other half of each tile row
    would stay unwritten: NaN in interpret mode); the statistic runs as the driver's reduce kernel."""
    rng = np.random.default_rng(8)
    args = (_normal(rng, 1, 4, 4, 3, offset=3.0), _normal(rng, 1, 1, 3, 8), _normal(rng, 1, 1, 3, 8))

    def fn(x, wa, wb):
        h = jnp.concatenate([_conv(x, wa), _conv(x, wb)], axis=1)
        return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

    plan = _run_backends(fn, args)
    assert len(_hosting_convs(plan)) == 2


# --- compiled for an H100 without a GPU ---------------------------------------------------------------


def test_a_resnet_block_and_a_skip_concat_groupnorm_compile_to_the_plans_kernels_only(tmp_path):
    """fp16, 64 -> 128 channels at 8x8: conv_in hosts norm1's statistics, conv1 norm2's, conv2 and a
    skip conv both host the GroupNorm over concat(h, skip) (192 channels in 32 groups of 6: group 21
    straddles the two). The executable launches exactly the plan's kernels, every one a Pallas
    kernel: no merge or concatenate fusion after a host, no iota from an index table."""
    from measure.xla_target import compile_for_h100

    shapes, dt = jax.ShapeDtypeStruct, jnp.float16

    def net(p, x, temb, s):
        h = layers.conv2d(p, "conv_in", x)
        h = layers.resnet_block(p, "r", h, temb, 32, 1e-5)
        cat = jnp.concatenate([h, layers.conv2d(p, "skip", s)], -1)
        return layers.conv2d(p, "out", layers.silu(layers.group_norm(p, "n", cat, 32, 1e-5)))

    params = {"conv_in.weight": (64, 4, 3, 3), "conv_in.bias": (64,), "r.norm1.weight": (64,), "r.norm1.bias": (64,),
              "r.conv1.weight": (128, 64, 3, 3), "r.conv1.bias": (128,), "r.time_emb_proj.weight": (128, 32),
              "r.time_emb_proj.bias": (128,), "r.norm2.weight": (128,), "r.norm2.bias": (128,),
              "r.conv2.weight": (128, 128, 3, 3), "r.conv2.bias": (128,), "r.conv_shortcut.weight": (128, 64, 1, 1),
              "r.conv_shortcut.bias": (128,), "skip.weight": (64, 4, 3, 3), "skip.bias": (64,),
              "n.weight": (192,), "n.bias": (192,), "out.weight": (4, 192, 3, 3), "out.bias": (4,)}
    args = ({k: shapes(v, dt) for k, v in params.items()}, shapes((2, 8, 8, 4), dt), shapes((2, 32), dt),
            shapes((2, 8, 8, 4), dt))
    plan = eqsat.optimize(net, **PLANNING).lower(*args).plan
    assert [len(k.outputs) for k in plan.kernels if k.kind == "conv"].count(2) == 4, \
        [(k.component, k.kind, len(k.outputs)) for k in plan.kernels]
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args)
    if report is None:
        pytest.skip("no H100 compile target here (the CUDA plugin): python -m measure.cuda_target install")
    names = [l.name for l in report.launches if l.counted != "none"]
    assert report.by_category == {"Pallas (Triton)": len(plan.kernels)}, names
    assert report.kernels == len(plan.kernels) and report.copies == 0 and report.memsets == 0, names
