"""Writes the tour notebooks from the cells below and executes them, so the committed files carry
their outputs (pictures included) for readers on GitHub:

    python notebooks/build.py            # write and execute all three
    python notebooks/build.py 02         # only the notebooks whose name contains "02"

Edit the cells here, not the .ipynb files. `tests/test_notebooks.py` executes the committed
notebooks and fails on any error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str):
    return nbformat.v4.new_code_cell(text.strip())


SETUP = code('''
import eqsat  # first: on a machine without a GPU it keeps the CUDA plugin from loading (and logging)
import jax
import jax.numpy as jnp
import numpy as np
from eqsat import viz
from extract import drawing

%matplotlib inline


def spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)
''')

# --- 01: the e-graph tour -----------------------------------------------------------------------------

TOUR = [
    md('''
# 1 · A tour of the e-graph

One small function goes through every stage of `eqsat.optimize` by hand: the jaxpr, the naive
program (one kernel per primitive), the e-graph before and after the rule families, which rules
fired, how the output's e-class grew, and the naive and fused plans side by side.

The function is the second half of a transformer layer: LayerNorm → matmul → GELU → residual.
'''),
    SETUP,
    code('''
def block(x, gamma, beta, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta
    return x + jax.nn.gelu(h @ w + b)


args = [spec(256, 64), spec(64), spec(64), spec(64, 64), spec(64)]
print(jax.make_jaxpr(block)(*args).pretty_print(use_color=False))
'''),
    md('''
## The naive program

`eqsat.lift` turns the jaxpr into terms of two sorts: `Tensor`s (values in memory, each made by
one kernel: `Pointwise`, `Reduce`, `Matmul`, ...) and `Expr`s (what a kernel computes per output
element: `Load`, `Binary`, `Broadcast`, ...). Lifting makes one kernel per primitive.
'''),
    code('''
from eqsat.cost import count_kernels
from eqsat.rules import format_terms

program = eqsat.lift(block, *args)
print(format_terms(program.outputs, width=130))
print(f"\\n{count_kernels(program.outputs)} kernels")
'''),
    md('''
## The e-graph before the rules

The builder writes the terms into an egglog e-graph; `extract.load` reads its serialized JSON into
flat arrays (e-classes, e-nodes, children). Before any rule runs, every e-class holds exactly the
one e-node lifting made. The output's e-class is outlined in red.
'''),
    code('''
import extract
from eqsat.egraph import Builder
from eqsat.saturate import serialized_data

builder = Builder()
handles = builder.add(program.outputs)
before = extract.load(serialized_data(builder.egraph))
root = before.handles[handles[0]]
print(f"{viz.language_classes(before)} e-classes, {before.num_nodes} e-nodes; "
      f"the output's e-class e{root} has {len(before.class_nodes[root])} e-node")
viz.egraph_drawing(before, viz.neighbourhood(before, [root], depth=5, max_classes=22), focus=[root],
                   title="the naive e-graph near the output (22 of its e-classes)")
'''),
    md('''
## Running the rule families

`eqsat.schedule.default_schedule()` lists the families in order (cleanup first, then fusion).
`eqsat.saturate` runs each stage until it changes nothing and repeats the list until a whole round
changes nothing; here the same loop is written out so that every rule's matches can be counted
(a rule is named after the generator that registered it; `/i` numbers the rules one generator
yields). Relations such as `reads`, `scalars` or `stat_views` are analyses the rewrites read.
'''),
    code('''
from collections import Counter

from eqsat import rules
from eqsat.schedule import default_schedule

schedule = default_schedule()
print("stages:", ", ".join(schedule.names))
rules.seed(builder.egraph, program)           # facts some families read from the program
fired = Counter()
changed = True
while changed:                                # until a whole round changes nothing
    changed = False
    for stage in schedule.stages:
        family = rules.family_ruleset(stage.name)
        for _ in range(stage.iterations):
            report = builder.egraph.run(stage.ruleset)
            for decl, count in report.num_matches_per_rule.items():
                if count:
                    fired[stage.name, rules.rule_name(family, decl).split("/")[0]] += count
            if not report.updated:
                break
            changed = True

for family in schedule.names:
    matched = {rule: n for (name, rule), n in sorted(fired.items()) if name == family}
    if matched:
        print(f"{family:>15}: " + ", ".join(f"{rule} ×{n}" for rule, n in matched.items()))
'''),
    md('''
## How the output's e-class grew

Nothing is ever removed: rules only add e-nodes and merge e-classes, so every fused alternative
sits next to the naive one. Extraction (`extract.extract`) then picks, for the whole DAG, the
cheapest e-node of every e-class it needs under the roofline cost model; the view below shows the
e-classes within two operand hops of the output, the extracted e-nodes in gold.
'''),
    code('''
from extract.plan import Plan, plan_from_extraction

after = extract.load(serialized_data(builder.egraph))
root_after = after.handles[handles[0]]
print(f"e-graph: {viz.language_classes(before)} -> {viz.language_classes(after)} e-classes, "
      f"{before.num_nodes} -> {after.num_nodes} e-nodes")
print(f"the output's e-class: {len(before.class_nodes[root])} -> {len(after.class_nodes[root_after])} e-nodes: "
      + ", ".join(sorted(after.node_op[n] for n in after.class_nodes[root_after])))

extraction = extract.extract(after, handles)
fused = plan_from_extraction(extraction, program, builder.handles)
chosen = viz.chosen_nodes(extraction.selection)
shown = viz.neighbourhood(after, [root_after], depth=2, max_classes=16)
viz.egraph_drawing(after, shown, chosen=chosen, focus=[root_after],
                   title=f"{len(shown)} of {viz.language_classes(after)} e-classes around the output "
                         "(extracted e-nodes in gold)")
'''),
    md('''
## The naive and the fused plan

`Plan.build` of the lifted terms is the naive plan; the extracted one computes the LayerNorm's row
statistics inside the matmul (`RowReduce` in its prologue), and the bias, GELU and residual add in
its epilogue: one kernel, reading `x` and the weights once.
'''),
    code('''
naive = Plan.build(program.outputs, program=program)
print(f"naive {len(naive.kernels)} kernels, {viz.human_bytes(naive.bytes)} moved, {naive.seconds * 1e6:.1f} µs modeled")
print(f"fused {len(fused.kernels)} kernels, {viz.human_bytes(fused.bytes)} moved, {fused.seconds * 1e6:.1f} µs modeled")
drawing.plans_drawing({"naive": naive, "fused": fused}, expression_chars=900)
'''),
    md('''
Both plans compute the function: the reference interpreter runs them on random values.
`eqsat.optimize` does all of the above in one call (`lowered.show()` draws its plan).
'''),
    code('''
rng = np.random.default_rng(0)
values = [rng.standard_normal(a.shape).astype(np.float32) for a in args]
expected = np.asarray(block(*values))
for name, plan in (("naive", naive), ("fused", fused)):
    error = np.abs(np.asarray(plan.evaluate(*values)) - expected).max()
    print(f"{name}: max abs error {error:.2e}")

lowered = eqsat.optimize(block, progress=False).lower(*args)
print(lowered.plan)
print("saturation:", lowered.saturation.summary())
lowered.show()
'''),
]

# --- 02: extraction -----------------------------------------------------------------------------------

EXTRACTION = [
    md('''
# 2 · Extraction and the cost model

How the plan is chosen: the roofline cost of each alternative of one e-class, greedy against ILP
extraction, the chosen plan as a kernel DAG, and Stable Diffusion 1.5's UNet (full size, abstract
shapes, no weights) against XLA's executable for an H100: kernels per component, modeled HBM
bytes, buffer lifetimes and the peak-memory curve.
'''),
    SETUP,
    code('''
from concurrent.futures import ThreadPoolExecutor

from measure import xla_target
from sd15.workloads import workloads

# XLA's compile of the UNet for an H100 runs in a subprocess for a minute or so: start it now,
# read it in the UNet section at the end.
unet = workloads(batch=2, dtype="float16", components=("unet",))["unet"]
xla_future = ThreadPoolExecutor(1).submit(xla_target.compile_for_h100, unet.fn, *unet.args)
'''),
    md('''
## The cost model on one e-class

A kernel costs `launch + bytes / bandwidth + flops / peak` on the device profile (`eqsat.cost`,
H100 here), where its bytes are the tensors it loads plus the one it writes. The output e-class of
a LayerNorm → matmul → GELU → residual block (SD 1.5 sizes: 4096 tokens × 320 channels, fp16)
holds several e-nodes; forcing each in turn and extracting the rest shows what each one costs: its
own kernel (bytes, flops, seconds) and the whole plan it implies.
'''),
    code('''
import dataclasses

import extract
from eqsat.cost import kernel_cost
from extract.plan import plan_from_extraction


def block(x, gamma, beta, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta
    return x + jax.nn.gelu(h @ w + b)


half = jnp.float16
block_args = [spec(4096, 320, dtype=half), spec(320, dtype=half), spec(320, dtype=half),
              spec(320, 320, dtype=half), spec(320, dtype=half)]
lowered = eqsat.optimize(block, progress=False).lower(*block_args)
graph = lowered.extraction.graph
root = graph.handles[lowered.builder.handle(lowered.program.outputs[0])]
chosen = viz.chosen_nodes(lowered.extraction.selection)

print(f"{'e-node':<34}{'kernel bytes':>14}{'GFLOP':>9}{'µs':>8}   whole plan")
for node in graph.class_nodes[root]:
    forced = dataclasses.replace(graph, class_nodes=[[node] if c == root else nodes
                                                     for c, nodes in enumerate(graph.class_nodes)])
    try:
        result = extract.extract(forced, roots=[root], method="greedy")
    except ValueError as error:
        print(f"{viz.node_label(graph, node):<34} no acyclic plan ({error})")
        continue
    plan = plan_from_extraction(result, lowered.program, lowered.builder.handles)
    own = kernel_cost(result.terms[0])
    mark = "  <- extracted" if node in chosen else ""
    print(f"{viz.node_label(graph, node):<34}{viz.human_bytes(own.bytes):>14}{own.flops / 1e9:>9.3f}"
          f"{own.seconds * 1e6:>8.2f}   {len(plan.kernels)} kernels, {plan.seconds * 1e6:.2f} µs{mark}")
'''),
    md('''
## Greedy against ILP

`extract.extract` offers a greedy DAG extractor (rounds of locally cheapest choices, then local
moves that retire shared tensors) and an exact ILP (`scipy.optimize.milp`, HiGHS) for graphs small
enough; both are rated on the same plan cost. On the block above the ILP proves the greedy plan
optimal or matches it; on an SD 1.5 transformer block (1024 tokens, 640 channels, 77 context
tokens) its search is cut off by the time limit, so whichever plan is cheaper is kept. The cell
says which happened on this run, and which kernels differ.
'''),
    code('''
from sd15 import params as sd_params
from sd15.config import UNetConfig
from sd15.unet import transformer_block

path = "down_blocks.1.attentions.0.transformer_blocks.0"
unet_params = sd_params.abstract_params("unet", UNetConfig(), dtype=half)
block_params = {k: v for k, v in unet_params.items() if k.startswith(path + ".")}


def sd_transformer_block(params, x, context):
    return transformer_block(params, path, x, context, 8)


def compare(name, lowered, time_limit=3.0):
    handles = [lowered.builder.handle(t) for t in lowered.program.outputs]
    plans = {}
    for method in ("greedy", "ilp"):
        result = extract.extract(lowered.extraction.graph, handles, method=method, time_limit=time_limit)
        plans[method] = (result, plan_from_extraction(result, lowered.program, lowered.builder.handles))
    (greedy, greedy_plan), (ilp, ilp_plan) = plans["greedy"], plans["ilp"]
    info = ilp.details["ilp"]
    print(f"{name}: greedy {len(greedy_plan.kernels)} kernels {greedy.cost * 1e6:.2f} µs; ILP ({info['status']}, "
          f"{info['variables']} variables, {info['seconds']:.1f} s) -> kept the {ilp.extractor} plan, "
          f"{len(ilp_plan.kernels)} kernels {ilp.cost * 1e6:.2f} µs")
    shape = lambda plan: [(k.kind, k.component) for k in plan.kernels]
    if shape(greedy_plan) != shape(ilp_plan):
        print("  different kernels:", shape(greedy_plan), "vs", shape(ilp_plan))
    differing = [(g, i) for g, i in zip(greedy_plan.kernels, ilp_plan.kernels) if g.term is not i.term]
    if not differing:
        print("  they agree: the same kernels computing the same expressions")
    for g, i in differing:
        print(f"  {g.kind} [{g.component}]: greedy {g.seconds * 1e6:.2f} µs, "
              f"ILP {i.seconds * 1e6:.2f} µs, {viz.human_bytes(g.bytes)} vs {viz.human_bytes(i.bytes)} moved")
    return plans


compare("LayerNorm block", lowered)
block_lowered = eqsat.optimize(sd_transformer_block, extractor="greedy", progress=False).lower(
    block_params, spec(2, 1024, 640, dtype=half), spec(2, 77, 768, dtype=half))
block_plans = compare("transformer block", block_lowered)
'''),
    md('''
Where they differ, they differ in which expression a kernel recomputes (the same kinds of kernels,
a cheaper prologue or epilogue in one of them): the greedy extractor decides class by class, the
ILP weighs a tensor shared by several readers once for the whole plan.

## The chosen plan as a kernel DAG

The transformer block's plan: LayerNorm statistics recomputed inside the matmuls that read them,
Q/K/V as one matmul over concatenated weights, attention as one flash-attention kernel, GEGLU's
split and gate in the epilogue of the matmul that produces it.
'''),
    code('''
drawing.plan_drawing(block_plans["greedy"][1], expression_chars=200)
'''),
    md('''
## Stable Diffusion 1.5: the UNet step against XLA

One classifier-free-guidance UNet step (batch 2, 64×64 latents, fp16, the DDIM update included),
traced from abstract shapes. XLA's kernels are counted from the thunk sequence of the executable
it compiles for an H100 without a GPU (`measure.xla_target`); without the CUDA plugin the cell says
so and shows eqsat's side only.
'''),
    code('''
import collections
import time

import matplotlib.pyplot as plt

started = time.perf_counter()
unet_lowered = eqsat.optimize(unet.fn, progress=False).lower(*unet.args)
unet_plan = unet_lowered.plan
print(f"eqsat: {unet_lowered.stats['naive_kernels']} naive -> {len(unet_plan.kernels)} kernels "
      f"({time.perf_counter() - started:.0f} s), {unet_lowered.stats['e_classes']} e-classes")
xla = xla_future.result()
ours = {r["component"]: r["fused"] for r in unet_plan.rows(depth=1)}
ours_bytes = {r["component"]: r["bytes"] / 2**30 for r in unet_plan.rows(depth=1)}
series, byte_series = {"eqsat": ours}, {"eqsat": ours_bytes}
if xla is None:
    print("XLA's H100 target is unavailable here (no jax-cuda12 plugin): eqsat's side only")
else:
    print(f"XLA:   {xla.summary()}")
    series["XLA"] = xla.by_scope(depth=1)
    xla_bytes = collections.Counter()
    for launch in xla.launches:
        if launch.counted == "kernel":
            xla_bytes[launch.scope.split("/")[0] if launch.scope else ""] += launch.bytes / 2**30
    byte_series["XLA"] = dict(xla_bytes)
fig, axes = plt.subplots(2, 1, figsize=(11, 7), constrained_layout=True)
viz.plot_kernel_counts(series, ax=axes[0], title="kernels per UNet component")
viz.plot_kernel_counts(byte_series, ax=axes[1], ylabel="modeled HBM GiB", fmt="%.2f",
                       title=f"modeled HBM bytes: eqsat {unet_plan.bytes / 2**30:.2f} GiB"
                             + (f", XLA {xla.modeled_bytes / 2**30:.2f} GiB" if xla else ""))
plt.show()
'''),
    md('''
What is left is one kernel per matmul, convolution and attention of the network: every
elementwise op, permute, concat and normalization statistic is fused into one of them.

## Buffer lifetimes and peak memory

A buffer lives from the kernel that writes it to the last kernel that reads it (plan order);
the peak of the sum of live activation buffers is the plan's activation memory (weights and inputs
not counted). Below: the curve over the UNet step, and the lifetimes of the 40 buffers that hold
the most memory over time (bytes × kernels alive): the skip connections of the down blocks live
until the up blocks read them.
'''),
    code('''
print(f"peak activations {viz.human_bytes(unet_plan.peak_bytes)}"
      + (f"; XLA's temporary memory {viz.human_bytes(xla.temp_bytes)}" if xla else ""))
fig, axes = plt.subplots(2, 1, figsize=(11, 9), height_ratios=[1, 2.4], constrained_layout=True)
drawing.plot_memory(unet_plan, ax=axes[0])
drawing.plot_lifetimes(unet_plan, ax=axes[1], largest=40)
plt.show()
'''),
    md('''
The UNet's e-graph has thousands of e-classes; drawn whole it says nothing. A view around one
component does: the e-classes of the mid block's first self-attention, and what they read.
'''),
    code('''
unet_lowered.egraph_view(component="mid_block.attentions.0.transformer_blocks.0.attn1", depth=1, max_classes=14)
'''),
]

# --- 03: writing a fusion rule ------------------------------------------------------------------------

RULE = [
    md('''
# 3 · Writing a fusion rule

The shipped `attention` family recognizes `softmax(scale · q·kᵀ + bias) · v` as one flash-attention
kernel, with any additive `bias` (a causal mask, ALiBi). A mask is often written another way:

```python
scores = jnp.where(mask, scores, -jnp.inf)
```

That is a `Select`, not an addition: a family that knows only additive biases does not see
attention there, and the scores matrix is materialized between two matmuls. The law that fixes it
is one line: `where(m, s, -inf) = s + where(m, 0, -inf)` for every finite `s` (both are `s` where
`m` holds and `-inf` elsewhere). This notebook writes it as a ruleset outside the package, checks
it, shows the check catching a wrong variant, and runs it with the shipped families. (The shipped
family has since learned this spelling itself, as its `masked_scores` rule; the notebook stays the
worked example of writing one, so the shipped plan below already has its attention kernel.)
'''),
    SETUP,
    code('''
def masked_attention(q, k, v, mask):
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


# CLIP's sizes: 77 tokens, head dim 64; 8 heads
qkv = [spec(2, 8, 77, 64)] * 3
mask = spec(77, 77, dtype=jnp.bool_)
shipped = eqsat.optimize(masked_attention, progress=False).lower(*qkv, mask)
print("shipped families:", shipped.plan.kinds())
'''),
    md('''
## The rule

Everything comes from `eqsat.lang` (the term language) and `eqsat.rules` (the rule-authoring API).
`NegInf(e)` is a small analysis: `e` is `-inf` everywhere (a literal, a scalar constant lifted
from the jaxpr, or a view or copy of one); `py_true` calls Python on the constant's key. The
rewrite itself is the generator `where_is_bias`: its name names the rule and its docstring states
the law.
'''),
    code('''
import math

from egglog import String, f64, relation, rule, ruleset, union

from eqsat.lang import Binary, Broadcast, Constant, Expr, Lit, Load, Pointwise, Select, Unary
from eqsat.rules import Example, RuleCheckError, check, dim, flag, py_true, tensor

mask_bias = ruleset(name="mask_bias")
NegInf = relation("NegInf", Expr)


def is_neg_inf_scalar(key: str) -> str:
    """Does a scalar Constant's key (`scalar:<dtype>:<value>`) hold -inf?"""
    return flag(key.startswith("scalar:") and float(key.rsplit(":", 1)[1]) == -math.inf)


