"""A model zoo in plain JAX: layers written after the semantics of flax.linen, haiku and equinox
(none of them is installed), small models built from them, losses and training steps.

Each `Model` is a function of arrays (parameters are pytrees of arrays passed as arguments, so
nothing is a constant folded at trace time) and a seeded `make_args()` drawing its arguments.
Shapes are tiny (Pallas runs in interpret mode on a CPU: ~1 s compile per kernel) but odd where it
matters: 77 and 7 tokens, head dim 40, 3 channels per group, 12x12 MNIST-like images. Inputs are
adversarial where it matters: rows offset far from zero against a small spread (50 + 0.05 * randn;
0.5 through flax's fast variance, see below) through every normalization, constant rows, an
all-zero row, a blank image, saturated logits, an example clipped hard, integer labels and token
ids, a length mask.

The layers follow their libraries' code:

- flax.linen: `Dense` (x @ kernel + bias), `LayerNorm` and `GroupNorm` with flax's default fast
  variance (var = max(0, mean(x*x) - mean(x)^2), statistics in float32, epsilon 1e-6), `Conv`
  (NHWC/HWIO, padding SAME), `MultiHeadDotProductAttention` (DenseGeneral projections, query scaled
  by 1/sqrt(head dim), `jnp.where(mask, scores, jnp.finfo(dtype).min)` with `make_causal_mask`,
  softmax, DenseGeneral output), `Embed` (`jnp.take(table, ids, axis=0)`, `attend` = x @ table.T),
  `LSTMCell` and `GRUCell` run with `lax.scan` (the SST-2 BiLSTM and seq2seq examples).
- haiku: `Linear`, `LayerNorm` (two-pass `jnp.var`, epsilon 1e-5), `RMSNorm`, `GroupNorm`, `Conv2D`
  (NHWC, SAME), `MultiHeadAttention` (mask by `jnp.where(mask, logits, -1e30)`), `nets.MLP`.
- equinox: modules act on one example and are `vmap`ped over the batch: `Linear` (weight @ x +
  bias, weight [out, in]), `MLP` with `jax.nn.relu`, `Conv2d` (CHW/OIHW, VALID), `MaxPool2d` via
  `lax.reduce_window`, `MultiheadAttention` (per-head `vmap`, softmax computed in float32).
- losses: softmax cross-entropy as `log_softmax` and as optax's `logsumexp` form (one-hot and integer
  labels), MSE, the JAX MNIST example's `value_and_grad` + SGD step, and the JAX dp-SGD example's
  step (per-example grads by `vmap`, clipping by global norm, Gaussian noise from a key argument,
  averaging).

Flax's norms get offset rows of 50 + 0.5 * randn, not 0.05: their fast variance cancels
catastrophically there in float32 (at a spread of 0.05, jit's own variance is ~17% off, which
leaves nothing to compare); the 0.05 rows go through the two-pass norms (haiku's).

`f64_reference=False` marks a model that cannot be run in float64 with the same meaning (random
draws change with the dtype): the test's float64 allowance (see tests/test_zoo.py) is then 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    fn: Callable
    make_args: Callable[[], tuple]
    dtype: str = "float32"
    f64_reference: bool = True


# --- argument helpers -----------------------------------------------------------------------------


def _normal(rng, *shape, scale=1.0, dtype="float32"):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _linear_params(rng, fan_in, fan_out, dtype="float32", transpose=False):
    """A weight of std 1/sqrt(fan_in) (haiku's and flax's lecun-style scale) and a random bias (never
    zero, so a dropped bias is caught). `transpose`: equinox's [out, in] layout."""
    w = _normal(rng, fan_in, fan_out, scale=fan_in ** -0.5, dtype=dtype)
    b = _normal(rng, fan_out, scale=0.1, dtype=dtype)
    return {"w": w.T.copy() if transpose else w, "b": b}


def _norm_params(rng, *shape, dtype="float32"):
    return {"scale": (1.0 + 0.2 * rng.standard_normal(shape)).astype(dtype), "bias": _normal(rng, *shape, scale=0.1, dtype=dtype)}


def _dyadic(rng, shape):
    """Values k / 8 with |k| < 40: a sum of a few hundred of them (and of their squares) is exact in
    float32 in any order, so a constant row's mean is exactly its value and its variance exactly 0
    however a kernel orders its sums. (An arbitrary constant leaves x - mean a rounding residue that
    rsqrt(eps) amplifies ~300x and no two summation orders agree on: that tests the order, not the
    optimizer.)"""
    return rng.integers(-39, 40, shape) / 8.0


