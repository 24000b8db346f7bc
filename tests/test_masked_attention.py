"""Masked (biased) attention is one `Attention` kernel: softmax(q·kᵀ·scale + bias)·v with the additive
score bias (CLIP's causal mask) read per score tile, so neither QKᵀ nor softmax·V is a matmul kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import eqsat
from sd15.clip import causal_bias
from sd15.workloads import workloads


def _causal_attention(q, k, v):
    """Plain JAX: [B, H, S, D] operands, scores plus CLIP's [1, 1, S, S] causal mask."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale + causal_bias(q.shape[2])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def test_causal_attention_is_one_attention_kernel():
    rng = np.random.default_rng(0)
    args = tuple(rng.standard_normal((2, 3, 9, 8)).astype(np.float32) for _ in range(3))
    lowered = eqsat.optimize(_causal_attention, progress=False).lower(*args)
    kinds = lowered.plan.kinds()
    assert kinds.get("attention") == 1, kinds
    assert not kinds.get("matmul"), kinds
    np.testing.assert_allclose(np.asarray(lowered(*args)), np.asarray(_causal_attention(*args)), rtol=1e-4, atol=1e-4)


def test_clip_text_encoder_attention_kernels():
    workload = workloads(components=("text_encoder",))["text_encoder"]
    lowered = eqsat.optimize(workload.fn, progress=False).lower(*workload.args)
    assert lowered.plan.kinds().get("attention") == 12, lowered.plan.kinds()  # one per encoder layer


def test_the_attention_family_adds_nothing_to_a_feed_forward_block():
    """A plain matmul has no batch axis and is not scores: with every rule family, a LayerNorm + GEGLU
    feed-forward block saturates to the e-graph and plan it has without the attention family (taking
    each plain matmul for scores once grew the UNet's e-graph by 968 e-nodes and its plan by 5
    kernels, the GEGLU projection split in two)."""
    from eqsat import rules

    def feed_forward(x, scale, w1, b1, w2):
        centered = x - x.mean(-1, keepdims=True)
        normed = centered * jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + 1e-5) * scale
        value, gate = jnp.split(normed @ w1 + b1, 2, axis=-1)
        return (value * jax.nn.gelu(gate, approximate=False)) @ w2

    args = [jax.ShapeDtypeStruct(shape, jnp.float16)
            for shape in ((2, 77, 40), (40,), (40, 320), (320,), (160, 40))]
    families = [name for name in rules.FAMILIES if name != "attention"]
    every = eqsat.optimize(feed_forward, cache=False, progress=False).lower(*args).stats
    without = eqsat.optimize(feed_forward, rulesets=families, cache=False, progress=False).lower(*args).stats
    assert every["e_nodes"] == without["e_nodes"], (every["e_nodes"], without["e_nodes"])
    assert every["fused_kernels"] == without["fused_kernels"]
