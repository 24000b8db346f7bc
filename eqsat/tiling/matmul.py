"""The matmul template's tiles (`emit.pallas.matmul`)."""

from __future__ import annotations

import dataclasses

from eqsat.tiling import MIN_DOT_BLOCK, next_pow2


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """Tile sizes (powers of two, >= 16) and launch parameters of one matmul kernel."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, m: int, n: int, k: int, itemsize: int = 2) -> "MatmulBlocks":
        """64x64x32 tiles (128x128 for large problems), shrunk to small dimensions; K blocks of 16
        for 4-byte operands (`itemsize`), so the pipelined operand buffers stay the fp16 size: a
        128x128x32 fp32 matmul with a GroupNorm prologue and a residual asked for 229,376 B of
        shared memory (fp16: 131,072 B), 3 KB under an H100's 232,448 (deviceless sm_90 compile)."""
        large = m >= 1024 and n >= 256
        block_m = min(128 if large else 64, max(MIN_DOT_BLOCK, next_pow2(m)))
        block_n = min(128 if large else 64, max(MIN_DOT_BLOCK, next_pow2(n)))
        block_k = min(32 if itemsize <= 2 else 16, max(MIN_DOT_BLOCK, next_pow2(k)))
        return cls(block_m, block_n, block_k, num_warps=8 if large else 4, num_stages=3 if large else 2)

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_BLOCK or value != next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")
