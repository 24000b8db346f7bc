"""XLA's kernel cache file (`driver.xla_kernel_cache`): one file per GPU kind, checked before XLA
reads it, given to the jits that compile an emitted plan, and hit by a second process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import eqsat
from driver import cache as plan_cache
from driver import xla_kernel_cache as kernel_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EQSAT_CACHE_DIR", str(tmp_path / "eqsat"))
    monkeypatch.delenv(kernel_cache.SWITCH, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    kernel_cache._checked.clear()
    yield tmp_path / "eqsat"
    kernel_cache._checked.clear()


def gpu(capability="9.0", platform="gpu"):
    return SimpleNamespace(platform=platform, compute_capability=capability, device_kind="NVIDIA H100 80GB HBM3")


def test_one_file_per_compute_capability_and_jaxlib(cache_dir):
    path = kernel_cache.cache_file([gpu(), gpu()])
    assert path == cache_dir / "xla-kernels" / f"sm90-jaxlib{jaxlib.__version__}.pb"
    assert kernel_cache.cache_file([gpu("8.0")]).name.startswith("sm80-")
    assert kernel_cache.cache_file([gpu(platform="cuda")]) == path  # a deviceless CUDA topology's devices


@pytest.mark.parametrize("devices", [
    [gpu("9.0"), gpu("8.0")],                                     # a kernel built for one would run on the other
    [gpu(capability="")],                                         # no compute capability to key the file by
    [SimpleNamespace(platform="cpu", compute_capability=None)],
    [SimpleNamespace(platform="rocm", compute_capability="gfx942")],
    [],
])
def test_no_file_where_one_file_would_be_wrong(cache_dir, devices):
    assert kernel_cache.cache_file(devices) is None
    assert kernel_cache.compiler_options(devices) == {}


def test_options_name_the_file_and_make_its_folder(cache_dir):
    options = kernel_cache.compiler_options([gpu()])
    assert options == {"xla_gpu_kernel_cache_file": str(kernel_cache.cache_file([gpu()]))}
    assert Path(options["xla_gpu_kernel_cache_file"]).parent.is_dir()


def test_no_options_on_this_cpu(cache_dir):
    assert kernel_cache.compiler_options() == {}


@pytest.mark.parametrize("switch", ["0", "off", "false", "no"])
def test_opting_out(cache_dir, monkeypatch, switch):
    monkeypatch.setenv(kernel_cache.SWITCH, switch)
    assert kernel_cache.compiler_options([gpu()]) == {}


def test_the_users_own_flag_is_left_alone(cache_dir, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_kernel_cache_file=/somewhere/kernels.pb --xla_dump_to=/tmp/x")
    assert kernel_cache.compiler_options([gpu()]) == {}


# --- the file's structure ------------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def kernel_cache_bytes(kernels: dict[str, bytes]) -> bytes:
    """A CompilationCacheProto as XLA writes it: entries (name -> fingerprint, launch dimensions,
    shared memory, binary) and the format's version."""
    entries = b"".join(
        field(1, field(1, name.encode()) + field(2, field(1, b"fingerprint of " + name.encode())
                                                    + field(2, field(1, 3) + field(2, 128)) + field(4, 24960)
                                                    + field(5, binary)))
        for name, binary in kernels.items())
    return entries + field(2, 3)


KERNELS = {"matmul": bytes(range(256)) * 3, "up_blocks_0_resnets_0_conv": b"\x00\xff" * 500, "empty": b""}


def test_a_file_as_xla_writes_it_is_well_formed():
    assert kernel_cache.well_formed(kernel_cache_bytes(KERNELS))
    assert kernel_cache.well_formed(b"")  # no kernels yet: XLA reads it as an empty cache


def test_every_truncation_inside_a_kernel_is_malformed():
    data = kernel_cache_bytes(KERNELS)
    boundaries = {0, len(data)}
    position = 0
    for _, _, span in kernel_cache._fields(data, 0, len(data)):  # where a top-level field ends
        position = span[1] if span else position
        boundaries.add(position)
    boundaries.add(len(data) - len(field(2, 3)))
    for cut in range(len(data)):
        assert kernel_cache.well_formed(data[:cut]) == (cut in boundaries), cut


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes_are_malformed(seed):
    noise = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert not kernel_cache.well_formed(noise)


@pytest.mark.parametrize("data", [
    field(3, b"x"),                          # a field the file does not have
    field(1, 7),                             # an entry that is not a message
    field(1, field(1, b"name")),             # an entry without its value
    field(1, field(1, b"name") + field(2, b"\x0a\x05ab")),  # a value whose field runs past it
    b"\x0f\x00",                             # wire type 7
    b"\x08" + b"\xff" * 11,                  # a varint that never ends
])
def test_malformed_structures(data):
    assert not kernel_cache.well_formed(data)


