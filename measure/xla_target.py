"""Count XLA's kernels for an NVIDIA H100 on a machine without a GPU.

    report = compile_for_h100(fn, *abstract_args)       # ShapeDtypeStructs (or arrays), any pytree
    report.kernels, report.temp_bytes, report.by_category, report.compile_seconds

XLA compiles for a GPU it does not have through a compile-only topology: `jax-cuda12-plugin` and
`jax-cuda12-pjrt` (installed outside the environment by `measure.cuda_target`) plus a device description
(`h100_target_config.txtpb`, shipped below as `H100_TARGET_CONFIG`). Arguments are lowered as
`ShapeDtypeStruct`s carrying a `NamedSharding` on that topology's one device, and the compile is
dumped with `XLA_FLAGS=--xla_dump_to=DIR`. XLA reads `XLA_FLAGS` once, when its backends start, so
the compile runs in a fresh subprocess (`python -m measure.xla_target`) with `JAX_PLATFORMS=cpu`;
the calling process keeps its own platform and flags untouched. The function travels to the
subprocess by cloudpickle (functions of importable modules by reference, closures by value) or as
a "module:function" string.

What counts as a kernel. `DIR/*.thunk_sequence.txt` lists, in execution order, every thunk the GPU
executable runs (the list before command-buffer grouping; the grouped `*_after_thunk_passes.txt`
wraps the same thunks in `kCommandBuffer`s). Each thunk line is classified by its kind:

- counted in `kernels`: every kind that launches device code — `kKernel`/`kCustomKernel` (XLA's
  loop/reduction/transpose/scatter fusions, Triton GEMM and Triton normalization/softmax fusions,
  sorts, Pallas kernels lowered through Triton or Mosaic GPU), `kGemm`/`kCublasLtMatmul` (cuBLAS),
  `kConvolution`/`kCuDnn`/`kNorm`/`kConvolutionReorder` (cuDNN), `kFft` (cuFFT),
  `kTriangularSolve`, `kSelectK`, `kCustomCall`, collectives, and any kind this module does not
  know (listed in `unknown_kinds`, so a new XLA kind is never silently dropped);
- counted separately, not in `kernels`: `kCopy` (`copies`: a device-to-device memcpy, run by the
  copy engine, not a kernel) and `kMemset32BitValue`/`kMemzero` (`memsets`: driver memsets).
  `launches` = kernels + copies + memsets. Leaving them out of `kernels` can only make XLA's count
  smaller, never ours look better;
- not counted: structure and synchronization — `kWhile`, `kConditional`, `kSequential`,
  `kCommandBuffer` (their nested thunks are counted instead), stream waits, host transfers,
  infeed/outfeed, send/recv, partition/replica ids.

Thunks inside a `while` body are counted once (the static kernel count of the executable);
`loop_kernels` says how many of `kernels` sit in loop bodies, so launches per run are higher when
it is non-zero.

Bytes. `compiled.cost_analysis()` is empty for a compile-only CUDA executable, so
`bytes_accessed` is usually None. `modeled_bytes` is the same roofline model eqsat's cost model
uses, applied to XLA's optimized HLO: for every launched kernel and copy, the bytes of its operands
plus the bytes of its result (a workspace `u8` element of a library call's result tuple is left
out). `temp_bytes` is `compiled.memory_analysis().temp_size_in_bytes`.

Deviceless compilation cannot autotune: XLA picks GEMM tilings (and cuBLAS vs Triton) by
heuristics, so a real H100 may pick other GEMM kernels; the fusion decisions, and so the launch
count, come from the same passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from measure import cuda_target

# A copy of ../shared/h100_target_config.txtpb, so an installed package compiles without the repo.
H100_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# The repository's copy, preferred when present: <repo>/../shared/h100_target_config.txtpb.
SHARED_TARGET_CONFIG = Path(__file__).resolve().parent.parent.parent / "shared" / "h100_target_config.txtpb"

# The deviceless CUDA compile needs the PJRT plugin and the jax CUDA plugin; measure.cuda_target keeps
# them outside the user's environment.
PLUGIN_DISTRIBUTIONS = cuda_target.PLUGIN_DISTRIBUTIONS
INSTALL_HINT = "run `python -m measure.cuda_target install` (jax-cuda12-plugin and jax-cuda12-pjrt matching jax)"

COPY_KINDS = frozenset({"kCopy"})
MEMSET_KINDS = frozenset({"kMemset32BitValue", "kMemzero"})
# Structure, synchronization and host traffic: no device code of their own.
NON_LAUNCH_KINDS = frozenset({
    "kWhile", "kConditional", "kSequential", "kCommandBuffer",
    "kWaitForStreams", "kHostSend", "kHostSendDone", "kHostRecv", "kHostRecvDone",
    "kHostExecuteStart", "kHostExecuteDone", "kInfeed", "kOutfeed", "kSend", "kSendDone",
    "kRecv", "kRecvDone", "kSendHost", "kRecvHost", "kPartitionId", "kReplicaId",
    "kCollectiveMetadata", "kAsyncDone", "kNcclAllGatherDone", "kNcclAllReduceDone",
    "kNcclAllToAllDone", "kNcclCollectivePermuteDone", "kNcclReduceScatterDone",
})
# Kinds known to launch device code (anything unknown is counted too, and reported).
LAUNCH_KINDS = frozenset({
    "kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kConvolution", "kConvolutionReorder",
    "kCuDnn", "kNorm", "kFft", "kTriangularSolve", "kCholesky", "kSelectK", "kTopK", "kCustomCall",
    "kDynamicSliceFusion", "kCollectiveKernel", "kAllGather", "kAllReduce", "kAllToAll",
    "kRaggedAllToAll", "kReduceScatter", "kCollectiveBroadcast", "kCollectivePermute",
    "kNcclAllGatherStart", "kNcclAllReduceStart", "kNcclAllToAllStart", "kNcclCollectivePermuteStart",
    "kNcclReduceScatterStart", "kCubSort",
})


class XlaTargetWarning(UserWarning):
    """The H100 compile target is unavailable (no CUDA plugin, or the topology cannot be built)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One thunk of the executable's sequence."""

    index: int  # position in thunk_sequence.txt (1-based, as XLA prints it)
    kind: str  # thunk kind, e.g. "kCustomKernel"
    name: str  # the HLO instruction it runs (its profile annotation), e.g. "loop_add_fusion.3"
    category: str  # see `categorize`
    counted: str  # "kernel", "copy", "memset" or "none"
    in_loop: bool  # inside a while body or condition
    bytes: int  # modeled HBM bytes: operands + result (0 when the HLO could not be read)
    scope: str  # the jax named-scope path of its HLO op_name, "/"-separated ("" if none)
    reads_only_inputs: bool  # every operand is a function argument (e.g. a weight layout transpose)


