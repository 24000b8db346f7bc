"""The emitted stages of a cached plan are kept as serialized StableHLO (`emit.exported`): a new
optimized function with the same plan calls them instead of tracing its kernels again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from driver import cache as plan_cache
from emit.exported import ExportCacheWarning


def mlp(params, x):
    h = x @ params["w1"] + params["b1"]
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    h = jax.nn.gelu((h - mean) * jax.lax.rsqrt(var + 1e-5))
    return h @ params["w2"]


def arguments(rows=24, width=40):
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((width, 48)), jnp.float32),
              "b1": jnp.asarray(1e3 + rng.standard_normal(48), jnp.float32),  # an offset large against the spread
              "w2": jnp.asarray(rng.standard_normal((48, 8)), jnp.float32)}
    return params, jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)


def run_fresh(args, **options):
    """A new optimized function (as in a new process: its own lowerings and executables)."""
    optimized = eqsat.optimize(mlp, backend="pallas", params_argnums=0, **options)
    out = optimized(*args)
    return out, optimized.lower(*args).executable("pallas", None)


def test_a_second_function_reads_the_exported_stages(fresh_plan_cache):
    args = arguments()
    expected = jax.jit(mlp)(*args)
    out, first = run_fresh(args)
    stages = 1 + bool(first.split.prepared_tensors)  # the per-call stage, and the prepare stage if any
    assert (first.exported.exports, first.exported.hits) == (stages, 0)
    assert "per_call" in {p.name.split("-")[0] for p in plan_cache.exported_dir().glob("*.bin")}
    again, second = run_fresh(args)
    assert (second.exported.exports, second.exported.hits) == (0, stages)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-4)
    np.testing.assert_array_equal(again, out)
    assert plan_cache.info()["exported"] == stages


def test_another_shape_is_another_entry(fresh_plan_cache):
    _, first = run_fresh(arguments())
    out, run = run_fresh(arguments(rows=7))
    assert run.exported.exports == first.exported.exports >= 1
    assert plan_cache.info()["exported"] == 2 * first.exported.exports
    np.testing.assert_allclose(out, jax.jit(mlp)(*arguments(rows=7)), rtol=2e-5, atol=2e-4)


def test_a_corrupt_entry_warns_and_is_exported_again(fresh_plan_cache):
    args = arguments()
    reference, _ = run_fresh(args)
    for path in plan_cache.exported_dir().glob("*.bin"):
        path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.warns(ExportCacheWarning, match="unreadable entry"):
        out, run = run_fresh(args)
    assert run.exported.exports >= 1
    np.testing.assert_array_equal(out, reference)
    _, healed = run_fresh(args)
    assert healed.exported.hits == run.exported.exports


def test_no_export_without_the_plan_cache(fresh_plan_cache):
    out, run = run_fresh(arguments(), cache=False)
    assert run.exported is None and not plan_cache.exported_dir().exists()
    np.testing.assert_allclose(out, jax.jit(mlp)(*arguments()), rtol=2e-5, atol=2e-4)


def test_traced_calls_trace_the_plan(fresh_plan_cache):
    """Under the user's own transformations the stages are traced as before (an exported call has no
    batching or differentiation rule)."""
    args = arguments()
    optimized = eqsat.optimize(mlp, backend="pallas", params_argnums=0)
    batched = jax.vmap(lambda x: optimized(args[0], x))(jnp.stack([args[1], args[1] * 2]))
    expected = jax.vmap(lambda x: mlp(args[0], x))(jnp.stack([args[1], args[1] * 2]))
    np.testing.assert_allclose(batched, expected, rtol=2e-5, atol=5e-4)
    assert not plan_cache.exported_dir().exists()


def with_callback(params, x):
    h = mlp(params, x)
    return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(h.shape, h.dtype), h)


def test_a_stage_that_does_not_serialize_runs_as_before(fresh_plan_cache):
    args = arguments()
    optimized = eqsat.optimize(with_callback, backend="pallas", params_argnums=0)
    with pytest.warns(UserWarning):  # the callback stays an opaque XLA op, with its warning
        out = optimized(*args)
    run = optimized.lower(*args).executable("pallas", None)
    assert "per_call" in " ".join(run.exported.failures)
    assert run.exported.exports == bool(run.split.prepared_tensors)  # the prepare stage has no callback
    np.testing.assert_allclose(out, 2 * jax.jit(mlp)(*args), rtol=2e-5, atol=5e-4)


def test_numpy_weights_go_through_the_exported_stages(fresh_plan_cache):
    params, x = arguments()
    numpy_params = {name: np.asarray(value) for name, value in params.items()}
    out, first = run_fresh((numpy_params, np.asarray(x)))
    again, second = run_fresh((numpy_params, np.asarray(x)))
    assert first.exported.exports >= 1 and second.exported.hits == first.exported.exports
    np.testing.assert_array_equal(again, out)
    np.testing.assert_allclose(out, jax.jit(mlp)(params, x), rtol=2e-5, atol=2e-4)


# --- JAX's persistent compilation cache, which eqsat turns on for the stages' executables ----------


@pytest.fixture
def jax_cache_state():
    """JAX's compilation cache settings as they were before the test (they are process-wide), every
    compile written (the test's stages compile in well under JAX's 1 s default), and the
    persistent cache's hits counted."""
    from jax.experimental.compilation_cache import compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
              plan_cache._jax_cache_set_by_eqsat)
    hits = []

    def listener(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.monitoring.register_event_listener(listener)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listener)
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        plan_cache._jax_cache_set_by_eqsat = before[2]
        compilation_cache.reset_cache()


