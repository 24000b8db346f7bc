"""The named schedule of rule families: which ruleset runs when, and for how long.

A `Schedule` is a flat list of `Stage`s; `eqsat.saturate.saturate` runs each stage one iteration
at a time (at most `iterations` per visit, until it changes nothing) and repeats the whole list
until a round changes nothing. The default order is cleanup first, then fusion:

    view_folding    views compose; identity views vanish                     (cleanup)
    functionalize   writes (Assign*) become pure expressions                 (cleanup)
    concat_slice    slices/elementwise push through concats; K-range concats
    absorb          prologues and epilogues: elementwise work joins kernels
    norm_split      normalization = statistics + apply                       (beyond the seeds)
    row_stats       row statistics computed inside the matmul reading them   (beyond the seeds)
    epilogue_stats  statistics computed by the kernel writing the normalized tensor  (beyond the seeds)
    attention       softmax(q k^T) v patterns -> Attention
    horizontal      matmuls sharing an input -> one matmul
    hoist           loop-invariant work out of loop bodies

Families that do not exist yet are left out silently (see `eqsat.rules.FAMILIES`). A family
module with `FIXPOINT_STAGE = True` (context relations propagated one term level per iteration,
adding few e-nodes: `row_stats`, `epilogue_stats`) runs to its own fixpoint in each stage iteration, so its
propagation depth does not eat the saturation's iteration limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egglog.egraph import Ruleset, UnstableCombinedRuleset
from egglog.egraph import Schedule as Schedule_

DEFAULT_ORDER = (
    "view_folding", "functionalize", "concat_slice", "absorb", "norm_split", "row_stats", "epilogue_stats",
    "attention", "horizontal", "hoist",
)


@dataclass(frozen=True)
class Stage:
    """One ruleset, run at most `iterations` times per visit (None: until it changes nothing).

    `ruleset` may also be an egglog schedule such as `ruleset.saturate()` (one run = its fixpoint).
    """

    name: str
    ruleset: Ruleset | UnstableCombinedRuleset | Schedule_
    iterations: int | None = 32


@dataclass(frozen=True)
class Schedule:
    """Stages in order, repeated until a round changes nothing (or `rounds` rounds, if set)."""

    stages: tuple[Stage, ...]
    rounds: int | None = None

    def __add__(self, other: "Schedule") -> "Schedule":
        return Schedule(self.stages + other.stages, self.rounds)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(stage.name for stage in self.stages)


def ruleset_name(ruleset) -> str:
    ident = getattr(ruleset, "ident", None)
    return ident.name if ident is not None else str(ruleset.__egg_ident__.name)


def default_schedule(families: Iterable[str] | None = None, *, iterations: int | None = 32,
                     extra: Iterable = ()) -> Schedule:
    """Every available family of `families` (default: all of `eqsat.rules.FAMILIES`) in `DEFAULT_ORDER`,
    then a stage per ruleset of `extra` (a user's own rulesets: `optimize(fn, rulesets=default_schedule(
    extra=[my_rules]))`; the whole list repeats until a round changes nothing, so the families see
    what the extra rules add)."""
    from eqsat import rules

    wanted = list(families) if families is not None else list(rules.FAMILIES)
    ordered = [name for name in DEFAULT_ORDER if name in wanted] + [n for n in wanted if n not in DEFAULT_ORDER]
    stages = []
    for name in ordered:
        ruleset = rules.family_ruleset(name)
        if ruleset is not None:
            if getattr(rules.family_module(name), "FIXPOINT_STAGE", False):
                ruleset = ruleset.saturate()  # one stage iteration runs it to its fixpoint
            stages.append(Stage(name, ruleset, iterations))
    for ruleset in extra:
        stages.append(Stage(ruleset_name(ruleset), ruleset, iterations))
    return Schedule(tuple(stages))


def as_schedule(schedule) -> Schedule:
    """`None` -> the default schedule; a family name, a ruleset, or a sequence of them (or of stages)
    -> one stage each (`["absorb", my_rules]`: a family, then a user's ruleset)."""
    if schedule is None:
        return default_schedule()
    if isinstance(schedule, str):
        return default_schedule([schedule])
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, Stage):
        return Schedule((schedule,))
    if isinstance(schedule, (Ruleset, UnstableCombinedRuleset)):
        return Schedule((Stage(ruleset_name(schedule), schedule),))
    if isinstance(schedule, Sequence):
        stages: list[Stage] = []
        for item in schedule:
            stages.extend(as_schedule(item).stages)
        return Schedule(tuple(stages))
    raise TypeError(f"not a schedule: {schedule!r} (expected a Schedule, a Ruleset or a sequence of them)")


def schedule_of(rulesets):
    """What `optimize(..., rulesets=)` accepts, as something `saturate` runs: None (the default
    schedule), a family name or a list of names (the default schedule of those families), or a
    schedule, ruleset or list of rulesets as given."""
    if rulesets is None:
        return default_schedule()
    if isinstance(rulesets, str):
        return default_schedule([rulesets])
    if isinstance(rulesets, (list, tuple)) and rulesets and all(isinstance(r, str) for r in rulesets):
        return default_schedule(rulesets)
    return rulesets
