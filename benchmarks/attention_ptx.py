"""The flash-attention template (`emit/pallas/attention.py`) compiled for an H100 without a GPU, read
from its PTX: instructions per score, per kind, and `ptxas -arch=sm_90a -v` registers and spills,
at the SD 1.5 shapes.

    python -m benchmarks.attention_ptx                 # every shape, a table
    python -m benchmarks.attention_ptx --only unet64   # shapes whose name starts with unet64
    python -m benchmarks.attention_ptx --json out.json --dump DIR
    python -m benchmarks.attention_ptx --plan          # the kernel as a plan emits it (views)

Each case is the template on contiguous `[batch, heads, seq, head_dim]` fp16 operands (CLIP's causal
mask as a `[seq, seq]` bias read per score tile, as the plan gives it), with its default tile sizes,
compiled by `measure.xla_target.compile_for_h100` (XLA drives Triton for sm_90a). With `--plan`, the
kernel as the emitter makes it from the plan of `sd15.layers.attention` on `[batch, seq, heads x
head_dim]` operands (q, k and v read per head through reshape views; CLIP's bias a constant).
Counted in the PTX of the kernel (`.entry attention`), one statement per instruction:

- `loop`: the instructions of the key loop's body (the region between a label and the branch back to
  it) and `loop_per_score` = loop instructions x threads / (block_q x block_k): what one score of a
  full key block costs, summed over the threads that share the block. `loop_kinds_per_score` splits
  it by opcode (`ex2`, `setp`, `selp`, `cvt`, `ld.global`, `fma`, ...).
- `per_score`: every instruction the programs of one (batch, head) execute (per program the code
  outside the loop once, the loop body `key_loop_trips` times) x threads / (q_len x kv_len): per
  *real* score, so padded keys and query rows are charged to the real ones.
- `step_instructions`: what all the kernels of this shape execute in one SD 1.5 step (thread
  instructions; the UNet, CLIP and VAE totals are printed last).
- `registers`, `spill_bytes` (stores + loads) from `ptxas -arch=sm_90a -v` (the `nvidia-cuda-nvcc-cu12`
  pip package's ptxas, never a system one).

Instructions are static counts per thread; warp-level work is this times the threads / 32.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from emit.pallas import attention as at
from emit.pallas.triton import gather_load


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    kernels: int  # how many attention kernels of this shape one SD 1.5 step runs
    causal_bias: bool = False

    @property
    def component(self) -> str:
        return self.name.split(".")[0].rstrip("0123456789")


# SD 1.5 at 512x512 with classifier-free guidance (batch 2): the UNet's self- and cross-attention at
# 64², 32², 16², 8² latents (8 heads of 40, 80, 160, 160; 77 context tokens; 5, 5, 5 and 1
# transformer blocks), CLIP's causal self-attention (12 layers of 12 heads of 64) and the VAE's
# mid-block attention (one head of 512).
SHAPES = (
    Shape("unet64.self", 2, 8, 4096, 4096, 40, 5),
    Shape("unet64.cross", 2, 8, 4096, 77, 40, 5),
    Shape("unet32.self", 2, 8, 1024, 1024, 80, 5),
    Shape("unet32.cross", 2, 8, 1024, 77, 80, 5),
    Shape("unet16.self", 2, 8, 256, 256, 160, 5),
    Shape("unet16.cross", 2, 8, 256, 77, 160, 5),
    Shape("unet8.self", 2, 8, 64, 64, 160, 1),
    Shape("unet8.cross", 2, 8, 64, 77, 160, 1),
    Shape("clip.causal", 2, 12, 77, 77, 64, 12, causal_bias=True),
    Shape("vae.mid", 1, 1, 4096, 4096, 512, 1),
)


def attention_fn(shape: Shape, blocks: at.AttentionBlocks | None = None):
    """`fn(q, k, v[, bias])` running the template on contiguous operands, and its abstract arguments."""
    B, H, Q, K, D = shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.head_dim

    def operand(position, length):
        def tile(refs, index, mask):
            b, h, s, d = index
            return gather_load(refs[position], ((b * H + h) * length + s) * D + d, mask)
        return tile

    def bias(refs, index, mask):
        _, _, rows, cols = index
        return gather_load(refs[3], rows * K + cols, mask)

    problem = at.AttentionProblem(B, H, Q, K, D, operand(0, Q), operand(1, K), operand(2, K),
                                  bias if shape.causal_bias else None, D**-0.5,
                                  lambda refs, acc, index, mask: acc, jnp.float16)

    def fn(*inputs):
        return at.build(problem, list(inputs), blocks=blocks, interpret=False)

    args = [jax.ShapeDtypeStruct((B, H, Q, D), jnp.float16)] + [jax.ShapeDtypeStruct((B, H, K, D), jnp.float16)] * 2
    if shape.causal_bias:
        args.append(jax.ShapeDtypeStruct((Q, K), jnp.float32))
    return fn, args


# --- reading PTX ---------------------------------------------------------------------------------

_LABEL = re.compile(r"^(\$\w+):$")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$\w+)")


def entry_body(ptx: str, entry: str) -> str:
    """The text between the braces of `.entry <entry>(...)`."""
    start = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(", ptx)
    if start is None:
        raise ValueError(f"no .entry {entry} in the PTX")
    open_brace = ptx.index("{", ptx.index(")", start.end()))
    depth, i = 0, open_brace
    while True:
        depth += {"{": 1, "}": -1}.get(ptx[i], 0)
        if depth == 0:
            return ptx[open_brace + 1:i]
        i += 1


def statements(body: str) -> list[str]:
    """Instructions and labels of a PTX function body, one per entry (inline-asm scopes unwrapped)."""
    out = []
    for line in body.splitlines():
        line = line.split("//", 1)[0].strip()
        if _LABEL.match(line):
            out.append(line)
            continue
        for part in line.split(";"):
            part = part.strip().lstrip("{}").strip()
            if part and not part.startswith(".") and part != "}":
                out.append(part)
    return out


def opcode(statement: str) -> str:
    words = statement.split()
    return words[1] if words[0].startswith("@") else words[0]


def kind(op: str) -> str:
    """A short instruction class: `ex2`, `setp`, `selp`, `cvt`, `ld.global`, `ld.shared`, `st.shared`,
    `wgmma`, `mma`, else the opcode's first word (`fma`, `add`, `mul`, `max`, `mov`, ...)."""
    parts = op.split(".")
    if parts[0] in ("ld", "st") and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


