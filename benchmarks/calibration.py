"""Measured kernel times against the cost model's, kernel by kernel and per kind.

A profiler trace names each Pallas launch by its Triton kernel name: the `pallas_call` name
`"<component>:<kind>"` with characters outside `[A-Za-z0-9_.]` made `_` (and `.` too, in the
trace), uniquified with a `__<n>` suffix when two launches share a name. Kernels of one plan can
share a name (two matmuls of one attention block; identical kernels share the first one's name plus
`.x<uses>`, `emit.kernel_names`), so the join is by name: a name's measured
seconds (every launch carrying it) against its modeled seconds (every plan kernel carrying it).

    rows = join(plan_kernels(lowered), measured)     # measured: {trace name: seconds per call}
    by_kind(rows)                                     # per kind: count, measured, modeled, ratio

`ratio` = measured / modeled: how many times slower the kernel ran than the model said. A model
that knows what each template executes has ratios near 1 for every kind; extraction trusts it.
`spread` (in `by_kind`) is the geometric standard deviation of the per-name ratios of a kind: 1.0
when every kernel is off by the same factor.

`python -m benchmarks.calibration [--results FILE] [--fit]` plans the measured components again
(full size, as `benchmarks.gpu` did), prices every plan kernel with the roofline and with the
calibrated device model (`eqsat.cost.work`, on the measuring device's profile, `h200-calibrated`),
and prints both models' ratio and spread per component and kind (`plan`: the plan's own seconds,
`extract.plan.Kernel.seconds`, the data-sheet roofline on the plan's device, `h100`). `--fit` fits the calibrated
model's factors per template (`eqsat.cost.work.TEMPLATE_FACTORS`: memory, MMA, ALU, and the time
of a serial step) to the measured per-kernel times: non-negative least squares on the
relative error of each measured kernel name, one fit per template over all components. Finalize
kernels are fitted with the work of the template that was measured (`MEASURED_FINALIZE`: 32 slots
per program on one warp, before the fix that removed its spills) and priced with today's.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

_UNIQUE_SUFFIX = re.compile(r"__\d+$")


def trace_name(name: str) -> str:
    """A `pallas_call` name (`"up_blocks.0.resnets.1.conv1:conv"`) as the profiler spells it."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def base_name(launch_name: str) -> str:
    """A launch's name without the `__<n>` suffix that makes repeated names unique."""
    return _UNIQUE_SUFFIX.sub("", launch_name)


def plan_kernels(lowered) -> list[dict[str, Any]]:
    """The per-call plan's kernels of an `eqsat.optimize(...).lower(...)` result: name, kind, modeled seconds."""
    from emit import kernel_names

    split = getattr(lowered, "split", None)
    plan = split.per_call if split is not None else lowered.plan
    return [{"name": name, "kind": k.kind, "seconds": float(k.seconds)} for k, name in zip(plan.kernels, kernel_names(plan))]


