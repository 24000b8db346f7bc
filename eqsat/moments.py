"""The `moments` reduction: what `Reduce("moments", x, axes, ...)` computes, and how pieces merge.

`moments(x, axes)` is float32 `[2, *kept_shape]`:

    [0] = mean = sum(x) / n           over `axes`, n the number of elements reduced
    [1] = M2 = sum((x - mean)^2)

so a variance is `[1] / n`, and the mean is `[0]` itself (a sum is `[0] * n`). Row 0 is the mean,
not the sum, so a kernel hands its readers the mean it holds: a constant row's mean is exactly
that constant (kernels compute it in a frame shifted by an element of the row), and x - mean is
exactly 0, where a sum rebuilt as mean * n and divided by n again is off by an ulp of x (an ulp
that `(x - mean) * rsqrt(var + eps)` magnifies a thousandfold). `two_pass` is the reference value
(what the interpreter computes): the mean first (sum / n, as `jnp.mean`), then the centred squares,
like `jnp.var`. Nothing cancels: its error is relative to the spread of x, not to its offset,
unlike E[x^2] - E[x]^2.

Kernels compute it in pieces (a matmul's K strips for row statistics, a producer's output tiles
for statistics computed in an epilogue). Each piece keeps its partial moments (count, mean, M2),
computed two-pass over the piece about its rough mean sum / count, then corrected by the mean of
the deviations (they are exact, so a piece of one value has exactly that value as its mean and M2
0), and the reader merges the pieces in a fixed order with Chan, Golub and LeVeque's parallel
formula ("Updating formulae and a pairwise algorithm for computing sample variances", 1979):

    n = n_a + n_b,   delta = mean_b - mean_a
    mean = mean_a + delta * n_b / n
    M2 = M2_a + M2_b + delta^2 * n_a * n_b / n

Every piece writes its own slot (no atomics, no zeroing of the buffer) and the merge order is the
piece order, so the result is deterministic. `partial_moments` and `merge_partials` are the
reference of that scheme (emitters compare against them); `two_pass` is what plans are checked
against.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# Partial moments of one piece: count, mean, M2 (float32 each).
PARTIAL_FIELDS = 3


def two_pass(x, axes: tuple[int, ...]):
    """`[mean(x), sum((x - mean(x))^2)]` over `axes` in float32 (mean = sum(x) / n), stacked on a new
    leading axis."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        x = lax.convert_element_type(x, jnp.float32)
    axes = tuple(sorted(a % x.ndim for a in axes)) if x.ndim else ()
    n = math.prod(x.shape[a] for a in axes)
    total = lax.reduce_sum(x, axes)
    kept = [d for a, d in enumerate(x.shape) if a not in axes]
    mean = total / jnp.float32(n) if n else total
    centered = x - lax.broadcast_in_dim(mean, x.shape, [a for a in range(x.ndim) if a not in axes])
    m2 = lax.reduce_sum(centered * centered, axes)
    return jnp.stack([mean, m2]).reshape((2, *kept))


def _rows(x, axes: tuple[int, ...]):
    """x as float32 [*kept, n]: the reduced axes moved last and flattened."""
    x = jnp.asarray(x, jnp.float32)
    axes = tuple(sorted(a % x.ndim for a in axes))
    kept = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*kept, *axes))
    return moved.reshape((*[x.shape[a] for a in kept], math.prod(x.shape[a] for a in axes)))


def partial_moments(x, axes: tuple[int, ...], piece: int):
    """Per-piece (count, mean, M2) of the reduction of x over `axes`, pieces of `piece` consecutive
    reduced elements (row-major over the reduced axes; the last piece may be shorter): float32
    `[pieces, 3, *kept]`, as a kernel's tiles would write them into their own slots."""
    if piece < 1:
        raise ValueError(f"{piece=} must be positive")
    rows = _rows(x, axes)
    n = rows.shape[-1]
    out = []
    for start in range(0, max(n, 1), piece):
        chunk = rows[..., start:start + piece]
        count = jnp.float32(max(chunk.shape[-1], 1))
        rough = jnp.sum(chunk, axis=-1) / count
        deviation = chunk - rough[..., None]
        drift = jnp.sum(deviation, axis=-1)
        m2 = jnp.maximum(jnp.sum(jnp.square(deviation), axis=-1) - drift * (drift / count), 0.0)
        mean = rough + drift / count
        out.append(jnp.stack([jnp.full_like(mean, chunk.shape[-1]), mean, m2]))
    return jnp.stack(out)


def merge_partials(partials):
    """Chan's merge of `partial_moments` pieces in piece order -> `[mean, M2]` (float32 `[2, *kept]`)."""
    partials = jnp.asarray(partials, jnp.float32)
    count, mean, m2 = partials[0, 0], partials[0, 1], partials[0, 2]
    for part in partials[1:]:
        n_b, mean_b, m2_b = part[0], part[1], part[2]
        n = count + n_b
        safe = jnp.where(n > 0, n, 1.0)
        delta = mean_b - mean
        mean = mean + delta * (n_b / safe)
        m2 = m2 + m2_b + delta * delta * (count * n_b / safe)
        count = n
    return jnp.stack([mean, m2])
