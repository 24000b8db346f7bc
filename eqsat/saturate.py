"""Running rule families over an e-graph: `saturate(egraph, schedule)` -> `SaturationReport`.

A schedule (see `eqsat.schedule`) is a list of named stages, each one egglog ruleset run one
iteration at a time. `saturate` repeats the stages in order until a whole round changes nothing
(saturated) or a limit stops it, and says which limit did. The e-graph is only ever added to:
stopping at a limit leaves it valid, with every rewrite applied so far.

    report = saturate(builder.egraph, node_limit=500_000, time_limit=10.0)
    report.saturated, report.limit_reached, report.e_nodes, report.seconds["absorb"]
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from egglog import EGraph, bindings
from egglog.egraph_state import span

from eqsat import lang
from eqsat.schedule import Schedule, as_schedule
from eqsat.serialized import parse_serialized

LIMITS = ("node_limit", "iteration_limit", "time_limit", "rounds")
LANGUAGE_SORTS = ("Tensor", "Expr", "TensorList")


@dataclass
class SaturationReport:
    """What one `saturate` call did."""

    iterations: int                                   # ruleset runs, over all stages and rounds
    e_nodes: int                                      # language e-nodes (`Ref` handles excluded)
    e_classes: int | None                             # None when counting was switched off
    seconds: dict[str, float]                         # wall time per stage (its ruleset's name)
    saturated: bool                                   # a whole round changed nothing
    limit_reached: str | None                         # one of LIMITS, or None ("rounds": the schedule's own cap)
    rounds: int = 0                                   # passes over the whole schedule
    matches: dict[str, int] = field(default_factory=dict)    # rule matches per stage
    e_nodes_per_op: dict[str, int] = field(default_factory=dict)
    history: list[tuple[str, int, float]] = field(default_factory=list)  # (stage, e-nodes, seconds)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def summary(self) -> str:
        stop = "saturated" if self.saturated else f"stopped by {self.limit_reached}"
        per_stage = ", ".join(f"{name} {sec:.2f}s" for name, sec in self.seconds.items())
        return (f"{self.iterations} iterations in {self.rounds} rounds, {stop}: {self.e_nodes} e-nodes, "
                f"{self.e_classes} e-classes ({per_stage})")


def count_nodes(egraph: EGraph) -> dict[str, int]:
    """Rows per language constructor (e-nodes), from egglog's table sizes; `Ref` handles excluded."""
    (output,) = egraph._egraph.run_program(bindings.PrintSize(span(), None))
    return {name: size for name, size in output.sizes if name in lang.OPS}


def count_classes(egraph: EGraph) -> int:
    """E-classes of the language sorts, from the serialized e-graph (costs one serialization: a
    caller that serializes anyway passes `classes=False` to `saturate` and counts with `classes_in`)."""
    return classes_in(serialized_data(egraph))


def serialized_data(egraph: EGraph) -> dict:
    """`egraph`'s serialization, parsed (the input of `extract.load`). Primitive outputs are not split
    into a class per node (egglog's default, for drawing): `extract.load` reads the same graph either
    way, and the UNet's e-graph serializes in a third of the time and 18% fewer bytes without it."""
    return parse_serialized(egraph._serialize(split_primitive_outputs=False))


def classes_in(data: dict) -> int:
    """E-classes of the language sorts in a parsed serialization (`serialized_data`)."""
    return sum(1 for info in data["class_data"].values() if info.get("type") in LANGUAGE_SORTS)


def saturate(
    egraph: EGraph,
    schedule=None,
    *,
    node_limit: int = 1_000_000,
    iteration_limit: int = 400,
    time_limit: float = 60.0,
    classes: bool = True,
    program=None,
) -> SaturationReport:
    """Run `schedule` (default: `eqsat.schedule.default_schedule()`) on `egraph` until saturated or a limit.

    `schedule` may be an `eqsat.schedule.Schedule`, one egglog `Ruleset`, or a sequence of them.
    Limits are checked between ruleset runs: e-nodes (language constructors), ruleset runs, and
    wall seconds. `classes=False` skips the final e-class count (one serialization). `program`
    (the lifted `Program` the e-graph was built from) lets families state facts that live outside
    the e-graph first (`eqsat.rules.seed`: loop constants, scatter kinds); without it those rules
    do not fire.
    """
    plan: Schedule = as_schedule(schedule)
    if program is not None:
        from eqsat.rules import seed

        seed(egraph, program)
    started = time.perf_counter()
    seconds: Counter[str] = Counter({stage.name: 0.0 for stage in plan.stages})
    matches: Counter[str] = Counter()
    history: list[tuple[str, int, float]] = []
    nodes = sum(count_nodes(egraph).values())
    iterations = rounds = 0
    limit: str | None = None
    saturated = False

    def exceeded() -> str | None:
        if nodes >= node_limit:
            return "node_limit"
        if iterations >= iteration_limit:
            return "iteration_limit"
        if time.perf_counter() - started >= time_limit:
            return "time_limit"
        return None

    while limit is None:
        if plan.rounds is not None and rounds >= plan.rounds:
            limit = "rounds"
            break
        rounds += 1
        changed = False
        for stage in plan.stages:
            runs = 0
            while stage.iterations is None or runs < stage.iterations:
                limit = exceeded()
                if limit is not None:
                    break
                tick = time.perf_counter()
                report = egraph.run(stage.ruleset)
                elapsed = time.perf_counter() - tick
                iterations += 1
                runs += 1
                seconds[stage.name] += elapsed
                matches[stage.name] += sum(report.num_matches_per_rule.values())
                nodes = sum(count_nodes(egraph).values())
                history.append((stage.name, nodes, elapsed))
                if not report.updated:
                    break
                changed = True
            if limit is not None:
                break
        if limit is None and not changed:
            saturated = True
            break
    per_op = count_nodes(egraph)
    return SaturationReport(
        iterations=iterations,
        e_nodes=sum(per_op.values()),
        e_classes=count_classes(egraph) if classes else None,
        seconds=dict(seconds),
        saturated=saturated,
        limit_reached=limit,
        rounds=rounds,
        matches=dict(matches),
        e_nodes_per_op=per_op,
        history=history,
    )