@dataclasses.dataclass(frozen=True)
class XlaReport:
    """XLA's executable for an H100: kernel count, memory, bytes, compile time."""

    kernels: int  # launches of device code (see the module docstring for what counts)
    copies: int  # device-to-device copies (not in `kernels`)
    memsets: int  # driver memsets (not in `kernels`)
    loop_kernels: int  # of `kernels`, how many sit in while bodies/conditions (counted once)
    input_only_kernels: int  # of `kernels`, how many read nothing but arguments (weight prep)
    by_kind: dict[str, int]  # every thunk kind in the sequence -> count (structure included)
    by_category: dict[str, int]  # kernels only: "loop fusion", "gemm (Triton)", "conv (cuDNN)", ...
    unknown_kinds: tuple[str, ...]  # thunk kinds this module does not know (counted as kernels)
    temp_bytes: int  # compiled.memory_analysis().temp_size_in_bytes
    argument_bytes: int
    output_bytes: int
    bytes_accessed: float | None  # compiled.cost_analysis()["bytes accessed"] when XLA gives it
    modeled_bytes: int  # sum over kernels and copies of operand + result bytes (optimized HLO)
    lower_seconds: float  # trace + lower in the subprocess
    compile_seconds: float  # XLA compile for sm_90 in the subprocess
    wall_seconds: float  # the whole subprocess, interpreter start and imports included
    launches: tuple[Launch, ...]  # the full sequence, structure thunks included
    module: str  # HLO module name
    device: str  # the target's device description
    dump_dir: str | None  # kept dump directory, or None when it was deleted

    @property
    def total_launches(self) -> int:
        return self.kernels + self.copies + self.memsets

    def by_scope(self, depth: int = 1) -> dict[str, int]:
        """Kernels grouped by named scope, `depth` scopes deep: depth 1 gives the outermost scope
        ("down_blocks.0", "mid_block", ...), depth 2 the one inside it ("down_blocks.0.resnets.1");
        "" for kernels traced outside any scope."""
        out: dict[str, int] = {}
        for launch in self.launches:
            if launch.counted != "kernel":
                continue
            parts = launch.scope.split("/") if launch.scope else [""]
            key = parts[min(depth, len(parts)) - 1]
            out[key] = out.get(key, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (launches as short records)."""
        out = dataclasses.asdict(self)
        out["total_launches"] = self.total_launches
        out["unknown_kinds"] = list(self.unknown_kinds)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> XlaReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["launches"] = tuple(Launch(**launch) for launch in data["launches"])
        values["unknown_kinds"] = tuple(data["unknown_kinds"])
        return cls(**values)

    def summary(self) -> str:
        """One line: kernels, their categories, temp memory, compile time."""
        parts = ", ".join(f"{n} {c}" for c, n in sorted(self.by_category.items(), key=lambda kv: -kv[1]))
        extra = f" (+{self.copies} copies, {self.memsets} memsets)" if self.copies or self.memsets else ""
        return (
            f"{self.kernels} kernels{extra} [{parts}]; temp {self.temp_bytes / 2**20:.1f} MiB; "
            f"modeled {self.modeled_bytes / 2**30:.2f} GiB moved; compiled in {self.compile_seconds:.1f} s"
        )


# --- availability and topology ---------------------------------------------------------------


def target_config_text() -> str:
    """The H100 device description: the repository's shared file when present, else the copy here."""
    if SHARED_TARGET_CONFIG.is_file():
        return SHARED_TARGET_CONFIG.read_text()
    return H100_TARGET_CONFIG


def unavailable_reason() -> str | None:
    """Why the H100 target cannot be used here without installing it, or None (cheap: no import)."""
    reason = cuda_target.unavailable_reason()
    if reason is not None or not cuda_target.plugin_in_environment():
        return reason
    jax_version = importlib.metadata.version("jax")
    for dist in PLUGIN_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue  # importable without metadata (a source tree): let the subprocess decide
        if version != jax_version:
            return f"{dist} {version} in this environment does not match jax {jax_version}; {INSTALL_HINT}"
    return None


def prepare_target() -> str | None:
    """Install the target on first use (see `measure.cuda_target`); why it is unusable, or None."""
    try:
        cuda_target.ensure_installed()
    except cuda_target.TargetInstallError as error:
        return str(error)
    return unavailable_reason()


def h100_topology():
    """A compile-only topology with one H100 (`topology="1x1x1"`).

    Call it in a process whose XLA flags are already what the compile should see: the CUDA
    plugin's backend starts here, and `XLA_FLAGS` is read once per process.
    """
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=target_config_text(), topology="1x1x1")


