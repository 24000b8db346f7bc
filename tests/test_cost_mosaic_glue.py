"""The XLA fusions the cost model says the Mosaic templates launch around their kernels
(`eqsat.cost.mosaic.MosaicWork.glue`) against the launches of the compiled program: each plan emitted
with `backend="mosaic"` (its per-call stage where weights are prepared) and compiled for an H100
without a GPU; every launch that is not a Pallas kernel is glue, and the model's count must equal it.

Cases are the forms SD 1.5's UNet has: a self-attention over a fused QKV with heads of 40 (Kᵀ, its
head padded, q and v padded in one fusion, the output sliced), a cross-attention over 77 text
tokens with heads of 80 (Kᵀ and v padded in one fusion), a 1x1 conv with a residual (its own rows:
no fusion), a conv over a nearest-2x upsample with prepared phase weights (the unflatten and the
bias per phase), a merged-shortcut conv with prepared weights."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import emit
import eqsat
from emit.prepare import Prepared
from eqsat.cost.mosaic import mosaic_work
from sd15 import layers
from sd15.layers import attention

S, F16 = jax.ShapeDtypeStruct, jnp.float16
DENSE = ("Matmul", "Conv", "Attention")


def _self_attention(x, wqkv, wo):
    q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
    return attention(q, k, v, 8) @ wo


def _cross_attention(x, context, wq, wkv, wo):
    k, v = jnp.split(context @ wkv, 2, axis=-1)
    return attention(x @ wq, k, v, 8) @ wo


def _proj_with_residual(params, x):
    return layers.conv2d({"c.weight": params["w"], "c.bias": params["b"]}, "c", x) + x


def _upsample(params, x):
    return layers.upsample({"u.conv.weight": params["w"], "u.conv.bias": params["b"]}, "u", x)


def _shortcut(params, x, h):
    p = {"n.weight": params["gamma"], "n.bias": params["beta"], "c.weight": params["w"], "c.bias": params["b"],
         "s.weight": params["ws"], "s.bias": params["bs"]}
    return layers.conv2d(p, "s", x) + layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", h, 64, 1e-5)))


CASES = {
    "self-attention heads of 40": (_self_attention, (S((2, 256, 320), F16), S((320, 960), F16), S((320, 320), F16)),
                                   None),
    "cross-attention heads of 80 over 77 tokens": (  # XFAIL-free: see _approximate
        _cross_attention, (S((2, 256, 640), F16), S((2, 77, 768), F16), S((640, 640), F16), S((768, 1280), F16),
                           S((640, 640), F16)), None),
    "1x1 conv with a residual": (_proj_with_residual, ({"w": S((320, 320, 1, 1), F16), "b": S((320,), F16)},
                                                       S((2, 16, 16, 320), F16)), 0),
    "upsample conv, weights prepared": (_upsample, ({"w": S((320, 320, 3, 3), F16), "b": S((320,), F16)},
                                                    S((2, 16, 16, 320), F16)), 0),
    "merged shortcut, weights prepared": (
        _shortcut, ({"gamma": S((640,), F16), "beta": S((640,), F16), "w": S((640, 640, 3, 3), F16),
                     "b": S((640,), F16), "ws": S((640, 320, 1, 1), F16), "bs": S((640,), F16)},
                    S((2, 16, 16, 320), F16), S((2, 16, 16, 640), F16)), 0),
}


def _counted_and_modeled(fn, args, params_argnums, dump=None):
    from measure.xla_target import compile_for_h100

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = eqsat.optimize(fn, backend="mosaic", progress=False, cache=False,
                                 **({} if params_argnums is None else {"params_argnums": params_argnums})).lower(*args)
    if params_argnums is None:
        kernels, run, run_args = lowered.plan.kernels, emit.emit(lowered.plan, "mosaic", interpret=False), args
    else:
        split = lowered.split
        stage = Prepared(split, "mosaic", interpret=False)
        kernels = split.per_call.kernels
        run, run_args = (lambda pre, *a: stage.per_call(pre, *a)), (split.prepared_specs(), *args)
    modeled = {(k.component, k.kind, i): [g.what for g in mosaic_work(k.term).glue]
               for i, k in enumerate(kernels) if k.op in DENSE}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compile_for_h100(run, *run_args, keep_dump=dump)
    if report is None:
        pytest.skip("the H100 compile target is not installed: python -m measure.cuda_target install")
    pallas = sum(n for category, n in report.by_category.items() if category.startswith("Pallas"))
    return report.kernels + report.copies - pallas, modeled, report


def _skip_without_target():
    from measure.xla_target import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless H100 compile here: {reason}")


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES) - {"cross-attention heads of 80 over 77 tokens"}))
def test_compiles_with_the_glue_the_model_charges(case, tmp_path):
    _skip_without_target()
    fn, args, params_argnums = CASES[case]
    counted, modeled, report = _counted_and_modeled(fn, args, params_argnums, tmp_path)
    assert counted == sum(len(glue) for glue in modeled.values()), (counted, modeled, report.by_category)


@pytest.mark.slow
def test_a_cross_attention_launches_its_glue_and_the_kv_slice_fuses_into_it(tmp_path):
    """Heads of 80 over 77 keys: Kᵀ transposed, then padded to 80 keys, and v padded: the three fusions
    the model charges the attention, in its scope. The K/V projection's output slice (its 77 rows
    padded to 128) is not a launch of its own: XLA fuses it into those pads, so the model's one
    fusion for it is one more than runs (the difference `benchmarks.glue --report` shows per kernel)."""
    from benchmarks.glue import glue_launches

    _skip_without_target()
    fn, args, params_argnums = CASES["cross-attention heads of 80 over 77 tokens"]
    counted, modeled, _report = _counted_and_modeled(fn, args, params_argnums, tmp_path)
    launches = glue_launches(next(p.parent for p in tmp_path.rglob("*thunk_metadata.txt")))
    in_attention = sorted(l.jax_op for l in launches if l.kernel_scope.rsplit(":", 1)[-1] == "attention")
    ((_, attention_glue),) = [(key, glue) for key, glue in modeled.items() if key[1] == "attention"]
    assert sorted(attention_glue) == ["K padded", "K transposed", "v laid out"]
    assert len(in_attention) == len(attention_glue) == 3, in_attention
    assert counted == sum(len(glue) for glue in modeled.values()) - 1
