"""Attention and normalization written the ways real code writes them, and whether each fuses.

    python -m benchmarks.spellings            # the table: spelling, kernels by kind, fused or not, explain()

Each spelling is a plain-JAX function of small arguments (`SPELLINGS`: name -> `Spelling`). Fused
means: an attention spelling plans exactly one `attention` kernel and no `matmul`; a normalization
spelling plans exactly `norms` reduction kernels (one statistics pass per normalization: the
mean and the variance from one `moments` or stacked reduction) and every output is computed by
them plus elementwise kernels. flax and equinox are not installed here: their layers are written
out below exactly as their sources compute them (flax.linen 0.10 `dot_product_attention`,
`LayerNorm`, `RMSNorm`, `GroupNorm`; equinox 0.11 `LayerNorm`, `GroupNorm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BATCH, TOKENS, HEADS, HEAD_DIM = 2, 9, 2, 8


@dataclass(frozen=True)
class Spelling:
    fn: Callable
    args: Callable[[np.random.Generator], tuple]
    family: str              # "attention" | "norm"
    norms: int = 1           # statistics passes a fused normalization spelling needs


# --- attention ---------------------------------------------------------------------------------------


def _bhtd(dtype=np.float32):
    def draw(rng):
        return tuple(rng.standard_normal((BATCH, HEADS, TOKENS, HEAD_DIM)).astype(dtype) for _ in range(3))
    return draw


def _bthd(dtype=np.float32):
    def draw(rng):
        return tuple(rng.standard_normal((BATCH, TOKENS, HEADS, HEAD_DIM)).astype(dtype) for _ in range(3))
    return draw


def _causal(length):
    return jnp.tril(jnp.ones((length, length), bool))


def attention_numpy_scale(q, k, v):
    """The spelling that always fused: scale `1/np.sqrt(d)` (a Python float) on the scores."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_bthd(q, k, v):
    """Einsum layout [B, T, H, D] in and out."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def attention_runtime_sqrt(q, k, v):
    """Scale `/ jnp.sqrt(d).astype(dtype)`: a sqrt of a constant computed at run time."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_runtime_rsqrt(q, k, v):
    """Scale `* lax.rsqrt(d)` at run time."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * lax.rsqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_scaled_q(q, k, v):
    """`q * d**-0.5` before the QKᵀ matmul."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q * q.shape[-1] ** -0.5, k)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_scaled_k(q, k, v):
    """`k / sqrt(d)` before the QKᵀ matmul."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k / math.sqrt(k.shape[-1]))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_where_finfo_min(q, k, v):
    """Causal mask as flax writes it: `jnp.where(mask, s, jnp.finfo(dtype).min)`."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(_causal(q.shape[2]), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_where_inf(q, k, v):
    """Causal mask `jnp.where(mask, s, -inf)`."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(_causal(q.shape[2]), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_additive_bias(q, k, v):
    """Causal mask as an additive bias `s + where(mask, 0, -inf)`."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s + jnp.where(_causal(q.shape[2]), 0.0, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_jax_nn(q, k, v):
    """`jax.nn.dot_product_attention(implementation="xla")`, [B, T, H, D]."""
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def attention_jax_nn_causal(q, k, v):
    """`jax.nn.dot_product_attention(is_causal=True, implementation="xla")`."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def attention_gqa_repeat(q, k, v):
    """Grouped-query attention as llama ports write it: each K/V head repeated for its G query heads
    (`jnp.repeat` on the head axis), then multi-head attention on [B, T, H, D]."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _gqa(dtype=np.float32, groups=3, kv_heads=2, kv_tokens=TOKENS + 4):
    """Grouped queries: [B, T, G·K, D] q against [B, S, K, D] k and v (G = 3 query heads per K/V head)."""
    def draw(rng):
        q = rng.standard_normal((BATCH, TOKENS, groups * kv_heads, HEAD_DIM)).astype(dtype)
        k, v = (rng.standard_normal((BATCH, kv_tokens, kv_heads, HEAD_DIM)).astype(dtype) for _ in range(2))
        return q, k, v
    return draw


def flax_dot_product_attention(query, key, value, mask=None):
    """flax.linen.dot_product_attention (weights, then the value einsum), [..., T, H, D], as its source
    computes it with dtype None, no dropout, no bias."""
    dtype = query.dtype
    depth = query.shape[-1]
    query = query / jnp.sqrt(depth).astype(dtype)
    attn_weights = jnp.einsum("...qhd,...khd->...hqk", query, key)
    if mask is not None:
        big_neg = jnp.finfo(dtype).min
        attn_weights = jnp.where(mask, attn_weights, big_neg)
    attn_weights = jax.nn.softmax(attn_weights).astype(dtype)
    return jnp.einsum("...hqk,...khd->...qhd", attn_weights, value)


def attention_flax(q, k, v):
    return flax_dot_product_attention(q, k, v)


