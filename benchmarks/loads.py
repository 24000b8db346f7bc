"""How the matmul and conv templates' kernels load, read from their sm_90 PTX (no GPU): SD 1.5
shapes through `eqsat.optimize(fn, backend="pallas", params_argnums=0)`, the per-call stage
compiled for an H100 (`measure.xla_target`, as `sd15 plan` does; the prepared weights are inputs),
and for each matmul and conv kernel:

- global loads by width (static PTX instructions): `ld.global` scalar (b16/b32/...) and vector
  (v2/v4, >= 64 bit), `cp.async` by its byte count; `vector_fraction`: the share of loaded bytes
  (instruction width x count, static) moved by >= 64-bit loads or `cp.async` of >= 8 bytes;
  `st.global` stores by width beside them;
- MMA: `wgmma.mma_async` / `mma.sync`, and the largest `wgmma.wait_group N` (N >= 1: an MMA is
  still in flight while the next tiles load);
- `ptxas -arch=sm_90a -v` (the pip package `nvidia-cuda-nvcc-cu12`): registers, spill bytes.

    python -m benchmarks.loads                                  # every case
    python -m benchmarks.loads --only clip_layer --json out.json --dump DIR

Cases: `transformer_block_320`, the SD 1.5 down_blocks.0 transformer block (4,096 tokens x 320,
8 heads of 40, 77 x 768 context, fp16: LayerNorm prologues, fused QKV, GEGLU, residual epilogues);
`clip_layer`, one CLIP encoder layer (2 x 77 tokens x 768, 12 heads, MLP 3,072, fp16);
`resnet_block_320`, the down_blocks.0 ResNet block (2 x 64 x 64 x 320, GroupNorm + SiLU prologues,
3 x 3 convs, time embedding, fp16).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from sd15.params import transformer_block_shapes

LOAD = re.compile(r"\bld\.global((?:\.[\w:]+)*)\s")
STORE = re.compile(r"\bst\.global((?:\.[\w:]+)*)\s")
CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
WAIT_GROUP = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
ENTRY = re.compile(r"^\.visible \.entry (\S+)\(", re.MULTILINE)
BITS = {"b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16, "b32": 32, "u32": 32, "s32": 32,
        "f32": 32, "b64": 64, "u64": 64, "s64": 64, "f64": 64, "b128": 128}


def ptxas_path() -> str:
    """`benchmarks.ptx.ptxas_path`: the pip package's ptxas, in this environment or eqsat's CUDA target dir."""
    from benchmarks.ptx import ptxas_path as find

    return str(find())


def load_widths(ptx: str, pattern: re.Pattern = LOAD) -> dict[str, int]:
    """Static global-load instructions by width: `"b16"`, `"v4.b32"`, `"cp.async.16"` -> count
    (with `pattern=STORE`, the `st.global` stores)."""
    counts: dict[str, int] = {}
    for suffixes in pattern.findall(ptx):
        parts = [p for p in suffixes.split(".") if p]
        vector = next((p for p in parts if p in ("v2", "v4", "v8")), None)
        width = next(p for p in reversed(parts) if p in BITS)
        key = f"{vector}.{width}" if vector else width
        counts[key] = counts.get(key, 0) + 1
    for size in CP_ASYNC.findall(ptx) if pattern is LOAD else ():
        key = f"cp.async.{int(size, 0)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def load_bytes(key: str) -> int:
    if key.startswith("cp.async."):
        return int(key.rsplit(".", 1)[1])
    lanes, _, width = key.rpartition(".")
    return (int(lanes[1:]) if lanes else 1) * BITS[width] // 8


def vector_fraction(widths: dict[str, int]) -> float:
    """The share of statically loaded bytes moved by >= 64-bit loads (or cp.async of >= 8 bytes)."""
    total = sum(load_bytes(k) * n for k, n in widths.items())
    vector = sum(load_bytes(k) * n for k, n in widths.items() if load_bytes(k) >= 8)
    return vector / total if total else 1.0


def ptxas_stats(ptx: str, entry: str, scratch: Path) -> dict[str, int]:
    """`ptxas -arch=sm_90a -v` on the one kernel: registers and spill bytes (stores + loads)."""
    source = scratch / f"{entry}.ptx"
    source.write_text(ptx)
    result = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", str(source), "-o", str(scratch / f"{entry}.cubin")],
                            capture_output=True, text=True)
    text = result.stdout + result.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None:
        raise RuntimeError(f"ptxas on {entry}: {text[-2000:]}")
    return {"registers": int(registers.group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0}


def kernel_ptx(dump: Path) -> dict[str, str]:
    """Entry name -> a standalone PTX module holding that entry (the module header kept)."""
    modules: dict[str, str] = {}
    for path in sorted(dump.glob("*.ptx")):
        text = path.read_text(errors="replace")
        starts = [(m.start(), m.group(1)) for m in ENTRY.finditer(text)]
        header = text[:starts[0][0]] if starts else ""
        for i, (start, name) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
            modules[name] = header + text[start:end]
    return modules


def measure(ptx: str, entry: str, scratch: Path) -> dict:
    widths = load_widths(ptx)
    waits = [int(n) for n in WAIT_GROUP.findall(ptx)]
    return {
        "kernel": entry,
        "loads": dict(sorted(widths.items())),
        "vector_fraction": round(vector_fraction(widths), 4),
        "stores": dict(sorted(load_widths(ptx, STORE).items())),
        "mma": "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
        "max_wait_group": max(waits) if waits else None,
        **ptxas_stats(ptx, entry, scratch),
    }


# --- the cases -----------------------------------------------------------------------------------


def _f16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float16)


def transformer_block_case():
    from sd15.unet import transformer_block

    width, context_width, tokens, heads = 320, 768, 4096, 8
    shapes = dict(transformer_block_shapes("b", width, context_width))
    params = {k: _f16(*s) for k, s in shapes.items()}
    fn = functools.partial(_block, transformer_block, heads)
    return fn, (params, _f16(2, tokens, width), _f16(2, 77, context_width))


def _block(transformer_block, heads, params, x, context):
    return transformer_block(params, "b", x, context, heads)


def clip_layer_case():
    from sd15 import clip
    from sd15.config import CLIPConfig

    config = CLIPConfig()
    shapes = {}
    for name in ("layer_norm1", "layer_norm2"):
        shapes[f"l.{name}.weight"] = shapes[f"l.{name}.bias"] = (config.hidden_size,)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        shapes[f"l.self_attn.{name}.weight"] = (config.hidden_size, config.hidden_size)
        shapes[f"l.self_attn.{name}.bias"] = (config.hidden_size,)
    shapes["l.mlp.fc1.weight"], shapes["l.mlp.fc1.bias"] = (config.intermediate_size, config.hidden_size), \
        (config.intermediate_size,)
    shapes["l.mlp.fc2.weight"], shapes["l.mlp.fc2.bias"] = (config.hidden_size, config.intermediate_size), \
        (config.hidden_size,)
    params = {k: _f16(*s) for k, s in shapes.items()}
    fn = functools.partial(_clip_layer, config)
    return fn, (params, _f16(2, 77, config.hidden_size))


def _clip_layer(config, params, x):
    from sd15 import clip

    return clip.encoder_layer(params, config, "l", x)


def resnet_block_case():
    from sd15.layers import resnet_block

    fan, temb = 320, 1280
    shapes = {"norm1.weight": (fan,), "norm1.bias": (fan,), "conv1.weight": (fan, fan, 3, 3), "conv1.bias": (fan,),
              "time_emb_proj.weight": (fan, temb), "time_emb_proj.bias": (fan,), "norm2.weight": (fan,),
              "norm2.bias": (fan,), "conv2.weight": (fan, fan, 3, 3), "conv2.bias": (fan,)}
    params = {f"r.{k}": _f16(*s) for k, s in shapes.items()}
    fn = functools.partial(_resnet, resnet_block)
    return fn, (params, _f16(2, 64, 64, fan), _f16(2, temb))


def _resnet(resnet_block, params, x, temb):
    return resnet_block(params, "r", x, temb, groups=32, eps=1e-5)


CASES = {"transformer_block_320": transformer_block_case, "clip_layer": clip_layer_case,
         "resnet_block_320": resnet_block_case}
KINDS = ("matmul", "conv")


def run_case(name: str, dump: Path | None = None) -> list[dict]:
    import eqsat
    from measure import xla_target
    from measure.compare import emitted_per_call, planned_kernel_names

    fn, args = CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = eqsat.optimize(fn, backend="pallas", params_argnums=0, progress=False)
        lowered = fast.lower(*args)
    prepared = lowered.split.prepared_specs()
    kernels = {re.sub(r"[^A-Za-z0-9_]", "_", n) for n in planned_kernel_names(lowered) if n.endswith(KINDS)}
    with tempfile.TemporaryDirectory(prefix="loads_") as scratch:
        where = dump / name if dump is not None else Path(scratch) / "dump"
        xla_target.compile_for_h100(functools.partial(emitted_per_call, fast), prepared, *args, keep_dump=where)
        modules = kernel_ptx(where)
        rows = [measure(ptx, entry, Path(scratch)) for entry, ptx in sorted(modules.items())
                if re.sub(r"__\d+$", "", entry) in kernels]
    return rows


def summary(rows: list[dict]) -> dict:
    widths: dict[str, int] = {}
    for row in rows:
        for key, count in row["loads"].items():
            widths[key] = widths.get(key, 0) + count
    waits = [row["max_wait_group"] for row in rows]
    return {"kernels": len(rows), "loads": dict(sorted(widths.items())),
            "vector_fraction": round(vector_fraction(widths), 4),
            "min_wait_group": min((w for w in waits if w is not None), default=None),
            "wgmma_kernels": sum(row["mma"] == "wgmma" for row in rows),
            "max_registers": max(row["registers"] for row in rows),
            "spill_bytes": sum(row["spill_bytes"] for row in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES))
    parser.add_argument("--json")
    parser.add_argument("--dump", type=Path, help="keep each case's XLA dump (PTX) under DIR/<case>")
    options = parser.parse_args(argv)
    results = {}
    for name in options.only or CASES:
        rows = run_case(name, options.dump)
        results[name] = {"summary": summary(rows), "kernels": rows}
        print(f"== {name}")
        for row in rows:
            loads = " ".join(f"{k}:{v}" for k, v in row["loads"].items())
            print(f"  {row['kernel'][:60]:60s} vec {row['vector_fraction']:.2f} {row['mma']:8s} "
                  f"wait {row['max_wait_group']} regs {row['registers']} spill {row['spill_bytes']}  {loads}  "
                  f"stores {' '.join(f'{k}:{v}' for k, v in row['stores'].items())}")
        print(f"  total: {json.dumps(results[name]['summary'])}")
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
