"""The XLA emitter: a plan as one jitted JAX function, each kernel computed with jax.numpy / lax.

It is the reference every Pallas template is tested against and the fast path on a CPU. A kernel's
value comes from the reference interpreter (`eqsat.interpret`) applied to that one kernel term,
its inputs bound to the values already computed, so the semantics are the interpreter's, not a
second copy of them. Each kernel is traced under `jax.named_scope(kernel.name)`, so XLA's
profile and HLO metadata read like the plan; XLA is then free to fuse across kernels.

    values = emit_kernel(KernelCall(term, "mid_block.resnets.0:pointwise", hosted), ctx)

One form is rewritten on the way, because XLA cannot undo it: a conv of `concat(h, x)` along input
channels with `concat(w, pad(w1x1))` weights (a ResNet shortcut fused into the 3x3 conv's K range,
how the Pallas template reads it) becomes one conv per part, each with its own unpadded weights
(`conv(h, w) + conv(x, w1x1)`): a 1x1 shortcut zero-padded to 3x3 would otherwise cost 9x its
multiplies and a concatenated copy of input and weights.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from eqsat.conv_params import ConvParams
from eqsat.interpret import _Evaluator, _pad_config


class _XlaEvaluator(_Evaluator):
    def _op_Conv(self, node, get, acc):
        lhs, rhs, params, epilogue, ty = node.args
        conv = ConvParams.parse(params)
        parts = _channel_parts(lhs, rhs, conv)
        if parts is None:
            return super()._op_Conv(node, get, acc)
        dtype = self._acc_dtype(epilogue, ty)
        core = None
        for xs, ws in parts:
            padding = list(conv.padding)
            if len(ws) == 1:
                weights, padding = _unpadded(ws[0], conv, self.constants)
                weights = self._value(weights)
            else:
                weights = lax.concatenate([self._value(w) for w in ws], conv.rhs_spec[1])
            x = lax.concatenate([self._value(x) for x in xs], conv.lhs_spec[1]) if len(xs) > 1 else self._value(xs[0])
            kwargs = {**conv.lax_kwargs(), "padding": padding}
            value = lax.conv_general_dilated(x, weights, **kwargs, preferred_element_type=dtype)
            core = value if core is None else core + value
        return self._epilogue(epilogue, core)

    def _value(self, term):
        """A part's value: computed already, or (a part inside the body of the kernel that wrote
        the concatenation) evaluated here from that kernel's own operands."""
        return self.lookup(term) if self._known(term) else self.run([term])[0]


def _through_load(term):
    """`Load(Pointwise(body))` -> `body`: a concatenation another kernel stored (weights concatenated
    once, in their own kernel) is read through to its parts."""
    if term.op == "Load" and term.args[0].op == "Pointwise":
        return term.args[0].args[0]
    return term


def _concat_parts(term, axis: int) -> list:
    """The operands of a (nested) `Concat` along `axis`, in order; `[term]` when it is none."""
    seen = _through_load(term)
    if seen.op != "Concat" or int(seen.args[2]) != axis:
        return [term]
    return _concat_parts(seen.args[0], axis) + _concat_parts(seen.args[1], axis)


def _extent(term, axis: int) -> int:
    from eqsat.types import parse_type

    return parse_type(term.ty).shape[axis]


def _channel_parts(lhs, rhs, conv: ConvParams):
    """`[(xs, ws)]`: input and weights concatenated along input channels, grouped at the boundaries
    both sides share (`concat(h, skip, x)` against `concat(pad(w1x1), w)` groups `h, skip` with
    the shortcut and `x` with `w`); None for an ungrouped conv with fewer than two groups."""
    if conv.feature_groups != 1 or conv.batch_groups != 1:
        return None
    xs, ws = _concat_parts(lhs, conv.lhs_spec[1]), _concat_parts(rhs, conv.rhs_spec[1])
    x_extents = [_extent(x, conv.lhs_spec[1]) for x in xs]
    w_extents = [_extent(w, conv.rhs_spec[1]) for w in ws]
    groups, group_x, group_w, seen_x, seen_w, i, j = [], [], [], 0, 0, 0, 0
    while i < len(xs) or j < len(ws):
        if (seen_x <= seen_w and i < len(xs)) or j == len(ws):
            group_x.append(xs[i])
            seen_x += x_extents[i]
            i += 1
        else:
            group_w.append(ws[j])
            seen_w += w_extents[j]
            j += 1
        if seen_x == seen_w and group_x and group_w:
            groups.append((group_x, group_w))
            group_x, group_w = [], []
    if group_x or group_w or len(groups) < 2:
        return None
    return groups


def _is_zero(term, constants) -> bool:
    """A scalar the term says is 0: a literal, a constant, either converted or loaded."""
    if term.op == "Lit":
        return float(term.args[0]) == 0.0
    if term.op in ("Load", "Pointwise") or (term.op == "Unary" and term.args[0] == "convert"):
        return _is_zero(term.args[1] if term.op == "Unary" else term.args[0], constants)
    if term.op == "Constant":
        value = constants.get(term.args[0])
        return value is not None and np.size(value) == 1 and float(np.asarray(value).reshape(())) == 0.0
    return False


def _unpadded(weights, conv: ConvParams, constants):
    """Weights zero-padded on their spatial dimensions only, with no rhs dilation: the unpadded
    weights and the conv padding that gives the same output; otherwise the weights as they are."""
    padding = list(conv.padding)
    weights = _through_load(weights)
    if weights.op != "Pad" or not _is_zero(weights.args[1], constants):
        return weights, padding
    config = _pad_config(weights.args[2])
    spatial = conv.rhs_spec[2:]
    if any(config[d] != (0, 0, 0) for d in conv.rhs_spec[:2]) or any(config[d][2] != 0 for d in spatial):
        return weights, padding
    if any(dilation != 1 for dilation in conv.rhs_dilation):
        return weights, padding
    unpadded = [(lo - config[d][0], hi - config[d][1]) for (lo, hi), d in zip(padding, spatial)]
    if any(lo < 0 or hi < 0 for lo, hi in unpadded):
        return weights, padding
    return weights.args[0], unpadded


def emit_kernel(kernel, ctx) -> dict:
    """`{kernel.term: value, **{hosted: value}}` for an `emit.pallas.KernelCall` in an `EmitContext`.

    Hosted statistics (`EpilogueReduce`) are plain reductions here: the interpreter's value of
    `Reduce(op, body, axes)`.
    """
    known = _XlaEvaluator({}, ctx.constants, ctx.payloads)
    known.values = ctx.values  # read-only parent: the kernel's operands (and loop args) by term
    evaluator = _XlaEvaluator({}, ctx.constants, ctx.payloads, parent=known)
    # Every output of a multi-output Opaque/Loop is its own kernel term: run the primitive once.
    evaluator.multi = ctx.shared.setdefault("interpreter multi-output results", {})
    terms = [kernel.term, *kernel.hosted]
    return dict(zip(terms, evaluator.run(terms)))
