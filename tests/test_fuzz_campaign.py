"""The differential test campaign (`benchmarks/fuzz.py`, issue 15): a fixed-seed slice of random
programs composing every pattern family runs through `eqsat.optimize` on the `xla` and `pallas`
backends exactly as under `jax.jit` (no crash, no wrong answer); the shrinker reduces a failing
program to a minimal one; a program's rendered source is a standalone script computing the program.
"""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from benchmarks import fuzz

SEED = 15
SLICE = 6  # programs per backend: 3 required families each, so all of fuzz.FAMILIES appear
# both backends run the same slice: the second emits the first's plans (conftest.module_plan_cache)
pytestmark = pytest.mark.usefixtures("module_plan_cache")


def test_the_slice_exercises_every_family():
    programs = fuzz.campaign_programs(SEED, SLICE)
    assert {step.kind for p in programs for step in p.steps} >= set(fuzz.FAMILIES)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fixed_slice_runs_as_under_jit(backend):
    report = fuzz.run_campaign(backend, SLICE, SEED, shrink_failures=False, progress=False)
    counts = report.counts()
    failures = [(p, r) for p, r in zip(report.programs, report.results) if r.status in ("crashed", "wrong")]
    message = "\n\n".join(f"program {p.index}: {r.status}: {r.detail}\n{p.source(backend, report.options)}"
                          for p, r in failures)
    assert counts["crashed"] == 0 and counts["wrong"] == 0, message
    assert counts["jit_fails"] == 0  # the grammar only draws programs jax.jit runs


def _synthetic_failure(program: fuzz.Program) -> bool:
    """A stand-in for a bug: any program with a convolution fails."""
    return any(step.kind == "conv" for step in program.steps)


def test_shrinker_reduces_a_failing_program():
    program = fuzz.generate(3, 0, require=["norm", "conv", "attention", "matmul", "concat"], steps=6)
    assert _synthetic_failure(program) and len(program.steps) >= 5
    tried = []
    shrunk = fuzz.shrink(program, _synthetic_failure, budget=60.0, on_try=lambda: tried.append(1))
    assert _synthetic_failure(shrunk)
    convs = [s for s in shrunk.steps if s.kind == "conv"]
    assert len(convs) == 1
    # what is left besides the convolution is the view that gives its operand its rank
    assert all(s.kind == "view" and s.out in convs[0].args for s in shrunk.steps if s.kind != "conv")
    assert all(not s.params.get(flag) for s in shrunk.steps for flag in s.params.get("flags", []))
    assert shrunk.sizes and all(value == 1 for value in shrunk.sizes.values()), shrunk.sizes
    assert all(a.regime == "centred" for a in shrunk.inputs)
    assert len(shrunk.arguments()) < len(program.arguments())
    assert fuzz.valid(shrunk) and len(tried) > 0


def test_shrinking_keeps_the_failure_class():
    """`same_failure` accepts only candidates failing with the same class: here a synthetic `Result`
    that no candidate reproduces, so nothing is accepted and the program stays as it was."""
    program = fuzz.generate(3, 1, require=["act"], steps=2)
    result = fuzz.Result("crashed", "ValueError: no such bug")
    shrunk = fuzz.shrink(program, fuzz.same_failure(result, "xla", None, 60.0), budget=30.0, max_tries=2)
    assert shrunk.function_source() == fuzz._prune(program).function_source()


def _exec(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "<reproducer>", "exec"), namespace)
    return namespace


def test_rendered_source_is_the_program():
    programs = fuzz.campaign_programs(SEED, SLICE)
    for program in programs:
        namespace = _exec(program.source())  # imports, def f, args: nothing from benchmarks
        args = program.args()
        assert len(namespace["args"]) == len(args) == len(program.arguments())
        for got, want, spec in zip(namespace["args"], args, program.arguments()):
            assert got.dtype == want.dtype == np.dtype(jax.numpy.dtype(spec.dtype)), spec
            assert got.shape == want.shape == tuple(program.size_of(d) for d in spec.shape), spec
            np.testing.assert_array_equal(got, want)
        fn = program.fn()
        assert str(jax.make_jaxpr(namespace["f"])(*args)) == str(jax.make_jaxpr(fn)(*args))
        with jax.default_matmul_precision("highest"):
            ours, theirs = jax.jit(namespace["f"])(*args), jax.jit(fn)(*args)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        again = fuzz.Program.from_json(json.loads(json.dumps(program.to_json())))
        assert again.source() == program.source()


def test_a_reproducer_runs_standalone():
    program = fuzz.shrink(fuzz.generate(3, 0, require=["norm", "conv"], steps=3), _synthetic_failure, budget=30.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _exec(program.source("xla", fuzz.DEFAULT_OPTIONS, header="a header\nof two lines"))
    assert len(out.getvalue().splitlines()) == len(program.outputs())


def test_compare_uses_float64_to_arbitrate():
    """A 1% error is wrong; a difference from jax.jit where jit is the inexact one (a fast variance
    cancelling at an offset of 300) is not."""
    x = (300.0 + 0.05 * np.random.default_rng(0).standard_normal((4, 16))).astype(np.float32)

    def fast_variance_norm(x):
        m = x.mean(-1, keepdims=True)
        return ((x - m) * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) - m ** 2 + 1e-5),)

    want = jax.jit(fast_variance_norm)(x)
    reference = fuzz._float64_run(fast_variance_norm, [x])
    exact = tuple(np.asarray(v, np.float32) for v in reference())
    magnitudes = fuzz.input_magnitudes(fast_variance_norm, [x])
    assert fuzz.compare(want, want, [x], reference, magnitudes) is None
    assert fuzz.compare(exact, want, [x], reference, magnitudes) == ("arbitrated", "")
    centred = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    want = jax.jit(fast_variance_norm)(centred)
    kind, detail = fuzz.compare(tuple(v * 1.01 for v in want), want, [centred])
    assert kind == "values" and "beyond tol" in detail
    assert fuzz.compare((want[0][:2],), want, [x])[0] == "shape"
    assert fuzz.compare((want[0].astype(np.float16),), want, [x])[0] == "dtype"
