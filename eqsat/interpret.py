"""The reference interpreter: evaluates any term DAG of the language with `jax.numpy`/`lax`.

It is the oracle for rule soundness, so it evaluates every form rules can produce, not only the
naive lift: epilogues over `Acc`, `Attention`, views inside any kernel, `Assign*`, `Opaque`, and
`Loop`s (scan/while/cond over their nested body terms). Every Tensor and Expr value is checked
against the term's type; a mismatch raises `TypeError` naming the term.

Semantics, per constructor (the rest of the stack relies on these):

- An `Expr` evaluates to a whole array of its type's shape; `Load(t, ty)` is `t`'s value.
- `Matmul`/`Conv`/`Reduce`/`Attention` compute their core in the dtype of the epilogue's `Acc`
  (the kernel's type when the epilogue has none), then the epilogue with `Acc` bound to the core.
  Attention is `softmax(q·kᵀ·scale + bias)·v` over `[batch, heads, seq, head_dim]` (the bias broadcast to
  the scores), computed in float32.
- `RowReduce` (an Expr) is `Reduce` over its one `axis`, with the same epilogue semantics;
  `EpilogueReduce` is `Reduce` with the identity epilogue (its producer only says who computes it).
- The `moments` reduction is `eqsat.moments.two_pass`: float32 `[mean, sum((x - mean)^2)]` (mean = sum/n)
  stacked on a new leading axis, in every form (`Reduce`, `RowReduce`, `EpilogueReduce`).
- `DynamicSlice` and `AssignDynamic` clamp starts as the `dynamic_slice`/`dynamic_update_slice`
  primitives do (no negative-index wrapping; the lift makes wrapping explicit).
- `Gather`/`AssignScatter`/`Opaque` bind `payloads[key] = (primitive, params)`.
- `Loop` follows the payload layouts documented in `eqsat.lift`.

Evaluation is iterative (a 20,000-deep chain is fine); loop bodies run under `lax.scan`,
`lax.while_loop` or `lax.switch`, so `evaluate` can itself be traced with `jax.jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eqsat.conv_params import ConvParams
from eqsat.ops import apply_binary, apply_reduce, apply_unary
from eqsat.term import Term, list_items
from eqsat.types import dtype_name, ints, parse_type

_MISSING = object()


def evaluate(terms, env, constants=None, payloads=None) -> list:
    """The values of `terms` (Tensor or Expr terms) with `Input(name)` bound to `env[name]`."""
    return _Evaluator(env, constants or {}, payloads or {}).run(list(terms))


def evaluate_program(program, *args, **kwargs):
    """Run a lifted `Program` on the arguments of the function it was lifted from."""
    env = program.environment(*args, **kwargs)
    return program.results(evaluate(program.outputs, env, program.constants, program.payloads))


def _dims(text: str) -> tuple[tuple[int, ...], ...]:
    """Matmul dims "lc;rc;lb;rb" -> four int tuples."""
    parts = text.split(";")
    if len(parts) != 4:
        raise ValueError(f"not matmul dims: {text!r}")
    return tuple(ints(part) for part in parts)


def _pad_config(text: str) -> list[tuple[int, int, int]]:
    return [tuple(ints(axis)) for axis in text.split(";")] if text else []


class _Evaluator:
    def __init__(self, env, constants, payloads, parent: "_Evaluator | None" = None, loop_args=None):
        self.env = env
        self.constants = constants
        self.payloads = payloads
        self.parent = parent
        self.loop_args: dict[tuple[str, int], object] = loop_args or {}
        self.values: dict[Term, object] = {}
        # Whether an Expr contains `Acc` (then its value depends on the enclosing kernel and is
        # computed per kernel, never stored); structural, so shared with nested evaluators.
        self.acc_flags: dict[Term, bool] = parent.acc_flags if parent is not None else {}
        self.multi: dict[tuple, list] = {}

    # --- lookup -------------------------------------------------------------------------------

    def lookup(self, term: Term):
        evaluator = self
        while evaluator is not None:
            value = evaluator.values.get(term, _MISSING)
            if value is not _MISSING:
                return value
            evaluator = evaluator.parent
        if self.acc_flags.get(term):
            raise ValueError(f"{term!r} reads Acc outside an epilogue")
        raise KeyError(f"{term!r} has not been evaluated")

    def _known(self, term: Term) -> bool:
        if self.acc_flags.get(term):
            return True
        evaluator = self
        while evaluator is not None:
            if term in evaluator.values:
                return True
            evaluator = evaluator.parent
        return False

    def _loop_arg(self, key: str, index: int):
        evaluator = self
        while evaluator is not None:
            value = evaluator.loop_args.get((key, index), _MISSING)
            if value is not _MISSING:
                return value
            evaluator = evaluator.parent
        raise KeyError(f"LoopArg({key!r}, {index}) outside its loop")

    # --- traversal ----------------------------------------------------------------------------

    @staticmethod
    def _deps(term: Term):
        if term.op == "Loop":
            return (term.args[1],)  # the body runs inside the loop
        if term.op == "TCons":
            return list_items(term)  # flat: a list's value is computed once, at its head
        return term.children

    def run(self, roots: list[Term]) -> list:
        stack: list[tuple[Term, bool]] = [(root, False) for root in reversed(roots)]
        while stack:
            node, ready = stack.pop()
            if self._known(node):
                continue
            if ready:
                self._finish(node)
                continue
            stack.append((node, True))
            for child in self._deps(node):
                if not self._known(child):
                    stack.append((child, False))
        for root in roots:
            if self.acc_flags.get(root):
                raise ValueError(f"{root!r} reads Acc outside an epilogue")
        return [self.lookup(root) for root in roots]

    def _finish(self, node: Term) -> None:
        if node.sort == "Expr":
            # A RowReduce binds the `Acc` of its own epilogue: only its body can read the kernel's.
            children = node.children[:1] if node.op == "RowReduce" else node.children
            has_acc = node.op == "Acc" or any(
                self.acc_flags.get(child, False) for child in children if child.sort == "Expr")
            self.acc_flags[node] = has_acc
            if has_acc:
                return
        self.values[node] = self._compute(node, self.lookup, None)

    def _epilogue(self, epilogue: Term, acc):
        """`epilogue` with `Acc` bound to `acc` (Acc-free parts come from the evaluated DAG)."""
        if not self.acc_flags.get(epilogue):
            return self.lookup(epilogue)
        local: dict[Term, object] = {}

        def get(term):
            value = local.get(term, _MISSING)
            return value if value is not _MISSING else self.lookup(term)

        stack: list[tuple[Term, bool]] = [(epilogue, False)]
        while stack:
            node, ready = stack.pop()
            if node in local:
                continue
            if ready:
                local[node] = self._compute(node, get, acc)
                continue
            stack.append((node, True))
            for child in node.children:
                if child.sort == "Expr" and self.acc_flags.get(child) and child not in local:
                    stack.append((child, False))
        return local[epilogue]

    def _acc_dtype(self, epilogue: Term, default_ty: str):
        stack = [epilogue]
        seen = set()
        while stack:
            node = stack.pop()
            if node.op == "Acc":
                return parse_type(node.args[0]).dtype
            for child in node.children:
                if child.sort == "Expr" and self.acc_flags.get(child) and child not in seen:
                    seen.add(child)
                    stack.append(child)
        return parse_type(default_ty).dtype

    # --- one node -----------------------------------------------------------------------------

    def _compute(self, node: Term, get, acc):
        op = node.op
        if node.sort == "TensorList":
            return tuple(get(item) for item in list_items(node))
        method = getattr(self, "_op_" + op)
        value = method(node, get, acc)
        _check(node, value)
        return value

    # Tensor leaves and kernels

    def _op_Input(self, node, get, acc):
        name = node.args[0]
        if name not in self.env:
            raise KeyError(f"no value for input {name!r}")
        return jnp.asarray(self.env[name])

    def _op_Constant(self, node, get, acc):
        return jnp.asarray(self.constants[node.args[0]])

    def _op_LoopArg(self, node, get, acc):
        return self._loop_arg(node.args[0], node.args[1])

    def _op_Pointwise(self, node, get, acc):
        return get(node.args[0])

    def _op_Reduce(self, node, get, acc):
        op, body, axes, epilogue, ty = node.args
        dtype = self._acc_dtype(epilogue, ty)
        return self._epilogue(epilogue, apply_reduce(op, get(body), ints(axes), dtype))

    def _op_EpilogueReduce(self, node, get, acc):
        """`Reduce(op, body, axes, Acc(ty), ty)`; which kernel computes it does not change its value."""
        _producer, op, body, axes, ty = node.args
        return apply_reduce(op, get(body), ints(axes), parse_type(ty).dtype)

    def _op_RowReduce(self, node, get, acc):
        """An Expr: the Reduce of `body` over `axis`, its epilogue's `Acc` bound to that reduction."""
        op, body, axis, epilogue, ty = node.args
        dtype = self._acc_dtype(epilogue, ty)
        return self._epilogue(epilogue, apply_reduce(op, get(body), (int(axis),), dtype))

    def _op_Matmul(self, node, get, acc):
        lhs, rhs, dims, epilogue, ty = node.args
        lc, rc, lb, rb = _dims(dims)
        dtype = self._acc_dtype(epilogue, ty)
        core = lax.dot_general(get(lhs), get(rhs), ((lc, rc), (lb, rb)), preferred_element_type=dtype)
        return self._epilogue(epilogue, core)

    def _op_Conv(self, node, get, acc):
        lhs, rhs, params, epilogue, ty = node.args
        dtype = self._acc_dtype(epilogue, ty)
        core = lax.conv_general_dilated(get(lhs), get(rhs), **ConvParams.parse(params).lax_kwargs(),
                                        preferred_element_type=dtype)
        return self._epilogue(epilogue, core)

    def _op_Attention(self, node, get, acc):
        q, k, v, bias, scale, epilogue, ty = node.args
        dtype = self._acc_dtype(epilogue, ty)
        scores = jnp.einsum("bhqd,bhkd->bhqk", get(q), get(k), preferred_element_type=jnp.float32) * scale
        scores = scores + jnp.broadcast_to(jnp.asarray(get(bias), jnp.float32), scores.shape)
        weights = jax.nn.softmax(scores, axis=-1)
        core = jnp.einsum("bhqk,bhkd->bhqd", weights, get(v).astype(jnp.float32)).astype(dtype)
        return self._epilogue(epilogue, core)

    def _op_Gather(self, node, get, acc):
        operand, indices, key, ty = node.args
        primitive, params = self.payloads[key]
        return primitive.bind(get(operand), get(indices), **params)

    def _op_AssignStatic(self, node, get, acc):
        target, starts, value, ty = node.args
        return lax.dynamic_update_slice(get(target), get(value), ints(starts))

    def _op_AssignDynamic(self, node, get, acc):
        target, starts, value, ty = node.args
        indices = [jnp.asarray(start).astype(jnp.int32) for start in get(starts)]
        return lax.dynamic_update_slice_p.bind(get(target), get(value), *indices)

    def _op_AssignScatter(self, node, get, acc):
        target, indices, updates, key, ty = node.args
        primitive, params = self.payloads[key]
        return primitive.bind(get(target), get(indices), get(updates), **params)

    def _op_Opaque(self, node, get, acc):
        key, operands, index, ty = node.args
        results = self.multi.get((key, operands))
        if results is None:
            primitive, params = self.payloads[key]
            out = primitive.bind(*get(operands), **params)
            results = list(out) if primitive.multiple_results else [out]
            self.multi[(key, operands)] = results
        return results[index]

    def _op_Loop(self, node, get, acc):
        key, operands, body, index, ty = node.args
        results = self.multi.get((key, operands, body))
        if results is None:
            results = self._run_loop(key, list(get(operands)), list_items(body))
            self.multi[(key, operands, body)] = results
        return results[index]

    def _nested(self, key: str, bound: list) -> "_Evaluator":
        loop_args = {(key, index): value for index, value in enumerate(bound)}
        return _Evaluator(self.env, self.constants, self.payloads, parent=self, loop_args=loop_args)

    def _run_loop(self, key: str, operands: list, items: list[Term]) -> list:
        spec = self.payloads[key]
        kind = spec["kind"]
        if kind == "scan":
            n_consts, n_carry = spec["num_consts"], spec["num_carry"]
            consts = operands[:n_consts]
            init, xs = operands[n_consts:n_consts + n_carry], operands[n_consts + n_carry:]

            def step(carry, x):
                outs = self._nested(key, consts + list(carry) + list(x)).run(items)
                return tuple(outs[:n_carry]), tuple(outs[n_carry:])

            final, ys = lax.scan(step, tuple(init), tuple(xs), length=spec["length"], reverse=spec["reverse"],
                                 unroll=spec.get("unroll", 1))
            return list(final) + list(ys)
        if kind == "while":
            n_consts = spec["num_consts"]
            consts, init = operands[:n_consts], operands[n_consts:]
            predicate, carry_items = items[0], items[1:]

            def cond(carry):
                return self._nested(key, consts + list(carry)).run([predicate])[0]

            def step(carry):
                return tuple(self._nested(key, consts + list(carry)).run(carry_items))

            return list(lax.while_loop(cond, step, tuple(init)))
        if kind == "cond":
            n_out = spec["num_outputs"]
            index, *ops = operands

            def branch(b):
                def run(*args):
                    return tuple(self._nested(key, [index, *args]).run(items[b * n_out:(b + 1) * n_out]))
                return run

            return list(lax.switch(index, [branch(b) for b in range(spec["num_branches"])], *ops))
        raise ValueError(f"unknown loop kind {kind!r}")

    # Exprs

    def _op_Load(self, node, get, acc):
        return get(node.args[0])

    def _op_Acc(self, node, get, acc):
        if acc is None:
            raise ValueError("Acc outside an epilogue")
        ty = parse_type(node.args[0])
        if tuple(acc.shape) != ty.shape:
            raise TypeError(f"Acc({node.args[0]!r}) bound to an accumulator of shape {acc.shape}")
        return acc if acc.dtype == ty.dtype else acc.astype(ty.dtype)

    def _op_Lit(self, node, get, acc):
        value, ty = node.args
        t = parse_type(ty)
        return jnp.full(t.shape, value, t.dtype)

    def _op_Iota(self, node, get, acc):
        dimension, ty = node.args
        t = parse_type(ty)
        return lax.broadcasted_iota(t.dtype, t.shape, dimension)

    def _op_Unary(self, node, get, acc):
        op, x, ty = node.args
        return apply_unary(op, get(x), parse_type(ty).dtype)

    def _op_Binary(self, node, get, acc):
        op, x, y, ty = node.args
        return apply_binary(op, get(x), get(y))

    def _op_Select(self, node, get, acc):
        pred, on_false, on_true, ty = node.args
        return lax.select_n(get(pred), get(on_false), get(on_true))

    def _op_Reshape(self, node, get, acc):
        x, ty = node.args
        return jnp.reshape(get(x), parse_type(ty).shape)

    def _op_Transpose(self, node, get, acc):
        x, permutation, ty = node.args
        return lax.transpose(get(x), ints(permutation))

    def _op_Broadcast(self, node, get, acc):
        x, dims, ty = node.args
        return lax.broadcast_in_dim(get(x), parse_type(ty).shape, ints(dims))

    def _op_Slice(self, node, get, acc):
        x, axis, start, stop, stride, ty = node.args
        if stride < 0:  # walking backwards from `start`: reverse, then walk forwards from its mirror
            value = get(x)
            extent = value.shape[axis]
            return lax.slice_in_dim(lax.rev(value, (axis,)), extent - 1 - start, extent - 1 - stop, -stride, axis)
        return lax.slice_in_dim(get(x), start, stop, stride, axis)

    def _op_DynamicSlice(self, node, get, acc):
        x, axis, start, size, ty = node.args
        value = get(x)
        starts = [jnp.int32(0)] * value.ndim
        starts[axis] = jnp.asarray(get(start)).astype(jnp.int32)
        sizes = list(value.shape)
        sizes[axis] = size
        return lax.dynamic_slice_p.bind(value, *starts, slice_sizes=tuple(sizes))

    def _op_Concat(self, node, get, acc):
        x, y, axis, split, ty = node.args
        left = get(x)
        if left.shape[axis] != split:
            raise TypeError(f"Concat split {split} but the left operand has extent {left.shape[axis]}")
        return lax.concatenate([left, get(y)], axis)

    def _op_Pad(self, node, get, acc):
        x, value, config, ty = node.args
        return lax.pad(get(x), jnp.reshape(get(value), ()), _pad_config(config))


def _check(node: Term, value) -> None:
    if node.sort == "TensorList":
        return
    expected = parse_type(node.ty)
    shape, dtype = tuple(np.shape(value)), dtype_name(value.dtype)  # dtype_name: PRNG keys too
    if shape != expected.shape or dtype != expected.dtype:
        raise TypeError(f"{node!r} evaluated to {dtype}{list(shape)}, its type says {node.ty}")
