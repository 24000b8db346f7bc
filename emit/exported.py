"""Emitted stages kept on disk as serialized StableHLO (`jax.export`), so that a new process whose
plan came from the plan cache calls the stored program instead of tracing and lowering every kernel
again (the UNet step's emission: ~18 s of Python on an idle 2-core machine before XLA compiles).

    stages = ExportedStages(directory, plan_key, backend, interpret)
    out = stages.call("per_call", stage_fn, leaves, prepared)   # None: run stage_fn as before

`emit.prepare.Prepared` asks it for its two stages (prepare and per-call) when it is called with
concrete arrays on one device and `optimize`'s plan cache is on, for every backend but
"interpret"; `Lowered.executable` passes the plan's cache key and `<cache dir>/exported`
(`driver.cache`), and turns JAX's persistent compilation cache on for the executables
(`driver.cache.use_jax_compilation_cache`). `seconds` says where an instance's time went.

- First call of a signature with no entry: `jax.export.export(jax.jit(stage_fn))` traces and
  lowers the stage once (what the jitted stage did before), the serialized `Exported` is written
  (temporary file + `os.replace`, as plan entries are), and the call runs `Exported.call` under
  `jax.jit`: the stage is traced once per process either way.
- With an entry: it is deserialized (milliseconds) and called; nothing is traced but a call.
- The entry's name digests the plan key, the stage, the argument shapes and dtypes, the platform,
  the backend and `interpret`, and the jax and jaxlib versions. A stage that does not export (GPU
  interpret mode's host callbacks, a primitive without a serialization rule) runs as before, and
  the reason is kept in `failures`; an unreadable entry warns once (`ExportCacheWarning`) and is
  exported again.

Custom calls the export accepts although JAX does not guarantee their stability across versions:
Pallas' Triton kernels (`__gpu$xla.gpu.triton`); the versions are in the entry name, so an entry is
never read by another jax.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import warnings
from pathlib import Path

import jax
import numpy as np

from emit.top_level_jit import TopLevelJit

FORMAT = 1
UNSTABLE_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)


class ExportCacheWarning(UserWarning):
    """An exported stage could not be read from the cache: it is exported again and rewritten."""


def _platform(arrays) -> str:
    for array in arrays:
        devices = getattr(array, "devices", None)
        if devices is not None:
            return next(iter(devices())).platform
    return jax.default_backend()


def concrete_on_one_device(arrays) -> bool:
    """Whether every array is concrete (a `jax.Array` that is no tracer, or a NumPy array) and the
    process sees one device."""
    return jax.device_count() == 1 and all(
        isinstance(a, np.ndarray) or (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)) for a in arrays)


class ExportedStages:
    """The exported stages of one emitted plan (see the module docstring)."""

    def __init__(self, directory: Path, plan_key: str, backend: str, interpret: bool | None, compiler_options=None):
        self.directory = Path(directory)
        self.plan_key = plan_key
        self.backend = backend
        self.interpret = interpret
        self.compiler_options = dict(compiler_options or {})  # XLA's, for compiling the stages
        self.hits = 0       # stages read from the cache
        self.exports = 0    # stages exported and written
        self.failures: dict[str, str] = {}  # entry name -> why the stage did not export
        # wall seconds: reading and deserializing entries, tracing and lowering stages to export
        # them, serializing and writing them
        self.seconds = {"read": 0.0, "export": 0.0, "write": 0.0}
        self._calls: dict[str, object] = {}  # entry name -> jax.jit(Exported.call)
        self._names: dict[tuple, str] = {}  # (stage, tree, platform, leaf shapes and dtypes) -> entry name

    def call(self, stage: str, fn, *args):
        """`fn(*args)` through the exported stage; None when this stage cannot go through it (the
        caller runs `fn` its own way)."""
        call = self.callable(stage, fn, *args)
        return None if call is None else call(*args)

    def callable(self, stage: str, fn, *args):
        """The jitted exported stage for arguments of the signature of `args` (exported or read
        now if need be); None when this stage cannot go through it."""
        arrays, tree = jax.tree_util.tree_flatten(args)
        if not concrete_on_one_device(arrays):
            return None
        platform = _platform(arrays)
        # Called on every call of the optimized function: the entry's name is digested once per
        # signature (dtype objects hash in nanoseconds; their names cost microseconds a leaf).
        key = (stage, tree, platform, tuple((a.shape, a.dtype) for a in arrays))
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self.entry_name(stage, args, platform)
        if name in self.failures:
            return None
        call = self._calls.get(name)
        if call is None:
            exported = self._load(name) or self._export(name, fn, args, _platform(arrays))
            if exported is None:
                return None
            call = self._calls[name] = TopLevelJit(exported.call, self.compiler_options, label=stage)
        return call

    def entry_name(self, stage: str, args, platform: str) -> str:
        import jaxlib

        leaves, tree = jax.tree_util.tree_flatten(args)
        shapes = [(tuple(a.shape), str(a.dtype)) for a in leaves]
        text = repr((FORMAT, self.plan_key, stage, str(tree), shapes, platform, self.backend, self.interpret,
                     jax.__version__, jaxlib.__version__))
        return f"{stage}-{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}"

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    def _load(self, name: str):
        began = time.perf_counter()
        try:
            return self._read(name)
        finally:
            self.seconds["read"] += time.perf_counter() - began

    def _read(self, name: str):
        path = self.path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            warnings.warn(f"eqsat export cache: cannot read {path} ({error}); exporting again", ExportCacheWarning,
                          stacklevel=5)
            return None
        try:
            exported = jax.export.deserialize(bytearray(raw))
        except Exception as error:  # a truncated or foreign file: flatbuffers raises many kinds
            warnings.warn(f"eqsat export cache: ignoring the unreadable entry {path} ({type(error).__name__}: "
                          f"{error}); exporting again and rewriting it", ExportCacheWarning, stacklevel=5)
            return None
        self.hits += 1
        return exported

    def _export(self, name: str, fn, args, platform: str):
        checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in UNSTABLE_CUSTOM_CALLS]
        began = time.perf_counter()
        try:
            exported = jax.export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(*args)
            traced = time.perf_counter()
            data = exported.serialize()
        except Exception as error:  # the stage itself is fine; it only does not serialize
            self.failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.seconds["export"] += time.perf_counter() - began
            return None
        self.seconds["export"] += traced - began
        self._store(name, data)
        self.seconds["write"] += time.perf_counter() - traced
        self.exports += 1
        return exported

    def _store(self, name: str, data: bytes) -> None:
        path, temporary = self.path(name), None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:  # a read-only cache still runs the exported stage
            warnings.warn(f"eqsat export cache: cannot write {path} ({error})", ExportCacheWarning, stacklevel=4)
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
