"""The crash and wrong-answer classes found on real model code (issue 15), each a minimal program run
on every backend against `jax.jit`:

- a statistic hosted by a kernel whose output the body reads twice (`concat([v @ w, v @ w]).sum()`,
  `tile`): each host element must feed one slot, else the statistic runs as its own reduction;
- a hosted statistic of one tile read as the finished statistic (its partials' shape);
- a statistic hosted before a `cond`/`switch`/`scan` and read inside its body;
- a matmul prologue that reads an earlier matmul whose own prologue reads a hosted statistic
  (the prologue's statistics substituted inside the earlier kernel's term);
- row statistics of a batched vector-matrix product (`einsum("bs,bsh->bh", softmax(s), v)`);
- a LayerNorm of a LayerNorm read by a matmul (the inner statistic at a moments row's kept index;
  rows of size 1 given no rows-shaped mask);
- bool reductions (`argmax(x > 0)`, `max(x > 0)`), zero-size operands and reductions over an
  empty slice;
- extraction's polish retiring a tensor read by a kernel it had not counted;
- a conv whose prologue merges a hosted statistic's partials (the hoist mistook the merge's memo
  entries for expression nodes).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from emit.pallas import TemplateError

BACKENDS = ("xla", "pallas", "interpret")


def ln(v):
    return (v - v.mean(-1, keepdims=True)) * lax.rsqrt(v.var(-1, keepdims=True) + 1e-5)


def _normal(seed, shape, offset=0.0):
    return offset + jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _residual_mlp(x, ws, bs):
    for w, b in zip(ws, bs):
        x = x + jax.nn.gelu(ln(x @ w + b))
    return x


def _cross_entropy(params, x, y):
    hidden = jnp.tanh(x @ params[0])
    return -(jax.nn.log_softmax(hidden @ params[1]) * y).sum(-1).mean()


def _logsumexp_loss(params, x, y):
    logits = jnp.tanh(x @ params[0]) @ params[1]
    return -((logits - jax.nn.logsumexp(logits, -1, keepdims=True)) * y).sum(-1).mean()


def _scan_norm(x, w):
    return lax.scan(lambda c, _: (ln(c @ w), c.sum()), x, None, length=3)


_P = [_normal(0, (8, 16)), _normal(1, (16, 4))]
_X, _Y = _normal(2, (5, 8)), jax.nn.one_hot(jnp.arange(5) % 4, 4)

CASES = {
    "concat_of_one_matmul_twice": (lambda v, w: jnp.concatenate([v @ w, v @ w]).sum(), (_normal(0, (3,)), _normal(1, (3, 8)))),
    "tile_of_a_matmul": (lambda v, w: jnp.tile(v @ w, 2).sum(), (_normal(0, (3,)), _normal(1, (3, 8)))),
    "concat_along_columns": (lambda a, w: jnp.concatenate([a @ w, a @ w], 1).sum(1), (_normal(2, (2, 3)), _normal(1, (3, 8)))),
    "row_sums_of_one_tile": (lambda a, w: (a @ w).sum(1), (_normal(2, (2, 3)), _normal(1, (3, 8)))),
    "concat_with_a_slice": (lambda a, w: jnp.concatenate([a @ w, (a @ w)[:, :3]], 1).sum(1),
                            (_normal(2, (2, 3)), _normal(1, (3, 8)))),
    "cond_reading_a_norm": (lambda i, x, w: lax.cond(i > 0, lambda u: u, jnp.sin, ln(x @ w)),
                            (jnp.int32(1), _normal(3, (3, 4)), _normal(4, (4, 5)))),
    "switch_reading_a_norm": (lambda i, x, w: lax.switch(i, [lambda u: u, jnp.sin, jnp.cos], ln(x @ w)),
                              (jnp.int32(2), _normal(3, (3, 4)), _normal(4, (4, 5)))),
    "scan_body_norm": (_scan_norm, (_normal(5, (3, 5), 300.0), _normal(6, (5, 5)))),
    "residual_mlp_3_layers": (_residual_mlp, (_normal(0, (4, 16)), [_normal(i, (16, 16)) for i in range(3)],
                                              [_normal(i + 3, (16,)) for i in range(3)])),
    "softmax_einsum": (lambda s, v: jnp.einsum("bs,bsh->bh", jax.nn.softmax(s, -1), v),
                       (_normal(0, (2, 16)), _normal(1, (2, 16, 8)))),
    "masked_softmax_einsum": (lambda s, v: jnp.einsum("bs,bsh->bh", jax.nn.softmax(jnp.where(s > 0, s, -1e9), -1), v),
                              (_normal(0, (2, 16)), _normal(1, (2, 16, 8)))),
    "norm_of_a_vector_into_matmul": (lambda x, w: ln(x) @ w, (_normal(0, (16,), 50.0), _normal(1, (16, 8)))),
    "concat_norm_vector_matmul": (lambda x, w: jnp.concatenate([ln(x), x]) @ w, (_normal(0, (16,)), _normal(1, (32, 8)))),
    "grad_of_cross_entropy": (jax.grad(_cross_entropy), (_P, _X, _Y)),
    "grad_of_logsumexp_loss": (jax.grad(_logsumexp_loss), (_P, _X, _Y)),
    "argmax_of_bools": (lambda x: jnp.argmax(x > 0, -1), (_normal(0, (4, 6)),)),
    "argmin_of_bools": (lambda x: jnp.argmin(x > 0, -1), (_normal(0, (4, 6)),)),
    "max_of_bools": (lambda x: jnp.max(x > 0, -1), (_normal(0, (4, 6)),)),
    "count_of_bools": (lambda x: jnp.sum(x > 0, -1) + jnp.any(x > 1, 0).sum() + jnp.all(x > -3), (_normal(0, (4, 6)),)),
    "norm_of_a_norm_into_matmul": (lambda x, w: ln(ln(x)) @ w, (_normal(7, (2, 3), 50.0), _normal(8, (3, 3)))),
    "norm_of_a_norm_size_1_rows": (lambda x, w: ln(ln(x)) @ w, (_normal(7, (1, 1, 1, 3)), _normal(8, (3, 3)))),
    "norm_of_a_matmul_into_a_conv": (lambda x, w, k: lax.conv_general_dilated(
        ln(x @ w)[None, :, None, :], k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
        (_normal(0, (2, 3)), _normal(1, (3, 40)), 0.05 * _normal(2, (3, 3, 40, 16)))),
    "sum_over_an_empty_slice": (lambda x: x + x[..., :0].sum(-1, keepdims=True) + x[..., :0].max(-1, keepdims=True, initial=-3.0)
                                + (x[..., :0] > 0).sum(-1, keepdims=True), (_normal(0, (2, 3)),)),
    "zero_size_reduction": (lambda x: jnp.sum(x, 0) + 1, (jnp.zeros((0, 3)),)),
    "zero_size_matmul": (lambda a, b: a @ b + 1, (jnp.zeros((2, 0)), jnp.zeros((0, 3)))),
}

# each case planned once for all backends (conftest.module_plan_cache)
pytestmark = pytest.mark.usefixtures("module_plan_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_program_runs_as_under_jit(name, backend):
    fn, args = CASES[name]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(fn)(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = eqsat.optimize(fn, backend=backend)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        scale = 1.0 + float(np.max(np.abs(np.asarray(w, np.float64)), initial=0.0))
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=1e-4,
                                   atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["concat_of_one_matmul_twice", "tile_of_a_matmul", "concat_with_a_slice"])
def test_a_statistic_reading_a_host_twice_or_in_part_is_not_hosted(name):
    """`concat([m, m])`'s or `concat([m, m[:, :3]])`'s sum is its own reduction: the plan never
    hosts what the matmul cannot write (each element it writes must feed exactly one slot)."""
    from eqsat.cost import hosted_reductions

    fn, args = CASES[name]
    plan = eqsat.optimize(fn).lower(*args).plan
    hosting = hosted_reductions(plan.outputs)
    assert hosting and all(hosts is None for hosts in hosting.values())
    assert [k.kind for k in plan.kernels].count("reduce") == 1


def test_a_broken_template_contract_names_the_kernel(monkeypatch):
    """An exception inside a template reaches the user as `TemplateError` naming the kernel."""
    import emit.pallas.matmul as matmul

    def broken(kernel, ctx):
        raise KeyError("an operand the plan did not provide")

    monkeypatch.setattr(matmul, "emit", broken)
    fn = lambda a, w: jnp.tanh(a @ w)  # noqa: E731
    with pytest.raises(TemplateError, match=r"matmul.*KeyError.*an operand the plan did not provide"):
        eqsat.optimize(fn, backend="pallas")(_normal(0, (4, 8)), _normal(1, (8, 8)))


def test_polish_counts_a_kernel_read_only_through_a_slot_choice():
    """`extract.greedy`'s polish: a kernel read only through another kernel's slot choice has its
    reads counted (its retire move raised `KeyError` on it; found by benchmarks.fuzz)."""

    def f(x, w, n):
        h = x @ w
        return jnp.sum((h[..., :1] - h[..., 1:] > 0).astype(jnp.int32), axis=-1) + n.sum(-1)

    args = (_normal(9, (1, 1)), _normal(10, (1, 2)), jnp.array([[3]], jnp.int32))
    for backend in ("xla", "pallas"):
        np.testing.assert_array_equal(eqsat.optimize(f, backend=backend)(*args), jax.jit(f)(*args))
