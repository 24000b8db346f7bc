"""How the matmul and conv templates read memory: operands as unit-stride runs Triton can vectorize
(`emit/pallas/contiguous.py`: the innermost axis masked, not clamped) and parameter-only operands
stored in MMA layout by the prepare stage (`emit.prepare`: a torch `[N, K]` weight prepared as
`[K, N]`, an OIHW conv weight as HWIO, each read through a `Transpose` view). In interpret mode
against the interpreter, the XLA emitter and `jax.jit` on odd shapes (77 rows, K = 40, N = 3,
3 channels per group) and adversarial values; compiled for sm_90 without a GPU, the PTX of a
matmul kernel loads vectors and pipelines its MMA, a conv's weight streams through cp.async."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

import eqsat
from emit.expr import ArrayMemory, compile_expr, grid_index
from emit.pallas import XlaFallbackWarning
from emit.pallas import triton as tr
from emit.pallas.contiguous import ContiguousMemory, inner_axis
from emit.pallas.matmul import zero_where_masked
from measure import xla_target
from eqsat.types import parse_type
from sd15.params import transformer_block_shapes
from test_emit_expr import view_chains

needs_h100_target = pytest.mark.skipif(xla_target.unavailable_reason() is not None,
                                       reason=str(xla_target.unavailable_reason()))


# --- ContiguousMemory reads what the tensor holds -------------------------------------------------


def _padded_tile(shape):
    """Every index of `shape` padded to powers of two per axis (lanes past the end), and the mask."""
    padded = tuple(tr.next_pow2(s) for s in shape)
    index = grid_index(padded)
    mask = True
    for entry, size in zip(index, shape):
        mask = (entry < size) & mask
    return padded, index, mask


def _in_kernel(expr, values: dict):
    """`expr` at a padded tile of its type through `ContiguousMemory`, in an interpreted kernel."""
    shape = parse_type(expr.ty).shape
    padded, _, _ = _padded_tile(shape)
    tensors = list(values)
    fn = compile_expr(expr)

    def kernel(*refs):
        *inputs, out_ref = refs
        _, index, mask = _padded_tile(shape)
        value = fn(ContiguousMemory(dict(zip(tensors, inputs))), index, mask)
        tr.store(out_ref, pl.ds(0, math.prod(padded)), jnp.reshape(jnp.broadcast_to(value, padded), (-1,)))

    out_shape = jax.ShapeDtypeStruct(padded, jnp.dtype(parse_type(expr.ty).dtype))
    return tr.pallas_call(kernel, [values[t] for t in tensors], [out_shape], grid=(1,), name="views",
                          interpret=True)[0]


@settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(view_chains())
def test_contiguous_loads_read_what_clamped_gathers_read(case):
    """Random view chains (transpose, reshape, broadcast, strided slice, concat, pad, elementwise)
    at a tile padded past every edge: where the mask holds, the value the array memory gives; where
    it does not and the expression is a view of loads, zero (what lets the template skip its select)."""
    expr, x, shape, extras, seed = case
    rng = np.random.default_rng(seed)
    values = {x: jnp.asarray(rng.normal(size=shape) * 3, jnp.float32)}
    for term, other_shape in extras.items():
        values[term] = jnp.asarray(rng.normal(size=other_shape), jnp.float32)
    out_shape = parse_type(expr.ty).shape
    got = np.asarray(_in_kernel(expr, values))
    want = np.asarray(jax.jit(lambda arrays: compile_expr(expr)(ArrayMemory(dict(zip(values, arrays))),
                                                                grid_index(out_shape)))(list(values.values())))
    inside = got[tuple(slice(0, s) for s in out_shape)]
    np.testing.assert_allclose(inside, want, rtol=2e-6, atol=2e-6)
    if zero_where_masked(expr):
        outside = np.ones(got.shape, bool)
        outside[tuple(slice(0, s) for s in out_shape)] = False
        assert not np.any(got[outside]), "a masked lane of a view of loads is not zero"


@pytest.mark.parametrize("bound", [77 * 3 + 16, 2**31 - 16])  # headroom for the masked lanes' shift, or none
def test_masked_store_writes_live_lanes_only(bound):
    """A [16 columns, 128 rows] tile stored into a 77 x 3 output: a masked column lane's offset is
    a live lane's of the next row (and comes after it in the tile); only the live lanes land (the
    select fallback without headroom)."""
    from emit.pallas.contiguous import masked_store

    rows, cols = jnp.arange(128)[:, None], jnp.arange(16)[None, :]

    def kernel(out_ref):
        tr.store(out_ref, pl.ds(0, 77 * 3), jnp.full((77 * 3,), -1.0, jnp.float32))
        c = jax.lax.broadcasted_iota(jnp.int32, (16, 1), 0)
        r = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
        masked_store(out_ref, r * 3 + c, (r * 100 + c).astype(jnp.float32), (r < 77) & (c < 3), bound=bound)

    [out] = tr.pallas_call(kernel, [], [jax.ShapeDtypeStruct((77, 3), jnp.float32)], grid=(1,), name="store",
                           interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray((rows * 100 + cols)[:77, :3], np.float32))


def test_the_inner_axis_is_the_last_longer_than_one():
    assert inner_axis((4, 40)) == 1 and inner_axis((4, 40, 1)) == 1 and inner_axis((1, 1)) is None


# --- plans: weights prepared in MMA layout, emitted in interpret mode -------------------------------


def layer_norm(x, eps=1e-5):
    y = x.astype(jnp.float32)
    mean = y.mean(-1, keepdims=True)
    centered = y - mean
    return (centered * jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def linear(x, w, b=None):
    """torch `nn.Linear`: w stored [out, in]."""
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
    return y if b is None else y + b


def fused_qkv(params, x):
    """LayerNorm (affine) prologue, Q/K/V of 3 outputs each over one input: one wide matmul."""
    h = layer_norm(x) * params["g"] + params["beta"]
    return linear(h, params["wq"], params["bq"]), linear(h, params["wk"]), linear(h, params["wv"])


def geglu_residual(params, x):
    """GEGLU feed-forward (value * gelu(gate) as the second matmul's prologue), residual epilogue."""
    value, gate = jnp.split(linear(x, params["w0"], params["b0"]), 2, axis=-1)
    return x + linear(value * jax.nn.gelu(gate, approximate=False), params["w2"], params["b2"])


def batched_weights(params, x):
    """A weight per batch entry, torch layout ([batch, N, K], contracted on K)."""
    return jnp.einsum("bsk,bnk->bsn", x, params["w"]) + params["b"][:, None, :]


def transformer_block(params, x, context):
    """SD 1.5's BasicTransformerBlock (torch-layout weights): Q/K/V of attn1 and K/V of attn2 fuse
    into wide matmuls over weight concatenations, which the prepare stage stores as [K, 3N]."""
    from sd15.unet import transformer_block as block

    return block(params, "b", x, context, 2)


def _block_params(width=40, context_width=24):
    shapes = dict(transformer_block_shapes("b", width, context_width))
    return shapes


M, K, N = 77, 40, 3
MODELS = {
    "fused_qkv": (fused_qkv, {"g": (K,), "beta": (K,), "wq": (N, K), "bq": (N,), "wk": (N, K), "wv": (N, K)},
                  (M, K)),
    "geglu_residual": (geglu_residual, {"w0": (2 * 24, K), "b0": (2 * 24,), "w2": (K, 24), "b2": (K,)}, (M, K)),
    "batched_weights": (batched_weights, {"w": (2, N, K), "b": (2, N)}, (2, M, K)),
}


@functools.cache
def lowered(name: str, dtype: str):
    fn, params, x = MODELS[name]
    spec = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extraction limits
        return eqsat.optimize(fn, params_argnums=0, progress=False).lower(spec, jax.ShapeDtypeStruct(x, dtype))


def _matmul_weights(split):
    """(rhs expression, stored shape) of each per-call matmul whose weight the prepare stage made."""
    prepared = set(split.prepared_tensors)
    found = []
    for kernel in split.per_call.kernels:
        if kernel.op != "Matmul":
            continue
        rhs = kernel.term.args[1]
        loads = [node for node in _expr_nodes(rhs) if node.op == "Load"]
        if loads and all(node.args[0] in prepared for node in loads):
            found.append((kernel.term, rhs, parse_type(loads[0].args[0].ty).shape))
    return found


def _prepared_weights(weights):
    return [next(node.args[0] for node in _expr_nodes(rhs) if node.op == "Load") for _, rhs, _ in weights]


def _expr_nodes(expr):
    from emit.expr import expr_nodes

    return list(expr_nodes(expr))


@functools.cache
def lowered_block(dtype: str):
    params = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in _block_params().items()}
    args = (params, jax.ShapeDtypeStruct((2, M, 40), dtype), jax.ShapeDtypeStruct((2, 10, 24), dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(transformer_block, params_argnums=0, progress=False).lower(*args)


@settings(max_examples=3, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(["float32", "float16"]), seed=st.integers(0, 2**31 - 1),
       offset=st.sampled_from([0.0, 300.0]))
def test_fused_qkv_of_a_transformer_block_is_prepared_as_k_by_3n(dtype, seed, offset):
    """The fused Q/K/V weight concatenation is one prepared [K, 3N] tensor the wide matmul reads
    through a Transpose view; the block (77 tokens, heads of 20, LayerNorm rows at an offset) through
    the Pallas templates equals the XLA emitter and jax.jit."""
    low = lowered_block(dtype)
    split = low.split
    stored = [shape for _, _, shape in _matmul_weights(split)]
    assert (40, 3 * 40) in stored and (24, 2 * 40) in stored, stored  # attn1's Q/K/V, attn2's K/V
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.standard_normal(s) * (0.2 if k.endswith("weight") and "norm" not in k else 1.0),
                             dtype) for k, s in _block_params().items()}
    offset = offset if dtype == "float32" else 0.0  # fp16 at 300 keeps a quarter of a unit: no spread left
    x = jnp.asarray(offset + rng.standard_normal((2, M, 40)), dtype)
    context = jnp.asarray(rng.standard_normal((2, 10, 24)), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = low.executable("pallas", interpret=True)(params, x, context)
    _close(pallas - x, low.executable("xla")(params, x, context) - x, dtype)  # the block's part, not the residual
    _close(pallas - x, jax.jit(transformer_block)(params, x, context) - x, dtype)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_layout_weights_are_prepared_as_k_by_n(name):
    """Every per-call matmul reads its weight from a prepared `[..., K, N]` tensor through a
    Transpose view; the prepare stage made it once (the fused QKV's concatenation included)."""
    from emit.pallas.matmul import DotAxes

    split = lowered(name, "float32").split
    weights = _matmul_weights(split)
    matmuls = [k for k in split.per_call.kernels if k.op == "Matmul"]
    assert matmuls and len(weights) == len(matmuls), weights  # every weight of these models is a parameter
    for term, rhs, stored in weights:
        lhs, _, dims, _, _ = term.args
        axes = DotAxes.of(dims, parse_type(lhs.ty).shape, parse_type(rhs.ty).shape)
        assert rhs.op == "Transpose" and rhs.args[0].op == "Load"
        assert stored == (*axes.batch_shape, *axes.k_shape, *axes.n_shape), (stored, axes)
    assert all(k.op == "Pointwise" for k in split.prepared.kernels)
    assert len(split.prepared.kernels) == len({stored_term for stored_term in _prepared_weights(weights)})


def _values(name: str, dtype, seed: int, offset: float, spread: float, special: str):
    fn, params, x = MODELS[name]
    rng = np.random.default_rng(seed)
    values = {k: (rng.standard_normal(s) * (0.5 if k.startswith("w") else 1.0)).astype(np.float32)
              for k, s in params.items()}
    inputs = (offset + spread * rng.standard_normal(x)).astype(np.float32)
    rows = inputs.reshape(-1, inputs.shape[-1])
    rows[::7] = rng.standard_normal((len(rows[::7]), rows.shape[1]))  # some ordinary rows beside the offset ones
    if special == "constant_rows":
        rows[1::5] = offset
    elif special == "zeros":
        rows[2::3] = 0.0
    elif special == "zero_weight":
        first = next(k for k in values if k.startswith("w"))
        values[first][..., 0, :] = 0.0
    return {k: jnp.asarray(v, dtype) for k, v in values.items()}, jnp.asarray(inputs, dtype)


def _close(got, want, dtype):
    tol = 3e-2 if dtype == "float16" else 2e-4
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = w[np.isfinite(w)]
        scale = max(1.0, float(finite.std())) if finite.size else 1.0  # the spread, not an offset
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


@settings(max_examples=10, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(MODELS)), dtype=st.sampled_from(["float32", "float16"]),
       seed=st.integers(0, 2**31 - 1), offset=st.sampled_from([0.0, 300.0, -40.0]),
       spread=st.sampled_from([1.0, 0.05]), special=st.sampled_from(["none", "constant_rows", "zeros", "zero_weight"]))
