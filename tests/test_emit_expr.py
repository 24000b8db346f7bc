"""The shared expression compiler (`emit.expr`) against the reference interpreter, on whole arrays.

Every Expr is evaluated at the full index grid of its type through `ArrayMemory` (gathers from
whole arrays) and compared with `eqsat.interpret`: random chains of views (transpose, reshape,
broadcast, slice, concat, pad with negative and interior padding) over odd shapes, elementwise ops
including the polynomial erf, and in-kernel row reductions (`RowReduce`) with adversarial values:
offsets large against the spread, constant rows, NaN/inf, huge and tiny magnitudes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emit.expr import (ArrayMemory, compile_expr, erf, grid_index, reduce_at, reshape_index,
                       unravel, unsupported_ops)
from eqsat.interpret import evaluate
from eqsat.moments import two_pass
from eqsat.term import Term
from eqsat.types import format_type, parse_type

SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _input(name: str, shape, dtype="float32") -> Term:
    return Term("Input", name, format_type(dtype, shape))


def _load(tensor: Term) -> Term:
    return Term("Load", tensor, tensor.ty)


def _reference(expr: Term, values: dict):
    """The interpreter's value, traced once (eager dispatch would compile every op of every shape)."""
    terms = list(values)
    run = jax.jit(lambda arrays: evaluate([expr], {t.args[0]: v for t, v in zip(terms, arrays)})[0])
    return run([values[t] for t in terms])


def _traced(fn, values: dict, *, chunk_elements: int | None = None):
    """`fn(memory)` over `ArrayMemory(values)`, traced once (as a kernel body is)."""
    terms = list(values)

    def run(arrays):
        memory = ArrayMemory(dict(zip(terms, arrays)))
        if chunk_elements is not None:
            memory.chunk_elements = chunk_elements
        return fn(memory)

    return jax.jit(run)([values[t] for t in terms])


def _whole(expr: Term, values: dict, **options):
    """`emit.expr`'s value at every index of `expr`'s type."""
    shape = parse_type(expr.ty).shape
    return _traced(lambda memory: compile_expr(expr)(memory, grid_index(shape)), values, **options)