@mask_bias.register
def neg_inf(e: Expr, x: Expr, key: String, ty: String, dims: String):
    """NegInf(e): e is -inf at every index (a literal, a scalar constant, or a view or copy of one)."""
    yield rule(e == Lit(f64(-math.inf), ty)).then(NegInf(e))
    yield rule(e == Load(Constant(key, ty), ty), py_true(is_neg_inf_scalar, key)).then(NegInf(e))
    yield rule(e == Broadcast(x, dims, ty), NegInf(x)).then(NegInf(e))
    yield rule(e == Unary("convert", x, ty), NegInf(x)).then(NegInf(e))
    yield rule(e == Load(Pointwise(x, ty), ty), NegInf(x)).then(NegInf(e))


@mask_bias.register
def where_is_bias(e: Expr, m: Expr, fill: Expr, s: Expr, ty: String):
    """where(m, s, -inf) = s + where(m, 0, -inf): a -inf fill is an additive bias (exact for finite s)."""
    yield rule(e == Select(m, fill, s, ty), NegInf(fill)).then(
        union(e).with_(Binary("add", s, Select(m, fill, Lit(0.0, ty), ty), ty)))
'''),
    md('''
## Its soundness check

`check` draws shapes and values with hypothesis for each `Example` (plain JAX), lifts it, runs the
ruleset until nothing changes, and evaluates many extractions of the rewritten e-graph (random
ones, and one forcing each alternative e-node) with the reference interpreter against the
function, on the drawn values and again on adversarial ones (`eqsat.rules.VALUE_REGIMES`: a mean
large against the spread, constant rows, zeros, tiny and huge magnitudes, NaN and ±inf). It also
asserts that the named rules fired, and that a guarded rule did **not** fire on its must-not-fire
example: here `where(m, x, 0.0)`, a finite fill, which is not a bias.