def test_prepared_layouts_match_the_xla_emitter_and_jit(name, dtype, seed, offset, spread, special):
    """The split plan through the Pallas templates (interpreted) equals the XLA emitter's and
    jax.jit's: LayerNorm rows at an offset large against their spread, constant rows, zero rows."""
    fn, _, _ = MODELS[name]
    low = lowered(name, dtype)
    params, x = _values(name, dtype, seed, offset, spread, special)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)  # no template falls back to XLA
        pallas = low.executable("pallas", interpret=True)(params, x)
    xla = low.executable("xla")(params, x)
    want = jax.jit(fn)(params, x)
    _close(pallas, xla, dtype)
    _close(pallas, want, dtype)


# --- conv weights: OIHW prepared as HWIO, K ranges kept -----------------------------------------------


def resnet(params, x, temb):
    from sd15.layers import resnet_block

    return resnet_block(params, "r", x, temb, groups=3, eps=1e-5)


RESNET = {"norm1.weight": (6,), "norm1.bias": (6,), "conv1.weight": (9, 6, 3, 3), "conv1.bias": (9,),
          "time_emb_proj.weight": (9, 8), "time_emb_proj.bias": (9,), "norm2.weight": (9,), "norm2.bias": (9,),
          "conv2.weight": (9, 9, 3, 3), "conv2.bias": (9,), "conv_shortcut.weight": (9, 6, 1, 1),
          "conv_shortcut.bias": (9,)}


