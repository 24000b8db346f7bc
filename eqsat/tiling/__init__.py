"""How the kernel templates tile their work: block sizes, grids and loop trips from shapes alone.

Pure arithmetic on shapes (no jax, no Pallas), so that the cost model (`eqsat.cost`) and the
templates (`emit.pallas.*`) read one configuration and cannot drift apart:

    eqsat.tiling.matmul      MatmulBlocks                       (emit.pallas.matmul)
    eqsat.tiling.conv        ConvGeometry, ConvConfig, KRange, grid, output_channel_tiles
                                                                (emit.pallas.conv)
    eqsat.tiling.attention   AttentionBlocks, head_pieces, key_loop_trips, tail_width
                                                                (emit.pallas.attention)
    eqsat.tiling.partials    FinalizeConfig, merge_block_tiles  (emit.pallas.partials, emit.expr)
    eqsat.tiling.reshape     reshape_groups                     (emit.expr's reshape index)
"""

MIN_DOT_BLOCK = 16  # Triton's tl.dot needs every dimension >= 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
