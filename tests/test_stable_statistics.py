"""Statistics that do not cancel (issue 8 §1): every fused form of a normalization's statistics —
split off its norm (`norm_split`), recomputed inside the matmul reading it (`row_stats`), computed
in the epilogue of the kernel writing its input (`epilogue_stats`) — matches `jax.jit` on inputs
whose mean is large against their spread, and on constant rows.

The tolerances catch cancellation: E[x^2] - E[x]^2 in float32 loses every digit of a variance of
1e-4 at an offset of 100 (relative error ~10, or a negative variance and NaN after rsqrt); the
stable forms are off by a few float32 roundings of the spread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from sd15.layers import group_norm, layer_norm

DN = ("NHWC", "HWIO", "NHWC")


def _ops(term) -> list:
    seen, stack, out = set(), [term], []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        if node is term or node.sort != "Tensor":
            stack.extend(node.children)
    return out


EPS32 = float(np.finfo(np.float32).eps)


def _rounding_tolerance(offset: float, spread: float) -> float:
    """What float32 rounding of inputs at `offset` does to values normalized by `spread`: the mean
    is known to a few ulps of the offset, whatever the order of the sum (jit's or ours)."""
    return 8 * EPS32 * abs(offset) / spread


def _assert_matches_jit(fn, *args, atol):
    ours, reference = np.asarray(eqsat.optimize(fn)(*args)), np.asarray(jax.jit(fn)(*args))
    assert np.isfinite(reference).all()
    assert np.isfinite(ours).all(), f"{np.isnan(ours).sum()} NaN of {ours.size}"
    np.testing.assert_allclose(ours, reference, rtol=0, atol=atol)


def _ln_params(width, seed=0):
    rng = np.random.default_rng(seed)
    return {"n.weight": jnp.asarray(1 + 0.1 * rng.normal(size=width), jnp.float32),
            "n.bias": jnp.asarray(0.1 * rng.normal(size=width), jnp.float32)}


# --- the cases -------------------------------------------------------------------------------


def test_variance_of_rows_far_from_zero():
    """The issue's example: jnp.var of 100 + 0.01 randn (we gave [0.0029, -0.00098, ...])."""
    x = jnp.asarray(100.0 + 0.01 * np.random.RandomState(0).randn(4, 64), jnp.float32)
    ours = np.asarray(eqsat.optimize(lambda x: x.var(-1))(x))
    reference = np.asarray(jax.jit(lambda x: x.var(-1))(x))
    exact = np.var(np.asarray(x, np.float64), axis=-1)
    assert np.all(ours > 0)
    np.testing.assert_allclose(ours, reference, rtol=1e-3)
    np.testing.assert_allclose(ours, exact, rtol=1e-3)


@pytest.mark.parametrize("offset", [300.0, -5e3])
def test_layer_norm_far_from_zero(offset):
    x = jnp.asarray(offset + 0.1 * np.random.default_rng(1).normal(size=(2, 5, 48)), jnp.float32)
    params = _ln_params(48)
    atol = max(1e-4, _rounding_tolerance(offset, 0.1))
    _assert_matches_jit(lambda x: layer_norm(params, "n", x, 1e-6), x, atol=atol)


def test_layer_norm_of_constant_rows_is_its_bias():
    """Constant rows (eps 1e-6): zero variance, so the output is the bias, where E[x^2] - E[x]^2
    goes negative and rsqrt makes NaN (it did: 480 of 480). The values sum exactly in float32, so
    the mean is exact in any order and the centred values are exactly zero."""
    values = 300.25 + 0.5 * np.arange(10, dtype=np.float32)
    x = jnp.asarray(np.broadcast_to(values.reshape(2, 5, 1), (2, 5, 48)), jnp.float32)
    params = _ln_params(48)
    fn = lambda x: layer_norm(params, "n", x, 1e-6)  # noqa: E731
    _assert_matches_jit(fn, x, atol=1e-5)
    np.testing.assert_allclose(np.asarray(eqsat.optimize(fn)(x)), np.broadcast_to(params["n.bias"], x.shape),
                               atol=1e-5)


def test_layer_norm_written_with_jnp_var_far_from_zero():
    """equinox's LayerNorm (jnp.mean, jnp.var) on 50 + 0.05 randn: abs error 0.59 on scale 2.8 before."""
    x = jnp.asarray(50.0 + 0.05 * np.random.default_rng(13).normal(size=(3, 64)), jnp.float32)
    weight, bias = _ln_params(64, seed=14).values()

    def layer_norm_var(x):
        mean, var = jnp.mean(x, axis=-1, keepdims=True), jnp.var(x, axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + 1e-5) * weight + bias

    _assert_matches_jit(layer_norm_var, x, atol=max(1e-4, _rounding_tolerance(50.0, 0.05)))


def test_group_norm_written_with_lax_square_on_constant_input():
    """flax's GroupNorm(use_fast_variance=False) computes mean(square(x - mean)): 256/256 NaN before. 300.7
    does not sum exactly, so the centred values are a rounding of the mean, amplified by 1/sqrt(eps)."""
    x = jnp.full((2, 4, 4, 8), 300.7, jnp.float32)

    def group_norm_square(x):
        groups = x.reshape(2, 16, 4, 2)
        mean = jnp.mean(groups, axis=(1, 3), keepdims=True)
        var = jnp.mean(lax.square(groups - mean), axis=(1, 3), keepdims=True)
        return ((groups - mean) * lax.rsqrt(var + 1e-6)).reshape(x.shape)

    _assert_matches_jit(group_norm_square, x, atol=_rounding_tolerance(300.7, np.sqrt(1e-6)))


def test_layer_norm_then_linear_recomputes_stable_row_statistics():
    """The statistics recomputed in the matmul's K pre-pass (`RowReduce`) are moments too."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(250.0 + 0.05 * rng.normal(size=(2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)
    params = _ln_params(32)
    fn = lambda x, w: layer_norm(params, "n", x, 1e-6) @ w  # noqa: E731
    plan = eqsat.optimize(fn).lower(x, w).plan
    assert [k.op for k in plan.kernels] == ["Matmul"]
    assert any(n.op == "RowReduce" for n in _ops(plan.kernels[0].term))
    _assert_matches_jit(fn, x, w, atol=max(1e-4, _rounding_tolerance(250.0, 0.05)))


def test_every_extraction_of_fused_layer_norm_statistics_is_stable():
    """Not only the plan the cost model picks: every form the e-graph holds (a statistics kernel,
    the row statistics recomputed in the matmul, the split variance) evaluates stably."""
    from eqsat import rules
    from eqsat.interpret import evaluate

    rng = np.random.default_rng(10)
    x = jnp.asarray(-800.0 + 0.2 * rng.normal(size=(2, 4, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 8)) / 4, jnp.float32)
    params = _ln_params(16, seed=11)
    fn = lambda x, w: layer_norm(params, "n", x, 1e-6) @ w  # noqa: E731
    lowered = eqsat.optimize(fn, rulesets=["absorb", "norm_split", "row_stats"]).lower(x, w)
    graph = rules.SerializedGraph(lowered.egraph._serialize().to_json())
    program = lowered.program
    roots = [graph.handle_class[lowered.builder.handles[t]] for t in program.outputs]
    plans = rules.extractions(graph, roots, limit=48)
    forms = {n.op for plan in plans for n in _ops_all(plan)}
    assert {"RowReduce", "Reduce"} <= forms and len(plans) >= 8
    reference = np.asarray(jax.jit(fn)(x, w))
    env = program.environment(x, w)
    for plan in plans:
        (value,) = evaluate(plan, env, program.constants, program.payloads)
        np.testing.assert_allclose(np.asarray(value), reference, rtol=0,
                                   atol=max(1e-4, _rounding_tolerance(800.0, 0.2)))


def _ops_all(roots) -> list:
    seen, stack, out = set(), list(roots), []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(node.children)
    return out


def _group_norm_input(offset, seed=3):
    rng = np.random.default_rng(seed)
    return jnp.asarray(offset + 0.05 * rng.normal(size=(2, 4, 4, 12)), jnp.float32)


@pytest.mark.parametrize("offset", [50.0, 1e4])
def test_group_norm_far_from_zero(offset):
    params = _ln_params(12, seed=4)
    fn = lambda x: group_norm(params, "n", x, 4, 1e-6)  # noqa: E731  3 channels per group
    _assert_matches_jit(fn, _group_norm_input(offset), atol=max(1e-4, _rounding_tolerance(offset, 0.05)))


def test_group_norm_of_constant_groups_is_its_bias():
    """Constant groups (eps 1e-6), exactly summable values: NaN in 192 of 384 outputs before."""
    x = jnp.asarray(np.broadcast_to((7.25 + np.arange(4, dtype=np.float32) * 123.5).repeat(3), (2, 4, 4, 12)),
                    jnp.float32)
    params = _ln_params(12, seed=5)
    fn = lambda x: group_norm(params, "n", x, 4, 1e-6)  # noqa: E731
    _assert_matches_jit(fn, x, atol=1e-5)


def _resnet_half(x, w1, bias, w2, gn):
    """conv -> GroupNorm -> SiLU -> conv, the GroupNorm's input far from zero (a large conv bias)."""
    h = lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=DN) + bias
    return lax.conv_general_dilated(jax.nn.silu(group_norm(gn, "n", h, 2, 1e-6)), w2, (1, 1), "SAME",
                                    dimension_numbers=DN)