The law holds for finite scores only. Where a masked score is NaN or +inf, `where` still gives
`-inf` but the sum gives NaN:
'''),
    code('''
s, m = jnp.array([1.0, jnp.nan, jnp.inf]), jnp.array([True, False, False])
print("where(m, s, -inf)     =", jnp.where(m, s, -jnp.inf))
print("s + where(m, 0, -inf) =", s + jnp.where(m, 0.0, -jnp.inf))
'''),
    md('''
Scores are finite unless `q` or `k` hold NaN or infinities, or `q·kᵀ` overflows, so the example
states that numerical contract: it is held to every value regime but `nonfinite` (the check would
report the NaN above otherwise). Random masks still include fully masked rows, where both sides
are NaN (a softmax of nothing but `-inf`).
'''),
    code('''
from eqsat.rules import VALUE_REGIMES

FINITE = tuple(regime for regime in VALUE_REGIMES if regime != "nonfinite")


def masked_attention_args(draw):
    batch, heads, q_len, kv_len, head_dim = dim(draw, 1, 2), dim(draw, 1, 2), dim(draw), dim(draw), dim(draw)
    return (tensor(draw, (batch, heads, q_len, head_dim)), tensor(draw, (batch, heads, kv_len, head_dim)),
            tensor(draw, (batch, heads, kv_len, head_dim)), tensor(draw, (q_len, kv_len), "bool"))


