"""Loop-invariant hoisting: inside a loop body, a loop constant IS the operand it was passed.

`scan` and `while` pass their constants (`num_consts` leading operands, see `eqsat.lift`) to
every step unchanged, and `cond` passes all of its operands to the taken branch unchanged, so

    LoopArg(key, i, ty) = i-th operand of Loop(key, ...)      for every constant i

(carries and scanned slices are never equal to their operands). The equality only holds inside
the loop's body, so the LoopArg is subsumed: never extracted, the body reads the operand itself
(the enclosing scope's value) and no use outside the loop can pick the LoopArg. By congruence every body
computation that reads only constants (and outer tensors) then has a LoopArg-free form in its
e-class: text-conditioned K/V projections inside a denoising loop become the same e-class as a
computation outside the loop, shared with any equal computation there and horizontally fusable
with other matmuls of the same context. A body kernel that reads no LoopArg of its loop is
loop-invariant: the interpreter looks such values up from the enclosing scope, and an
emitter computes them once, before the loop, passing them in as constants.

Which operands are constants lives in `Program.payloads[key]` (`num_consts`), outside the
e-graph: `seed(egraph, program)` states it as `LoopConst(key, i)` facts; call it after building
the e-graph and before saturating. Without those facts the rule does not fire.
"""

from __future__ import annotations

from egglog import EGraph, String, i64, relation, rule, ruleset, subsume, union

from eqsat.lang import Loop, LoopArg, TCons, Tensor, TensorList

hoist = ruleset(name="hoist")

LoopConst = relation("HoistLoopConst", String, i64)
# (loop key, list, i): `list` is the suffix of the loop's operand list starting at operand i.
OperandSuffix = relation("HoistOperandSuffix", String, TensorList, i64)
# (loop key, i, x): operand i of the loop is x.
Operand = relation("HoistOperand", String, i64, Tensor)


def constant_operands(payload) -> range:
    """The operand indices of a loop that every step (or branch) sees unchanged."""
    if not isinstance(payload, dict):
        return range(0)
    kind = payload.get("kind")
    if kind in ("scan", "while"):
        return range(int(payload.get("num_consts", 0)))
    if kind == "cond":  # the index, then the operands every branch receives as its arguments
        return range(1 + int(payload.get("num_operands", 1 << 30)))
    return range(0)


def seed(egraph: EGraph, program) -> int:
    """State the constants of every loop of `program` in `egraph`; returns how many facts."""
    from eqsat.term import list_items, postorder

    facts = []
    for term in postorder(program.outputs):
        if term.op != "Loop":
            continue
        key, operands = term.args[0], list_items(term.args[1])
        for index in constant_operands(program.payloads.get(key)):
            if index >= len(operands):
                break
            facts.append(LoopConst(String(key), i64(index)))
    facts = list(dict.fromkeys(facts))
    if facts:
        egraph.register(*facts)
    return len(facts)


@hoist.register
def _loop_operands(key: String, operands: TensorList, body: TensorList, rest: TensorList, head: Tensor,
                   index: i64, i: i64, ty: String):
    """Operand(key, i, x): x is the i-th operand of loop `key` (walking its TCons list)."""
    yield rule(Loop(key, operands, body, index, ty), LoopConst(key, i)).then(OperandSuffix(key, operands, i64(0)))
    yield rule(OperandSuffix(key, operands, i), operands == TCons(head, rest)).then(
        Operand(key, i, head), OperandSuffix(key, rest, i + 1))


@hoist.register
def _loop_constant(key: String, i: i64, ty: String, x: Tensor):
    """LoopArg(key, i) = operand i for a loop constant i: invariant body work reads no LoopArg."""
    # Subsumed: the equality holds inside the body only, so the LoopArg must never be extracted
    # for the operand's uses outside the loop; inside, the operand itself is read (a closure).
    yield rule(LoopConst(key, i), Operand(key, i, x), LoopArg(key, i, ty)).then(
        union(LoopArg(key, i, ty)).with_(x), subsume(LoopArg(key, i, ty)))


# --- soundness examples (eqsat.rules.check, which calls `seed`) ---------------------------------
# Positive: a scan whose body projects a loop constant (the text context) with a constant weight.
# Must not fire: a scan with no loop constants, all of whose body work depends on the carry.


def _invariant_projection_scan(h, xs, context, weight):
    import jax.numpy as jnp
    from jax import lax

    def step(carry, x):
        keys = context @ weight                      # reads only loop constants
        return jnp.tanh(carry * x + keys.sum(axis=0)), None

    return lax.scan(step, h, xs)[0]


def _invariant_projection_scan_args(draw):
    from eqsat.rules import dim, tensor

    n, s, k = dim(draw, 1, 3), dim(draw, 1, 3), dim(draw, 1, 3)
    return (tensor(draw, (n,), low=-0.5, high=0.5), tensor(draw, (dim(draw, 1, 3), n)),
            tensor(draw, (s, k)), tensor(draw, (k, n)))


def _carried_scan(h, xs):
    import jax.numpy as jnp
    from jax import lax

    return lax.scan(lambda c, x: (jnp.tanh(c @ c + x), None), h, xs)[0]


def _carried_scan_args(draw):
    from eqsat.rules import dim, tensor

    n = dim(draw, 1, 3)
    return tensor(draw, (n, n), low=-0.5, high=0.5), tensor(draw, (dim(draw, 1, 3), n, n))


def _examples():
    from eqsat.rules import Example

    return [
        Example(_invariant_projection_scan, _invariant_projection_scan_args, ("loop_operands", "loop_constant")),
        Example(_carried_scan, _carried_scan_args, ("loop_constant",), fires=False),
    ]


EXAMPLES = _examples()
