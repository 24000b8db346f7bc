"""View folding: chains of views collapse and identity views vanish (DESIGN.md, family 1).

Views (Reshape, Transpose, Broadcast, Slice, Pad) are index arithmetic inside a kernel; these
rules keep that arithmetic short. Chains across kernels meet once the absorb family has inlined
view kernels into their consumers (`Load(Pointwise(v)) = v`), so the two families run together.

A reduction over axes of extent 1 reduces one element per output: it is a reshape of its body
(`unit_reduction`); autodiff writes many (the transpose of a broadcast that adds size-1 axes, a
norm's statistics summed over the unit axes of their own [N, 1, G, 1] layout).

Permutations and broadcast dimensions compose in Python (`py_string`); slice offsets compose with
egglog's i64 arithmetic. An identity view is recognized by its operand already having the view's
type (every Expr constructor ends with its type: one rule per constructor, see `typed_forms`).
"""

from __future__ import annotations

from functools import lru_cache

from egglog import String, eq, f64, i64, rewrite, rule, ruleset, union

from eqsat.lang import Acc, Broadcast, Expr, Lit, Pad, Pointwise, Reduce, Reshape, Slice, Tensor, Transpose, Unary
from eqsat.rules import Example, dim, flag, py_string, py_true, tensor, typed_forms
from eqsat.types import ints, ints_key, parse_type

view_folding = ruleset(name="view_folding")


@lru_cache(maxsize=None)
def _compose_permutations(inner: str, outer: str) -> str:
    """transpose(transpose(x, inner), outer) = transpose(x, q) with q[i] = inner[outer[i]]."""
    first, second = ints(inner), ints(outer)
    return ints_key(first[axis] for axis in second)


@lru_cache(maxsize=None)
def _compose_broadcasts(inner: str, outer: str) -> str:
    """broadcast(broadcast(x, inner), outer) maps x's axis i to outer[inner[i]]."""
    first, second = ints(inner), ints(outer)
    return ints_key(second[axis] for axis in first)


@lru_cache(maxsize=None)
def _is_identity_permutation(permutation: str) -> str:
    return flag(ints(permutation) == tuple(range(len(ints(permutation)))))


@lru_cache(maxsize=None)
def _is_zero_padding(config: str) -> str:
    return flag(all(ints(axis) == (0, 0, 0) for axis in config.split(";")) if config else True)


@view_folding.register
def _reshape_of_reshape(x: Expr, t1: String, t2: String):
    """Reshape(Reshape(x, t1), t2) = Reshape(x, t2): row-major reshapes compose."""
    yield rewrite(Reshape(Reshape(x, t1), t2)).to(Reshape(x, t2))


@view_folding.register
def _transpose_of_transpose(x: Expr, p1: String, p2: String, t1: String, t2: String):
    """Transpose(Transpose(x, p1), p2) = Transpose(x, p1 . p2)."""
    yield rewrite(Transpose(Transpose(x, p1, t1), p2, t2)).to(
        Transpose(x, py_string(_compose_permutations, p1, p2), t2))


@view_folding.register
def _broadcast_of_broadcast(x: Expr, d1: String, d2: String, t1: String, t2: String):
    """Broadcast(Broadcast(x, d1), d2) = Broadcast(x, d2 . d1)."""
    yield rewrite(Broadcast(Broadcast(x, d1, t1), d2, t2)).to(
        Broadcast(x, py_string(_compose_broadcasts, d1, d2), t2))


@view_folding.register
def _slice_of_slice(x: Expr, axis: i64, s1: i64, e1: i64, k1: i64, s2: i64, e2: i64, k2: i64,
                    t1: String, t2: String):
    """x[s1:e1:k1][s2:e2:k2] = x[s1+s2*k1 : .. : k1*k2] along one axis (one element: stride 1).
    Forward strides only (k1, k2 >= 1): the count and stop below assume them."""
    count = (e2 - s2 + k2 - 1) / k2
    start = s1 + s2 * k1
    stride = k1 * k2
    whole = Slice(Slice(x, axis, s1, e1, k1, t1), axis, s2, e2, k2, t2)
    # A one-element result keeps stride 1: with an identity slice in the e-graph a slice can be its
    # own operand, and composing strides would then grow them without end.
    forward = (k1 >= 1, k2 >= 1)
    yield rewrite(whole).to(Slice(x, axis, start, start + 1, 1, t2), eq(count).to(i64(1)), *forward)
    yield rewrite(whole).to(Slice(x, axis, start, start + (count - 1) * stride + 1, stride, t2), count >= 2, *forward)