def join(planned: Iterable[Mapping[str, Any]], measured: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per kernel name: its kind, plan kernels, launches seen, measured and modeled seconds
    per call. Launches no plan kernel is named after (an XLA fusion or copy around the kernels)
    are rows of kind `"not planned"` with no modeled time."""
    rows: dict[str, dict[str, Any]] = {}
    for kernel in planned:
        key = trace_name(kernel["name"])
        row = rows.setdefault(key, {"name": kernel["name"], "kind": kernel["kind"], "kernels": 0, "launches": 0,
                                    "measured_seconds": 0.0, "modeled_seconds": 0.0})
        row["kernels"] += 1
        row["modeled_seconds"] += kernel["seconds"]
    for launch, seconds in measured.items():
        key = base_name(launch)
        if key not in rows and launch in rows:
            key = launch
        row = rows.setdefault(key, {"name": launch, "kind": "not planned", "kernels": 0, "launches": 0,
                                    "measured_seconds": 0.0, "modeled_seconds": None})
        row["launches"] += 1
        row["measured_seconds"] += seconds
    for row in rows.values():
        modeled = row["modeled_seconds"]
        row["ratio"] = row["measured_seconds"] / modeled if modeled else None
    return sorted(rows.values(), key=lambda r: -r["measured_seconds"])


def by_kind(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per kind: plan kernels, launches, measured and modeled seconds per call, their ratio, and
    the spread of the per-name ratios (geometric standard deviation)."""
    kinds: dict[str, dict[str, Any]] = defaultdict(lambda: {"kernels": 0, "launches": 0, "measured_seconds": 0.0,
                                                             "modeled_seconds": 0.0})
    for row in rows:
        total = kinds[row["kind"]]
        total["kernels"] += row["kernels"]
        total["launches"] += row["launches"]
        total["measured_seconds"] += row["measured_seconds"]
        total["modeled_seconds"] += row["modeled_seconds"] or 0.0
        if row["modeled_seconds"] and row["measured_seconds"] and row["launches"] == row["kernels"]:
            total.setdefault("log_ratios", []).append(math.log(row["measured_seconds"] / row["modeled_seconds"]))
    out = []
    for kind, total in kinds.items():
        modeled = total["modeled_seconds"]
        logs = total.pop("log_ratios", [])
        spread = math.exp(statistics.pstdev(logs)) if len(logs) > 1 else (1.0 if logs else None)
        out.append({"kind": kind, **total, "ratio": total["measured_seconds"] / modeled if modeled else None,
                    "spread": spread})
    return sorted(out, key=lambda r: -r["measured_seconds"])


# --- the calibrated model: features, fit, report ------------------------------------------------

RESULTS = "benchmarks/results/gpu-h200-2ce0105.json"
# The measured plans were extracted by the data-sheet roofline: planned again the same way, so that
# the kernels priced are the kernels measured (names whose launches do not match are left out).
PLANNING_DEVICE = "h100"
FEATURES = ("memory", "mma", "alu", "serial")


def measured_finalize_loads(tiles: int, fields: int) -> int:
    """Serial partial loads per thread of the finalize template that was measured (one warp,
    32 slots as the lanes of one program, `merge_partials_at`'s 4096-element blocks)."""
    from emit.expr import merge_block_tiles

    block = merge_block_tiles(tiles, 32, 4096)
    return -(-tiles // block) * fields * block


def kernel_features(kernel, device, measured_template: bool = False) -> tuple[str, dict[str, float], float]:
    """(template, its resources' data-sheet seconds on `device` as a calibrated `kernel_cost`
    weighs them, launch seconds) of a plan kernel (`extract.plan.Kernel`)."""
    from eqsat.cost import merges, work

    if kernel.kind == "finalize":
        w = work.finalize_work(kernel.term)
        if measured_template:
            loads = measured_finalize_loads(merges.statistic_tiles(kernel.term), merges.fields(kernel.term))
            w = work.TemplateWork("finalize", w.programs, steps=loads)
    else:
        w = work.template_work(kernel.term)
    features = {"memory": kernel.bytes / device.hbm_bandwidth,
                "alu": (max(0.0, kernel.flops - w.useful_mma_flops) + w.alu_flops) / device.peak_fp32,
                "mma": w.mma_flops / (work.rate(w.mma, device) * w.sm_utilization) if w.mma_flops else 0.0,
                "serial": float(w.serial)}
    return w.template, features, device.launch_overhead


@dataclass(frozen=True)
class Calibration:
    """The calibrated model's constants (`eqsat.cost.work`): the shared memory and ALU factors and
    each template's `TemplateFactors`."""

    memory: float
    alu: float
    templates: dict

    @classmethod
    def current(cls) -> "Calibration":
        from eqsat.cost import work

        return cls(work.MEMORY_FACTOR, work.ALU_FACTOR, dict(work.TEMPLATE_FACTORS))


def calibrated_seconds(kernel, device, calibration: Calibration, measured_template: bool = False) -> float:
    """A plan kernel's seconds under `calibration` on `device`'s data sheet (as `kernel_cost` on a
    calibrated device prices it)."""
    from eqsat.cost.work import TemplateFactors

    template, features, launch = kernel_features(kernel, device, measured_template)
    f = calibration.templates.get(template, TemplateFactors())
    return (launch + calibration.memory * features["memory"] + calibration.alu * features["alu"]
            + f.mma * features["mma"] + f.serial * features["serial"])


def fit(samples: list[tuple[str, dict[str, float], float, float]]) -> Calibration:
    """The constants from (template, summed features, summed launch, measured seconds) per measured
    kernel name: least squares of (measured - launch) / measured on the features divided by
    measured (the relative error), all templates at once. `memory` and `alu` are one factor for
    every template (a byte or a vector flop costs the same in any kernel: what lets extraction price
    them per e-node, `eqsat.cost.work`), `mma` and `serial` one per template; every factor is at
    least 1 (no resource runs faster than its data sheet), `serial` at least 0."""
    import numpy as np
    from scipy.optimize import lsq_linear

    from eqsat.cost.work import TemplateFactors

    samples = [s for s in samples if s[3] > 0]
    templates = sorted({s[0] for s in samples})
    columns = [("memory", None), ("alu", None)]
    columns += [(name, t) for t in templates for name in ("mma", "serial")
                if any(s[1][name] for s in samples if s[0] == t)]
    a = np.zeros((len(samples), len(columns)))
    for i, (template, features, _launch, measured) in enumerate(samples):
        for j, (name, t) in enumerate(columns):
            if t is None or t == template:
                a[i, j] = features[name] / measured
    b = np.array([(s[3] - s[2]) / s[3] for s in samples])
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns of ~1 (serial steps are ~1e-6 s each)
    lower = np.array([0.0 if name == "serial" else 1.0 for name, _ in columns]) * scale
    coef = lsq_linear(a / scale, b, bounds=(lower, np.inf)).x / scale
    values = {column: float(c) for column, c in zip(columns, coef)}
    return Calibration(values[("memory", None)], values[("alu", None)],
                       {t: TemplateFactors(mma=values.get(("mma", t), 1.0), serial=values.get(("serial", t), 0.0))
                        for t in templates if t != "other"})


def _plans(components: Iterable[str]):
    from eqsat import optimize
    from sd15.workloads import workloads

    for name in components:
        workload = workloads(batch=2, dtype="float16", components=(name,))[name]
        lowered = optimize(workload.fn, params_argnums=0, progress=False, extract_time_limit=120.0,
                           device=PLANNING_DEVICE).lower(*workload.args)
        split = getattr(lowered, "split", None)
        yield name, split.per_call if split is not None else lowered.plan


def main(argv: list[str] | None = None) -> int:
    from eqsat.cost import get_device

    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS, help=f"a benchmarks.gpu JSON (default {RESULTS})")
    parser.add_argument("--backend", default="pallas")
    parser.add_argument("--fit", action="store_true", help="fit the factors per template and print them")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the per-kind tables as JSON")
    args = parser.parse_args(argv)
    report = json.loads(open(args.results).read())
    device = get_device("h200-calibrated" if "H200" in report["device"] else "h100-calibrated")
    measured_rows = {c["component"]: c for c in report["components"] if c["backend"] == args.backend}
    plans = dict(_plans(measured_rows))
    samples, joined = [], {}
    for name, plan in plans.items():
        measured = {k["name"]: k["seconds_per_call"] for k in measured_rows[name]["ours_top_kernels"]}
        by_name: dict[str, list] = defaultdict(list)
        for kernel in plan.kernels:
            by_name[trace_name(name_of_kernel(kernel))].append(kernel)
        for key, kernels in by_name.items():
            seconds = sum(v for launch, v in measured.items() if base_name(launch) == key or launch == key)
            launches = sum(1 for launch in measured if base_name(launch) == key or launch == key)
            if launches != len(kernels) or not seconds:
                continue
            feats = [kernel_features(k, device, measured_template=True) for k in kernels]
            summed = {f: sum(x[1][f] for x in feats) for f in FEATURES}
            samples.append((feats[0][0], summed, sum(x[2] for x in feats), seconds))
        joined[name] = measured
    calibration = fit(samples) if args.fit else Calibration.current()
    tables = {}
    for name, plan in plans.items():
        for label, price in (("plan", lambda k: k.seconds),
                             ("calibrated", lambda k: calibrated_seconds(k, device, calibration, measured_template=True))):
            planned = [{"name": name_of_kernel(k), "kind": k.kind, "seconds": price(k)} for k in plan.kernels]
            tables[(name, label)] = by_kind(join(planned, joined[name]))
    print(f"measured: {args.results} ({report['device']}, jax {report['jax']}); planned on {PLANNING_DEVICE}, "
          f"calibrated model on {device.name}; {len(samples)} measured kernel names joined")
    print(f"{'component':13} {'model':10} {'kind':10} {'names':>5} {'measured ms':>11} {'modeled ms':>10} "
          f"{'ratio':>6} {'spread':>6}")
    for (name, label), rows in tables.items():
        for row in rows:
            if row["kind"] == "not planned" or not row["launches"]:
                continue
            print(f"{name:13} {label:10} {row['kind']:10} {row['kernels']:5d} {row['measured_seconds'] * 1e3:11.3f} "
                  f"{row['modeled_seconds'] * 1e3:10.3f} {row['ratio']:6.2f} {row['spread'] or 0:6.2f}")
    print("fitted" if args.fit else "current", "constants (eqsat.cost.work):")
    print(f"MEMORY_FACTOR = {calibration.memory:.4g}\nALU_FACTOR = {calibration.alu:.4g}")
    for template, f in calibration.templates.items():
        print(f'    "{template}": TemplateFactors(mma={f.mma:.4g}, serial={f.serial:.4g}),')
    if args.json:
        out = {f"{name}/{label}": rows for (name, label), rows in tables.items()}
        out["constants"] = {"memory": calibration.memory, "alu": calibration.alu,
                            "templates": {t: vars(f) for t, f in calibration.templates.items()}}
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)
    return 0


def name_of_kernel(kernel) -> str:
    from emit.pallas import name_of

    return name_of(kernel.component, kernel.kind)


if __name__ == "__main__":
    sys.exit(main())
