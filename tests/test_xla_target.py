"""measure.xla_target: XLA's kernels for an H100, compiled without a GPU.

The compile tests need the `cuda-target` extra (jax-cuda12-plugin + jax-cuda12-pjrt) and are
skipped without it; the dump-parsing and missing-plugin tests run everywhere.
"""

from __future__ import annotations

import os
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest

from measure import xla_target
from measure.xla_target import XlaTargetWarning, compile_for_h100, parse_dump

needs_cuda_target = pytest.mark.skipif(
    xla_target.unavailable_reason() is not None, reason=str(xla_target.unavailable_reason())
)


def matmul_bias_relu(x, w, b):
    return jax.nn.relu(x @ w + b)


def conv_silu(x, w):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "OIHW", "NHWC"))
    return y * jax.nn.sigmoid(y)


def broken(x):
    raise ValueError("this function does not trace")


F16 = jnp.float16


@needs_cuda_target
def test_matmul_bias_relu_is_one_or_two_kernels():
    env_before = {key: os.environ.get(key) for key in ("XLA_FLAGS", "JAX_PLATFORMS")}
    report = compile_for_h100(
        matmul_bias_relu,
        jax.ShapeDtypeStruct((128, 256), F16),
        jax.ShapeDtypeStruct((256, 512), F16),
        jax.ShapeDtypeStruct((512,), F16),
    )
    assert report is not None
    assert 1 <= report.kernels <= 2, report.launches
    assert any(category.startswith("gemm") for category in report.by_category), report.by_category
    assert report.temp_bytes >= 0 and report.argument_bytes == (128 * 256 + 256 * 512 + 512) * 2
    assert report.output_bytes == 128 * 512 * 2
    # Every kernel reads its operands and writes its result: at least x, w, b in and y out.
    assert report.modeled_bytes >= report.argument_bytes + report.output_bytes
    assert report.compile_seconds > 0 and report.wall_seconds >= report.compile_seconds
    assert report.device == "NVIDIA H100 80GB HBM3"
    assert report.dump_dir is None
    # The calling process keeps its platform and flags.
    assert jax.default_backend() == "cpu"
    assert {key: os.environ.get(key) for key in env_before} == env_before


@needs_cuda_target
def test_convolution_goes_to_cudnn_and_arrays_are_abstracted(tmp_path):
    x = jnp.zeros((2, 16, 16, 32), F16)  # a concrete array: only its shape and dtype travel
    report = compile_for_h100(conv_silu, x, jax.ShapeDtypeStruct((64, 32, 3, 3), F16), keep_dump=tmp_path / "dump")
    assert report is not None
    assert report.by_category.get("conv (cuDNN)") == 1, report.by_category
    assert report.kernels <= 4, report.launches  # conv (+ weight/layout transposes) + the SiLU epilogue
    assert report.dump_dir == str(tmp_path / "dump")
    assert list((tmp_path / "dump").glob("*thunk_sequence.txt"))


@needs_cuda_target
def test_module_function_string_and_static_arguments():
    report = compile_for_h100("jax.numpy:sin", jax.ShapeDtypeStruct((1024,), jnp.float32))
    assert report is not None and report.kernels == 1

    report = compile_for_h100(jnp.sum, jax.ShapeDtypeStruct((64, 128), jnp.float32), 1, static_argnums=1)
    assert report is not None and report.by_category == {"reduction fusion": 1}, report.by_category


@needs_cuda_target
def test_a_failing_function_raises_with_the_subprocess_traceback():
    with pytest.raises(RuntimeError, match="does not trace"):
        compile_for_h100(broken, jax.ShapeDtypeStruct((4,), jnp.float32))


def test_missing_plugin_returns_none_and_says_so(no_cuda_target):
    assert "not installed" in xla_target.unavailable_reason()
    assert "measure.cuda_target install" in xla_target.unavailable_reason()
    with pytest.warns(XlaTargetWarning, match="no index reachable"):
        report = compile_for_h100(matmul_bias_relu, jax.ShapeDtypeStruct((8, 8), F16))
    assert report is None


def test_target_config_falls_back_to_the_packaged_copy(monkeypatch, tmp_path):
    monkeypatch.setattr(xla_target, "SHARED_TARGET_CONFIG", tmp_path / "absent.txtpb")
    assert xla_target.target_config_text() == xla_target.H100_TARGET_CONFIG
    shared = xla_target.Path(xla_target.__file__).resolve().parents[2] / "shared" / "h100_target_config.txtpb"
    if shared.is_file():  # the packaged copy is the shared file, verbatim
        assert shared.read_text() == xla_target.H100_TARGET_CONFIG


