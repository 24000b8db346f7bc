"""Differential test campaign: random JAX programs built from the patterns real models use, run
through `eqsat.optimize(fn, backend=B)` and through `jax.jit(fn)`, compared, and every failure
shrunk to a minimal program printed as Python source.

    python -m benchmarks.fuzz --backend xla|pallas|hybrid|mosaic --programs N [--seed S] [--json out.json]

A program (`Program`) is a list of `Step`s over a pool of arrays: each step reads earlier values
(its `args`; mostly the newest one, through a "view" step that merges axes or adds size-1 ones when
its family needs another rank, so families compose), owns its weights (inputs it adds to the
function's signature) and writes one value (`out`); the function returns the values no step reads.
Shapes are expressions over named sizes (`sizes`: "S3", "(H2 + 1) // 2", "G4*3"), so a program can
be re-rendered with smaller sizes. `Program.source()` renders the step list as a self-contained
script (imports, `def f(...)`, the arguments, the comparison), the program's one source of truth:
`Program.fn()` is that function, exec'd. Everything is deterministic from (seed, index) through
numpy's `Generator`; program i requires family `FAMILIES[i % len(FAMILIES)]` (several for short
campaigns), so every family appears.

Families (`FAMILIES`): LayerNorm/RMSNorm (jnp.var, the fast variance `max(mean(x*x) - mean(x)**2, 0)`,
flax's spelling of it, fp32 upcasts; the fast variance is clamped at 0 as flax clamps it: unclamped,
`rsqrt` of a cancelled difference is NaN or not depending on which products the compiler contracts
into FMAs, under `jax.jit` as under eqsat) feeding matmuls; GroupNorm over reshaped NHWC groups (1-4
channels per group, 3 often, or one group) feeding 3x3/1x1 `lax.conv_general_dilated` convs,
stride 1/2; matmuls written as `@`, einsum, dot, dot_general, `x @ w.T`; activations; residual
chains and pre-norm MLP / ResNet blocks; attention written several ways (einsum
"bhqk,bhkd->bhqd", "...qk,...kd", `@` with a hand-written softmax, "bqhd" layouts,
`jax.nn.dot_product_attention`; self and cross) with causal / padding masks filled with -inf,
finfo.min, -1e9 or added; softmax pooling "bs,bsh->bh"; concatenations / tiles / splits / slices
of matmul outputs (the same matmul twice, a norm concatenated with its input), optionally summed;
reductions (sums, max, logsumexp, norms); bool and integer reductions (argmax / max over bools,
sums of ints, any / all); zero-size and size-1 axes; 1-D operands (`ln(x) @ w`); `lax.cond` /
`lax.switch` / `lax.scan` / `lax.fori_loop` / `lax.while_loop` whose bodies normalize a matmul,
or read a norm of a matmul computed outside; gradients of cross-entropy (one-hot and integer
labels) / logsumexp / MSE losses of a small MLP. float32 mostly, some float16 and bfloat16
programs, int32 and bool values. Inputs are centred, offset (+-300 + 0.05 randn), constant along
rows, zeros, huge or tiny; sizes odd (3, 5, 7, 77, 40) and small (Pallas interpret mode).

Classes (`run_program`):

- equal: the values agree within a tolerance scaled to the output's and the inputs' magnitude
  (`TOLERANCE`); where they do not, a float64 run of the same program (`jax.jit` under
  `jax.enable_x64`) arbitrates: eqsat's answer is still equal when it is within tolerance of the
  float64 one or no further than 10x `jax.jit`'s distance from it (e.g. a cancelling fast variance
  that eqsat computes stably: `Result.note` says so);
- wrong: values differ beyond that, or shapes / dtypes / the output structure differ;
- crashed: `eqsat.optimize` or the call raised (type and first line of the message recorded);
- fell back: equal, but an eqsat warning was raised (`emit.pallas.XlaFallbackWarning`,
  `eqsat.lift.OpaqueWarning`, ...; the saturation/extraction limit warnings this harness's small
  limits cause are recorded as `limits`, not counted);
- jit fails: `jax.jit(fn)` itself fails: skipped.

Crashes are grouped by (exception type, message with numbers stripped), fallbacks by warning,
wrong answers by what differs and the program's families; the smallest program of each group is
shrunk (`shrink`: drop steps with their dependents, bypass steps, clear optional parts, smaller
sizes, plainer inputs) while it fails the same way (same status and class), within a time budget,
and its source printed; wrong answers whose shrunk programs have the same steps are merged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import linecache
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import eqsat  # noqa: E402,F401  before jax: no CUDA plugin noise without a GPU (eqsat.quiet_cuda)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

FAMILIES = ("norm", "groupnorm", "matmul", "conv", "act", "residual", "attention", "pool", "concat",
            "reduce", "reduce_int", "sizes", "vector", "control", "grad")
FLOATS = ("float32", "float16", "bfloat16")
STATUSES = ("equal", "crashed", "wrong", "fell_back", "jit_fails")
COLUMNS = (("programs", None), ("equal", "equal"), ("crashed", "crashed"), ("wrong", "wrong"),
           ("fell back", "fell_back"), ("jit fails (skipped)", "jit_fails"))
EQSAT_PACKAGES = ("eqsat", "emit", "extract")
LIMIT_WARNINGS = ("SaturationLimitWarning", "ExtractionLimitWarning")

# (rtol, k): |got - want| <= rtol * max|want| + k * max|float inputs|, per output dtype
TOLERANCE = {"float32": (2e-4, 1e-4), "float16": (2e-2, 4e-3), "bfloat16": (6e-2, 3e-2), "float64": (2e-4, 1e-4)}

# sizes drawn per role: odd sizes, small enough for Pallas interpret mode (~35 us a grid step)
SIZES = {
    "batch": (1, 2, 2, 3),
    "seq": (3, 5, 7, 8, 16, 40, 77),
    "feat": (3, 4, 5, 7, 8, 16, 40),
    "hidden": (4, 5, 8, 16),
    "spatial": (1, 3, 4, 5, 7, 8),
    "heads": (1, 2, 3),
    "head_dim": (2, 4, 5, 8),
    "groups": (1, 2, 3, 4),
    "classes": (3, 5, 7),
    "time": (1, 2, 3, 5),
}
REGIMES = (("centred", 0.35), ("offset", 0.2), ("constant", 0.1), ("zeros", 0.05), ("huge", 0.1),
           ("tiny", 0.1), ("uniform", 0.1))


# --------------------------------------------------------------------------------------------------
# programs


@dataclass(frozen=True)
class Input:
    """One argument of the program's function: its name, shape (size expressions), dtype, how its
    values are drawn (`regime`) and the seed of its `np.random.default_rng`."""

    name: str
    shape: tuple
    dtype: str
    regime: str
    seed: int


@dataclass(frozen=True)
class Step:
    """One step: `kind` (a family) and `variant`, the values it reads, the value it writes, its
    parameters (`params["flags"]` lists the optional parts the shrinker may switch off), the
    symbolic shape and dtype of `out`, and the seed its weights are drawn from."""

    kind: str
    variant: str
    args: tuple
    out: str
    params: dict
    shape: tuple
    dtype: str
    seed: int

    def flag(self, name: str) -> bool:
        return bool(self.params.get(name))


@dataclass
class Program:
    sizes: dict
    dtype: str
    inputs: list                  # the data inputs steps read (weights belong to their steps)
    steps: list
    seed: int = 0
    index: int = 0

    # ---- structure
    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    def step_weights(self, step: Step) -> list:
        return render(step, self.sizes)[1]

    def used(self) -> set:
        return {a for step in self.steps for a in step.args}

    def arguments(self) -> list:
        """The function's parameters, in order: the data inputs read, then each step's weights."""
        used = self.used()
        return [i for i in self.inputs if i.name in used] + [w for s in self.steps for w in self.step_weights(s)]

    def outputs(self) -> list:
        """The values no later step reads (the last step's always among them)."""
        used = self.used()
        return [s.out for s in self.steps if s.out not in used]

    def families(self) -> tuple:
        return tuple(sorted({s.kind for s in self.steps}))

    def signature(self) -> tuple:
        return tuple(sorted({f"{s.kind}.{s.variant}" for s in self.steps}))

    def size_of(self, expr) -> int:
        return evaluate_size(expr, self.sizes)

    # ---- source
    def function_source(self, name: str = "f", outputs=None) -> str:
        params = ", ".join(a.name for a in self.arguments())
        lines = [f"def {name}({params}):"]
        for step in self.steps:
            lines += ["    " + line for line in render(step, self.sizes)[0]]
        outs = self.outputs() if outputs is None else outputs
        lines.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        return "\n".join(lines) + "\n"

    def args_source(self) -> str:
        lines = ["args = ["]
        for a in self.arguments():
            kind, _, arg = a.regime.partition(":")
            regime = f"labels in [0, {evaluate_size(arg, self.sizes)})" if kind == "labels" else a.regime
            lines.append(f"    {input_source(a, self.sizes)},  # {a.name}: {regime}")
        lines.append("]")
        return "\n".join(lines) + "\n"

    def source(self, backend: str | None = None, options: dict | None = None, header: str = "") -> str:
        """The program as a script: imports, `f`, `args`, and (with a backend) the comparison of
        `eqsat.optimize(f, backend=...)` with `jax.jit(f)`."""
        parts = []
        if header:
            parts.append("".join(f"# {line}\n" for line in header.splitlines()))
        parts.append("import jax\nimport jax.numpy as jnp\nimport numpy as np\nfrom jax import lax\n")
        if backend is not None:
            parts[-1] += "\nimport eqsat\n"
        parts.append(self.function_source())
        parts.append(self.args_source())
        if backend is not None:
            opts = "".join(f", {k}={v!r}" for k, v in (options or {}).items())
            parts.append(
                'with jax.default_matmul_precision("highest"):\n'
                "    want = jax.jit(f)(*args)\n"
                f"    got = eqsat.optimize(f, backend={backend!r}{opts})(*args)\n"
                "for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):\n"
                "    a, b = np.asarray(g, np.float64), np.asarray(w, np.float64)\n"
                "    same = (a == b) | (np.isnan(a) & np.isnan(b))  # NaN where only one side is NaN\n"
                "    print(g.shape, g.dtype, w.shape, w.dtype, \"max |got - want|:\",\n"
                "          np.max(np.where(same, 0.0, np.abs(a - b)), initial=0.0) if a.shape == b.shape else \"-\")\n")
        return "\n".join(parts)

    def fn(self, outputs=None, *, wide: bool = False):
        """The program's function (its rendered source, exec'd). `wide`: every float dtype the source
        names (`.astype(jnp.float32)`, ...) is float64, for the float64 reference (under x64)."""
        name = f"<fuzz {self.seed}:{self.index}:{id(self)}{':wide' if wide else ''}>"
        src = NAMESPACE_SOURCE + ("jnp, np = _wide(jnp), _wide(np)\n" if wide else "") + self.function_source(outputs=outputs)
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # tracebacks show the lines
        namespace: dict = {"_wide": _WideFloats}
        exec(compile(src, name, "exec"), namespace)
        return namespace["f"]

    def args(self) -> list:
        namespace = {"np": np, "jnp": jnp}
        return [eval(input_source(a, self.sizes), namespace) for a in self.arguments()]

    def to_json(self) -> dict:
        return {"seed": self.seed, "index": self.index, "dtype": self.dtype, "sizes": dict(self.sizes),
                "inputs": [dataclasses.asdict(i) for i in self.inputs],
                "steps": [dataclasses.asdict(s) for s in self.steps]}

    @classmethod
    def from_json(cls, data: dict) -> "Program":
        inputs = [Input(**{**i, "shape": tuple(i["shape"])}) for i in data["inputs"]]
        steps = [Step(**{**s, "args": tuple(s["args"]), "shape": tuple(s["shape"])}) for s in data["steps"]]
        return cls(dict(data["sizes"]), data["dtype"], inputs, steps, data.get("seed", 0), data.get("index", 0))


NAMESPACE_SOURCE = "import jax\nimport jax.numpy as jnp\nimport numpy as np\nfrom jax import lax\n"


class _WideFloats:
    """`jnp` or `np` with float16, bfloat16 and float32 meaning float64: a program's explicit casts
    (an fp32 upcast, a cast back to the input's dtype) stay exact in the float64 reference."""

    NARROW = ("float16", "bfloat16", "float32")

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, "float64" if name in self.NARROW else name)