def _offset_rows(rng, shape, dtype="float32", spread=0.05):
    """Activations whose rows (last axis) are, in turn: 50 + spread * randn (a mean large against the
    spread), constant (zero variance), plain randn."""
    x = rng.standard_normal(shape)
    rows = x.reshape(-1, shape[-1])
    rows[0::3] = 50.0 + spread * rows[0::3]
    rows[1::3] = _dyadic(rng, (len(rows[1::3]), 1))
    return rows.reshape(shape).astype(dtype)


def _offset_images(rng, shape, dtype="float32", spread=0.05):
    """NHWC images, in turn: 50 + spread * randn, per-channel constant (groups of constant channels:
    zero variance), plain randn."""
    x = rng.standard_normal(shape)
    x[0::3] = 50.0 + spread * x[0::3]
    for i in range(1, shape[0], 3):
        x[i] = np.broadcast_to(_dyadic(rng, shape[-1]), x[i].shape)
    return x.astype(dtype)


def _one_hot(rng, batch, classes, dtype="float32"):
    return np.eye(classes, dtype=dtype)[rng.integers(0, classes, batch)]


FLAX_SPREAD = 0.5  # the spread of offset rows through flax's fast-variance norms (module docstring)


# --- flax.linen layers ----------------------------------------------------------------------------


def flax_dense(p, x):
    """nn.Dense: dot_general over x's last axis and kernel's first, plus bias."""
    y = lax.dot_general(x, p["w"], (((x.ndim - 1,), (0,)), ((), ())))
    return y + jnp.reshape(p["b"], (1,) * (y.ndim - 1) + (-1,))


def _flax_normalize(x, mean, var, p, reduction_axes, feature_shape, eps):
    y = x - mean
    mul = lax.rsqrt(var + eps)
    mul = mul * p["scale"].reshape(feature_shape)
    y = y * mul
    y = y + p["bias"].reshape(feature_shape)
    return jnp.asarray(y, x.dtype)


def _flax_fast_stats(x, axes):
    """flax.linen.normalization._compute_stats with use_fast_variance=True: float32 at least,
    mean(x*x) - mean(x)^2 clipped at 0."""
    x = jnp.asarray(x, jnp.promote_types(jnp.float32, x.dtype))
    mean = jnp.mean(x, axes, keepdims=True)
    mean2 = jnp.mean(lax.square(x), axes, keepdims=True)
    var = jnp.maximum(0.0, mean2 - lax.square(mean))
    return mean, var


def flax_layer_norm(p, x, eps=1e-6):
    mean, var = _flax_fast_stats(x, (-1,))
    return _flax_normalize(x, mean, var, p, (-1,), (1,) * (x.ndim - 1) + (x.shape[-1],), eps)