# A dump as XLA 0.10.2 writes it (trimmed): a command buffer's kernels, a copy, a memset, a while
# loop whose body holds a GEMM, a cuDNN convolution, and a thunk kind this module has never seen.
SEQUENCE = textwrap.dedent(
    """\
    001: kCustomKernel [source       | next=002 (1)] wrapped_transpose grid: [18, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    002: kConvolution  [prev=001 (1) | next=003 (1)] kConvolution
    003: kCustomKernel [prev=002 (1) | next=004 (1)] loop_multiply_fusion grid: [2048, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    004: kCopy         [prev=002 (4) | next=005 (2)] kCopy
    005: kMemset32BitValue [prev=004 (1) | next=006 (1)] kMemset32BitValue
    006: kWhile        [prev=005 (1) | next=011 (1)]
    condition:
        007: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        008: kCustomKernel [source       | next=009 (1)] gemm_fusion_dot_general_0 grid: [32, 1, 1] threads: [64, 1, 1]  shared_memory: 1024 bytes
        009: kCopy         [prev=008 (1) | sink        ] kCopy
    011: kCustomKernel [prev=006 (1) | next=012 (1)] input_reduce_fusion grid: [2, 1, 1] threads: [1024, 1, 1]  shared_memory: 0 bytes
    012: kBrandNewThunk [prev=011 (1) | sink        ] whatever
    """
)
METADATA = "\n".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n  thunk_kind: "{kind}"\n}}'
    for i, name, kind in [
        (1, "wrapped_transpose", "kCustomKernel"),
        (2, "cudnn-conv.1", "kConvolution"),
        (3, "loop_multiply_fusion", "kCustomKernel"),
        (8, "gemm_fusion_dot_general.0", "kCustomKernel"),
        (11, "input_reduce_fusion", "kCustomKernel"),
    ]
)
HLO = textwrap.dedent(
    """\
    ENTRY %main.1 (w.1: f16[64,32,3,3], x.1: f16[2,16,16,32]) -> f32[2] {
      %w.1 = f16[64,32,3,3]{3,2,1,0} parameter(0), metadata={op_name="w"}
      %x.1 = f16[2,16,16,32]{3,2,1,0} parameter(1), metadata={op_name="x"}
      %bitcast.1 = f16[64,32,9]{2,1,0} bitcast(%w.1)
      %wrapped_transpose = f16[64,3,3,32]{3,2,1,0} fusion(%bitcast.1), kind=kLoop, calls=%t, metadata={op_name="jit(f)/blocks.0/transpose"}
      %cudnn-conv.1 = (f16[2,16,16,64]{3,2,1,0}, u8[1024]{0}) custom-call(%x.1, %wrapped_transpose), custom_call_target="__cudnn$convForward", metadata={op_name="jit(f)/blocks.0/blocks.0.conv/conv_general_dilated"}
      %get-tuple-element.1 = f16[2,16,16,64]{3,2,1,0} get-tuple-element(%cudnn-conv.1), index=0
      %loop_multiply_fusion = f16[2,16,16,64]{3,2,1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%m, metadata={op_name="jit(f)/blocks.0/mul"}
      %gemm_fusion_dot_general.0 = f32[2,2]{1,0} fusion(%x.1), kind=kCustom, calls=%g, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
      ROOT %input_reduce_fusion = f32[2]{0} fusion(%loop_multiply_fusion), kind=kInput, calls=%r
    }
    """
)


def test_parse_dump_counts_launches_not_structure(tmp_path):
    prefix = str(tmp_path / "module_0001.jit_f.")
    (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text(SEQUENCE)
    (tmp_path / "module_0001.jit_f.thunk_metadata.txt").write_text(METADATA)
    (tmp_path / "module_0001.jit_f.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    parsed = parse_dump(prefix)
    # transpose, conv, multiply, compare (loop condition), gemm (loop body), reduce, the unknown kind
    assert parsed["kernels"] == 7
    assert parsed["copies"] == 2 and parsed["memsets"] == 1
    assert parsed["loop_kernels"] == 2
    assert parsed["unknown_kinds"] == ["kBrandNewThunk"]
    assert parsed["by_kind"]["kWhile"] == 1 and parsed["by_kind"]["kCopy"] == 2
    assert parsed["by_category"] == {
        "transpose": 1,
        "conv (cuDNN)": 1,
        "loop fusion": 2,
        "gemm (Triton)": 1,
        "reduction fusion": 1,
        "other kernel": 1,
    }
    launches = {launch["name"]: launch for launch in parsed["launches"]}
    conv = launches["cudnn-conv.1"]
    # operands x (16,384 B) + transposed w (36,864 B) + result (65,536 B); the u8 workspace is left out
    assert conv["bytes"] == 2 * 16 * 16 * 32 * 2 + 64 * 32 * 9 * 2 + 2 * 16 * 16 * 64 * 2
    assert conv["scope"] == "blocks.0/blocks.0.conv"
    assert launches["wrapped_transpose"]["reads_only_inputs"]  # a weight layout change
    assert not launches["loop_multiply_fusion"]["reads_only_inputs"]
    assert parsed["module"] == "module_0001.jit_f"


def test_report_round_trips_through_json(tmp_path):
    (tmp_path / "m.thunk_sequence.txt").write_text(SEQUENCE)
    parsed = parse_dump(str(tmp_path / "m."))
    parsed.update(
        temp_bytes=1, argument_bytes=2, output_bytes=3, bytes_accessed=None, lower_seconds=0.1,
        compile_seconds=0.2, wall_seconds=0.3, device="H100", dump_dir=None,
    )
    report = xla_target.XlaReport.from_json(parsed)
    assert xla_target.XlaReport.from_json(report.to_json()) == report
    assert report.total_launches == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "7 kernels (+2 copies, 1 memsets)" in report.summary()
