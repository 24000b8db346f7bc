"""Keeping an installed CUDA plugin quiet on a machine without an NVIDIA GPU.

The `cuda-target` extra installs `jax-cuda12-plugin` so that `measure.xla_target` can compile for an
H100 without one. On a machine with no GPU, that plugin is noise: `import jax` loads its extension
modules, each of which prints absl lines (`cudart_stub.cc:31] Could not find cuda drivers on your
machine`), and the first array prints a traceback ending in `RuntimeError: Unable to load CUDA. Is
it installed?`. Nothing failed: JAX runs on the CPU. Both come from C++ static initializers and
from the plugin's `initialize()`, which no logging setting silences, so `hide_plugin_without_gpu()`
(run by `import eqsat` and `import sd15`) keeps the plugin from loading at all:

- `jax_cuda12_plugin` / `jax_cuda13_plugin` (GPU kernels for solvers, PRNG, Triton): still found
  (`importlib.util.find_spec` says they are installed), but importing them raises
  `ModuleNotFoundError`, which jaxlib already treats as "no CUDA kernels";
- `jax_plugins.xla_cuda12` / `xla_cuda13` (the PJRT plugin JAX discovers at backend start): a stub
  whose `initialize()` registers nothing, so JAX starts with its CPU backend only.

It does this only when no GPU is present (no `/dev/nvidia*` or `/dev/dxg` device node and no
loadable `libcuda.so.1`), `JAX_PLATFORMS` does not ask for CUDA, and `EQSAT_CUDA_PLUGIN` is not
`1`. A machine with a GPU is never touched. `measure.xla_target` sets `EQSAT_CUDA_PLUGIN=1` in its
compile subprocess, which needs the plugin's H100 compiler; so can anyone else who wants it.
A plugin module that was imported before `import eqsat` stays as it is.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.abc
import importlib.machinery
import os
import sys

_DEVICE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg")
_DRIVER_LIBRARIES = ("libcuda.so.1", "libcuda.so")
_KERNEL_PACKAGES = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_PJRT_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_CUDA_PLATFORMS = ("cuda", "gpu")


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA device node or a loadable CUDA driver."""
    if any(glob.glob(pattern) for pattern in _DEVICE_GLOBS):
        return True
    for library in _DRIVER_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError:
            continue
        return True
    return False


def should_hide_plugin() -> bool:
    """No GPU, and nobody asked for the CUDA plugin (`JAX_PLATFORMS`, `EQSAT_CUDA_PLUGIN=1`)."""
    if os.environ.get("EQSAT_CUDA_PLUGIN") == "1":
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "").lower().split(",")
    if any(p.strip() in _CUDA_PLATFORMS for p in platforms):
        return False
    return not gpu_present()


class _PluginStub(importlib.abc.Loader):
    """A PJRT plugin module whose `initialize()` registers nothing."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = "Stand-in for the CUDA PJRT plugin on a machine without a GPU (eqsat.quiet_cuda)."
        module.initialize = lambda: None


class _Unloadable(importlib.abc.Loader):
    """An installed CUDA kernel package that refuses to load (found by `find_spec`, not importable)."""

    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name!r} is not loaded: no GPU on this machine (eqsat.quiet_cuda; "
                                  f"set EQSAT_CUDA_PLUGIN=1 to load it)", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable: create_module refuses")


class _HideCudaPlugin(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _PJRT_PLUGINS and name not in _KERNEL_PACKAGES:
            return None
        installed = importlib.machinery.PathFinder.find_spec(name, path)
        if installed is None:
            return None
        loader = _PluginStub() if name in _PJRT_PLUGINS else _Unloadable()
        return importlib.machinery.ModuleSpec(name, loader, origin=installed.origin)


def hide_plugin_without_gpu() -> bool:
    """Install the import hook when `should_hide_plugin()`; returns whether it is installed."""
    if any(isinstance(finder, _HideCudaPlugin) for finder in sys.meta_path):
        return True
    if not should_hide_plugin():
        return False
    sys.meta_path.insert(0, _HideCudaPlugin())
    return True
