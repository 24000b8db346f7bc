"""The matmul Pallas template (`emit/pallas/matmul.py`), in interpret mode: the template against its
plain-jnp reference, and plans of small JAX functions emitted with `backend="pallas"` against the
XLA emitter (the same plan in jax.numpy) and `jax.jit` of the function. Shapes are small and odd
(77 tokens, 40 and 50 wide) so every tail of M, N and K is masked."""

from __future__ import annotations

import glob
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import emit
import eqsat
from emit.pallas import XlaFallbackWarning
from emit.pallas import matmul as mm
from emit.pallas.triton import gather_load
from eqsat.term import postorder
from sd15.params import transformer_block_shapes

TOLERANCE = {np.float32: 2e-5, np.float16: 2e-2, jnp.bfloat16: 6e-2}  # relative to |lhs| @ |rhs|


def assert_close(actual, expected, bound, dtype, inf_signs_determined: bool = True):
    """|actual - expected| <= tol * bound elementwise (bound: the dot's |a| @ |b| plus |expected|);
    NaN exactly where expected is NaN, ±inf where it is ±inf. `inf_signs_determined=False`: an inf
    operand times a value whose sign rounding decides (a LayerNorm of rows whose offset is 1e7 times
    their spread normalizes some elements to ±eps·1e7 either way) may be inf of either sign."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite = np.isfinite(expected)
    infinite = ~finite & ~np.isnan(expected)
    if inf_signs_determined:
        np.testing.assert_array_equal(actual[infinite], expected[infinite])
    else:
        np.testing.assert_array_equal(np.isinf(actual[infinite]), True)
    with np.errstate(invalid="ignore"):
        error = np.abs(actual - expected)[finite]
    allowed = (TOLERANCE[dtype] * (np.asarray(bound, np.float64) + np.abs(expected)) + 1e-30)[finite]
    worst = np.argmax(error - allowed) if error.size else 0
    assert error.size == 0 or np.all(error <= allowed), f"error {error[worst]:.3g} > allowed {allowed[worst]:.3g}"


# --- the template on hand-written closures --------------------------------------------------------


def lhs_prologue(x):
    return jnp.log(x * x).astype(x.dtype)  # -inf where a padded lane reads 0


def rhs_prologue(w):
    return (1 / w).astype(w.dtype)  # inf where a padded lane reads 0


def run_template(a, w, bias, blocks):
    """`log(a²) @ (1 / w) * 2 + bias` through the template: both prologues are infinite at padded
    K, so an unmasked tail turns the result into NaN."""
    batch, m, k = a.shape
    n = w.shape[1]

    def lhs(refs, index, mask, stats):
        b, rows, ks = index
        return lhs_prologue(gather_load(refs[0], (b * m + rows) * k + ks, mask))

    def rhs(refs, index, mask):
        b, ks, cols = index
        return rhs_prologue(gather_load(refs[1], ks * n + cols, mask))

    def epilogue(refs, acc, index, mask):
        b, rows, cols = index
        return acc * 2 + gather_load(refs[2], cols, mask).astype(jnp.float32)

    problem = mm.MatmulProblem(batch, m, n, k, lhs, rhs, epilogue, a.dtype)
    return mm.build(problem, [a, w, bias], blocks=blocks, interpret=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape,blocks", [
    ((2, 77, 40, 50), mm.MatmulBlocks(32, 16, 16)),   # tails on M, N and K; several K steps
    ((1, 5, 3, 7), None),                             # everything smaller than one 16-tile
    ((1, 64, 32, 32), mm.MatmulBlocks(32, 32, 16)),   # exact tiles
])
def test_template_matches_reference(dtype, shape, blocks):
    batch, m, n, k = shape
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 2.0, (batch, m, k)).astype(dtype)
    w = (rng.choice([-1, 1], (k, n)) * rng.uniform(0.5, 2.0, (k, n))).astype(dtype)
    bias = rng.standard_normal((n,)).astype(dtype)
    out = run_template(a, w, bias, blocks)
    a_tile, w_tile = lhs_prologue(jnp.asarray(a)), jnp.broadcast_to(rhs_prologue(jnp.asarray(w)), (batch, k, n))
    expected = mm.reference(a_tile, w_tile, lambda acc: acc * 2 + bias.astype(np.float32))
    bound = 2 * np.abs(np.asarray(a_tile, np.float32)) @ np.abs(np.asarray(w_tile, np.float32))
    assert out.shape == (batch, m, n) and out.dtype == a.dtype
    assert_close(out, expected, bound, dtype)


def test_blocks_are_validated():
    with pytest.raises(ValueError, match="block_k=24 must be a power of two >= 16"):
        mm.MatmulBlocks(32, 32, 24).validate()
    with pytest.raises(ValueError, match="block_m=8"):
        mm.MatmulBlocks(8, 32, 32).validate()
    assert mm.MatmulBlocks.get_default(77, 40, 50) == mm.MatmulBlocks(64, 64, 32)
    assert mm.MatmulBlocks.get_default(4096, 1280, 320).block_m == 128


# --- plans of JAX functions -----------------------------------------------------------------------


def emitted(fn, args):
    """(pallas output, xla-emitter output, jax.jit output, plan) of `fn` on `args`; no kernel may
    fall back to the XLA emitter."""
    plan = eqsat.optimize(fn).lower(*args).plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = emit.emit(plan, "pallas", interpret=True)(*args)
    return pallas, emit.emit(plan, "xla")(*args), jax.jit(fn)(*args), plan


def pallas_calls(jaxpr) -> list:
    """Every `pallas_call` equation of `jaxpr` and the jaxprs nested in it (identical kernels are
    traced once inside a `jit` and called from every site: `emit.pallas.emit_shared`)."""
    calls, stack = [], [jaxpr]
    while stack:
        current = stack.pop()
        for eqn in current.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append(eqn)
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if hasattr(sub, "eqns"):
                        stack.append(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        stack.append(sub.jaxpr)
    return calls


def ops(plan) -> list[str]:
    return [k.term.op for k in plan.kernels]


def nodes(term) -> list:
    return list(postorder([term]))


def repr_ops(term) -> set[str]:
    return {node.op for node in postorder([term])}


def dense_gelu_residual(x, w, b, r):
    return jax.nn.gelu(x @ w + b, approximate=False) + r


def layernorm_linear(x, g, b, w):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b) @ w


def geglu_ff(x, w, b, w2):
    value, gate = jnp.split(x @ w + b, 2, axis=-1)
    return (value * jax.nn.gelu(gate, approximate=False)) @ w2


def torch_linear_batched(x, w, y):
    """A torch-layout weight ([out, in], contracted on axis 1) and a batched product."""
    return jnp.einsum("bsk,nk->bsn", x, w), jnp.einsum("bij,bjk->bik", x, y)


def normal(rng, shape, dtype, offset=0.0, scale=1.0):
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dense_gelu_residual(dtype):
    rng = np.random.default_rng(1)
    x, w = normal(rng, (77, 40), dtype), normal(rng, (40, 96), dtype, scale=0.3)
    b, r = normal(rng, (96,), dtype), normal(rng, (77, 96), dtype)
    pallas, xla, jit, plan = emitted(dense_gelu_residual, (x, w, b, r))
    assert ops(plan) == ["Matmul"]
    bound = np.abs(x.astype(np.float32)) @ np.abs(w.astype(np.float32)) + np.abs(b) + np.abs(r)
    assert_close(pallas, xla, bound, dtype)
    assert_close(pallas, jit, bound, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_layernorm_prologue_with_row_statistics(dtype):
    rng = np.random.default_rng(2)
    x = normal(rng, (2, 77, 40), dtype)
    g, b, w = normal(rng, (40,), dtype, 1.0, 0.2), normal(rng, (40,), dtype, 0, 0.1), normal(rng, (40, 50), dtype, 0, 0.3)
    pallas, xla, jit, plan = emitted(layernorm_linear, (x, g, b, w))
    assert ops(plan) == ["Matmul"] and "RowReduce" in repr_ops(plan.kernels[0].term)
    bound = 6 * np.ones_like(np.asarray(x, np.float32)) @ np.abs(w.astype(np.float32))
    assert_close(pallas, xla, bound, dtype)
    assert_close(pallas, jit, bound, dtype)


def test_layernorm_prologue_hoists_statistics_out_of_the_k_loop():
    """K = 640 in 32-wide steps, sd15's two-pass LayerNorm (the variance's body reads the mean):
    each statistic is one loop over K before the K loop, none nested in another loop."""
    from sd15.layers import layer_norm

    def layernorm_then_linear(x, g, b, w):
        return layer_norm({"n.weight": g, "n.bias": b}, "n", x, 1e-5) @ w

    rng = np.random.default_rng(3)
    args = (normal(rng, (1, 20, 640), np.float32, 100.0), normal(rng, (640,), np.float32),
            normal(rng, (640,), np.float32), normal(rng, (640, 16), np.float32, 0, 0.05))
    plan = eqsat.optimize(layernorm_then_linear).lower(*args).plan
    assert ops(plan) == ["Matmul"]
    run = emit.emit(plan, "pallas", interpret=True)
    closed = jax.make_jaxpr(run._run_leaves)([jnp.asarray(a) for a in args])
    (call,) = pallas_calls(closed.jaxpr)

    def loops(jaxpr):
        return [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]

    def body(loop):
        return loop.params["jaxpr"].jaxpr if loop.primitive.name == "scan" else loop.params["body_jaxpr"].jaxpr

    top = loops(call.params["jaxpr"])
    assert len(top) == 3, "the mean, the variance, the K loop"
    assert not any(loops(body(loop)) for loop in top), "a statistic recomputed inside another loop"
    np.testing.assert_allclose(np.asarray(run(*args)), np.asarray(jax.jit(layernorm_then_linear)(*args)),
                               rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_geglu_gate_in_the_prologue(dtype):
    """The second matmul's A tile is `value * gelu(gate)`, two column ranges of the first one's
    output, with the polynomial erf."""
    rng = np.random.default_rng(4)
    x, w, b = normal(rng, (77, 40), dtype), normal(rng, (40, 192), dtype, 0, 0.3), normal(rng, (192,), dtype)
    w2 = normal(rng, (96, 40), dtype, 0, 0.2)
    pallas, xla, jit, plan = emitted(geglu_ff, (x, w, b, w2))
    assert ops(plan) == ["Matmul", "Matmul"]
    assert {"erf", "erfc"} & {n.args[0] for n in nodes(plan.kernels[1].term) if n.op == "Unary"}
    value, gate = np.split(x.astype(np.float64) @ w + b, 2, axis=-1)
    hidden = np.abs(value) * np.abs(gate) + np.abs(value)  # >= |value * gelu(gate)|
    bound = hidden @ np.abs(w2.astype(np.float64))
    assert_close(pallas, xla, bound, dtype)
    assert_close(pallas, jit, bound, dtype)


def test_torch_layout_weight_and_batched_product():
    rng = np.random.default_rng(5)
    x, w, y = normal(rng, (2, 77, 40), np.float32), normal(rng, (50, 40), np.float32), normal(rng, (2, 40, 3), np.float32)
    pallas, xla, jit, plan = emitted(torch_linear_batched, (x, w, y))
    assert ops(plan) == ["Matmul", "Matmul"]
    for p, e, bound in zip(pallas, jit, (np.abs(x) @ np.abs(w).T, np.abs(x) @ np.abs(y))):
        assert_close(p, e, bound, np.float32)


# --- statistics of the output, computed in the epilogue (EpilogueReduce) ------------------------------


@pytest.mark.parametrize("op,offset,spread", [("moments", 1e4, 1e-2), ("moments", -300.0, 1.0), ("moments", 5.0, 0.0),
                                               ("moments", 141.8948, 0.0), ("moments", 0.0, 1e-20), ("moments", 0.0, 1e18),
                                               ("sum", 1e4, 1e-2)])
def test_row_statistics_of_the_output_are_stable(op, offset, spread):
    """`out = x @ I + offset` (exact in fp32), moments of each output row from three N tiles'
    partials merged with Chan's formula, against the two-pass reference: offsets large against the
    spread, constant rows (their mean exactly the offset, 141.8948 too, whose sum / n rounds), tiny
    and huge values."""
    from eqsat.moments import two_pass
    from emit.pallas.conv import merge_partials

    batch, m, n = 2, 20, 40
    rng = np.random.default_rng(8)
    x = (spread * rng.standard_normal((batch, m, n))).astype(np.float32)
    x[0, 3] = 0.0  # a constant row (after the offset)
    eye = np.eye(n, dtype=np.float32)

    def lhs(refs, index, mask, stats):
        b, rows, ks = index
        return gather_load(refs[0], (b * m + rows) * n + ks, mask)

    def rhs(refs, index, mask):
        b, ks, cols = index
        return gather_load(refs[1], ks * n + cols, mask)

    statistic = mm.RowStatistic(op, lambda refs, out, index, mask: (out.astype(jnp.float32), True),
                                lambda b, rows: b * m + rows, batch * m)
    problem = mm.MatmulProblem(batch, m, n, n, lhs, rhs, lambda refs, acc, index, mask: acc + offset,
                               np.float32, statistics=(statistic,))
    out, (partials,) = mm.build(problem, [x, eye], blocks=mm.MatmulBlocks(16, 16, 16), interpret=True)
    assert partials.shape == (3, statistic.fields, batch * m)
    merged = np.asarray(merge_partials(partials, op))
    stored = np.asarray(out, np.float64).reshape(batch * m, n)
    np.testing.assert_array_equal(stored, (x + np.float32(offset)).astype(np.float64).reshape(batch * m, n))
    expected = np.asarray(two_pass(stored.astype(np.float32), (1,)), np.float64)
    if op == "sum":
        np.testing.assert_allclose(merged, stored.sum(1), rtol=1e-6, atol=1e-6 * np.abs(stored).sum(1).max() + 1e-45)
    else:
        np.testing.assert_allclose(merged[0], stored.mean(1), rtol=1e-6, atol=1e-6 * np.abs(stored).max() + 1e-45)
        assert merged[0][3] == np.float32(offset)  # the constant row's mean: exactly its value
        exact_m2 = ((stored - stored.mean(1, keepdims=True)) ** 2).sum(1)
        scale = np.abs(stored).max() * np.abs(stored - stored.mean(1, keepdims=True)).max() * n
        flushed = n * np.finfo(np.float32).tiny  # squares below float32's normal range flush to zero
        np.testing.assert_allclose(merged[1], exact_m2, rtol=1e-5, atol=1e-6 * scale + flushed)
        assert merged[1][3] == 0.0  # the constant row: exactly no spread
        # (the reference's mean, sum / n, may be an ulp off a constant row: M2 n ulps squared)
        assert expected[1][3] <= n * (np.spacing(np.float32(offset)) * 2) ** 2
        assert np.all(merged[1] >= 0)


def layernorm_of_dense(x, w, b, g, beta):
    y = x @ w + b
    mean = y.mean(-1, keepdims=True)
    var = jnp.square(y - mean).mean(-1, keepdims=True)
    return (y - mean) * jax.lax.rsqrt(var + 1e-5) * g + beta, y


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_layernorm_statistics_hosted_by_the_matmul(dtype):
    """The plan computes the LayerNorm's statistics in the matmul's epilogue: emitted as partials of
    that kernel (no extra Pallas kernel), on outputs offset far from zero."""
    rng = np.random.default_rng(9)
    x, w = normal(rng, (2, 77, 40), dtype), normal(rng, (40, 96), dtype, 0, 0.3)
    b, g, beta = normal(rng, (96,), dtype, 300.0), normal(rng, (96,), dtype, 1.0, 0.2), normal(rng, (96,), dtype)
    args = (x, w, b, g, beta)
    pallas, xla, jit, plan = emitted(layernorm_of_dense, args)
    matmul = plan.kernels[0]
    assert matmul.term.op == "Matmul" and [h.op for h in matmul.outputs[1:]] == ["EpilogueReduce"]
    run = emit.emit(plan, "pallas", interpret=True)
    closed = jax.make_jaxpr(run._run_leaves)([jnp.asarray(a) for a in args])
    launched = [e.params["name"] for e in pallas_calls(closed.jaxpr)]
    assert len(launched) == len(plan.kernels), launched
    tolerance = {np.float32: 5e-5, np.float16: 2e-2}[dtype]
    for p, x_, j in zip(pallas, xla, jit):
        np.testing.assert_allclose(np.asarray(p, np.float32), np.asarray(x_, np.float32), rtol=tolerance, atol=tolerance)
        np.testing.assert_allclose(np.asarray(p, np.float32), np.asarray(j, np.float32), rtol=tolerance,
                                   atol=tolerance * 4)


# --- adversarial values (hypothesis) ---------------------------------------------------------------


def adversarial(draw, shape):
    """float32 values and their condition (|offset| / spread): an offset large against the spread,
    tiny or huge scales, constant rows, zeros, and now and then a NaN or an inf."""
    offset = draw(st.sampled_from([0.0, 1.0, -300.0, 1e4]))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e-20, 1e12, 0.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = offset + scale * rng.standard_normal(shape)
    if draw(st.booleans()):
        x[..., rng.integers(0, shape[-2]), :] = offset  # a constant row
    special = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
    if special is not None:
        x.reshape(-1)[rng.integers(0, x.size)] = special
    x = x.astype(np.float32)
    spread = np.abs(x.astype(np.float64) - np.float32(offset)).max(initial=0.0, where=np.isfinite(x))
    return x, (abs(offset) / spread if spread > 0 else 0.0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_adversarial_values_match_the_xla_emitter(data):
    """Same plan, same formula: the template differs from XLA only in summation order, so the
    difference is bounded by the rounding of the dot (and, after a LayerNorm, of the mean: an error
    eps * |offset| in the mean is eps * |offset| / spread in the normalized row)."""
    x, condition = adversarial(data.draw, (2, 77, 40))
    w, _ = adversarial(data.draw, (40, 50))
    g, b = np.full((40,), 1.5, np.float32), np.full((40,), -0.25, np.float32)
    plan = _plan(layernorm_linear, (x, g, b, w))
    pallas, xla = _pallas(plan)(x, g, b, w), emit.emit(plan, "xla")(x, g, b, w)
    with np.errstate(all="ignore"):
        normalized = 1.5 * np.sqrt(40) + 0.25  # |LayerNorm(x) * g + b| <= sqrt(n) |g| + |b|
        bound = (1 + condition) * normalized * np.ones(x.shape) @ np.abs(w.astype(np.float64))
    assert_close(pallas, xla, bound, np.float32, inf_signs_determined=condition * np.finfo(np.float32).eps < 1e-3)

    r, _ = adversarial(data.draw, (2, 77, 50))
    bias = np.zeros((50,), np.float32)
    plan = _plan(dense_gelu_residual, (x, w, bias, r))
    pallas, xla = _pallas(plan)(x, w, bias, r), emit.emit(plan, "xla")(x, w, bias, r)
    with np.errstate(all="ignore"):
        bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)) + np.abs(r)
    assert_close(pallas, xla, bound, np.float32)


_PLANS: dict = {}


def _plan(fn, args):
    key = (fn, tuple((a.shape, a.dtype) for a in args))
    if key not in _PLANS:
        _PLANS[key] = eqsat.optimize(fn).lower(*args).plan
    return _PLANS[key]


_RUNS: dict = {}


def _pallas(plan):
    if id(plan) not in _RUNS:
        _RUNS[id(plan)] = emit.emit(plan, "pallas", interpret=True)
    return _RUNS[id(plan)]


# --- an SD 1.5 transformer block ---------------------------------------------------------------------


def transformer_block_args(width, context_width, heads, tokens, context_tokens, dtype, abstract):
    shapes = dict(transformer_block_shapes("b", width, context_width))
    shapes["x"], shapes["context"] = (2, tokens, width), (2, context_tokens, context_width)
    if abstract:
        values = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
    else:
        rng = np.random.default_rng(7)
        values = {k: normal(rng, s, dtype, 1.0 if k.endswith("weight") and "norm" in k else 0.0,
                            1.0 if k in ("x", "context") else 0.15) for k, s in shapes.items()}
    x, context = values.pop("x"), values.pop("context")
    return values, x, context


def transformer_block(params, x, context, heads):
    from sd15.unet import transformer_block as block

    return block(params, "b", x, context, heads)


def test_sd15_transformer_block_runs_as_pallas_kernels():
    """LayerNorm prologues, fused QKV and K/V, both attentions, GEGLU and residual epilogues: the
    whole block through the Pallas templates equals sd15's function."""
    args = transformer_block_args(64, 48, 2, 77, 10, np.float32, abstract=False)
    pallas, xla, jit, plan = emitted(lambda p, x, c: transformer_block(p, x, c, 2), args)
    assert set(ops(plan)) == {"Matmul", "Attention"}
    wide = [k.term for k in plan.kernels if k.term.op == "Matmul" and "Concat" in repr_ops(k.term.args[1])]
    assert len(wide) == 2, "Q/K/V of attn1 and K/V of attn2 are not each one wide matmul"
    assert any("RowReduce" in repr_ops(k.term.args[0]) for k in plan.kernels), "no LayerNorm prologue"
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(jit), rtol=2e-4, atol=2e-4)