def flax_group_norm(p, x, num_groups, eps=1e-6):
    """nn.GroupNorm on NHWC: statistics over (H, W, C/G) per group, fast variance."""
    *lead, c = x.shape
    g = x.reshape(*lead, num_groups, c // num_groups)
    axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
    mean, var = _flax_fast_stats(g, axes)
    mean = jnp.repeat(mean, c // num_groups, axis=-1).reshape(*mean.shape[:-2], c)
    var = jnp.repeat(var, c // num_groups, axis=-1).reshape(*var.shape[:-2], c)
    return _flax_normalize(x, mean, var, p, None, (1,) * (x.ndim - 1) + (c,), eps)


def flax_conv(p, x):
    """nn.Conv: NHWC input, HWIO kernel, padding SAME, stride 1, plus bias."""
    y = lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["b"]


def flax_make_causal_mask(x):
    """nn.make_causal_mask: [batch, 1, L, L] booleans from arange comparisons."""
    idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    mask = jnp.greater_equal(jnp.expand_dims(idxs, -1), jnp.expand_dims(idxs, -2))
    return jnp.expand_dims(mask, -3)


def flax_mha(p, x, mask):
    """nn.MultiHeadDotProductAttention (self-attention, dropout off)."""
    def dense_general(w, b, h):  # features -> (heads, head_dim)
        return lax.dot_general(h, w, (((h.ndim - 1,), (0,)), ((), ()))) + b

    q = dense_general(p["q"]["w"], p["q"]["b"], x)
    k = dense_general(p["k"]["w"], p["k"]["b"], x)
    v = dense_general(p["v"]["w"], p["v"]["b"], x)
    dtype = q.dtype
    depth = q.shape[-1]
    q = q / jnp.sqrt(depth).astype(dtype)
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k)
    big_neg = jnp.finfo(dtype).min
    scores = jnp.where(mask, scores, big_neg)
    weights = jax.nn.softmax(scores).astype(dtype)
    y = jnp.einsum("...hqk,...khd->...qhd", weights, v)
    out = lax.dot_general(y, p["o"]["w"], (((y.ndim - 2, y.ndim - 1), (0, 1)), ((), ())))
    return out + p["o"]["b"]


def _flax_mha_params(rng, features, heads, head_dim, dtype="float32"):
    def proj():
        return {"w": _normal(rng, features, heads, head_dim, scale=features ** -0.5, dtype=dtype),
                "b": _normal(rng, heads, head_dim, scale=0.1, dtype=dtype)}

    return {"q": proj(), "k": proj(), "v": proj(),
            "o": {"w": _normal(rng, heads, head_dim, features, scale=(heads * head_dim) ** -0.5, dtype=dtype),
                  "b": _normal(rng, features, scale=0.1, dtype=dtype)}}


def flax_embed(table, ids):
    return jnp.take(table, ids, axis=0)


def flax_attend(table, x):
    """nn.Embed.attend: logits against the (tied) embedding table."""
    return jnp.dot(x, table.T)


def flax_lstm_cell(p, carry, x):
    """nn.LSTMCell: input projections without bias, hidden projections with bias; gates i, f, g, o."""
    c, h = carry

    def gate(name, act):
        return act(x @ p["i" + name] + h @ p["h" + name] + p["b" + name])

    i = gate("i", jax.nn.sigmoid)
    f = gate("f", jax.nn.sigmoid)
    g = gate("g", jnp.tanh)
    o = gate("o", jax.nn.sigmoid)
    new_c = f * c + i * g
    new_h = o * jnp.tanh(new_c)
    return (new_c, new_h), new_h


def _lstm_params(rng, features, hidden):
    p = {}
    for name in "ifgo":
        p["i" + name] = _normal(rng, features, hidden, scale=features ** -0.5)
        p["h" + name] = _normal(rng, hidden, hidden, scale=hidden ** -0.5)
        p["b" + name] = _normal(rng, hidden, scale=0.1)
    return p


def flax_gru_cell(p, h, x):
    """nn.GRUCell: r, z from input (no bias) and hidden (bias) projections; n = tanh(W_in x + b_in
    + r * (W_hn h + b_hn)); h' = (1 - z) * n + z * h."""
    r = jax.nn.sigmoid(x @ p["ir"] + h @ p["hr"] + p["br"])
    z = jax.nn.sigmoid(x @ p["iz"] + h @ p["hz"] + p["bz"])
    n = jnp.tanh(x @ p["in"] + p["bin"] + r * (h @ p["hn"] + p["bhn"]))
    new_h = (1.0 - z) * n + z * h
    return new_h, new_h


def _gru_params(rng, features, hidden):
    p = {}
    for name in ("r", "z", "n"):
        p["i" + name] = _normal(rng, features, hidden, scale=features ** -0.5)
        p["h" + name] = _normal(rng, hidden, hidden, scale=hidden ** -0.5)
    for name in ("br", "bz", "bin", "bhn"):
        p[name] = _normal(rng, hidden, scale=0.1)
    return p


# --- haiku layers ---------------------------------------------------------------------------------


def hk_linear(p, x):
    return jnp.dot(x, p["w"]) + p["b"]


def hk_layer_norm(p, x, eps=1e-5):
    """hk.LayerNorm(axis=-1, create_scale=True, create_offset=True): two-pass jnp.var."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    inv = p["scale"] * lax.rsqrt(variance + eps)
    return inv * (x - mean) + p["bias"]


def hk_rms_norm(p, x, eps=1e-5):
    mean_squared = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * p["scale"] * lax.rsqrt(mean_squared + eps)


def hk_group_norm(p, x, groups, eps=1e-5):
    """hk.GroupNorm on NHWC: jnp.mean / jnp.var over (H, W, C/G)."""
    *lead, c = x.shape
    g = x.reshape(*lead, groups, c // groups)
    axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
    mean = jnp.mean(g, axes, keepdims=True)
    var = jnp.var(g, axes, keepdims=True)
    g = (g - mean) * lax.rsqrt(var + eps)
    return g.reshape(x.shape) * p["scale"] + p["bias"]


def hk_conv2d(p, x):
    return lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]


def hk_mlp(layers, x, activation=jax.nn.relu):
    """hk.nets.MLP: activation between layers, none after the last."""
    for i, p in enumerate(layers):
        x = hk_linear(p, x)
        if i < len(layers) - 1:
            x = activation(x)
    return x


def hk_mha(p, x, mask, heads, key_size):
    """hk.MultiHeadAttention (self-attention)."""
    *lead, t, _ = x.shape

    def project(q):
        return hk_linear(q, x).reshape(*lead, t, heads, key_size)

    q, k, v = project(p["q"]), project(p["k"]), project(p["v"])
    logits = jnp.einsum("...thd,...Thd->...htT", q, k)
    logits = logits / np.sqrt(key_size).astype(k.dtype)
    logits = jnp.where(mask, logits, -1e30)
    weights = jax.nn.softmax(logits)
    attn = jnp.einsum("...htT,...Thd->...thd", weights, v)
    return hk_linear(p["o"], attn.reshape(*lead, t, heads * key_size))


# --- equinox layers (one example; vmapped over the batch) -----------------------------------------


def eqx_linear(p, x):
    return p["w"] @ x + p["b"]


def eqx_mlp(layers, x):
    """eqx.nn.MLP(activation=jax.nn.relu), final_activation identity."""
    for p in layers[:-1]:
        x = jax.nn.relu(eqx_linear(p, x))
    return eqx_linear(layers[-1], x)


def eqx_conv2d(p, x):
    """eqx.nn.Conv2d on one CHW image: VALID, OIHW weight, bias [O, 1, 1]."""
    y = lax.conv_general_dilated(x[None], p["w"], (1, 1), "VALID")[0]
    return y + p["b"]


def eqx_max_pool2d(x, window=2, stride=2):
    """eqx.nn.MaxPool2d via lax.reduce_window with init -inf, on one CHW image."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, window, window), (1, stride, stride), "VALID")


def eqx_mha(p, x, mask, heads):
    """eqx.nn.MultiheadAttention (self-attention): projections vmapped over the sequence, heads by
    vmap over the head axis, softmax in float32 cast back."""
    seq, _ = x.shape

    def project(q):
        return jax.vmap(lambda r: eqx_linear(q, r))(x).reshape(seq, heads, -1)

    q, k, v = project(p["q"]), project(p["k"]), project(p["v"])

    def head(q, k, v):
        q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        logits = jnp.einsum("sd,Sd->sS", q, k)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)

    attn = jax.vmap(head, in_axes=1, out_axes=1)(q, k, v).reshape(seq, -1)
    return jax.vmap(lambda r: eqx_linear(p["o"], r))(attn)


# --- models: flax-style ---------------------------------------------------------------------------


def flax_dense_layernorm(params, x):
    """Dense -> LayerNorm (fast variance) -> gelu -> Dense."""
    h = flax_dense(params["d1"], x)
    h = flax_layer_norm(params["ln"], h)
    return flax_dense(params["d2"], jax.nn.gelu(h))


def _flax_dense_layernorm_args(dtype):
    def make():
        rng = np.random.default_rng(1)
        params = {"d1": _linear_params(rng, 24, 40, dtype), "ln": _norm_params(rng, 40, dtype=dtype),
                  "d2": _linear_params(rng, 40, 10, dtype)}
        # The first Dense's bias is a constant offset (50; 4 in float16, whose ulp at 50 is 1/32):
        # rows of x scaled by FLAX_SPREAD come out as offset + a small spread, zero rows as
        # constant rows (the bias only), the others as offset + randn.
        params["d1"]["b"] = np.full(40, 50.0 if dtype == "float32" else 4.0, dtype)
        x = rng.standard_normal((48, 24))  # 16 offset rows: jit's largest error is a stable statistic
        x[0::3] *= FLAX_SPREAD
        x[1::3] = 0.0
        return params, x.astype(dtype)

    return make


def flax_layernorm_offset(params, x):
    """LayerNorm (fast variance) straight on offset rows (50 + 0.5 randn, constant rows), then Dense."""
    return flax_dense(params["d"], flax_layer_norm(params["ln"], x))


def _flax_layernorm_offset_args():
    rng = np.random.default_rng(2)
    return {"ln": _norm_params(rng, 33), "d": _linear_params(rng, 33, 8)}, _offset_rows(rng, (4, 12, 33), spread=FLAX_SPREAD)


def flax_conv_groupnorm(params, x):
    """Conv (SAME) -> GroupNorm (fast variance, 3 channels per group) -> swish -> Conv."""
    h = flax_conv(params["c1"], x)
    h = flax_group_norm(params["gn"], h, num_groups=2)
    return flax_conv(params["c2"], jax.nn.swish(h))


def _flax_conv_groupnorm_args():
    rng = np.random.default_rng(3)
    params = {"c1": {"w": _normal(rng, 3, 3, 4, 6, scale=0.2), "b": _normal(rng, 6, scale=0.1)},
              "gn": _norm_params(rng, 6),
              "c2": {"w": _normal(rng, 3, 3, 6, 5, scale=0.15), "b": _normal(rng, 5, scale=0.1)}}
    return params, _normal(rng, 2, 6, 5, 4)


def flax_groupnorm_offset(params, x):
    """GroupNorm (fast variance, 3 groups of 3 channels) straight on offset NHWC images, then swish."""
    return jax.nn.swish(flax_group_norm(params["gn"], x, num_groups=3))


def _flax_groupnorm_offset_args():
    rng = np.random.default_rng(4)
    return {"gn": _norm_params(rng, 9)}, _offset_images(rng, (6, 5, 4, 9), spread=FLAX_SPREAD)


def flax_causal_lm(params, ids):
    """Embed -> LayerNorm -> causal MultiHeadDotProductAttention (2 heads of 40, 77 tokens) with a
    residual -> LayerNorm -> logits by Embed.attend."""
    x = flax_embed(params["embed"], ids)
    mask = flax_make_causal_mask(ids)
    x = x + flax_mha(params["mha"], flax_layer_norm(params["ln1"], x), mask)
    return flax_attend(params["embed"], flax_layer_norm(params["ln2"], x))


def _flax_causal_lm_args(seq, dtype="float32"):
    def make():
        rng = np.random.default_rng(5)
        features, vocab = 80, 13
        params = {"embed": _normal(rng, vocab, features, dtype=dtype), "ln1": _norm_params(rng, features, dtype=dtype),
                  "mha": _flax_mha_params(rng, features, 2, 40, dtype), "ln2": _norm_params(rng, features, dtype=dtype)}
        return params, rng.integers(0, vocab, (1, seq)).astype(np.int32)

    return make


def flax_bilstm_classifier(params, ids, lengths):
    """The SST-2 example's shape: Embed -> BiLSTM by lax.scan over time (a padded step keeps its
    carry), last states concatenated -> Dense -> log_softmax."""
    x = jnp.swapaxes(flax_embed(params["embed"], ids), 0, 1)  # [time, batch, features]
    batch, hidden = ids.shape[0], params["fwd"]["hi"].shape[0]
    t = jnp.arange(ids.shape[1])
    zeros = jnp.zeros((batch, hidden), x.dtype)

    def run(p, reverse):
        def step(carry, inputs):
            xt, tt = inputs
            new_carry, _ = flax_lstm_cell(p, carry, xt)
            valid = (tt < lengths)[:, None]
            carry = tuple(jnp.where(valid, n, o) for n, o in zip(new_carry, carry))
            return carry, carry[1]

        (c, h), _ = lax.scan(step, (zeros, zeros), (x, t), reverse=reverse)
        return h

    h = jnp.concatenate([run(params["fwd"], False), run(params["bwd"], True)], axis=-1)
    return jax.nn.log_softmax(flax_dense(params["out"], h))


def _flax_bilstm_args():
    rng = np.random.default_rng(6)
    params = {"embed": _normal(rng, 11, 8), "fwd": _lstm_params(rng, 8, 6), "bwd": _lstm_params(rng, 8, 6),
              "out": _linear_params(rng, 12, 2)}
    return params, rng.integers(0, 11, (3, 7)).astype(np.int32), np.array([7, 4, 1], np.int32)


def flax_gru_seq2seq(params, src, tgt_in):
    """The seq2seq example's shape with GRU cells: an encoder scan, a decoder scan from the encoder's
    last state with teacher forcing, Dense logits per step, log_softmax."""
    enc_x = jnp.swapaxes(flax_embed(params["embed"], src), 0, 1)
    dec_x = jnp.swapaxes(flax_embed(params["embed"], tgt_in), 0, 1)
    h0 = jnp.zeros((src.shape[0], params["enc"]["hr"].shape[0]), enc_x.dtype)
    h, _ = lax.scan(lambda h, x: flax_gru_cell(params["enc"], h, x), h0, enc_x)
    _, hs = lax.scan(lambda h, x: flax_gru_cell(params["dec"], h, x), h, dec_x)
    logits = flax_dense(params["out"], jnp.swapaxes(hs, 0, 1))
    return jax.nn.log_softmax(logits)


def _flax_gru_seq2seq_args():
    rng = np.random.default_rng(7)
    params = {"embed": _normal(rng, 9, 6), "enc": _gru_params(rng, 6, 10), "dec": _gru_params(rng, 6, 10),
              "out": _linear_params(rng, 10, 9)}
    return params, rng.integers(0, 9, (2, 5)).astype(np.int32), rng.integers(0, 9, (2, 3)).astype(np.int32)


# --- models: haiku-style --------------------------------------------------------------------------


def hk_layernorm_mlp(params, x):
    """LayerNorm on offset rows -> MLP (relu) -> LayerNorm."""
    h = hk_layer_norm(params["ln_in"], x)
    h = hk_mlp(params["mlp"], h)
    return hk_layer_norm(params["ln_out"], h)


def _hk_layernorm_mlp_args():
    rng = np.random.default_rng(8)
    params = {"ln_in": _norm_params(rng, 33),
              "mlp": [_linear_params(rng, 33, 24), _linear_params(rng, 24, 24), _linear_params(rng, 24, 10)],
              "ln_out": _norm_params(rng, 10)}
    return params, _offset_rows(rng, (48, 33))  # 16 offset rows: jit's largest error is a stable statistic


def hk_transformer_block(params, x):
    """Pre-LN block: x + MHA(LN(x)) (causal), then h + MLP(LN(h)) with GELU (tanh form)."""
    t = x.shape[-2]
    mask = jnp.tril(jnp.ones((t, t), bool))
    h = x + hk_mha(params["mha"], hk_layer_norm(params["ln1"], x), mask, heads=2, key_size=16)
    return h + hk_mlp(params["mlp"], hk_layer_norm(params["ln2"], h), activation=jax.nn.gelu)


def _hk_transformer_block_args(dtype):
    def make():
        rng = np.random.default_rng(9)
        d = 32
        params = {"ln1": _norm_params(rng, d, dtype=dtype), "ln2": _norm_params(rng, d, dtype=dtype),
                  "mha": {n: _linear_params(rng, d, d, dtype) for n in "qkvo"},
                  "mlp": [_linear_params(rng, d, 4 * d, dtype), _linear_params(rng, 4 * d, d, dtype)]}
        if dtype == "float32":
            x = _offset_rows(rng, (2, 7, d))
        else:  # float16's ulp at 50 is 1/32, its mean's rounding alone 4% of a 0.05 spread: 4 + randn
            x = _offset_rows(rng, (2, 7, d), spread=1.0)
            x = np.where(x > 40, x - 46.0, x)
        return params, x.astype(dtype)

    return make


def hk_rmsnorm_linear(params, x):
    """RMSNorm -> Linear -> RMSNorm (offset rows and constant rows)."""
    return hk_rms_norm(params["n2"], hk_linear(params["lin"], hk_rms_norm(params["n1"], x)))


def _hk_rmsnorm_args():
    rng = np.random.default_rng(10)
    params = {"n1": {"scale": _norm_params(rng, 21)["scale"]}, "lin": _linear_params(rng, 21, 15),
              "n2": {"scale": _norm_params(rng, 15)["scale"]}}
    x = _offset_rows(rng, (10, 21))
    x[-1] = 0.0  # an all-zero row: rsqrt(eps)
    return params, x


def hk_resnet_block(params, x):
    """GroupNorm + SiLU + Conv3x3, GroupNorm + SiLU + Conv3x3, plus a 1x1 conv shortcut (6 -> 9
    channels, 3 channels per group)."""
    h = hk_conv2d(params["c1"], jax.nn.silu(hk_group_norm(params["gn1"], x, groups=2)))
    h = hk_conv2d(params["c2"], jax.nn.silu(hk_group_norm(params["gn2"], h, groups=3)))
    return h + hk_conv2d(params["skip"], x)


def _hk_resnet_block_args():
    rng = np.random.default_rng(11)
    params = {"gn1": _norm_params(rng, 6), "c1": {"w": _normal(rng, 3, 3, 6, 9, scale=0.15), "b": _normal(rng, 9, scale=0.1)},
              "gn2": _norm_params(rng, 9), "c2": {"w": _normal(rng, 3, 3, 9, 9, scale=0.12), "b": _normal(rng, 9, scale=0.1)},
              "skip": {"w": _normal(rng, 1, 1, 6, 9, scale=0.4), "b": _normal(rng, 9, scale=0.1)}}
    return params, _offset_images(rng, (2, 6, 5, 6))


# --- models: equinox-style ------------------------------------------------------------------------


def eqx_mlp_model(layers, x):
    return jax.vmap(lambda r: eqx_mlp(layers, r))(x)


def _eqx_mlp_args():
    rng = np.random.default_rng(12)
    layers = [_linear_params(rng, 13, 16, transpose=True), _linear_params(rng, 16, 16, transpose=True),
              _linear_params(rng, 16, 3, transpose=True)]
    return layers, _normal(rng, 5, 13)


def eqx_cnn(params, images):
    """MNIST-like 1x12x12: Conv2d(1->4, 3x3, VALID) -> MaxPool2d(2) -> relu -> Conv2d(4->6, 3x3) ->
    relu -> flatten -> Linear -> log_softmax; vmapped over the batch."""
    def one(x):
        h = jax.nn.relu(eqx_max_pool2d(eqx_conv2d(params["c1"], x)))
        h = jax.nn.relu(eqx_conv2d(params["c2"], h))
        return jax.nn.log_softmax(eqx_linear(params["lin"], h.reshape(-1)))

    return jax.vmap(one)(images)


def _eqx_cnn_args():
    rng = np.random.default_rng(13)
    params = {"c1": {"w": _normal(rng, 4, 1, 3, 3, scale=0.3), "b": _normal(rng, 4, 1, 1, scale=0.1)},
              "c2": {"w": _normal(rng, 6, 4, 3, 3, scale=0.15), "b": _normal(rng, 6, 1, 1, scale=0.1)},
              "lin": _linear_params(rng, 6 * 3 * 3, 10, transpose=True)}
    images = rng.uniform(0, 1, (3, 1, 12, 12)).astype(np.float32)
    images[1] = 0.0  # a blank image: ties in every pooling window
    return params, images


def eqx_attention(params, x):
    """eqx.nn.MultiheadAttention, 2 heads, causal mask, on one sequence per example (vmapped)."""
    seq = x.shape[-2]
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    return jax.vmap(lambda s: eqx_mha(params, s, mask, heads=2))(x)


def _eqx_attention_args(dtype):
    def make():
        rng = np.random.default_rng(14)
        params = {n: _linear_params(rng, 16, 16, dtype, transpose=True) for n in "qkvo"}
        return params, _normal(rng, 2, 7, 16, dtype=dtype)

    return make


# --- losses, gradients, training steps ------------------------------------------------------------


def ce_log_softmax_grad(params, x, labels):
    """value_and_grad of mean softmax cross-entropy (one-hot labels, log_softmax form) of a linear
    classifier."""
    def loss(p):
        logits = x @ p["w"] + p["b"]
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

    return jax.value_and_grad(loss)(params)


def ce_logsumexp_grad(params, x, labels):
    """optax.softmax_cross_entropy_with_integer_labels (logsumexp(logits) - logits[label]): loss and
    gradients w.r.t. the weights and w.r.t. the logits themselves."""
    def loss_of_logits(logits):
        label_logits = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label_logits)

    def loss(p):
        return loss_of_logits(x @ p["w"] + p["b"])

    value, grads = jax.value_and_grad(loss)(params)
    logits = x @ params["w"] + params["b"]
    return value, grads, jax.grad(loss_of_logits)(logits)


