"""Whole programs through lift + the default schedule: the fused plans the rules are for exist.

Each test finds the plan with the fewest kernels in the saturated e-graph (`rules.min_kernel_plan`,
an exact ILP on these small graphs), checks it against the function with the interpreter, and
checks its shape:

- FuncTs' Normalize written with a JAX ref (swap channels 0 and 2 in place, then
  (dup - mean) * scale) is ONE kernel;
- a fori_loop doing b[i] = b[i] + 1 through a ref and through `.at[i].set` leaves no opaque op and
  no write kernel: the loop body's results are pure elementwise kernels;
- a ResNet block and a transformer block (the sd15 code) have plans without standalone pointwise,
  permute or concat kernels: only convolutions, matmuls, reductions (and attention).
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from eqsat import rules
from eqsat.egraph import Builder
from eqsat.interpret import evaluate
from eqsat.lift import lift
from eqsat.saturate import saturate

HEAVY = frozenset({"Conv", "Matmul", "Reduce", "Attention"})


def _fused(fn, *args, tolerance=1e-4, forbid=()):
    """Lift, saturate with the default schedule, and return (naive program, fewest-kernel plan)
    (without ops in `forbid`)."""
    program = lift(fn, *args)
    builder = Builder()
    handles = builder.add(program.outputs)
    report = saturate(builder.egraph, program=program, time_limit=60.0)
    assert report.saturated, report.summary()
    graph = rules.SerializedGraph(builder.egraph._serialize().to_json())
    plan = rules.min_kernel_plan(graph, [graph.handle_class[h] for h in handles], forbid=forbid)
    assert plan is not None
    env = {f"arg{i}": leaf for i, leaf in enumerate(jax.tree.leaves(args))}
    with jax.default_matmul_precision("highest"):
        expected = jax.tree.leaves(fn(*jax.tree.map(jnp.asarray, args)))
        for got, want in zip(evaluate(plan, env, program.constants, program.payloads), expected):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tolerance, atol=tolerance)
    return program, plan


def _kinds(plan) -> Counter:
    return Counter(term.op for term in rules.kernel_terms(plan))


# --- FuncTs: Normalize with in-place channel swaps -------------------------------------------------------


def normalize(x, mean, scale):
    """torchvision-style BGR -> RGB by in-place swaps through a ref, then (dup - mean) * scale."""
    r = jax.new_ref(x)
    first = r[:, 0]
    r[:, 0] = r[:, 2]
    r[:, 2] = first
    dup = jax.freeze(r)
    return (dup - mean) * scale


def test_normalize_with_ref_writes_is_one_kernel():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5), np.float32)
    mean = rng.standard_normal((1, 3, 1, 1), np.float32)
    scale = rng.standard_normal((1, 3, 1, 1), np.float32)
    program, plan = _fused(normalize, x, mean, scale)
    assert program.naive_kernel_count() >= 5
    assert sum(_kinds(plan).values()) == 1, rules.format_terms(plan)
    assert _kinds(plan) == Counter({"Pointwise": 1})


# --- writes carried through loops ----------------------------------------------------------------------------


def increment_through_ref(b):
    r = jax.new_ref(b)

    def body(i, carry):
        r[i] = r[i] + 1.0
        return carry

    lax.fori_loop(0, b.shape[0], body, 0)
    return jax.freeze(r)


def increment_through_at_set(b):
    return lax.fori_loop(0, b.shape[0], lambda i, b: b.at[i].set(b[i] + 1.0), b)


@pytest.mark.parametrize("fn", [increment_through_ref, increment_through_at_set])
def test_loop_writes_become_pure_kernels(fn):
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    writes = ("Opaque", "AssignStatic", "AssignDynamic", "AssignScatter")
    program, plan = _fused(fn, b, forbid=writes)
    naive = Counter(term.op for term in program.kernel_terms())
    assert naive["AssignDynamic"] + naive["AssignScatter"] == 1
    kinds = _kinds(plan)
    assert not set(writes) & set(kinds), rules.format_terms(plan)
    assert kinds["Loop"] == 1


# --- SD 1.5 blocks -------------------------------------------------------------------------------------------


def _parameters(shapes: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {key: (0.3 * rng.standard_normal(shape)).astype(np.float32) for key, shape in shapes.items()}


def test_resnet_block_has_no_standalone_elementwise_kernels():
    from sd15.layers import resnet_block

    c, co, t, groups = 8, 16, 12, 4
    params = _parameters({
        "r.norm1.weight": (c,), "r.norm1.bias": (c,), "r.conv1.weight": (co, c, 3, 3), "r.conv1.bias": (co,),
        "r.time_emb_proj.weight": (co, t), "r.time_emb_proj.bias": (co,),
        "r.norm2.weight": (co,), "r.norm2.bias": (co,), "r.conv2.weight": (co, co, 3, 3), "r.conv2.bias": (co,),
        "r.conv_shortcut.weight": (co, c, 1, 1), "r.conv_shortcut.bias": (co,),
    })
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 6, c), np.float32)
    temb = rng.standard_normal((2, t), np.float32)
    program, plan = _fused(lambda p, x, t: resnet_block(p, "r", x, t, groups, 1e-5), params, x, temb)
    kinds = _kinds(plan)
    assert set(kinds) <= HEAVY, rules.format_terms(plan)
    assert sum(kinds.values()) <= 6 < program.naive_kernel_count()


def test_transformer_block_has_no_standalone_elementwise_kernels():
    from sd15.unet import transformer_block

    c, heads, s, s2, dc = 8, 2, 6, 5, 12
    params = _parameters({
        "b.norm1.weight": (c,), "b.norm1.bias": (c,), "b.norm2.weight": (c,), "b.norm2.bias": (c,),
        "b.norm3.weight": (c,), "b.norm3.bias": (c,),
        "b.attn1.to_q.weight": (c, c), "b.attn1.to_k.weight": (c, c), "b.attn1.to_v.weight": (c, c),
        "b.attn1.to_out.0.weight": (c, c), "b.attn1.to_out.0.bias": (c,),
        "b.attn2.to_q.weight": (c, c), "b.attn2.to_k.weight": (c, dc), "b.attn2.to_v.weight": (c, dc),
        "b.attn2.to_out.0.weight": (c, c), "b.attn2.to_out.0.bias": (c,),
        "b.ff.net.0.proj.weight": (8 * c, c), "b.ff.net.0.proj.bias": (8 * c,),
        "b.ff.net.2.weight": (c, 4 * c), "b.ff.net.2.bias": (c,),
    })
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, s, c), np.float32)
    context = rng.standard_normal((2, s2, dc), np.float32)
    program, plan = _fused(lambda p, x, ctx: transformer_block(p, "b", x, ctx, heads), params, x, context,
                           tolerance=1e-3)
    kinds = _kinds(plan)
    assert set(kinds) <= HEAVY, rules.format_terms(plan)
    assert sum(kinds.values()) < program.naive_kernel_count() // 3
