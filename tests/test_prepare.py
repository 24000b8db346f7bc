"""Weights prepared once (`eqsat.optimize(params_argnums=...)`, `emit.prepare`): the kernels that read
only parameters run in a prepare stage cached by identity of the parameter leaves; the per-call
executable reads the prepared tensors and computes nothing from parameters alone."""

from __future__ import annotations

import functools
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import eqsat
from emit.prepare import split_plan
from eqsat.term import Term
from test_fuzz import programs
from test_xla_kernel_cache import mlp, mlp_args

D, N, T = 24, 40, 9  # model width, head width (a multiple of 8 but not of 16), tokens


def attention(params, x):
    """Q, K and V over the same input: the planner fuses them into one matmul over concat(wq, wk, wv)."""
    q = x @ params["wq"]
    k = x @ params["wk"]
    v = x @ params["wv"]
    return jax.nn.softmax(q @ k.T / np.sqrt(N), axis=-1) @ v


def make_params(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal((D, N)) * scale / np.sqrt(D), jnp.float32)
            for name in ("wq", "wk", "wv")}


def make_x(seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, D)), jnp.float32)


@functools.cache
def optimized_attention():
    """One lowering shared by the tests (the executables differ per backend, the plan does not)."""
    fast = eqsat.optimize(attention, params_argnums=0, progress=False)
    return fast, fast.lower(make_params(), make_x())


@pytest.fixture
def lowered():
    return optimized_attention()


def own_expressions(term) -> list:
    """The Expr nodes of a kernel term (not entering the tensors it loads)."""
    nodes, stack, seen = [], [c for c in term.children if c.sort == "Expr"], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(c for c in node.children if c.sort == "Expr")
    return nodes


def loaded_concat_of_parameters(term, parameters) -> bool:
    """Whether the kernel `term` concatenates loads of parameters (the QKV weights) in an operand."""
    for node in own_expressions(term):
        if node.op == "Concat":
            loads = [n for n in own_expressions(Term("Pointwise", node, node.ty)) if n.op == "Load"]
            if loads and all(n.args[0].op == "Input" and n.args[0].args[0] in parameters for n in loads):
                return True
    return False


