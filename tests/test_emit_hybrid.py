"""backend="hybrid": convs and matmuls through the XLA emitter (cuDNN/cuBLAS on a GPU), every other
kernel through its Pallas template (interpret mode here), with the statistics between them intact."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from emit.library import LIBRARY_OPS, runs_in_library
from emit.pallas import XlaFallbackWarning


def _group_norm(x, groups, eps=1e-5):
    n, c, h, w = x.shape
    g = x.reshape(n, groups, -1).astype(jnp.float32)
    mean = g.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), -1, keepdims=True)
    return ((g - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape).astype(x.dtype)


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))


def resnet_with_attention(x, w1, w2, skip, wq, wk, wv):
    """GroupNorm+SiLU -> conv -> GroupNorm over concat(h, relu(skip)) -> conv, then attention over
    the pixels spelled with explicit matmuls and a softmax: Pallas reductions and pointwise kernels
    between library convs and matmuls."""
    h = _conv(jax.nn.silu(_group_norm(x, 3)), w1)
    z = jnp.concatenate([h, jax.nn.relu(skip)], axis=1)
    h = _conv(jax.nn.silu(_group_norm(z, 3)), w2) + x
    n, c, hh, ww = h.shape
    tokens = h.reshape(n, c, hh * ww).transpose(0, 2, 1)
    q, k, v = tokens @ wq, tokens @ wk, tokens @ wv
    scores = (q @ k.transpose(0, 2, 1)) / np.sqrt(q.shape[-1])
    return jax.nn.softmax(scores, axis=-1) @ v + tokens


def _args(seed=0):
    rng = np.random.default_rng(seed)
    c, s = 9, 7  # 3 channels per group, an odd image
    return (
        jnp.asarray(300.0 + 0.05 * rng.standard_normal((2, c, s, s)), jnp.float32),  # offset large against the spread
        jnp.asarray(rng.standard_normal((c, c, 3, 3)) / 9, jnp.float32),
        jnp.asarray(rng.standard_normal((c, 2 * c, 3, 3)) / 13, jnp.float32),
        jnp.asarray(np.where(rng.random((2, c, s, s)) < 0.3, 0.0, rng.standard_normal((2, c, s, s))), jnp.float32),
        *(jnp.asarray(rng.standard_normal((c, c)) / 3, jnp.float32) for _ in range(3)),
    )


def _pallas_call_names(fn, args):
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params.get("name_and_src_info", eqn.params.get("name"))))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def test_only_convs_and_matmuls_go_to_the_library():
    assert LIBRARY_OPS == {"Conv", "Matmul"}
    assert emit.BACKENDS.count("hybrid") == 1
    assert emit.resolve_backend("hybrid") == "hybrid"


def test_hybrid_equals_jit_and_launches_pallas_kernels_only_for_the_other_kinds():
    args = _args()
    lowered = eqsat.optimize(resnet_with_attention, progress=False).lower(*args)
    kinds = {k.term.op for k in lowered.plan.kernels}
    assert {"Conv", "Matmul"} <= kinds and kinds - {"Conv", "Matmul"}, kinds
    run = lowered.executable("hybrid", interpret=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)  # a deliberate choice, not a fallback
        got = run(*args)
    expected = jax.jit(resnet_with_attention)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-4)

    names = _pallas_call_names(run, args)
    library = [k for k in lowered.plan.kernels if runs_in_library(k.term)]
    templated = [k for k in lowered.plan.kernels if not runs_in_library(k.term)]
    assert library and templated
    assert not any(":conv" in n or ":matmul" in n for n in names), names
    assert len(names) >= len(templated)


@pytest.mark.parametrize("seed", [1, 2])
def test_hybrid_and_pallas_agree_on_odd_values(seed):
    args = list(_args(seed))
    args[0] = args[0].at[0].set(5.0)  # a constant image: variance exactly 0 in every group
    lowered = eqsat.optimize(resnet_with_attention, progress=False).lower(*args)
    hybrid = lowered.executable("hybrid", interpret=True)(*args)
    reference = lowered.executable("xla")(*args)
    np.testing.assert_allclose(np.asarray(hybrid), np.asarray(reference), rtol=2e-4, atol=2e-4)


def test_the_tiny_unet_step_in_hybrid_equals_jit_with_statistics_hosted_by_library_kernels():
    """The SD 1.5 UNet step (tiny config): GroupNorm statistics hosted in conv and matmul epilogues
    (some by two hosts, across a skip concat) while those convs and matmuls run in the library and
    their readers (attention, pointwise, other convs' prologues) read them finished."""
    from benchmarks.gpu import concrete_args
    from sd15.workloads import workloads

    workload = workloads(batch=2, size=64, dtype="float32", config="tiny", components=("unet",))["unet"]
    args = concrete_args(workload)
    lowered = eqsat.optimize(workload.fn, progress=False, params_argnums=0).lower(*args)
    per_call = lowered.split.per_call.kernels
    hosts = [k for k in per_call if k.hosted]
    assert any(runs_in_library(k.term) for k in hosts)
    shared = {h for k in per_call for h in k.hosted if sum(h in j.hosted for j in per_call) > 1}
    assert shared, "the tiny UNet plan no longer hosts a statistic in two kernels: pick another case"
    assert any(k.term.op == "Attention" for k in per_call)
    got = lowered.executable("hybrid", interpret=True)(*args)
    expected = jax.jit(workload.fn)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
