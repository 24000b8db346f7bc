"""`jax.random` through `eqsat.optimize`: typed keys (`jax.random.key`) and raw uint32 keys as
arguments, values and outputs, keys made inside, split/fold_in, dropout masks and normal noise; the
results equal `jax.jit`'s bit for bit."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqsat
from eqsat.lift import lift
from eqsat.types import format_type, parse_type, type_of


def optimized(fn, **options):
    return eqsat.optimize(fn, progress=False, **options)


def run_both(fn, *args, **options):
    """`(eqsat result, jax.jit result)`; the lift's opaque warnings are expected, not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = optimized(fn, **options)(*args)
    options.pop("backend", None)
    return ours, jax.jit(fn, **options)(*args)


def key_data(x):
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_bitwise_equal(ours, theirs):
    ours_leaves, theirs_leaves = jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)
    assert len(ours_leaves) == len(theirs_leaves)
    for a, b in zip(ours_leaves, theirs_leaves):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_array_equal(np.asarray(key_data(a)), np.asarray(key_data(b)))


def dropout(key, x, rate):
    """flax.linen.Dropout's computation."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


def layer(key, x, w):
    drop_key, noise_key = jax.random.split(key)
    h = jax.nn.gelu(x @ w)
    h = dropout(drop_key, h, 0.25)
    noise = jax.random.normal(jax.random.fold_in(noise_key, 7), h.shape, h.dtype)
    return h + 0.1 * noise, noise_key


def random_parts(key):
    drop_key, noise_key = jax.random.split(key)
    return (jax.random.bernoulli(drop_key, 0.75, (8, 16)), jax.random.normal(jax.random.fold_in(noise_key, 7), (8, 16)),
            noise_key)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((12, 16)).astype(np.float32)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_dropout_and_noise_equal_jit_bit_for_bit(make_key):
    x, w = inputs()
    ours, theirs = run_both(layer, make_key(3), x, w)
    assert_bitwise_equal(ours, theirs)
    # The reference interpreter runs op by op: its float arithmetic (gelu) may round differently
    # from jit's fusions, but the random draws themselves are the same bits.
    ours, theirs = run_both(random_parts, make_key(3), backend="interpret")
    assert_bitwise_equal(ours, theirs)
    assert not np.all(np.asarray(ours[0]) == np.asarray(run_both(layer, make_key(4), x, w)[0][0]))


def test_keys_made_inside_from_a_seed_and_key_arrays_as_outputs():
    def f(seed, x):
        key = jax.random.key(seed)
        keys = jax.random.split(key, 3)
        bits = jax.random.bits(keys[1], x.shape)
        perm = jax.random.permutation(keys[2], x.shape[0])
        return keys, bits, x[perm] * jax.random.uniform(keys[0], x.shape), jax.random.key_data(keys)

    def g(seed, x):
        raw = jax.random.PRNGKey(seed)
        wrapped = jax.random.wrap_key_data(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)))
        return raw, jax.random.split(raw), jax.random.truncated_normal(wrapped, -1.0, 1.0, x.shape) + x

    x = inputs()[0]
    for fn, seed in ((f, 11), (g, np.int32(12))):
        ours, theirs = run_both(fn, seed, x)
        assert_bitwise_equal(ours, theirs)


def test_keys_in_pytrees_scans_and_with_abstract_shapes():
    def f(state, xs):
        def step(carry, x):
            key, total = carry
            key, sub = jax.random.split(key)
            return (key, total + jax.random.normal(sub, x.shape) * x), jax.random.key_data(sub)

        (key, total), subs = lax.scan(step, (state["key"], jnp.zeros(xs.shape[1:])), xs)
        return {"key": key, "total": total}, subs

    state = {"key": jax.random.key(5)}
    xs = np.arange(12, dtype=np.float32).reshape(4, 3)
    ours, theirs = run_both(f, state, xs)
    assert_bitwise_equal(ours, theirs)
    abstract = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = optimized(f).lower({"key": abstract}, jax.ShapeDtypeStruct(xs.shape, xs.dtype))
    key_input = lowered.program.inputs[0]
    assert key_input.ty == "key<fry>[]" and parse_type(key_input.ty).itemsize == 8
    assert np.isfinite(lowered.plan.seconds) and lowered.plan.bytes > 0


def test_random_primitives_lift_and_threefry_runs():
    import jax.extend

    def f(raw, counts):
        key = jax.random.wrap_key_data(raw)
        bits = jax.random.bits(key, (4,), jnp.uint32)
        mixed = jax.extend.random.threefry_2x32(jax.random.key_data(key), counts)
        return bits ^ mixed[:4], jax.random.key_data(jax.random.key(7))

    raw = jax.random.key_data(jax.random.key(9))
    counts = np.arange(8, dtype=np.uint32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = lift(f, raw, counts)
    primitives = {t.args[0].rstrip("0123456789").rstrip("#") for t in program.kernel_terms() if t.op == "Opaque"}
    assert {"random_wrap", "random_bits", "random_unwrap", "random_seed", "threefry2x32"} <= primitives
    assert all("random_bits" not in str(w.message) or "opaque" in str(w.message) for w in caught)
    ours, theirs = run_both(f, raw, counts)
    assert_bitwise_equal(ours, theirs)


def test_key_types_have_a_representation():
    key = jax.random.key(0)
    assert type_of(key) == "key<fry>[]"
    assert type_of(jax.random.split(key, 4)) == "key<fry>[4]"
    assert format_type(key.dtype, (2, 3)) == "key<fry>[2,3]"
    parsed = parse_type("key<fry>[2,3]")
    assert parsed.shape == (2, 3) and parsed.itemsize == 8 and parsed.nbytes == 48
    rbg = jax.random.key(0, impl="rbg")
    assert type_of(rbg) == "key<rbg>[]" and parse_type(type_of(rbg)).itemsize == 16
    with pytest.raises(ValueError, match="key"):
        parse_type("key<nonsense>[2]").itemsize