@functools.cache
def lowered_resnet(dtype: str):
    params = {f"r.{k}": jax.ShapeDtypeStruct(s, dtype) for k, s in RESNET.items()}
    args = (params, jax.ShapeDtypeStruct((2, 5, 7, 6), dtype), jax.ShapeDtypeStruct((2, 8), dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eqsat.optimize(resnet, params_argnums=0, progress=False, extract_time_limit=5.0).lower(*args)


def test_conv_weights_are_prepared_hwio_and_keep_their_k_ranges():
    """Each conv reads every weight it multiplies from a prepared [kh, kw, in, out] copy; a merged
    1x1 shortcut stays a K range over the centre tap (its zero taps are still skipped)."""
    from emit.pallas.conv import k_ranges
    from eqsat.conv_params import ConvParams

    split = lowered_resnet("float32").split
    prepared = set(split.prepared_tensors)
    convs = [k.term for k in split.per_call.kernels if k.op == "Conv"]
    assert len(convs) == 2
    shortcut_ranges = 0
    for term in convs:
        params = ConvParams.parse(term.args[2])
        order = (*params.rhs_spec[2:], params.rhs_spec[1], params.rhs_spec[0])
        for part in k_ranges(term):
            loads = [node for node in _expr_nodes(part.rhs) if node.op == "Load"]
            assert loads and all(node.args[0] in prepared for node in loads), part.rhs
            assert part.rhs.op == "Transpose" and part.rhs.args[0].op == "Load", part.rhs
            stored = parse_type(part.rhs.args[0].ty).shape
            assert stored == tuple(parse_type(part.rhs.ty).shape[a] for a in order)
            shortcut_ranges += part.taps == ((1, 2), (1, 2))
    assert shortcut_ranges == 1, "the 1x1 shortcut is not a K range over the centre tap"


@settings(max_examples=6, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(["float32", "float16"]), seed=st.integers(0, 2**31 - 1),
       offset=st.sampled_from([0.0, 300.0]), spread=st.sampled_from([1.0, 0.05]))
def test_prepared_conv_weights_match_the_xla_emitter_and_jit(dtype, seed, offset, spread):
    """The ResNet block (3 channels per group, 5 x 7 images, merged shortcut) split at its weights,
    through the Pallas templates (interpreted), equals the XLA emitter and jax.jit, with inputs at
    an offset large against their spread."""
    low = lowered_resnet(dtype)
    rng = np.random.default_rng(seed)
    params = {f"r.{k}": jnp.asarray(rng.standard_normal(s) * (0.3 if "conv" in k or "proj" in k else 1.0), dtype)
              for k, s in RESNET.items()}
    x = jnp.asarray(offset + spread * rng.standard_normal((2, 5, 7, 6)), dtype)
    temb = jnp.asarray(rng.standard_normal((2, 8)), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaFallbackWarning)
        pallas = low.executable("pallas", interpret=True)(params, x, temb)
    _close(pallas, low.executable("xla")(params, x, temb), dtype)
    _close(pallas, jax.jit(resnet)(params, x, temb), dtype)


# --- compiled for sm_90: what the PTX of a matmul kernel does ---------------------------------------


def plain_linear(params, x):
    return x + linear(x, params["w"], params["b"])


def layernorm_linear(params, x):
    return linear(layer_norm(x), params["w"], params["b"])


def _compiled_matmuls(fn, params, x, tmp_path):
    from benchmarks.loads import kernel_ptx, measure
    from measure.compare import emitted_per_call, planned_kernel_names

    params = {k: jax.ShapeDtypeStruct(s, jnp.float16) for k, s in params.items()}
    x = jax.ShapeDtypeStruct(x, jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = eqsat.optimize(fn, backend="pallas", params_argnums=0, progress=False)
        low = fast.lower(params, x)
    names = {n.replace(":", "_") for n in planned_kernel_names(low) if n.endswith("matmul")}
    dump = tmp_path / "dump"
    xla_target.compile_for_h100(functools.partial(emitted_per_call, fast), low.split.prepared_specs(), params, x,
                                keep_dump=dump)
    rows = [measure(ptx, entry, tmp_path) for entry, ptx in kernel_ptx(dump).items() if entry in names]
    assert rows, "no matmul kernel in the dump"
    return rows


@needs_h100_target
def test_a_linear_layer_loads_vectors_and_pipelines_its_mma(tmp_path):
    """154 x 768 @ 768 x 768 (a CLIP projection) with bias and residual: every global load of the
    matmul kernel is a 16-byte vector or cp.async (weights along N of the prepared [K, N] copy),
    the wgmma waits for at most one group in flight, nothing spills."""
    [row] = _compiled_matmuls(plain_linear, {"w": (768, 768), "b": (768,)}, (2, 77, 768), tmp_path)
    assert row["vector_fraction"] == 1.0, row
    assert row["mma"] == "wgmma" and row["max_wait_group"] >= 1, row
    assert row["spill_bytes"] == 0, row


@needs_h100_target
def test_a_layernorm_prologue_matmul_streams_its_weight_through_cp_async(tmp_path):
    """With a LayerNorm prologue the A tile is computed in registers (Triton then waits for each
    wgmma: a register operand defined in the loop cannot be asynchronous), but the weight still
    streams through 16-byte cp.async into the pipelined buffer, and nothing spills."""
    [row] = _compiled_matmuls(layernorm_linear, {"w": (1280, 320), "b": (1280,)}, (2, 1024, 320), tmp_path)
    assert row["loads"].get("cp.async.16", 0) >= 4 and row["mma"] == "wgmma", row
    assert row["spill_bytes"] == 0, row
