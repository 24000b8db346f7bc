"""Reading a compiled kernel: its PTX text and what `ptxas -arch=sm_90a -v` says about it.

    ptx = read_ptx(text)                          # {entry name: PtxKernel}, static counts
    resources = run_ptxas(path)                   # {entry name: PtxasResources}, from ptxas -v
    ctas_per_sm(registers, threads, shared_bytes) # occupancy on an H100 SM

Every figure here is *counted* from the compiled program, not measured on a GPU:

- `PtxKernel` counts static PTX instructions of one `.entry`: each instruction once, however many
  times a loop runs it. Global-load bytes are the instructions weighted by the width they move
  (`ld.global.v4.b32` 16 bytes, `ld.global.b16` 2 bytes): a static count of instructions, not the
  bytes a run moves.
- `PtxasResources` is `ptxas -v`'s report: registers per thread, spill stores/loads, static shared
  memory, stack frame.

`ptxas` comes from the pip package `nvidia-cuda-nvcc-cu12` only (the `test` and `cuda-target`
extras), never from a system path, so every machine reads the same ptxas version.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

# --- H100 SM limits (CUDA C Programming Guide, compute capability 9.0) --------------------------
SM_COUNT = 132  # H100 SXM5 (core_count of measure.xla_target's H100 target config)
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_THREADS = 2048
SM_CTAS = 32
# Registers are allocated per warp in units of 256 (8 per thread).
REGISTER_ALLOCATION_UNIT = 256
# Shared memory the system reserves for every CTA on compute capability 8.x/9.x.
CTA_RESERVED_SHARED_BYTES = 1024
WARP = 32

# A global load at least this wide (bits, one instruction) is a vector load.
VECTOR_BITS = 64
# A TMA copy (`cp.async.bulk.tensor`) moves a box the tensor map describes, which the PTX does not
# show: it is counted as one load of this many bytes, the widest plain vector load, so the vector
# share is never overstated by it.
TMA_COUNTED_BYTES = 16

PTXAS_PACKAGE = "nvidia-cuda-nvcc-cu12"


class PtxasMissing(RuntimeError):
    """ptxas of the pip package nvidia-cuda-nvcc-cu12 is not installed."""


def ptxas_path() -> Path:
    """`ptxas` of the pip package nvidia-cuda-nvcc-cu12 (`nvidia/cuda_nvcc/bin/ptxas`), in this
    environment or in eqsat's CUDA target dir (installed on first use, see `measure.cuda_target`);
    raises `PtxasMissing` with a one-line message when neither has it. No system path is looked at."""
    from measure import cuda_target

    def found():
        return next((p for p in cuda_target.ptxas_candidates() if p.is_file() and os.access(p, os.X_OK)), None)

    path = found()
    if path is None:
        try:
            cuda_target.ensure_installed()
        except cuda_target.TargetInstallError as error:
            raise PtxasMissing(f"ptxas not found and the CUDA target could not be installed: {error}") from None
        path = found()
    if path is None:
        raise PtxasMissing(f"ptxas not found: run `python -m measure.cuda_target install` (or pip install {PTXAS_PACKAGE})")
    return path


# --- the PTX text ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PtxKernel:
    """Static counts over one `.entry` of a PTX module."""

    name: str
    wgmma: int  # wgmma.mma_async instructions
    mma_sync: int  # mma.sync instructions
    wgmma_wait_depth: int | None  # the largest N of `wgmma.wait_group.sync.aligned N` (None: no wgmma waits)
    global_loads: int  # global load instructions (ld.global, ldu.global, cp.async from global, TMA)
    global_load_bytes: int  # the same, each weighted by the bytes it moves
    vector_load_bytes: int  # of those bytes, moved by loads >= 64 bits wide, cp.async >= 8 bytes or TMA
    tma_loads: int  # cp.async.bulk(.tensor) copies from global memory

    @property
    def tensor_core(self) -> str:
        """"wgmma", "mma.sync", both ("wgmma+mma.sync") or "none"."""
        kinds = [kind for kind, count in (("wgmma", self.wgmma), ("mma.sync", self.mma_sync)) if count]
        return "+".join(kinds) or "none"

    @property
    def vector_load_fraction(self) -> float | None:
        return self.vector_load_bytes / self.global_load_bytes if self.global_load_bytes else None


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$.]*)\s*\(")
# Comments, and the debug-line directives Mosaic GPU puts before instructions (`.loc 1 237 12`).
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/|^[ \t]*\.(?:loc|file)\b[^\n]*", re.DOTALL | re.MULTILINE)
_LABEL = re.compile(r"^\s*[$\w]+:\s*")
_PREDICATE = re.compile(r"^@!?%?\w+\s+")
_WIDTH = re.compile(r"^(?:b|u|s|f)(\d+)$")
_WAIT_GROUP = re.compile(r"^wgmma\.wait_group(?:\.sync)?(?:\.aligned)?\s+(\d+)")
_CP_ASYNC_SIZE = re.compile(r",\s*(0[xX][0-9a-fA-F]+|\d+)\s*(?:,|$)")  # the copy size: 4, 8 or 16 (often hex)


def entries(text: str) -> dict[str, str]:
    """Each `.entry` of a PTX module -> its body (the text between its outermost braces)."""
    text = _COMMENT.sub("", text)
    out = {}
    for match in _ENTRY.finditer(text):
        start = text.find("{", match.end())
        if start < 0:
            continue
        depth = 0
        for i in range(start, len(text)):
            depth += (text[i] == "{") - (text[i] == "}")
            if depth == 0:
                out[match[1]] = text[start + 1 : i]
                break
    return out


def instructions(body: str) -> list[str]:
    """The instructions of a PTX body, one string each, labels and guard predicates removed
    (several instructions may share a line; braces of a `{ %r1, %r2 }` vector operand stay)."""
    out = []
    for statement in body.split(";"):
        statement = statement.strip()
        while True:  # scope braces `{`/`}` and labels before the instruction
            stripped = _LABEL.sub("", statement.lstrip("{} \t\n"))
            if stripped == statement:
                break
            statement = stripped
        statement = _PREDICATE.sub("", statement).strip()
        if statement and not statement.startswith("."):  # `.reg`, `.shared` declarations
            out.append(statement)
    return out


def load_width_bytes(opcode: str) -> int | None:
    """Bytes one `ld.global...`/`ldu.global...` instruction moves per thread: its vector count
    times its type's width (`ld.global.v4.b32` -> 16, `ld.global.L1::evict_last.b16` -> 2); None for
    an opcode that is not a global load."""
    parts = opcode.split(".")
    if parts[0] not in ("ld", "ldu") or "global" not in parts[1:]:
        return None
    lanes, bits = 1, None
    for part in parts[1:]:
        if re.fullmatch(r"v\d+", part):
            lanes = int(part[1:])
        elif part == "bf16" or part == "f16x2" or part == "bf16x2":
            bits = 16 if part == "bf16" else 32
        elif (width := _WIDTH.match(part)) is not None:
            bits = int(width[1])
    if bits is None:
        return None
    return lanes * bits // 8


def read_kernel(name: str, body: str) -> PtxKernel:
    """Static counts of one `.entry` body (see `PtxKernel`)."""
    wgmma = mma_sync = loads = load_bytes = vector_bytes = tma = 0
    wait_depth: int | None = None
    for instruction in instructions(body):
        opcode = instruction.split(None, 1)[0]
        if opcode.startswith("wgmma.mma_async"):
            wgmma += 1
        elif opcode.startswith("mma.sync"):
            mma_sync += 1
        elif opcode.startswith("wgmma.wait_group"):
            match = _WAIT_GROUP.match(instruction)
            if match is not None:
                wait_depth = max(wait_depth or 0, int(match[1]))
        elif opcode.startswith("cp.async.bulk") and ".global" in opcode and ".shared" in opcode.split(".global")[0]:
            # global -> shared bulk copy (TMA): its box size is in the tensor map, not the PTX
            tma += 1
            loads += 1
            load_bytes += TMA_COUNTED_BYTES
            vector_bytes += TMA_COUNTED_BYTES
        elif opcode.startswith("cp.async.") and ".global" in opcode and ".shared" in opcode:
            size = _CP_ASYNC_SIZE.search(instruction.split(None, 1)[1] if " " in instruction else "")
            if size is not None:
                width = int(size[1], 0)
                loads += 1
                load_bytes += width
                vector_bytes += width if width * 8 >= VECTOR_BITS else 0
        else:
            width = load_width_bytes(opcode)
            if width is not None:
                loads += 1
                load_bytes += width
                vector_bytes += width if width * 8 >= VECTOR_BITS else 0
    return PtxKernel(name, wgmma, mma_sync, wait_depth, loads, load_bytes, vector_bytes, tma)


def read_ptx(text: str) -> dict[str, PtxKernel]:
    """Every `.entry` of a PTX module, counted (see `PtxKernel`)."""
    return {name: read_kernel(name, body) for name, body in entries(text).items()}


# --- ptxas -v ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PtxasResources:
    """What `ptxas -v` reports for one entry function."""

    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int  # static shared memory (Triton's is dynamic: see the launch's shared memory)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


_COMPILING = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for ([\w$.]+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_verbose(text: str) -> dict[str, PtxasResources]:
    """`ptxas -v` output (its stderr/stdout text) -> entry function -> resources."""
    out: dict[str, PtxasResources] = {}
    entry = properties = None
    frame = (0, 0, 0)
    for line in text.splitlines():
        if (match := _COMPILING.search(line)) is not None:
            entry, properties, frame = match[1], None, (0, 0, 0)
        elif (match := _PROPERTIES.search(line)) is not None:
            properties = match[1]
        elif (match := _FRAME.search(line)) is not None:
            if properties is None or properties == entry:
                frame = tuple(int(v) for v in match.groups())
        elif (match := _USED.search(line)) is not None and entry is not None:
            smem = _SMEM.search(line)
            out[entry] = PtxasResources(entry, int(match[1]), frame[1], frame[2], frame[0],
                                        int(smem[1]) if smem else 0)
            entry = None
    return out


def run_ptxas(ptx_path: str | os.PathLike, arch: str = "sm_90a", ptxas: Path | None = None) -> dict[str, PtxasResources]:
    """`ptxas -arch=<arch> -v` on one PTX file: its entries' resources. Raises RuntimeError with
    ptxas's message when it rejects the file."""
    ptxas = ptxas or ptxas_path()
    done = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(ptx_path), "-o", os.devnull],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas -arch={arch} failed on {ptx_path}:\n{(done.stderr or done.stdout)[-2000:]}")
    return parse_ptxas_verbose(done.stdout + "\n" + done.stderr)


# --- occupancy ---------------------------------------------------------------------------------


def waves(ctas: int, per_sm: int) -> float | None:
    """Launch waves on an H100: CTAs over the CTAs all SMs hold at once (0.3: most SMs idle; 1.05:
    a nearly empty second wave). None when one CTA does not fit on an SM."""
    return ctas / (SM_COUNT * per_sm) if per_sm else None


def ctas_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """CTAs of one kernel resident on an H100 SM at once: the least of the thread, CTA, register
    and shared-memory limits (registers allocated per warp in units of 256; 1 KB of shared memory
    reserved per CTA). 0 when one CTA does not fit."""
    if threads <= 0:
        return 0
    warps = -(-threads // WARP)
    limits = [SM_CTAS, SM_THREADS // (warps * WARP)]
    if registers > 0:
        per_warp = -(-registers * WARP // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
        limits.append((SM_REGISTERS // per_warp) // warps)
    limits.append(SM_SHARED_BYTES // (shared_bytes + CTA_RESERVED_SHARED_BYTES))
    return max(0, min(limits))
