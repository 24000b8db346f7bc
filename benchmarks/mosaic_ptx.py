"""The matmul, conv and attention templates compiled for an H100 without a GPU, side by side: the
Mosaic GPU templates (`emit/mosaic/matmul.py`, `emit/mosaic/conv.py`, `emit/mosaic/attention.py`)
and the Pallas Triton ones (`emit/pallas/matmul.py`, `emit/pallas/conv.py`,
`emit/pallas/attention.py`), read from their PTX and `ptxas -arch=sm_90a -v`, at SD 1.5 UNet shapes.

    python -m benchmarks.mosaic_ptx                   # every shape, a table
    python -m benchmarks.mosaic_ptx --only unet64     # shapes whose name starts with unet64
    python -m benchmarks.mosaic_ptx --only unet64.conv --backend mosaic
    python -m benchmarks.mosaic_ptx --only attn       # the attention shapes
    python -m benchmarks.mosaic_ptx --json out.json --dump DIR

A matmul case is the plan of `x @ w + bias` (fp16, `[M, K] x [K, N] + [N]`: one `Matmul` kernel with
a bias epilogue); a conv case the plan of a 3x3 conv + bias (NHWC, fp16, `sd15.layers.conv2d`;
`.gn_silu`: its input through GroupNorm(32) + SiLU first: one `Conv` kernel with that prologue); an
attention case the plan of sd15's multi-head attention over fp16 `[batch, seq, heads·head_dim]`
projections (one `Attention` kernel reading them per head, and the `Pointwise` kernel that writes
the result back as `[B, S, H·D]`), with CLIP's causal mask as an additive bias where the case says
so. Each is emitted with `backend="mosaic"` and with `backend="pallas"`, each compiled by
`measure.xla_target.compile_for_h100` (the Mosaic kernel's PTX dumped by Mosaic itself:
`MOSAIC_GPU_DUMP_PTX`/`MOSAIC_GPU_DUMP_TO`, the Triton kernel's by XLA's dump). Counted, per template:

- `launches`: kernels of the whole executable (the template's plus whatever XLA launches around it:
  a pad of an operand whose rows the tile does not divide, the Mosaic conv's input layout, the
  Mosaic attention's heads padded 40 -> 48 when its projections are not prepared), by category;
- from the PTX of the template's `.entry` (`benchmarks.ptx.read_ptx`, static instruction counts):
  tensor-core instruction, `wgmma` instructions, the deepest `wgmma.wait_group N` (N >= 1: the next
  MMA is issued before the previous one is waited for), TMA copies (`cp.async.bulk.tensor`
  global -> shared) and the vector-load share of global-load bytes;
- `registers`, `spill_bytes` from `ptxas -arch=sm_90a -v`: for Triton the pip package's
  (`benchmarks.ptx.run_ptxas`); for Mosaic the `-v` report of the ptxas its own compile ran
  (`MOSAIC_GPU_DUMP_PTXAS`), since Mosaic emits PTX ISA 9.0, newer than the pip ptxas (8.8) reads;
- `compile_s`: XLA's compile for sm_90a in the subprocess (the Mosaic kernel's PTX and cubin are
  made inside it).

Nothing here runs a kernel: these are properties of the compiled code, not times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from benchmarks import ptx
from emit.mosaic import kernel_cache


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int
    kind = "matmul"

    def case(self):
        import jax
        import jax.numpy as jnp

        f16 = jnp.float16
        return dense, (jax.ShapeDtypeStruct((self.m, self.k), f16), jax.ShapeDtypeStruct((self.k, self.n), f16),
                       jax.ShapeDtypeStruct((self.n,), f16))

    def describe(self) -> dict:
        return {"m": self.m, "k": self.k, "n": self.n}


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """A 3x3 conv (padding 1) + bias over `[batch, size, size, cin]` NHWC, GroupNorm(32) + SiLU first
    when `gn_silu`."""

    name: str
    batch: int
    size: int
    cin: int
    cout: int
    gn_silu: bool = False
    kind = "conv"

    def case(self):
        import jax
        import jax.numpy as jnp

        f16 = jnp.float16
        args = (jax.ShapeDtypeStruct((self.batch, self.size, self.size, self.cin), f16),
                jax.ShapeDtypeStruct((self.cout, self.cin, 3, 3), f16), jax.ShapeDtypeStruct((self.cout,), f16))
        if not self.gn_silu:
            return conv3x3, args
        return gn_silu_conv3x3, (*args, jax.ShapeDtypeStruct((self.cin,), f16), jax.ShapeDtypeStruct((self.cin,), f16))

    def describe(self) -> dict:
        return {"m": self.batch * self.size * self.size, "k": 9 * self.cin, "n": self.cout}


# SD 1.5 at 512x512, batch 2: the 64x64-latent transformer's GEGLU half (320 -> 1280), its FF out
# (1280 -> 320) per image's 4096 tokens, and a cross-attention K/V projection of the 2 x 77 text
# tokens (768 -> 320; 154 rows: not a multiple of the tile).
SHAPES = (
    Shape("unet64.ff_in", 4096, 320, 1280),
    Shape("unet64.ff_out", 4096, 1280, 320),
    Shape("unet64.cross_kv", 154, 768, 320),
    # The 64x64 latent's ResNet conv (320 -> 320, batch 2), plain and with its GroupNorm + SiLU input.
    ConvShape("unet64.conv", 2, 64, 320, 320),
    ConvShape("unet64.conv.gn_silu", 2, 64, 320, 320, gn_silu=True),
)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    name: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    kind = "attention"

    def case(self):
        import jax
        import jax.numpy as jnp

        q = jax.ShapeDtypeStruct((self.batch, self.q_len, self.heads * self.head_dim), jnp.float16)
        kv = jax.ShapeDtypeStruct((self.batch, self.kv_len, self.heads * self.head_dim), jnp.float16)
        return attention_fn(self), (q, kv, kv)

    def describe(self) -> dict:
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "name"}


# SD 1.5 at 512x512, batch 2: the 64x64-latent transformer's self-attention (4096 tokens, 8 heads of
# 40) and cross-attention (4096 queries over the 77 text tokens); the 32x32 level's self-attention
# (1024 tokens, 8 heads of 80) and the 16x16 level's (256 tokens, 8 heads of 160); CLIP's causal
# self-attention (77 tokens, 12 heads of 64, the mask an additive bias).
ATTENTION_SHAPES = (
    AttentionShape("attn.unet64.self", 2, 8, 4096, 4096, 40),
    AttentionShape("attn.unet64.cross", 2, 8, 4096, 77, 40),
    AttentionShape("attn.unet32.self", 2, 8, 1024, 1024, 80),
    AttentionShape("attn.unet16.self", 2, 8, 256, 256, 160),
    AttentionShape("attn.clip.causal", 2, 12, 77, 77, 64, causal=True),
)
BACKENDS = ("mosaic", "pallas")


def dense(x, w, b):
    return x @ w + b


def attention_fn(shape: AttentionShape):
    """sd15's multi-head attention (`sd15.layers.attention`): q, k, v `[batch, seq, heads·head_dim]`
    projections read per head, `softmax(q kᵀ / sqrt(d) [+ causal mask]) v`, back to `[B, S, H·D]`."""
    import numpy as np

    from sd15.layers import attention

    mask = None
    if shape.causal:
        mask = np.where(np.arange(shape.q_len)[:, None] >= np.arange(shape.kv_len)[None, :], 0.0,
                        np.finfo(np.float32).min).astype(np.float32)

    def attend(q, k, v):
        return attention(q, k, v, shape.heads, bias=mask)

    return attend


def conv3x3(x, w, b):
    from sd15 import layers

    return layers.conv2d({"c.weight": w, "c.bias": b}, "c", x)


def gn_silu_conv3x3(x, w, b, gamma, beta):
    from sd15 import layers

    p = {"n.weight": gamma, "n.bias": beta, "c.weight": w, "c.bias": b}
    return layers.conv2d(p, "c", layers.silu(layers.group_norm(p, "n", x, 32, 1e-5)))


@contextlib.contextmanager
def dumping(directory: Path):
    """Mosaic GPU dumps each kernel's PTX and its ptxas `-v` report into `directory` while this holds
    (`MOSAIC_GPU_DUMP_*`; a compile subprocess inherits them). Mosaic also logs every MLIR pass per
    kernel there (`*.mlir-passes.log`, ~60 MB a kernel: 7 GB for the full UNet); nothing here reads
    them, and they are deleted when this ends."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(directory))
    try:
        yield directory
    finally:
        for log in directory.glob("*.mlir-passes.log"):
            log.unlink(missing_ok=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_dump(directory: Path) -> dict[str, tuple[Path, "ptx.PtxKernel", "ptx.PtxasResources | None"]]:
    """Every Mosaic kernel `.entry` dumped in `directory` -> (its PTX file, its static counts, the
    registers and spills of the ptxas `-v` report of its own compile: Mosaic's PTX ISA is newer than
    the pip ptxas reads); a kernel that ran an equal kernel's module (`emit.mosaic.kernel_cache`)
    -> that module's entry."""
    out = {}
    for path in sorted(Path(directory).glob("*.ptx")):
        verbose = path.with_suffix(".ptxas")
        resources = ptx.parse_ptxas_verbose(verbose.read_text()) if verbose.exists() else {}
        for name, counts in ptx.read_ptx(path.read_text(errors="replace")).items():
            out[name] = (path, counts, resources.get(name))
    served = Path(directory) / kernel_cache.SERVED_FILE  # kernels that ran an equal kernel's module
    for line in (served.read_text().splitlines() if served.exists() else []):
        name, module = line.split("\t")
        for entry in [e for e in out if e.startswith(module) and e[len(module):] in ("", "_mosaic_gpu_kernel")]:
            out.setdefault(name + entry[len(module):], out[entry])
    return out


def compile_case(shape: Shape | ConvShape | AttentionShape, backend: str, dump: Path, ptxas: Path) -> dict:
    """Plan the case's function at `shape`, emit it with `backend`, compile it for an H100, read its PTX."""
    import emit
    import eqsat
    from measure.xla_target import compile_for_h100

    fn, args = shape.case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = eqsat.optimize(fn, progress=False).lower(*args).plan
    ops = [k.term.op for k in plan.kernels]
    mosaic_dump = dump / "mosaic"
    with dumping(mosaic_dump):
        report = compile_for_h100(emit.emit(plan, backend, interpret=False), *args, keep_dump=dump / "xla")
    if report is None:
        raise RuntimeError("the H100 compile target is not installed (jax-cuda12-plugin)")
    if backend == "mosaic":
        kernels = read_dump(mosaic_dump)
    else:
        kernels = {}
        for path in sorted((dump / "xla").glob("*.ptx")):
            for name, counts in ptx.read_ptx(path.read_text(errors="replace")).items():
                kernels[name] = (path, counts, None)
    matching = {name: entry for name, entry in kernels.items() if shape.kind in name}
    if len(matching) != 1:
        raise RuntimeError(f"{shape.name} {backend}: expected one {shape.kind} entry in the PTX, found {sorted(kernels)}")
    (name, (path, counts, resources)), = matching.items()
    if backend != "mosaic":
        resources = ptx.run_ptxas(path, ptxas=ptxas).get(name)
    return {
        "shape": shape.name, **shape.describe(), "backend": backend, "plan_ops": ops,
        "entry": name, "launches": report.kernels, "by_category": report.by_category,
        "tensor_core": counts.tensor_core, "wgmma": counts.wgmma, "wgmma_wait_depth": counts.wgmma_wait_depth,
        "tma_loads": counts.tma_loads, "vector_load_fraction": counts.vector_load_fraction,
        "registers": resources.registers if resources else None,
        "spill_bytes": resources.spill_bytes if resources else None,
        "compile_s": round(report.compile_seconds, 2),
    }


def run(shapes=SHAPES + ATTENTION_SHAPES, backends=BACKENDS, dump: Path | None = None) -> list[dict]:
    ptxas = ptx.ptxas_path()
    root = Path(dump) if dump is not None else Path(tempfile.mkdtemp(prefix="mosaic_ptx_"))
    rows = []
    for shape in shapes:
        for backend in backends:
            rows.append(compile_case(shape, backend, root / shape.name / backend, ptxas))
            print(f"  {shape.name} {backend}: done", file=sys.stderr, flush=True)
    return rows


COLUMNS = ("shape", "backend", "launches", "tensor_core", "wgmma", "wgmma_wait_depth", "tma_loads",
           "vector_load_fraction", "registers", "spill_bytes", "compile_s")


def render(rows: list[dict]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:.2f}"
        return "-" if value is None else str(value)

    table = [COLUMNS] + [tuple(cell(row[c]) for c in COLUMNS) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="shapes whose name starts with this")
    parser.add_argument("--backend", choices=BACKENDS, action="append", help="one template only (repeatable)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--dump", help="keep the PTX and XLA dumps here")
    args = parser.parse_args(argv)
    shapes = [s for s in SHAPES + ATTENTION_SHAPES if s.name.startswith(args.only)]
    try:
        rows = run(shapes, tuple(args.backend or BACKENDS), args.dump)
    except ptx.PtxasMissing as error:
        print(error, file=sys.stderr)
        return 2
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