def attention_flax_causal(q, k, v):
    """flax with `nn.make_causal_mask`: a [B, 1, T, T] boolean mask."""
    mask = jnp.broadcast_to(_causal(q.shape[1])[None, None], (q.shape[0], 1, q.shape[1], q.shape[1]))
    return flax_dot_product_attention(q, k, v, mask)


def attention_equinox(q, k, v):
    """equinox.nn.MultiheadAttention's core on [T, H, D] (no batch axis): heads by `vmap`, the
    logits masked with finfo.min and soft-maxed in float32, then cast back."""
    mask = _causal(q.shape[0])

    def head(q, k, v):
        q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        logits = jnp.einsum("sd,Sd->sS", q, k)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
        return jnp.einsum("sS,Sd->sd", weights, v)

    return jax.vmap(head, in_axes=1, out_axes=1)(q, k, v)


def _thd(dtype=np.float32):
    def draw(rng):
        return tuple(rng.standard_normal((TOKENS, HEADS, HEAD_DIM)).astype(dtype) for _ in range(3))
    return draw


# --- normalization -----------------------------------------------------------------------------------


def _rows(channels=40, rows=(2, 9)):
    def draw(rng):
        x = (rng.standard_normal((*rows, channels)) * 3.0 + 5.0).astype(np.float32)
        return x, rng.standard_normal(channels).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    return draw


def _images(channels=12):
    def draw(rng):
        x = (rng.standard_normal((2, 5, 5, channels)) * 3.0 + 5.0).astype(np.float32)
        return x, rng.standard_normal(channels).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    return draw


