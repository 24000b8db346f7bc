"""A statistic finished from its hosts' partials (`finalize`) is one kernel for every statistic of
its op and type, whatever produced it: lowered once, compiled once (issue 18)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqsat
from benchmarks.compile import triton_calls
from emit.pallas import KernelCall, finalize_structure, shared_names
from eqsat.term import Term


def norm_silu(y, groups=2):
    b, h, w, c = y.shape
    g = y.reshape(b, h, w, groups, c // groups).astype(jnp.float32)
    mean, var = g.mean(axis=(1, 2, 4), keepdims=True), g.var(axis=(1, 2, 4), keepdims=True)
    return jax.nn.silu(((g - mean) * lax.rsqrt(var + 1e-5)).reshape(y.shape))


def two_producers(x, z, w, v):
    """GroupNorm + SiLU after a 3x3 conv of a 5x7 image and after a 1x1 conv of a 3x3 one: two
    statistics of one type (2 images x 2 groups) over producers of different shapes, as the UNet's
    GroupNorms of 640 channels at 32x32 and 1280 at 16x16 (32 groups each)."""
    outs = []
    for i, (image, weight) in enumerate(((x, w), (z, v))):
        with jax.named_scope(f"blocks.{i}"):
            y = lax.conv_general_dilated(image, weight, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            outs.append(norm_silu(y + 100.0))  # an offset large against the spread
    return outs


def arguments():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 5, 7, 6)), jnp.float32).at[0, 2].set(0.0)  # a zero row
    z = jnp.asarray(rng.normal(size=(2, 3, 3, 6)), jnp.float32)
    w = jnp.asarray(0.1 * rng.normal(size=(3, 3, 6, 6)), jnp.float32)
    v = jnp.asarray(0.1 * rng.normal(size=(1, 1, 6, 6)), jnp.float32)
    return x, z, w, v


def finalizing_plan(monkeypatch, fn, args):
    import extract.plan
    from eqsat.cost import roofline

    monkeypatch.setattr(extract.plan, "finished_statistics",
                        lambda *a: roofline.finished_statistics(*a, share_limit=0.0))
    return eqsat.optimize(fn, extractor="greedy", extract_time_limit=120.0, progress=False).lower(*args).plan


def test_finalize_of_different_producers_is_emitted_once(monkeypatch):
    import emit
    import emit.pallas.partials as partials

    args = arguments()
    plan = finalizing_plan(monkeypatch, two_producers, args)
    assert plan.kinds().get("finalize") == 2, plan.kinds()
    finalized = []
    original = partials.finalize
    monkeypatch.setattr(partials, "finalize", lambda *a, **k: finalized.append(k["name"]) or original(*a, **k))
    got = emit.emit(plan, "pallas", interpret=True)(*args)
    assert len(finalized) == 1, finalized  # traced once, for both statistics
    names = [n for n in emit.kernel_names(plan) if "finalize" in n]
    assert len(names) == 2 and names[0] == names[1] and names[0].endswith(".x2"), names
    monkeypatch.setattr(emit.pallas, "emit_shared", lambda kernel, ctx, mosaic=False: emit.pallas.emit_kernel(kernel, ctx))
    apart = emit.emit(plan, "pallas", interpret=True)(*args)  # every kernel emitted on its own
    assert len(finalized) == 3
    reference = emit.emit(plan, "xla")(*args)
    for g, a, r, e in zip(got, apart, reference, jax.jit(two_producers)(*args)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(a))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)


def test_one_finalize_kernel_in_the_gpu_lowering(monkeypatch):
    """Lowered for a GPU (no GPU needed): both finalize launches carry one backend config (name and
    Triton IR), so XLA compiles it once."""
    import emit

    args = arguments()
    plan = finalizing_plan(monkeypatch, two_producers, args)
    run = emit.emit(plan, "pallas", interpret=False)
    lowered = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))
    finalizes = [(name, ir) for name, ir in triton_calls(lowered) if "finalize" in name]
    assert len(finalizes) == 2 and finalizes[0] == finalizes[1], [name for name, _ in finalizes]
    assert lowered.as_text().count("finalize") >= 1


def test_finalize_structure_is_op_and_type():
    a, b = Term("Input", "a", "f32[2,6]"), Term("Input", "b", "f32[2,6]")

    def moments(producer, body, ty="f32[2,2]"):
        return Term("EpilogueReduce", producer, "moments", body, "1", ty)

    load_a, load_b = Term("Load", a, "f32[2,6]"), Term("Load", b, "f32[2,6]")
    doubled = Term("Binary", "add", load_b, load_b, "f32[2,6]")
    first, second, wider = moments(a, load_a), moments(b, doubled), moments(b, doubled, "f32[2,3]")
    assert finalize_structure(first) == finalize_structure(second) != finalize_structure(wider)
    host_a = KernelCall(Term("Pointwise", load_a, "f32[2,6]"), "h0:pointwise", (first,))
    host_b = KernelCall(Term("Pointwise", doubled, "f32[2,6]"), "h1:pointwise", (second,))
    calls = [host_a, KernelCall(first, "a:finalize"), host_b, KernelCall(second, "b:finalize")]
    names = shared_names(calls)
    assert names[1] == names[3] == "a:finalize.x2", names
    assert names[0] == "h0:pointwise" and names[2] == "h1:pointwise"
    # Not hosted by any call: reductions computed from their bodies, known by their whole structure.
    assert shared_names([KernelCall(first, "a:reduce"), KernelCall(second, "b:reduce")]) == ["a:reduce", "b:reduce"]


def test_lowering_to_triton_ir_does_not_look_for_a_triton_dialect_module():
    """`emit.pallas.remember_missing_triton_dialect_module`: MLIR's bindings find the (empty) `tt`
    module once instead of failing an import for every Triton value."""
    import sys

    import emit.pallas  # noqa: F401 - installs the module
    from emit.pallas import triton

    assert "jaxlib.mlir.dialects.tt" in sys.modules
    looked_up = []

    class Spy:
        def find_spec(self, name, path=None, target=None):
            looked_up.append(name)
            return None

    def kernel(x_ref, o_ref):
        offsets = jnp.arange(64)
        y = triton.gather_load(x_ref, offsets)
        triton.store(o_ref, offsets, jnp.exp(y) * 2.0 + y)

    def run(x):
        return triton.pallas_call(kernel, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], grid=(1,), name="spy",
                                  interpret=False)[0]

    sys.meta_path.insert(0, Spy())
    try:
        jax.jit(run).trace(jax.ShapeDtypeStruct((64,), jnp.float32)).lower(lowering_platforms=("cuda",))
    finally:
        sys.meta_path.pop(0)
    assert not [name for name in looked_up if name.endswith(".tt")], looked_up[:5]