def test_a_malformed_file_is_removed_once_with_a_warning(cache_dir):
    path = kernel_cache.cache_file([gpu()])
    path.parent.mkdir(parents=True)
    path.write_bytes(kernel_cache_bytes(KERNELS)[:-40])
    with pytest.warns(kernel_cache.KernelCacheWarning, match="malformed"):
        kernel_cache.compiler_options([gpu()])
    assert not path.exists()
    path.write_bytes(b"garbage written later, by someone else")
    kernel_cache.compiler_options([gpu()])  # checked once per process: XLA's own writes are atomic
    assert path.exists()


def test_a_well_formed_file_is_kept(cache_dir, recwarn):
    path = kernel_cache.cache_file([gpu()])
    path.parent.mkdir(parents=True)
    path.write_bytes(kernel_cache_bytes(KERNELS))
    kernel_cache.compiler_options([gpu()])
    assert path.read_bytes() == kernel_cache_bytes(KERNELS)
    assert not [w for w in recwarn if issubclass(w.category, kernel_cache.KernelCacheWarning)]


def test_cache_info_and_clear_count_the_kernel_files(cache_dir):
    path = kernel_cache.cache_file([gpu()])
    path.parent.mkdir(parents=True)
    path.write_bytes(kernel_cache_bytes(KERNELS))
    found = plan_cache.info()
    assert found["kernel_files"] == 1 and found["bytes"] >= path.stat().st_size
    plan_cache.clear()
    assert not path.exists() and plan_cache.info()["kernel_files"] == 0


# --- given to the jits that compile a plan ---------------------------------------------------------


def mlp(params, x):
    w1, w2 = params
    h = jax.nn.gelu(x @ w1)
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return h @ w2


def mlp_args():
    rng = np.random.default_rng(0)
    params = (rng.standard_normal((24, 40)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32))
    return params, rng.standard_normal((16, 24)).astype(np.float32)


@pytest.fixture
def options_on_this_cpu(cache_dir, monkeypatch):
    """`compiler_options` as on a GPU. XLA's CPU compiler takes the option and has no kernels to cache."""
    options = {"xla_gpu_kernel_cache_file": str(cache_dir / "xla-kernels" / "sm90-test.pb")}
    monkeypatch.setattr(kernel_cache, "compiler_options", lambda devices=None: dict(options))
    return options


def test_a_planned_call_compiles_with_the_options(options_on_this_cpu):
    params, x = mlp_args()
    fast = eqsat.optimize(mlp, backend="xla", params_argnums=0)
    np.testing.assert_allclose(fast(params, x), jax.jit(mlp)(params, x), rtol=1e-5, atol=1e-5)
    run = fast.lower(params, x).executable("xla")
    assert run.compiler_options == options_on_this_cpu
    assert run.exported is not None and run.exported.compiler_options == options_on_this_cpu


def test_the_dispatching_jit_compiles_with_the_options(options_on_this_cpu):
    params, x = mlp_args()
    fast = eqsat.optimize(mlp, backend="xla")
    np.testing.assert_allclose(fast(params, x), jax.jit(mlp)(params, x), rtol=1e-5, atol=1e-5)
    assert fast._jitted is not None
    assert fast.lower(params, x).executable("xla").compiler_options == options_on_this_cpu


@pytest.mark.parametrize("params_argnums", [None, 0])
def test_an_optimized_function_inside_the_users_jit(options_on_this_cpu, params_argnums):
    """JAX refuses `compiler_options` on a jit staged into another: traced, the plan's jits are plain
    (the user's jit compiles them); called again outside, they compile with the options."""
    params, x = mlp_args()
    fast = eqsat.optimize(mlp, backend="xla", params_argnums=params_argnums)
    expected = jax.jit(mlp)(params, x)
    np.testing.assert_allclose(jax.jit(fast)(params, x), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda x: fast(params, x).sum())(x),
                               jax.grad(lambda x: mlp(params, x).sum())(x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fast(params, x), expected, rtol=1e-5, atol=1e-5)


def test_a_top_level_jit_uses_its_options_only_outside_a_trace(monkeypatch):
    from emit.top_level_jit import TopLevelJit

    run = TopLevelJit(lambda x: x * 2, {"xla_gpu_kernel_cache_file": "/nonexistent/kernels.pb"}, progress=False)
    called = []
    for name in ("plain", "optioned"):
        jitted = getattr(run, name)
        monkeypatch.setattr(run, name, lambda *a, jitted=jitted, name=name: called.append(name) or jitted(*a))
    assert float(run(1.5)) == 3.0
    assert float(jax.jit(lambda x: run(x) + 1)(1.5)) == 4.0
    assert called == ["optioned", "plain"]
    assert TopLevelJit(lambda x: x, {}).optioned is None


def test_no_options_without_the_plan_cache(options_on_this_cpu):
    params, x = mlp_args()
    fast = eqsat.optimize(mlp, backend="xla", params_argnums=0, cache=False)
    fast(params, x)
    assert fast.lower(params, x).executable("xla").compiler_options == {}
    assert fast._dispatch_compiler_options() is None


# --- a second process compiling for an H100 (deviceless) ------------------------------------------