def _ce_args(integer):
    def make():
        rng = np.random.default_rng(15)
        x = _normal(rng, 6, 12)
        x[0] *= 30.0  # one example with large logits: a saturated softmax
        p = _linear_params(rng, 12, 5)
        labels = rng.integers(0, 5, 6).astype(np.int32) if integer else _one_hot(rng, 6, 5)
        return p, x, labels

    return make


def mse_grad(layers, x, y):
    """value_and_grad of the MSE of a tanh MLP w.r.t. all its layers."""
    def loss(ls):
        return jnp.mean((hk_mlp(ls, x, activation=jnp.tanh) - y) ** 2)

    return jax.value_and_grad(loss)(layers)


def _mse_args():
    rng = np.random.default_rng(16)
    layers = [_linear_params(rng, 7, 11), _linear_params(rng, 11, 3)]
    return layers, _normal(rng, 9, 7), _normal(rng, 9, 3)


def _mnist_predict(params, inputs):
    """The JAX MNIST example's predict: tanh hidden layers, log-probabilities by logsumexp."""
    activations = inputs
    for w, b in params[:-1]:
        activations = jnp.tanh(jnp.dot(activations, w) + b)
    final_w, final_b = params[-1]
    logits = jnp.dot(activations, final_w) + final_b
    return logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)


