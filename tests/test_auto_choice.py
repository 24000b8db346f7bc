"""`backend="auto"` on a CPU: the plan or `jax.jit`, whichever the first call of a signature timed faster
(`driver.auto_choice`). Which one wins depends on timing, so no test asserts it."""

from __future__ import annotations

import contextlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from driver import auto_choice

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto times candidates on a CPU only")


def block(x, w, scale):
    h = x @ w
    centered = h - h.mean(-1, keepdims=True)
    return jax.nn.silu(centered * jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + 1e-5) * scale)


def block_args(rows=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 20)).astype(np.float32) * 3.0 + 100.0  # offsets large against the spread
    x[0] = 7.0  # a constant row
    return [x, (rng.standard_normal((20, 12)) * 0.2).astype(np.float32), np.linspace(-2, 2, 12, dtype=np.float32)]


@pytest.fixture(autouse=True)
def timed(monkeypatch):
    """The timed choice on (the suite's conftest turns it off)."""
    monkeypatch.delenv(auto_choice.ENVIRONMENT, raising=False)


def close(got, want, tol=2e-4):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.fixture
def choices(monkeypatch):
    """The records `choose` made, in order (the real timing runs)."""
    made = []
    real = auto_choice.choose

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(auto_choice, "choose", counting)
    return made


def forced(monkeypatch, chose):
    """`choose` records `chose` after running both candidates (their values kept for the test)."""
    values = {}

    def choose(plan, jitted, args, kwargs, in_trace=False, **_):
        with jax.ensure_compile_time_eval() if in_trace else contextlib.nullcontext():  # as `choose` does
            values["plan"], values["jit"] = plan(*args, **kwargs), jitted(*args, **kwargs)
        return {"chose": chose, "plan_s": 2e-3 if chose == "jit" else 1e-3,
                "jit_s": 1e-3 if chose == "jit" else 2e-3, "calls": 2}

    monkeypatch.setattr(auto_choice, "choose", choose)
    return values


def test_the_choice_is_made_once_per_signature_and_recorded(choices):
    fast = eqsat.optimize(block, progress=False)
    small, large = block_args(), block_args(rows=9, seed=1)
    for args in (small, small, large, small, large):
        close(fast(*args), jax.jit(block)(*args))
    assert len(choices) == 2
    for args, made in zip((small, large), choices):
        record = fast.lower(*args).stats["auto"]
        assert record is made
        assert record["plan_s"] > 0 and record["jit_s"] > 0
        assert 2 <= record["calls"] <= auto_choice.CALLS
        assert record["chose"] == ("jit" if record["jit_s"] < record["plan_s"] * (1 - auto_choice.MARGIN) else "plan")
        assert "backend auto on this CPU: runs" in fast.lower(*args).report()
    again = pickle.loads(pickle.dumps(fast))  # without its lowerings and choices: it chooses anew
    close(again(*small), jax.jit(block)(*small))
    assert len(choices) == 3
    prepared = eqsat.optimize(block, params_argnums=(1, 2), progress=False)  # no dispatching jit
    for _ in range(2):
        close(prepared(*small), jax.jit(block)(*small))
    assert len(choices) == 4 and prepared.lower(*small).stats["auto"] is choices[-1]
    assert choices[-1]["plan_s"] > 0 and choices[-1]["jit_s"] > 0


@pytest.mark.parametrize("chose", ["plan", "jit"])
def test_either_candidate_computes_what_jit_computes(monkeypatch, chose):
    values = forced(monkeypatch, chose)
    traces = []

    def traced_block(*args):
        traces.append(len(traces))
        return block(*args)

    fast = eqsat.optimize(traced_block, progress=False)
    args = block_args(rows=77)
    want = jax.jit(block)(*args)
    close(fast(*args), want)  # plans, runs the plan, then times both
    close(values["plan"], want)
    close(values["jit"], want)
    before = len(traces)
    close(fast(*args), want)  # the chosen one, through the dispatching jit
    close(fast(*args), want)
    assert len(traces) - before == (1 if chose == "jit" else 0)  # jit: the function traced into the dispatcher once
    assert fast.lower(*args).stats["auto"]["chose"] == chose


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("chose", ["plan", "jit"])
def test_the_choice_holds_with_prepared_parameters_and_donation(monkeypatch, chose):
    forced(monkeypatch, chose)
    fast = eqsat.optimize(block, params_argnums=1, progress=False)
    args = block_args()
    close(fast(*args), jax.jit(block)(*args))
    assert fast.lower(*args).stats["auto"]["chose"] == chose
    donating = eqsat.optimize(block, donate_argnums=0, progress=False)
    want = jax.jit(block)(*args)
    close(donating(jnp.asarray(args[0]), *args[1:]), want)  # timing runs before the donating call
    close(donating(jnp.asarray(args[0]), *args[1:]), want)


