"""Identical kernels share one `pallas_call` name, so XLA compiles their Triton IR once
(`emit.pallas.shared_names`); every launch keeps its own named scope."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import emit
import eqsat
from benchmarks.compile import kernel_counts, triton_calls
from emit.pallas import KernelCall, shared_names
from measure import compare, xla_target


def repeated(x, y, z, w):
    """Three blocks, two of one structure (same shapes), one with another width."""
    outs = []
    for i, (a, width) in enumerate(((x, 96), (y, 96), (z, 40))):
        with jax.named_scope(f"blocks.{i}"):
            h = a[:, :width] @ w[:width]
            outs.append(jax.nn.silu(h) * 2.0 + 1.0)
    return outs


def arguments():
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(1e2 + rng.standard_normal((24, 96)), jnp.float32) for _ in range(2))
    z = jnp.asarray(rng.standard_normal((24, 96)), jnp.float32).at[3].set(0.0)
    w = jnp.asarray(rng.standard_normal((96, 77)) / 96, jnp.float32)
    return x, y, z, w


def test_identical_kernels_share_a_name_and_their_ir():
    args = arguments()
    fast = eqsat.optimize(repeated, backend="pallas", progress=False)
    run = fast.lower(*args).executable()
    lowered = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))  # no GPU needed
    calls = triton_calls(lowered)
    names = [name for name, _ in calls]
    assert len(calls) == 3, names
    assert names[0] == names[1] == "blocks.0_matmul.x2" and names[2] == "blocks.2_matmul"
    assert calls[0][1] == calls[1][1] and calls[0][1] != calls[2][1]  # one backend config: compiled once
    assert kernel_counts(lowered) == {"launched": 3, "distinct": 2, "distinct_ir": 2, "lowered": 2}
    got = run(*args)
    want = jax.jit(repeated)(*args)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-4)


def test_operand_order_and_repeats_are_part_of_the_structure():
    from eqsat.term import Term

    a = Term("Input", "a", "f32[4,8]")
    b = Term("Input", "b", "f32[4,8]")
    c = Term("Input", "c", "f32[4,8]")

    def add(x, y):
        body = Term("Binary", "add", Term("Load", x, "f32[4,8]"), Term("Load", y, "f32[4,8]"), "f32[4,8]")
        return Term("Pointwise", body, "f32[4,8]")

    calls = [KernelCall(add(a, b), "one:pointwise"), KernelCall(add(b, c), "two:pointwise"),
             KernelCall(add(a, a), "three:pointwise"), KernelCall(add(c, c), "four:pointwise")]
    assert shared_names(calls) == ["one:pointwise.x2", "one:pointwise.x2", "three:pointwise.x2",
                                   "three:pointwise.x2"]
    half = Term("Input", "h", "f16[4,8]")
    assert shared_names([calls[0], KernelCall(add(half, half), "h:pointwise")]) == ["one:pointwise", "h:pointwise"]


def test_shared_launches_are_matched_to_plan_kernels_by_scope(tmp_path):
    def launch(name, scope):
        return xla_target.Launch(0, "kCustomKernel", name, "Pallas (Triton)", "kernel", False, 0, scope, False)

    (tmp_path / "module.sm_9.0a_gpu_after_optimizations.txt").write_text(
        '  %pallas_call.1 = f16[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={name = "up.0_conv.x2"}\n'
        '  %pallas_call.2 = f16[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={name = "up.0_conv.x2"}\n')
    names = compare.triton_kernel_names(tmp_path)
    report = types.SimpleNamespace(launches=(launch("pallas_call.1", "up.0:conv"), launch("pallas_call.2", "up.1:conv")),
                                   by_category={"Pallas (Triton)": 2})
    found = compare.emitted_against_plan(report, ["up.0:conv", "up.1:conv"], names)
    assert found["emitted_missing"] == [] and found["emitted_extra"] == []


def test_emission_progress_bar(capsys):
    args = arguments()
    shown = eqsat.optimize(repeated, backend="pallas", progress=True)
    shown(*args)
    err = capsys.readouterr().err
    assert "eqsat emit" in err and "/3 [" in err, err[-500:]  # kernels emitted out of 3
    quiet = eqsat.optimize(repeated, backend="pallas", progress=False)
    quiet(*args)
    assert "eqsat" not in capsys.readouterr().err


def test_finalize_kernels_finish_from_partials_when_shared(monkeypatch):
    """Two identical GroupNorm + SiLU readers of two identical convs, each statistic finished once
    (`finalize`): the shared emission hands the finalize kernel its hosts' partials (it must not
    recompute the statistic from the conv's output), and the results are `jax.jit`'s."""
    import emit
    import emit.pallas.partials as partials
    import extract.plan
    from eqsat.cost import roofline
    from jax import lax

    monkeypatch.setattr(extract.plan, "finished_statistics",
                        lambda *a: roofline.finished_statistics(*a, share_limit=0.0))
    finalized = []
    original = partials.finalize
    monkeypatch.setattr(partials, "finalize", lambda *a, **k: finalized.append(k["name"]) or original(*a, **k))

    def norm_silu(y, groups=2):
        b, h, w, c = y.shape
        g = y.reshape(b, h, w, groups, c // groups).astype(jnp.float32)
        mean, var = g.mean(axis=(1, 2, 4), keepdims=True), g.var(axis=(1, 2, 4), keepdims=True)
        return jax.nn.silu(((g - mean) * lax.rsqrt(var + 1e-5)).reshape(y.shape))

    def fn(x, w, v):
        outs = []
        for i, weight in enumerate((w, v)):
            with jax.named_scope(f"blocks.{i}"):
                y = lax.conv_general_dilated(x, weight, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                outs.append(norm_silu(y + 100.0))  # an offset large against the spread
        return outs

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 5, 7, 6)), jnp.float32)
    w, v = (jnp.asarray(0.1 * rng.normal(size=(3, 3, 6, 6)), jnp.float32) for _ in range(2))
    plan = eqsat.optimize(fn, extractor="greedy", extract_time_limit=120.0, progress=False).lower(x, w, v).plan
    assert plan.kinds().get("finalize") == 2, plan.kinds()
    got = emit.emit(plan, "pallas", interpret=True)(x, w, v)
    assert len(finalized) == 1  # traced once, for both sites
    monkeypatch.setattr(emit.pallas, "emit_shared", lambda kernel, ctx, mosaic=False: emit.pallas.emit_kernel(kernel, ctx))
    apart = emit.emit(plan, "pallas", interpret=True)(x, w, v)  # every kernel emitted on its own
    assert len(finalized) == 3
    for g, a, e in zip(got, apart, jax.jit(fn)(x, w, v)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(a))
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)


def repeated_half(x, y, z, w, v):
    """Three fp16 matmul blocks for the Mosaic GPU template, two of one structure."""
    outs = []
    for i, (a, b) in enumerate(((x, w), (y, w), (z, v))):
        with jax.named_scope(f"blocks.{i}"):
            outs.append(jax.nn.silu(a @ b) * 2.0)
    return outs


def half_arguments():
    rng = np.random.default_rng(1)
    x = jnp.asarray(1e2 + rng.standard_normal((128, 64)), jnp.float16)  # an offset large against the spread
    y = jnp.asarray(rng.standard_normal((128, 64)), jnp.float16).at[5].set(0.0)
    z = jnp.asarray(rng.standard_normal((128, 128)), jnp.float16)
    w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float16)
    v = jnp.asarray(rng.standard_normal((128, 64)) / 8, jnp.float16)
    return x, y, z, w, v


def test_identical_mosaic_kernels_are_traced_once(monkeypatch):
    """On the Mosaic backend too, the first kernel of a structure is traced for all its sites: the
    template builds two kernels for three launches, and each site computes its own values."""
    from emit.mosaic import matmul as mm

    built = []
    original = mm.build
    monkeypatch.setattr(mm, "build", lambda *a, **k: built.append(k.get("name")) or original(*a, **k))
    args = half_arguments()
    got = eqsat.optimize(repeated_half, backend="mosaic", progress=False)(*args)
    assert built == ["blocks.0:matmul.x2", "blocks.2:matmul"], built
    for g, e in zip(got, jax.jit(repeated_half)(*args)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=2e-2, atol=2e-2)


def test_identical_mosaic_kernels_compile_once_for_h100(tmp_path):
    """Deviceless: the executable launches three Mosaic GPU kernels and Mosaic compiles two (one PTX
    dump per compiled module)."""
    from benchmarks.mosaic_ptx import dumping

    args = half_arguments()
    plan = eqsat.optimize(repeated_half, backend="mosaic", progress=False).lower(*args).plan
    with dumping(tmp_path / "mosaic"):
        report = xla_target.compile_for_h100(emit.emit(plan, "mosaic", interpret=False), *args)
    if report is None:
        pytest.skip(xla_target.unavailable_reason() or "the H100 compile target is unavailable")
    assert report.by_category.get("Pallas (Mosaic GPU)") == 3, report.by_category
    assert len(list((tmp_path / "mosaic").glob("*.ptx"))) == 2, sorted(p.name for p in (tmp_path / "mosaic").iterdir())
