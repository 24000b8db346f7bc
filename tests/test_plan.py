"""The Plan: kernel order, kinds, components, buffers and peak memory, reports, evaluation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqsat.cost import kernel_cost
from eqsat.egraph import Builder
from eqsat.lift import lift
from eqsat.term import Term
from extract import extract, load
from extract.plan import Plan, component_group, components_of_classes, kernel_kind, plan_from_extraction


def ld(t: Term) -> Term:
    return Term("Load", t, t.ty)


def unary(op: str, x: Term) -> Term:
    return Term("Pointwise", Term("Unary", op, ld(x), x.ty), x.ty)


def test_component_groups_keep_indices_with_their_modules():
    path = "down_blocks.0/down_blocks.0.resnets.1/down_blocks.0.resnets.1.conv1"
    assert component_group(path, 1) == "down_blocks.0"
    assert component_group(path, 2) == "down_blocks.0.resnets.1"
    assert component_group(path, 3) == "down_blocks.0.resnets.1.conv1"
    assert component_group(path, 9) == "down_blocks.0.resnets.1.conv1"
    assert component_group("up_blocks.1.attentions.2.transformer_blocks.0.attn1", 2) == "up_blocks.1.attentions.2"
    assert component_group("", 1) == ""


def test_kinds_map_every_kernel_op():
    x = Term("Input", "arg0", "f32[4,8]")
    reduce = Term("Reduce", "sum", ld(x), "1", Term("Acc", "f32[4]"), "f32[4]")
    assert kernel_kind(reduce, "down_blocks.0.resnets.0.norm1") == "norm"
    assert kernel_kind(reduce, "mid_block.attentions.0.transformer_blocks.0.norm3") == "norm"
    assert kernel_kind(reduce, "text_model.final_layer_norm") == "norm"
    assert kernel_kind(reduce, "down_blocks.0.attentions.0.transformer_blocks.0.attn1") == "reduce"
    assert kernel_kind(unary("exp", x)) == "pointwise"
    assert kernel_kind(Term("AssignStatic", x, "0,0", ld(x), x.ty)) == "pointwise"
    assert kernel_kind(Term("Opaque", "k", Term("TCons", x, Term("TNil")), 0, x.ty)) == "opaque"


def test_buffers_live_from_producer_to_last_reader_and_outputs_to_the_end():
    ty = "f32[1000]"  # 4000 bytes
    x = Term("Input", "arg0", ty)
    a = unary("exp", x)
    b = unary("neg", a)
    c = Term("Pointwise", Term("Binary", "add", ld(b), ld(a), ty), ty)
    d = unary("abs", x)
    plan = Plan.build([c, d])
    assert [k.term for k in plan.kernels] == [a, b, c, d]
    assert [k.inputs for k in plan.kernels] == [[x], [a], [b, a], [x]] or \
        [set(k.inputs) for k in plan.kernels] == [{x}, {a}, {a, b}, {x}]
    buffers = {b_.name: b_ for b_ in plan.buffers}
    assert (buffers["%0"].first, buffers["%0"].last) == (0, 2)
    assert (buffers["%1"].first, buffers["%1"].last) == (1, 2)
    assert buffers["%2"].kind == "output" and buffers["%2"].last == 3  # outputs live to the end
    assert buffers["arg0"].kind == "input" and buffers["arg0"].first == -1
    # At kernel 2, a, b and c are live; at kernel 3, c and d.
    assert plan.peak_bytes == 3 * 4000
    assert plan.bytes == pytest.approx(sum(kernel_cost(k.term).bytes for k in plan.kernels))
    assert plan.seconds == pytest.approx(sum(k.seconds for k in plan.kernels))


def scoped_fn(x, w, b):
    with jax.named_scope("block"):
        with jax.named_scope("block.proj"):
            h = x @ w + b
        with jax.named_scope("block.norm1"):
            mean = jnp.mean(h, axis=-1, keepdims=True)
            h = h - mean
    with jax.named_scope("head"):
        return jnp.exp(h)


def scoped_args(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32),
            rng.standard_normal((32,)).astype(np.float32))


def test_the_naive_plan_groups_the_lifted_kernels_by_scope():
    program = lift(scoped_fn, *scoped_args())
    plan = Plan.build(program.outputs, program=program)
    assert plan.naive_kernels == len(plan.kernels)
    kinds = {k.component: k.kind for k in plan.kernels if k.op == "Reduce"}
    assert kinds == {"block.norm1": "norm"}
    assert {k.component for k in plan.kernels if k.op == "Matmul"} == {"block.proj"}
    rows = {r["component"]: r for r in plan.rows(depth=1)}
    assert set(rows) == {"block", "head"}
    assert rows["block"]["naive"] == rows["block"]["fused"] >= 4
    text = plan.summary(depth=1)
    assert "block" in text and "head" in text and "total" in text and str(plan.naive_kernels) in text


def optimized_plan(fn, args):
    from eqsat.saturate import saturate

    program = lift(fn, *args)
    builder = Builder()
    handles = builder.add(program.outputs)
    saturate(builder.egraph, None, time_limit=30)
    extraction = extract(builder.egraph._serialize(), handles)
    return program, plan_from_extraction(extraction, program, builder.handles), extraction


def test_an_extracted_plan_evaluates_like_the_function_and_keeps_components():
    args = scoped_args()
    program, plan, extraction = optimized_plan(scoped_fn, args)
    assert len(plan.kernels) < plan.naive_kernels
    want = scoped_fn(*args)
    got = plan.evaluate(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Every fused kernel landed in a scope of the function, and the per-group totals add up.
    assert all(k.component.split(".")[0] in ("block", "head") for k in plan.kernels)
    rows = plan.rows(depth=1)
    assert sum(r["fused"] for r in rows) == len(plan.kernels)
    assert sum(r["naive"] for r in rows) == plan.naive_kernels
    assert plan.extractor == extraction.extractor


def test_to_json_is_self_contained():
    program, plan, _ = optimized_plan(scoped_fn, scoped_args())
    data = json.loads(plan.to_json())
    assert data["fused_kernels"] == len(plan.kernels) and data["naive_kernels"] == plan.naive_kernels
    names = {b["name"] for b in data["buffers"]}
    for kernel in data["kernels"]:
        assert set(kernel["inputs"]) <= names and set(kernel["outputs"]) <= names
        assert kernel["kind"] in ("pointwise", "reduce", "matmul", "conv", "norm", "attention", "gather", "opaque")
        assert kernel["expression"].startswith(kernel["op"])
    assert data["peak_bytes"] == plan.peak_bytes
    assert set(data["outputs"]) <= names


def test_classes_without_lifted_terms_take_their_readers_component():
    """A kernel the rules made (no builder handle in its class) is named after who reads it: a
    wide matmul whose slice equals a lifted matmul's output takes that matmul's component."""
    from egglog import union

    from eqsat import lang as L

    ty, wide_ty = "f32[4,8]", "f32[4,16]"
    x, w = Term("Input", "arg0", "f32[4,3]"), Term("Input", "arg1", "f32[3,8]")
    m = Term("Matmul", ld(x), ld(w), "1;0;;", Term("Acc", ty), ty)
    out = unary("exp", m)
    builder = Builder()
    builder.add([out])
    wide = L.Matmul(L.Load(L.Ref(0), "f32[4,3]"), L.Load(L.Input("wide_w", "f32[3,16]"), "f32[3,16]"), "1;0;;",
                    L.Acc(wide_ty), wide_ty)
    builder.egraph.register(union(L.Slice(L.Load(wide, wide_ty), 1, 0, 8, 1, ty)).with_(
        L.Load(L.Ref(builder.handle(m)), ty)))
    graph = load(builder.egraph._serialize())
    components = {builder.handle(out): "model.head", builder.handle(m): "model.proj"}
    labels = components_of_classes(graph, components)
    wide_class = next(c for c in range(graph.num_classes)
                      if graph.class_sort[c] == "Tensor" and graph.class_type[c] == wide_ty)
    assert wide_class not in graph.class_handles
    assert labels[wide_class] == "model.proj"
    assert labels[graph.handles[builder.handle(out)]] == "model.head"