def zero_masked(x, mask):
    return jnp.where(mask, x, 0.0)


def zero_masked_args(draw):
    shape = (dim(draw), dim(draw))
    return tensor(draw, shape), tensor(draw, shape, "bool")


cases = [Example(masked_attention, masked_attention_args, ("where_is_bias",), regimes=FINITE),
         Example(zero_masked, zero_masked_args, ("where_is_bias",), fires=False)]
print(check(mask_bias, examples=3, cases=cases))
'''),
    md('''
## A deliberately wrong variant

Drop the guard: "any fill is a bias". On `where(m, x, 0.0)` that claims `x + where(m, 0, 0) = x`
where the mask is off, instead of `0`. The check finds a counterexample, names the rule, and prints
the wrong plan.
'''),
    code('''
unguarded = ruleset(name="mask_bias_unguarded")


@unguarded.register
def any_fill_is_bias(e: Expr, m: Expr, fill: Expr, s: Expr, ty: String):
    """where(m, s, c) = s + where(m, 0, c) for any fill c (wrong unless c is -inf)."""
    yield rule(e == Select(m, fill, s, ty)).then(
        union(e).with_(Binary("add", s, Select(m, fill, Lit(0.0, ty), ty), ty)))


try:
    check(unguarded, examples=3, cases=[Example(zero_masked, zero_masked_args, ("any_fill_is_bias",))])
