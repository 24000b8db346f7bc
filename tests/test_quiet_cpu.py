"""On a machine without a GPU, installing eqsat changes nothing a JAX program prints: the CUDA plugin
of the H100 compile target lives outside the environment (`measure.cuda_target`), so a plain
`import jax` script stays quiet. And where a CUDA plugin is on the path anyway (installed by hand,
or the `cuda-target` extra), it stays quiet too: no "Unable to load CUDA" traceback, no absl
`cudart_stub` lines, from `import eqsat`, `import sd15`, the `sd15` commands and the tests; a machine
with a GPU keeps using it (see `eqsat.quiet_cuda`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eqsat import quiet_cuda
from measure import cuda_target

NOISE = ("Unable to load CUDA", "cudart_stub", "Could not find cuda drivers", "absl::InitializeLog",
         "Jax plugin configuration error", "CUDA backend failed")

PLUGIN_PATHS = [] if cuda_target.plugin_in_environment() else cuda_target.search_paths()
needs_plugin = pytest.mark.skipif(not (cuda_target.plugin_in_environment() or PLUGIN_PATHS),
                                  reason="no CUDA plugin installed (neither here nor in eqsat's target dir): "
                                         "nothing could be noisy")
needs_cpu_only = pytest.mark.skipif(quiet_cuda.gpu_present(), reason="this machine has a GPU")


def user_environment(plugin_on_path: bool = True) -> dict[str, str]:
    """The environment a user's shell has: none of the test session's JAX settings. With
    `plugin_on_path`, the CUDA plugin is importable as if installed into the environment (eqsat's
    target dir on PYTHONPATH when that is where it lives)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "XLA_", "TF_CPP", "EQSAT_"))}
    extra = PLUGIN_PATHS if plugin_on_path else []
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@needs_cpu_only
@pytest.mark.skipif(cuda_target.plugin_in_environment(),
                    reason="jax-cuda12-plugin is installed in this Python environment itself (by hand or the "
                           "`cuda-target` extra), not in eqsat's target dir: plain JAX loads it here")
def test_a_plain_jax_program_is_quiet_after_installing_eqsat():
    """The user's own JAX script, eqsat not imported: exactly what it printed before eqsat was installed."""
    code = "import jax, jax.numpy as jnp; print(jax.devices()[0].platform, jnp.ones(3).sum())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=user_environment(plugin_on_path=False), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "cpu 3.0" and done.stderr == "", done.stderr[-3000:]


def test_installing_eqsat_with_its_tests_puts_no_cuda_plugin_in_the_environment():
    """Only the opt-in `cuda-target` extra names the plugin; the target is installed beside, not in, the env."""
    import importlib.metadata

    requirements = importlib.metadata.requires("eqsat") or []
    pulled = [r for r in requirements if "cuda" in r.lower() and "cuda-target" not in r]
    assert pulled == [], pulled


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, env=user_environment(), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def assert_quiet(done: subprocess.CompletedProcess) -> None:
    for stream in (done.stdout, done.stderr):
        for line in NOISE:
            assert line not in stream, f"{line!r} printed:\n{stream[-3000:]}"


@needs_plugin
@needs_cpu_only
@pytest.mark.parametrize("code", [
    "import eqsat; import jax.numpy as jnp; jnp.ones(3).block_until_ready()",
    "import sd15; import jax.numpy as jnp; jnp.ones(3).block_until_ready()",
    "import eqsat, jax; assert jax.devices()[0].platform == 'cpu', jax.devices()",
])
def test_imports_are_quiet(code):
    assert_quiet(run([sys.executable, "-c", code]))


@needs_plugin
@needs_cpu_only
def test_no_traceback_when_jax_was_imported_first():
    """`import jax` has loaded the plugin's extension modules already (their absl lines are out of our
    hands), but the backend start no longer prints the "Unable to load CUDA" traceback."""
    done = run([sys.executable, "-c", "import jax; import eqsat; import jax.numpy as jnp; print(jnp.ones(3).sum())"])
    assert "Unable to load CUDA" not in done.stderr and "Jax plugin configuration error" not in done.stderr
    assert done.stdout.strip() == "3.0"


@needs_plugin
@needs_cpu_only
def test_sd15_commands_are_quiet(tmp_path):
    cli = [sys.executable, "-c", "import sys; from sd15.cli import main; sys.exit(main())"]
    assert_quiet(run(cli + ["--help"]))
    assert_quiet(run(cli + ["plan", "--help"]))
    out = tmp_path / "tiny.png"
    done = run(cli + ["generate", "--tiny", "--prompt", "hi", "--steps", "1", "--size", "32", "--out", str(out)])
    assert_quiet(done)
    assert out.exists()


@needs_plugin
@needs_cpu_only
def test_the_h100_compile_target_still_loads_the_plugin():
    """`EQSAT_CUDA_PLUGIN=1` (set by `measure.xla_target` for its compile subprocess) keeps the plugin."""
    code = ("import eqsat, jax; from jax.experimental import topologies; "
            "import jax_plugins.xla_cuda12 as p; assert hasattr(p, '_check_cuda_versions'), p")
    env = user_environment()
    env["EQSAT_CUDA_PLUGIN"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_gpu_detection(monkeypatch, tmp_path):
    monkeypatch.setattr(quiet_cuda, "_DEVICE_GLOBS", (str(tmp_path / "nvidia*"),))
    monkeypatch.setattr(quiet_cuda, "_DRIVER_LIBRARIES", ("libcuda-that-does-not-exist.so.1",))
    assert not quiet_cuda.gpu_present()
    (tmp_path / "nvidia0").touch()
    assert quiet_cuda.gpu_present()


def test_quiet_only_without_a_gpu_and_without_a_cuda_request(monkeypatch):
    monkeypatch.setattr(quiet_cuda, "gpu_present", lambda: True)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert not quiet_cuda.should_hide_plugin()
    monkeypatch.setattr(quiet_cuda, "gpu_present", lambda: False)
    assert quiet_cuda.should_hide_plugin()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")      # the user asked for CUDA: let it speak
    assert not quiet_cuda.should_hide_plugin()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("EQSAT_CUDA_PLUGIN", "1")
    assert not quiet_cuda.should_hide_plugin()
