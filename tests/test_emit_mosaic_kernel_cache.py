"""`emit.mosaic.kernel_cache`: equal Mosaic kernels (up to their names) lowered to one module, each site
still computing on its own operands (GPU interpret mode against `lax` convs); different constants or
programs never share."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.compile import mosaic_phase_seconds
from emit.mosaic import conv as mc
from emit.mosaic import conv_halo as ch
from emit.mosaic import kernel_cache
from emit.pallas.conv import ConvGeometry
from eqsat.tiling.mosaic import HaloGrid, halo_blocks
from tests.test_emit_mosaic_conv_halo import _params

SIZE = 9


def _grid():
    params = _params((1, SIZE, SIZE, 64), (3, 3, 64, 64), ((1, 1), (1, 1)))
    geometry = ConvGeometry(params, (1, SIZE, SIZE, 64), (3, 3, 64, 64), (1, SIZE, SIZE, 64))
    grid_of = functools.partial(HaloGrid, geometry)
    blocks = halo_blocks(grid_of, grid_of(128).out_rows, 64, batch=1)
    return params, grid_of(blocks.tile_m), blocks


def test_equal_kernels_named_apart_lower_to_one_mosaic_module():
    """Three haloed convs in one function: two alike but for their names, one with another epilogue:
    two Mosaic modules lowered for a GPU."""
    _params_, grid, blocks = _grid()
    x = jax.ShapeDtypeStruct((1, SIZE, SIZE, 64), jnp.float16)
    w = jax.ShapeDtypeStruct((9 * 64, 64), jnp.float16)

    def convs(x, w1, w2):
        first = ch.build([x], w1, grid, blocks, interpret=False, name="first:conv")
        doubled = ch.build([x], w2, grid, blocks, interpret=False, name="doubled:conv",
                           epilogue=lambda acc, _: acc * 2)
        again = ch.build([x], w2, grid, blocks, interpret=False, name="again:conv")
        return first, doubled, again

    with mosaic_phase_seconds() as lowered:
        jax.jit(convs).trace(x, w, w).lower(lowering_platforms=("cuda",))
    assert lowered["modules"] == 2, lowered


def test_sites_sharing_a_kernel_compute_on_their_own_operands():
    """Two equal convs on different inputs and weights, in GPU interpret mode, each against `lax`."""
    params, grid, blocks = _grid()
    rng = np.random.default_rng(3)
    xs = [jnp.asarray(rng.standard_normal((1, SIZE, SIZE, 64)), jnp.float16) for _ in range(2)]
    ws = [jnp.asarray(0.1 * rng.standard_normal((3, 3, 64, 64)), jnp.float16) for _ in range(2)]

    @jax.jit
    def both(x1, x2, w1, w2):
        outs = []
        for x, w, name in ((x1, w1, "one:conv"), (x2, w2, "two:conv")):
            flat = ch.build([x], ch.layout_weight(w, params.rhs_spec, 64), grid, blocks, out_dtype=jnp.float32,
                            interpret=True, name=name)
            outs.append(ch.unflatten(flat, grid, 64))
        return outs

    for out, x, w in zip(both(*xs, *ws), xs, ws):
        np.testing.assert_allclose(np.asarray(out), np.asarray(mc.reference(x, w, params)), rtol=2e-3, atol=2e-3)


def test_constants_and_programs_are_part_of_the_key():
    """Functions alike but for a closed-over constant, or for an op, keep their own results; alike
    but for the name, the second site calls the first's function."""
    x = jnp.arange(4, dtype=jnp.float32)
    before = len(kernel_cache._functions)
    plus = [kernel_cache.launch(lambda v, c=c: v + c, (x,), "k") for c in (jnp.ones(4), jnp.full(4, 2.0))]
    np.testing.assert_array_equal(np.asarray(plus[0]), np.asarray(x + 1))
    np.testing.assert_array_equal(np.asarray(plus[1]), np.asarray(x + 2))
    times = kernel_cache.launch(lambda v: v * 3, (x,), "k")
    np.testing.assert_array_equal(np.asarray(times), np.asarray(x * 3))
    assert len(kernel_cache._functions) == before + 3
    named = [kernel_cache.launch(lambda v, name=name: jax.named_call(lambda u: u - 1, name=name)(v), (x,), name)
             for name in ("site_a_kernel", "site_b_kernel")]
    np.testing.assert_array_equal(np.asarray(named[1]), np.asarray(x - 1))
    assert len(kernel_cache._functions) == before + 4