except RuleCheckError as error:
    print(f"caught: rule {error.rule!r} on example {error.example!r}\\n")
    print("\\n".join(str(error).splitlines()[:14]))
'''),
    md('''
## Running it with the shipped families

`eqsat.schedule.default_schedule(extra=[mask_bias])` runs the shipped families and then the new
ruleset, repeating the list until nothing changes, so the `attention` family sees the additive bias
the new rule adds. `eqsat.optimize(fn, rulesets=...)` takes that schedule. Before the shipped
family knew masks, this is where the kernel count moved from two matmuls to one attention kernel;
now both plans have the attention kernel, and the values agree.
'''),
    code('''
from eqsat.schedule import default_schedule

extended = eqsat.optimize(masked_attention, rulesets=default_schedule(extra=[mask_bias]), progress=False)
fused = extended.lower(*qkv, mask)
print(f"shipped families: {len(shipped.plan.kernels)} kernels {shipped.plan.kinds()}, "
      f"{viz.human_bytes(shipped.plan.bytes)} moved")
print(f"with mask_bias:   {len(fused.plan.kernels)} kernels {fused.plan.kinds()}, "
      f"{viz.human_bytes(fused.plan.bytes)} moved")

rng = np.random.default_rng(0)
values = [rng.standard_normal(a.shape).astype(np.float32) for a in qkv] + [np.tril(np.ones((77, 77), bool))]
error = np.abs(np.asarray(extended(*values)) - np.asarray(masked_attention(*values))).max()
print(f"causal mask, 77 tokens: max abs error against jax {error:.1e}")
drawing.plans_drawing({"shipped families": shipped.plan, "with mask_bias": fused.plan}, expression_chars=160)
'''),
    md('''