@dataclasses.dataclass
class KernelPtx:
    threads: int
    instructions: int
    loop_instructions: int  # 0 when the key loop was unrolled away
    loop_kinds: dict[str, int]
    kinds: dict[str, int]


def read_kernel(ptx: str, entry: str = "attention") -> KernelPtx:
    body = entry_body(ptx, entry)
    threads_match = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx[ptx.index(".entry " + entry):])
    threads = int(threads_match.group(1)) if threads_match else 0
    items = statements(body)
    labels = {m.group(1): i for i, s in enumerate(items) if (m := _LABEL.match(s))}
    loops = []  # (start, end) index ranges of backward branches
    for i, s in enumerate(items):
        m = _BRANCH.search(s)
        if m and labels.get(m.group(1), i + 1) < i:
            loops.append((labels[m.group(1)], i))
    instructions = [s for s in items if not _LABEL.match(s)]
    if len(loops) > 1:
        raise ValueError(f"expected at most one loop in the attention kernel, found {len(loops)}")
    loop = [s for s in items[loops[0][0]:loops[0][1] + 1] if not _LABEL.match(s)] if loops else []
    return KernelPtx(threads, len(instructions), len(loop),
                     dict(collections.Counter(kind(opcode(s)) for s in loop)),
                     dict(collections.Counter(kind(opcode(s)) for s in instructions)))


def ptxas_path() -> str:
    """`benchmarks.ptx.ptxas_path`: the pip package's ptxas, in this environment or eqsat's CUDA target dir."""
    from benchmarks.ptx import ptxas_path as find

    return str(find())


def ptxas_usage(ptx_path: str, entry: str = "attention") -> dict[str, int]:
    """Registers and spill bytes of kernel `entry` in `ptx_path`, from `ptxas -arch=sm_90a -v`."""
    done = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                          capture_output=True, text=True, check=True)
    text = (done.stderr + done.stdout).split(f"Compiling entry function '{entry}'", 1)[1]
    text = text.split("Compiling entry function", 1)[0]
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(registers.group(1)) if registers else -1,
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else -1}


# --- one case ----------------------------------------------------------------------------------------


def plan_fn(shape: Shape):
    """The emitted plan of `sd15.layers.attention` at `shape` (fp16 [batch, seq, heads x head_dim])."""
    import emit
    import eqsat
    from sd15.clip import causal_bias
    from sd15.layers import attention

    bias = causal_bias(shape.q_len) if shape.causal_bias else None
    width = shape.heads * shape.head_dim
    args = [jax.ShapeDtypeStruct((shape.batch, length, width), jnp.float16)
            for length in (shape.q_len, shape.kv_len, shape.kv_len)]
    plan = eqsat.optimize(lambda q, k, v: attention(q, k, v, shape.heads, bias=bias), progress=False).lower(*args).plan
    return emit.emit(plan, "pallas", interpret=False), args