def evaluate_size(expr, sizes: dict) -> int:
    return int(eval(str(expr), {"__builtins__": {"min": min}}, sizes))


def _p(expr: str) -> str:
    """`expr` parenthesized unless it is a name or a number."""
    return expr if re.fullmatch(r"\w+", expr) else f"({expr})"


def times(expr: str, k: int) -> str:
    return f"{_p(expr)}*{k}"


def input_source(a: Input, sizes: dict) -> str:
    """A numpy expression that makes the values of input `a` (the reproducer's and `Program.args`')."""
    shape = tuple(evaluate_size(d, sizes) for d in a.shape)
    rng = f"np.random.default_rng({a.seed})"
    cast = {"float32": ".astype(np.float32)", "float16": ".astype(np.float16)",
            "bfloat16": ".astype(jnp.bfloat16)", "int32": ".astype(np.int32)", "bool": ""}[a.dtype]
    big = {"float32": "3e4", "float16": "200.0", "bfloat16": "3e3"}.get(a.dtype, "3e4")
    kind, _, arg = a.regime.partition(":")
    if kind == "centred":
        expr = f"{rng}.standard_normal({shape})"
    elif kind == "offset":
        expr = f"({arg or '300.0'} + 0.05 * {rng}.standard_normal({shape}))"
    elif kind == "constant":
        expr = f"np.broadcast_to({rng}.uniform(-3.0, 3.0, {shape[:-1] + (1,)}), {shape})"
    elif kind == "zeros":
        expr = f"np.zeros({shape})"
    elif kind == "huge":
        expr = f"({big} * {rng}.standard_normal({shape}))"
    elif kind == "tiny":
        expr = f"(1e-3 * {rng}.standard_normal({shape}))"
    elif kind == "uniform":
        expr = f"{rng}.uniform(-2.0, 2.0, {shape})"
    elif kind == "weight":
        expr = f"({arg} * {rng}.standard_normal({shape}))"
    elif kind == "gamma":
        expr = f"(1.0 + 0.1 * {rng}.standard_normal({shape}))"
    elif kind == "mask":
        return f"({rng}.random({shape}) < {arg or '0.8'})"
    elif kind == "labels":
        expr = f"{rng}.integers(0, {evaluate_size(arg, sizes)}, {shape})"
    elif kind == "ints":
        expr = f"{rng}.integers(-5, 6, {shape})"
    else:
        raise ValueError(f"unknown regime {a.regime!r}")
    return expr + cast


# --------------------------------------------------------------------------------------------------
# rendering: step -> (source lines, weight inputs)

EPS = (1e-5, 1e-6, 1e-12)
ACTS = {"gelu": "jax.nn.gelu({})", "gelu_exact": "jax.nn.gelu({}, approximate=False)", "silu": "jax.nn.silu({})",
        "tanh": "jnp.tanh({})", "relu": "jax.nn.relu({})", "swish": "{0} * jax.nn.sigmoid({0})",
        "gelu_tanh": "0.5 * {0} * (1.0 + jnp.tanh(0.7978845608 * ({0} + 0.044715 * {0} ** 3)))"}


class _W:
    """Collects a step's weight inputs while it renders."""

    def __init__(self, step: Step, dtype: str):
        self.step, self.dtype, self.inputs = step, dtype, []

    def __call__(self, suffix: str, shape, regime: str = "w", dtype: str | None = None, fan_in=None) -> str:
        name = f"{self.step.out}_{suffix}"
        if regime == "w":
            regime = f"weight:{0.5 if fan_in is None else round(1.0 / math.sqrt(max(fan_in, 1)), 4)}"
        self.inputs.append(Input(name, tuple(str(d) for d in shape), dtype or self.dtype, regime,
                                 self.step.seed * 16 + len(self.inputs)))
        return name


def _ln(x: str, eps, axes="-1") -> str:
    return f"({x} - {x}.mean({axes}, keepdims=True)) * lax.rsqrt({x}.var({axes}, keepdims=True) + {eps})"


def render(step: Step, sizes: dict) -> tuple[list, list]:
    """The source lines of `step` (assigning `step.out`) and the weight inputs it owns."""
    lines: list = []
    w = _W(step, step.params.get("wdtype", step.dtype if step.dtype in FLOATS else "float32"))
    RENDERERS[step.kind](step, sizes, lines, w)
    return lines, w.inputs


def _size(sizes, expr) -> int:
    return evaluate_size(expr, sizes)