In a whole layer: self-attention with a key-padding mask (the padded tokens of each sequence are
masked for every query), as a text encoder with variable-length prompts would write it.
'''),
    code('''
def padded_self_attention(x, lengths, w_qkv, w_out, heads=8):
    batch, tokens, width = x.shape
    q, k, v = jnp.split(x @ w_qkv, 3, axis=-1)
    split = lambda t: t.reshape(batch, tokens, heads, width // heads).transpose(0, 2, 1, 3)
    scores = jnp.einsum("bhqd,bhkd->bhqk", split(q), split(k)) / np.sqrt(width // heads)
    valid = jnp.arange(tokens)[None, :] < lengths[:, None]                 # [batch, kv tokens]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), split(v))
    return out.transpose(0, 2, 1, 3).reshape(batch, tokens, width) @ w_out


layer_args = [spec(2, 77, 320), spec(2, dtype=jnp.int32), spec(320, 960), spec(320, 320)]
for name, rulesets in (("shipped families", None), ("with mask_bias", default_schedule(extra=[mask_bias]))):
    plan = eqsat.optimize(padded_self_attention, rulesets=rulesets, progress=False).lower(*layer_args).plan
    print(f"{name:>16}: {len(plan.kernels)} kernels {plan.kinds()}, {viz.human_bytes(plan.bytes)} moved, "
          f"{plan.seconds * 1e6:.1f} µs modeled")
'''),
    md('''
What this rule does not cover: a finite fill such as `-1e9` is not an additive bias of the same
value (the masked scores become `s - 1e9`, equal after the softmax only while `|s|` stays far below
the fill's rounding step): the check above is exactly what would catch a rule claiming it. The
shipped `masked_scores` covers a finite fill at or below the dtype's lowest finite value (flax's
`jnp.finfo(dtype).min`) another way: its bias is float32's lowest, to which `s + bias` rounds for
any `|s| < 2**103`, so a fully masked row stays uniform as jax computes it. A fill above that, such
as `-1e4`, stays two matmuls, and `lowered.explain()` says why.

To ship a rule like this one, put it in `eqsat/rules/<name>.py` with `EXAMPLES`, list it in
`eqsat.rules.FAMILIES` and `eqsat.schedule.DEFAULT_ORDER`, and the soundness suite runs it.
'''),
]

NOTEBOOKS = {
    "01_egraph_tour.ipynb": TOUR,
    "02_extraction.ipynb": EXTRACTION,
    "03_writing_a_fusion_rule.ipynb": RULE,
}


def build(name: str, cells, execute: bool = True) -> float:
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    started = time.perf_counter()
    if execute:
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(HERE.parent)}}).execute()
    nbformat.write(notebook, HERE / name)
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    wanted = argv or [""]
    for name, cells in NOTEBOOKS.items():
        if any(w in name for w in wanted):
            print(f"{name}: {build(name, cells):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
