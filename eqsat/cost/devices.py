"""Device profiles: the four numbers the roofline needs, from published data sheets.

| profile | HBM bandwidth | dense fp16 (tensor cores) | fp32 (vector) | launch |
|---|---|---|---|---|
| `h100` (H100 SXM5 80 GB) | 3.35 TB/s | 989 TFLOP/s | 67 TFLOP/s | 4 µs |
| `h200` (H200 SXM 141 GB) | 4.8 TB/s | 989 TFLOP/s | 67 TFLOP/s | 4 µs |
| `a100` (A100 SXM4 80 GB) | 2.0 TB/s | 312 TFLOP/s | 19.5 TFLOP/s | 5 µs |
| `cpu` (one 16-core AVX2 server socket) | 50 GB/s | 1 TFLOP/s | 1 TFLOP/s | 1 µs |

Launch overhead is the per-kernel cost of issuing a kernel and draining the previous one (a few
microseconds on current GPUs; on the CPU, the dispatch of one XLA thunk). Statistics computed in
their producers' epilogues need no launch and no memset: their tiles write per-tile partials that
the readers merge (`eqsat.cost.roofline`).

`h100-calibrated` and `h200-calibrated` are what our Pallas templates reach of those peaks, fitted
to the per-kernel times measured on an H200 (`eqsat.cost.work`: `MEMORY_FACTOR` times the
data-sheet time per byte, `ALU_FACTOR` per vector flop (both here), and per template its MMA factor and
serial-step time on the MMA instruction and padded tiles its configuration runs). `h100` (what
planning uses by default) and `h200` are the data sheet alone (useful flops at the peak, every byte
at full bandwidth). Extraction on `h100-calibrated` found a UNet plan that model prices 0.7 %
slower than the data-sheet extraction's; since candidates are compared on the finished plan's
price, every greedy round polished, and matmul operands charged per tile (`extract`), it finds
a plan it prices below the data-sheet extraction's for the UNet (30.08 against 30.11 ms) and the
VAE (19.09 against 19.11 ms), not for the text encoder (1.650 against 1.648 ms: the greedy search
misses a selection its own objective prices lower), so `h100` stays the default.

`link_bandwidth` prices the collectives of a plan partitioned over several devices (`emit.sharded`): 450 GB/s each way per H100/H200 (NVLink 4),
300 GB/s per A100 (NVLink 3), 25 GB/s for the CPU (its peers are other sockets or hosts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# A calibrated device's time per byte and per vector flop as multiples of the data sheet's, one
# number for every kernel (fitted with `eqsat.cost.work.TEMPLATE_FACTORS` by
# `python -m benchmarks.calibration --fit`: both at their lower bound, the data-sheet rates).
MEMORY_FACTOR = 1.0
ALU_FACTOR = 1.0


@dataclass(frozen=True)
class Device:
    """A roofline device: `seconds = launch + bytes / hbm_bandwidth + flops / peak`; calibrated
    (`calibrated`): bytes and vector flops at `eqsat.cost.work`'s factors, dense work as the
    template executes it (`eqsat.cost.work.mma_seconds`)."""

    name: str
    hbm_bandwidth: float  # bytes / second
    peak_fp16: float  # flop / second, dense 16-bit matmul (tensor cores)
    peak_fp32: float  # flop / second, 32-bit vector units (elementwise work, f32 matmuls)
    launch_overhead: float  # seconds per kernel
    link_bandwidth: float = 450e9  # bytes / second one device receives from its peers (NVLink 4: 450 GB/s each way)
    calibrated: bool = False
    # Which templates emit the dense kernels (`eqsat.cost.backends`): "triton" (the Pallas Triton
    # templates, as before), "mosaic" (the Mosaic GPU ones), "hybrid" (convs and matmuls as XLA
    # library calls), "auto" (per kernel, whichever of those the model prices lowest).
    backend: str = "triton"

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to move `nbytes` to or from HBM in our kernels."""
        return nbytes * (MEMORY_FACTOR if self.calibrated else 1.0) / self.hbm_bandwidth

    def vector_seconds(self, flops: float) -> float:
        """Seconds of `flops` of elementwise (fp32 vector) work in our kernels."""
        return flops * (ALU_FACTOR if self.calibrated else 1.0) / self.peak_fp32

    def peak(self, dtype: str, dense: bool) -> float:
        """The throughput for `dense` (matmul-like) or elementwise work on operands of `dtype`."""
        if dense and dtype in ("float16", "bfloat16", "int8", "uint8"):
            return self.peak_fp16
        return self.peak_fp32


H100 = Device("h100", hbm_bandwidth=3.35e12, peak_fp16=989e12, peak_fp32=67e12, launch_overhead=4e-6)
H200 = Device("h200", hbm_bandwidth=4.8e12, peak_fp16=989e12, peak_fp32=67e12, launch_overhead=4e-6)
H100_CALIBRATED = Device("h100-calibrated", 3.35e12, 989e12, 67e12, 4e-6, calibrated=True)
H200_CALIBRATED = Device("h200-calibrated", 4.8e12, 989e12, 67e12, 4e-6, calibrated=True)
A100 = Device("a100", hbm_bandwidth=2.0e12, peak_fp16=312e12, peak_fp32=19.5e12, launch_overhead=5e-6,
            link_bandwidth=300e9)
CPU = Device("cpu", hbm_bandwidth=50e9, peak_fp16=1e12, peak_fp32=1e12, launch_overhead=1e-6, link_bandwidth=25e9)

DEVICES: dict[str, Device] = {d.name: d for d in (H100, H200, H100_CALIBRATED, H200_CALIBRATED, A100, CPU)}


BACKENDS = ("triton", "mosaic", "hybrid", "auto")


def with_backend(device: "str | Device", backend: str) -> Device:
    """`device` whose dense kernels are priced as `backend`'s templates emit them (`BACKENDS`),
    named `<profile>+<backend>` (`h100+mosaic`; the default `triton` keeps the bare name) so that a
    plan's device name (`Plan.device`) says it too: `get_device("h100+mosaic")` is this device."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown cost backend {backend!r}; known: {BACKENDS}")
    device = get_device(device)
    if device.backend == backend:
        return device
    base = device.name.split("+", 1)[0]
    return dataclasses.replace(device, backend=backend, name=base if backend == "triton" else f"{base}+{backend}")


def get_device(device: "str | Device") -> Device:
    """`get_device("h100")` -> `H100`; a `Device` passes through."""
    if isinstance(device, Device):
        return device
    if "+" in device:  # a profile priced for a backend: "h100+mosaic"
        base, backend = device.split("+", 1)
        return with_backend(get_device(base), backend)
    key = device.lower().replace(" ", "").replace("-", "").replace("_", "")
    for alias, name in (("h100sxm", "h100"), ("h200sxm", "h200"), ("a100sxm", "a100"),
                        ("h100calibrated", "h100-calibrated"), ("h200calibrated", "h200-calibrated")):
        key = name if key == alias else key
    if key not in DEVICES:
        raise ValueError(f"unknown device {device!r}; known: {sorted(DEVICES)}")
    return DEVICES[key]