# Reductions whose one-element result is that element (not argmax/argmin: an index; not moments).
ELEMENT_REDUCTIONS = frozenset({"sum", "max", "min", "prod", "and", "or", "xor"})


@lru_cache(maxsize=None)
def _reduces_units(op: str, axes: str, body_ty: str, ty: str) -> str:
    """Does reduction `op` over `axes` of a `body_ty` body read one element per output, in `ty`'s dtype?"""
    body = parse_type(body_ty)
    return flag(op in ELEMENT_REDUCTIONS and body.dtype == parse_type(ty).dtype
                and all(body.shape[axis] == 1 for axis in ints(axes)))


@view_folding.register
def _unit_reduction(t: Tensor, body: Expr, op: String, axes: String, ty: String, bt: String):
    """Reduce(op, body, axes) = Pointwise(Reshape(body)) when every reduced axis has extent 1 (sum, max,
    min, prod, and, or, xor of one element is the element; same dtype)."""
    for form in typed_forms(bt, prefix="_unit_body"):
        yield rule(t == Reduce(op, body, axes, Acc(ty), ty), eq(body).to(form),
                   py_true(_reduces_units, op, axes, bt, ty)).then(union(t).with_(Pointwise(Reshape(body, ty), ty)))


@view_folding.register
def _view_of_literal(v: f64, t1: String, t2: String, dims: String, axis: i64, start: i64, stop: i64,
                     stride: i64):
    """A view of a splatted scalar is the scalar splatted to the view's type."""
    yield rewrite(Reshape(Lit(v, t1), t2)).to(Lit(v, t2))
    yield rewrite(Broadcast(Lit(v, t1), dims, t2)).to(Lit(v, t2))
    yield rewrite(Transpose(Lit(v, t1), dims, t2)).to(Lit(v, t2))
    yield rewrite(Slice(Lit(v, t1), axis, start, stop, stride, t2)).to(Lit(v, t2))


@view_folding.register
def _identity_view(x: Expr, ty: String, dims: String, axis: i64, start: i64, stop: i64, stride: i64):
    """V(x) = x for a reshape, broadcast or forward slice whose operand already has the view's type."""
    for form in typed_forms(ty):
        typed = x == form
        yield rewrite(Reshape(x, ty)).to(x, typed)
        yield rewrite(Broadcast(x, dims, ty)).to(x, typed)
        yield rewrite(Slice(x, axis, start, stop, stride, ty)).to(x, typed, stride >= 1)  # not a reversal


@view_folding.register
def _identity_convert(x: Expr, ty: String):
    """Unary("convert", x, ty) = x when x already has type ty (weak-typed index arithmetic)."""
    for form in typed_forms(ty, prefix="_convert"):
        yield rewrite(Unary("convert", x, ty)).to(x, x == form)


@view_folding.register
def _identity_transpose(x: Expr, permutation: String, ty: String):
    """Transpose(x, 0,1,..,n-1) = x."""
    yield rewrite(Transpose(x, permutation, ty)).to(x, py_true(_is_identity_permutation, permutation))


@view_folding.register
def _identity_pad(x: Expr, value: Expr, config: String, ty: String):
    """Pad(x, v, 0,0,0;..) = x."""
    yield rewrite(Pad(x, value, config, ty)).to(x, py_true(_is_zero_padding, config))


# --- soundness examples ------------------------------------------------------------------------------


def _cube(draw):
    return (tensor(draw, (dim(draw), dim(draw), dim(draw))),)