def r_norm(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    eps = p["eps"]
    K = p["K"]
    x = a
    if s.variant == "ln_f32":
        L.append(f"{o}_x = {a}.astype(jnp.float32)")
        x = f"{o}_x"
    if s.variant in ("ln", "ln_f32"):
        L.append(f"{o} = {_ln(x, eps)}")
    elif s.variant == "ln_fast":
        L.append(f"{o}_m = {x}.mean(-1, keepdims=True)")
        L.append(f"{o} = ({x} - {o}_m) * lax.rsqrt(jnp.maximum(({x} * {x}).mean(-1, keepdims=True) - {o}_m ** 2, 0.0)"
                 f" + {eps})")
    elif s.variant == "ln_flax":
        L.append(f"{o}_m = jnp.mean({x}, -1, keepdims=True)")
        L.append(f"{o}_v = jnp.maximum(0.0, jnp.mean(jnp.square({x}), -1, keepdims=True) - jnp.square({o}_m))")
        L.append(f"{o} = ({x} - {o}_m) * lax.rsqrt({o}_v + {eps})")
    elif s.variant == "rms":
        L.append(f"{o} = {x} * lax.rsqrt(jnp.mean({x} * {x}, -1, keepdims=True) + {eps})")
    else:
        raise ValueError(s.variant)
    if s.variant == "ln_f32":
        L.append(f"{o} = {o}.astype({a}.dtype)")
    if s.flag("affine"):
        g = w("g", (K,), "gamma")
        b = w("b", (K,), "weight:0.1") if s.variant != "rms" else None
        L.append(f"{o} = {o} * {g}" + (f" + {b}" if b else ""))
    if s.flag("proj"):
        m = w("w", (K, p["N"]), fan_in=_size(sizes, K))
        L.append(f"{o} = {o} @ {m}")
        if s.flag("proj_bias"):
            L.append(f"{o} = {o} + {w('pb', (p['N'],), 'weight:0.1')}")


def r_groupnorm(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    G, cpg = _size(sizes, p["G"]), _size(sizes, p["cpg"])
    L.append(f"{o}_r = {a}.reshape({a}.shape[:-1] + ({G}, {cpg}))")
    L.append(f"{o}_m = {o}_r.mean((1, 2, 4), keepdims=True)")
    if s.variant == "fast":
        L.append(f"{o}_v = jnp.maximum(jnp.mean({o}_r * {o}_r, (1, 2, 4), keepdims=True) - {o}_m ** 2, 0.0)")
    else:
        L.append(f"{o}_v = {o}_r.var((1, 2, 4), keepdims=True)")
    L.append(f"{o} = (({o}_r - {o}_m) * lax.rsqrt({o}_v + {p['eps']})).reshape({a}.shape)")
    C = p["C"]
    if s.flag("affine"):
        L.append(f"{o} = {o} * {w('g', (C,), 'gamma')} + {w('b', (C,), 'weight:0.1')}")
    if s.flag("silu"):
        L.append(f"{o} = jax.nn.silu({o})")
    if s.flag("conv"):
        k = w("k", (3, 3, C, p["Cout"]), fan_in=9 * _size(sizes, C))
        L.append(f'{o} = lax.conv_general_dilated({o}, {k}, (1, 1), "SAME", '
                 f'dimension_numbers=("NHWC", "HWIO", "NHWC"))')


def r_matmul(s: Step, sizes, L, w):
    """matmul with an optional activation, the pre-activation in its own line when the activation
    reads it more than once."""
    a, o, p = s.args[0], s.out, s.params
    K, N = p["K"], p["N"]
    fan = _size(sizes, K)
    v = s.variant
    if v == "linear_t":
        m = w("w", (N, K), fan_in=fan)
        expr = f"{a} @ {m}.T"
    else:
        m = w("w", (K, N), fan_in=fan)
        expr = {"at": f"{a} @ {m}", "einsum": f'jnp.einsum("...k,kn->...n", {a}, {m})', "dot": f"jnp.dot({a}, {m})",
                "dot_general": f"lax.dot_general({a}, {m}, ((({p['rank'] - 1},), (0,)), ((), ())))"}[v]
    if s.flag("bias"):
        expr = f"{expr} + {w('b', (N,), 'weight:0.1')}"
    if s.flag("act"):
        L.append(f"{o} = {expr}")
        L.append(f"{o} = {ACTS[p['act']].format(o)}")
    else:
        L.append(f"{o} = {expr}")


def r_conv(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    kh, stride, pad = p["kh"], p["stride"], p["pad"]
    k = w("k", (kh, kh, p["C"], p["Cout"]), fan_in=kh * kh * _size(sizes, p["C"]))
    pad_src = f'"{pad}"' if isinstance(pad, str) else repr(tuple(tuple(int(x) for x in lo_hi) for lo_hi in pad))
    L.append(f"{o} = lax.conv_general_dilated({a}, {k}, ({stride}, {stride}), {pad_src}, "
             f'dimension_numbers=("NHWC", "HWIO", "NHWC"))')
    if s.flag("bias"):
        L.append(f"{o} = {o} + {w('b', (p['Cout'],), 'weight:0.1')}")


def r_act(s: Step, sizes, L, w):
    L.append(f"{s.out} = {ACTS[s.variant].format(s.args[0])}")


def r_residual(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    if s.variant == "add":
        L.append(f"{o} = {a} + {s.args[1]}")
    elif s.variant == "scaled":
        L.append(f"{o} = {a} + 0.5 * jax.nn.silu({a})")
    elif s.variant == "mlp_block":
        K, Hd = p["K"], p["Hd"]
        L.append(f"{o}_h = {_ln(a, p['eps'])}")
        w1 = w("w1", (K, Hd), fan_in=_size(sizes, K))
        b1 = w("b1", (Hd,), "weight:0.1")
        w2 = w("w2", (Hd, K), fan_in=_size(sizes, Hd))
        L.append(f"{o}_h = jax.nn.gelu({o}_h @ {w1} + {b1})")
        L.append(f"{o} = {a} + {o}_h @ {w2}")
    elif s.variant == "resnet_block":
        C, G, cpg = p["C"], _size(sizes, p["G"]), _size(sizes, p["cpg"])
        x = a
        for i in (1, 2):
            L.append(f"{o}_r = {x}.reshape({x}.shape[:-1] + ({G}, {cpg}))")
            L.append(f"{o}_h = (({o}_r - {o}_r.mean((1, 2, 4), keepdims=True)) * "
                     f"lax.rsqrt({o}_r.var((1, 2, 4), keepdims=True) + 1e-5)).reshape({x}.shape)")
            k = w(f"k{i}", (3, 3, C, C), fan_in=9 * _size(sizes, C))
            L.append(f'{o}_h = lax.conv_general_dilated(jax.nn.silu({o}_h), {k}, (1, 1), "SAME", '
                     f'dimension_numbers=("NHWC", "HWIO", "NHWC"))')
            x = f"{o}_h"
        L.append(f"{o} = {a} + {o}_h")
    else:
        raise ValueError(s.variant)


def r_attention(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    kv = s.args[1] if len(s.args) > 1 else a
    D, E = p["D"], p["E"]
    H, Dh = _size(sizes, p["H"]), _size(sizes, p["Dh"])
    HD = f"{_p(p['H'])}*{_p(p['Dh'])}"
    wq = w("wq", (D, HD), fan_in=_size(sizes, D))
    wk = w("wk", (E, HD), fan_in=_size(sizes, E))
    wv = w("wv", (E, HD), fan_in=_size(sizes, E))
    scale = round(1.0 / math.sqrt(max(Dh, 1)), 6)
    v = s.variant
    L.append(f"{o}_q = ({a} @ {wq}).reshape({a}.shape[:-1] + ({H}, {Dh}))")
    L.append(f"{o}_k = ({kv} @ {wk}).reshape({kv}.shape[:-1] + ({H}, {Dh}))")
    L.append(f"{o}_v = ({kv} @ {wv}).reshape({kv}.shape[:-1] + ({H}, {Dh}))")
    mask = None
    S, T = _size(sizes, p["S"]), _size(sizes, p["T"])
    if s.flag("mask"):
        if p["mask"] == "causal":
            mask = f"jnp.tril(jnp.ones(({S}, {T}), bool))"
        else:
            pm = w("pm", (p["B"], p["T"]), "mask:0.7", dtype="bool")
            mask = f"{pm}[:, None, None, :]"
    if v == "dpa":
        if mask is not None and p["mask"] == "causal":
            L.append(f"{o}_o = jax.nn.dot_product_attention({o}_q, {o}_k, {o}_v, is_causal=True)")
        elif mask is not None:
            L.append(f"{o}_o = jax.nn.dot_product_attention({o}_q, {o}_k, {o}_v, mask={mask})")
        else:
            L.append(f"{o}_o = jax.nn.dot_product_attention({o}_q, {o}_k, {o}_v)")
    else:
        if v != "bshd":
            for t in "qkv":
                L.append(f"{o}_{t} = {o}_{t}.transpose(0, 2, 1, 3)")
        if v == "bhqk":
            L.append(f'{o}_s = jnp.einsum("bhqd,bhkd->bhqk", {o}_q, {o}_k) * {scale}')
        elif v == "ellipsis":
            L.append(f'{o}_s = jnp.einsum("...qd,...kd->...qk", {o}_q, {o}_k) / np.sqrt({Dh}).astype(np.float32)')
        elif v == "matmul":
            L.append(f"{o}_s = {o}_q @ {o}_k.swapaxes(-1, -2) * {scale}")
        elif v == "bshd":
            L.append(f'{o}_s = jnp.einsum("bqhd,bkhd->bhqk", {o}_q, {o}_k) * {scale}')
        if mask is not None:
            fill = p["fill"]
            if fill == "additive":
                L.append(f"{o}_s = {o}_s + jnp.where({mask}, 0.0, -1e9)")
            else:
                value = {"-inf": "-jnp.inf", "finfo": f"jnp.finfo({o}_s.dtype).min", "-1e9": "-1e9"}[fill]
                L.append(f"{o}_s = jnp.where({mask}, {o}_s, {value})")
        if v == "matmul":
            L.append(f"{o}_e = jnp.exp({o}_s - {o}_s.max(-1, keepdims=True))")
            L.append(f"{o}_p = {o}_e / {o}_e.sum(-1, keepdims=True)")
            L.append(f"{o}_o = ({o}_p @ {o}_v).transpose(0, 2, 1, 3)")
        elif v == "ellipsis":
            L.append(f"{o}_p = jax.nn.softmax({o}_s.astype(jnp.float32), axis=-1).astype({o}_v.dtype)")
            L.append(f'{o}_o = jnp.einsum("...qk,...kd->...qd", {o}_p, {o}_v).transpose(0, 2, 1, 3)')
        elif v == "bhqk":
            L.append(f"{o}_p = jax.nn.softmax({o}_s, axis=-1)")
            L.append(f'{o}_o = jnp.einsum("bhqk,bhkd->bhqd", {o}_p, {o}_v).transpose(0, 2, 1, 3)')
        else:
            L.append(f"{o}_p = jax.nn.softmax({o}_s, axis=-1)")
            L.append(f'{o}_o = jnp.einsum("bhqk,bkhd->bqhd", {o}_p, {o}_v)')
    L.append(f"{o} = {o}_o.reshape({a}.shape[:-1] + ({H * Dh},))")
    if s.flag("proj"):
        wo = w("wo", (HD, D), fan_in=H * Dh)
        L.append(f"{o} = {o} @ {wo}")
        if s.flag("residual"):
            L.append(f"{o} = {a} + {o}")


def r_pool(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    u = w("u", (p["K"],), fan_in=_size(sizes, p["K"]))
    L.append(f"{o}_s = {a} @ {u}")
    if s.flag("mask"):
        pm = w("pm", (p["B"], p["S"]), "mask:0.7", dtype="bool")
        value = {"-inf": "-jnp.inf", "finfo": f"jnp.finfo({o}_s.dtype).min", "-1e9": "-1e9"}[p["fill"]]
        L.append(f"{o}_s = jnp.where({pm}, {o}_s, {value})")
    if s.variant == "log_softmax":
        L.append(f"{o}_p = jnp.exp(jax.nn.log_softmax({o}_s, axis=-1))")
    else:
        L.append(f"{o}_p = jax.nn.softmax({o}_s, axis=-1)")
    L.append(f'{o} = jnp.einsum("bs,bsh->bh", {o}_p, {a})')


def r_concat(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    K, N = p["K"], p["N"]
    fan = _size(sizes, K)
    v = s.variant
    if v in ("concat_mm", "concat0_mm"):
        w1 = w("w1", (K, N), fan_in=fan)
        w2 = w("w2", (K, p["N2"] if v == "concat_mm" else N), fan_in=fan)
        axis = -1 if v == "concat_mm" else 0
        L.append(f"{o} = jnp.concatenate([{a} @ {w1}, {a} @ {w2}], axis={axis})")
    elif v == "tile_mm":
        m = w("w", (K, N), fan_in=fan)
        L.append(f"{o} = jnp.tile({a} @ {m}, {(1,) * (p['rank'] - 1) + (2,)})")
    elif v == "split_glu":
        m = w("w", (K, times(N, 2)), fan_in=fan)
        L.append(f"{o}_h, {o}_g = jnp.split({a} @ {m}, 2, axis=-1)")
        L.append(f"{o} = {o}_h * jax.nn.gelu({o}_g)")
    elif v == "split_qkv":
        m = w("w", (K, times(N, 3)), fan_in=fan)
        L.append(f"{o}_q, {o}_k, {o}_v = jnp.split({a} @ {m}, 3, axis=-1)")
        L.append(f"{o} = {o}_q * jax.nn.sigmoid({o}_k) + {o}_v")
    elif v == "slices":
        m = w("w", (K, times(N, 2)), fan_in=fan)
        n = _size(sizes, N)
        L.append(f"{o}_h = {a} @ {m}")
        L.append(f"{o} = {o}_h[..., :{n}] - {o}_h[..., {n}:]")
    elif v == "concat_same":
        m = w("w", (K, N), fan_in=fan)
        L.append(f"{o} = jnp.concatenate([{a} @ {m}, {a} @ {m}], axis={p['axis']})")
    elif v == "concat_slice":
        m = w("w", (K, N), fan_in=fan)
        L.append(f"{o}_h = {a} @ {m}")
        L.append(f"{o} = jnp.concatenate([{o}_h, {o}_h[..., :{p['cut']}]], axis=-1)")
    elif v == "concat_norm":
        m = w("w", (times(K, 2), N), fan_in=2 * fan)
        L.append(f"{o} = jnp.concatenate([{_ln(a, '1e-5')}, {a}], axis=-1) @ {m}")
    else:
        raise ValueError(v)
    if s.flag("reduce"):
        L.append(f"{o} = {o}.sum({p['reduce_axis']})")


def r_reduce_int(s: Step, sizes, L, w):
    a, o = s.args[0], s.out
    v = s.variant
    if v == "argmax_bool":
        L.append(f"{o} = jnp.argmax({a} > 0, axis=-1)")
    elif v == "max_bool":
        L.append(f"{o} = jnp.max({a} > 0.5, axis=-1)")
    elif v == "sum_int":
        n = w("n", s.params["shape"], "ints", dtype="int32")
        L.append(f"{o} = jnp.sum(({a} > 0).astype(jnp.int32), axis=-1) + {n}.sum(-1)")
    elif v == "any_all":
        L.append(f"{o} = jnp.any({a} > 1.0, axis=-1) & ~jnp.all({a} < 0.0, axis=-1)")
    elif v == "where_any":
        L.append(f"{o} = jnp.where(jnp.any({a} > 0, axis=-1, keepdims=True), {a}, 0.0)")
    elif v == "count":
        L.append(f"{o} = {a} * jnp.sum({a} > 0, axis=-1, keepdims=True).astype({a}.dtype)")
    elif v == "int_math":
        n = w("n", s.params["shape"], "ints", dtype="int32")
        L.append(f"{o} = (({n} * 3 - {n}.max(-1, keepdims=True)) * ({a} > 0)).sum(-1) // 2")
    else:
        raise ValueError(v)


def r_sizes(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    v = s.variant
    if v == "empty_concat":
        L.append(f"{o} = jnp.concatenate([{a}, {a}[..., :0]], axis=-1) * 2.0")
    elif v == "empty_sum":
        L.append(f"{o} = {a} + {a}[..., :0].sum(-1, keepdims=True)")
    elif v == "zero_contract":
        z = w("z", tuple(p["shape"][:-1]) + ("0",), "centred")
        m = w("w", ("0", p["K"]))
        L.append(f"{o} = {a} + {z} @ {m}")
    elif v == "unit_norm":
        L.append(f"{o}_u = {a}[..., None]")
        L.append(f"{o} = {a} + ({_ln(o + '_u', '1e-5')})[..., 0]")
    elif v == "unit_bcast":
        u = w("u", ("1",) * (len(p["shape"]) - 1) + (p["K"],), "gamma")
        L.append(f"{o} = {a} * {u} + {u}.sum(0)")
    elif v == "zero_batch":
        m = w("w", (p["K"], p["N"]), fan_in=_size(sizes, p["K"]))
        L.append(f"{o} = ({_ln(a, '1e-5')}) @ {m}")
    else:
        raise ValueError(v)


def r_vector(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    D, N = p["K"], p["N"]
    v = s.variant
    if v == "ln_vec_mm":
        m = w("w", (D, N), fan_in=_size(sizes, D))
        L.append(f"{o} = ({_ln(a, '1e-5')}) @ {m}")
    elif v == "matvec":
        m = w("w", (N, D), fan_in=_size(sizes, D))
        L.append(f"{o} = {m} @ {a}")
    elif v == "outer":
        m = w("w", (D, N), fan_in=_size(sizes, D))
        L.append(f"{o} = jnp.outer({a}, {a} @ {m})")
    elif v == "softmax_mm":
        m = w("w", (D, N), fan_in=_size(sizes, D))
        L.append(f"{o} = jax.nn.softmax({a}) @ {m}")
    else:
        raise ValueError(v)


def r_control(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    K = p["K"]
    m = w("w", (K, K), fan_in=_size(sizes, K))
    v = s.variant
    norm_h = "(h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)"
    if v == "cond":
        pred = f"jnp.isfinite({a}).all()" if p["pred"] else f"jnp.abs({a}).sum() < 0"
        L += [f"def {o}_then(u):", f"    h = u @ {m}", f"    return {norm_h}",
              f"def {o}_else(u):", "    return u * 2.0",
              f"{o} = lax.cond({pred}, {o}_then, {o}_else, {a})"]
    elif v == "switch":
        L += [f"def {o}_b0(u):", f"    h = u @ {m}", f"    return {norm_h}",
              f"{o}_i = jnp.clip(jnp.int32(jnp.abs({a}).sum() >= 0) + {p['k']}, 0, 2)",
              f"{o} = lax.switch({o}_i, [{o}_b0, jax.nn.silu, lambda u: u - u.mean(-1, keepdims=True)], {a})"]
    elif v in ("scan", "scan_ys"):
        L += [f"def {o}_body(c, xt):", f"    h = (c + xt) @ {m}", f"    c = {norm_h}",
              "    return c, c.sum(-1)",
              f"{o}_c, {o}_ys = lax.scan({o}_body, jnp.zeros_like({a}[0]), {a})",
              f"{o} = {o}_c" if v == "scan" else f"{o} = {o}_ys"]
    elif v == "fori":
        L += [f"def {o}_body(i, c):", f"    h = c @ {m}",
              f"    return c + 0.5 * {norm_h}",
              f"{o} = lax.fori_loop(0, 3, {o}_body, {a})"]
    elif v == "cond_outer":
        L += [f"{o}_h = {a} @ {m}", f"{o}_n = {_ln(o + '_h', '1e-5')}",
              f"{o} = lax.cond(jnp.isfinite({a}).all() == {p['pred']}, lambda u: u, jnp.sin, {o}_n)"]
    elif v == "switch_outer":
        L += [f"{o}_h = {a} @ {m}", f"{o}_n = {_ln(o + '_h', '1e-5')}",
              f"{o}_i = jnp.clip(jnp.int32(jnp.abs({a}).sum() >= 0) + {p['k']}, 0, 2)",
              f"{o} = lax.switch({o}_i, [lambda u: u, jnp.sin, jnp.cos], {o}_n)"]
    elif v == "scan_outer":
        L += [f"{o}_h = {a} @ {m}", f"{o}_n = {_ln(o + '_h', '1e-5')}",
              f"{o} = lax.scan(lambda c, _: (c * 0.5 + {o}_n, c.sum()), {o}_n, None, length=3)[0]"]
    elif v == "while":
        L += [f"def {o}_body(state):", "    i, h = state", f"    h = h @ {m}",
              "    return i + 1, h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)",
              f"{o} = lax.while_loop(lambda state: state[0] < 2, {o}_body, (0, {a}))[1]"]
    else:
        raise ValueError(v)


def r_grad(s: Step, sizes, L, w):
    a, o, p = s.args[0], s.out, s.params
    D, Hd, C, B = p["K"], p["Hd"], p["C"], p["B"]
    w1 = w("w1", (D, Hd), fan_in=_size(sizes, D))
    b1 = w("b1", (Hd,), "weight:0.1")
    w2 = w("w2", (Hd, C), fan_in=_size(sizes, Hd))
    L += [f"def {o}_loss(w1, x):", f"    h = jax.nn.gelu(x @ w1 + {b1})", f"    logits = h @ {w2}"]
    v = s.variant
    if v == "xent_onehot":
        y = w("y", (B,), f"labels:{C}", dtype="int32")
        L.append(f"    return -(jax.nn.one_hot({y}, {_size(sizes, C)}, dtype=logits.dtype) * "
                 f"jax.nn.log_softmax(logits)).sum(-1).mean()")
    elif v == "xent_take":
        y = w("y", (B,), f"labels:{C}", dtype="int32")
        L.append(f"    return -jnp.take_along_axis(jax.nn.log_softmax(logits), {y}[:, None], axis=1).mean()")
    elif v == "lse":
        L.append("    return (jax.nn.logsumexp(logits, axis=-1) - logits[:, 0]).mean()")
    elif v == "mse":
        t = w("t", (B, C), "centred")
        L.append(f"    return jnp.mean((logits - {t}) ** 2)")
    else:
        raise ValueError(v)
    L.append(f"{o} = jax.grad({o}_loss, argnums={p['wrt']})({w1}, {a})")


def r_view(s: Step, sizes, L, w):
    a, o = s.args[0], s.out
    L.append(f"{o} = " + {"flatten": f"{a}.reshape(-1)", "rows": f"{a}.reshape(-1, {a}.shape[-1])",
                          "tokens": f"{a}.reshape({a}.shape[0], -1, {a}.shape[-1])", "unit_w": f"{a}[:, :, None, :]",
                          "image": f"{a}[None, :, None, :]",
                          "expand": f"jnp.expand_dims({a}, {tuple(s.params.get('axes') or ())})"}[s.variant])


def r_reduce(s: Step, sizes, L, w):
    a, o = s.args[0], s.out
    L.append(f"{o} = " + {"sum_last": f"{a}.sum(-1)", "sum_first": f"{a}.sum(0)", "mean_all": f"{a}.mean()",
                          "max_last": f"{a}.max(-1)", "logsumexp": f"jax.nn.logsumexp({a}, axis=-1)",
                          "l2": f"jnp.sqrt(jnp.sum({a} * {a}, axis=-1))",
                          "centre": f"{a} - {a}.sum(-1, keepdims=True) / {a}.shape[-1]",
                          "softmax": f"jax.nn.softmax({a}, axis=-1)"}[s.variant])


RENDERERS = {"view": r_view, "reduce": r_reduce, "norm": r_norm, "groupnorm": r_groupnorm, "matmul": r_matmul, "conv": r_conv, "act": r_act,
             "residual": r_residual, "attention": r_attention, "pool": r_pool, "concat": r_concat,
             "reduce_int": r_reduce_int, "sizes": r_sizes, "vector": r_vector, "control": r_control,
             "grad": r_grad}


# --------------------------------------------------------------------------------------------------
# generation


class _Gen:
    """The state of one program's generation: sizes, inputs, steps and the pool of values."""

    def __init__(self, rng: np.random.Generator, dtype: str):
        self.rng, self.dtype = rng, dtype
        self.sizes: dict = {}
        self.inputs: list = []
        self.steps: list = []
        self.pool: dict = {}       # name -> (shape, dtype)
        self.count = 0
        self.pending: list = []    # view steps the step being drawn reads

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def coin(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def size(self, role: str, prefix: str | None = None) -> str:
        name = f"{prefix or role[0].upper()}{len(self.sizes)}"
        self.sizes[name] = int(self.pick(SIZES[role]))
        return name

    def channels(self) -> str:
        """A channel count `G*c`: a groups symbol times 1-4 channels per group (3 often)."""
        return times(self.size("groups", "G"), int(self.pick((1, 2, 3, 3, 4))))

    def fresh(self, shape, regime: str | None = None, dtype: str | None = None) -> str:
        if regime is None:
            names, weights = zip(*REGIMES)
            regime = str(self.rng.choice(names, p=np.array(weights) / sum(weights)))
        if regime == "offset":
            regime = f"offset:{self.pick(('300.0', '-300.0'))}"
        name = f"x{len(self.inputs)}"
        spec = Input(name, tuple(shape), dtype or self.dtype, regime, int(self.rng.integers(2**31)))
        self.inputs.append(spec)
        self.pool[name] = (spec.shape, spec.dtype)
        return name

    def operand(self, ranks, make, ok=None):
        """A float value of the program's dtype with a rank in `ranks` (and `ok(shape)`): mostly the
        newest value, reshaped to such a rank by a "view" step when it has another (`adapt`), or a
        new input of shape `make()`."""
        values = [n for n, (shape, dtype) in self.pool.items() if dtype == self.dtype and len(shape) >= 1]
        fits = [n for n in values if len(self.shape(n)) in ranks and (ok is None or ok(self.shape(n)))]
        if not values or self.coin(0.08):
            return self.fresh(make())
        name = values[-1] if self.coin(0.7) else self.pick(values)
        if name in fits:
            return name
        if ok is None or self.coin(0.5):
            rank = min(ranks, key=lambda r: (abs(r - len(self.shape(name))), r))
            adapted = self.adapt(name, rank)
            if ok is None or ok(self.shape(adapted)):
                return adapted
        return self.pick(fits) if fits and self.coin(0.7) else self.fresh(make())

    def adapt(self, name: str, rank: int) -> str:
        """A "view" step giving value `name` rank `rank` (merged leading axes or new size-1 axes)."""
        shape = self.shape(name)
        q = len(shape)
        if q > rank:
            if rank == 1:
                variant, out = "flatten", ("*".join(_p(d) for d in shape),)
            elif rank == 2:
                variant, out = "rows", ("*".join(_p(d) for d in shape[:-1]), shape[-1])
            else:  # 4 -> 3: an image's pixels as tokens
                variant, out = "tokens", (shape[0], "*".join(_p(d) for d in shape[1:-1]), shape[-1])
            params = {"flags": []}
        elif q == 3 and rank == 4:
            variant, out, params = "unit_w", (shape[0], shape[1], "1", shape[2]), {"flags": []}
        elif q == 2 and rank == 4:
            variant, out, params = "image", ("1", shape[0], "1", shape[1]), {"flags": []}
        else:
            variant, out, params = "expand", ("1",) * (rank - q) + tuple(shape), {"axes": tuple(range(rank - q)),
                                                                                 "flags": []}
        step = self.step("view", variant, [name], params, out)
        self.pending.append(step)
        self.pool[step.out] = (step.shape, step.dtype)
        return step.out

    def shape(self, name):
        return self.pool[name][0]

    def features(self, K: str) -> str:
        """An output feature size: the input's (square, residual-able) half the time."""
        return K if self.coin(0.5) else self.size("feat", "N")

    def step(self, kind, variant, args, params, shape, dtype=None) -> Step:
        out = f"v{self.count}"
        self.count += 1
        return Step(kind, variant, tuple(args), out, params, tuple(shape), dtype or self.dtype,
                    int(self.rng.integers(2**31)))

    # shape makers
    def any_shape(self):
        rank = int(self.pick((1, 2, 2, 3, 3, 4)))
        roles = {1: ("feat",), 2: ("seq", "feat"), 3: ("batch", "seq", "feat"),
                 4: ("batch", "spatial", "spatial", "feat")}[rank]
        return tuple(self.size(r) for r in roles)

    def nhwc(self):
        return (self.size("batch"), self.size("spatial", "H"), self.size("spatial", "W"), self.channels())

    def bsd(self):
        return (self.size("batch"), self.size("seq"), self.size("feat", "D"))


def g_norm(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    K = shape[-1]
    variant = g.pick(("ln", "ln", "ln_fast", "ln_flax", "rms", "ln_f32"))
    params = {"eps": g.pick(EPS), "K": K, "affine": g.coin(0.5), "proj": g.coin(0.6), "flags": ["affine", "proj", "proj_bias"]}
    out = shape
    if params["proj"]:
        params["N"] = g.features(K)
        params["proj_bias"] = g.coin(0.5)
        out = shape[:-1] + (params["N"],)
    return g.step("norm", variant, [a], params, out)


def _groups(C: str):
    """(groups, channels per group) of a channel expression `G*c`; one channel per group otherwise."""
    m = re.fullmatch(r"(\w+)\*(\d+)", C)
    return (m.group(1), m.group(2)) if m else (C, "1")


def g_groupnorm(g: _Gen) -> Step:
    a = g.operand((4,), g.nhwc)
    shape = g.shape(a)
    C = shape[-1]
    G, cpg = _groups(C) if g.coin(0.8) else ("1", C)  # or one group of all channels
    params = {"G": G, "cpg": cpg, "C": C, "eps": g.pick((1e-5, 1e-6)), "affine": g.coin(0.6),
              "silu": g.coin(0.6), "conv": g.coin(0.5), "flags": ["affine", "silu", "conv"]}
    out = shape
    if params["conv"]:
        params["Cout"] = g.channels() if g.coin(0.5) else C
        out = shape[:-1] + (params["Cout"],)
    return g.step("groupnorm", g.pick(("var", "var", "fast")), [a], params, out)


def g_matmul(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    K = shape[-1]
    N = g.features(K)
    variant = g.pick(("at", "at", "einsum", "dot", "dot_general", "linear_t"))
    params = {"K": K, "N": N, "rank": len(shape), "bias": g.coin(0.5), "act": g.pick(tuple(ACTS)),
              "flags": ["bias", "act"]}
    params["act"] = params["act"] if g.coin(0.4) else None
    return g.step("matmul", variant, [a], params, shape[:-1] + (N,))


def _spatial(H: str, stride: int) -> str:
    return H if stride == 1 else f"({H} + 1) // 2"


def g_conv(g: _Gen) -> Step:
    a = g.operand((4,), g.nhwc)
    B, H, W, C = g.shape(a)
    kh = int(g.pick((1, 3, 3)))
    stride = int(g.pick((1, 1, 2)))
    pad = g.pick(("SAME", ((1, 1), (1, 1)))) if kh == 3 else g.pick(("SAME", "VALID"))
    Cout = g.channels() if g.coin(0.6) else C
    params = {"kh": kh, "stride": stride, "pad": pad, "C": C, "Cout": Cout, "bias": g.coin(0.5), "flags": ["bias"]}
    return g.step("conv", f"{kh}x{kh}s{stride}", [a], params, (B, _spatial(H, stride), _spatial(W, stride), Cout))


def g_act(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    return g.step("act", g.pick(tuple(ACTS)), [a], {}, g.shape(a))


def g_residual(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    partners = [n for n, (s, d) in g.pool.items() if s == shape and d == g.dtype and n != a]
    options = ["scaled", "mlp_block"] + (["add", "add"] if partners else [])
    if len(shape) == 4:
        options += ["resnet_block"]
    v = g.pick(options)
    params: dict = {"flags": []}
    args = [a]
    if v == "add":
        args.append(g.pick(partners))
    elif v == "mlp_block":
        params.update(K=shape[-1], Hd=g.size("hidden", "F"), eps=g.pick(EPS))
    elif v == "resnet_block":
        G, cpg = _groups(shape[-1])
        params.update(C=shape[-1], G=G, cpg=cpg)
    return g.step("residual", v, args, params, shape)


def g_attention(g: _Gen) -> Step:
    a = g.operand((3,), g.bsd)
    B, S, D = g.shape(a)
    args = [a]
    T, E = S, D
    cross = g.coin(0.25)
    if cross:
        kvs = [n for n, (s, d) in g.pool.items() if len(s) == 3 and s[0] == B and d == g.dtype and n != a]
        kv = g.pick(kvs) if kvs and g.coin(0.5) else g.fresh((B, g.size("seq", "T"), g.size("feat", "E")))
        args.append(kv)
        T, E = g.shape(kv)[1], g.shape(kv)[2]
    mask = g.pick(("causal", "padding")) if g.coin(0.6) else None
    if mask == "causal" and cross:
        mask = "padding"
    params = {"B": B, "S": S, "T": T, "D": D, "E": E, "H": g.size("heads", "H"), "Dh": g.size("head_dim", "Dh"),
              "mask": mask, "fill": g.pick(("-inf", "finfo", "-1e9", "additive")), "proj": True,
              "residual": g.coin(0.5), "flags": ["mask", "residual", "proj"]}
    variant = g.pick(("bhqk", "ellipsis", "matmul", "bshd", "dpa"))
    if variant == "dpa" and g.dtype != "float32":  # f16/bf16: "highest" precision is not supported on CPU
        variant = "bhqk"
    return g.step("attention", variant, args, params, (B, S, D))


def g_pool(g: _Gen) -> Step:
    a = g.operand((3,), g.bsd)
    B, S, K = g.shape(a)
    mask = g.coin(0.5)
    params = {"B": B, "S": S, "K": K, "mask": mask, "fill": g.pick(("-inf", "finfo", "-1e9")), "flags": ["mask"]}
    return g.step("pool", g.pick(("softmax", "softmax", "log_softmax")), [a], params, (B, K))


def g_concat(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    K = shape[-1]
    variants = ["concat_mm", "tile_mm", "split_glu", "split_qkv", "slices", "concat_same", "concat_slice",
                "concat_norm"] + (["concat0_mm"] if len(shape) >= 2 else [])
    v = g.pick(variants)
    N = g.features(K)
    params = {"K": K, "N": N, "rank": len(shape), "flags": ["reduce"]}
    if v == "concat_mm":
        params["N2"] = g.size("feat", "N")
        out = shape[:-1] + (f"{_p(N)} + {_p(params['N2'])}",)
    elif v == "concat0_mm":
        out = (times(shape[0], 2),) + shape[1:-1] + (N,)
    elif v == "tile_mm":
        out = shape[:-1] + (times(N, 2),)
    elif v == "concat_same":
        params["axis"] = int(g.pick((0, -1))) if len(shape) >= 2 else 0
        out = (times(shape[0], 2),) + shape[1:-1] + (N,) if params["axis"] == 0 else shape[:-1] + (times(N, 2),)
        if len(shape) == 1:
            out = (times(N, 2),)
    elif v == "concat_slice":
        params["cut"] = int(g.pick((1, 2, 3)))
        out = shape[:-1] + (f"{_p(N)} + min({_p(N)}, {params['cut']})",)
    else:
        out = shape[:-1] + (N,)
    params["reduce_axis"] = int(g.pick((-1, 0))) if len(out) >= 2 else -1
    params["reduce"] = g.coin(0.4)
    if params["reduce"]:
        out = tuple(d for i, d in enumerate(out) if i != params["reduce_axis"] % len(out))
    return g.step("concat", v, [a], params, out)


def g_reduce_int(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    v = g.pick(("argmax_bool", "max_bool", "sum_int", "any_all", "where_any", "count", "int_math"))
    dtype = {"argmax_bool": "int32", "max_bool": "bool", "sum_int": "int32", "any_all": "bool",
             "int_math": "int32"}.get(v, g.dtype)
    out = shape if v in ("where_any", "count") else shape[:-1]
    return g.step("reduce_int", v, [a], {"shape": shape, "flags": []}, out, dtype)


def g_sizes(g: _Gen) -> Step:
    v = g.pick(("empty_concat", "empty_sum", "zero_contract", "unit_norm", "unit_bcast", "zero_batch"))
    if v == "zero_batch":
        K = g.size("feat", "K")
        a = g.fresh(("0", K) if g.coin(0.5) else (g.size("batch"), "0", K))
        shape = g.shape(a)
        N = g.features(K)
        return g.step("sizes", v, [a], {"K": K, "N": N, "shape": shape, "flags": []}, shape[:-1] + (N,))
    if v == "unit_bcast":
        a = g.operand((2, 3, 4), lambda: (g.size("seq"), g.size("feat")))
    else:
        a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    return g.step("sizes", v, [a], {"K": shape[-1], "shape": shape, "flags": []}, shape)


def g_vector(g: _Gen) -> Step:
    a = g.operand((1,), lambda: (g.size("feat", "D"),))
    D = g.shape(a)[0]
    N = g.features(D)
    v = g.pick(("ln_vec_mm", "ln_vec_mm", "matvec", "outer", "softmax_mm"))
    out = (D, N) if v == "outer" else (N,)
    return g.step("vector", v, [a], {"K": D, "N": N, "flags": []}, out)


def g_control(g: _Gen) -> Step:
    v = g.pick(("cond", "switch", "scan", "scan_ys", "fori", "while", "cond_outer", "switch_outer", "scan_outer"))
    if v.startswith("scan"):
        a = g.operand((2, 3), lambda: (g.size("time", "T"), g.size("batch"), g.size("feat")))
    else:
        a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    params = {"K": shape[-1], "pred": g.coin(0.7), "k": int(g.pick((-1, 0, 1))), "flags": []}
    out = shape
    if v == "scan":
        out = shape[1:]
    elif v == "scan_ys":
        out = shape[:1] + shape[1:-1]
    return g.step("control", v, [a], params, out)


def g_grad(g: _Gen) -> Step:
    a = g.operand((2,), lambda: (g.size("batch"), g.size("feat", "D")))
    B, D = g.shape(a)
    params = {"B": B, "K": D, "Hd": g.size("hidden", "F"), "C": g.size("classes", "C"), "wrt": int(g.pick((0, 1))),
              "flags": []}
    out = (D, params["Hd"]) if params["wrt"] == 0 else (B, D)
    return g.step("grad", g.pick(("xent_onehot", "xent_take", "lse", "mse")), [a], params, out)


def g_reduce(g: _Gen) -> Step:
    a = g.operand((1, 2, 3, 4), g.any_shape)
    shape = g.shape(a)
    v = g.pick(("sum_last", "sum_last", "sum_first", "mean_all", "max_last", "logsumexp", "l2", "centre", "softmax"))
    out = {"sum_first": shape[1:], "mean_all": (), "centre": shape, "softmax": shape}.get(v, shape[:-1])
    return g.step("reduce", v, [a], {"flags": []}, out)


GENERATORS = {"reduce": g_reduce, "norm": g_norm, "groupnorm": g_groupnorm, "matmul": g_matmul, "conv": g_conv, "act": g_act,
              "residual": g_residual, "attention": g_attention, "pool": g_pool, "concat": g_concat,
              "reduce_int": g_reduce_int, "sizes": g_sizes, "vector": g_vector, "control": g_control, "grad": g_grad}


def abstract_outputs(program: Program, outputs=None):
    """`jax.eval_shape` of the program returning `outputs` (default: its outputs)."""
    args = [jax.ShapeDtypeStruct(tuple(program.size_of(d) for d in a.shape), jnp.dtype(a.dtype))
            for a in program.arguments()]
    return jax.eval_shape(program.fn(outputs), *args)


def valid(program: Program) -> bool:
    """The program traces (jax.eval_shape) and every step's value has the shape and dtype the
    grammar says it has."""
    if not program.steps:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = abstract_outputs(program, [s.out for s in program.steps])
    except Exception:  # noqa: BLE001  an invalid program (a size made it invalid)
        return False
    for step, out in zip(program.steps, outs):
        if tuple(out.shape) != tuple(program.size_of(d) for d in step.shape) or str(out.dtype) != step.dtype:
            raise AssertionError(f"grammar: {step.kind}.{step.variant} {step.out} is {out.dtype}{list(out.shape)}, "
                                 f"not {step.dtype}{[program.size_of(d) for d in step.shape]}\n"
                                 f"{program.function_source()}")
    return True


def generate(seed: int, index: int, *, require=(), steps: int | None = None, dtype: str | None = None,
             families=FAMILIES) -> Program:
    """Program `index` of campaign `seed`: `steps` steps (2 to 7 when None) of random families,
    `require`d ones among them."""
    rng = np.random.default_rng([seed, index])
    if dtype is None:
        dtype = str(rng.choice(FLOATS, p=[0.8, 0.1, 0.1]))
    g = _Gen(rng, dtype)
    count = int(steps if steps is not None else rng.integers(2, 8))
    todo = list(require) + [str(rng.choice(families)) for _ in range(max(0, count - len(require)))]
    order = list(rng.permutation(len(todo)))
    for i in order:
        family = todo[i]
        for _ in range(8):
            state = (dict(g.sizes), list(g.inputs), dict(g.pool), g.count)
            g.pending = []
            step = GENERATORS[family](g)
            new = g.pending + [step]
            candidate = Program(g.sizes, dtype, list(g.inputs), g.steps + new, seed, index)
            if valid(candidate):
                g.steps += new
                g.pool[step.out] = (step.shape, step.dtype)
                break
            g.sizes, g.inputs, g.pool, g.count = state
    return Program(dict(g.sizes), dtype, list(g.inputs), list(g.steps), seed, index)


def campaign_programs(seed: int, count: int, *, steps: int | None = None) -> list:
    """The campaign's programs: program i requires family FAMILIES[i % len(FAMILIES)] (and, for
    short campaigns, more, so that every family appears), plus random others."""
    programs = []
    per = max(1, math.ceil(len(FAMILIES) / max(count, 1)))
    for i in range(count):
        require = [FAMILIES[(i * per + j) % len(FAMILIES)] for j in range(per)]
        programs.append(generate(seed, i, require=require, steps=None if steps is None else max(steps, per)))
    return programs


# --------------------------------------------------------------------------------------------------
# running and comparing


@dataclass
class Result:
    status: str                     # one of STATUSES
    key: str = ""                   # the failure class ("" when equal)
    detail: str = ""
    warnings: list = field(default_factory=list)
    limits: list = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""                  # "differs from jax.jit ... but not from float64": jit was the inexact one


def _strip(message: str) -> str:
    """A message with what varies between instances of one bug removed: numbers, shapes, names."""
    s = message.splitlines()[0] if message else ""
    s = re.sub(r"0x[0-9a-fA-F]+", "0x?", s)
    s = re.sub(r"\b[A-Z]\w*\(\.\.\.\)", "...", s)                # elided term operands: Load(...), Concat(...)
    s = re.sub(r"\b(v|x)\d+(_\w+)?\b", "v", s)                 # our value names
    s = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", s)
    s = re.sub(r"N(\s*,\s*N)+", "N", s)                        # shapes of any rank
    return s[:200]


def classify_warning(w) -> str | None:
    module = getattr(w.category, "__module__", "") or ""
    if module.split(".")[0] not in EQSAT_PACKAGES:
        return None
    return f"{w.category.__name__}: {_strip(str(w.message))}"


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float | None):
    if not seconds or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _Timeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _errors(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """|got - want| / tol per element, 0 where both are the same NaN/inf, inf where only one is NaN."""
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w) / tol
    err = np.where(same, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


def _tolerance(want: np.ndarray, dtype: str, magnitude: float) -> float:
    rtol, k = TOLERANCE.get(dtype, TOLERANCE["float32"])
    finite = np.abs(want[np.isfinite(want)].astype(np.float64)) if want.size else np.zeros(0)
    scale = float(finite.max()) if finite.size else 0.0
    return rtol * scale + k * magnitude + 1e-30


def _is_float(a) -> bool:
    dtype = np.asarray(a).dtype
    return bool(np.issubdtype(dtype, np.floating)) or str(dtype) == "bfloat16"


def input_magnitudes(fn, args) -> list:
    """Per output leaf of `fn(*args)`: the largest |value| of the float arguments it depends on."""
    from jax._src.interpreters import partial_eval as pe

    closed = jax.make_jaxpr(fn)(*args)
    size = [float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)) if _is_float(a) else 0.0 for a in args]
    size = [m if np.isfinite(m) else 0.0 for m in size]
    count = len(closed.jaxpr.outvars)
    out = []
    for i in range(count):
        _, used = pe.dce_jaxpr(closed.jaxpr, [j == i for j in range(count)])
        out.append(max((m for m, u in zip(size, used) if u), default=0.0))
    return out


def compare(got, want, args, reference=None, magnitudes=None):
    """None when `got` matches `want` (the jit result), else (kind, detail). The tolerance of output
    i is `TOLERANCE[dtype]`: rtol * max|want_i| + k * magnitudes[i] (the largest input it reads;
    default: of all inputs). `reference` (a callable giving the float64 result) arbitrates value
    differences: eqsat is right where it is within tolerance of float64 or no further than 10x
    jit's distance from it."""
    gl, wl = _leaves(got), _leaves(want)
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(want) or len(gl) != len(wl):
        return "structure", f"{jax.tree_util.tree_structure(got)} vs {jax.tree_util.tree_structure(want)}"
    for i, (g, w) in enumerate(zip(gl, wl)):
        if g.shape != w.shape:
            return "shape", f"output {i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        if g.dtype != w.dtype:
            return "dtype", f"output {i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
    if magnitudes is None:
        every = [float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)) for a in args if _is_float(a)]
        magnitudes = [max((m for m in every if np.isfinite(m)), default=0.0)] * len(wl)
    bad = []
    for i, (g, w) in enumerate(zip(gl, wl)):
        dtype = str(w.dtype)
        if dtype in TOLERANCE:
            tol = _tolerance(w, dtype, magnitudes[i])
            err = _errors(g, w, tol)
            if err.size and err.max() > 1.0:
                bad.append((i, tol, int((err > 1.0).sum())))
        elif not np.array_equal(g, w):
            bad.append((i, None, int((g != w).sum())))
    if not bad:
        return None
    ref = _leaves(reference()) if reference is not None else None
    wrong = []
    for i, tol, count in bad:
        g, w = gl[i], wl[i]
        if ref is not None:
            r = ref[i]
            if tol is None:
                if int((g != r.astype(g.dtype)).sum()) <= int((w != r.astype(w.dtype)).sum()):
                    continue
            else:
                e_got = _errors(g, r, tol).max(initial=0.0)
                e_jit = _errors(w, r, tol).max(initial=0.0)
                if e_got <= max(1.0, 10.0 * e_jit):
                    continue
        if tol is None:
            wrong.append(f"output {i} ({w.dtype}{list(w.shape)}): {count} elements differ")
        else:
            at = np.unravel_index(int(np.argmax(_errors(g, w, tol))), w.shape) if w.size else ()
            wrong.append(f"output {i} ({w.dtype}{list(w.shape)}): {count} elements beyond tol {tol:.3g}, worst at "
                         f"{tuple(int(x) for x in at)}: {g[at]!r} vs {w[at]!r}"
                         + (f" (float64 {ref[i][at]!r})" if ref is not None else ""))
    if not wrong:
        return "arbitrated", ""
    return "values", "; ".join(wrong)


def _float64_run(fn, args):
    def run():
        with jax.enable_x64(True), jax.default_matmul_precision("highest"):
            wide = [np.asarray(a, np.float64) if (np.issubdtype(np.asarray(a).dtype, np.floating)
                                                  or str(np.asarray(a).dtype) == "bfloat16") else a for a in args]
            return jax.tree_util.tree_map(np.asarray, jax.jit(fn)(*wide))
    return run


DEFAULT_OPTIONS = {"time_limit": 4.0, "extract_time_limit": 2.0, "node_limit": 50_000}


def run_program(program: Program, backend: str, options: dict | None = None, timeout: float | None = 240.0) -> Result:
    """Run `program` through `jax.jit` and `eqsat.optimize(..., backend=backend)` and classify it."""
    options = dict(DEFAULT_OPTIONS if options is None else options)
    start = time.perf_counter()
    fn = program.fn()
    args = program.args()
    try:
        with _deadline(timeout), jax.default_matmul_precision("highest"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = jax.block_until_ready(jax.jit(fn)(*args))
    except Exception as error:  # noqa: BLE001
        return Result("jit_fails", f"{type(error).__name__}: {_strip(str(error))}",
                      f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}",
                      seconds=time.perf_counter() - start)
    caught: list = []
    try:
        with _deadline(timeout), jax.default_matmul_precision("highest"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fast = eqsat.optimize(fn, backend=backend, progress=False, **options)
            got = jax.block_until_ready(fast(*args))
    except Exception as error:  # noqa: BLE001  every failure is a result
        first = (str(error).splitlines() or [""])[0]
        return Result("crashed", f"{type(error).__name__}: {_strip(str(error))}", f"{type(error).__name__}: {first}",
                      _eqsat_warnings(caught)[0], _eqsat_warnings(caught)[1], time.perf_counter() - start)
    found, limits = _eqsat_warnings(caught)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        magnitudes = input_magnitudes(fn, args)
        try:
            diff = compare(got, want, args, _float64_run(program.fn(wide=True), args), magnitudes)
        except Exception as error:  # noqa: BLE001  the float64 run failed: compare without it
            diff = compare(got, want, args, None, magnitudes)
            if diff is not None:
                diff = (diff[0], diff[1] + f" (float64 run failed: {type(error).__name__})")
    seconds = time.perf_counter() - start
    note = ""
    if diff is not None and diff[0] == "arbitrated":
        diff, note = None, "differs from jax.jit beyond tolerance, but not from float64 (jit's own error)"
    if diff is not None:
        return Result("wrong", f"wrong {diff[0]}", diff[1], found, limits, seconds)
    if found:
        return Result("fell_back", found[0], "; ".join(found), found, limits, seconds, note)
    return Result("equal", "", note, found, limits, seconds, note)


def _eqsat_warnings(caught) -> tuple[list, list]:
    found, limits = [], []
    for w in caught or []:
        key = classify_warning(w)
        if key is None:
            continue
        target = limits if w.category.__name__ in LIMIT_WARNINGS else found
        if key not in target:
            target.append(key)
    return found, limits


# --------------------------------------------------------------------------------------------------
# shrinking


def _without(program: Program, drop: set) -> Program:
    """`program` without the steps writing `drop` and every step that reads them, transitively."""
    dead = set(drop)
    steps = []
    for s in program.steps:
        if s.out in dead or any(a in dead for a in s.args):
            dead.add(s.out)
        else:
            steps.append(s)
    return program.replace(steps=steps)


def _bypass(program: Program, i: int) -> Program | None:
    """`program` with step i removed and its readers reading its first operand instead (when that has
    the same shape and dtype)."""
    step = program.steps[i]
    source = step.args[0]
    shapes = {a.name: (a.shape, a.dtype) for a in program.inputs}
    shapes.update({s.out: (s.shape, s.dtype) for s in program.steps})
    if source not in shapes or shapes[source] != (step.shape, step.dtype):
        return None
    steps = []
    for j, s in enumerate(program.steps):
        if j == i:
            continue
        if step.out in s.args:
            s = dataclasses.replace(s, args=tuple(source if a == step.out else a for a in s.args))
        steps.append(s)
    return program.replace(steps=steps)


def _prune(program: Program) -> Program:
    used = program.used()
    sizes_used = set()
    text = repr([a.shape for a in program.arguments()]) + repr([(s.shape, s.params) for s in program.steps]) + \
        repr([a.regime for a in program.arguments()])
    for name in program.sizes:
        if re.search(rf"\b{re.escape(name)}\b", text):
            sizes_used.add(name)
    return program.replace(inputs=[a for a in program.inputs if a.name in used],
                           sizes={k: v for k, v in program.sizes.items() if k in sizes_used})


def _candidates(program: Program):
    """Smaller programs, most promising first."""
    n = len(program.steps)
    for i in reversed(range(n)):                       # drop a step and what reads it
        yield _without(program, {program.steps[i].out})
    for i in reversed(range(n)):                       # drop a step, its readers read its operand
        c = _bypass(program, i)
        if c is not None:
            yield c
    for i, s in enumerate(program.steps):              # switch off optional parts
        for flag in s.params.get("flags", []):
            if s.params.get(flag):
                steps = list(program.steps)
                steps[i] = dataclasses.replace(s, params={**s.params, flag: False})
                yield program.replace(steps=steps)
    for name, value in program.sizes.items():          # smaller sizes
        for smaller in sorted({1, 2, 3, value // 2} - {value}):
            if 0 < smaller < value:
                yield program.replace(sizes={**program.sizes, name: smaller})
    for j, a in enumerate(program.inputs):             # plainer inputs
        if a.regime != "centred":
            inputs = list(program.inputs)
            inputs[j] = dataclasses.replace(a, regime="centred")
            yield program.replace(inputs=inputs)


def _cost(program: Program) -> tuple:
    flags = sum(bool(s.params.get(f)) for s in program.steps for f in s.params.get("flags", []))
    return (len(program.steps), flags, sum(program.sizes.values()),
            sum(a.regime != "centred" for a in program.inputs))


def shrink(program: Program, fails, *, budget: float = 120.0, max_tries: int = 200, on_try=None) -> Program:
    """The smallest program found (greedy, first improvement, until no candidate fails or the
    budget runs out) for which `fails(program)` is true. Candidates that do not trace are skipped
    without calling `fails`."""
    best = _prune(program)
    deadline = time.perf_counter() + budget
    tries = 0
    improved = True
    seen = set()
    while improved and time.perf_counter() < deadline and tries < max_tries:
        improved = False
        for candidate in _candidates(best):
            if time.perf_counter() >= deadline or tries >= max_tries:
                break
            candidate = _prune(candidate)
            if not candidate.steps or _cost(candidate) >= _cost(best):
                continue
            key = json.dumps(candidate.to_json(), sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            try:
                if not valid(candidate):
                    continue
            except AssertionError:
                continue
            tries += 1
            if on_try is not None:
                on_try()
            if fails(candidate):
                best = candidate
                improved = True
                break
    return best


def same_failure(result: Result, backend: str, options: dict | None, timeout: float | None):
    """The predicate `shrink` uses: the candidate fails the way `result` did."""
    def fails(candidate: Program) -> bool:
        r = run_program(candidate, backend, options, timeout)
        return r.status == result.status and r.key == result.key
    return fails


# --------------------------------------------------------------------------------------------------
# the campaign


@dataclass
class Failure:
    status: str
    key: str
    programs: list               # indices
    detail: str
    original: Program
    shrunk: Program | None = None
    shrunk_detail: str = ""
    shrink_seconds: float = 0.0
    merged: bool = False         # folded into an earlier class (its programs listed there)

    def reproducer(self, backend: str, options: dict) -> str:
        program = self.shrunk or self.original
        header = (f"eqsat fuzz, backend={backend}: {self.status} ({self.key})\n{self.shrunk_detail or self.detail}\n"
                  f"campaign program {self.original.seed}:{self.original.index}"
                  + (", shrunk" if self.shrunk is not None else ""))
        return program.source(backend, options, header)


@dataclass
class Report:
    backend: str
    seed: int
    programs: list
    results: list
    failures: list
    options: dict
    seconds: float = 0.0

    def counts(self) -> dict:
        counts = {s: 0 for s in STATUSES}
        for r in self.results:
            counts[r.status] += 1
        return counts

    def table_row(self) -> dict:
        c = self.counts()
        return {"backend": self.backend, "programs": len(self.results), **{label: c[s] for label, s in COLUMNS if s}}

    def to_json(self) -> dict:
        return {
            "backend": self.backend, "seed": self.seed, "options": self.options, "seconds": self.seconds,
            "table": self.table_row(),
            "results": [{"index": p.index, "families": p.families(), "dtype": p.dtype, "steps": len(p.steps),
                         **dataclasses.asdict(r)} for p, r in zip(self.programs, self.results)],
            "failures": [{"status": f.status, "key": f.key, "count": len(f.programs), "programs": f.programs,
                          "detail": f.detail, "shrunk_detail": f.shrunk_detail,
                          "shrink_seconds": f.shrink_seconds,
                          "reproducer": f.reproducer(self.backend, self.options),
                          "program": (f.shrunk or f.original).to_json(), "original": f.original.to_json()}
                         for f in self.failures],
        }


def group_failures(programs, results) -> list:
    """Failures grouped by class: crashes by (type, stripped message), fallbacks by warning, wrong
    answers by what differs and the program's families (a wrong answer in a program whose step
    kinds contain an earlier class's joins it)."""
    groups: dict = {}
    for p, r in zip(programs, results):
        if r.status not in ("crashed", "wrong", "fell_back"):
            continue
        key = (r.status, r.key)
        if r.status == "wrong":
            key = (r.status, r.key, p.families())
        groups.setdefault(key, []).append((p, r))
    failures = []
    for (status, key, *_), members in groups.items():
        members.sort(key=lambda m: _cost(m[0]))
        p, r = members[0]
        failures.append(Failure(status, key, [m[0].index for m in members], r.detail, p))
    order = {"crashed": 0, "wrong": 1, "fell_back": 2}
    failures.sort(key=lambda f: (order[f.status], -len(f.programs)))
    return failures


def run_campaign(backend: str, count: int, seed: int = 0, *, options: dict | None = None, shrink_failures=True,
                 shrink_fallbacks=True, shrink_budget: float = 120.0, total_shrink_budget: float = 600.0,
                 timeout: float | None = 240.0, progress: bool = True, programs: list | None = None) -> Report:
    from tqdm.auto import tqdm

    options = dict(DEFAULT_OPTIONS if options is None else options)
    start = time.perf_counter()
    programs = campaign_programs(seed, count) if programs is None else programs
    results = []
    bar = tqdm(programs, desc=f"fuzz {backend}", unit="program", disable=not progress, dynamic_ncols=True)
    for i, program in enumerate(bar):
        results.append(run_program(program, backend, options, timeout))
        c = {s: 0 for s in STATUSES}
        for r in results:
            c[r.status] += 1
        bar.set_postfix(ok=c["equal"], crash=c["crashed"], wrong=c["wrong"], fb=c["fell_back"], refresh=False)
        if (i + 1) % 25 == 0:
            jax.clear_caches()
    bar.close()
    failures = group_failures(programs, results)
    if shrink_failures:
        shrink_end = time.perf_counter() + total_shrink_budget
        todo = [f for f in failures if f.status != "fell_back" or shrink_fallbacks]
        bar = tqdm(total=len(todo), desc=f"shrink {backend}", unit="class", disable=not progress, dynamic_ncols=True)
        merged: list = []
        for f in todo:
            bar.update()
            # a wrong answer whose program holds the steps of a shrunk wrong answer is that class
            twin = next((m for m in merged if f.status == m.status == "wrong" and f.key == m.key and m.shrunk is not None
                         and set(m.shrunk.signature()) <= set(f.original.signature())), None)
            if twin is not None:
                twin.programs += f.programs
                f.merged = True
                continue
            left = shrink_end - time.perf_counter()
            if left <= 0:
                continue
            t0 = time.perf_counter()
            original = next(r for p, r in zip(programs, results) if p is f.original)
            f.shrunk = shrink(f.original, same_failure(original, backend, options, timeout),
                              budget=min(shrink_budget, left))
            check = run_program(f.shrunk, backend, options, timeout)
            f.shrunk_detail = check.detail if check.status == f.status else \
                f"(the shrunk program's last run: {check.status} {check.detail})"
            f.shrink_seconds = time.perf_counter() - t0
            merged.append(f)
        bar.close()
        failures = [f for f in failures if not f.merged]
    return Report(backend, seed, programs, results, failures, options, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------
# printing


def print_table(reports, file=None) -> None:
    rows = [r.table_row() for r in reports]
    headers = ["backend"] + [label for label, _ in COLUMNS]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="eqsat differential fuzzing")
        for h in headers:
            table.add_column(h, justify="left" if h == "backend" else "right")
        for row in rows:
            table.add_row(*[str(row[h]) for h in headers])
        Console(file=file).print(table)
    except ImportError:  # pragma: no cover
        out = file or sys.stdout
        widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in headers]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)), file=out)
        for r in rows:
            print("  ".join(str(r[h]).rjust(w) for h, w in zip(headers, widths)), file=out)


def print_failures(report: Report, file=None) -> None:
    out = file or sys.stdout
    inexact = sum(bool(r.note) for r in report.results)
    if inexact:
        print(f"\n{report.backend}: {inexact} programs equal only against float64 (jax.jit was the inexact side)",
              file=out)
    if not report.failures:
        print(f"\n{report.backend}: no failures", file=out)
        return
    print(f"\n{report.backend}: {len(report.failures)} failure classes", file=out)
    for n, f in enumerate(report.failures, 1):
        print(f"\n[{n}] {f.status}: {f.key}  ({len(f.programs)} programs: {f.programs})", file=out)
        print(f"    {f.shrunk_detail or f.detail}", file=out)
        steps = f"{len(f.original.steps)} -> {len(f.shrunk.steps)} steps" if f.shrunk is not None else "not shrunk"
        print(f"    {steps}\n", file=out)
        print(f.reproducer(report.backend, report.options), file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("xla", "pallas", "hybrid", "mosaic", "interpret"), action="append",
                        help="eqsat.optimize backend (repeat for several)")
    parser.add_argument("--programs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the table, the failures and their reproducers here")
    parser.add_argument("--no-shrink", action="store_true", help="report failures without shrinking them")
    parser.add_argument("--no-shrink-fallbacks", action="store_true", help="shrink crashes and wrong answers only")
    parser.add_argument("--shrink-seconds", type=float, default=120.0, help="budget per failure class")
    parser.add_argument("--total-shrink-seconds", type=float, default=600.0, help="budget for all shrinking")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per program run")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_OPTIONS["time_limit"], help="saturation limit (s)")
    parser.add_argument("--extract-time-limit", type=float, default=DEFAULT_OPTIONS["extract_time_limit"])
    parser.add_argument("--node-limit", type=int, default=DEFAULT_OPTIONS["node_limit"])
    parser.add_argument("--show", type=int, metavar="INDEX", help="print program INDEX's source and exit")
    args = parser.parse_args(argv)
    backends = args.backend or ["xla"]
    options = {"time_limit": args.time_limit, "extract_time_limit": args.extract_time_limit,
               "node_limit": args.node_limit}
    if args.show is not None:
        program = campaign_programs(args.seed, max(args.programs, args.show + 1))[args.show]
        print(program.source(backends[0], options))
        return 0
    reports = []
    for backend in backends:
        reports.append(run_campaign(backend, args.programs, args.seed, options=options,
                                    shrink_failures=not args.no_shrink, shrink_fallbacks=not args.no_shrink_fallbacks,
                                    shrink_budget=args.shrink_seconds, total_shrink_budget=args.total_shrink_seconds,
                                    timeout=args.timeout))
    print_table(reports)
    for report in reports:
        print_failures(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": " ".join(["python -m benchmarks.fuzz"] + list(argv if argv is not None else sys.argv[1:])),
                       "versions": {"jax": jax.__version__},
                       "table": [r.table_row() for r in reports],
                       "backends": [r.to_json() for r in reports]}, handle, indent=1, default=str)
    failed = any(r.counts()["crashed"] or r.counts()["wrong"] for r in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
