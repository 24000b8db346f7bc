"""Small pointwise kernels computed in their readers (`extract.small_kernels`): inlined where the model
prices the plan lower, kept where a reader is an output, values unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from eqsat.interpret import evaluate
from eqsat.term import Term
from extract.plan import Plan
from extract.siblings import stack_sibling_reductions

ROWS, COLS = 6, 4096


def ld(t: Term) -> Term:
    return Term("Load", t, t.ty)


def mean_and_readers():
    """mean = sum(x) / n, a kernel of 6 elements, read by a pointwise and a reduction over x."""
    x = Term("Input", "x", f"f32[{ROWS},{COLS}]")
    total = Term("Reduce", "sum", ld(x), "1", Term("Acc", f"f32[{ROWS}]"), f"f32[{ROWS}]")
    mean = Term("Pointwise", Term("Binary", "div", ld(total), Term("Lit", float(COLS), f"f32[{ROWS}]"), f"f32[{ROWS}]"),
                f"f32[{ROWS}]")
    spread = Term("Broadcast", ld(mean), "0", x.ty)
    centred = Term("Pointwise", Term("Binary", "sub", ld(x), spread, x.ty), x.ty)
    absolute = Term("Reduce", "sum", Term("Unary", "abs", Term("Binary", "sub", ld(x), spread, x.ty), x.ty), "1",
                    Term("Acc", f"f32[{ROWS}]"), f"f32[{ROWS}]")
    return x, mean, [centred, absolute]


def test_a_statistic_sized_kernel_is_computed_by_its_readers():
    _, mean, outputs = mean_and_readers()
    naive = Plan.build(outputs)
    planned = Plan.build(outputs, plan_passes=True)
    assert mean in [k.term for k in naive.kernels]
    assert mean not in [k.term for k in planned.kernels]
    assert len(planned.kernels) == len(naive.kernels) - 1 and planned.seconds < naive.seconds


def test_a_kernel_that_is_an_output_stays():
    _, mean, outputs = mean_and_readers()
    planned = Plan.build([*outputs, mean], plan_passes=True)
    assert mean in [k.term for k in planned.kernels]


@pytest.mark.parametrize("offset", [0.0, 1e4, -3e7])
def test_values_are_unchanged(offset):
    x, _, outputs = mean_and_readers()
    rng = np.random.default_rng(0)
    value = (offset + rng.standard_normal((ROWS, COLS))).astype(np.float32)
    value[2] = np.float32(5.0)  # a constant row
    value[3, 7] = np.inf
    naive, planned = Plan.build(outputs), Plan.build(outputs, plan_passes=True)
    want = evaluate(naive.outputs, {"x": value})
    got = evaluate(planned.outputs, {"x": value})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_negated_sum_stacks_with_its_sibling():
    """-sum(x * y) and sum(x) over the same axes: one stacked kernel whose row reduces -(x * y)."""
    x = Term("Input", "x", f"f32[{ROWS},{COLS}]")
    y = Term("Input", "y", f"f32[{ROWS},{COLS}]")
    ty = f"f32[{ROWS}]"
    plain = Term("Reduce", "sum", ld(x), "1", Term("Acc", ty), ty)
    negated = Term("Reduce", "sum", Term("Binary", "mul", ld(x), ld(y), x.ty), "1",
                   Term("Unary", "neg", Term("Acc", ty), ty), ty)
    reader = Term("Pointwise", Term("Binary", "add", ld(plain), ld(negated), ty), ty)
    outputs, source_of = stack_sibling_reductions([reader], {})
    assert len(Plan.build(outputs).kernels) == 2
    rng = np.random.default_rng(1)
    env = {"x": (1e4 + rng.standard_normal((ROWS, COLS))).astype(np.float32),
           "y": rng.standard_normal((ROWS, COLS)).astype(np.float32)}
    np.testing.assert_array_equal(np.asarray(evaluate(outputs, env)[0]), np.asarray(evaluate([reader], env)[0]))