def _close(got, want, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


# --- random view chains -----------------------------------------------------------------------------


def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n + 1):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(2, n // a + 1):
                if (n // a) % b == 0:
                    out.append((a, b, n // a // b))
    return out


@st.composite
def view_chains(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    x = _input("x", shape)
    expr = _load(x)
    extras = {}
    for step in range(draw(st.integers(1, 5))):
        cur = parse_type(expr.ty).shape
        kind = draw(st.sampled_from(["transpose", "reshape", "broadcast", "slice", "concat", "pad", "unary", "binary"]))
        if kind == "transpose":
            perm = draw(st.permutations(range(len(cur))))
            expr = Term("Transpose", expr, ",".join(map(str, perm)), format_type("float32", [cur[p] for p in perm]))
        elif kind == "reshape":
            new = draw(st.sampled_from(_factorizations(math.prod(cur))))
            if draw(st.booleans()):
                new = new + (1,)
            expr = Term("Reshape", expr, format_type("float32", new))
        elif kind == "broadcast" and len(cur) < 4:
            axis = draw(st.integers(0, len(cur)))
            size = draw(st.integers(1, 3))
            out = cur[:axis] + (size,) + cur[axis:]
            dims = [d if d < axis else d + 1 for d in range(len(cur))]
            expr = Term("Broadcast", expr, ",".join(map(str, dims)), format_type("float32", out))
        elif kind == "slice":
            axis = draw(st.integers(0, len(cur) - 1))
            start = draw(st.integers(0, cur[axis] - 1))
            stop = draw(st.integers(start + 1, cur[axis]))
            stride = draw(st.integers(1, 3))
            if draw(st.booleans()):  # walking backwards (`rev`, `x[::-k]`): from stop - 1 down to start
                start, stop, stride = stop - 1, start - 1, -stride
            size = -(-(stop - start) // stride)
            out = cur[:axis] + (size,) + cur[axis + 1:]
            expr = Term("Slice", expr, axis, start, stop, stride, format_type("float32", out))
        elif kind == "concat":
            axis = draw(st.integers(0, len(cur) - 1))
            other_extent = draw(st.integers(1, 4))
            other_shape = cur[:axis] + (other_extent,) + cur[axis + 1:]
            other = _input(f"c{step}", other_shape)
            extras[other] = other_shape
            out = cur[:axis] + (cur[axis] + other_extent,) + cur[axis + 1:]
            left, right = (expr, _load(other)) if draw(st.booleans()) else (_load(other), expr)
            split = parse_type(left.ty).shape[axis]
            expr = Term("Concat", left, right, axis, split, format_type("float32", out))
        elif kind == "pad":
            config, out = [], []
            for size in cur:
                lo, hi, interior = draw(st.integers(-1, 2)), draw(st.integers(-1, 2)), draw(st.integers(0, 1))
                extent = lo + hi + size + max(0, size - 1) * interior
                if extent < 1:
                    lo, hi = 0, 0
                    extent = size + max(0, size - 1) * interior
                config.append(f"{lo},{hi},{interior}")
                out.append(extent)
            value = Term("Lit", draw(st.sampled_from([0.0, -1.5, float("inf")])), "f32[]")
            expr = Term("Pad", expr, value, ";".join(config), format_type("float32", out))
        elif kind == "unary":
            op = draw(st.sampled_from(["exp", "tanh", "erf", "neg", "abs", "round:0", "round:1", "integer_pow:2"]))
            expr = Term("Unary", op, expr, expr.ty)
        else:
            op = draw(st.sampled_from(["add", "mul", "max", "sub"]))
            expr = Term("Binary", op, expr, Term("Iota", len(cur) - 1, expr.ty), expr.ty)
    seed = draw(st.integers(0, 2**31 - 1))
    return expr, x, shape, extras, seed


@SETTINGS
@given(view_chains())
def test_random_view_chains_match_the_interpreter(case):
    expr, x, shape, extras, seed = case
    rng = np.random.default_rng(seed)
    values = {x: jnp.asarray(rng.normal(size=shape) * 3, jnp.float32)}
    for term, other_shape in extras.items():
        values[term] = jnp.asarray(rng.normal(size=other_shape), jnp.float32)
    _close(_whole(expr, values), _reference(expr, values), rtol=2e-6, atol=2e-6)


def test_reshape_index_only_touches_the_axes_it_merges():
    i, j = grid_index((6, 5))
    # [6, 5] -> [2, 3, 5]: axis 1 passes through as the very same array, axis 0 splits.
    index = reshape_index((i, j), (6, 5), (2, 3, 5))
    assert index[2] is j
    np.testing.assert_array_equal(np.asarray(index[0])[:, 0], [0, 0, 0, 1, 1, 1])
    assert reshape_index((3, 4), (6, 5), (30,)) == (19,)  # static indices fold at trace time
    assert unravel(29, (2, 3, 5)) == (1, 2, 4)


def test_static_concat_index_picks_its_side_without_reading_the_other():
    a, b = _input("a", (3,)), _input("b", (2,))
    expr = Term("Concat", _load(a), _load(b), 0, 3, "f32[5]")

    class OnlyB:
        def load(self, tensor, index, mask):
            assert tensor is b, "a static index into the right side must not read the left"
            return jnp.float32(7.0) + index[0]

    assert float(compile_expr(expr)(OnlyB(), (4,))) == 8.0


def test_shared_subterms_are_loaded_once_per_point():
    x = _input("x", (4, 6))
    lx = _load(x)
    expr = Term("Binary", "mul", lx, Term("Unary", "logistic", lx, "f32[4,6]"), "f32[4,6]")
    loads = []

    class Counting(ArrayMemory):
        def load(self, tensor, index, mask):
            loads.append(tensor)
            return super().load(tensor, index, mask)

    values = {x: jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 10}
    got = compile_expr(expr)(Counting(values), grid_index((4, 6)))
    assert len(loads) == 1
    _close(got, _reference(expr, values))


# --- elementwise ops --------------------------------------------------------------------------------


def test_polynomial_erf_is_within_1e_6_in_float32():
    x = jnp.concatenate([jnp.linspace(-8, 8, 400_001, dtype=jnp.float32),
                         jnp.asarray([0.0, -0.0, 1e-30, -1e-30, 3.9999, 4.0001, jnp.inf, -jnp.inf], jnp.float32)])
    err = jnp.abs(erf(x) - jax.lax.erf(x))
    assert float(jnp.max(err)) <= 1e-6
    assert bool(jnp.isnan(erf(jnp.float32(jnp.nan))))


@pytest.mark.parametrize("op", ["round:0", "round:1"])
def test_round_from_floor_matches_lax_on_halves(op):
    x = _input("x", (13,))
    values = {x: jnp.asarray([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -3.49, 0.0, 1e7 + 0.5, -7.5, 2.4999, 1e30],
                             jnp.float32)}
    expr = Term("Unary", op, _load(x), "f32[13]")
    _close(_whole(expr, values), _reference(expr, values), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, rtol", [("float16", 1e-3), ("bfloat16", 1e-2), ("float32", 1e-6)])
def test_half_precision_ops_run_in_float32_and_round_once(dtype, rtol):
    x, y = _input("x", (5, 40), dtype), _input("y", (5, 40), dtype)
    ty = format_type(dtype, (5, 40))
    expr = Term("Binary", "div", Term("Unary", "exp", _load(x), ty), Term("Binary", "add", _load(y),
                                                                         Term("Lit", 3.0, ty), ty), ty)
    rng = np.random.default_rng(0)
    values = {x: jnp.asarray(rng.normal(size=(5, 40)), dtype), y: jnp.asarray(rng.uniform(0, 2, (5, 40)), dtype)}
    got = _whole(expr, values)
    assert got.dtype == jnp.dtype(dtype)
    _close(got.astype(jnp.float32), _reference(expr, values).astype(jnp.float32), rtol=rtol, atol=rtol)


def test_unsupported_ops_are_named_before_tracing():
    x = _load(_input("x", (3,)))
    expr = Term("Binary", "add", Term("Unary", "lgamma", x, "f32[3]"), Term("Binary", "igamma", x, x, "f32[3]"), "f32[3]")
    assert unsupported_ops(expr) == ["Binary igamma", "Unary lgamma"]
    with pytest.raises(NotImplementedError, match="lgamma"):
        compile_expr(expr)


def test_acc_outside_an_epilogue_is_a_clear_error():
    with pytest.raises(ValueError, match="outside an epilogue"):
        compile_expr(Term("Acc", "f32[3]"))(ArrayMemory({}), grid_index((3,)))


# --- row reductions inside a kernel -----------------------------------------------------------------


def _row_reduce(op, x: Term, axis: int, acc_dtype="float32"):
    shape = parse_type(x.ty).shape
    kept = shape[:axis] + shape[axis + 1:]
    core = ((2,) if op == "moments" else ()) + kept
    dtype = "int32" if op in ("argmax", "argmin") else acc_dtype
    ty = format_type(dtype, core)
    return Term("RowReduce", op, _load(x), axis, Term("Acc", ty), ty)


ROWS = {
    "offset": lambda rng, shape: 1e4 + rng.normal(size=shape),
    "constant": lambda rng, shape: np.full(shape, 3.25),
    "constant far from zero": lambda rng, shape: np.full(shape, 141.8948),  # its float32 sum / n rounds
    "huge": lambda rng, shape: rng.normal(size=shape) * 1e18,
    "tiny": lambda rng, shape: rng.normal(size=shape) * 1e-20,
    "zeros": lambda rng, shape: np.zeros(shape),
    "mixed": lambda rng, shape: rng.standard_cauchy(size=shape),
}


@pytest.mark.parametrize("kind", sorted(ROWS))
@pytest.mark.parametrize("length", [1, 77, 300])
def test_moments_are_stable_for_adversarial_rows(kind, length):
    """[mean, M2] from chunked Chan merges: relative to the spread, never to the offset; a constant
    row's mean is exactly its value (the shift plus a mean of zeros) and its M2 exactly 0."""
    rng = np.random.default_rng(length)
    data = ROWS[kind](rng, (3, length)).astype(np.float32)
    x = _input("x", (3, length))
    expr = _row_reduce("moments", x, 1)
    # several chunks per row: exercises the merge
    got = np.asarray(_whole(expr, {x: jnp.asarray(data)}, chunk_elements=3 * 16), np.float64)
    exact = data.astype(np.float64)
    want_m2 = ((exact - exact.mean(axis=1, keepdims=True)) ** 2).sum(axis=1)
    scale = np.abs(exact).max(axis=1) + 1e-45
    np.testing.assert_allclose(got[0], exact.mean(axis=1), rtol=1e-5, atol=1e-5 * scale.max())
    if kind.startswith("constant"):
        np.testing.assert_array_equal(got, np.stack([data[:, 0], np.zeros(3)]))
    assert np.all(got[1] >= 0)
    rounding = length * (scale * 2.0**-23) ** 2 * 64 + 1e-37  # float32 rounding of the values themselves
    assert np.all(np.abs(got[1] - want_m2) <= 1e-4 * want_m2 + rounding), (got[1], want_m2)
    interpreted = np.asarray(two_pass(jnp.asarray(data), (1,)), np.float64)[1]
    assert np.all(np.abs(got[1] - interpreted) <= 1e-3 * want_m2 + 2 * rounding), (got[1], interpreted)


def test_moments_propagate_nan_and_inf():
    data = np.array([[1.0, np.nan, 3.0], [1.0, np.inf, 2.0], [1.0, 2.0, 3.0]], np.float32)
    x = _input("x", (3, 3))
    got = np.asarray(_whole(_row_reduce("moments", x, 1), {x: jnp.asarray(data)}))
    want = np.asarray(two_pass(jnp.asarray(data), (1,)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[:, 2], want[:, 2], rtol=1e-6)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "argmax", "argmin"])
@pytest.mark.parametrize("shape, axis", [((3, 77), 1), ((40, 5), 0), ((2, 3, 9), 1), ((1, 1), 1)])
def test_row_reductions_match_the_interpreter(op, shape, axis):
    rng = np.random.default_rng(len(shape) * 31 + axis)
    data = rng.normal(size=shape).astype(np.float32)
    if op == "prod":
        data = np.sign(data) * (0.9 + 0.2 * rng.uniform(size=shape)).astype(np.float32)
    x = _input("x", shape)
    expr = _row_reduce(op, x, axis)
    values = {x: jnp.asarray(data)}
    got = _whole(expr, values, chunk_elements=64)
    _close(got, _reference(expr, values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_arg_reductions_take_the_first_nan_and_the_first_tie(op):
    data = np.array([[1.0, 5.0, 5.0, 0.0, 5.0], [2.0, np.nan, 9.0, np.nan, 1.0], [-np.inf] * 5], np.float32)
    x = _input("x", data.shape)
    expr = _row_reduce(op, x, 1)
    values = {x: jnp.asarray(data)}
    got = _whole(expr, values, chunk_elements=6)  # chunks of 2 elements per lane, merged across the row
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_reference(expr, values)))


def test_row_reduce_epilogue_reads_its_own_accumulator_and_the_kernels():
    """LayerNorm-style: mean from a RowReduce epilogue, inside an outer epilogue over the kernel's Acc."""
    x = _input("x", (4, 9))
    mean = Term("RowReduce", "sum", _load(x), 1,
                Term("Binary", "div", Term("Acc", "f32[4]"), Term("Lit", 9.0, "f32[4]"), "f32[4]"), "f32[4]")
    outer = Term("Binary", "sub", Term("Acc", "f32[4,9]"), Term("Broadcast", mean, "0", "f32[4,9]"), "f32[4,9]")
    data = jnp.asarray(np.random.default_rng(3).normal(size=(4, 9)), jnp.float32)
    got = _traced(lambda memory: compile_expr(outer)(memory, grid_index((4, 9)), True,
                                                     lambda ty, index, mask: memory.values[x][index] * 2), {x: data})
    _close(got, data * 2 - data.mean(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_reduce_at_several_axes_in_one_range():
    data = jnp.asarray(np.random.default_rng(4).normal(size=(3, 5, 7)), jnp.float32)
    (k,) = grid_index((5,))

    def body(index, mask):
        return data[index[1], index[0], index[2]]  # kept axis 1, reduced axes 0 and 2

    got = reduce_at("sum", body, (k,), True, (3, 7), value_dtype="float32", out_dtype="float32", budget=40)
    _close(got, data.sum(axis=(0, 2)), rtol=1e-5, atol=1e-5)


class _Recording(ArrayMemory):
    """`ArrayMemory` that keeps the index each load was asked for."""

    def __init__(self, values):
        super().__init__(values)
        self.indices = []

    def load(self, tensor, index, mask):
        self.indices.append(index)
        return super().load(tensor, index, mask)


def test_a_reshape_and_its_inverse_hand_the_load_the_very_same_index():
    """GroupNorm over NHWC reads `x` through `reshape(reshape(x, [N, HW, G, C/G]), [N, H, W, C])`:
    the load sees the channel entry itself (not `c // 4 * 4 + c % 4`, which Triton cannot prove
    unit-stride: every lane loaded alone and the VAE's 512² convs spilled) and the pixel entries
    themselves; a coarser regrouping (`[2, 3, 4] -> [24] -> [6, 4]`) merges runs of the entries."""
    x = _input("x", (2, 6, 5, 8))
    grouped = Term("Reshape", Term("Unary", "exp", _load(x), x.ty), "f32[2,30,4,2]")
    expr = Term("Reshape", Term("Unary", "neg", grouped, grouped.ty), x.ty)
    index = grid_index((2, 6, 5, 8))
    memory = _Recording({x: jnp.arange(480, dtype=jnp.float32).reshape(2, 6, 5, 8) / 100})
    got = compile_expr(expr)(memory, index)
    [seen] = memory.indices
    assert all(a is b for a, b in zip(seen, index)), "the round trip rebuilt the index"
    _close(got, _reference(expr, memory.values))

    y = _input("y", (6, 4))
    merged = Term("Reshape", Term("Reshape", _load(y), "f32[24]"), "f32[2,3,4]")
    index = grid_index((2, 3, 4))
    memory = _Recording({y: jnp.arange(24, dtype=jnp.float32).reshape(6, 4)})
    got = compile_expr(merged)(memory, index)
    [(rows, cols)] = memory.indices
    assert cols is index[2]
    np.testing.assert_array_equal(np.broadcast_to(rows, (2, 3, 4)), np.broadcast_to(index[0] * 3 + index[1], (2, 3, 4)))
    _close(got, _reference(merged, memory.values))


@st.composite
def reshape_chains(draw):
    """Chains of 2-5 reshapes (size-1 axes among them) with elementwise ops between: the round
    trips and regroupings `IndexViews` shortcuts, against the interpreter."""
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4)))
    x = _input("x", shape)
    expr = _load(x)
    for _ in range(draw(st.integers(2, 5))):
        cur = parse_type(expr.ty).shape
        new = draw(st.sampled_from(_factorizations(math.prod(cur)) + [shape]))
        if draw(st.booleans()):
            at = draw(st.integers(0, len(new)))
            new = new[:at] + (1,) + new[at:]
        expr = Term("Reshape", expr, format_type("float32", new))
        if draw(st.booleans()):
            expr = Term("Binary", "add", expr, Term("Iota", len(new) - 1, expr.ty), expr.ty)
    return expr, x, shape, draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(reshape_chains())
def test_random_reshape_chains_match_the_interpreter(case):
    expr, x, shape, seed = case
    values = {x: jnp.asarray(np.random.default_rng(seed).normal(size=shape) * 3, jnp.float32)}
    _close(_whole(expr, values), _reference(expr, values), rtol=2e-6, atol=2e-6)

