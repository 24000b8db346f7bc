"""The roofline cost model: device profiles, per-node costs, per-kernel costs, DAG costs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import eqsat
from eqsat import lang
from eqsat.conv_params import ConvParams
from eqsat.cost import (
    A100,
    CPU,
    H100,
    H200,
    Cost,
    count_kernels,
    dag_cost,
    get_device,
    kernel_cost,
    kernel_reads,
    kernels,
    node_cost,
)
from eqsat.cost import roofline
from eqsat.term import Term


def load(t: Term) -> Term:
    return Term("Load", t, t.ty)


def test_device_profiles_use_published_figures():
    assert H100.hbm_bandwidth == 3.35e12 and H100.peak_fp16 == 989e12 and H100.peak_fp32 == 67e12
    assert H200.hbm_bandwidth == 4.8e12
    assert A100.hbm_bandwidth == 2.0e12 and A100.peak_fp16 == 312e12 and A100.peak_fp32 == 19.5e12
    for device in (H100, H200, A100):
        assert 3e-6 <= device.launch_overhead <= 5e-6
    assert CPU.hbm_bandwidth < A100.hbm_bandwidth
    assert get_device("H100-SXM") is H100 and get_device("a100") is A100 and get_device(H200) is H200
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")
    with pytest.raises(Exception):
        H100.hbm_bandwidth = 1.0  # frozen


def test_the_cost_model_mirrors_the_language_and_never_imports_egglog():
    assert roofline.KERNEL_OPS == lang.KERNEL_OPS
    assert roofline.LEAF_OPS == lang.LEAF_TENSOR_OPS
    assert roofline.KNOWN_OPS == set(lang.OPS) | {"Ref"}
    code = "import eqsat.cost, sys; assert 'egglog' not in sys.modules, 'egglog imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# The cost model's modules, bottom first: each imports only modules before it (issue 21's house).
COST_LAYERS = ("devices", "hosting", "terms", "mma", "tiles", "partials", "work", "mosaic", "prologues", "merges",
               "backends", "finish", "roofline")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function) for every import statement of the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, node.col_offset > 0)] + [(f"{node.module}.{a.name}", node.col_offset > 0)
                                                             for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.col_offset > 0) for a in node.names]
    return found


def test_the_cost_model_and_the_tilings_import_downward_only():
    """`eqsat.cost` reads the templates' tilings from `eqsat.tiling` (never from `emit`), its modules
    import one way (`COST_LAYERS`), and no import hides in a function; `eqsat.tiling` is pure
    arithmetic on shapes (no jax). Importing both loads neither jax nor the emitters."""
    root = Path(eqsat.__file__).parent
    assert sorted(p.stem for p in (root / "cost").glob("*.py") if p.stem != "__init__") == sorted(COST_LAYERS)
    for package in ("cost", "tiling"):
        for path in (root / package).glob("*.py"):
            for module, inside in _imports(path):
                assert not inside, f"{path.name} imports {module} inside a function"
                assert not module.startswith(("emit", "extract", "jax", "driver", "measure")), (path.name, module)
                if package == "tiling":
                    assert not module.startswith("eqsat.cost"), (path.name, module)
                if package == "cost" and path.stem != "__init__" and module.startswith("eqsat.cost."):
                    lower = module.split(".")[2]
                    if lower in COST_LAYERS:
                        assert COST_LAYERS.index(lower) < COST_LAYERS.index(path.stem), f"{path.stem} imports {lower}"
    code = ("import sys, eqsat.cost, eqsat.tiling.conv, eqsat.tiling.matmul, eqsat.tiling.attention, "
            "eqsat.tiling.partials; bad = [m for m in ('jax', 'emit') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# The formulas below are the data-sheet roofline's (`h100`); `h100-calibrated` scales them by
# `eqsat.cost.work`'s fitted factors (tests/test_cost_work.py).
ROOFLINE = "h100"


def test_node_costs_of_expressions_and_loads():
    ty = "f32[4,8]"
    binary = node_cost("Binary", ("add", ty, ty, ty), ROOFLINE)
    assert binary.flops == 32 and binary.bytes == 0
    assert binary.seconds == pytest.approx(32 / H100.peak_fp32)
    # Ops of several instructions count them (`roofline.ALU_INSTRUCTIONS`): erf is its polynomial.
    assert node_cost("Unary", ("erf", ty, ty), ROOFLINE).flops == 32 * roofline.ALU_INSTRUCTIONS["erf"]
    assert node_cost("Binary", ("div", ty, ty, ty), ROOFLINE).flops == 32 * roofline.ALU_INSTRUCTIONS["div"]
    assert node_cost("Reshape", (ty, "f32[32]")).seconds == 0.0  # views are index arithmetic
    assert node_cost("Transpose", (ty, "1,0", "f32[8,4]")) == Cost()
    read = node_cost("Load", (ty, ty), ROOFLINE)
    assert read.bytes == 128 and read.flops == 0 and read.seconds == pytest.approx(128 / H100.hbm_bandwidth)


def test_kernel_node_costs_launch_write_and_dense_flops():
    lhs, rhs, out = "f16[64,128]", "f16[128,256]", "f16[64,256]"
    matmul = node_cost("Matmul", (lhs, rhs, "1;0;;", out, out), ROOFLINE)
    assert matmul.flops == 2 * 64 * 256 * 128
    assert matmul.bytes == 64 * 256 * 2  # its output write; reads belong to its Loads
    expected = H100.launch_overhead + matmul.bytes / H100.hbm_bandwidth + matmul.flops / H100.peak_fp16
    assert matmul.seconds == pytest.approx(expected)
    f32 = node_cost("Matmul", ("f32[64,128]", "f32[128,256]", "1;0;;", "f32[64,256]", "f32[64,256]"), ROOFLINE)
    assert f32.seconds > matmul.seconds  # fp32 runs on the vector units
    batched = node_cost("Matmul", ("f16[2,8,64,32]", "f16[2,8,32,64]", "3;2;0,1;0,1", "f16[2,8,64,64]",
                                   "f16[2,8,64,64]"))
    assert batched.flops == 2 * (2 * 8 * 64 * 64) * 32


def test_conv_flops_follow_the_weight_layout():
    key = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1),
                              ((0, 3, 1, 2), (0, 1, 2, 3), (0, 3, 1, 2))).key
    lhs, rhs, out = "f16[2,64,64,320]", "f16[640,320,3,3]", "f16[2,64,64,640]"
    conv = node_cost("Conv", (lhs, rhs, key, out, out))
    assert conv.flops == 2 * (2 * 64 * 64 * 640) * (320 * 3 * 3)
    grouped = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1),
                                  ((0, 3, 1, 2), (0, 1, 2, 3), (0, 3, 1, 2)), feature_group_count=320).key
    depthwise = node_cost("Conv", ("f16[2,8,8,320]", "f16[320,1,3,3]", grouped, "f16[2,8,8,320]", "f16[2,8,8,320]"))
    assert depthwise.flops == 2 * (2 * 8 * 8 * 320) * 9


def test_attention_and_reduce_flops():
    q, kv = "f16[2,8,1024,40]", "f16[2,8,77,40]"
    attention = node_cost("Attention", (q, kv, kv, "f32[2,8,1024,77]", 0.125, q, q))
    assert attention.flops == 4 * 2 * 8 * 1024 * 77 * 40
    reduce = node_cost("Reduce", ("sum", "f32[2,4096,32,10]", "1,3", "f32[2,32]", "f32[2,32]"))
    assert reduce.flops == 2 * 4096 * 32 * 10 and reduce.bytes == 2 * 32 * 4


def test_kernel_cost_reads_each_distinct_tensor_once():
    ty = "f32[1024]"
    x = Term("Input", "arg0", ty)
    square = Term("Pointwise", Term("Binary", "mul", load(x), load(x), ty), ty)
    cost = kernel_cost(square, ROOFLINE)
    assert kernel_reads(square) == {x: 4096.0}
    assert cost.bytes == 4096 + 4096  # x once, the output once
    assert cost.flops == 1024
    expected = H100.launch_overhead + cost.bytes / H100.hbm_bandwidth + 1024 / H100.peak_fp32
    assert cost.seconds == pytest.approx(expected)


def test_kernel_cost_charges_slices_for_what_they_read():
    wide = Term("Input", "arg0", "f16[2,77,1920]")
    thirds = [Term("Slice", load(wide), 2, i * 640, (i + 1) * 640, 1, "f16[2,77,640]") for i in range(3)]
    one = Term("Pointwise", Term("Unary", "exp", thirds[0], "f16[2,77,640]"), "f16[2,77,640]")
    assert kernel_reads(one)[wide] == pytest.approx(2 * 77 * 640 * 2)
    total = Term("Pointwise", Term("Binary", "add", thirds[0], Term("Binary", "add", thirds[1], thirds[2],
                                                                   "f16[2,77,640]"), "f16[2,77,640]"),
                 "f16[2,77,640]")
    assert kernel_reads(total)[wide] == pytest.approx(2 * 77 * 1920 * 2)  # never more than the tensor
    mixed = Term("Pointwise", Term("Binary", "add", thirds[0], Term("Slice", Term("Unary", "neg", load(wide),
                                                                                   "f16[2,77,1920]"),
                                                                    2, 0, 640, 1, "f16[2,77,640]"),
                                   "f16[2,77,640]"), "f16[2,77,640]")
    assert kernel_reads(mixed)[wide] == pytest.approx(2 * 77 * 1920 * 2)  # also read whole


def test_gather_reads_only_the_rows_it_gathers():
    table = Term("Input", "arg0", "f16[49408,768]")
    ids = Term("Input", "arg1", "i32[2,77,1]")
    gather = Term("Gather", load(table), load(ids), "g0", "f16[2,77,768]")
    reads = kernel_reads(gather)
    assert reads[table] == pytest.approx(2 * 77 * 768 * 2) and reads[ids] == 2 * 77 * 4


def test_dag_cost_pays_a_shared_tensor_once():
    ty = "f32[256,256]"
    x, w = Term("Input", "arg0", ty), Term("Input", "arg1", ty)
    m = Term("Matmul", load(x), load(w), "1;0;;", Term("Acc", ty), ty)
    a = Term("Pointwise", Term("Unary", "exp", load(m), ty), ty)
    b = Term("Pointwise", Term("Unary", "neg", load(m), ty), ty)
    assert kernels([a, b]) == [m, a, b]
    assert count_kernels([a, b]) == 3
    total = dag_cost([a, b], "h100").seconds
    assert total == pytest.approx(sum(kernel_cost(k, "h100").seconds for k in (m, a, b)))
    assert kernel_cost(x) == Cost()  # inputs are not kernels


def test_devices_rank_the_same_kernel_by_their_figures():
    ty = "f16[2,4096,320]"
    x = Term("Input", "arg0", ty)
    kernel = Term("Pointwise", Term("Unary", "exp", load(x), ty), ty)
    seconds = {name: kernel_cost(kernel, name).seconds for name in ("h200", "h100", "a100", "cpu")}
    assert seconds["h200"] < seconds["h100"] < seconds["a100"] < seconds["cpu"]