def _mnist_loss(params, batch):
    inputs, targets = batch
    return -jnp.mean(jnp.sum(_mnist_predict(params, inputs) * targets, axis=1))


def mnist_train_step(params, inputs, targets):
    """value_and_grad of the cross-entropy plus an SGD update (step size 0.1); returns the loss and
    the new parameters."""
    loss, grads = jax.value_and_grad(_mnist_loss)(params, (inputs, targets))
    return loss, [(w - 0.1 * dw, b - 0.1 * db) for (w, b), (dw, db) in zip(params, grads)]


def _mnist_params(rng, sizes):
    return [(_normal(rng, m, n, scale=m ** -0.5), _normal(rng, n, scale=0.1)) for m, n in zip(sizes[:-1], sizes[1:])]


def _mnist_args():
    rng = np.random.default_rng(17)
    return _mnist_params(rng, [144, 24, 16, 10]), rng.uniform(0, 1, (8, 144)).astype(np.float32), _one_hot(rng, 8, 10)


def dpsgd_step(params, inputs, targets, key):
    """The JAX dp-SGD example's step: per-example grads by vmap, each clipped by its global norm
    (l2_norm_clip 1.5), summed, Gaussian noise (noise_multiplier 1.1) from `key`, averaged, SGD."""
    l2_norm_clip, noise_multiplier, step_size = 1.5, 1.1, 0.25
    batch_size = inputs.shape[0]

    def clipped_grad(params, single_example_batch):
        grads = jax.grad(_mnist_loss)(params, single_example_batch)
        nonempty_grads, tree_def = jax.tree_util.tree_flatten(grads)
        total_grad_norm = jnp.linalg.norm(jnp.array([jnp.linalg.norm(g.ravel()) for g in nonempty_grads]))
        divisor = jnp.maximum(total_grad_norm / l2_norm_clip, 1.0)
        normalized = [g / divisor for g in nonempty_grads]
        return jax.tree_util.tree_unflatten(tree_def, normalized)

    batch = (inputs[:, None], targets[:, None])
    clipped = jax.vmap(clipped_grad, (None, 0))(params, batch)
    clipped_flat, tree_def = jax.tree_util.tree_flatten(clipped)
    aggregated = [g.sum(0) for g in clipped_flat]
    rngs = jax.random.split(key, len(aggregated))
    noised = [(g + l2_norm_clip * noise_multiplier * jax.random.normal(r, g.shape)) / batch_size
              for r, g in zip(rngs, aggregated)]
    grads = jax.tree_util.tree_unflatten(tree_def, noised)
    return [(w - step_size * dw, b - step_size * db) for (w, b), (dw, db) in zip(params, grads)]