def xla_fresh(args, **options):
    optimized = eqsat.optimize(mlp, backend="xla", params_argnums=0, **options)
    out = optimized(*args)
    return out, optimized.lower(*args).executable("xla", None)


def test_a_second_function_loads_the_stages_executables(fresh_plan_cache, jax_cache_state, monkeypatch):
    monkeypatch.delenv(plan_cache.JAX_CACHE_SWITCH, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    args = arguments()
    out, first = xla_fresh(args)
    stages = 1 + bool(first.split.prepared_tensors)
    assert first.exported.exports == stages  # the XLA backend's stages are exported too
    assert jax.config.jax_compilation_cache_dir == str(plan_cache.jax_cache_dir())
    assert plan_cache.info()["executables"] >= stages
    hits_before = len(jax_cache_state)
    again, second = xla_fresh(args)
    assert second.exported.hits == stages
    assert len(jax_cache_state) - hits_before >= stages  # each stage's executable read, not compiled
    np.testing.assert_array_equal(again, out)
    np.testing.assert_allclose(out, jax.jit(mlp)(*args), rtol=2e-5, atol=2e-4)
    assert plan_cache.clear() == 1 and not plan_cache.jax_cache_dir().exists()


def test_the_users_own_jax_cache_is_left_alone(fresh_plan_cache, jax_cache_state, tmp_path, monkeypatch):
    monkeypatch.delenv(plan_cache.JAX_CACHE_SWITCH, raising=False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    xla_fresh(arguments())
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert not plan_cache.jax_cache_dir().exists() and any((tmp_path / "mine").iterdir())


@pytest.mark.parametrize("switch", ["0", "off"])
def test_opting_out_leaves_jax_cache_off(fresh_plan_cache, jax_cache_state, monkeypatch, switch):
    monkeypatch.setenv(plan_cache.JAX_CACHE_SWITCH, switch)
    jax.config.update("jax_compilation_cache_dir", None)
    out, run = xla_fresh(arguments())
    assert jax.config.jax_compilation_cache_dir is None and not plan_cache.jax_cache_dir().exists()
    assert run.exported.exports >= 1  # the exported stages do not depend on it
    np.testing.assert_allclose(out, jax.jit(mlp)(*arguments()), rtol=2e-5, atol=2e-4)


def test_jax_cache_follows_a_moved_eqsat_cache(jax_cache_state, tmp_path, monkeypatch):
    monkeypatch.delenv(plan_cache.JAX_CACHE_SWITCH, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    for name in ("one", "two"):
        monkeypatch.setenv("EQSAT_CACHE_DIR", str(tmp_path / name))
        xla_fresh(arguments())
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / name / "jax")
        assert plan_cache.info()["executables"] >= 1
