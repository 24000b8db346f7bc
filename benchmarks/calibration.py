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
"""

from __future__ import annotations

import re
from collections import defaultdict
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
    """Per kind: plan kernels, launches, measured and modeled seconds per call, and their ratio."""
    kinds: dict[str, dict[str, Any]] = defaultdict(lambda: {"kernels": 0, "launches": 0, "measured_seconds": 0.0,
                                                             "modeled_seconds": 0.0})
    for row in rows:
        total = kinds[row["kind"]]
        total["kernels"] += row["kernels"]
        total["launches"] += row["launches"]
        total["measured_seconds"] += row["measured_seconds"]
        total["modeled_seconds"] += row["modeled_seconds"] or 0.0
    out = []
    for kind, total in kinds.items():
        modeled = total["modeled_seconds"]
        out.append({"kind": kind, **total, "ratio": total["measured_seconds"] / modeled if modeled else None})
    return sorted(out, key=lambda r: -r["measured_seconds"])
