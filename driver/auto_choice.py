"""On a CPU, `backend="auto"` runs the faster of the emitted plan and `jax.jit` of the original function.

The first call of a signature, with concrete arguments, compiles and runs both once, then times them
in alternating rounds (at most `CALLS` timed calls, stopping after `SECONDS` once a round is done)
and keeps the plan unless `jax.jit`'s best time is more than `MARGIN` smaller (a switch costs a compile,
and within a few percent the two are the same program timed through noise). The choice is recorded in the
signature's `Lowered.stats["auto"]`:

    {"chose": "plan" | "jit", "plan_s": best seconds per call, "jit_s": ..., "calls": timed calls}

How `eqsat.optimize` calls it (`Optimized._auto_choice`): the first call runs the plan through the
dispatching jit, then times that jit against `jax.jit(fn)`; if `jax.jit` won, the dispatching jit
is rebuilt and traces `fn` for the signature on its next call. A call that donates its arguments is
timed before it runs, inside the dispatching jit's trace (`choose(..., in_trace=True)`), with the
emitted plan as its own jit. With prepared parameters (no dispatching jit) the call times the
prepared plan against `jax.jit(fn)` and runs the winner itself.

Nothing is timed on a GPU (`auto` is `hybrid` there), for an explicit backend, under an outer trace
(`jit`, `vmap`, `grad`: the plan runs, as before), or when a call has effects (debug prints,
callbacks) or mutable `Ref` arguments a timing run would repeat; those record
`{"chose": "plan", "plan_s": None, "jit_s": None, "why": ...}`. Both candidates compute the same
function: they differ in float rounding only. `EQSAT_AUTO_CHOICE=plan` in the environment turns the
timing off (the plan runs, untimed): the test suite sets it, so that a test of the plan tests the plan.
"""

from __future__ import annotations

import contextlib
import os
import time

import jax
import numpy as np

CALLS = 10      # timed calls in all, both candidates together, after each has compiled and run once
SECONDS = 2.0   # no new round starts after this many seconds of timed calls
MARGIN = 0.03   # jax.jit must be this much faster (a fraction of the plan's time) to be chosen
CANDIDATES = ("plan", "jit")
ENVIRONMENT = "EQSAT_AUTO_CHOICE"


def times_choice(backend: str) -> bool:
    """Whether calls with `backend` choose between the plan and `jax.jit` by timing: `auto` on a CPU,
    unless `EQSAT_AUTO_CHOICE=plan` (the plan, untimed, as `backend="xla"`; the tests' setting)."""
    setting = os.environ.get(ENVIRONMENT, "timed")
    if setting not in ("timed", "plan"):
        raise ValueError(f"{ENVIRONMENT}={setting!r}: expected 'timed' (the default) or 'plan'")
    return backend == "auto" and setting == "timed" and jax.default_backend() == "cpu"


def untimeable(program, dynamic_args) -> str | None:
    """Why a call cannot be run again for timing (None when it can); `dynamic_args`: its arguments
    but the static ones."""
    if program.effect_outputs:
        return "the function has effects (a timing run would repeat them)"
    for leaf in jax.tree_util.tree_leaves(dynamic_args):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
            return f"an argument is a {type(leaf).__name__}, not an array (a timing run could change it)"
    return None


def not_timed(why: str) -> dict:
    return {"chose": "plan", "plan_s": None, "jit_s": None, "calls": 0, "why": why}


def choose(plan, jitted, args, kwargs, calls: int = CALLS, seconds: float = SECONDS, in_trace: bool = False,
           plan_ran: bool = False) -> dict:
    """Compile and run `plan` and `jitted` once each on `(args, kwargs)` (not `plan` when `plan_ran`:
    it has run on such arguments already), then time them in alternating rounds (the first of a
    round alternates); the record of the module docstring. `in_trace`: a jit is tracing the caller,
    and the candidates must run eagerly on the concrete `args` all the same
    (`jax.ensure_compile_time_eval`, which is part of a jit's cache key: only where needed)."""
    fns = {"plan": plan, "jit": jitted}
    best = dict.fromkeys(CANDIDATES, float("inf"))
    with jax.ensure_compile_time_eval() if in_trace else contextlib.nullcontext():
        if not plan_ran:
            jax.block_until_ready(plan(*args, **kwargs))
        try:
            jax.block_until_ready(jitted(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - the plan ran; a jit that cannot is no candidate
            return not_timed(f"jax.jit of the original function failed: {type(error).__name__}: {error}")
        timed, began = 0, time.perf_counter()
        while timed + len(fns) <= max(calls, len(fns)) and (timed == 0 or time.perf_counter() - began < seconds):
            order = CANDIDATES if (timed // len(fns)) % 2 == 0 else CANDIDATES[::-1]
            for name in order:
                start = time.perf_counter()
                jax.block_until_ready(fns[name](*args, **kwargs))
                best[name] = min(best[name], time.perf_counter() - start)
                timed += 1
    chose = "jit" if best["jit"] < best["plan"] * (1 - MARGIN) else "plan"
    return {"chose": chose, "plan_s": best["plan"], "jit_s": best["jit"], "calls": timed}


def report_line(record: dict) -> str:
    """One line of `Lowered.report()` for a signature's `stats["auto"]`."""
    if record["plan_s"] is None:
        return f"backend auto on this CPU: ran the plan untimed ({record['why']})"
    ran = "the plan" if record["chose"] == "plan" else "jax.jit of the original function"
    return (f"backend auto on this CPU: runs {ran} (measured on the first call, best of {record['calls'] // 2} "
            f"alternating rounds: plan {record['plan_s'] * 1e3:,.3f} ms, jax.jit {record['jit_s'] * 1e3:,.3f} ms "
            f"per call)")