def _square(draw):
    n = dim(draw, 2, 4)
    return (tensor(draw, (n, n)),)


def _reshape_chain(x):
    return x.reshape(-1).reshape(x.shape[::-1]) + 1.0


def _reshape_round_trip(x):
    return x.reshape(-1).reshape(x.shape) * 2.0


def _transpose_chain(x):
    return x.transpose(1, 0, 2).transpose(2, 0, 1) + 1.0


def _transpose_round_trip(x):
    return x.T.T * 2.0


def _transpose_square(x):
    return x.T + 1.0


def _broadcast_chain(x):
    from jax import lax

    a, b, c = x.shape
    y = lax.broadcast_in_dim(x, (a, 1, b, c), (0, 2, 3))
    return lax.broadcast_in_dim(y, (2, a, 3, b, c), (1, 2, 3, 4)) - 1.0


def _slice_chain(x):
    return x[1:][::2] * 3.0


def _slices_of_reversals(x):
    """`rev` is a stride -1 slice: a forward slice of it, and a reversal of a strided slice."""
    import jax.numpy as jnp

    return jnp.flip(x, 0)[1:] * 3.0, x[::2][::-1] + 1.0


def _unit_reductions(x):
    """Reductions over size-1 axes (as autodiff writes them): each is its body, reshaped."""
    import jax.numpy as jnp

    n, c = x.shape
    return (jnp.sum(x.reshape(n, 1, c), axis=1) * 2.0, jnp.max(x[None, :, None], axis=(0, 2)) + 1.0,
            jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=1) - 1.0)


def _real_reductions(x):
    """A sum over an axis longer than one, and an argmax over a unit axis (an index): must not fire."""
    import jax.numpy as jnp

    return jnp.sum(x, axis=0) * 2.0, jnp.argmax(x[:, None], axis=1)


def _literal_view(x):
    import jax.numpy as jnp

    return x + jnp.full(x.shape[::-1], 2.0).T.reshape(x.shape)


def _zero_pad(x):
    from jax import lax

    return lax.pad(x, 0.0, [(0, 0, 0)] * x.ndim) + 1.0


def _index_update(x, i):
    """`.at[i]` index arithmetic converts a weak-typed int32 index to int32."""
    from jax import lax

    return lax.fori_loop(0, x.shape[0], lambda k, b: b.at[k].add(1.0), x) * 2.0


def _matrix_index(draw):
    return tensor(draw, (dim(draw), dim(draw))), tensor(draw, (), "int32", low=0, high=2)


def _slices_args(draw):
    return (tensor(draw, (dim(draw, 2, 6), dim(draw))),)


EXAMPLES = [
    Example(_reshape_chain, _cube, ("reshape_of_reshape",), support=("absorb",)),
    Example(_reshape_round_trip, _cube, ("reshape_of_reshape", "identity_view"), support=("absorb",)),
    Example(_transpose_chain, _cube, ("transpose_of_transpose",), support=("absorb",)),
    Example(_transpose_round_trip, _square, ("transpose_of_transpose", "identity_transpose"), support=("absorb",)),
    Example(_transpose_square, _square, ("identity_transpose",), fires=False, name="transpose of a square matrix"),
    Example(_broadcast_chain, _cube, ("broadcast_of_broadcast",), support=("absorb",)),
    Example(_slice_chain, _slices_args, ("slice_of_slice",), support=("absorb",)),
    Example(_slices_of_reversals, _slices_args, ("slice_of_slice",), fires=False, support=("absorb",),
            name="slices of reversals (negative strides)"),
    Example(_literal_view, _cube, ("view_of_literal",), support=("absorb",)),
    Example(_unit_reductions, _slices_args, ("unit_reduction",), support=("absorb",)),
    Example(_real_reductions, _slices_args, ("unit_reduction",), fires=False, support=("absorb",),
            name="reductions over a long axis, an argmax"),
    Example(_zero_pad, _cube, ("identity_pad",)),
    Example(_index_update, _matrix_index, ("identity_convert",), support=("absorb",)),
]
