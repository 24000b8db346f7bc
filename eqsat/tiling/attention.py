"""The attention template's tiles (`emit.pallas.attention`): query and key blocks, head pieces."""

from __future__ import annotations

import dataclasses

from eqsat.tiling import MIN_DOT_BLOCK, SHARED_MEMORY_BYTES, dot_itemsize, next_pow2  # noqa: F401


def head_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """`(offset, width)` pieces of the head dim, powers of two >= 16 covering it (rounded up to 16):
    40 -> 32+16, 80 -> 64+16, 160 -> 128+32, 64 -> 64. The dots and the accumulator run per piece,
    so a head of 160 multiplies and holds 160 lanes, not 256."""
    total = -(-head_dim // MIN_DOT_BLOCK) * MIN_DOT_BLOCK
    pieces, offset = [], 0
    for width in sorted((1 << bit for bit in range(total.bit_length()) if total >> bit & 1), reverse=True):
        pieces.append((offset, width))
        offset += width
    return tuple(pieces)


def key_loop_trips(kv_len: int, block_k: int) -> int:
    """Key blocks the kernel's loop runs: the full ones (a partial last block runs once after it)."""
    return kv_len // block_k


# The most the attention template's Triton kernel was measured to ask per byte of its q block and k/v block,
# read from XLA's thunk sequence of the deviceless sm_90 compile (blocks q x k x head lanes):
# fp16 64 x 32 x 512: 98,304 B (1.0x); fp32 64 x 32 x 512: 327,680 (1.67x), 32 x 32 x 512: 200,704
# (1.53x), 32 x 16 x 512: 133,120 (1.35x), 64 x 16 x 512 and 256 x 64 x 128: 229,376 (1.4x),
# 64 x 64 x 256: 262,144 (2.0x).
SHARED_BYTES_PER_TILE_BYTE = 2.0


def fits_shared_memory(block_q: int, block_k: int, width: int, itemsize: int) -> bool:
    """Whether the attention kernel's q block and k/v block of `width` head lanes fit an H100's
    shared memory, at the most it was measured to ask per tile byte."""
    return SHARED_BYTES_PER_TILE_BYTE * (block_q + block_k) * width * itemsize <= SHARED_MEMORY_BYTES


def tail_width(kv_len: int, block_k: int) -> int:
    """Key slots of the partial last block: the leftover keys rounded up to a power of two >= 16
    (77 keys in blocks of 64: one block of 64 and a tail of 16 slots, not 128)."""
    return max(MIN_DOT_BLOCK, next_pow2(kv_len % block_k))


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes (powers of two, >= 16) and launch parameters of one attention kernel."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, q_len: int, kv_len: int, head_dim: int, itemsize: int = 2) -> "AttentionBlocks":
        """Tiles read from the sm_90 PTX (`python -m benchmarks.attention_ptx --blocks ...`): 64 keys
        and a warpgroup (4 warps) per 64 query rows: 256 rows from 4096 queries (heads up to 128
        lanes: at 16 warps ptxas has 128 registers, and a 160-lane accumulator spills), 128 from
        1024 (the k/v loads per score shrink with the rows while the grid still fills the GPU),
        else 64; heads wider than 256 lanes (the VAE's 512): 64 x 32 on 8 warps. Shrunk to short
        sequences, then to an H100's shared memory (`fits_shared_memory`; `itemsize` is the dots'
        operand bytes)."""
        width = sum(w for _, w in head_pieces(head_dim))
        if width > 256:
            block_q, block_k, warps = 64, 32, 8
        else:
            block_q = 256 if q_len >= 4096 and width <= 128 else 128 if q_len >= 1024 else 64
            block_k, warps = 64, block_q // 16
        block_q = min(block_q, max(MIN_DOT_BLOCK, next_pow2(q_len)))
        block_k = min(block_k, max(MIN_DOT_BLOCK, next_pow2(kv_len)))
        while not fits_shared_memory(block_q, block_k, width, itemsize):
            if block_q > 32:
                block_q, warps = block_q // 2, max(4, warps // 2)
            elif block_k > MIN_DOT_BLOCK:
                block_k //= 2
            else:
                break  # the smallest tiles: a head this wide does not fit; Triton's compile says so
        return cls(block_q, block_k, num_warps=warps)

    def validate(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_BLOCK or value != next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")