def layer_norm_two_pass(x, scale, bias):
    """sd15's LayerNorm: mean, then the mean of the centered squares."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * lax.rsqrt(var + 1e-5) * scale + bias


def layer_norm_flax(x, scale, bias):
    """flax.linen.LayerNorm (use_fast_variance=True): var = max(0, E[x²] - E[x]²)."""
    x = jnp.asarray(x, jnp.promote_types(jnp.float32, x.dtype))
    mean = jnp.mean(x, axis=-1)
    mean2 = jnp.mean(lax.square(x), axis=-1)
    var = jnp.maximum(0.0, mean2 - lax.square(mean))
    y = x - jnp.expand_dims(mean, -1)
    mul = lax.rsqrt(jnp.expand_dims(var, -1) + 1e-6) * scale
    return y * mul + bias


def rms_norm_flax(x, scale, bias):
    """flax.linen.RMSNorm: x * rsqrt(E[x²] + eps) * scale (no bias: `bias` is unused)."""
    mean2 = jnp.mean(lax.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(mean2 + 1e-6) * scale


def layer_norm_equinox(x, scale, bias):
    """equinox.nn.LayerNorm, vmapped over the rows as equinox code does."""
    def one(row):
        mean = jnp.mean(row, keepdims=True)
        variance = jnp.maximum(0.0, jnp.var(row, keepdims=True))
        return (row - mean) * lax.rsqrt(variance + 1e-5) * scale + bias
    return jax.vmap(jax.vmap(one))(x)


def layer_norm_standardize(x, scale, bias):
    """`jax.nn.standardize` (var = E[x²] - E[x]²), then the affine."""
    return jax.nn.standardize(x, axis=-1, epsilon=1e-5) * scale + bias


def group_norm_flax(x, scale, bias, groups=4):
    """flax.linen.GroupNorm on [B, H, W, C] (use_fast_variance=True)."""
    shape = x.shape
    y = x.reshape(*shape[:-1], groups, shape[-1] // groups)
    axes = (1, 2, 4)
    mean = jnp.mean(y, axis=axes, keepdims=True)
    mean2 = jnp.mean(lax.square(y), axis=axes, keepdims=True)
    var = jnp.maximum(0.0, mean2 - lax.square(mean))
    y = ((y - mean) * lax.rsqrt(var + 1e-6)).reshape(shape)
    return y * scale + bias


def group_norm_equinox(x, scale, bias, groups=4):
    """equinox.nn.GroupNorm (channels first per example), vmapped over batch on [B, C, H, W]."""
    def one(image):
        channels = image.shape[0]
        y = image.reshape(groups, -1)
        mean = jnp.mean(y, axis=1, keepdims=True)
        variance = jnp.maximum(0.0, jnp.var(y, axis=1, keepdims=True))
        out = ((y - mean) * lax.rsqrt(variance + 1e-5)).reshape(image.shape)
        return scale.reshape(channels, 1, 1) * out + bias.reshape(channels, 1, 1)
    return jax.vmap(one)(x.transpose(0, 3, 1, 2))


SPELLINGS: dict[str, Spelling] = {
    "attention: np.sqrt scale (bhtd)": Spelling(attention_numpy_scale, _bhtd(), "attention"),
    "attention: einsum bthd": Spelling(attention_bthd, _bthd(), "attention"),
    "attention: / jnp.sqrt(d) at run time": Spelling(attention_runtime_sqrt, _bhtd(), "attention"),
    "attention: * lax.rsqrt(d) at run time": Spelling(attention_runtime_rsqrt, _bhtd(), "attention"),
    "attention: q * d**-0.5 before QK": Spelling(attention_scaled_q, _bhtd(), "attention"),
    "attention: q * d**-0.5 before QK, fp16": Spelling(attention_scaled_q, _bhtd(np.float16), "attention"),
    "attention: k / sqrt(d) before QK": Spelling(attention_scaled_k, _bhtd(), "attention"),
    "attention: where(mask, s, finfo.min)": Spelling(attention_where_finfo_min, _bhtd(), "attention"),
    "attention: where(mask, s, finfo.min), fp16": Spelling(attention_where_finfo_min, _bhtd(np.float16), "attention"),
    "attention: where(mask, s, -inf)": Spelling(attention_where_inf, _bhtd(), "attention"),
    "attention: s + additive mask bias": Spelling(attention_additive_bias, _bhtd(), "attention"),
    "attention: jax.nn.dot_product_attention": Spelling(attention_jax_nn, _bthd(), "attention"),
    "attention: jax.nn.dot_product_attention causal": Spelling(attention_jax_nn_causal, _bthd(), "attention"),
    "attention: jax.nn.dot_product_attention GQA (6 q heads, 2 kv heads)":
        Spelling(attention_jax_nn, _gqa(), "attention"),
    "attention: jax.nn.dot_product_attention GQA causal": Spelling(attention_jax_nn_causal, _gqa(kv_tokens=TOKENS),
                                                                   "attention"),
    "attention: GQA, kv heads jnp.repeat-ed": Spelling(attention_gqa_repeat, _gqa(), "attention"),
    "attention: GQA, kv heads jnp.repeat-ed, fp16": Spelling(attention_gqa_repeat, _gqa(np.float16), "attention"),
    "attention: flax dot_product_attention": Spelling(attention_flax, _bthd(), "attention"),
    "attention: flax dot_product_attention causal": Spelling(attention_flax_causal, _bthd(), "attention"),
    "attention: flax causal, fp16": Spelling(attention_flax_causal, _bthd(np.float16), "attention"),
    "attention: equinox MultiheadAttention (no batch axis)": Spelling(attention_equinox, _thd(), "attention"),
    "attention: equinox MultiheadAttention, fp16": Spelling(attention_equinox, _thd(np.float16), "attention"),
    "layernorm: two-pass (sd15)": Spelling(layer_norm_two_pass, _rows(), "norm"),
    "layernorm: flax (E[x²]-E[x]²)": Spelling(layer_norm_flax, _rows(), "norm"),
    "layernorm: equinox (vmapped jnp.var)": Spelling(layer_norm_equinox, _rows(), "norm"),
    "layernorm: jax.nn.standardize": Spelling(layer_norm_standardize, _rows(), "norm"),
    "rmsnorm: flax": Spelling(rms_norm_flax, _rows(), "norm"),
    "groupnorm: flax": Spelling(group_norm_flax, _images(), "norm"),
    "groupnorm: equinox (vmapped, CHW)": Spelling(group_norm_equinox, _images(), "norm"),
}


# --- the measurement -----------------------------------------------------------------------------------


def kernel_counts(lowered) -> dict[str, int]:
    return lowered.plan.kinds()


def statistics_passes(lowered) -> int:
    """Reduction kernels of the plan (statistics passes), hosted statistics included."""
    kinds = lowered.plan.kinds()
    return kinds.get("reduce", 0) + kinds.get("norm", 0) + lowered.plan.hosted_reductions


def is_fused(spelling: Spelling, lowered) -> bool:
    kinds = lowered.plan.kinds()
    if spelling.family == "attention":
        return kinds.get("attention") == 1 and not kinds.get("matmul")
    return statistics_passes(lowered) == spelling.norms


def measure(names=None, seed: int = 0) -> list[dict]:
    import eqsat

    rows = []
    for name, spelling in SPELLINGS.items():
        if names and name not in names:
            continue
        args = spelling.args(np.random.default_rng(seed))
        lowered = eqsat.optimize(spelling.fn, progress=False, backend="xla").lower(*args)
        rows.append({"spelling": name, "kinds": kernel_counts(lowered), "fused": is_fused(spelling, lowered),
                     "statistics_passes": statistics_passes(lowered),
                     "not_fused_because": [m.found for m in lowered.explain()]})
    return rows


def table(rows) -> str:
    lines = ["| spelling | kernels | fused | explain() |", "|---|---|---|---|"]
    for row in rows:
        kinds = ", ".join(f"{n} {kind}" for kind, n in row["kinds"].items())
        why = "; ".join(row["not_fused_because"])
        lines.append(f"| {row['spelling']} | {kinds} | {'yes' if row['fused'] else 'NO'} | {why} |")
    return "\n".join(lines)


def main() -> None:
    print(table(measure()))


if __name__ == "__main__":
    main()
