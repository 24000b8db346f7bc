"""The `sd15 plan` report as a benchmark: the table, plus the JSON written to a file.

    python -m benchmarks.sd15_plan --out results.json                 # full-size SD 1.5, fp16, H100
    python -m benchmarks.sd15_plan --out unet.json --components unet
    python -m benchmarks.sd15_plan --out xla.json --no-optimize       # XLA's side only

Takes every `sd15 plan` option (see benchmarks/README.md for what each number means). The JSON is
`sd15 plan --json`'s report plus the environment it ran in and the benchmark's own wall time.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

from sd15 import plan_cli


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "packages": {
            name: _version(name)
            for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "egglog", "eqsat")
        },
        "command": " ".join(["python -m benchmarks.sd15_plan", *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sd15_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write the JSON report here")
    plan_cli.add_arguments(parser)
    options = parser.parse_args(argv)

    start = time.perf_counter()
    report = plan_cli.run_plan(
        batch=options.batch, size=options.size, dtype=options.dtype, components=options.components,
        device=options.device, config=options.config, xla=options.xla, optimize=options.optimize,
        emit=options.emit, backend=options.backend,
        log=lambda message: print(message, file=sys.stderr, flush=True),
    )
    report["benchmark_seconds"] = time.perf_counter() - start
    report["environment"] = environment()
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if options.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        plan_cli.render(report)
        print(f"wrote {options.out} ({report['benchmark_seconds']:.0f} s)")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