def test_calls_under_an_outer_trace_do_not_time(choices):
    fast = eqsat.optimize(block, progress=False)
    args = block_args()
    close(jax.jit(fast)(*args), jax.jit(block)(*args))
    close(jax.vmap(fast, in_axes=(0, None, None))(np.stack([args[0]] * 3), *args[1:]),
          jax.vmap(block, in_axes=(0, None, None))(np.stack([args[0]] * 3), *args[1:]))
    close(jax.grad(lambda x: fast(x, *args[1:]).sum())(args[0]), jax.grad(lambda x: block(x, *args[1:]).sum())(args[0]),
          tol=2e-3)
    assert choices == []
    assert "auto" not in fast.lower(*args).stats


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_an_explicit_backend_never_times(choices, backend):
    fast = eqsat.optimize(block, backend=backend, progress=False)
    args = block_args()
    close(fast(*args), jax.jit(block)(*args))
    close(fast(*args), jax.jit(block)(*args))
    assert choices == []
    assert "auto" not in fast.lower(*args).stats


@pytest.mark.filterwarnings("ignore:eqsat.lift")  # the callback stays opaque, as it should
def test_effects_are_not_repeated_for_timing(choices):
    seen = []

    def printing(x, w, scale):
        jax.debug.callback(lambda v: seen.append(float(v)), x[0, 0])
        return block(x, w, scale)

    fast = eqsat.optimize(printing, progress=False)
    args = block_args()
    close(fast(*args), jax.jit(block)(*args))
    jax.effects_barrier()
    assert seen == [7.0]
    assert choices == []
    record = fast.lower(*args).stats["auto"]
    assert record["chose"] == "plan" and record["plan_s"] is None and "effects" in record["why"]
    assert "untimed" in fast.lower(*args).report()


def test_timing_is_bounded_by_calls_and_seconds():
    calls = []

    def counted(name):
        def run(x):
            calls.append(name)
            return x

        return run

    record = auto_choice.choose(counted("plan"), counted("jit"), (jnp.ones(3),), {}, calls=6, seconds=60.0)
    assert calls == ["plan", "jit", "plan", "jit", "jit", "plan", "plan", "jit"]  # once each, then 3 rounds
    assert record["calls"] == 6
    calls.clear()
    record = auto_choice.choose(counted("plan"), counted("jit"), (jnp.ones(3),), {}, calls=10, seconds=0.0)
    assert record["calls"] == 2 and len(calls) == 4  # one round, whatever the time
    calls.clear()
    record = auto_choice.choose(counted("plan"), counted("jit"), (jnp.ones(3),), {}, seconds=0.0, plan_ran=True)
    assert calls == ["jit", "plan", "jit"]  # the plan that ran already is not run to warm it


def test_the_environment_turns_timing_off(choices, monkeypatch):
    monkeypatch.setenv(auto_choice.ENVIRONMENT, "plan")
    fast = eqsat.optimize(block, progress=False)
    args = block_args()
    close(fast(*args), jax.jit(block)(*args))
    assert choices == [] and "auto" not in fast.lower(*args).stats
    monkeypatch.setenv(auto_choice.ENVIRONMENT, "fastest")
    with pytest.raises(ValueError, match="EQSAT_AUTO_CHOICE='fastest'"):
        eqsat.optimize(block, progress=False)(*block_args(rows=3))


def test_a_jit_that_fails_is_no_candidate():
    def failing(x):
        raise RuntimeError("XLA cannot compile this")

    record = auto_choice.choose(lambda x: x + 1, failing, (jnp.ones(3),), {})
    assert record["chose"] == "plan" and record["plan_s"] is None
    assert "RuntimeError: XLA cannot compile this" in record["why"]


def test_static_arguments_that_are_not_arrays_are_timed_all_the_same(choices):
    def scaled(x, w, scale, *, settings):
        return block(x, w, scale) * settings[1]

    fast = eqsat.optimize(scaled, static_argnames="settings", progress=False)
    args = block_args()
    close(fast(*args, settings=("twice", 2.0)), 2.0 * jax.jit(block)(*args))
    assert len(choices) == 1 and choices[0]["plan_s"] > 0


def test_a_mutable_ref_argument_is_not_run_again():
    if not hasattr(jax, "new_ref"):
        pytest.skip("this jax has no mutable refs")
    from eqsat.program import Program

    ref = jax.new_ref(jnp.zeros(3))
    why = auto_choice.untimeable(Program(inputs=[], outputs=[]), ([jnp.ones(3), ref], {}))
    assert why is not None and "Ref" in why
    assert auto_choice.untimeable(Program(inputs=[], outputs=[]), ([jnp.ones(3), np.ones(2), 3, 2.5], {})) is None