def test_statistics_in_the_producing_conv_epilogue_are_stable():
    """The GroupNorm's moments are hosted by the conv writing its input (`EpilogueReduce`)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(1, 6, 6, 3)), jnp.float32)
    w1 = jnp.asarray(0.01 * rng.normal(size=(3, 3, 3, 8)), jnp.float32)
    bias = jnp.asarray(400.0 + rng.normal(size=8), jnp.float32)
    w2 = jnp.asarray(0.3 * rng.normal(size=(3, 3, 8, 4)), jnp.float32)
    gn = _ln_params(8, seed=7)
    fn = lambda *a: _resnet_half(*a, gn)  # noqa: E731
    plan = eqsat.optimize(fn).lower(x, w1, bias, w2).plan
    assert [k.kind for k in plan.kernels] == ["conv", "conv"]
    hosted = [t for k in plan.kernels for t in k.outputs[1:]]
    assert hosted and {t.op for t in hosted} == {"EpilogueReduce"}
    assert "moments" in {t.args[1] for t in hosted}
    _assert_matches_jit(fn, x, w1, bias, w2, atol=max(1e-4, _rounding_tolerance(400.0, 0.03)))


# --- the moments reduction and its partials -----------------------------------------------------------


def _adversarial_rows():
    rng = np.random.default_rng(8)
    return [
        1e4 + rng.normal(size=(3, 40)),                         # offset 1e4 against a spread of 1
        np.full((2, 33), 0.1) + np.arange(2)[:, None] * 300.7,  # constant rows
        np.zeros((2, 7)),
        1e-15 * rng.normal(size=(2, 9)),                        # tiny (squares ~1e-30)
        1e18 * rng.normal(size=(2, 9)),                         # huge (M2 ~ 1e37, below float32's max)
        rng.normal(size=(1, 77)) * np.where(np.arange(77) % 2, 1.0, 1e3),
    ]


@pytest.mark.parametrize("index", range(6))
def test_moments_are_the_float64_mean_and_centred_squares(index):
    """Two-pass moments (the interpreter's) are off by the mean's rounding, squared: second order in
    eps * offset. Merged per-piece partials (the kernels') carry each piece's mean rounding into the
    merge: first order in eps * offset * spread, still relative to the spread, never to offset^2."""
    from eqsat.moments import merge_partials, partial_moments, two_pass

    x = np.asarray(_adversarial_rows()[index], np.float32)
    x64 = x.astype(np.float64)
    exact = np.stack([x64.mean(-1), ((x64 - x64.mean(-1, keepdims=True)) ** 2).sum(-1)])
    n, scale = x.shape[-1], np.abs(x64).max(-1)
    spread = np.abs(x64 - x64.mean(-1, keepdims=True)).max(-1)
    mean_rounding = n * (4 * EPS32 * scale) ** 2
    two = np.asarray(two_pass(x, (1,)), np.float64)
    merged = np.asarray(merge_partials(partial_moments(x, (1,), 8)), np.float64)
    for value in (two, merged):
        assert value.shape == (2, x.shape[0]) and np.all(value[1] >= 0)
        np.testing.assert_allclose(value[0], exact[0], rtol=1e-5, atol=1e-5 * np.abs(x64).mean(-1).max())
    assert np.all(np.abs(two[1] - exact[1]) <= 1e-5 * exact[1] + mean_rounding)
    assert np.all(np.abs(merged[1] - exact[1]) <= 1e-5 * exact[1] + 2 * EPS32 * n * scale * spread + mean_rounding)


def test_partials_merge_in_a_fixed_order_whatever_the_piece_size():
    from eqsat.moments import merge_partials, partial_moments, two_pass

    x = jnp.asarray(1e3 + np.random.default_rng(9).normal(size=(2, 3, 5, 7)), jnp.float32)
    reference = np.asarray(two_pass(x, (1, 3)))
    assert reference.shape == (2, 2, 5)
    for piece in (1, 4, 21, 64):
        parts = partial_moments(x, (1, 3), piece)
        assert parts.shape == (-(-21 // piece), 3, 2, 5)
        merged = np.asarray(merge_partials(parts))
        np.testing.assert_allclose(merged, reference, rtol=2e-4)
        assert np.array_equal(merged, np.asarray(merge_partials(parts)))  # deterministic


def test_moments_propagate_nan_and_inf_like_jnp_var():
    from eqsat.moments import two_pass

    x = np.array([[1.0, np.nan, 2.0], [1.0, np.inf, 2.0], [1.0, 2.0, 3.0]], np.float32)
    value = np.asarray(two_pass(x, (1,)))
    var = np.asarray(jnp.var(x, axis=1))
    np.testing.assert_array_equal(np.isnan(value[1]), np.isnan(var))
    np.testing.assert_allclose(value[1, 2] / 3, var[2])


# --- cost: partials, no memsets ----------------------------------------------------------------------


def test_hosted_statistics_cost_partials_and_no_memset():
    from eqsat.cost import H100, hosted_cost, kernel_cost, node_cost
    from eqsat.cost.roofline import PARTIAL_TILE, partials_bytes
    from eqsat.term import Term

    assert not hasattr(H100, "memset_overhead")
    x_ty, stats_ty = "f32[2,4096,32,10]", "f32[2,2,32]"
    # 64 (batch, group) outputs, each reducing 40,960 elements: 3 tiles of PARTIAL_TILE, 3 floats each
    assert partials_bytes("moments", x_ty, stats_ty) == 64 * -(-40960 // PARTIAL_TILE) * 3 * 4
    assert partials_bytes("sum", "f32[8,64]", "f32[8]") == 8 * 1 * 4
    own = node_cost("EpilogueReduce", ("f32[2,4096,320]", "moments", x_ty, "1,3", stats_ty), H100)
    assert own.seconds == pytest.approx(own.bytes / H100.hbm_bandwidth + own.flops / H100.peak_fp32)
    assert own.seconds < H100.launch_overhead / 10

    producer = Term("Input", "h", x_ty)
    conv = Term("Pointwise", Term("Load", producer, x_ty), x_ty)
    stats = Term("EpilogueReduce", conv, "moments", Term("Load", conv, x_ty), "1,3", stats_ty)
    # what the hosts write: every host tile (one per PARTIAL_TILE elements here) a row of all 64 slots
    from eqsat.cost.merges import partials_bytes as buffer_bytes, statistic_tiles

    assert statistic_tiles(stats) == 2 * 4096 * 320 // PARTIAL_TILE
    assert hosted_cost(stats, H100).bytes == buffer_bytes(stats) == statistic_tiles(stats) * 3 * 64 * 4
    reader = Term("Pointwise", Term("Reshape", Term("Slice", Term("Load", stats, stats_ty), 0, 0, 1, 1, "f32[1,2,32]"),
                                    "f32[2,32]"), "f32[2,32]")
    # the reader reads the whole partials buffer (and merges it), even for one row of the statistic
    assert kernel_cost(reader, H100).bytes == buffer_bytes(stats) + 2 * 32 * 4
    # ... unless the plan finishes it once: then the reader reads the finished statistic
    assert kernel_cost(reader, H100, frozenset({stats})).bytes == 2 * 2 * 32 * 4 + 2 * 32 * 4


# --- the soundness checker draws adversarial values ---------------------------------------------------


def test_the_checker_draws_every_value_regime():
    from eqsat.rules.checker import VALUE_REGIMES, values

    rng = np.random.default_rng(12)
    shape = (6, 40)
    for _ in range(20):
        x = values(shape, "float32", "offset", rng).astype(np.float64)
        assert np.all(np.abs(x.mean(-1)) >= 5 * x.std(-1)) and x.std() > 0
    ratios = [abs(v.mean()) / v.std() for v in (values((4000,), "float32", "offset", rng) for _ in range(40))]
    assert max(ratios) > 1e3  # means up to 1e4 spreads
    rows = values(shape, "float32", "constant_rows", rng)
    assert np.all(rows == rows[:, :1]) and len(set(rows[:, 0])) == 6 and np.abs(rows).max() > 1.0
    assert not values(shape, "float32", "zeros", rng).any()
    assert np.abs(values(shape, "float32", "tiny", rng)).max() < 1e-14
    assert np.abs(values(shape, "float32", "huge", rng)).max() > 1e14
    nonfinite = values(shape, "float32", "nonfinite", rng)
    assert np.isnan(nonfinite).any() and np.isinf(nonfinite).any() and np.isfinite(nonfinite).mean() > 0.8
    for regime in VALUE_REGIMES:  # float16 stays finite where it should (squares too)
        half = values(shape, "float16", regime, rng)
        assert half.dtype == np.float16
        if regime != "nonfinite":
            assert np.isfinite(half.astype(np.float32) ** 2).all()


def test_the_checker_compares_nan_and_infinities_exactly():
    from eqsat.rules.checker import _close

    e = np.array([1.0, np.nan, np.inf, -np.inf, 0.0], np.float32)
    assert _close(e.copy(), e) is None
    assert "NaN" in _close(np.array([1.0, 2.0, np.inf, -np.inf, 0.0], np.float32), e)
    assert "NaN" in _close(np.array([np.nan, np.nan, np.inf, -np.inf, 0.0], np.float32), e)
    assert "infinities" in _close(np.array([1.0, np.nan, -np.inf, -np.inf, 0.0], np.float32), e)
    tiny = np.array([1e-20, 2e-20], np.float32)
    assert _close(tiny * 1.5, tiny) is not None  # relative to the output's own magnitude


def _count(tx: str, axes: str) -> str:
    import math

    from eqsat.types import ints, parse_type

    return str(math.prod(parse_type(tx).shape[a] for a in ints(axes)))


def _cancelling_ruleset():
    """The variance law norm_split shipped before: E[x^2] - E[x]^2 (wrong on purpose)."""
    from egglog import String, f64, rule, ruleset, union

    from eqsat.lang import Acc, Binary, Expr, Lit, Load, Reduce, Tensor
    from eqsat.rules import py_int
    from eqsat.rules.norm_split import Centered, SquareOf

    cancelling = ruleset(name="cancelling_variance_for_test")

    @cancelling.register
    def _e_x2_minus_mean2(v: Tensor, s: Tensor, body: Expr, d: Expr, x: Expr, axes: String, tx: String,
                          ts: String):
        """sum((x - sum(x)/n)^2) = sum(x*x) - sum(x)^2/n: cancels when |mean| >> spread."""
        n = Lit(f64.from_i64(py_int(_count, tx, axes)), ts)
        squares = Reduce("sum", Binary("mul", x, x, tx), axes, Acc(ts), ts)
        yield rule(v == Reduce("sum", body, axes, Acc(ts), ts), SquareOf(body, d, tx), Centered(d, x, s, tx),
                   s == Reduce("sum", x, axes, Acc(ts), ts)).then(
            union(Load(v, ts)).with_(Binary("sub", Load(squares, ts),
                                            Binary("div", Binary("mul", Load(s, ts), Load(s, ts), ts), n, ts), ts)))

    return cancelling


def test_the_checker_catches_the_cancelling_variance_law():
    """The old law passed the checker on centred values in [-2, 2]; adversarial values catch it."""
    from eqsat import rules
    from eqsat.rules import Example, dim, tensor

    def layer_norm_rows(x):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + 1e-5)

    def args(draw):
        return (tensor(draw, (dim(draw, 1, 3), dim(draw, 4, 8))),)

    case = Example(layer_norm_rows, args, ("e_x2_minus_mean2",), support=("norm_split",))
    with pytest.raises(rules.RuleCheckError) as caught:
        rules.check(_cancelling_ruleset(), examples=2, cases=[case])
    assert caught.value.rule == "e_x2_minus_mean2"
    assert "(drawn values)" not in str(caught.value).split("\n")[0]  # found on adversarial values
    # the stable law of the shipped family passes the same case
    shipped = Example(layer_norm_rows, args, ("variance",))
    assert rules.check("norm_split", examples=2, cases=[shipped]).extractions > 0


def test_the_checker_catches_a_rule_that_loses_nan():
    """x * 0 = 0 holds in real arithmetic, not for inf and NaN."""
    from egglog import String, rewrite, ruleset

    from eqsat import rules
    from eqsat.lang import Binary, Expr, Lit, Load, Pointwise
    from eqsat.rules import Example, dim, tensor

    times_zero = ruleset(name="times_zero_for_test")

    @times_zero.register
    def _drop_product(e: Expr, ty: String):
        """Load(Pointwise(x * 0)) = 0: loses NaN and infinities (wrong on purpose)."""
        yield rewrite(Load(Pointwise(Binary("mul", e, Lit(0.0, ty), ty), ty), ty)).to(Lit(0.0, ty))

    case = Example(lambda x: (x * 0.0) + 1.0, lambda draw: (tensor(draw, (dim(draw, 2, 5),)),), ("drop_product",))
    with pytest.raises(rules.RuleCheckError, match="nonfinite values"):
        rules.check(times_zero, examples=2, cases=[case])


def test_the_checker_holds_a_rule_to_its_stated_contract():
    """A law off by a bounded amount passes only under a contract (`Example.tolerance`) that allows it."""
    from egglog import String, rewrite, ruleset

    from eqsat import rules
    from eqsat.lang import Binary, Expr, Lit, Load, Pointwise
    from eqsat.rules import Example, dim, tensor

    nudge = ruleset(name="nudge_for_test")

    @nudge.register
    def _nudge(e: Expr, ty: String):
        """Load(Pointwise(x + 1)) = x + 1.001: off by 1e-3 on purpose."""
        yield rewrite(Load(Pointwise(Binary("add", e, Lit(1.0, ty), ty), ty), ty)).to(
            Binary("add", e, Lit(1.001, ty), ty))

    def args(draw):
        return (tensor(draw, (dim(draw, 2, 5),)),)

    def fn(x):
        return (x + 1.0) * 2.0

    plain = Example(fn, args, ("nudge",), regimes=("zeros",))
    with pytest.raises(rules.RuleCheckError, match="nudge"):
        rules.check(nudge, examples=1, cases=[plain])
    contract = Example(fn, args, ("nudge",), regimes=("zeros",), tolerance=lambda leaves: 4e-3)
    assert rules.check(nudge, examples=1, cases=[contract]).extractions > 0
