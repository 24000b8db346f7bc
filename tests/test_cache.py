"""The plan cache (`driver.cache`): hits, misses, invalidation, damaged entries, concurrent writers.

Every test plans into its own empty folder (`conftest.fresh_plan_cache`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqsat
from driver import cache
from driver.cache import PlanCacheWarning

ROOT = Path(__file__).resolve().parent.parent


def block(x, w, b, r):
    return jax.nn.gelu(x @ w + b) + r


def other_block(x, w, b, r):
    return jax.nn.silu(x @ w + b) + r


def specs(m=24, k=40, n=77, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct(s, dtype) for s in [(m, k), (k, n), (n,), (m, n)]]


def arrays(m=24, k=40, n=77, seed=0):
    rng = np.random.default_rng(seed)
    # Adversarial: a large offset against a small spread, a constant row, zeros.
    x = (1e3 + rng.standard_normal((m, k))).astype(np.float32)
    x[1] = 7.0
    w = (rng.standard_normal((k, n)) / k).astype(np.float32)
    b = np.zeros(n, np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    return [jnp.asarray(a) for a in (x, w, b, r)]


def lower(fn, args, **options):
    return eqsat.optimize(fn, progress=False, **options).lower(*args)


def entries(folder: Path) -> list[Path]:
    return sorted((folder / "plans").glob("*.json"))


def test_miss_then_hit_same_plan(fresh_plan_cache):
    first = lower(block, specs())
    assert first.stats["cache"] == "miss"
    assert len(entries(fresh_plan_cache)) == 1
    second = lower(block, specs())
    assert second.stats["cache"] == "hit"
    assert second.stats["cache_key"] == first.stats["cache_key"]
    assert set(second.stats["seconds"]) == {"lift"}  # build, saturate, extract skipped
    assert second.plan.to_dict() == first.plan.to_dict()
    assert "plan from the plan cache" in second.report()
    for name in ("e_nodes", "e_classes", "iterations", "saturated", "extractor"):
        assert second.stats[name] == first.stats[name]


def test_hit_builds_the_egraph_side_on_first_use():
    lower(block, specs())
    hit = lower(block, specs())
    assert hit._replan is not None
    assert hit.extraction.extractor == hit.stats["extractor"]  # built now, by the skipped stages
    assert hit._replan is None and hit.egraph is not None and hit.builder.handles
    assert hit.saturation.e_nodes == hit.stats["e_nodes"]


def test_second_process_hits(fresh_plan_cache):
    script = (
        "import jax, jax.numpy as jnp, eqsat\n"
        "def block(x, w, b, r):\n"
        "    return jax.nn.gelu(x @ w + b) + r\n"
        "args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(24, 40), (40, 77), (77,), (24, 77)]]\n"
        "lowered = eqsat.optimize(block, progress=False).lower(*args)\n"
        "import sys\n"
        "print('CACHE', lowered.stats['cache'], sorted(lowered.stats['seconds']), 'scipy.optimize' in sys.modules)\n"
    )
    env = {**os.environ, "EQSAT_CACHE_DIR": str(fresh_plan_cache), "PYTHONPATH": str(ROOT),
           "JAX_PLATFORMS": "cpu"}
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append([line for line in done.stdout.splitlines() if line.startswith("CACHE")][0])
    assert outputs[0].startswith("CACHE miss")
    assert outputs[1] == "CACHE hit ['lift'] False"  # nor imported scipy (the ILP extractor's, seconds)


@pytest.mark.parametrize("change", ["function", "shape", "dtype", "rules", "option", "version", "source", "device"])
def test_invalidation(change, monkeypatch):
    base = lower(block, specs())
    fn, args, options = block, specs(), {}
    if change == "function":
        fn = other_block
    elif change == "shape":
        args = specs(n=78)
    elif change == "dtype":
        args = specs(dtype=jnp.float16)
    elif change == "rules":
        options = {"rulesets": ["view_folding", "absorb"]}
    elif change == "option":
        options = {"node_limit": 100_000}
    elif change == "device":
        options = {"device": "a100"}
    elif change == "version":
        monkeypatch.setattr(cache, "eqsat_version", lambda: "99.0")
    elif change == "source":
        monkeypatch.setattr(cache, "source_digest", lambda: "another source")
    changed = lower(fn, args, **options)
    assert changed.stats["cache"] == "miss"
    assert changed.stats["cache_key"] != base.stats["cache_key"]
    assert lower(fn, args, **options).stats["cache"] == "hit"


def test_scope_names_are_in_the_key():
    def scoped(x, w, b, r):
        with jax.named_scope("encoder.layers.0"):
            return block(x, w, b, r)

    base = lower(block, specs())
    renamed = lower(scoped, specs())
    assert renamed.stats["cache"] == "miss" and renamed.stats["cache_key"] != base.stats["cache_key"]


def test_closed_over_constants_are_in_the_key():
    table = {}
    for value in (1.0, 2.0):
        constant = np.full((24, 77), value, np.float32)
        table[value] = lower(lambda x, w, b, r, c=constant: block(x, w, b, r) * c, specs()).stats
    assert table[2.0]["cache"] == "miss"
    assert table[1.0]["cache_key"] != table[2.0]["cache_key"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "format", "empty", "bad reference"])
def test_damaged_entry_warns_once_and_is_rewritten(damage, fresh_plan_cache):
    lower(block, specs())
    (path,) = entries(fresh_plan_cache)
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "empty":
        path.write_text("")
    elif damage == "format":
        data = json.loads(text)
        data["format"] = cache.FORMAT + 1
        path.write_text(json.dumps(data))
    else:
        data = json.loads(text)
        data["nodes"][-1][1] = 10**6  # a term argument pointing nowhere
        path.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = lower(block, specs())
    said = [w for w in caught if issubclass(w.category, PlanCacheWarning)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert str(path) in str(said[0].message)
    assert again.stats["cache"] == "miss"
    assert json.loads(path.read_text())["format"] == cache.FORMAT  # rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanCacheWarning)
        assert lower(block, specs()).stats["cache"] == "hit"


def test_concurrent_writers_leave_a_valid_entry(fresh_plan_cache):
    first = lower(block, specs())
    key = first.stats["cache_key"]
    entry = cache.load(key)
    errors, loaded = [], []

    def write():
        try:
            for _ in range(30):
                cache.store(entry)
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    def read():
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanCacheWarning)  # a torn entry would warn
            try:
                for _ in range(60):
                    loaded.append(cache.load(key))
            except Exception as error:  # noqa: BLE001
                errors.append(error)

    threads = [threading.Thread(target=write) for _ in range(3)] + [threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(e is not None and e.nodes == entry.nodes for e in loaded)
    assert [p.name for p in (fresh_plan_cache / "plans").iterdir()] == [f"{key}.json"]  # no temporary files left
    assert lower(block, specs()).stats["cache"] == "hit"


def test_cache_false_neither_reads_nor_writes(fresh_plan_cache):
    off = lower(block, specs(), cache=False)
    assert off.stats["cache"] == "off" and not entries(fresh_plan_cache)
    lower(block, specs())
    assert lower(block, specs(), cache=False).stats["cache"] == "off"
    assert "extract" in lower(block, specs(), cache=False).stats["seconds"]


def test_cache_dir_rules(monkeypatch, tmp_path):
    monkeypatch.delenv("EQSAT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "eqsat"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "eqsat"
    monkeypatch.setenv("EQSAT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"


def test_info_and_clear_command(fresh_plan_cache):
    lower(block, specs())
    lower(other_block, specs())
    env = {**os.environ, "EQSAT_CACHE_DIR": str(fresh_plan_cache), "PYTHONPATH": str(ROOT)}
    run = lambda command: subprocess.run([sys.executable, "-m", "driver.cache", command], env=env, cwd=ROOT,  # noqa: E731
                                         capture_output=True, text=True, check=True).stdout
    assert f"{fresh_plan_cache}: 2 plans" in run("info")
    assert "removed 2 plans" in run("clear")
    assert not entries(fresh_plan_cache)
    assert lower(block, specs()).stats["cache"] == "miss"
    assert cache.console(["cache", "info"]) == 0 and cache.console(["info"]) == 2  # the `eqsat` script


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_cached_plan_gives_the_same_outputs(backend):
    args = arrays()
    fresh = eqsat.optimize(block, backend=backend, progress=False)
    expected = fresh(*args)
    assert fresh.lowerings[0].stats["cache"] == "miss"
    cached = eqsat.optimize(block, backend=backend, progress=False)
    got = cached(*args)
    assert cached.lowerings[0].stats["cache"] == "hit"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(block)(*args)), rtol=2e-5, atol=2e-4)


def test_loops_payload_keys_are_renumbered():
    """Payload keys are unique per process (`loop17`); a hit rebinds the stored plan to the keys
    of the new lift, so the loop runs with its own payload."""

    def scanned(x, w):
        def step(carry, row):
            carry = jnp.tanh(carry @ w + row)
            return carry, carry.sum()

        return jax.lax.scan(step, x[0], x)

    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), jnp.asarray(rng.standard_normal((3, 3)),
                                                                               jnp.float32)]
    first = eqsat.optimize(scanned, backend="xla", progress=False)
    expected = first(*args)
    second = eqsat.optimize(scanned, backend="xla", progress=False)
    got = second(*args)
    lowered = second.lowerings[0]
    assert lowered.stats["cache"] == "hit"
    assert set(lowered.program.payloads) != set(first.lowerings[0].program.payloads)  # fresh keys
    used = {t.args[0] for k in lowered.plan.kernels for t in [k.term] if t.op == "Loop"}
    assert used and used <= set(lowered.program.payloads)
    for a, b, c in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected),
                       jax.tree_util.tree_leaves(jax.jit(scanned)(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


def test_prepare_split_from_a_cached_plan():
    args = arrays()
    options = dict(params_argnums=(1, 2), backend="xla", progress=False)
    first = eqsat.optimize(block, **options)
    expected = first(*args)
    second = eqsat.optimize(block, **options)
    got = second(*args)
    miss, hit = first.lowerings[0], second.lowerings[0]
    assert hit.stats["cache"] == "hit"
    assert "prepare" in hit.stats["seconds"]
    assert hit.split.per_call.to_dict() == miss.split.per_call.to_dict()
    assert hit.split.prepared.to_dict() == miss.split.prepared.to_dict()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_own_ruleset_is_not_cached(fresh_plan_cache):
    from eqsat.rules import family_ruleset
    from eqsat.schedule import Stage

    mine = Stage("mine", family_ruleset("absorb"))  # not named as its family: its content is unknown
    lowered = lower(block, specs(), rulesets=[mine])
    assert lowered.stats["cache"].startswith("uncacheable")
    assert not entries(fresh_plan_cache)
