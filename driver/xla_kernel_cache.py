"""XLA's own cache of compiled GPU kernels, one file per GPU kind, for the executables of eqsat's plans.

JAX's persistent compilation cache keeps whole executables; whether it hits on a GPU for programs
with Triton kernels is unmeasured here (jax-ml/jax#26304 reports misses, and a deviceless compile
cannot read its entries back). XLA has a second cache below it: `--xla_gpu_kernel_cache_file`
keeps each compiled kernel (Triton kernels included: the cubin, its launch dimensions and shared
memory) under a fingerprint of the kernel's computation (its name and Triton IR). XLA reads the file
at the start of a compile and merges its new kernels into it at the end (a temporary file and a
rename). A second process compiling the same kernels then skips Triton's pipeline, LLVM and ptxas
for them: the tiny VAE's per-call executable, compiled deviceless for an H100, took 4.5 s cold and
0.09 s from the file (`benchmarks.compile`; the full-size figures are in benchmarks/README.md).

    jax.jit(fn, compiler_options=compiler_options())   # {} off a GPU, or when the user set the flag

Three things make the file eqsat's to manage rather than a flag for the user:
- the fingerprint leaves out the GPU, so a cubin built for sm_90 would be handed to an sm_80
  compile: one file per compute capability and jaxlib version, `<cache dir>/xla-kernels/
  sm90-jaxlib0.10.2.pb` (`driver.cache.xla_kernels_dir`); a process whose GPUs differ in compute
  capability gets no file;
- a truncated or foreign file fails every compile that reads it ("Can't parse ... as binary
  proto", "Read less bytes than requested"): before XLA is pointed at it, the file's protobuf
  structure is checked once per process (`well_formed`), and a bad file is removed with one
  `KernelCacheWarning` (XLA writes a new one);
- left alone: a kernel cache file the user gave XLA in `XLA_FLAGS`, and everything when
  `EQSAT_XLA_KERNEL_CACHE=0`.

`optimize` passes these options to the jits that compile an emitted plan when its plan cache is on
(`driver.optimize.Lowered.executable`); `eqsat cache info|clear` count and clear the folder.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from driver.cache import xla_kernels_dir

SWITCH = "EQSAT_XLA_KERNEL_CACHE"  # "0" (or off, false, no): no kernel cache file from eqsat
OPTION = "xla_gpu_kernel_cache_file"
CUDA_PLATFORMS = ("gpu", "cuda")  # `Device.platform` of a CUDA device, and of a deviceless CUDA topology's

_checked: set[Path] = set()
_lock = threading.Lock()


class KernelCacheWarning(UserWarning):
    """XLA's kernel cache file was unreadable: it is removed, and XLA writes a new one."""


def opted_out() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() in ("0", "off", "false", "no")


def user_flag_set() -> bool:
    """Whether `XLA_FLAGS` already names a kernel cache file (the user's, left alone)."""
    return f"--{OPTION}" in os.environ.get("XLA_FLAGS", "")


def cache_file(devices) -> Path | None:
    """The kernel cache file for compiles on `devices`: CUDA GPUs of one compute capability, else None."""
    devices = list(devices)
    if not devices or any(getattr(d, "platform", None) not in CUDA_PLATFORMS for d in devices):
        return None
    capabilities = {str(getattr(d, "compute_capability", "") or "") for d in devices}
    if len(capabilities) != 1 or "" in capabilities:
        return None
    import jaxlib

    capability = capabilities.pop().replace(".", "")
    return xla_kernels_dir() / f"sm{capability}-jaxlib{jaxlib.__version__}.pb"


def compiler_options(devices=None) -> dict[str, str]:
    """`jax.jit`'s `compiler_options` that give XLA the kernel cache file of `devices` (default: the
    default backend's devices); empty where there is none (not a CUDA GPU, opted out, the user's flag)."""
    if opted_out() or user_flag_set():
        return {}
    if devices is None:
        import jax

        devices = jax.devices()
    path = cache_file(devices)
    if path is None:
        return {}
    checked(path)
    return {OPTION: str(path)}


def checked(path: Path) -> Path:
    """`path`, its folder made and, once per process, a malformed file removed (with a warning)."""
    path = Path(path)
    with _lock:
        if path in _checked:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as error:
            data, reason = b"", f"unreadable ({error})"
        else:
            reason = "not a kernel cache (malformed protobuf)"
        if data is not None and not well_formed(data):
            warnings.warn(f"eqsat: XLA's kernel cache file {path} is {reason}; removing it (XLA writes a new one)",
                          KernelCacheWarning, stacklevel=4)
            path.unlink(missing_ok=True)
        _checked.add(path)
    return path


# --- the file's structure ------------------------------------------------------------------------
# XLA's CompilationCacheProto: field 1 repeated (a map entry: 1 the kernel's name, 2 its entry:
# fingerprint, launch dimensions, shared memory, binary), field 2 the format's version (a varint).

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def well_formed(data: bytes) -> bool:
    """Whether `data` has the structure of XLA's kernel cache: every field of the file, of each map
    entry and of each entry's value well delimited and ending where its message ends. (A cubin's
    bytes are not looked into: XLA's parser does not either.)"""
    try:
        for number, wire, span in _fields(data, 0, len(data)):
            if (number, wire) == (2, _VARINT):
                continue
            if (number, wire) != (1, _LENGTH):
                return False
            entry = {n: (w, s) for n, w, s in _fields(data, *span)}
            if entry.get(1, (_LENGTH,))[0] != _LENGTH or entry.get(2, (None,))[0] != _LENGTH:
                return False
            list(_fields(data, *entry[2][1]))
    except ValueError:
        return False
    return True


def _fields(data: bytes, start: int, end: int):
    """(field number, wire type, (start, end) of a length-delimited value or None) of the message in
    `data[start:end]`; ValueError where it is not a well-formed message."""
    position = start
    while position < end:
        key, position = _varint(data, position, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == _VARINT:
            _, position = _varint(data, position, end)
            span = None
        elif wire == _LENGTH:
            length, position = _varint(data, position, end)
            span = (position, position + length)
            position += length
        elif wire in (_FIXED64, _FIXED32):
            position += 8 if wire == _FIXED64 else 4
            span = None
        else:
            raise ValueError(f"wire type {wire}")
        if position > end:
            raise ValueError("a field runs past its message")
        yield number, wire, span


def _varint(data: bytes, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise ValueError("a truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, position
