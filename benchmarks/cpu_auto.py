"""On this CPU: the emitted plan (`backend="xla"`) made for the H100 and for the CPU, against `jax.jit`,
steady state, on a ResNet block (GroupNorm, SiLU), an MLP with LayerNorm, a ResNet-18 (BatchNorm, 32x32
input) and SD 1.5's tiny UNet step and VAE decode; and what `backend="auto"` chose for each (it times the
plan against `jax.jit` on a signature's first call, `driver.auto_choice`).

    python -m benchmarks.cpu_auto                    # every program, 2 s per pair
    python -m benchmarks.cpu_auto --only mlp --seconds 4

Times are the best per-call seconds over alternating rounds (`benchmarks.emit.steady_pair`), float32;
"1st+2nd call": the first two calls of a fresh `eqsat.optimize(fn, backend=...)` whose plan is already
made (compiling; for "auto" also timing both candidates, and when jax.jit won, its compile into the
dispatching jit on the second call).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import jax
import jax.numpy as jnp

from benchmarks.emit import Case, _concrete, _f32, _sd15_tiny, steady_pair


def resnet_block(params, x):
    from sd15.layers import resnet_block as block

    return block(params, "block", x, None, groups=8, eps=1e-5)


def _resnet_params(channels: int, out: int) -> dict:
    shapes = {"block.norm1.weight": (channels,), "block.norm1.bias": (channels,),
              "block.conv1.weight": (out, channels, 3, 3), "block.conv1.bias": (out,),
              "block.norm2.weight": (out,), "block.norm2.bias": (out,),
              "block.conv2.weight": (out, out, 3, 3), "block.conv2.bias": (out,),
              "block.conv_shortcut.weight": (out, channels, 1, 1), "block.conv_shortcut.bias": (out,)}
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}


def mlp(params, x):
    from sd15.layers import gelu, layer_norm, linear

    h = layer_norm(params, "norm", x, 1e-5)
    return x + linear(params, "fc2", gelu(linear(params, "fc1", h)))


def _mlp_params(width: int, hidden: int) -> dict:
    shapes = {"norm.weight": (width,), "norm.bias": (width,), "fc1.weight": (hidden, width), "fc1.bias": (hidden,),
              "fc2.weight": (width, hidden), "fc2.bias": (width,)}
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}


def resnet18(params, x):
    """torchvision's ResNet-18 on NHWC input, BatchNorm in inference form, max pool by reduce_window."""
    from jax import lax

    def conv(name, h, stride=1):
        w = params[f"{name}.weight"]
        pad = w.shape[0] // 2
        return lax.conv_general_dilated(h, w, (stride, stride), ((pad, pad), (pad, pad)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def norm(name, h):
        scale = params[f"{name}.scale"] * lax.rsqrt(params[f"{name}.var"] + 1e-5)
        return (h - params[f"{name}.mean"]) * scale + params[f"{name}.bias"]

    h = jax.nn.relu(norm("bn1", conv("conv1", x, 2)))
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))
    for stage, _ in enumerate(RESNET18_WIDTHS):
        for block in range(2):
            name, stride = f"layer{stage + 1}.{block}", 2 if stage and not block else 1
            out = jax.nn.relu(norm(f"{name}.bn1", conv(f"{name}.conv1", h, stride)))
            out = norm(f"{name}.bn2", conv(f"{name}.conv2", out))
            if f"{name}.downsample.weight" in params:
                h = norm(f"{name}.downsample.bn", conv(f"{name}.downsample", h, stride))
            h = jax.nn.relu(out + h)
    return h.mean(axis=(1, 2)) @ params["fc.weight"] + params["fc.bias"]


RESNET18_WIDTHS = (64, 128, 256, 512)


def _resnet18_params(classes: int = 1000) -> dict:
    shapes = {}

    def conv(name, k, cin, cout):
        shapes[f"{name}.weight"] = (k, k, cin, cout)

    def norm(name, c):
        shapes.update({f"{name}.{stat}": (c,) for stat in ("scale", "bias", "mean", "var")})

    conv("conv1", 7, 3, 64)
    norm("bn1", 64)
    cin = 64
    for stage, width in enumerate(RESNET18_WIDTHS):
        for block in range(2):
            name = f"layer{stage + 1}.{block}"
            conv(f"{name}.conv1", 3, cin if not block else width, width)
            norm(f"{name}.bn1", width)
            conv(f"{name}.conv2", 3, width, width)
            norm(f"{name}.bn2", width)
            if stage and not block:
                conv(f"{name}.downsample", 1, cin, width)
                norm(f"{name}.downsample.bn", width)
        cin = width
    shapes.update({"fc.weight": (512, classes), "fc.bias": (classes,)})
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}


def cases() -> list[Case]:
    sd15 = {case.name: case for case in _sd15_tiny()}
    return [Case("resnet_block", resnet_block, (_resnet_params(64, 128), _f32(2, 32, 32, 64)), True),
            Case("mlp_layernorm", mlp, (_mlp_params(320, 1280), _f32(2, 256, 320)), True),
            Case("resnet18", resnet18, (_resnet18_params(), _f32(1, 32, 32, 3)), True),
            sd15["unet_tiny"], sd15["vae_tiny"]]


def measure(case: Case, seconds: float) -> dict:
    import eqsat

    args = _concrete(case.args)
    row = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # First: the first two calls of a fresh optimized function whose plan is made (from the plan
        # cache), before jax.jit(fn) is compiled here (jax keeps what it compiled for the same fn).
        for backend in ("xla", "auto"):
            fast = eqsat.optimize(case.fn, backend=backend, static_argnums=case.static_argnums, progress=False)
            fast.lower(*args)
            for call in ("first", "second"):
                start = time.perf_counter()
                jax.block_until_ready(fast(*args))
                row[f"{call}_{backend}"] = time.perf_counter() - start
        row["auto"] = fast.lower(*args).stats.get("auto")
        jitted = jax.jit(case.fn, static_argnums=case.static_argnums)
        for device in ("h100", "cpu"):
            emitted = eqsat.optimize(case.fn, device=device, backend="xla", static_argnums=case.static_argnums,
                                     progress=False).lower(*args).executable("xla")
            row[device] = steady_pair(emitted, jitted, args, seconds)
    return row


def _chose(record) -> str:
    if record is None:
        return "-"
    if record["plan_s"] is None:
        return f"plan, untimed ({record['why']})"
    return f"{record['chose']} (plan {record['plan_s'] * 1e3:.2f} ms, jit {record['jit_s'] * 1e3:.2f} ms)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="program names (default: all)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per pair")
    options = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'program':<14} {'h100 plan':>10} {'jit':>9} {'ratio':>6} {'cpu plan':>10} {'jit':>9} {'ratio':>6}  "
          f"{'1st+2nd call xla':>16} {'auto':>12}  auto chose")
    for case in cases():
        if options.only and case.name not in options.only:
            continue
        row = measure(case, options.seconds)
        (h, hj), (c, cj) = row["h100"], row["cpu"]
        print(f"{case.name:<14} {h * 1e3:>8.2f}ms {hj * 1e3:>7.2f}ms {h / hj:>5.2f}x {c * 1e3:>8.2f}ms "
              f"{cj * 1e3:>7.2f}ms {c / cj:>5.2f}x  {row['first_xla']:>7.2f}+{row['second_xla']:.2f}s "
              f"{row['first_auto']:>6.2f}+{row['second_auto']:.2f}s  {_chose(row['auto'])}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