def _unavailable(reason: str) -> None:
    warnings.warn(f"XLA H100 target unavailable: {reason}", XlaTargetWarning, stacklevel=3)
    return None


# --- the parent side ---------------------------------------------------------------------------


def compile_for_h100(
    fn: Callable | str,
    *abstract_args,
    static_argnums: int | tuple[int, ...] = (),
    keep_dump: str | os.PathLike | None = None,
    timeout: float | None = 3600,
) -> XlaReport | None:
    """Compile `jax.jit(fn)` for an H100 in a subprocess and count its kernels.

    `fn` is a callable (sent by cloudpickle) or an importable "module:function" string;
    `abstract_args` are `jax.ShapeDtypeStruct`s, arrays or pytrees of them (static arguments as
    they are). Returns None, with an `XlaTargetWarning` saying why, when the CUDA plugin is missing
    or the H100 topology cannot be built; raises `RuntimeError` with the subprocess's traceback when
    `fn` itself fails to trace or compile. `keep_dump` keeps XLA's dump in that directory.
    """
    reason = prepare_target()  # installs the target once per machine, announced on stderr
    if reason is not None:
        return _unavailable(reason)
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    try:
        import cloudpickle as pickler
    except ImportError:  # egglog depends on cloudpickle; plain pickle handles importable functions.
        import pickle as pickler

    workdir = Path(tempfile.mkdtemp(prefix="eqsat_h100_"))
    try:
        dump = Path(keep_dump).resolve() if keep_dump is not None else workdir / "dump"
        if dump.exists():
            shutil.rmtree(dump)
        dump.mkdir(parents=True)
        request, report_path = workdir / "request.pkl", workdir / "report.json"
        request.write_bytes(pickler.dumps({"fn": fn, "args": _abstract(abstract_args, static), "static": static}))
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "measure.xla_target", "--child", str(request), str(report_path), str(dump)],
                env=_child_env(dump),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the H100 compile did not finish within {timeout} s") from None
        wall = time.perf_counter() - start
        if not report_path.is_file():
            raise RuntimeError(f"the H100 compile subprocess died (exit {done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(report_path.read_text())
        if result["status"] == "unavailable":
            return _unavailable(result["reason"])
        if result["status"] != "ok":
            raise RuntimeError(f"compiling {_describe(fn)} for H100 failed:\n{result['traceback']}")
        result["report"]["wall_seconds"] = wall
        result["report"]["dump_dir"] = str(dump) if keep_dump is not None else None
        return XlaReport.from_json(result["report"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _describe(fn) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


def _abstract(args: tuple, static: tuple[int, ...]) -> tuple:
    """Arrays become ShapeDtypeStructs (no data crosses to the subprocess); statics stay as they are."""
    import jax

    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        return x

    return tuple(arg if i in static else jax.tree_util.tree_map(leaf, arg) for i, arg in enumerate(args))


def _child_env(dump: Path) -> dict[str, str]:
    """The parent's environment, on the CPU platform, dumping to `dump`; the parent's own sys.path
    goes along so that whatever it could import (the repo, test modules), the child can."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["EQSAT_CUDA_PLUGIN"] = "1"  # the H100 compiler is the CUDA plugin (see eqsat.quiet_cuda)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_dump_to")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_dump_to={dump}"])
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [package_root, *cuda_target.search_paths(), *(os.path.abspath(p or os.curdir) for p in sys.path)]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


# --- the subprocess side -----------------------------------------------------------------------


def _resolve(fn):
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        if not name:
            raise ValueError(f"expected 'module:function', got {fn!r}")
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    return fn


def _child(request_path: str, report_path: str, dump_dir: str) -> int:
    """Compile one request for the H100 topology and write {"status": ...} to `report_path`."""
    import pickle

    def write(payload):
        Path(report_path).write_text(json.dumps(payload))

    try:
        import jax
        import numpy as np

        jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would skip the dump
        request = pickle.loads(Path(request_path).read_bytes())
        try:
            topology = h100_topology()
        except Exception as error:  # noqa: BLE001 - any failure here means "no target", not a bug in fn
            write({"status": "unavailable", "reason": f"cannot build the H100 topology: {error}"})
            return 0
        device = topology.devices[0]
        mesh = jax.sharding.Mesh(np.array(topology.devices), ("x",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def place(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
            return x

        static = request["static"]
        args = [a if i in static else jax.tree_util.tree_map(place, a) for i, a in enumerate(request["args"])]
        fn = _resolve(request["fn"])
        before = set(glob.glob(os.path.join(dump_dir, "*gpu_target_config.pbtxt")))
        start = time.perf_counter()
        lowered = jax.jit(fn, static_argnums=static).lower(*args)
        lower_seconds = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        try:
            cost = compiled.cost_analysis()
        except Exception:  # noqa: BLE001 - compile-only executables may not implement it
            cost = None
        if isinstance(cost, list):
            cost = cost[0] if cost else None
        bytes_accessed = float(cost["bytes accessed"]) if cost and "bytes accessed" in cost else None
        new = sorted(set(glob.glob(os.path.join(dump_dir, "*gpu_target_config.pbtxt"))) - before)
        if not new:
            raise RuntimeError(f"XLA wrote no GPU module to {dump_dir}; is --xla_dump_to in XLA_FLAGS?")
        prefix = new[-1][: -len("gpu_target_config.pbtxt")]
        report = parse_dump(prefix)
        report.update(
            temp_bytes=int(memory.temp_size_in_bytes),
            argument_bytes=int(memory.argument_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes),
            bytes_accessed=bytes_accessed,
            lower_seconds=lower_seconds,
            compile_seconds=compile_seconds,
            wall_seconds=0.0,
            device=str(device.device_kind),
            dump_dir=None,
        )
        write({"status": "ok", "report": report})
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        write({"status": "error", "traceback": traceback.format_exc()})
    return 0


# --- reading the dump --------------------------------------------------------------------------

_THUNK_LINE = re.compile(r"^(?P<indent>\s*)(?P<id>\d+):\s+(?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<rest>.*)$")
_METADATA_ENTRY = re.compile(
    r'profile_annotation:\s*"(?P<name>[^"]*)"\s*thunk_id:\s*(?P<id>\d+)\s*\}\s*thunk_kind:\s*"(?P<kind>\w+)"'
)
_SHAPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')


def parse_dump(prefix: str) -> dict[str, Any]:
    """Read `<prefix>thunk_sequence.txt`, `thunk_metadata.txt` and the optimized HLO of one module.

    `prefix` is the dump path up to the file kind, e.g. "DIR/module_0001.jit_f.". Returns the
    XlaReport fields that come from the dump (kernels, copies, memsets, loop_kernels, by_kind,
    by_category, unknown_kinds, modeled_bytes, launches, module).
    """
    sequence = Path(prefix + "thunk_sequence.txt").read_text()
    metadata_path = Path(prefix + "thunk_metadata.txt")
    names = {}
    if metadata_path.is_file():
        text = re.sub(r"\s+", " ", metadata_path.read_text())
        names = {int(m["id"]): m["name"] for m in _METADATA_ENTRY.finditer(text)}
    hlo_files = glob.glob(prefix + "*gpu_after_optimizations.txt")
    hlo = _read_hlo(Path(hlo_files[0]).read_text()) if hlo_files else {}

    launches, by_kind, by_category, unknown = [], {}, {}, set()
    containers: list[tuple[int, str]] = []  # (indent, kind) of enclosing while/conditional thunks
    for line in sequence.splitlines():
        match = _THUNK_LINE.match(line)
        if match is None:
            continue  # "condition:", "body:" and blank lines
        indent, kind = len(match["indent"]), match["kind"]
        while containers and containers[-1][0] >= indent:
            containers.pop()
        in_loop = any(k == "kWhile" for _, k in containers)
        if kind in ("kWhile", "kConditional"):
            containers.append((indent, kind))
        by_kind[kind] = by_kind.get(kind, 0) + 1
        thunk_id = int(match["id"])
        rest = match["rest"].split()
        name = names.get(thunk_id) or (rest[0] if rest else kind)
        if kind in COPY_KINDS:
            counted = "copy"
        elif kind in MEMSET_KINDS:
            counted = "memset"
        elif kind in NON_LAUNCH_KINDS:
            counted = "none"
        else:
            counted = "kernel"
            if kind not in LAUNCH_KINDS:
                unknown.add(kind)
        info = hlo.get(name, {})
        category = categorize(kind, name, info) if counted == "kernel" else counted
        if counted == "kernel":
            by_category[category] = by_category.get(category, 0) + 1
        moved = info.get("bytes", 0) if counted in ("kernel", "copy") else 0
        launches.append(
            Launch(
                thunk_id, kind, name, category, counted, in_loop, int(moved), info.get("scope", ""),
                bool(info.get("reads_only_inputs", False)),
            )
        )
    kernels = [launch for launch in launches if launch.counted == "kernel"]
    return {
        "kernels": len(kernels),
        "copies": sum(launch.counted == "copy" for launch in launches),
        "memsets": sum(launch.counted == "memset" for launch in launches),
        "loop_kernels": sum(launch.in_loop for launch in kernels),
        "input_only_kernels": sum(launch.reads_only_inputs for launch in kernels),
        "by_kind": by_kind,
        "by_category": by_category,
        "unknown_kinds": sorted(unknown),
        "modeled_bytes": sum(launch.bytes for launch in launches),
        "launches": [dataclasses.asdict(launch) for launch in launches],
        "module": Path(prefix).name.rstrip("."),
    }


def categorize(kind: str, name: str, info: dict[str, Any]) -> str:
    """A short human category for one kernel, from its thunk kind, HLO fusion kind and name."""
    backend, target = info.get("backend_kind", ""), info.get("target", "")
    if kind in ("kGemm", "kCublasLtMatmul") or target.startswith("__cublas"):
        return "gemm (cuBLAS)"
    if kind in ("kConvolution", "kConvolutionReorder") or target.startswith("__cudnn$conv"):
        return "conv (cuDNN)"
    if kind in ("kCuDnn", "kNorm") or backend.startswith("__cudnn"):
        return "cuDNN fusion"
    if kind == "kFft":
        return "fft (cuFFT)"
    if target == "__gpu$xla.gpu.triton":
        return "Pallas (Triton)"
    if "mosaic" in target:
        return "Pallas (Mosaic GPU)"
    if "gemm" in backend or name.startswith("gemm_fusion"):
        return "gemm (Triton)"
    if backend == "__triton":
        return "Triton fusion (norm/softmax)"
    if "scatter" in name:
        return "scatter fusion"
    if name.startswith("sort") or info.get("opcode") == "sort":
        return "sort"
    if "transpose" in name:
        return "transpose"
    if "reduce" in name or info.get("fusion_kind") == "kInput":
        return "reduction fusion"
    if name.startswith("loop_") or info.get("fusion_kind") == "kLoop":
        return "loop fusion"
    if name.startswith("wrapped_"):
        return "single-op kernel"
    return "other kernel"


def _array_bytes(shape_text: str, drop_workspace: bool = False) -> int:
    arrays = _ARRAY.findall(shape_text)
    if drop_workspace and shape_text.startswith("(") and len(arrays) > 1 and arrays[-1][0] == "u8":
        arrays = arrays[:-1]
    total = 0.0
    for dtype, dims in arrays:
        size = 1
        for d in dims.split(",") if dims else ():
            size *= int(d)
        total += size * _SHAPE_BYTES.get(dtype, 1)
    return int(total)


def split_shape(rest: str) -> tuple[str, str]:
    """`"(f16[2]{0}, u8[0]{0}) custom-call(%a), ..."` -> (shape text, text after it)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, after = rest.partition(" ")
    return shape, after


def split_instruction(after_shape: str) -> tuple[str, list[str], str]:
    """`(opcode, operand names, attributes)` of an HLO instruction's text after its result shape."""
    opcode, _, args = after_shape.partition("(")
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return opcode.strip(), re.findall(r"%([\w.\-]+)", args[:end]), args[end:]


def _read_hlo(text: str) -> dict[str, dict[str, Any]]:
    """name -> {bytes (operands + result), opcode, fusion_kind, backend_kind, target, scope,
    reads_only_inputs}."""
    shapes, instructions = {}, {}
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        shape, after = split_shape(match["rest"])
        opcode, operands, attributes = split_instruction(after)
        shapes[match["name"]] = shape
        instructions[match["name"]] = (shape, opcode, operands, attributes)
    from_inputs: dict[str, bool] = {}  # instruction -> is an argument seen through views

    def is_input(name: str) -> bool:
        if name not in from_inputs:
            shape, opcode, operands, _ = instructions.get(name, ("", "", [], ""))
            from_inputs[name] = opcode == "parameter" or (
                opcode in ("bitcast", "get-tuple-element", "reshape") and all(map(is_input, operands))
            )
        return from_inputs[name]

    out = {}
    for name, (shape, opcode, operands, attributes) in instructions.items():
        target = re.search(r'custom_call_target="([^"]*)"', attributes)
        fusion_kind = re.search(r"kind=(k\w+)", attributes)
        backend_kind = re.search(r'"fusion_backend_config":\{"kind":"([^"]*)"', attributes)
        op_name = _OP_NAME.search(attributes)
        is_library = opcode == "custom-call"
        moved = _array_bytes(shape, drop_workspace=is_library)
        moved += sum(_array_bytes(shapes.get(operand, "")) for operand in operands)
        out[name] = {
            "bytes": moved,
            "opcode": opcode,
            "fusion_kind": fusion_kind[1] if fusion_kind else "",
            "backend_kind": backend_kind[1] if backend_kind else "",
            "target": target[1] if target else "",
            "scope": _scope(op_name["op"]) if op_name else "",
            "reads_only_inputs": bool(operands) and all(map(is_input, operands)),
        }
    return out


def _scope(op_name: str) -> str:
    """`"jit(f)/down_blocks.0/down_blocks.0.resnets.1/conv_general_dilated"` ->
    `"down_blocks.0/down_blocks.0.resnets.1"`: the named-scope path, outermost first ("" if none)."""
    parts = [p for p in op_name.split("/") if p and "(" not in p]  # drops jit(f), jvp(...), ...
    return "/".join(parts[:-1])  # the last part is the primitive


# --- command line ------------------------------------------------------------------------------


def _parse_arg(text: str):
    """`"f16[2,4,64,64]"` -> ShapeDtypeStruct; a JSON value (number, list, dict) -> that value."""
    import jax

    from eqsat.types import parse_type

    try:
        ty = parse_type(text)
    except ValueError:
        return json.loads(text)
    return jax.ShapeDtypeStruct(ty.shape, ty.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m measure.xla_target",
        description="Compile jax.jit(module:function) for an H100 without a GPU and count its kernels.",
    )
    parser.add_argument("function", nargs="?", help="importable 'module:function'")
    parser.add_argument("--arg", action="append", default=[], help='an argument: a type "f16[2,4,64,64]" or JSON')
    parser.add_argument("--static-argnums", default="", help="comma list of static argument positions")
    parser.add_argument("--dump", default=None, help="keep XLA's dump in this directory")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--child", nargs=3, metavar=("REQUEST", "REPORT", "DUMP"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return _child(*options.child)
    if not options.function:
        parser.error("give a 'module:function'")
    static = tuple(int(i) for i in options.static_argnums.split(",") if i)
    args = [_parse_arg(text) for text in options.arg]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XlaTargetWarning)
        report = compile_for_h100(options.function, *args, static_argnums=static, keep_dump=options.dump)
    if report is None:
        print("; ".join(str(w.message) for w in caught) or "XLA H100 target unavailable", file=sys.stderr)
        return 1
    if options.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(f"{options.function} on {report.device}: {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