def pallas_call_names(closed_jaxpr) -> set[str]:
    names, stack = set(), [closed_jaxpr.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.add(eqn.params["name"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if hasattr(sub, "eqns"):  # a Jaxpr
                        stack.append(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                        stack.append(sub.jaxpr)
    return names


def test_fused_qkv_weight_concat_is_a_prepared_kernel(lowered):
    _, low = lowered
    split = low.split
    assert split is not None and len(split.parameters) == 3
    assert [k.kind for k in split.prepared.kernels] == ["pointwise"]
    concat = split.prepared.kernels[0]
    assert loaded_concat_of_parameters(concat.term, split.parameters)
    assert concat.term.ty == f"f32[{D},{3 * N}]"
    # The per-call plan: the same kernels as the unsplit plan, none reading only parameters (or
    # prepared tensors), none concatenating parameters in an operand.
    assert len(split.per_call.kernels) == len(low.plan.kernels) == low.stats["per_call_kernels"]
    prepared = set(split.prepared_tensors)
    for kernel in split.per_call.kernels:
        assert not all((t.op == "Input" and t.args[0] in split.parameters) or t.op == "Constant" or t in prepared
                       for t in kernel.inputs), kernel
        assert not loaded_concat_of_parameters(kernel.term, split.parameters)
    wide = [k for k in split.per_call.kernels if concat.term in k.inputs]
    assert len(wide) == 1 and wide[0].op == "Matmul"
    stats = low.stats
    assert (stats["prepared_kernels"], stats["hoisted_kernels"], stats["parameters"]) == (1, 1, 3)
    assert stats["prepared_bytes"] == D * 3 * N * 4
    report = low.report()
    assert "1 prepared once per set of parameters" in report and "per call:" in report


@pytest.mark.parametrize("backend", ["xla", "pallas", "interpret"])
def test_prepared_once_per_set_of_parameters(lowered, backend):
    fast, low = lowered
    params, x = make_params(), make_x()
    want = jax.jit(attention)(params, x)
    run = low.executable(backend)
    assert run.prepare_runs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no template falls back to XLA
        got = [low.executable(backend)(params, x) for _ in range(3)]
    for value in got:
        np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert (run.prepare_runs, run.cache_hits) == (1, 2)

    again = run(dict(params), make_x(2))  # a new dict holding the same arrays: the same weights
    np.testing.assert_allclose(np.asarray(again), np.asarray(jax.jit(attention)(params, make_x(2))), rtol=2e-5,
                               atol=2e-6)
    assert run.prepare_runs == 1

    changed = dict(params, wk=params["wk"] * -2.0)
    got = run(changed, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(attention)(changed, x)), rtol=2e-5, atol=2e-6)
    assert run.prepare_runs == 2
    run(params, x)  # back to the first weights: one entry is kept, so they are prepared again
    assert run.prepare_runs == 3


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_per_call_executable_computes_nothing_from_parameters_alone(lowered, backend):
    _, low = lowered
    run = low.executable(backend)
    params, x = make_params(), make_x()
    env = low.program.environment(params, x)
    per_call = jax.make_jaxpr(run._per_call_stage)([env[n] for n in run.split.per_call_inputs],
                                                    run.prepare(params, x))
    prepare = jax.make_jaxpr(run._prepare_stage)([env[n] for n in run.split.prepare_inputs])
    if backend == "xla":
        assert "concatenate" not in str(per_call) and "concatenate" in str(prepare)
    else:
        from emit import kernel_calls

        assert pallas_call_names(per_call) == {call.name for call in kernel_calls(run.split.per_call)}
        assert pallas_call_names(prepare) == {call.name for call in kernel_calls(run.split.prepared)}
        assert all(name.endswith(":pointwise") or name == "pointwise" for name in pallas_call_names(prepare))
    # The parameters the prepare stage consumed are not even passed to the per-call stage.
    assert not set(run.split.prepare_inputs) & set(run.split.per_call_inputs)


def test_prepared_tensors_are_dropped_with_their_parameters(lowered):
    _, low = lowered
    run = low.executable("xla")
    params = make_params(seed=5)
    run(params, make_x())
    assert run._entry is not None
    del params
    gc.collect()
    assert run._entry is None


def test_under_jit_and_grad_nothing_is_cached(lowered):
    fast, low = lowered
    params, x = make_params(), make_x()
    run = low.executable("xla")
    before = run.prepare_runs
    np.testing.assert_allclose(np.asarray(jax.jit(fast)(params, x)), np.asarray(jax.jit(attention)(params, x)),
                               rtol=2e-5, atol=2e-6)

    def loss(f):
        return lambda p: jnp.sum(f(p, x) ** 2)

    got = jax.grad(loss(fast))(params)
    want = jax.grad(loss(attention))(params)
    for name in params:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-4, atol=1e-5)
    assert run.prepare_runs == before


def test_concrete_parameters_inside_a_differentiated_call_are_not_kept():
    """Differentiated in its input only, a call prepares concrete parameters inside the planned
    backward's trace: those prepared values are that trace's and must not serve the next call (an
    UnexpectedTracerError before). The next concrete call prepares them again and is right."""
    params, x = mlp_args()
    fast = eqsat.optimize(mlp, params_argnums=0, backend="xla", progress=False)
    want = jax.jit(mlp)(params, x)
    np.testing.assert_allclose(np.asarray(jax.jit(fast)(params, x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda x: jnp.sum(fast(params, x) ** 2))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(lambda x: jnp.sum(mlp(params, x) ** 2))(x)),
                               rtol=1e-4, atol=1e-4)
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(fast(params, x)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_whole_parameter_only_kernel_is_prepared():
    def low_rank(params, x):
        return jnp.tanh(x @ (params["a"] @ params["b"]))

    rng = np.random.default_rng(3)
    params = {"a": jnp.asarray(rng.standard_normal((D, 5)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((5, N)), jnp.float32)}
    fast = eqsat.optimize(low_rank, params_argnames="params", progress=False)
    low = fast.lower(params=params, x=make_x())
    assert [k.op for k in low.split.prepared.kernels] == ["Matmul"] and low.stats["hoisted_kernels"] == 0
    assert low.stats["per_call_kernels"] == 1
    got = fast(params=params, x=make_x())
    np.testing.assert_allclose(np.asarray(got), np.asarray(low_rank(params, make_x())), rtol=1e-5, atol=1e-5)
    assert low.executable().prepare_runs == 1


def test_a_broadcast_bias_stays_in_the_epilogue():
    """Preparing `b` broadcast to [T, N] would store more than it reads: nothing is prepared."""

    def dense(params, x):
        return jax.nn.gelu(x @ params["w"] + params["b"])

    rng = np.random.default_rng(4)
    params = {"w": jnp.asarray(rng.standard_normal((D, N)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((N,)), jnp.float32)}
    low = eqsat.optimize(dense, params_argnums=0, progress=False).lower(params, make_x())
    assert low.stats["prepared_kernels"] == 0 and low.stats["per_call_kernels"] == low.stats["fused_kernels"]


def test_effects_on_parameters_run_at_every_call():
    seen = []

    def logged(params, x):
        jax.debug.callback(lambda total: seen.append(float(total)), jnp.sum(params["w"] * 2.0))
        return x @ params["w"]

    params = {"w": jnp.asarray(np.random.default_rng(6).standard_normal((D, N)), jnp.float32)}
    fast = eqsat.optimize(logged, params_argnums=0, backend="xla", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the callback lifts as an opaque kernel, with a warning saying so
        for _ in range(2):
            fast(params, make_x())
    split = fast.lower(params, make_x()).split
    assert not [k for k in split.prepared.kernels if k.op == "Opaque"]  # it reads only a parameter, yet runs per call
    assert len(seen) == 2 and seen[0] == pytest.approx(float(jnp.sum(params["w"] * 2.0)), rel=1e-5)


def test_parameters_cannot_be_static_or_donated():
    with pytest.raises(ValueError, match="marked as parameters and static"):
        eqsat.optimize(attention, params_argnums=0, static_argnums=0)
    with pytest.raises(ValueError, match="marked as parameters and donated"):
        eqsat.optimize(attention, params_argnames="params", donate_argnums=0)
    with pytest.raises(ValueError, match="params_argnames"):
        eqsat.optimize(attention, params_argnames="weights")


def test_split_plan_names_unknown_parameters(lowered):
    _, low = lowered
    with pytest.raises(ValueError, match="not inputs of the plan's program"):
        split_plan(low.plan, ["arg0", "no_such_input"])


def test_without_parameters_nothing_changes(lowered):
    fast = eqsat.optimize(attention, progress=False)
    low = fast.lower(make_params(), make_x())
    assert low.split is None and low.stats["prepared_kernels"] == 0
    assert low.stats["per_call_kernels"] == low.stats["fused_kernels"]
    assert type(low.executable("xla")).__name__ == "Emitted"


ADVERSARIAL = st.sampled_from([0.0, 1.0, -1.0, 1e-30, 1e30, 3e38, np.nan, np.inf, -np.inf, 1e4 + 1e-3])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), value=ADVERSARIAL, where=st.sampled_from(["wq", "wk", "wv", "x"]),
       offset=st.sampled_from([0.0, 1e3, -5e3]))
def test_prepared_concat_equals_jit_on_adversarial_values(seed, value, where, offset):
    """Weights with an offset large against their spread, a constant, huge, tiny or non-finite
    entry: the prepared concatenation gives what jax.jit gives (NaN where it gives NaN)."""
    _, low = optimized_attention()
    rng = np.random.default_rng(seed)
    params = {k: np.array(v) + np.float32(offset) for k, v in make_params(seed).items()}
    x = np.array(make_x(seed + 1))
    target = x if where == "x" else params[where]
    target[tuple(rng.integers(0, s) for s in target.shape)] = value
    params = {k: jnp.asarray(v) for k, v in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = np.asarray(low.executable("xla")(params, jnp.asarray(x)))
        want = np.asarray(jax.jit(attention)(params, jnp.asarray(x)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want[finite]).max(
        initial=0.0)))


@settings(max_examples=8, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(programs())
def test_random_programs_split_at_their_parameters(case):
    """Random programs (tests/test_fuzz.py's grammar) with `z` and `w` marked as parameters: what
    depends only on them is prepared, the per-call kernels each read a per-call value, and the
    results equal jax.jit's, again with new parameters."""
    fn, (x, z, w), steps = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saturation limits
        fast = eqsat.optimize(fn, params_argnums=(1, 2), backend="xla", time_limit=20.0, progress=False)
        split = fast.lower(x, z, w).split
    prepared = set(split.prepared_tensors)
    event(f"{len(split.prepared.kernels)} prepared kernels")
    for kernel in split.per_call.kernels:
        assert any(t.op == "Input" and t.args[0] not in split.parameters or
                   (t.op not in ("Input", "Constant") and t not in prepared) for t in kernel.inputs), (steps, kernel)
    with jax.default_matmul_precision("highest"):
        for params in ((z, w), (z * -1.5, w + 0.25)):
            got, want = fast(x, *params), jax.jit(fn)(x, *params)
            for g, v in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=2e-4, atol=2e-4, err_msg=str(steps))
        assert fast.lowerings[0].executable().prepare_runs == (2 if prepared else 0)
