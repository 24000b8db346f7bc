"""Effects run through `eqsat.optimize` as they do under `jax.jit`: `jax.debug.print` and
`jax.debug.callback` print/call once per call (per iteration inside loops), ordered ones in
program order, whether the function is called, its plan evaluated, or its program interpreted,
and extraction never drops them."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from eqsat.interpret import evaluate_program
from eqsat.lift import OpaqueWarning, lift


def quietly(fn):
    """`eqsat.optimize(fn)` with the lift's warnings recorded, not shown."""
    fast = eqsat.optimize(fn, progress=False)
    return fast


def lowered_quietly(fast, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = fast.lower(*args)
    return lowered, [str(w.message) for w in caught]


def jit_output(fn, *args, capsys) -> tuple[object, str]:
    capsys.readouterr()
    result = jax.jit(fn)(*args)
    jax.effects_barrier()
    return result, capsys.readouterr().out


def eqsat_output(fn, *args, capsys) -> tuple[object, str]:
    fast = quietly(fn)
    lowered_quietly(fast, *args)
    capsys.readouterr()
    result = fast(*args)
    jax.effects_barrier()
    return result, capsys.readouterr().out


def printing(x):
    jax.debug.print("first {}", x[0], ordered=True)
    y = jnp.sin(x) * 2
    jax.debug.print("total {t:.3f}", t=y.sum(), ordered=True)
    jax.debug.print("last {}", y[-1], ordered=True)
    return y + 1


def test_debug_print_prints_what_jit_prints_in_order(capsys):
    x = np.linspace(0, 1, 5, dtype=np.float32)
    want, jit_text = jit_output(printing, x, capsys=capsys)
    got, text = eqsat_output(printing, x, capsys=capsys)
    assert text == jit_text
    lines = text.splitlines()
    assert lines[:2] == ["first 0.0", f"total {float(np.sum(np.sin(x) * 2)):.3f}"]
    assert len(lines) == 3 and lines[2].startswith("last 1.68294")
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_an_effect_whose_value_nothing_reads_is_not_dropped(capsys):
    def f(x):
        jax.debug.print("sum is {}", x.sum())          # no output depends on it
        return x

    x = np.arange(4, dtype=np.float32)
    fast = quietly(f)
    lowered, messages = lowered_quietly(fast, x)
    assert any(k.kind == "opaque" for k in lowered.plan.kernels)
    assert lowered.program.effect_outputs == 1
    capsys.readouterr()
    result = fast(x)
    assert capsys.readouterr().out == "sum is 6.0\n"
    np.testing.assert_array_equal(result, x)
    assert messages and all("stays an opaque XLA op" not in m for m in messages)
    assert any("debug_print" in m and "program order" in m for m in messages)


def test_plan_evaluation_and_the_program_interpreter_print_too(capsys):
    x = np.linspace(0, 1, 5, dtype=np.float32)
    lowered, _ = lowered_quietly(quietly(printing), x)
    capsys.readouterr()
    lowered.plan.evaluate(x)
    first = capsys.readouterr().out
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        program = lift(printing, x)
    assert not [w for w in again if issubclass(w.category, OpaqueWarning)], "warned twice for one function"
    evaluate_program(program, x)
    second = capsys.readouterr().out
    assert first == second and first.count("\n") == 3 and first.startswith("first 0.0")


def test_callbacks_run_once_per_call_in_order():
    seen = []

    def f(x):
        jax.debug.callback(lambda v: seen.append(("a", float(v))), x.max(), ordered=True)
        y = x * 3
        jax.debug.callback(lambda v: seen.append(("b", float(v))), y.sum(), ordered=True)
        return y

    x = np.arange(3, dtype=np.float32)
    fast = quietly(f)
    lowered_quietly(fast, x)
    assert seen == []                                   # lowering traces, it does not run
    fast(x)
    fast(x + 1)
    assert seen == [("a", 2.0), ("b", 9.0), ("a", 3.0), ("b", 18.0)]


def test_effects_inside_loops_and_branches_run_per_iteration(capsys):
    def f(x, flag):
        def step(carry, t):
            jax.debug.print("step {} carry {}", t, carry, ordered=True)
            return carry + t, carry * 2

        total, doubled = lax.scan(step, jnp.float32(0), x)

        def body(i, c):
            jax.debug.print("while {}", i, ordered=True)
            return c + 1.0

        counted = lax.fori_loop(0, 2, body, total)
        branch = lax.cond(flag, lambda v: (jax.debug.print("yes {}", v, ordered=True), v)[1],
                          lambda v: (jax.debug.print("no {}", v, ordered=True), -v)[1], counted)
        return branch, doubled

    x = np.array([1, 2, 3], np.float32)
    for flag in (True, False):
        want, jit_text = jit_output(f, x, flag, capsys=capsys)
        got, text = eqsat_output(f, x, flag, capsys=capsys)
        assert text == jit_text, (text, jit_text)
        assert text.count("step") == 3 and text.count("while") == 2
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w)


def test_while_loops_with_effects_in_the_body_or_the_predicate(capsys):
    def f(x):
        def body(c):
            jax.debug.print("body {}", c[0], ordered=True)
            return c * 2

        def check(c):
            jax.debug.print("check {}", c[0], ordered=True)
            return c[0] < 20

        grown = lax.while_loop(lambda c: c[0] < 10, body, x)
        return lax.while_loop(check, lambda c: c + 5, grown)

    x = np.array([1, 2], np.float32)
    want, jit_text = jit_output(f, x, capsys=capsys)
    got, text = eqsat_output(f, x, capsys=capsys)
    assert text == jit_text and text.count("body") == 4 and text.count("check") == 2
    np.testing.assert_allclose(got, want)
    lowered, _ = lowered_quietly(quietly(f), x)
    loops = [k for k in lowered.plan.kernels if k.op == "Loop"]
    assert loops, "the loop with effects in its body stays a Loop"


def test_effects_in_nested_jit_and_unordered_prints(capsys):
    @jax.jit
    def inner(v):
        jax.debug.print("inner {}", v.sum())
        return v * 2

    def f(x):
        jax.debug.print("outer {}", x[0])
        return inner(x) + 1

    x = np.ones(3, np.float32)
    _, jit_text = jit_output(f, x, capsys=capsys)
    got, text = eqsat_output(f, x, capsys=capsys)
    assert sorted(text.splitlines()) == sorted(jit_text.splitlines()) == ["inner 3.0", "outer 1.0"]
    np.testing.assert_allclose(got, x * 2 + 1)