def measure(shape: Shape, dump: Path, blocks: at.AttentionBlocks | None = None, *, plan: bool = False) -> dict:
    """Compile `shape` (with `blocks`, else the template's default tiles; `plan`: as the plan of
    `sd15.layers.attention` is emitted, with the default tiles) and read its PTX."""
    from measure.xla_target import compile_for_h100

    if plan and blocks is not None:
        raise ValueError("the emitted plan uses the template's default tiles")
    blocks = blocks or at.AttentionBlocks.get_default(shape.q_len, shape.kv_len, shape.head_dim)
    fn, args = plan_fn(shape) if plan else attention_fn(shape, blocks)
    report = compile_for_h100(fn, *args, keep_dump=dump)
    if report is None:
        raise SystemExit("the H100 compile target is unavailable (see the XlaTargetWarning above; python -m measure.cuda_target info)")
    (ptx_path,) = [p for p in glob.glob(str(dump / "*.ptx")) if ".entry attention" in Path(p).read_text()]
    kernel = read_kernel(Path(ptx_path).read_text())
    trips = at.key_loop_trips(shape.kv_len, blocks.block_k) if kernel.loop_instructions else 0
    executed = kernel.instructions + kernel.loop_instructions * (trips - 1) if trips else kernel.instructions
    query_blocks = -(-shape.q_len // blocks.block_q)
    tile_scores = blocks.block_q * blocks.block_k
    row = {
        "shape": dataclasses.asdict(shape),
        "blocks": dataclasses.asdict(blocks),
        "threads": kernel.threads,
        "instructions": kernel.instructions,
        "loop_instructions": kernel.loop_instructions,
        "loop_trips": trips,
        "loop_per_score": kernel.loop_instructions * kernel.threads / tile_scores,
        "loop_kinds_per_score": {k: v * kernel.threads / tile_scores for k, v in sorted(kernel.loop_kinds.items())},
        "per_score": executed * kernel.threads * query_blocks / (shape.q_len * shape.kv_len),
        # every program of every kernel of this shape in one SD 1.5 step, thread instructions
        "step_instructions": executed * kernel.threads * query_blocks * shape.batch * shape.heads * shape.kernels,
        "kinds": kernel.kinds,
        **ptxas_usage(ptx_path),
    }
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="shape name prefixes")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--blocks", default=None, metavar="BQxBKxWARPS",
                        help="tile sizes and warps for every shape instead of the template's defaults")
    parser.add_argument("--plan", action="store_true",
                        help="measure the kernel the emitter makes from the plan of sd15.layers.attention")
    parser.add_argument("--dump", default=None, help="keep each compile's XLA dump (PTX) under DIR/<shape>")
    options = parser.parse_args(argv)
    shapes = [s for s in SHAPES if options.only is None or any(s.name.startswith(p) for p in options.only)]
    blocks = None
    if options.blocks:
        block_q, block_k, warps = (int(x) for x in options.blocks.split("x"))
        blocks = at.AttentionBlocks(block_q, block_k, num_warps=warps)
    rows = []
    root = Path(options.dump) if options.dump else Path(tempfile.mkdtemp(prefix="attention_ptx_"))
    print(f"{'shape':14} {'q x kv x d':>18} {'bq x bk':>8} {'thr':>4} {'loop/score':>10} {'ex2':>5} {'setp':>5} "
          f"{'selp':>5} {'cvt':>5} {'ld.g':>5} {'all/score':>9} {'regs':>4} {'spill':>5}")
    for shape in shapes:
        row = measure(shape, root / shape.name, blocks, plan=options.plan)
        rows.append(row)
        kinds = row["loop_kinds_per_score"]
        b = row["blocks"]
        print(f"{shape.name:14} {f'{shape.q_len}x{shape.kv_len}x{shape.head_dim}':>18} "
              f"{'%dx%d' % (b['block_q'], b['block_k']):>8} {row['threads']:4d} {row['loop_per_score']:10.1f} "
              + " ".join(f"{kinds.get(k, 0):5.2f}" for k in ("ex2", "setp", "selp", "cvt", "ld.global"))
              + f" {row['per_score']:9.1f} {row['registers']:4d} {row['spill_bytes']:5d}", flush=True)
    totals = collections.Counter()
    for row in rows:
        totals[Shape(**row["shape"]).component] += row["step_instructions"]
    print("per SD 1.5 step, thread instructions in attention kernels: "
          + ", ".join(f"{component} {total / 1e9:.2f} G" for component, total in totals.items()))
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
