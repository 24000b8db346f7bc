"""How the kernel templates tile their work: block sizes, grids and loop trips from shapes alone.

Pure arithmetic on shapes (no jax, no Pallas), so that the cost model (`eqsat.cost`) and the
templates (`emit.pallas.*`) read one configuration and cannot drift apart:

    eqsat.tiling             dot_itemsize, SHARED_MEMORY_BYTES (what every template's tiles fit)
    eqsat.tiling.matmul      MatmulBlocks                       (emit.pallas.matmul)
    eqsat.tiling.conv        ConvGeometry, ConvConfig, KRange, grid, output_channel_tiles
                                                                (emit.pallas.conv)
    eqsat.tiling.attention   AttentionBlocks, head_pieces, key_loop_trips, tail_width
                                                                (emit.pallas.attention)
    eqsat.tiling.partials    FinalizeConfig, merge_block_tiles  (emit.pallas.partials, emit.expr)
    eqsat.tiling.reshape     reshape_groups                     (emit.expr's reshape index)
"""

import numpy as np

from eqsat.types import parse_type

MIN_DOT_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


# Shared memory one CTA may use on an H100 (`shared_memory_per_block_optin` of the target config).
# A Triton kernel that asks for more fails XLA's compile of the whole program.
SHARED_MEMORY_BYTES = 232_448


def dot_itemsize(*types: str) -> int:
    """Bytes per element of the dots' operands: the promoted dtype of the operand type strings."""
    return int(np.result_type(*(parse_type(ty).dtype for ty in types)).itemsize)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