def _dpsgd_args():
    rng = np.random.default_rng(18)
    inputs = rng.uniform(0, 1, (6, 20)).astype(np.float32)
    inputs[0] *= 40.0  # one example whose gradient is clipped hard
    return _mnist_params(rng, [20, 12, 10]), inputs, _one_hot(rng, 6, 10), np.asarray(jax.random.PRNGKey(0))


# --- the zoo --------------------------------------------------------------------------------------


ZOO = [
    Model("flax_dense_layernorm", flax_dense_layernorm, _flax_dense_layernorm_args("float32")),
    Model("flax_dense_layernorm_f16", flax_dense_layernorm, _flax_dense_layernorm_args("float16"), "float16"),
    Model("flax_layernorm_offset", flax_layernorm_offset, _flax_layernorm_offset_args),
    Model("flax_conv_groupnorm", flax_conv_groupnorm, _flax_conv_groupnorm_args),
    Model("flax_groupnorm_offset", flax_groupnorm_offset, _flax_groupnorm_offset_args),
    Model("flax_causal_lm_77", flax_causal_lm, _flax_causal_lm_args(77)),
    Model("flax_causal_lm_7", flax_causal_lm, _flax_causal_lm_args(7)),
    Model("flax_bilstm_classifier", flax_bilstm_classifier, _flax_bilstm_args),
    Model("flax_gru_seq2seq", flax_gru_seq2seq, _flax_gru_seq2seq_args),
    Model("hk_layernorm_mlp", hk_layernorm_mlp, _hk_layernorm_mlp_args),
    Model("hk_transformer_block", hk_transformer_block, _hk_transformer_block_args("float32")),
    Model("hk_transformer_block_f16", hk_transformer_block, _hk_transformer_block_args("float16"), "float16"),
    Model("hk_rmsnorm_linear", hk_rmsnorm_linear, _hk_rmsnorm_args),
    Model("hk_resnet_block", hk_resnet_block, _hk_resnet_block_args),
    Model("eqx_mlp", eqx_mlp_model, _eqx_mlp_args),
    Model("eqx_cnn", eqx_cnn, _eqx_cnn_args),
    Model("eqx_attention", eqx_attention, _eqx_attention_args("float32")),
    Model("eqx_attention_f16", eqx_attention, _eqx_attention_args("float16"), "float16"),
    Model("ce_log_softmax_grad", ce_log_softmax_grad, _ce_args(integer=False)),
    Model("ce_logsumexp_grad", ce_logsumexp_grad, _ce_args(integer=True)),
    Model("mse_grad", mse_grad, _mse_args),
    Model("mnist_train_step", mnist_train_step, _mnist_args),
    Model("dpsgd_step", dpsgd_step, _dpsgd_args, f64_reference=False),
]

BY_NAME = {m.name: m for m in ZOO}