def test_sd15_width_transformer_block_compiles_to_pallas_kernels_only(tmp_path):
    """SD 1.5's down_blocks.1 width (640 channels, 8 heads of 80, 1,024 tokens, 77x768 context, fp16)
    compiled for an H100: the thunk sequence launches exactly the plan's kernels, all Pallas, and
    every kernel but a stored matmul operand (pointwise) multiplies on tensor cores (wgmma/mma in
    its PTX)."""
    from measure.xla_target import compile_for_h100

    args = transformer_block_args(640, 768, 8, 1024, 77, jnp.float16, abstract=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the extraction time limit
        plan = eqsat.optimize(lambda p, x, c: transformer_block(p, x, c, 8)).lower(*args).plan
    report = compile_for_h100(emit.emit(plan, "pallas", interpret=False), *args, keep_dump=tmp_path / "dump")
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    assert report.kernels == len(plan.kernels), (report.summary(), len(plan.kernels))
    assert set(report.by_category) == {"Pallas (Triton)"}, report.by_category
    assert report.copies == 0 and report.memsets <= 1
    ptx = "".join(open(path).read() for path in glob.glob(str(tmp_path / "dump" / "*.ptx")))
    entries = re.split(r"\.visible \.entry ", ptx)[1:]  # kernels with one name and body compile once
    names = {re.sub(r"__\d+$", "", entry.split("(")[0]) for entry in entries}  # XLA suffixes same-named bodies
    assert names == {_entry_name(name) for name in emit.kernel_names(plan)}
    for entry in entries:
        if entry.split("(")[0].endswith("_pointwise"):
            continue  # a matmul operand the plan stores (norm3: cheaper than recomputing it per N tile)
        assert re.search(r"\b(wgmma\.mma_async|mma\.sync)\.\S*f16", entry), f"no tensor cores in {entry[:60]}"


def _entry_name(name: str) -> str:
    """The PTX entry of a `pallas_call` named `name` (Triton keeps [A-Za-z0-9_])."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def test_integer_matmul_runs_through_xla_with_a_warning():
    """An int32 dot is not what an fp32-accumulating template computes: the dispatcher falls back."""
    x, w = np.arange(77 * 40, dtype=np.int32).reshape(77, 40) % 7, np.arange(40 * 9, dtype=np.int32).reshape(40, 9) % 5
    plan = eqsat.optimize(lambda x, w: x @ w).lower(x, w).plan
    with pytest.warns(XlaFallbackWarning, match="int32 operand"):
        out = emit.emit(plan, "pallas", interpret=True)(x, w)
    np.testing.assert_array_equal(np.asarray(out), x @ w)