COMPILE_TWICE = textwrap.dedent("""
    import warnings
    import jax, jax.numpy as jnp, numpy as np
    import eqsat, emit
    from measure.xla_target import h100_topology
    from driver.xla_kernel_cache import compiler_options
    from tests.test_xla_kernel_cache import mlp

    import sys
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    shapes = (((64, width), (width, 64)), (256, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.float16), shapes,
                                      is_leaf=lambda s: isinstance(s, tuple) and isinstance(s[0], int))
        plan = eqsat.optimize(mlp, cache=False).lower(*args).plan
    jax.config.update("jax_enable_compilation_cache", False)
    topology = h100_topology()
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topology.devices), ("x",)),
                                          jax.sharding.PartitionSpec())
    args = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    options = compiler_options(topology.devices)
    jax.jit(emit.emit(plan, "pallas", interpret=False), compiler_options=options).lower(*args).compile()
    print("KERNELS", len(plan.kernels), options["xla_gpu_kernel_cache_file"])
""")


def compiled_entries(dump: Path) -> set[str]:
    return {name for ptx in dump.glob("*.ptx") for name in re.findall(r"\.visible \.entry (\w+)\(", ptx.read_text())}


def compile_process(tmp_path: Path, dump: str, width: int = 128) -> subprocess.Popen:
    """A fresh process compiling the MLP's plan for the deviceless H100 with eqsat's kernel cache
    options (the cache folder `tmp_path / "eqsat"`), dumping XLA's output in `tmp_path / dump`."""
    from measure import xla_target

    root = Path(__file__).resolve().parent.parent
    env = xla_target._child_env(tmp_path / dump)
    env["EQSAT_CACHE_DIR"] = str(tmp_path / "eqsat")
    env.pop(kernel_cache.SWITCH, None)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env["PYTHONPATH"]])
    return subprocess.Popen([sys.executable, "-c", COMPILE_TWICE, str(width)], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def h100_target_or_skip():
    from measure import xla_target

    reason = xla_target.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the H100 compile target is not usable: {reason}")


def test_a_second_process_compiles_no_kernel_again(tmp_path):
    h100_target_or_skip()
    compiled, files = [], []
    for attempt in ("cold", "warm"):
        stdout = finished(compile_process(tmp_path, f"dump-{attempt}"))
        done = SimpleNamespace(stdout=stdout)
        line = next(line for line in done.stdout.splitlines() if line.startswith("KERNELS"))
        kernels, path = int(line.split()[1]), Path(line.split()[2])
        compiled.append(compiled_entries(tmp_path / f"dump-{attempt}"))
        files.append(path.read_bytes())
    assert path.parent == tmp_path / "eqsat" / "xla-kernels" and path.name.startswith("sm90-")
    assert len(compiled[0]) >= kernels  # every plan kernel (and XLA's own fusions) compiled cold
    assert compiled[1] == set(), compiled[1]  # warm: not one PTX entry, every kernel read from the file
    assert kernel_cache.well_formed(files[0]) and files[1] == files[0]


def test_two_processes_writing_at_once_leave_a_well_formed_file(tmp_path):
    """XLA writes the file through a temporary file and a rename: two compiles of different kernels
    finishing together leave one whole file (one of them may lose its new kernels, never corrupt it)."""
    h100_target_or_skip()
    processes = [compile_process(tmp_path, f"dump-{width}", width) for width in (96, 160)]
    paths = {Path(finished(p).split()[-1]) for p in processes}
    (path,) = paths
    data = path.read_bytes()
    assert kernel_cache.well_formed(data) and b"matmul" in data
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left behind


# --- a status line while XLA compiles --------------------------------------------------------------


def test_the_first_call_compiles_under_a_status_line_once(capsys):
    from emit.top_level_jit import TopLevelJit

    traces = []

    def stage(x):
        traces.append(x.shape)
        return jnp.tanh(x) * 2

    run = TopLevelJit(stage, label="per_call", kernels=7, progress=True)
    x = np.linspace(-3, 3, 12, dtype=np.float32)
    np.testing.assert_allclose(run(x), np.tanh(x) * 2, rtol=1e-6)
    shown = capsys.readouterr().err
    assert "eqsat compile per_call (7 kernels)" in shown
    np.testing.assert_allclose(run(x + 1), np.tanh(x + 1) * 2, rtol=1e-6)
    assert capsys.readouterr().err == "" and len(traces) == 1  # traced once: the call ran what compile made
    assert run.plain._cache_size() == 1


def test_no_status_line_when_progress_is_off(capsys):
    from emit.top_level_jit import TopLevelJit

    run = TopLevelJit(lambda x: x + 1, progress=False)
    assert float(run(np.float32(1))) == 2.0
    assert "eqsat compile" not in capsys.readouterr().err


def test_a_top_level_jit_is_a_jit_for_lower_and_trace(options_on_this_cpu):
    from emit.top_level_jit import TopLevelJit

    run = TopLevelJit(lambda x: x * 3, options_on_this_cpu)
    compiled = run.lower(np.float32(2)).compile()
    assert float(compiled(np.float32(2))) == 6.0
    assert run.trace(np.float32(2)).jaxpr is not None
    assert TopLevelJit(lambda x: x).lower(np.float32(1)) is not None  # no options: the plain jit's
