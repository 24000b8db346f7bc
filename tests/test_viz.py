"""Drawing plans and e-graphs (`eqsat.viz`): DOT text, SVG through `dot` when installed, text otherwise, plots."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from eqsat import viz
from extract import drawing


def _spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _rms_after_matmul(x, w, g):
    """A matmul, then RMSNorm: the norm's sum of squares is computed in the matmul's epilogue."""
    h = x @ w
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g


@pytest.fixture(scope="module")
def lowered():
    return eqsat.optimize(_rms_after_matmul, progress=False).lower(_spec(24, 16), _spec(16, 40), _spec(40))


def test_plan_dot_has_a_box_per_kernel_and_an_edge_per_tensor_read(lowered):
    plan = lowered.plan
    source = plan.to_dot()
    boxes = re.findall(r"^  k(\d+) \[shape=box", source, flags=re.M)
    assert sorted(map(int, boxes)) == [k.index for k in plan.kernels]
    for kernel in plan.kernels:
        assert f"%{kernel.index} {kernel.kind}" in source
    reads = sum(len(k.inputs) for k in plan.kernels)
    assert len(re.findall(r"-> k\d+ \[", source)) == reads
    assert "x f32[24,16] 1.5 KiB" in source                         # a tensor edge: name, type, size
    assert "outputs [shape=doublecircle" in source and re.search(r"k\d+ -> outputs", source)


def test_epilogue_statistics_are_dashed_edges_and_listed_in_their_host(lowered):
    plan = lowered.plan
    assert plan.hosted_reductions == 1, plan.kinds()
    source = plan.to_dot()
    assert len(re.findall(r"style=dashed", source)) == 1
    assert "+ statistics %0.1" in source
    assert "(epilogue statistics)" in drawing.plan_text(plan)


def test_many_inputs_collapse_into_one_node(lowered):
    source = drawing.plan_to_dot(lowered.plan, inputs=False)
    assert "in_arg" not in source and "3 inputs and constants" in source


@pytest.mark.skipif(viz.dot_program() is None, reason="Graphviz `dot` is not installed")
def test_dot_renders_svg(lowered):
    svg = lowered._repr_svg_()
    assert svg is not None and "<svg" in svg and "matmul" in svg


def test_without_dot_a_drawing_says_so_and_is_text(lowered, monkeypatch, capsys):
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    picture = drawing.plan_drawing(lowered.plan)
    assert picture._repr_svg_() is None
    text = repr(picture)
    assert text.splitlines()[0] == viz.NO_DOT and "matmul" in text
    lowered.show()                                                   # no notebook here: prints
    assert viz.NO_DOT in capsys.readouterr().out


def test_egraph_view_is_limited_and_highlights_the_extracted_nodes(lowered):
    graph = lowered.extraction.graph
    output = lowered.program.outputs[0]
    picture = lowered.egraph_view(term=output, depth=2, max_classes=6)
    clusters = re.findall(r"subgraph cluster_(\d+)", picture.source)
    assert 1 < len(clusters) <= 6 < graph.num_classes
    root = graph.handles[lowered.builder.handles[output]]
    focus = [line for line in picture.source.splitlines() if "color=red" in line]
    assert int(clusters[0]) == root and len(focus) == 1 and f"cluster_{root} " in focus[0]
    chosen = viz.chosen_nodes(lowered.extraction.selection)
    drawn = {int(n) for n in re.findall(r"^    n(\d+) \[", picture.source, flags=re.M)}
    gold = {int(n) for n in re.findall(r"^    n(\d+) \[.*fillcolor=gold", picture.source, flags=re.M)}
    assert gold == drawn & chosen and gold
    assert [graph.node_op[n] for n in gold & set(graph.class_nodes[root])] == [lowered.plan.outputs[0].op]
    lines = picture.text.splitlines()[1:]
    assert len(lines) == len(clusters) and lines[0].startswith(f"e{root} ")


def test_egraph_view_by_component_and_its_errors():
    def scoped(x, w):
        with jax.named_scope("proj"):
            h = x @ w
        with jax.named_scope("act"):
            return jax.nn.relu(h) * 2.0

    lowered = eqsat.optimize(scoped, progress=False).lower(_spec(8, 4), _spec(4, 8))
    picture = lowered.egraph_view(component="proj", depth=1)
    assert "around proj" in picture.text
    with pytest.raises(ValueError, match="no kernel e-class belongs"):
        lowered.egraph_view(component="nowhere")
    with pytest.raises(ValueError, match="say what to draw"):
        lowered.egraph_view()


def test_live_bytes_peak_is_the_plans_peak(lowered):
    assert max(drawing.live_bytes(lowered.plan)) == lowered.plan.peak_bytes


def test_plots_draw(lowered):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = drawing.plot_memory(lowered.plan)
    assert len(ax.lines) == 1
    ax = drawing.plot_lifetimes(lowered.plan)
    assert len(ax.patches) == sum(b.kind in ("activation", "output") for b in lowered.plan.buffers)
    ax = viz.plot_kernel_counts({"eqsat": {"a": 1, "b": 2}, "XLA": {"a": 3, "c": 1}})
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"] and len(ax.patches) == 6
    plt.close("all")


def test_human_bytes():
    assert [viz.human_bytes(n) for n in (0, 1023, 1024, 3 * 2**20, 2**31)] == ["0 B", "1023 B", "1.0 KiB",
                                                                               "3.0 MiB", "2.0 GiB"]


def test_inputs_are_labelled_with_their_place_in_the_arguments():
    def linear(params, x):
        return x @ params["down_blocks.0.attentions.1.proj_in.weight"] + params["bias"]

    params = {"down_blocks.0.attentions.1.proj_in.weight": _spec(4, 6), "bias": _spec(6)}
    lowered = eqsat.optimize(linear, progress=False).lower(params, _spec(3, 4))
    assert drawing.input_paths(lowered.program) == {"arg0": "params['bias']",
                                                "arg1": "params['…attentions.1.proj_in.weight']", "arg2": "x"}
    dot = lowered.plan.to_dot()
    assert "params['…attentions.1.proj_in.weight']" in dot and "arg1" not in dot.replace("in_arg1", "")


def test_inputs_are_named_and_drawn_in_the_functions_order(tmp_path):
    def block(x, w, b, r, *rest, scale=1.0):
        return jax.nn.gelu(x @ w + b) * scale + r + rest[0]

    args = [_spec(8, 4), _spec(4, 6), _spec(6), _spec(8, 6), _spec(8, 6)]
    lowered = eqsat.optimize(block, progress=False).lower(*args, scale=np.float32(2.0))
    assert drawing.input_paths(lowered.program) == {"arg0": "x", "arg1": "w", "arg2": "b", "arg3": "r",
                                                "arg4": "args[4]", "arg5": "scale"}
    dot = lowered.plan.to_dot()
    drawn = [line.split("label=")[1].split("\\l")[0].strip('"') for line in dot.splitlines() if "shape=ellipse" in line]
    assert drawn[:4] == ["x", "w", "b", "r"]
    text = drawing.plan_text(lowered.plan)
    assert "matmul 1·0(x, w)" in text and "'1;0;;'" not in text and "Binary(" not in text


@pytest.mark.parametrize("suffix", ["dot", "txt", "svg", "png"])
def test_a_plan_drawing_is_written_to_a_file(tmp_path, suffix):
    if suffix in ("svg", "png") and viz.dot_program() is None:
        pytest.skip("Graphviz's dot is not installed")
    lowered = eqsat.optimize(lambda x: jnp.sin(x) * 2, progress=False).lower(_spec(4, 4))
    path = lowered.show(tmp_path / f"plan.{suffix}")
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" if suffix == "png" else (b"<svg" in data if suffix == "svg" else len(data) > 10)
    with pytest.raises(ValueError, match="cannot tell the format"):
        lowered.show(tmp_path / "plan.xyz")


def test_a_large_plan_is_drawn_folded_by_component(monkeypatch):
    """Over `FOLD_ABOVE` kernels (20 here, to keep the plan small), `fold="auto"` draws one box per component at the deepest level with
    at most `FOLDED_BOXES` boxes, each with its kernel count; `fold=0` draws every kernel."""
    def deep(x, ws):
        for i, w in enumerate(ws):  # components are full paths, as sd15's scopes are
            with jax.named_scope(f"blocks.{i}.proj"):
                h = x @ w
            with jax.named_scope(f"blocks.{i}.norm"):
                h = h / jnp.max(jnp.abs(h), axis=-1, keepdims=True)
            with jax.named_scope(f"blocks.{i}"):
                x = jnp.tanh(h) + x
        return x

    monkeypatch.setattr(drawing, "FOLD_ABOVE", 20)
    ws = [_spec(8, 8) for _ in range(32)]
    lowered = eqsat.optimize(deep, progress=False).lower(_spec(4, 8), ws)
    plan = lowered.plan
    assert len(plan.kernels) > drawing.FOLD_ABOVE
    depth = drawing.fold_depth(plan)
    boxes = {drawing.component_at(k.component, depth) for k in plan.kernels}
    assert depth >= 1 and 1 < len(boxes) <= drawing.FOLDED_BOXES
    source = drawing.plan_to_dot(plan)
    assert source.count("shape=box") == len(boxes)
    assert "blocks.7" in source and re.search(r"\d+ kernels: \d+ matmul", source)
    total = sum(int(n) for n in re.findall(r"(\d+) kernels:", source))
    assert total == len(plan.kernels)
    assert drawing.plan_to_dot(plan, fold=0).count("shape=box") == len(plan.kernels)
    assert drawing.plan_to_dot(plan, fold=1).count("shape=box") == len({drawing.component_at(k.component, 1)
                                                                        for k in plan.kernels})
